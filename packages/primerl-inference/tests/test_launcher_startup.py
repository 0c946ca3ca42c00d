"""The launcher counts a replica as serving only when the server answering at its address is the
one it started: another run's server on the same port (it answers /health with 200 at once,
while ours is still loading and would fail to bind 48 s later) made `primerl rl` print "serving
at http://127.0.0.1:8000" and run on the other run's server. No vLLM here: the servers are
small HTTP servers that answer as vLLM with primerl's admin routes does, and the replica's
process is a `sleep` (alive, as a loading vLLM is)."""

import http.server
import subprocess
import threading

import pytest
from primerl_inference.config import ADMIN_TOKEN_ENV
from primerl_inference.launcher import LaunchError, Servers, ServerSpec
from primerl_trainer.testing import free_port_block


def serve(port: int, token: str):
    """An HTTP server on `port` answering /health (200) and /admin/health (200 with `token`, else 401)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/admin/health":
                ok = self.headers.get("Authorization") == f"Bearer {token}"
                self.send_response(200 if ok else 401)
            else:
                self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def loading(tmp_path):
    """(port, Servers): one replica on a free port whose process is alive and not serving yet."""
    port = free_port_block(1)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    spec = ServerSpec(0, "127.0.0.1", port, ["sleep"], {ADMIN_TOKEN_ENV: "ours"})
    log = tmp_path / "inference-0.log"
    log.write_text("loading the model\n")
    servers = Servers([spec], [proc], [log], startup_timeout_s=10)
    yield port, servers
    servers.stop(timeout_s=5)


def test_another_runs_server_on_the_port_is_not_taken_for_ours(loading):
    port, servers = loading
    other = serve(port, token="another run's")
    try:
        with pytest.raises(
            LaunchError,
            match=rf"inference replica 0 \(http://127.0.0.1:{port}\) cannot serve: another "
            rf"server answers at .* refuses this launch's admin token .* port {port} "
            "is taken",
        ):
            servers.wait_healthy(poll_s=0.1)
    finally:
        other.shutdown()
        other.server_close()


def test_our_own_server_is_serving(loading):
    port, servers = loading
    ours = serve(port, token="ours")
    try:
        serving, problems = servers.watch_startup(fail_fast=True, poll_s=0.1)
        assert serving == {0} and problems == []
    finally:
        ours.shutdown()
        ours.server_close()
