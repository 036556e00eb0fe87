"""Inspection: what dpar's passes did to a model, what it costs, and how it would run at N ranks.

``explain`` (in ``dpar.inspect.explain``) is the entry point; the other
modules each hold one concern (costs, simulation, rendering). It reads the
compiler and the compiler never imports it; heavy dependencies (sympy,
matplotlib, rich) load only in the modules that use them.
"""
