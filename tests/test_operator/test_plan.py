from kubelora.operator.plan import DesiredAdapter, Load, ObservedAdapter, Unload, plan_pod

A = DesiredAdapter("a", "/adapters/a", None, "rev-a")
B = DesiredAdapter("b", "/adapters/b", None, "rev-b")


def seen(name, source, residency="host"):
    return ObservedAdapter(name, source, None, "c0ffee", residency)


def test_empty_pod_gets_placed_preloaded_and_others_registered():
    actions = plan_pod("p", {"a": A, "b": B}, {"a"}, {}, {})
    assert actions == [Load("p", A, is_preload=True, is_inplace=False),
                       Load("p", B, is_preload=False, is_inplace=False)]


def test_converged_pod_needs_nothing():
    observed = {"a": seen("a", "/adapters/a"), "b": seen("b", "/adapters/b", "known")}
    assert plan_pod("p", {"a": A, "b": B}, {"a"}, observed, {"a": "rev-a"}) == []


def test_placed_but_only_known_is_preloaded_in_place():
    observed = {"a": seen("a", "/adapters/a", "known")}
    assert plan_pod("p", {"a": A}, {"a"}, observed, {}) == [Load("p", A, is_preload=True, is_inplace=True,
                                                                 is_residency_repair=True)]


def test_new_source_is_loaded_in_place_on_placed_and_registered_pods():
    observed = {"a": seen("a", "/adapters/a-old"), "b": seen("b", "/adapters/b-old", "known")}
    actions = plan_pod("p", {"a": A, "b": B}, {"a"}, observed, {})
    assert actions == [Load("p", A, is_preload=True, is_inplace=True), Load("p", B, is_preload=False, is_inplace=True)]


def test_changed_sha256_under_the_same_path_is_a_new_revision():
    observed = {"a": seen("a", "/adapters/a")}
    assert plan_pod("p", {"a": A}, {"a"}, observed, {"a": "rev-old"}) == [Load("p", A, is_preload=True,
                                                                                 is_inplace=True)]


def test_unknown_adapters_are_unloaded_and_frozen_ones_left_alone():
    observed = {"manual": seen("manual", "/x"), "bad": seen("bad", "/adapters/bad")}
    assert plan_pod("p", {}, set(), observed, {}, frozen={"bad"}) == [Unload("p", "manual")]
    assert plan_pod("p", {"a": A}, {"a"}, {}, {}, frozen={"a"}) == []


def test_adapter_cards_parse():
    card = {"id": "a", "source": "/adapters/a", "revision": "abc", "residency": "device", "created": 5,
            "last_error": None, "parent": "base"}
    observed = ObservedAdapter.from_card(card)
    assert observed.is_resident and observed.content_revision == "abc" and observed.loaded_at == 5


def test_a_changed_sha256_under_the_same_path_is_reloaded_even_without_memory_of_past_loads():
    # After an operator restart `served_revisions` is empty: the engine's echoed sha256 tells the change apart.
    pinned = DesiredAdapter("a", "/adapters/a", "ab" * 32, "rev-a2")
    observed = {"a": ObservedAdapter("a", "/adapters/a", "cd" * 32, "c0ffee", "host")}
    assert plan_pod("p", {"a": pinned}, {"a"}, observed, {}) == [Load("p", pinned, is_preload=True, is_inplace=True)]
    same = {"a": ObservedAdapter("a", "/adapters/a", "ab" * 32, "c0ffee", "host")}
    assert plan_pod("p", {"a": pinned}, {"a"}, same, {}) == []


def test_adapter_cards_echo_sha256():
    card = {"id": "a", "source": "/adapters/a", "sha256": "ab" * 32, "revision": "abc", "residency": "known"}
    assert ObservedAdapter.from_card(card).sha256 == "ab" * 32


def test_a_redacted_source_is_compared_by_its_digest():
    """Without the engine's admin token the card's source has no query string; its digest is of the full URL."""
    import hashlib

    url = "https://models.example.com/a.tar.gz?X-Amz-Signature=s3cret"
    want = DesiredAdapter("a", url, None, "rev-a")
    card = {"id": "a", "source": "https://models.example.com/a.tar.gz?<redacted>", "revision": "abc",
            "residency": "host", "source_digest": "sha256:" + hashlib.sha256(url.encode()).hexdigest()}
    assert plan_pod("p", {"a": want}, {"a"}, {"a": ObservedAdapter.from_card(card)}, {}) == []
    other = {**card, "source_digest": "sha256:" + hashlib.sha256(b"https://models.example.com/b.tar.gz").hexdigest()}
    assert plan_pod("p", {"a": want}, {"a"}, {"a": ObservedAdapter.from_card(other)}, {}) == [
        Load("p", want, is_preload=True, is_inplace=True)]
    full = {k: v for k, v in card.items() if k != "source_digest"} | {"source": url}  # with the token, or older engines
    assert plan_pod("p", {"a": want}, {"a"}, {"a": ObservedAdapter.from_card(full)}, {}) == []
