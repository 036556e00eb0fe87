"""The auto-sharding planner: a cost model over the captured graph and an ILP that picks placements."""
