#!/usr/bin/env bash
# Builds the prometheus server the monitoring e2e test runs (tests/test_chart/test_monitoring_prometheus.py) from
# its Go module, into a cache outside the repo:
#   ~/.cache/kubelora/prometheus/$VERSION/bin/prometheus   (KUBELORA_CACHE moves the root)
# Prints the binary's path on the last line of stdout; a cached binary costs nothing.
# Why not Debian's `prometheus` package (which the alert unit tests' promtool comes from): Debian builds it without
# the Kubernetes service discovery, and the test discovers the cluster's pods through the API server.
# How: upstream's own go.mod and go.sum pin every dependency (the module as the proxy serves it, its checksum pinned
# here too); the build tags keep Kubernetes as the only service discovery besides file and http, so only the
# modules those need are downloaded (remove_all_sd, enable_kubernetes_sd: plugins/plugin_*.go). The web UI's
# assets are not in the module (npm builds them); the HTTP API the test uses needs none.
# To move to another release: change VERSION (the module's v0.3MM.P is Prometheus 3.MM.P) and SUM
# (`go mod download -json github.com/prometheus/prometheus@<version>` prints it).
set -euo pipefail
MODULE=github.com/prometheus/prometheus
VERSION=v0.316.0
SUM="h1:f1GRFerhTMKQma+awCoC9T820ecWeGSdF+xAlMHzZzM="
bin_dir="${KUBELORA_CACHE:-$HOME/.cache/kubelora}/prometheus/$VERSION/bin"
if [[ -x "$bin_dir/prometheus" ]]; then
  echo "prometheus $VERSION cached in $bin_dir" >&2
  echo "$bin_dir/prometheus"
  exit 0
fi
export PATH="/usr/local/go/bin:$PATH" CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
started=$(date +%s)
tmp="$bin_dir.tmp.$$"
log="$(dirname "$bin_dir")/build.log"
rm -rf "$tmp" && mkdir -p "$tmp"
# The compile cache only serves a rebuild of the same release, which the cached binary makes moot: temporary,
# unless the caller set GOCACHE.
scratch=
if [[ -z "${GOCACHE:-}" ]]; then
  scratch="$bin_dir.gocache.$$"
  export GOCACHE="$scratch"
fi
ticker=
trap 'kill $ticker 2>/dev/null; rm -rf "$tmp" $scratch' EXIT
echo "building prometheus $VERSION from the Go module proxy (minutes on 2 cores; log: $log)" >&2
source "$(dirname "$0")/../gomodule.sh"
source="$(module_dir "$MODULE" "$VERSION" "$SUM" "$tmp")"
# Progress while the build runs: a line every 30 s.
( while sleep 30; do echo "  prometheus: still building, $(( $(date +%s) - started )) s" >&2; done ) &
ticker=$!
release="$(cat "$source/VERSION")"
stamp="-X github.com/prometheus/common/version.Version=$release -X github.com/prometheus/common/version.Branch=HEAD"
if ! (cd "$source" && go build -trimpath -tags remove_all_sd,enable_kubernetes_sd -ldflags "-s -w $stamp" \
      -o "$tmp/prometheus" ./cmd/prometheus) >"$log" 2>&1; then
  echo "prometheus $VERSION: the build failed after $(( $(date +%s) - started )) s; the end of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
rm -rf "$bin_dir" && mv "$tmp" "$bin_dir"
echo "prometheus $VERSION built in $(( $(date +%s) - started )) s into $bin_dir" >&2
echo "$bin_dir/prometheus"
