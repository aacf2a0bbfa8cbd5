"""The decoding engine: per-request state and one step = propose -> ONE target call -> verify ->
commit / roll back -> observe. Plain decoding is the same step with no proposer (k = 0).

Each step feeds the target ``[last committed token, d_1..d_k]`` and reads k+1 distributions:
position i scores d_{i+1}, position k gives the bonus. Verification commits ``num_accepted + 1``
tokens; the target cache keeps the KV of the last committed token and of the accepted drafts and
is truncated past them (O(1)). The final committed token (replacement or bonus) is fed at the
next step, so no extra target call is ever needed.

Continuous batching: :class:`Engine` holds one :class:`RowState` per request in flight. Requests
join between steps (:meth:`Engine.add`; their prefill is one target call over the joining rows
only, written into fresh rows of the shared cache: the others do not restart) and leave when they
finish or are cancelled (rows compacted in place, the proposer told which rows remain). Rows of a
step run in lockstep with one shared k; their acceptance is ragged. Because the runtime is batch
invariant, a row's logits do not depend on the other rows, so greedy output does not either; a
request with its own ``seed`` is sampled reproducibly (:mod:`specdec.verify.reproducible`), so its
sampled output does not depend on them either.

:func:`generate` is the thin batch loop over the engine that the API, CLI and bench use;
:func:`new_engine` is where engines are made. The same step for one row, top to bottom in one
function, is :func:`specdec.core.reference.reference_generate`: read it first.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from specdec.core.adaptive import K_MAX, AdaptiveK, CallCosts, ShapeRace, TreeBudget, check_k
from specdec.core.blocks import Block, ChainBlock, RowKind, block_of, row_kind
from specdec.core.metrics import GenerationMetrics, Timings
from specdec.core.prefill import chunk_groups, common_prefix, prefill_groups
from specdec.core.prefix_cache import PrefixCache
from specdec.core.recorder import FeatureRecorder
from specdec.core.rows import MAX_SEED, Filling, Request, RowResult, RowState, commit_tokens
from specdec.proposers.base import Proposer, no_drafts, tree_shape
from specdec.runtime import elementwise
from specdec.runtime.model import Transformer
from specdec.verify.sampling import SamplingMetadata, SamplingParams, probs_per_row, sample_at
from specdec.verify.reproducible import PositionUniforms
from specdec.verify.chain import ChainVerification, verify_chain_unchecked



# With a token budget, prompt chunks get at least this share of it even when decoding takes it all.
MIN_CHUNK_SHARE = 0.25
# With a token budget, the prompts of a named client (``Request.client``) that has several requests in
# the engine (a flood) prefill after other clients' prompts, at most this share of a step between them
# while another client has, or just had, a request in it; at most FLOOD_CHUNK_SHARE while it is alone
# (a client that comes then waits for the step in flight). A prefill token costs what a tenth to a fifth
# of a decoding step does on 2 cores: the flood's chunks set every step's length (docs/BENCHMARKS.md 8c).
BACKGROUND_CHUNK_SHARE = 1 / 32
FLOOD_CHUNK_SHARE = 1 / 4
RECENT_STEPS = 16  # a client counts as present this many filling steps after its last request left (its next one is on the way)


class PhaseTimer:
    """Adds the seconds of each ``with timer.phase(name):`` block to ``Timings.<name>`` and keeps
    this step's own totals in ``step`` (what the k controllers learn from)."""

    def __init__(self, timings: Timings) -> None:
        self.timings = timings
        self.step: dict[str, float] = {}

    def since(self, mark: dict[str, float]) -> dict[str, float]:
        """This step's seconds per phase after ``mark`` (a copy of :attr:`step` taken earlier)."""
        return {name: seconds - mark.get(name, 0.0) for name, seconds in self.step.items()}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.timings.add(name, dt)
            self.step[name] = self.step.get(name, 0.0) + dt


def kv_headroom(k: int | str, k_max: int) -> int:
    """KV slots a row needs beyond its prompt + max_new_tokens: a verification block of up to
    max(k, k_max) drafts and the bonus, and the slot of the token whose KV is written next."""
    return max(k_max, k if isinstance(k, int) else 0) + 2


def kv_capacity(tokens: int, k: int | str, k_max: int) -> int:
    """KV slots per row for ``tokens`` (the longest prompt + max_new_tokens) at draft length ``k``
    (an int or "auto") with ``k_max``: the one formula (callers: :func:`new_engine`, the reference step)."""
    return tokens + kv_headroom(k, k_max)


def new_engine(target: Transformer, tokens: int, draft: Callable[[int], Proposer] | None = None, *,
               k: int | str = 0, k_max: int = K_MAX, **options) -> "Engine":
    """The one place engines are made (the API, :func:`generate`, head training's own answers):
    rows of up to ``tokens`` (prompt + max_new_tokens) get :func:`kv_capacity` slots at ``k`` and
    ``k_max``, and ``draft`` builds the proposer for that capacity (None: plain decoding).
    ``options``: :class:`Engine`'s other keyword arguments."""
    capacity = kv_capacity(tokens, k, k_max)
    return Engine(target, None if draft is None else draft(capacity), capacity=capacity, k=k, k_max=k_max, **options)


class Engine:
    """Continuous batching over one target (and one proposer, shared by every row).

    ``capacity``: KV slots per row (:func:`kv_capacity` of prompt + max_new_tokens must fit;
    requests that do not are refused by :meth:`add`). ``max_batch``: rows decoded together (the others wait).
    A :class:`~specdec.core.recorder.FeatureRecorder` attached by :meth:`attach` is given the
    target's features of every row's committed positions (head training reads its own answers').
    ``k``: draft tokens per step, or "auto" (one :class:`AdaptiveK` / :class:`TreeBudget` per
    proposer source, from measured costs and acceptance). ``seed`` seeds the engine's own streams
    (rejection sampling of requests without a seed, and the proposer's draws). ``verifier`` has
    :func:`~specdec.verify.chain.verify_chain`'s signature; only exactness checks pass another one.
    ``token_budget``: the positions one step computes (chunked prefill): the batch's decoding block
    first, then chunks of waiting prompts, shortest first, with what is left (at least
    :data:`MIN_CHUNK_SHARE` of it), so that a long prompt stalls the running rows for one chunk
    a step, not for its whole prefill; None: every request that joins prefills its whole prompt
    in its first step. ``call_costs``: the target's call costs to learn into and choose k by
    (None: a fresh one).
    """

    def __init__(self, target: Transformer, proposer: Proposer | None = None, *, capacity: int, k: int | str = 0,
                 k_max: int = K_MAX, eos_token_ids: set[int] | frozenset[int] = frozenset(), seed: int = 0,
                 max_batch: int | None = None, prefix_cache: PrefixCache | None = None,
                 verifier: Callable[..., ChainVerification] = verify_chain_unchecked,
                 token_budget: int | None = None, call_costs: CallCosts | None = None) -> None:
        self.controllers: dict[str, AdaptiveK | TreeBudget] | None = None  # per source and shape
        # What a target call costs by the positions it scores is one fact about the machine and
        # the target, not about the proposer: every controller learns it from every call (one
        # CallCosts), and a caller that runs many engines over one target passes its own, so that
        # each starts with the shape the earlier ones measured (a cold one costs adaptive k 3-6%
        # of a 128-token answer at 7B while it finds v(n): docs/CHANGELOG.md, 'warm call costs').
        self.call_costs = CallCosts() if call_costs is None else call_costs
        # trees or chains, measured per source (adaptive k with a proposer that drafts trees)
        self.races: dict[str, ShapeRace] | None = None
        self._source: str | None = None  # the source of this step's proposal
        if check_k(k) == "auto":
            self.controllers, k = {}, k_max
            if proposer is not None and proposer.tree_mode != "chains":
                self.races = {}
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget
        # Requests a server holds back per client, not handed to the engine yet: a client's load counts them
        # (:meth:`_background`; set by :class:`specdec.server.scheduler.Scheduler`)
        self.held: Counter[str] = Counter()
        self._seen: dict[str, int] = {}  # client -> the last step with prompts to fill in which it had a request in the engine
        self._fills = 0
        self._background_now: tuple[set[str], float] = (set(), 1.0)  # this step's (:meth:`_background`)
        self.target, self.proposer, self.verifier = target, proposer, verifier
        self.k = k if proposer is not None else 0
        self.k_max, self.capacity, self.max_batch = k_max, capacity, max_batch
        self.eos_token_ids = eos_token_ids
        self.context_len = min(target.cfg.max_position_embeddings, capacity)
        self.prefix = prefix_cache
        self.want_hidden = proposer is not None and proposer.wants_target_hidden
        self.g_verify = torch.Generator().manual_seed(seed)
        self.g_draft = torch.Generator().manual_seed(seed + 1)
        self.cache = target.new_cache(0, capacity)
        self.rows: list[RowState] = []  # the batch, in cache-row order
        self.waiting: deque[RowState] = deque()
        self.filling: list[Filling] = []  # prompts being prefilled in chunks (cache rows after self.rows)
        self.last = torch.zeros(0, dtype=torch.long)  # [B] committed tokens whose KV is not yet in the cache
        self.metrics = GenerationMetrics(requests=0)  # all rows together, with the time by phase
        self.timer = PhaseTimer(self.metrics.timings)
        self.recorders: list[FeatureRecorder] = []
        # the prefix cache keeps the features of a finished row's KV when the proposer reads them
        self._cached_features = None
        if prefix_cache is not None and self.want_hidden:
            self._cached_features = FeatureRecorder()
            self.attach(self._cached_features)

    # -- requests in and out ------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError (naming the parameter) for a request this engine cannot run."""
        if len(request.prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {request.seed}")
        need = len(request.prompt) + request.max_new_tokens
        limit = min(self.target.cfg.max_position_embeddings, self.capacity - kv_headroom(self.k, self.k_max))
        if need > limit:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds the {'context length' if limit == self.target.cfg.max_position_embeddings else 'per-request token limit'} {limit}")

    def add(self, request: Request) -> RowState:
        """Queue a request; it joins the batch (prefill) at the next :meth:`step` with room."""
        self.check(request)
        row = RowState(request, None if request.seed is None else PositionUniforms(request.seed))
        self.waiting.append(row)
        self.metrics.requests += 1
        return row

    def cancel(self, row: RowState, reason: str = "cancelled", keep: int | None = None) -> None:
        """Finish ``row`` now (a stop string, a client gone): its output is cut to ``keep`` ids if
        given, and a cut names how it finished even when this step had already ended it (at EOS
        or max_new_tokens, after the cut) unless it failed; it leaves the batch, freeing its
        cache row, at the next step. The one place a row's ``finish_reason`` is set after its step."""
        if keep is not None:
            del row.result.token_ids[keep:]
            row.result.metrics.generated_tokens = len(row.result.token_ids)
        if not row.done or (keep is not None and row.result.finish_reason != "error"):
            row.result.finish_reason = reason
        if not row.done:
            row.done = True
            row.result.metrics.timings.total = time.perf_counter() - row.added_at
        if row in self.waiting:
            self.waiting.remove(row)

    def attach(self, recorder: FeatureRecorder) -> None:
        """Give ``recorder`` the target's features of every row that joins from now on (the
        target then returns its features with every call)."""
        if self.rows:
            raise ValueError("attach a recorder before any request joins the batch")
        self.recorders.append(recorder)
        self.want_hidden = True

    @property
    def room(self) -> int:
        """Requests that could still join the batch now beyond those waiting (a large number
        without ``max_batch``): a server hands the engine no more than that, keeping the rest in
        its own per-client queues (:class:`specdec.server.scheduler.Scheduler`)."""
        if self.max_batch is None:
            return 1 << 30
        return self.max_batch - len(self.rows) - len(self.filling) - len(self.waiting)

    @property
    def queued_positions(self) -> int:
        """Prompt positions of the requests admitted but not started (waiting, or filling with no
        chunk planned yet): what a server may still hold back for a fairer order."""
        return sum(len(r.request.prompt) for r in self.waiting) + sum(f.left for f in self.filling if not f.started)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.filling)

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[RowState]:
        """Rows leave, waiting requests join (prefill), then one decoding step of the batch;
        with a ``token_budget``, the decoding step first, then prompt chunks (:meth:`_fill`).
        Returns the rows that committed tokens or finished in this step."""
        self.timer.step = {}
        self._leave()
        if self.token_budget is None:
            changed = self._join()
            self._leave()
            return changed + (self._decode()[0] if self.rows else [])
        changed, positions = self._decode() if self.rows else ([], 0)
        self._leave()
        budget = max(self.token_budget - positions, int(self.token_budget * MIN_CHUNK_SHARE))
        return changed + self._fill(budget)

    def _leave(self) -> None:
        """Drop finished rows from the batch, the cache (compacted in place) and the proposer,
        and cancelled ones from the prompts being filled."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        filling = [j for j, f in enumerate(self.filling) if not f.row.done]
        if len(keep) == len(self.rows) and len(filling) == len(self.filling):
            return
        with self.timer.phase("cache"):
            batch, gone = len(self.rows), [r for r in self.rows if r.done]
            if self.prefix is not None and gone:
                self._store_finished([i for i, r in enumerate(self.rows) if r.done])
            if self._cached_features is not None:  # (now in the prefix cache)
                for row in gone:
                    self._cached_features.forget(row)
            self.rows = [self.rows[i] for i in keep]
            self.last = self.last[keep]
            self.filling = [self.filling[j] for j in filling]
            self.cache.retain(keep + [batch + j for j in filling])
            if self.proposer is not None and gone:  # (also when none is left: a proposer may keep finished outputs)
                self.proposer.retain(keep, [r.draft for r in gone])

    def _store_finished(self, index: list[int]) -> None:
        """Put the prompt and output KV of finished rows (not failed ones) into the prefix cache:
        the next turn of a conversation starts with them. A row's cache holds every token but
        its last (never fed); a stop string may have cut its output shorter still."""
        for i in index:
            row = self.rows[i]
            if row.result.finish_reason == "error":
                continue
            ids = row.request.prompt + row.token_ids
            n = min(int(self.cache.lengths[i]), len(ids))
            hidden = None if self._cached_features is None else self._cached_features.features(row)[:n]
            self.prefix.insert(ids[:n], self.cache, i, hidden)

    def _join(self) -> list[RowState]:
        """Prefill the waiting requests that fit and commit each one's first token. Rows that
        share an uncached prefix with another joining row are prefilled after it, in the same
        step, and take that prefix from the prefix cache (:meth:`_share_prefixes`)."""
        room = len(self.waiting) if self.max_batch is None else self.max_batch - len(self.rows)
        joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not joining:
            return []
        first, then = self._share_prefixes(joining)
        return self._join_rows(first) + (self._join_rows(then) if then else [])

    def _share_prefixes(self, joining: list[RowState]) -> tuple[list[RowState], list[RowState]]:
        """(rows to prefill first, rows to prefill after them): a row whose prompt shares at least
        one whole block more with an earlier first row than the prefix cache holds waits, so that
        requests joining together (16 cold first turns with one system prompt) prefill the common
        part once. Exact: a reused prefix's KV is the bits a prefill computes (batch invariance)."""
        if self.prefix is None or len(joining) < 2:
            return joining, []
        first, then = [], []
        for row in joining:
            waits = self._shares_uncached(row.request.prompt, [r.request.prompt for r in first])
            (then if waits else first).append(row)
        return first, then

    def _join_rows(self, joining: list[RowState]) -> list[RowState]:
        """Prefill ``joining`` in target calls over just their rows and commit each one's first token."""
        with self.timer.phase("prefill"):
            joining, logits, hidden, calls = self._prefill(joining)  # [N, 1, V], [N, L, E] or None
        self.metrics.target_calls += calls
        return self._enter(joining, logits, hidden, [1] * len(joining))

    def _enter(self, joining: list[RowState], logits: torch.Tensor, hidden: torch.Tensor | None,
               calls: list[int]) -> list[RowState]:
        """Prefilled rows (in the cache rows right after the batch's) join the batch: each one's
        first token from ``logits`` ``[N, 1, V]`` at its prompt's last token, its proposer state
        from its prompt (and features ``hidden`` ``[N, L, E]``), ``calls`` target calls each."""
        sampling = SamplingMetadata([r.request.params for r in joining])
        with self.timer.phase("verification"):
            first = self._verify(joining, logits, ChainBlock(no_drafts(len(joining))), sampling)
        if self.proposer is not None:
            with self.timer.phase("draft"):
                states = self.proposer.add([r.request.prompt for r in joining], target_hidden=hidden)
            if len(states) != len(joining):
                raise ValueError(f"the proposer returned {len(states)} row states for {len(joining)} rows")
            for row, state in zip(joining, states):
                row.draft = state
        if not self.metrics.timings.ttft:
            self.metrics.timings.ttft = sum(self.timer.step.values())
        self.rows += joining
        self.last = torch.cat([self.last, first.tokens[:, 0]])
        now = time.perf_counter()
        for row, token, n in zip(joining, first.tokens[:, 0].tolist(), calls):
            row.result.metrics.target_calls = n
            row.result.metrics.timings.ttft = now - row.added_at
            if not row.done:  # (a row that failed in verification commits nothing)
                self._commit(row, [token])
        return joining

    def _prefill(self, joining: list[RowState]) -> tuple[list[RowState], torch.Tensor, torch.Tensor | None, int]:
        """Prefill the joining rows into fresh cache rows. With a prefix cache, each row first
        takes the cached KV of its prompt's longest cached prefix and prefills only the rest.
        The rows are ordered by what is left to prefill (longest first) and prefilled in groups
        of similar lengths (:func:`prefill_groups`): one call over right-padded rows computes
        the padding too, and a short remainder beside a long one would be mostly padding.

        Returns the rows in their new order, the logits at each prompt's last token ``[N, 1, V]``,
        the target's features of every prompt position ``[N, L, E]`` if wanted (else None), and
        the number of target calls."""
        block = self.prefix.block if self.prefix is not None else 0
        chains = [self.prefix.match(r.request.prompt, self.want_hidden) if self.prefix is not None else []
                  for r in joining]
        reused = self._fit_reuse([r.request.prompt for r in joining], [len(c) * block for c in chains])
        order = sorted(range(len(joining)), key=lambda i: len(joining[i].request.prompt) - reused[i], reverse=True)
        joining, chains, reused = [joining[i] for i in order], [chains[i] for i in order], [reused[i] for i in order]
        prompts = [r.request.prompt for r in joining]
        rows = self.cache.append_rows(len(joining))
        for i, (chain, m) in enumerate(zip(chains, reused)):
            if self.prefix is not None:
                self.prefix.load(rows, i, chain[: m // block])
                self.prefix.record(len(prompts[i]), m)
            joining[i].result.metrics.cached_prompt_tokens = m
        self.metrics.cached_prompt_tokens += sum(reused)
        rest = [p[m:] for p, m in zip(prompts, reused)]
        hidden = None  # [N, L, E]: every prompt position's features (cached, then computed)
        logits = []
        groups = prefill_groups([len(r) for r in rest])
        for a, b in groups:
            part = rows.view(a, b)
            lengths = torch.tensor([len(r) for r in rest[a:b]])
            width = int(lengths[0])
            padded = torch.tensor([r + [0] * (width - len(r)) for r in rest[a:b]])  # [n, T]
            out = self.target(padded, part, logit_index=(lengths - 1).unsqueeze(1), return_hidden=self.want_hidden)
            logits.append(out[0] if self.want_hidden else out)  # [n, 1, V]
            part.truncate(part.lengths - width + lengths)
            rows.set_lengths(a, part.lengths)
            if self.want_hidden:
                if hidden is None:
                    hidden = out[1].new_zeros(len(joining), max(map(len, prompts)), out[1].shape[-1])
                for i in range(a, b):
                    hidden[i, reused[i] : len(prompts[i])] = out[1][i - a, : len(rest[i])]
        self.cache.set_lengths(len(self.rows), rows.lengths)
        for i, (chain, m) in enumerate(zip(chains, reused)):
            if hidden is not None and m:
                hidden[i, :m] = PrefixCache.hidden_of(chain[: m // block])
            if self.prefix is not None:
                self.prefix.insert(prompts[i], rows, i, None if hidden is None else hidden[i, : len(prompts[i])])
            for recorder in self.recorders:
                recorder.prefilled(joining[i], hidden[i, : len(prompts[i])])
        return joining, torch.cat(logits), hidden, len(groups)

    def _fit_reuse(self, prompts: list[list[int]], reused: list[int]) -> list[int]:
        """Cached tokens each row takes: a row whose cached prefix would push a block as wide
        as the longest remainder past the context takes none (a row's prefill block is at most
        that wide)."""
        while True:
            width = max(len(p) - m for p, m in zip(prompts, reused))
            over = [i for i, m in enumerate(reused) if m and m + width > self.context_len]
            if not over:
                return reused
            for i in over:
                reused[i] = 0

    # -- chunked prefill (a token budget per step) ---------------------------------------------

    def _fill(self, budget: int) -> list[RowState]:
        """Admit waiting requests while the batch has room (cache rows after the batch's), give
        ``budget`` prompt positions to the prompts being filled, shortest first, and let the
        rows whose prompt is complete join the batch with their first token."""
        self._admit()
        if not self.filling:  # (a decoding step with nothing to fill: no client bookkeeping)
            return []
        self._background_now = self._background()
        self._shortest_first()
        plan = self._plan(budget)
        if not plan:
            return []
        with self.timer.phase("prefill"):
            logits = self._prefill_chunks(plan)  # [P, 1, V] at each chunk's last token
        done = 0
        while done < len(plan) and self.filling[done].left == 0:
            done += 1
        if not done:
            return []
        joined, self.filling = self.filling[:done], self.filling[done:]
        with self.timer.phase("prefill"):
            hidden = self._finish_fill(joined)
        return self._enter([f.row for f in joined], logits[:done], hidden, [f.calls for f in joined])

    def _admit(self) -> None:
        """Waiting requests take cache rows (empty, after the batch's) while the batch has room."""
        taken = len(self.rows) + len(self.filling)
        room = len(self.waiting) if self.max_batch is None else self.max_batch - taken
        n = min(room, len(self.waiting))
        if n > 0:
            self.cache.append_rows(n)
            self.filling += [Filling(self.waiting.popleft()) for _ in range(n)]

    def _shortest_first(self) -> None:
        """Order the prompts being filled by what is left to prefill (a prompt not started yet:
        beyond its cached prefix), shortest first, moving their cache rows (a started row's
        written slots only): a short request then never waits behind a long prompt's chunks,
        which brings the mean time to first token down (shortest remaining time first). Prompts
        of :meth:`_background` clients come after all others."""
        def left(f: Filling) -> int:
            if f.started or self.prefix is None:
                return f.left
            return f.left - len(self.prefix.match(f.prompt, self.want_hidden)) * self.prefix.block

        background = self._background_now[0]
        order = sorted(range(len(self.filling)),
                       key=lambda j: (self.filling[j].row.request.client in background, left(self.filling[j])))
        if order != list(range(len(order))):
            self.cache.reorder(len(self.rows), order)
            self.filling = [self.filling[j] for j in order]

    def _plan(self, budget: int) -> list[tuple[int, int]]:
        """This step's chunks ``[(start, end), ...]``, one per prompt being filled, in their
        order (:meth:`_shortest_first`), ``budget`` positions in all. A prompt starts (:meth:`_start_fill`) when its turn
        comes; one that shares more whole blocks with a prompt planned before it in this step
        than the prefix cache holds waits for the next step, and the prompts after it too: it
        then takes that prefix from the cache (same-step sharing, as :meth:`_share_prefixes`). The
        prompts of :meth:`_background` clients share at most its share of the budget."""
        plan: list[tuple[int, int]] = []
        background, share = self._background_now
        for j, f in enumerate(self.filling):
            if f.row.request.client in background:  # (they come last: the rest of the budget, capped)
                budget = min(budget, max(1, int(self.token_budget * share)))
                background = set()
            if budget <= 0:
                break
            if not f.started:
                if self.prefix is not None and self._shares_uncached(f.prompt, [g.prompt for g in self.filling[:j]]):
                    break
                self._start_fill(len(self.rows) + j, f)
            n = min(f.left, budget)
            plan.append((f.done, f.done + n))
            budget -= n
        return plan

    def _background(self) -> tuple[set[str], float]:
        """The clients whose prompts prefill behind the others', a small chunk a step, and that
        chunk's share of the budget: named clients (``Request.client``) with several requests in
        the engine or held for it (``held``), ``BACKGROUND_CHUNK_SHARE`` while another client has (or had within
        ``RECENT_STEPS`` steps, its next request on the way) at most one, else
        ``FLOOD_CHUNK_SHARE``. (The unnamed client, as every library caller is, and clients that
        all have several beside each other, fill at the whole budget.)"""
        self._fills += 1
        jobs = Counter(r.request.client for r in self.rows)
        jobs.update(f.row.request.client for f in self.filling)
        jobs.update(r.request.client for r in self.waiting)
        jobs.update(self.held)
        self._seen.update(dict.fromkeys(jobs, self._fills))
        self._seen = {c: t for c, t in self._seen.items() if self._fills - t <= RECENT_STEPS}
        heavy = {c for c, n in jobs.items() if n > 1}
        if len(self._seen) > len(heavy):
            return heavy, BACKGROUND_CHUNK_SHARE
        return (heavy - {""}, FLOOD_CHUNK_SHARE) if len(heavy) == 1 else (set(), 1.0)

    def _shares_uncached(self, prompt: list[int], before: list[list[int]]) -> bool:
        """Whether ``prompt`` shares at least one whole block more with one of the prompts
        ``before`` it than the prefix cache holds (then it waits for theirs: same-step sharing)."""
        block = self.prefix.block
        cached = len(self.prefix.match(prompt, self.want_hidden)) * block
        shared = max((common_prefix(prompt, p) for p in before), default=0)
        return min(shared, len(prompt) - 1) // block * block > cached  # (the last token is always prefilled)

    def _start_fill(self, index: int, f: Filling) -> None:
        """Cache row ``index`` takes the cached KV (and features) of ``f``'s prompt's longest
        cached prefix; its chunks start after it."""
        f.started = True
        if self.prefix is None:
            return
        chain = self.prefix.match(f.prompt, self.want_hidden)
        self.prefix.load(self.cache, index, chain)
        f.done = len(chain) * self.prefix.block
        self.prefix.record(len(f.prompt), f.done)
        f.row.result.metrics.cached_prompt_tokens = f.done
        self.metrics.cached_prompt_tokens += f.done
        if self.want_hidden and chain:
            f.hidden.append(PrefixCache.hidden_of(chain))

    def _prefill_chunks(self, plan: list[tuple[int, int]]) -> torch.Tensor:
        """The planned chunks of the first ``len(plan)`` filling rows, in right-padded target calls
        over contiguous groups of their cache rows (:func:`chunk_groups`); returns the logits at
        each chunk's last token ``[P, 1, V]``."""
        batch, logits = len(self.rows), []
        starts, lengths = [a for a, _ in plan], [b - a for a, b in plan]
        for a, b in chunk_groups(starts, lengths, self.context_len):
            part = self.cache.view(batch + a, batch + b)
            width = max(lengths[a:b])
            chunks = [self.filling[j].prompt[s:e] for j, (s, e) in enumerate(plan[a:b], a)]
            padded = torch.tensor([c + [0] * (width - len(c)) for c in chunks])  # [n, T]
            n_tokens = torch.tensor(lengths[a:b])
            out = self.target(padded, part, logit_index=(n_tokens - 1).unsqueeze(1), return_hidden=self.want_hidden)
            logits.append(out[0] if self.want_hidden else out)  # [n, 1, V]
            part.truncate(part.lengths - width + n_tokens)
            self.cache.set_lengths(batch + a, part.lengths)
            for i, j in enumerate(range(a, b)):
                f = self.filling[j]
                f.done, f.calls = f.done + lengths[j], f.calls + 1
                if self.want_hidden:
                    f.hidden.append(out[1][i, : lengths[j]])
        self.metrics.target_calls += len(logits)
        return torch.cat(logits)

    def _finish_fill(self, joined: list[Filling]) -> torch.Tensor | None:
        """Complete prompts (the filling rows right after the batch's): each one's KV into the
        prefix cache and its features to the recorders; returns the features ``[N, L, E]`` of
        every prompt position (None if not wanted)."""
        hidden = None
        if self.want_hidden:
            rows = [torch.cat(f.hidden) for f in joined]  # [L_i, E]
            hidden = rows[0].new_zeros(len(rows), max(len(r) for r in rows), rows[0].shape[-1])
            for i, r in enumerate(rows):
                hidden[i, : len(r)] = r
        for i, f in enumerate(joined):
            features = None if hidden is None else hidden[i, : len(f.prompt)]
            if self.prefix is not None:
                self.prefix.insert(f.prompt, self.cache, len(self.rows) + i, features)
            for recorder in self.recorders:
                recorder.prefilled(f.row, features)
        return hidden

    def _decode(self) -> tuple[list[RowState], int]:
        """propose -> one target call -> verify -> commit / roll back -> observe. Returns the
        batch's rows and the positions the call computed (rows x block)."""
        sampling = SamplingMetadata([r.request.params for r in self.rows], self.g_draft)  # this step's, once
        # The controllers learn from this decoding step's own times: a step that also joined
        # requests spent "draft" time on their proposer prefill (``add``) and "verification"
        # time on their first tokens, which say nothing about the cost of a draft token.
        mark = dict(self.timer.step)
        drafts = [r.draft for r in self.rows]  # the proposer's row states, in batch order
        if self.proposer is not None:
            with self.timer.phase("draft"):
                self._source = self.proposer.feed(drafts, [r.pending for r in self.rows])
        controller, tree = self._controller(sampling)
        block = self._propose(drafts, controller, tree, sampling)
        cache = self.cache.view(0, len(self.rows)) if self.filling else self.cache  # (filling rows after them)
        with self.timer.phase("target_forward"):
            before = cache.lengths.clone()
            logits, hidden = block.score(self.target, cache, self.last, self.want_hidden)
        self.metrics.target_calls += 1
        with self.timer.phase("verification"):
            result = self._verify(self.rows, logits, block, sampling)
        with self.timer.phase("cache"):
            self.last, hidden = block.commit_kv(cache, before, result, hidden)
            if cache is not self.cache:
                self.cache.set_lengths(0, cache.lengths)
        if self.proposer is not None:
            with self.timer.phase("draft"):
                self.proposer.observe(drafts, result.num_accepted, target_hidden=hidden)
        t = self.timer.since(mark)
        if controller is None:  # a fixed k (or plain decoding) measures the target's calls too
            self.call_costs.observe(logits.shape[0] * logits.shape[1], t["target_forward"] + t["verification"])
        else:
            controller.observe_step(block.proposal, result, t.get("draft", 0.0), t["target_forward"] + t["verification"],
                                    caught_up=block.proposal.caught_up)
            if self.races is not None:
                self.races[self._source].observe(block.trees, int(result.num_accepted.sum()) + len(self.rows),
                                                 t.get("draft", 0.0) + t["target_forward"] + t["verification"] + t.get("cache", 0.0))
        self._record(block, result, hidden)
        return list(self.rows), logits.shape[0] * logits.shape[1]

    def _controller(self, sampling: SamplingMetadata) -> tuple[AdaptiveK | TreeBudget | None, bool]:
        """This step's shape (a tree or a chain: :func:`tree_shape`, the source's
        :class:`ShapeRace` choosing under adaptive k) and the k controller of the source the
        proposer uses next (adaptive k only)."""
        if self.proposer is None:
            return None, False
        if self.controllers is None:
            return None, tree_shape(self.proposer.tree_mode, True, sampling)
        wanted = self.races.setdefault(self._source, ShapeRace()).choose() if self.races is not None else True
        tree = tree_shape(self.proposer.tree_mode, wanted, sampling)
        key = f"{self._source}:{'tree' if tree else 'chain'}"
        if key not in self.controllers:
            self.controllers[key] = (TreeBudget(self.k_max, verify_cost=self.call_costs) if tree
                                     else AdaptiveK(k_max=self.k_max, verify_cost=self.call_costs))
        return self.controllers[key], tree

    def _propose(self, drafts: list, controller, tree: bool, sampling: SamplingMetadata) -> Block:
        """The drafts of this step: a chain of at most k tokens per row (one token fewer than the
        longest row still needs), or a tree of at most k nodes that deep; none without a proposer."""
        batch = len(self.rows)
        if self.proposer is None:
            return ChainBlock(no_drafts(batch))
        remaining = max(r.request.max_new_tokens - len(r.token_ids) for r in self.rows)
        # The block writes positions lengths .. lengths + k of every row: no row may pass the
        # context (ragged acceptance can leave a long row near its end while others still draft).
        room = self.context_len - 1 - int(self.cache.lengths[:batch].max())
        depth_cap = min(remaining - 1, room)
        k = controller.choose(batch) if controller is not None else self.k
        k = min(k, room) if tree else min(k, depth_cap)
        with self.timer.phase("draft"):
            proposal = self.proposer.propose(drafts, k, tree, sampling)
            if proposal.size > k:
                raise ValueError(f"the proposer returned {proposal.size} tokens, more than k={k}")
            return block_of(proposal).fit(depth_cap, controller)

    def _verify(self, rows: list[RowState], logits: torch.Tensor, block: Block, sampling: SamplingMetadata):
        """``logits`` ``[B, k+1, V]`` (a tree: ``[B, N+1, V]``) -> the committed tokens, each row by
        its :class:`~specdec.core.blocks.RowKind`: greedy rows commit the target's argmax, seeded rows
        the target's inverse-CDF draws at their own uniforms, the others go through rejection
        sampling from the engine's stream (the best acceptance of sampled drafts)."""
        if not elementwise.all_finite(logits):
            logits = self._fail_non_finite(rows, logits)
        batch = len(rows)
        kinds = [row_kind(p.greedy, r.uniforms is not None) for p, r in zip(sampling.params, rows)]
        other = [i for i, kind in enumerate(kinds) if kind is RowKind.REJECTION]
        rejection = None
        if other:
            whole = len(other) == batch
            part = block if whole else block.rows(torch.tensor(other))
            probs = probs_per_row(logits if whole else logits[other], [sampling.params[i] for i in other])
            rejection = part.verify_sampled(probs, self.g_verify, self.verifier)
            if whole:
                return rejection
        drawn = torch.zeros(logits.shape[:2], dtype=torch.long)  # [B, k+1]: the target's token at each slot
        greedy = [i for i, kind in enumerate(kinds) if kind is RowKind.GREEDY]
        if greedy:
            drawn[greedy] = elementwise.argmax(logits if len(greedy) == batch else logits[greedy])
        seeded = [i for i, kind in enumerate(kinds) if kind is RowKind.REPRODUCIBLE]
        if seeded:
            width = block.draw_width(seeded)
            u = torch.stack([rows[i].uniforms.take(len(rows[i].token_ids), width) for i in seeded])  # [S, width]
            probs = probs_per_row(logits[seeded], [sampling.params[i] for i in seeded])
            drawn[seeded] = sample_at(probs, block.slot_uniforms(u, seeded))
        result = block.verify_drawn(drawn)
        if rejection is not None:
            block.put_rows(result, torch.tensor(other), rejection)
        return result

    def _fail_non_finite(self, rows: list[RowState], logits: torch.Tensor) -> torch.Tensor:
        """Fail the rows whose logits hold a NaN or an inf (finish_reason "error"), and return the
        logits with theirs zeroed, so that the step goes on for the others: a row's logits do not
        depend on the other rows (batch invariance), so one broken row says nothing about them."""
        bad = (~torch.isfinite(logits)).flatten(1).any(1)  # [B]
        for i in bad.nonzero().flatten().tolist():
            self.fail(rows[i], "the target model produced non-finite logits for this request")
        return logits.masked_fill(bad.view(-1, *[1] * (logits.dim() - 1)), 0.0)

    def fail(self, row: RowState, message: str) -> None:
        """End ``row`` with finish_reason "error" and ``message``; it commits nothing more and
        leaves the batch at the next step."""
        if not row.done:
            row.result.error = message
        self.cancel(row, "error")

    def _record(self, block: Block, result, hidden: torch.Tensor | None) -> None:
        """Per-row acceptance bookkeeping (one tolist per quantity, no per-row tensor ops), the
        commit of each row's tokens, and for each recorder the features of the positions whose KV
        was kept (``hidden`` ``[B, k+1, E]``: the fed token's, then the accepted path's)."""
        depth, accepted, scored = block.depth, result.num_accepted.tolist(), block.scored
        committed = result.tokens.tolist()
        for i, row in enumerate(self.rows):
            metrics = row.result.metrics
            metrics.target_calls += 1
            if row.done:  # failed in this step's verification
                continue
            metrics.acceptance.record(depth[i], accepted[i], scored[i])
            self.metrics.acceptance.record(depth[i], accepted[i], scored[i])
            before = len(row.token_ids)
            self._commit(row, committed[i][: accepted[i] + 1])
            # the fed token's features and those of the accepted drafts committed (a row cut by its
            # budget or an end-of-sequence token inside the block commits fewer than it accepted)
            kept = 1 + min(accepted[i], len(row.token_ids) - before)
            for recorder in self.recorders:
                recorder.committed(row, hidden[i, :kept])

    def _commit(self, row: RowState, ids: list[int]) -> None:
        going = commit_tokens(row.result, ids, self.eos_token_ids, row.request.max_new_tokens)
        row.pending = ids
        if not going:
            row.done = True
            row.result.metrics.timings.total = time.perf_counter() - row.added_at
            row.result.metrics.generated_tokens = len(row.token_ids)


def generate(
    target: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_new_tokens: int,
    *,
    proposer: Proposer | None = None,
    k: int | str = 0,
    k_max: int = K_MAX,
    seed: int = 0,
    seeds: list[int | None] | None = None,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    verifier: Callable[..., ChainVerification] = verify_chain_unchecked,
    call_costs: CallCosts | None = None,
) -> list[RowResult]:
    """Generate up to ``max_new_tokens`` per prompt, all rows joining at once; exact target
    sampling whatever the proposer. A thin loop over :class:`Engine`, token ids in and out (text,
    stop strings and streaming: :class:`specdec.text.session.Session`).

    ``k``: draft tokens per step, or ``"auto"``. ``seed``: the engine's streams; ``seeds`` (one
    per prompt, None for some): reproducible sampling for those rows. ``call_costs``: the
    target's measured call costs, kept across calls by the caller (None: measured afresh).
    """
    batch = len(prompts)
    if batch == 0:
        return []
    if seeds is not None and len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for {batch} prompts")
    row_params = params if isinstance(params, list) else [params] * batch
    longest = max(len(p) for p in prompts)
    engine = new_engine(target, longest + max_new_tokens, None if proposer is None else lambda _: proposer, k=k,
                        k_max=k_max, eos_token_ids=eos_token_ids, seed=seed, verifier=verifier,
                        call_costs=call_costs)
    rows = [engine.add(Request(p, row_params[i], max_new_tokens, None if seeds is None else seeds[i]))
            for i, p in enumerate(prompts)]
    for _ in steps(engine, rows):
        pass
    return [r.result for r in rows]


def steps(engine: Engine, rows: list[RowState]) -> Iterator[list[RowState]]:
    """Step ``engine`` until it is idle, yielding each step's changed rows (the batch loop of
    :func:`generate` and of the text session). Once exhausted, the metrics are complete: the
    batch's total time and tokens, each row's tokens and its ``batch_metrics``."""
    start = time.perf_counter()
    while engine.busy:
        yield engine.step()
    engine.metrics.timings.total = time.perf_counter() - start
    engine.metrics.generated_tokens = sum(len(r.token_ids) for r in rows)
    for r in rows:
        r.result.metrics.generated_tokens = len(r.token_ids)
        r.result.batch_metrics = engine.metrics
