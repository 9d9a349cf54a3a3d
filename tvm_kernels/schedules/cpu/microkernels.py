"""The micro-kernel macros and helpers the CPU kernels share: prefetching, register tiles
(zero, accumulate, save, load, store), row runs, the residue-major row table and packing, square
tiles transposed in registers (rows made feature-major), rounding to the output dtype, and
vectorisable exp and erf."""

from __future__ import annotations

from tvm.script import tirx as T

# Keep small per-tile buffers on the stack (LLVM promotes them to registers).
# TVM otherwise lowers every allocation inside a parallel loop to a heap workspace
# call (3x slower kernels); the annotation survives only if StorageRewrite is off.
_ON_STACK = {"disable_lower_builtin": True}
_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def _rounded(dtype: str, x):
    """The expression x rounded to the output dtype: ``T.Cast(dtype, x)``, with a NaN kept NaN in
    bfloat16. TVM rounds float32 to bfloat16 in integer arithmetic (bits + 0x7fff + the kept
    half's lowest bit, then the high half), which carries a NaN whose low bits are set through the
    exponent into the sign bit: 0xffffffff, what torch's exp makes of the NaN 0xffff0000 that its
    bfloat16 GEMMs give, came out 0. Such a NaN is replaced by the quiet NaN 0x7fc00000 first,
    tested on the bits (an and, a compare, a masked move: a float test, ``T.isnan``, let LLVM fold
    it into the clamps before it and tangle the loop in mask operations). float16's conversion is
    the hardware's, NaN-correct.

    For bfloat16 ``x`` appears twice in the result: a computed expression (a GELU, a dropout hash)
    is stored through :func:`_store_rounded` instead, or TVM's simplifier works through both copies
    (minutes per kernel: bench/NOTES.md)."""
    if dtype != "bfloat16":
        return T.Cast(dtype, x)
    bits = T.reinterpret("int32", x)
    is_nan = T.bitwise_and(bits, T.int32(0x7FFFFFFF)) > T.int32(0x7F800000)
    return T.Cast(dtype, T.reinterpret("float32", T.Select(is_nan, T.int32(0x7FC00000), bits)))


def _staging(dtype: str, lanes: int, acc_dtype: str):
    """:func:`_store_rounded`'s buffer: one vector of the accumulation dtype in bfloat16, none otherwise
    (call it inside the PrimFunc: ``staged = _staging(...)``)."""
    return T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK) if dtype == "bfloat16" else ()


@T.macro
def _store_rounded(dtype, out, row, column, value, staged, lane):
    """out[row, column] = ``value`` rounded (:func:`_rounded`); in bfloat16 the value is stored to
    ``staged[lane]`` (:func:`_staging`) and rounded from there, so that the rounding's two uses name a
    load, not the expression (bfloat16 dropout and GELU kernels compiled in 40-200 s instead of 3-13;
    LLVM keeps the value in a register)."""
    if dtype == "bfloat16":
        staged[lane] = value
        out[row, column] = _rounded(dtype, staged[lane])
    else:
        out[row, column] = _rounded(dtype, value)


@T.macro
def _add_lanes(total, partial, lanes, at=0, row=None):
    """total[at] += the lanes of ``partial`` (of its row ``row`` where it holds several), in lane
    order (a vector's partial sums into a row's)."""
    for lane in range(lanes):
        if row is None:
            total[at] = total[at] + partial[lane]
        else:
            total[at] = total[at] + partial[row, lane]


@T.macro
def _max_of_lanes(result, partial, lanes, lowest):
    """result[0] = the largest of ``partial``'s lanes, ``lowest`` where none is larger (a vector's
    running maxima into a row's)."""
    result[0] = lowest
    for lane in range(lanes):
        result[0] = T.max(result[0], partial[lane])


# bfloat16 as 32-bit pairs of values (the elementwise kernels on AVX2, Tiles.bfloat16_pairs; gelu.py's
# docstring): a pair widens to two float32 vectors, even columns and odd, with a shift and a mask,
# and two rounded vectors pack back into pairs in the same lanes.
def _bfloat16_even(words):
    """The bfloat16 values at the even positions of 32-bit pairs (the low halves), as float32."""
    return T.reinterpret("float32", T.shift_left(words, T.uint32(16)))


def _bfloat16_odd(words):
    """The bfloat16 values at the odd positions of 32-bit pairs (the high halves), as float32."""
    return T.reinterpret("float32", T.bitwise_and(words, T.uint32(0xFFFF0000)))


def _rounded_nearest_even(bits):
    """float32 ``bits`` rounded to bfloat16's 16 high bits (nearest, ties to even), still in the high
    half. No NaN guard (:func:`_rounded` has one): a NaN whose low half carries into its exponent
    must have low bits set, and the NaNs of the kernels that use this are their bfloat16 inputs'
    (low half zero, payload kept by x86's arithmetic) or the default NaN 0xffc00000."""
    return bits + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(bits, T.uint32(16)), T.uint32(1))


def _quieted(bits):
    """float32 ``bits`` with a NaN of any payload replaced by the quiet NaN 0x7fc00000 (:func:`_rounded`'s
    guard), for :func:`_rounded_nearest_even` where NaNs of any bit pattern can arrive."""
    return T.Select(T.bitwise_and(bits, T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000), T.uint32(0x7FC00000), bits)


def _bfloat16_pair(even, odd, nan_guard: bool = False):
    """float32 ``even`` and ``odd`` rounded to bfloat16 as one 32-bit pair (``even`` the low half); with
    ``nan_guard``, NaNs of any bit pattern quieted first (:func:`_quieted`)."""
    guard = _quieted if nan_guard else (lambda bits: bits)
    return T.bitwise_or(
        T.bitwise_and(_rounded_nearest_even(guard(T.reinterpret("uint32", odd))), T.uint32(0xFFFF0000)),
        T.shift_right(_rounded_nearest_even(guard(T.reinterpret("uint32", even))), T.uint32(16)),
    )


def _pair_view(tensor, pairs: bool):
    """A bfloat16 tensor's bit patterns as 32-bit pairs of values (its last axis halved); ``()``
    without ``pairs``. Meaningful where that axis is even: :func:`_paired_vectors`."""
    if not pairs:
        return ()
    return T.decl_buffer(
        tuple(tensor.shape[:-1]) + (tensor.shape[-1] // T.int64(2),), "uint32", data=tensor.data, align=2
    )


def _flat_pair_view(tensor, pairs: bool):
    """A bfloat16 tensor's bit patterns as one flat run of 32-bit pairs (word k: flat elements 2k and
    2k + 1), for rows of odd length, which start inside a pair every other row; ``()`` without ``pairs``."""
    if not pairs:
        return ()
    size = T.int64(1)
    for extent in tensor.shape:
        size = size * extent
    return T.decl_buffer((size // T.int64(2),), "uint32", data=tensor.data, align=2)


def _paired_vectors(cols, lanes: int):
    """Vectors of pairs a row of ``cols`` values holds whole (``T.let``): none where ``cols`` is odd
    (its rows would start inside a pair); the columns after them go one value at a time."""
    return T.if_then_else(cols % T.int64(2) == T.int64(0), cols // T.int64(2 * lanes), T.int64(0))


@T.macro
def _sums_from_pairs(sums, chunk, scratch, paired, lanes):
    """Column sums kept per vector of pairs as even columns, then odd (``sums[chunk, 2 lanes v + l]``
    for column ``2 lanes v + 2 l``, ``+ lanes`` for the odd one) put back in column order;
    ``scratch``: ``2 * lanes`` values."""
    for vector in range(paired):
        for lane in range(2 * lanes):
            scratch[lane] = sums[chunk, vector * T.int64(2 * lanes) + lane]
        for lane in range(lanes):
            sums[chunk, vector * T.int64(2 * lanes) + T.int64(2 * lane)] = scratch[lane]
            sums[chunk, vector * T.int64(2 * lanes) + T.int64(2 * lane + 1)] = scratch[lanes + lane]


# The kernels' parallel loops take (batch, head, run) tasks: a (batch, head) split into ``runs`` runs
# of consecutive query tiles, each with its own packed operands, so that more threads than batch x
# heads have work (a static split of 12 heads over 8 threads keeps 6 busy); the caller picks
# ``runs`` from its thread count (kernels.py). A run has at least 2w + 1 queries, so that a key is
# reached by the queries of two runs at most (the fused backward sums its dK and dV across an edge).
def _run_tiles(tiles, window, rows, runs):
    """Query tiles per run."""
    return T.max((tiles + runs - T.int64(1)) // runs, (T.int64(2) * window + T.int64(rows)) // T.int64(rows))


def _run_origin(first_packed, align):
    """Where a run's packed operands start: its first tile's first packed column or row
    ``first_packed``, rounded down to a multiple of ``align`` (the packed key blocks' width, or 1).
    The kernels then index them with their margin less this origin."""
    return first_packed // T.int64(align) * T.int64(align)


# Packing reads one head's slice of every row: a few lines, then a jump of heads * head_dim
# elements, which crosses a 4 KiB page almost every row, where hardware prefetchers stop.
_ROWS_AHEAD = 8


@T.macro
def _prefetch_line(x, b, row, h, column, write=0):
    """Ask for the cache line of x[b, row, h, column] (a hint: no fault, no effect on results);
    ``write``: 1 where it is to be written."""
    T.evaluate(
        T.call_llvm_intrin(
            "void", "llvm.prefetch.p0", T.address_of(x[b, row, h, column]), T.int32(write), T.int32(3), T.int32(1)
        )
    )


@T.macro
def _prefetch_element(x, index):
    """Ask for the cache line of the flat buffer x's element ``index`` (a hint: an index past the
    buffer's end faults nothing)."""
    T.evaluate(
        T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(x[index]), T.int32(0), T.int32(3), T.int32(1))
    )


@T.macro
def _prefetch_row(x, b, row, h, length, per_line, write=0):
    """Ask for the cache lines of x[b, row, h, 0:length]."""
    for line in range((length + T.int64(per_line - 1)) // T.int64(per_line)):
        _prefetch_line(x, b, row, h, line * T.int64(per_line), write)


@T.macro
def _prefetch_next_tile(x, b, row_of, p0, rows, n, h, length, per_line):
    """Ask for the rows of x that the next tile of ``rows`` (packed rows p0 + rows ..) reads: they
    lie heads * head_dim elements apart, a new 4 KiB page every row or two, where hardware
    prefetchers stop (the fused kernels' Q, dO and O rows)."""
    for r in range(rows):
        _prefetch_row(x, b, row_of[T.min(p0 + T.int64(rows + r), n - T.int64(1))], h, length, per_line)


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
                out[b, query[r], h, column + lane] = _rounded(dtype, acc[r, lane])


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
            out[b, i, h, begin + vector * T.int64(lanes) + lane] = _rounded(
                dtype, buffer[r, offset + begin + vector * T.int64(lanes) + lane]
            )
    for j in range(begin + (end - begin) // T.int64(lanes) * T.int64(lanes), end):
        out[b, i, h, j] = _rounded(dtype, buffer[r, offset + j])


@T.macro
def _tile_bounds(query, low, high, row_of, p0, n, d, offset, band, rows):
    """The tile's rows (past the end: the last row again, never stored) and each row's valid band
    columns: 0 <= i + d*(j - offset) < n  <=>  low <= j < high."""
    for r in range(rows):
        query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]
        low[r] = T.max(offset - query[r] // d, T.int64(0))
        high[r] = T.min(offset + (n - T.int64(1) - query[r]) // d + T.int64(1), band)


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


def _butterfly_indices(size: int, step: int, high: bool) -> list:
    """One round of a size x size transpose: the lanes of rows i and i + step (step a power of two,
    bit ``step`` of i clear) that go to row i (``high`` False) or i + step, as indices into the
    pair's concatenation. After the rounds for size/2, ..., 2, 1, row i holds the old column i."""
    if high:
        return [j + step if j & step == 0 else size + j for j in range(size)]
    return [j if j & step == 0 else size + j - step for j in range(size)]


@T.macro
def _butterfly(source, target, size, step):
    for k in T.unroll(size // 2):
        # rows i and i + step, i = the k-th row with bit ``step`` clear
        target[k // step * (2 * step) + k % step, T.Ramp(0, 1, size)] = T.Shuffle(
            [
                source[k // step * (2 * step) + k % step, T.Ramp(0, 1, size)],
                source[k // step * (2 * step) + k % step + step, T.Ramp(0, 1, size)],
            ],
            _butterfly_indices(size, step, False),
        )
        target[k // step * (2 * step) + k % step + step, T.Ramp(0, 1, size)] = T.Shuffle(
            [
                source[k // step * (2 * step) + k % step, T.Ramp(0, 1, size)],
                source[k // step * (2 * step) + k % step + step, T.Ramp(0, 1, size)],
            ],
            _butterfly_indices(size, step, True),
        )


@T.macro
def _transpose_square(tile, scratch, size):
    """tile = tile^T for a size x size tile (size 8 or 16, the callers' condition: a vector per row),
    through ``scratch``: log2(size) rounds of two-row shuffles (64 for 16 x 16, where gathering the
    columns took 256 loads and inserts)."""
    if size == 16:
        _butterfly(tile, scratch, 16, 8)
        _butterfly(scratch, tile, 16, 4)
        _butterfly(tile, scratch, 16, 2)
        _butterfly(scratch, tile, 16, 1)
    else:
        _butterfly(tile, scratch, 8, 4)
        _butterfly(scratch, tile, 8, 2)
        _butterfly(tile, scratch, 8, 1)
        for r in T.unroll(8):
            tile[r, T.Ramp(0, 1, 8)] = scratch[r, T.Ramp(0, 1, 8)]


def _feature_major(dot: bool, rows: int, lanes: int) -> bool:
    """Whether a tile's rows (queries, or dO rows) go feature-major (:func:`_rows_feature_major`):
    where the tile is a square of vectors (AVX-512's float kernels), never on the bfloat16 dot
    product (its operands are pairs of features)."""
    return not dot and rows == lanes and lanes in (8, 16)


@T.macro
def _rows_feature_major(rows_t, tile, scratch, t_rows, query, b, h, head_dim, scale, lanes, acc_dtype):
    """rows_t[f, r] = row ``query[r]`` of ``t_rows`` times ``scale``, for ``lanes`` rows (a tile of
    queries, or of dO rows), feature-major, a square of features at a time transposed in registers
    (``tile``, ``scratch``: ``lanes x lanes``). The Q.K^T micro-kernel then finds row r's feature f
    at a constant offset from feature f's first: with the rows head_dim apart (a stride known only
    at run time) it spent an address addition per broadcast, which on an Intel core competes with
    the FMAs for issue (bench/NOTES.md)."""
    for chunk in range(head_dim // T.int64(lanes)):
        for r in T.unroll(lanes):
            for f in T.vectorized(lanes):
                tile[r, f] = T.Cast(acc_dtype, t_rows[b, query[r], h, chunk * T.int64(lanes) + f]) * T.Cast(
                    acc_dtype, scale
                )
        _transpose_square(tile, scratch, lanes)
        for f in T.unroll(lanes):
            for r in T.vectorized(lanes):
                rows_t[chunk * T.int64(lanes) + T.int64(f), r] = tile[f, r]


@T.macro
def _pack_operands(
    keys,
    values,
    biases,
    key_tile,
    t_keys,
    t_values,
    key_bias,
    row_of,
    block_keys,
    b,
    h,
    n,
    head_dim,
    margin,
    blocks,
    cols,
    lanes,
    per_line,
    acc_dtype,
    with_bias,
    with_values,
):
    """One (batch, head)'s operands in packed (residue-major) order, zero outside the sequence:
    keys in blocks of ``cols``, feature-major (the Q.K^T micro-kernel's layout: Q.K^T and the fused
    kernels), with_values the values as rows (probs.V's layout), and with_bias the keys' score
    biases, at the same packed columns. ``key_tile``: scratch of ``cols x lanes``."""
    key_scratch = T.alloc_local((cols, lanes), key_tile.dtype, annotations=_ON_STACK)  # (square tiles)
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
                        T.Cast(acc_dtype, t_keys[b, block_keys[lane], h, chunk * T.int64(lanes) + f]),
                        T.Cast(acc_dtype, 0),
                    )
            if cols == lanes and lanes in (8, 16):  # square: in registers, log2(lanes) rounds of shuffles
                _transpose_square(key_tile, key_scratch, lanes)
                for f in T.unroll(lanes):
                    for lane in T.vectorized(cols):
                        keys[block, chunk * T.int64(lanes) + T.int64(f), lane] = key_tile[f, lane]
            else:  # a strided gather from the tile: a load and an insert per element
                for f in range(lanes):
                    for lane in T.vectorized(cols):
                        keys[block, chunk * T.int64(lanes) + T.int64(f), lane] = key_tile[lane, f]
        for lane in range(T.int64(cols)):
            inside: T.let = block * T.int64(cols) + lane >= margin and block * T.int64(cols) + lane < margin + n
            if with_values:
                for vector in range(head_dim // T.int64(lanes)):
                    for lane2 in T.vectorized(lanes):
                        values[block * T.int64(cols) + lane, vector * T.int64(lanes) + lane2] = T.Select(
                            inside,
                            T.Cast(acc_dtype, t_values[b, block_keys[lane], h, vector * T.int64(lanes) + lane2]),
                            T.Cast(acc_dtype, 0),
                        )
            if with_bias:
                biases[block * T.int64(cols) + lane] = T.Select(
                    inside, key_bias[b, block_keys[lane]], T.Cast(acc_dtype, 0)
                )


# exp on [-inf, 0] for the fused softmax, vectorisable: TVM lowers ``T.exp`` to one scalar ``expf``
# call per lane. exp(x) = 2^m * exp(t), m = round(x / ln 2), t = x - m ln 2 in [-ln2/2, ln2/2]
# (ln 2 split in two constants so that t keeps float32 precision), exp(t) by a polynomial, 2^m
# built in the exponent bits. Inputs are clamped at -127 ln 2, where m = -127 makes those bits 0:
# exp(-inf) = 0 exactly, and results below float32's smallest normal number (x < -87.7) flush to 0.
# The clamp keeps a NaN (see _at_least): a NaN score gives a NaN row, not a probability of 0.
# m is rounded by adding _SHIFTER (1.5 * 2^23, whose ulp is 1, plus the exponent's bias): the sum's
# low mantissa bits are then m + 127, shifted into place as 2^m's exponent, where a floor, a
# conversion to int32 and an integer addition took three more instructions per vector (bench/NOTES.md:
# the AMX forward 0.97 of its time, results bit for bit the same). The sum's round trip through
# int32 keeps TVM's simplifier from folding (y + _SHIFTER) - _SHIFTER into y.
_LOG2E = 1.4426950408889634
_LN2_HIGH = 0.693145751953125  # few mantissa bits: m * _LN2_HIGH is exact in float32
_LN2_LOW = 1.4286068203094172e-06
_SHIFTER = 1.5 * 2**23 + 127
# exp(t)'s polynomial, highest degree first. By default the degree-7 Taylor polynomial, within 1.5
# ulp of float32 in float32 arithmetic. Where everything derived from exp is rounded to bfloat16 or
# float16 (the fused attention's half-type kernels) a degree-4 minimax fit of the relative error,
# 2.7e-6 (1/180 of float16's unit roundoff, 1/1400 of bfloat16's): three of exp's ~14 vector
# operations fewer.
_EXP_FLOAT32 = tuple(1.0 / k for k in (5040, 720, 120, 24, 6, 2, 1, 1))
_EXP_HALF = (0.0414586067199707, 0.16790907084941864, 0.5000435709953308, 0.9999634027481079, 0.9999992847442627)


def _at_least(x, low):
    """The expression max(x, low) that keeps a NaN x: ``T.max`` lowers to ``x > low ? x : low``,
    which turns NaN into low (hiding a diverged input behind a finite result); ``x < low ? low : x``
    is the same one vmaxps."""
    return T.Select(x < low, low, x)


def _at_most(x, high):
    """The expression min(x, high) that keeps a NaN x (as :func:`_at_least`)."""
    return T.Select(x > high, high, x)


def _exp(x, acc_dtype, half_results: bool = False):
    """The expression exp(x) for x <= 0 (a plain Python helper building the expression);
    ``half_results``: the caller rounds what it computes from it to a half type (the cheaper
    polynomial above)."""
    if acc_dtype == "float64":  # no speed goal for float64: the library's exp, exactly rounded
        return T.exp(x)
    x = _at_least(x, T.float32(-127 * 0.6931471805599453))
    shifted = x * T.float32(_LOG2E) + T.float32(_SHIFTER)
    m = T.reinterpret("float32", T.reinterpret("int32", shifted)) - T.float32(_SHIFTER)
    t = x - m * T.float32(_LN2_HIGH) - m * T.float32(_LN2_LOW)
    coefficients = _EXP_HALF if half_results else _EXP_FLOAT32
    poly = T.float32(coefficients[0])
    for c in coefficients[1:]:
        poly = poly * t + T.float32(c)
    return poly * T.reinterpret("float32", T.shift_left(T.reinterpret("int32", shifted), T.int32(23)))


# tanh for the fused attention's logit soft-cap (attention.py), vectorisable and accurate near 0:
# TVM lowers ``T.tanh`` to (1 - e^-2x) / (1 + e^-2x), whose subtraction cancels as x -> 0 (2.7e-8
# relative at x = 1e-9 in float64). Here |x| below _TANH_SERIES_BELOW takes tanh's Taylor series
# (eight terms: the remainder ratio per term is ~0.4 x^2, below 1e-12 at 0.25 and 1e-22 at
# 0.0625), above it the quotient, whose cancellation then costs at most 3 bits (~8 ulp in float64,
# exp exactly rounded; float32: _exp's 1.5 ulp, ~2 bits at 0.25). The sign is put back last, so a
# NaN stays NaN and +-inf give +-1.
_TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075, -929569 / 638512875)
_TANH_SERIES_BELOW = {"float32": 0.25, "float64": 0.0625}


def _tanh(x, acc_dtype):
    """The expression tanh(x) in ``acc_dtype`` (float32 or float64; a plain Python helper building it)."""
    magnitude = T.abs(x)
    square = magnitude * magnitude
    series = T.Cast(acc_dtype, _TANH_SERIES[-1])
    for c in reversed(_TANH_SERIES[:-1]):
        series = series * square + T.Cast(acc_dtype, c)
    small = magnitude * series
    if acc_dtype == "float64":
        e = T.exp(T.Cast(acc_dtype, -2) * magnitude)
    else:
        e = _exp(T.float32(-2) * magnitude, acc_dtype)
    large = (T.Cast(acc_dtype, 1) - e) / (T.Cast(acc_dtype, 1) + e)
    value = T.Select(magnitude < T.Cast(acc_dtype, _TANH_SERIES_BELOW[acc_dtype]), small, large)
    return T.Select(x < T.Cast(acc_dtype, 0), -value, value)


# erf for the GELU kernels, vectorisable (TVM lowers ``T.erf`` to one scalar ``erff`` call per
# lane): erf(z) = z P(s) / Q(s), s = z^2 / 16, z clamped to [-4, 4] (1 - erf(4) = 1.5e-8, below
# float32's half ulp of 1). A rational fit (tools/fit_erf.py: P of degree 7, Q of degree 4): 1.0e-8
# in exact arithmetic, 3.8e-7 evaluated in float32, where torch's own float32 GELU is off by up to
# 1.2e-6 (at x = 3.5; its erf is a fixed-form approximation). What GELU needs is 1 + erf(z), and
# that is clamped at 0: at z = -4 the float32 evaluation lands an ulp below -1, and 1 + erf(z) was
# -1.2e-7 where it must be 0 (GELU(-20) was +1.2e-6 and GELU(-1e6) +0.06, growing with |x|). The
# clamp after the fused 1 + z P / Q costs one vmaxps (clamping erf itself at -1 took three
# operations, the fused multiply-add split: bfloat16 bias-GELU ~10% slower). Where the GELU is
# rounded to a half type (8 or 11 bits) a fit of degrees 4 and 3 (``tools/fit_erf.py --degrees 4 3``):
# 3.7e-6 evaluated in float32 (1/1000 of bfloat16's unit roundoff, 1/130 of float16's), three of the
# erf's FMAs fewer (gelu.py's docstring has what it gained).
_ERF_Z_MAX = 4.0
_ERF_P = (
    1.128379075110033,
    2.3689332468719773,
    11.529766079130393,
    7.550756739158106,
    9.005213846679423,
    -3.678338374302783,
    1.251627841146014,
    -0.20006841108392498,
)
_ERF_Q = (1.0, 7.432727638433365, 24.26036545712762, 43.2919858710228, 39.84000414470118)
_ERF_P_HALF = (1.1284049785270638, 2.589223206823955, 12.239847139118256, 4.591763869953932, -0.32482795756876776)
_ERF_Q_HALF = (1.0, 7.6312851626173615, 25.81129398160848, 46.454788048258564)


def _one_plus_erf(z, acc_dtype, half_results: bool = False):
    """The expression 1 + erf(z), never below 0 (a plain Python helper building the expression);
    float64: the library's erf (no speed goal there, and gradcheck's finite differences need its
    accuracy); ``half_results``: the caller rounds the result to a half type (the cheaper fit)."""
    if acc_dtype == "float64":
        return T.float64(1) + T.erf(z)
    z = _at_most(_at_least(z, T.float32(-_ERF_Z_MAX)), T.float32(_ERF_Z_MAX))
    s = z * z * T.float32(1 / _ERF_Z_MAX**2)
    p, q = (_ERF_P_HALF, _ERF_Q_HALF) if half_results else (_ERF_P, _ERF_Q)
    numerator = T.float32(p[-1])
    for c in reversed(p[:-1]):
        numerator = numerator * s + T.float32(c)
    denominator = T.float32(q[-1])
    for c in reversed(q[:-1]):
        denominator = denominator * s + T.float32(c)
    return _at_least(T.float32(1) + z * (numerator / denominator), T.float32(0))
