"""The decoding loop: prefill -> propose -> ONE target call over k+1 positions -> verify ->
commit / roll back -> observe. Plain decoding is the same loop with no proposer (k = 0).

Each step feeds the target ``[last committed token, d_1..d_k]`` and reads k+1 distributions:
position i scores d_{i+1}, position k gives the bonus. ``verify_chain`` commits
``num_accepted + 1`` tokens; the target cache keeps the KV of the last committed token and of the
accepted drafts and is truncated past them (O(1)). The final committed token (replacement or
bonus) is fed at the next step, so no extra target call is ever needed.

Rows of a batch run in lockstep with one shared k; their acceptance is ragged. Finished rows
(EOS, a stop string, or max_new_tokens) leave the batch: the target cache and the proposer keep
only the rows still running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.adaptive import AdaptiveK, TreeBudget
from specdec.metrics import GenerationMetrics
from specdec.proposers.base import Proposal, Proposer
from specdec.runtime.model import Transformer
from specdec.sampling import SamplingParams, probs_per_row
from specdec.tree import TreeVerification, ancestor_mask, verify_tree
from specdec.verify import ChainVerification, verify_chain

MAX_SEED = 2**63 - 2  # the draft's generator gets seed + 1: both must fit a signed 64-bit integer


@dataclass
class RowResult:
    """One request's output. ``metrics`` are this request's own (its acceptance, the target
    calls it took part in, its TTFT and finish time); ``batch_metrics`` aggregate the whole
    batch, including the time breakdown by phase."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "length", "eos" or "stop"
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)
    batch_metrics: GenerationMetrics | None = None


# A stop checker gets (row, generated ids so far) and returns the number of ids to keep if a stop
# string has appeared, else None.
StopChecker = Callable[[int, list[int]], "int | None"]


def _probs(logits: torch.Tensor, params: list[SamplingParams], who: str) -> torch.Tensor:
    """``logits`` ``[B, T, V]`` -> processed probabilities, each row with its own parameters."""
    if not torch.isfinite(logits).all():
        raise ValueError(f"the {who} model produced non-finite logits")
    return probs_per_row(logits, params)


def commit_tokens(res: RowResult, ids: list[int], eos_token_ids, max_new_tokens: int,
                  stop_checker: Callable[[list[int]], "int | None"] | None) -> bool:
    """Append a step's committed ``ids`` to one row, stopping at EOS (kept), at a stop sequence
    (cut where the checker says) or at ``max_new_tokens``; returns whether the row goes on."""
    for token in ids:
        res.token_ids.append(token)
        if token in eos_token_ids:
            res.finish_reason = "eos"
        elif stop_checker is not None:
            keep = stop_checker(res.token_ids)
            if keep is not None:
                del res.token_ids[keep:]
                res.finish_reason = "stop"
        if res.finish_reason != "length" or len(res.token_ids) >= max_new_tokens:
            return False
    return True


def score_chain(target: Transformer, cache, last: torch.Tensor, proposal: Proposal, want_hidden: bool):
    """One target call over ``[last committed token, d_1..d_k]`` -> logits ``[B, k+1, V]`` (and
    the block's features ``[B, k+1, E]`` when ``want_hidden``, else None)."""
    block = torch.cat([last.unsqueeze(1), proposal.tokens], 1)  # [B, k+1]
    out = target(block, cache, return_hidden=want_hidden)
    return out if want_hidden else (out, None)


def score_tree(target: Transformer, cache, last: torch.Tensor, proposal: Proposal, want_hidden: bool):
    """One target call over ``[root, node_0..node_{N-1}]``: each node attends to the committed
    slots, the root and its ancestors, at position prefix + depth — so its logits are exactly
    those the same path would get as a chain. Padding nodes score a dummy token, unused."""
    tokens, parents = proposal.tokens, proposal.parents  # [B, N]
    batch, n = tokens.shape
    mask = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool)  # [B, N+1, N+1]
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = ancestor_mask(parents)
    depth = torch.cat([torch.zeros(batch, 1, dtype=torch.long), proposal.node_depths], 1)  # [B, N+1]
    block = torch.cat([last.unsqueeze(1), tokens.clamp(min=0)], 1)  # [B, N+1]
    out = target(block, cache, tree_mask=mask, positions=cache.lengths.unsqueeze(1) + depth, return_hidden=want_hidden)
    return out if want_hidden else (out, None)


def commit_kv(cache, before: torch.Tensor, result, hidden: torch.Tensor | None):
    """Keep the KV of the fed token and the accepted drafts, drop the rest: O(1) for a chain
    (truncate), O(accepted) for a tree (the accepted branch is compacted into place). Returns
    ``[B]`` the last committed token of each row (replacement or bonus; its KV is written at the
    next step) and the features of the fed token and accepted drafts in order ``[B, D+1, E]``."""
    if isinstance(result, TreeVerification):
        cache.keep_path(before, result.path, result.num_accepted)
        if hidden is not None:  # root, then the accepted path's nodes (-1 padding reads the root)
            index = torch.cat([torch.zeros_like(result.path[:, :1]), result.path + 1], 1).clamp(min=0)
            hidden = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    else:
        cache.truncate(before + 1 + result.num_accepted)
    return result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1), hidden


def draft_depth(proposal: Proposal) -> list[int]:
    """The draft positions each row offered: k for a chain, the tree's depth."""
    if not proposal.is_tree:
        return [proposal.size] * proposal.tokens.shape[0]
    if proposal.size == 0:
        return [0] * proposal.tokens.shape[0]
    return proposal.node_depths.max(1).values.tolist()


def generate(
    target: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_new_tokens: int,
    *,
    proposer: Proposer | None = None,
    k: int | str = 0,
    k_max: int = 8,
    seed: int = 0,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    stop_checker: StopChecker | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    verifier: Callable[..., ChainVerification] = verify_chain,
) -> list[RowResult]:
    """Generate up to ``max_new_tokens`` per prompt; exact target sampling whatever the proposer.

    ``k`` is the number of draft tokens per step, or ``"auto"``: an :class:`AdaptiveK` controller
    (one per proposer source, see ``HybridProposer.next_source``) picks 0..``k_max`` each step
    from measured costs and acceptance.

    ``verifier`` has :func:`~specdec.verify.verify_chain`'s signature; only exactness checks pass
    another one (a deliberately wrong verifier as their negative control).
    """
    batch = len(prompts)
    if batch == 0:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    controllers: dict[str, AdaptiveK] | None = None
    if k == "auto":
        controllers, k = {}, k_max
    elif not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0 or 'auto', got {k!r}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
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
    # A proposer that reads the target's features (a draft head) gets them from the same calls.
    want_hidden = proposer is not None and proposer.wants_target_hidden
    out = target(padded, cache, logit_index=(lengths - 1).unsqueeze(1), return_hidden=want_hidden)
    logits, prefill_hidden = out if want_hidden else (out, None)  # [B, 1, V], [B, L, E]
    cache.truncate(lengths)
    metrics.target_calls += 1
    t = time.perf_counter()
    tm.prefill = t - start
    first = verifier(_probs(logits, row_params, "target"), None, torch.zeros(batch, 0, dtype=torch.long), g_verify)
    tm.sampling += time.perf_counter() - t

    last = first.tokens[:, 0].clone()  # [B'] committed tokens whose KV is not yet in the cache
    pending = [[int(x)] for x in last]
    alive = list(range(batch))  # original row of each position in the (compacted) batch

    def commit(row: int, ids: list[int]) -> bool:
        """Append ``ids`` to ``row``; returns whether the row is still going."""
        res = results[row]
        going = commit_tokens(res, ids, eos_token_ids, max_new_tokens,
                              None if stop_checker is None else lambda ids: stop_checker(row, ids))
        if on_tokens is not None:
            on_tokens(row, res.token_ids)
        if not going:
            res.metrics.timings.total = time.perf_counter() - start
        return going

    if proposer is not None:
        t = time.perf_counter()
        proposer.start(prompts, row_params, g_draft, target_hidden=prefill_hidden)
        tm.draft += time.perf_counter() - t
    for row in range(batch):
        results[row].metrics.target_calls = 1
        results[row].metrics.timings.ttft = time.perf_counter() - start
    tm.ttft = time.perf_counter() - start
    keep = [i for i in range(batch) if commit(i, pending[i])]

    while True:
        if len(keep) < len(alive):  # drop finished rows from the batch (and from the proposer)
            t = time.perf_counter()
            alive, last = [alive[i] for i in keep], last[keep]
            pending = [pending[i] for i in keep]
            if proposer is not None:  # (also when none is left: a proposer may keep finished outputs)
                proposer.retain(keep)
            if not alive:
                break
            cache = cache.fork(keep)
            tm.cache += time.perf_counter() - t
        remaining = max(max_new_tokens - len(results[r].token_ids) for r in alive)
        # The block writes positions lengths .. lengths + k of every row: no row may pass the
        # context (ragged acceptance can leave a long row near its end while others still draft).
        room = context_len - 1 - int(cache.lengths.max())
        controller = None
        if controllers is not None and proposer is not None:
            source = proposer.next_source(pending)
            if source not in controllers:
                controllers[source] = TreeBudget(k_max) if proposer.emits_trees else AdaptiveK(k_max=k_max)
            controller = controllers[source]
        # A chain drafts at most one token fewer than the row still needs; a tree (k = nodes) at
        # most that deep.
        depth_cap = min(remaining - 1, room)
        step_k = controller.choose() if controller else k
        step_k = min(step_k, room) if proposer is not None and proposer.emits_trees else min(step_k, depth_cap)
        t0 = time.perf_counter()
        if proposer is not None:
            proposal = proposer.propose(pending, step_k)
            if proposal.size > step_k:
                raise ValueError(f"the proposer returned {proposal.size} tokens, more than k={step_k}")
            if proposal.is_tree:
                proposal = proposal.cut_depth(depth_cap)
            if controller is not None and proposal.is_tree:
                proposal = proposal.prune(controller.nodes(proposal))
        else:
            proposal = Proposal(torch.zeros(len(alive), 0, dtype=torch.long), None)
        step_k = proposal.size  # a proposer may propose fewer (e.g. no n-gram match)
        t1 = time.perf_counter()
        before = cache.lengths.clone()
        logits, hidden = (score_tree if proposal.is_tree else score_chain)(target, cache, last, proposal, want_hidden)
        metrics.target_calls += 1
        t2 = time.perf_counter()
        probs = _probs(logits, [row_params[r] for r in alive], "target")  # [B', k+1, V]
        if proposal.is_tree:
            result = verify_tree(probs, proposal.probs, proposal.tokens, proposal.parents, g_verify,
                                 without_replacement=proposal.without_replacement)
        else:
            result = verifier(probs, proposal.probs, proposal.tokens, g_verify)
        t3 = time.perf_counter()
        last, hidden = commit_kv(cache, before, result, hidden)
        t4 = time.perf_counter()
        if proposer is not None:
            proposer.observe(result.num_accepted, target_hidden=hidden)
        t5 = time.perf_counter()
        if controller is not None:
            controller.observe_step(proposal, result, (t1 - t0) + (t5 - t4), t3 - t1,
                               caught_up=proposer.caught_up)
        tm.draft += (t1 - t0) + (t5 - t4)
        tm.verify += t2 - t1
        tm.sampling += t3 - t2
        tm.cache += t4 - t3
        # per row, as plain ints (one conversion each, not per row): drafted positions (a tree's
        # depth), accepted, and draft tokens scored (a tree's real nodes)
        depth, accepted = draft_depth(proposal), result.num_accepted.tolist()
        scored = (proposal.tokens >= 0).sum(1).tolist() if proposal.is_tree else depth
        pending, keep = [], []
        for i, row in enumerate(alive):
            ids = result.committed(i)
            pending.append(ids)
            row_metrics = results[row].metrics
            row_metrics.target_calls += 1
            row_metrics.acceptance.record(depth[i], accepted[i], scored[i])
            metrics.acceptance.record(depth[i], accepted[i], scored[i])
            if commit(row, ids):
                keep.append(i)
    tm.total = time.perf_counter() - start
    metrics.generated_tokens = sum(len(r.token_ids) for r in results)
    for r in results:
        r.metrics.generated_tokens = len(r.token_ids)
        r.batch_metrics = metrics
    return results
