"""`kubelora operator [flags]`: resolve the settings (settings.py), then run kopf in this process with our
handlers, behind the leader election when it is on."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
from collections.abc import Sequence

import aiohttp

from kubelora.operator import settings
from kubelora.operator.kube import Kube, load_connection
from kubelora.operator.settings import ElectionSettings, OperatorSettings, RunSettings

log = logging.getLogger("kubelora.operator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubelora operator",
                                     description="Run the kubelora control plane (LoRAPool, LoRAAdapter).")
    settings.add_arguments(parser)
    return parser


def settings_from_env() -> OperatorSettings:
    """For `kopf run -m kubelora.operator.main`, where no flags reach us: the environment and defaults."""
    return settings.resolve_operator(build_parser().parse_args([]))


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["--"]:  # `kubelora operator -- --namespace x`: the separator some parsers pass through
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        operator_settings, run_settings = settings.resolve_operator(args), settings.resolve_run(args)
    except ValueError as exc:
        print(f"kubelora operator: {exc}")
        return 2
    if run_settings.metrics_port:
        from kubelora.operator.metrics import serve

        serve(run_settings.metrics_port)
    return run(operator_settings, run_settings)


def run(operator_settings: OperatorSettings, run_settings: RunSettings) -> int:
    """kopf with our handlers; with an election only while this replica leads. Returns the exit code: 0 after
    SIGTERM/SIGINT, 1 when leadership was lost (the pod restarts as a standby)."""
    import kopf

    from kubelora.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=run_settings.is_verbose)
    port = run_settings.liveness_port
    memo = kopf.Memo(operator_settings=operator_settings)
    operator = functools.partial(kopf.operator, standalone=True, clusterwide=not run_settings.namespaces,
                                 namespaces=run_settings.namespaces,
                                 liveness_endpoint=f"http://0.0.0.0:{port}/healthz" if port else None, memo=memo)
    try:
        return asyncio.run(operate(operator, run_settings.election, port, memo))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


async def operate(operator, election: ElectionSettings | None, liveness_port: int | None,
                  memo: dict | None = None) -> int:
    """`operator(stop_flag=...)` runs kopf until SIGTERM/SIGINT (kopf's own handlers) or the flag is set. memo:
    kopf's memo, given `release_leadership`, which the cleanup handler calls as soon as kopf's handlers have
    stopped (handlers.on_cleanup); the release after kopf returns is then a no-op."""
    from kubelora.operator.metrics import METRICS

    if election is None:
        METRICS.set_leader(True)
        await operator()
        return 0
    from kubelora.operator.leader import LeaderElector

    connection = await asyncio.to_thread(load_connection)
    async with aiohttp.ClientSession() as session:
        # Each election request times out within a retry period: a hung call must not keep a leader that
        # cannot renew.
        elector = LeaderElector(election, Kube(connection, session, timeout_s=election.retry_period_s))
        return await _operate_elected(operator, elector, liveness_port, memo)


async def _operate_elected(operator, elector, liveness_port: int | None, memo: dict | None) -> int:
    from kubelora.operator.leader import stand_by
    from kubelora.operator.metrics import METRICS

    election = elector.settings
    elector.start()
    try:
        METRICS.set_leader(False)
        if not await stand_by(elector, liveness_port):
            return 0
        METRICS.set_leader(True)
        if memo is not None:
            memo["release_leadership"] = elector.release
        await operator(stop_flag=elector.lost)
        if elector.lost.is_set() and not elector.is_released:  # released on purpose: renewals stop, no loss
            log.error("lost the Lease %s/%s: exiting so that this pod restarts as a standby", election.namespace,
                      election.lease_name)
            return 1
        return 0
    finally:
        METRICS.set_leader(False)
        if await elector.release():  # a standby takes over at its next retry, not after the lease runs out
            log.info("released the Lease %s/%s", election.namespace, election.lease_name)
