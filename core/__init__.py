"""The bottom layer: the plan and its vocabulary, the named errors, the world's facts, the per-model state and
the facts surgery records in it (``facts.py``).

Every other package of dpar may import it; it imports nothing of dpar's. See docs/architecture.md.
"""
