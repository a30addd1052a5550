#!/usr/bin/env bash
# `make images`: builds the kubelora images without pulling from any container registry.
#  1. a base rootfs from Debian packages (mmdebstrap: bookworm, python3 + venv, ca-certificates), imported into
#     a private podman store and tagged localhost/kubelora-base:bookworm (built once, then cached);
#  2. podman build of images/<name>/Dockerfile with --build-arg BASE=<that tag> and --pull=never;
#  3. podman save into build/images/<name>.tar (load with `podman load -i` or `docker load -i`).
# Podman runs with vfs storage and the runc runtime (no overlay or fuse needed) and a private containers.conf
# with `default_ulimits = []`: podman's default ulimits fail where the caller's hard limits are lower.
# Env: KUBELORA_IMAGES (names, default all three), KUBELORA_CACHE (default ~/.cache/kubelora),
# KUBELORA_DEBIAN_MIRROR, KUBELORA_REBASE=1 (rebuild the base). docs/chart.md says more.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KUBELORA_CACHE:-$HOME/.cache/kubelora}/podman"
out="$repo/build/images"
mirror="${KUBELORA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
read -r -a names <<<"${KUBELORA_IMAGES:-kubelora-operator kubelora-router kubelora-engine}"
base=localhost/kubelora-base:bookworm
version="$(python3 -c 'import tomllib, sys; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$repo/pyproject.toml")"
revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || true)"
source_url="$(git -C "$repo" remote get-url origin 2>/dev/null || true)"

say() { printf '[images %(%H:%M:%S)T] %s\n' -1 "$*"; }

missing=()
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
if ((${#missing[@]})); then
  say "installing ${missing[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

mkdir -p "$cache/config" "$out"
cat >"$cache/config/containers.conf" <<'CONF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF="$cache/config/containers.conf"
podman=(podman --storage-driver vfs --root "$cache/storage" --runroot "$cache/run" --runtime runc)

if [[ "${KUBELORA_REBASE:-0}" == 1 ]] || ! "${podman[@]}" image exists "$base"; then
  say "building the base rootfs from Debian packages ($mirror, bookworm)"
  rootfs="$cache/base-bookworm.tar"
  # Docs, man pages, locales and glibc's iconv modules (Python has its own codecs) are dropped at unpack time;
  # the essential variant has no apt, so no package lists or caches.
  # The merged-usr hook sets up bookworm's /usr layout itself, so the usrmerge package (and the 50 MB of perl
  # it depends on) stays out.
  mmdebstrap --variant=essential --include=python3,python3-venv,ca-certificates \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*' \
    bookworm "$rootfs" "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main"
  "${podman[@]}" import --change 'CMD ["/bin/sh"]' "$rootfs" "$base" >/dev/null
  rm -f "$rootfs"
fi

# The host's CA bundle is mounted over the builder's for RUN steps only (volumes are never committed), so pip
# works behind a TLS-inspecting proxy; KUBELORA_BUILD_CA names another bundle.
ca="${KUBELORA_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
ca_volume=()
[[ -f "$ca" ]] && ca_volume=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")

for name in "${names[@]}"; do
  tag="localhost/$name:$version"
  say "building $tag"
  start=$SECONDS
  # --network host: pip in the builder stage reaches the package index; nothing is pulled (--pull=never).
  "${podman[@]}" build --pull=never --network host --layers=false "${ca_volume[@]}" -f "$repo/images/$name/Dockerfile" \
    --build-arg "BASE=$base" --build-arg "VERSION=$version" --build-arg "SOURCE=$source_url" \
    --build-arg "REVISION=$revision" -t "$tag" "$repo"
  rm -f "$out/$name.tar"
  "${podman[@]}" save --format docker-archive -o "$out/$name.tar" "$tag"
  size="$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")"
  say "$name: $((size / 1000000)) MB image, $(($(stat -c %s "$out/$name.tar") / 1000000)) MB archive, $((SECONDS - start)) s"
done
