"""x86-64 CPU kernels: the three banded products and fused local attention, hand-written in TIR,
GEMM-like tiles for any dilation.

Why not TE schedules: the fast loop nests run over *residue classes* whose size
depends on each head's runtime dilation, compute dense tiles wider than the band
and store them skewed into the band layout. Schedule primitives cannot reorder a
TE output that way (bench/NOTES.md has the schedules tried first), so these kernels
are written directly in TIR (TVMScript). Each computes exactly its definition in
:mod:`tvm_kernels.compute` and is tested against the same plain references.

Common structure, per (batch, head) in parallel: the second operand is packed
residue-major (dilation d: rows r, r+d, r+2d, ... for r = 0..d-1, with zero
margins). In packed order every query's band is a run of consecutive rows, for
any dilation: dilation d is d interleaved undilated problems laid end to end.
Then tiles of ``rows`` consecutive packed queries run a register-blocked
micro-kernel (bench/NOTES.md has every variant measured):

- qk (16 rows x 1 vector of accumulators on AVX-512, 6 x 2 on AVX2): keys packed in
  blocks of ``cols`` (one tile width), transposed so that for a fixed feature a
  block's keys are contiguous. Per feature: one broadcast per row, one load per
  vector, one FMA per row and vector. A block's result for a row whose columns there
  are all valid is stored straight into the output row (those stores overlap the next
  blocks' FMAs); the rest goes, skewed by its row, into a small row buffer, from which
  the row's remaining columns are copied, ``padding`` outside the sequence.
- pv / transposed (8 x 2 vectors on AVX-512, 4 x 4 for half types when head_dim is a
  multiple of 64; 6 x 2 on AVX2): for a tile whose rows are consecutive in one residue
  class, the keys inside the sequence are the same packed rows for every row, so the
  FMA loop reads its weights straight from the band
  (for transposed: from *other* rows' bands) with loop bounds instead of masks. Tiles
  across classes or past the end first gather their weights, zeroed at invalid keys,
  into a small buffer. The output features accumulate in registers while the packed
  rows the tile touches stream through once. On AVX2 the direct loop runs in chunks of 32
  steps, every feature tile of a chunk before the next one (a chunk's band lines stay in
  L1), and half types convert a chunk's weights once into a small float32 buffer.
- attention: the qk micro-kernel writes a tile's scores into a buffer that stays in cache, the
  softmax runs there, and the pv micro-kernel streams the value rows once; no band in memory
  (see :func:`attention`). Its backward recomputes each tile's probabilities from the forward's
  row log-sum-exp and accumulates dK and dV in packed rows (:func:`attention_backward`).

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``
(feature loops run over whole vectors or register tiles; the runtime zero-pads,
which is exact). Scratch per (batch, head): the packed rows (about one
head's slice of the input; the attention backward also its dK and dV sums), a row
table and a per-tile buffer; accumulators live in registers.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype

FEATURE_MULTIPLE = 32  # head_dim: whole vectors for qk, whole 2-vector tiles for pv / transposed (32 float32 lanes on AVX-512; the others divide it)

# Keep small per-tile buffers on the stack (LLVM promotes them to registers).
# TVM otherwise lowers every allocation inside a parallel loop to a heap workspace
# call (3x slower kernels); the annotation survives only if StorageRewrite is off.
_ON_STACK = {"disable_lower_builtin": True}
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}
_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


# Packing reads one head's slice of every row: a few lines, then a jump of heads * head_dim
# elements, which crosses a 4 KiB page almost every row, where hardware prefetchers stop.
_ROWS_AHEAD = 8


@T.macro
def _prefetch_line(x, b, row, h, column):
    """Ask for the cache line of x[b, row, h, column] (a hint: no fault, no effect on results)."""
    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(x[b, row, h, column]),
                                  T.int32(0), T.int32(3), T.int32(1)))


@T.macro
def _prefetch_row(x, b, row, h, length, per_line):
    """Ask for the cache lines of x[b, row, h, 0:length]."""
    for line in range((length + T.int64(per_line - 1)) // T.int64(per_line)):
        _prefetch_line(x, b, row, h, line * T.int64(per_line))


@T.macro
def _zero_tile(acc, rows, cols, acc_dtype):
    for r in T.unroll(rows):
        for lane in T.vectorized(cols):
            acc[r, lane] = T.Cast(acc_dtype, 0)


@T.macro
def _accumulate(acc, r, packed, row, column, cols, weight):
    """Tile row r += weight * packed[row, column : column + cols] (one broadcast, an FMA per vector)."""
    for lane in T.vectorized(cols):
        acc[r, lane] = acc[r, lane] + weight * packed[row, column + lane]


@T.macro
def _save_tile(sums, acc, column, rows, cols):
    for r in T.unroll(rows):
        for lane in T.vectorized(cols):
            sums[r, column + lane] = acc[r, lane]


@T.macro
def _load_tile(acc, sums, column, rows, cols):
    for r in T.unroll(rows):
        for lane in T.vectorized(cols):
            acc[r, lane] = sums[r, column + lane]


@T.macro
def _store_tile(out, acc, b, h, query, p0, n, column, rows, cols, dtype):
    for r in T.unroll(rows):
        if p0 + T.int64(r) < n:
            for lane in T.vectorized(cols):
                out[b, query[r], h, column + lane] = T.Cast(dtype, acc[r, lane])


@T.macro
def _fill_run(buffer, r, begin, end, value, lanes):
    """buffer[r, begin:end] = value (whole vectors, then the rest)."""
    for vector in range((end - begin) // T.int64(lanes)):
        for lane in T.vectorized(lanes):
            buffer[r, begin + vector * T.int64(lanes) + lane] = value
    for j in range(begin + (end - begin) // T.int64(lanes) * T.int64(lanes), end):
        buffer[r, j] = value


@T.macro
def _copy_run(out, b, i, h, buffer, r, offset, begin, end, lanes, dtype):
    """out[b, i, h, begin:end] = buffer[r, offset + begin : offset + end], cast (whole vectors, then the rest)."""
    for vector in range((end - begin) // T.int64(lanes)):
        for lane in T.vectorized(lanes):
            out[b, i, h, begin + vector * T.int64(lanes) + lane] = T.Cast(
                dtype, buffer[r, offset + begin + vector * T.int64(lanes) + lane])
    for j in range(begin + (end - begin) // T.int64(lanes) * T.int64(lanes), end):
        out[b, i, h, j] = T.Cast(dtype, buffer[r, offset + j])


@T.macro
def _valid_span(span, low, high, first, p0, n, rows):
    """span = [first + min(r + low[r]), first + max(r + high[r])) over the tile's rows inside the sequence:
    the packed columns where some row has a valid band column (row r's band column j is first + r + j)."""
    span[0] = first + T.int64(rows)
    span[1] = first
    for r in T.unroll(rows):
        if p0 + T.int64(r) < n:
            span[0] = T.min(span[0], first + T.int64(r) + low[r])
            span[1] = T.max(span[1], first + T.int64(r) + high[r])


@T.macro
def _fill_residue_major(row_of, n, d):
    """row_of[p] = the sequence row at packed position p: rows r, r+d, r+2d, ... for r = 0..d-1."""
    start = T.alloc_local((1,), "int64", annotations=_ON_STACK)
    start[0] = T.int64(0)
    for residue in range(T.min(d, n)):
        for step in range((n - residue + d - T.int64(1)) // d):
            row_of[start[0] + step] = residue + d * step
        start[0] = start[0] + (n - residue + d - T.int64(1)) // d


@T.macro
def _pack_operands(keys, values, biases, key_tile, t_keys, t_values, key_bias, row_of, block_keys, b, h, n,
                             head_dim, margin, blocks, cols, lanes, per_line, acc_dtype, with_bias, with_values):
    """One (batch, head)'s operands in packed (residue-major) order, zero outside the sequence:
    keys in blocks of ``cols``, feature-major (the Q.K^T micro-kernel's layout: Q.K^T and the fused
    kernels), with_values the values as rows (probs.V's layout), and with_bias the keys' score
    biases, at the same packed columns. ``key_tile``: scratch of ``cols x lanes``."""
    for block in range(blocks):
        for lane in range(T.int64(cols)):
            p: T.let = block * T.int64(cols) + lane - margin  # packed position
            block_keys[lane] = row_of[T.max(T.min(p, n - T.int64(1)), T.int64(0))]
            ahead: T.let = row_of[T.max(T.min(p + T.int64(_ROWS_AHEAD), n - T.int64(1)), T.int64(0))]
            _prefetch_row(t_keys, b, ahead, h, head_dim, per_line)
            if with_values:
                _prefetch_row(t_values, b, ahead, h, head_dim, per_line)
        # The block's keys transposed a vector of features at a time through a tile of constant
        # strides: gathering each packed vector straight from the key rows took a vector index
        # extract per element.
        for chunk in range(head_dim // T.int64(lanes)):
            for lane in range(T.int64(cols)):
                for f in T.vectorized(lanes):
                    key_tile[lane, f] = T.Select(
                        block * T.int64(cols) + lane >= margin and block * T.int64(cols) + lane < margin + n,
                        T.Cast(acc_dtype, t_keys[b, block_keys[lane], h, chunk * T.int64(lanes) + f]), T.Cast(acc_dtype, 0))
            for f in range(lanes):
                for lane in T.vectorized(cols):
                    keys[block, chunk * T.int64(lanes) + T.int64(f), lane] = key_tile[lane, f]
        for lane in range(T.int64(cols)):
            inside: T.let = block * T.int64(cols) + lane >= margin and block * T.int64(cols) + lane < margin + n
            if with_values:
                for vector in range(head_dim // T.int64(lanes)):
                    for lane2 in T.vectorized(lanes):
                        values[block * T.int64(cols) + lane, vector * T.int64(lanes) + lane2] = T.Select(
                            inside, T.Cast(acc_dtype, t_values[b, block_keys[lane], h, vector * T.int64(lanes) + lane2]),
                            T.Cast(acc_dtype, 0))
            if with_bias:
                biases[block * T.int64(cols) + lane] = T.Select(inside, key_bias[b, block_keys[lane]], T.Cast(acc_dtype, 0))


def qk(dtype: str, autoregressive: bool, vector_bits: int):
    """The Q.K^T PrimFunc; same arguments as :func:`tvm_kernels.compute.qk`."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    # AVX-512: 16 rows x 1 vector; the tile then advances by exactly one key block, so every tile's
    # band starts on a block boundary and computes 528 columns per 513 (12 x 2 vectors: ~557).
    # AVX2: 6 x 2 vectors (16 ymm registers). Accumulators + 1 load + 1 broadcast fit the register file.
    rows, vectors = (16, 1) if vector_bits >= 512 else (6, 2)
    cols = vectors * lanes                  # keys per packed block = one register tile's width
    slack = rows + cols                     # row buffer margin on each side of the band
    per_line = 64 * 8 // _BITS[dtype]       # elements of one 64-byte cache line
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
            queries = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)  # the tile's query rows, converted once
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), acc_dtype, annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            direct_begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            direct_end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            valid_span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            # Keys only (the values and biases arguments are not used).
            _pack_operands(packed, packed, packed, key_tile, t2, t2, t2, row_of, block_keys, b, h, n, head_dim, margin,
                                     (n + T.int64(2 * cols) + band + T.int64(rows + 2 * cols)) // T.int64(cols) + T.int64(1),
                                     cols, lanes, per_line, acc_dtype, False, False)
            for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + margin  # packed column of row 0's band column 0
                for r in T.unroll(rows):
                    query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
                    # Valid band columns: 0 <= i + d*(j - w) < n  <=>  low <= j < high.
                    low[r] = T.max(w - query[r] // d, T.int64(0))
                    high[r] = T.min(w + (n - T.int64(1) - query[r]) // d + T.int64(1), band)
                    # Key blocks whose columns for row r (block * cols - first - r + 0..cols-1) are all
                    # valid go straight from the registers to the output row: those stores then
                    # overlap the next blocks' FMAs (stored at the end, they stalled on memory).
                    direct_begin[r] = (low[r] + first + T.int64(r) + T.int64(cols - 1)) // T.int64(cols)
                    direct_end[r] = T.Select(p0 + T.int64(r) < n, (high[r] + first + T.int64(r)) // T.int64(cols), T.int64(0))
                for r in range(rows):
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            queries[r, vector * T.int64(lanes) + lane] = T.Cast(
                                acc_dtype, t1[b, query[r], h, vector * T.int64(lanes) + lane])
                # Only the key blocks holding a valid column of some row: near the sequence's ends (and,
                # dilated, near each residue class's ends) the rest of the band is padding, filled below.
                _valid_span(valid_span, low, high, first, p0, n, rows)
                for block in range(valid_span[0] // T.int64(cols), (valid_span[1] + T.int64(cols - 1)) // T.int64(cols)):
                    _zero_tile(acc, rows, cols, acc_dtype)
                    for f in range(head_dim):
                        for r in T.unroll(rows):
                            for lane in T.vectorized(cols):
                                acc[r, lane] = acc[r, lane] + queries[r, f] * packed[block, f, lane]
                    for r in T.unroll(rows):
                        # Row r's band column j is packed column first + r + j.
                        if block >= direct_begin[r] and block < direct_end[r]:
                            for lane in T.vectorized(cols):
                                out[b, query[r], h, block * T.int64(cols) - first - T.int64(r) + lane] = T.Cast(dtype, acc[r, lane])
                        else:
                            for lane in T.vectorized(cols):
                                row_buffer[r, block * T.int64(cols) - first - T.int64(r) + T.int64(slack) + lane] = acc[r, lane]
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        # The rest of the row from the row buffer: padding outside [low, high), and
                        # the partial blocks at both ends of the directly stored run [done_begin, done_end).
                        done_begin: T.let = T.Select(direct_begin[r] < direct_end[r], direct_begin[r] * T.int64(cols) - first - T.int64(r), band)
                        done_end: T.let = T.Select(direct_begin[r] < direct_end[r], direct_end[r] * T.int64(cols) - first - T.int64(r), band)
                        _fill_run(row_buffer, r, T.int64(slack), T.int64(slack) + low[r], T.Cast(acc_dtype, padding), lanes)
                        _fill_run(row_buffer, r, T.int64(slack) + high[r], T.int64(slack) + band, T.Cast(acc_dtype, padding), lanes)
                        _copy_run(out, b, query[r], h, row_buffer, r, T.int64(slack), T.int64(0), done_begin, lanes, dtype)
                        _copy_run(out, b, query[r], h, row_buffer, r, T.int64(slack), done_end, band, lanes, dtype)

    return main


def pv(dtype: str, autoregressive: bool, vector_bits: int):
    """The probs.V PrimFunc; same arguments as :func:`tvm_kernels.compute.pv`.

    The transpose of the Q.K^T tiling: per tile of ``rows`` consecutive packed queries, the
    output features accumulate in registers (``rows x 2`` vectors) while the packed value
    rows the tile touches stream through once, one broadcast weight per row (row r's weight
    for the k-th packed row is its band column k - r) and two vector FMAs each.
    ``head_dim`` must be a multiple of ``2 * lanes`` (the runtime zero-pads).
    """
    return _band_times_rows(dtype, autoregressive, vector_bits, transposed=False)


def transposed(dtype: str, autoregressive: bool, vector_bits: int):
    """The transposed (backward) PrimFunc; same arguments as :func:`tvm_kernels.compute.transposed`.

    The probs.V loop nest with other weights: query i's weight for row
    ``p = i + d*(j - w_upper)`` is ``t1[p, band - 1 - j]``, a column of *another* band row.
    For a tile of consecutive packed queries, the weights of the k-th packed row they touch
    are ``rows`` consecutive entries of that row's band: the FMA loop broadcasts them from
    there (tiles in one residue class), or the weight buffer is built transposed
    (``weights[k, r]``), one short vector load per row (the other tiles).
    """
    return _band_times_rows(dtype, autoregressive, vector_bits, transposed=True)


def _band_weight(t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, clamp):
    """Row r's weight for the tile's k-th packed row, read from the band (a plain Python helper
    that builds the expression; ``clamp`` keeps the read inside the buffers where the weight
    may be invalid, for the caller to select away).

    probs.V: band column k - r of row r's own band row. Transposed: column band - 1 - k + r of
    the band row of packed row p0 - offset + k.
    """
    if transposed:
        source = p0 - offset + k
        column = band - T.int64(1) - k + T.int64(r)
        if clamp:
            source = T.max(T.min(source, n - T.int64(1)), T.int64(0))
            column = T.max(T.min(column, band - T.int64(1)), T.int64(0))
        return T.Cast(acc_dtype, t1[b, row_of[source], h, column])
    column = k - T.int64(r)
    if clamp:
        column = T.max(T.min(column, band - T.int64(1)), T.int64(0))
    return T.Cast(acc_dtype, t1[b, query[r], h, column])


@T.macro
def _stage_chunk(staged, t1, query, b, h, d, offset, band, chunk, k_from, k_to, steps, rows, acc_dtype, by_step):
    """A direct tile's weights for steps k_from..k_to-1 of the chunk from step ``chunk``, in the
    accumulation dtype: probs.V ``staged[r, k - chunk]`` = row r's band column k - r; transposed
    ``staged[k - chunk, r]`` = column band - 1 - k + r of step k's band row (which it also
    prefetches where the next tile reads it, as the unstaged loop does). ``by_step``: transposed."""
    if by_step:
        for k in range(k_from, k_to):
            source: T.let = query[0] + (k - offset) * d
            _prefetch_line(t1, b, source, h, T.min(band + T.int64(2 * rows - 2) - k, band - T.int64(1)))
            for r in T.vectorized(rows):
                staged[k - chunk, r] = T.Cast(acc_dtype, t1[b, source, h, band - T.int64(1) - k + T.int64(r)])
    else:
        for r in range(rows):
            if k_from == chunk and k_to == chunk + T.int64(steps):
                for k in T.vectorized(steps):
                    staged[r, k] = T.Cast(acc_dtype, t1[b, query[r], h, chunk + k - T.int64(r)])
            else:
                for k in range(k_from, k_to):
                    staged[r, k - chunk] = T.Cast(acc_dtype, t1[b, query[r], h, k - T.int64(r)])


def _band_times_rows(dtype: str, autoregressive: bool, vector_bits: int, transposed: bool):
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    rows = 8 if vector_bits >= 512 else 6  # 12 measured no faster for pv, 1.5x slower for transposed
    cols = 2 * lanes  # output features of one register tile
    # Half types on AVX-512 when head_dim is a multiple of 4 vectors: 4 rows x 4 vectors. A half
    # weight costs a broadcast and a convert per use (float32's broadcast rides in the FMA); this
    # tile uses each weight for 4 FMAs instead of 2 (bench/NOTES.md). 0: no wide tile.
    wide_cols = 4 * lanes if vector_bits >= 512 and dtype in ("float16", "bfloat16") else 0
    # AVX2 (16 ymm registers, 32 KiB L1): the direct path runs its steps in chunks of 32, every
    # feature tile of a chunk before the next chunk, so that the band lines a chunk reads are
    # read again from L1 (transposed reads a new band row per step); half types convert the
    # chunk's weights to the accumulation dtype once, into a small buffer, instead of at each
    # use (one per feature tile). AVX-512 (0: one chunk) keeps the loop measured there.
    chunk_steps = 32 if vector_bits < 512 else 0
    stage_weights = vector_bits < 512 and dtype in ("float16", "bfloat16")
    causal = 1 if autoregressive else 0
    per_line = 64 * 8 // _BITS[dtype]  # elements of one 64-byte cache line
    # Row offset of band column 0: w for probs.V; w_upper (w, or 0 when causal) for transposed.
    offset_is_w = 0 if transposed and autoregressive else 1

    @T.macro
    def tiles(t1, out, row_of, packed, b, h, d, n, band, head_dim, offset, margin, rows, cols):
        """Every tile of ``rows`` packed rows x ``cols`` output features (the packed rows have a
        margin of at least ``rows`` before the first)."""
        weights = T.decl_buffer((band + T.int64(rows), T.int64(rows)) if transposed
                                else (T.int64(rows), band + T.int64(rows)), acc_dtype)
        query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        next_row = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
        sums = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)  # the direct path's tile between phases
        staged = T.decl_buffer((T.int64(max(chunk_steps, 1)), T.int64(rows)) if transposed  # a chunk's weights
                               else (T.int64(rows), T.int64(max(chunk_steps, 1))), acc_dtype)
        for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
            p0: T.let = tile * T.int64(rows)
            for r in range(rows):
                query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
                # Valid band columns: 0 <= i + d*(j - offset) < n  <=>  low <= j < high.
                low[r] = T.max(offset - query[r] // d, T.int64(0))
                high[r] = T.min(offset + (n - T.int64(1) - query[r]) // d + T.int64(1), band)
            first: T.let = p0 - offset + margin  # packed row of k = 0
            # Row r's weight for the k-th packed row (p0 - offset + k) belongs to band column j = k - r.
            # When the tile's rows are consecutive in one residue class (all but about one tile
            # per class), the keys inside the sequence are the same packed rows for every row:
            # k in [low[0], k_end), and row r has a column there iff r <= k < r + band.
            k_end: T.let = T.min(offset + (n - T.int64(1) - query[0]) // d + T.int64(1), band + T.int64(rows - 1))
            if (p0 + T.int64(rows) <= n and query[rows - 1] == query[0] + T.int64(rows - 1) * d
                    and band >= T.int64(rows - 1)):
                # The FMA loop reads its weights straight from the band rows; only the two
                # triangles k < rows - 1 and k >= band, where some row has no column, select.
                k_low: T.let = T.max(low[0], T.int64(rows - 1))
                k_high: T.let = T.max(T.min(k_end, band), k_low)
                for feature_tile in range(head_dim // T.int64(cols)):
                    _zero_tile(acc, rows, cols, acc_dtype)
                    for k in range(low[0], T.max(T.min(k_end, T.int64(rows - 1)), low[0])):
                        for r in T.unroll(rows):
                            _accumulate(acc, r, packed, first + k, feature_tile * T.int64(cols), cols, T.Select(
                                k >= T.int64(r), _band_weight(t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, True),
                                T.Cast(acc_dtype, 0)))
                    _save_tile(sums, acc, feature_tile * T.int64(cols), rows, cols)
                for r in range(rows):
                    next_row[r] = row_of[T.min(p0 + T.int64(rows + r), n - T.int64(1))]  # the next tile's rows
                steps: T.let = T.int64(chunk_steps) if chunk_steps > 0 else band + T.int64(rows)
                # The chunks by an index from 0: the same loop written from k_low // steps to its end
                # computed wrong sums under TVM 0.27 (cause not isolated; tests caught it).
                for chunk_index in range((k_high + steps - T.int64(1)) // steps - k_low // steps):
                    chunk: T.let = (k_low // steps + chunk_index) * steps  # its first step
                    k_from: T.let = T.max(chunk, k_low)
                    k_to: T.let = T.min(chunk + steps, k_high)
                    if not transposed and chunk_steps > 0:
                        # Fetch the next tile's band rows, the lines of this chunk's steps: all at
                        # once they fill the miss queue and the FMA loop stalls (perf).
                        for line in range((chunk_steps + per_line - 1) // per_line):
                            for r in range(rows):
                                _prefetch_line(t1, b, next_row[r], h, T.min(chunk + T.int64(line * per_line), band - T.int64(1)))
                    if stage_weights:
                        _stage_chunk(staged, t1, query, b, h, d, offset, band, chunk, k_from, k_to, chunk_steps, rows, acc_dtype, transposed)
                    for feature_tile in range(head_dim // T.int64(cols)):
                        _load_tile(acc, sums, feature_tile * T.int64(cols), rows, cols)
                        for k in range(k_from, k_to):
                            if transposed:
                                # The band row of packed row p0 - offset + k, in the tile's residue
                                # class (the loop bounds keep it there): no row table in the loop,
                                # the weights' address advances by a constant per step.
                                source: T.let = query[0] + (k - offset) * d
                                if not stage_weights:
                                    # The next tile reads the next `rows` entries of this band row
                                    # (its last one: column band - 1 - k + 2 * rows - 1): fetch that
                                    # line now. Without it head_dim 32 (one pass per tile) ran 2.5x
                                    # slower per FLOP than 64 (bench/NOTES.md).
                                    _prefetch_line(t1, b, source, h, T.min(band + T.int64(2 * rows - 2) - k, band - T.int64(1)))
                                for r in T.unroll(rows):
                                    _accumulate(acc, r, packed, first + k, feature_tile * T.int64(cols), cols,
                                                staged[k - chunk, r] if stage_weights else
                                                T.Cast(acc_dtype, t1[b, source, h, band - T.int64(1) - k + T.int64(r)]))
                            else:
                                if chunk_steps == 0:
                                    # Fetch the next tile's band rows, a line per step.
                                    _prefetch_line(t1, b, row_of[T.min(p0 + T.int64(rows) + k % T.int64(rows), n - T.int64(1))], h,
                                                   T.min(k // T.int64(rows) * T.int64(per_line), band - T.int64(1)))
                                for r in T.unroll(rows):
                                    _accumulate(acc, r, packed, first + k, feature_tile * T.int64(cols), cols,
                                                staged[r, k - chunk] if stage_weights else
                                                _band_weight(t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, False))
                        _save_tile(sums, acc, feature_tile * T.int64(cols), rows, cols)
                for feature_tile in range(head_dim // T.int64(cols)):
                    _load_tile(acc, sums, feature_tile * T.int64(cols), rows, cols)
                    for k in range(T.max(low[0], band), T.max(k_end, T.max(low[0], band))):
                        for r in T.unroll(rows):
                            _accumulate(acc, r, packed, first + k, feature_tile * T.int64(cols), cols, T.Select(
                                k - T.int64(r) < band, _band_weight(t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, True),
                                T.Cast(acc_dtype, 0)))
                    _store_tile(out, acc, b, h, query, p0, n, feature_tile * T.int64(cols), rows, cols, dtype)
            else:
                # A tile across residue classes or past the end: gather the weights, zeroed at
                # invalid columns, into a buffer first.
                if transposed:
                    for k in range(band + T.int64(rows - 1)):
                        # That row's band holds the weights of rows r = 0.. at columns band - 1 - k + r.
                        row: T.let = row_of[T.max(T.min(p0 - offset + k, n - T.int64(1)), T.int64(0))]
                        if k >= T.int64(rows - 1) and k < band:
                            for r in T.vectorized(rows):
                                weights[k, r] = T.Select(
                                    k - T.int64(r) >= low[r] and k - T.int64(r) < high[r],
                                    T.Cast(acc_dtype, t1[b, row, h, band - T.int64(1) - k + T.int64(r)]), T.Cast(acc_dtype, 0))
                        else:  # the band's first and last columns: clamp the read, the weight is 0 anyway
                            for r in range(rows):
                                weights[k, r] = T.Select(
                                    k - T.int64(r) >= low[r] and k - T.int64(r) < high[r],
                                    T.Cast(acc_dtype, t1[b, row, h, T.max(T.min(band - T.int64(1) - k + T.int64(r), band - T.int64(1)), T.int64(0))]),
                                    T.Cast(acc_dtype, 0))
                else:
                    # Fetch the next tile's band rows while this tile computes (the direct path
                    # spreads them over its FMA loop instead). Transposed reads a few entries per
                    # row, in an order the hardware prefetcher follows (measured: no gain).
                    for r in range(rows):
                        _prefetch_row(t1, b, row_of[T.min(p0 + T.int64(rows + r), n - T.int64(1))], h, band, per_line)
                    for r in range(rows):
                        for k in range(r):
                            weights[r, k] = T.Cast(acc_dtype, 0)
                        for vector in range(band // T.int64(lanes)):
                            for lane in T.vectorized(lanes):
                                weights[r, T.int64(r) + vector * T.int64(lanes) + lane] = T.Select(
                                    vector * T.int64(lanes) + lane >= low[r] and vector * T.int64(lanes) + lane < high[r],
                                    T.Cast(acc_dtype, t1[b, query[r], h, vector * T.int64(lanes) + lane]), T.Cast(acc_dtype, 0))
                        for j in range(band // T.int64(lanes) * T.int64(lanes), band):
                            weights[r, T.int64(r) + j] = T.Select(j >= low[r] and j < high[r],
                                                                  T.Cast(acc_dtype, t1[b, query[r], h, j]), T.Cast(acc_dtype, 0))
                        for k in range(T.int64(r) + band, band + T.int64(rows - 1)):
                            weights[r, k] = T.Cast(acc_dtype, 0)
                for feature_tile in range(head_dim // T.int64(cols)):
                    column: T.let = feature_tile * T.int64(cols)
                    _zero_tile(acc, rows, cols, acc_dtype)
                    for k in range(band + T.int64(rows - 1)):
                        for r in T.unroll(rows):
                            _accumulate(acc, r, packed, first + k, column, cols,
                                        weights[k, r] if transposed else weights[r, k])
                    _store_tile(out, acc, b, h, query, p0, n, column, rows, cols, dtype)

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
        offset: T.let = T.int64(offset_is_w) * w
        margin: T.let = w + T.int64(rows)  # packed rows before the first row
        for bh in T.parallel(batch * heads):
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer((n + T.int64(2) * band + T.int64(2 * rows), head_dim), acc_dtype)
            _fill_residue_major(row_of, n, d)
            for t in range(n + T.int64(2) * band + T.int64(2 * rows)):
                p: T.let = t - margin  # packed position
                if p >= T.int64(0) and p < n:
                    source: T.let = row_of[p]
                    _prefetch_row(t2, b, row_of[T.min(p + T.int64(_ROWS_AHEAD), n - T.int64(1))], h, head_dim, per_line)
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(
                                acc_dtype, t2[b, source, h, vector * T.int64(lanes) + lane])
                else:
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
            if wide_cols > 0 and head_dim % T.int64(wide_cols) == 0:
                tiles(t1, out, row_of, packed, b, h, d, n, band, head_dim, offset, margin, 4, wide_cols)
            else:
                tiles(t1, out, row_of, packed, b, h, d, n, band, head_dim, offset, margin, rows, cols)

    return main


# exp on [-inf, 0] for the fused softmax, vectorisable: TVM lowers ``T.exp`` to one scalar ``expf``
# call per lane. exp(x) = 2^m * exp(t), m = round(x / ln 2), t = x - m ln 2 in [-ln2/2, ln2/2]
# (ln 2 split in two constants so that t keeps float32 precision), exp(t) by its degree-7
# Taylor polynomial (relative error < 1e-8 there), 2^m built in the exponent bits. Inputs are
# clamped at -127 ln 2, where m = -127 makes those bits 0: exp(-inf) = 0 exactly, and results
# below float32's smallest normal number (x < -87.7) flush to 0.
_LOG2E = 1.4426950408889634
_LN2_HIGH = 0.693145751953125  # few mantissa bits: m * _LN2_HIGH is exact in float32
_LN2_LOW = 1.4286068203094172e-06


def _exp(x, acc_dtype):
    """The expression exp(x) for x <= 0 (a plain Python helper building the expression)."""
    if acc_dtype == "float64":  # no speed goal for float64: the library's exp, exactly rounded
        return T.exp(x)
    x = T.max(x, T.float32(-127 * 0.6931471805599453))
    m = T.floor(x * T.float32(_LOG2E) + T.float32(0.5))
    t = x - m * T.float32(_LN2_HIGH) - m * T.float32(_LN2_LOW)
    poly = T.float32(1.0 / 5040)
    for k in (720, 120, 24, 6, 2, 1, 1):
        poly = poly * t + T.float32(1.0 / k)
    return poly * T.reinterpret("float32", T.shift_left(T.Cast("int32", m) + T.int32(127), T.int32(23)))


# Attention dropout without generator state, so that the backward regenerates the forward's mask:
# each row's key is murmur3's 32-bit finaliser chained over (seed, batch * heads + head, query row);
# band column j of that row is kept when the top 24 bits of mix(key + j * golden) are >= p * 2^24.
# longformer_ops.reference.dropout_factor_reference computes the same mask in PyTorch.
_GOLDEN = 0x9E3779B9


def _mix32(x):
    """murmur3's fmix32 of a uint32 expression (a plain Python helper building the expression)."""
    x = x ^ T.shift_right(x, T.uint32(16))
    x = x * T.uint32(0x85EBCA6B)
    x = x ^ T.shift_right(x, T.uint32(13))
    x = x * T.uint32(0xC2B2AE35)
    return x ^ T.shift_right(x, T.uint32(16))


def _dropout_row_key(seed, bh, row):
    return _mix32(T.Cast("uint32", seed) ^ _mix32(T.Cast("uint32", bh) * T.uint32(_GOLDEN) ^ _mix32(T.Cast("uint32", row))))


def _dropout_factor(key, column, dropout, acc_dtype):
    """1 / (1 - p) if band column ``column`` of the row with ``key`` is kept, else 0."""
    bits = T.shift_right(_mix32(key + T.Cast("uint32", column) * T.uint32(_GOLDEN)), T.uint32(8))
    return T.Select(bits >= T.Cast("uint32", dropout * T.float64(1 << 24)),
                    T.Cast(acc_dtype, T.float64(1) / (T.float64(1) - dropout)), T.Cast(acc_dtype, 0))


@T.macro
def _apply_dropout(scores, kept, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype):
    """kept[r, c] = scores[r, c] * (1/(1-p) or 0) at each row's valid columns [begin, end) (its other
    columns are left as they are); ``kept`` may be ``scores`` itself (in place)."""
    for r in range(rows):
        key: T.let = _dropout_row_key(seed, bh, query[r])
        for vector in range((end[r] - begin[r]) // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                kept[r, begin[r] + vector * T.int64(lanes) + lane] = scores[r, begin[r] + vector * T.int64(lanes) + lane] * _dropout_factor(
                    key, begin[r] + vector * T.int64(lanes) + lane - base - T.int64(r), dropout, acc_dtype)
        for c in range(begin[r] + (end[r] - begin[r]) // T.int64(lanes) * T.int64(lanes), end[r]):
            kept[r, c] = scores[r, c] * _dropout_factor(key, c - base - T.int64(r), dropout, acc_dtype)


@T.macro
def _attention_tile_rows(query, begin, end, queries, t_rows, row_of, b, h, n, head_dim, p0, w, d, band, base, scale,
                         rows, lanes, acc_dtype):
    """The tile's sequence rows, their valid columns [begin, end) in the scores buffer (row r's band
    column j is at base + r + j; empty past the end), and their first operand rows times ``scale``."""
    for r in T.unroll(rows):
        query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
        begin[r] = T.Select(p0 + T.int64(r) < n, base + T.int64(r) + T.max(w - query[r] // d, T.int64(0)), T.int64(0))
        end[r] = T.Select(p0 + T.int64(r) < n, base + T.int64(r) + T.min(w + (n - T.int64(1) - query[r]) // d + T.int64(1), band), T.int64(0))
    for r in range(rows):
        for vector in range(head_dim // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                queries[r, vector * T.int64(lanes) + lane] = T.Cast(
                    acc_dtype, t_rows[b, query[r], h, vector * T.int64(lanes) + lane]) * T.Cast(acc_dtype, scale)


@T.macro
def _attention_tile_blocks(tile_blocks, begin, end, rows, cols):
    """tile_blocks = the key blocks (relative to block0) holding a valid column of some row of the
    tile: at the sequence's ends and, dilated, at each residue class's ends the band reaches past
    the keys, and those blocks are neither computed nor read. Row 0 is inside the sequence and
    has a valid column (itself); rows past the end have begin = end = 0 and are left out."""
    tile_blocks[0] = begin[0]
    tile_blocks[1] = end[0]
    for r in range(1, rows):
        if begin[r] < end[r]:
            tile_blocks[0] = T.min(tile_blocks[0], begin[r])
            tile_blocks[1] = T.max(tile_blocks[1], end[r])
    tile_blocks[0] = tile_blocks[0] // T.int64(cols)
    tile_blocks[1] = (tile_blocks[1] + T.int64(cols - 1)) // T.int64(cols)


@T.macro
def _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, value):
    """scores[r] = value over the tile's computed columns outside [begin[r], end[r]) (all of them
    for a row past the end, whose begin = end = 0 lie left of them)."""
    _fill_run(scores, r, tile_blocks[0] * T.int64(cols), T.max(begin[r], tile_blocks[0] * T.int64(cols)), value, lanes)
    _fill_run(scores, r, T.max(end[r], tile_blocks[0] * T.int64(cols)), tile_blocks[1] * T.int64(cols), value, lanes)


@T.macro
def _attention_tile_scores(scores, acc, queries, keys, biases, block0, tile_blocks, head_dim, rows, cols, acc_dtype, with_bias):
    """scores[r, c] = queries[r] . packed key (block0 * cols + c) (+ that key's bias), for the key
    blocks [tile_blocks[0], tile_blocks[1]) (relative to block0)."""
    for block in range(tile_blocks[0], tile_blocks[1]):
        _zero_tile(acc, rows, cols, acc_dtype)
        for f in range(head_dim):
            for r in T.unroll(rows):
                for lane in T.vectorized(cols):
                    acc[r, lane] = acc[r, lane] + queries[r, f] * keys[block0 + block, f, lane]
        for r in T.unroll(rows):
            for lane in T.vectorized(cols):
                if with_bias:
                    scores[r, block * T.int64(cols) + lane] = acc[r, lane] + biases[(block0 + block) * T.int64(cols) + lane]
                else:
                    scores[r, block * T.int64(cols) + lane] = acc[r, lane]


@T.macro
def _attention_tile_context(out, out_acc, scores, values, row_scale, span, begin, end, query, b, h, p0, n, block0,
                            tile_blocks, head_dim, rows, cols, group, features, acc_dtype, dtype):
    """out row r = row_scale[r] * sum over c of scores[r, c] * packed value row (block0 * cols + c)."""
    for g in range(rows // group):
        # The columns some row of the group has; the other rows' weights there are 0. (Rows past
        # the end have begin = end = 0, left of the tile's computed blocks: not read.)
        span[0] = begin[g * group]
        span[1] = end[g * group]
        for r in range(1, group):
            span[0] = T.min(span[0], begin[g * group + r])
            span[1] = T.max(span[1], end[g * group + r])
        span[0] = T.max(span[0], tile_blocks[0] * T.int64(cols))
        for feature_tile in range(head_dim // T.int64(features)):
            column: T.let = feature_tile * T.int64(features)
            _zero_tile(out_acc, group, features, acc_dtype)
            for key in range(span[0], span[1]):
                for r in T.unroll(group):
                    _accumulate(out_acc, r, values, block0 * T.int64(cols) + key, column, features, scores[g * group + r, key])
            for r in T.unroll(group):
                if p0 + T.int64(g * group + r) < n:
                    for lane in T.vectorized(features):
                        out[b, query[g * group + r], h, column + lane] = T.Cast(dtype, out_acc[r, lane] * row_scale[g * group + r])


@T.macro
def _attention_tile_softmax(scores, partial, row_max, reciprocal, log_sum, begin, end, tile_blocks, rows, cols, lanes,
                            acc_dtype, minus_inf):
    """Each row, over the tile's computed blocks: -inf at its invalid and out-of-band columns (exp
    gives exactly 0 there), then exp(score - row max) in place, 1 / their sum, and the row's
    log-sum-exp of the scores (-inf for a row with no key)."""
    for r in range(rows):
        _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, minus_inf)
        for lane in T.vectorized(lanes):
            partial[lane] = minus_inf
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                partial[lane] = T.max(partial[lane], scores[r, vector * T.int64(lanes) + lane])
        row_max[0] = partial[0]
        for lane in range(1, lanes):
            row_max[0] = T.max(row_max[0], partial[lane])
        if row_max[0] == minus_inf:  # a row past the end (never stored): no NaN from -inf - -inf
            row_max[0] = T.Cast(acc_dtype, 0)
        for lane in T.vectorized(lanes):
            partial[lane] = T.Cast(acc_dtype, 0)
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                scores[r, vector * T.int64(lanes) + lane] = _exp(scores[r, vector * T.int64(lanes) + lane] - row_max[0], acc_dtype)
                partial[lane] = partial[lane] + scores[r, vector * T.int64(lanes) + lane]
        reciprocal[r] = T.Cast(acc_dtype, 0)
        for lane in range(lanes):
            reciprocal[r] = reciprocal[r] + partial[lane]
        log_sum[r] = row_max[0] + T.log(reciprocal[r])  # one scalar log per row; log(0) = -inf
        reciprocal[r] = T.Select(reciprocal[r] > T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 1) / reciprocal[r], T.Cast(acc_dtype, 0))


@T.macro
def _attention_tile_probs(scores, lse, query, begin, end, b, h, tile_blocks, rows, cols, lanes, acc_dtype, minus_inf):
    """The backward's P from the forward's log-sum-exp, in place over the tile's computed blocks:
    exp(score - lse) at each row's valid columns, exactly 0 elsewhere (-inf first) and in rows with
    no key (lse -inf) or past the end (no valid column)."""
    for r in range(rows):
        _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, minus_inf)
        row_lse: T.let = T.Select(lse[b, query[r], h] == minus_inf, T.Cast(acc_dtype, 0), lse[b, query[r], h])
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                scores[r, vector * T.int64(lanes) + lane] = _exp(scores[r, vector * T.int64(lanes) + lane] - row_lse, acc_dtype)


@T.macro
def _attention_tile_deltas(row_delta, partial, grad_rows, out, grad_lse, query, p0, n, b, h, head_dim, rows, lanes, acc_dtype):
    """row_delta[r] = rowsum(dO * O) less the log-sum-exp's gradient, per row of the tile (0 past the end):
    the softmax backward's shift, from the tile's dO rows already converted in grad_rows."""
    for r in range(rows):
        for lane in T.vectorized(lanes):
            partial[lane] = T.Cast(acc_dtype, 0)
        for vector in range(head_dim // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                partial[lane] = partial[lane] + grad_rows[r, vector * T.int64(lanes) + lane] * T.Cast(
                    acc_dtype, out[b, query[r], h, vector * T.int64(lanes) + lane])
        row_delta[r] = T.Cast(acc_dtype, 0) - grad_lse[b, query[r], h]
        for lane in range(lanes):
            row_delta[r] = row_delta[r] + partial[lane]
        if p0 + T.int64(r) >= n:
            row_delta[r] = T.Cast(acc_dtype, 0)


@T.macro
def _attention_tile_softmax_grad(grads, probs, row_delta, tile_blocks, rows, cols, lanes):
    """Softmax backward in place: grads (dP) -> dS = P * (dP - row_delta) over the tile's computed
    blocks (0 wherever P is 0; rows past the end have P = 0)."""
    for r in range(rows):
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                grads[r, vector * T.int64(lanes) + lane] = probs[r, vector * T.int64(lanes) + lane] * (
                    grads[r, vector * T.int64(lanes) + lane] - row_delta[r])


@T.macro
def _accumulate_keys(total, weights, tile_rows, first, start, width, head_dim, rows, keys, features, key_acc, acc_dtype):
    """total[first + c] += sum over the tile's rows r of weights[r, c] * tile_rows[r], for c in
    [start, start + width) (width a multiple of ``keys``): dK and dV, the transposed products, per
    tile. ``keys`` packed rows x ``features`` accumulate in registers; per tile row one broadcast per
    key, one load per vector."""
    for group in range(width // T.int64(keys)):
        for feature_tile in range(head_dim // T.int64(features)):
            column: T.let = feature_tile * T.int64(features)
            for j in T.unroll(keys):
                for lane in T.vectorized(features):
                    key_acc[j, lane] = total[first + start + group * T.int64(keys) + T.int64(j), column + lane]
            for r in range(rows):
                for j in T.unroll(keys):
                    _accumulate(key_acc, j, tile_rows, T.int64(r), column, features, weights[r, start + group * T.int64(keys) + T.int64(j)])
            for j in T.unroll(keys):
                for lane in T.vectorized(features):
                    total[first + start + group * T.int64(keys) + T.int64(j), column + lane] = key_acc[j, lane]


def _attention_sizes(dtype: str, autoregressive: bool, vector_bits: int) -> tuple:
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    rows, vectors = (16, 1) if vector_bits >= 512 else (6, 2)  # the Q.K^T tile, as in qk
    return (acc_dtype, lanes, rows, vectors * lanes,
            8 if vector_bits >= 512 else 6,  # rows of one probs.V register tile (as in pv)
            2 * lanes, 1 if autoregressive else 0, 64 * 8 // _BITS[dtype], tirx.const(float("-inf"), acc_dtype))


# Packed rows of one head's operands: the sequence with margins of a band and a few tiles.
def _packed_length(n, window, causal, rows, cols):
    return ((n + T.int64(2 - causal) * window + T.int64(1) + T.int64(rows + 4 * cols)) // T.int64(cols) + T.int64(1)) * T.int64(cols)


def attention(dtype: str, autoregressive: bool, vector_bits: int):
    """Fused local attention: ``out = softmax(scale * Q.K^T on the band) . V``, and each row's
    log-sum-exp.

    What :func:`qk`, a softmax over each row's valid keys and :func:`pv` compute one after the
    other, without the band in memory: per tile of ``rows`` consecutive packed queries, the
    Q.K^T micro-kernel writes the tile's scores (the keys it touches, a few more than the band)
    into a buffer that stays in cache; each row is exponentiated in place (0 at its invalid
    and out-of-band keys) and summed; the probs.V micro-kernel then streams the same packed
    value rows through once, and each output row is divided by its sum as it is stored.
    Arguments: q, k, v ``[b, n, h, f]``, key_bias ``[b, n]`` (accumulation dtype: 0, or -inf for
    a key no query attends to), dilation ``[h]``, the one-sided window ``w``, the score scale, the
    dropout probability p and its seed (p = 0: none; else each probability is kept with its
    factor 1/(1-p) or zeroed, by the stateless generator above, after lse), out
    ``[b, n, h, f]``, lse ``[b, n, h]`` (accumulation dtype: each row's log-sum-exp of its scaled,
    biased scores, -inf for a row with no key: what the backward recomputes the probabilities
    from, and what merges this result with attention to other keys, such as global tokens).
    A row with no key left gets 0.
    """
    acc_dtype, lanes, rows, cols, group, features, causal, per_line, minus_inf = _attention_sizes(dtype, autoregressive, vector_bits)

    @T.prim_func
    def main(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle, key_bias_handle: T.handle,
             dilation_handle: T.handle, window: T.int64, scale: T.float64, dropout: T.float64, seed: T.int64,
             out_handle: T.handle, lse_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        q = T.match_buffer(q_handle, (batch, n, heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (batch, n, heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (batch, n, heads, head_dim), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        w: T.let = window
        band: T.let = T.int64(2 - causal) * window + T.int64(1)
        margin: T.let = w + T.int64(cols)  # packed columns before the first key
        for bh in T.parallel(batch * heads):
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            row_of = T.decl_buffer((n,), "int64")
            keys = T.decl_buffer((_packed_length(n, window, causal, rows, cols) // T.int64(cols), head_dim, T.int64(cols)), acc_dtype)
            values = T.decl_buffer((_packed_length(n, window, causal, rows, cols), head_dim), acc_dtype)
            biases = T.decl_buffer((_packed_length(n, window, causal, rows, cols),), acc_dtype)
            scores = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            queries = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), acc_dtype, annotations=_ON_STACK)
            begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            row_scale = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            log_sum = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            row_max = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
            out_acc = T.alloc_local((group, features), acc_dtype, annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            _pack_operands(keys, values, biases, key_tile, k, v, key_bias, row_of, block_keys, b, h, n, head_dim,
                                     margin, _packed_length(n, window, causal, rows, cols) // T.int64(cols),
                                     cols, lanes, per_line, acc_dtype, True, True)
            for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + margin  # packed column of row 0's band column 0
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)  # scores column of row 0's band column 0
                _attention_tile_rows(query, begin, end, queries, q, row_of, b, h, n, head_dim, p0, w, d, band, base,
                                     scale, rows, lanes, acc_dtype)
                _attention_tile_blocks(tile_blocks, begin, end, rows, cols)
                _attention_tile_scores(scores, acc, queries, keys, biases, block0, tile_blocks, head_dim, rows, cols, acc_dtype, True)
                _attention_tile_softmax(scores, partial, row_max, row_scale, log_sum, begin, end, tile_blocks, rows, cols,
                                        lanes, acc_dtype, minus_inf)
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        lse[b, query[r], h] = log_sum[r]
                if dropout > T.float64(0):
                    _apply_dropout(scores, scores, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype)
                _attention_tile_context(out, out_acc, scores, values, row_scale, span, begin, end, query, b, h, p0, n,
                                        block0, tile_blocks, head_dim, rows, cols, group, features, acc_dtype, dtype)

    return main


def attention_backward(dtype: str, autoregressive: bool, vector_bits: int):
    """The fused kernel's backward, FlashAttention-style: dQ, dK and dV with no band in memory.

    Arguments: dO ``[b, n, h, f]``, q, k, v, key_bias, out and lse as in :func:`attention` (out and
    lse from its forward call), grad_lse ``[b, n, h]`` (the gradient of lse, accumulation dtype;
    it joins the softmax's shift delta = rowsum(dO * O) - grad_lse, computed per tile), dilation, ``w``,
    the score scale, the forward's dropout p and seed (its mask Z is regenerated: dP = (dO . V^T) * Z,
    dV from P * Z), dQ, dK, dV ``[b, n, h, f]``. Per (batch, head) K and V are packed as in the
    forward, and dK, dV accumulate over the tiles in packed rows (scratch of the packed operands'
    size), cast into place at the end. Per tile of ``rows`` packed queries, in cache: the
    scores again (the Q.K^T micro-kernel) and P = exp(score - lse); dP = dO . V^T (the same
    micro-kernel); dS = P * (dP - delta); dQ = scale * dS . K (the probs.V micro-kernel);
    dV += P^T dO and dK += dS^T (scale Q) over the keys the tile touches.
    """
    acc_dtype, lanes, rows, cols, group, features, causal, per_line, minus_inf = _attention_sizes(dtype, autoregressive, vector_bits)
    keys_per_update = 8 if vector_bits >= 512 else 4  # rows of the dK/dV register tile (x 2 vectors)

    @T.prim_func
    def main(grad_handle: T.handle, q_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
             key_bias_handle: T.handle, out_handle: T.handle, lse_handle: T.handle, grad_lse_handle: T.handle,
             dilation_handle: T.handle,
             window: T.int64, scale: T.float64, dropout: T.float64, seed: T.int64, grad_q_handle: T.handle, grad_k_handle: T.handle,
             grad_v_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        grad = T.match_buffer(grad_handle, (batch, n, heads, head_dim), dtype)
        q = T.match_buffer(q_handle, (batch, n, heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (batch, n, heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (batch, n, heads, head_dim), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        grad_lse = T.match_buffer(grad_lse_handle, (batch, n, heads), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        grad_q = T.match_buffer(grad_q_handle, (batch, n, heads, head_dim), dtype)
        grad_k = T.match_buffer(grad_k_handle, (batch, n, heads, head_dim), dtype)
        grad_v = T.match_buffer(grad_v_handle, (batch, n, heads, head_dim), dtype)
        w: T.let = window
        band: T.let = T.int64(2 - causal) * window + T.int64(1)
        margin: T.let = w + T.int64(cols)
        for bh in T.parallel(batch * heads):
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            row_of = T.decl_buffer((n,), "int64")
            keys_k = T.decl_buffer((_packed_length(n, window, causal, rows, cols) // T.int64(cols), head_dim, T.int64(cols)), acc_dtype)
            keys_v = T.decl_buffer((_packed_length(n, window, causal, rows, cols) // T.int64(cols), head_dim, T.int64(cols)), acc_dtype)
            rows_k = T.decl_buffer((_packed_length(n, window, causal, rows, cols), head_dim), acc_dtype)
            biases = T.decl_buffer((_packed_length(n, window, causal, rows, cols),), acc_dtype)
            total_k = T.decl_buffer((_packed_length(n, window, causal, rows, cols), head_dim), acc_dtype)
            total_v = T.decl_buffer((_packed_length(n, window, causal, rows, cols), head_dim), acc_dtype)
            probs = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            grads = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            kept = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)  # P with dropout
            queries = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)
            grad_rows = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), acc_dtype, annotations=_ON_STACK)
            begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            row_scale = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            row_delta = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
            out_acc = T.alloc_local((group, features), acc_dtype, annotations=_ON_STACK)
            key_acc = T.alloc_local((keys_per_update, features), acc_dtype, annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            _pack_operands(keys_k, rows_k, biases, key_tile, k, k, key_bias, row_of, block_keys, b, h, n, head_dim,
                                     margin, _packed_length(n, window, causal, rows, cols) // T.int64(cols),
                                     cols, lanes, per_line, acc_dtype, True, True)
            _pack_operands(keys_v, rows_k, biases, key_tile, v, v, key_bias, row_of, block_keys, b, h, n, head_dim,
                                     margin, _packed_length(n, window, causal, rows, cols) // T.int64(cols),
                                     cols, lanes, per_line, acc_dtype, False, False)
            for t in range(_packed_length(n, window, causal, rows, cols)):
                for vector in range(head_dim // T.int64(lanes)):
                    for lane in T.vectorized(lanes):
                        total_k[t, vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
                        total_v[t, vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
            for r in range(rows):
                row_scale[r] = T.Cast(acc_dtype, scale)
            for tile in range((n + T.int64(rows - 1)) // T.int64(rows)):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + margin
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)
                _attention_tile_rows(query, begin, end, queries, q, row_of, b, h, n, head_dim, p0, w, d, band, base,
                                     scale, rows, lanes, acc_dtype)
                _attention_tile_blocks(tile_blocks, begin, end, rows, cols)
                start: T.let = tile_blocks[0] * T.int64(cols)  # the computed columns: [start, start + width)
                width: T.let = (tile_blocks[1] - tile_blocks[0]) * T.int64(cols)
                _attention_tile_scores(probs, acc, queries, keys_k, biases, block0, tile_blocks, head_dim, rows, cols, acc_dtype, True)
                _attention_tile_probs(probs, lse, query, begin, end, b, h, tile_blocks, rows, cols, lanes, acc_dtype, minus_inf)
                _attention_tile_rows(query, begin, end, grad_rows, grad, row_of, b, h, n, head_dim, p0, w, d, band, base,
                                     T.float64(1), rows, lanes, acc_dtype)
                _attention_tile_deltas(row_delta, partial, grad_rows, out, grad_lse, query, p0, n, b, h, head_dim, rows,
                                       lanes, acc_dtype)
                _attention_tile_scores(grads, acc, grad_rows, keys_v, biases, block0, tile_blocks, head_dim, rows, cols, acc_dtype, False)
                if dropout > T.float64(0):  # the forward's mask Z: dP = (dO . V^T) * Z, dV from P * Z
                    for r in range(rows):
                        _fill_run(kept, r, start, start + width, T.Cast(acc_dtype, 0), lanes)
                    _apply_dropout(probs, kept, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype)
                    _apply_dropout(grads, grads, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype)
                _attention_tile_softmax_grad(grads, probs, row_delta, tile_blocks, rows, cols, lanes)
                _attention_tile_context(grad_q, out_acc, grads, rows_k, row_scale, span, begin, end, query, b, h, p0, n,
                                        block0, tile_blocks, head_dim, rows, cols, group, features, acc_dtype, dtype)
                if dropout > T.float64(0):
                    _accumulate_keys(total_v, kept, grad_rows, block0 * T.int64(cols), start, width, head_dim, rows,
                                     keys_per_update, features, key_acc, acc_dtype)
                else:
                    _accumulate_keys(total_v, probs, grad_rows, block0 * T.int64(cols), start, width, head_dim, rows,
                                     keys_per_update, features, key_acc, acc_dtype)
                _accumulate_keys(total_k, grads, queries, block0 * T.int64(cols), start, width, head_dim, rows,
                                 keys_per_update, features, key_acc, acc_dtype)
            for p in range(n):
                for vector in range(head_dim // T.int64(lanes)):
                    for lane in T.vectorized(lanes):
                        grad_k[b, row_of[p], h, vector * T.int64(lanes) + lane] = T.Cast(
                            dtype, total_k[margin + p, vector * T.int64(lanes) + lane])
                        grad_v[b, row_of[p], h, vector * T.int64(lanes) + lane] = T.Cast(
                            dtype, total_v[margin + p, vector * T.int64(lanes) + lane])

    return main


# ----------------------------------------------------------------------------- band softmax
# The original API's path (Q.K^T band, mask, softmax, probs.V) on one band: the softmax runs in place
# over each row's valid keys and applies the invalid-location mask itself, so no mask tensor, no
# second band and one pass through memory (each row, a few KiB, stays in L1 across its passes).


@T.macro
def _row_span(first, stop, i, d, w, n, band):
    """The row's valid band columns [first, stop): key i + d (j - w) inside [0, n)."""
    first[0] = T.max(w - i // d, T.int64(0))
    stop[0] = T.min(w + (n - T.int64(1) - i) // d + T.int64(1), band)


def _row_vectors(first, stop, lanes):
    """Whole vectors of the span [first, stop), and where its scalar tail begins."""
    return (stop - first) // T.int64(lanes), first + (stop - first) // T.int64(lanes) * T.int64(lanes)


def softmax(dtype: str, autoregressive: bool, vector_bits: int):
    """In place: each row of ``band [b, n, h, c]`` becomes the softmax of its scores over the row's
    valid keys (exactly 0 at the others), and ``lse [b, n, h]`` (accumulation dtype) gets the row's
    log-sum-exp. ``key_bias [b, n]`` (accumulation dtype; read only when ``with_bias`` is nonzero)
    is added to the scores of each key first: -inf removes the key (padding). A row with no key
    left (every score -inf) gets 0 and lse -inf, not NaN. Per row: a max pass (adding the bias and
    storing the biased scores, exact for 0 and -inf), a pass storing exp(score - max) and summing
    it, and a pass scaling by 1 / sum. Half types recompute the exponential in the last pass
    instead of storing it, so that they round once (a row stays in L1 across its passes either way).
    """
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)
    store_exp = dtype == acc_dtype

    @T.prim_func
    def main(band_handle: T.handle, key_bias_handle: T.handle, with_bias: T.int64, dilation_handle: T.handle,
             lse_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        width = T.int64()
        scores = T.match_buffer(band_handle, (batch, n, heads, width), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        w: T.let = T.int64(causal) * (width - T.int64(1)) + T.int64(1 - causal) * ((width - T.int64(1)) // T.int64(2))
        for bi in T.parallel(batch * n):
            b: T.let = bi // n
            i: T.let = bi % n
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            row_max = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            first = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            stop = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            for h in range(heads):
                d: T.let = T.Cast("int64", dilation[h])
                _row_span(first, stop, i, d, w, n, width)
                if with_bias != T.int64(0):
                    for j in range(first[0], stop[0]):
                        scores[b, i, h, j] = T.Cast(dtype, T.Cast(acc_dtype, scores[b, i, h, j]) + key_bias[b, i + d * (j - w)])
                vectors, tail = _row_vectors(first[0], stop[0], lanes)
                for lane in T.vectorized(lanes):
                    partial[lane] = minus_inf
                for vector in range(vectors):
                    for lane in T.vectorized(lanes):
                        partial[lane] = T.max(partial[lane], T.Cast(acc_dtype, scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]))
                row_max[0] = minus_inf
                for lane in range(lanes):
                    row_max[0] = T.max(row_max[0], partial[lane])
                for j in range(tail, stop[0]):
                    row_max[0] = T.max(row_max[0], T.Cast(acc_dtype, scores[b, i, h, j]))
                if row_max[0] == minus_inf:  # no key left: exp gives 0 everywhere, no NaN from -inf - -inf
                    row_max[0] = T.Cast(acc_dtype, 0)
                for lane in T.vectorized(lanes):
                    partial[lane] = T.Cast(acc_dtype, 0)
                if store_exp:  # the band holds the accumulation dtype: keep each exp, rescale it below
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] = _exp(
                                scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] - row_max[0], acc_dtype)
                            partial[lane] = partial[lane] + scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]
                else:
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            partial[lane] = partial[lane] + _exp(
                                T.Cast(acc_dtype, scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]) - row_max[0], acc_dtype)
                total[0] = T.Cast(acc_dtype, 0)
                for lane in range(lanes):
                    total[0] = total[0] + partial[lane]
                for j in range(tail, stop[0]):
                    if store_exp:
                        scores[b, i, h, j] = _exp(scores[b, i, h, j] - row_max[0], acc_dtype)
                        total[0] = total[0] + scores[b, i, h, j]
                    else:
                        total[0] = total[0] + _exp(T.Cast(acc_dtype, scores[b, i, h, j]) - row_max[0], acc_dtype)
                lse[b, i, h] = row_max[0] + T.log(total[0])  # log(0) = -inf: a row with no key
                total[0] = T.Select(total[0] > T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 1) / total[0], T.Cast(acc_dtype, 0))
                if store_exp:
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] = \
                                scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] * total[0]
                    for j in range(tail, stop[0]):
                        scores[b, i, h, j] = scores[b, i, h, j] * total[0]
                else:
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] = T.Cast(dtype, _exp(
                                T.Cast(acc_dtype, scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]) - row_max[0],
                                acc_dtype) * total[0])
                    for j in range(tail, stop[0]):
                        scores[b, i, h, j] = T.Cast(dtype, _exp(T.Cast(acc_dtype, scores[b, i, h, j]) - row_max[0], acc_dtype) * total[0])
                for j in range(first[0]):
                    scores[b, i, h, j] = T.Cast(dtype, 0)
                for j in range(stop[0], width):
                    scores[b, i, h, j] = T.Cast(dtype, 0)

    return main


def softmax_backward(dtype: str, autoregressive: bool, vector_bits: int):
    """The gradient of :func:`softmax`'s scores: ``out = P * (dP - rowsum(dP * P) + dlse)`` at each
    row's valid keys (d lse / d score = P), 0 at the others. Arguments: probs ``P`` and ``grad``
    ``dP`` ``[b, n, h, c]``, ``grad_lse [b, n, h]`` (accumulation dtype), dilation, out
    ``[b, n, h, c]`` (not aliasing the others)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = vector_bits // (64 if acc_dtype == "float64" else 32)
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(probs_handle: T.handle, grad_handle: T.handle, grad_lse_handle: T.handle, dilation_handle: T.handle,
             out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        width = T.int64()
        probs = T.match_buffer(probs_handle, (batch, n, heads, width), dtype)
        grad = T.match_buffer(grad_handle, (batch, n, heads, width), dtype)
        grad_lse = T.match_buffer(grad_lse_handle, (batch, n, heads), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, width), dtype)
        w: T.let = T.int64(causal) * (width - T.int64(1)) + T.int64(1 - causal) * ((width - T.int64(1)) // T.int64(2))
        for bi in T.parallel(batch * n):
            b: T.let = bi // n
            i: T.let = bi % n
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            shift = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            first = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            stop = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            for h in range(heads):
                d: T.let = T.Cast("int64", dilation[h])
                _row_span(first, stop, i, d, w, n, width)
                vectors, tail = _row_vectors(first[0], stop[0], lanes)
                for lane in T.vectorized(lanes):
                    partial[lane] = T.Cast(acc_dtype, 0)
                for vector in range(vectors):
                    for lane in T.vectorized(lanes):
                        partial[lane] = partial[lane] + T.Cast(acc_dtype, probs[b, i, h, first[0] + vector * T.int64(lanes) + lane]) * T.Cast(
                            acc_dtype, grad[b, i, h, first[0] + vector * T.int64(lanes) + lane])
                shift[0] = T.Cast(acc_dtype, 0) - grad_lse[b, i, h]
                for lane in range(lanes):
                    shift[0] = shift[0] + partial[lane]
                for j in range(tail, stop[0]):
                    shift[0] = shift[0] + T.Cast(acc_dtype, probs[b, i, h, j]) * T.Cast(acc_dtype, grad[b, i, h, j])
                for vector in range(vectors):
                    for lane in T.vectorized(lanes):
                        out[b, i, h, first[0] + vector * T.int64(lanes) + lane] = T.Cast(dtype, T.Cast(
                            acc_dtype, probs[b, i, h, first[0] + vector * T.int64(lanes) + lane]) * (T.Cast(
                                acc_dtype, grad[b, i, h, first[0] + vector * T.int64(lanes) + lane]) - shift[0]))
                for j in range(tail, stop[0]):
                    out[b, i, h, j] = T.Cast(dtype, T.Cast(acc_dtype, probs[b, i, h, j]) * (T.Cast(acc_dtype, grad[b, i, h, j]) - shift[0]))
                for j in range(first[0]):
                    out[b, i, h, j] = T.Cast(dtype, 0)
                for j in range(stop[0], width):
                    out[b, i, h, j] = T.Cast(dtype, 0)

    return main


HAND_WRITTEN = {"qk": qk, "pv": pv, "transposed": transposed, "attention": attention,
                "attention_backward": attention_backward, "softmax": softmax, "softmax_backward": softmax_backward}
