# Sourced by the scripts that take a tool from its Go module through the Go module proxy (e2e/prometheus/build.sh,
# e2e/prometheus-operator-crds.sh): github.com and release assets are not reachable here, the proxy is.
# module_dir MODULE VERSION SUM WORKDIR: downloads MODULE@VERSION (outside any module: WORKDIR is an empty folder,
# so no go.mod around it takes part), checks its go.sum h1: hash against SUM on top of go's own check against
# sum.golang.org, and prints the module's source folder. `go mod download -json MODULE@VERSION` prints both.
module_dir() {
  local module=$1 version=$2 want=$3 workdir=$4 info source sum
  info="$(cd "$workdir" && go mod download -json "$module@$version")" || {
    echo "go mod download $module@$version failed: $info" >&2
    return 1
  }
  read -r source sum < <(python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["Dir"], d["Sum"])' <<<"$info")
  if [[ "$sum" != "$want" ]]; then
    echo "$module@$version: checksum $sum, expected $want" >&2
    return 1
  fi
  echo "$source"
}
