"""Service benchmark (issues 4, 15): GET throughput and latency at 1/16/64 clients (full plan and 304),
cold POST to first usable plan (by size, with and without a memory limit), 200 concurrent distinct
small POSTs, and worker improvement -> SSE client latency.

    .venv/bin/python bench/service.py                 # SQLite file + local Redis db 12, ~1 minute
    .venv/bin/python bench/service.py --duration 10 --database-url postgresql+psycopg://...
    .venv/bin/python bench/service.py --only-posts    # cold POST by size, 200 concurrent POSTs, RSS

It starts one `pipeplan serve` (uvicorn, one process) on loopback with no worker running, so the
solver does not compete for the CPU; the bench itself plays the worker for the SSE measurement
(stores a better revision in SQL and publishes it on Redis, exactly as worker.tasks does). The load
generator is a minimal keep-alive HTTP/1.1 client on raw asyncio sockets: a Python HTTP library would
saturate before the server does. Load is bounded (loopback only, a few seconds per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeplan.planner.contract import Device, Options, Problem, Stage


def problem(devices: int = 8, microbatches: int = 32, tag: str = "") -> Problem:
    stages = [Stage(device=d, forward_ms=1.0, backward_input_ms=1.2, backward_weight_ms=0.8,
                    activation_mib=512.0, weight_grad_mib=128.0) for d in range(devices)]
    return Problem(num_devices=devices, num_microbatches=microbatches, p2p_ms=0.05,
                   options=Options(split_backward=True), stages=stages,
                   devices=[Device(memory_limit_mib=None, static_mib=8000.0) for _ in range(devices)],
                   metadata={"bench": tag or uuid.uuid4().hex})


def tight(devices: int, microbatches: int, tag: str = "") -> Problem:
    """Room for 8 activations per device: no classic schedule fits, the first plan is the greedy's."""
    p = problem(devices, microbatches, tag)
    return p.model_copy(update={"devices": [Device(memory_limit_mib=8000.0 + 640.0 * 8, static_mib=8000.0)
                                            for _ in range(devices)]})


def cold_by_size(base: str, sizes: list[tuple[int, int]], reps: int) -> list[dict]:
    """Cold POST (cache miss -> first plan -> stored -> response) by size, without and with a memory
    limit that no classic schedule fits; distinct problems each time (a tag in metadata). The default
    sizes end with the largest the service accepts by default (max_ops 131,072 = 4 x P x M)."""
    rows = []
    with httpx.Client(timeout=120) as c:
        for devices, microbatches in sizes:
            for kind, make in (("free", problem), ("tight", tight)):
                lat, codes, method = [], {}, ""
                for _ in range(reps):
                    doc = {"problem": make(devices, microbatches).model_dump(mode="json"), "time_budget_s": 1}
                    t0 = time.perf_counter()
                    r = c.post(f"{base}/v1/plans", json=doc)
                    lat.append(time.perf_counter() - t0)
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                    if r.status_code == 201:
                        method = r.json()["plan"]["method"]
                row = {"devices": devices, "microbatches": microbatches, "memory": kind, "n": len(lat),
                       "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000, "codes": codes,
                       "method": method}
                rows.append(row)
                print(f"cold POST P={devices} M={microbatches} {kind:5} (n={len(lat)}): p50 {row['p50_ms']:6.0f} ms,"
                      f" p99 {row['p99_ms']:6.0f} ms  codes {codes}  revision 1: {method}", flush=True)
    return rows


async def concurrent_posts(base: str, n: int) -> dict:
    """`n` distinct small problems POSTed at once (each a cold miss)."""
    docs = [{"problem": problem(4, 8).model_dump(mode="json"), "time_budget_s": 1} for _ in range(n)]
    lat: list[float] = []
    codes: dict[int, int] = {}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        async def one(doc: dict) -> None:
            t0 = time.perf_counter()
            r = await c.post(f"{base}/v1/plans", json=doc)
            lat.append(time.perf_counter() - t0)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

        start = time.perf_counter()
        await asyncio.gather(*(one(d) for d in docs))
        wall = time.perf_counter() - start
    return {"n": n, "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000, "wall_s": wall, "codes": codes}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def memory_after_big_views(base: str, pid: int, n: int, rounds: int = 2) -> dict:
    """The server's RSS after `n` distinct largest-size plans are POSTed, then read `rounds` times
    (plan, both exports, dashboard page): bounded caches keep it flat however many big plans pass."""
    out = {"n": n, "start_mib": rss_mib(pid)}
    with httpx.Client(timeout=120) as c:
        keys = [c.post(f"{base}/v1/plans", json={"problem": problem(64, 512).model_dump(mode="json"),
                                                 "time_budget_s": 1}).json()["problem_key"] for _ in range(n)]
        out["after_posts_mib"] = rss_mib(pid)
        for r in range(rounds):
            for key in keys:
                for path in (f"/v1/plans/{key}", f"/v1/plans/{key}/export/chrome-trace.json",
                             f"/v1/plans/{key}/export/torch.csv", f"/dashboard/plans/{key}"):
                    c.get(base + path)
            out[f"after_round_{r + 1}_mib"] = rss_mib(pid)
        time.sleep(5)
        out["idle_5s_mib"] = rss_mib(pid)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# -- a minimal keep-alive HTTP/1.1 GET client ----------------------------------------------------
async def client_loop(host: str, port: int, path: str, headers: str, stop_at: float, lat: list[float],
                      codes: dict[int, int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode()
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            codes[status] = codes.get(status, 0) + 1
    finally:
        writer.close()


async def load(host: str, port: int, path: str, clients: int, seconds: float, headers: str = "") -> dict:
    lat: list[float] = []
    codes: dict[int, int] = {}
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(host, port, path, headers, start + seconds, lat, codes)
                           for _ in range(clients)))
    elapsed = time.perf_counter() - start
    return {"clients": clients, "requests": len(lat), "rps": len(lat) / elapsed,
            "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000, "codes": codes}


# -- the server ---------------------------------------------------------------------------------
def start_server(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).parent / "pipeplan"
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--log-level", "warning"], env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=str(ROOT))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server did not start; see {log}")


def sse_latency(base: str, settings, improvements: int, subscribers: int) -> dict:
    """Bench plays the worker: store a better revision, publish it; clients time its arrival."""
    from pipeplan.planner.ops import Kind, Op
    from pipeplan.planner.simulator import DeviceOrder, Schedule, Timing, build_plan, simulate
    from pipeplan.service.db import make_engine
    from pipeplan.service.events import RedisPublisher, revision_message
    from pipeplan.service.repository import Repository

    p = problem(8, 32)
    key = p.key()
    m = p.num_microbatches
    orders = []
    for d in range(p.num_devices):
        o = DeviceOrder(compute=[Op(Kind.F, d, i) for i in range(m)])
        o.compute += [x for i in range(m) for x in (Op(Kind.B, d, i), Op(Kind.W, d, i))]
        orders.append(o)
    schedule = Schedule(orders)
    base_timing = simulate(p, schedule)
    t_b = min(s for op, (s, _) in base_timing.times.items() if op.kind != Kind.F)

    def plan_with_delay(delay: float):
        times = {op: ((s + delay, e + delay) if s >= t_b else (s, e)) for op, (s, e) in base_timing.times.items()}
        return build_plan(p, schedule, Timing(times, base_timing.choices), method="bench")

    engine = make_engine(settings["database_url"], 2)
    repo = Repository(engine)
    publisher = RedisPublisher(settings["redis_url"], f"{settings['queue_name']}:improved")
    repo.store_first(p, plan_with_delay(improvements + 10.0), 1.0, key=key)
    plans = [plan_with_delay(improvements + 9.0 - i) for i in range(improvements)]
    sent: dict[int, float] = {}
    published: dict[int, float] = {}
    received: list[float] = []
    after_publish: list[float] = []
    ready = threading.Barrier(subscribers + 1)
    lock = threading.Lock()

    def subscriber() -> None:
        with httpx.stream("GET", f"{base}/v1/plans/{key}/events", params={"summary": "true"},
                          timeout=60) as stream:
            first = True
            for line in stream.iter_lines():
                if line.startswith("id:"):
                    rev = int(line[3:])
                    now = time.perf_counter()
                    if first:
                        first = False
                        ready.wait()
                        continue
                    with lock:
                        received.append(now - sent[rev])
                        after_publish.append(now - published[rev])
                    if rev == improvements + 1:
                        return

    threads = [threading.Thread(target=subscriber, daemon=True) for _ in range(subscribers)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.2)
    for plan in plans:
        t0 = time.perf_counter()
        revision = repo.store_if_better(key, plan, p)  # validate + atomic upsert, as the worker does
        sent[revision] = t0
        published[revision] = time.perf_counter()
        publisher.publish(key, revision_message(key, revision))
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    engine.dispose()
    return {"improvements": improvements, "subscribers": subscribers, "events": len(received),
            "p50_ms": pct(received, 50) * 1000, "p99_ms": pct(received, 99) * 1000,
            "max_ms": max(received) * 1000,
            "publish_to_client_p50_ms": pct(after_publish, 50) * 1000,
            "publish_to_client_p99_ms": pct(after_publish, 99) * 1000}


def cleanup_queue(redis_url: str, name: str) -> None:
    """Drop the refine jobs the cold POSTs queued (no worker ran them) and the queue itself."""
    import redis
    from rq import Queue

    conn = redis.Redis.from_url(redis_url)
    Queue(name, connection=conn).delete(delete_jobs=True)
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per load step")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--cold-posts", type=int, default=20)
    ap.add_argument("--improvements", type=int, default=50)
    ap.add_argument("--subscribers", type=int, default=8)
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--http-workers", type=int, default=1, help="uvicorn processes (PIPEPLAN_HTTP_WORKERS)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--sizes", default="8x32,16x64,32x128,64x512,32x1024,256x128",
                    help="cold POST by size, PxM list ('' to skip); the last three are the largest accepted sizes")
    ap.add_argument("--size-reps", type=int, default=5, help="cold POSTs per size and memory kind")
    ap.add_argument("--concurrent", type=int, default=200, help="distinct small POSTs at once (0 to skip)")
    ap.add_argument("--only-posts", action="store_true", help="only the cold-POST-by-size, concurrent and RSS rows")
    ap.add_argument("--big-views", type=int, default=12,
                    help="distinct largest-size plans read twice (plan, exports, dashboard) for the RSS row (0 to skip)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pipeplan-bench-"))
    settings = {"database_url": args.database_url or f"sqlite:///{tmp / 'bench.db'}",
                "redis_url": args.redis_url, "queue_name": f"bench-{uuid.uuid4().hex[:6]}"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPLAN_")}
    env.update({f"PIPEPLAN_{k.upper()}": v for k, v in settings.items()})
    env["PIPEPLAN_AUTO_MIGRATE"] = "true"
    env["PIPEPLAN_HTTP_WORKERS"] = str(args.http_workers)
    env["PYTHONPATH"] = str(ROOT)
    base = f"http://127.0.0.1:{args.port}"
    server = start_server(env, args.port, tmp / "server.log")
    results: dict = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        if args.sizes:
            sizes = [tuple(int(v) for v in part.split("x")) for part in args.sizes.split(",")]
            results["cold_by_size"] = cold_by_size(base, sizes, args.size_reps)
        if args.concurrent:
            res = results["concurrent_posts"] = asyncio.run(concurrent_posts(base, args.concurrent))
            print(f"{res['n']} concurrent distinct small POSTs (P=4 M=8): p50 {res['p50_ms']:.0f} ms, p99"
                  f" {res['p99_ms']:.0f} ms, all done in {res['wall_s']:.1f} s  codes {res['codes']}", flush=True)
        if args.big_views:
            res = results["memory"] = memory_after_big_views(base, server.pid, args.big_views)
            print(f"server RSS with {res['n']} distinct P=64 M=512 plans: {res['start_mib']:.0f} MiB at start,"
                  f" {res['after_posts_mib']:.0f} after the POSTs, {res['after_round_1_mib']:.0f} / "
                  f"{res['after_round_2_mib']:.0f} after reading them all once / twice, {res['idle_5s_mib']:.0f}"
                  " 5 s later", flush=True)
        if not args.only_posts:
            # cold POST: cache miss -> best heuristic inline -> stored revision 1 -> response
            cold = []
            with httpx.Client(timeout=30) as c:
                for _ in range(args.cold_posts):
                    doc = {"problem": problem(8, 32).model_dump(mode="json"), "time_budget_s": 1}
                    t0 = time.perf_counter()
                    r = c.post(f"{base}/v1/plans", json=doc)
                    cold.append(time.perf_counter() - t0)
                    assert r.status_code == 201, r.text
                key = r.json()["problem_key"]
                size = len(c.get(f"{base}/v1/plans/{key}").content)
                etag = c.get(f"{base}/v1/plans/{key}").headers["etag"]
            results["cold_post"] = {"n": len(cold), "p50_ms": pct(cold, 50) * 1000, "p99_ms": pct(cold, 99) * 1000,
                                    "max_ms": max(cold) * 1000}
            print(f"cold POST P=8 M=32 (n={len(cold)}): p50 {results['cold_post']['p50_ms']:.0f} ms, "
                  f"p99 {results['cold_post']['p99_ms']:.0f} ms")
            path = f"/v1/plans/{key}"
            results["get_plan_bytes"] = size
            for name, headers in (("get_200", ""), ("get_304", f"If-None-Match: {etag}\r\n")):
                results[name] = []
                for n in (int(x) for x in args.clients.split(",")):
                    res = asyncio.run(load("127.0.0.1", args.port, path, n, args.duration, headers))
                    results[name].append(res)
                    print(f"{name} ({size} B plan) clients={n:>3}: {res['rps']:7.0f} req/s  p50 {res['p50_ms']:6.1f} ms"
                          f"  p99 {res['p99_ms']:6.1f} ms  codes {res['codes']}")
            results["sse"] = sse_latency(base, settings, args.improvements, args.subscribers)
            s = results["sse"]
            print(f"improvement -> SSE ({s['subscribers']} subscribers, {s['events']} events): p50 {s['p50_ms']:.1f} ms, "
                  f"p99 {s['p99_ms']:.1f} ms, max {s['max_ms']:.1f} ms; of which publish -> client p50 "
                  f"{s['publish_to_client_p50_ms']:.1f} ms, p99 {s['publish_to_client_p99_ms']:.1f} ms")
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        cleanup_queue(args.redis_url, settings["queue_name"])
    results["loadavg_end"] = os.getloadavg()
    print(f"load average (1 min) at start {results['loadavg_start'][0]:.1f}, at end {results['loadavg_end'][0]:.1f}"
          f" on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
