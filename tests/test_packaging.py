"""Packaging guards: stdlib `operator` is never shadowed, and every package folder ships in the wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"operator": "kubelora.operator", "engine": "kubelora.engine", "kernels": "kubelora.kernels",
                "cli": "kubelora.cli", "bench": "kubelora.bench"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _import_operator_from(cwd: Path, extra_path: Path | None) -> str:
    code = "import sys\n"
    if extra_path is not None:
        code += f"sys.path.insert(0, {str(extra_path)!r})\n"
    code += "import operator; print(operator.__file__); print(operator.itemgetter(1)([5, 7]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout


def test_stdlib_operator_is_not_shadowed_from_repo_root():
    # `python -c` run in the repo root puts the root first on sys.path: the classic shadowing set-up.
    out = _import_operator_from(ROOT, ROOT)
    path, value = out.split()
    assert not path.startswith(str(ROOT)), f"`import operator` resolved to the repo folder: {path}"
    assert value == "7"


def test_operator_folder_refuses_to_import_as_top_level():
    code = f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location('operator', {str(ROOT / 'operator' / '__init__.py')!r})\nmod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "must be imported as kubelora.operator" in result.stderr


def test_control_plane_imports_under_its_package_name():
    import kubelora.operator

    assert kubelora.operator.__name__ == "kubelora.operator"


def test_package_dir_maps_each_folder():
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert mapping == {name: folder for folder, name in PACKAGE_DIRS.items()}


def _packages_on_disk() -> set[str]:
    found = set()
    for folder, dotted in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((dotted, *rel.parts)))
        for module in (ROOT / folder).rglob("*.py"):
            if module.parent != ROOT / folder and not (module.parent / "__init__.py").exists():
                raise AssertionError(f"{module.parent} holds Python code but no __init__.py")
    return found


def test_every_package_on_disk_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - on_disk)}"


def test_data_files_the_code_reads_ship_as_package_data():
    # An editable install reads them from the repo; a wheel has only what package-data lists.
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "lora_configs.json" in package_data["kubelora.kernels"]
    assert (ROOT / "kernels" / "lora_configs.json").is_file()
