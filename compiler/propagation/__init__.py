"""Sharding propagation: a placement per value of an FX graph, and the redistributions between them."""
