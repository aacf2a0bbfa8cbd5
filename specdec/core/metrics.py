"""Metrics as plain data, in the three classes that are always reported separately.

1. acceptance quality: accepted draft tokens per call, full-acceptance rate, histogram of the
   first-rejection position;
2. target serial steps: target calls per emitted token, tokens per call;
3. end-to-end time: TTFT, TPOT, throughput, and where the time went (draft, target forward,
   verification, cache).

No I/O here; ``to_dict`` gives the JSON shape used by ``specdec generate --json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    k_max: int = 0
    calls: int = 0  # verification calls that carried at least one draft token
    drafted: int = 0
    accepted: int = 0
    full_accepts: int = 0
    # first_rejection[i] = calls whose first rejected draft was at position i (0-based);
    # calls where every draft was accepted are counted in full_accepts instead.
    first_rejection: list[int] = field(default_factory=list)
    # Per draft position i (0-based), as vLLM's per-position counters: calls that reached i (drafted
    # it with every earlier draft accepted) and calls that accepted it.
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # Tokens the target scored as drafts: = drafted for chains, all nodes for candidate trees (whose
    # "positions" above are depths: a tree of depth d counts as d drafted positions).
    scored: int = 0

    def record(self, num_drafted: int, num_accepted: int, scored: int | None = None) -> None:
        """One call: ``num_drafted`` draft positions (a tree's depth), ``num_accepted`` of them
        accepted, ``scored`` draft tokens scored (tree nodes; default ``num_drafted``)."""
        if num_drafted == 0:
            return
        self.calls += 1
        self.drafted += num_drafted
        self.scored += num_drafted if scored is None else scored
        self.accepted += num_accepted
        self.k_max = max(self.k_max, num_drafted)
        grow = num_drafted - len(self.reached_at)
        if grow > 0:
            self.reached_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(min(num_accepted + 1, num_drafted)):
            self.reached_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1
        if num_accepted == num_drafted:
            self.full_accepts += 1
        else:
            while len(self.first_rejection) <= num_accepted:
                self.first_rejection.append(0)
            self.first_rejection[num_accepted] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        out = AcceptanceStats(max(self.k_max, other.k_max), self.calls + other.calls, self.drafted + other.drafted,
                              self.accepted + other.accepted, self.full_accepts + other.full_accepts,
                              scored=self.scored + other.scored)
        out.first_rejection = _add(self.first_rejection, other.first_rejection)
        out.reached_at = _add(self.reached_at, other.reached_at)
        out.accepted_at = _add(self.accepted_at, other.accepted_at)
        return out

    def per_position(self) -> list[float]:
        """Acceptance rate of each draft position given that every earlier one was accepted
        (``a_i`` of the adaptive controller and of ``specdec profile``)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    def to_dict(self) -> dict:
        return {
            "verify_calls_with_drafts": self.calls,
            "drafted_tokens": self.drafted,
            "scored_draft_tokens": self.scored,
            "accepted_tokens": self.accepted,
            "mean_accepted_per_call": self.accepted / self.calls if self.calls else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "full_acceptance_rate": self.full_accepts / self.calls if self.calls else 0.0,
            "first_rejection_histogram": list(self.first_rejection),
            "acceptance_per_position": [round(a, 4) for a in self.per_position()],
            "reached_per_position": list(self.reached_at),
            "accepted_per_position": list(self.accepted_at),
        }


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class Timings:
    """Seconds spent per phase; ``total`` is wall-clock from start to the last token."""

    prefill: float = 0.0  # target calls over prompts (and the joining rows' cache set-up)
    draft: float = 0.0  # the proposer: propose, observe, and prefill of its own cache
    target_forward: float = 0.0  # target forward calls over the verified blocks
    verification: float = 0.0  # logits -> probabilities, acceptance / residual / bonus, sampling
    cache: float = 0.0  # KV rollback, compaction of rows that left
    ttft: float = 0.0
    total: float = 0.0

    PHASES = ("prefill", "draft", "target_forward", "verification", "cache")

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to one of :attr:`PHASES`."""
        if phase not in self.PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(self.PHASES)}")
        setattr(self, phase, getattr(self, phase) + seconds)


@dataclass
class GenerationMetrics:
    generated_tokens: int = 0
    target_calls: int = 0  # target forward calls, prefill included
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    timings: Timings = field(default_factory=Timings)
    requests: int = 1
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        if self.generated_tokens <= 1:
            return 0.0
        return (self.timings.total - self.timings.ttft) / (self.generated_tokens - 1)

    def to_dict(self) -> dict:
        t = self.timings
        n = self.generated_tokens
        return {
            "acceptance": self.acceptance.to_dict(),
            "target_calls": self.target_calls,
            "target_calls_per_token": self.target_calls / n if n else 0.0,
            "tokens_per_call": n / self.target_calls if self.target_calls else 0.0,
            "generated_tokens": n,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "ttft_s": t.ttft,
            "tpot_s": self.tpot,
            "throughput_tok_s": n / t.total if t.total > 0 else 0.0,
            "total_s": t.total,
            "time_breakdown_s": {
                "prefill": t.prefill,
                "draft": t.draft,
                "target_forward": t.target_forward,
                "verification": t.verification,
                "cache": t.cache,
            },
        }
