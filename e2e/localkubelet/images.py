"""A container's argv from its spec and its image's ENTRYPOINT and CMD."""
from __future__ import annotations

from .imagestore import ImageConfig


class UnknownEntrypoint(Exception):
    pass


def build_argv(container: dict, image: ImageConfig) -> list[str]:
    """Kubernetes semantics: `command` replaces ENTRYPOINT (and drops CMD), `args` replace CMD."""
    command, args = container.get("command"), container.get("args")
    if command:
        return [*command, *(args or [])]
    argv = [*image.entrypoint, *(args if args else image.cmd)]
    if not argv:
        raise UnknownEntrypoint(f"image {container.get('image')!r} has neither ENTRYPOINT nor CMD; "
                                "set `command`")
    return argv
