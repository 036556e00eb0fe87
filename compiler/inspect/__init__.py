"""Inspection: what dpar's passes did to a model, what it costs, and how it would run at N ranks.

``explain`` (in ``dpar.compiler.inspect.explain``) is the entry point; the other
modules each hold one concern (costs, simulation, rendering, logging). This
package is imported by the compiler for its logging hooks, so it stays light:
heavy dependencies (sympy, matplotlib, rich) load only in the modules that use them.
"""
