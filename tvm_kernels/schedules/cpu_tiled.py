"""Hand-written TIR for the CPU's Q.K^T band: GEMM-like register tiles for any dilation.

Why not a TE schedule: the fast loop nest runs over *residue classes* whose size
depends on each head's runtime dilation, computes a dense tile wider than the
band and stores it skewed into the band layout. Schedule primitives cannot
reorder a TE output that way (see bench/NOTES.md), so this kernel is written
directly in TIR (TVMScript). It computes exactly :func:`tvm_kernels.compute.qk`
and is tested against the same plain references as every other kernel.

Per (batch, head), in parallel:

1. Pack the keys residue-major (dilation d: keys r, r+d, r+2d, ... for r = 0..d-1)
   into blocks of ``cols`` consecutive packed keys, transposed so that for a fixed
   feature the block's keys are one contiguous vector run. In packed order every
   query's band is a run of consecutive keys, for any dilation: dilation d is d
   interleaved undilated problems laid end to end.
2. For each tile of ``rows`` consecutive packed queries, multiply it against every
   key block its bands touch: a ``rows x cols`` register tile, per feature one
   broadcast per row and one load per vector (an 8 x 32 GEMM micro-kernel on
   AVX-512). Each block result is stored, skewed by the row's offset, into a small
   per-tile row buffer, so that row r's band starts at the same column.
3. Copy each row's band into the output row of its query, writing ``padding``
   where the key lies outside the sequence (two bounds per row, no division per
   column).

No head_dim constraint: the feature loop is the reduction, one FMA step per
feature. Scratch per (batch, head): the packed keys (about the size of one
head's K) and the row buffer; accumulators live in registers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype

# Keep small per-tile buffers on the stack (LLVM promotes them to registers).
# TVM otherwise lowers every allocation inside a parallel loop to a heap workspace
# call; the annotation survives only if StorageRewrite is off (see PASS_CONFIG in cpu.py).
_ON_STACK = {"disable_lower_builtin": True}


@T.macro
def _fill_residue_major(row_of, n, d):
    """row_of[p] = the sequence row at packed position p: rows r, r+d, r+2d, ... for r = 0..d-1."""
    start = T.alloc_local((1,), "int64", annotations=_ON_STACK)
    start[0] = T.int64(0)
    for residue in range(T.min(d, n)):
        for step in range((n - residue + d - T.int64(1)) // d):
            row_of[start[0] + step] = residue + d * step
        start[0] = start[0] + (n - residue + d - T.int64(1)) // d


def qk(dtype: str, autoregressive: bool, vector_bits: int):
    """The Q.K^T PrimFunc; same arguments as :func:`tvm_kernels.compute.qk`."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    rows = 8 if vector_bits >= 512 else 6   # rows x 2 vectors of accumulators + operands fit the register file
    cols = 2 * lanes                        # keys per packed block = one register tile's width
    slack = rows + cols                     # row buffer margin on each side of the band
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, padding: T.float64,
             out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, head_dim), dtype)
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, band), dtype)
        # One-sided window: band = 2w + 1 (symmetric) or w + 1 (autoregressive).
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        margin: T.let = w + T.int64(cols)  # packed columns before the first key
        for bh in T.parallel(batch * heads):
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            # Buffer shapes cannot name let-bound values (TVM 0.27), hence the repeated expressions.
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer(
                ((n + T.int64(2 * cols) + band + T.int64(rows + 2 * cols)) // T.int64(cols) + T.int64(1),
                 head_dim, T.int64(cols)), acc_dtype)
            row_buffer = T.decl_buffer((T.int64(rows), band + T.int64(2 * slack)), acc_dtype)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            acc_lo = T.alloc_local((rows, lanes), acc_dtype, annotations=_ON_STACK)
            acc_hi = T.alloc_local((rows, lanes), acc_dtype, annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            for block in range((n + T.int64(2 * cols) + band + T.int64(rows + 2 * cols)) // T.int64(cols) + T.int64(1)):
                for lane in range(T.int64(cols)):
                    p: T.let = block * T.int64(cols) + lane - margin  # packed position
                    if p >= T.int64(0) and p < n:
                        for f in range(head_dim):
                            packed[block, f, lane] = T.Cast(acc_dtype, t2[b, row_of[p], h, f])
                    else:
                        for f in range(head_dim):
                            packed[block, f, lane] = T.Cast(acc_dtype, 0)
            for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
                p0: T.let = tile * T.int64(rows)
                for r in T.unroll(rows):
                    query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
                first: T.let = p0 - w + margin  # packed column of row 0's band column 0
                for block in range(first // T.int64(cols), (first + T.int64(rows - 2) + band) // T.int64(cols) + T.int64(1)):
                    for r in T.unroll(rows):
                        for lane in T.vectorized(lanes):
                            acc_lo[r, lane] = T.Cast(acc_dtype, 0)
                            acc_hi[r, lane] = T.Cast(acc_dtype, 0)
                    for f in range(head_dim):
                        for r in T.unroll(rows):
                            for lane in T.vectorized(lanes):
                                acc_lo[r, lane] = acc_lo[r, lane] + T.Cast(acc_dtype, t1[b, query[r], h, f]) * packed[block, f, lane]
                                acc_hi[r, lane] = acc_hi[r, lane] + T.Cast(acc_dtype, t1[b, query[r], h, f]) * packed[block, f, T.int64(lanes) + lane]
                    for r in T.unroll(rows):
                        for lane in T.vectorized(lanes):
                            # Row r's band column j is packed column first + r + j.
                            row_buffer[r, block * T.int64(cols) - first - T.int64(r) + T.int64(slack) + lane] = acc_lo[r, lane]
                            row_buffer[r, block * T.int64(cols) - first - T.int64(r) + T.int64(slack + lanes) + lane] = acc_hi[r, lane]
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        i: T.let = query[r]
                        # Valid band columns: 0 <= i + d*(j - w) < n  <=>  low <= j < high.
                        low: T.let = T.max(w - i // d, T.int64(0))
                        high: T.let = T.min(w + (n - T.int64(1) - i) // d + T.int64(1), band)
                        for vector in range(band // T.int64(lanes)):
                            for lane in T.vectorized(lanes):
                                out[b, i, h, vector * T.int64(lanes) + lane] = T.Select(
                                    vector * T.int64(lanes) + lane >= low and vector * T.int64(lanes) + lane < high,
                                    T.Cast(dtype, row_buffer[r, T.int64(slack) + vector * T.int64(lanes) + lane]),
                                    T.Cast(dtype, padding))
                        for j in range(band // T.int64(lanes) * T.int64(lanes), band):
                            out[b, i, h, j] = T.Select(j >= low and j < high,
                                                       T.Cast(dtype, row_buffer[r, T.int64(slack) + j]), T.Cast(dtype, padding))

    return main


def pv(dtype: str, autoregressive: bool, vector_bits: int):
    """The probs.V PrimFunc; same arguments as :func:`tvm_kernels.compute.pv`.

    The transpose of the Q.K^T tiling: per tile of ``rows`` consecutive packed queries,
    their band rows are first copied, each shifted by its row offset and zeroed at invalid
    keys, into a ``rows x (band + rows)`` weight buffer; then the tile's output features
    accumulate in registers (``rows x 2`` vectors) while the packed value rows the tile
    touches stream through once, one broadcast weight per row and two vector FMAs each.
    ``head_dim`` must be a multiple of ``2 * lanes`` (the runtime zero-pads).
    """
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    rows = 8 if vector_bits >= 512 else 6
    cols = 2 * lanes  # output features of one register tile
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, band), dtype)
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        margin: T.let = w + T.int64(rows)  # packed rows before the first value row
        for bh in T.parallel(batch * heads):
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer((n + T.int64(2) * band + T.int64(2 * rows), head_dim), acc_dtype)
            weights = T.decl_buffer((T.int64(rows), band + T.int64(rows)), acc_dtype)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            acc_lo = T.alloc_local((rows, lanes), acc_dtype, annotations=_ON_STACK)
            acc_hi = T.alloc_local((rows, lanes), acc_dtype, annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            for t in range(n + T.int64(2) * band + T.int64(2 * rows)):
                p: T.let = t - margin  # packed position
                if p >= T.int64(0) and p < n:
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(
                                acc_dtype, t2[b, row_of[p], h, vector * T.int64(lanes) + lane])
                else:
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
            for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
                p0: T.let = tile * T.int64(rows)
                for r in range(rows):
                    query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
                    i: T.let = query[r]
                    # Valid band columns: 0 <= i + d*(j - w) < n  <=>  low <= j < high. Row r's weight
                    # for packed row p0 - w + k sits at column k = r + j; zeros around the band.
                    low: T.let = T.max(w - i // d, T.int64(0))
                    high: T.let = T.min(w + (n - T.int64(1) - i) // d + T.int64(1), band)
                    for k in range(r):
                        weights[r, k] = T.Cast(acc_dtype, 0)
                    for vector in range(band // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            weights[r, T.int64(r) + vector * T.int64(lanes) + lane] = T.Select(
                                vector * T.int64(lanes) + lane >= low and vector * T.int64(lanes) + lane < high,
                                T.Cast(acc_dtype, t1[b, i, h, vector * T.int64(lanes) + lane]), T.Cast(acc_dtype, 0))
                    for j in range(band // T.int64(lanes) * T.int64(lanes), band):
                        weights[r, T.int64(r) + j] = T.Select(j >= low and j < high, T.Cast(acc_dtype, t1[b, i, h, j]),
                                                              T.Cast(acc_dtype, 0))
                    for k in range(T.int64(r) + band, band + T.int64(rows - 1)):
                        weights[r, k] = T.Cast(acc_dtype, 0)
                first: T.let = p0 - w + margin  # packed row of column k = 0
                for feature_tile in range(head_dim // T.int64(cols)):
                    for r in T.unroll(rows):
                        for lane in T.vectorized(lanes):
                            acc_lo[r, lane] = T.Cast(acc_dtype, 0)
                            acc_hi[r, lane] = T.Cast(acc_dtype, 0)
                    for k in range(band + T.int64(rows - 1)):
                        for r in T.unroll(rows):
                            for lane in T.vectorized(lanes):
                                acc_lo[r, lane] = acc_lo[r, lane] + weights[r, k] * packed[first + k, feature_tile * T.int64(cols) + lane]
                                acc_hi[r, lane] = acc_hi[r, lane] + weights[r, k] * packed[first + k, feature_tile * T.int64(cols) + T.int64(lanes) + lane]
                    for r in T.unroll(rows):
                        if p0 + T.int64(r) < n:
                            for lane in T.vectorized(lanes):
                                out[b, query[r], h, feature_tile * T.int64(cols) + lane] = T.Cast(dtype, acc_lo[r, lane])
                                out[b, query[r], h, feature_tile * T.int64(cols) + T.int64(lanes) + lane] = T.Cast(dtype, acc_hi[r, lane])

    return main
