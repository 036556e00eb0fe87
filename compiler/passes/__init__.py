"""Graph passes: each a pure function from an FX graph (and a plan) to a graph.

The order the backend applies them in lives in ``dpar.compiler.pass_listing``.
"""
