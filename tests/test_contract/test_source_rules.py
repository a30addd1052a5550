"""One table of adapter sources through the operator's admission (`validate_adapter`) and the engine's load-source
check (`check_load_source`, then `confine_local` for local paths): both answer every row the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.load import S3Access
from kubelora.contract.sources import SourceKind, check_host_pattern, host_allowed
from kubelora.engine.server.sources import SourceConfig, check_load_source, confine_local
from kubelora.operator.specs import AdapterSpec, InvalidSpec, PoolSpec
from kubelora.operator.validation import validate_adapter

HOSTS = ("models.example.com:443", "*.cdn.example.org", "127.0.0.1:8080", "[::1]:8443")
BUCKETS = ("team-*", "shared")
ENDPOINTS = ("http://minio.storage:9000",)

# (source, allowed, s3 endpoint named by the load, host patterns); {root} and {outside} are real directories.
CASES = [
    ("{root}/a", True, None, HOSTS),
    ("team/b", True, None, HOSTS),  # relative: looked up under each root
    ("file://{root}/a", True, None, HOSTS),
    ("file://localhost{root}/a", True, None, HOSTS),
    ("{root}", True, None, HOSTS),
    ("{root}/a/../../outside", False, None, HOSTS),
    ("../outside", False, None, HOSTS),
    ("{outside}", False, None, HOSTS),
    ("{root}X/a", False, None, HOSTS),  # a sibling sharing the root's name as a prefix
    ("file://elsewhere{root}/a", False, None, HOSTS),
    ("gs://bucket/a", False, None, HOSTS),
    ("ftp://models.example.com/a", False, None, HOSTS),
    # A pattern's port against the URL's default port, filled in before matching.
    ("https://models.example.com/a.tar", True, None, HOSTS),
    ("https://models.example.com:443/a.tar", True, None, HOSTS),
    ("http://models.example.com/a.tar", False, None, HOSTS),
    ("https://MODELS.example.com/a.tar", True, None, HOSTS),
    # `*` matches within one DNS label: neither none nor two.
    ("https://models.example.com/a", True, None, ("models.*.com",)),
    ("https://models.a.b.com/a", False, None, ("models.*.com",)),
    ("https://eu.cdn.example.org/a", True, None, HOSTS),
    ("https://a.eu.cdn.example.org/a", False, None, HOSTS),
    ("https://cdn.example.org/a", False, None, HOSTS),
    ("https://models-eu.example.com/a", True, None, ("models-*.example.com",)),
    ("https://models.example.com/a", True, None, ("models.example.com",)),  # no port: every port
    ("http://models.example.com:8080/a", True, None, ("models.example.com",)),
    ("http://127.0.0.1:8080/a", True, None, HOSTS),
    ("http://127.0.0.1:9090/a", False, None, HOSTS),
    ("http://127.0.0.1/a", False, None, HOSTS),
    ("https://[::1]:8443/a", True, None, HOSTS),
    ("https://u:p@models.example.com/a", False, None, HOSTS),
    ("https://evil.com/models.example.com", False, None, HOSTS),
    ("https://models.example.com.evil.com/a", False, None, HOSTS),
    ("https://models.example.com/a", False, None, ()),
    ("s3://team-a/x.tar.gz", True, None, HOSTS),
    ("s3://shared/a/", True, None, HOSTS),
    ("s3://shared", True, None, HOSTS),
    ("s3://other/a", False, None, HOSTS),
    ("s3://Team-A/a", False, None, HOSTS),
    ("s3://ak:sk@team-a/a", False, None, HOSTS),
    ("s3://team-a/a?versionId=1", False, None, HOSTS),
    ("s3://team-a/x/../y", False, None, HOSTS),
    ("s3://team-a/a", True, "http://MINIO.storage:9000/", HOSTS),
    ("s3://team-a/a", False, "http://evil:9000", HOSTS),
    ("s3://team-a/a", False, "minio.storage:9000", HOSTS),  # not http(s)://host[:port]
]


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    for directory in (root / "a", root / "team" / "b", outside, tmp_path / "adaptersX" / "a"):
        directory.mkdir(parents=True)
    return {"root": root, "outside": outside}


def operator_allows(source: str, endpoint: str | None, hosts: tuple[str, ...], root: Path) -> bool:
    pool = PoolSpec.from_body({"metadata": {"name": "p", "namespace": "ns"}, "spec": {
        "model": {"path": "/m/x"}, "adapterRoots": [str(root)], "adapterUrlHosts": list(hosts),
        "adapterS3Buckets": list(BUCKETS), "adapterS3Endpoints": list(ENDPOINTS)}})
    is_url = "://" in source and not source.startswith("file:")
    spec_source = {"url": source} if is_url else {"path": source}
    if endpoint is not None:
        spec_source["s3"] = {"endpoint": endpoint}
    try:
        validate_adapter(AdapterSpec.from_body({"metadata": {"name": "a", "namespace": "ns"},
                                                "spec": {"pool": "p", "source": spec_source}}), pool)
    except InvalidSpec:
        return False
    return True


def engine_allows(source: str, endpoint: str | None, hosts: tuple[str, ...], root: Path) -> bool:
    config = SourceConfig(roots=(root,), allowed_hosts=hosts, allowed_s3_buckets=BUCKETS,
                          allowed_s3_endpoints=ENDPOINTS)
    try:
        s3 = S3Access(endpoint=endpoint) if endpoint is not None else None
        checked = check_load_source(config, source, s3=s3)
        if checked.kind is SourceKind.LOCAL:
            confine_local(config.roots, source)
    except (AdapterSourceError, ValueError):  # ValueError: the engine's request parsing refuses the s3 field
        return False
    return True


@pytest.mark.parametrize("source, allowed, endpoint, hosts", CASES)
def test_operator_admission_and_engine_load_agree(tree, source, allowed, endpoint, hosts):
    text = source.format(root=tree["root"], outside=tree["outside"])
    answers = {"operator": operator_allows(text, endpoint, hosts, tree["root"]),
               "engine": engine_allows(text, endpoint, hosts, tree["root"])}
    assert answers == {"operator": allowed, "engine": allowed}


def test_a_symlink_out_of_the_roots_is_refused_by_the_engine_which_alone_sees_the_files(tree):
    os.symlink(tree["outside"], tree["root"] / "link")
    text = f"{tree['root']}/link"
    assert operator_allows(text, None, HOSTS, tree["root"])  # only the manifest: lexically under the root
    assert not engine_allows(text, None, HOSTS, tree["root"])


def test_refusals_name_the_rule_each_side_calls_by_its_own_name(tree):
    config = SourceConfig(allowed_hosts=HOSTS)
    with pytest.raises(AdapterSourceError) as info:
        check_load_source(config, "https://evil.com/a")
    assert "--adapter-url-host" in info.value.message and info.value.code == "url_not_allowed"
    assert not info.value.is_transient
    pool = PoolSpec.from_body({"metadata": {"name": "p", "namespace": "ns"},
                               "spec": {"model": {"path": "/m/x"}, "adapterUrlHosts": list(HOSTS)}})
    with pytest.raises(InvalidSpec) as refused:
        validate_adapter(AdapterSpec.from_body({"metadata": {"name": "a", "namespace": "ns"},
                                                "spec": {"pool": "p", "source": {"url": "https://evil.com/a"}}}), pool)
    assert refused.value.reason == "UrlNotAllowed" and "adapterUrlHosts" in str(refused.value)


def test_host_patterns():
    assert host_allowed(("*.example.com",), "https://a.example.com/x")
    assert not host_allowed(("*.example.com",), "https://example.com/x")
    assert not host_allowed(("a.example.com",), "file:///a.example.com")
    for good in ("models.example.com", "*.example.com:443", "[::1]:8080", "10.0.0.1"):
        check_host_pattern(good)
    for bad in ("models.example.com:http", "https://models.example.com", "u@host", "host/path", ""):
        with pytest.raises(ValueError, match="host pattern"):
            check_host_pattern(bad)


def test_the_engine_refuses_to_start_with_a_malformed_host_pattern_or_endpoint():
    from kubelora.engine.config import EngineConfig
    from kubelora.engine.server.config import ServerConfig

    engine = EngineConfig(model_dir="/m", device="cpu")
    with pytest.raises(ValueError, match="host pattern"):
        ServerConfig(engine, adapter_url_host=("models.example.com:https",))
    with pytest.raises(ValueError, match="s3 endpoint"):
        ServerConfig(engine, adapter_s3_endpoint=("minio:9000",))
    assert ServerConfig(engine, adapter_url_host=("*.example.com:443",)).adapter_url_host == ("*.example.com:443",)
