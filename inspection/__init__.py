"""Inspection: what dpar's passes did to a model, what it costs, and how it would run at N ranks.

``explain`` (in ``dpar.inspect.explain``) is the entry point; the other
modules each hold one concern (simulation, memory, rendering). It reads the
compiler (its cost model, ``dpar.compiler.costs``, the graphs' live bytes,
``dpar.compiler.memory``, and the pipeline stage costs,
``dpar.compiler.pipeline_parallel.costs``, which the planner reads too); the
compiler never imports it, and it and the planner never import each other.
Heavy dependencies (sympy, matplotlib, rich) load only in the modules that
use them.
"""
