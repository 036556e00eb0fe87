import os
import sys

# Tests import the example models (examples/gpt.py) and the rank runner beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
