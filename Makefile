# The two commands a newcomer needs: `make demo` and `make test`. Both create the venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# -P / PYTHONSAFEPATH: the repo root never lands on sys.path, so `operator/` cannot shadow the stdlib.
export PYTHONSAFEPATH := 1

.PHONY: venv test demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel
	$(PY) -m pip install -e '.[test]'
	touch $@

test: venv
	$(PY) -P -m pytest $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/kubelora demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
