"""Chunked prefill (an engine's ``token_budget``): a prompt prefilled in chunks gives the bits of
one prefill (the KV and the logits), answers do not depend on the budget (greedy, seeded
sampling, with and without proposers reading the target's features, with the prefix cache),
a long prompt never stalls the running rows for more than one chunk a step, and a prompt
cancelled while it fills leaves without a trace."""

from __future__ import annotations

import pytest
import torch

from specdec.core.engine import Engine, kv_capacity, steps
from specdec.core.prefill import chunk_groups
from specdec.core.prefix_cache import PrefixCache
from specdec.core.rows import Request
from specdec.proposers.suffix import SuffixProposer
from specdec.runtime import q4
from specdec.verify.sampling import SamplingParams
from specdec.proposers.head import HeadProposer
from tiny_models import hf_tiny, ours, tiny_head

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)
DTYPES = ["int8"] + [pytest.param(d, marks=pytest.mark.skipif(not q4.available(), reason="the 4-bit kernel needs an AVX2 CPU"))
                     for d in ("q4", "q4k")]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [torch.randint(0, 97, (m,), generator=g).tolist() for m in lengths]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_prompt_prefilled_in_chunks_gives_the_bits_of_one_prefill(arch, dtype):
    """Two rows prefilled in chunks (80 tokens in chunks of 7, 55 in chunks of 11), in
    right-padded calls over both rows while both have some left, then over the longer one's
    row alone: the same logits at every position and the same KV in every written slot as
    one call over each whole prompt (gemma3: sliding windows span the chunks)."""
    model = ours(hf_tiny(arch), dtype)
    prompts, widths = [list(range(80)), list(range(5, 60))], [7, 11]
    whole = model.new_cache(2, 96)
    ref = [model(torch.tensor([p]), whole.view(i, i + 1))[0] for i, p in enumerate(prompts)]
    cache = model.new_cache(2, 96)
    got, at = [[], []], [0, 0]
    while at[0] < len(prompts[0]):
        live = [i for i in (0, 1) if at[i] < len(prompts[i])]
        chunks = [prompts[i][at[i] : at[i] + widths[i]] for i in live]
        width = max(map(len, chunks))
        part = cache.view(live[0], live[-1] + 1)
        before = part.lengths.clone()
        out = model(torch.tensor([c + [0] * (width - len(c)) for c in chunks]), part)  # [n, T, V]
        part.truncate(before + torch.tensor([len(c) for c in chunks]))
        cache.set_lengths(live[0], part.lengths)
        for j, (i, c) in enumerate(zip(live, chunks)):
            got[i].append(out[j, : len(c)])
            at[i] += len(c)
    for i, p in enumerate(prompts):
        assert torch.equal(torch.cat(got[i]), ref[i])
        n = len(p)  # [L, B, H, capacity, D]
        assert torch.equal(cache.k[:, i, :, :n], whole.k[:, i, :, :n]) and torch.equal(cache.v[:, i, :, :n], whole.v[:, i, :, :n])


def _run(target, prompts, budget, *, proposer=None, k=0, params=GREEDY, prefix=None, late=3, max_batch=None):
    """Answers (and per-row cached tokens) with ``token_budget=budget``; the last ``late``
    prompts join after the first three steps, while the others decode or fill."""
    engine = Engine(target, proposer, capacity=kv_capacity(160, k, 8), k=k, token_budget=budget,
                    prefix_cache=prefix, max_batch=max_batch)
    early = [engine.add(Request(p, params, 20, seed=None if params.greedy else 7 + i))
             for i, p in enumerate(prompts[: len(prompts) - late])]
    for _ in range(3):
        engine.step()
    rows = early + [engine.add(Request(p, params, 20, seed=None if params.greedy else 70 + i))
                    for i, p in enumerate(prompts[len(prompts) - late:])]
    for _ in steps(engine, rows):
        pass
    return [r.token_ids for r in rows], [r.result.metrics.cached_prompt_tokens for r in rows]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["none", "suffix", "head"])
def test_answers_do_not_depend_on_the_token_budget(kind, params):
    """Nine prompts of 3-89 tokens, three of them joining later, at budgets of 1 (one token a
    step), 13, 64 and none; 4 rows at most in the batch: the same answers."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    prompts = _prompts(9)

    def proposer():
        if kind == "none":
            return None
        return SuffixProposer() if kind == "suffix" else HeadProposer(tiny_head(target, 97, seed=0), 256)

    k = 0 if kind == "none" else 3
    ref, _ = _run(target, prompts, None, proposer=proposer(), k=k, params=params, max_batch=4)
    for budget in (1, 13, 64):
        got, _ = _run(target, prompts, budget, proposer=proposer(), k=k, params=params, max_batch=4)
        assert got == ref, budget


def test_the_features_of_a_chunked_prompt_are_those_of_one_prefill():
    """What a head and the recorders read: every prompt position's features, gathered chunk by
    chunk (and from the prefix cache for a cached prefix), equal one prefill's, bit for bit."""
    from specdec.core.recorder import FeatureRecorder

    target = ours(hf_tiny("qwen2", seed=0), "int8")
    prompts = _prompts(5, seed=1)
    prompts.append(prompts[0][:40] + [1, 2, 3])  # (shares 2 whole blocks with prompts[0]: the prefix cache)

    def features(budget):
        recorder = FeatureRecorder()
        engine = Engine(target, HeadProposer(tiny_head(target, 97, seed=0), 256), capacity=kv_capacity(160, 3, 8), k=3,
                        token_budget=budget, prefix_cache=PrefixCache(2**30))
        engine.attach(recorder)
        rows = [engine.add(Request(p, GREEDY, 6)) for p in prompts]
        for _ in steps(engine, rows):
            pass
        return [recorder.features(r)[: len(r.request.prompt)] for r in rows], [r.result.metrics.cached_prompt_tokens for r in rows]

    ref, _ = features(None)
    got, cached = features(16)
    assert sorted([cached[0], cached[-1]]) == [0, 32]  # one of the two takes the shared 2 blocks from the other
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_chunks_share_a_system_prompt_through_the_prefix_cache():
    """16 requests with one 70-token system prompt, budget 48: the first prefills it in two
    chunks; the others wait for it and take its 4 whole blocks from the cache; answers are
    those without the cache and without chunks."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    system = [(7 * i + 3) % 97 for i in range(70)]
    prompts = [system + [i % 97, (3 * i + 1) % 97, 5] for i in range(16)]
    ref, _ = _run(target, prompts, None, late=0)
    prefix = PrefixCache(2**30)
    got, cached = _run(target, prompts, 48, prefix=prefix, late=0)
    assert got == ref
    assert sorted(cached) == [0] + [64] * 15


def test_a_long_prompt_stalls_running_rows_for_one_chunk_a_step():
    """Two rows decode; a 150-token prompt joins with a budget of 24: every step while it
    fills computes at most 24 positions of prompt, the running rows commit a token in each
    of those steps, and the long prompt's first token comes after ceil(150 / 22) chunks."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    calls = []
    forward = target.forward

    def logged(tokens, cache, *args, **kwargs):
        calls.append(tuple(tokens.shape))
        return forward(tokens, cache, *args, **kwargs)

    target.forward = logged
    engine = Engine(target, capacity=kv_capacity(200, 0, 0), token_budget=24)
    running = [engine.add(Request([1, 2, 3], GREEDY, 40)), engine.add(Request([4, 5], GREEDY, 40))]
    engine.step()
    long = engine.add(Request([(3 * i) % 97 for i in range(150)], GREEDY, 4))
    fill_steps = 0
    while not long.token_ids:
        counts = [len(r.token_ids) for r in running]
        calls.clear()
        engine.step()
        fill_steps += 1
        assert [len(r.token_ids) for r in running] == [c + 1 for c in counts]
        assert calls[0] == (2, 1) and all(b * t <= 24 for b, t in calls[1:]), calls
    assert fill_steps == -(-150 // 22)
    ref = Engine(target, capacity=kv_capacity(200, 0, 0))
    alone = ref.add(Request(long.request.prompt, GREEDY, 4))
    for _ in steps(ref, [alone]):
        pass
    for _ in steps(engine, [long]):
        pass
    assert long.token_ids == alone.token_ids


def test_a_prompt_cancelled_while_it_fills_leaves_and_the_others_go_on():
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    prompts = _prompts(4, seed=2)
    ref, _ = _run(target, [p for i, p in enumerate(prompts) if i != 1], None, late=0)
    engine = Engine(target, capacity=kv_capacity(160, 0, 0), token_budget=8)
    rows = [engine.add(Request(p, GREEDY, 20)) for p in prompts]
    engine.step()
    engine.cancel(rows[1])
    for _ in steps(engine, rows):
        pass
    assert rows[1].finish_reason == "cancelled" and rows[1].token_ids == []
    assert [r.token_ids for i, r in enumerate(rows) if i != 1] == ref
    assert not engine.filling and not engine.rows


def test_chunk_groups_keep_padding_and_the_context_bounded():
    assert chunk_groups([0, 0, 0], [10, 10, 10], 100) == [(0, 3)]
    assert chunk_groups([0, 0], [40, 4], 100) == [(0, 1), (1, 2)]  # 80 slots for 44 tokens
    assert chunk_groups([0, 90], [8, 8], 96) == [(0, 1), (1, 2)]  # row 2's block would pass 96
    assert chunk_groups([], [], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        Engine(ours(hf_tiny("qwen2"), "int8"), capacity=16, token_budget=0)


def test_negative_control_a_chunk_that_skips_a_prompt_token_changes_the_answers():
    """The budget test's power: chunks that lose one prompt token (the second chunk of every
    prompt starts one token late) must give other answers than one prefill."""

    class Skipping(Engine):
        def _plan(self, budget):
            for f in self.filling:
                if f.started and f.calls == 1 and f.left > 1 and not getattr(f, "skipped", False):
                    f.done, f.skipped = f.done + 1, True
            return super()._plan(budget)

    target = ours(hf_tiny("qwen2", seed=0), "int8")
    prompts = _prompts(9)
    ref, _ = _run(target, prompts, None)
    engine = Skipping(target, capacity=kv_capacity(160, 0, 8), token_budget=13)
    rows = [engine.add(Request(p, GREEDY, 20)) for p in prompts]
    for _ in steps(engine, rows):
        pass
    assert sum(r.token_ids != a for r, a in zip(rows, ref)) >= 3


def test_a_short_prompt_does_not_wait_behind_a_long_one_being_filled():
    """Shortest remaining first: a 150-token prompt is filling when a 6-token one arrives; the
    short one gets its first token in its first step (its row moves before the long one's,
    whose written KV moves with it), and both answers are those of each request alone."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    engine = Engine(target, capacity=kv_capacity(200, 0, 0), token_budget=24)
    long = engine.add(Request([(3 * i) % 97 for i in range(150)], GREEDY, 8))
    engine.step()
    engine.step()
    short = engine.add(Request([5, 6, 7, 8, 9, 10], GREEDY, 8))
    engine.step()
    assert short.token_ids and not long.token_ids
    for _ in steps(engine, [long, short]):
        pass
    for row in (long, short):
        alone = Engine(target, capacity=kv_capacity(200, 0, 0))
        ref = alone.add(Request(row.request.prompt, GREEDY, 8))
        for _ in steps(alone, [ref]):
            pass
        assert row.token_ids == ref.token_ids


class _Logged(Engine):
    """An engine that logs the prompt positions each step's plan fills (``planned``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.planned: list[int] = []

    def _plan(self, budget):
        plan = super()._plan(budget)
        self.planned.append(sum(e - s for s, e in plan))
        return plan


@pytest.mark.parametrize("clients", [("a", "flood", "b"), ("", "", "")], ids=["three-clients", "negative-control-one-client"])
def test_a_clients_flood_prefills_a_small_chunk_a_step_beside_another_clients_row(clients):
    """Client A's row decodes; a flood of three 100-token prompts joins, then client B's
    40-token prompt. With a budget of 64, the flood's prompts fill at most 64 / 8 = 8 positions a
    step between them while A and B have a request each (``BACKGROUND_CHUNK_SHARE``), B's prompt
    fills first and gets its first token in its first step, and every answer is the one of its
    request alone. Negative control: every request one client's (as a library caller's): the
    flood fills at the whole budget, shortest remaining first, and B's prompt, then longer than
    what is left of the flood's first, waits behind it."""
    from specdec.core.engine import BACKGROUND_CHUNK_SHARE

    target = ours(hf_tiny("qwen2", seed=0), "int8")

    engine = _Logged(target, capacity=kv_capacity(200, 0, 0), token_budget=64)
    running = engine.add(Request([1, 2, 3], GREEDY, 60, client=clients[0]))
    engine.step()
    flood = [engine.add(Request([(7 * i + j) % 97 for i in range(100)], GREEDY, 4, client=clients[1])) for j in range(3)]
    engine.step()
    b = engine.add(Request([(5 * i) % 97 for i in range(40)], GREEDY, 4, client=clients[2]))
    engine.planned.clear()
    engine.step()
    if clients[1] == "flood":
        assert b.token_ids and engine.planned == [40 + int(64 * BACKGROUND_CHUNK_SHARE)]
        for _ in range(3):
            engine.step()
        assert all(n <= int(64 * BACKGROUND_CHUNK_SHARE) for n in engine.planned[1:]), engine.planned
    else:
        assert not b.token_ids and engine.planned == [63]
    for _ in steps(engine, [running, b] + flood):
        pass
    for row in [running, b] + flood:
        alone = Engine(target, capacity=kv_capacity(200, 0, 0))
        ref = alone.add(Request(row.request.prompt, GREEDY, row.request.max_new_tokens))
        for _ in steps(alone, [ref]):
            pass
        assert row.token_ids == ref.token_ids


@pytest.mark.parametrize("client", ["flood", ""], ids=["named-client", "negative-control-unnamed"])
def test_a_named_clients_flood_alone_fills_a_quarter_of_a_step(client):
    """A named client's three 100-token prompts, nobody else's: with a budget of 64, each step
    fills at most 64 / 4 = 16 positions (``FLOOD_CHUNK_SHARE``: a client that comes waits for the
    step in flight, no longer), and the answers are those of each request alone. Negative control:
    the unnamed client (every library caller) fills at the whole budget."""
    from specdec.core.engine import FLOOD_CHUNK_SHARE

    target = ours(hf_tiny("qwen2", seed=0), "int8")

    engine = _Logged(target, capacity=kv_capacity(200, 0, 0), token_budget=64)
    flood = [engine.add(Request([(7 * i + j) % 97 for i in range(100)], GREEDY, 4, client=client)) for j in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.planned == ([int(64 * FLOOD_CHUNK_SHARE)] * 3 if client else [64, 64, 63])  # (63: a row decodes)
    for _ in steps(engine, flood):
        pass
    for row in flood:
        alone = Engine(target, capacity=kv_capacity(200, 0, 0))
        ref = alone.add(Request(row.request.prompt, GREEDY, 4))
        for _ in steps(alone, [ref]):
            pass
        assert row.token_ids == ref.token_ids


@pytest.mark.parametrize("held", [5, 0], ids=["five-held", "negative-control-none-held"])
def test_a_clients_requests_held_by_the_server_count_toward_its_flood(held):
    """A named client's one 100-token prompt in the engine and ``held`` more held back by a
    server (``Engine.held``, as the scheduler paces a flood): it is a flood, a quarter of the
    budget a step. Negative control: nothing held, one request: the whole budget."""
    from specdec.core.engine import FLOOD_CHUNK_SHARE

    target = ours(hf_tiny("qwen2", seed=0), "int8")

    engine = _Logged(target, capacity=kv_capacity(200, 0, 0), token_budget=64)
    engine.held["flood"] = held
    engine.add(Request([(7 * i) % 97 for i in range(100)], GREEDY, 4, client="flood"))
    engine.step()
    assert engine.planned == [int(64 * FLOOD_CHUNK_SHARE) if held else 64]
