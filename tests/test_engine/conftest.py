"""Tiny models and PEFT adapters built once per session (random weights, real transformers/PEFT writers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Tiny tensors gain nothing from intra-op threads, and spinning OpenMP workers collapse on a busy 2-core box.
torch.set_num_threads(1)

# name -> (rank, alpha, targets, use_rslora): different ranks, alphas, scalings and target sets.
ADAPTERS = {
    "r4-qv": (4, 8, "q_proj,v_proj", False),
    "r8-all": (8, 16, "all-linear", False),
    "r16-all-rs": (16, 8, "all-linear", True),
    "r32-attn": (32, 64, "q_proj,k_proj,v_proj,o_proj", False),
}
MAX_RANK = 32


@dataclass(frozen=True)
class Material:
    arch: str
    model_dir: Path
    adapters: dict[str, Path]


def build_material(root: Path, arch: str) -> Material:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    model_dir = make_tiny_model(root / "model", arch=arch, seed=0)
    adapters = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        adapters[name] = make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed,
                                      use_rslora=rslora)
    return Material(arch, model_dir, adapters)


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Material:
    return build_material(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def mistral(tmp_path_factory) -> Material:
    return build_material(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory) -> Material:
    return build_material(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def material(request) -> Material:
    """Parametrize indirectly with an arch name."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def llama_llm(llama):
    """A shared engine with every test adapter loaded; tests must not unload them or leave requests behind."""
    from kubelora.engine import LLM

    llm = LLM(llama.model_dir, max_loras=4, max_lora_rank=MAX_RANK, max_cpu_loras=8)
    for name, path in llama.adapters.items():
        llm.load_adapter(name, path)
    yield llm
    llm.close()


def make_prompt(index: int, length: int, vocab: int = 512) -> list[int]:
    """Deterministic varied prompts (token ids away from the specials at the start of the vocabulary)."""
    return [1] + [(17 + 31 * index + 7 * j) % (vocab - 20) + 10 for j in range(length - 1)]


@pytest.fixture(scope="session")
def prompt_ids():
    return make_prompt


def build_reference(material, device: str = "cpu"):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(material.model_dir, dtype=torch.float32).to(device)
    names = list(material.adapters)
    model = PeftModel.from_pretrained(base, material.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(material.adapters[name], adapter_name=name)
    return model.eval()


def reference_logits(model, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, with that sequence's adapter (or none)."""
    ids = torch.tensor([token_ids], device=model.device)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return model(ids).logits[0]
        model.set_adapter(adapter)
        return model(ids).logits[0]


@pytest.fixture(scope="session")
def peft_reference():
    """(build_reference, reference_logits): transformers+PEFT with every test adapter, the correctness bar."""
    return build_reference, reference_logits


def build_sampling_batch(logits: torch.Tensor, params: list, generators=None, outputs=None, prompts=None, eos=()):
    """A SamplingBatch over stand-in sequences (prompt, output so far, generator) for the logits rows."""
    from kubelora.engine.sampling_batch import prepare_sampling
    from kubelora.engine.sequence import Sequence

    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(request_id=f"r{i}", prompt_token_ids=list(prompts[i]) if prompts else [1], params=p,
                       adapter_name=None, adapter=None, max_tokens=64, arrival_time=0.0,
                       generator=generators[i] if generators else None)
        seq.output_token_ids = list(outputs[i]) if outputs else []
        seqs.append(seq)
    return prepare_sampling(seqs, logits.shape[-1], logits.device, eos)


@pytest.fixture(scope="session")
def sampling_batch():
    return build_sampling_batch


class _Replay:
    """A stand-in for a CUDA graph on CPU: replay reruns the captured forward into the same static output."""

    def __init__(self, forward, output: torch.Tensor) -> None:
        self.forward, self.output = forward, output

    @torch.inference_mode()
    def replay(self) -> None:
        self.output.copy_(self.forward())


def _fake_capture(device, pool, forward):
    output = forward()
    return _Replay(forward, output), output, 0.0


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Static steps on CPU as on CUDA: graphs stood in for by `_Replay`, the base ones captured at start-up, the
    rest on first use (decode) or while idle; engines built after this run the static path with graphs on."""
    from kubelora.engine import setup
    from kubelora.engine.step import graphs

    monkeypatch.setattr(graphs, "capture_graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    build = setup.build_step_executor

    def build_graphed(*args, **kwargs):
        steps = build(*args, **kwargs)
        steps.use_graphs = steps.is_static  # the engine then captures the base graphs, as on CUDA
        return steps

    monkeypatch.setattr(setup, "build_step_executor", build_graphed)
