"""A tiny HTTP server that runs as a pod of the local cluster (shipped in a ConfigMap).

GET /healthz -> ok; GET /whoami -> what the pod sees (env, volumes); GET /whoami/api ->
who the API server says this pod is, through in-cluster config.
"""
import http.server
import json
import os
import ssl
import urllib.request

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PORT = int(os.environ.get("PORT", "8080"))


def read(path):
    with open(path) as handle:
        return handle.read()


def whoami():
    return {"pod": os.environ["POD_NAME"], "namespace": os.environ["POD_NAMESPACE"],
            "pod_ip": os.environ["POD_IP"], "greeting": os.environ["GREETING"],
            "password": os.environ["PASSWORD"], "config_file": read("/etc/echo/greeting"),
            "sa_namespace": read(f"{SA_DIR}/namespace")}


def api_identity():
    """POST a SelfSubjectReview with the pod's own token, like any in-cluster client."""
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    context = ssl.create_default_context(cafile=f"{SA_DIR}/ca.crt")
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    request = urllib.request.Request(
        f"https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews",
        data=body.encode(), method="POST",
        headers={"Authorization": f"Bearer {read(SA_DIR + '/token')}",
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(request, context=context, timeout=5) as response:
        return json.loads(response.read())["status"]["userInfo"]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        routes = {"/healthz": lambda: "ok", "/whoami": whoami, "/whoami/api": api_identity}
        if self.path not in routes:
            self.send_error(404)
            return
        body = json.dumps(routes[self.path]()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        print(f"{self.command} {self.path}", flush=True)


print(f"echo server {os.environ['POD_NAME']} listening on {os.environ['POD_IP']}:{PORT}",
      flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", PORT), Handler).serve_forever()
