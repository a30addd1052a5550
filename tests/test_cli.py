"""The `kubelora` command's material makers: real HF/PEFT directories, deterministic for a seed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

KUBELORA = [sys.executable, "-P", "-m", "kubelora.cli.main"]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run([*KUBELORA, *args], capture_output=True, text=True, check=True, env=env).stdout


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen") / "model"
    _run("make-tiny-model", str(out), "--arch", "qwen2", "--seed", "3", "--layers", "1")
    return out


def test_tiny_model_is_a_loadable_hf_directory(qwen_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (qwen_dir / name).is_file(), name
    config = json.loads((qwen_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 1
    assert "chat_template" in json.loads((qwen_dir / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|assistant|>")
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    logits = model(torch.tensor([tokenizer("Hello there")["input_ids"]])).logits
    assert torch.isfinite(logits).all()
    weights = load_file(qwen_dir / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0  # qwen2 qkv biases are real


def test_tiny_model_is_deterministic_for_a_seed(tmp_path: Path, qwen_dir: Path):
    again = tmp_path / "again"
    _run("make-tiny-model", str(again), "--arch", "qwen2", "--seed", "3", "--layers", "1")
    other = tmp_path / "other"
    _run("make-tiny-model", str(other), "--arch", "qwen2", "--seed", "4", "--layers", "1")
    assert _digest(again / "model.safetensors") == _digest(qwen_dir / "model.safetensors")
    assert _digest(again / "tokenizer.json") == _digest(qwen_dir / "tokenizer.json")
    assert _digest(other / "model.safetensors") != _digest(qwen_dir / "model.safetensors")


def test_make_adapter_writes_a_peft_adapter_that_changes_the_output(tmp_path: Path, qwen_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    _run("make-adapter", str(out), "--model", str(qwen_dir), "--rank", "4", "--alpha", "8", "--targets", "all-linear")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    tensors = load_file(out / "adapter_model.safetensors")
    assert all(t.abs().sum() > 0 for name, t in tensors.items() if "lora_B" in name)
    ids = torch.tensor([[5, 17, 42, 99]])
    base = AutoModelForCausalLM.from_pretrained(qwen_dir)
    base_logits = base(ids).logits
    adapted = PeftModel.from_pretrained(base, out)
    assert (adapted(ids).logits - base_logits).abs().max() > 1e-3


def test_make_adapter_rejects_unknown_targets(tmp_path: Path, qwen_dir: Path):
    from kubelora.cli.tiny import make_adapter

    with pytest.raises(ValueError, match="targets must be a subset"):
        make_adapter(tmp_path / "bad", qwen_dir, targets="q_proj,lm_head_typo")


@pytest.mark.parametrize("command, flag", [("operator", "--resync-seconds"), ("router", "--placement-configmap"),
                                           ("bench kernels", "--no-baselines"), ("bench engine", "--scenarios")])
def test_passthrough_commands_take_their_own_options(command: str, flag: str):
    # Options right after the subcommand go to the owning module's parser (no `--` needed).
    assert flag in _run(*command.split(), "--help")

