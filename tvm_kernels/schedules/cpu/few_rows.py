"""Products of a few rows with a matrix on the CPU, ``a @ b`` and ``a @ b^T``, half types widened in
registers: a generation step's attention products (one query row against the key and value cache).

Why a kernel: on CPUs without half-type arithmetic, torch's bfloat16 matrix products are loops
(dense.py), and widening the cache to float32 for torch's float32 product costs more than the
product: LED's decoder at n = 4096 (12 heads x 64) spent 1.3-1.5 ms per cross-attention product
widening 4096 keys a head for a 0.3 ms product, each of 12 products a step, every step (bench/NOTES.md).
Here each element is read once in its own dtype and widened in a register, so a half-type cache
costs half float32's memory traffic, not three times it.

Both are memory-bound: the matrix streams through once per row of ``a`` (a few rows, a block of the
matrix that stays in L1 or L2 between them). Sums in the accumulation dtype, rounded once.
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu.microkernels import _BITS, _ON_STACK, _add_lanes, _staging, _store_rounded
from tvm_kernels.schedules.cpu.tiles import accumulation_lanes

# a @ b^T: keys per parallel task (a block of 256 keys of 64 features is 32 KiB in a half type), and
# dot products computed side by side, so that their FMA chains hide each other's latency.
_KEY_BLOCK = 256
_DOTS_AT_ONCE = 8
# a @ b: the columns a task accumulates in registers (one 64-feature head's output row), at most
# this many vectors of them (AVX2 has 16 registers: 8 sums and their 8 loads).
_COLUMN_BLOCK = 64
_MAX_COLUMN_VECTORS = 8


def _element_bytes(dtype: str) -> int:
    # Buffers aligned to their element only (see gelu.bias_gelu): a view may start anywhere.
    return _BITS[dtype] // 8


def few_rows_mm_nt(dtype: str, isa: str):
    """``out[b * rows + r, j] = sum_k a[b, r, k] * bt[b, j, k]`` (``a @ bt^T`` per batch element).
    Arguments: a ``[batch, rows, depth]``, bt ``[batch, cols, depth]``, out ``[batch * rows, cols]``."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    align = _element_bytes(dtype)

    @T.macro
    def dots(a, bt, out, b, r, first, count, vectors, depth, rows, partial, total, staged):
        """out[b * rows + r, first : first + count] (count a Python int), each dot product's lanes
        summed in lane order after its vectors, then the features past the last whole vector."""
        for u in T.unroll(count):
            for lane in T.vectorized(lanes):
                partial[u, lane] = T.Cast(acc_dtype, 0)
        for vector in range(vectors):
            for u in T.unroll(count):
                for lane in T.vectorized(lanes):
                    partial[u, lane] = partial[u, lane] + T.Cast(
                        acc_dtype, a[b, r, vector * T.int64(lanes) + lane]
                    ) * T.Cast(acc_dtype, bt[b, first + T.int64(u), vector * T.int64(lanes) + lane])
        for u in T.unroll(count):
            total[u] = T.Cast(acc_dtype, 0)
            _add_lanes(total, partial, lanes, at=u, row=u)
            for k in range(vectors * T.int64(lanes), depth):
                total[u] = total[u] + T.Cast(acc_dtype, a[b, r, k]) * T.Cast(acc_dtype, bt[b, first + T.int64(u), k])
            _store_rounded(dtype, out, b * rows + r, first + T.int64(u), total[u], staged, u)

    @T.prim_func
    def main(a_handle: T.handle, bt_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        rows = T.int64()
        depth = T.int64()
        cols = T.int64()
        out_rows = T.int64()
        a = T.match_buffer(a_handle, (batch, rows, depth), dtype, align=align)
        bt = T.match_buffer(bt_handle, (batch, cols, depth), dtype, align=align)
        out = T.match_buffer(out_handle, (out_rows, cols), dtype, align=align)
        blocks = (cols + T.int64(_KEY_BLOCK - 1)) // T.int64(_KEY_BLOCK)
        vectors = depth // T.int64(lanes)
        for task in T.parallel(batch * blocks):
            partial = T.alloc_local((_DOTS_AT_ONCE, lanes), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((_DOTS_AT_ONCE,), acc_dtype, annotations=_ON_STACK)
            staged = _staging(dtype, lanes, acc_dtype)
            b: T.let = task // blocks
            first: T.let = task % blocks * T.int64(_KEY_BLOCK)
            size: T.let = T.min(cols - first, T.int64(_KEY_BLOCK))
            for group in range(size // T.int64(_DOTS_AT_ONCE)):
                for r in range(rows):  # (the group's keys stay in L1 for every row)
                    dots(
                        a,
                        bt,
                        out,
                        b,
                        r,
                        first + group * T.int64(_DOTS_AT_ONCE),
                        _DOTS_AT_ONCE,
                        vectors,
                        depth,
                        rows,
                        partial,
                        total,
                        staged,
                    )
            for j in range(size // T.int64(_DOTS_AT_ONCE) * T.int64(_DOTS_AT_ONCE), size):
                for r in range(rows):
                    dots(a, bt, out, b, r, first + j, 1, vectors, depth, rows, partial, total, staged)

    return main


def few_rows_mm(dtype: str, isa: str):
    """``out[b * rows + r, c] = sum_j a[b, r, j] * m[b, j, c]`` (``a @ m`` per batch element).
    Arguments: a ``[batch, rows, inner]``, m ``[batch, inner, cols]``, out ``[batch * rows, cols]``."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    align = _element_bytes(dtype)
    column_vectors = max(1, min(_MAX_COLUMN_VECTORS, _COLUMN_BLOCK // lanes))
    width = column_vectors * lanes

    @T.prim_func
    def main(a_handle: T.handle, m_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        rows = T.int64()
        inner = T.int64()
        cols = T.int64()
        out_rows = T.int64()
        a = T.match_buffer(a_handle, (batch, rows, inner), dtype, align=align)
        m = T.match_buffer(m_handle, (batch, inner, cols), dtype, align=align)
        out = T.match_buffer(out_handle, (out_rows, cols), dtype, align=align)
        blocks = (cols + T.int64(width - 1)) // T.int64(width)
        for task in T.parallel(batch * blocks):
            acc = T.alloc_local((column_vectors, lanes), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            staged = _staging(dtype, lanes, acc_dtype)
            b: T.let = task // blocks
            first: T.let = task % blocks * T.int64(width)
            for r in range(rows):
                if first + T.int64(width) <= cols:
                    for v in T.unroll(column_vectors):
                        for lane in T.vectorized(lanes):
                            acc[v, lane] = T.Cast(acc_dtype, 0)
                    for j in range(inner):
                        # (a[b, r, j] widened in the expression: a bfloat16 value bound by T.let is
                        # widened as its integer bits, TVM 0.27's legalisation.)
                        for v in T.unroll(column_vectors):
                            for lane in T.vectorized(lanes):
                                acc[v, lane] = acc[v, lane] + T.Cast(acc_dtype, a[b, r, j]) * T.Cast(
                                    acc_dtype, m[b, j, first + T.int64(v * lanes) + lane]
                                )
                    for v in T.unroll(column_vectors):
                        for lane in T.vectorized(lanes):
                            _store_rounded(
                                dtype, out, b * rows + r, first + T.int64(v * lanes) + lane, acc[v, lane], staged, lane
                            )
                else:  # the last columns, fewer than a block: a vector at a time, then one at a time
                    for v in range((cols - first) // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            acc[0, lane] = T.Cast(acc_dtype, 0)
                        for j in range(inner):
                            for lane in T.vectorized(lanes):
                                acc[0, lane] = acc[0, lane] + T.Cast(acc_dtype, a[b, r, j]) * T.Cast(
                                    acc_dtype, m[b, j, first + v * T.int64(lanes) + lane]
                                )
                        for lane in T.vectorized(lanes):
                            _store_rounded(
                                dtype, out, b * rows + r, first + v * T.int64(lanes) + lane, acc[0, lane], staged, lane
                            )
                    for c in range(first + (cols - first) // T.int64(lanes) * T.int64(lanes), cols):
                        total[0] = T.Cast(acc_dtype, 0)
                        for j in range(inner):
                            total[0] = total[0] + T.Cast(acc_dtype, a[b, r, j]) * T.Cast(acc_dtype, m[b, j, c])
                        _store_rounded(dtype, out, b * rows + r, c, total[0], staged, 0)

    return main
