"""images/*/Dockerfile follow the image conventions (multi-stage, pinned BASE, non-root, kubelora entrypoint,
OCI labels) and ship every package folder; .dockerignore lets exactly what the wheel needs into the context;
the deps stage (the dependencies, minutes to build) is keyed on its own inputs only, so a code change keeps it.

This checks the files; tests/test_images_run.py runs the built images.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["kubelora-operator", "kubelora-engine"]  # the control plane (operator and router) and the engine
_spec = importlib.util.spec_from_file_location("inputs_digest", ROOT / "images" / "inputs_digest.py")
inputs_digest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inputs_digest)


def _dockerfile(name: str) -> str:
    return (ROOT / "images" / name / "Dockerfile").read_text()


def _package_folders() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())


def test_one_dockerfile_per_image():
    assert sorted(p.parent.name for p in (ROOT / "images").glob("*/Dockerfile")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_dockerfile_conventions(name):
    text = _dockerfile(name)
    assert re.search(r"^ARG BASE=\S+@sha256:[0-9a-f]{64}$", text, re.M), "BASE pinned by digest"
    # deps and builder on the same base; the final image is deps plus the project
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${BASE} AS deps", "${BASE} AS builder", "deps"]
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert 'ENTRYPOINT ["kubelora"]' in text
    for label in ("version", "source", "revision", "title"):
        assert f"org.opencontainers.image.{label}=" in text
    assert f'org.opencontainers.image.title="{name}"' in text
    deps, builder, final = re.split(r"^FROM .+$", text, flags=re.M)[1:]
    # The final image installs nothing and adds only the project's files from the builder
    assert "RUN" not in final and "pip" not in final
    assert re.findall(r"^COPY .+$", final, re.M) == ["COPY --from=builder /app/ /"]
    # deps: the dependencies only, pip and setuptools removed again; the user's passwd entry
    assert "pip uninstall --disable-pip-version-check -y wheel setuptools pip" in deps
    assert "kubelora:x:65532:65532" in deps
    if name == "kubelora-engine":  # Triton builds its launcher with gcc; apt only where the base lacks it
        assert "if ! command -v gcc" in deps and "rm -rf /var/lib/apt/lists/*" in deps
    else:
        assert "apt-get" not in deps
    # builder: the project without its dependencies
    assert "--no-deps" in builder and "-r requirements.txt" not in builder
    copied = set(re.findall(r"^COPY (\w+) \1$", builder, re.M))
    assert copied == _package_folders()


@pytest.mark.parametrize("name", NAMES)
def test_the_deps_stage_copies_only_what_its_digest_covers(name):
    """build.sh reuses the deps stage while inputs_digest.py --deps is unchanged: the stage must read nothing
    else from the context, or a change there would be missed."""
    deps = inputs_digest.deps_stage(_dockerfile(name)).split("AS deps", 1)[1]
    copies = re.findall(r"^(?:COPY|ADD) (.+)$", deps, re.M)
    assert copies == [" ".join(inputs_digest.DEPS_FILES) + " /tmp/kubelora-deps/"]
    assert "--mount=type=bind" not in deps


def _digests(name: str) -> tuple[str, str]:
    return inputs_digest.image_digest(name, "base-id"), inputs_digest.deps_digest(name, "base-id")


@pytest.fixture
def repo_copy(tmp_path, monkeypatch):
    """A copy of the files the digests read, so the tests can change them."""
    for entry in ("images", "operator", "engine", "kernels", "cli", "bench"):
        shutil.copytree(ROOT / entry, tmp_path / entry, ignore=shutil.ignore_patterns("__pycache__"))
    for entry in (".dockerignore", "pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy(ROOT / entry, tmp_path / entry)
    monkeypatch.setattr(inputs_digest, "REPO", tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", NAMES)
def test_a_code_change_rebuilds_the_image_but_not_its_deps_stage(repo_copy, name):
    image, deps = _digests(name)
    module = repo_copy / "engine" / "sampler.py"
    module.write_text(module.read_text() + "\n# a code change\n")
    assert _digests(name)[0] != image
    assert _digests(name)[1] == deps
    (repo_copy / "images" / name / "Dockerfile").write_text(_dockerfile(name).replace(
        'CMD [', 'EXPOSE 9999\nCMD ['))  # the final stage changed
    assert _digests(name)[1] == deps


@pytest.mark.parametrize("name", NAMES)
def test_a_comment_in_the_deps_stage_keeps_it_cached(repo_copy, name):
    _, deps = _digests(name)
    path = repo_copy / "images" / name / "Dockerfile"
    path.write_text(path.read_text().replace("AS deps\n", "AS deps\n# why this stage exists\n\n   # indented\n"))
    assert _digests(name)[1] == deps
    path.write_text(path.read_text().replace("# why this stage exists", "ENV WHY=1"))
    assert _digests(name)[1] != deps
    assert inputs_digest.instructions("# syntax=docker/dockerfile:1\n# note\nFROM x") == \
        "# syntax=docker/dockerfile:1\nFROM x"


@pytest.mark.parametrize("change", ["constraints.txt", "pyproject.toml", "deps stage", "base"])
def test_the_deps_stage_is_rebuilt_when_its_inputs_change(repo_copy, change):
    name = "kubelora-engine"
    image, deps = _digests(name)
    if change == "base":
        assert inputs_digest.deps_digest(name, "another-base") != deps
        return
    if change == "deps stage":
        path = repo_copy / "images" / name / "Dockerfile"
        path.write_text(path.read_text().replace("AS deps\n", "AS deps\nENV EXTRA=1\n"))
    else:
        path = repo_copy / change
        path.write_text(path.read_text() + "\n# changed\n")
    assert _digests(name) != (image, deps) and _digests(name)[1] != deps


def test_only_the_engine_image_installs_the_engine_extra():
    engine_extra = 'p["optional-dependencies"]["engine"]'
    assert engine_extra in _dockerfile("kubelora-engine")
    assert "optional-dependencies" not in _dockerfile("kubelora-operator")


def test_dockerignore_lets_in_what_the_wheel_needs():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == _package_folders() | {"pyproject.toml", "README.md", "constraints.txt"}
