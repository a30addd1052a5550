"""Pictures of the dashboard's rows for docs/monitoring.md, drawn with matplotlib from a real Prometheus's series.

`python -P -m kubelora.cli.dashboard_plots SERIES.json [OUT_DIR]` writes one PNG per dashboard row (default
docs/images/dashboard/<row>.png). SERIES.json is what the monitoring e2e test exports when
`KUBELORA_DASHBOARD_SERIES` names a path (tests/test_chart/test_monitoring_prometheus.py): for each row, each panel's
queries as Prometheus's `query_range` answered them, with Grafana's variables filled in:

    {"rows": [{"title": "Adapters", "panels": [{"title": ..., "unit": ..., "series": [
        {"legend": "t0 waiting", "points": [[unix_s, value], ...]}, ...]}]}]}

These are plots of the panels' data, not Grafana's rendering of them. matplotlib is not a dependency of the
package: `pip install matplotlib` to draw them.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images" / "dashboard"
COLUMNS = 2  # as the dashboard lays them out: two panels a row
UNITS = {"s": "seconds", "percentunit": "fraction", "bytes": "bytes", "reqps": "per second", "ops": "per second"}


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: `{{label}}` replaced by the series' label value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def plot_row(row: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    panels = row["panels"]
    num_rows = math.ceil(len(panels) / COLUMNS)
    figure, axes = pyplot.subplots(num_rows, COLUMNS, figsize=(12, 3.2 * num_rows), squeeze=False)
    start = min((p[0] for panel in panels for s in panel["series"] for p in s["points"]), default=0.0)
    for ax, panel in zip(axes.flat, panels):
        for series in panel["series"]:
            times = [t - start for t, _ in series["points"]]
            ax.plot(times, [v for _, v in series["points"]], label=series["legend"], linewidth=1.2)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.set_ylabel(UNITS.get(panel["unit"], ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if panel["series"]:
            ax.legend(fontsize=6, ncol=2, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    figure.suptitle(row["title"], fontsize=12)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -P -m kubelora.cli.dashboard_plots SERIES.json [OUT_DIR]", file=sys.stderr)
        return 2
    out_dir = Path(args[1]) if len(args) > 1 else DOCS_IMAGES
    for row in json.loads(Path(args[0]).read_text())["rows"]:
        print(plot_row(row, out_dir / f"{row['title'].lower()}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
