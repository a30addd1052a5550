#!/usr/bin/env bash
# Builds helm from its Go module (get.helm.sh is not reachable here) into a cache outside the repo:
#   ~/.cache/kubelora/helm/$HELM_VERSION/bin/helm   (KUBELORA_CACHE moves the root)
# Prints the binary's path on the last line of stdout; a cached binary costs nothing.
# Why these flags: -trimpath/-s -w shrink the link step; CGO_ENABLED=0 needs no C toolchain;
# -mod=mod lets a fresh machine fill its module cache from the proxy using our go.sum.
# To move to another release: change HELM_VERSION here and the require in go.mod, then `go mod tidy`.
set -euo pipefail
HELM_VERSION=v3.22.0
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin_dir="${KUBELORA_CACHE:-$HOME/.cache/kubelora}/helm/$HELM_VERSION/bin"
if [[ -x "$bin_dir/helm" ]]; then
  echo "helm $HELM_VERSION cached in $bin_dir" >&2
  echo "$bin_dir/helm"
  exit 0
fi
export PATH="/usr/local/go/bin:$PATH" CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
# Without the stamp `helm version` reports the bare minor (v3.22) and no commit state.
stamp="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
stamp+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
started=$(date +%s)
tmp="$bin_dir.tmp.$$"
log="$(dirname "$bin_dir")/build.log"
rm -rf "$tmp" && mkdir -p "$tmp"
echo "building helm $HELM_VERSION from the Go module proxy (about a minute on 2 cores; log: $log)" >&2
# Progress while the build runs: a line every 30 s.
( while sleep 30; do echo "  helm: still building, $(( $(date +%s) - started )) s" >&2; done ) &
ticker=$!
# The compile cache only serves a rebuild of the same release, which the cached binary makes moot: temporary.
export GOCACHE="$bin_dir.gocache.$$"
trap 'kill "$ticker" 2>/dev/null; rm -rf "$tmp" "$GOCACHE"' EXIT
cd "$here"
if ! go build -trimpath -ldflags "-s -w $stamp" -o "$tmp/" tool >"$log" 2>&1; then
  echo "helm $HELM_VERSION: the build failed after $(( $(date +%s) - started )) s; the end of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
rm -rf "$bin_dir" && mv "$tmp" "$bin_dir"
echo "helm $HELM_VERSION built in $(( $(date +%s) - started ))s into $bin_dir" >&2
echo "$bin_dir/helm"
