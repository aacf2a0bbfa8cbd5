"""The reference step: speculative decoding of ONE row, top to bottom, in one function.

This is the page to read before :class:`~specdec.core.engine.Engine` (gpt-fast's
``speculative_decode``): prefill -> propose -> ONE target call over ``[last token, d_1..d_k]`` ->
verify (accept / residual / bonus) -> commit and roll the cache back -> observe. The engine does
the same for a batch of rows that join and leave, with trees, adaptive k, greedy rows by argmax,
seeded rows at their own uniforms, a prefix cache and per-phase timing; none of that changes what
a single unseeded row commits. So this function is also the engine's test oracle
(tests/test_reference.py): for one row at a fixed k it commits the very tokens the engine does,
greedy and sampled (the same generators, drawn in the same order).
"""

from __future__ import annotations

import torch

from specdec.core.engine import kv_capacity
from specdec.core.rows import MAX_SEED
from specdec.proposers.base import Proposer
from specdec.runtime.model import Transformer
from specdec.verify.chain import verify_chain
from specdec.verify.sampling import SamplingMetadata, SamplingParams, probs_from_logits


def reference_generate(target: Transformer, proposer: Proposer | None, prompt: list[int], params: SamplingParams,
                       max_new_tokens: int, k: int, seed: int = 0, eos: frozenset[int] = frozenset()) -> list[int]:
    """Up to ``max_new_tokens`` ids after ``prompt`` (stopping after a token of ``eos``), with
    ``proposer`` drafting chains of ``k`` tokens (None or k = 0: plain decoding)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
    g_verify, g_draft = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    reads = proposer is not None and proposer.wants_target_hidden  # a draft head reads the target's features
    capacity = kv_capacity(len(prompt) + max_new_tokens, k, k)
    cache = target.new_cache(1, capacity)
    context = min(target.cfg.max_position_embeddings, capacity)
    # prefill: the logits at the prompt's last token give the first token (a chain of no drafts)
    out = target(torch.tensor([prompt]), cache, logit_index=torch.tensor([[len(prompt) - 1]]), return_hidden=reads)
    logits, hidden = out if reads else (out, None)  # [1, 1, V], [1, L, E]
    first = verify_chain(probs_from_logits(logits, params), None, torch.zeros(1, 0, dtype=torch.long), g_verify)
    committed = first.tokens[0, :1].tolist()
    if proposer is not None:
        states = proposer.add([prompt], target_hidden=hidden)  # the row's own proposer state
    out_ids: list[int] = []
    while _commit(out_ids, committed, eos, max_new_tokens):
        last = torch.tensor([[committed[-1]]])  # [1, 1]: committed, its KV not yet in the cache
        # propose: at most one token fewer than the row still needs, and within the context
        depth = min(k, max_new_tokens - len(out_ids) - 1, context - 1 - int(cache.lengths[0]))
        drafts, q = torch.zeros(1, 0, dtype=torch.long), None  # [1, k], [1, k, V] or None (deterministic)
        if proposer is not None:
            proposer.feed(states, [committed])
            proposal = proposer.propose(states, depth, False, SamplingMetadata([params], g_draft))
            drafts, q = proposal.tokens, proposal.probs
        # ONE target call scores every draft and gives the bonus position
        before = cache.lengths.clone()
        out = target(torch.cat([last, drafts], 1), cache, return_hidden=reads)
        logits, hidden = out if reads else (out, None)  # [1, k+1, V], [1, k+1, E]
        # verify: accept d_i with min(1, p/q), else sample the residual; all accepted: the bonus
        result = verify_chain(probs_from_logits(logits, params), q, drafts, g_verify)
        accepted = int(result.num_accepted[0])
        # commit / roll back: keep the KV of the fed token and the accepted drafts, drop the rest
        cache.truncate(before + 1 + accepted)
        committed = result.tokens[0, : accepted + 1].tolist()
        if proposer is not None:  # observe: the proposer learns what the target accepted
            proposer.observe(states, result.num_accepted, target_hidden=hidden)  # (it reads the first accepted + 1)
    return out_ids


def _commit(out_ids: list[int], ids: list[int], eos: frozenset[int], max_new_tokens: int) -> bool:
    """Append a step's committed ``ids``, stopping after an ``eos`` token or at the length limit;
    whether the row goes on."""
    for token in ids:
        out_ids.append(token)
        if token in eos or len(out_ids) >= max_new_tokens:
            return False
    return True
