import os
import pathlib
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "Tests" / "python"))


def real_binary():
    """chatcore itself (these tests give it --store themselves)."""
    path = os.environ.get("CHATCORE_REAL_BINARY") or os.environ.get("CHATCORE_BINARY") or str(ROOT / ".build" / "debug" / "chatcore")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no chatcore binary at {path}: run `swift build` (or `make test-postgres`)")
    return path


# Tests/python's helpers start "the binary" through this name.
chatcore_binary = real_binary


@pytest.fixture
def cluster():
    """A PostgreSQL cluster of the test's own (initdb in a temporary directory)."""
    from postgres_cluster import Cluster
    with Cluster() as made:
        yield made


@pytest.fixture
def scratch():
    with tempfile.TemporaryDirectory() as directory:
        yield directory
