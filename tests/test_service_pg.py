"""The API on real PostgreSQL, and what clients see when the database goes away: 503 with
Retry-After (never a stack trace), readiness failing, and recovery once it is back."""

from __future__ import annotations

import socket
import threading

from fastapi.testclient import TestClient
from pipeplan.service import create_app
from service_support import make_problem, migrated_engine, pg_url, problem_doc  # noqa: F401
from sqlalchemy.engine import make_url

from pipeplan.settings import Settings


class TcpProxy:
    """Forwards a local port to PostgreSQL; `stop()` makes the database unreachable (and drops
    every open connection), `start()` brings it back on the same port."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self._conns: list[socket.socket] = []
        self._server: socket.socket | None = None

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self.port = server.getsockname()[1]
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() and stops listening
        except OSError:
            pass
        self._server.close()
        for s in self._conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self._conns.clear()


def test_api_on_postgresql_and_503_when_the_database_is_down(pg_url):  # noqa: F811
    migrated_engine(pg_url).dispose()  # production: `pipeplan migrate` ran first
    url = make_url(pg_url)
    proxy = TcpProxy((url.host, url.port or 5432))
    proxy.start()
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    app = create_app(Settings(database_url=proxied, embedded_workers=0, retry_after_s=7))
    with TestClient(app, raise_server_exceptions=False) as client:
        problem = make_problem(devices=4, microbatches=8)
        r = client.post("/v1/plans", json={"problem": problem_doc(problem)})
        assert r.status_code == 201, r.text
        key = r.json()["problem_key"]
        assert client.post("/v1/plans", json={"problem": problem_doc(problem)}).json()["cached"] is True
        assert client.get("/v1/plans").json()["total"] == 1
        proxy.stop()
        for path in ("/v1/plans", f"/v1/plans/{key}/revisions"):
            down = client.get(path)
            assert down.status_code == 503, down.text
            assert down.headers["retry-after"] == "7"
            assert down.json()["error"] == "unavailable" and "Traceback" not in down.text
        other = make_problem(devices=2, microbatches=3)
        assert client.post("/v1/plans", json={"problem": problem_doc(other)}).status_code == 503
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["database"].startswith("unavailable")
        assert client.get("/healthz").status_code == 200
        proxy.start()  # the database is back
        assert client.get("/v1/plans").status_code == 200
        assert client.get("/readyz").status_code == 200
    proxy.stop()
