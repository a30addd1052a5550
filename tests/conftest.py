"""Shared test settings."""

import torch

# CI machines have 2 cores and several suites start servers and subprocesses beside the pytest process:
# one intra-op thread keeps tiny-model math from oversubscribing them (seen: 113 s -> 7 s for test_engine).
torch.set_num_threads(1)
