import pytest

from kubelora.operator import cli
from kubelora.operator.settings import OperatorSettings


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("KUBELORA_OPERATOR_RESYNC_S", "2.5")
    args = cli.build_parser().parse_args(["--namespace", "a", "-n", "b", "--liveness", "8081"])
    assert args.namespace == ["a", "b"] and args.liveness == 8081 and args.resync_seconds == 2.5


def test_main_runs_kopf_with_the_parsed_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "run", lambda settings, namespaces, port, verbose, election: seen.update(
        settings=settings, namespaces=namespaces, port=port) or 0)
    assert cli.main(["--", "-n", "x", "--resync-seconds", "3", "--max-concurrent-calls", "2"]) == 0
    assert seen == {"settings": OperatorSettings(resync_s=3, max_concurrent_calls=2), "namespaces": ["x"],
                    "port": None}
    assert cli.main(["--resync-seconds", "0"]) == 2


def test_metrics_port_from_flag_or_env_starts_the_server(monkeypatch):
    served = []
    monkeypatch.setattr("kubelora.operator.metrics.serve", served.append)
    monkeypatch.setattr(cli, "run", lambda *args: 0)
    assert cli.main([]) == 0 and served == []  # off unless asked
    assert cli.main(["--metrics-port", "9090"]) == 0 and served == [9090]
    monkeypatch.setenv("KUBELORA_OPERATOR_METRICS_PORT", "8080")
    assert cli.main([]) == 0 and served == [9090, 8080]


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
    assert cli.settings_from_args(args).network_policy.is_enabled
    monkeypatch.setenv("KUBELORA_OPERATOR_POD_LABELS", "nolabel")
    assert cli.main(["--resync-seconds", "3"]) == 2  # a bad label list is a settings error, not a crash
