"""The seed experiment: plain target sampling vs exact speculative sampling on a Markov pair.

``run_reference`` is a faithful scalar loop that consumes the random streams in the seed's order
(draft multinomials, then one uniform per tested position, then the residual or bonus
multinomial), so with the seed defaults it reproduces the seed's printed digits exactly.

``run_fast`` simulates many independent streams at once with tensor operations and verifies them
with the library's batched :func:`specdec.verify_chain`. It reaches the same statistics (different
random draws) far faster; each stream first runs ``burn_in`` uncounted calls so that call-start
states are near the stationary distribution the closed form assumes.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from specdec.toy.markov import MarkovPair, closed_form
from specdec.verify.chain import verify_chain

SEED_TOKENS = 100_000
SEED_K = 4
SEED_BASELINE = 202
SEED_SPECULATIVE = 303


@dataclass
class ToyResult:
    mode: str
    tokens: int
    vocab: int
    proposal_len: int
    baseline_vs_target_max_error: float
    speculative_vs_target_max_error: float
    baseline_vs_speculative_max_error: float
    mean_accepted_draft_tokens_per_call: float
    target_calls_per_emitted_token: float
    expected_accepted_draft_tokens_per_call: float
    expected_target_calls_per_emitted_token: float
    seconds: float
    streams: int = 1
    # Standard errors (fast mode only: computed across independent streams).
    accepted_per_call_stderr: float | None = None
    calls_per_token_stderr: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _draw(probs: torch.Tensor, g: torch.Generator) -> int:
    return torch.multinomial(probs, 1, generator=g).item()


def reference_target_stream(pair: MarkovPair, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    current, output = 0, []
    for _ in range(length):
        current = _draw(pair.target[current], g)
        output.append(current)
    return output


def _reference_step(pair: MarkovPair, current: int, k: int, g: torch.Generator) -> tuple[list[int], int]:
    candidates, q_rows, state = [], [], current
    for _ in range(k):
        q = pair.draft[state]
        token = _draw(q, g)
        candidates.append(token)
        q_rows.append(q)
        state = token
    p_rows, state = [], current
    for token in candidates:
        p_rows.append(pair.target[state])
        state = token
    bonus_p = pair.target[state]
    accepted: list[int] = []
    for token, p, q in zip(candidates, p_rows, q_rows):
        a = min(1.0, (p[token] / q[token]).item())
        if torch.rand((), generator=g).item() <= a:
            accepted.append(token)
            continue
        correction = torch.clamp(p - q, min=0)
        correction /= correction.sum()
        accepted.append(_draw(correction, g))
        return accepted, len(accepted) - 1
    accepted.append(_draw(bonus_p, g))
    return accepted, k


def reference_speculative_stream(pair: MarkovPair, length: int, k: int, seed: int) -> tuple[list[int], int, int]:
    g = torch.Generator().manual_seed(seed)
    current, output, calls, accepted_draft = 0, [], 0, 0
    while len(output) < length:
        emitted, accepted = _reference_step(pair, current, k, g)
        calls += 1
        accepted_draft += accepted
        output.extend(emitted[: length - len(output)])
        current = output[-1]
    return output, calls, accepted_draft


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    previous = 0
    for token in tokens:
        counts[previous, token] += 1
        previous = token
    return counts / counts.sum(-1, keepdim=True)


def run_reference(
    pair: MarkovPair | None = None,
    tokens: int = SEED_TOKENS,
    k: int = SEED_K,
    baseline_seed: int = SEED_BASELINE,
    speculative_seed: int = SEED_SPECULATIVE,
) -> ToyResult:
    """The seed experiment, scalar and in the seed's random order."""
    pair = pair or MarkovPair.seed()
    start = time.perf_counter()
    baseline = reference_target_stream(pair, tokens, baseline_seed)
    speculative, calls, accepted = reference_speculative_stream(pair, tokens, k, speculative_seed)
    f1, f2 = _frequencies(baseline, pair.vocab), _frequencies(speculative, pair.vocab)
    seconds = time.perf_counter() - start
    exact = closed_form(pair, k)
    return ToyResult(
        mode="reference",
        tokens=tokens,
        vocab=pair.vocab,
        proposal_len=k,
        baseline_vs_target_max_error=(f1 - pair.target).abs().max().item(),
        speculative_vs_target_max_error=(f2 - pair.target).abs().max().item(),
        baseline_vs_speculative_max_error=(f1 - f2).abs().max().item(),
        mean_accepted_draft_tokens_per_call=accepted / calls,
        target_calls_per_emitted_token=calls / tokens,
        expected_accepted_draft_tokens_per_call=exact.expected_accepted_per_call,
        expected_target_calls_per_emitted_token=exact.target_calls_per_token,
        seconds=seconds,
    )


def _transition_counts(prev: torch.Tensor, nxt: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[V, V]`` counts of (prev, next) pairs where ``next >= 0``."""
    valid = nxt >= 0
    flat = prev[valid] * vocab + nxt[valid]
    return torch.bincount(flat, minlength=vocab * vocab).to(torch.float64).view(vocab, vocab)


def run_fast(
    pair: MarkovPair | None = None,
    tokens: int = SEED_TOKENS,
    k: int = SEED_K,
    baseline_seed: int = SEED_BASELINE,
    speculative_seed: int = SEED_SPECULATIVE,
    streams: int = 2000,
    burn_in: int = 4,
) -> ToyResult:
    """Many independent streams at once; speculative steps go through :func:`verify_chain`."""
    pair = pair or MarkovPair.seed()
    if streams < 2:
        raise ValueError("fast mode needs at least 2 streams (standard errors are taken across streams)")
    vocab = pair.vocab
    start = time.perf_counter()
    base_counts = _plain_counts(pair.target, tokens, streams, baseline_seed)
    spec_counts, accepted, emitted, calls = _speculative_counts(pair, tokens, k, streams, speculative_seed, burn_in)
    seconds = time.perf_counter() - start

    f1 = base_counts / base_counts.sum(-1, keepdim=True)
    f2 = spec_counts / spec_counts.sum(-1, keepdim=True)
    per_stream_accepted = accepted / calls  # [N] each stream made the same number of calls
    mean_accepted = per_stream_accepted.mean().item()
    accepted_se = (per_stream_accepted.std() / math.sqrt(streams)).item()
    exact = closed_form(pair, k)
    total_tokens = int(emitted.sum().item())
    return ToyResult(
        mode="fast",
        tokens=total_tokens,
        vocab=vocab,
        proposal_len=k,
        baseline_vs_target_max_error=(f1 - pair.target).abs().max().item(),
        speculative_vs_target_max_error=(f2 - pair.target).abs().max().item(),
        baseline_vs_speculative_max_error=(f1 - f2).abs().max().item(),
        mean_accepted_draft_tokens_per_call=mean_accepted,
        target_calls_per_emitted_token=calls * streams / total_tokens,
        expected_accepted_draft_tokens_per_call=exact.expected_accepted_per_call,
        expected_target_calls_per_emitted_token=exact.target_calls_per_token,
        seconds=seconds,
        streams=streams,
        accepted_per_call_stderr=accepted_se,
        # delta method: d/dA 1/(1+A) = -1/(1+A)^2
        calls_per_token_stderr=accepted_se / (1.0 + mean_accepted) ** 2,
        extra={
            "burn_in_calls": burn_in,
            "calls_per_stream": calls,
            "speculative_transition_counts": spec_counts.to(torch.long).tolist(),
        },
    )


def _plain_counts(target: torch.Tensor, tokens: int, streams: int, seed: int) -> torch.Tensor:
    """Plain target sampling, every stream one token per step: transition counts ``[V, V]``."""
    vocab = target.shape[0]
    g = torch.Generator().manual_seed(seed)
    current = torch.zeros(streams, dtype=torch.long)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(math.ceil(tokens / streams)):
        nxt = torch.multinomial(target[current], 1, generator=g).squeeze(-1)  # [N]
        counts += _transition_counts(current, nxt, vocab)
        current = nxt
    return counts


def _draft_chains(draft: torch.Tensor, current: torch.Tensor, k: int, g: torch.Generator):
    """``k`` draft tokens per stream from ``current`` ``[N]``: tokens ``[N, k]`` and the q each
    was drawn from ``[N, k, V]``."""
    state, drafted, q_rows = current, [], []
    for _ in range(k):
        q = draft[state]  # [N, V]
        state = torch.multinomial(q, 1, generator=g).squeeze(-1)  # [N]
        drafted.append(state)
        q_rows.append(q)
    if not k:
        return torch.zeros(len(current), 0, dtype=torch.long), torch.zeros(len(current), 0, draft.shape[0], dtype=draft.dtype)
    return torch.stack(drafted, 1), torch.stack(q_rows, 1)


def _speculative_counts(pair: MarkovPair, tokens: int, k: int, streams: int, seed: int, burn_in: int):
    """Speculative sampling, one chain verification per stream per call (the first ``burn_in``
    calls not counted): transition counts ``[V, V]``, accepted and emitted tokens per stream
    ``[N]``, and the calls counted."""
    vocab = pair.vocab
    g = torch.Generator().manual_seed(seed)
    current = torch.zeros(streams, dtype=torch.long)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted = torch.zeros(streams, dtype=torch.float64)
    emitted = torch.zeros(streams, dtype=torch.float64)
    calls = call_index = 0
    while emitted.sum().item() < tokens:
        draft_tokens, q_all = _draft_chains(pair.draft, current, k, g)  # [N, k], [N, k, V]
        p = pair.target[torch.cat([current.unsqueeze(1), draft_tokens], 1)]  # [N, k+1, V]
        result = verify_chain(p, q_all, draft_tokens, g)
        committed_prev = torch.cat([current.unsqueeze(1), result.tokens[:, :-1]], 1)  # [N, k+1]
        current = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
        call_index += 1
        if call_index <= burn_in:
            continue
        counts += _transition_counts(committed_prev.clamp(min=0), result.tokens, vocab)
        accepted += result.num_accepted.to(torch.float64)
        emitted += result.num_committed.to(torch.float64)
        calls += 1
    return counts, accepted, emitted, calls
