"""The operator benchmark's tables, its targets and the markdown report."""

from __future__ import annotations

import statistics
import textwrap
from typing import TYPE_CHECKING

from kubelora.bench.router_keys_report import format_table, percentile

if TYPE_CHECKING:
    from kubelora.bench.operator import OperatorReport
    from kubelora.bench.operator_measure import PhaseResult

MAX_SINGLE_P50_S = 1.0  # one adapter into a steady fleet, create -> Ready
MIB = 2**20
PHASE_COLUMNS = ("phase", "adapters", "wall s", "all done s", "per adapter p50 / p90 / max s", "passes (whole)",
                 "mean pass s", "engine calls: preload / register / unload", "GETs per pod per whole pass",
                 "operator CPU s", "operator cores", "operator RSS MiB")
CPU_COLUMNS = ("phase", "operator", "kube-apiserver", "etcd", "fake engines", "routers")
TARGET_COLUMNS = ("target", "measured", "verdict")
ANATOMY_COLUMNS = ("part of a pass", "seconds", "what")


def phase(report: OperatorReport, name: str) -> PhaseResult:
    return next(p for p in report.phases if p.name == name)


def gets_per_pass(result: PhaseResult) -> str:
    """The pods' plain model lists over the phase's whole passes (a pass for changed adapters reads none): 'n' when
    every pod has the same ratio, else a range."""
    if not result.whole_passes:
        return "-"
    ratios = sorted({count / result.whole_passes for count in result.calls.lists.values()})
    return f"{ratios[0]:.2f}" if len(ratios) == 1 else f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def spread_s(times: tuple[float, ...]) -> str:
    if not times:
        return "-"
    return f"{percentile(times, 50):.2f} / {percentile(times, 90):.2f} / {max(times):.2f}"


def phase_row(result: PhaseResult) -> dict[str, str]:
    calls = result.calls
    operator_cpu = result.cpu_s.get("operator", 0.0)
    done = "-" if result.all_done_s is None else f"{result.all_done_s:.1f}"
    if result.all_unloaded_s is not None:
        done += f" (unloaded {result.all_unloaded_s:.1f})"
    values = (result.name, str(result.num_adapters), f"{result.wall_s:.1f}", done, spread_s(result.times_s),
              f"{result.passes} ({result.whole_passes})",
              f"{result.pass_seconds / result.passes:.2f}" if result.passes else "-",
              f"{calls.preloads} / {calls.registrations} / {calls.unloads}", gets_per_pass(result),
              f"{operator_cpu:.1f}", f"{operator_cpu / result.window_s:.2f}" if result.window_s else "-",
              f"{result.operator_memory.rss_bytes / MIB:.0f}")
    return dict(zip(PHASE_COLUMNS, values))


def cpu_row(result: PhaseResult) -> dict[str, str]:
    def seconds(*prefixes: str) -> str:
        total = sum(v for k, v in result.cpu_s.items() if k.startswith(prefixes))
        return f"{total:.1f}"

    return dict(zip(CPU_COLUMNS, (result.name, seconds("operator"), seconds("kube-apiserver"), seconds("etcd"),
                                  seconds("fake-engines"), seconds("router-"))))


def one_call_each(result: PhaseResult, num_pods: int) -> tuple[str, bool]:
    """Whether every (pod, adapter) of the phase got exactly one engine call and no other adapter got any."""
    calls = result.calls
    wanted = result.num_adapters * num_pods
    is_met = calls.pairs_once == wanted and calls.other_calls == 0 and calls.engine_calls == wanted
    text = (f"{calls.engine_calls} calls for {result.num_adapters} adapters x {num_pods} pods: {calls.pairs_once} "
            f"pairs with one call, {calls.pairs_repeated} with more, {calls.pairs_missing} with none; "
            f"{calls.other_calls} calls for other adapters")
    return text, is_met


def verdict(is_met: bool) -> str:
    return "met" if is_met else "MISSED"


def target_rows(report: OperatorReport) -> list[dict[str, str]]:
    config = report.config
    singles, steady = phase(report, "singles"), phase(report, "steady")
    bulk_apply, bulk_delete = phase(report, "bulk-apply"), phase(report, "bulk-delete")
    p50 = statistics.median(singles.times_s)
    rows = [(f"one adapter into a steady fleet of {config.num_adapters}: create -> Ready p50 <= "
             f"{MAX_SINGLE_P50_S:g} s", f"p50 {p50:.2f} s over {len(singles.times_s)} (p90 / max "
             f"{percentile(singles.times_s, 90):.2f} / {max(singles.times_s):.2f} s)",
             verdict(p50 <= MAX_SINGLE_P50_S))]
    done = sum(1 for _ in bulk_apply.times_s)
    rows.append((f"a bulk apply of {config.num_bulk}: all Ready within a reported time",
                 f"{done} of {config.num_bulk} Ready {bulk_apply.all_done_s:.1f} s after the first create",
                 "reported"))
    for result, wanted in ((steady, "one GET /v1/models per pod per pass"),
                           (singles, "one GET /v1/models per pod per whole pass, none in a pass for changed adapters")):
        counts = set(result.calls.lists.values())
        is_met = result.whole_passes > 0 and counts == {result.whole_passes}
        if result is steady:
            is_met = is_met and result.whole_passes == result.passes
        rows.append((f"{result.name}: {wanted}",
                     f"passes: {result.passes}, {result.whole_passes} whole; GETs per pod: {min(counts)}-{max(counts)} "
                     f"({gets_per_pass(result)} per whole pass); engine calls: {result.calls.engine_calls}",
                     verdict(is_met)))
    for result in (bulk_apply, bulk_delete):
        text, is_met = one_call_each(result, config.num_replicas)
        rows.append((f"{result.name} of {config.num_bulk}: one engine call per adapter and pod", text,
                     verdict(is_met)))
    rows.append((f"a bulk delete of {config.num_bulk}: gone, and unloaded from every pod, within a reported time",
                 f"gone from the API server {bulk_delete.all_done_s:.1f} s after the first delete, unloaded from "
                 f"every pod {bulk_delete.all_unloaded_s:.1f} s after it", "reported"))
    fill = phase(report, "fill")
    rows.append(("operator CPU and memory reported",
                 f"steady {steady.cpu_s.get('operator', 0.0) / steady.window_s:.3f} cores, fill "
                 f"{fill.cpu_s.get('operator', 0.0):.1f} CPU s; RSS {steady.operator_memory.rss_bytes / MIB:.0f} MiB "
                 f"steady, peak {report.operator_peak_rss_bytes / MIB:.0f} MiB", "reported"))
    return [dict(zip(TARGET_COLUMNS, row)) for row in rows]


def anatomy_rows(report: OperatorReport) -> list[dict[str, str]]:
    a, steady = report.anatomy, phase(report, "steady")
    parts = a.list_adapters_s + a.observe_s + a.plan_s
    rows = [("list the pool's LoRAAdapters", a.list_adapters_s, f"{a.num_adapters} objects with their status"),
            ("observe every pod (`observe_pool`)", a.observe_s,
             f"{a.num_pods} `GET /v1/models` at once; one pod's list is {a.model_list_bytes / 1e6:.2f} MB of JSON, "
             f"{1e3 * a.model_list_parse_s:.0f} ms to parse"),
            ("decide (`decide.plan_pass`)", a.plan_s, "classify, place, plan the calls"),
            ("the three together", parts, "timed in the bench's process, each the fastest of 3 rounds"),
            ("decide for one changed adapter (`plan_pass` with a `Change`)", a.plan_change_s,
             "classify it, place the whole pool, plan its calls; a pass for changed adapters reads nothing else")]
    if steady.passes:
        cpu = steady.cpu_s.get("operator", 0.0) / steady.passes
        rows.append(("a whole steady pass, as the operator ran it", steady.pass_seconds / steady.passes,
                     f"its metrics' mean over {steady.passes}; the operator's CPU {cpu:.2f} s per pass (kopf "
                     "and the long polls included)"))
    return [dict(zip(ANATOMY_COLUMNS, (part, f"{seconds:.2f}", what))) for part, seconds, what in rows]


ANATOMY_TEXT = (
    "A whole pass reads and decides over the whole pool: every adapter object, every pod's full model list (one "
    "card per adapter), then placement and a plan for every (pod, adapter). The operator makes one every resync "
    "and on any trigger but an adapter's own events. One adapter applied into a steady fleet gets a pass for "
    "changed adapters instead (operator/decide.py, `Change`): it waits for the trigger's debounce (0.2 s after the "
    "create's last event), reads that adapter's object, decides from what the last pass left (its observation "
    "with its calls applied), places the whole pool and plans that adapter's calls; the watch event that shows it "
    "Ready comes at the end of that pass, after the placement is published, the routers have taken it and its "
    "status is written. Its own loads then move every pod's adapter-set tag: each pod's long poll answers with its "
    "full model list, which the watcher reads for the tag alone (operator/watch.py), and a whole pass follows, "
    "which finds nothing to do. Below, the reading and deciding parts of a pass, timed on the steady fleet with the "
    "operator's own functions.")


def _paragraph(text: str) -> list[str]:
    return [*textwrap.wrap(text, 115, break_on_hyphens=False), ""]  # a hyphen at a line's end reads as "- "


def render_markdown(report: OperatorReport) -> str:
    config = report.config
    routers = (f"{config.num_routers} real `kubelora router` process{'es' if config.num_routers > 1 else ''} "
               "(the Deployment's args, the bench's admin kubeconfig instead of a ServiceAccount token), reading the "
               "placement ConfigMap and answering the operator's placement acknowledgements as in a cluster"
               if config.num_routers else "none (the pool has no router)")
    resync = "30 s (the default)" if config.resync_s is None else f"{config.resync_s:g} s"
    text = [
        f"# Operator benchmark: {config.num_replicas} engine pods x {config.num_adapters} adapters against a real "
        "API server", "",
        *_paragraph("Written by `kubelora bench operator --write docs/benchmarks-operator.md` (`bench/operator.py`). "
                    "The operator runs as its CLI runs it (`kubelora operator --namespace bench --metrics-port P`) "
                    "against the bench's own etcd and kube-apiserver (e2e/localcluster's binaries; no "
                    "controller-manager, scheduler or kubelet). The bench makes the engine and router pods from the "
                    "Deployments the operator applies and marks them Ready on loopback addresses. Engine pods are "
                    "stood in by fake engines, a test double (`bench/operator_engines.py`): the engine's own admin "
                    "HTTP layer (model list with `ETag` and long poll, load, unload, API key table, admin token, "
                    "error middleware, request parsers, local source confinement) over a stand-in adapter manager "
                    "that reads no weights, all in one process; the real engine is covered by the e2e tests. "
                    f"Routers: {routers}."),
        *_paragraph("Times are the bench's clock: from just before a create (or delete) request to the arrival of "
                    "the watch event that shows the adapter Ready (or deleted); status conditions carry one-second "
                    "timestamps only. Calls are counted at the fakes; passes and their durations are the operator's "
                    "own metrics; CPU is each process's CPU clock (every thread); RSS is the operator's at the end "
                    "of each phase. A phase's readings end once the operator has been quiet (no pass ended, no "
                    f"model list, load or unload at the fakes) for {config.settle_s:g} s after its action, so that "
                    "the passes it caused end inside them; each single starts after as much quiet."),
        *[f"- {k}: {v}" for k, v in report.env.items()],
        f"- shapes: {config.num_replicas} engine pods, {config.num_adapters} adapters in the steady fleet "
        f"(`replicas: {config.copies}`, rank {config.rank}), {config.num_singles} singles "
        f"one by one, a bulk of {config.num_bulk} created then deleted at once; "
        f"engine `maxLoras` {config.max_loras}, `maxLoraRank` {config.max_lora_rank}, `maxCpuLoras` "
        f"{config.max_cpu_loras}; operator resync {resync}; the bench keeps {config.create_concurrency} API "
        "requests in flight",
        f"- setup (API server up to the pool Ready with its pods, before any adapter): {report.setup_s:.1f} s", "",
    ]
    if report.note:
        text += _paragraph(report.note)
    text += ["## Targets", "", format_table(TARGET_COLUMNS, target_rows(report)), "",
             "## One pass, in parts", "", *_paragraph(ANATOMY_TEXT),
             format_table(ANATOMY_COLUMNS, anatomy_rows(report)), "",
             "## Phases", "", format_table(PHASE_COLUMNS, [phase_row(p) for p in report.phases]), "",
             "CPU seconds per phase, by process:", "",
             format_table(CPU_COLUMNS, [cpu_row(p) for p in report.phases]), ""]
    return "\n".join(text)
