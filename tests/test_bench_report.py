"""The bench's bookkeeping on synthetic runs: resume, speed-up tables, greedy check, plots."""

from __future__ import annotations

import json

import pytest

from specdec.bench import jobs, plots, report
from specdec.bench.report import write_report
from specdec.core.metrics import AcceptanceStats


def _run(method, category, prompt, temp, tps, tokens, acc=None):
    metrics = {"throughput_tok_s": tps, "target_calls_per_token": 0.5}
    if acc is not None:
        metrics["acceptance"] = {"verify_calls_with_drafts": 4, "mean_accepted_per_call": 2.0, "acceptance_rate": 0.5,
                                 "full_acceptance_rate": 0.25, "first_rejection_histogram": acc}
    return {"method": method, "category": category, "prompt": prompt, "temperature": temp,
            "token_ids": tokens, "metrics": metrics}


def test_report_tables_greedy_check_and_plots(tmp_path):
    runs = [
        _run("plain", "code", 0, 0.0, 10.0, [1, 2, 3]),
        _run("hf_plain", "code", 0, 0.0, 8.0, [1, 2, 4]),
        _run("ngram", "code", 0, 0.0, 25.0, [1, 2, 3], acc=[1, 2]),
        _run("draft_auto", "code", 0, 0.0, 12.0, [1, 9, 3], acc=[0, 1]),  # a deliberate difference
        _run("ngram_k2", "code", 0, 0.0, 15.0, [1, 2, 3], acc=[1]),
        _run("ngram_k8", "code", 0, 0.0, 20.0, [1, 2, 3], acc=[2]),
        _run("hf_assisted", "code", 0, 0.0, 9.0, [1, 2, 4]),
    ]
    runs[2]["metrics"].update(ttft_s=0.5, tpot_s=0.04, total_s=2.0, time_breakdown_s={"draft": 0.1})
    runs[2]["metrics"]["acceptance"].update(reached_per_position=[4, 3, 1], accepted_per_position=[3, 1, 0])
    text = report.write_report({"runs": runs, "environment": {
        "date": "x", "target": "t", "draft": "d", "dtype": "int8", "max_new_tokens": 3, "torch": "x",
        "transformers": "x", "cores": 2, "cpu": "Some CPU (avx2 fma)"}}, plots.write_plots(runs, tmp_path))
    assert "| ngram | 2.50x | 2.50x |" in text  # 25 / 10
    assert "2 threads on Some CPU (avx2 fma)." in text
    assert "draft_auto / code #0: differs from its plain decoding at token 1" in text
    assert "specdec speculative: 1 of 4 greedy runs differ from `plain` (3 identical):" in text
    assert "transformers assisted / prompt-lookup: all 1 greedy runs are token-identical to `hf_plain`." in text
    assert "| ngram | 0.0 | 500 | 40.0 | 25.00 | 5.0% |" in text  # the time table
    assert "| ngram | 0.0 | 2.00 | 50% | 25% | 0.75 / 0.33 / 0.00 | 0.500 | 25.00 |" in text  # pooled a_i
    assert "![speedup_vs_k](speedup_vs_k.png)" in text
    for name in ["speedup_by_category.png", "first_rejection.png", "speedup_vs_k.png"]:
        assert (tmp_path / name).stat().st_size > 1000


def test_resume_skips_finished_runs(tmp_path, monkeypatch):
    """Runs already in runs.jsonl are not repeated (nothing is loaded when nothing is left)."""
    workloads = {"code": {"grounded": True, "prompts": ["p0"]}}
    monkeypatch.setattr(jobs, "load_workloads", lambda include_extra=False: workloads)
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.write(json.dumps(_run("plain", "code", 0, 0.0, 10.0, [1])) + "\n")

    def no_bench(*a, **kw):
        raise AssertionError("nothing should have been run")

    monkeypatch.setattr(jobs, "Bench", no_bench)
    results = jobs.run_bench(tmp_path, ["plain"], [0.0], None, "t", "d", "int8", 1, 4, 8)
    assert len(results["runs"]) == 1
    assert (tmp_path / "report.md").exists() and (tmp_path / "results.json").exists()


def test_llamacpp_methods_are_skipped_and_said_so_without_the_extra(tmp_path, monkeypatch):
    workloads = {"code": {"grounded": True, "prompts": ["p0"]}}
    monkeypatch.setattr(jobs, "load_workloads", lambda include_extra=False: workloads)
    monkeypatch.setattr(jobs.llamacpp, "available", lambda: False)
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.write(json.dumps(_run("plain", "code", 0, 0.0, 10.0, [1])) + "\n")
    monkeypatch.setattr(jobs, "Bench", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("nothing to run")))
    results = jobs.run_bench(tmp_path, ["plain", "llamacpp_plain", "llamacpp_spec"], [0.0], None, "t", "d", "int8",
                              1, 4, 8)
    assert [r["method"] for r in results["runs"]] == ["plain"]
    report = (tmp_path / "report.md").read_text()
    assert "llamacpp_plain, llamacpp_spec skipped: not installed (pip install -e '.[llamacpp]')" in report


def test_llamacpp_greedy_check_and_block_costs_in_the_report(tmp_path):
    runs = [
        _run("plain", "code", 0, 0.0, 10.0, [1, 2, 3]),
        _run("ngram", "code", 0, 0.0, 12.0, [1, 2, 3], acc=[1]),
        _run("llamacpp_plain", "code", 0, 0.0, 20.0, [1, 2, 3]),
        _run("llamacpp_spec", "code", 0, 0.0, 22.0, [1, 2, 7]),  # llama.cpp's speculation changed its output
    ]
    peer = {"prefix_tokens": 40,
            "specdec": {"eval_ms": {"1": 50.0, "5": 75.0}, "ratio": 1.5, "logit_max_diff": 0.0},
            "llama.cpp": {"eval_ms": {"1": 36.0, "5": 108.0}, "ratio": 3.0, "logit_max_diff": 0.52}}
    report = write_report({"runs": runs, "peer_costs": peer, "notes": [], "environment": {
        "date": "x", "target": "t", "draft": "d", "dtype": "q4", "max_new_tokens": 3, "torch": "x",
        "transformers": "x", "cores": 2}}, [])
    assert "specdec speculative: all 1 greedy runs are token-identical to `plain`." in report
    assert "llama.cpp speculation (prompt lookup, draft model): 1 of 1 greedy runs differ from `llamacpp_plain`" in report
    assert "| llamacpp_plain | 2.00x | 2.00x |" in report
    assert "| specdec | 50.0 | 75.0 | 1.50x | 0 |" in report
    assert "| llama.cpp | 36.0 | 108.0 | 3.00x | 0.52 |" in report


def test_workloads_have_six_categories_of_eight():
    w = jobs.load_workloads()
    assert len(w) == 6 and all(len(c["prompts"]) >= 8 for c in w.values())
    extra = jobs.load_workloads(include_extra=True)
    assert set(extra) - set(w) == {"editing"} and extra["editing"]["grounded"] and len(extra["editing"]["prompts"]) == 8


def test_acceptance_per_position_counters():
    # 10 calls with k=3: first rejection at 0 (2 calls), at 2 (3 calls), 5 full accepts
    stats = AcceptanceStats()
    for accepted in [0, 0, 2, 2, 2, 3, 3, 3, 3, 3]:
        stats.record(3, accepted)
    assert stats.per_position() == [8 / 10, 8 / 8, 5 / 8]
    assert stats.first_rejection == [2, 0, 3] and stats.full_accepts == 5
    # ragged k (adaptive): a call with k=1 reaches only position 0
    stats.record(1, 1)
    stats.record(5, 4)
    assert stats.reached_at == [12, 9, 9, 1, 1] and stats.accepted_at == [10, 9, 6, 1, 0]
    merged = stats.merge(stats)
    assert merged.reached_at == [24, 18, 18, 2, 2] and merged.per_position() == stats.per_position()
    assert stats.to_dict()["acceptance_per_position"] == [round(10 / 12, 4), 1.0, round(6 / 9, 4), 1.0, 0.0]


def test_each_bench_run_starts_with_an_empty_suffix_history(tmp_path):
    """A run must not see other runs' answers to the same prompt through the suffix proposers'
    shared history (it predicted a repeated greedy answer whole: 3.45x instead of ~1.4x)."""
    from tiny_models import hf_tiny, save_hf_dir

    model = save_hf_dir(hf_tiny("qwen2", seed=3), tmp_path / "model")
    bench = jobs.Bench(str(model), None, "float32", 40, 4, 8, head=None)
    prompt = [5, 6, 7, 8, 9, 10]
    sizes = []
    for _ in range(2):
        answer = bench.run("suffix", prompt, 0.0, seed=0)["token_ids"]
        sizes.append(len(bench.gen.suffix_history.index.tokens))
    # after each run: at most that run's own answer (and a separator), never the earlier run's too
    assert 0 < sizes[0] <= len(answer) + 1 and 0 < sizes[1] <= len(answer) + 1


def test_stop_at_eos_ends_a_run_where_the_answer_ends(tmp_path):
    """Categories marked ``stop_at_eos`` stop at the end-of-turn token; the others generate exactly
    max_new_tokens (past the end, for equal lengths across methods)."""
    from tiny_models import hf_tiny, save_hf_dir

    model = save_hf_dir(hf_tiny("qwen2", seed=3), tmp_path / "model")
    bench = jobs.Bench(str(model), None, "float32", 40, 4, 8, head=None)
    prompt = [5, 6, 7, 8, 9, 10]
    full = bench.run("plain", prompt, 0.0, seed=0)["token_ids"]
    assert len(full) == 40
    bench.gen.eos_token_ids = {full[3]}  # pretend the 4th generated token ends the turn
    for method in ("plain", "ngram"):
        stopped = bench.run(method, prompt, 0.0, seed=0, stop_at_eos=True)["token_ids"]
        assert stopped == full[: full.index(full[3]) + 1]
    assert bench.run("plain", prompt, 0.0, seed=0)["token_ids"] == full  # the flag does not stick


def _fake_bench(monkeypatch, failures: dict[str, str] | None = None) -> list[str]:
    """Replace the bench's runner: every run answers [1, 2] at 10 tok/s, a method in ``failures``
    raises PeerFailed with its message. Returns the list of methods run, in order."""
    calls: list[str] = []

    class FakeBench:
        def __init__(self, *a, **kw):
            pass

        def encode(self, prompt):
            return [1]

        def run(self, method, ids, temperature, seed, stop_at_eos=False):
            calls.append(method)
            if method in (failures or {}):
                raise jobs.PeerFailed(failures[method])
            return {"token_ids": [1, 2], "metrics": {"throughput_tok_s": 10.0, "target_calls_per_token": 1.0}}

        def close(self):
            calls.append("close")

    monkeypatch.setattr(jobs, "Bench", FakeBench)
    return calls


def test_methods_run_back_to_back_in_alternating_order(tmp_path, monkeypatch):
    """Each prompt runs every method back to back, in reversed order on every other prompt (the
    machine's speed drifts: a fixed order would favour the same methods); the report keeps the
    methods in the order they were asked for."""
    workloads = {"code": {"grounded": True, "prompts": ["p0", "p1"]}, "qa": {"grounded": True, "prompts": ["q0"]}}
    monkeypatch.setattr(jobs, "load_workloads", lambda include_extra=False: workloads)
    calls = _fake_bench(monkeypatch)
    results = jobs.run_bench(tmp_path, ["plain", "ngram", "suffix"], [0.0], None, "t", "d", "int8", 1, 4, 8)
    # code p0, qa q0 (prompt index 0), then code p1
    assert calls == ["plain", "ngram", "suffix", "suffix", "ngram", "plain", "plain", "ngram", "suffix", "close"]
    assert [r["method"] for r in results["runs"][:3]] == ["plain", "ngram", "suffix"]
    assert "| plain | 1.00x | 1.00x | 1.00x |" in (tmp_path / "report.md").read_text()


def test_a_peer_that_is_missing_or_fails_is_reported_in_one_line_and_never_fails_the_bench(tmp_path, monkeypatch):
    """A peer not installed is skipped; one that raises on this machine (here openvino_spec, as
    OpenVINO's GGUF reader does on a file with Q5_0 tensors) is dropped after its first error; the
    other methods run on and the report names both, one line each."""
    workloads = {"code": {"grounded": True, "prompts": ["p0", "p1"]}}
    monkeypatch.setattr(jobs, "load_workloads", lambda include_extra=False: workloads)
    monkeypatch.setattr(jobs.llamacpp, "available", lambda: False)
    monkeypatch.setattr(jobs.openvino, "available", lambda: True)
    failure = "openvino_spec failed: RuntimeError: [load_gguf] gguf_tensor_to_f16 failed"
    calls = _fake_bench(monkeypatch, {"openvino_spec": failure})
    methods = ["plain", "openvino_plain", "openvino_spec", "llamacpp_plain"]
    results = jobs.run_bench(tmp_path, methods, [0.0], None, "t", "d", "int8", 1, 4, 8)
    assert calls.count("openvino_spec") == 1 and calls.count("openvino_plain") == 2 and "llamacpp_plain" not in calls
    assert {r["method"] for r in results["runs"]} == {"plain", "openvino_plain"}
    report = (tmp_path / "report.md").read_text()
    assert "> llamacpp_plain, llamacpp_spec skipped: not installed (pip install -e '.[llamacpp]')." in report
    assert f"> {failure}" in report
    assert "OpenVINO GenAI speculative / prompt lookup" not in report  # no speculative run of it to check


def _script(name: str):
    """A module of benchmarks/ (scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_ratios_and_the_sign_test():
    paired = _script("paired")

    def run(method, prompt, t, speed):
        return {"method": method, "category": "qa", "prompt": prompt, "temperature": t,
                "metrics": {"throughput_tok_s": speed}}

    runs = [run("plain", 0, 0.0, 10.0), run("x", 0, 0.0, 12.0), run("plain", 1, 0.0, 10.0), run("x", 1, 0.0, 9.0),
            run("x", 2, 0.0, 50.0), run("plain", 0, 0.7, 5.0), run("x", 0, 0.7, 10.0)]
    assert paired.paired(runs, "plain", "x", 0.0) == [1.2, 0.9]  # prompt 2 has no baseline: left out
    assert paired.paired(runs, "plain", "x", 0.7) == [2.0]
    assert paired.sign_test(5, 10) == 1.0
    assert abs(paired.sign_test(0, 5) - 2 / 32) < 1e-12
    assert abs(paired.sign_test(34, 48) - 0.00552) < 1e-4


def test_serve_bench_levels_send_new_prompts_until_the_list_runs_out():
    serve_bench = _script("serve_bench")
    levels = [(0, 1), (0, 4), (1, 1), (1, 4)]
    slices = serve_bench.level_prompts(levels, lambda c: 3 if c > 1 else 6, 20)
    assert slices[(0, 1)] == list(range(6)) and slices[(0, 4)] == list(range(6, 18))
    assert slices[(1, 1)] == [18, 19, 0, 1, 2, 3]  # wrapped: the bench restarts the server first
    assert len(slices[(1, 4)]) == 12


def test_speed_ceiling_bounds_follow_the_cost_model():
    ceiling = _script("speed_ceiling")
    costs = ceiling.parse_costs("1:1,5:1.8,9:3.0")
    assert ceiling.best_k(0.0, costs, 0.0, 8) == (0, 1.0)  # drafts never hold: plain decoding
    k, per_token = ceiling.best_k(1.0, costs, 0.0, 8)  # drafts always hold: the most positions per second
    assert k == 8 and abs(per_token - 3.0 / 9) < 1e-12
    k, per_token = ceiling.best_k(1.0, costs, 0.0, 12)  # r(13) extrapolated from the last two sizes: 4.2
    assert k == 12 and abs(per_token - 4.2 / 13) < 1e-12
    # r(2) = 1.2 and r(3) = 1.4 interpolated; at a = 0.6, E(1) = 1.6 and E(2) = 1.96: 0.75 against 0.714 a token
    k, per_token = ceiling.best_k(0.6, costs, 0.0, 2)
    assert k == 2 and abs(per_token - 1.4 / 1.96) < 1e-12
    k, per_token = ceiling.best_k(0.6, costs, 0.1, 2)  # a draft at 0.1 of a step: 1.3 / 1.6 against 1.6 / 1.96
    assert k == 1 and abs(per_token - 1.3 / 1.6) < 1e-12

    def plain(category, ttft, total):
        return {"method": "plain", "category": category, "prompt": 0, "temperature": 0.0,
                "metrics": {"ttft_s": ttft, "total_s": total, "generated_tokens": 10}}

    runs = [plain("qa", 1.0, 4.0), plain("code", 0.0, 3.0), plain("code", 2.0, 2.0)]
    row = ceiling.bounds(runs, 1.0, costs, 0.0, 8, 0.0)
    # qa: 4 / (1 + 3 / 3) = 2; code: median of 3 / 1 and 2 / 2
    assert abs(row["categories"]["qa"] - 2.0) < 1e-12 and abs(row["categories"]["code"] - 2.0) < 1e-12
    assert abs(ceiling.bounds(runs, 0.0, costs, 0.0, 8, 0.0)["median"] - 1.0) < 1e-12
    assert abs(ceiling.prefill_share(runs, 0.0) - 0.25) < 1e-12
    with pytest.raises(ValueError, match="n = 1"):
        ceiling.parse_costs("2:1.1,5:1.8")
    with pytest.raises(ValueError, match="second size"):
        ceiling.parse_costs("1:1")


def test_fit_gap_groups_name_slices_of_own_answers():
    from specdec.training import fit_gap as gap

    name, part = gap.parse_group("seen=sharegpt:222-225")
    assert (name, part.source, list(part.batches)) == ("seen", "sharegpt", [222, 223, 224])
    assert gap.parse_group("x=sharegpt-translate:4")[1].batches == range(0, 4)
    for bad in ("sharegpt:1-2", "=sharegpt:1-2", "a=nosuch:1-2", "a=sharegpt:5-5"):
        with pytest.raises(ValueError):
            gap.parse_group(bad)



STAND_IN_BASE = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server(BaseHTTPRequestHandler):
    """A peer's stand-in: healthy at once, quiet, streaming server-sent events."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')

    def events(self, chunks):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {{json.dumps(chunk)}}\\n\\n".encode())
            self.wfile.flush()
'''
SERVE = '''
port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''
STAND_IN_SERVER = STAND_IN_BASE + '''
# llama-server's command line and /completion stream (the client's test only)
if "-md" not in sys.argv:
    sys.exit("error: this stand-in needs -md")


class Handler(Server):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["ignore_eos"] and not body["cache_prompt"] and body["top_k"] == 0
        tokens = [body["prompt"][-1] + i for i in range(1, body["n_predict"] + 1)]
        last = {{"timings": {{"draft_n": 6, "draft_n_accepted": 4}}}}
        self.events([{{"tokens": tokens[i:i + 2], "stop": i + 2 >= len(tokens), **(last if i + 2 >= len(tokens) else {{}})}}
                     for i in range(0, len(tokens), 2)])  # two tokens a chunk, as an accepted draft gives them
''' + SERVE


def test_llama_server_client_cuts_at_eos_and_reports_a_failed_start_in_one_line(tmp_path, monkeypatch):
    """`llamacpp_draft`'s client over llama-server's protocol (a stand-in script here; the real
    server is measured by `specdec bench --methods llamacpp_draft`): the stream's token ids, the
    cut after an end-of-turn token, draft counts from the last chunk; a server that exits at start
    is a one-line error."""
    import sys

    from specdec.bench import llama_server

    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN_SERVER.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("SPECDEC_LLAMA_SERVER", str(exe))
    assert llama_server.available()
    server = llama_server.LlamaServer(tmp_path / "t.gguf", tmp_path / "d.gguf", threads=1)
    try:
        whole = server.run([5, 10], 6, 0.0, seed=0)
        cut = server.run([5, 10], 6, 0.0, seed=0, eos=frozenset({13}))
    finally:
        server.close()
    assert whole["token_ids"] == [11, 12, 13, 14, 15, 16] and whole["metrics"]["accepted_draft_tokens"] == 4
    assert cut["token_ids"] == [11, 12, 13] and cut["metrics"]["generated_tokens"] == 3
    with pytest.raises(RuntimeError, match="llama-server exited with status 1: error: this stand-in needs -md"):
        llama_server.start(tmp_path / "t.gguf", None, threads=1)


STAND_IN_VLLM = STAND_IN_BASE + '''
# vLLM's OpenAI server's command line and /v1/completions stream (the client's test only)
assert sys.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


class Handler(Server):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["ignore_eos"] and body["return_token_ids"] and body["top_k"] == -1
        shift = 100 if "--speculative-config" in sys.argv else 0
        tokens = [body["prompt"][-1] + i + shift for i in range(1, body["max_tokens"] + 1)]
        self.events([{{"choices": [{{"text": "", "token_ids": tokens[i:i + 2],
                                     "finish_reason": "length" if i + 2 >= len(tokens) else None}}]}}
                     for i in range(0, len(tokens), 2)])
''' + SERVE


def _state_when_settled(pid: int, seconds: float = 5.0) -> str:
    """A process's state letter once it is stopped (T), or as it is after ``seconds``: a signal
    sent to a process running on another core lands a moment later."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + seconds
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        if state == "T" or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_vllm_client_streams_token_ids_cuts_at_eos_and_pauses_its_server_between_runs(tmp_path, monkeypatch):
    """`vllm_plain` / `vllm_ngram`'s client over vLLM's protocol (a stand-in script here; the real
    server is measured by `specdec bench --methods vllm_plain,vllm_ngram`): one server per method,
    the stream's token ids, the cut after an end-of-turn token, and each server stopped (SIGSTOP,
    state T) between its runs, so that its idle spinning does not slow the other methods; where
    memory has no room for two, the first ends before the second starts."""
    import sys

    from specdec.bench import vllm_server

    monkeypatch.delenv("SPECDEC_VLLM_PYTHON", raising=False)
    assert not vllm_server.available()
    exe = tmp_path / "python"
    exe.write_text(STAND_IN_VLLM.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", str(exe))
    monkeypatch.setattr(vllm_server, "available_gib", lambda: 64.0)  # room for both servers
    server = vllm_server.VllmServer(tmp_path)
    try:
        plain = server.run("vllm_plain", [5, 10], 6, 0.0, seed=0)
        cut = server.run("vllm_ngram", [5, 10], 6, 0.0, seed=0, eos=frozenset({113}))
        states = {m: _state_when_settled(p.pid) for m, (p, _) in server.servers.items()}
        monkeypatch.setattr(vllm_server, "available_gib", lambda: 4.0)  # no room: one server at a time
        server.close()
        server.run("vllm_plain", [5], 2, 0.0, seed=0)
        server.run("vllm_ngram", [5], 2, 0.0, seed=0)
        alone = list(server.servers)
    finally:
        server.close()
    assert plain["token_ids"] == [11, 12, 13, 14, 15, 16] and plain["metrics"]["generated_tokens"] == 6
    assert cut["token_ids"] == [111, 112, 113]
    assert states == {"vllm_plain": "T", "vllm_ngram": "T"}
    assert alone == ["vllm_ngram"] and server.servers == {}


def test_serve_bench_report_has_tail_latencies_errors_and_answer_independence():
    serve_bench = _script("serve_bench")
    assert serve_bench._percentile([3.0, 1.0, 2.0], 50) == 2.0 and serve_bench._percentile([1.0, 2.0], 99) == 2.0

    def level(method, throughput, texts, errors=0):
        return {"round": 0, "method": method, "clients": 16, "throughput_tok_s": throughput, "median_ttft_s": 1.0,
                "p99_ttft_s": 3.0, "p50_tpot_s": 0.05, "p99_tpot_s": 0.2, "median_latency_s": 5.0,
                "median_accepted_per_call": None, "errors": errors, "texts": texts}

    runs = [level("none", 20.0, {"0": "a", "1": "b"}), level("llamacpp_draft", 30.0, {"0": "a", "1": "B"}, errors=1)]
    text = serve_bench.report(runs, {"none": {"0": "a", "1": "b"}, "llamacpp_draft": {"0": "a", "1": "b"}})
    assert "| llamacpp_draft | 16 | 1 | 30.0 | 1.50x | 1.50 | 1.00 / 3.00 | 50 / 200 | - / - | 5.0 | nan | 1 | 1 / 2 |" in text
    assert "| none | 16 | 1 | 20.0 | 1.00x | 1.00 | 1.00 / 3.00 | 50 / 200 | - / - | 5.0 | nan | 0 | 2 / 2 |" in text
    runs[0] |= {"p50_itl_s": 0.04, "p99_itl_s": 0.09}
    assert "| 50 / 200 | 40 / 90 |" in serve_bench.report(runs, {})


def test_serve_bench_long_prompts_are_long_and_share_no_start():
    serve_bench = _script("serve_bench")
    from specdec.bench.jobs import load_workloads

    longs = serve_bench.long_prompts(load_workloads(include_extra=True)["editing"]["prompts"])
    texts = [p[0]["content"] for p in longs]
    assert len(set(t[:200] for t in texts)) == 8 and all(len(t) > 5000 for t in texts)


def test_openvino_peer_server_streams_whole_characters_and_counts_tokens():
    """The served OpenVINO peer's stream (its pipeline needs openvino; the stream does not): new
    text only when it ends on a whole character, then usage and [DONE]."""
    import asyncio

    from specdec.bench.openvino_server import _stream

    pieces = {1: "h", 2: "\ufffd", 3: "é", 4: "!"}  # token 2 alone is half of a character

    class Tokenizer:
        def decode(self, ids):
            text = "".join(pieces[i] for i in ids)
            return text.replace("\ufffdé", "é")

    async def run():
        tokens: asyncio.Queue = asyncio.Queue()
        for new in ([1], [2], [3], [4], None):
            tokens.put_nowait(new)
        return [chunk async for chunk in _stream(Tokenizer(), tokens)]

    chunks = asyncio.run(run())
    deltas = [json.loads(c[6:].split("\n")[0])["choices"][0]["delta"]["content"] for c in chunks[:-1]]
    assert deltas == ["h", "é", "!"]
    assert '"completion_tokens": 4' in chunks[-1] and chunks[-1].endswith("data: [DONE]\n\n")
