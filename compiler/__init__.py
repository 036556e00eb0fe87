"""Capture, the plan, the pass listing and lowering: everything that edits graphs.

The planner (``dpar.planner``) and inspection (``dpar.inspect``) read it from outside.
"""
