"""The auto-sharding planner: a cost model over the captured graph and an ILP that picks placements."""

from dpar.planner.pipeline import PipelinePlan, plan_pipeline

__all__ = ["PipelinePlan", "plan_pipeline"]
