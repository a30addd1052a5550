import pytest

from kubelora.operator.specs import AdapterSource, AdapterSpec, InvalidSpec, PoolSpec, parse_replicas
from kubelora.operator.validation import validate_adapter


def pool(**spec):
    return PoolSpec.from_body({"metadata": {"name": "p", "namespace": "ns"},
                               "spec": {"model": {"path": "/m/x"}, "engine": {"maxLoraRank": 8}, **spec}})


def adapter(**spec):
    body = {"metadata": {"name": "a", "namespace": "ns", "generation": 2},
            "spec": {"pool": "p", "source": {"path": "/adapters/a"}, **spec}}
    return AdapterSpec.from_body(body)


def test_replicas_int_or_all():
    assert parse_replicas("all") is None and parse_replicas(3) == 3 and parse_replicas("2") == 2
    assert adapter(replicas="all").replicas is None
    for bad in ("some", 0, -1):
        with pytest.raises(InvalidSpec):
            adapter(replicas=bad)


def test_source_revision_changes_with_path_url_or_sha256():
    base = AdapterSource(path="/adapters/a")
    assert base.revision == AdapterSource(path="/adapters/a").revision
    assert base.revision != AdapterSource(path="/adapters/b").revision
    assert base.revision != AdapterSource(path="/adapters/a", sha256="0" * 64).revision
    with pytest.raises(InvalidSpec):
        AdapterSource(path="/a", url="http://h/a")
    with pytest.raises(InvalidSpec):
        AdapterSource()


def test_pool_engine_settings_are_checked():
    with pytest.raises(InvalidSpec, match="maxCpuLoras"):
        pool(engine={"maxLoras": 8, "maxCpuLoras": 4})
    with pytest.raises(InvalidSpec, match="model.path"):
        PoolSpec.from_body({"metadata": {"name": "p", "namespace": "ns"}, "spec": {}})


@pytest.mark.parametrize("spec, reason", [
    ({"rank": 16}, "RankTooHigh"),
    ({"targets": ["c_attn"]}, "TargetUnsupported"),
    ({"source": {"path": "/etc/passwd"}}, "PathNotAllowed"),
    ({"source": {"path": "/adapters/../etc"}}, "PathNotAllowed"),
    ({"source": {"path": "/adaptersX/a"}}, "PathNotAllowed"),
    ({"source": {"url": "http://evil.com/a.tar.gz"}}, "UrlNotAllowed"),
    ({"source": {"url": "http://u:p@hub.example.com/a"}}, "UrlNotAllowed"),
    ({"source": {"url": "http://hub.example.com:81/a"}}, "UrlNotAllowed"),
    ({"source": {"url": "ftp://hub.example.com/a"}}, "UrlNotAllowed"),
])
def test_invalid_adapters_name_their_reason(spec, reason):
    with pytest.raises(InvalidSpec) as info:
        validate_adapter(adapter(**spec), pool(adapterRoots=["/adapters"], adapterUrlHosts=["*.example.com:80",
                                                                                             "models.local"]))
    assert info.value.reason == reason


@pytest.mark.parametrize("spec", [
    {"rank": 8, "targets": ["q_proj", "v_proj"]},
    {"targets": ["qkv_proj", "gate_up_proj", "embed_tokens", "lm_head"]},
    {"source": {"path": "file:///adapters/a"}},
    {"source": {"path": "tenant/a"}},
    {"source": {"path": "/adapters"}},
    {"source": {"url": "http://hub.example.com:80/a.tar.gz"}},
    {"source": {"url": "https://models.local:8443/a"}},
])
def test_valid_adapters_pass(spec):
    validate_adapter(adapter(**spec), pool(adapterRoots=["/adapters/"], adapterUrlHosts=["*.example.com:80",
                                                                                        "models.local"]))


def test_sources_need_configured_roots_or_hosts():
    with pytest.raises(InvalidSpec, match="adapterRoots"):
        validate_adapter(adapter(), pool())
    with pytest.raises(InvalidSpec, match="adapterUrlHosts"):
        validate_adapter(adapter(source={"url": "http://h/a"}), pool())


S3_POOL = {"adapterS3Buckets": ["team-*", "shared"], "adapterS3Endpoints": ["http://minio.storage:9000"]}


@pytest.mark.parametrize("source, reason", [
    ({"url": "s3://other/a.tar.gz"}, "UrlNotAllowed"),  # a bucket the pool does not list
    ({"url": "s3://Team-A/a"}, "UrlNotAllowed"),  # not a valid bucket name
    ({"url": "s3://ak:sk@team-a/a"}, "UrlNotAllowed"),  # credentials belong in a Secret
    ({"url": "s3://team-a/a?versionId=1"}, "UrlNotAllowed"),
    ({"url": "s3://team-a/x/../y"}, "UrlNotAllowed"),
    ({"url": "s3://team-a/a", "s3": {"endpoint": "http://evil:9000"}}, "UrlNotAllowed"),
    ({"path": "/adapters/a", "s3": {"region": "eu-west-1"}}, "InvalidSpec"),  # s3 settings on a path source
    ({"url": "https://models.local/a", "s3": {"region": "eu-west-1"}}, "InvalidSpec"),
])
def test_invalid_s3_sources_name_their_reason(source, reason):
    with pytest.raises(InvalidSpec) as info:
        validate_adapter(adapter(source=source), pool(adapterRoots=["/adapters"], adapterUrlHosts=["models.local"],
                                                      **S3_POOL))
    assert info.value.reason == reason


@pytest.mark.parametrize("source", [
    {"url": "s3://team-a/adapters/a.tar.gz"},
    {"url": "s3://shared/adapters/a/"},
    {"url": "s3://shared", "authSecretRef": {"name": "s3-creds"}},
    {"url": "s3://team-b/a", "s3": {"endpoint": "http://MINIO.storage:9000/", "region": "eu-west-1"}},
])
def test_valid_s3_sources_pass(source):
    validate_adapter(adapter(source=source), pool(**S3_POOL))


def test_s3_sources_need_configured_buckets_and_their_settings_are_a_new_revision():
    with pytest.raises(InvalidSpec, match="adapterS3Buckets"):
        validate_adapter(adapter(source={"url": "s3://team-a/a"}), pool(adapterUrlHosts=["team-a"]))
    base = AdapterSource(url="s3://team-a/a")
    assert base.is_s3 and not AdapterSource(url="https://h/a").is_s3
    assert base.revision == AdapterSource(url="s3://team-a/a").revision
    assert base.revision != AdapterSource(url="s3://team-a/a", s3_endpoint="http://minio:9000").revision
    assert base.revision != AdapterSource(url="s3://team-a/a", s3_region="eu-west-1").revision
    spec = adapter(source={"url": "s3://team-a/a", "s3": {"endpoint": "http://m:9000", "region": "eu-west-1"}})
    assert (spec.source.s3_endpoint, spec.source.s3_region) == ("http://m:9000", "eu-west-1")
    parsed = pool(**S3_POOL)
    assert parsed.adapter_s3_buckets == ("team-*", "shared")
    assert parsed.adapter_s3_endpoints == ("http://minio.storage:9000",)
