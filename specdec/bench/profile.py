"""``specdec profile``: measure what speculation costs and gains for a target/proposer pair on a
prompt set, recommend k, and check the prediction against a measured run.

1. costs: the target's forward time for n = 1..k_max+1 new tokens (after the prompt), and the
   proposer's time per draft token (from a fixed-k run);
2. acceptance per position, from a run with k = k_max: ``a_i`` = accepted at i / reached i;
3. recommended ``k* = argmax E(k)/T(k)`` (see :mod:`specdec.core.adaptive`), predicted speed-up
   ``(E(k*)/T(k*)) * v(1)`` over plain decoding;
4. measured speed-up: decode-phase tokens per second with k* vs plain decoding, same prompts.
"""

from __future__ import annotations

from specdec.core.adaptive import best_k, expected_tokens
from specdec.bench.measure import forward_scaling


def _decode_rate(results) -> float:
    tokens = sum(len(r.token_ids) - 1 for r in results)
    seconds = sum(r.batch_metrics.timings.total - r.batch_metrics.timings.ttft for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def profile(gen, prompts: list[list[int]], spec, params, max_new_tokens: int) -> dict:
    """``spec``: the :class:`~specdec.speculation.SpeculationConfig` to profile (its method and
    k_max; k is varied here)."""
    k_max = spec.k_max
    context = max(len(p) for p in prompts)
    v = forward_scaling(gen.target.model, context=context, sizes=tuple(range(1, k_max + 2)), repeats=3)
    verify = [v[n] for n in range(1, k_max + 2)]

    def run(k):
        out = []
        for i, p in enumerate(prompts):
            out += gen.generate([p], params, max_new_tokens, speculation=spec.with_k(k), seed=i)
        return out

    fixed = run(k_max)
    stats = fixed[0].batch_metrics.acceptance
    for r in fixed[1:]:
        stats = stats.merge(r.batch_metrics.acceptance)
    accept = stats.per_position() + [0.0] * (k_max - len(stats.per_position()))
    draft_time = sum(r.batch_metrics.timings.draft for r in fixed)
    draft_per_token = draft_time / max(1, stats.drafted)
    k_star = best_k(accept, draft_per_token, verify, k_max)
    predicted = expected_tokens(accept, k_star) / (k_star * draft_per_token + verify[k_star]) * verify[0]
    plain_rate = _decode_rate(run(0))
    spec_rate = _decode_rate(run(k_star)) if k_star else plain_rate
    auto_rate = _decode_rate(run("auto"))
    return {
        "verify_cost_s": verify,
        "verify_cost_ratio": [c / verify[0] for c in verify],
        "draft_cost_per_token_s": draft_per_token,
        "draft_to_target_cost_ratio": draft_per_token / verify[0],
        "acceptance_per_position": accept,
        "recommended_k": k_star,
        "predicted_speedup": predicted,
        "measured_speedup": spec_rate / plain_rate,
        "measured_auto_speedup": auto_rate / plain_rate,
        "plain_decode_tok_s": plain_rate,
    }


def format_profile(p: dict) -> str:
    lines = [
        "verify cost vs 1 token: " + "  ".join(f"n={i + 1}:{r:.2f}x" for i, r in enumerate(p["verify_cost_ratio"])),
        f"draft cost per token: {p['draft_cost_per_token_s'] * 1e3:.1f} ms ({p['draft_to_target_cost_ratio']:.2f}x a target step)",
        "acceptance per position: " + "  ".join(f"{a:.2f}" for a in p["acceptance_per_position"]),
        f"recommended k: {p['recommended_k']}",
        f"speed-up over plain decoding (decode phase): predicted {p['predicted_speedup']:.2f}x, "
        f"measured {p['measured_speedup']:.2f}x at k={p['recommended_k']}, measured {p['measured_auto_speedup']:.2f}x with --k auto",
        f"plain decoding: {p['plain_decode_tok_s']:.2f} tok/s",
    ]
    return "\n".join(lines)
