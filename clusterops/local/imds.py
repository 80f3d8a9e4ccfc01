"""An IMDSv2 stand-in for the emulated cluster: `fab drill spot` and the tests serve it on the
controller's bridge address, where a node's Spot watcher (cluster_node.daemons.spotwatch, AUTOSTOP_IMDS_URL)
polls it as a node polls 169.254.169.254. IMDSv2 as EC2 serves it: a PUT /latest/api/token with a
TTL header, then GETs carrying that token (401 without) - docs.aws.amazon.com/AWSEC2/latest/UserGuide/
configuring-instance-metadata-service.html; spot/instance-action answers 404 until a notice is set
(spot-instance-termination-notices.html)."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeImds(BaseHTTPRequestHandler):
    """The identity document and spot/instance-action (404 until server.instance_action is set)."""

    TOKEN = "TOKEN123"

    def do_PUT(self):
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._answer(200 if ok else 400, self.TOKEN.encode())

    def do_GET(self):
        token = self.headers.get("X-aws-ec2-metadata-token")
        self.server.gets.append((self.path, token))  # type: ignore[attr-defined]
        if token != self.TOKEN:
            return self._answer(401, b"")
        document = {
            "region": "us-east-1",
            "instanceId": "i-0123456789abcdef0",
            "accountId": "123456789012",
            "privateIp": self.client_address[0],  # the address the node asked from
        }
        if self.path == "/latest/dynamic/instance-identity/document":
            return self._answer(200, json.dumps(document).encode())
        action = self.server.instance_action  # type: ignore[attr-defined]
        if self.path == "/latest/meta-data/spot/instance-action" and action is not None:
            return self._answer(200, json.dumps(action).encode())
        self._answer(404, b"<html>404 - Not Found</html>")

    def _answer(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve_imds(host: str = "127.0.0.1"):
    """A FakeImds on host (any free port); .url, .instance_action (None: no notice), .gets."""
    server = ThreadingHTTPServer((host, 0), FakeImds)
    server.instance_action, server.gets = None, []  # type: ignore[attr-defined]
    server.url = f"http://{host}:{server.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
