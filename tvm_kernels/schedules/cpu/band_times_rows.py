"""probs.V and the transposed (backward) product on the CPU: a band times rows, register tiles
of consecutive packed queries x output features (see the package docstring)."""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, is_half
from tvm_kernels.schedules.cpu import bf16_dot
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _ROWS_AHEAD,
    _accumulate,
    _fill_residue_major,
    _load_tile,
    _prefetch_element,
    _prefetch_line,
    _prefetch_row,
    _run_tiles,
    _save_tile,
    _store_tile,
    _tile_bounds,
    _zero_tile,
)
from tvm_kernels.schedules.cpu.tiles import Tiles, tiles_for


def pv(dtype: str, autoregressive: bool, isa: str):
    """The probs.V PrimFunc; the arguments of :func:`tvm_kernels.compute.pv`, then ``runs``
    (int64: runs of query tiles per (batch, head), :func:`microkernels._run_tiles`; the results
    do not depend on it).

    The transpose of the Q.K^T tiling: per tile of ``rows`` consecutive packed queries, the
    output features accumulate in registers (``rows x 2`` vectors) while the packed value
    rows the tile touches stream through once, one broadcast weight per row (row r's weight
    for the k-th packed row is its band column k - r) and two vector FMAs each.
    ``head_dim`` must be a multiple of ``2 * lanes`` (the runtime zero-pads).
    """
    return _band_times_rows(dtype, autoregressive, tiles_for(isa), transposed=False)


def transposed(dtype: str, autoregressive: bool, isa: str):
    """The transposed (backward) PrimFunc; the arguments of :func:`tvm_kernels.compute.transposed`,
    then ``runs`` (as :func:`pv`).

    The probs.V loop nest with other weights: query i's weight for row
    ``p = i + d*(j - w_upper)`` is ``t1[p, band - 1 - j]``, a column of *another* band row.
    For a tile of consecutive packed queries, the weights of the k-th packed row they touch
    are ``rows`` consecutive entries of that row's band: the FMA loop broadcasts them from
    there (tiles in one residue class), or the weight buffer is built transposed
    (``weights[k, r]``), one short vector load per row (the other tiles).
    """
    return _band_times_rows(dtype, autoregressive, tiles_for(isa), transposed=True)


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


def _band_times_rows(dtype: str, autoregressive: bool, tiles: Tiles, transposed: bool):
    """``tiles``: this ISA's tiles and loop choices (tiles.py has why). bfloat16 on an ISA with the
    bfloat16 dot product: the same tiles two keys per step (bf16_dot.py)."""
    if tiles.dot_product_for(dtype):
        return bf16_dot.band_times_pairs(autoregressive, tiles.band_rows, transposed)
    acc_dtype = accumulation_dtype(dtype)
    lanes = tiles.vector_bits // (64 if acc_dtype == "float64" else 32)
    half = is_half(dtype)
    rows = tiles.band_rows
    cols = 2 * lanes  # output features of one register tile
    wide_cols = 4 * lanes if tiles.wide_half_tile and half else 0  # 0: no wide tile (of 4 rows)
    if wide_cols and rows % 4:
        raise ValueError(f"tiles.py: band_rows {rows} must be a multiple of the wide tile's 4 rows")
    # The direct path's steps per chunk (0: one chunk), and whether half types convert a chunk's
    # weights once into a small buffer instead of at each use (one per feature tile).
    chunk_steps = tiles.chunk_steps
    stage_weights = tiles.stage_half_weights and half
    causal = 1 if autoregressive else 0
    per_line = 64 * 8 // _BITS[dtype]  # elements of one 64-byte cache line
    # Row offset of band column 0: w for probs.V; w_upper (w, or 0 when causal) for transposed.
    offset_is_w = 0 if transposed and autoregressive else 1

    @T.macro
    def tiles(
        t1,
        band_flat,
        out,
        row_of,
        packed,
        b,
        h,
        d,
        n,
        heads,
        band,
        head_dim,
        offset,
        margin,
        tile_begin,
        tile_end,
        rows,
        cols,
    ):
        """The tiles [tile_begin, tile_end) of ``rows`` packed rows x ``cols`` output features (the
        packed rows start at the first tile's first step: ``margin`` rows before the first row).
        ``band_flat``: t1 as one flat buffer, for the direct loops' addresses (below)."""
        weights = T.decl_buffer(
            (band + T.int64(rows), T.int64(rows)) if transposed else (T.int64(rows), band + T.int64(rows)), acc_dtype
        )
        query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        next_row = T.alloc_local((rows,), "int64", annotations=_ON_STACK)  # flat index of each next row's band
        low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
        acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
        sums = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)  # the direct path's tile between phases
        staged = T.decl_buffer(
            (T.int64(max(chunk_steps, 1)), T.int64(rows))
            if transposed  # a chunk's weights
            else (T.int64(rows), T.int64(max(chunk_steps, 1))),
            acc_dtype,
        )
        for tile in range(tile_begin, tile_end):
            p0: T.let = tile * T.int64(rows)
            _tile_bounds(query, low, high, row_of, p0, n, d, offset, band, rows)
            first: T.let = p0 - offset + margin  # packed row of k = 0
            # Row r's weight for the k-th packed row (p0 - offset + k) belongs to band column j = k - r.
            # When the tile's rows are consecutive in one residue class (all but about one tile
            # per class), the keys inside the sequence are the same packed rows for every row:
            # k in [low[0], k_end), and row r has a column there iff r <= k < r + band.
            k_end: T.let = T.min(offset + (n - T.int64(1) - query[0]) // d + T.int64(1), band + T.int64(rows - 1))
            if (
                p0 + T.int64(rows) <= n
                and query[rows - 1] == query[0] + T.int64(rows - 1) * d
                and band >= T.int64(rows - 1)
            ):
                # The FMA loop reads its weights straight from the band rows; only the two
                # triangles k < rows - 1 and k >= band, where some row has no column, select.
                k_low: T.let = T.max(low[0], T.int64(rows - 1))
                # Transposed: the flat index of step k's first weight is weights_at + k * weights_step.
                weights_at: T.let = ((b * n + query[0] - offset * d) * heads + h) * band + band - T.int64(1)
                weights_step: T.let = d * heads * band - T.int64(1)
                k_high: T.let = T.max(T.min(k_end, band), k_low)
                for feature_tile in range(head_dim // T.int64(cols)):
                    _zero_tile(acc, rows, cols, acc_dtype)
                    for k in range(low[0], T.max(T.min(k_end, T.int64(rows - 1)), low[0])):
                        for r in T.unroll(rows):
                            _accumulate(
                                acc,
                                r,
                                packed,
                                first + k,
                                feature_tile * T.int64(cols),
                                cols,
                                T.Select(
                                    k >= T.int64(r),
                                    _band_weight(
                                        t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, True
                                    ),
                                    T.Cast(acc_dtype, 0),
                                ),
                            )
                    _save_tile(sums, acc, feature_tile * T.int64(cols), rows, cols)
                for r in range(rows):
                    next_row[r] = ((b * n + row_of[T.min(p0 + T.int64(rows + r), n - T.int64(1))]) * heads + h) * band
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
                                _prefetch_element(
                                    band_flat, next_row[r] + T.min(chunk + T.int64(line * per_line), band - T.int64(1))
                                )
                    if stage_weights:
                        _stage_chunk(
                            staged,
                            t1,
                            query,
                            b,
                            h,
                            d,
                            offset,
                            band,
                            chunk,
                            k_from,
                            k_to,
                            chunk_steps,
                            rows,
                            acc_dtype,
                            transposed,
                        )
                    for feature_tile in range(head_dim // T.int64(cols)):
                        _load_tile(acc, sums, feature_tile * T.int64(cols), rows, cols)
                        for k in range(k_from, k_to):
                            if transposed:
                                # Step k's weights: columns band - 1 - k + r of the band row of packed
                                # row p0 - offset + k, in the tile's residue class (the loop bounds
                                # keep it there), so their flat index advances by a constant per
                                # step. Written as t1[b, row, h, column], it cost ~20 integer
                                # operations a step, against 16 FMAs (perf on an Intel Xeon).
                                at: T.let = weights_at + k * weights_step
                                if not stage_weights:
                                    # The next tile reads the next `rows` entries of this band row
                                    # (its last one `2 * rows - 1` on): fetch that line now, in the
                                    # first feature pass (for the first steps it is the next head's
                                    # row: a hint, harmless). Without it head_dim 32 (one pass per
                                    # tile) ran 2.5x slower per FLOP than 64 (bench/NOTES.md).
                                    if feature_tile == T.int64(0):
                                        _prefetch_element(band_flat, at + T.int64(2 * rows - 1))
                                for r in T.unroll(rows):
                                    _accumulate(
                                        acc,
                                        r,
                                        packed,
                                        first + k,
                                        feature_tile * T.int64(cols),
                                        cols,
                                        staged[k - chunk, r]
                                        if stage_weights
                                        else T.Cast(acc_dtype, band_flat[at + T.int64(r)]),
                                    )
                            else:
                                if chunk_steps == 0:
                                    # Fetch the next tile's band rows, a line per step, in the first
                                    # feature pass (the others would ask for the same lines again).
                                    if feature_tile == T.int64(0):
                                        _prefetch_element(
                                            band_flat,
                                            next_row[k % T.int64(rows)]
                                            + T.min(k // T.int64(rows) * T.int64(per_line), band - T.int64(1)),
                                        )
                                for r in T.unroll(rows):
                                    _accumulate(
                                        acc,
                                        r,
                                        packed,
                                        first + k,
                                        feature_tile * T.int64(cols),
                                        cols,
                                        staged[r, k - chunk]
                                        if stage_weights
                                        else _band_weight(
                                            t1,
                                            row_of,
                                            query,
                                            b,
                                            h,
                                            p0,
                                            offset,
                                            k,
                                            r,
                                            n,
                                            band,
                                            acc_dtype,
                                            transposed,
                                            False,
                                        ),
                                    )
                        _save_tile(sums, acc, feature_tile * T.int64(cols), rows, cols)
                for feature_tile in range(head_dim // T.int64(cols)):
                    _load_tile(acc, sums, feature_tile * T.int64(cols), rows, cols)
                    for k in range(T.max(low[0], band), T.max(k_end, T.max(low[0], band))):
                        for r in T.unroll(rows):
                            _accumulate(
                                acc,
                                r,
                                packed,
                                first + k,
                                feature_tile * T.int64(cols),
                                cols,
                                T.Select(
                                    k - T.int64(r) < band,
                                    _band_weight(
                                        t1, row_of, query, b, h, p0, offset, k, r, n, band, acc_dtype, transposed, True
                                    ),
                                    T.Cast(acc_dtype, 0),
                                ),
                            )
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
                                    T.Cast(acc_dtype, t1[b, row, h, band - T.int64(1) - k + T.int64(r)]),
                                    T.Cast(acc_dtype, 0),
                                )
                        else:  # the band's first and last columns: clamp the read, the weight is 0 anyway
                            for r in range(rows):
                                weights[k, r] = T.Select(
                                    k - T.int64(r) >= low[r] and k - T.int64(r) < high[r],
                                    T.Cast(
                                        acc_dtype,
                                        t1[
                                            b,
                                            row,
                                            h,
                                            T.max(
                                                T.min(band - T.int64(1) - k + T.int64(r), band - T.int64(1)), T.int64(0)
                                            ),
                                        ],
                                    ),
                                    T.Cast(acc_dtype, 0),
                                )
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
                                    vector * T.int64(lanes) + lane >= low[r]
                                    and vector * T.int64(lanes) + lane < high[r],
                                    T.Cast(acc_dtype, t1[b, query[r], h, vector * T.int64(lanes) + lane]),
                                    T.Cast(acc_dtype, 0),
                                )
                        for j in range(band // T.int64(lanes) * T.int64(lanes), band):
                            weights[r, T.int64(r) + j] = T.Select(
                                j >= low[r] and j < high[r],
                                T.Cast(acc_dtype, t1[b, query[r], h, j]),
                                T.Cast(acc_dtype, 0),
                            )
                        for k in range(T.int64(r) + band, band + T.int64(rows - 1)):
                            weights[r, k] = T.Cast(acc_dtype, 0)
                for feature_tile in range(head_dim // T.int64(cols)):
                    column: T.let = feature_tile * T.int64(cols)
                    _zero_tile(acc, rows, cols, acc_dtype)
                    for k in range(band + T.int64(rows - 1)):
                        for r in T.unroll(rows):
                            _accumulate(
                                acc, r, packed, first + k, column, cols, weights[k, r] if transposed else weights[r, k]
                            )
                    _store_tile(out, acc, b, h, query, p0, n, column, rows, cols, dtype)

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, out_handle: T.handle, runs: T.int64):
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
        band_flat = T.decl_buffer((batch * n * heads * band,), dtype, data=t1.data)
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        offset: T.let = T.int64(offset_is_w) * w
        tiles_total: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles_total, w, rows, runs)  # (microkernels.py)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles_total)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles_total)
            # Packed rows from ``rows`` before the run's first step on (the first row is margin rows in).
            margin: T.let = offset + T.int64(rows) - tile_begin * T.int64(rows)
            length: T.let = run_tiles * T.int64(rows) + T.int64(2) * band + T.int64(2 * rows)
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer((length, head_dim), acc_dtype)
            _fill_residue_major(row_of, n, d)
            for t in range(length):
                p: T.let = t - margin  # packed position
                if p >= T.int64(0) and p < n:
                    source: T.let = row_of[p]
                    _prefetch_row(t2, b, row_of[T.min(p + T.int64(_ROWS_AHEAD), n - T.int64(1))], h, head_dim, per_line)
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(
                                acc_dtype, t2[b, source, h, vector * T.int64(lanes) + lane]
                            )
                else:
                    for vector in range(head_dim // T.int64(lanes)):
                        for lane in T.vectorized(lanes):
                            packed[t, vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
            if wide_cols > 0 and head_dim % T.int64(wide_cols) == 0:
                tiles(
                    t1,
                    band_flat,
                    out,
                    row_of,
                    packed,
                    b,
                    h,
                    d,
                    n,
                    heads,
                    band,
                    head_dim,
                    offset,
                    margin,
                    tile_begin * T.int64(rows // 4),
                    T.min(tile_end * T.int64(rows // 4), (n + T.int64(3)) // T.int64(4)),
                    4,
                    wide_cols,
                )
            else:
                tiles(
                    t1,
                    band_flat,
                    out,
                    row_of,
                    packed,
                    b,
                    h,
                    d,
                    n,
                    heads,
                    band,
                    head_dim,
                    offset,
                    margin,
                    tile_begin,
                    tile_end,
                    rows,
                    cols,
                )

    return main
