"""Leader election (operator/leader.py) over the operator's own client (operator/kube.py), against a small Lease
API on loopback that keeps resourceVersions as the API server does (a stale replace is a 409 Conflict).
Timings: lease 3 s, renew deadline 2 s, retry 1 s."""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import json
import threading
import time
import urllib.request

import aiohttp
import kopf
import pytest

from kubelora.operator import cli, handlers, settings
from kubelora.operator.kube import Kube, KubeConnection
from kubelora.operator.leader import LeaderElector
from kubelora.operator.metrics import METRICS
from kubelora.operator.settings import ElectionSettings

NS, LEASE = "ops", "kubelora-operator"
PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"


class LeaseStore:
    def __init__(self) -> None:
        self.lease: dict | None = None
        self.version = 0
        self.is_failing = False  # every write answers 500 (an API server the leader cannot reach)
        self.is_dropping = False  # every request's connection is closed unanswered (an API server restarting)
        self.guard = threading.Lock()

    def holder(self) -> str | None:
        return ((self.lease or {}).get("spec") or {}).get("holderIdentity")

    def put(self, lease: dict) -> dict:
        self.version += 1
        lease["metadata"] = {**lease.get("metadata", {}), "name": LEASE, "namespace": NS,
                             "resourceVersion": str(self.version)}
        self.lease = lease
        return lease


def serve(store: LeaseStore):
    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def status(self, code: int, reason: str) -> None:
            self.reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                              "reason": reason, "message": reason})

        def body(self) -> dict:
            return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

        def do_GET(self) -> None:  # noqa: N802
            if store.is_dropping:
                self.close_connection = True
                return
            with store.guard:
                if self.path != f"{PATH}/{LEASE}" or store.lease is None:
                    return self.status(404, "NotFound")
                self.reply(200, store.lease)

        def do_POST(self) -> None:  # noqa: N802
            lease = self.body()
            with store.guard:
                if store.is_failing:
                    return self.status(500, "InternalError")
                if store.lease is not None:
                    return self.status(409, "AlreadyExists")
                self.reply(201, store.put(lease))

        def do_PUT(self) -> None:  # noqa: N802
            lease = self.body()
            with store.guard:
                if store.is_failing:
                    return self.status(500, "InternalError")
                if store.lease is None:
                    return self.status(404, "NotFound")
                if lease["metadata"].get("resourceVersion") != store.lease["metadata"]["resourceVersion"]:
                    return self.status(409, "Conflict")
                self.reply(200, store.put(lease))

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
async def api():
    """The store, and a factory of electors on it (each with the request timeout cli.operate gives it)."""
    store = LeaseStore()
    server = serve(store)
    connection = KubeConnection(f"http://127.0.0.1:{server.server_address[1]}", False, {})
    async with aiohttp.ClientSession() as session:
        yield store, connection, lambda identity: LeaderElector(election(identity), Kube(connection, session, 1.0))
    server.shutdown()
    server.server_close()


def election(identity: str) -> ElectionSettings:
    return ElectionSettings(LEASE, NS, identity, lease_duration_s=3, renew_deadline_s=2.0, retry_period_s=1.0)


async def wait_until(check, timeout_s: float) -> float:
    """Seconds until `check()` is true; fails after `timeout_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_one_leads_the_other_stands_by_and_release_hands_over(api):
    store, _, elector = api
    a, b = elector("a"), elector("b")
    a.start()
    await wait_until(a.leading.is_set, 3)
    b.start()
    await asyncio.sleep(5)  # longer than the lease: a renews it, b never takes it
    assert store.holder() == "a" and not b.leading.is_set() and not a.lost.is_set()
    assert await a.release()
    took_s = await wait_until(b.leading.is_set, 3)
    assert took_s < 2.5 and store.holder() == "b"  # at b's next retry, not after the lease runs out
    assert not await a.release()  # not ours any more: nothing is written
    assert store.holder() == "b"
    await b.release()


async def test_a_dead_leaders_lease_is_taken_after_it_expires(api):
    store, _, elector = api
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    store.put({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "spec": {"holderIdentity": "dead", "leaseDurationSeconds": 3, "acquireTime": now, "renewTime": now,
                        "leaseTransitions": 4}})
    b = elector("b")
    b.start()
    took_s = await wait_until(b.leading.is_set, 8)
    assert 3 <= took_s <= 3 + 2 * 1.0 + 0.5  # the lease, then at most two retry periods
    assert store.holder() == "b" and store.lease["spec"]["leaseTransitions"] == 5
    await b.release()
    assert store.holder() is None


async def test_a_standby_survives_an_unreachable_api_server(api):
    store, _, elector = api
    store.is_dropping = True
    b = elector("b")
    b.start()
    await asyncio.sleep(3)
    store.is_dropping = False
    await wait_until(b.leading.is_set, 3)
    assert store.holder() == "b"
    await b.release()


async def test_a_leader_that_cannot_renew_steps_down_within_the_renew_deadline(api):
    store, _, elector = api
    a = elector("a")
    a.start()
    await wait_until(a.leading.is_set, 3)
    renewals = store.version
    await asyncio.sleep(2.5)
    assert store.version >= renewals + 2 and store.holder() == "a"  # renewed every retry period
    store.is_failing = True
    failed_at = time.monotonic()
    await wait_until(a.lost.is_set, 5)
    # the standby's earliest takeover is a lease (3 s) after the last renewal: the leader stopped before it
    assert time.monotonic() - failed_at < 3.0


async def test_operate_runs_kopf_only_while_leading_and_releases_on_exit(api, monkeypatch):
    store, connection, _ = api
    monkeypatch.setattr(cli, "load_connection", lambda: connection)
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    store.put({"spec": {"holderIdentity": "other", "leaseDurationSeconds": 3, "acquireTime": now, "renewTime": now}})
    runs, leader_gauge = [], []

    async def operator(stop_flag):
        runs.append(store.holder())
        leader_gauge.append(_leader_gauge())
        store.is_failing = True  # the API becomes unreachable for this replica: it must stop and exit 1
        await stop_flag.wait()

    port = _free_port()
    task = asyncio.create_task(cli.operate(operator, election("b"), port))
    await asyncio.sleep(1.5)
    health = await asyncio.to_thread(_get_json, f"http://127.0.0.1:{port}/healthz")
    assert health == {"leading": False} and runs == []  # a standby: probed healthy, kopf not started
    assert _leader_gauge() == 0  # and its metrics say it stands by
    assert await asyncio.wait_for(task, 12) == 1
    assert runs == ["b"] and leader_gauge == [1]
    assert _leader_gauge() == 0  # it stopped leading
    store.is_failing = False


async def test_the_lease_is_released_by_kopfs_cleanup_not_after_kopf_returns(api, monkeypatch):
    """kopf calls the cleanup handler once its daemons and watchers stopped, then may wait up to 5 s more for
    leftover tasks: the standby must get the Lease at the cleanup."""
    store, connection, _ = api
    monkeypatch.setattr(cli, "load_connection", lambda: connection)
    memo = kopf.Memo()
    holders = []

    async def operator(stop_flag):
        holders.append(store.holder())
        await handlers.on_cleanup(memo=memo)  # what kopf runs on SIGTERM once its handlers stopped
        holders.append(store.holder())
        await asyncio.sleep(7)  # kopf's remaining exit; longer than the renew deadline (2 s here)

    started = time.monotonic()
    assert await asyncio.wait_for(cli.operate(operator, election("a"), None, memo), 15) == 0  # not "lost"
    assert holders == ["a", None] and time.monotonic() - started > 7


def _leader_gauge() -> float:
    return METRICS.registry.get_sample_value("kubelora_operator_leader")


async def test_operate_without_election_runs_kopf_directly():
    runs = []

    async def operator():
        runs.append(_leader_gauge())

    assert await cli.operate(operator, None, None) == 0 and runs == [1]


def _election_from(argv: list[str]) -> ElectionSettings | None:
    return settings.resolve_run(cli.build_parser().parse_args(argv)).election


def test_election_settings_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("POD_NAME", "op-7d9f-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "kubelora-system")
    monkeypatch.setenv("KUBELORA_OPERATOR_LEADER_ELECT", "true")
    election = _election_from([])
    assert election.namespace == "kubelora-system" and election.lease_name == "kubelora-operator"
    assert election.identity.startswith("op-7d9f-abcde_") and len(election.identity) == len("op-7d9f-abcde_") + 8
    assert (election.lease_duration_s, election.renew_deadline_s, election.retry_period_s) == (10, 6.0, 1.0)
    assert _election_from(["--leader-elect-lease", "x", "--leader-elect-identity", "me"]).identity == "me"
    monkeypatch.setenv("KUBELORA_OPERATOR_LEADER_ELECT_RETRY_S", "2")
    assert _election_from(["--leader-elect-renew-seconds", "3"]).retry_period_s == 2
    assert _election_from(["--no-leader-elect"]) is None  # the flag wins over the variable
    monkeypatch.delenv("KUBELORA_OPERATOR_LEADER_ELECT")
    assert _election_from([]) is None


def test_election_needs_a_namespace_and_sane_timings(monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(settings, "SERVICE_ACCOUNT_NAMESPACE", "/nonexistent")
    monkeypatch.setattr(cli, "run", lambda *args: pytest.fail("must not run"))
    assert cli.main(["--leader-elect"]) == 2
    assert cli.main(["--leader-elect", "--leader-elect-namespace", "x", "--leader-elect-renew-seconds", "20"]) == 2
    with pytest.raises(ValueError, match="renew_deadline_s"):
        ElectionSettings(LEASE, NS, "a", lease_duration_s=10, renew_deadline_s=1.0, retry_period_s=1.0)
    with pytest.raises(ValueError, match="lease_duration_s"):
        ElectionSettings(LEASE, NS, "a", lease_duration_s=6, renew_deadline_s=6.0)
    with pytest.raises(ValueError, match="retry_period_s"):
        ElectionSettings(LEASE, NS, "a", retry_period_s=0)
    with pytest.raises(ValueError, match="identity"):
        ElectionSettings(LEASE, NS, "")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)
