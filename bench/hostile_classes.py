"""The hostile-tenant benchmark's request classes: each a hostile request at the server's current limits and its
plain twin (the same token count, or the same adapter load, without what makes it hostile).

Limits are read from the server's modules when a class is built, so the requests follow them as they change.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

JSON = {"Content-Type": "application/json"}
SCHEMA_PROPERTIES = 32  # the slow-regex schema's properties (fewer if the spec limit is smaller)
# Patterns whose automata grow with their counted repetitions (each compiles in tens of ms alone).
SLOW_PATTERNS = ("(a|aa)*b{0,20}c{0,20}", "(a{0,20}b{0,20}){0,20}", "((a|b)*a(a|b){0,12})")
SLOW_PATTERN_KEY = "(.|.){{0,24}}!{i}"  # an alpha_pattern key that backtracking regex engines take seconds on


@dataclass(frozen=True)
class Probe:
    """One HTTP request as sent: a path on the serving port (or the admin port), its body and headers."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    is_admin: bool = False


@dataclass(frozen=True)
class HostileClass:
    name: str
    hostile: Probe
    plain: Probe  # the twin the victim's baseline runs beside
    cleanup: tuple[Probe, ...] = ()  # sent after each hostile and plain run (e.g. unload what they loaded)


@dataclass(frozen=True)
class Workload:
    """What the classes are built from: the base model's served name, one prompt's token ids and length."""

    model: str
    prompt: list[int]
    max_tokens: int
    vocab_size: int
    adapter_path: Path  # a plain PEFT adapter
    pathological_path: Path  # the same weights, its alpha_pattern at the key limit of slow keys
    variant: int = 0  # each repeat's requests differ by it where the server caches work (compiled grammars)

    def completion(self, **fields) -> dict:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 1.0,
                "seed": 0, "ignore_eos": True}
        return {**body, **fields}


def _post(body: dict, path: str = "/v1/completions", is_admin: bool = False) -> Probe:
    return Probe(path, json.dumps(body).encode(), is_admin=is_admin)


def _pair(name: str, plain: dict, **hostile) -> HostileClass:
    return HostileClass(name, _post({**plain, **hostile}), _post(plain))


def stop_strings(w: Workload) -> HostileClass:
    from kubelora.engine.server.protocol import MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS

    # Near misses for a KMP scan: each a run of one letter ending in a character the run never holds.
    stops = [chr(ord("a") + i % 26) * (MAX_STOP_CHARS - 1) + "\x01" for i in range(MAX_STOP_STRINGS)]
    return _pair(f"n={MAX_PROMPTS}, {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} chars",
                 w.completion(n=MAX_PROMPTS), stop=stops)


def bad_words(w: Workload) -> HostileClass:
    from kubelora.engine.server.protocol import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS

    words = [(f"q{i}z" * MAX_BAD_WORD_CHARS)[:MAX_BAD_WORD_CHARS] for i in range(MAX_BAD_WORDS)]
    return _pair(f"{MAX_BAD_WORDS} bad_words of {MAX_BAD_WORD_CHARS} chars", w.completion(), bad_words=words)


def token_id_lists(w: Workload) -> HostileClass:
    """allowed_token_ids in the upper half of the vocabulary, stop_token_ids in the lower half (never sampled,
    so the request keeps its token count), each repeated up to its limit."""
    from kubelora.engine.server.protocol import MAX_ALLOWED_TOKEN_IDS, MAX_STOP_TOKEN_IDS

    half = w.vocab_size // 2
    allowed = [half + i % (w.vocab_size - half) for i in range(MAX_ALLOWED_TOKEN_IDS)]
    stops = [1 + i % (half - 1) for i in range(MAX_STOP_TOKEN_IDS)]
    return _pair(f"{MAX_ALLOWED_TOKEN_IDS} allowed_token_ids + {MAX_STOP_TOKEN_IDS} stop_token_ids",
                 w.completion(), allowed_token_ids=allowed, stop_token_ids=stops)


def slow_regex_schema(w: Workload) -> HostileClass:
    from kubelora.engine.server.structured import MAX_SPEC_CHARS

    properties: dict[str, dict] = {}
    for i in range(SCHEMA_PROPERTIES):
        pattern = {"type": "string", "pattern": SLOW_PATTERNS[i % len(SLOW_PATTERNS)]}
        candidate = {**properties, f"p{i}v{w.variant}": pattern}
        if len(json.dumps(_schema(candidate), separators=(",", ":"))) > MAX_SPEC_CHARS:
            break
        properties = candidate
    response_format = {"type": "json_schema", "json_schema": {"name": "slow", "schema": _schema(properties)}}
    return _pair(f"json_schema of {len(properties)} slow-to-compile patterns", w.completion(),
                 response_format=response_format)


def _schema(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


def gzip_body(w: Workload) -> HostileClass:
    plain = _post(w.completion())
    hostile = replace(plain, body=gzip.compress(plain.body), headers={**JSON, "Content-Encoding": "gzip"})
    return HostileClass("gzip-encoded body", hostile, plain)


def empty_arrays(w: Workload) -> HostileClass:
    """The plain body with a field of empty arrays that fills it to the body size limit."""
    from kubelora.engine.server.app import MAX_BODY_BYTES

    plain = _post(w.completion())
    head, tail = plain.body[:-1] + b', "pad": [', b"[]]}"
    count = (MAX_BODY_BYTES - len(head) - len(tail)) // len(b"[],")
    body = head + b"[]," * count + tail
    return HostileClass(f"{len(body) / 2**20:.1f} MiB of empty arrays", replace(plain, body=body), plain)


def tiny_temperature(w: Workload) -> HostileClass:
    return _pair("temperature 1e-40", w.completion(), temperature=1e-40)


def n2_allowed(w: Workload) -> HostileClass:
    allowed = [w.vocab_size // 2 + i for i in range(3)]
    return _pair("n=2 with allowed_token_ids", w.completion(n=2), allowed_token_ids=allowed)


def alpha_pattern_load(w: Workload) -> HostileClass:
    from kubelora.engine.adapters.patterns import MAX_PATTERN_KEYS

    def load(path: Path) -> Probe:
        return _post({"lora_name": "hostile-load", "lora_path": str(path)}, "/v1/load_lora_adapter", True)

    unload = _post({"lora_name": "hostile-load"}, "/v1/unload_lora_adapter", True)
    return HostileClass(f"adapter load, alpha_pattern of {MAX_PATTERN_KEYS} slow keys", load(w.pathological_path),
                        load(w.adapter_path), (unload,))


def write_pathological_config(adapter: Path, out: Path) -> Path:
    """A copy of `adapter` whose alpha_pattern holds as many slow keys as a load takes (each matching no module)."""
    from kubelora.engine.adapters.patterns import MAX_PATTERN_KEYS

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["alpha_pattern"] = {SLOW_PATTERN_KEY.format(i=i): 1.0 for i in range(MAX_PATTERN_KEYS)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    return out


CLASSES: dict[str, Callable[[Workload], HostileClass]] = {
    "stop-strings": stop_strings, "bad-words": bad_words, "token-ids": token_id_lists,
    "slow-regex": slow_regex_schema, "gzip": gzip_body, "empty-arrays": empty_arrays,
    "tiny-temperature": tiny_temperature, "n2-allowed": n2_allowed, "alpha-pattern": alpha_pattern_load,
}
