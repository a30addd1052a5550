"""Packaging guards: stdlib `operator` is never shadowed, and every package folder ships in the wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"operator": "kubelora.operator", "engine": "kubelora.engine", "kernels": "kubelora.kernels",
                "cli": "kubelora.cli", "bench": "kubelora.bench", "contract": "kubelora.contract",
                "router": "kubelora.router"}


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


def _packages_on_disk(root: Path = ROOT) -> set[str]:
    """Every folder under a mapped package folder: a subpackage, or a data folder (no Python code), which
    setuptools treats as a namespace package and ships only when it is listed (else it warns, and a later
    setuptools drops it)."""
    found = set()
    for folder, dotted in PACKAGE_DIRS.items():
        for path in (root / folder).rglob("*"):
            rel = path.relative_to(root / folder)
            if not path.is_dir() or "__pycache__" in rel.parts or path.name.startswith("."):
                continue
            has_code = any(path.glob("*.py"))
            if has_code and not (path / "__init__.py").exists():
                raise AssertionError(f"{path} holds Python code but no __init__.py")
            found.add(".".join((dotted, *rel.parts)))
        found.add(dotted)
    return found


def test_data_folders_count_as_packages(tmp_path):
    # The guard itself: a folder of data files next to the code is a package that must be listed.
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "cli" / "data").mkdir()
    (tmp_path / "cli" / "data" / "corpus.txt").write_text("hello\n")
    (tmp_path / "cli" / "__pycache__").mkdir()
    assert "kubelora.cli.data" in _packages_on_disk(tmp_path)
    assert "kubelora.cli.__pycache__" not in _packages_on_disk(tmp_path)


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
    assert "*.txt" in package_data["kubelora.cli.data"]
    assert (ROOT / "cli" / "data" / "corpus.txt").is_file()


def test_license_is_an_spdx_expression_read_by_the_required_setuptools():
    # The `{ text = ... }` table is deprecated (setuptools stops reading it after 2027-02-18); the SPDX string
    # needs setuptools >= 77.
    config = _pyproject()
    assert config["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in config["build-system"]["requires"]
