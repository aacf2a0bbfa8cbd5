"""Adaptive speculation length: choose k from measured costs and acceptance, down to k = 0.

Model of one step with k draft tokens (a batch of B rows shares k):

* time: ``T(k) = k * d + v(B (k + 1))`` — ``d`` the proposer's cost per draft token (~0 for
  n-gram lookup), ``v(n)`` the target's cost to score n positions in one call, all rows
  together (:class:`CallCosts`: a scale that follows the machine's speed from every call times
  a shape learned per measured n; unmeasured n are interpolated linearly from the measured ones,
  and before any measurement ``v(n) = v1 * (1 + 0.1 (n - 1))`` is assumed). Keying the cost by the
  positions of the whole call is what makes the choice follow the load: one row's extra drafts
  are nearly free (the weights are read once either way), sixteen rows' are not (the call is
  compute-bound), and the same measurements serve every batch size;
* tokens: with ``a_i`` = P(draft i accepted | drafts 1..i-1 accepted), the step commits
  ``E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j`` tokens in expectation (every step commits at least
  the replacement or bonus token). With a constant ``a`` this is Leviathan et al.'s
  ``(1 - a^(k+1)) / (1 - a)``; measuring ``a_i`` per position drops the i.i.d. assumption.

Expected throughput is ``B E(k) / T(k)`` (renewal-reward: tokens per second over many steps), and
the controller picks ``k* = argmax_{0 <= k <= k_max} E(k) / T(k)``. ``k = 0`` is plain decoding,
``1 / v(1)``: when drafts do not pay, speculation turns itself off.

Estimates are online: per-position acceptance counts with exponential forgetting (so the choice
follows the text as it changes), exponential moving averages for the costs. While k = 0 is
chosen, nothing would be learned about acceptance, so every ``probe_every`` steps one step with
``probe_k`` drafts is taken to keep the estimates fresh. One draft is enough for that (the first
position decides whether speculation resumes) and costs least: in a simulation of this
controller with a draft model at 0.3 of a target step whose drafts are never accepted, probes of
two drafts lost 8% against plain decoding and probes of one 4-5% (docs/CHANGELOG.md, 'joining request's prefill').
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def expected_tokens(accept: list[float], k: int) -> float:
    """``E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j`` for per-position acceptance ``accept``."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= accept[i]
        total += run
    return total


def best_k(accept: list[float], draft_cost: float, verify_cost: list[float], k_max: int) -> int:
    """``argmax_k E(k) / (k * draft_cost + verify_cost[k])``; ``verify_cost[n-1]`` verifies n positions."""
    rates = [expected_tokens(accept, k) / (k * draft_cost + verify_cost[k]) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


def verify_costs(measured: dict[int, float], n_max: int) -> list[float]:
    """Seconds to verify n = 1..``n_max`` positions from the ``measured`` ones (n -> seconds):
    linear interpolation between measured sizes, extrapolation above them from the last two,
    and below the smallest the prior's shape scaled to it (extrapolating down from the two
    largest made v(1) look far cheaper than it is: plain decoding then won a step it loses);
    one measurement scales the prior ``v(n) = v1 * (1 + 0.1 (n - 1))``, none gives that prior."""
    known = sorted(measured.items())
    if not known:
        return [1.0 + 0.1 * (n - 1) for n in range(1, n_max + 1)]
    if len(known) == 1:
        (n0, c0), = known
        base = c0 / (1 + 0.1 * (n0 - 1))
        return [base * (1 + 0.1 * (n - 1)) for n in range(1, n_max + 1)]
    out = []
    for n in range(1, n_max + 1):
        if n in measured:
            out.append(measured[n])
            continue
        if n < known[0][0]:  # below every measured size: the prior's shape from the smallest one
            n0, c0 = known[0]
            out.append(c0 * (1 + 0.1 * (n - 1)) / (1 + 0.1 * (n0 - 1)))
            continue
        lo = max((p for p in known if p[0] < n), default=known[0], key=lambda p: p[0])
        hi = min((p for p in known if p[0] > n), default=known[-1], key=lambda p: p[0])
        if lo[0] == hi[0]:
            (n1, c1), (n2, c2) = known[-2], known[-1]
            lo, hi = (n1, c1), (n2, c2)
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        out.append(max(1e-9, lo[1] + slope * (n - lo[0])))
    return out


def moving_average(old: float | None, new: float, rate: float) -> float:
    """Exponential moving average; the first measurement stands alone."""
    return new if old is None else old + rate * (new - old)


@dataclass
class CallCosts:
    """Seconds of one target call by the positions it scores, ``n`` (all rows together), as
    ``v(n) = scale * r(n)``. The shape ``r`` is 1 at the smallest size measured (the reference)
    and learned for every other measured size as a moving average (rate ``shape_ema``) of its
    time over the current scale; unmeasured sizes are interpolated by :func:`verify_costs`. The
    ``scale`` follows the machine's speed from every call of a size already measured (rate
    ``ema``).

    Why a scale and a shape, not one average per n: a step's time drifts by 10-20% within a
    request here (the memory bandwidth, a growing KV), while most steps are of one size. A v(2)
    measured once in a fast minute then stood against a v(1) kept fresh in a slow one, two
    positions looked cheaper than one, and any draft at all seemed worth verifying: on
    translation, where the head is nearly never accepted, adaptive k kept asking it to look.
    Calls of the reference size move only the scale, so the sizes keep their ratios."""

    ema: float = 0.3
    shape_ema: float = 0.1
    scale: float | None = None
    shape: dict[int, float] = field(default_factory=dict)

    @classmethod
    def measured(cls, seconds: dict[int, float]) -> "CallCosts":
        """Costs that are ``seconds`` (n -> seconds) as they stand."""
        ref = seconds[min(seconds)]
        return cls(scale=ref, shape={n: s / ref for n, s in seconds.items()})

    def state(self) -> dict:
        """What :meth:`from_state` restores: the scale and the shape (JSON-ready)."""
        return {"scale": self.scale, "shape": {str(n): r for n, r in sorted(self.shape.items())}}

    @classmethod
    def from_state(cls, state: dict) -> "CallCosts":
        """Costs learned earlier (:meth:`state`); ValueError on anything malformed, so that a
        damaged file is said and ignored, never trusted."""
        shape = {int(n): float(r) for n, r in state["shape"].items()}
        scale = state["scale"]
        if (not shape or scale is None or float(scale) <= 0 or any(n < 1 or r <= 0 for n, r in shape.items())
                or shape[min(shape)] != 1.0):
            raise ValueError(f"malformed call costs: {state!r}")
        return cls(scale=float(scale), shape=shape)

    def observe(self, n: int, seconds: float) -> None:
        """Fold a call that scored ``n`` positions in ``seconds`` into the scale and the shape."""
        if not self.shape:  # the first call: its size is the reference
            self.scale, self.shape = seconds, {n: 1.0}
            return
        if n < min(self.shape):  # a smaller size becomes the reference; every v(m) stays as it was
            factor = verify_costs(self.shape, n)[n - 1]
            self.shape = {m: r / factor for m, r in self.shape.items()} | {n: 1.0}
            self.scale *= factor
        if n not in self.shape:  # a new size: its first ratio, at the current scale
            self.shape[n] = seconds / self.scale
            return
        self.scale = moving_average(self.scale, seconds / self.shape[n], self.ema)
        if n != min(self.shape):
            self.shape[n] = moving_average(self.shape[n], seconds / self.scale, self.shape_ema)

    def costs(self, n_max: int) -> list[float]:
        """Estimated seconds of a call scoring n = 1..``n_max`` positions (before any call: the
        prior ``v(n) = 1 + 0.1 (n - 1)``, in units of one position's call)."""
        scale = 1.0 if self.scale is None else self.scale
        return [scale * c for c in verify_costs(self.shape, n_max)]


# The largest k that --k auto may choose (and the KV headroom a row keeps for it): the one default.
K_MAX = 8


def check_k(k) -> int | str:
    """``k`` as the engine, the speculation config and the CLI take it: an integer >= 0 (draft
    tokens per step, or a tree's node budget) or "auto" (:class:`AdaptiveK`); else ValueError.
    The one check of k: every boundary that takes one calls it."""
    if k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        return k
    raise ValueError(f"k must be an integer >= 0 or 'auto', got {k!r}")


@dataclass
class AdaptiveK:
    k_max: int = K_MAX
    forget: float = 0.97  # per-step decay of the acceptance counts
    prior_accept: float = 0.5
    prior_weight: float = 2.0
    ema: float = 0.3
    probe_every: int = 8
    probe_k: int = 1
    accepted: list[float] = field(default_factory=list)
    tested: list[float] = field(default_factory=list)
    draft_cost: float | None = None
    verify_cost: CallCosts = field(default_factory=CallCosts)
    _since_spec: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError("k_max must be >= 0")
        self.accepted = [0.0] * self.k_max
        self.tested = [0.0] * self.k_max

    def acceptance(self) -> list[float]:
        """Per-position acceptance estimates. Each position's prior is the estimate of the
        position before it (the first one's, ``prior_accept``): a depth never drafted is taken to
        be accepted as the deepest one measured. With a fixed prior of 0.5 instead, the
        controller that had settled on k = 2 never tried k = 3 and never learned that it pays:
        simulated with the 7B's measured costs at a = 0.8, it kept k = 2 throughout, 4% below the
        best fixed k (docs/CHANGELOG.md, 'adaptive k at 7B')."""
        out, prior = [], self.prior_accept
        for a, t in zip(self.accepted, self.tested):
            prior = (a + prior * self.prior_weight) / (t + self.prior_weight)
            out.append(prior)
        return out

    def verify_costs(self, rows: int = 1) -> list[float]:
        """Estimated seconds of a call verifying k = 0..k_max drafts for each of ``rows`` rows."""
        costs = self.verify_cost.costs(rows * (self.k_max + 1))
        return [costs[rows * (k + 1) - 1] for k in range(self.k_max + 1)]

    def choose(self, rows: int = 1) -> int:
        """k for the next step of a batch of ``rows`` rows."""
        if self.k_max == 0:
            return 0
        k = best_k(self.acceptance(), self.draft_cost or 0.0, self.verify_costs(rows), self.k_max)
        if k == 0:
            self._since_spec += 1
            if self._since_spec >= self.probe_every:
                self._since_spec = 0
                return min(self.probe_k, self.k_max)
        else:
            self._since_spec = 0
        return k

    def observe_step(self, proposal, result, draft_seconds: float, verify_seconds: float, caught_up: bool) -> None:
        """The engine's call after each step (a chain proposal and its verification)."""
        self.observe(proposal.size, result.num_accepted.tolist(), draft_seconds, verify_seconds, caught_up,
                     declined=proposal.declined)

    def observe(self, k: int, num_accepted: list[int], draft_seconds: float, verify_seconds: float,
                caught_up: bool = False, declined: bool = False) -> None:
        """One step: ``k`` drafts were verified for each row, rows accepted ``num_accepted``.

        ``caught_up``: the proposer also fed tokens it had skipped while k was 0 (or the whole
        prompt, on its first step); that time is not a per-draft cost, so it does not update the
        draft cost estimate. Until a step that is not a catch-up measures it, the draft cost is
        taken as 0, which keeps speculating until it is measured.

        ``declined``: the proposer looked at position k + 1 and chose not to draft it (a chain
        cut by the head's confidence, ``Proposal.declined``). That position counts as a rejected
        draft of every row that accepted all k, and its look as one more position of draft time:
        the estimates then describe what asking for k drafts yields, cuts included. Without
        this, a step cut to zero drafts taught the controller nothing, so where the head is
        nearly always cut (translation) it stayed on, paying its catch-up every step, on the
        acceptance of the rare uncut steps (docs/BENCHMARKS.md, "Adaptive k")."""
        self.verify_cost.observe(len(num_accepted) * (k + 1), verify_seconds)
        looked = min(k + 1 if declined else k, self.k_max)  # positions the proposer paid for
        if looked == 0:
            return
        if not caught_up:  # (the first step is always one: the proposer's own prefill of the prompt)
            self.draft_cost = moving_average(self.draft_cost, draft_seconds / looked, self.ema)
        self.accepted = [a * self.forget for a in self.accepted]
        self.tested = [t * self.forget for t in self.tested]
        for acc in num_accepted:
            for i in range(min(acc + 1, looked)):  # positions 1..acc accepted, acc+1 rejected or declined
                self.tested[i] += 1.0
                if i < acc:
                    self.accepted[i] += 1.0


@dataclass
class TreeBudget:
    """How many nodes of a candidate tree to verify, chosen each step from the tree itself.

    A tree proposer attaches to each node a score ``s`` — its estimate that the node lies on the
    accepted path (e.g. the product of draft probabilities along the path; EAGLE-2 shows this
    confidence tracks acceptance). The expected tokens a step commits with the best ``n`` nodes of
    each row is ``E(n) = 1 + sum_{i<=n} c_{d(i)} s_i`` (each accepted node is one token, plus the
    replacement or bonus): every node counts once, whichever branch wins. ``c_d`` calibrates the
    scores per depth d from what was measured (accepted nodes at depth d / summed scores of the
    verified nodes at depth d, with forgetting; prior 1). The step keeps
    ``n* = argmax_n sum_rows E_row(n) / (d + v(n + 1))``, ``d`` the measured drafting time per
    step and ``v`` the measured verification time per block size (interpolated as for chains).
    ``n = 0`` is plain decoding at ``B / v(1)``.

    Two decisions, two time frames. Once a tree is drafted its drafting time is spent, so the
    step keeps ``n* = argmax_n sum_rows E_row(n) / v(n + 1)`` (n = 0 included: a hopeless tree is
    not verified). Whether to draft at all is decided on the average: each drafted step also
    measures ``gain = max_{n>=1} sum_rows E_row(n) / (d + v(n + 1)) / (B / v(1))`` — what drafting
    bought, its cost ``d`` included — and drafting continues while an exponential average of that
    gain is at least 1; otherwise it pauses, with a probe every ``probe_every`` steps.
    """

    max_nodes: int
    forget: float = 0.97
    prior_weight: float = 2.0
    ema: float = 0.3
    probe_every: int = 8
    hits: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    draft_cost: float | None = None
    verify_cost: CallCosts = field(default_factory=CallCosts)
    gain: float | None = None  # exponential average of what drafting bought (see above)
    _since_spec: int = 0

    def __post_init__(self) -> None:
        if self.max_nodes < 0:
            raise ValueError("max_nodes must be >= 0")

    def calibration(self, depth: int) -> float:
        """``c_d`` for depth d (1-based)."""
        i = depth - 1
        hits = self.hits[i] if i < len(self.hits) else 0.0
        pred = self.predicted[i] if i < len(self.predicted) else 0.0
        return (hits + self.prior_weight) / (pred + self.prior_weight)

    def choose(self, rows: int = 1) -> int:
        """Nodes to ask the proposer for this step: ``max_nodes``, or 0 while trees do not pay
        (``rows`` plays no part here: :meth:`nodes` sizes each tree knowing the batch)."""
        if self.gain is None or self.gain >= 1.0 or self.max_nodes == 0:
            self._since_spec = 0
            return self.max_nodes
        self._since_spec += 1
        if self._since_spec >= self.probe_every:
            self._since_spec = 0
            return self.max_nodes
        return 0

    def nodes(self, proposal) -> int:
        """``n*`` for this proposal (a tree whose ``scores`` are set)."""
        size = proposal.size
        if size == 0:
            return 0
        real = proposal.tokens >= 0
        depth = proposal.node_depths  # [B, N]
        calib = torch.tensor([self.calibration(d) for d in range(1, int(depth.max()) + 2)])
        value = torch.where(real, proposal.scores.float().clamp(0, 1) * calib[(depth - 1).clamp(min=0)], 0.0)
        gain = torch.sort(value, dim=1, descending=True).values.sum(0).cumsum(0)  # [N] summed over rows
        rows = proposal.tokens.shape[0]
        per_call = self.verify_cost.costs(rows * (size + 1))  # keyed by the call's positions (as AdaptiveK)
        costs = [per_call[rows * (n + 1) - 1] for n in range(size + 1)]
        expected = [float(rows)] + [rows + float(gain[n - 1]) for n in range(1, size + 1)]
        best = max(range(size + 1), key=lambda n: (expected[n] / costs[n], -n))  # drafting is spent
        draft = self.draft_cost or 0.0
        bought = max(expected[n] / (draft + costs[n]) for n in range(1, size + 1)) / (rows / costs[0])
        self.gain = moving_average(self.gain, bought, self.ema)
        return best

    def observe_step(self, proposal, result, draft_seconds: float, verify_seconds: float, caught_up: bool) -> None:
        self.verify_cost.observe(proposal.tokens.shape[0] * (proposal.size + 1), verify_seconds)
        if proposal.size == 0 or not proposal.is_tree:
            return
        if not caught_up:
            self.draft_cost = moving_average(self.draft_cost, draft_seconds, self.ema)
        depth = proposal.node_depths  # [B, N]
        max_depth = int(depth.max())
        grow = max_depth - len(self.hits)
        if grow > 0:
            self.hits += [0.0] * grow
            self.predicted += [0.0] * grow
        self.hits = [h * self.forget for h in self.hits]
        self.predicted = [p * self.forget for p in self.predicted]
        real = proposal.tokens >= 0
        scores = proposal.scores.float().clamp(0, 1)
        for d in range(1, max_depth + 1):
            at = real & (depth == d)
            self.predicted[d - 1] += float(scores[at].sum())
            self.hits[d - 1] += float((result.num_accepted >= d).sum())


@dataclass
class ShapeRace:
    """Trees or chains, for a proposer that can draft either: whichever has committed more tokens
    per second lately.

    A tree's value depends on things its own model cannot see well: how often the proposer's
    second guesses are right on this text, what an extra scored node costs on this machine in its
    current state (~2 ms, 10-16% of a step, when memory is fast: the 4-bit kernel is then
    compute-bound) and what drafting the levels costs. Measured on answers that end at the end of
    the turn, the head's trees ran at 0.90x of its chains greedy (docs/CHANGELOG.md, 'all layers in one call'), while on
    copy-heavy edits trees win. So the engine measures both: per shape, an exponential average of
    tokens committed and of seconds spent (drafting, target call, verification) per step, and the
    rate is their ratio (renewal-reward, as :class:`AdaptiveK`). Each shape is tried first; then
    the faster one runs, and every ``explore_every``-th step the other, to follow the text.
    Steps where the proposer drafted a chain although trees were asked for (every row sampling)
    count as chain steps.
    """

    ema: float = 0.2
    explore_every: int = 8
    tokens: dict[bool, float] = field(default_factory=dict)  # shape (True: trees) -> average tokens per step
    seconds: dict[bool, float] = field(default_factory=dict)  # shape -> average seconds per step
    _steps: int = 0

    def rate(self, trees: bool) -> float | None:
        if trees not in self.seconds:
            return None
        return self.tokens[trees] / max(self.seconds[trees], 1e-9)

    def choose(self) -> bool:
        """Whether the next step should draft trees."""
        self._steps += 1
        for shape in (False, True):  # chains first: the cheaper start
            if shape not in self.seconds:
                return shape
        best = self.rate(True) > self.rate(False)
        return (not best) if self._steps % self.explore_every == 0 else best

    def observe(self, trees: bool, tokens: int, seconds: float) -> None:
        """One step: its shape, the tokens it committed (all rows) and its seconds."""
        self.tokens[trees] = moving_average(self.tokens.get(trees), float(tokens), self.ema)
        self.seconds[trees] = moving_average(self.seconds.get(trees), seconds, self.ema)
