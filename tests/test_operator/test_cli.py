from pathlib import Path

import pytest

from kubelora.operator import cli, settings
from kubelora.operator.settings import (ELECTION_SETTINGS, OPERATOR_SETTINGS, SETTINGS, ElectionSettings,
                                        OperatorSettings, RunSettings)

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def _run_settings(argv: list[str]) -> RunSettings:
    return settings.resolve_run(cli.build_parser().parse_args(argv))


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("KUBELORA_OPERATOR_RESYNC_S", "2.5")
    monkeypatch.setenv("KUBELORA_OPERATOR_NAMESPACES", "x, y")
    monkeypatch.setenv("KUBELORA_OPERATOR_LIVENESS_PORT", "9000")
    monkeypatch.setenv("KUBELORA_OPERATOR_VERBOSE", "true")
    args = cli.build_parser().parse_args(["--namespace", "a", "-n", "b", "--liveness", "8081"])
    assert settings.resolve_operator(args).resync_s == 2.5
    assert settings.resolve_run(args) == RunSettings(namespaces=("a", "b"), liveness_port=8081, is_verbose=True)
    assert _run_settings([]).namespaces == ("x", "y")  # comma-separated in the environment
    monkeypatch.delenv("KUBELORA_OPERATOR_NAMESPACES")
    assert _run_settings(["-A"]).namespaces == ()
    with pytest.raises(ValueError, match="--all-namespaces"):
        _run_settings(["-A", "-n", "a"])
    monkeypatch.setenv("KUBELORA_OPERATOR_RESYNC_S", "soon")
    with pytest.raises(ValueError, match="KUBELORA_OPERATOR_RESYNC_S"):
        cli.settings_from_env()


def test_main_runs_kopf_with_the_parsed_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "run", lambda operator_settings, run_settings: seen.update(
        settings=operator_settings, run=run_settings) or 0)
    assert cli.main(["--", "-n", "x", "--resync-seconds", "3", "--max-concurrent-calls", "2"]) == 0
    assert seen == {"settings": OperatorSettings(resync_s=3, max_concurrent_calls=2),
                    "run": RunSettings(namespaces=("x",))}
    assert cli.main(["--resync-seconds", "0"]) == 2
    assert cli.main(["--metrics-port", "70000"]) == 2


def test_metrics_port_from_flag_or_env_starts_the_server(monkeypatch):
    served = []
    monkeypatch.setattr("kubelora.operator.metrics.serve", served.append)
    monkeypatch.setattr(cli, "run", lambda *args: 0)
    assert cli.main([]) == 0 and served == []  # off unless asked
    assert cli.main(["--metrics-port", "9090"]) == 0 and served == [9090]
    monkeypatch.setenv("KUBELORA_OPERATOR_METRICS_PORT", "8080")
    assert cli.main([]) == 0 and served == [9090, 8080]


def test_every_setting_is_documented_with_its_default():
    """docs/operator.md's settings table has a row per flag, naming its variable; a default that a dataclass
    holds is the one the row states."""
    rows = {line.split("|")[1].split("`")[1].split()[0]: line for line in DOC.read_text().splitlines()
            if line.startswith("| `--")}
    missing = [s.flag for s in SETTINGS if s.flag not in rows or f"`{s.env}" not in rows[s.flag]]
    assert not missing, f"undocumented settings: {missing}"
    assert set(rows) == {s.flag for s in SETTINGS}, "docs/operator.md lists a flag the operator does not have"
    defaults = {**{s.flag: getattr(OperatorSettings, s.field_name) for s in OPERATOR_SETTINGS},
                **{s.flag: getattr(ElectionSettings, s.field_name) for s in ELECTION_SETTINGS
                   if hasattr(ElectionSettings, s.field_name)}}
    wrong = [flag for flag, default in defaults.items() if f"| `{default:g}` |" not in rows[flag]]
    assert not wrong, f"defaults in docs/operator.md differ from the dataclasses' for {wrong}"


def test_settings_validate_and_back_off():
    with pytest.raises(ValueError, match="max_concurrent_calls"):
        OperatorSettings(max_concurrent_calls=0)
    settings = OperatorSettings(backoff_initial_s=1, backoff_max_s=5)
    assert [settings.backoff_s(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 5]


def test_package_imports_only_as_kubelora_operator():
    import kubelora.operator.main  # noqa: F401  (registers the handlers without a path on sys.path)
    import operator

    assert operator.__name__ == "operator" and hasattr(operator, "itemgetter")  # the stdlib module


def test_settings_from_env_for_kopf_run(monkeypatch):
    monkeypatch.setenv("KUBELORA_OPERATOR_BACKOFF_MAX_S", "7")
    assert cli.settings_from_env() == OperatorSettings(backoff_max_s=7)


def test_network_policy_settings_from_flags_and_env(monkeypatch):
    from kubelora.operator.settings import NetworkPolicySettings

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setenv("KUBELORA_OPERATOR_POD_NAMESPACE", "kubelora-system")
    monkeypatch.setenv("KUBELORA_OPERATOR_POD_LABELS", "app.kubernetes.io/name=kubelora,app.kubernetes.io/instance=r")
    network = cli.settings_from_env().network_policy
    assert network == NetworkPolicySettings(operator_namespace="kubelora-system", operator_pod_labels={
        "app.kubernetes.io/name": "kubelora", "app.kubernetes.io/instance": "r"})
    monkeypatch.setenv("KUBELORA_OPERATOR_NETWORK_POLICY", "false")
    assert not cli.settings_from_env().network_policy.is_enabled
    args = cli.build_parser().parse_args(["--network-policy"])
    assert settings.resolve_operator(args).network_policy.is_enabled
    monkeypatch.setenv("KUBELORA_OPERATOR_POD_LABELS", "nolabel")
    assert cli.main(["--resync-seconds", "3"]) == 2  # a bad label list is a settings error, not a crash
