"""`python3 images/inputs_digest.py NAME BASE_ID`: a digest of everything image NAME is built from.

The build context as .dockerignore admits it (the `!` entries, less __pycache__ and *.pyc), the Dockerfile and
the base image's id. images/build.sh skips an image whose archive was built from the same digest.
"""
import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def context_files() -> list[Path]:
    allowed = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    files = []
    for entry in allowed:
        path = REPO / entry
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc")


def main() -> None:
    name, base_id = sys.argv[1], sys.argv[2]
    digest = hashlib.sha256(base_id.encode())
    for path in [REPO / "images" / name / "Dockerfile", *context_files()]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    print(digest.hexdigest())


if __name__ == "__main__":
    main()
