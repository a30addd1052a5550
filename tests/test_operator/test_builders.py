import json

import pytest

from kubelora.operator import names
from kubelora.operator.builders import (build_admin_token_secret, build_engine_args, build_engine_deployment,
                                        build_network_policy, build_owner_reference, build_placement_configmap,
                                        build_pool_manifests, build_pool_service)
from kubelora.operator.settings import NetworkPolicySettings
from kubelora.operator.specs import PoolSpec

BODY = {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"model": {"path": "/models/llama", "servedName": "llama"}, "replicas": 3,
                 "modelVolume": {"claimName": "weights", "mountPath": "/models"},
                 "adapterVolume": {"hostPath": "/srv/adapters", "mountPath": "/adapters", "readOnly": True},
                 "engine": {"maxLoras": 8, "maxLoraRank": 32, "maxCpuLoras": 16, "maxModelLen": 4096,
                            "device": "cuda", "dtype": "bfloat16", "extraArgs": ["--log-level", "debug"]},
                 "resources": {"limits": {"nvidia.com/gpu": 1}},
                 "adapterRoots": ["/adapters"], "adapterUrlHosts": ["*.example.com"],
                 "adminTokenSecretRef": {"name": "tok", "key": "t"}}}


def pool(**spec):
    body = json.loads(json.dumps(BODY))
    body["spec"].update(spec)
    return PoolSpec.from_body(body)


OWNER = build_owner_reference(BODY)


def test_owner_reference_controls_for_garbage_collection():
    assert OWNER == {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool", "name": "p", "uid": "u-1",
                     "controller": True, "blockOwnerDeletion": True}


def test_engine_args_render_every_setting():
    args = build_engine_args(pool())
    assert args[:2] == ["engine", "serve"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--model"] == "/models/llama" and flags["--served-model-name"] == "llama"
    assert (flags["--max-loras"], flags["--max-lora-rank"], flags["--max-cpu-loras"]) == ("8", "32", "16")
    assert flags["--max-model-len"] == "4096" and flags["--dtype"] == "bfloat16" and flags["--port"] == "8000"
    assert flags["--adapter-root"] == "/adapters" and flags["--adapter-url-host"] == "*.example.com"
    assert args[-2:] == ["--log-level", "debug"]


def test_engine_args_render_the_s3_source_policy():
    args = build_engine_args(pool(adapterS3Buckets=["team-*", "shared"], adapterS3Endpoints=["http://minio:9000"]))
    pairs = list(zip(args, args[1:]))
    assert [v for f, v in pairs if f == "--adapter-s3-bucket"] == ["team-*", "shared"]
    assert [v for f, v in pairs if f == "--adapter-s3-endpoint"] == ["http://minio:9000"]
    assert "--adapter-s3-bucket" not in build_engine_args(pool())


def test_engine_deployment_probes_volumes_gpu_and_token():
    deployment = build_engine_deployment(pool(), OWNER)
    assert deployment["metadata"]["ownerReferences"] == [OWNER]
    assert deployment["spec"]["replicas"] == 3
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    container = template["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    token = next(e for e in container["env"] if e["name"] == "KUBELORA_ADMIN_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "tok", "key": "t"}}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "weights"
    assert volumes["adapters"]["hostPath"]["path"] == "/srv/adapters"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/models", "/adapters"}


def test_defaults_without_optional_fields():
    body = {"metadata": {"name": "q", "namespace": "ns", "uid": "u"}, "spec": {"model": {"path": "/m/base/"}}}
    spec = PoolSpec.from_body(body)
    assert spec.served_name == "base" and spec.replicas == 1 and spec.image is None
    container = build_engine_deployment(spec, OWNER)["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in container and "volumeMounts" not in container
    # No adminTokenSecretRef: the token comes from the Secret the operator creates for the pool.
    assert {"name": "KUBELORA_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "q-engine-admin", "key": "token"}}
            } in container["env"]


def test_router_objects_only_when_enabled():
    kinds = [m["kind"] for m in build_pool_manifests(pool(), OWNER)]
    assert kinds == ["Deployment", "Service", "Service"]
    with_router = build_pool_manifests(pool(router={"enabled": True, "replicas": 2}), OWNER)
    by_kind = {(m["kind"], m["metadata"]["name"]) for m in with_router}
    assert {("Deployment", "p-router"), ("ServiceAccount", "p-router"), ("Role", "p-router"),
            ("RoleBinding", "p-router")} <= by_kind
    router = next(m for m in with_router if m["metadata"]["name"] == "p-router" and m["kind"] == "Deployment")
    spec = router["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "p-router" and router["spec"]["replicas"] == 2
    assert spec["containers"][0]["args"] == ["router", "--", "--pool", "p", "--namespace", "ns",
                                             "--placement-configmap",
                                             "p-placement", "--port", "8080"]
    role = next(m for m in with_router if m["kind"] == "Role")
    # Only its own placement ConfigMap, by name, read with get (the router polls it; docs/router.md).
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["p-placement"],
                              "verbs": ["get"]}]


def test_pool_service_points_at_router_or_engines():
    assert build_pool_service(pool(), OWNER)["spec"]["selector"][names.LABEL_COMPONENT] == "engine"
    routed = build_pool_service(pool(router={"enabled": True}), OWNER)
    assert routed["spec"]["selector"][names.LABEL_COMPONENT] == "router"
    assert routed["spec"]["ports"][0]["port"] == 8080


def test_placement_configmap_is_the_router_contract():
    payload = {"pool": "p", "baseModel": "llama", "revision": 3, "replicas": [], "adapters": {"a": []}}
    configmap = build_placement_configmap(pool(), OWNER, payload)
    assert configmap["metadata"]["name"] == "p-placement"
    assert json.loads(configmap["data"]["placement.json"]) == payload


def test_engine_pods_carry_the_pool_spec_digest():
    """Scaling keeps the digest (no rollout); an engine setting changes it (the pods are replaced)."""
    from kubelora.operator.names import ANNOTATION_POOL_SPEC

    def digest(body: dict) -> str:
        template = build_engine_deployment(PoolSpec.from_body(body), OWNER)["spec"]["template"]
        return template["metadata"]["annotations"][ANNOTATION_POOL_SPEC]

    body = {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"model": {"path": "/models/m"}, "engine": {"maxLoraRank": 8}}}
    scaled = {**body, "spec": {**body["spec"], "replicas": 3, "router": {"enabled": True}}}
    raised = {**body, "spec": {**body["spec"], "engine": {"maxLoraRank": 16}}}
    assert len(digest(body)) == 16 and digest(scaled) == digest(body) != digest(raised)


def _without_token_ref(**spec):
    body = json.loads(json.dumps(BODY))
    del body["spec"]["adminTokenSecretRef"]
    body["spec"].update(spec)
    return PoolSpec.from_body(body)


def test_engines_get_the_admin_port_and_a_token_from_the_pools_secret():
    args = build_engine_args(pool())
    assert dict(zip(args[2::2], args[3::2]))["--admin-port"] == "8001"
    managed = _without_token_ref()
    assert managed.is_admin_token_managed and managed.admin_token.name == "p-engine-admin"
    assert not pool().is_admin_token_managed and pool().admin_token.name == "tok"  # the pool's own Secret wins
    container = build_engine_deployment(managed, OWNER)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "KUBELORA_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "p-engine-admin", "key": "token"}}
            } in container["env"]
    assert {"name": "admin", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    assert container["readinessProbe"]["httpGet"]["port"] == 8000  # probes stay on the serving port
    secret = build_admin_token_secret(managed, OWNER, "r4nd0m")
    assert secret["metadata"]["name"] == "p-engine-admin" and secret["metadata"]["ownerReferences"] == [OWNER]
    assert secret["stringData"] == {"token": "r4nd0m"} and secret["type"] == "Opaque"


NETWORK = NetworkPolicySettings(operator_namespace="kubelora-system",
                                operator_pod_labels={"app.kubernetes.io/name": "kubelora",
                                                     "app.kubernetes.io/component": "operator"})


def test_network_policy_admits_the_operator_to_the_admin_port_and_routers_to_the_serving_port():
    policy = build_network_policy(pool(router={"enabled": True}, allowedClientNamespaces=["team-a", "monitoring"]),
                                  OWNER, NETWORK)
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["ownerReferences"] == [OWNER]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": names.engine_selector("p")} and spec["policyTypes"] == ["Ingress"]
    admin, serving = spec["ingress"]
    assert admin["ports"] == [{"protocol": "TCP", "port": 8001}]
    assert admin["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubelora-system"}},
                              "podSelector": {"matchLabels": NETWORK.operator_pod_labels}}]
    assert serving["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert serving["from"] == [
        {"podSelector": {"matchLabels": {"kubelora.io/pool": "p", "app.kubernetes.io/component": "router"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_network_policy_without_router_or_operator_namespace():
    policy = build_network_policy(pool(), OWNER, NetworkPolicySettings())
    admin, serving = policy["spec"]["ingress"]
    # Unknown operator namespace: operator-labelled pods in any namespace; no router: the pool's own namespace.
    assert admin["from"] == [{"namespaceSelector": {},
                              "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}]
    assert serving["from"] == [{"podSelector": {}}]


def test_network_policy_is_in_the_pool_manifests_only_when_enabled():
    kinds = lambda network: [m["kind"] for m in build_pool_manifests(pool(), OWNER, network=network)]  # noqa: E731
    assert "NetworkPolicy" in kinds(NETWORK)
    assert "NetworkPolicy" not in kinds(NetworkPolicySettings(is_enabled=False))
    assert "NetworkPolicy" not in kinds(None)
    assert "Secret" not in kinds(NETWORK)  # created once by the handler, never applied


def test_network_policy_settings_parse_and_refuse_an_empty_selector():
    assert NetworkPolicySettings.parse_labels("a=b, c = d,") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        NetworkPolicySettings.parse_labels("a")
    with pytest.raises(ValueError, match="operator_pod_labels"):
        NetworkPolicySettings(operator_pod_labels={})
    assert NetworkPolicySettings(is_enabled=False, operator_pod_labels={}).operator_pod_labels == {}
