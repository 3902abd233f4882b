"""The OpenAPI document as the API really behaves, and its docs pages served without a CDN.

FastAPI documents a 422 body the app never sends and none of the errors raised in handlers, middleware
or dependencies; `install()` rewrites each operation's responses from the routes' real behaviour
(one ErrorBody for every 4xx/5xx), types the model spec, and serves Swagger UI and ReDoc from
service/static/docs (vendored, see its README) so /docs works offline.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import ErrorBody, error_responses

DOCS_STATIC = Path(__file__).resolve().parent / "static" / "docs"
STATIC_URL = "/static/docs"
UNGATED = {"/healthz", "/readyz", "/metrics"}
# ReDoc 3 ships as an ES module (it reads `import.meta` and ends in `export`): loaded by a classic
# <script>, as FastAPI's get_redoc_html writes it, it fails to parse and the page stays blank. As a
# module it is imported and started here, with its telemetry (a beacon to redocly.com) turned off.
REDOC_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="shortcut icon" href="{favicon}">
<link rel="modulepreload" href="{js}"><style>body {{ margin: 0; padding: 0; }}</style></head>
<body><noscript>ReDoc needs JavaScript; the OpenAPI document itself is at {openapi}.</noscript>
<div id="redoc"></div>
<script type="module">
import {{ init }} from "{js}";
init("{openapi}", {{ disableTelemetry: true }}, document.getElementById("redoc"));
</script>
</body></html>
"""
METRICS_TYPE = CONTENT_TYPE_LATEST  # what /metrics really sends


def _statuses(path: str, method: str, op: dict[str, Any]) -> list[int]:
    """The error statuses this operation can answer (see ErrorBody's codes)."""
    if path == "/healthz":
        return []
    out = [503]  # database, queue or capacity down; every other route reads the database
    if path not in UNGATED:
        out.append(401)  # keys configured (writes) or read_requires_key (reads)
    if op.get("parameters") or "requestBody" in op:
        out.append(422)
    if "{" in path:
        out.append(404)
    if method in ("post", "put", "patch"):
        out += [400, 413, 429]  # unparsable body; body limit; admission control / per-key rate limits
    return sorted(out)


def _spec_schema(schema: dict[str, Any]) -> None:
    """PlanRequest.spec: planner.spec.Spec's schema instead of an untyped object."""
    try:
        from pipeplan.planner.spec import Spec
    except ImportError:
        return
    defs = schema.setdefault("components", {}).setdefault("schemas", {})
    spec = Spec.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in spec.pop("$defs", {}).items():
        defs.setdefault(name, sub)
    defs["Spec"] = spec
    for name in ("PlanRequest", "FrontierRequest"):
        props = defs.get(name, {}).get("properties", {})
        if "spec" in props:
            props["spec"] = {"anyOf": [{"$ref": "#/components/schemas/Spec"}, {"type": "null"}],
                             "description": props["spec"].get("description", "")}


def _exactly_one(schema: dict[str, Any]) -> None:
    """`{}` is invalid for the app (exactly one of problem / spec): say so in the schema too."""
    for name in ("PlanRequest", "FrontierRequest"):
        body = schema.get("components", {}).get("schemas", {}).get(name)
        if body is None or not {"problem", "spec"} <= set(body.get("properties", {})):
            continue
        body["oneOf"] = [
            {"required": ["problem"], "properties": {"problem": {"not": {"type": "null"}}, "spec": {"type": "null"}}},
            {"required": ["spec"], "properties": {"spec": {"not": {"type": "null"}}, "problem": {"type": "null"}}},
        ]


# Numbers the contract's validators bound (planner.contract): say it in the schema too.
_POSITIVE = {"Stage": ("forward_ms", "backward_input_ms")}
_NON_NEGATIVE = {
    "Stage": ("backward_weight_ms", "recompute_ms", "offload_ms", "reload_ms", "activation_mib", "weight_grad_mib",
              "offloadable_mib", "checkpoint_mib", "output_grad_mib", "reduce_ms"),
    "Device": ("memory_limit_mib", "static_mib", "host_memory_limit_mib", "optimizer_ms"),
    "Problem": ("p2p_ms",),
}


def _number_bounds(schema: dict[str, Any]) -> None:
    schemas = schema.get("components", {}).get("schemas", {})
    for table, bound in ((_POSITIVE, {"exclusiveMinimum": 0}), (_NON_NEGATIVE, {"minimum": 0})):
        for model, fields in table.items():
            props = schemas.get(model, {}).get("properties", {})
            for field in fields:
                prop = props.get(field)
                if prop is None:
                    continue
                for branch in prop.get("anyOf", [prop]):
                    if branch.get("type") in ("number", "integer"):
                        branch.update(bound)


SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <key>`, one of the"
                   " server's PIPEPLAN_API_KEYS."},
    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-API-Key", "description": "The same key in"
                     " `X-API-Key`."},
}


def _gate_of(dependant: Any) -> str | None:
    """"write" or "read" when the operation checks keys (service.security), else None."""
    from .security import require_read, require_write

    calls, stack = set(), [dependant]
    while stack:
        d = stack.pop()
        calls.add(d.call)
        stack.extend(d.dependencies)
    return "write" if require_write in calls else "read" if require_read in calls else None


def _security(app: FastAPI, schema: dict[str, Any]) -> None:
    """securitySchemes, and each gated operation's requirement as this server is configured: either
    scheme, or also none (`{}`) where no key is needed (no keys set; reads unless read_requires_key)."""
    from fastapi.routing import APIRoute, iter_route_contexts

    schema.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    settings = app.state.pipeplan.settings
    for route in iter_route_contexts(app.routes):  # included routers' routes too
        gate = _gate_of(route.dependant) if isinstance(route.original_route, APIRoute) else None
        if gate is None:
            continue
        needed = bool(settings.api_keys) and (gate == "write" or settings.read_requires_key)
        ops = schema.get("paths", {}).get(route.path_format, {})
        for method in route.methods:
            if method.lower() in ops:
                ops[method.lower()]["security"] = [{name: []} for name in SECURITY_SCHEMES] + (
                    [] if needed else [{}])


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            for status, entry in error_responses(*_statuses(path, method, op)).items():
                doc = {"description": responses.get(str(status), {}).get("description") or entry["description"],
                       "content": {"application/json": {"schema": ref}}}
                if "headers" in entry:
                    doc["headers"] = entry["headers"]
                responses[str(status)] = doc
    metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
    if metrics:
        metrics["responses"]["200"] = {"description": "Prometheus text exposition format",
                                       "content": {METRICS_TYPE: {"schema": {"type": "string"}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _spec_schema(schema)
    _exactly_one(schema)
    _number_bounds(schema)
    _security(app, schema)
    return schema


def install(app: FastAPI) -> None:
    """The real OpenAPI document at /openapi.json, Swagger UI at /docs and ReDoc at /redoc, offline."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount(STATIC_URL, StaticFiles(directory=DOCS_STATIC), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API docs",
            swagger_js_url=f"{STATIC_URL}/swagger-ui-bundle.js", swagger_css_url=f"{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_URL}/favicon-32x32.png")

    page = REDOC_PAGE.format(title=escape(f"{app.title} - ReDoc"), favicon=f"{STATIC_URL}/favicon-32x32.png",
                             openapi=escape(app.openapi_url or "/openapi.json"), js=f"{STATIC_URL}/redoc.standalone.js")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return HTMLResponse(page)
