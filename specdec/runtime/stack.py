"""A llama model's decoder layers in one C++ call (``kernels/stack.cpp``).

With 4-bit weights and fp32 activations a layer is seven kernel calls and two additions
(:meth:`specdec.runtime.model.Block._forward_fused`); from Python each costs a few microseconds of
interpreter and dispatch, ~9 x 24 of them in a draft model's step. The stack runs the same kernels
in the same order from C++ — the same bits (tested) — so that a step is the weights' bytes and
little else. Used where every layer is fused and every linear is a :class:`~specdec.runtime.q4.Q4Linear`
whose output needs no trimming; anything else runs the per-layer path.
"""

from __future__ import annotations

from specdec.runtime import native, q4


def kernel():
    """The compiled module (the q4, attention and elementwise kernels' sources, built together)."""
    return native.kernel("stack")


def eligible(blocks) -> bool:
    """Whether :func:`build` can run these blocks (fused llama blocks over whole q4 tiles)."""
    return len(blocks) > 0 and q4.available() and all(
        block.fused and all(isinstance(lin, q4.Q4Linear) and lin.packed.shape[0] * q4.TILE == lin.out_features
                            for lin in (block.qkv, block.o, block.gate_up, block.down))
        and block.gate_up.bias.numel() == 0 and block.down.bias.numel() == 0  # the MLP has no biases
        for block in blocks)


def build(blocks, eps: float, scale: float, heads: int):
    """A ``Stack`` over ``blocks`` (each :func:`eligible`); its ``forward(x, k, v, cos, sin,
    slots, lo, hi, extra_ptr, extra)`` is the blocks' loop (see kernels/stack.cpp)."""
    parts = [[b.norms["input_layernorm"], b.qkv.packed, b.qkv.bias, b.o.packed, b.o.bias,
              b.norms["post_attention_layernorm"], b.gate_up.packed, b.down.packed] for b in blocks]
    return kernel().Stack(parts, eps, scale, heads)
