"""Capture, the plan, the pass pipeline and lowering: everything that edits graphs.

The planner (``dpar.planner``) and inspection (``dpar.inspect``) read it from outside.
"""
