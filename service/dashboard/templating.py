"""The frame every dashboard page shares: the Jinja templates, their common context, and the vendored
static files they link.

Templates and static files live in service/templates and service/static (package data of
pipeplan.service), beside the API docs' own static files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from fastapi.templating import Jinja2Templates

PREFIX = "/dashboard"
SERVICE_DIR = Path(__file__).resolve().parent.parent
STATIC_DIR = SERVICE_DIR / "static" / "dashboard"
STATIC_FILES = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}

templates = Jinja2Templates(directory=str(SERVICE_DIR / "templates"))
ASSET_VERSION = str(int(max((STATIC_DIR / n).stat().st_mtime for n in STATIC_FILES)))
router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)


def context(request: Request, **values: Any) -> dict[str, Any]:
    return {"base": PREFIX, "asset_version": ASSET_VERSION, **values}


@router.get("/static/{name}")
def static_file(name: str) -> FileResponse:
    """Vendored CSS/JS only (no CDN); a fixed list, so no path from the URL reaches the disk."""
    if name not in STATIC_FILES:
        raise HTTPException(404, "no such file")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name],
                        headers={"Cache-Control": "public, max-age=3600"})
