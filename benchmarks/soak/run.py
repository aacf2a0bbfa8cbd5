"""``make soak``: a load and soak test of ``specdec serve`` with locust (headless, loopback only,
bounded in time), then a report.

Starts ``specdec serve`` on 127.0.0.1 (a free port), samples the server's resident memory every
few seconds, runs ``locustfile.py`` for ``--minutes`` with ``--users`` clients, stops the server
with SIGTERM, and writes ``report.json`` and ``report.md`` into ``--out``: requests/s, p50/p99 of
TTFT and TPOT, requests by outcome, failures by kind, memory over time, tracebacks in the server's
log. Exit 0 only when the conditions hold: 0 lost requests, 0 5xx, 0 tracebacks, and memory after
warm-up growing by less than ``--max-growth-mb``.

    .venv/bin/python benchmarks/soak/run.py --target smollm2-135m-instruct --minutes 3 --users 16 --out soak-out
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
        return f"{model} ({', '.join(isa)})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--proposer", default=None, help="passed to specdec serve (default: its default)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--warmup-s", type=float, default=30.0, help="memory growth is measured after this")
    ap.add_argument("--max-growth-mb", type=float, default=100.0)
    ap.add_argument("--out", default="soak-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    specdec = Path(sys.executable).with_name("specdec")
    cmd = [str(specdec), "serve", "--target", args.target, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "soak", "--max-batch", "8", "--max-queue", "64", "--max-model-len", "1024"]
    if args.proposer:
        cmd += ["--proposer", args.proposer]
    log = open(out / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if server.poll() is not None or time.time() > deadline:
            print(f"the server did not start; see {out / 'server.log'}", file=sys.stderr)
            server.kill()
            return 1
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)

    memory: list[tuple[float, float]] = []
    stop = threading.Event()
    t0 = time.time()

    def sample() -> None:
        while not stop.is_set():
            memory.append((round(time.time() - t0, 1), round(_rss_mb(server.pid), 1)))
            stop.wait(5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seconds = int(args.minutes * 60)
    locust = [str(Path(sys.executable).with_name("locust")), "-f", str(HERE / "locustfile.py"), "--headless",
              "-u", str(args.users), "-r", str(max(1, args.users // 4)), "-t", f"{seconds}s", "--host", url,
              "--csv", str(out / "locust"), "--only-summary", "--stop-timeout", "30"]
    started = time.time()
    subprocess.run(locust, stdout=open(out / "locust.log", "w"), stderr=subprocess.STDOUT, timeout=seconds + 180)
    elapsed = time.time() - started
    stop.set()
    sampler.join()
    health_after = httpx.get(url + "/health", timeout=5).status_code
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()

    stats = {row["Name"] if row["Type"] not in ("TTFT", "TPOT") else row["Type"]: row
             for row in csv.DictReader(open(out / "locust_stats.csv")) if row["Name"] != "Aggregated"}
    failures = [row for row in csv.DictReader(open(out / "locust_failures.csv"))]
    by_kind: dict[str, int] = {}
    for row in failures:
        kind = row["Error"].split(":")[0].split()[0].strip("'\"")
        by_kind[kind] = by_kind.get(kind, 0) + int(row["Occurrences"])
    requests = {name: int(row["Request Count"]) for name, row in stats.items() if name not in ("TTFT", "TPOT")}
    text = (out / "server.log").read_text()
    tracebacks = text.count("Traceback (most recent call last)")
    after = [m for t, m in memory if t >= args.warmup_s]
    growth = (max(after[len(after) // 2:]) - after[0]) if len(after) >= 4 else float("nan")

    def pct(name: str, col: str) -> float | None:
        row = stats.get(name)
        return float(row[col]) if row and row[col] not in ("", "N/A") else None

    report = {
        "machine": _cpu(), "target": args.target, "users": args.users, "seconds": round(elapsed),
        "requests": requests, "requests_per_s": round(sum(requests.values()) / elapsed, 2),
        "ttft_ms": {"p50": pct("TTFT", "50%"), "p99": pct("TTFT", "99%")},
        "tpot_ms": {"p50": pct("TPOT", "50%"), "p99": pct("TPOT", "99%")},
        "failures_by_kind": by_kind, "lost": by_kind.get("lost", 0), "server_5xx": by_kind.get("5xx", 0),
        "tracebacks_in_server_log": tracebacks, "health_after": health_after,
        "memory_mb": memory, "memory_growth_after_warmup_mb": round(growth, 1),
    }
    ok = (report["lost"] == 0 and report["server_5xx"] == 0 and not by_kind and tracebacks == 0
          and health_after == 200 and growth < args.max_growth_mb)
    report["conditions_hold"] = ok
    (out / "report.json").write_text(json.dumps(report, indent=1))
    rows = "\n".join(f"| {name} | {n} |" for name, n in sorted(requests.items()))
    (out / "report.md").write_text(
        f"Soak test: `{args.target}`, {args.users} users, {elapsed:.0f} s, on {report['machine']}\n\n"
        f"| requests/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | lost | 5xx | other failures | tracebacks "
        f"| RSS growth after {args.warmup_s:.0f} s |\n|---|---|---|---|---|---|---|---|\n"
        f"| {report['requests_per_s']} | {report['ttft_ms']['p50']} / {report['ttft_ms']['p99']} | "
        f"{report['tpot_ms']['p50']} / {report['tpot_ms']['p99']} | {report['lost']} | {report['server_5xx']} | "
        f"{sum(by_kind.values()) - report['lost'] - report['server_5xx']} | {tracebacks} | {growth:.1f} MB |\n\n"
        f"| request kind | count |\n|---|---|\n{rows}\n")
    print((out / "report.md").read_text())
    print("conditions hold" if ok else f"CONDITIONS FAILED: {json.dumps({k: report[k] for k in ('failures_by_kind', 'tracebacks_in_server_log', 'memory_growth_after_warmup_mb')})}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
