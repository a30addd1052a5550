"""The engine with lora_backend="triton" (Triton's CPU interpreter, float32) over DoRA and embed_tokens / lm_head
adapters mixed with plain LoRA gives the torch backend's tokens and logits: the batched launches read each module's
B^T at rows of their own in the pool arena, decode steps stage A rows from it, the expand launch's store applies
DoRA's output scale (the bias left out), and the vocabulary modules' ops run beside."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lora_problems import count_calls, run_tiny


def _formats():
    """tests/test_engine/test_adapter_formats.py, which writes these adapters with PEFT."""
    path = Path(__file__).parents[1] / "test_engine" / "test_adapter_formats.py"
    spec = importlib.util.spec_from_file_location("adapter_formats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # Qwen2: q/k/v biases, which DoRA's scale leaves out
def tiny(tmp_path_factory, request):
    from kubelora.cli.tiny import make_tiny_model

    formats, root = _formats(), tmp_path_factory.mktemp(f"formats-triton-{request.param}")
    model_dir = make_tiny_model(root / "model", arch=request.param, seed=0, num_layers=2)
    adapters = {name: formats.make_peft_adapter(root / name, model_dir, seed, config, save)
                for seed, (name, (config, save)) in enumerate(formats.ADAPTERS.items(), start=1)}
    return model_dir, adapters


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU needs Triton's interpreter (set without CUDA)")
def test_triton_backend_matches_torch_backend_on_every_format(triton_backend, monkeypatch, tiny):
    from kubelora.engine import SamplingParams

    torch.set_num_threads(1)
    batch = _formats().BATCH
    prompts = [[1] + [(17 + 31 * i + 7 * j) % 490 + 10 for j in range(4 + 3 * i)] for i in range(len(batch))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    run = lambda backend: run_tiny(tiny, prompts, params, batch, max_loras=8, max_lora_rank=8,  # noqa: E731
                                   lora_backend=backend)[0]
    expected = run("torch")
    calls = count_calls(monkeypatch, triton_backend, "add_lora_triton")
    got = run("triton")
    assert calls
    for want, result in zip(expected, got):
        assert result.token_ids == want.token_ids
        assert (result.logits - want.logits).abs().max() < 1e-4
