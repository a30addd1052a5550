"""A grammar compile cannot hold other requests up: each runs under a deadline, past which its request fails
alone (400) and its thread is abandoned; abandoned and waiting compiles are bounded (503 with Retry-After)."""

from __future__ import annotations

import threading
import time

import pytest

from kubelora.contract.errors import InvalidRequest, Unavailable
from kubelora.contract.http_errors import to_http
from kubelora.engine.structured import StructuredKind, StructuredOutput
from kubelora.engine.structured.compile_pool import CompileLimits, CompilePool


def _regex(value: str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.REGEX, value, "guided_regex")


class FakeCompiler:
    """Compiles `slow*` specs only once released; the others at once. Counts compiles per spec."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []
        self.pool: CompilePool | None = None

    def __call__(self, spec: StructuredOutput) -> str:
        self.calls.append(spec.value)
        self.pool.arm(spec)
        if spec.value.startswith("slow"):
            self.release.wait(30)
        return f"grammar:{spec.value}"


@pytest.fixture
def pool():
    compiler = FakeCompiler()
    compiler.pool = CompilePool(compiler, CompileLimits(timeout_s=0.3, max_running=1, max_abandoned=2,
                                                        max_queued=2))
    yield compiler.pool, compiler
    compiler.release.set()
    compiler.pool.close()


def test_a_compile_past_its_deadline_fails_alone_and_frees_its_slot(pool):
    pool, compiler = pool
    slow = pool.submit(_regex("slow-a"))
    fast = pool.submit(_regex("fast"))  # queued behind the slow one (one running slot)
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as caught:
        slow.result(timeout=5)
    assert 0.25 < time.monotonic() - started < 2
    assert caught.value.code == "grammar_compile_timeout" and caught.value.param == "guided_regex"
    assert to_http(caught.value).status == 400
    assert fast.result(timeout=5).grammar == "grammar:fast"
    # The same spec again while its compile still runs: refused at once, not compiled twice.
    with pytest.raises(InvalidRequest, match="did not compile"):
        pool.submit(_regex("slow-a"))
    assert compiler.calls.count("slow-a") == 1


def test_abandoned_compiles_are_bounded_then_new_ones_are_503(pool):
    pool, compiler = pool
    for name in ("slow-a", "slow-b"):
        with pytest.raises(InvalidRequest):
            pool.submit(_regex(name)).result(timeout=5)
    with pytest.raises(Unavailable) as caught:
        pool.submit(_regex("fast"))
    error = to_http(caught.value)
    assert error.status == 503 and error.code == "grammar_compilers_busy" and error.headers["Retry-After"] == "1"
    compiler.release.set()  # the abandoned compiles end: room again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert pool.submit(_regex("fast")).result(timeout=5).grammar == "grammar:fast"
            return
        except Unavailable:
            time.sleep(0.02)
    raise AssertionError("no room after the abandoned compiles ended")


def test_requests_for_one_spec_share_its_compile(pool):
    pool, compiler = pool
    futures = [pool.submit(_regex("slow-shared")) for _ in range(5)]
    compiler.release.set()
    assert {f.result(timeout=5).grammar for f in futures} == {"grammar:slow-shared"}
    assert compiler.calls == ["slow-shared"]


def test_a_full_queue_is_503(pool):
    pool, _ = pool
    pool.submit(_regex("slow-running"))
    pool.submit(_regex("queued-1")), pool.submit(_regex("queued-2"))
    with pytest.raises(Unavailable, match="busy"):
        pool.submit(_regex("queued-3"))


def test_a_compile_that_waited_too_long_for_a_slot_is_503_untried(pool):
    pool, compiler = pool
    pool.limits = CompileLimits(timeout_s=30, max_wait_s=0.05, max_running=1)
    slow = pool.submit(_regex("slow-a"))
    waiting = pool.submit(_regex("waits"))
    time.sleep(0.2)
    compiler.release.set()
    assert slow.result(timeout=5).grammar == "grammar:slow-a"
    with pytest.raises(Unavailable):
        waiting.result(timeout=5)
    assert "waits" not in compiler.calls


@pytest.mark.parametrize("field", ["timeout_s", "max_wait_s", "max_running", "max_abandoned", "max_queued"])
def test_limits_are_validated(field):
    with pytest.raises(ValueError, match=field):
        CompileLimits(**{field: 0})


HOSTILE_PATTERN = "^(([a-z0-9]{1,20}){1,20}){1,20}$"  # compiles in seconds over the tiny model's 512 tokens


def test_a_slow_grammar_fails_its_request_and_others_are_served(live_server, monkeypatch):
    server = live_server()
    pool = server.serving.engine.grammars.pool
    monkeypatch.setattr(pool, "limits", CompileLimits(timeout_s=0.5))
    model = server.serving.model_name
    body = {"model": model, "prompt": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": {"type": "string", "pattern": HOSTILE_PATTERN}}}}
    started = time.monotonic()
    status, answer = server.post("/v1/completions", body)
    assert status == 400 and answer["error"]["code"] == "grammar_compile_timeout", answer
    assert answer["error"]["param"] == "response_format.json_schema.schema"
    assert time.monotonic() - started < 3
    victim = server.client().completions.create(model=model, prompt="x", max_tokens=3,
                                                extra_body={"guided_regex": "[ab]{3}"})
    assert len(victim.choices[0].text) == 3 and set(victim.choices[0].text) <= {"a", "b"}
    assert server.get("/health")[0] == 200
