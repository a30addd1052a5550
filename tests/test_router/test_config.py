"""Settings (flags over KUBELORA_ROUTER_* over defaults) and the placement document's validation."""

from __future__ import annotations

import argparse
import json

import pytest

from kubelora.router.cli import main
from kubelora.router.config import add_arguments, resolve_config
from kubelora.router.placement import parse_placement


def resolve(argv: list[str], environ: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_config(parser.parse_args(argv), environ)


def test_flags_win_over_environment_over_defaults():
    config = resolve(["--pool", "p", "--port", "9000"],
                     {"KUBELORA_ROUTER_PORT": "1", "KUBELORA_ROUTER_LOAD_FACTOR": "1.5",
                      "KUBELORA_ROUTER_NAMESPACE": "tenants"})
    assert (config.pool, config.port, config.load_factor, config.namespace) == ("p", 9000, 1.5, "tenants")
    assert config.placement_configmap == "p-placement" and config.host == "0.0.0.0" and config.poll_interval == 1.0


@pytest.mark.parametrize("argv, field", [([], "pool"), (["--pool", "p", "--load-factor", "0.9"], "load_factor"),
                                         (["--pool", "p", "--port", "70000"], "port"),
                                         (["--pool", "p", "--port", "x"], "--port"),
                                         (["--pool", "p", "--log-level", "loud"], "log_level")])
def test_bad_settings_name_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        resolve(argv, {})


def test_cli_exits_2_on_bad_settings(capsys):
    assert main(["--pool", "p", "--load-factor", "0.5"]) == 2
    assert "load_factor" in capsys.readouterr().err
    assert main(["--", "--pool", "p", "--port", "-1"]) == 2  # the "--" form parses the same
    assert "port" in capsys.readouterr().err


def test_placement_parses_the_documented_example():
    placement = parse_placement(json.dumps(
        {"pool": "p", "baseModel": "tiny-llama", "revision": 17,
         "replicas": [{"pod": "p-engine-7d9c-abcde", "url": "http://10.244.0.7:8000/", "ready": True},
                      {"pod": "p-engine-7d9c-fghij", "url": "http://10.244.0.8:8000", "ready": False}],
         "adapters": {"tenant-a": ["p-engine-7d9c-abcde", "gone"], "tenant-b": []}}))
    assert placement.base_model == "tiny-llama" and placement.revision == 17
    assert placement.replicas[0].url == "http://10.244.0.7:8000"
    assert list(placement.ready_replicas()) == ["p-engine-7d9c-abcde"]
    assert placement.holders("tenant-a") == ("p-engine-7d9c-abcde",) and placement.holders("tenant-b") == ()


@pytest.mark.parametrize("text, field", [("{", "not JSON"), ("[]", "<root>"), ('{"revision": 1}', "baseModel"),
                                         ('{"baseModel": "b", "revision": "1"}', "revision"),
                                         ('{"baseModel": "b", "replicas": [{"pod": "x", "url": "10.0.0.1"}]}',
                                          "replicas\\[0\\].url"),
                                         ('{"baseModel": "b", "adapters": {"a": "p0"}}', "adapters")])
def test_bad_placement_names_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        parse_placement(text)
