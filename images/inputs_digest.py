"""`python3 images/inputs_digest.py [--deps] NAME BASE_ID`: a digest of what image NAME (or its deps stage) is
built from.

Whole image: the build context as .dockerignore admits it (the `!` entries, less __pycache__ and *.pyc), the
Dockerfile and the base image's id; images/build.sh skips an image whose archive was built from the same digest.
`--deps`: the deps stage only: the Dockerfile's instructions up to its next stage (comment and blank lines left
out, as the builder leaves them out; the Dockerfiles use no heredocs, where `#` lines would be content), the files
that stage copies (pyproject.toml, constraints.txt) and the base image's id. build.sh tags the deps stage with it,
so a code change finds it cached and rebuilds only the project's layer.
"""
import hashlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPS_FILES = ("pyproject.toml", "constraints.txt")
DIRECTIVE = re.compile(r"#\s*(syntax|escape|check)\s*=", re.I)


def context_files() -> list[Path]:
    allowed = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    files = []
    for entry in allowed:
        path = REPO / entry
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc")


def deps_stage(dockerfile: str) -> str:
    """The Dockerfile's text up to the stage after `deps` (its global ARGs and the deps stage itself)."""
    match = re.search(r"^FROM \S+ AS deps$(.*?)(?=^FROM )", dockerfile, re.M | re.S)
    if match is None:
        raise SystemExit("the Dockerfile has no `FROM ... AS deps` stage followed by another stage")
    return dockerfile[:match.end()]


def instructions(dockerfile: str) -> str:
    """The Dockerfile without comment and blank lines (parser directives such as `# syntax=` kept)."""
    kept = [line for line in dockerfile.splitlines()
            if line.strip() and (not line.lstrip().startswith("#") or DIRECTIVE.match(line))]
    return "\n".join(kept)


def image_digest(name: str, base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in [REPO / "images" / name / "Dockerfile", *context_files()]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def deps_digest(name: str, base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    digest.update(instructions(deps_stage((REPO / "images" / name / "Dockerfile").read_text())).encode() + b"\0")
    for path in DEPS_FILES:
        digest.update(path.encode() + b"\0" + (REPO / path).read_bytes() + b"\0")
    return digest.hexdigest()


def main() -> None:
    args = sys.argv[1:]
    deps = args[:1] == ["--deps"]
    name, base_id = args[1:] if deps else args
    print((deps_digest if deps else image_digest)(name, base_id))


if __name__ == "__main__":
    main()
