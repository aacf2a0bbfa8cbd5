import sys, statistics, argparse
sys.path.insert(0, "benchmarks")
import serve_bench as sb
from specdec.bench.jobs import load_workloads
args = argparse.Namespace(target="qwen2.5-coder-1.5b-instruct", dtype=sys.argv[1], max_batch=16)
prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}] for cat in load_workloads().values() for p in cat["prompts"]]
servers = [sb.start_server(args, "none"), sb.start_server(args, "none")]
try:
    for s, url in servers:
        sb.one_request(url, prompts[0], 8)
    res = {0: [], 1: []}
    for rnd in range(8):
        for j in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            r = sb.run_level(servers[j][1], prompts, 1, 2, 96)
            ms = 1000 * r["engine_time_s"]["target_forward"] / r["target_calls"]
            res[j].append(ms)
        print(rnd, [round(res[j][-1], 1) for j in (0, 1)], flush=True)
finally:
    for s, _ in servers:
        s.terminate(); s.wait(60)
