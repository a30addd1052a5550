"""The local kubelet under API-server faults, without a cluster: a refused or cut status write never ends a pod's
worker (its containers keep running and the next tick writes again), and a pod whose sandbox is set up again keeps
the IP the API records (the API refuses to change a pod's IPs)."""
from __future__ import annotations

import http.client
from types import SimpleNamespace

import pytest

from localkubelet import apiclient
from localkubelet.network import IpAllocator
from localkubelet.podworker import PodWorker, WorkerDeps


class FlakyApi:
    """Refuses connections while `is_down`, then records the status patches it gets."""

    def __init__(self) -> None:
        self.is_down, self.patches = True, []

    def patch(self, path, body, content_type=None):
        if self.is_down:
            raise ConnectionRefusedError(111, "Connection refused")
        self.patches.append(body["status"])
        return {"metadata": {"resourceVersion": str(len(self.patches))}}


def worker(tmp_path, api) -> PodWorker:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "0123-4567-89ab"},
           "spec": {"containers": [{"name": "c", "image": "kubelora-engine:0"}]}}
    cfg = SimpleNamespace(pods_dir=tmp_path, restart_backoff_base_s=1.0, restart_backoff_max_s=30.0,
                          node_ip="10.244.0.1")
    return PodWorker(pod, WorkerDeps(cfg, api, IpAllocator("10.244.0.0/24", "10.244.0.1"), None))


def test_a_refused_status_write_is_retried_at_the_next_tick_not_fatal(tmp_path):
    api = FlakyApi()
    pod_worker = worker(tmp_path, api)
    pod_worker._push_status()  # the API server is down: logged, nothing raised
    pod_worker._push_status()
    assert api.patches == []
    api.is_down = False
    pod_worker._push_status()  # back: the same status is written now
    assert len(api.patches) == 1 and api.patches[0]["phase"] == "Pending"
    pod_worker._push_status()
    assert len(api.patches) == 1  # unchanged: not written again


def test_a_cut_answer_is_an_oserror_callers_survive(monkeypatch):
    class CutConnection:
        def __init__(self, *args, **kwargs):
            pass

        def request(self, *args, **kwargs):
            pass

        def getresponse(self):
            raise http.client.BadStatusLine("")

        def close(self):
            pass

    monkeypatch.setattr(apiclient.http.client, "HTTPSConnection", CutConnection)
    client = apiclient.ApiClient("https://10.244.0.1:16443", SimpleNamespace(client_context=lambda: None))
    with pytest.raises(OSError, match="BadStatusLine"):
        client.get("/api/v1/pods")


def test_a_pod_set_up_again_keeps_the_ip_the_api_records():
    ips = IpAllocator("10.244.0.0/24", "10.244.0.1")
    first = ips.allocate()
    other = ips.allocate()
    ips.release(first)  # its worker ended (a crash): the sandbox is gone, the pod is not
    assert ips.allocate(wanted=first) == first
    assert ips.allocate(wanted=other) not in (first, other)  # taken: the next free one instead
    assert ips.allocate(wanted="192.168.0.9") not in (first, other)  # not of this pool
