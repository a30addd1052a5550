"""The kubelet's HTTPS endpoint for `kubectl logs` (the API server proxies to it).

Serves GET /containerLogs/<namespace>/<pod>/<container> with `follow`, `previous`,
`tailLines` and `limitBytes`. Each container attempt's stdout+stderr is one file; lines
carry no runtime timestamps, so `timestamps=true` is ignored (docs/cluster.md).
"""
from __future__ import annotations

import http.server
import ssl
import threading
import time
import urllib.parse
from pathlib import Path

from .config import KubeletConfig
from .manager import PodManager

FOLLOW_POLL_S = 0.2


def attempt_logs(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("*.log"), key=lambda p: int(p.stem))


def tail_lines(data: bytes, num_lines: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-num_lines:]) if num_lines > 0 else b""


class LogHandler(http.server.BaseHTTPRequestHandler):
    manager: PodManager  # set on the subclass made by serve()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if parts == ["healthz"]:
            return self._reply(200, b"ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(404, b"only /containerLogs/<ns>/<pod>/<container> is served")
        params = dict(urllib.parse.parse_qsl(url.query))
        self._serve_logs(parts[1], parts[2], parts[3], params)

    def _serve_logs(self, namespace: str, pod: str, container: str, params: dict) -> None:
        worker = self.manager.find_worker(namespace, pod)
        runner = worker.find_runner(container) if worker else None
        if runner is None:
            return self._reply(404, f"container {container} of pod {namespace}/{pod} "
                               "not found on this node".encode())
        files = attempt_logs(runner.log_path(0).parent)
        index = -2 if params.get("previous") == "true" else -1
        if len(files) < -index:
            return self._reply(400, f"no {'previous ' if index == -2 else ''}logs for "
                               f"container {container}".encode())
        data = files[index].read_bytes()
        if "tailLines" in params:
            data = tail_lines(data, int(params["tailLines"]))
        if "limitBytes" in params:
            data = data[: int(params["limitBytes"])]
        self._start_stream()
        self.wfile.write(data)
        if params.get("follow") == "true" and index == -1:
            self._follow(files[-1], files[-1].stat().st_size, runner)

    def _follow(self, path: Path, offset: int, runner) -> None:
        """Stream new output until this attempt ends (or the client goes away)."""
        attempt = int(path.stem)
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            while True:
                chunk = log_file.read(65536)
                if chunk:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    continue
                is_current = runner.is_running and runner.restart_count == attempt
                if not is_current:
                    return
                time.sleep(FOLLOW_POLL_S)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # the API server polls; keep the kubelet log readable


def serve(cfg: KubeletConfig, manager: PodManager) -> http.server.ThreadingHTTPServer:
    """HTTPS with the node's serving cert; clients must present a cert from the cluster CA
    (the API server uses its kubelet-client cert)."""
    handler = type("BoundLogHandler", (LogHandler,), {"manager": manager})
    server = http.server.ThreadingHTTPServer((cfg.node_ip, cfg.port), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cfg.serving_cert, cfg.serving_key)
    context.load_verify_locations(cfg.identity.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
    return server
