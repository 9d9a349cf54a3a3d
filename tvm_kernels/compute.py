"""The math of Longformer's banded products, as TVM tensor expressions.

This module says *what* is computed and nothing about *how*: schedules live in
``tvm_kernels/schedules/`` (one module per target) and take the PrimFuncs built
here.

Layout is ``[batch, seq, heads, features]`` everywhere. ``w`` is the one-sided
window; the band holds ``c = w + w_upper + 1`` diagonals, with ``w_upper = w``
(symmetric) or ``0`` (autoregressive: keys only to the left and self). Column
``w`` of the band is the token itself. Key position of band column ``j`` for
query ``i`` in head ``h`` is ``i + dil[h] * (j - w)``; positions outside
``[0, n)`` are invalid.

Every size (batch, seq_len, heads, head_dim, band) is a symbolic variable, so
one compiled function serves every length and every per-layer window. The
window is not an argument of its own: it is implied by the band width
``c`` of the band tensor (``w = (c - 1) // 2``, or ``c - 1`` when
autoregressive), which is why symmetric and autoregressive are separate
variants. Index arithmetic is 64-bit (``index_dtype_override="int64"``), so
``batch * seq * heads * band`` may exceed 2**31.

Half types (float16, bfloat16) accumulate in float32; every product ends in two
stages: ``acc`` (the reduction, in the accumulation dtype) and ``out`` (the
cast, and for Q.K^T the padding value at invalid positions). Keeping the
condition out of the reduction is what TE requires, and it lets schedules
fuse the two stages freely.

The CPU and CUDA kernels are written directly in TIR instead (``tvm_kernels/schedules/``):
these definitions are the specification they implement (and what a target without
hand-written kernels would schedule). The CPU's fused local-attention kernels compose them (Q.K^T, a softmax over the
band, probs.V; their backward likewise); their reference is
``longformer_ops.ops.reference.sliding_window_attention_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx
from tvm.script import tirx as T


def is_half(dtype: str) -> bool:
    """float16 and bfloat16: accumulated in float32, results rounded to the half type."""
    return dtype in ("float16", "bfloat16")


def accumulation_dtype(dtype: str) -> str:
    """Half types accumulate in float32; float32/float64 in themselves."""
    return "float32" if is_half(dtype) else dtype


@dataclass(frozen=True)
class _Sizes:
    batch: tirx.Var
    seq_len: tirx.Var
    heads: tirx.Var
    head_dim: tirx.Var
    band: tirx.Var

    @staticmethod
    def symbolic() -> "_Sizes":
        return _Sizes(*(te.var(name, "int64") for name in ("batch", "seq_len", "heads", "head_dim", "band")))


def _one_sided_windows(band, autoregressive: bool):
    """(w, w_upper) implied by the band width c = w + w_upper + 1."""
    if autoregressive:
        return band - 1, tirx.const(0, "int64")
    w = tirx.floordiv(band - 1, 2)
    return w, w


def _valid(position, seq_len):
    return tirx.all(position >= 0, position < seq_len)


def _clamp(position, seq_len):
    # Reads at invalid positions are discarded by the caller; clamping keeps the
    # read inside the tensor without a branch in the innermost loop.
    return tirx.max(tirx.min(position, seq_len - 1), 0)


def qk(dtype: str, autoregressive: bool) -> tirx.PrimFunc:
    """Q.K^T mode: ``out[b,i,h,j] = sum_f t1[b,i,h,f] * t2[b, i + dil[h]*(j-w), h, f]``.

    Arguments of the PrimFunc, in order: ``t1 [b,n,h,f]``, ``t2 [b,n,h,f]``,
    ``dilation [h] int32``, ``padding`` (float64 scalar), ``out [b,n,h,c]``.
    Invalid positions hold exactly ``padding``.
    """
    s = _Sizes.symbolic()
    acc_dtype = accumulation_dtype(dtype)
    w, _ = _one_sided_windows(s.band, autoregressive)
    t1 = te.placeholder((s.batch, s.seq_len, s.heads, s.head_dim), dtype, name="t1")
    t2 = te.placeholder((s.batch, s.seq_len, s.heads, s.head_dim), dtype, name="t2")
    dilation = te.placeholder((s.heads,), "int32", name="dilation")
    padding = te.var("padding", "float64")
    f = te.reduce_axis((0, s.head_dim), name="f")

    def key(i, h, j):
        return i + dilation[h].astype("int64") * (j - w)

    acc = te.compute(
        (s.batch, s.seq_len, s.heads, s.band),
        lambda b, i, h, j: te.sum(
            t1[b, i, h, f].astype(acc_dtype) * t2[b, _clamp(key(i, h, j), s.seq_len), h, f].astype(acc_dtype),
            axis=f,
        ),
        name="acc",
    )
    out = te.compute(
        (s.batch, s.seq_len, s.heads, s.band),
        lambda b, i, h, j: tirx.if_then_else(
            _valid(key(i, h, j), s.seq_len), acc[b, i, h, j].astype(dtype), padding.astype(dtype)
        ),
        name="out",
    )
    return te.create_prim_func([t1, t2, dilation, padding, out], index_dtype_override="int64")


def _band_times_rows(dtype: str, autoregressive: bool, transposed: bool) -> tirx.PrimFunc:
    s = _Sizes.symbolic()
    acc_dtype = accumulation_dtype(dtype)
    w, w_upper = _one_sided_windows(s.band, autoregressive)
    band = te.placeholder((s.batch, s.seq_len, s.heads, s.band), dtype, name="t1")
    rows = te.placeholder((s.batch, s.seq_len, s.heads, s.head_dim), dtype, name="t2")
    dilation = te.placeholder((s.heads,), "int32", name="dilation")
    j = te.reduce_axis((0, s.band), name="j")

    def term(b, i, h, f):
        d = dilation[h].astype("int64")
        if transposed:
            # dK / dV: row p = i + d*(j - w_upper) used band column (w + w_upper) - j to reach i.
            p = i + d * (j - w_upper)
            band_value = band[b, _clamp(p, s.seq_len), h, (w + w_upper) - j]
        else:
            p = i + d * (j - w)
            band_value = band[b, i, h, j]
        row_value = rows[b, _clamp(p, s.seq_len), h, f].astype(acc_dtype)
        product = band_value.astype(acc_dtype) * row_value
        return tirx.if_then_else(_valid(p, s.seq_len), product, tirx.const(0, acc_dtype))

    acc = te.compute(
        (s.batch, s.seq_len, s.heads, s.head_dim),
        lambda b, i, h, f: te.sum(term(b, i, h, f), axis=j),
        name="acc",
    )
    out = te.compute(acc.shape, lambda *idx: acc[idx].astype(dtype), name="out")
    return te.create_prim_func([band, rows, dilation, out], index_dtype_override="int64")


def pv(dtype: str, autoregressive: bool) -> tirx.PrimFunc:
    """probs.V mode: ``out[b,i,h,f] = sum_j t1[b,i,h,j] * t2[b, i + dil[h]*(j-w), h, f]`` over valid j.

    Arguments: ``t1 [b,n,h,c]`` (the band), ``t2 [b,n,h,f]``, ``dilation [h] int32``,
    ``out [b,n,h,f]``.
    """
    return _band_times_rows(dtype, autoregressive, transposed=False)


def transposed(dtype: str, autoregressive: bool) -> tirx.PrimFunc:
    """Transposed mode (backward): ``out[b,i,h,f] = sum_j t1[b,p,h,(w+w_upper)-j] * t2[b,p,h,f]``,
    ``p = i + dil[h]*(j - w_upper)``, over valid p.

    It is the adjoint of both other modes with respect to their second input:
    for ``S = qk(Q, K)``, ``dK = transposed(dS, Q)``; for ``O = pv(P, V)``,
    ``dV = transposed(P, dO)``. Arguments as for :func:`pv`.
    """
    return _band_times_rows(dtype, autoregressive, transposed=True)


# Attention dropout without generator state, so that the backward regenerates the forward's mask:
# each row's key is murmur3's 32-bit finaliser chained over (seed, batch * heads + head, query row);
# band column j of that row is kept when the top 24 bits of mix(key + j * golden) are >= p * 2^24.
# longformer_ops.ops.reference.dropout_factor_reference computes the same mask in PyTorch. Here, with
# the math, because every target's fused kernels must draw the same mask.
_GOLDEN = 0x9E3779B9


def _mix32(x, bind: bool):
    """murmur3's fmix32 of a uint32 expression (a plain Python helper building the expression).
    ``bind``: each step's value is bound to a variable (a ``Let``) instead of repeated where the next
    step uses it twice: C source prints an expression as a tree, and three chained finalisers
    repeated that way grow by 8^3 (CUDA lines of 240,000 characters); LLVM sees the same DAG either way."""

    def step(value, rest):
        if not bind:
            return rest(value)
        var = tirx.Var("mixed", "uint32")
        return tirx.Let(var, value, rest(var))

    return step(
        x,
        lambda x: step(
            (x ^ T.shift_right(x, T.uint32(16))) * T.uint32(0x85EBCA6B),
            lambda y: step(
                (y ^ T.shift_right(y, T.uint32(13))) * T.uint32(0xC2B2AE35),
                lambda z: z ^ T.shift_right(z, T.uint32(16)),
            ),
        ),
    )


def dropout_row_key(seed, bh, row, bind: bool = False):
    """The dropout key of one row (``bind``: see :func:`_mix32`). The int64 seed's low 32 bits seed
    the mask; its high 32 bits are added to the row: a call on a shard of a longer sequence whose
    first row is row ``o`` of the whole passes ``seed + (o << 32)`` and gets the whole sequence's
    mask for its rows (sequence parallelism, ``longformer_ops.distributed``)."""
    row_of_whole = T.Cast("uint32", row) + T.Cast("uint32", T.shift_right(seed, T.int64(32)))
    return _mix32(
        T.Cast("uint32", seed) ^ _mix32(T.Cast("uint32", bh) * T.uint32(_GOLDEN) ^ _mix32(row_of_whole, bind), bind),
        bind,
    )


def dropout_factor(key, column, dropout, acc_dtype, bind: bool = False):
    """1 / (1 - p) if band column ``column`` of the row with ``key`` is kept, else 0."""
    return dropout_factor_of(key + column_step(column), dropout, acc_dtype, bind)


def column_step(column):
    """Band column ``column``'s term of the hash input, ``column * golden`` (uint32)."""
    return T.Cast("uint32", column) * T.uint32(_GOLDEN)


def dropout_factor_of(hashed, dropout, acc_dtype, bind: bool = False):
    """:func:`dropout_factor` from its hash input ``key + column_step(column)`` (a kernel may sum
    that its own way: e.g. a vector of 16 columns as one scalar plus a constant vector)."""
    bits = T.shift_right(_mix32(hashed, bind), T.uint32(8))
    return T.Select(
        bits >= T.Cast("uint32", dropout * T.float64(1 << 24)),
        T.Cast(acc_dtype, T.float64(1) / (T.float64(1) - dropout)),
        T.Cast(acc_dtype, 0),
    )


DEFINITIONS = {"qk": qk, "pv": pv, "transposed": transposed}
