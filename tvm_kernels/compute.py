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

The band-times-rows products also have a second, equivalent formulation
(``pack_rows``) in which the rows are first copied, inside the kernel, into
residue-major order (stages ``key_table``, ``packed``, ``base``), so that the
rows a query's band touches are consecutive for any dilation. A schedule module
says which formulation it expects (``COMPUTE_OPTIONS``). The CPU's Q.K^T and
probs.V kernels are written directly in TIR instead
(``tvm_kernels/schedules/cpu_tiled.py``); these definitions remain the
specification they implement.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

def accumulation_dtype(dtype: str) -> str:
    """Half types accumulate in float32; float32/float64 in themselves."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


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


# Keys packed for the band: margin of the packed rows on each side, beyond the window.
PACK_MARGIN = 64


def qk(dtype: str, autoregressive: bool) -> tirx.PrimFunc:
    """Q.K^T mode: ``out[b,i,h,j] = sum_f t1[b,i,h,f] * t2[b, i + dil[h]*(j-w), h, f]``.

    Arguments of the PrimFunc, in order: ``t1 [b,n,h,f]``, ``t2 [b,n,h,f]``,
    ``dilation [h] int32``, ``padding`` (float64 scalar), ``out [b,n,h,c]``.
    Invalid positions hold exactly ``padding``. (The CPU runs a hand-written TIR kernel of
    this same product: ``tvm_kernels/schedules/cpu_tiled.py``.)
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


def _residue_major(t2, dilation, s: _Sizes, w, offset, acc_dtype):
    """Rows of ``t2`` per head in residue-major order: for dilation d, rows r, r+d, r+2d, ...
    for r = 0..d-1, one after the other, with zero margins; ``[b, h, position, f]``. Returns the
    packed rows and ``base [h, n]``: the packed position of band column 0 of query i, whose row is
    ``i - dil*offset`` (so band column j is at ``base + j``).

    With dilation d and n keys, residue r holds ``L = ceil(n/d)`` keys if ``r < full``
    (``full = n - d*(L-1)``), else ``L - 1``; it starts at ``r*(L-1) + min(r, full)``.
    Positions are shifted by ``PACK_MARGIN + w`` so that every band, and the vector
    tail past its end, reads inside the buffer (zeros, or another residue's keys at
    positions that are invalid anyway and get the padding value).
    """
    n = s.seq_len
    margin = PACK_MARGIN + w
    width = n + 2 * margin + PACK_MARGIN

    def geometry(h):
        d = dilation[h].astype("int64")
        longest = tirx.floordiv(n + d - 1, d)
        return d, longest, n - d * (longest - 1)

    def key_at(h, p):  # inverse of position_of
        d, longest, full = geometry(h)
        in_full = p < full * longest
        rest = p - full * longest
        shorter = tirx.max(longest - 1, 1)
        r = tirx.if_then_else(in_full, tirx.floordiv(p, longest), full + tirx.floordiv(rest, shorter))
        q = tirx.if_then_else(in_full, tirx.floormod(p, longest), tirx.floormod(rest, shorter))
        return r + d * q

    def position_of(h, m):
        d, longest, full = geometry(h)
        r = tirx.floormod(m, d)
        return r * (longest - 1) + tirx.min(r, full) + tirx.floordiv(m, d)

    key_table = te.compute(
        (s.heads, width),
        lambda h, t: tirx.if_then_else(tirx.all(t >= margin, t < margin + n), key_at(h, t - margin), tirx.const(-1, "int64")),
        name="key_table",
    )
    def row(b, h, t, f):
        return tirx.if_then_else(
            key_table[h, t] >= 0, t2[b, tirx.max(key_table[h, t], 0), h, f].astype(acc_dtype), tirx.const(0, acc_dtype))

    packed = te.compute((s.batch, s.heads, width, s.head_dim), row, name="packed")
    base = te.compute((s.heads, n), lambda h, i: position_of(h, i) + margin - offset, name="base")
    return packed, base


def _band_times_rows(dtype: str, autoregressive: bool, transposed: bool, pack_rows: bool) -> tirx.PrimFunc:
    s = _Sizes.symbolic()
    acc_dtype = accumulation_dtype(dtype)
    w, w_upper = _one_sided_windows(s.band, autoregressive)
    band = te.placeholder((s.batch, s.seq_len, s.heads, s.band), dtype, name="t1")
    rows = te.placeholder((s.batch, s.seq_len, s.heads, s.head_dim), dtype, name="t2")
    dilation = te.placeholder((s.heads,), "int32", name="dilation")
    j = te.reduce_axis((0, s.band), name="j")
    if pack_rows:  # row of band column j at packed position base[h, i] + j, for any dilation
        packed, base = _residue_major(rows, dilation, s, w, w_upper if transposed else w, acc_dtype)

    def term(b, i, h, f):
        d = dilation[h].astype("int64")
        if transposed:
            # dK / dV: row p = i + d*(j - w_upper) used band column (w + w_upper) - j to reach i.
            p = i + d * (j - w_upper)
            band_value = band[b, _clamp(p, s.seq_len), h, (w + w_upper) - j]
        else:
            p = i + d * (j - w)
            band_value = band[b, i, h, j]
        if pack_rows:
            row_value = packed[b, h, base[h, i] + j, f]
        else:
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


def pv(dtype: str, autoregressive: bool, pack_rows: bool = False) -> tirx.PrimFunc:
    """probs.V mode: ``out[b,i,h,f] = sum_j t1[b,i,h,j] * t2[b, i + dil[h]*(j-w), h, f]`` over valid j.

    Arguments: ``t1 [b,n,h,c]`` (the band), ``t2 [b,n,h,f]``, ``dilation [h] int32``,
    ``out [b,n,h,f]``. ``pack_rows``: read ``t2`` packed residue-major (see :func:`qk`), so the
    rows of a query's band are consecutive.
    """
    return _band_times_rows(dtype, autoregressive, transposed=False, pack_rows=pack_rows)


def transposed(dtype: str, autoregressive: bool, pack_rows: bool = False) -> tirx.PrimFunc:
    """Transposed mode (backward): ``out[b,i,h,f] = sum_j t1[b,p,h,(w+w_upper)-j] * t2[b,p,h,f]``,
    ``p = i + dil[h]*(j - w_upper)``, over valid p.

    It is the adjoint of both other modes with respect to their second input:
    for ``S = qk(Q, K)``, ``dK = transposed(dS, Q)``; for ``O = pv(P, V)``,
    ``dV = transposed(P, dO)``. Arguments as for :func:`pv`.
    """
    return _band_times_rows(dtype, autoregressive, transposed=True, pack_rows=pack_rows)


DEFINITIONS = {"qk": qk, "pv": pv, "transposed": transposed}
