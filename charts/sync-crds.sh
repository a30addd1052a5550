#!/usr/bin/env bash
# Copies the CRDs from crds/ (the single hand-edited source) into the chart's crds/ folder, byte for byte.
# Helm installs charts/kubelora/crds/*.yaml before the templates and never templates them.
# tests/test_chart/test_crds_in_sync.py fails when the copies drift: run this after editing crds/.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$repo/crds"
dst="$repo/charts/kubelora/crds"
mkdir -p "$dst"
rm -f "$dst"/*.yaml
cp "$src"/*.yaml "$dst"/
echo "synced $(ls "$src"/*.yaml | wc -l) CRDs from crds/ into charts/kubelora/crds/"
