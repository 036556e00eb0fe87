"""Surgery: what ``dpar.parallelize`` does to a model once, before it trains.

Parameters replaced by their shards (``sharding``), tensor-parallel blocks split and their modules' classes
swapped for ones that read them through the marker op (``tensor_parallel``), zero1's ranges recorded
(``zero1``), local SGD's period attached (``local_sgd``); a model's blocks and which are alike (``blocks``), which
the planner reads too. Each step records its facts in the model's
``ModelState`` (``core/facts.py``), where the compiler and the runtime read them. What runs while training
is ``runtime/``'s; surgery and runtime are peers that import ``core`` only, but for the one edge
``surgery/tensor_parallel.py`` explains. See docs/architecture.md.
"""
