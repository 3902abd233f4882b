"""Slow clients against a real `pipeplan serve` (issue 39 point 7): connections that dribble their
headers, send nothing, or never finish their body are answered 408 and closed after the configured
read timeouts, while normal requests go on; and the OpenAPI document declares how to authenticate."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from service_support import start_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    proc, base = start_server(tmp, data_dir=tmp, embedded_workers=0, header_timeout_s=1, body_timeout_s=1,
                              api_keys="secret")
    yield base
    proc.stop()


def held_for(base: str, sent: bytes) -> tuple[float, bytes]:
    """How long the server keeps a connection that sent `sent` and then nothing, and what it answered."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=6) as conn:
        conn.sendall(sent)
        t0, answer = time.monotonic(), b""
        while chunk := conn.recv(4096):  # raises TimeoutError if the server holds the connection
            answer += chunk
        return time.monotonic() - t0, answer


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1",
                                  b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"problem\": "])
def test_slow_headers_and_bodies_are_cut_off_with_408(server, sent):
    took, answer = held_for(server, sent)
    assert 0.5 < took < 3.0, took
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert httpx.get(f"{server}/healthz", timeout=5).status_code == 200


def test_openapi_declares_the_key_schemes_and_which_operations_need_them(server):
    doc = httpx.get(f"{server}/openapi.json", timeout=10).json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearerAuth"] == {**schemes["bearerAuth"], "type": "http", "scheme": "bearer"}
    assert (schemes["apiKeyHeader"]["in"], schemes["apiKeyHeader"]["name"]) == ("header", "X-API-Key")
    either = [{"bearerAuth": []}, {"apiKeyHeader": []}]
    assert doc["paths"]["/v1/plans"]["post"]["security"] == either  # keys configured: writes need one
    assert doc["paths"]["/v1/plans/{key}/refine"]["post"]["security"] == either
    assert doc["paths"]["/v1/plans/{key}"]["get"]["security"] == [*either, {}]  # reads stay open
    assert "security" not in doc["paths"]["/healthz"]["get"]
    r = httpx.post(f"{server}/v1/plans", json={}, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
