"""The bench's bookkeeping on synthetic runs: resume, speed-up tables, greedy check, plots."""

from __future__ import annotations

import json

import pytest

from specdec.bench import jobs, plots, report
from specdec.bench.report import write_report
from specdec.metrics import AcceptanceStats


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
        "transformers": "x", "cores": 2}}, plots.write_plots(runs, tmp_path))
    assert "| ngram | 2.50x | 2.50x |" in text  # 25 / 10
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
    assert "llama.cpp methods skipped: llama-cpp-python is not installed (pip install -e '.[llamacpp]')" in report


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
    assert "llama.cpp prompt-lookup speculation: 1 of 1 greedy runs differ from `llamacpp_plain`" in report
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


def test_methods_run_back_to_back_in_alternating_order(tmp_path, monkeypatch):
    """Each prompt runs every method back to back, in reversed order on every other prompt (the
    machine's speed drifts: a fixed order would favour the same methods); the report keeps the
    methods in the order they were asked for."""
    workloads = {"code": {"grounded": True, "prompts": ["p0", "p1"]}, "qa": {"grounded": True, "prompts": ["q0"]}}
    monkeypatch.setattr(jobs, "load_workloads", lambda include_extra=False: workloads)
    calls = []

    class FakeBench:
        def __init__(self, *a, **kw):
            pass

        def encode(self, prompt):
            return [1]

        def run(self, method, ids, temperature, seed, stop_at_eos=False):
            calls.append(method)
            return {"token_ids": [1, 2], "metrics": {"throughput_tok_s": 10.0, "target_calls_per_token": 1.0}}

    monkeypatch.setattr(jobs, "Bench", FakeBench)
    results = jobs.run_bench(tmp_path, ["plain", "ngram", "suffix"], [0.0], None, "t", "d", "int8", 1, 4, 8)
    # code p0, qa q0 (prompt index 0), then code p1
    assert calls == ["plain", "ngram", "suffix", "suffix", "ngram", "plain", "plain", "ngram", "suffix"]
    assert [r["method"] for r in results["runs"][:3]] == ["plain", "ngram", "suffix"]
    assert "| plain | 1.00x | 1.00x | 1.00x |" in (tmp_path / "report.md").read_text()


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


def test_head_confidence_bins_acceptance_by_the_gate_score():
    conf = _script("head_confidence")
    steps = [{"conf": [0.95, 0.9], "accepted": 2}, {"conf": [0.92, 0.1], "accepted": 1},
             {"conf": [0.05, 0.5], "accepted": 0}, {"conf": [0.03], "accepted": 1}]
    first = {tuple(r["bin"]): (r["accepted"], r["steps"]) for r in conf.calibration(steps, 1, product=False)}
    assert first == {(0.9, 1.0): (2, 2), (0.0, 0.05): (1, 1), (0.05, 0.1): (0, 1)}
    # position 2: only steps whose first draft was accepted reach it; by the product of the two
    second = {tuple(r["bin"]): (r["accepted"], r["steps"]) for r in conf.calibration(steps, 2, product=True)}
    assert second == {(0.8, 0.9): (1, 1), (0.05, 0.1): (0, 1)}


def test_chain_cut_bench_registers_cut_methods_the_bench_runs_by_their_names():
    import specdec.speculation as speculation

    cut_bench = _script("chain_cut_bench")
    saved = dict(speculation.METHODS)
    try:
        assert not jobs.known_method("hybrid_head_g0.35")
        names = cut_bench.add_cut_methods([0.0, 0.35], silent=[0.2])
        assert names == ["hybrid_head_g0", "hybrid_head_g0.35", "hybrid_head_g0.2_silent"]
        assert all(jobs.known_method(n) for n in names)  # registered in METHODS: nothing patched in the bench
        assert jobs._method_spec("hybrid_head_g0", 4) == ("hybrid-head-g0", "auto")
        assert jobs._method_spec("hybrid_head_g0.2_silent", 4) == ("hybrid-head-g0.2-silent", "auto")
        assert jobs._method_spec("head_k2", 4) == ("head", 2)  # the bench's own names still resolve
        assert not jobs.known_method("none")  # plain decoding is the bench's "plain"
        assert speculation.METHODS["hybrid-head-g0.35"].needs_head
    finally:
        speculation.METHODS.clear()
        speculation.METHODS.update(saved)


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


def test_lookup_replay_match_length_and_the_heads_expected_accepted():
    replay = _script("lookup_replay")
    assert replay.match_length([1, 2, 3, 1, 2], 2, 4) == 2
    assert replay.match_length([1, 2, 3, 4, 9, 1, 2, 3, 4], 2, 4) == 4  # capped at hi, though 4 of 4 repeat
    assert replay.match_length([1, 2, 3, 4, 9, 2, 3, 4], 2, 4) == 3
    assert replay.match_length([1, 2, 3, 4, 5], 2, 4) == 0  # no suffix occurred before
    assert replay.match_length([7, 7], 2, 4) == 0  # the suffix itself is not an earlier occurrence
    assert replay.match_length([7, 7, 7], 2, 4) == 2  # overlapping occurrences count

    def run(method, accepted, reached, category="code", temperature=0.0):
        return {"method": method, "category": category, "temperature": temperature,
                "metrics": {"acceptance": {"accepted_per_position": accepted, "reached_per_position": reached}}}

    runs = [run("head", [1, 1], [2, 1]), run("head", [1, 0], [2, 1]), run("plain", [], []),
            run("head", [9, 9], [9, 9], category="math"), run("head", [0, 0], [9, 9], temperature=0.7)]
    # pooled over the two code runs: a1 = 2/4, a2 = 1/2, so E = 0.5 + 0.5 * 0.5
    assert abs(replay.head_expected_accepted(runs, "code", 0.0) - 0.75) < 1e-12
    assert replay.head_expected_accepted(runs, "qa", 0.0) is None


def test_fit_gap_groups_name_slices_of_own_answers():
    gap = _script("fit_gap")
    name, part = gap.parse_group("seen=sharegpt:222-225")
    assert (name, part.source, list(part.batches)) == ("seen", "sharegpt", [222, 223, 224])
    assert gap.parse_group("x=sharegpt-translate:4")[1].batches == range(0, 4)
    for bad in ("sharegpt:1-2", "=sharegpt:1-2", "a=nosuch:1-2", "a=sharegpt:5-5"):
        with pytest.raises(ValueError):
            gap.parse_group(bad)


class _CountingDraft:
    """A model draft that proposes zeros and keeps what it was fed (the hybrid's queue)."""

    tree_mode, wants_target_hidden, feature_layers = "chains", False, ()

    def __init__(self) -> None:
        self.fed: list[list[list[int]]] = []

    def add(self, prompts, params, generator, target_hidden=None) -> None:
        pass

    def propose(self, pending, k, tree=False):
        import torch

        from specdec.proposers.base import Proposal

        self.fed.append(pending)
        return Proposal(torch.zeros(len(pending), k, dtype=torch.long), None)

    def observe(self, num_accepted, target_hidden=None) -> None:
        pass

    def retain(self, rows) -> None:
        pass


def test_source_race_bench_races_lookup_and_draft_where_the_lookup_matches(monkeypatch):
    """benchmarks/source_race_bench.py's RacingHybrid: where every row's lookup matches, the
    source that has committed more tokens per second at such steps runs: each is tried first (the
    lookup, then the draft), then the faster, and every 8th matched step the other. Steps without
    a match always draft and teach the race nothing; the plain hybrid (the default) drafts with
    the lookup at every match. A step's seconds run from ``propose`` to the end of ``observe``
    (a fake clock here)."""
    import torch

    from specdec.proposers import HybridProposer, NgramProposer
    from specdec.sampling import SamplingParams

    bench = _script("source_race_bench")
    clock = [0.0]
    monkeypatch.setattr(bench, "perf_counter", lambda: clock[0])
    names = {False: "ngram", True: "draft"}

    def run(hybrid, prompt, tokens, accepted, seconds):
        hybrid.add([prompt], [SamplingParams(temperature=0.0)], torch.Generator())
        sources = []
        for token in tokens:
            pending = [[token]]  # a new list each step, as the engine's
            source = hybrid.next_source(pending)
            assert hybrid.next_source(pending) == source  # asked twice a step: one choice
            hybrid.propose(pending, 3)
            clock[0] += seconds[source]
            hybrid.observe(torch.tensor([accepted[source]]))
            sources.append(source)
        return sources

    # The lookup's matches commit 1 token in 10 ms (100 tokens/s), the draft 4 in 20 ms (200 tokens/s).
    accepted, seconds = {"ngram": 0, "draft": 3}, {"ngram": 0.010, "draft": 0.020}
    repeats = [1, 2, 1, 2, 1, 2]  # the 2-token lookup always matches
    draft = _CountingDraft()
    hybrid = bench.RacingHybrid(NgramProposer(1, 2), draft)
    sources = run(hybrid, repeats, repeats * 3, accepted, seconds)
    assert sources[:2] == ["ngram", "draft"]
    assert sources[2:].count("draft") == 14 and sources[2:].count("ngram") == 2  # steps 8 and 16 explore
    rates = {names[arm]: hybrid.race.rate(arm) for arm in names}
    assert rates["draft"] == pytest.approx(200) and rates["ngram"] == pytest.approx(100)
    assert draft.fed[0] == [[1, 2]]  # the lookup step's token, queued, then the draft step's
    # The other way round: a lookup committing 4 in 10 ms keeps the lookup.
    hybrid = bench.RacingHybrid(NgramProposer(1, 2), _CountingDraft())
    assert run(hybrid, repeats, repeats * 3, {"ngram": 3, "draft": 1}, seconds)[2:].count("ngram") == 14
    # No match (distinct tokens): the draft, and the race learns nothing.
    hybrid = bench.RacingHybrid(NgramProposer(2, 2), _CountingDraft())
    assert set(run(hybrid, [10, 11, 12], [13, 14, 15, 16, 17, 18], accepted, seconds)) == {"draft"}
    assert hybrid.race.rate(True) is None and hybrid.race.rate(False) is None
    # The default hybrid: the lookup whenever it matches.
    assert set(run(HybridProposer(NgramProposer(1, 2), _CountingDraft()), repeats, repeats * 3, accepted,
                   seconds)) == {"ngram"}
