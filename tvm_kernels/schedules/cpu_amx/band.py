"""The standalone band products on AMX tiles (bfloat16 operands, float32 sums): Q.K^T, probs.V and
the transposed product, with :func:`cpu.qk.qk`'s and :func:`cpu.band_times_rows.pv`'s arguments
and results (the partition into (batch, head, run) tasks and the dilation's residue-major packing
are those kernels').

Each works on tiles of 16 packed queries and the whole blocks of 16 packed keys that hold any of
their rows' valid band columns (row r's band column j is packed key first + r + j; near the
sequence's ends, and dilated near each residue class's ends, the rest of the band is padding).

- Q.K^T: the fused forward's product (matrix.tile_scores): the keys packed as feature pairs, the
  tile's queries as 32-bit words, four key blocks per step into a tile-wide row buffer, from which
  each row's band is cut and rounded, padding outside its valid columns.
- probs.V: the fused forward's P.V (matrix.tile_context): the tile's band rows copied, skewed, into
  a row buffer of key columns (zero elsewhere), taken as pairs of columns against the values
  packed as pairs of rows.
- transposed: out^T = V^T W^T, so that the band is read along its rows: row r's weight at tile
  column c is column band - 1 - (c - base - r) of the band row of packed key c, so a column pair's
  16 rows' weights are two runs of 16 consecutive band values (B, one row per column pair), and V^T
  (A: features x pairs of rows) is packed once per task; each 16 x 16 result is transposed back.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.schedules.cpu import bf16_dot
from tvm_kernels.schedules.cpu.bf16_dot import _pair
from tvm_kernels.schedules.cpu.microkernels import (
    _ON_STACK,
    _copy_run,
    _fill_residue_major,
    _prefetch_element,
    _rounded,
    _run_origin,
    _run_tiles,
    _tile_bounds,
    _transpose_square,
    _valid_span,
)
from tvm_kernels.schedules.cpu_amx.matrix import (
    KEYS,
    PAIRS,
    ROWS,
    _configure,
    _load,
    _multiply,
    _release,
    _store,
    _zero,
    tile_context,
    tile_scores,
)

_PER_LINE = 32  # bfloat16 elements of one 64-byte cache line


@T.macro
def _tile_blocks(tile_blocks, span, low, high, first, block0, p0, n):
    """tile_blocks = the key blocks, relative to block0, holding a valid band column of some row."""
    _valid_span(span, low, high, first, p0, n, ROWS)
    tile_blocks[0] = span[0] // T.int64(KEYS) - block0
    tile_blocks[1] = T.max((span[1] + T.int64(KEYS - 1)) // T.int64(KEYS) - block0, tile_blocks[0])


def qk(autoregressive: bool):
    """The bfloat16 Q.K^T PrimFunc on AMX (:func:`cpu.qk.qk`'s arguments and results)."""
    rows, cols = ROWS, KEYS
    causal = 1 if autoregressive else 0

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
        t1 = T.match_buffer(t1_handle, (batch, n, heads, head_dim), "bfloat16")
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), "bfloat16")
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, band), "bfloat16")
        # The operands' rows as 32-bit words, each a pair of features.
        query_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=t1.data)
        key_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=t2.data)
        # One-sided window: band = 2w + 1 (symmetric) or w + 1 (autoregressive).
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        margin: T.let = w + T.int64(cols)  # packed columns before the first key
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)
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
            packed = T.decl_buffer((blocks, head_dim // T.int64(2), T.int64(cols)), "int32")
            queries = T.decl_buffer((T.int64(rows), head_dim // T.int64(2)), "int32")
            # The tile's sums, packed key block0 * 16 + c at column c (computed blocks only): every
            # row's band, skewed by r and the first block's offset, base (< 16), within it.
            scores = T.decl_buffer((T.int64(rows), band + T.int64(rows + 3 * cols)), "float32")
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, cols), "int32", annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
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
                _PER_LINE,
            )
            _configure()
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + run_margin  # packed column of row 0's band column 0
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)
                _tile_bounds(query, low, high, row_of, p0, n, d, w, band, rows)
                bf16_dot.copy_word_rows(queries, query_words, query, b, h, head_dim, rows)
                _tile_blocks(tile_blocks, span, low, high, first, block0, p0, n)
                tile_scores(
                    scores,
                    (),
                    queries,
                    packed,
                    (),
                    block0,
                    tile_blocks,
                    head_dim,
                    rows,
                    rows,
                    cols,
                    "float32",
                    False,
                    True,
                    None,
                )
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        for j in range(low[r]):
                            out[b, query[r], h, j] = _rounded("bfloat16", T.Cast("float32", padding))
                        _copy_run(out, b, query[r], h, scores, r, base + T.int64(r), low[r], high[r], cols, "bfloat16")
                        for j in range(high[r], band):
                            out[b, query[r], h, j] = _rounded("bfloat16", T.Cast("float32", padding))
            _release()

    return main


def pv(autoregressive: bool):
    """The bfloat16 probs.V PrimFunc on AMX (:func:`cpu.band_times_rows.pv`'s arguments and results)."""
    rows, cols = ROWS, KEYS
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, out_handle: T.handle, runs: T.int64):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, band), "bfloat16")
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), "bfloat16")
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), "bfloat16")
        weight_bits = T.decl_buffer((batch, n, heads, band), "uint16", data=t1.data)
        value_bits = T.decl_buffer((batch, n, heads, head_dim), "uint16", data=t2.data)
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        margin: T.let = w + T.int64(cols)
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            run_margin: T.let = margin - _run_origin(tile_begin * T.int64(rows) - w + margin, cols)
            length: T.let = (
                (run_tiles * T.int64(rows) + band + T.int64(rows + 4 * cols)) // T.int64(cols) + T.int64(1)
            ) * T.int64(cols)
            # Row buffer columns: the computed blocks end before base + 30 + band, base < 16.
            width: T.let = (band + T.int64(rows + 3 * cols + 2 * PAIRS - 1)) // T.int64(2 * PAIRS) * T.int64(2 * PAIRS)
            row_of = T.decl_buffer((n,), "int64")
            pairs = T.decl_buffer((length, head_dim), "int32")
            # The tile's band rows at their key columns (as qk's row buffer), as pairs of columns.
            probs = T.decl_buffer((T.int64(rows), width // T.int64(2)), "int32")
            probs_bits = T.decl_buffer((T.int64(rows), width), "uint16", data=probs.data)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            row_scale = T.alloc_local((rows,), "float32", annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            bf16_dot.pack_row_pairs(pairs, value_bits, t2, row_of, b, h, n, head_dim, run_margin, length, _PER_LINE)
            for r in range(rows):
                row_scale[r] = T.float32(1)
            _configure()
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + run_margin  # packed row of row 0's band column 0
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)
                _tile_bounds(query, low, high, row_of, p0, n, d, w, band, rows)
                _tile_blocks(tile_blocks, span, low, high, first, block0, p0, n)
                for r in range(rows):
                    for block in range(tile_blocks[0], tile_blocks[1]):
                        for lane in T.vectorized(cols):
                            probs_bits[r, block * T.int64(cols) + lane] = T.uint16(0)
                    if p0 + T.int64(r) < n:  # (a plain copy: LLVM vectorises it)
                        for j in range(low[r], high[r]):
                            probs_bits[r, base + T.int64(r) + j] = weight_bits[b, query[r], h, j]
                tile_context(
                    out,
                    (),
                    probs,
                    pairs,
                    row_scale,
                    (),
                    (),
                    (),
                    query,
                    b,
                    h,
                    p0,
                    n,
                    block0,
                    tile_blocks,
                    head_dim,
                    rows,
                    cols,
                    1,
                    1,
                    "float32",
                    "bfloat16",
                    True,
                )
            _release()

    return main


@T.macro
def _pack_pairs_feature_major(packed, value_bits, row_of, b, h, n, head_dim, margin, pair_count, tile, scratch):
    """packed[f, q] = feature f of packed rows 2q and 2q + 1 (positions 2q - margin, + 1; zero outside
    the sequence) as one 32-bit pair: probs.V's value-row pairs transposed, 16 x 16 at a time."""
    for q0 in range(pair_count // T.int64(16)):
        for chunk in range(head_dim // T.int64(16)):
            for ql in range(16):
                t: T.let = (q0 * T.int64(16) + T.int64(ql)) * T.int64(2) - margin
                for fl in T.vectorized(16):
                    tile[ql, fl] = _pair(
                        T.Select(
                            t >= T.int64(0) and t < n,
                            value_bits[
                                b, row_of[T.max(T.min(t, n - T.int64(1)), T.int64(0))], h, chunk * T.int64(16) + fl
                            ],
                            T.uint16(0),
                        ),
                        T.Select(
                            t + T.int64(1) >= T.int64(0) and t + T.int64(1) < n,
                            value_bits[
                                b,
                                row_of[T.max(T.min(t + T.int64(1), n - T.int64(1)), T.int64(0))],
                                h,
                                chunk * T.int64(16) + fl,
                            ],
                            T.uint16(0),
                        ),
                    )
            _transpose_square(tile, scratch, 16)
            for i in T.unroll(16):
                for lane in T.vectorized(16):
                    packed[chunk * T.int64(16) + T.int64(i), q0 * T.int64(16) + lane] = tile[i, lane]


def _checked_weight(weight_bits, row_of, b, h, n, band, low, high, c, base, block0, run_margin, r):
    """Row r's weight at tile column c as bits (0 where the row has none), read with the band row and
    column clamped into the buffers: column band - 1 - (c - base - r) of the band row at packed row
    block0 * 16 + c."""
    position = block0 * T.int64(KEYS) + c - run_margin
    column = band - T.int64(1) - (c - base) + r
    return T.Select(
        tirx.all(c - base - r >= low[r], c - base - r < high[r]),
        weight_bits[
            b,
            row_of[T.max(T.min(position, n - T.int64(1)), T.int64(0))],
            h,
            T.max(T.min(column, band - T.int64(1)), T.int64(0)),
        ],
        T.uint16(0),
    )


def _lane_weight(weight_flat, index, c, base, low, high, r):
    """Row r's weight at tile column c from ``index`` + r of the flat band (0 where the row has none)."""
    return T.Select(tirx.all(c - base - r >= low[r], c - base - r < high[r]), weight_flat[index + r], T.uint16(0))


@T.macro
def _weight_pair(
    weights, weight_bits, weight_flat, row_of, b, h, n, heads, band, low, high, c, base, block0, run_margin, pl
):
    """weights[pl, r] = row r's weights at tile columns c and c + 1 as one pair (B's row pl of W^T):
    16 consecutive columns of two band rows, each lane selected to 0 where its row has no weight
    (a lane past its band row reads the next one's, inside the tensor), where both band rows are
    in the sequence; else per row, clamped into the buffers."""
    position: T.let = block0 * T.int64(KEYS) + c - run_margin  # of column c's band row; c + 1: the next
    column: T.let = band - T.int64(1) - (c - base)  # lane r reads column + r (c + 1: column - 1 + r)
    first_index: T.let = (
        (b * n + row_of[T.max(T.min(position, n - T.int64(1)), T.int64(0))]) * heads + h
    ) * band + column
    second_index: T.let = (
        ((b * n + row_of[T.max(T.min(position + T.int64(1), n - T.int64(1)), T.int64(0))]) * heads + h) * band
        + column
        - T.int64(1)
    )
    if (
        position >= T.int64(0)
        and position + T.int64(1) < n
        and first_index >= T.int64(0)
        and second_index + T.int64(ROWS) <= weight_flat.shape[0]
    ):
        # The next tile reads the next 16 columns of these band rows: their lines asked for now, the
        # loads otherwise wait on memory (a band row every step, 12 KiB and more apart).
        _prefetch_element(weight_flat, T.min(first_index + T.int64(2 * ROWS), weight_flat.shape[0] - T.int64(1)))
        _prefetch_element(weight_flat, T.min(second_index + T.int64(2 * ROWS), weight_flat.shape[0] - T.int64(1)))
        for r in T.vectorized(ROWS):
            weights[pl, r] = _pair(
                _lane_weight(weight_flat, first_index, c, base, low, high, T.Cast("int64", r)),
                _lane_weight(weight_flat, second_index, c + T.int64(1), base, low, high, T.Cast("int64", r)),
            )
    else:
        for r in range(ROWS):
            weights[pl, r] = _pair(
                _checked_weight(weight_bits, row_of, b, h, n, band, low, high, c, base, block0, run_margin, r),
                _checked_weight(
                    weight_bits, row_of, b, h, n, band, low, high, c + T.int64(1), base, block0, run_margin, r
                ),
            )


@T.macro
def _transposed_pass(out, context, tile, scratch, weights, packed, query, b, h, p0, n, q0, chunks, column, width):
    """Output features [column, column + 16 width) of the tile's rows: out^T = V^T W^T, V^T (A) from
    packed, W^T's row pairs (B) from weights, then each 16 x 16 result transposed and stored."""
    for j in T.unroll(width):
        _zero(j)
    for chunk in range(chunks):
        _load(4, T.address_of(weights[chunk * T.int64(PAIRS), 0]), T.int64(4 * ROWS))
        for j in T.unroll(width):
            _load(
                5 + j % 3,
                T.address_of(packed[column + T.int64(j * KEYS), q0 + chunk * T.int64(PAIRS)]),
                T.int64(4) * packed.shape[1],
            )
            _multiply(j, 5 + j % 3, 4)
    for j in T.unroll(width):
        _store(j, T.address_of(context[j * KEYS, 0]), T.int64(4 * ROWS))
    for j in range(width):
        for f in range(KEYS):
            for r in T.vectorized(ROWS):
                tile[f, r] = context[j * KEYS + f, r]
        _transpose_square(tile, scratch, 16)
        for r in range(ROWS):
            if p0 + T.int64(r) < n:
                for lane in T.vectorized(KEYS):
                    out[b, query[r], h, column + T.int64(j * KEYS) + lane] = _rounded("bfloat16", tile[r, lane])


def transposed(autoregressive: bool):
    """The bfloat16 transposed product on AMX (:func:`cpu.band_times_rows.transposed`'s arguments and results)."""
    rows, cols = ROWS, KEYS
    offset_is_w = 0 if autoregressive else 1
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, out_handle: T.handle, runs: T.int64):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, band), "bfloat16")
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), "bfloat16")
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), "bfloat16")
        weight_bits = T.decl_buffer((batch, n, heads, band), "uint16", data=t1.data)
        weight_flat = T.decl_buffer((batch * n * heads * band,), "uint16", data=t1.data)
        value_bits = T.decl_buffer((batch, n, heads, head_dim), "uint16", data=t2.data)
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        offset: T.let = T.int64(offset_is_w) * w
        margin: T.let = offset + T.int64(cols)
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            run_margin: T.let = margin - _run_origin(tile_begin * T.int64(rows) - offset + margin, cols)
            # Pairs of packed rows of V^T (whole 16s), past the run's last tile's last band row.
            pair_count: T.let = (run_tiles * T.int64(rows) + T.int64(2) * band + T.int64(128)) // T.int64(32) * T.int64(
                16
            ) + T.int64(16)
            row_of = T.decl_buffer((n,), "int64")
            packed = T.decl_buffer((head_dim, pair_count), "int32")
            # W^T as row pairs: the tile's computed columns (before base + 30 + band) in whole 16s.
            weights = T.decl_buffer(
                (
                    (band + T.int64(3 * cols + rows)) // T.int64(2 * PAIRS) * T.int64(PAIRS) + T.int64(2 * PAIRS),
                    T.int64(rows),
                ),
                "int32",
            )
            context = T.alloc_local((4 * KEYS, ROWS), "float32", annotations=_ON_STACK)  # out^T, 64 features
            tile32 = T.alloc_local((16, 16), "int32", annotations=_ON_STACK)
            scratch32 = T.alloc_local((16, 16), "int32", annotations=_ON_STACK)
            tile = T.alloc_local((16, 16), "float32", annotations=_ON_STACK)
            scratch = T.alloc_local((16, 16), "float32", annotations=_ON_STACK)
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            _pack_pairs_feature_major(
                packed, value_bits, row_of, b, h, n, head_dim, run_margin, pair_count, tile32, scratch32
            )
            _configure()
            for tile_index in range(tile_begin, tile_end):
                p0: T.let = tile_index * T.int64(rows)
                first: T.let = p0 - offset + run_margin  # packed row of row 0's step 0
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)
                _tile_bounds(query, low, high, row_of, p0, n, d, offset, band, rows)
                _tile_blocks(tile_blocks, span, low, high, first, block0, p0, n)
                c0: T.let = tile_blocks[0] * T.int64(cols)  # the first computed column
                chunks: T.let = (
                    (tile_blocks[1] - tile_blocks[0]) * T.int64(cols // 2) + T.int64(PAIRS - 1)
                ) // T.int64(PAIRS)
                for pl in range(chunks * T.int64(PAIRS)):
                    _weight_pair(
                        weights,
                        weight_bits,
                        weight_flat,
                        row_of,
                        b,
                        h,
                        n,
                        heads,
                        band,
                        low,
                        high,
                        c0 + pl * T.int64(2),
                        base,
                        block0,
                        run_margin,
                        pl,
                    )
                q0: T.let = (block0 * T.int64(cols) + c0) // T.int64(2)  # its pair of packed rows in V^T
                for feature_tile in range(head_dim // T.int64(4 * KEYS)):
                    _transposed_pass(
                        out,
                        context,
                        tile,
                        scratch,
                        weights,
                        packed,
                        query,
                        b,
                        h,
                        p0,
                        n,
                        q0,
                        chunks,
                        feature_tile * T.int64(4 * KEYS),
                        4,
                    )
                if head_dim % T.int64(4 * KEYS) != T.int64(0):
                    _transposed_pass(
                        out,
                        context,
                        tile,
                        scratch,
                        weights,
                        packed,
                        query,
                        b,
                        h,
                        p0,
                        n,
                        q0,
                        chunks,
                        head_dim - T.int64(2 * KEYS),
                        2,
                    )
            _release()

    return main
