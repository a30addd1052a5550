"""Which replicas may serve a request for `model`, in the order to try them. Pure: no I/O, no clocks.

One rule (docs/router.md, "Routing"): the replicas that may serve first, by tier, then among a tier the request's
affinity key (`affinity.py`), and the load bound over every candidate of the tiers above all:
- the base model: every ready replica; by the affinity key on the bounded-load ring (`hashring`), or least
  in-flight first without one (ties rotate with `tiebreak`);
- an adapter some ready replicas hold: those holding it on device, then those holding it in host memory, each
  tier walked by the affinity key (the model when the request has none); the first under the bound over all
  holders leads, so a busy device holder passes the request to the next, then to a host holder;
- an adapter of the pool no ready replica holds yet: its hashed home over all ready replicas (keyed by the
  model, never by the affinity key: one replica loads it), whose engine loads it on demand (the operator
  registers every pool adapter on every replica with preload false);
- anything else: `UnknownModel` (404). No placement yet, or one without replicas (a pool the operator has not
  observed yet, whose adapter list may lag too): `PlacementNotLoaded`; replicas but none ready:
  `NoReadyReplica` (both 503 with Retry-After).

The retry order after the first candidate is the rest of the same walk: the holders first, then the home walk
over the other ready replicas, so a retry of an adapter request still lands where the adapter can load.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from kubelora.router.hashring import bounded_walk, tiered_walk
from kubelora.router.placement import Placement, Replica


class Decision(enum.Enum):
    BASE = "base"  # the base model
    DEVICE = "device"  # a replica that holds the adapter in its device pool
    HOLDER = "holder"  # a replica that holds the adapter, in host memory (or not published as on device)
    HOME = "home"  # the adapter's hashed home; it loads the adapter on demand


@dataclass(frozen=True)
class Route:
    decision: Decision
    candidates: tuple[Replica, ...]  # [first choice, retry, ...]; never empty


class RoutingError(Exception):
    pass


class PlacementNotLoaded(RoutingError):
    pass


class NoReadyReplica(RoutingError):
    pass


class UnknownModel(RoutingError):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


def route(placement: Placement | None, model: str, in_flight: Mapping[str, int], load_factor: float,
          tiebreak: int = 0, affinity: str | None = None) -> Route:
    if placement is None or not placement.replicas:
        raise PlacementNotLoaded()
    ready = placement.ready_replicas()
    if model != placement.base_model and model not in placement.adapters:
        raise UnknownModel(model)
    if not ready:
        raise NoReadyReplica()
    if model == placement.base_model:
        order = (bounded_walk(affinity, list(ready), in_flight, load_factor) if affinity is not None
                 else least_loaded(list(ready), in_flight, tiebreak))
        return Route(Decision.BASE, tuple(ready[pod] for pod in order))
    device, host = placement.holder_tiers(model)
    home_walk = bounded_walk(model, list(ready), in_flight, load_factor)
    if not device and not host:
        return Route(Decision.HOME, tuple(ready[pod] for pod in home_walk))
    order = tiered_walk(affinity if affinity is not None else model, [device, host], in_flight, load_factor)
    rest = [pod for pod in home_walk if pod not in order]
    decision = Decision.DEVICE if order[0] in device else Decision.HOLDER
    return Route(decision, tuple(ready[pod] for pod in order + rest))


def least_loaded(pods: list[str], in_flight: Mapping[str, int], tiebreak: int) -> list[str]:
    """Pods by in-flight count; among equals the order rotates by `tiebreak`, so idle replicas share the work."""
    pods = sorted(pods)
    shift = tiebreak % len(pods)
    rotated = pods[shift:] + pods[:shift]
    return sorted(rotated, key=lambda pod: in_flight.get(pod, 0))  # stable: keeps the rotation among ties
