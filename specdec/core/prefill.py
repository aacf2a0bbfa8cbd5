"""Prefill grouping: which joining rows share one right-padded target call, and what prompts share."""

from __future__ import annotations

# Positions an engine step computes while serving (chunked prefill; the engine's token_budget):
# measured on 2 cores, docs/BENCHMARKS.md ("served under load").
STEP_TOKENS = 256
PADDING_WASTE = 1.25  # a prefill group computes at most this many slots per prompt token


def prefill_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Contiguous groups ``[(a, b), ...]`` of rows sorted by ``lengths`` (longest first) for
    right-padded prefill calls: a group grows while its padded size (rows x its first row's
    length) stays within :data:`PADDING_WASTE` times its tokens. Equal lengths make one group;
    a 500-token remainder and fifteen 30-token ones make two calls instead of one call of
    8,000 slots for 950 tokens. (:func:`chunk_groups` with every row's block at slot 0 and no
    limit: sorted longest first, a group's widest row is its first.)"""
    return chunk_groups([0] * len(lengths), lengths, float("inf"))


def chunk_groups(starts: list[int], lengths: list[int], limit: int) -> list[tuple[int, int]]:
    """Contiguous groups ``[(a, b), ...]`` of prompt chunks (chunked prefill, rows in the
    engine's order: by what is left, not by chunk width) for right-padded calls: a group grows while its padded size (rows x its
    widest chunk) stays within :data:`PADDING_WASTE` times its tokens and every row's padded
    block, written at its ``starts`` slot, stays within ``limit`` slots."""
    groups, a = [], 0
    while a < len(lengths):
        b, tokens, width, start = a + 1, lengths[a], lengths[a], starts[a]
        while b < len(lengths):
            wider, later = max(width, lengths[b]), max(start, starts[b])  # running maxima: linear
            if later + wider > limit or (b + 1 - a) * wider > PADDING_WASTE * (tokens + lengths[b]):
                break
            tokens, width, start, b = tokens + lengths[b], wider, later, b + 1
        groups.append((a, b))
        a = b
    return groups


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
