"""The router stays torch-free and apart from the engine: importing it loads no torch, no core, no server."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import json, sys
import kubelora.engine.router.app, kubelora.engine.router.cli
print(json.dumps(sorted(sys.modules)))
"""
CORE_MODULES = ("kubelora.engine.engine", "kubelora.engine.errors", "kubelora.engine.config",
                "kubelora.engine.scheduler", "kubelora.engine.adapters", "kubelora.kernels")


def test_router_imports_no_torch_core_or_server():
    out = subprocess.run([sys.executable, "-P", "-c", CODE], capture_output=True, text=True, check=True)
    modules = set(json.loads(out.stdout))
    assert "torch" not in modules and "transformers" not in modules
    assert not any(m == "kubelora.engine.server" or m.startswith("kubelora.engine.server.") for m in modules)
    assert not modules & set(CORE_MODULES), sorted(modules & set(CORE_MODULES))


def test_only_the_placement_source_talks_to_kubernetes():
    from pathlib import Path

    import kubelora.engine.router as router

    folder = Path(router.__file__).parent
    users = sorted(p.name for p in folder.glob("*.py") if "import kubernetes" in p.read_text()
                   or "from kubernetes" in p.read_text())
    assert users == ["sources.py"]
