"""The bfloat16 band products and fused attention through the AVX512-BF16 dot product
(``vdpbf16ps``), for CPUs that have it (AMD Zen 4 and later, Intel since Cooper Lake).

``vdpbf16ps acc, a, b`` adds ``a[2l] * b[2l] + a[2l+1] * b[2l+1]`` to each float32 lane l: 32
products per instruction where an FMA does 16, and no conversion of the bfloat16 operands. Q.K^T
(qk.py, with the packing and micro-kernel step from here), probs.V and transposed (here) are the
float32 kernels' loop nests with each step taking a *pair*: of features (Q.K^T: a query's two
features broadcast against 16 keys' same two) or of keys (probs.V, transposed), operands packed as
32-bit pairs of bfloat16, accumulation in float32 registers. The fused attention kernels
(attention.py) run their products on the same steps: Q.K^T and dO.V^T by feature pairs, P.V and
dS.K by pairs of columns, dV and dK by pairs of tile rows; their float32 probabilities and dS are
rounded to bfloat16 pairs for it (``vcvtneps2bf16``, as the unfused path stores its band in
bfloat16), and the scale applies to the scores and dK sums instead of the queries.

How the instruction is reached: TVM 0.27 cannot hold a ``<32 x bfloat>`` value (its bfloat16
legalisation turns every one into float32; bench/NOTES.md), so the operands stay 32-bit integers
in TIR, and one small LLVM IR function (:data:`_DOT_IR`, imported with ``pragma_import_llvm``)
bitcasts them and calls the intrinsic; two more round float32 vectors to bfloat16 pairs
(``fptrunc``: ``vcvtneps2bf16``). LLVM links and inlines them (``alwaysinline``): the hot loops
hold ``vdpbf16ps`` with the pair broadcast from memory, no call. The IR is text the build's own
LLVM parses; no compiler is needed to build or run.

Results differ from the FMA kernels' only in rounding: the pair's two products are added before
the accumulator (the instruction's own rounding, round to nearest even, denormals flushed).
"""

from __future__ import annotations

from tvm import tirx
from tvm.ir import StringImm
from tvm.script import tirx as T

from tvm_kernels.schedules.cpu.microkernels import (
    _ON_STACK,
    _fill_residue_major,
    _prefetch_line,
    _prefetch_row,
    _run_tiles,
    _store_tile,
    _tile_bounds,
    _transpose_square,
    _zero_tile,
)

LANES = 16  # float32 lanes of a 512-bit accumulator = pairs per operand vector
_DOT = "longformer_dpbf16"
# 16 float32 rounded to bfloat16 (nearest even: vcvtneps2bf16), as 8 pairs of consecutive values.
_ROUND = "longformer_bf16_pairs"
# Two times 16 float32 rounded to bfloat16 and interleaved: 16 pairs (a[l], b[l]).
_INTERLEAVE = "longformer_bf16_interleave"
_INTERLEAVE_MASK = ", ".join(f"i32 {lane + 16 * second}" for lane in range(16) for second in (0, 1))
# linkonce_odr: every kernel of a library imports the same definition; the linker keeps one.
_DOT_IR = f"""
define linkonce_odr <16 x float> @{_DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {{
  %a_pairs = bitcast <16 x i32> %a to <32 x bfloat>
  %b_pairs = bitcast <16 x i32> %b to <32 x bfloat>
  %sum = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %a_pairs, <32 x bfloat> %b_pairs)
  ret <16 x float> %sum
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define linkonce_odr <8 x i32> @{_ROUND}(<16 x float> %x) #0 {{
  %halves = fptrunc <16 x float> %x to <16 x bfloat>
  %pairs = bitcast <16 x bfloat> %halves to <8 x i32>
  ret <8 x i32> %pairs
}}
define linkonce_odr <16 x i32> @{_INTERLEAVE}(<16 x float> %a, <16 x float> %b) #0 {{
  %a_halves = fptrunc <16 x float> %a to <16 x bfloat>
  %b_halves = fptrunc <16 x float> %b to <16 x bfloat>
  %both = shufflevector <16 x bfloat> %a_halves, <16 x bfloat> %b_halves, <32 x i32> <{_INTERLEAVE_MASK}>
  %pairs = bitcast <32 x bfloat> %both to <16 x i32>
  ret <16 x i32> %pairs
}}
attributes #0 = {{ alwaysinline nounwind memory(none) }}
"""


def with_dot_product(func):
    """``func`` with :data:`_DOT_IR` imported: its body under a ``pragma_import_llvm`` attribute."""
    return func.with_body(tirx.AttrStmt(tirx.IntImm("int32", 0), "pragma_import_llvm", StringImm(_DOT_IR), func.body))


def _pair(low, high):
    """Two bfloat16 bit patterns (uint16 expressions) as one 32-bit pair, ``low`` first in memory."""
    return T.Cast("int32", low) | T.shift_left(T.Cast("int32", high), T.int32(16))


@T.macro
def dot_into(acc, r, v, weight_pair, value_pairs):
    """acc[r, 16v : 16v + 16] += the pair ``weight_pair`` (broadcast) . ``value_pairs`` (16 pairs)."""
    T.buffer_store(
        acc,
        T.call_extern(
            "float32x16",
            _DOT,
            T.BufferLoad(acc, [r, T.Ramp(v * LANES, 1, LANES)]),
            # The broadcast last: the instruction's memory operand, where the load folds ({1to16}).
            value_pairs,
            T.Broadcast(weight_pair, LANES),
        ),
        [r, T.Ramp(v * LANES, 1, LANES)],
    )


@T.macro
def dot_pairs(acc, r, pairs, row, column, vectors, weight_pair):
    """Tile row r += the pair ``weight_pair`` (broadcast) . pairs[row, column : column + 16 * vectors]."""
    for v in T.unroll(vectors):
        dot_into(
            acc,
            r,
            v,
            weight_pair,
            T.BufferLoad(pairs, [row, T.Ramp(column + T.Cast("int64", v * LANES), T.int64(1), LANES)]),
        )


@T.macro
def pack_key_pairs(
    packed, key_words, key_tile, row_of, block_keys, t2, b, h, n, head_dim, margin, blocks, cols, per_line
):
    """Q.K^T's keys in packed (residue-major) order for the dot product, zero outside the sequence:
    blocks of ``cols`` keys, ``packed[block, i, key]`` = the key's features 2i and 2i + 1 (one
    32-bit word of its row, ``key_words``). ``key_tile``: scratch of ``cols x 16`` words."""
    key_scratch = T.alloc_local((cols, LANES), key_tile.dtype, annotations=_ON_STACK)  # (square tiles)
    for block in range(blocks):
        for lane in range(T.int64(cols)):
            p: T.let = block * T.int64(cols) + lane - margin  # packed position
            block_keys[lane] = row_of[T.max(T.min(p, n - T.int64(1)), T.int64(0))]
            _prefetch_row(
                t2, b, row_of[T.max(T.min(p + T.int64(8), n - T.int64(1)), T.int64(0))], h, head_dim, per_line
            )
        # Transposed 16 words at a time through a tile of constant strides (as _pack_operands): a
        # square tile in registers, where the words were gathered column by column (~1% of the
        # fused kernels' time; bench/NOTES.md).
        for chunk in range(head_dim // T.int64(2 * LANES)):
            for lane in range(T.int64(cols)):
                for i in T.vectorized(LANES):
                    key_tile[lane, i] = T.Select(
                        block * T.int64(cols) + lane >= margin and block * T.int64(cols) + lane < margin + n,
                        key_words[b, block_keys[lane], h, chunk * T.int64(LANES) + i],
                        T.int32(0),
                    )
            if cols == LANES:
                _transpose_square(key_tile, key_scratch, LANES)
                for i in T.unroll(LANES):
                    for lane in T.vectorized(cols):
                        packed[block, chunk * T.int64(LANES) + T.int64(i), lane] = key_tile[i, lane]
            else:
                for i in range(LANES):
                    for lane in T.vectorized(cols):
                        packed[block, chunk * T.int64(LANES) + T.int64(i), lane] = key_tile[lane, i]


@T.macro
def pack_row_pairs(pairs, row_bits, t2, row_of, b, h, n, head_dim, margin, length, per_line):
    """probs.V's value rows (and the fused kernels' K and V rows) as pairs of consecutive packed rows,
    zero outside the sequence: ``pairs[t, f]`` = features f of packed rows t - margin and
    t - margin + 1 (``row_bits``: t2's bit patterns), for t in [0, length)."""
    for t in range(length):
        p: T.let = t - margin  # packed position of the pair's first row
        first_row: T.let = row_of[T.max(T.min(p, n - T.int64(1)), T.int64(0))]
        second_row: T.let = row_of[T.max(T.min(p + T.int64(1), n - T.int64(1)), T.int64(0))]
        _prefetch_row(t2, b, row_of[T.max(T.min(p + T.int64(8), n - T.int64(1)), T.int64(0))], h, head_dim, per_line)
        for vector in range(head_dim // T.int64(LANES)):
            for lane in T.vectorized(LANES):
                f: T.let = vector * T.int64(LANES) + lane
                pairs[t, f] = _pair(
                    T.Select(p >= T.int64(0) and p < n, row_bits[b, first_row, h, f], T.uint16(0)),
                    T.Select(
                        p + T.int64(1) >= T.int64(0) and p + T.int64(1) < n, row_bits[b, second_row, h, f], T.uint16(0)
                    ),
                )


@T.macro
def copy_word_rows(words, t_words, query, b, h, head_dim, rows):
    """words[r] = the tile's row r (sequence row query[r]) of ``t_words``, a bfloat16 tensor's 32-bit view."""
    for r in range(rows):
        for vector in range(head_dim // T.int64(2 * LANES)):
            for lane in T.vectorized(LANES):
                words[r, vector * T.int64(LANES) + lane] = t_words[b, query[r], h, vector * T.int64(LANES) + lane]


@T.macro
def dot_key_block(acc, words, row0, packed, block, head_dim, rows, vectors):
    """Q.K^T's micro-kernel step by feature pairs: acc[r, key] += words[row0 + r] . the packed block's
    key (``vectors`` x 16 keys), one dot product per pair of features, row and vector."""
    for i in range(head_dim // T.int64(2)):
        for r in T.unroll(rows):
            for v in T.unroll(vectors):
                dot_into(
                    acc,
                    r,
                    v,
                    words[row0 + T.int64(r), i],
                    T.BufferLoad(packed, [block, i, T.Ramp(T.Cast("int64", v * LANES), T.int64(1), LANES)]),
                )


@T.macro
def round_to_pairs(words, r, values, start, end):
    """words[r, c / 2] = values[r, c] and values[r, c + 1] rounded to bfloat16 (one 32-bit pair), for
    even c in [start, end), whole vectors of 16 (start even)."""
    for vector in range((end - start) // T.int64(LANES)):
        c: T.let = start + vector * T.int64(LANES)
        T.buffer_store(
            words,
            T.call_extern("int32x8", _ROUND, T.BufferLoad(values, [r, T.Ramp(c, T.int64(1), LANES)])),
            [r, T.Ramp(c // T.int64(2), T.int64(1), LANES // 2)],
        )


@T.macro
def round_to_row_pairs(words, pair, values, start, end):
    """words[pair, c] = values[2 pair, c] and values[2 pair + 1, c] rounded to bfloat16 (one 32-bit
    pair), for c in [start, end), whole vectors of 16: a tile's weights for the transposed products,
    two tile rows per step."""
    for vector in range((end - start) // T.int64(LANES)):
        c: T.let = start + vector * T.int64(LANES)
        T.buffer_store(
            words,
            T.call_extern(
                "int32x16",
                _INTERLEAVE,
                T.BufferLoad(values, [pair * T.int64(2), T.Ramp(c, T.int64(1), LANES)]),
                T.BufferLoad(values, [pair * T.int64(2) + T.int64(1), T.Ramp(c, T.int64(1), LANES)]),
            ),
            [pair, T.Ramp(c, T.int64(1), LANES)],
        )


@T.macro
def copy_row_pairs(pairs, bits, query, b, h, head_dim, rows):
    """pairs[i, f] = feature f of the tile's rows 2i and 2i + 1 (sequence rows query[.]) of a
    bfloat16 tensor (``bits``: its bit patterns), one 32-bit pair: the transposed products' rows."""
    for i in range(rows // 2):
        for vector in range(head_dim // T.int64(LANES)):
            for lane in T.vectorized(LANES):
                f: T.let = vector * T.int64(LANES) + lane
                pairs[i, f] = _pair(bits[b, query[2 * i], h, f], bits[b, query[2 * i + 1], h, f])


def _weight(weight_bits, row_of, query, b, h, p0, offset, d, k, r, n, band, transposed, in_class):
    """Row r's weight at step k, as bits (a plain Python helper building the expression). probs.V:
    column k - r of row r's band row; transposed: column band - 1 - k + r of the band row of packed
    row p0 - offset + k (``in_class``: inside the direct loop's steps, where that row is in the
    tile's residue class and found without the row table). Elsewhere the column (and row) are
    clamped into the buffers, for the caller to select the weight away."""
    if transposed:
        column = band - T.int64(1) - k + T.int64(r)
        source = (
            query[0] + (k - offset) * d
            if in_class
            else row_of[T.max(T.min(p0 - offset + k, n - T.int64(1)), T.int64(0))]
        )
    else:
        column = k - T.int64(r)
        source = query[r]
    if not in_class:
        column = T.max(T.min(column, band - T.int64(1)), T.int64(0))
    return weight_bits[b, source, h, column]


def band_times_pairs(autoregressive: bool, rows: int, transposed: bool):
    """probs.V (``transposed`` False) or the transposed product in bfloat16; the arguments of
    :func:`tvm_kernels.compute.pv` / ``transposed``, then ``runs`` (as :func:`band_times_rows.pv`).

    The float32 kernel's tiles (``rows`` consecutive packed queries x 2 vectors of output features),
    two keys per step: the values are packed as pairs of consecutive packed rows
    (``pairs[t, f]`` = values of packed rows t and t + 1 at feature f). probs.V: row r's weights for
    steps k, k + 1 are its band columns k - r, k - r + 1, adjacent in memory: one 32-bit broadcast.
    Transposed: row r's weight at step k is column band - 1 - k + r of the band row of packed row
    p0 - offset + k, so a step pair's two weights come from two band rows: in tiles of one residue
    class the tile's rows' weights of a step are consecutive there, and the first feature tile
    stages each step pair's as 32-bit pairs (two vector loads, interleaved) for the others.
    Where a row has no column at a step (the tile's first and last steps, and tiles across residue
    classes or past the end) the weight is selected to 0; its value row is finite, so it adds 0.
    ``head_dim`` must be a multiple of 32 (the runtime zero-pads).
    """
    cols = 2 * LANES  # output features of one register tile
    causal = 1 if autoregressive else 0
    per_line = 32  # bfloat16 elements of one 64-byte cache line
    # Row offset of band column 0: w for probs.V; w_upper (w, or 0 when causal) for transposed.
    offset_is_w = 0 if transposed and autoregressive else 1

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
        # The inputs' bit patterns: uint16 loads stay integers through TVM's bfloat16 legalisation.
        weight_bits = T.decl_buffer((batch, n, heads, band), "uint16", data=t1.data)
        value_bits = T.decl_buffer((batch, n, heads, head_dim), "uint16", data=t2.data)
        w: T.let = T.int64(causal) * (band - T.int64(1)) + T.int64(1 - causal) * ((band - T.int64(1)) // T.int64(2))
        offset: T.let = T.int64(offset_is_w) * w
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)  # (microkernels.py)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            # Packed rows from ``rows`` before the run's first step on (the first row is margin rows in).
            margin: T.let = offset + T.int64(rows) - tile_begin * T.int64(rows)
            length: T.let = run_tiles * T.int64(rows) + T.int64(2) * band + T.int64(2 * rows + 2)
            row_of = T.decl_buffer((n,), "int64")
            pairs = T.decl_buffer((length, head_dim), "int32")
            # transposed: a tile's weights, a pair per row and step pair
            staged = T.decl_buffer((band // T.int64(2) + T.int64(1), T.int64(rows)), "int32") if transposed else ()
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            low = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            high = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), "float32", annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            pack_row_pairs(pairs, value_bits, t2, row_of, b, h, n, head_dim, margin, length, per_line)
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                _tile_bounds(query, low, high, row_of, p0, n, d, offset, band, rows)
                first: T.let = p0 - offset + margin  # packed row of step k = 0
                # Row r's weight at step k (packed row first + k) belongs to its band column k - r.
                direct: T.let = (
                    p0 + T.int64(rows) <= n
                    and query[rows - 1] == query[0] + T.int64(rows - 1) * d
                    and band >= T.int64(rows - 1)
                )
                # Rows consecutive in one residue class: every row's valid steps end together
                # (the next packed rows belong to another class), and between the triangles
                # k < rows - 1 and k >= band every row has a column: no select there.
                k_end: T.let = T.min(offset + (n - T.int64(1) - query[0]) // d + T.int64(1), band + T.int64(rows - 1))
                k_low: T.let = T.max(low[0], T.int64(rows - 1))
                pair_steps: T.let = T.max(T.min(k_end, band) - k_low, T.int64(0)) // T.int64(2)
                for feature_tile in range(head_dim // T.int64(cols)):
                    column: T.let = feature_tile * T.int64(cols)
                    _zero_tile(acc, rows, cols, "float32")
                    if direct:
                        for k in range(low[0], T.min(k_low, k_end), 2):
                            for r in T.unroll(rows):
                                dot_pairs(
                                    acc,
                                    r,
                                    pairs,
                                    first + k,
                                    column,
                                    2,
                                    _pair(
                                        T.Select(
                                            k >= T.int64(r),
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k,
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                        T.Select(
                                            k + T.int64(1) >= T.int64(r) and k + T.int64(1) < T.min(k_low, k_end),
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k + T.int64(1),
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                    ),
                                )
                        for step in range(pair_steps):
                            k: T.let = k_low + step * T.int64(2)
                            if transposed:
                                if feature_tile == 0:
                                    # The step pair's weights as 32-bit pairs, staged for every feature
                                    # tile: the tile's rows' weights at step k are consecutive in one
                                    # band row (columns band - 1 - k + r), so two vector loads
                                    # interleaved, where reading them per row and feature tile took
                                    # two 16-bit loads, a shift and an or each.
                                    for r in T.vectorized(rows):
                                        staged[step, r] = _pair(
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k,
                                                r,
                                                n,
                                                band,
                                                True,
                                                True,
                                            ),
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k + T.int64(1),
                                                r,
                                                n,
                                                band,
                                                True,
                                                True,
                                            ),
                                        )
                                    # The next tile reads the next `rows` entries of these two band
                                    # rows: fetch those lines now (as the FMA kernel does).
                                    for j in range(2):
                                        _prefetch_line(
                                            t1,
                                            b,
                                            query[0] + (k + T.int64(j) - offset) * d,
                                            h,
                                            T.min(band + T.int64(2 * rows - 2 - j) - k, band - T.int64(1)),
                                        )
                                for r in T.unroll(rows):
                                    dot_pairs(acc, r, pairs, first + k, column, 2, staged[step, r])
                            else:
                                # Fetch the next tile's band rows, a line per step.
                                _prefetch_line(
                                    t1,
                                    b,
                                    row_of[T.min(p0 + T.int64(rows) + step % T.int64(rows), n - T.int64(1))],
                                    h,
                                    T.min(step // T.int64(rows) * T.int64(per_line), band - T.int64(1)),
                                )
                                for r in T.unroll(rows):
                                    dot_pairs(
                                        acc,
                                        r,
                                        pairs,
                                        first + k,
                                        column,
                                        2,
                                        _pair(
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k,
                                                r,
                                                n,
                                                band,
                                                False,
                                                True,
                                            ),
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k + T.int64(1),
                                                r,
                                                n,
                                                band,
                                                False,
                                                True,
                                            ),
                                        ),
                                    )
                        for k in range(k_low + pair_steps * T.int64(2), k_end, 2):
                            for r in T.unroll(rows):
                                dot_pairs(
                                    acc,
                                    r,
                                    pairs,
                                    first + k,
                                    column,
                                    2,
                                    _pair(
                                        T.Select(
                                            k - T.int64(r) < band,
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k,
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                        T.Select(
                                            k + T.int64(1) - T.int64(r) < band and k + T.int64(1) < k_end,
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k + T.int64(1),
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                    ),
                                )
                    else:
                        # Across residue classes or past the end: every weight selected.
                        for k in range(0, band + T.int64(rows - 1), 2):
                            for r in T.unroll(rows):
                                dot_pairs(
                                    acc,
                                    r,
                                    pairs,
                                    first + k,
                                    column,
                                    2,
                                    _pair(
                                        T.Select(
                                            k - T.int64(r) >= low[r] and k - T.int64(r) < high[r],
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k,
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                        T.Select(
                                            k + T.int64(1 - r) >= low[r] and k + T.int64(1 - r) < high[r],
                                            _weight(
                                                weight_bits,
                                                row_of,
                                                query,
                                                b,
                                                h,
                                                p0,
                                                offset,
                                                d,
                                                k + T.int64(1),
                                                r,
                                                n,
                                                band,
                                                transposed,
                                                False,
                                            ),
                                            T.uint16(0),
                                        ),
                                    ),
                                )
                    _store_tile(out, acc, b, h, query, p0, n, column, rows, cols, "bfloat16")

    return with_dot_product(main)
