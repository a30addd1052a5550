# The two commands a newcomer needs: `make demo` and `make test`. Both create the venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# constraints.txt pins the versions CI and the docs were verified with (pip freeze of a green venv).
# -P / PYTHONSAFEPATH: the repo root never lands on sys.path, so `operator/` cannot shadow the stdlib.
export PYTHONSAFEPATH := 1

.PHONY: venv k8s promtool prometheus test test-gpu demo images clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	$(PY) -m pip install -c constraints.txt -e '.[test]'
	touch $@

# The e2e control plane (Kubernetes from the official sources, via the Go module proxy) and helm, cached in
# ~/.cache/kubelora: minutes on a fresh machine, instant afterwards. See docs/cluster.md, docs/chart.md.
k8s:
	e2e/cluster build
	e2e/helm/build.sh

# promtool runs the chart's alert unit tests (tests/test_chart/test_alerts.py); Debian's prometheus package has it.
promtool:
	command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# The monitoring e2e test's Prometheus server, built from its Go module with the Kubernetes discovery (Debian's
# has none; e2e/prometheus/build.sh), cached in ~/.cache/kubelora: minutes on a fresh machine, instant afterwards.
prometheus:
	e2e/prometheus/build.sh >/dev/null

# The e2e cluster's pods run the images (the local kubelet unpacks build/images/*.tar and runs them with runc).
test: venv k8s promtool prometheus images
	$(PY) -P -m pytest $(PYTEST_ARGS)

# Every GPU test on a CUDA machine (bench/gpu-tests.sh; log under OUT, /tmp/kubelora-out by default).
test-gpu: venv
	PYTHON=$(abspath $(PY)) bash bench/gpu-tests.sh

demo: venv k8s images
	$(VENV)/bin/kubelora demo

# The two container images (images/): the operator image (operator and router) and the engine image, built with
# podman from a Debian rootfs, no container registry needed; archives in build/images/kubelora-{operator,engine}.tar,
# rebuilt only when their inputs change.
# KUBELORA_IMAGES picks a subset. docs/chart.md.
images:
	images/build.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
