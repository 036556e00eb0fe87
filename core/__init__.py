"""The bottom layer: the plan and its vocabulary, the named errors, the world's facts, the per-model state.

Every other package of dpar may import it; it imports nothing of dpar's. See docs/architecture.md.
"""
