"""The engine benchmark's other model families (Qwen3, Gemma 2, Phi-4) at tiny sizes on CPU: each shape's
checkpoint as transformers and PEFT write it, loaded by both, one bench run through the family comparison's
scenarios; and the bytes floor's sliding-window accounting.

The full-size shapes run on an H200, one command per family (docs/benchmarks-engine.md, "Model families").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubelora.bench.engine_assets import ATTENTION, MLP, SHAPES, AdapterSpec

FAMILIES = ("tiny-qwen3-8b", "tiny-gemma2-9b", "tiny-phi4")


def test_window_context_counts_only_the_tokens_inside_the_window():
    from kubelora.bench.engine_device import window_context

    assert window_context(128, 128, None) == 192  # full attention: the mean decode context
    assert window_context(128, 128, 4096) == 192  # a window the decode never fills
    assert window_context(128, 128, 64) == 64  # a window the prompt already fills
    # A window reached half-way: the mean over the decode's contexts of min(context, window), as a discrete sum.
    steps = 100_000
    discrete = sum(min(100 + 100 * (i + 0.5) / steps, 150) for i in range(steps)) / steps
    assert window_context(100, 100, 150) == pytest.approx(discrete, rel=1e-6)


def test_kv_bytes_read_by_a_sliding_layer_stop_at_its_window():
    from kubelora.bench.engine_device import kv_bytes

    llama, gemma = SHAPES["7b"], SHAPES["gemma2-9b"]
    # Llama-2-7B: every layer full, 32 layers x 32 KV heads x 128 x K and V x bf16 per token.
    assert kv_bytes(llama, 64, 128, 128) == 2 * 2 * 32 * 32 * 128 * 64 * 192
    # Gemma-2-9B: even layers slide over 4096 tokens, odd ones attend over everything.
    windows = gemma.layer_windows()
    assert windows[:4] == (4096, None, 4096, None) and len(windows) == 42
    per_token = 2 * 2 * 8 * 256
    assert kv_bytes(gemma, 1, 128, 128) == per_token * 42 * 192
    assert kv_bytes(gemma, 1, 8000, 200) == per_token * (21 * 4096 + 21 * 8100)


def test_family_shapes_are_the_real_checkpoints():
    """The sizes transformers' own model gives for each shape: parameter counts of the published checkpoints."""
    billions = {name: SHAPES[name].checkpoint_bytes() / 2e9 for name in ("qwen3-8b", "gemma2-9b", "phi4")}
    assert billions == pytest.approx({"qwen3-8b": 8.19, "gemma2-9b": 9.24, "phi4": 14.66}, abs=0.01)
    gemma = SHAPES["gemma2-9b"].hf_config()
    assert (gemma.query_pre_attn_scalar, gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (256, 50, 30)
    assert SHAPES["gemma2-9b"].is_tied and not SHAPES["phi4"].is_tied
    assert SHAPES["phi4"].peft_modules(ATTENTION + MLP) == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    with pytest.raises(ValueError, match="qkv_proj"):
        SHAPES["phi4"].peft_modules(("q_proj", "v_proj"))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_checkpoint_and_adapter_load_in_transformers_peft_and_the_engine(name: str, tmp_path: Path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from kubelora.bench.engine_assets import shape_of, write_adapters, write_model
    from kubelora.cli.tiny import make_adapter
    from kubelora.engine import LLM, SamplingParams

    shape = SHAPES[name]
    model_dir = write_model(tmp_path / "model", shape, "cpu")
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == shape.model_type and shape_of(model_dir) == shape
    # The adapter as PEFT writes it for this model: the same keys, shapes and target modules.
    targets = shape.peft_modules(ATTENTION)
    peft = make_adapter(tmp_path / "peft", model_dir, rank=4, targets=",".join(targets))
    [ours] = write_adapters(tmp_path, [AdapterSpec("ours", 4)], shape, model_dir, "cpu").values()
    with safe_open(str(peft / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(ours / "adapter_model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    assert sorted(json.loads((ours / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
    llm = LLM(model_dir, device="cpu", max_model_len=64)
    try:
        llm.load_adapter("ours", ours)
        prompt = list(range(11, 31))  # longer than the tiny shapes' 8-token windows
        results = llm.generate([prompt, prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                               adapters=[None, "ours"])
    finally:
        llm.close()
    assert all(len(r.token_ids) == 3 for r in results)


@pytest.mark.parametrize("name", FAMILIES)
def test_bench_family_run_on_cpu(name: str, tmp_path: Path):
    """The family comparison's scenarios (base, adapters, compiled transformers, floor) end to end, judged against
    a reference run's share of the floor."""
    from kubelora.bench import engine

    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"shape": SHAPES["7b"].as_dict(), "env": {"device": "cpu"},
                                     "floors": {"4x0": {"ms": 1.0}}, "rows": {"base-b4": {"runs": [{"decode_ms": 2.0}]}}}))
    report, raw = tmp_path / "report.md", tmp_path / "raw.json"
    argv = ["--preset", "smoke", "--shape", name, "--scenarios", "base,adapters,hf,floor", "--adapter-counts", "2",
            "--num-registered", "2", "--workdir", str(tmp_path / "work"), "--reference", str(reference),
            "--write", str(report), "--json", str(raw)]
    assert engine.main(argv) == 0
    text, data = report.read_text(), json.loads(raw.read_text())
    assert data["errors"] == {} and data["shape"]["model_type"] == SHAPES[name].model_type
    assert {"base-b1", "base-b4", "lora-a2", "hf-b1", "hf-b4"} <= set(data["rows"])
    assert data["reference"]["share"] == 0.5
    targets = text.split("## Targets")[1]
    for target in ("share of the bytes floor against the reference run's", "(ms/step with / without) over (floor",
                   "batch 4: speed-up over compiled transformers"):
        assert target in targets, target
    assert ">= 1.30x" in targets  # the other families' limit against compiled transformers
    row = text.split("## Model family row")[1].split("\n## ")[0]
    assert f"| {name} ({SHAPES[name].model_type}) |" in row
