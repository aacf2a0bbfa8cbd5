"""The decoding loop: prefill -> propose -> ONE target call over k+1 positions -> verify ->
commit / roll back -> observe. Plain decoding is the same loop with no proposer (k = 0).

Each step feeds the target ``[last committed token, d_1..d_k]`` and reads k+1 distributions:
position i scores d_{i+1}, position k gives the bonus. ``verify_chain`` commits
``num_accepted + 1`` tokens; the target cache keeps the KV of the last committed token and of the
accepted drafts and is truncated past them (O(1)). The final committed token (replacement or
bonus) is fed at the next step, so no extra target call is ever needed.

Rows of a batch run in lockstep with one shared k; their acceptance is ragged. Finished rows
(EOS, a stop string, or max_new_tokens) stop contributing tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.metrics import GenerationMetrics
from specdec.proposers.base import Proposer
from specdec.runtime.model import Transformer
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.verify import verify_chain


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "length", "eos" or "stop"
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)


# A stop checker gets (row, generated ids so far) and returns the number of ids to keep if a stop
# string has appeared, else None.
StopChecker = Callable[[int, list[int]], "int | None"]


def _probs(logits: torch.Tensor, params: list[SamplingParams], who: str) -> torch.Tensor:
    """``logits`` ``[B, T, V]`` -> processed probabilities, each row with its own parameters."""
    if not torch.isfinite(logits).all():
        raise ValueError(f"the {who} model produced non-finite logits")
    return torch.stack([probs_from_logits(logits[b], params[b]) for b in range(logits.shape[0])])


def generate(
    target: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_new_tokens: int,
    *,
    proposer: Proposer | None = None,
    k: int = 0,
    seed: int = 0,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    stop_checker: StopChecker | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[RowResult]:
    """Generate up to ``max_new_tokens`` per prompt; exact target sampling whatever the proposer."""
    batch = len(prompts)
    if batch == 0:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if proposer is None:
        k = 0
    row_params = params if isinstance(params, list) else [params] * batch
    context_len = target.cfg.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context length {context_len}"
        )
    capacity = longest + max_new_tokens + k + 2
    g_verify = torch.Generator().manual_seed(seed)
    g_draft = torch.Generator().manual_seed(seed + 1)
    results = [RowResult() for _ in range(batch)]
    metrics = GenerationMetrics(requests=batch)
    tm = metrics.timings
    start = time.perf_counter()

    # Prefill: right-padded prompts, logits at each row's last prompt token only.
    cache = target.new_cache(batch, capacity)
    lengths = torch.tensor([len(p) for p in prompts])
    padded = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    logits = target(padded, cache, logit_index=(lengths - 1).unsqueeze(1))  # [B, 1, V]
    cache.truncate(lengths)
    metrics.target_calls += 1
    t = time.perf_counter()
    tm.prefill = t - start
    first = verify_chain(_probs(logits, row_params, "target"), None, torch.zeros(batch, 0, dtype=torch.long), g_verify)
    tm.sampling += time.perf_counter() - t

    active = [True] * batch
    last = first.tokens[:, 0].clone()  # [B] the committed token whose KV is not yet in the cache
    pending = [[int(x)] for x in last]

    def commit(row: int, ids: list[int]) -> None:
        res = results[row]
        for token in ids:
            res.token_ids.append(token)
            if token in eos_token_ids:
                res.finish_reason = "eos"
            elif stop_checker is not None:
                keep = stop_checker(row, res.token_ids)
                if keep is not None:
                    del res.token_ids[keep:]
                    res.finish_reason = "stop"
            if res.finish_reason != "length" or len(res.token_ids) >= max_new_tokens:
                active[row] = False
                break
        if on_tokens is not None:
            on_tokens(row, res.token_ids)

    for row in range(batch):
        commit(row, pending[row])
    tm.ttft = time.perf_counter() - start
    if proposer is not None:
        t = time.perf_counter()
        proposer.start(prompts, row_params, g_draft)
        tm.draft += time.perf_counter() - t

    while any(active):
        remaining = max(max_new_tokens - len(r.token_ids) for r, a in zip(results, active) if a)
        step_k = min(k, remaining - 1)
        t0 = time.perf_counter()
        if proposer is not None:
            proposal = proposer.propose(pending, step_k)
            draft_tokens, draft_probs = proposal.tokens, proposal.probs
        else:
            draft_tokens, draft_probs = torch.zeros(batch, 0, dtype=torch.long), None
        t1 = time.perf_counter()
        block = torch.cat([last.unsqueeze(1), draft_tokens], 1)  # [B, k+1]
        before = cache.lengths.clone()
        logits = target(block, cache)  # [B, k+1, V]
        metrics.target_calls += 1
        t2 = time.perf_counter()
        result = verify_chain(_probs(logits, row_params, "target"), draft_probs, draft_tokens, g_verify)
        t3 = time.perf_counter()
        # Finished rows ride along in the batch but never grow their cache.
        alive = torch.tensor(active)
        cache.truncate(torch.where(alive, before + 1 + result.num_accepted, before))
        last = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
        t4 = time.perf_counter()
        if proposer is not None:
            proposer.observe(result.num_accepted)
        t5 = time.perf_counter()
        tm.draft += (t1 - t0) + (t5 - t4)
        tm.verify += t2 - t1
        tm.sampling += t3 - t2
        tm.cache += t4 - t3
        pending = []
        for row in range(batch):
            ids = result.committed(row)
            pending.append(ids)
            if active[row]:
                metrics.acceptance.record(step_k, int(result.num_accepted[row]))
                commit(row, ids)
    tm.total = time.perf_counter() - start
    metrics.generated_tokens = sum(len(r.token_ids) for r in results)
    for r in results:
        r.metrics = metrics
    return results
