"""Metrics as plain data, in the three classes that are always reported separately.

1. acceptance quality: accepted draft tokens per call, full-acceptance rate, histogram of the
   first-rejection position;
2. target serial steps: target calls per emitted token, tokens per call;
3. end-to-end time: TTFT, TPOT, throughput, and where the time went (draft, verify, sampling,
   cache).

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

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.calls += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.k_max = max(self.k_max, num_drafted)
        if num_accepted == num_drafted:
            self.full_accepts += 1
        else:
            while len(self.first_rejection) <= num_accepted:
                self.first_rejection.append(0)
            self.first_rejection[num_accepted] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        out = AcceptanceStats(max(self.k_max, other.k_max), self.calls + other.calls, self.drafted + other.drafted,
                              self.accepted + other.accepted, self.full_accepts + other.full_accepts)
        n = max(len(self.first_rejection), len(other.first_rejection))
        out.first_rejection = [
            (self.first_rejection[i] if i < len(self.first_rejection) else 0)
            + (other.first_rejection[i] if i < len(other.first_rejection) else 0)
            for i in range(n)
        ]
        return out

    def to_dict(self) -> dict:
        return {
            "verify_calls_with_drafts": self.calls,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "mean_accepted_per_call": self.accepted / self.calls if self.calls else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "full_acceptance_rate": self.full_accepts / self.calls if self.calls else 0.0,
            "first_rejection_histogram": list(self.first_rejection),
        }


@dataclass
class Timings:
    """Seconds spent per phase; ``total`` is wall-clock from start to the last token."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0  # target forward calls after prefill
    sampling: float = 0.0  # logits -> probabilities, verification math, sampling
    cache: float = 0.0  # KV rollback and bookkeeping
    ttft: float = 0.0
    total: float = 0.0


@dataclass
class GenerationMetrics:
    generated_tokens: int = 0
    target_calls: int = 0  # target forward calls, prefill included
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    timings: Timings = field(default_factory=Timings)
    requests: int = 1

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
            "ttft_s": t.ttft,
            "tpot_s": self.tpot,
            "throughput_tok_s": n / t.total if t.total > 0 else 0.0,
            "total_s": t.total,
            "time_breakdown_s": {
                "prefill": t.prefill,
                "draft": t.draft,
                "verify": t.verify,
                "sampling": t.sampling,
                "cache": t.cache,
            },
        }
