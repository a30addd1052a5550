"""Which admin token each engine pod is called with (tokens.py): pods started before a rotation keep theirs."""
from __future__ import annotations

from kubelora.operator import names
from kubelora.operator.builders import admin_token_digest
from kubelora.operator.tokens import remember_tokens, token_for_pod


def pod(name: str, token: str | None) -> dict:
    annotations = {} if token is None else {names.ANNOTATION_ADMIN_TOKEN: admin_token_digest(token)}
    return {"metadata": {"name": name, "annotations": annotations}}


def test_each_pod_gets_the_token_it_was_started_with():
    known = remember_tokens({}, "old", [pod("a", "old")])
    known = remember_tokens(known, "new", [pod("a", "old"), pod("b", "new")])  # rotated, rolling
    assert known == {admin_token_digest("old"): "old", admin_token_digest("new"): "new"}
    assert token_for_pod(pod("a", "old"), known, "new") == "old"
    assert token_for_pod(pod("b", "new"), known, "new") == "new"


def test_unknown_or_missing_digests_get_the_current_token():
    known = remember_tokens({}, "new", [])
    assert token_for_pod(pod("a", "lost-in-a-restart"), known, "new") == "new"
    assert token_for_pod(pod("b", None), known, "new") == "new"
    assert token_for_pod(pod("c", None), {}, None) is None


def test_a_token_no_pod_runs_with_is_forgotten_but_the_current_one_kept():
    known = remember_tokens({}, "old", [pod("a", "old")])
    known = remember_tokens(known, "new", [pod("b", "new")])
    assert known == {admin_token_digest("new"): "new"}
    assert remember_tokens(known, "new", []) == {admin_token_digest("new"): "new"}
