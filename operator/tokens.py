"""Which admin token each engine pod answers to. Pure: pods and tokens in, tokens out.

An engine reads its admin token once, at start, and each engine pod carries the digest of the token it was made
with (annotation kubelora.io/admin-token-digest, from the Deployment's pod template: `builders.admin_token_digest`).
After a rotation (a new value in the Secret, or a deleted generated Secret recreated) the pods started with the
old token keep serving and answer 401 to the new one until the rollout replaces them; calling them with the new
token would make them unobservable and drop them from the placement while they still serve. So the operator
keeps every token some pod of the pool still runs with, and calls each pod with its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kubelora.operator import names
from kubelora.operator.builders import admin_token_digest


def pod_token_digest(pod: dict) -> str | None:
    """The digest of the admin token `pod` was started with (None: its template recorded none)."""
    return (pod["metadata"].get("annotations") or {}).get(names.ANNOTATION_ADMIN_TOKEN)


def remember_tokens(known: Mapping[str, str], current: str | None, pods: Iterable[dict]) -> dict[str, str]:
    """digest -> token: the current token, and each earlier one that some pod of the pool still carries. A token
    no pod runs with any more is forgotten."""
    carried = {pod_token_digest(pod) for pod in pods}
    kept = {digest: token for digest, token in known.items() if digest in carried}
    if current is not None:
        kept[admin_token_digest(current)] = current
    return kept


def token_for_pod(pod: dict, known: Mapping[str, str], current: str | None) -> str | None:
    """The token to call `pod` with: the one whose digest it carries, else the current one (a pod without the
    annotation, or with a token this operator never saw: a restart lost it)."""
    return known.get(pod_token_digest(pod) or "", current)
