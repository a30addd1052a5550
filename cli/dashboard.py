"""kubelora's Grafana dashboard, built in code with Grafana's foundation SDK (extra `dashboards`).

`python -P -m kubelora.cli.dashboard [PATH]` writes it (default: the chart's dashboards/kubelora.json, which the
chart's ConfigMap carries for Grafana's sidecar); tests/test_chart/test_dashboard.py checks the committed file
equals this output. Only this generator needs the SDK: the chart carries JSON, the operator image neither.

Every query selects by the `$namespace` and `$pool` variables: engine and router series carry the pod's
`kubelora.io/pool` as `kubelora_io_pool` (the chart's ServiceMonitor and PodMonitor), the operator's carry `pool`.
Rates use `$__rate_interval`, so a panel is right at any scrape interval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

CHART_DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "kubelora" / "dashboards" / "kubelora.json"
UID = "kubelora"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
ENGINE = 'namespace=~"$namespace", kubelora_io_pool=~"$pool"'  # engine and router series
ADAPTER = ENGINE + ', adapter=~"$adapter"'
OPERATOR = 'namespace=~"$namespace", pool=~"$pool"'
RATE = "[$__rate_interval]"
WIDTH, HEIGHT = 12, 8  # two panels a row, of Grafana's 24 columns


def query(expr: str, legend: str, *, is_table: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)
    return q.instant().format("table") if is_table else q.range()


def graph(title: str, unit: str, *queries: prometheus.Dataquery, description: str = "") -> timeseries.Panel:
    # A table legend with the last and the highest value: with one series per adapter, the worst is one sort away.
    legend = (common.VizLegendOptions().display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.BOTTOM)
              .show_legend(True).calcs(["lastNotNull", "max"]))
    tooltip = common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)
    panel = (timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(HEIGHT).span(WIDTH)
             .description(description).legend(legend).tooltip(tooltip))
    for i, q in enumerate(queries):
        panel = panel.with_target(q.ref_id(chr(ord("A") + i)))
    return panel


def quantiles(metric: str, selector: str, by: str) -> list[prometheus.Dataquery]:
    """p50 and p99 of a histogram, per `by`."""
    return [query(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}{RATE})))",
                  f"{{{{{by}}}}} p{int(q * 100)}") for q in (0.5, 0.99)]


def adapter_panels() -> list:
    host_loads = f"sum by (adapter) (rate(kubelora_adapter_host_load_seconds_count{{{ADAPTER}}}{RATE}))"
    explicit_loads = f"sum by (adapter) (rate(kubelora_adapter_load_seconds_count{{{ADAPTER}}}{RATE}))"
    return [
        graph("Residency: pods holding the adapter, by tier", "short",
              query(f"sum by (adapter, tier) (kubelora_adapter_residency{{{ADAPTER}}})", "{{adapter}} {{tier}}"),
              description="device: in the GPU adapter pool; host: a staged copy in memory; known: registered only"),
        graph("Requests running and waiting", "short",
              query(f"sum by (adapter) (kubelora_requests_running{{{ADAPTER}}})", "{{adapter}} running"),
              query(f"sum by (adapter) (kubelora_requests_waiting{{{ADAPTER}}})", "{{adapter}} waiting")),
        graph("Time to first token", "s", *quantiles("kubelora_time_to_first_token_seconds", ADAPTER, "adapter")),
        graph("Time per output token", "s",
              *quantiles("kubelora_time_per_output_token_seconds", ADAPTER, "adapter")),
        graph("Tokens per second", "short",
              query(f"sum by (adapter) (rate(kubelora_generation_tokens_total{{{ADAPTER}}}{RATE}))",
                    "{{adapter}} generated"),
              query(f"sum by (adapter) (rate(kubelora_prompt_tokens_total{{{ADAPTER}}}{RATE}))",
                    "{{adapter}} prompt")),
        graph("Loads and on-demand misses", "ops",
              query(explicit_loads, "{{adapter}} loads (operator)"),
              query(f"{host_loads} - ({explicit_loads} or {host_loads} * 0)", "{{adapter}} on-demand misses"),
              description="on-demand misses: host loads the engine made for a request, beyond the explicit ones"),
    ]


def pool_panels() -> list:
    return [
        graph("Distinct adapters per batch", "short",
              query(f"max by (pod) (kubelora_batch_adapters{{{ENGINE}}})", "{{pod}}"),
              description="the table beside it gives each pod's limit (vLLM's max_lora)"),
        table.Panel().title("Distinct adapters a batch can hold (max_lora)").datasource(DATASOURCE)
        .height(HEIGHT).span(WIDTH)
        .with_target(query(f"max by (pod, max_lora) (vllm:lora_requests_info{{{ENGINE}}})", "", is_table=True)
                     .ref_id("A")),
        graph("KV cache use", "percentunit",
              query(f"max by (pod) (kubelora_kv_cache_usage_ratio{{{ENGINE}}})", "{{pod}}")),
        graph("Adapter pool use", "percentunit",
              query(f'sum by (pod) (kubelora_adapter_pool_bytes{{{ENGINE}, state="used"}}) '
                    f"/ sum by (pod) (kubelora_adapter_pool_bytes{{{ENGINE}}})", "{{pod}} device"),
              description="device: the GPU adapter pool's used bytes over its size"),
        graph("Evictions", "ops",
              query(f"sum by (pod, tier) (rate(kubelora_adapter_evictions_total{{{ENGINE}}}{RATE}))",
                    "{{pod}} {{tier}}")),
        graph("Adapter loads and failures", "ops",
              query(f"sum by (pod) (rate(kubelora_adapter_loads_total{{{ENGINE}}}{RATE}))", "{{pod}} loads"),
              query(f"sum by (pod) (rate(kubelora_adapter_load_failures_total{{{ENGINE}}}{RATE}))",
                    "{{pod}} failures")),
    ]


def router_panels() -> list:
    return [
        graph("Router placement age", "s",
              query(f"max by (pod) (kubelora_router_placement_age_seconds{{{ENGINE}}})", "{{pod}}"),
              description="since the router last read its placement; over a minute alerts"),
        graph("Router errors", "ops",
              query(f"sum by (pod, kind) (rate(kubelora_router_upstream_errors_total{{{ENGINE}}}{RATE}))",
                    "{{pod}} upstream {{kind}}"),
              query(f"sum by (code) (rate(kubelora_router_rejected_requests_total{{{ENGINE}}}{RATE}))",
                    "rejected {{code}}"),
              query(f"sum by (pod) (rate(kubelora_router_placement_read_failures_total{{{ENGINE}}}{RATE}))",
                    "{{pod}} placement reads failed")),
    ]


def operator_panels() -> list:
    return [
        graph("Operator pass duration", "s",
              *quantiles("kubelora_operator_reconcile_duration_seconds", OPERATOR, "pool")),
        graph("Operator passes, errors and engine calls", "ops",
              query(f"sum by (pool) (rate(kubelora_operator_reconcile_passes_total{{{OPERATOR}}}{RATE}))",
                    "{{pool}} passes"),
              query(f"sum by (pool) (rate(kubelora_operator_reconcile_errors_total{{{OPERATOR}}}{RATE}))",
                    "{{pool}} errors"),
              query(f"sum by (pool, call, result) (rate(kubelora_operator_engine_calls_total{{{OPERATOR}}}{RATE}))",
                    "{{pool}} {{call}} {{result}}")),
        graph("Adapters by phase", "short",
              query(f"sum by (pool, phase) (kubelora_operator_adapters{{{OPERATOR}}})", "{{pool}} {{phase}}")),
    ]


def variables() -> list:
    def labels(name: str, label: str, metric: str, selector: str) -> dashboard.QueryVariable:
        return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE)
                .query(f"label_values({metric}{{{selector}}}, {label if name != 'pool' else 'kubelora_io_pool'})")
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*"))

    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        labels("namespace", "namespace", "kubelora_requests_running", ""),
        labels("pool", "pool", "kubelora_requests_running", 'namespace=~"$namespace"'),
        labels("adapter", "adapter", "kubelora_requests_running", ENGINE),
    ]


def build_dashboard() -> dict:
    board = (dashboard.Dashboard("kubelora").uid(UID).tags(["kubelora", "lora"]).refresh("30s")
             .time("now-1h", "now").timezone("browser").editable())
    for variable in variables():
        board = board.with_variable(variable)
    for title, panels in (("Adapters", adapter_panels()), ("Pool", pool_panels()), ("Routers", router_panels()),
                          ("Operator", operator_panels())):
        board = board.with_row(dashboard.Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else CHART_DASHBOARD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
