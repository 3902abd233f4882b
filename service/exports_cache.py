"""Exports (torch CSV, Chrome trace) computed once per revision, kept gzipped on disk, served cheaply.

A revision never changes, so an export is a pure function of (key, revision, kind): it is built once,
in a killable child process (service.inline's forkserver; a large plan's trace takes seconds and
~100 MB that the API process would otherwise keep), written gzipped to
`export_cache_dir/<key[:2]>/<key>/r<revision>.<kind>.gz` (tmp file + rename: readers never see half a
file), and from then on every GET streams that file: as is to clients that accept gzip (no CPU at
all), decompressed in chunks to those that do not. The ETag names the revision, so If-None-Match
answers 304 from the cached best revision alone.

Why disk, not the database: exports are derived data that can be rebuilt from the stored plan at any
time, they are 10-100x the size of the plan (a trace of a P=256 plan: tens of MB), and a file can be
sent in chunks without ever being in memory. Losing the directory costs one rebuild per export;
each API host keeps its own (in a multi-host deployment each builds an export once).
"""

from __future__ import annotations

import gzip
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

KINDS: dict[str, tuple[str, str]] = {  # kind -> (media type, download file suffix)
    "torch.csv": ("text/csv", ".csv"),
    "chrome-trace.json": ("application/json", ".trace.json"),
    # torchtitan's overrides name the CSV "schedule.csv": save torch.csv under that name in the job's
    # working directory (the service cannot know the job's paths; `pipeplan export torchtitan` can)
    "torchtitan.args": ("text/plain", ".torchtitan.args"),
    "megatron.args": ("text/plain", ".megatron.args"),
    "runtimes.json": ("application/json", ".runtimes.json"),
}
CHUNK = 256 * 1024


def cache_path(root: Path, key: str, revision: int, kind: str) -> Path:
    return Path(root) / key[:2] / key / f"r{revision}.{kind}.gz"


def etag_of(key: str, revision: int, kind: str) -> str:
    """Weak: the same export goes out gzipped or not (same content, other encoding)."""
    return f'W/"{key[:32]}-r{revision}-{kind}"'


def render(problem: Any, plan: Any, kind: str) -> bytes:
    """The export's bytes; runs in the child process. Raises planner.exports.ExportRefused when the
    plan cannot be expressed in that format. torch.csv is the CSV torch's stock runtime runs
    (planner.exports.torch_schedule: renumbered, compute order only), as torchtitan.args expects."""
    import json

    from pipeplan.planner.exports import chrome_trace, torch_schedule
    from pipeplan.planner.megatron_args import megatron_export
    from pipeplan.planner.runtimes import runtimes_document
    from pipeplan.planner.torchtitan_args import torchtitan_export

    if kind == "torch.csv":
        return torch_schedule(problem, plan).csv(problem).encode()
    if kind == "torchtitan.args":
        return torchtitan_export(problem, plan, "schedule.csv").args_text().encode()
    if kind == "megatron.args":
        return ("\n".join(megatron_export(problem, plan).lines()) + "\n").encode()
    document = runtimes_document(problem, plan) if kind == "runtimes.json" else chrome_trace(problem, plan)
    return json.dumps(document, separators=(",", ":")).encode()


def _replace(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """`write` into a temporary file beside `path`, then rename it over `path` (readers never see half
    a file; a failed write leaves no temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path: Path, data: bytes) -> None:
    """Gzip `data` into `path` via a temporary file in the same directory and a rename."""
    def write(raw: BinaryIO) -> None:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
            gz.write(data)

    _replace(path, write)


def build(job: dict[str, Any]) -> dict[str, Any]:
    """Child-process entry (service.inline.run_in_child): load the revision, render, store gzipped.
    Returns {"path", "bytes"} or {"error": {...}} (404 when the revision does not exist)."""
    from pipeplan.planner.contract import Plan
    from pipeplan.planner.exports import ExportRefused
    from pipeplan.service.db import make_engine
    from pipeplan.service.repository import Repository

    key, revision, kind = job["key"], job["revision"], job["kind"]
    engine = make_engine(job["database_url"], 1)
    try:
        repo = Repository(engine)
        problem = repo.get_problem(key)
        plan_json = repo.revision_plan(key, revision)
    finally:
        engine.dispose()
    if problem is None or plan_json is None:
        return {"error": {"status": 404, "code": "not_found", "message": f"no revision {revision} for key {key}",
                          "extra": {}}}
    try:
        data = render(problem, Plan.model_validate_json(plan_json), kind)
    except ExportRefused as exc:  # the plan, not the request, is what the format cannot hold
        return {"error": {"status": 409, "code": "not_exportable", "message": f"{kind}: {exc}",
                          "extra": {"revision": revision}}}
    path = Path(job["path"])
    write_atomically(path, data)
    return {"path": str(path), "bytes": len(data)}


def gunzip_chunks(path: Path) -> Iterator[bytes]:
    """The file decompressed, CHUNK bytes at a time (for clients without gzip): memory stays flat."""
    with gzip.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


# -- the dashboard's baselines table: per key (it depends on the problem only) -------------------------
def baselines_path(root: Path, key: str) -> Path:
    return Path(root) / key[:2] / key / "baselines.json"


def read_baselines(root: Path, key: str) -> list[dict[str, Any]] | None:
    """The stored table's rows, or None (not computed yet, or unreadable: then it is recomputed)."""
    import json

    try:
        return json.loads(baselines_path(root, key).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_baselines(root: Path, key: str, rows: list[dict[str, Any]]) -> None:
    """Kept on disk beside the key's exports: computed once per problem (a big one takes a minute),
    across restarts and shared by the API processes of one host."""
    import json

    _replace(baselines_path(root, key), lambda raw: raw.write(json.dumps({"rows": rows}).encode()))
