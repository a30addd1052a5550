#!/usr/bin/env bash
# The prometheus-operator CRDs the chart's monitoring objects are instances of (ServiceMonitor, PodMonitor,
# PrometheusRule), taken from prometheus-operator's Go module through the Go module proxy (github.com and its
# release assets are not reachable here) into a cache outside the repo:
#   ~/.cache/kubelora/prometheus-operator/$VERSION/crds/monitoring.coreos.com_*.yaml   (KUBELORA_CACHE moves the root)
# Prints the folder on the last line of stdout; cached files cost nothing.
# The module's checksum is pinned (SUM, the go.sum h1: hash) on top of go's own check against sum.golang.org.
# To move to another release: change VERSION and SUM (`go mod download -json <module>@<version>` prints both).
set -euo pipefail
MODULE=github.com/prometheus-operator/prometheus-operator
VERSION=v0.85.0
SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
KINDS=(servicemonitors podmonitors prometheusrules)
dir="${KUBELORA_CACHE:-$HOME/.cache/kubelora}/prometheus-operator/$VERSION/crds"
if [[ -f "$dir/monitoring.coreos.com_prometheusrules.yaml" ]]; then
  echo "prometheus-operator $VERSION CRDs cached in $dir" >&2
  echo "$dir"
  exit 0
fi
export PATH="/usr/local/go/bin:$PATH" GOFLAGS=-mod=mod
started=$(date +%s)
tmp="$dir.tmp.$$"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
echo "downloading $MODULE@$VERSION from the Go module proxy for its CRDs (a few MB)" >&2
source "$(dirname "$0")/gomodule.sh"
source="$(module_dir "$MODULE" "$VERSION" "$SUM" "$tmp")"
for kind in "${KINDS[@]}"; do
  cp "$source/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$tmp/"
done
chmod 644 "$tmp"/*.yaml
rm -rf "$dir" && mv "$tmp" "$dir"
echo "prometheus-operator $VERSION CRDs (${KINDS[*]}) cached in $dir in $(( $(date +%s) - started )) s" >&2
echo "$dir"
