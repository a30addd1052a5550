#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from the
# pinned release in this module, in ONE `go build` so the five binaries share compiled
# packages (the build is CPU-bound: ~2 cores in CI). Output: $1 (a bin directory).
# Why these flags: -trimpath/-s -w shrink the link step; CGO_ENABLED=0 needs no C toolchain;
# -mod=mod lets a fresh machine fill its module cache from the proxy using our go.sum.
set -euo pipefail
out="${1:?usage: build.sh BIN_DIR}"
kube_version="${KUBE_VERSION:?KUBE_VERSION must be set}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PATH="/usr/local/go/bin:$PATH" CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
minor="${kube_version#v1.}"; minor="${minor%%.*}"
# Without these stamps every binary reports v0.0.0-master and kubectl warns about skew.
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
tmp="$out.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp"
# The compile cache (4.5 GB for these five) only serves a rebuild of the same release, and the binaries are
# cached by release already (e2e/localcluster/build.py): it lives in a temporary directory, removed afterwards.
export GOCACHE="$out.gocache.$$"
trap 'rm -rf "$GOCACHE"' EXIT
cd "$here"
go build -trimpath -ldflags "-s -w$stamp" -o "$tmp/" tool
# go names the binary of go.etcd.io/etcd/server/v3 after "server".
mv "$tmp/server" "$tmp/etcd"
rm -rf "$out" && mv "$tmp" "$out"
