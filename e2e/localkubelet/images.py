"""Images map to the local Python environment: there is no container runtime here.

Every image runs its container's `command`/`args` on this machine, with the project venv's
`bin` first on PATH (so `python`, `kopf` and this project's entry points are the local
install). A container without `command` needs its image's entrypoint, known only for the
images listed here (matched on the repository name, any registry and tag).
"""
from __future__ import annotations

ENTRYPOINTS: dict[str, tuple[str, ...]] = {
    "python": ("python",),
    "kubelora-engine": ("python", "-m", "kubelora.engine"),
    "kubelora-router": ("python", "-m", "kubelora.engine.router"),
    "kubelora-operator": ("kopf", "run", "--all-namespaces", "-m", "kubelora.operator.main"),
}


class UnknownEntrypoint(Exception):
    pass


def repository_name(image: str) -> str:
    """`ghcr.io/org/kubelora-engine:0.1@sha256:...` -> `kubelora-engine`."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def build_argv(container: dict) -> list[str]:
    """Kubernetes semantics: `command` replaces the entrypoint, `args` replace its CMD."""
    command = container.get("command")
    if not command:
        name = repository_name(container.get("image", ""))
        if name not in ENTRYPOINTS:
            raise UnknownEntrypoint(f"image {container.get('image')!r} has no known entrypoint; "
                                    "set `command` (see e2e/localkubelet/images.py)")
        command = list(ENTRYPOINTS[name])
    return [*command, *container.get("args", [])]
