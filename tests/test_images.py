"""images/*/Dockerfile follow the conventions of issue 17 (multi-stage, pinned BASE, non-root, kubelora entrypoint,
OCI labels) and ship every package folder; .dockerignore lets exactly what the wheel needs into the context.

This checks the files; tests/test_images_run.py runs the built images.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["kubelora-operator", "kubelora-router", "kubelora-engine"]


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
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE}", "${BASE}"]  # builder, then final: same base
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert 'ENTRYPOINT ["kubelora"]' in text
    for label in ("version", "source", "revision", "title"):
        assert f"org.opencontainers.image.{label}=" in text
    assert f'org.opencontainers.image.title="{name}"' in text
    final = text.split("\nFROM ${BASE}\n", 1)[1]
    assert "pip install" not in final  # nothing installed in the final stage, but for the engine's compiler:
    if name == "kubelora-engine":  # Triton builds its launcher with gcc; apt only where the base lacks it
        assert "if ! command -v gcc" in final and "rm -rf /var/lib/apt/lists/*" in final
    else:
        assert "apt-get" not in final
    assert "COPY --from=builder /opt/kubelora /opt/kubelora" in final
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    assert copied == _package_folders()


def test_only_the_engine_image_installs_the_engine_extra():
    assert "[engine]" in _dockerfile("kubelora-engine")
    for name in ("kubelora-operator", "kubelora-router"):
        assert "[engine]" not in _dockerfile(name)


def test_dockerignore_lets_in_what_the_wheel_needs():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == _package_folders() | {"pyproject.toml", "README.md", "constraints.txt"}
