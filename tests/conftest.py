import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from distributed import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks kept alive for the whole session (2 nodes x 2 by default in tests)."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks (for resharding a 4-rank checkpoint into 2)."""
    pool = RankPool(2)
    yield pool
    pool.close()
