"""dpar where users already train: Hugging Face Trainer and Accelerate, Lightning.

The top layer: it imports ``dpar`` (the api) and the training library it adapts, and nothing below the
api reaches up to it. Each adapter lives in its own module and imports its library only when used, so
``import dpar`` never needs transformers, accelerate or lightning.
"""
