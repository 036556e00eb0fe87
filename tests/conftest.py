import os
import sys

import pytest

# Tests import the example models (examples/gpt.py) and the rank runner beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]


@pytest.fixture
def world_of_four():
    """A fake process group of four ranks for the test (bad-input tests: nothing is sent)."""
    from fake_world import fake_world

    with fake_world(4) as graphs:
        yield graphs


@pytest.fixture
def world_of_two():
    """A fake process group of two ranks (structure tests: graphs are built, nothing is sent)."""
    from fake_world import fake_world

    with fake_world(2) as graphs:
        yield graphs
