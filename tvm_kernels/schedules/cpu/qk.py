"""Q.K^T on the CPU: the band of scores from register tiles of packed queries x packed key
blocks, stored skewed into the band (see the package docstring)."""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu import bf16_dot
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _copy_run,
    _feature_major,
    _fill_residue_major,
    _fill_run,
    _pack_operands,
    _rows_feature_major,
    _run_origin,
    _run_tiles,
    _valid_span,
    _zero_tile,
)
from tvm_kernels.schedules.cpu.tiles import tiles_for


def qk(dtype: str, autoregressive: bool, isa: str):
    """The Q.K^T PrimFunc; the arguments of :func:`tvm_kernels.compute.qk`, then ``runs``
    (int64: runs of query tiles per (batch, head), :func:`microkernels._run_tiles`; the results
    do not depend on it).

    bfloat16 where the ISA has the bfloat16 dot product: keys packed as pairs of features
    (:func:`bf16_dot.pack_key_pairs`), each micro-kernel step takes two features.
    """
    acc_dtype = accumulation_dtype(dtype)
    tiles = tiles_for(isa)  # this ISA's choices, and why: tiles.py
    lanes = tiles.vector_bits // (64 if acc_dtype == "float64" else 32)
    rows, vectors = tiles.qk_rows, tiles.qk_vectors
    cols = vectors * lanes  # keys per packed block = one register tile's width
    slack = rows + cols  # row buffer margin on each side of the band
    per_line = 64 * 8 // _BITS[dtype]  # elements of one 64-byte cache line
    causal = 1 if autoregressive else 0
    dot = tiles.dot_product_for(dtype)
    features_per_step = 2 if dot else 1  # packed keys: features (FMA) or pairs of features (dot)
    packed_dtype = "int32" if dot else acc_dtype
    # The tile's queries feature-major: its micro-kernel then reads them at constant offsets.
    transposed = _feature_major(dot, rows, lanes)

    @T.prim_func
    def main(
        t1_handle: T.handle,
        t2_handle: T.handle,
        dilation_handle: T.handle,
        padding: T.float64,
        out_handle: T.handle,
        runs: T.int64,
    ):
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
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)  # (microkernels.py)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            run_margin: T.let = margin - _run_origin(tile_begin * T.int64(rows) - w + margin, cols)
            blocks: T.let = (run_tiles * T.int64(rows) + band + T.int64(rows + 4 * cols)) // T.int64(cols) + T.int64(1)
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer((blocks, head_dim // T.int64(features_per_step), T.int64(cols)), packed_dtype)
            row_buffer = T.decl_buffer((T.int64(rows), band + T.int64(2 * slack)), acc_dtype)
            # The tile's query rows, converted once (the dot product: as words, copied)
            queries = T.decl_buffer(
                (head_dim, T.int64(rows)) if transposed else (T.int64(rows), head_dim // T.int64(features_per_step)),
                packed_dtype,
            )
            query_tile = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            query_scratch = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), packed_dtype, annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            direct_begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            direct_end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            valid_span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            if dot:
                # bfloat16 rows as 32-bit words, each a pair of features (the dot product's operands).
                key_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=t2.data)
                bf16_dot.pack_key_pairs(
                    packed,
                    key_words,
                    key_tile,
                    row_of,
                    block_keys,
                    t2,
                    b,
                    h,
                    n,
                    head_dim,
                    run_margin,
                    blocks,
                    cols,
                    per_line,
                )
            else:
                # Keys only (the values and biases arguments are not used).
                _pack_operands(
                    packed,
                    packed,
                    packed,
                    key_tile,
                    t2,
                    t2,
                    t2,
                    row_of,
                    block_keys,
                    b,
                    h,
                    n,
                    head_dim,
                    run_margin,
                    blocks,
                    cols,
                    lanes,
                    per_line,
                    acc_dtype,
                    False,
                    False,
                )
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + run_margin  # packed column of row 0's band column 0
                for r in T.unroll(rows):
                    query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
                    # Valid band columns: 0 <= i + d*(j - w) < n  <=>  low <= j < high.
                    low[r] = T.max(w - query[r] // d, T.int64(0))
                    high[r] = T.min(w + (n - T.int64(1) - query[r]) // d + T.int64(1), band)
                    # Key blocks whose columns for row r (block * cols - first - r + 0..cols-1) are all
                    # valid go straight from the registers to the output row: those stores then
                    # overlap the next blocks' FMAs (stored at the end, they stalled on memory).
                    direct_begin[r] = (low[r] + first + T.int64(r) + T.int64(cols - 1)) // T.int64(cols)
                    direct_end[r] = T.Select(
                        p0 + T.int64(r) < n, (high[r] + first + T.int64(r)) // T.int64(cols), T.int64(0)
                    )
                if dot:
                    query_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=t1.data)
                    bf16_dot.copy_word_rows(queries, query_words, query, b, h, head_dim, rows)
                elif transposed:
                    _rows_feature_major(
                        queries, query_tile, query_scratch, t1, query, b, h, head_dim, T.float64(1), lanes, acc_dtype
                    )
                else:
                    for r in range(rows):
                        for vector in range(head_dim // T.int64(lanes)):
                            for lane in T.vectorized(lanes):
                                queries[r, vector * T.int64(lanes) + lane] = T.Cast(
                                    acc_dtype, t1[b, query[r], h, vector * T.int64(lanes) + lane]
                                )
                # Only the key blocks holding a valid column of some row: near the sequence's ends (and,
                # dilated, near each residue class's ends) the rest of the band is padding, filled below.
                _valid_span(valid_span, low, high, first, p0, n, rows)
                for block in range(
                    valid_span[0] // T.int64(cols), (valid_span[1] + T.int64(cols - 1)) // T.int64(cols)
                ):
                    _zero_tile(acc, rows, cols, acc_dtype)
                    if dot:
                        bf16_dot.dot_key_block(acc, queries, T.int64(0), packed, block, head_dim, rows, vectors)
                    else:
                        for f in range(head_dim):
                            for r in T.unroll(rows):
                                for lane in T.vectorized(cols):
                                    if transposed:
                                        acc[r, lane] = acc[r, lane] + queries[f, r] * packed[block, f, lane]
                                    else:
                                        acc[r, lane] = acc[r, lane] + queries[r, f] * packed[block, f, lane]
                    for r in T.unroll(rows):
                        # Row r's band column j is packed column first + r + j.
                        if block >= direct_begin[r] and block < direct_end[r]:
                            # Rounded without _rounded's NaN guard: a score is a sum of products of
                            # the inputs' own values, so in bfloat16 its NaNs are the inputs' (quieted,
                            # payload kept: low half zero) or x86's default NaN 0xffc00000, which
                            # TVM's rounding keeps NaN. The guard took ~12% of bfloat16 Q.K^T's time on
                            # AVX2 (bench/NOTES.md). The row buffer's runs keep it: they hold the padding.
                            for lane in T.vectorized(cols):
                                out[b, query[r], h, block * T.int64(cols) - first - T.int64(r) + lane] = T.Cast(
                                    dtype, acc[r, lane]
                                )
                        else:
                            for lane in T.vectorized(cols):
                                row_buffer[r, block * T.int64(cols) - first - T.int64(r) + T.int64(slack) + lane] = acc[
                                    r, lane
                                ]
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        # The rest of the row from the row buffer: padding outside [low, high), and
                        # the partial blocks at both ends of the directly stored run [done_begin, done_end).
                        done_begin: T.let = T.Select(
                            direct_begin[r] < direct_end[r], direct_begin[r] * T.int64(cols) - first - T.int64(r), band
                        )
                        done_end: T.let = T.Select(
                            direct_begin[r] < direct_end[r], direct_end[r] * T.int64(cols) - first - T.int64(r), band
                        )
                        _fill_run(
                            row_buffer, r, T.int64(slack), T.int64(slack) + low[r], T.Cast(acc_dtype, padding), lanes
                        )
                        _fill_run(
                            row_buffer,
                            r,
                            T.int64(slack) + high[r],
                            T.int64(slack) + band,
                            T.Cast(acc_dtype, padding),
                            lanes,
                        )
                        _copy_run(
                            out, b, query[r], h, row_buffer, r, T.int64(slack), T.int64(0), done_begin, lanes, dtype
                        )
                        _copy_run(out, b, query[r], h, row_buffer, r, T.int64(slack), done_end, band, lanes, dtype)

    return bf16_dot.with_dot_product(main) if dot else main
