"""Non-finite adapter weights are refused as the pool would hold them (cast to its dtype), naming the first tensor
at fault in the adapter's order; finite weights are laid out in the pool's dtype, equal to a cast of the file's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubelora.engine.adapters.peft_reader import read_adapter_spec, read_adapter_weights
from kubelora.engine.adapters.spec import AdapterLimits
from kubelora.engine.errors import AdapterCorrupt
from kubelora.engine.model.config import load_hf_config, model_config_from_hf

GOOD = "r8-all"
F16_MAX = torch.finfo(torch.float16).max


@pytest.fixture(scope="module")
def model(llama):
    return model_config_from_hf(load_hf_config(llama.model_dir), llama.model_dir)


def _read(path: Path, model, dtype: torch.dtype):
    limits = AdapterLimits(max_lora_rank=64, model_names=(model.name,), is_base_model_strict=False)
    spec = read_adapter_spec("x", path, model, limits)
    return spec, read_adapter_weights(spec, model, dtype, pin=False)


def _poisoned(llama, tmp_path: Path, values: dict[str, float]) -> Path:
    """The good adapter with tensor[0, 0] set, for each key fragment in `values`."""
    path = tmp_path / "poisoned"
    shutil.copytree(llama.adapters[GOOD], path)
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    for fragment, value in values.items():
        tensors[next(k for k in sorted(tensors) if fragment in k)][0, 0] = value
    save_file(tensors, str(weights))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_weights_are_laid_out_in_the_pools_dtype(llama, model, dtype):
    spec, host = _read(llama.adapters[GOOD], model, dtype)
    tensors = load_file(str(llama.adapters[GOOD] / "adapter_model.safetensors"))
    for (layer, module), (a_key, b_key) in spec.tensor_names.items():
        a, b = tensors[a_key], tensors[b_key]
        assert host.a[module].dtype == dtype
        assert torch.equal(host.a[module][layer, : a.shape[0]], a.to(dtype))
        assert torch.equal(host.b[module][layer, : b.shape[1]], b.T.to(dtype))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(llama, model, tmp_path, value):
    path = _poisoned(llama, tmp_path, {"layers.1.mlp.up_proj.lora_B": value})
    with pytest.raises(AdapterCorrupt, match="NaN or infinite values") as caught:
        _read(path, model, torch.float32)
    assert "layers.1.mlp.up_proj.lora_B" in caught.value.field


def test_a_value_past_float16s_range_is_refused_only_for_a_float16_pool(llama, model, tmp_path):
    path = _poisoned(llama, tmp_path, {"layers.0.self_attn.k_proj.lora_A": 2 * F16_MAX})
    _read(path, model, torch.float32)
    _read(path, model, torch.bfloat16)
    with pytest.raises(AdapterCorrupt, match=r"\(as float16\)") as caught:
        _read(path, model, torch.float16)
    assert "layers.0.self_attn.k_proj.lora_A" in caught.value.field


def test_the_first_tensor_at_fault_in_the_adapters_order_is_named(llama, model, tmp_path):
    path = _poisoned(llama, tmp_path, {"layers.1.self_attn.v_proj.lora_A": float("nan"),
                                       "layers.0.mlp.down_proj.lora_B": float("inf")})
    with pytest.raises(AdapterCorrupt) as caught:
        _read(path, model, torch.float32)
    assert "layers.0.mlp.down_proj.lora_B" in caught.value.field


def test_a_good_adapter_is_checked_once_per_module_buffer(llama, model, monkeypatch):
    """Per tensor, a check is a handful of torch calls each holding the GIL for its Python; per buffer it is
    one pass over the values as the pool holds them."""
    from kubelora.engine.adapters import peft_reader

    calls = []
    real = torch.isfinite
    monkeypatch.setattr(peft_reader.torch, "isfinite", lambda t: calls.append(t.shape) or real(t))
    spec, host = _read(llama.adapters[GOOD], model, torch.float16)
    assert len(calls) == len(host.a) + len(host.b) < 2 * len(spec.tensor_names)  # A and B per module and layer
