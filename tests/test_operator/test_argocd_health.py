"""The Argo CD health check shipped in docs/operator.md, run with a Lua interpreter (lupa) against the statuses
the operator writes: Healthy when Ready, Progressing while reconciling or before the spec is seen, Degraded when
Stalled. The script is read from the page, so page and test cannot drift."""
from __future__ import annotations

import re
from pathlib import Path

import lupa
import pytest
import yaml

from kubelora.operator.status import Failure, ReplicaState, ReplicaStatus, build_adapter_status, build_pool_status

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


@pytest.fixture(scope="module")
def health():
    block = re.search(r"```yaml\n(data:\n  resource\.customizations\.health\..*?)```", DOC.read_text(), re.S)
    data = yaml.safe_load(block.group(1))["data"]
    scripts = {key.removeprefix("resource.customizations.health."): value for key, value in data.items()}
    assert set(scripts) == {"kubelora.io_LoRAAdapter", "kubelora.io_LoRAPool"}

    def run(kind: str, body: dict) -> tuple[str, str]:
        lua = lupa.LuaRuntime(unpack_returned_tuples=True)
        check = lua.eval(f"function(obj)\n{scripts['kubelora.io_' + kind]}\nend")
        result = check(_to_lua(lua, body))
        return result["status"], result["message"]

    return run


def _to_lua(lua, value):
    """JSON-like Python values as Lua tables (lists 1-based, as Argo CD hands objects to its scripts)."""
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def _adapter(status: dict, generation: int = 3) -> dict:
    return {"metadata": {"name": "a", "generation": generation}, "status": status}


def _replicas(*states):
    return [ReplicaStatus(f"p{i}", s) for i, s in enumerate(states)]


LOADED, LOADING = ReplicaState.LOADED, ReplicaState.LOADING


def test_adapter_health_follows_the_conditions(health):
    def status(**kwargs):
        return build_adapter_status(generation=3, revision="r", **kwargs)

    assert health("LoRAAdapter", _adapter(status(wanted=1, replicas=_replicas(LOADED))))[0] == "Healthy"
    assert health("LoRAAdapter", _adapter(status(wanted=2, replicas=_replicas(LOADED, LOADING))))[0] == "Progressing"
    failed = health("LoRAAdapter", _adapter(status(wanted=0, replicas=[], failure=Failure("AdapterCorrupt", "bad"))))
    assert failed == ("Degraded", "AdapterCorrupt: bad")
    assert health("LoRAAdapter", _adapter(status(wanted=1, replicas=[])))[0] == "Degraded"  # no room
    assert health("LoRAAdapter", _adapter(status(wanted=0, replicas=[],
                                                 pending=Failure("NoReadyReplicas", "none"))))[0] == "Progressing"
    stale = _adapter(status(wanted=1, replicas=_replicas(LOADED)), generation=4)
    assert health("LoRAAdapter", stale)[0] == "Progressing"
    assert health("LoRAAdapter", {"metadata": {"name": "a", "generation": 1}}) == ("Progressing",
                                                                                   "waiting for the operator")


def test_pool_health_follows_the_conditions(health):
    common = {"generation": 3, "num_pods": 1, "selector": "s", "num_adapters": 0, "placement_revision": 0}
    ready = build_pool_status(spec_replicas=1, pods=[{"name": "e0", "ready": True}], **common)
    assert health("LoRAPool", _adapter(ready))[0] == "Healthy"
    scaling = build_pool_status(spec_replicas=2, pods=[{"name": "e0", "ready": True}], **common)
    assert health("LoRAPool", _adapter(scaling))[0] == "Progressing"
    invalid = build_pool_status(spec_replicas=1, pods=[], invalid=Failure("InvalidSpec", "bad"), **common)
    assert health("LoRAPool", _adapter(invalid)) == ("Degraded", "InvalidSpec: bad")
    stale = build_pool_status(spec_replicas=1, pods=[{"name": "e0", "ready": True}],
                              degraded=Failure("RouterPlacementStale", "router r0 routes on revision 6"), **common)
    assert health("LoRAPool", _adapter(stale)) == ("Degraded", "RouterPlacementStale: router r0 routes on revision 6")
