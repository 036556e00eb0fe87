"""Pipeline parallelism: stages cut from the captured graph, schedules as data."""
