"""Pools that name no image get the operator's own (settings, flags, env); a pool's own image wins."""

from __future__ import annotations

import pytest

from kubelora.operator import cli, settings
from kubelora.operator.builders import build_pool_manifests
from kubelora.operator.settings import VERSION, DefaultImages, OperatorSettings
from kubelora.operator.specs import PoolSpec

OWNER = {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool", "name": "p", "uid": "u", "controller": True,
         "blockOwnerDeletion": True}
IMAGES = DefaultImages(engine="registry.example.com/kubelora-engine:1.2.3",
                       router="registry.example.com/kubelora-operator:1.2.3")


def _images(spec: dict, images: DefaultImages) -> dict[str, str]:
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"path": "/models/base"}, "router": {"enabled": True}, **spec}}
    found = {}
    for manifest in build_pool_manifests(PoolSpec.from_body(body), OWNER, images):
        if manifest["kind"] == "Deployment":
            [container] = manifest["spec"]["template"]["spec"]["containers"]
            found[container["name"]] = container["image"]
    return found


def test_pool_without_images_gets_the_operators():
    assert _images({}, IMAGES) == {"engine": IMAGES.engine, "router": IMAGES.router}


def test_pool_images_win():
    spec = {"image": "mine/engine:x", "router": {"enabled": True, "image": "mine/router:y"}}
    assert _images(spec, IMAGES) == {"engine": "mine/engine:x", "router": "mine/router:y"}


def test_built_in_defaults_are_the_images_of_this_version():
    assert VERSION != "dev"  # installed: the distribution's version
    # The router runs from the control-plane image, the operator's own, with the router command.
    assert _images({}, DefaultImages()) == {"engine": f"kubelora-engine:{VERSION}",
                                            "router": f"kubelora-operator:{VERSION}"}
    assert OperatorSettings().images == DefaultImages()


def test_the_router_deployment_runs_the_router_command_of_the_image():
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"path": "/models/base"}, "router": {"enabled": True}}}
    [router] = [m for m in build_pool_manifests(PoolSpec.from_body(body), OWNER, DefaultImages())
                if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("router")]
    [container] = router["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"kubelora-operator:{VERSION}" and container["args"][0] == "router"
    assert "command" not in container  # the image's entrypoint, `kubelora`


def test_flags_and_env_set_the_default_images(monkeypatch):
    monkeypatch.setenv("KUBELORA_OPERATOR_ENGINE_IMAGE", "r/e:1")
    monkeypatch.setenv("KUBELORA_OPERATOR_ROUTER_IMAGE", "r/r:1")
    assert cli.settings_from_env().images == DefaultImages(engine="r/e:1", router="r/r:1")
    args = cli.build_parser().parse_args(["--engine-image", "f/e:2"])
    assert settings.resolve_operator(args).images == DefaultImages(engine="f/e:2", router="r/r:1")


@pytest.mark.parametrize("bad", ["", "has space:1"])
def test_bad_default_image_is_refused(bad):
    with pytest.raises(ValueError, match="engine image"):
        DefaultImages(engine=bad)
