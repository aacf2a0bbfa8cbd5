"""A user's own proof that a deployment is lossless: ``specdec verify``.

For a loaded target, a proposer, k and sampling parameters:

(a) **Greedy identity.** On N prompts, speculative greedy decoding must give exactly the tokens
    of plain greedy decoding (our kernels are batch invariant, so this is an equality, not a
    tolerance).
(b) **Exact law at T > 0.** The joint law of the first ``depth`` generated tokens under top-k
    sampling is enumerated from the target's own conditionals (``top_k ** depth`` cells at most),
    then ``samples`` sequences are drawn through the real engine with the proposer, and Pearson's
    chi-square compares the counts with the law (cells with expected count < 5 pooled). The first
    token comes from the prefill, so each sample verifies one block of up to ``depth - 1``
    drafts (acceptance, residual and bonus); (a) exercises the full ``k``.
(c) **Negative control.** The same sampling with a deliberately wrong verifier (after a rejection
    it samples from ``p`` instead of the residual ``norm([p - q]+)``) must be rejected. Its
    p-value, and the Monte-Carlo power of the test against the law that wrong verifier produced,
    show that this run could have caught a wrong verifier (power: the noncentral chi-square with
    the noncentrality estimated from the control's statistic, ``X - dof``). A control that is *not* rejected
    means the run had no power (e.g. the proposer hardly drafted): the result is "inconclusive",
    never "exact".
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from specdec.core.adaptive import K_MAX
from specdec.core.engine import generate, kv_capacity
from specdec.verify.sampling import SamplingParams, probs_from_logits
from specdec.verify.stats import chi_square, merge_small_cells, power
from specdec.verify.chain import verify_chain

# The negative control: a verifier that ignores q after a rejection (residual := p).
WRONG_VERIFIER = functools.partial(verify_chain, residual_tolerance=float("inf"))


@dataclass
class LawTest:
    """One chi-square test of sampled first-``depth`` tokens against the exact law."""

    samples: int
    cells: int  # cells after pooling the small ones
    statistic: float
    dof: int
    p_value: float
    drafted: int  # draft tokens proposed during the run (0: the proposer was never tested)
    accepted: int


@dataclass
class ExactnessReport:
    proposer: str
    k: int | str
    temperature: float
    top_k: int
    depth: int
    alpha: float
    greedy_prompts: int
    greedy_identical: int
    greedy_mismatches: list[dict] = field(default_factory=list)
    law: LawTest | None = None
    negative_control: LawTest | None = None
    power_vs_control: float = 0.0
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """"exact", "NOT exact" or "inconclusive" (the negative control was not rejected)."""
        if self.greedy_identical < self.greedy_prompts or self.law.p_value < self.alpha:
            return "NOT exact"
        if self.negative_control.p_value >= self.alpha:
            return "inconclusive"
        return "exact"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def exact_joint_law(target, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """``p(t_1..t_depth | prompt)`` for every sequence with positive probability, enumerated from
    the target's processed conditionals (one batched forward per depth)."""
    law = {(): 1.0}
    for _ in range(depth):
        prefixes = list(law)
        batch = torch.tensor([prompt + list(s) for s in prefixes])  # [N, T]
        logits = target(batch, target.new_cache(len(prefixes), batch.shape[1]), logit_index=torch.full(
            (len(prefixes), 1), batch.shape[1] - 1))[:, 0]  # [N, V]
        probs = probs_from_logits(logits, params).double()  # [N, V]
        nxt = {}
        for seq, row in zip(prefixes, probs):
            for tok in torch.nonzero(row).flatten().tolist():
                nxt[seq + (tok,)] = law[seq] * float(row[tok])
        law = nxt
    return law


def _sample_law(target, make_proposer, prompt, params, k, depth, samples, batch, seed, verifier, desc):
    """Counts of the first ``depth`` tokens over ``samples`` engine runs; drafted/accepted totals."""
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    with tqdm(total=samples, desc=desc, unit="sample", leave=False) as bar:
        for start in range(0, samples, batch):
            n = min(batch, samples - start)
            capacity = kv_capacity(len(prompt) + depth, k, K_MAX)
            rows = generate(target, [prompt] * n, params, depth, proposer=make_proposer(capacity),
                            k=k, seed=seed + start, verifier=verifier)
            for r in rows:
                key = tuple(r.token_ids)
                counts[key] = counts.get(key, 0) + 1
            acc = rows[0].batch_metrics.acceptance
            drafted, accepted = drafted + acc.drafted, accepted + acc.accepted
            bar.update(n)
    return counts, drafted, accepted


def _law_test(counts: dict, law: dict, samples: int, drafted: int, accepted: int) -> LawTest:
    cells = list(law) + [c for c in counts if c not in law]  # unseen-by-law outcomes are impossible
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    probs = torch.tensor([law.get(c, 0.0) for c in cells], dtype=torch.float64)
    obs, exp = merge_small_cells(observed, probs, samples)
    stat, dof, p = chi_square(obs, exp)
    return LawTest(samples, int(obs.numel()), stat, dof, p, drafted, accepted)


def verify_deployment(
    target,
    make_proposer,
    proposer_name: str,
    prompts: list[list[int]],
    *,
    k: int | str = 4,
    temperature: float = 0.8,
    top_k: int = 4,
    depth: int = 3,
    samples: int = 2000,
    greedy_tokens: int = 32,
    alpha: float = 1e-3,
    batch: int = 200,
    seed: int = 0,
) -> ExactnessReport:
    """Run checks (a)-(c) of the module docstring. ``make_proposer(capacity)`` builds a fresh
    proposer for one engine call; the law test uses the first prompt."""
    if not prompts:
        raise ValueError("verify_deployment needs at least one prompt")
    if not 1 <= depth <= 3:
        raise ValueError(f"depth must be 1, 2 or 3, got {depth}")
    if not 1 <= top_k <= 16:
        raise ValueError(f"top_k must be in [1, 16] (the exact law has top_k ** depth cells), got {top_k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for the law test, got {temperature}")
    if samples < 100:
        raise ValueError(f"samples must be >= 100, got {samples}")
    begin = time.perf_counter()
    report = ExactnessReport(proposer_name, k, temperature, top_k, depth, alpha, len(prompts), 0)

    greedy = SamplingParams(temperature=0.0)
    for i, prompt in enumerate(tqdm(prompts, desc="greedy identity", unit="prompt", leave=False)):
        plain = generate(target, [prompt], greedy, greedy_tokens)[0].token_ids
        spec = generate(target, [prompt], greedy, greedy_tokens,
                        proposer=make_proposer(kv_capacity(len(prompt) + greedy_tokens, k, K_MAX)), k=k)[0].token_ids
        if spec == plain:
            report.greedy_identical += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
            report.greedy_mismatches.append({"prompt": i, "first_difference": first})

    params = SamplingParams(temperature=temperature, top_k=top_k)
    prompt = prompts[0]
    law = exact_joint_law(target, prompt, params, depth)
    common = (target, make_proposer, prompt, params, k, depth, samples, batch)
    counts, drafted, accepted = _sample_law(*common, seed, verify_chain, "law (exact verifier)")
    report.law = _law_test(counts, law, samples, drafted, accepted)
    counts, drafted, accepted = _sample_law(*common, seed + 10**6, WRONG_VERIFIER, "law (negative control)")
    report.negative_control = _law_test(counts, law, samples, drafted, accepted)
    ctl = report.negative_control
    report.power_vs_control = power(ctl.dof, ctl.statistic - ctl.dof, alpha, seed=seed)
    report.seconds = time.perf_counter() - begin
    return report


def format_report(r: ExactnessReport) -> str:
    law, ctl = r.law, r.negative_control
    lines = [
        f"specdec verify: proposer {r.proposer}, k={r.k}, T={r.temperature}, top-k={r.top_k}",
        f"  (a) greedy identity: {r.greedy_identical}/{r.greedy_prompts} prompts token-identical to plain decoding"
        + (f"  MISMATCHES: {r.greedy_mismatches}" if r.greedy_mismatches else ""),
        f"  (b) law of the first {r.depth} tokens: {law.samples} samples, {law.cells} cells, "
        f"chi2={law.statistic:.1f} (dof {law.dof}), p={law.p_value:.3g} "
        f"({'pass' if law.p_value >= r.alpha else 'FAIL'} at alpha={r.alpha:g}); "
        f"{law.drafted} drafts proposed, {law.accepted} accepted",
        f"  (c) negative control (residual replaced by p): p={ctl.p_value:.3g} "
        f"({'rejected, as it must be' if ctl.p_value < r.alpha else 'NOT rejected: this run had no power'}); "
        f"{ctl.drafted} drafts, {ctl.accepted} accepted",
        f"      power of (b) against that wrong verifier: {r.power_vs_control:.0%} "
        f"({law.samples} samples, alpha={r.alpha:g}; noncentrality estimated from the control)",
        f"  verdict: {r.verdict}  ({r.seconds:.0f} s)",
    ]
    if r.verdict == "inconclusive":
        rejected = law.drafted - law.accepted
        lines.append(
            f"  ({rejected} of {law.drafted} drafts were rejected: a wrong residual barely shows. Use a first "
            "--prompt whose continuation the proposer often gets wrong, a higher --temperature, a larger "
            "--top-k or more --samples.)"
        )
    return "\n".join(lines)


__all__ = ["ExactnessReport", "LawTest", "WRONG_VERIFIER", "exact_joint_law", "format_report", "verify_deployment"]
