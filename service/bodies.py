"""The edge every request body passes: its size, and JSON that our models and databases can hold.

One pure-ASGI middleware reads each body once (413 beyond `max_body_bytes`, whether announced or
streamed) and refuses, with a 422 naming the field, what Python's JSON parser accepts but nothing
downstream can store or serialize again: lone UTF-16 surrogates (`"\\ud800"`: not Unicode text, so
neither UTF-8 nor PostgreSQL can hold it) and the non-standard constants `NaN` / `Infinity` (not JSON,
RFC 8259; a stored `Infinity` comes back as `null`). Refused rather than replaced: a silently
rewritten problem would get another key than the one the client computed.
"""

from __future__ import annotations

import json
from typing import Any

class _NonFinite:
    """A JSON constant Python accepts and JSON does not (NaN, Infinity, -Infinity), kept for its path."""

    def __init__(self, text: str):
        self.text = text


def _bad_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # only lone surrogates fail: json.loads joins valid pairs
        return True
    return False


def body_problem(body: bytes) -> str | None:
    """`field.path: reason` for the first value of a JSON body no store can hold, else None.

    Bodies without a `\\u` escape or a bare constant skip the parse: the common case costs two scans.
    Invalid JSON is left to the route, which names the character where it breaks.
    """
    if b"\\u" not in body and b"NaN" not in body and b"Infinity" not in body:
        return None
    try:
        doc = json.loads(body, parse_constant=_NonFinite)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        item, path = stack.pop()
        where = path or "body"
        if isinstance(item, _NonFinite):
            return f"{where}: {item.text} is not a JSON number (numbers must be finite)"
        if isinstance(item, str) and _bad_text(item):
            return f"{where}: contains a lone UTF-16 surrogate; text must be valid Unicode"
        if isinstance(item, dict):
            for k, v in item.items():
                if _bad_text(k):
                    return f"{where}: a key contains a lone UTF-16 surrogate; text must be valid Unicode"
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


class BodyMiddleware:
    """413 for bodies over the limit, 422 for JSON no store can hold; the body is read once and
    replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        await _too_large(send, self.max_bytes)
                        return
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
            chunks.append(body)
            if not message.get("more_body"):
                break
        whole = b"".join(chunks)
        problem = body_problem(whole)
        if problem is not None:
            await _answer(send, 422, {"error": "invalid_request", "message": problem, "detail": [problem]})
            return
        replay = {"sent": False}

        async def receive_replay():
            if not replay["sent"]:
                replay["sent"] = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, receive_replay, send)


async def _too_large(send, limit: int) -> None:
    await _answer(send, 413, {"error": "payload_too_large",
                              "message": f"request body exceeds the limit of {limit} bytes"}, close=True)


async def _answer(send, status: int, doc: dict[str, Any], close: bool = False) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of an oversized body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
