"""``specdec bench --speculate``: speculation at 7-8B, measured at a controlled acceptance.

Real-shape files with synthetic weights (:mod:`specdec.models.synthetic`) give every cost of a
7-8B target exactly, but no draft agrees with random weights. So acceptance is set instead of
found: :class:`ControlledProposer` runs a real draft model (its time is real: every draft token is
one forward of it, through the pruned output layer users get) but proposes the target's own
greedy continuation, known from a plain run of the same prompt, with a fraction ``a`` of the
positions right and the others replaced by wrong tokens (drawn once per position by a seeded
generator, the same for every k). Verification is the real, exact one, so the output equals
plain decoding (checked in every run) and the measured per-position acceptance comes out at ``a``.

For a target and draft, one process measures: the draft's cost ratio ``c`` (one draft forward
against one target forward), ``v(n)`` (a forward of ``n`` = 2..9 tokens against one), plain
TPOT, and at each ``a`` the speculative time for k = 1..8 fixed and for adaptive k (once per seed
of :data:`SEEDS`; the report takes medians), beside
the chain formula's prediction ``(1 - a^(k+1)) / ((1 - a)(k c + v(k+1)))``. Adaptive k runs three
times: with the target's call costs that the process's earlier runs measured (one
:class:`~specdec.core.adaptive.CallCosts`, as one API object or server keeps it); cold, in an
engine that measures them from nothing (a first one-shot ``specdec generate``); and kept, from
what that cold run learned (a second ``specdec generate``, which reads the first one's costs,
:mod:`specdec.models.costs`). llama.cpp runs the
target (and the draft, for its ``c``) in a process of its own: its plain TPOT, its ``v(n)`` and
what the same formula predicts for it. Rows go to ``speculate.jsonl`` (resumable by case) and
the table to ``speculate.md``. A bench method only: never a user's proposer.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.core.adaptive import CallCosts
from specdec.models.costs import calibrate
from specdec.proposers.base import Proposal, no_drafts
from specdec.proposers.draft_model import DraftModelProposer, DraftRow
from specdec.verify.sampling import SamplingMetadata

K_RANGE = tuple(range(1, 9))
SEEDS = 3  # each (a, k) runs once per seed; the report takes medians
SIZES = tuple(range(1, 10))
COLD = "auto-cold"  # adaptive k in an engine of its own: the call costs measured from nothing
KEPT = "auto-kept"  # adaptive k starting from what the cold run kept (a second one-shot process)


@dataclass
class ControlledRow(DraftRow):
    """A row's draft state plus what it proposes at each position and how much is committed."""

    schedule: list[int] = field(default_factory=list)  # the token proposed at each generated position
    generated: int = 0
    proposed: int = 0  # drafts of the last proposal


class ControlledProposer(DraftModelProposer):
    """Drafts the reference continuation with per-token acceptance ``acceptance`` while running
    ``model`` (the draft) on the drafted tokens, as a draft model proposer does. ``references``:
    one greedy continuation per prompt, in the order the rows are added. Token ids past the
    draft's vocabulary reach it modulo its size (only its time matters).

    Whether the draft at a position is right is drawn once per position, not per proposal:
    exactly ``round(a * n)`` of a row's ``n`` positions (its reference plus :data:`K_RANGE`'s
    largest k), in an order shuffled by the seeded generator. The verifier reaches each position
    at most once before its first rejected draft fixes it, so a step accepts the run of right
    positions from where it starts, as with a fresh draw per draft; and every k (and adaptive k)
    meets the same positions right and wrong, so they are compared on the same run of luck."""

    def __init__(self, model, capacity: int, references: list[list[int]], acceptance: float, vocab_size: int,
                 seed: int = 0) -> None:
        super().__init__(model, capacity)
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.references, self.acceptance, self.target_vocab = list(references), acceptance, vocab_size
        self.rng = random.Random(seed)
        self.drafted = self.accepted = self.attempted = 0

    def _ids(self, tokens: list[int]) -> list[int]:
        return [t % self.model.vocab_size for t in tokens]

    def _schedule(self, reference: list[int]) -> list[int]:
        n = len(reference) + max(K_RANGE)
        right = [True] * round(self.acceptance * n) + [False] * (n - round(self.acceptance * n))
        self.rng.shuffle(right)
        out = []
        for i, ok in enumerate(right):
            token = reference[i] if i < len(reference) else 0
            out.append(token if ok else (token + 1 + self.rng.randrange(self.target_vocab - 1)) % self.target_vocab)
        return out

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[ControlledRow]:
        super().add([self._ids(p) for p in prompts])
        return [ControlledRow(schedule=self._schedule(self.references.pop(0))) for _ in prompts]

    def feed(self, states: list[ControlledRow], pending: list[list[int]]) -> str:
        for row, new in zip(states, pending):
            row.generated += len(new)
        return super().feed(states, [self._ids(p) for p in pending])

    def _token(self, row: ControlledRow, position: int) -> int:
        return row.schedule[min(position, len(row.schedule) - 1)]

    def propose(self, states: list[ControlledRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        for row in states:
            row.proposed = k  # (a step without drafts too: else observe counts the last k again)
        if k == 0:
            return no_drafts(len(states))
        _, caught_up = self._feed_unfed(states)  # the draft's forward over the committed tokens, as it runs it
        tokens = []
        for i in range(k):
            token = torch.tensor([[self._token(row, row.generated + i)] for row in states])  # [B, 1]
            tokens.append(token)
            if i < k - 1:
                self.model(token % self.model.vocab_size, self.cache)  # the draft's time for one more token
        self._fed_drafts = k - 1
        return Proposal(torch.cat(tokens, 1), None, caught_up=caught_up)

    def observe(self, states: list[ControlledRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        for row, n in zip(states, num_accepted.tolist()):
            self.drafted += row.proposed
            self.accepted += n
            self.attempted += n + (1 if n < row.proposed else 0)  # positions reached: the accepted and the first rejected
        super().observe(states, num_accepted, target_hidden)

    def measured_acceptance(self) -> float:
        """Accepted drafts over drafts the verifier reached (per position, the quantity ``a``)."""
        return self.accepted / self.attempted if self.attempted else float("nan")


def predicted_speedup(a: float, k: int, c: float, v: dict[int, float]) -> float:
    """The chain formula: tokens a step commits over its cost in plain steps."""
    if k == 0:
        return 1.0
    tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return tokens / (k * c + v[k + 1])


def prompt(vocab: int) -> list[int]:
    """32 token ids (synthetic weights make every prompt alike)."""
    return [(1000 + i) % vocab for i in range(32)]


def run_speculate(out: Path, cases: list[str], draft: str, acceptances: list[float], tokens: int,
                  llamacpp: bool) -> list[dict]:
    """Measure every case not yet in ``out/speculate.jsonl`` (specdec, then llama.cpp, each in a
    fresh process); returns all rows and writes ``speculate.md``."""
    from specdec.bench import llamacpp as peer
    from specdec.bench.scale import case_file
    from specdec.runtime.native import cpu_name

    out.mkdir(parents=True, exist_ok=True)
    path_rows = out / "speculate.jsonl"
    done = [json.loads(ln) for ln in path_rows.read_text().splitlines() if ln.strip()] if path_rows.is_file() else []
    runtimes = ["specdec"] + (["llama.cpp"] if llamacpp and peer.available() else [])
    for case in cases:
        path = case_file(case)
        for runtime in runtimes:
            if any(r["case"] == case and r["runtime"] == runtime for r in done):
                continue
            print(f"{case}: {runtime} with draft {draft} ...", file=sys.stderr, flush=True)
            drafted = str(case_file(draft)) if ":" in draft else draft  # a registry name, a file, or SHAPE:MIX
            spec = {"runtime": runtime, "path": str(path), "draft": drafted, "acceptances": acceptances,
                    "tokens": tokens, "threads": torch.get_num_threads()}
            run = subprocess.run([sys.executable, "-m", "specdec.bench.controlled", json.dumps(spec)],
                                 stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
            result = json.loads(lines[-1]) if lines and not run.returncode else {
                "error": f"exit {run.returncode} (its messages are above)"}
            row = {"case": case, "file": str(path), "runtime": runtime, "draft": draft, "cpu": cpu_name(),
                   "threads": torch.get_num_threads(), "tokens": tokens, **result}
            done.append(row)
            with open(path_rows, "a") as f:
                f.write(json.dumps(row) + "\n")
    (out / "speculate.md").write_text(report(done))
    return done


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    value = fn()
    return time.perf_counter() - t, value


def _memory(spec: dict) -> dict:
    """This process's peak RSS beside the bytes of the target and draft files it holds."""
    from specdec.bench.scale import peak_rss
    from specdec.models import loading

    files = Path(spec["path"]).stat().st_size + loading.source_path(spec["draft"]).stat().st_size
    return {"peak_rss_gb": peak_rss() / 1e9, "files_gb": files / 1e9}


def _costs_for(k, shared: CallCosts, cold: CallCosts | None, model=None) -> tuple[CallCosts, float]:
    """The call costs a run of ``k`` starts from: the process's shared ones; for :data:`COLD`
    fresh ones, calibrated on ``model`` as a first ``specdec generate`` does
    (:func:`specdec.models.costs.calibrate`; not timed with the run: the report gives its
    seconds); for :data:`KEPT` what the cold run before it learned, through the JSON form
    :mod:`specdec.models.costs` keeps between processes (as a second ``specdec generate`` reads them).
    Also returns the calibration's seconds (0 but for a cold run)."""
    if k == COLD:
        fresh = CallCosts()
        return fresh, (calibrate(model, fresh) if model is not None else 0.0)
    if k == KEPT:
        return CallCosts.from_state(json.loads(json.dumps(cold.state()))), 0.0
    return shared, 0.0


def _measure_specdec(spec: dict) -> dict:
    """Costs, plain decoding and the controlled runs of one target and draft, in this process:
    every (a, k) once per seed of :data:`SEEDS`. The draft is the view users get
    (:func:`specdec.models.heads.pruned_draft`: its output layer cut to the frequent ids)."""
    from specdec.bench.measure import forward_scaling
    from specdec.core.engine import generate
    from specdec.models import heads, loading
    from specdec.verify.sampling import SamplingParams

    greedy, n = SamplingParams(temperature=0.0), spec["tokens"]
    target = loading.load(spec["path"]).model
    draft = heads.pruned_draft(loading.load(spec["draft"], role="draft"), None).model
    ids = prompt(target.vocab_size)
    costs = CallCosts()  # the target's call costs, learned by every run but the cold ones (as in one API or server)
    with torch.inference_mode():
        generate(target, [ids], greedy, 2)
        forward = forward_scaling(target, sizes=SIZES)
        c = forward_scaling(draft, sizes=(1,))[1] / forward[1]
        plain = [_timed(lambda: generate(target, [ids], greedy, n, call_costs=costs))[0] for _ in range(2)]
        reference = generate(target, [ids], greedy, n)[0].token_ids
        runs, learned = [], costs
        for seed in range(SEEDS):
            for a in spec["acceptances"]:
                for k in (K_RANGE if a >= 0.5 else (1,)) + ("auto", COLD, KEPT):
                    proposer = ControlledProposer(draft, len(ids) + n + 16, [reference], a, target.vocab_size, seed=seed)
                    learned, calibration = _costs_for(k, costs, learned if k == KEPT else None, target)
                    seconds, rows = _timed(lambda: generate(target, [ids], greedy, n, proposer=proposer,
                                                            k=k if isinstance(k, int) else "auto", call_costs=learned))
                    runs.append({"a": a, "k": k, "seed": seed, "seconds": seconds, "calibration_s": calibration,
                                 "identical": rows[0].token_ids == reference, "measured_a": proposer.measured_acceptance(),
                                 "drafted": proposer.drafted, "accepted": proposer.accepted})
                    print(f"  seed {seed} a={a} k={k}: {seconds:.2f} s (plain {min(plain):.2f} s), measured a "
                          f"{runs[-1]['measured_a']:.3f}, output {'= plain' if runs[-1]['identical'] else 'DIFFERS'}",
                          file=sys.stderr, flush=True)
        plain.append(_timed(lambda: generate(target, [ids], greedy, n))[0])
    v = {m: forward[m] / forward[1] for m in SIZES}
    return {"c": c, "v": v, "forward_ms": {m: t * 1e3 for m, t in forward.items()}, "plain_seconds": plain, "runs": runs,
            **_memory(spec)}


def _measure_llamacpp(spec: dict) -> dict:
    """llama.cpp's plain decoding of the target, its forward scaling, and its draft's cost ratio."""
    import statistics

    from specdec.bench import llamacpp as peer
    from specdec.models import loading

    n = spec["tokens"]
    llm = peer.open_file(Path(spec["path"]), spec["threads"], 4096)
    ids = prompt(llm.n_vocab())
    seconds = [peer.greedy_seconds(llm, ids, n) for _ in range(3)]
    forward = peer.forward_scaling(llm, sizes=SIZES)
    small = peer.open_file(loading.source_path(spec["draft"]), spec["threads"], 4096)
    c = peer.forward_scaling(small, sizes=(1,))[1] / forward[1]
    v = {m: forward[m] / forward[1] for m in SIZES}
    return {"c": c, "v": v, "forward_ms": {m: t * 1e3 for m, t in forward.items()},
            "plain_seconds": [statistics.median(seconds)], **_memory(spec)}


def report(rows: list[dict]) -> str:
    """Two tables: the measured costs, then per acceptance the speed-ups beside the formula."""
    import statistics

    if not rows:
        return ""
    lines = [f"CPU: {rows[0]['cpu']}, {rows[0]['threads']} threads; greedy, {rows[0]['tokens']} tokens "
             f"(prefill included), draft {rows[0]['draft']}", "",
             "| case | runtime | plain TPOT ms | draft cost c | v(2) / v(3) / v(5) / v(9) | peak RSS / target + draft files, GB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['runtime']} | failed: {r['error']} | | | |")
            continue
        v = {int(m): x for m, x in r["v"].items()}
        memory = f"{r['peak_rss_gb']:.2f} / {r['files_gb']:.2f}" if "peak_rss_gb" in r else "-"
        lines.append(f"| {r['case']} | {r['runtime']} | {statistics.median(r['plain_seconds']) / r['tokens'] * 1e3:.0f} | "
                     f"{r['c']:.3f} | {' / '.join(f'{v[m]:.2f}' for m in (2, 3, 5, 9))} | {memory} |")
    lines += ["", "Speed-ups over plain decoding, each the median over the seeds.", "",
              "| case | a | measured a | adaptive k: speed-up | adaptive k, cold costs | adaptive k, costs kept | best fixed k: k, speed-up | "
              "predicted (best k) | vs llama.cpp plain (adaptive) | llama.cpp predicted | greedy = plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["runtime"] == "specdec" and "runs" in r):
        plain = statistics.median(r["plain_seconds"])
        v = {int(m): x for m, x in r["v"].items()}
        peer = next((p for p in rows if p["case"] == r["case"] and p["runtime"] == "llama.cpp" and "v" in p), None)
        for a in sorted({run["a"] for run in r["runs"]}):
            runs = [run for run in r["runs"] if run["a"] == a]
            seconds = {k: statistics.median(run["seconds"] for run in runs if run["k"] == k)
                       for k in dict.fromkeys(run["k"] for run in runs)}  # median over the seeds
            auto = {"seconds": seconds["auto"]}
            cold, kept = (f"{plain / seconds[key]:.2f}x" if key in seconds else "-" for key in (COLD, KEPT))
            fixed = min(({"k": k, "seconds": t} for k, t in seconds.items() if isinstance(k, int)),
                        key=lambda run: run["seconds"])
            best_pred = max(K_RANGE, key=lambda k: predicted_speedup(a, k, r["c"], v))
            measured_a = statistics.median(run["measured_a"] for run in runs)
            vs_peer, peer_pred = "-", "-"
            if peer:
                peer_plain = statistics.median(peer["plain_seconds"])
                pv = {int(m): x for m, x in peer["v"].items()}
                vs_peer = f"{peer_plain / auto['seconds']:.2f}x"
                peer_pred = f"{max(predicted_speedup(a, k, peer['c'], pv) for k in K_RANGE):.2f}x"
            same = all(run["identical"] for run in runs)
            lines.append(f"| {r['case']} | {a:.1f} | {measured_a:.3f} | {plain / auto['seconds']:.2f}x | {cold} | {kept} | "
                         f"k={fixed['k']}: {plain / fixed['seconds']:.2f}x | "
                         f"k={best_pred}: {predicted_speedup(a, best_pred, r['c'], v):.2f}x | {vs_peer} | {peer_pred} | "
                         f"{'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    measure = _measure_specdec if spec["runtime"] == "specdec" else _measure_llamacpp
    print(json.dumps(measure(spec)), flush=True)


if __name__ == "__main__":
    main()
