"""Makes the reusable `cluster` fixture of e2e/pytest_cluster.py available here.

`pytest_plugins` is only honoured in the rootdir conftest (tests/conftest.py, shared), so
the fixture is imported instead; other test folders needing the cluster do the same.
"""
import sys
from pathlib import Path

# --import-mode=importlib and -P: neither the repo root nor e2e/ is on sys.path by default.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))

from pytest_cluster import cluster  # noqa: E402,F401  (a fixture, registered by import)
