"""Adapters as PEFT writes them beyond plain LoRA, equal to transformers + PEFT on tiny models: DoRA, LoRA on
embed_tokens and lm_head (with and without PEFT's full embedding copies), in one mixed batch with plain LoRA, greedy
tokens and logprobs one prompt at a time; what is not served is refused naming the key; and the device pool, paged
per module, holds every adapter mix whose reported bytes fit its reported room."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubelora.engine import LLM, SamplingParams
from kubelora.engine import errors
from kubelora.engine.adapters.pool import slot_tables, table_modules
from kubelora.engine.step.plan import plan_graphs
from kubelora.engine.step.shape import decode_shape, prefill_shape

TOL = 1e-4  # float32 max abs logit difference
NUM_DECODE = 6
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig arguments, save_embedding_layers); Phi-3's targets are its fused modules (PHI3_TARGETS)
ADAPTERS = {
    "plain": (dict(r=8, lora_alpha=16, target_modules=LINEAR), True),
    "dora": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True),
             True),
    "dora-all": (dict(r=8, lora_alpha=8, target_modules=LINEAR, use_dora=True, use_rslora=True), True),
    "vocab": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]), True),
    "vocab-only": (dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "lm_head"]), False),
    # PEFT resolves all-linear and writes every module's full name (model.layers.0.mlp.up_proj) in the config
    "all-linear": (dict(r=4, lora_alpha=8, target_modules="all-linear"), True),
}
PHI3_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}
BATCH = [None, "plain", "dora", "vocab", "dora-all", "vocab-only", "all-linear", "vocab"]


def _tie_embeddings(model_dir: Path) -> None:
    """The model rewritten with its lm_head tied to the embedding (as small Qwen2 and Gemma checkpoints are)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    model.tie_weights()
    model.save_pretrained(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _for_arch(config: dict, arch: str) -> dict:
    if arch != "phi3" or isinstance(config["target_modules"], str):
        return config
    targets = list(dict.fromkeys(PHI3_TARGETS.get(t, t) for t in config["target_modules"]))
    return {**config, "target_modules": targets}


def make_peft_adapter(out: Path, model_dir: Path, seed: int, config: dict, save_embedding_layers) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:  # PEFT starts it at ||W||: moved so that DoRA changes the output
                param.mul_(1 + 0.3 * torch.rand(param.shape, generator=generator))
            elif "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator) / config["r"] ** 0.5)
    model.save_pretrained(out, save_embedding_layers=save_embedding_layers)
    return out


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """arch -> Material with the ADAPTERS, built on first use."""
    from kubelora.cli.tiny import make_tiny_model

    from .conftest import Material

    built = {}

    def build(arch: str) -> Material:
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            model_dir = make_tiny_model(root / "model", arch=arch.removesuffix("-tied"), seed=0, num_layers=2)
            if arch.endswith("-tied"):
                _tie_embeddings(model_dir)
            adapters = {name: make_peft_adapter(root / name, model_dir, seed, _for_arch(config, arch), save)
                        for seed, (name, (config, save)) in enumerate(ADAPTERS.items(), start=1)}
            built[arch] = Material(arch, model_dir, adapters)
        return built[arch]

    return build


def generate(material, prompts, names, **options):
    llm = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8, **options)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.generate(prompts, params, adapters=names)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-tied", "gemma2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}], ids=["static", "eager"])
def test_mixed_formats_match_transformers_peft(arch, options, formats, prompt_ids, peft_reference):
    material = formats(arch)
    prompts = [prompt_ids(i, 5 + 2 * i) for i in range(len(BATCH))]
    if arch == "phi3":  # sequences within original_max_position_embeddings (32): longrope's short factors, as
        options = {**options, "max_model_len": 32}  # transformers runs such sequences
    results = generate(material, prompts, BATCH, **options)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material)
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1])
        num_prompt = len(prompt)
        assert expected[num_prompt - 1 :].argmax(-1).tolist() == result.token_ids, name
        assert (result.prompt_logits - expected[:num_prompt]).abs().max() < TOL, name
        assert (result.logits - expected[num_prompt - 1 :]).abs().max() < TOL, name
        logprobs = torch.log_softmax(result.logits, -1)
        assert (logprobs - torch.log_softmax(expected[num_prompt - 1 :], -1)).abs().max() < 2 * TOL, name


def test_graphs_planned_for_every_format_replay_them(formats, prompt_ids, peft_reference, cpu_graphs):
    """With graphs on (stood in for on CPU), the graphs planned for the registered adapters (DoRA and vocabulary
    kinds in their shapes) are the ones the steps replay, and their tokens are the reference's."""
    material = formats("llama")
    prompts = [prompt_ids(i, 5 + 2 * i) for i in range(len(BATCH))]
    llm = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        engine = llm.engine
        steps, model = engine._runner.steps, engine.model_config
        for name in ADAPTERS:  # the graphs planned for an adapter are those its steps look up
            revision = engine.adapters.acquire(name)
            assert engine.adapters.ensure_device(revision, set()).value == "resident"
            tables = slot_tables((engine.adapters.slot_view(revision),), table_modules(model))
            engine.adapters.release(revision)
            wanted = plan_graphs([engine.adapters.get(name)], model, steps)[1]
            assert prefill_shape(16, tables) in wanted, name
            assert decode_shape(1, [0], tables) in wanted, name
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True)
        for name, prompt in zip(BATCH, prompts):  # one at a time: each decode step's shape is an adapter's own
            result = llm.generate([prompt], params, adapters=[name])[0]
            build_reference, reference_logits = peft_reference
            expected = reference_logits(_reference(material, build_reference), name, prompt + result.token_ids[:-1])
            assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
    finally:
        llm.close()


_REFERENCES: dict = {}


def _reference(material, build_reference):
    if material.model_dir not in _REFERENCES:
        _REFERENCES[material.model_dir] = build_reference(material)
    return _REFERENCES[material.model_dir]


# ---- refusals: a 4xx naming the key ----

def _spec(material, path: Path, **limits):
    from kubelora.engine.adapters.peft_reader import read_adapter_spec
    from kubelora.engine.adapters.spec import AdapterLimits
    from kubelora.engine.model.config import load_hf_config, model_config_from_hf

    model = model_config_from_hf(load_hf_config(material.model_dir), material.model_dir)
    options = dict(max_lora_rank=16, model_names=(model.name,), is_base_model_strict=False,
                   model_dir=str(material.model_dir))
    return read_adapter_spec("tenant", path, model, AdapterLimits(**{**options, **limits})), model


def _edited(material, name: str, out: Path, edit_tensors=None, **config) -> Path:
    out.mkdir()
    source = material.adapters[name]
    tensors = load_file(source / "adapter_model.safetensors")
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_file(tensors, out / "adapter_model.safetensors")
    adapter_config = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**adapter_config, **config}))
    return out


COPY = "base_model.model.lm_head.base_layer.weight"
EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"


def test_full_copies_equal_to_the_base_are_served_and_counted_as_the_lora_alone(formats, tmp_path):
    material = formats("llama")
    with_copies, model = _spec(material, material.adapters["vocab"])
    header = load_file(material.adapters["vocab"] / "adapter_model.safetensors")
    assert COPY in header and EMBED_COPY in header  # PEFT's default save wrote them
    without = _edited(material, "vocab", tmp_path / "without",
                      lambda t: [t.pop(k) for k in (COPY, EMBED_COPY)])
    spec, _ = _spec(material, without)
    assert with_copies.ranks == spec.ranks == {"q_proj": 8, "embed_tokens": 8, "lm_head": 8}
    assert COPY not in {k for pair in with_copies.tensor_names.values() for k in pair}
    from kubelora.engine.adapters.peft_reader import read_adapter_weights

    host, host_without = (read_adapter_weights(s, model, torch.float32, pin=False) for s in (with_copies, spec))
    assert host.num_bytes == host_without.num_bytes  # the copies stream through the load: not in the host tier
    assert all(torch.equal(host.b[m], host_without.b[m]) for m in spec.ranks)


@pytest.mark.parametrize("case", ["copy_differs", "resized_vocab", "modules_to_save", "dora_on_lm_head",
                                  "magnitude_without_dora", "no_checkpoint"])
def test_what_is_not_served_is_refused_naming_the_key(case, formats, tmp_path):
    material = formats("llama")
    out = tmp_path / case
    limits = {}
    if case == "copy_differs":
        path = _edited(material, "vocab", out, lambda t: t[COPY][3].add_(1.0))
        error, key = errors.InvalidAdapter, COPY
    elif case == "resized_vocab":
        path = _edited(material, "vocab", out, lambda t: t.update({EMBED_COPY: torch.cat(
            [t[EMBED_COPY], torch.zeros(8, t[EMBED_COPY].shape[1])])}))
        error, key = errors.AdapterShapeMismatch, EMBED_COPY
    elif case == "modules_to_save":
        path = _edited(material, "vocab", out, modules_to_save=["lm_head"])
        error, key = errors.InvalidAdapter, "modules_to_save"
    elif case == "dora_on_lm_head":
        magnitude = "base_model.model.lm_head.lora_magnitude_vector"
        path = _edited(material, "dora", out, lambda t: t.update({
            magnitude: torch.ones(512), "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4)}))
        error, key = errors.AdapterTargetUnsupported, magnitude
    elif case == "magnitude_without_dora":
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
        path = _edited(material, "plain", out, lambda t: t.update({key: torch.ones(64)}))
        error = errors.InvalidAdapter
    else:
        path, limits = material.adapters["vocab"], {"model_dir": None}
        error, key = errors.AdapterTargetUnsupported, COPY  # the first copy in the file
    with pytest.raises(error) as info:
        _spec(material, path, **limits)
    assert key in str(info.value) and info.value.adapter == "tenant"
    if case not in ("dora_on_lm_head", "no_checkpoint"):
        assert info.value.field == key


def test_dora_over_a_quantized_base_is_refused_naming_its_format(formats):
    material = formats("llama")
    with pytest.raises(errors.InvalidAdapter) as info:
        _spec(material, material.adapters["dora"], base_format="bitsandbytes nf4")
    assert info.value.field == "use_dora" and "bitsandbytes nf4" in str(info.value)
    _spec(material, material.adapters["plain"], base_format="bitsandbytes nf4")  # plain LoRA needs no W


# ---- the pool, paged per module ----

def _host(material, name: str):
    from kubelora.engine.adapters.peft_reader import read_adapter_weights

    spec, model = _spec(material, material.adapters[name])
    return spec, read_adapter_weights(spec, model, torch.float32, pin=False), model


def test_an_adapter_takes_bytes_for_its_own_modules_and_ranks_as_reported(formats):
    from kubelora.engine.adapters.pool import module_costs, spec_bytes

    material = formats("llama")
    spec, _, model = _host(material, "dora")
    costs = module_costs(model, torch.float32)
    expected = sum(4 * costs[m]["per_rank"] + costs[m]["fixed"] + costs[m]["dora"]
                   for m in ("q_proj", "v_proj", "o_proj", "down_proj"))
    assert spec_bytes(model, torch.float32, spec) == expected
    plain, _, _ = _host(material, "plain")
    attention = {m: 8 for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    from kubelora.engine.adapters.pool import adapter_bytes

    # attention-only pays for q/k/v/o alone: the share of their rows in every module's, not all of them
    ratio = adapter_bytes(model, torch.float32, attention) / spec_bytes(model, torch.float32, plain)
    rows = sum(costs[m]["per_rank"] for m in attention) / sum(costs[m]["per_rank"] for m in plain.ranks)
    assert abs(ratio - rows) < 0.05 and ratio < 0.6
    vocab, _, _ = _host(material, "vocab-only")
    assert spec_bytes(model, torch.float32, vocab) == sum(4 * costs[m]["per_rank"] + costs[m]["fixed"]
                                                          for m in ("embed_tokens", "lm_head"))


def test_every_mix_within_the_reported_room_is_made_resident(formats):
    """Adapters whose reported bytes sum to at most the pool's total are all placed, whatever the order of places
    and frees before (the holes they leave are compacted away); their rows hold their weights."""
    import random

    from kubelora.engine.adapters.pool import DeviceLoRAPool, spec_bytes
    from kubelora.kernels.lora_formats import vocab_rows

    material = formats("qwen2")
    universe = {name: _host(material, name) for name in ADAPTERS}
    model = universe["plain"][2]
    attention = _edited_attention(material, model, universe)
    universe.update(attention)
    cost = {name: spec_bytes(model, torch.float32, spec) for name, (spec, _, _) in universe.items()}
    mix = ["plain", "vocab", "dora-all", "attn-0", "attn-1", "attn-2", "vocab-only"]
    pool = DeviceLoRAPool(model, 1, torch.float32, torch.device("cpu"), num_bytes=sum(cost[n] for n in mix))
    pool.set_base_weight(lambda layer, module: torch.zeros(model.module_dims(module)[::-1]))
    rng = random.Random(0)
    owners = {}  # owner id -> name
    for round_ in range(300):  # the pool kept near full: a random adapter in when its bytes fit, else one out
        name = rng.choice(sorted(universe))
        spec, host, _ = universe[name]
        fits = sum(cost[n] for n in owners.values()) + cost[name] <= pool.total_bytes
        assert pool.place(round_, spec, host) == fits, (name, sorted(owners.values()))
        if fits:
            owners[round_] = name
        else:
            pool.free(owner := rng.choice(sorted(owners)))
            del owners[owner]
        assert pool.used_bytes == sum(cost[n] for n in owners.values())
    for owner, name in owners.items():
        spec, host, _ = universe[name]
        view = pool.view(owner, spec.scales)
        for module, rank in view.rank.items():
            a_rows, b_rows = pool.a[module], pool.b[module]
            start, b_start = view.row_start[module], view.b_row(module)
            assert torch.equal(a_rows[:, start : start + rank], host.a[module])
            assert torch.equal(b_rows[:, b_start : b_start + rank], host.b[module])
    vocab_owner = next((o for o, n in owners.items() if n in ("vocab", "vocab-only")), None)
    if vocab_owner is not None:  # a vocabulary module's logical rows are its pieces end to end
        spec, host, _ = universe[owners[vocab_owner]]
        view = pool.view(vocab_owner, spec.scales)
        rows = torch.arange(view.row_start["lm_head"], view.row_start["lm_head"] + view.rank["lm_head"])
        lora_a = load_file(material.adapters[owners[vocab_owner]] / "adapter_model.safetensors")[
            "base_model.model.lm_head.lora_A.weight"]
        assert torch.equal(vocab_rows(pool.a["lm_head"], rows, model.hidden_size), lora_a)


def _edited_attention(material, model, universe) -> dict:
    """Three attention-only adapters of different ranks (plain's q/k/v/o rows cut to rank 2, 5, 8)."""
    import dataclasses

    spec, host, _ = universe["plain"]
    out = {}
    for i, rank in enumerate((2, 5, 8)):
        modules = ("q_proj", "k_proj", "v_proj", "o_proj")
        cut = dataclasses.replace(spec, ranks={m: rank for m in modules}, scales={m: spec.scales[m] for m in modules})
        out[f"attn-{i}"] = (cut, type(host)(a={m: host.a[m][:, :rank].clone() for m in modules},
                                            b={m: host.b[m][:, :rank].clone() for m in modules}), model)
    return out


# ---- on the GPU: graphs on and off, each LoRA backend ----

TOLERANCE = {"torch": 1e-3, "triton": 3e-2}  # float32 on the GPU; Triton's tl.dot may use TF32 (test_cuda.py)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2-tied", "gemma2"])
@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_cuda_mixed_formats_match_transformers_peft(arch, backend, options, formats, prompt_ids, peft_reference):
    material = formats(arch)
    prompts = [prompt_ids(i, 5 + 2 * i) for i in range(len(BATCH))]
    results = generate(material, prompts, BATCH, device="cuda", dtype="float32", lora_backend=backend, **options)
    build_reference, reference_logits = peft_reference
    reference = build_reference(material, device="cuda")
    worst = 0.0
    for name, prompt, result in zip(BATCH, prompts, results):
        expected = reference_logits(reference, name, prompt + result.token_ids[:-1]).cpu()
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
        worst = max(worst, float((torch.cat([result.prompt_logits, result.logits[1:]]) - expected).abs().max()))
    print(f"\n{arch} cuda float32 {backend} {options}: max |logit diff| = {worst:.2e}")
    assert worst < TOLERANCE[backend]


def test_an_engine_holds_at_once_every_adapter_its_reported_room_admits(formats, prompt_ids):
    """The engine's reported room (the pool's total_bytes, /v1/models' adapter_pool_bytes) against the adapters'
    reported bytes, as the operator places them: a mix of attention-only, all-linear, DoRA and embedding adapters
    whose bytes fit is resident at once, one batch over all of them, no eviction; one more adapter past the room
    evicts."""
    from kubelora.engine.adapters.pool import DeviceLoRAPool

    material = formats("llama")
    model = _spec(material, material.adapters["plain"])[1]
    per_rank = DeviceLoRAPool.bytes_per_rank(model, torch.float32)
    probe = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8)
    try:
        sizes = {name: probe.load_adapter(name, path).bytes for name, path in material.adapters.items()}
    finally:
        probe.close()
    mix = ["plain", "dora", "vocab", "vocab-only"]
    rows = -(-sum(sizes[n] for n in mix) // per_rank)  # the budget the operator's sum asks for, in whole rows
    llm = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8, max_lora_pool_bytes=rows * per_rank)
    try:
        for name in mix:
            llm.load_adapter(name, material.adapters[name])
        stats = llm.engine.adapters.stats()
        assert sum(sizes[n] for n in mix) <= stats.pool_total_bytes < sum(sizes[n] for n in mix) + per_rank
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        llm.generate([prompt_ids(i, 6) for i in range(len(mix))], params, adapters=mix)
        infos = {info.name: info for info in llm.engine.adapters.list()}
        assert all(infos[n].tier == "device" for n in mix) and llm.engine.adapters.stats().num_device_evictions == 0
        llm.load_adapter("dora-all", material.adapters["dora-all"])  # past the room: someone is evicted
        llm.generate([prompt_ids(9, 6)], params, adapters=["dora-all"])
        assert llm.engine.adapters.stats().num_device_evictions >= 1
    finally:
        llm.close()


@pytest.mark.parametrize("bad", ["dora", "vocab"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_poisoned_format_leaves_other_requests_alone(bad, value, formats, prompt_ids):
    """NaN or infinities in every pool row of a DoRA or an embed/lm_head adapter (A, B^T, DoRA's scales) reach no
    other adapter's tokens, nor the base model's: their tokens and logits are bit for bit the clean run's."""
    from kubelora.engine.adapters.types import Residency

    material = formats("qwen2")
    victims = [None, "plain", "dora-all", "vocab-only"]
    prompts = [prompt_ids(i, 4 + 3 * i) for i in range(len(victims) + 1)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    llm = LLM(material.model_dir, max_loras=len(ADAPTERS), max_lora_rank=8)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        clean = llm.generate(prompts, params, adapters=[*victims, bad])
        manager = llm.engine.adapters
        revision = manager.acquire(bad)
        assert manager.ensure_device(revision, set()) is Residency.RESIDENT
        manager._pool.fill(revision.id, value)
        manager.release(revision)
        poisoned = llm.generate(prompts, params, adapters=[*victims, bad])
    finally:
        llm.close()
    for name, want, got in zip(victims, clean, poisoned):
        assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits), name
    own = poisoned[-1]  # the poisoned adapter's own request sees it: failed, or non-finite logits
    assert own.logits is None or not torch.isfinite(own.logits).all()
