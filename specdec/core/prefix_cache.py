"""Prefix caching: the KV of token prefixes that earlier requests prefilled or generated, reused
by later requests that start with the same tokens (vLLM's automatic prefix caching, SGLang's
RadixAttention; here: blocks of ``BLOCK`` tokens chained by hash).

Why reuse is exact: a slot's K/V depends only on the tokens up to it, and the runtime is batch
invariant (a row's block gives the same bits whether it is computed in one call, in pieces, or
beside other rows: ``tests/test_runtime.py``). So a prompt prefilled from a cached prefix gets
bit-identical logits to one prefilled from scratch (the quantized dtypes; float32/bfloat16 agree
to rounding), and greedy output does not change. ``tests/test_prefix_cache.py`` checks both.

Structure: block ``i`` of a sequence (its tokens ``[i*BLOCK, (i+1)*BLOCK)``) is stored under a
key chained from the previous block's: ``key_i = blake2b(key_{i-1} || tokens of block i)``, so a
key names the whole prefix up to its block's end, and a lookup walks the prompt block by block
from the start and stops at the first miss. The hash is cryptographic because prompts come from
clients: a crafted collision must not hand one request another prefix's KV.

Memory: a budget in bytes over every entry's K/V (and target features, for proposers that read
them), evicted least-recently-used. A lookup refreshes the matched chain from its last block to
its first, so a chain's first blocks (shared by the most requests: a system prompt) are the last
to go. A block whose parent was evicted is unreachable until the parent is stored again (its
key still names the same prefix, so it is then valid again).

The KV cache stays the only owner of positions: entries hold copies read with
:meth:`KVCache.read` and are written back with :meth:`KVCache.place`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.runtime.kv_cache import KVCache

BLOCK = 16  # tokens per cached block
# The server's default budget (MiB). Qwen2.5-1.5B's KV is 56 KiB per token in fp32 (28 layers x
# 2 KV heads x 128 x K and V x 4 bytes; half that in bf16) and its features 6 KiB: this holds
# ~8k tokens of recent turns.
PREFIX_CACHE_MB = 512


@dataclass(eq=False)
class _Entry:
    key: bytes  # names the prefix up to this block's end
    k: torch.Tensor  # [L, H, BLOCK, D]
    v: torch.Tensor  # [L, H, BLOCK, D]
    hidden: torch.Tensor | None  # [BLOCK, E] the target's features (for proposers that read them), or None

    @property
    def nbytes(self) -> int:
        extra = self.hidden.nbytes if self.hidden is not None else 0
        return self.k.nbytes + self.v.nbytes + extra


@dataclass
class PrefixStats:
    """What the cache saved: prompt tokens looked up, and those whose prefill was skipped."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """KV blocks of token prefixes under a memory budget of ``budget_bytes``, LRU-evicted.
    One per target model (an engine is handed it; the server keeps one across engines)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK) -> None:
        if budget_bytes < 0 or block < 1:
            raise ValueError(f"prefix cache needs budget_bytes >= 0 and block >= 1, got {budget_bytes}, {block}")
        self.budget, self.block = budget_bytes, block
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # key -> entry, least recently used first
        self.bytes = 0
        self.stats = PrefixStats()

    @classmethod
    def of_megabytes(cls, mb: float) -> "PrefixCache | None":
        """A cache of ``mb`` MiB, or None for 0 (no prefix caching)."""
        if mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {mb}")
        return cls(int(mb * 2**20)) if mb > 0 else None

    def _keys(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The keys of the first ``blocks`` full blocks of ``tokens``."""
        keys, key = [], b""
        for i in range(blocks):
            piece = array("q", tokens[i * self.block : (i + 1) * self.block]).tobytes()
            key = hashlib.blake2b(key + piece, digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, tokens: list[int], need_hidden: bool) -> list[_Entry]:
        """The cached blocks that start ``tokens``, in order: at most ``(len(tokens) - 1) //
        block`` of them (the last token is always prefilled, for its logits). With
        ``need_hidden``, only blocks that hold the target's features count."""
        chain: list[_Entry] = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.block):
            entry = self.entries.get(key)
            if entry is None or (need_hidden and entry.hidden is None):
                break
            chain.append(entry)
        for entry in reversed(chain):  # the first blocks end up the most recent
            self.entries.move_to_end(entry.key)
        return chain

    def record(self, prompt_tokens: int, reused: int) -> None:
        """Count one request's lookup: its prompt's length and the tokens it took from here."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        self.stats.hit_tokens += reused

    def load(self, cache: KVCache, row: int, chain: list[_Entry]) -> None:
        """Write ``chain``'s K/V into the empty ``row`` of ``cache`` (its first slots)."""
        if chain:
            cache.place(row, torch.cat([e.k for e in chain], 2), torch.cat([e.v for e in chain], 2))

    @staticmethod
    def hidden_of(chain: list[_Entry]) -> torch.Tensor | None:
        """``[n, E]`` the target's features of ``chain``'s tokens (None if it is empty)."""
        return torch.cat([e.hidden for e in chain]) if chain else None

    def insert(self, tokens: list[int], cache: KVCache, row: int, hidden: torch.Tensor | None) -> None:
        """Store the full blocks of ``tokens`` whose K/V ``row`` of ``cache`` holds (its first
        ``len(tokens)`` slots, at least); ``hidden`` ``[len(tokens), E]`` or None. Blocks
        already cached are refreshed (and given their features if they lacked them)."""
        keys = self._keys(tokens, len(tokens) // self.block)
        for i, key in enumerate(keys):
            start, end = i * self.block, (i + 1) * self.block
            entry = self.entries.get(key)
            if entry is None:
                k, v = cache.read(row, start, end)
                entry = _Entry(key, k, v, None if hidden is None else hidden[start:end].clone())
                self.entries[key] = entry
                self.bytes += entry.nbytes
            elif entry.hidden is None and hidden is not None:
                entry.hidden = hidden[start:end].clone()
                self.bytes += entry.hidden.nbytes
        for key in reversed(keys):
            self.entries.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.budget and self.entries:
            _, entry = self.entries.popitem(last=False)
            self.bytes -= entry.nbytes
            self.stats.evicted_blocks += 1

    def __len__(self) -> int:
        return len(self.entries)
