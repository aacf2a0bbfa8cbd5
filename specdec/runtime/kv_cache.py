"""The KV cache: the ONLY owner of cache positions in specdec.

Preallocated per layer, indexed by slot (gpt-fast style), with a per-row length. A forward call
appends a block of ``T`` slots at each row's length; ``truncate`` rolls back in O(1) by lowering
lengths — stale slots past a row's length are never attended to (the model's mask only admits
committed slots and the current block), and they are overwritten by the next block.

Layout: ``k[layer]`` and ``v[layer]`` are ``[B, H_kv, capacity, D]``: views of the first ``B``
rows of a storage that may hold more. Rows join (:meth:`append_rows`, continuous batching) and
leave (:meth:`retain`, compacted in place) without reallocating once the storage has grown to
the largest batch seen, so memory stays bounded by that batch.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch < 0 or capacity < 1:
            raise ValueError("KVCache needs batch >= 0 and capacity >= 1")
        self.capacity = capacity
        shape = (num_layers, max(batch, 1), num_kv_heads, capacity, head_dim)
        self._k = torch.zeros(shape, dtype=dtype)  # storage: [L, rows, H, capacity, D]
        self._v = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [B] committed + appended slots per row

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, : self.batch]  # [L, B, H, capacity, D] (a view)

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, : self.batch]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def block_slots(self, block_len: int) -> torch.Tensor:
        """``[B, T]`` the slots a block of ``block_len`` new tokens will occupy in each row."""
        slots = self.lengths.unsqueeze(1) + torch.arange(block_len).unsqueeze(0)
        if slots.numel() and int(slots.max()) >= self.capacity:
            raise ValueError(
                f"KV cache overflow: a row would reach {int(slots.max()) + 1} slots, capacity is {self.capacity}"
            )
        return slots

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, ``[B, H, capacity, D]`` each (views). A forward writes
        its block into them at :meth:`block_slots` — through :meth:`write`, or inside the fused
        attention kernel (``attention.attend_block``); the slots are always this cache's."""
        return self._k[layer, : self.batch], self._v[layer, : self.batch]

    def common_start(self, slots: torch.Tensor) -> int | None:
        """The first slot of a block ``slots`` ``[B, T]`` when every row writes at the same one
        (the common case: one contiguous copy per layer), else None. Once per forward call."""
        start = slots[:, 0]
        return int(start[0]) if bool((start == start[0]).all()) else None

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
              common_start: int | None) -> None:
        """Store ``k_new``/``v_new`` ``[B, H, T, D]`` at ``slots`` ``[B, T]`` of ``layer``;
        ``common_start`` is :meth:`common_start` of ``slots``."""
        k, v = self.layer(layer)  # [B, H, capacity, D]
        k_new, v_new = k_new.to(k.dtype), v_new.to(v.dtype)  # rounded to the cache's dtype (ties to even)
        if common_start is not None:
            t = slots.shape[1]
            k[:, :, common_start : common_start + t] = k_new
            v[:, :, common_start : common_start + t] = v_new
            return
        rows = torch.arange(self.batch).unsqueeze(1)  # [B, 1]
        k[rows, :, slots] = k_new.transpose(1, 2)  # index result is [B, T, H, D]
        v[rows, :, slots] = v_new.transpose(1, 2)

    def read(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``row``'s K and V at slots ``start .. end``, ``[L, H, end - start, D]`` each
        (a prefix cache's block: :mod:`specdec.core.prefix_cache`)."""
        if not 0 <= start <= end <= int(self.lengths[row]):
            raise ValueError(f"read({row}, {start}, {end}): row {row} holds {int(self.lengths[row])} slots")
        return self._k[:, row, :, start:end].clone(), self._v[:, row, :, start:end].clone()

    def place(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append K/V ``[L, H, n, D]`` computed elsewhere (a cached prefix) to ``row``."""
        start, n = int(self.lengths[row]), k.shape[2]
        if start + n > self.capacity:
            raise ValueError(f"KV cache overflow: row {row} would reach {start + n} slots, capacity is {self.capacity}")
        self._k[:, row, :, start : start + n] = k
        self._v[:, row, :, start : start + n] = v
        lengths = self.lengths.clone()
        lengths[row] += n
        self.lengths = lengths

    def advance(self, counts: torch.Tensor | int) -> None:
        """Mark ``counts`` (per row or for all rows) more slots as written."""
        self.lengths = self.lengths + counts

    def truncate(self, lengths: torch.Tensor | int) -> None:
        """Roll back to ``lengths`` (per row, or one int for all rows) in O(1): no data moves."""
        new = torch.as_tensor(lengths, dtype=torch.long).expand(self.batch).clone()
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"truncate({new.tolist()}) must be between 0 and the current lengths {self.lengths.tolist()}")
        self.lengths = new

    def keep_path(self, before: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a tree block ``[root, node_0 .. node_{N-1}]`` written at slots ``before ..
        before + N`` (per row), keep the root and the accepted nodes only: node ``path[b, j]``'s
        K/V moves to slot ``before + 1 + j``, and the row's length becomes ``before + 1 +
        num_accepted``. O(accepted) copies; a path-shaped acceptance (node j at depth j) moves
        nothing. ``path`` ``[B, D]`` is -1 padded."""
        steps = torch.arange(path.shape[1]).unsqueeze(0)  # [1, D]
        src = before.unsqueeze(1) + 1 + path  # [B, D] slots of the accepted nodes
        dst = before.unsqueeze(1) + 1 + steps
        moved = (steps < num_accepted.unsqueeze(1)) & (path >= 0) & (src != dst)
        if bool(moved.any()):
            b, j = torch.nonzero(moved, as_tuple=True)
            # reads complete before writes: an accepted node never moves to a slot that a later
            # accepted node is read from (dst < src along the path, both increasing)
            self.k[:, b, :, dst[b, j]] = self.k[:, b, :, src[b, j]]
            self.v[:, b, :, dst[b, j]] = self.v[:, b, :, src[b, j]]
        self.truncate(before + 1 + num_accepted)

    def append_rows(self, n: int) -> "KVCache":
        """Add ``n`` empty rows at the end of the batch (growing the storage if it is full) and
        return a cache over just those rows that shares this one's storage: a forward call on it
        (e.g. the prefill of joining requests) fills them in place; then :meth:`set_lengths`."""
        start, end = self.batch, self.batch + n
        if end > self._k.shape[1]:  # grow to exactly the rows needed, copying only written slots
            used = int(self.lengths.max()) if start else 0
            shape = list(self._k.shape)
            shape[1] = end
            k, v = self._k.new_zeros(shape), self._v.new_zeros(shape)
            k[:, :start, :, :used] = self._k[:, :start, :, :used]
            v[:, :start, :, :used] = self._v[:, :start, :, :used]
            self._k, self._v = k, v
        self.lengths = torch.cat([self.lengths, torch.zeros(n, dtype=torch.long)])
        return self.view(start, end)

    def view(self, start: int, end: int) -> "KVCache":
        """A cache over rows ``start .. end`` of this one, sharing its storage (a forward call on
        it writes them in place; then :meth:`set_lengths` here)."""
        view = KVCache.__new__(KVCache)
        view.capacity = self.capacity
        view._k, view._v = self._k[:, start:end], self._v[:, start:end]
        view.lengths = self.lengths[start:end].clone()
        return view

    def set_lengths(self, start: int, lengths: torch.Tensor) -> None:
        """Rows ``start ..`` now hold ``lengths`` slots (after filling a view of them)."""
        new = self.lengths.clone()
        new[start : start + lengths.shape[0]] = lengths
        self.lengths = new

    def reorder(self, start: int, order: list[int]) -> None:
        """Rows ``start ..`` take rows ``start + order[j]`` in turn (a permutation of the rows
        from ``start`` on), copying only the written slots of the rows that move."""
        moved = [(start + j, start + s) for j, s in enumerate(order) if s != j]
        if not moved:
            return
        saved = [(dst, self.read(src, 0, int(self.lengths[src]))) for dst, src in moved]  # (copies)
        for dst, (k, v) in saved:
            self._k[:, dst, :, : k.shape[2]] = k
            self._v[:, dst, :, : v.shape[2]] = v
        lengths = self.lengths.clone()
        lengths[start : start + len(order)] = self.lengths[start + torch.tensor(order, dtype=torch.long)]
        self.lengths = lengths

    def retain(self, order: list[int]) -> None:
        """Keep the rows ``order`` (current positions), in that order, compacting in place. When
        ``order`` is increasing (rows that leave, the others keeping their order) each moved row
        goes to a lower index and only its written slots are copied, in ascending order: a row is
        read before any write reaches its index. Otherwise the kept rows are gathered."""
        n, index = len(order), torch.as_tensor(order, dtype=torch.long)
        increasing = all(a < b for a, b in zip(order, order[1:]))
        moved = sum(s != j for j, s in enumerate(order)) if increasing else n
        if increasing and moved <= 16:  # a few rows move (the server): each one's written slots
            for j, s in enumerate(order):
                if s != j:
                    used = int(self.lengths[s])
                    self._k[:, j, :, :used] = self._k[:, s, :, :used]
                    self._v[:, j, :, :used] = self._v[:, s, :, :used]
        elif moved:  # many rows (a large batch finishing): one gather of the written slots
            used = int(self.lengths[index].max())
            self._k[:, :n, :, :used] = self._k[:, index, :, :used]
            self._v[:, :n, :, :used] = self._v[:, index, :, :used]
        self.lengths = self.lengths[index].clone()
