"""Shared test settings."""

import contextlib

import pytest
import torch

# CI machines have 2 cores and several suites start servers and subprocesses beside the pytest process:
# one intra-op thread keeps tiny-model math from oversubscribing them (seen: 113 s -> 7 s for test_engine).
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with every GPU test by bench/gpu-tests.sh (make test-gpu)")


@pytest.fixture(scope="session")
def shown(pytestconfig):
    """`with shown(): build()`: output that passes pytest's capture, for a fixture that builds a tool for minutes
    (MinIO, the kstatus reader; e2e/gobuild.py) and must say so rather than sit silent under `make test`."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    return capture.global_and_fixture_disabled if capture else contextlib.nullcontext


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU-only tests are deselected, not skipped, where there is no GPU: the CPU suite covers the same code
    paths on the PyTorch reference and the Triton interpreter, and the GPU runs are their own command (bench/gpu-tests.sh)."""
    if torch.cuda.is_available():
        return
    gpu_only = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_only:
        config.hook.pytest_deselected(items=gpu_only)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
