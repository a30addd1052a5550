"""The event loop never does unbounded work: a huge prompt is refused by a character bound before
any tokenizing while `/health` keeps answering within 100 ms, and memory is not retained afterwards.

The live server runs in a thread of this process; the clients run in other threads, with their bodies built
before the clock starts.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from ..live_http import HealthProbe, post_json

BIG_BYTES = 15 << 20  # under the 16 MiB body limit
MAX_HEALTH_S = 0.1


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def assert_health_holds(url: str, action: Callable[[], None], attempts: int = 2) -> None:
    """`action` with /health polled beside it; the slowest answer under MAX_HEALTH_S in one of `attempts` runs.

    A stall the server causes (work on its event loop) comes back every run. On the 2 shared cores of CI a whole
    suite has once descheduled the server's thread past the bound for one probe (0.11 and 0.17 s, the other
    probes under 0.06 s): a second run tells such a hiccup from the server's own stall."""
    for _ in range(attempts):
        with HealthProbe(url) as probe:
            action()
        if probe.worst_s < MAX_HEALTH_S:
            return
    raise AssertionError(f"/health slower than {MAX_HEALTH_S} s in {attempts} runs; the last run's slowest: "
                         f"{sorted(probe.latencies)[-5:]}")


def _three_at_once(url: str, body: bytes) -> list[tuple[int, dict, float]]:
    """`body` posted to `url` three times at once, from three threads."""
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda _: post_json(url, body), range(3)))


def _big_bodies(model: str) -> dict[str, bytes]:
    text = "hello world " * (BIG_BYTES // 12)
    return {
        "completion": json.dumps({"model": model, "prompt": text, "max_tokens": 4}).encode(),
        "completion-batch": json.dumps({"model": model, "prompt": [text[: BIG_BYTES // 64]] * 63,
                                        "max_tokens": 4}).encode(),
        "completion-token-ids": json.dumps({"model": model, "prompt": [1] * (BIG_BYTES // 3)}).encode(),
        "chat": json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode(),
        "chat-many": json.dumps({"model": model, "messages": [{"role": "user", "content": text[:20_000]}] * 750}
                                ).encode(),
    }


@pytest.mark.parametrize("kind", ["completion", "completion-batch", "chat", "chat-many"])
def test_huge_prompt_refused_while_health_answers(live_server, kind):
    server = live_server()
    base = server.serving.model_name
    body = _big_bodies(base)[kind]
    assert len(body) > 14 << 20
    path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"

    def refused_three_at_once() -> None:
        for status, answer, seconds in _three_at_once(server.url + path, body):
            # Text is refused by its length in characters, before tokenizing.
            assert status == 413 and answer["error"]["type"] == "prompt_too_long", answer
            assert "characters" in answer["error"]["message"] and seconds < 5

    assert_health_holds(server.url, refused_three_at_once)
    ok = server.client().completions.create(model=base, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def _shape_bodies(model: str) -> dict[str, bytes]:
    """~15 MiB bodies whose cost is their shape: millions of arrays, objects or strings that no hook of the C
    decoder sees (empty arrays held the GIL 1.6 s there)."""
    head, tail = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1})[:-1].encode() + b', "x": [', b"[]]}"
    return {name: head + item * (BIG_BYTES // len(item)) + tail
            for name, item in (("empty arrays", b"[],"), ("empty objects", b"{},"), ("empty strings", b'"",'))}


@pytest.mark.parametrize("kind", ["empty arrays", "empty objects", "empty strings"])
def test_bodies_of_millions_of_values_are_refused_while_health_answers(live_server, kind):
    server = live_server()
    body = _shape_bodies(server.serving.model_name)[kind]

    def refused_three_at_once() -> None:
        for status, answer, seconds in _three_at_once(server.url + "/v1/completions", body):
            assert status == 400 and answer["error"]["code"] == "out_of_range", answer
            assert seconds < 5

    assert_health_holds(server.url, refused_three_at_once)


def test_millions_of_token_ids_are_refused_and_the_server_keeps_serving(live_server):
    """Token ids are counted once decoded, which takes seconds for five million of them, on one worker thread
    in turn. /health is not held to 100 ms here: in the whole suite on 2 cores it answered in up to 0.3 s
    while three such bodies decoded (docs/server.md, known gaps)."""
    server = live_server()
    base = server.serving.model_name
    body = _big_bodies(base)["completion-token-ids"]
    for status, answer, seconds in _three_at_once(server.url + "/v1/completions", body):
        assert status == 413 and answer["error"]["type"] == "prompt_too_long", answer
        assert "5242880 tokens" in answer["error"]["message"] and seconds < 30
    ok = server.client().completions.create(model=base, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_huge_prompts_leave_no_memory_behind(live_server):
    server = live_server()
    bodies = _big_bodies(server.serving.model_name)
    post_json(server.url + "/v1/completions", bodies["completion"])  # first-use allocations out of the way
    gc.collect()
    before = _rss_bytes()
    for _ in range(3):
        for kind, body in bodies.items():
            path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
            assert post_json(server.url + path, body)[0] == 413
    gc.collect()
    assert _rss_bytes() - before < 200 << 20, f"{(_rss_bytes() - before) >> 20} MiB more resident"


def test_prompt_under_the_bound_is_tokenized_off_the_loop(live_server):
    """A prompt just under the character bound is tokenized on the worker thread: /health stays fast, and
    the answer is the token-count 413."""
    server = live_server()
    max_chars = server.serving.prompts.max_chars
    body = json.dumps({"model": server.serving.model_name, "prompt": "x" * max_chars}).encode()

    def one() -> None:
        status, answer, _ = post_json(server.url + "/v1/completions", body)
        assert status == 413 and "tokens" in answer["error"]["message"], answer

    assert_health_holds(server.url, one)


def test_the_choices_of_one_request_share_their_stop_string_tables():
    """n choices are n engine requests, each with its own seed; their KMP tables for the request's stop strings
    (1024 characters each at the limit) are built once on the engine thread, not once per choice."""
    from kubelora.engine.sampling_params import SamplingParams
    from kubelora.engine.server.choices import _nth_params

    params = SamplingParams(seed=0, stop=tuple(chr(97 + i) * 1023 + "\x01" for i in range(16)))
    tables = [_nth_params(params, j).stop_prefix_tables for j in range(64)]
    assert len({p.seed for p in (_nth_params(params, j) for j in range(64))}) == 64
    assert all(t is first for choice in tables for t, first in zip(choice, tables[0]))


def test_containers_are_counted_from_the_bytes_outside_strings():
    """Brackets inside strings do not count; an escaped quote leaves the count to the parse."""
    from kubelora.engine.server.json_body import count_containers

    bodies = [{"a": [[], {}], "b": "[[{{"}, {"x": [[1], {"y": "{["}], "z": []}, {"s": "]]", "t": [{}] * 5}]
    for body in bodies:
        raw = json.dumps(body).encode()
        containers = raw.count(b"[") + raw.count(b"{") - sum(s.count("[") + s.count("{") for s in _strings(body))
        assert count_containers(raw) == containers, body
    assert count_containers(json.dumps({"a\"": [[]]}).encode()) is None


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [k for k in value] + [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_a_body_of_empty_arrays_is_refused_before_any_parse(monkeypatch):
    from kubelora.engine.server import json_body

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(json_body, "_BoundedScan", no_parse)
    monkeypatch.setattr(json_body.json, "loads", no_parse)
    body = _shape_bodies("m")["empty arrays"]
    with pytest.raises(json_body.InvalidRequest, match="more than 65536 arrays and objects"):
        json_body.decode_json_object(body, is_large=True)
