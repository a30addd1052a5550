"""Bad adapters fail their own load with a typed error naming the adapter, the field and the limit; the
engine keeps its loaded adapters and keeps generating the same outputs."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubelora.engine import LLM, SamplingParams
from kubelora.engine import errors
from kubelora.engine.adapters import patterns
from kubelora.contract.http_errors import to_http

GOOD = "r8-all"


@pytest.fixture(scope="module")
def before(llama_llm, prompt_ids):
    """Reference outputs of the shared engine before any bad load."""
    return _probe(llama_llm, prompt_ids)


def _probe(llm, prompt_ids):
    names = [None, "r4-qv", "r8-all", "r32-attn"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = llm.generate([prompt_ids(i, 7) for i in range(len(names))], params, adapters=names)
    return [r.token_ids for r in results], sorted(a.name for a in llm.list_adapters())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> Path:
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return path


def _edit_tensors(path: Path, edit) -> Path:
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights))
    return path


def _rank_too_high(tmp: Path, llama) -> Path:
    from kubelora.cli.tiny import make_adapter

    return make_adapter(tmp / "r64", llama.model_dir, rank=64, alpha=16)


def _unknown_target(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "c_attn"), target_modules=["q_proj", "c_attn"])


def _norm_tensor(tmp: Path, llama) -> Path:
    def add_norm(tensors):
        tensors["base_model.model.model.norm.lora_A.weight"] = torch.zeros(8, 64)
        tensors["base_model.model.model.norm.lora_B.weight"] = torch.zeros(64, 8)

    path = _edit_config(_copy(llama.adapters[GOOD], tmp / "norm"), target_modules=".*proj|norm")
    return _edit_tensors(path, add_norm)


def _wrong_shapes(tmp: Path, llama) -> Path:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    other = make_tiny_model(tmp / "wide-model", arch="llama", hidden_size=96, num_heads=4, num_kv_heads=2)
    return make_adapter(tmp / "wide", other, rank=8, alpha=16)


def _truncated_weights(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "truncated")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return path


def _garbage_weights(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "garbage")
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" * 4)
    return path


def _missing_weights(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "no-weights")
    (path / "adapter_model.safetensors").unlink()
    return path


def _config_not_json(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "bad-json")
    (path / "adapter_config.json").write_text("{'r': 8, oops")
    return path


def _missing_dir(tmp: Path, llama) -> Path:
    return tmp / "does-not-exist"


def _dora_without_magnitudes(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "dora"), use_dora=True)


def _int_tensors(tmp: Path, llama) -> Path:
    def to_int(tensors):
        for key in tensors:
            tensors[key] = tensors[key].to(torch.int32)

    return _edit_tensors(_copy(llama.adapters[GOOD], tmp / "int"), to_int)


def _rank_pattern_too_high(tmp: Path, llama) -> Path:
    def widen_q(tensors):
        for key in list(tensors):
            if "q_proj.lora_A" in key:
                tensors[key] = torch.randn(40, 64)
            elif "q_proj.lora_B" in key:
                tensors[key] = torch.randn(64, 40)

    path = _edit_config(_copy(llama.adapters[GOOD], tmp / "pattern"), rank_pattern={"q_proj": 40})
    return _edit_tensors(path, widen_q)


def _edit_header(path: Path, key_part: str, **changes) -> Path:
    """Rewrite the safetensors header entry whose key contains `key_part`; the data stays as it is."""
    weights = path / "adapter_model.safetensors"
    blob = weights.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    key = next(k for k in header if key_part in k)
    header[key] = {**header[key], **changes}
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    return path


def _crafted(name: str, **changes):
    def make(tmp: Path, llama) -> Path:
        return _edit_header(_copy(llama.adapters[GOOD], tmp / name), "q_proj.lora_A", **changes)

    make.__name__ = f"_{name}"
    return make


def _trailing_bytes(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "trailing")
    with (path / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\0" * 4096)
    return path


def _gap_between_tensors(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "gap")
    weights = path / "adapter_model.safetensors"
    blob = weights.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [begin + 4, end + 4]  # overlaps the next tensor, leaves 4 bytes unused
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    return path


def _targets_not_strings(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "nested-targets"), target_modules=[["q_proj"]])


def _alpha_pattern_a_list(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "alpha-list"), alpha_pattern=["q_proj"])


def _alpha_pattern_bad_regex(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "alpha-regex"), alpha_pattern={"q_proj(": 16})


def _config_too_large(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "huge-config"), padding="x" * (2 << 20))


WEIGHTS = "adapter_model.safetensors"
# (case, expected exception, field, text the message must contain: the limit or what was expected)
CASES = [
    (_rank_too_high, errors.AdapterRankTooLarge, "r", "max_lora_rank 32"),
    (_rank_pattern_too_high, errors.AdapterRankTooLarge, "rank_pattern", "max_lora_rank 32"),
    (_unknown_target, errors.AdapterTargetUnsupported, "target_modules", "c_attn"),
    (_norm_tensor, errors.AdapterTargetUnsupported, "target_modules", "model.norm"),
    (_wrong_shapes, errors.AdapterShapeMismatch, None, "64"),
    (_truncated_weights, errors.AdapterCorrupt, "adapter_model.safetensors", "corrupt"),
    (_garbage_weights, errors.AdapterCorrupt, "adapter_model.safetensors", "corrupt"),
    (_missing_weights, errors.AdapterNotFound, "adapter_model.safetensors", "does not exist"),
    (_config_not_json, errors.AdapterCorrupt, "adapter_config.json", "not valid JSON"),
    (_missing_dir, errors.AdapterNotFound, "path", "not a directory"),
    (_dora_without_magnitudes, errors.AdapterShapeMismatch, "adapter_model.safetensors", "lora_magnitude_vector"),
    (_int_tensors, errors.InvalidAdapter, "dtype", "I32"),
    (_crafted("offsets-scalar", data_offsets=0), errors.AdapterCorrupt, WEIGHTS, "data_offsets"),
    (_crafted("offsets-three", data_offsets=[0, 1024, 2048]), errors.AdapterCorrupt, WEIGHTS, "data_offsets"),
    (_crafted("dtype-list", dtype=["F32"]), errors.AdapterCorrupt, WEIGHTS, "dtype must be a string"),
    (_crafted("shape-int", shape=8), errors.AdapterCorrupt, WEIGHTS, "shape must be an array"),
    (_crafted("shape-bools", shape=[True, True]), errors.AdapterCorrupt, WEIGHTS, "shape must be an array"),
    (_crafted("shape-huge", shape=[2**40, 2**40]), errors.AdapterCorrupt, WEIGHTS, "do not hold"),
    (_crafted("no-dtype", dtype=None), errors.AdapterCorrupt, WEIGHTS, "dtype must be a string"),
    (_trailing_bytes, errors.AdapterCorrupt, WEIGHTS, "4096 trailing bytes"),
    (_gap_between_tensors, errors.AdapterCorrupt, WEIGHTS, "without gaps or overlaps"),
    (_targets_not_strings, errors.InvalidAdapter, "target_modules", "must be module names"),
    (_alpha_pattern_a_list, errors.InvalidAdapter, "alpha_pattern", "must be an object"),
    (_alpha_pattern_bad_regex, errors.InvalidAdapter, "alpha_pattern", "not a regular expression"),
    (_config_too_large, errors.InvalidAdapter, "adapter_config.json", "larger than 1048576 bytes"),
]


@pytest.mark.parametrize("make_bad, error_type, field, text", CASES, ids=[c[0].__name__[1:] for c in CASES])
def test_bad_adapter_fails_alone(llama_llm, llama, before, tmp_path, prompt_ids, make_bad, error_type, field, text):
    path = make_bad(tmp_path, llama)
    with pytest.raises(error_type) as info:
        llama_llm.load_adapter("bad-one", path)
    exc = info.value
    assert exc.adapter == "bad-one" and "'bad-one'" in str(exc)
    if field is not None:
        assert exc.field == field and field in str(exc)
    assert text in str(exc)
    assert llama_llm.engine.adapters.get("bad-one") is None
    assert _probe(llama_llm, prompt_ids) == before


def test_loading_a_different_path_under_a_loaded_name_is_refused(llama_llm, llama, before, prompt_ids):
    with pytest.raises(errors.AdapterExists) as info:
        llama_llm.load_adapter(GOOD, llama.adapters["r4-qv"])
    assert GOOD in str(info.value) and "load_inplace" in str(info.value)
    assert llama_llm.load_adapter(GOOD, llama.adapters[GOOD]).name == GOOD  # same revision: success
    assert _probe(llama_llm, prompt_ids) == before


def test_base_model_mismatch_warns_or_errors(llama, tmp_path):
    path = _edit_config(_copy(llama.adapters[GOOD], tmp_path / "other-base"),
                        base_model_name_or_path="meta-llama/Llama-3.1-8B")
    lenient = LLM(llama.model_dir, max_loras=1, max_lora_rank=32)
    assert lenient.load_adapter("x", path).base_model == "meta-llama/Llama-3.1-8B"
    strict = LLM(llama.model_dir, max_loras=1, max_lora_rank=32, is_base_model_strict=True)
    with pytest.raises(errors.AdapterBaseModelMismatch) as info:
        strict.load_adapter("x", path)
    assert info.value.field == "base_model_name_or_path" and "Llama-3.1-8B" in str(info.value)
    assert strict.load_adapter("ok", llama.adapters[GOOD]).tier == "host"


def test_adapter_larger_than_the_pool_is_refused(llama):
    llm = LLM(llama.model_dir, max_loras=1, max_lora_rank=32, max_lora_pool_bytes=100_000)
    with pytest.raises(errors.AdapterTooLarge) as info:  # r32-attn takes 116 kB of the pool
        llm.load_adapter("big", llama.adapters["r32-attn"])
    assert info.value.field == "max_lora_pool_bytes"
    llm.load_adapter("small", llama.adapters["r4-qv"])


def test_trailing_gigabyte_is_refused_without_reading_it(llama_llm, llama, tmp_path):
    """A valid header followed by 1 GiB (sparse) is refused from the header and the file size alone."""
    path = _copy(llama.adapters[GOOD], tmp_path / "gigabyte")
    weights = path / "adapter_model.safetensors"
    valid_size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(valid_size + (1 << 30))
    started = time.monotonic()
    for preload in (True, False):
        with pytest.raises(errors.AdapterCorrupt) as info:
            llama_llm.load_adapter("gigabyte", path, preload=preload)
        assert f"{1 << 30} trailing bytes" in str(info.value)
    assert time.monotonic() - started < 0.5  # hashing or reading 1 GiB twice takes seconds
    assert llama_llm.engine.adapters.get("gigabyte") is None


def test_bytes_appended_after_registration_fail_the_on_demand_load(llama, tmp_path, prompt_ids):
    path = _copy(llama.adapters[GOOD], tmp_path / "grows")
    llm = LLM(llama.model_dir, max_loras=1, max_lora_rank=32)
    try:
        assert llm.load_adapter("grows", path, preload=False).tier == "known"
        weights = path / "adapter_model.safetensors"
        with weights.open("r+b") as f:
            f.truncate(weights.stat().st_size + (1 << 30))
        [result] = llm.generate([prompt_ids(0, 5)], SamplingParams(max_tokens=2), adapters="grows")
        assert result.finish_reason == "error" and "changed since revision" in result.error
        assert llm.engine.adapters.stats().host_bytes == 0
    finally:
        llm.close()


def _nan_lora_b(tmp: Path, llama) -> Path:
    def poison(tensors):
        key = next(k for k in sorted(tensors) if "v_proj.lora_B" in k)
        tensors[key][3, 1] = float("nan")

    return _edit_tensors(_copy(llama.adapters[GOOD], tmp / "nan-b"), poison)


def _inf_lora_a(tmp: Path, llama) -> Path:
    def poison(tensors):
        key = next(k for k in sorted(tensors) if "down_proj.lora_A" in k)
        tensors[key][0, 0] = float("-inf")

    return _edit_tensors(_copy(llama.adapters[GOOD], tmp / "inf-a"), poison)


def _config(name: str, **changes):
    def make(tmp: Path, llama) -> Path:
        return _edit_config(_copy(llama.adapters[GOOD], tmp / name), **changes)

    make.__name__ = f"_{name}"
    return make


def _rank_mismatch(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "r4-of-r8"), r=4)  # rank-8 tensors


def _rank_pattern_mismatch(tmp: Path, llama) -> Path:
    return _edit_config(_copy(llama.adapters[GOOD], tmp / "pattern-r16"), rank_pattern={r"mlp\.up_proj": 16})


def _replace_with(kind: str, file: str):
    def make(tmp: Path, llama) -> Path:
        path = _copy(llama.adapters[GOOD], tmp / f"{kind}-{file}")
        (path / file).unlink()
        if kind == "dir":
            (path / file).mkdir()
        else:
            os.mkfifo(path / file)
        return path

    make.__name__ = f"_{kind}_{file.split('_')[-1].split('.')[0]}"
    return make


def _config_nested_deep(tmp: Path, llama) -> Path:
    path = _copy(llama.adapters[GOOD], tmp / "deep")
    (path / "adapter_config.json").write_text('{"r": 8, "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    return path


NEW_CASES = [
    (_nan_lora_b, errors.AdapterCorrupt, None, "NaN or infinite"),
    (_inf_lora_a, errors.AdapterCorrupt, None, "NaN or infinite"),
    (_config("alpha-nan", lora_alpha=float("nan")), errors.AdapterCorrupt, "lora_alpha", "nan"),
    (_config("alpha-inf", lora_alpha=float("inf")), errors.AdapterCorrupt, "lora_alpha", "inf"),
    (_config("alpha-pattern-inf", alpha_pattern={"q_proj": float("-inf")}), errors.AdapterCorrupt, "alpha_pattern",
     "-inf"),
    (_config("rank-pattern-nan", rank_pattern={"q_proj": float("nan")}), errors.AdapterCorrupt, "rank_pattern",
     "nan"),
    (_config("r-true", r=True), errors.InvalidAdapter, "r", "is true; it must be a positive integer"),
    (_config("r-float", r=8.0), errors.InvalidAdapter, "r", "is 8.0"),
    (_config("alpha-bool", lora_alpha=True), errors.InvalidAdapter, "lora_alpha", "is true; it must be a number"),
    (_config("alpha-string", lora_alpha="16"), errors.InvalidAdapter, "lora_alpha", 'is "16"'),
    (_config("rank-pattern-bool", rank_pattern={"q_proj": True}), errors.InvalidAdapter, "rank_pattern",
     "a positive integer"),
    (_config("rslora-string", use_rslora="yes"), errors.InvalidAdapter, "use_rslora", "true or false"),
    (_rank_mismatch, errors.AdapterShapeMismatch, None, "has rank 8 tensors, but the config gives it rank 4"),
    (_rank_pattern_mismatch, errors.AdapterShapeMismatch, None, "up_proj in layer 0 has rank 8 tensors, but the "
     "config gives it rank 16"),
    (_config("backreference", alpha_pattern={r"(q)\1_proj": 4}), errors.InvalidAdapter, "alpha_pattern",
     r"(q)\\1_proj"),
    (_config("lookahead", rank_pattern={r"q(?=_proj)": 8}), errors.InvalidAdapter, "rank_pattern",
     "not a regular expression RE2 accepts"),
    (_config("many-keys", alpha_pattern={f"layers\\.{i}\\.x": 1 for i in range(patterns.MAX_PATTERN_KEYS + 1)}),
     errors.InvalidAdapter, "alpha_pattern", f"at most {patterns.MAX_PATTERN_KEYS}"),
    (_replace_with("dir", WEIGHTS), errors.InvalidAdapter, WEIGHTS, "is a directory"),
    (_replace_with("dir", "adapter_config.json"), errors.InvalidAdapter, "adapter_config.json", "is a directory"),
    (_replace_with("fifo", WEIGHTS), errors.InvalidAdapter, WEIGHTS, "is a FIFO"),
    (_replace_with("fifo", "adapter_config.json"), errors.InvalidAdapter, "adapter_config.json", "is a FIFO"),
    (_config_nested_deep, errors.AdapterCorrupt, "adapter_config.json", "nested too deep"),
]


@pytest.mark.parametrize("make_bad, error_type, field, text", NEW_CASES, ids=[c[0].__name__[1:] for c in NEW_CASES])
def test_hostile_adapter_fails_alone_at_once(llama_llm, llama, before, tmp_path, prompt_ids, make_bad, error_type,
                                            field, text):
    """Refused at load with its own error, within seconds (a FIFO's open would block forever), others unaffected."""
    path = make_bad(tmp_path, llama)
    outcome: list[BaseException] = []
    loader = threading.Thread(target=_load_into, args=(llama_llm, path, outcome), daemon=True)
    loader.start()
    loader.join(10)
    assert not loader.is_alive(), "the load blocked"
    [exc] = outcome
    assert isinstance(exc, error_type) and exc.adapter == "bad-one", repr(exc)
    if field is not None:
        assert exc.field == field
    assert text in str(exc)
    assert to_http(exc).status == 400 and to_http(exc).code == exc.type
    assert llama_llm.engine.adapters.get("bad-one") is None
    assert _probe(llama_llm, prompt_ids) == before


def _load_into(llm, path: Path, outcome: list) -> None:
    try:
        llm.load_adapter("bad-one", path)
    except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
        outcome.append(exc)


def test_non_finite_weights_fail_the_on_demand_load(llama, tmp_path, prompt_ids):
    """Registered without reading the weights (preload off), the first request's load refuses them."""
    llm = LLM(llama.model_dir, max_loras=1, max_lora_rank=32)
    try:
        assert llm.load_adapter("nan", _nan_lora_b(tmp_path, llama), preload=False).tier == "known"
        [result] = llm.generate([prompt_ids(0, 5)], SamplingParams(max_tokens=2), adapters="nan")
        assert result.finish_reason == "error" and "NaN or infinite" in result.error
    finally:
        llm.close()


@pytest.mark.parametrize("key", ["(.|.){0,24}!", "(a|a)*(a|a)*(a|a)*(a|a)*$x", "(.*.*)*=q_proj"])
def test_pathological_pattern_key_loads_in_linear_time(llama_llm, llama, tmp_path, key):
    """Keys that take a backtracking engine seconds to minutes per module name match nothing, at once."""
    path = _edit_config(_copy(llama.adapters[GOOD], tmp_path / "slow"), alpha_pattern={key: 64})
    started = time.monotonic()
    info = llama_llm.load_adapter("slow-pattern", path, preload=False)
    try:
        assert time.monotonic() - started < 1.0
        assert info.name == "slow-pattern"
    finally:
        llama_llm.unload_adapter("slow-pattern")


def test_pattern_keys_match_as_peft_matches_them(llama, tmp_path, prompt_ids):
    """rank_pattern and alpha_pattern keys (a regex, a dotted suffix, a full name for one layer) give the ranks
    and scales PEFT gives: the engine's logits equal transformers + PEFT's."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama.model_dir, dtype=torch.float32)
    num_layers = base.config.num_hidden_layers
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        rank_pattern={"(q|v)_proj": 12}, task_type="CAUSAL_LM",
                        alpha_pattern={r"self_attn\.v_proj": 6, **{f"model.layers.{i}.self_attn.o_proj": 2
                                                                    for i in range(num_layers)}})
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen) / 3)
    model.save_pretrained(tmp_path / "patterns")
    llm = LLM(llama.model_dir, max_loras=1, max_lora_rank=32)
    try:
        info = llm.load_adapter("patterns", tmp_path / "patterns")
        assert info.ranks == {"q_proj": 12, "k_proj": 4, "v_proj": 12, "o_proj": 4}
        prompt = prompt_ids(2, 9)
        [result] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, return_logits=True),
                                adapters="patterns")
    finally:
        llm.close()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama.model_dir, dtype=torch.float32),
                                          tmp_path / "patterns").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (result.prompt_logits - expected).abs().max() < 1e-4


def test_matching_many_slow_pattern_keys_rests_the_loading_thread(monkeypatch):
    """Compiling MAX_PATTERN_KEYS slow keys and looking up every module name is tens of ms of short GIL-holding
    calls on the loading thread: it rests (sleeps, GIL released) often, never working long stretches in a row
    that would make the engine thread wait for the GIL."""
    from kubelora.engine.adapters import patterns
    from kubelora.engine.adapters.peft_config import module_name

    rests: list[float] = []
    monkeypatch.setattr(patterns.time, "sleep", lambda seconds: rests.append(time.perf_counter()))
    started = time.perf_counter()
    keys = {f"(.|.){{0,24}}!{i}": 1.0 for i in range(patterns.MAX_PATTERN_KEYS)}
    compiled = patterns.compile_patterns("a", "alpha_pattern", keys, is_rank=False)
    for layer in range(2):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert compiled.lookup(module_name(layer, module), 8.0) == 8.0
    marks = [started, *rests, time.perf_counter()]
    assert len(rests) >= 5 and max(b - a for a, b in zip(marks, marks[1:])) < 0.02, len(rests)


def test_pattern_lookup_picks_the_first_matching_key_in_order():
    """PEFT's get_pattern_key: the first key (config order) matching the whole name or its end after a dot."""
    from peft.utils.other import get_pattern_key

    from kubelora.engine.adapters import patterns

    keys = {"layers.1.self_attn.q_proj": 1, "q_proj": 2, r"self_attn\.(q|k)_proj": 3, ".*": 4, "proj": 5}
    compiled = patterns.compile_patterns("a", "alpha_pattern", keys, is_rank=False)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.q_proj",
                 "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj"):
        assert compiled.lookup(name, 0) == keys[get_pattern_key(list(keys), name)], name
