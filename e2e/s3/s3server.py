"""A real S3-compatible server for the e2e tests: MinIO, built from the Go module proxy and run on the host.

    python -P e2e/s3/s3server.py build          # prints the binary's path (built once, then cached)
    python -P e2e/s3/s3server.py run DATA_DIR [--address 0.0.0.0]   # a free port, printed

The build is pinned by go.mod/go.sum here (a `tool` requirement on github.com/minio/minio) and cached under
~/.cache/kubelora/minio/<digest of go.mod and go.sum> (e2e/gobuild.py, as the kstatus reader is): the first
build takes minutes and says so, later ones none. Tests import `build_minio` and `MinioServer` (e2e/s3 on
sys.path).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parent
sys.path.insert(0, str(SOURCE.parent))  # e2e/, for gobuild: under -P a script's own folder is not on sys.path
from gobuild import build_cached  # noqa: E402

PACKAGE = "github.com/minio/minio"
ROOT_USER = "kubelora-e2e"
ROOT_PASSWORD = "kubelora-e2e-secret"  # MinIO wants at least 8 characters


def build_minio(timeout_s: float = 1800) -> Path:
    """The cached MinIO binary, built first when missing (about 5 minutes on 2 cores)."""
    return build_cached("minio", SOURCE, ("go.mod", "go.sum"), PACKAGE, timeout_s,
                        hint="about 5 minutes on 2 cores the first time, cached after")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class MinioServer:
    """`with MinioServer(data_dir, host) as s3:` a MinIO on host:free port; `s3.endpoint` is its URL."""
    data_dir: Path
    listen_host: str = "127.0.0.1"
    advertised_host: str | None = None  # what clients (pods) use to reach it; default: listen_host
    access_key_id: str = ROOT_USER
    secret_access_key: str = ROOT_PASSWORD
    is_scratch: bool = True  # remove data_dir (and the log beside it) on exit
    _process: subprocess.Popen | None = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.advertised_host or self.listen_host}:{self.port}"

    def __enter__(self) -> MinioServer:
        binary = build_minio()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(self.listen_host)
        console = free_port(self.listen_host)
        log = open(self.data_dir.parent / f"{self.data_dir.name}.log", "wb")
        env = {**os.environ, "MINIO_ROOT_USER": self.access_key_id, "MINIO_ROOT_PASSWORD": self.secret_access_key,
               "MINIO_BROWSER": "off", "MINIO_UPDATE": "off"}
        self._process = subprocess.Popen(
            [str(binary), "server", "--quiet", "--address", f"{self.listen_host}:{self.port}",
             "--console-address", f"{self.listen_host}:{console}", str(self.data_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.listen_host}:{self.port}/minio/health/ready"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"minio exited with {self._process.returncode}; see {self.data_dir}.log")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"minio did not become ready within {timeout_s} s")

    def __exit__(self, *exc_info) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self.is_scratch:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            (self.data_dir.parent / f"{self.data_dir.name}.log").unlink(missing_ok=True)

    def store(self, bucket: str):
        """An obstore S3Store on `bucket` with the root credentials (reached at the listen address)."""
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=f"http://{self.listen_host}:{self.port}", region="us-east-1",
                       access_key_id=self.access_key_id, secret_access_key=self.secret_access_key,
                       client_options={"allow_http": True})

    def make_bucket(self, bucket: str) -> None:
        """A PUT Bucket (CreateBucket), which obstore has no call for: obstore presigns a PUT of the empty key,
        `/<bucket>/`, which is the bucket's own path-style URL."""
        from datetime import timedelta

        import obstore

        signed = obstore.sign(self.store(bucket), "PUT", "", timedelta(minutes=5))
        request = urllib.request.Request(signed, method="PUT", data=b"")
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise RuntimeError(f"creating bucket {bucket} answered HTTP {response.status}")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.store(bucket), key, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find) the cached MinIO binary and print its path")
    run = sub.add_parser("run", help="run MinIO on DATA_DIR (kept) until interrupted")
    run.add_argument("data_dir", type=Path)
    run.add_argument("--address", default="127.0.0.1")
    args = parser.parse_args()
    if args.command == "build":
        print(build_minio())
        return
    with MinioServer(args.data_dir, listen_host=args.address, is_scratch=False) as server:
        print(f"minio at {server.endpoint} (access key {server.access_key_id}); Ctrl-C stops it", flush=True)
        try:
            server._process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
