"""The router stays torch-free and apart from the engine: importing it loads no torch and nothing of
`kubelora.engine`; what it shares with the engine and the operator comes from `kubelora.contract`."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import json, sys
import kubelora.router.app, kubelora.router.cli
print(json.dumps(sorted(sys.modules)))
"""


def test_router_imports_no_torch_and_nothing_of_the_engine():
    out = subprocess.run([sys.executable, "-P", "-c", CODE], capture_output=True, text=True, check=True)
    modules = set(json.loads(out.stdout))
    assert "torch" not in modules and "transformers" not in modules
    engine = sorted(m for m in modules if m.startswith(("kubelora.engine", "kubelora.kernels")))
    assert engine == [], engine
    assert "kubelora.contract.errors" in modules  # the error classes both sides answer with


def test_no_router_module_names_the_engine_package():
    from pathlib import Path

    import kubelora.router as router

    folder = Path(router.__file__).parent
    assert [p.name for p in folder.glob("*.py") if "kubelora.engine" in p.read_text()] == []


def test_only_the_placement_source_talks_to_kubernetes():
    from pathlib import Path

    import kubelora.router as router

    folder = Path(router.__file__).parent
    users = sorted(p.name for p in folder.glob("*.py") if "import kubernetes" in p.read_text()
                   or "from kubernetes" in p.read_text())
    assert users == ["sources.py"]
