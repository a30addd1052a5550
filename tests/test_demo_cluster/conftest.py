"""The local cluster fixture (e2e/pytest_cluster.py), imported: see tests/test_cluster/conftest.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))

from pytest_cluster import cluster  # noqa: E402,F401  (a fixture, registered by import)
