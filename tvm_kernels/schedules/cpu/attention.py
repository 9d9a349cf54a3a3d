"""Fused local attention on the CPU, forward and backward: Q.K^T, softmax and probs.V per tile
of queries, no band in memory (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import (
    accumulation_dtype,
    column_step,
    dropout_factor,
    dropout_factor_of,
    dropout_row_key,
    is_half,
)
from tvm_kernels.schedules.cpu import bf16_dot
from tvm_kernels.schedules.cpu.dropout import lane_column_steps
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _ROWS_AHEAD,
    _accumulate,
    _add_lanes,
    _exp,
    _feature_major,
    _fill_residue_major,
    _fill_run,
    _pack_operands,
    _prefetch_next_tile,
    _prefetch_row,
    _rounded,
    _rows_feature_major,
    _run_origin,
    _run_tiles,
    _tanh,
    _transpose_square,
    _zero_tile,
)
from tvm_kernels.schedules.cpu.tiles import tiles_for


@T.macro
def _apply_dropout(
    scores, kept, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype, grads=None, twice=False
):
    """kept[r, c] = scores[r, c] * Z[r, c] (the mask: 1/(1-p) or 0) at each row's valid columns [begin,
    end) (its other columns are left as they are); ``kept`` may be ``scores`` itself (in place).
    ``twice``: also grads *= Z in the same pass (the backward's two uses of the forward's mask, P * Z
    for dV and dP * Z, at one hash per element: the factor is written out at each use, which LLVM
    computes once, where a let of it inside the vectorized loop would scalarize it)."""
    lane_steps = T.alloc_local((lanes,), "uint32", annotations=_ON_STACK)
    lane_column_steps(lane_steps, lanes)
    for r in range(rows):
        key: T.let = dropout_row_key(seed, bh, query[r])
        for vector in range((end[r] - begin[r]) // T.int64(lanes)):
            start: T.let = begin[r] + vector * T.int64(lanes)
            hashed_start: T.let = key + column_step(start - base - T.int64(r))
            for lane in T.vectorized(lanes):
                kept[r, start + lane] = scores[r, start + lane] * dropout_factor_of(
                    hashed_start + lane_steps[lane], dropout, acc_dtype
                )
                if twice:
                    grads[r, start + lane] = grads[r, start + lane] * dropout_factor_of(
                        hashed_start + lane_steps[lane], dropout, acc_dtype
                    )
        for c in range(begin[r] + (end[r] - begin[r]) // T.int64(lanes) * T.int64(lanes), end[r]):
            kept[r, c] = scores[r, c] * dropout_factor(key, c - base - T.int64(r), dropout, acc_dtype)
            if twice:
                grads[r, c] = grads[r, c] * dropout_factor(key, c - base - T.int64(r), dropout, acc_dtype)


@T.macro
def _attention_tile_bounds(query, begin, end, row_of, n, p0, w, d, band, base, rows):
    """The tile's sequence rows and their valid columns [begin, end) in the scores buffer (row r's
    band column j is at base + r + j; empty past the end)."""
    for r in T.unroll(rows):
        query[r] = row_of[T.min(p0 + T.int64(r), n - T.int64(1))]  # rows past the end are not stored
        begin[r] = T.Select(p0 + T.int64(r) < n, base + T.int64(r) + T.max(w - query[r] // d, T.int64(0)), T.int64(0))
        end[r] = T.Select(
            p0 + T.int64(r) < n,
            base + T.int64(r) + T.min(w + (n - T.int64(1) - query[r]) // d + T.int64(1), band),
            T.int64(0),
        )


@T.macro
def _attention_tile_operand(queries, t_rows, query, b, h, head_dim, scale, rows, lanes, acc_dtype):
    """queries[r] = the tile's row r of ``t_rows`` times ``scale``, in the accumulation dtype."""
    for r in range(rows):
        for vector in range(head_dim // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                queries[r, vector * T.int64(lanes) + lane] = T.Cast(
                    acc_dtype, t_rows[b, query[r], h, vector * T.int64(lanes) + lane]
                ) * T.Cast(acc_dtype, scale)


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
def _soft_cap(
    scores, derivatives, begin, end, tile_blocks, rows, cols, lanes, softcap, acc_dtype, minus_inf, with_derivatives
):
    """Logit soft-capping (Gemma 2) in place over the tile's computed blocks: each row's valid
    scores become softcap * tanh(score / softcap), the others -inf (the softmax's fill, done first
    so that nothing outside a row's band reaches its derivatives); a score of -inf (a padding
    key's bias) stays -inf, as transformers adds its mask after the cap. ``with_derivatives``:
    also derivatives[r, c] = d capped / d score = 1 - (capped / softcap)^2 (0 at -inf), the factor
    the backward's dS takes."""
    cap: T.let = T.Cast(acc_dtype, softcap)
    inverse: T.let = T.Cast(acc_dtype, T.float64(1) / softcap)
    for r in range(rows):
        _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, minus_inf)
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                scores[r, vector * T.int64(lanes) + lane] = T.Select(
                    scores[r, vector * T.int64(lanes) + lane] == minus_inf,
                    minus_inf,
                    cap * _tanh(scores[r, vector * T.int64(lanes) + lane] * inverse, acc_dtype),
                )
                if with_derivatives:
                    derivatives[r, vector * T.int64(lanes) + lane] = T.Select(
                        scores[r, vector * T.int64(lanes) + lane] == minus_inf,
                        T.Cast(acc_dtype, 0),
                        T.Cast(acc_dtype, 1)
                        - (scores[r, vector * T.int64(lanes) + lane] * inverse)
                        * (scores[r, vector * T.int64(lanes) + lane] * inverse),
                    )


@T.macro
def _attention_tile_scores(
    scores,
    acc,
    queries,
    keys,
    biases,
    block0,
    tile_blocks,
    head_dim,
    rows,
    sub_rows,
    cols,
    acc_dtype,
    with_bias,
    dot,
    scale,
    transposed=False,
):
    """scores[r, c] = queries[r] . packed key (block0 * cols + c) (+ that key's bias), for the key
    blocks [tile_blocks[0], tile_blocks[1]) (relative to block0), ``sub_rows`` rows (the register
    tile ``acc``) at a time. ``dot``: queries and keys are bfloat16 feature pairs (bf16_dot.py),
    the products times ``scale`` (the float kernels scale the queries instead). ``transposed``:
    queries feature-major, ``queries[f, r]`` (:func:`microkernels._rows_feature_major`)."""
    for sub in range(rows // sub_rows):
        row0: T.let = sub * T.int64(sub_rows)
        for block in range(tile_blocks[0], tile_blocks[1]):
            _zero_tile(acc, sub_rows, cols, acc_dtype)
            if dot:
                bf16_dot.dot_key_block(acc, queries, row0, keys, block0 + block, head_dim, sub_rows, 1)
                for r in T.unroll(sub_rows):
                    for lane in T.vectorized(cols):
                        acc[r, lane] = acc[r, lane] * T.Cast(acc_dtype, scale)
            else:
                for f in range(head_dim):
                    for r in T.unroll(sub_rows):
                        for lane in T.vectorized(cols):
                            if transposed:
                                acc[r, lane] = (
                                    acc[r, lane] + queries[f, row0 + T.int64(r)] * keys[block0 + block, f, lane]
                                )
                            else:
                                acc[r, lane] = (
                                    acc[r, lane] + queries[row0 + T.int64(r), f] * keys[block0 + block, f, lane]
                                )
            for r in T.unroll(sub_rows):
                for lane in T.vectorized(cols):
                    if with_bias:
                        scores[row0 + T.int64(r), block * T.int64(cols) + lane] = (
                            acc[r, lane] + biases[(block0 + block) * T.int64(cols) + lane]
                        )
                    else:
                        scores[row0 + T.int64(r), block * T.int64(cols) + lane] = acc[r, lane]


@T.macro
def _attention_tile_context(
    out,
    out_acc,
    scores,
    values,
    row_scale,
    span,
    begin,
    end,
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
    group,
    features,
    acc_dtype,
    dtype,
    dot,
):
    """out row r = row_scale[r] * sum over c of scores[r, c] * packed value row (block0 * cols + c).
    ``dot``: scores as bfloat16 pairs of columns (2c, 2c + 1), values as pairs of packed rows
    (bf16_dot.py), two columns per step."""
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
            if dot:  # pairs of columns from an even one (the tile's blocks start even, end even)
                for pair in range(span[0] // T.int64(2), (span[1] + T.int64(1)) // T.int64(2)):
                    for r in T.unroll(group):
                        bf16_dot.dot_pairs(
                            out_acc,
                            r,
                            values,
                            block0 * T.int64(cols) + pair * T.int64(2),
                            column,
                            features // bf16_dot.LANES,
                            scores[g * group + r, pair],
                        )
            else:
                for key in range(span[0], span[1]):
                    for r in T.unroll(group):
                        _accumulate(
                            out_acc,
                            r,
                            values,
                            block0 * T.int64(cols) + key,
                            column,
                            features,
                            scores[g * group + r, key],
                        )
            for r in T.unroll(group):
                if p0 + T.int64(g * group + r) < n:
                    for lane in T.vectorized(features):
                        out[b, query[g * group + r], h, column + lane] = _rounded(
                            dtype, out_acc[r, lane] * row_scale[g * group + r]
                        )


# Independent running maxima per row in the softmax's first pass: one chain waited on each vmaxps
# (latency 4 on an Intel core) where the loop issues one every half cycle.
_MAX_CHAINS = 4


def _lanes_reduced(kind, buffer, row, lanes):
    """The max or sum (``kind``) of buffer[row, 0 .. lanes) as a balanced tree (a plain Python
    helper building the expression): log2(lanes) dependent steps where a running fold took
    lanes - 1 (each ~4 cycles)."""
    terms = [buffer[row, lane] for lane in range(lanes)]
    while len(terms) > 1:
        terms = [T.max(x, y) if kind == "max" else x + y for x, y in zip(terms[::2], terms[1::2])]
    return terms[0]


@T.macro
def _attention_tile_softmax(
    scores,
    partial,
    row_max,
    reciprocal,
    log_sum,
    begin,
    end,
    tile_blocks,
    rows,
    cols,
    lanes,
    acc_dtype,
    dtype,
    minus_inf,
    pairs=None,
    round_now=None,
):
    """Each row, over the tile's computed blocks: -inf at its invalid and out-of-band columns (exp
    gives exactly 0 there), then exp(score - row max) in place, 1 / their sum, and the row's
    log-sum-exp of the scores (-inf for a row with no key). ``partial``: _MAX_CHAINS x lanes. With
    ``pairs`` and where ``round_now`` (no dropout to apply first), the probabilities also rounded
    to the dot product's bfloat16 pairs of columns as each vector is computed, where a pass of its
    own re-read them (the AMX forward 0.97 of its time)."""
    first: T.let = tile_blocks[0] * T.int64(cols // lanes)  # the row's computed vectors
    count: T.let = (tile_blocks[1] - tile_blocks[0]) * T.int64(cols // lanes)
    for r in range(rows):
        _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, minus_inf)
        for chain in T.unroll(_MAX_CHAINS):
            for lane in T.vectorized(lanes):
                partial[chain, lane] = minus_inf
        for step in range(count // T.int64(_MAX_CHAINS)):
            for chain in T.unroll(_MAX_CHAINS):
                for lane in T.vectorized(lanes):
                    partial[chain, lane] = T.max(
                        partial[chain, lane],
                        scores[r, (first + step * T.int64(_MAX_CHAINS) + T.int64(chain)) * T.int64(lanes) + lane],
                    )
        for vector in range(first + count // T.int64(_MAX_CHAINS) * T.int64(_MAX_CHAINS), first + count):
            for lane in T.vectorized(lanes):
                partial[0, lane] = T.max(partial[0, lane], scores[r, vector * T.int64(lanes) + lane])
        for chain in T.unroll(1, _MAX_CHAINS):
            for lane in T.vectorized(lanes):
                partial[0, lane] = T.max(partial[0, lane], partial[chain, lane])
        row_max[0] = _lanes_reduced("max", partial, 0, lanes)
        if row_max[0] == minus_inf:  # a row past the end (never stored): no NaN from -inf - -inf
            row_max[0] = T.Cast(acc_dtype, 0)
        for lane in T.vectorized(lanes):
            partial[0, lane] = T.Cast(acc_dtype, 0)
        for vector in range(first, first + count):
            for lane in T.vectorized(lanes):
                scores[r, vector * T.int64(lanes) + lane] = _exp(
                    scores[r, vector * T.int64(lanes) + lane] - row_max[0], acc_dtype, is_half(dtype)
                )
                partial[0, lane] = partial[0, lane] + scores[r, vector * T.int64(lanes) + lane]
            if pairs is not None:
                if round_now:
                    bf16_dot.round_to_pairs(
                        pairs, r, scores, vector * T.int64(lanes), (vector + T.int64(1)) * T.int64(lanes)
                    )
        reciprocal[r] = _lanes_reduced("sum", partial, 0, lanes)
        log_sum[r] = row_max[0] + T.log(reciprocal[r])  # one scalar log per row; log(0) = -inf
        # 1 / sum, 0 for a row with no key; a NaN sum (a NaN score) stays NaN.
        reciprocal[r] = T.Select(
            reciprocal[r] == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 1) / reciprocal[r]
        )


@T.macro
def _attention_tile_probs(
    scores, lse, query, begin, end, b, h, tile_blocks, rows, cols, lanes, acc_dtype, dtype, minus_inf
):
    """The backward's P from the forward's log-sum-exp, in place over the tile's computed blocks:
    exp(score - lse) at each row's valid columns, exactly 0 elsewhere (-inf first) and in rows with
    no key (lse -inf) or past the end (no valid column)."""
    for r in range(rows):
        _fill_outside_row(scores, r, begin, end, tile_blocks, cols, lanes, minus_inf)
        row_lse: T.let = T.Select(lse[b, query[r], h] == minus_inf, T.Cast(acc_dtype, 0), lse[b, query[r], h])
        for vector in range(tile_blocks[0] * T.int64(cols // lanes), tile_blocks[1] * T.int64(cols // lanes)):
            for lane in T.vectorized(lanes):
                scores[r, vector * T.int64(lanes) + lane] = _exp(
                    scores[r, vector * T.int64(lanes) + lane] - row_lse, acc_dtype, is_half(dtype)
                )


@T.macro
def _attention_tile_deltas(
    row_delta, partial, grad_rows, out, grad_lse, query, p0, n, b, h, head_dim, rows, lanes, acc_dtype
):
    """row_delta[r] = rowsum(dO * O) less the log-sum-exp's gradient, per row of the tile (0 past the end):
    the softmax backward's shift, from the tile's dO rows already converted in grad_rows."""
    for r in range(rows):
        for lane in T.vectorized(lanes):
            partial[lane] = T.Cast(acc_dtype, 0)
        for vector in range(head_dim // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                partial[lane] = partial[lane] + grad_rows[r, vector * T.int64(lanes) + lane] * T.Cast(
                    acc_dtype, out[b, query[r], h, vector * T.int64(lanes) + lane]
                )
        row_delta[r] = T.Cast(acc_dtype, 0) - grad_lse[b, query[r], h]
        _add_lanes(row_delta, partial, lanes, r)
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
                    grads[r, vector * T.int64(lanes) + lane] - row_delta[r]
                )


@T.macro
def _accumulate_keys(
    total, weights, tile_rows, first, start, width, head_dim, rows, keys, features, key_acc, acc_dtype, dot
):
    """total[first + c] += sum over the tile's rows r of weights[r, c] * tile_rows[r], for c in
    [start, start + width) (width a multiple of ``keys``): dK and dV, the transposed products, per
    tile. ``keys`` packed rows x ``features`` accumulate in registers; per tile row one broadcast per
    key, one load per vector. ``dot``: two tile rows per step, weights and rows as bfloat16 pairs of
    rows (``weights[i, c]``, ``tile_rows[i]``: rows 2i and 2i + 1; bf16_dot.py)."""
    for group in range(width // T.int64(keys)):
        for feature_tile in range(head_dim // T.int64(features)):
            column: T.let = feature_tile * T.int64(features)
            for j in T.unroll(keys):
                for lane in T.vectorized(features):
                    key_acc[j, lane] = total[first + start + group * T.int64(keys) + T.int64(j), column + lane]
            if dot:
                for pair in range(rows // 2):
                    for j in T.unroll(keys):
                        bf16_dot.dot_pairs(
                            key_acc,
                            j,
                            tile_rows,
                            T.int64(pair),
                            column,
                            features // bf16_dot.LANES,
                            weights[pair, start + group * T.int64(keys) + T.int64(j)],
                        )
            else:
                for r in range(rows):
                    for j in T.unroll(keys):
                        _accumulate(
                            key_acc,
                            j,
                            tile_rows,
                            T.int64(r),
                            column,
                            features,
                            weights[r, start + group * T.int64(keys) + T.int64(j)],
                        )
            for j in T.unroll(keys):
                for lane in T.vectorized(features):
                    total[first + start + group * T.int64(keys) + T.int64(j), column + lane] = key_acc[j, lane]


@T.macro
def _nothing():
    T.evaluate(0)


@dataclass(frozen=True)
class TileProducts:
    """The fused kernels' tile products, as macros with the signatures of the vector ones here, and
    what each task of the parallel loop runs before its first tile and after its last
    (``task_begin``, ``task_end``). ``scores``: the Q.K^T-shaped products (the forward's scores, the
    backward's scores and dP = dO.V^T; :func:`_attention_tile_scores`); ``context``: the P.V-shaped
    ones (the forward's output, the backward's dQ = dS.K; :func:`_attention_tile_context`);
    ``key_sums``: the backward's dV += P^T dO and dK += dS^T Q (:func:`_accumulate_keys`), into sums
    laid out key-major (``total[t, f]``) or, with ``feature_major_sums``, in blocks of ``cols`` keys
    feature-major (``total[t // cols, f, t % cols]``). The default runs them on vector registers
    (FMAs, or bf16_dot.py's dot product); a target whose products run on other units (AMX tiles:
    schedules/cpu_amx) passes its own to :func:`attention` and :func:`attention_backward` and keeps
    the rest of the kernels."""

    scores: object = _attention_tile_scores
    context: object = _attention_tile_context
    key_sums: object = _accumulate_keys
    feature_major_sums: bool = False
    task_begin: object = _nothing
    task_end: object = _nothing


VECTOR_PRODUCTS = TileProducts()


@T.macro
def _pack_dot_operands(
    keys,
    pairs,
    biases,
    key_tile,
    k,
    key_words,
    v,
    value_bits,
    key_bias,
    row_of,
    block_keys,
    b,
    h,
    n,
    head_dim,
    margin,
    length,
    cols,
    per_line,
):
    """The fused kernels' operands for the bfloat16 dot product, in packed order as
    :func:`_pack_operands` (``length`` packed columns, ``margin`` of them before the first key):
    keys as feature pairs, values as pairs of consecutive rows (bf16_dot.py), the biases.
    ``key_words``, ``value_bits``: k's and v's 32-bit and 16-bit views."""
    bf16_dot.pack_key_pairs(
        keys,
        key_words,
        key_tile,
        row_of,
        block_keys,
        k,
        b,
        h,
        n,
        head_dim,
        margin,
        length // T.int64(cols),
        cols,
        per_line,
    )
    bf16_dot.pack_row_pairs(pairs, value_bits, v, row_of, b, h, n, head_dim, margin, length, per_line)
    for t in range(length):
        biases[t] = T.Select(
            t >= margin and t < margin + n,
            key_bias[b, row_of[T.max(T.min(t - margin, n - T.int64(1)), T.int64(0))]],
            T.Cast(key_bias.dtype, 0),
        )


def _attention_sizes(dtype: str, autoregressive: bool, isa: str) -> tuple:
    acc_dtype = accumulation_dtype(dtype)
    tiles = tiles_for(isa)  # the Q.K^T and probs.V tiles of qk and pv (tiles.py)
    lanes = tiles.vector_bits // (64 if acc_dtype == "float64" else 32)
    return (
        acc_dtype,
        lanes,
        tiles.qk_rows,
        tiles.qk_vectors * lanes,
        tiles.band_rows,  # rows of one probs.V register tile
        2 * lanes,
        1 if autoregressive else 0,
        64 * 8 // _BITS[dtype],
        tirx.const(float("-inf"), acc_dtype),
    )


# Packed rows of one head's operands: the sequence with margins of a band and a few tiles.
def _packed_length(n, window, causal, rows, cols):
    return (
        (n + T.int64(2 - causal) * window + T.int64(1) + T.int64(rows + 4 * cols)) // T.int64(cols) + T.int64(1)
    ) * T.int64(cols)


def attention(dtype: str, autoregressive: bool, isa: str, products: TileProducts = VECTOR_PRODUCTS):
    """Fused local attention: ``out = softmax(scale * Q.K^T on the band) . V``, and each row's
    log-sum-exp.

    What :func:`qk`, a softmax over each row's valid keys and :func:`pv` compute one after the
    other, without the band in memory: per tile of ``rows`` consecutive packed queries, the
    Q.K^T micro-kernel writes the tile's scores (the keys it touches, a few more than the band)
    into a buffer that stays in cache; each row is exponentiated in place (0 at its invalid
    and out-of-band keys) and summed; the probs.V micro-kernel then streams the same packed
    value rows through once, and each output row is divided by its sum as it is stored.
    Arguments: q ``[b, n, h, f]``, k and v ``[b, n, h_kv, f]`` (grouped key/value heads: ``h_kv``
    divides ``h``, query head i reads key/value head ``i // (h / h_kv)``), key_bias ``[b, n]`` (accumulation dtype: 0, or -inf for
    a key no query attends to), dilation ``[h]``, the one-sided window ``w``, the score scale, the
    logit soft-cap (0: none; else each valid score s becomes softcap * tanh(s / softcap) before the
    softmax, the bias's -inf kept: :func:`_soft_cap`), the dropout probability p and its seed (p = 0: none; else each probability is kept with its
    factor 1/(1-p) or zeroed, by the stateless generator above, after lse), out
    ``[b, n, h, f]``, lse ``[b, n, h]`` (accumulation dtype: each row's log-sum-exp of its scaled,
    biased scores, -inf for a row with no key: what the backward recomputes the probabilities
    from, and what merges this result with attention to other keys, such as global tokens), and
    ``runs``: runs of query tiles per (batch, head), each a task of the parallel loop with its
    own packed operands (:func:`_run_tiles`; the results do not depend on it).
    A row with no key left gets 0. bfloat16 where the ISA has the bfloat16 dot product: both
    products on it (bf16_dot.py), the probabilities rounded to bfloat16 pairs before P.V.
    ``products``: the tile products' implementation (:class:`TileProducts`).
    """
    acc_dtype, lanes, rows, cols, group, features, causal, per_line, minus_inf = _attention_sizes(
        dtype, autoregressive, isa
    )
    dot = tiles_for(isa).dot_product_for(dtype)
    features_per_step = 2 if dot else 1  # packed keys: features (FMA) or pairs of features (dot)
    packed_dtype = "int32" if dot else acc_dtype
    transposed = _feature_major(dot, rows, lanes)  # the tile's queries (microkernels.py)

    @T.prim_func
    def main(
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        key_bias_handle: T.handle,
        dilation_handle: T.handle,
        window: T.int64,
        scale: T.float64,
        softcap: T.float64,
        dropout: T.float64,
        seed: T.int64,
        out_handle: T.handle,
        lse_handle: T.handle,
        runs: T.int64,
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        kv_heads = T.int64()
        q = T.match_buffer(q_handle, (batch, n, heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (batch, n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (batch, n, kv_heads, head_dim), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        # The dot product's views of the inputs: bfloat16 pairs as 32-bit words, bit patterns.
        query_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=q.data) if dot else ()
        key_words = T.decl_buffer((batch, n, kv_heads, head_dim // T.int64(2)), "int32", data=k.data) if dot else ()
        value_bits = T.decl_buffer((batch, n, kv_heads, head_dim), "uint16", data=v.data) if dot else ()
        w: T.let = window
        band: T.let = T.int64(2 - causal) * window + T.int64(1)
        margin: T.let = w + T.int64(cols)  # packed columns before the first key
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            kv_h: T.let = h // (heads // kv_heads)  # its key/value head (grouped heads: kv_heads divides heads)
            d: T.let = T.Cast("int64", dilation[h])
            tile_begin: T.let = T.min(item % runs * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            # The run's operands are packed from its first column on (run_margin columns before the first key).
            run_margin: T.let = margin - _run_origin(tile_begin * T.int64(rows) - w + margin, cols)
            length: T.let = _packed_length(run_tiles * T.int64(rows), window, causal, rows, cols)
            row_of = T.decl_buffer((n,), "int64")
            keys = T.decl_buffer(
                (length // T.int64(cols), head_dim // T.int64(features_per_step), T.int64(cols)), packed_dtype
            )
            # Value rows (the dot product: pairs of consecutive rows).
            values = T.decl_buffer((length, head_dim), packed_dtype)
            biases = T.decl_buffer((length,), acc_dtype)
            scores = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            # The dot product's probabilities: bfloat16 pairs of scores columns (the float kernels
            # read the scores themselves).
            probs = (
                T.decl_buffer((T.int64(rows), (band + T.int64(rows + 2 * cols + 1)) // T.int64(2)), "int32")
                if dot
                else ()
            )
            queries = T.decl_buffer(
                (head_dim, T.int64(rows)) if transposed else (T.int64(rows), head_dim // T.int64(features_per_step)),
                packed_dtype,
            )
            query_tile = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            query_scratch = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), packed_dtype, annotations=_ON_STACK)
            begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            row_scale = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            log_sum = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            partial = T.alloc_local((_MAX_CHAINS, lanes), acc_dtype, annotations=_ON_STACK)
            row_max = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            acc = T.alloc_local((rows, cols), acc_dtype, annotations=_ON_STACK)
            out_acc = T.alloc_local((group, features), acc_dtype, annotations=_ON_STACK)
            _fill_residue_major(row_of, n, d)
            if dot:
                _pack_dot_operands(
                    keys,
                    values,
                    biases,
                    key_tile,
                    k,
                    key_words,
                    v,
                    value_bits,
                    key_bias,
                    row_of,
                    block_keys,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length,
                    cols,
                    per_line,
                )
            else:
                _pack_operands(
                    keys,
                    values,
                    biases,
                    key_tile,
                    k,
                    v,
                    key_bias,
                    row_of,
                    block_keys,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length // T.int64(cols),
                    cols,
                    lanes,
                    per_line,
                    acc_dtype,
                    True,
                    True,
                )
            products.task_begin()
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + run_margin  # packed column of row 0's band column 0
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)  # scores column of row 0's band column 0
                _attention_tile_bounds(query, begin, end, row_of, n, p0, w, d, band, base, rows)
                _prefetch_next_tile(q, b, row_of, p0, rows, n, h, head_dim, per_line)
                if dot:
                    bf16_dot.copy_word_rows(queries, query_words, query, b, h, head_dim, rows)
                elif transposed:
                    _rows_feature_major(
                        queries, query_tile, query_scratch, q, query, b, h, head_dim, scale, lanes, acc_dtype
                    )
                else:
                    _attention_tile_operand(queries, q, query, b, h, head_dim, scale, rows, lanes, acc_dtype)
                _attention_tile_blocks(tile_blocks, begin, end, rows, cols)
                products.scores(
                    scores,
                    acc,
                    queries,
                    keys,
                    biases,
                    block0,
                    tile_blocks,
                    head_dim,
                    rows,
                    rows,
                    cols,
                    acc_dtype,
                    True,
                    dot,
                    scale,
                    transposed,
                )
                if softcap > T.float64(0):
                    _soft_cap(
                        scores, (), begin, end, tile_blocks, rows, cols, lanes, softcap, acc_dtype, minus_inf, False
                    )
                _attention_tile_softmax(
                    scores,
                    partial,
                    row_max,
                    row_scale,
                    log_sum,
                    begin,
                    end,
                    tile_blocks,
                    rows,
                    cols,
                    lanes,
                    acc_dtype,
                    dtype,
                    minus_inf,
                    probs if dot else None,
                    dropout <= T.float64(0),
                )
                for r in range(rows):
                    if p0 + T.int64(r) < n:
                        lse[b, query[r], h] = log_sum[r]
                if dropout > T.float64(0):
                    _apply_dropout(scores, scores, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype)
                if dot and dropout > T.float64(0):  # (without dropout the softmax rounded them)
                    for r in range(rows):
                        bf16_dot.round_to_pairs(
                            probs, r, scores, tile_blocks[0] * T.int64(cols), tile_blocks[1] * T.int64(cols)
                        )
                products.context(
                    out,
                    out_acc,
                    probs if dot else scores,
                    values,
                    row_scale,
                    span,
                    begin,
                    end,
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
                    group,
                    features,
                    acc_dtype,
                    dtype,
                    dot,
                )
            products.task_end()

    return bf16_dot.with_dot_product(main) if dot else main


def attention_backward(dtype: str, autoregressive: bool, isa: str, products: TileProducts = VECTOR_PRODUCTS):
    """The fused kernel's backward, FlashAttention-style: dQ, dK and dV with no band in memory.

    Arguments: dO ``[b, n, h, f]``, q, k, v, key_bias, out and lse as in :func:`attention` (out and
    lse from its forward call), grad_lse ``[b, n, h]`` (the gradient of lse, accumulation dtype;
    it joins the softmax's shift delta = rowsum(dO * O) - grad_lse, computed per tile), dilation, ``w``,
    the score scale, the forward's soft-cap (with one, P comes from the capped scores and dS is
    multiplied by the cap's derivative 1 - tanh^2 before dQ and dK), the forward's dropout p and seed
    (its mask Z is regenerated: dP = (dO . V^T) * Z, dV from P * Z), dQ, dK, dV ``[b, n, h, f]``
    (per query head: with grouped key/value heads the caller sums each group's dK and dV), and
    ``runs`` as in the forward. Per run of
    query tiles K and V are packed as in the forward, and dK, dV accumulate over the run's tiles
    in packed rows (scratch of the packed operands' size), cast into place at the end; the keys
    near an edge between two runs, which both runs' queries reach, are summed after all runs (dQ
    does not depend on ``runs``, dK and dV only by the order of that sum). Per tile of ``rows`` packed queries, in cache: the
    scores again (the Q.K^T micro-kernel) and P = exp(score - lse); dP = dO . V^T (the same
    micro-kernel); dS = P * (dP - delta); dQ = scale * dS . K (the probs.V micro-kernel);
    dV += P^T dO and dK += dS^T (scale Q) over the keys the tile touches. bfloat16 where the ISA
    has the bfloat16 dot product: the five products on it (bf16_dot.py), P and dS rounded to
    bfloat16 pairs for them. ``products``: the tile products' implementation (:class:`TileProducts`).
    """
    acc_dtype, lanes, qk_rows, cols, group, features, causal, per_line, minus_inf = _attention_sizes(
        dtype, autoregressive, isa
    )
    keys_per_update = tiles_for(isa).key_update_rows  # rows of the dK/dV register tile (x 2 vectors)
    # Queries per tile: the dK/dV update sums over them in registers, so a taller tile loads and
    # stores its accumulators fewer times per FMA; Q.K^T and dQ run over it in register tiles.
    rows = tiles_for(isa).backward_tile_rows
    if rows % qk_rows or rows % group:
        raise ValueError(
            f"tiles.py: backward_tile_rows {rows} must be a multiple of qk_rows {qk_rows} and band_rows {group}"
        )
    # The update walks a tile's key span (whole packed blocks of ``cols`` keys) in groups of
    # ``keys_per_update``: a group size that does not divide the block would drop keys silently.
    if cols % keys_per_update:
        raise ValueError(
            f"tiles.py: key_update_rows {keys_per_update} must divide the Q.K^T block of "
            f"{cols} keys ({acc_dtype}, {isa})"
        )
    dot = tiles_for(isa).dot_product_for(dtype)  # the five products on the dot product (see attention)
    if dot and rows % 2:  # dK and dV take the tile's rows in pairs: an odd row would be dropped
        raise ValueError(f"tiles.py: backward_tile_rows {rows} must be even for the bfloat16 dot product ({isa})")
    features_per_step = 2 if dot else 1
    packed_dtype = "int32" if dot else acc_dtype
    # Q and dO feature-major too for the two Q.K^T-shaped products (see attention); dK and dV read
    # them as rows.
    transposed = _feature_major(dot, rows, lanes)
    blocked = products.feature_major_sums  # dK, dV sums as total[t // cols, f, t % cols] (TileProducts)
    if blocked and cols != lanes:
        raise ValueError(f"feature-major key sums need blocks of one vector of keys (cols {cols}, lanes {lanes})")

    @T.prim_func
    def main(
        grad_handle: T.handle,
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        key_bias_handle: T.handle,
        out_handle: T.handle,
        lse_handle: T.handle,
        grad_lse_handle: T.handle,
        dilation_handle: T.handle,
        window: T.int64,
        scale: T.float64,
        softcap: T.float64,
        dropout: T.float64,
        seed: T.int64,
        grad_q_handle: T.handle,
        grad_k_handle: T.handle,
        grad_v_handle: T.handle,
        runs: T.int64,
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        kv_heads = T.int64()
        grad = T.match_buffer(grad_handle, (batch, n, heads, head_dim), dtype)
        q = T.match_buffer(q_handle, (batch, n, heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (batch, n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (batch, n, kv_heads, head_dim), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        grad_lse = T.match_buffer(grad_lse_handle, (batch, n, heads), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        grad_q = T.match_buffer(grad_q_handle, (batch, n, heads, head_dim), dtype)
        grad_k = T.match_buffer(grad_k_handle, (batch, n, heads, head_dim), dtype)
        grad_v = T.match_buffer(grad_v_handle, (batch, n, heads, head_dim), dtype)
        # The dot product's views of the inputs: bfloat16 pairs as 32-bit words, bit patterns.
        grad_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=grad.data) if dot else ()
        grad_bits = T.decl_buffer((batch, n, heads, head_dim), "uint16", data=grad.data) if dot else ()
        query_words = T.decl_buffer((batch, n, heads, head_dim // T.int64(2)), "int32", data=q.data) if dot else ()
        query_bits = T.decl_buffer((batch, n, heads, head_dim), "uint16", data=q.data) if dot else ()
        key_words = T.decl_buffer((batch, n, kv_heads, head_dim // T.int64(2)), "int32", data=k.data) if dot else ()
        key_bits = T.decl_buffer((batch, n, kv_heads, head_dim), "uint16", data=k.data) if dot else ()
        value_words = T.decl_buffer((batch, n, kv_heads, head_dim // T.int64(2)), "int32", data=v.data) if dot else ()
        w: T.let = window
        band: T.let = T.int64(2 - causal) * window + T.int64(1)
        margin: T.let = w + T.int64(cols)
        tiles: T.let = (n + T.int64(rows - 1)) // T.int64(rows)
        run_tiles: T.let = _run_tiles(tiles, w, rows, runs)
        # Keys within the window of a run's edge at packed position e, [e - w, e + reach), are
        # summed by the runs on both sides: each writes its part here (side 0: the run before the
        # edge), added and stored after all runs (edge c: the start of run c + 1). At most 4x the
        # size of dK in float32 (runs of 2w + 1 queries); a few rows with one run.
        reach: T.let = T.int64(1 - causal) * w
        # (Never 0: a division by it inside ``if runs > 1`` still trapped with one run.)
        edges: T.let = T.max(runs - T.int64(1), T.int64(1))
        edge_keys: T.let = T.Select(runs > T.int64(1), w + reach, T.int64(0)) + T.int64(1)
        edge_parts_k = T.decl_buffer((batch * heads, edges, T.int64(2), edge_keys, head_dim), acc_dtype)
        edge_parts_v = T.decl_buffer((batch * heads, edges, T.int64(2), edge_keys, head_dim), acc_dtype)
        for item in T.parallel(batch * heads * runs):
            bh: T.let = item // runs
            b: T.let = bh // heads
            h: T.let = bh % heads
            kv_h: T.let = h // (heads // kv_heads)
            d: T.let = T.Cast("int64", dilation[h])
            run: T.let = item % runs
            tile_begin: T.let = T.min(run * run_tiles, tiles)
            tile_end: T.let = T.min(tile_begin + run_tiles, tiles)
            run_margin: T.let = margin - _run_origin(tile_begin * T.int64(rows) - w + margin, cols)
            length: T.let = _packed_length(run_tiles * T.int64(rows), window, causal, rows, cols)
            row_of = T.decl_buffer((n,), "int64")
            keys_k = T.decl_buffer(
                (length // T.int64(cols), head_dim // T.int64(features_per_step), T.int64(cols)), packed_dtype
            )
            keys_v = T.decl_buffer(
                (length // T.int64(cols), head_dim // T.int64(features_per_step), T.int64(cols)), packed_dtype
            )
            rows_k = T.decl_buffer((length, head_dim), packed_dtype)  # dot: row pairs
            biases = T.decl_buffer((length,), acc_dtype)
            sums_shape = (length // T.int64(cols), head_dim, T.int64(cols)) if blocked else (length, head_dim)
            total_k = T.decl_buffer(sums_shape, acc_dtype)
            total_v = T.decl_buffer(sums_shape, acc_dtype)
            probs = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            grads = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)
            kept = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)  # P with dropout
            derivatives = T.decl_buffer((T.int64(rows), band + T.int64(rows + 2 * cols)), acc_dtype)  # of the soft-cap
            queries = T.decl_buffer((T.int64(rows), head_dim // T.int64(features_per_step)), packed_dtype)
            grad_rows = T.decl_buffer((T.int64(rows), head_dim), acc_dtype)
            queries_t = T.decl_buffer((head_dim, T.int64(rows)), acc_dtype) if transposed else ()
            grad_rows_t = T.decl_buffer((head_dim, T.int64(rows)), acc_dtype) if transposed else ()
            operand_tile = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            operand_scratch = T.alloc_local((rows, rows), acc_dtype, annotations=_ON_STACK) if transposed else ()
            # The dot product's tile operands: dO rows as feature pairs (dP), Q and dO rows as pairs
            # of rows (dK, dV), dS as pairs of columns (dQ) and P, dS as pairs of rows (dV, dK).
            grad_row_words = T.decl_buffer((T.int64(rows), head_dim // T.int64(2)), "int32") if dot else ()
            query_pairs = T.decl_buffer((T.int64(rows // 2), head_dim), "int32") if dot else ()
            grad_pairs = T.decl_buffer((T.int64(rows // 2), head_dim), "int32") if dot else ()
            grad_column_pairs = (
                T.decl_buffer((T.int64(rows), (band + T.int64(rows + 2 * cols + 1)) // T.int64(2)), "int32")
                if dot
                else ()
            )
            weight_pairs = T.decl_buffer((T.int64(rows // 2), band + T.int64(rows + 2 * cols)), "int32") if dot else ()
            query = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            block_keys = T.alloc_local((cols,), "int64", annotations=_ON_STACK)
            key_tile = T.alloc_local((cols, lanes), packed_dtype, annotations=_ON_STACK)
            begin = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            end = T.alloc_local((rows,), "int64", annotations=_ON_STACK)
            row_scale = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            row_delta = T.alloc_local((rows,), acc_dtype, annotations=_ON_STACK)
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            span = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            tile_blocks = T.alloc_local((2,), "int64", annotations=_ON_STACK)
            acc = T.alloc_local((qk_rows, cols), acc_dtype, annotations=_ON_STACK)
            out_acc = T.alloc_local((group, features), acc_dtype, annotations=_ON_STACK)
            key_acc = T.alloc_local((keys_per_update, features), acc_dtype, annotations=_ON_STACK)
            square = T.alloc_local((cols, lanes), acc_dtype, annotations=_ON_STACK) if blocked else ()
            scratch = T.alloc_local((cols, lanes), acc_dtype, annotations=_ON_STACK) if blocked else ()
            _fill_residue_major(row_of, n, d)
            if dot:
                _pack_dot_operands(
                    keys_k,
                    rows_k,
                    biases,
                    key_tile,
                    k,
                    key_words,
                    k,
                    key_bits,
                    key_bias,
                    row_of,
                    block_keys,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length,
                    cols,
                    per_line,
                )
                bf16_dot.pack_key_pairs(
                    keys_v,
                    value_words,
                    key_tile,
                    row_of,
                    block_keys,
                    v,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length // T.int64(cols),
                    cols,
                    per_line,
                )
            else:
                _pack_operands(
                    keys_k,
                    rows_k,
                    biases,
                    key_tile,
                    k,
                    k,
                    key_bias,
                    row_of,
                    block_keys,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length // T.int64(cols),
                    cols,
                    lanes,
                    per_line,
                    acc_dtype,
                    True,
                    True,
                )
                _pack_operands(
                    keys_v,
                    rows_k,
                    biases,
                    key_tile,
                    v,
                    v,
                    key_bias,
                    row_of,
                    block_keys,
                    b,
                    kv_h,
                    n,
                    head_dim,
                    run_margin,
                    length // T.int64(cols),
                    cols,
                    lanes,
                    per_line,
                    acc_dtype,
                    False,
                    False,
                )
            all_k = T.decl_buffer((length * head_dim,), acc_dtype, data=total_k.data)  # (either layout)
            all_v = T.decl_buffer((length * head_dim,), acc_dtype, data=total_v.data)
            for vector in range(length * head_dim // T.int64(lanes)):
                for lane in T.vectorized(lanes):
                    all_k[vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
                    all_v[vector * T.int64(lanes) + lane] = T.Cast(acc_dtype, 0)
            for r in range(rows):
                row_scale[r] = T.Cast(acc_dtype, scale)
            products.task_begin()
            for tile in range(tile_begin, tile_end):
                p0: T.let = tile * T.int64(rows)
                first: T.let = p0 - w + run_margin
                block0: T.let = first // T.int64(cols)
                base: T.let = first - block0 * T.int64(cols)
                _attention_tile_bounds(query, begin, end, row_of, n, p0, w, d, band, base, rows)
                _prefetch_next_tile(q, b, row_of, p0, rows, n, h, head_dim, per_line)
                _prefetch_next_tile(grad, b, row_of, p0, rows, n, h, head_dim, per_line)
                _prefetch_next_tile(out, b, row_of, p0, rows, n, h, head_dim, per_line)
                if dot:
                    bf16_dot.copy_word_rows(queries, query_words, query, b, h, head_dim, rows)
                    bf16_dot.copy_row_pairs(query_pairs, query_bits, query, b, h, head_dim, rows)
                else:
                    _attention_tile_operand(queries, q, query, b, h, head_dim, scale, rows, lanes, acc_dtype)
                    if transposed:
                        _rows_feature_major(
                            queries_t, operand_tile, operand_scratch, q, query, b, h, head_dim, scale, lanes, acc_dtype
                        )
                _attention_tile_blocks(tile_blocks, begin, end, rows, cols)
                start: T.let = tile_blocks[0] * T.int64(cols)  # the computed columns: [start, start + width)
                width: T.let = (tile_blocks[1] - tile_blocks[0]) * T.int64(cols)
                products.scores(
                    probs,
                    acc,
                    queries_t if transposed else queries,
                    keys_k,
                    biases,
                    block0,
                    tile_blocks,
                    head_dim,
                    rows,
                    qk_rows,
                    cols,
                    acc_dtype,
                    True,
                    dot,
                    scale,
                    transposed,
                )
                if softcap > T.float64(0):
                    _soft_cap(
                        probs,
                        derivatives,
                        begin,
                        end,
                        tile_blocks,
                        rows,
                        cols,
                        lanes,
                        softcap,
                        acc_dtype,
                        minus_inf,
                        True,
                    )
                _attention_tile_probs(
                    probs, lse, query, begin, end, b, h, tile_blocks, rows, cols, lanes, acc_dtype, dtype, minus_inf
                )
                _attention_tile_operand(grad_rows, grad, query, b, h, head_dim, T.float64(1), rows, lanes, acc_dtype)
                if transposed:
                    _rows_feature_major(
                        grad_rows_t,
                        operand_tile,
                        operand_scratch,
                        grad,
                        query,
                        b,
                        h,
                        head_dim,
                        T.float64(1),
                        lanes,
                        acc_dtype,
                    )
                _attention_tile_deltas(
                    row_delta, partial, grad_rows, out, grad_lse, query, p0, n, b, h, head_dim, rows, lanes, acc_dtype
                )
                if dot:
                    bf16_dot.copy_word_rows(grad_row_words, grad_words, query, b, h, head_dim, rows)
                    bf16_dot.copy_row_pairs(grad_pairs, grad_bits, query, b, h, head_dim, rows)
                products.scores(
                    grads,
                    acc,
                    grad_row_words if dot else (grad_rows_t if transposed else grad_rows),
                    keys_v,
                    biases,
                    block0,
                    tile_blocks,
                    head_dim,
                    rows,
                    qk_rows,
                    cols,
                    acc_dtype,
                    False,
                    dot,
                    T.float64(1),
                    transposed,
                )
                if dropout > T.float64(0):  # the forward's mask Z: dP = (dO . V^T) * Z, dV from P * Z
                    for r in range(rows):
                        _fill_run(kept, r, start, start + width, T.Cast(acc_dtype, 0), lanes)
                    _apply_dropout(
                        probs, kept, seed, bh, query, begin, end, base, rows, lanes, dropout, acc_dtype, grads, True
                    )
                _attention_tile_softmax_grad(grads, probs, row_delta, tile_blocks, rows, cols, lanes)
                if softcap > T.float64(0):  # dS of the scores before the cap
                    for r in range(rows):
                        for vector in range(start // T.int64(lanes), (start + width) // T.int64(lanes)):
                            for lane in T.vectorized(lanes):
                                grads[r, vector * T.int64(lanes) + lane] = (
                                    grads[r, vector * T.int64(lanes) + lane]
                                    * derivatives[r, vector * T.int64(lanes) + lane]
                                )
                if dot:
                    for r in range(rows):
                        bf16_dot.round_to_pairs(grad_column_pairs, r, grads, start, start + width)
                products.context(
                    grad_q,
                    out_acc,
                    grad_column_pairs if dot else grads,
                    rows_k,
                    row_scale,
                    span,
                    begin,
                    end,
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
                    group,
                    features,
                    acc_dtype,
                    dtype,
                    dot,
                )
                if dot:
                    for pair in range(rows // 2):
                        if dropout > T.float64(0):
                            bf16_dot.round_to_row_pairs(weight_pairs, T.int64(pair), kept, start, start + width)
                        else:
                            bf16_dot.round_to_row_pairs(weight_pairs, T.int64(pair), probs, start, start + width)
                    products.key_sums(
                        total_v,
                        weight_pairs,
                        grad_pairs,
                        block0 * T.int64(cols),
                        start,
                        width,
                        head_dim,
                        rows,
                        keys_per_update,
                        features,
                        key_acc,
                        acc_dtype,
                        True,
                    )
                    for pair in range(rows // 2):
                        bf16_dot.round_to_row_pairs(weight_pairs, T.int64(pair), grads, start, start + width)
                    products.key_sums(
                        total_k,
                        weight_pairs,
                        query_pairs,
                        block0 * T.int64(cols),
                        start,
                        width,
                        head_dim,
                        rows,
                        keys_per_update,
                        features,
                        key_acc,
                        acc_dtype,
                        True,
                    )
                else:
                    if dropout > T.float64(0):
                        products.key_sums(
                            total_v,
                            kept,
                            grad_rows,
                            block0 * T.int64(cols),
                            start,
                            width,
                            head_dim,
                            rows,
                            keys_per_update,
                            features,
                            key_acc,
                            acc_dtype,
                            False,
                        )
                    else:
                        products.key_sums(
                            total_v,
                            probs,
                            grad_rows,
                            block0 * T.int64(cols),
                            start,
                            width,
                            head_dim,
                            rows,
                            keys_per_update,
                            features,
                            key_acc,
                            acc_dtype,
                            False,
                        )
                    products.key_sums(
                        total_k,
                        grads,
                        queries,
                        block0 * T.int64(cols),
                        start,
                        width,
                        head_dim,
                        rows,
                        keys_per_update,
                        features,
                        key_acc,
                        acc_dtype,
                        False,
                    )
            products.task_end()
            # The keys only this run's queries reach, stored; those within reach of an edge, to edge_parts.
            left_edge: T.let = tile_begin * T.int64(rows)
            right_edge: T.let = tile_end * T.int64(rows)
            own_begin: T.let = T.Select(tile_begin > T.int64(0), T.min(left_edge + reach, n), T.int64(0))
            own_end: T.let = T.Select(tile_end < tiles, right_edge - w, n)
            if blocked:
                _store_blocked_sums(
                    grad_k,
                    grad_v,
                    total_k,
                    total_v,
                    square,
                    scratch,
                    row_of,
                    b,
                    h,
                    n,
                    own_begin,
                    own_end,
                    run_margin,
                    head_dim,
                    scale,
                    lanes,
                    cols,
                    per_line,
                    dtype,
                    acc_dtype,
                    dot,
                )
            else:
                for p in range(own_begin, own_end):
                    _store_key_row(
                        grad_k,
                        grad_v,
                        total_k,
                        total_v,
                        row_of,
                        b,
                        h,
                        n,
                        p,
                        run_margin,
                        head_dim,
                        scale,
                        lanes,
                        cols,
                        per_line,
                        dtype,
                        acc_dtype,
                        dot,
                        blocked,
                    )
            if tile_begin < tile_end:
                if tile_begin > T.int64(0):  # side 1 of the edge before this run
                    _store_edge_part(
                        edge_parts_k,
                        edge_parts_v,
                        total_k,
                        total_v,
                        bh,
                        run - T.int64(1),
                        T.int64(1),
                        left_edge,
                        run_margin,
                        w,
                        reach,
                        n,
                        head_dim,
                        lanes,
                        cols,
                        blocked,
                    )
                if tile_end < tiles:  # side 0 of the edge after it
                    _store_edge_part(
                        edge_parts_k,
                        edge_parts_v,
                        total_k,
                        total_v,
                        bh,
                        run,
                        T.int64(0),
                        right_edge,
                        run_margin,
                        w,
                        reach,
                        n,
                        head_dim,
                        lanes,
                        cols,
                        blocked,
                    )
        if runs > T.int64(1):
            for item in T.parallel(batch * heads * edges):
                bh: T.let = item // edges
                b: T.let = bh // heads
                h: T.let = bh % heads
                edge_index: T.let = item % edges
                edge: T.let = (edge_index + T.int64(1)) * run_tiles * T.int64(rows)
                if edge < n:  # (runs past the last tile are empty: no edge)
                    row_of = T.decl_buffer((n,), "int64")
                    _fill_residue_major(row_of, n, T.Cast("int64", dilation[h]))
                    for p in range(T.max(edge - w, T.int64(0)), T.min(edge + reach, n)):
                        for vector in range(head_dim // T.int64(lanes)):
                            for lane in T.vectorized(lanes):
                                f: T.let = vector * T.int64(lanes) + lane
                                grad_k[b, row_of[p], h, f] = _key_gradient(
                                    dtype,
                                    acc_dtype,
                                    edge_parts_k[bh, edge_index, 0, p - edge + w, f]
                                    + edge_parts_k[bh, edge_index, 1, p - edge + w, f],
                                    scale,
                                    dot,
                                )
                                grad_v[b, row_of[p], h, f] = _rounded(
                                    dtype,
                                    edge_parts_v[bh, edge_index, 0, p - edge + w, f]
                                    + edge_parts_v[bh, edge_index, 1, p - edge + w, f],
                                )

    return bf16_dot.with_dot_product(main) if dot else main


def _summed(total, t, f, cols, blocked):
    """The dK or dV sum of packed row t, feature f, in either layout (:class:`TileProducts`)."""
    return total[t // T.int64(cols), f, t % T.int64(cols)] if blocked else total[t, f]


def _key_gradient(dtype, acc_dtype, total, scale, dot):
    """A dK sum rounded to the output dtype (the dot product's sums are of unscaled queries: scaled here)."""
    return _rounded(dtype, total * T.Cast(acc_dtype, scale) if dot else total)


@T.macro
def _store_key_row(
    grad_k,
    grad_v,
    total_k,
    total_v,
    row_of,
    b,
    h,
    n,
    p,
    run_margin,
    head_dim,
    scale,
    lanes,
    cols,
    per_line,
    dtype,
    acc_dtype,
    dot,
    blocked,
):
    """The dK and dV rows of packed row p (sequence row row_of[p]) from their sums, rounded."""
    # The rows written _ROWS_AHEAD steps later (a new page every row or two).
    _prefetch_row(grad_k, b, row_of[T.min(p + T.int64(_ROWS_AHEAD), n - T.int64(1))], h, head_dim, per_line, 1)
    _prefetch_row(grad_v, b, row_of[T.min(p + T.int64(_ROWS_AHEAD), n - T.int64(1))], h, head_dim, per_line, 1)
    for vector in range(head_dim // T.int64(lanes)):
        for lane in T.vectorized(lanes):
            grad_k[b, row_of[p], h, vector * T.int64(lanes) + lane] = _key_gradient(
                dtype,
                acc_dtype,
                _summed(total_k, run_margin + p, vector * T.int64(lanes) + lane, cols, blocked),
                scale,
                dot,
            )
            grad_v[b, row_of[p], h, vector * T.int64(lanes) + lane] = _rounded(
                dtype, _summed(total_v, run_margin + p, vector * T.int64(lanes) + lane, cols, blocked)
            )


@T.macro
def _store_square(
    grad,
    total,
    square,
    scratch,
    row_of,
    b,
    h,
    block,
    vector,
    run_margin,
    scale,
    lanes,
    cols,
    dtype,
    acc_dtype,
    dot,
    is_key,
):
    """One square of :func:`_store_blocked_sums`: features [vector * lanes, + lanes) of the block's
    keys, transposed into their rows of ``grad`` (dK where ``is_key``: :func:`_key_gradient`)."""
    for i in T.unroll(cols):
        for lane in T.vectorized(lanes):
            square[i, lane] = total[block, vector * T.int64(lanes) + i, lane]
    _transpose_square(square, scratch, lanes)
    for i in T.unroll(cols):
        for lane in T.vectorized(lanes):
            grad[b, row_of[block * T.int64(cols) + i - run_margin], h, vector * T.int64(lanes) + lane] = (
                _key_gradient(dtype, acc_dtype, square[i, lane], scale, dot)
                if is_key
                else _rounded(dtype, square[i, lane])
            )


@T.macro
def _store_blocked_sums(
    grad_k,
    grad_v,
    total_k,
    total_v,
    square,
    scratch,
    row_of,
    b,
    h,
    n,
    own_begin,
    own_end,
    run_margin,
    head_dim,
    scale,
    lanes,
    cols,
    per_line,
    dtype,
    acc_dtype,
    dot,
):
    """:func:`_store_key_row` for packed rows [own_begin, own_end) from sums in blocks of ``cols`` keys
    feature-major (``cols == lanes``): each whole block's 16 x 16 squares transposed in registers
    (``square``, ``scratch``) into key rows, where reading a row's features took a cache line each
    (the AMX backward 0.98 of its time); the partial blocks at the ends row by row."""
    block_begin: T.let = (run_margin + own_begin + T.int64(cols - 1)) // T.int64(cols)
    block_end: T.let = T.max((run_margin + own_end) // T.int64(cols), block_begin)
    head_end: T.let = T.min(block_begin * T.int64(cols) - run_margin, own_end)
    for p in range(own_begin, head_end):
        _store_key_row(
            grad_k,
            grad_v,
            total_k,
            total_v,
            row_of,
            b,
            h,
            n,
            p,
            run_margin,
            head_dim,
            scale,
            lanes,
            cols,
            per_line,
            dtype,
            acc_dtype,
            dot,
            True,
        )
    for block in range(block_begin, block_end):
        for key in range(cols):  # the next block's rows (a new page every row or two)
            _prefetch_row(
                grad_k,
                b,
                row_of[T.min((block + T.int64(1)) * T.int64(cols) + key - run_margin, n - T.int64(1))],
                h,
                head_dim,
                per_line,
                1,
            )
            _prefetch_row(
                grad_v,
                b,
                row_of[T.min((block + T.int64(1)) * T.int64(cols) + key - run_margin, n - T.int64(1))],
                h,
                head_dim,
                per_line,
                1,
            )
        for vector in range(head_dim // T.int64(lanes)):
            _store_square(
                grad_k,
                total_k,
                square,
                scratch,
                row_of,
                b,
                h,
                block,
                vector,
                run_margin,
                scale,
                lanes,
                cols,
                dtype,
                acc_dtype,
                dot,
                True,
            )
            _store_square(
                grad_v,
                total_v,
                square,
                scratch,
                row_of,
                b,
                h,
                block,
                vector,
                run_margin,
                scale,
                lanes,
                cols,
                dtype,
                acc_dtype,
                dot,
                False,
            )
    for p in range(T.max(block_end * T.int64(cols) - run_margin, head_end), own_end):
        _store_key_row(
            grad_k,
            grad_v,
            total_k,
            total_v,
            row_of,
            b,
            h,
            n,
            p,
            run_margin,
            head_dim,
            scale,
            lanes,
            cols,
            per_line,
            dtype,
            acc_dtype,
            dot,
            True,
        )


@T.macro
def _store_edge_part(
    edge_parts_k,
    edge_parts_v,
    total_k,
    total_v,
    bh,
    edge_index,
    side,
    edge,
    run_margin,
    w,
    reach,
    n,
    head_dim,
    lanes,
    cols,
    blocked,
):
    """A run's dK and dV sums of the keys within reach of ``edge``, [edge - w, edge + reach), into
    ``edge_parts[bh, edge_index, side]``."""
    for p in range(T.max(edge - w, T.int64(0)), T.min(edge + reach, n)):
        for vector in range(head_dim // T.int64(lanes)):
            for lane in T.vectorized(lanes):
                f: T.let = vector * T.int64(lanes) + lane
                edge_parts_k[bh, edge_index, side, p - edge + w, f] = _summed(total_k, run_margin + p, f, cols, blocked)
                edge_parts_v[bh, edge_index, side, p - edge + w, f] = _summed(total_v, run_margin + p, f, cols, blocked)
