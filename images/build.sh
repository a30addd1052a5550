#!/usr/bin/env bash
# `make images`: builds the kubelora images without pulling from any container registry.
#  1. a base rootfs from Debian packages (mmdebstrap: bookworm, python3 + venv, ca-certificates), imported into
#     a private podman store and tagged localhost/kubelora-base:bookworm (built once, then cached);
#  2. the deps stage of images/<name>/Dockerfile (the venv with the dependencies, minutes for the engine), built
#     with --target deps and tagged localhost/<name>-deps:<digest of the stage, pyproject.toml, constraints.txt,
#     base> (images/inputs_digest.py --deps), kept in the store while those inputs stay the same;
#  3. podman build of the Dockerfile with --build-arg BASE=<that tag> and --pull=never, its final stage's
#     `FROM deps` naming that image: a code change rebuilds only the builder stage and the project's layer;
#  4. podman save into build/images/<name>.tar (load with `podman load -i` or `docker load -i`).
# Podman runs with the runc runtime and a private containers.conf with `default_ulimits = []` (podman's default
# ulimits fail where the caller's hard limits are lower), on overlay storage where the kernel mounts overlayfs
# over the cache's filesystem (as root), else on vfs, which needs neither overlayfs nor fuse.
# An image is rebuilt only when its inputs changed (images/inputs_digest.py: Dockerfile, build context, base),
# and then on its cached deps stage unless pyproject.toml, constraints.txt or the base changed too.
# Env: KUBELORA_IMAGES (names, default both), KUBELORA_CACHE (default ~/.cache/kubelora),
# KUBELORA_DEBIAN_MIRROR, KUBELORA_REBASE=1 (rebuild the bases), KUBELORA_IMAGES_FORCE=1 (rebuild the images),
# KUBELORA_STORAGE_DRIVER (overlay or vfs; default: overlay when a test mount of it works).
# docs/chart.md says more.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KUBELORA_CACHE:-$HOME/.cache/kubelora}/podman"
out="$repo/build/images"
mirror="${KUBELORA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
read -r -a names <<<"${KUBELORA_IMAGES:-kubelora-operator kubelora-engine}"
base=localhost/kubelora-base:bookworm
engine_base=localhost/kubelora-base-engine:bookworm
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
# One build at a time per cache (test sessions call this too: e2e/pytest_cluster.py): they share the archives.
exec 9>"$cache/build.lock"
flock 9
cat >"$cache/config/containers.conf" <<'CONF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF="$cache/config/containers.conf"
# With overlay a layer holds only what its step changed; with vfs every layer is a full copy of the one below
# it, so the engine's 6 GB dependency layer is copied again into each layer and container built on it.
driver="${KUBELORA_STORAGE_DRIVER:-}"
if [[ -z "$driver" ]]; then
  driver=vfs
  probe="$(mktemp -d "$cache/overlay-probe.XXXXXX")"
  mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
      "$probe/merged" 2>/dev/null; then
    umount "$probe/merged"
    driver=overlay
  fi
  rm -rf "$probe"
fi
case "$driver" in
  vfs) storage="$cache/storage" ;;
  overlay) storage="$cache/storage-overlay"
    # A vfs store left by an earlier build here (7 GB or more) would only take up disk.
    if [[ -d "$cache/storage" ]]; then
      say "removing the vfs store $cache/storage: builds use overlay storage now"
      rm -rf "$cache/storage" "$cache/run"
    fi ;;
  *) say "KUBELORA_STORAGE_DRIVER=$driver: expected overlay or vfs"; exit 2 ;;
esac
# The runroot (locks and sockets, rebuilt at will) lives under /tmp, one per store: podman refuses a runroot
# longer than 50 characters, which a path under a long $HOME (or a mktemp one) exceeds.
run="/tmp/kubelora-podman-$(printf '%s' "$storage" | sha256sum | cut -c1-12)"
say "podman storage: $driver ($storage, runroot $run)"
podman=(podman --storage-driver "$driver" --root "$storage" --runroot "$run" --runtime runc)
# Untagged leftovers, also after a failed build: builder stages, a final image's layer, deps images of earlier
# inputs (6 GB each for the engine). The tagged deps images stay: the next code change builds on them.
trap '"${podman[@]}" image prune -f >/dev/null' EXIT

# build_base TAG PACKAGES...: a Debian rootfs with python3 and PACKAGES, imported as TAG (once, then cached).
build_base() {
  local tag="$1"; shift
  if [[ "${KUBELORA_REBASE:-0}" != 1 ]] && "${podman[@]}" image exists "$tag"; then
    return
  fi
  say "building the base $tag from Debian packages ($mirror, bookworm)"
  local rootfs="$cache/base-bookworm.tar" packages
  packages="$(IFS=,; echo "python3,python3-venv,ca-certificates${*:+,$*}")"
  # Docs, man pages, locales and glibc's iconv modules (Python has its own codecs) are dropped at unpack time;
  # the essential variant has no apt, so no package lists or caches.
  # The merged-usr hook sets up bookworm's /usr layout itself, so the usrmerge package (and the 50 MB of perl
  # it depends on) stays out.
  mmdebstrap --variant=essential --include="$packages" \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*' \
    bookworm "$rootfs" "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main"
  "${podman[@]}" import --change 'CMD ["/bin/sh"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "$rootfs" "$tag" >/dev/null
  rm -f "$rootfs"
}

build_base "$base"
# The engine's base adds what torch and Triton load at run time: libstdc++ (torch's C++ libraries), and the C
# compiler and Python headers Triton's CUDA driver builds its launcher with on first use (triton/runtime/build.py).
if [[ " ${names[*]} " == *" kubelora-engine "* ]]; then
  build_base "$engine_base" libstdc++6 gcc libc6-dev libpython3.11-dev
fi

# The base is an image of its own for the local cluster's own tests (a pod that needs python3 and a shell).
if [[ ! -f "$out/kubelora-base.tar" ]] || [[ "${KUBELORA_REBASE:-0}" == 1 ]]; then
  rm -f "$out/kubelora-base.tar"
  rm -f "$out/kubelora-base.tar.partial"  # podman save refuses to overwrite what a failed save left
  "${podman[@]}" save --format docker-archive -o "$out/kubelora-base.tar.partial" "$base"
  mv "$out/kubelora-base.tar.partial" "$out/kubelora-base.tar"
fi

# The host's CA bundle is mounted over the builder's for RUN steps only (volumes are never committed), so pip
# works behind a TLS-inspecting proxy; KUBELORA_BUILD_CA names another bundle.
ca="${KUBELORA_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
ca_volume=()
[[ -f "$ca" ]] && ca_volume=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")

for name in "${names[@]}"; do
  tag="localhost/$name:$version"
  name_base="$base"
  [[ "$name" == kubelora-engine ]] && name_base="$engine_base"
  # An archive built from the same Dockerfile, context and base is kept (KUBELORA_IMAGES_FORCE=1 rebuilds).
  inputs="$(python3 "$repo/images/inputs_digest.py" "$name" "$("${podman[@]}" image inspect --format '{{.Id}}' "$name_base")")"
  if [[ "${KUBELORA_IMAGES_FORCE:-0}" != 1 && -f "$out/$name.tar" && "$(cat "$out/$name.inputs" 2>/dev/null)" == "$inputs" ]]; then
    say "$name: up to date ($out/$name.tar)"
    continue
  fi
  start=$SECONDS
  # --network host: pip in the build stages reaches the package index; nothing is pulled (--pull=never).
  # --layers=false: each build commits one layer per stage (with vfs each committed layer is a full copy of
  # the image below it, 6 GB for the engine), and the deps stage is kept as an image of its own instead.
  build=("${podman[@]}" build --pull=never --network host --layers=false "${ca_volume[@]}" --build-arg "BASE=$name_base")
  dockerfile="$repo/images/$name/Dockerfile"
  deps_tag="localhost/$name-deps:$(python3 "$repo/images/inputs_digest.py" --deps "$name" \
    "$("${podman[@]}" image inspect --format '{{.Id}}' "$name_base")" | cut -c1-16)"
  if ! "${podman[@]}" image exists "$deps_tag"; then
    say "building $deps_tag: the dependencies (pyproject.toml, constraints.txt or the base changed; minutes)"
    "${build[@]}" -f "$dockerfile" --target deps -t "$deps_tag" "$repo"
    say "$deps_tag: $((SECONDS - start)) s"
  fi
  # Deps images of earlier inputs lose their tag, so the prune at the end frees them. One name at a time:
  # two Dockerfiles with the same deps stage give one image with two names.
  for old in $("${podman[@]}" images --format '{{.Repository}}:{{.Tag}}' "localhost/$name-deps"); do
    if [[ "$old" == "localhost/$name-deps:"* && "$old" != "$deps_tag" ]]; then
      "${podman[@]}" untag "$old" "$old"
    fi
  done
  # The same Dockerfile with its final stage's `FROM deps` naming that image: podman skips the unused deps
  # stage and builds only the builder stage and the project's layer on top of it.
  [[ "$(grep -cx 'FROM deps' "$dockerfile")" == 1 ]] || { say "$dockerfile: expected one 'FROM deps' line"; exit 1; }
  say "building $tag on $deps_tag"
  sed "s#^FROM deps\$#FROM $deps_tag#" "$dockerfile" | "${build[@]}" -f - --build-arg "VERSION=$version" \
    --build-arg "SOURCE=$source_url" --build-arg "REVISION=$revision" -t "$tag" "$repo"
  rm -f "$out/$name.tar" "$out/$name.inputs"
  say "saving $tag to $out/$name.tar"
  rm -f "$out/$name.tar.partial"  # podman save refuses to overwrite what a failed save left
  "${podman[@]}" save --format docker-archive -o "$out/$name.tar.partial" "$tag"
  mv "$out/$name.tar.partial" "$out/$name.tar"  # never a half-written archive under the name the kubelet reads
  echo "$inputs" >"$out/$name.inputs"
  size="$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")"
  # The archive is the product (with vfs the store would hold another full copy: 6 GB for the engine).
  # `podman load -i build/images/<name>.tar` brings it back, e.g. to push it.
  "${podman[@]}" rmi "$tag" >/dev/null
  say "$name: $((size / 1000000)) MB image, $(($(stat -c %s "$out/$name.tar") / 1000000)) MB archive, $((SECONDS - start)) s"
done
