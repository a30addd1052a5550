"""The operator benchmark: its fake engine answers as the operator's engine client expects, the call counting, the
settings' bounds, and the --small preset end to end against a real kube-apiserver (its own etcd and API server,
e2e/localcluster's binaries: `make test` builds them) with the report's numbers checked for sanity, never its
timings against the targets."""

from __future__ import annotations

import aiohttp
import pytest

from kubelora.bench.operator import SMALL, OperatorBenchConfig, main, run
from kubelora.bench.operator_engines import BYTES_PER_RANK, FakeFleetConfig, build_fake_pod, resolve_engine_config
from kubelora.bench.operator_measure import count_calls
from kubelora.bench.operator_report import PHASE_COLUMNS, TARGET_COLUMNS, render_markdown
from kubelora.operator.builders import build_engine_args
from kubelora.operator.engine_client import EngineClient, EngineError
from kubelora.operator.plan import DesiredAdapter
from kubelora.operator.specs import PoolSpec

pytestmark = pytest.mark.timeout(300)
TOKEN = "t" * 43


def fake_config(root) -> FakeFleetConfig:
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"path": "/models/base"}, "adapterRoots": [str(root)],
                     "engine": {"maxLoras": 8, "maxLoraRank": 16, "maxCpuLoras": 16}}}
    args = build_engine_args(PoolSpec.from_body(body))[2:]
    return FakeFleetConfig(("127.0.0.1",), tuple(args), {"KUBELORA_ADMIN_TOKEN": TOKEN}, rank=8)


async def test_the_fake_engine_answers_the_operators_client_as_an_engine_does(aiohttp_server, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pod = build_fake_pod(resolve_engine_config(fake_config(tmp_path)), 8)
    counts = pod.counts
    server = await aiohttp_server(pod.admin)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineError) as refused:
            await EngineClient(session, None, 5).list_models(url)
        assert refused.value.status == 401
        client = EngineClient(session, TOKEN, 5)
        tag = await client.wait_for_change(url, None, 1)
        a = DesiredAdapter("a", str(tmp_path / "a"), None, "r1")
        loaded = await client.load(url, a, is_preload=False, is_inplace=False)
        assert loaded.card["residency"] == "known" and not loaded.was_loaded
        assert (await client.load(url, a, is_preload=True, is_inplace=False)).card["residency"] == "host"
        await client.load(url, DesiredAdapter("b", str(tmp_path / "b"), None, "r1"), is_preload=True,
                          is_inplace=False)
        with pytest.raises(EngineError) as exists:  # another source under the same name needs load_inplace
            await client.load(url, DesiredAdapter("a", str(tmp_path / "b"), None, "r2"), is_preload=True,
                              is_inplace=False)
        assert exists.value.status == 409 and exists.value.code == "adapter_exists"
        with pytest.raises(EngineError) as outside:  # local sources are confined to the adapter roots
            await client.load(url, DesiredAdapter("c", "/etc", None, "r1"), is_preload=True, is_inplace=False)
        assert outside.value.is_permanent
        listed = await client.list_models(url)
        assert listed.budget == 8 * 16 * BYTES_PER_RANK and listed.api_keys_fingerprint
        assert {name: (card.residency, card.num_bytes, card.rank, card.tokens_served)
                for name, card in listed.adapters.items()} == {"a": ("host", 8 * BYTES_PER_RANK, 8, 0),
                                                               "b": ("host", 8 * BYTES_PER_RANK, 8, 0)}
        assert listed.adapters["a"].has_source(str(tmp_path / "a"))
        assert await client.wait_for_change(url, tag, 1) != tag  # the long poll answers a changed set
        assert await client.unload(url, "a") and not await client.unload(url, "a")
    # lists: the refused one, the long poll's first (no tag yet: it answers at once), list_models
    assert counts.requests["list"] == 3 and counts.requests["watch"] == 1
    assert counts.requests["load"] == 5 and counts.requests["unload"] == 2
    # every call counts, refused or not
    assert counts.preloads == {"a": 2, "b": 1, "c": 1} and counts.registrations == {"a": 1}
    assert counts.unloads == {"a": 2}


def test_calls_are_counted_per_pod_and_adapter():
    def pod(lists, preloads=None, registrations=None, unloads=None):
        return {"requests": {"list": lists, "watch": 1}, "preloads": preloads or {},
                "registrations": registrations or {}, "unloads": unloads or {}}

    before = {"ip0": pod(3, {"old": 1}), "ip1": pod(3)}
    after = {"ip0": pod(5, {"old": 1, "x": 1}, {"y": 1}), "ip1": pod(5, {"y": 1}, {"x": 2}, {"old": 1})}
    calls = count_calls(before, after, {"ip0": "p0", "ip1": "p1"}, {"x", "y", "z"})
    assert calls.lists == {"p0": 2, "p1": 2} and calls.watches == 0
    assert (calls.preloads, calls.registrations, calls.unloads, calls.engine_calls) == (2, 3, 1, 6)
    # x: one call on p0, two on p1; y: one on each; z: none anywhere; old: an unload outside the subject
    assert (calls.pairs_once, calls.pairs_repeated, calls.pairs_missing, calls.other_calls) == (3, 1, 2, 1)


def test_settings_are_bounded_and_refused_at_the_entry_point(capsys):
    with pytest.raises(ValueError, match="copies"):
        OperatorBenchConfig(num_replicas=2, copies=3)
    with pytest.raises(ValueError, match="max_cpu_loras"):  # more placed per pod than a pod holds
        OperatorBenchConfig(num_replicas=1, num_adapters=300, max_cpu_loras=256)
    assert main(["--replicas", "0"]) == 2
    assert "num_replicas" in capsys.readouterr().out


def test_small_preset_against_a_real_api_server(tmp_path):
    config = SMALL
    report = run(config, tmp_path)
    phases = {p.name: p for p in report.phases}
    assert list(phases) == ["fill", "steady", "singles", "bulk-apply", "bulk-delete"]
    pods, copies = config.num_replicas, config.copies
    fill = phases["fill"]
    assert len(fill.times_s) == config.num_adapters and all(t > 0 for t in fill.times_s)  # every adapter Ready
    assert fill.calls.preloads == config.num_adapters * copies
    assert fill.calls.registrations == config.num_adapters * (pods - copies)
    assert fill.calls.pairs_missing == 0 and fill.calls.unloads == 0
    steady = phases["steady"]
    assert steady.passes >= 1 and steady.calls.engine_calls == 0 and steady.whole_passes == steady.passes
    for result in (steady, phases["singles"]):  # one GET /v1/models per pod and whole pass, none in the others
        assert set(result.calls.lists.values()) == {result.whole_passes}
    singles = phases["singles"]
    assert singles.passes > singles.whole_passes  # each single came in a pass for changed adapters
    assert len(singles.times_s) == config.num_singles and all(0 < t < 10 for t in singles.times_s)
    assert singles.calls.pairs_once == config.num_singles * pods and singles.calls.other_calls == 0
    for name in ("bulk-apply", "bulk-delete"):  # one engine call per adapter and pod, nothing else moved
        result = phases[name]
        assert len(result.times_s) == config.num_bulk
        assert result.calls.pairs_once == config.num_bulk * pods == result.calls.engine_calls
        assert result.calls.other_calls == 0 and result.call_errors == 0
        assert result.operator_calls == result.calls.engine_calls  # the operator's metrics agree with the fakes
    assert phases["bulk-apply"].calls.preloads == config.num_bulk * copies
    assert phases["bulk-delete"].calls.unloads == config.num_bulk * pods
    assert all(p.cpu_s["operator"] > 0 and p.operator_memory.rss_bytes > 0 for p in report.phases)
    assert report.operator_peak_rss_bytes >= max(p.operator_memory.rss_bytes for p in report.phases)
    text = render_markdown(report)
    tables = [line for line in text.splitlines() if line.startswith("| ")]
    assert "| " + " | ".join(TARGET_COLUMNS) + " |" in tables and "| " + " | ".join(PHASE_COLUMNS) + " |" in tables
    assert "1 real `kubelora router` process" in text and "- kopf: " in text
