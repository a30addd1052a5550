"""Images map to the local Python environment: there is no container runtime here.

Every image runs its container's command on this machine, with the project venv's `bin`
first on PATH (so `python`, `kopf` and this project's entry points are the local install).
An image only contributes its ENTRYPOINT and CMD, known for the images listed here (matched
on the repository name, any registry and tag); any other image counts as having no
ENTRYPOINT and no CMD, like most base images' ENTRYPOINT, so it needs `command` or `args`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


IMAGES: dict[str, ImageConfig] = {
    "python": ImageConfig(cmd=("python3",)),
}
# This project's images (`kubelora`, `kubelora-engine`, `kubelora/operator`, `ghcr.io/kubelora/router`, ...:
# any image whose repository path has a segment starting with `kubelora`) have the `kubelora` CLI as
# ENTRYPOINT: `args: [engine, serve, ...]` runs the local install's `kubelora engine serve`.
PROJECT_IMAGE = ImageConfig(entrypoint=("kubelora",))
PROJECT_PREFIX = "kubelora"


class UnknownEntrypoint(Exception):
    pass


def repository_name(image: str) -> str:
    """`ghcr.io/org/kubelora-engine:0.1@sha256:...` -> `kubelora-engine`."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def repository_path(image: str) -> str:
    """`localhost:5000/kubelora/engine:0.1@sha256:...` -> `localhost:5000/kubelora/engine` (no tag, no digest)."""
    path = image.split("@", 1)[0]
    head, _, last = path.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def is_project_image(image: str) -> bool:
    """`kubelora/operator:0.1`, `ghcr.io/kubelora/engine`, `kubelora-router:dev` are ours."""
    return any(segment.startswith(PROJECT_PREFIX) for segment in repository_path(image).split("/"))


def lookup_image(image: str) -> ImageConfig:
    if is_project_image(image):
        return PROJECT_IMAGE
    return IMAGES.get(repository_name(image), ImageConfig())


def build_argv(container: dict, image: ImageConfig | None = None) -> list[str]:
    """Kubernetes semantics: `command` replaces ENTRYPOINT (and drops CMD), `args` replace CMD. `image`: the
    image's own config (runc); None looks it up in the table above (host processes)."""
    image = image or lookup_image(container.get("image", ""))
    command, args = container.get("command"), container.get("args")
    if command:
        return [*command, *(args or [])]
    argv = [*image.entrypoint, *(args if args else image.cmd)]
    if not argv:
        raise UnknownEntrypoint(f"image {container.get('image')!r} has no known entrypoint; "
                                "set `command` (see e2e/localkubelet/images.py)")
    return argv
