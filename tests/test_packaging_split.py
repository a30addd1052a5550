"""The dependency split: the operator and the router install and import without the engine's stack.

The base distribution is what images/kubelora-operator (the operator and the router) installs; `kubelora[engine]`
adds torch, triton, transformers and the rest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_STACK = {"torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "xgrammar", "obstore",
                "google-re2"}
# Installed by the control plane's image; kubelora.operator.main registers every handler on import.
TORCH_FREE_IMPORTS = "import kubelora.operator.main, kubelora.operator.cli, kubelora.router.app, " \
                     "kubelora.router.cli, kubelora.cli.main"
BLOCKER = f'''import sys

class _BlockEngineStack:
    """Any import of the engine's stack fails, as it would where only the base distribution is installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {sorted(ENGINE_STACK)!r}:
            raise ImportError(f"{{name}} is blocked: not installed without kubelora[engine]")
        return None

sys.meta_path.insert(0, _BlockEngineStack())
'''


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_base_requirements_leave_out_the_engine_stack():
    assert {_name(r) for r in _project()["dependencies"]} & ENGINE_STACK == set()


def test_installed_metadata_agrees():
    # What pip resolves from: requirements of the installed distribution without an `extra ==` marker.
    from importlib import metadata

    base = [r for r in metadata.requires("kubelora") or [] if "extra ==" not in r]
    assert base and {_name(r) for r in base} & ENGINE_STACK == set()


def test_engine_extra_holds_the_stack_and_test_pulls_it_in():
    extras = _project()["optional-dependencies"]
    assert {_name(r) for r in extras["engine"]} == ENGINE_STACK
    assert "kubelora[engine]" in extras["test"] and "kubelora[engine]" in extras["tools"]


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("block-engine-stack")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(folder), "PYTHONSAFEPATH": "1"}


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_blocker_blocks(blocked_env):
    result = _run([sys.executable, "-P", "-c", "import torch"], blocked_env)
    assert result.returncode != 0 and "blocked" in result.stderr


def test_control_plane_and_router_import_without_the_engine_stack(blocked_env):
    code = f"import sys\n{TORCH_FREE_IMPORTS}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in " \
           f"{sorted(ENGINE_STACK)!r}))"
    result = _run([sys.executable, "-P", "-c", code], blocked_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["operator", "--help"], ["router", "--", "--help"]])
def test_cli_answers_without_the_engine_stack(blocked_env, args):
    result = _run([sys.executable, "-P", "-c", "import sys; from kubelora.cli.main import main; "
                   f"sys.argv = ['kubelora', *{args!r}]; sys.exit(main())"], blocked_env)
    assert result.returncode == 0, result.stderr
    assert "usage: kubelora" in result.stdout


def test_fresh_venv_installs_the_base_distribution_alone(tmp_path):
    # The real thing: the wheel into an empty venv with its base requirements only (constraints.txt versions;
    # pip's cache serves them after `make venv`), then the control plane and router import and the CLI answers.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, cwd=tmp_path, timeout=300)
    [wheel] = wheels.glob("kubelora-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"), str(wheel)],
                   check=True, cwd=tmp_path, env=env, timeout=600)
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], check=True, cwd=tmp_path,
                               env=env, capture_output=True, text=True).stdout
    assert {_name(line) for line in installed.splitlines()} & ENGINE_STACK == set(), installed
    result = subprocess.run([python, "-P", "-c", TORCH_FREE_IMPORTS], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    result = subprocess.run([env_dir / "bin" / "kubelora", "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "usage: kubelora" in result.stdout, result.stderr
