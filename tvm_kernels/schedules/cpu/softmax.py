"""The band softmax of the unfused path on the CPU, in place, with its backward."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu.microkernels import (
    _ON_STACK,
    _add_lanes,
    _bfloat16_even,
    _bfloat16_odd,
    _bfloat16_pair,
    _exp,
    _flat_pair_view,
    _max_of_lanes,
    _quieted,
    _rounded,
)
from tvm_kernels.schedules.cpu.tiles import tiles_for

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


@T.macro
def _row_on_pairs(
    scores,
    words,
    exps,
    lead_exp,
    partial,
    row_max,
    total,
    lse,
    b,
    i,
    h,
    first,
    stop,
    row_start,
    lanes,
    acc_dtype,
    dtype,
    minus_inf,
):
    """:func:`softmax`'s max, exp and scaling passes over a row's span ``[first, stop)`` in bfloat16 on
    pairs (``words``: the band's flat pair view, ``row_start``: the row's flat index): a lone value
    where the span starts inside a pair (rows of 2w + 1 values do every other row), then vectors of
    pairs, vectors of values and single values; a vector of pairs' exponentials kept in ``exps`` even
    columns first; results rounded as pairs without the NaN guard. Its NaNs: a bfloat16 score's (low
    half zero; the biased scores were rounded with the guard), which x86's arithmetic carries, and
    whose exp's scale factor (its bits shifted left by 23) has a zero exponent, so is no NaN of its
    own; or the default NaN 0xffc00000 (inf - inf)."""
    lead: T.let = T.min((row_start + first[0]) % T.int64(2), stop[0] - first[0])
    word0: T.let = (row_start + first[0] + lead) // T.int64(2)
    paired: T.let = (stop[0] - first[0] - lead) // T.int64(2 * lanes)
    values_start: T.let = first[0] + lead + paired * T.int64(2 * lanes)  # (their exps from exps[paired * 2 lanes] on)
    vectors: T.let = (stop[0] - values_start) // T.int64(lanes)
    tail: T.let = values_start + vectors * T.int64(lanes)
    for lane in T.vectorized(lanes):
        partial[lane] = minus_inf
    for vector in range(paired):
        for lane in T.vectorized(lanes):
            partial[lane] = T.max(
                partial[lane],
                T.max(
                    _bfloat16_even(words[word0 + vector * T.int64(lanes) + lane]),
                    _bfloat16_odd(words[word0 + vector * T.int64(lanes) + lane]),
                ),
            )
    for vector in range(vectors):
        for lane in T.vectorized(lanes):
            partial[lane] = T.max(
                partial[lane], T.Cast(acc_dtype, scores[b, i, h, values_start + vector * T.int64(lanes) + lane])
            )
    _max_of_lanes(row_max, partial, lanes, minus_inf)
    for j in range(first[0], first[0] + lead):
        row_max[0] = T.max(row_max[0], T.Cast(acc_dtype, scores[b, i, h, j]))
    for j in range(tail, stop[0]):
        row_max[0] = T.max(row_max[0], T.Cast(acc_dtype, scores[b, i, h, j]))
    if row_max[0] == minus_inf:  # no key left: exp gives 0 everywhere, no NaN from -inf - -inf
        row_max[0] = T.Cast(acc_dtype, 0)
    for lane in T.vectorized(lanes):
        partial[lane] = T.Cast(acc_dtype, 0)
    for vector in range(paired):
        for lane in T.vectorized(lanes):
            exps[vector * T.int64(2 * lanes) + lane] = _exp(
                _bfloat16_even(words[word0 + vector * T.int64(lanes) + lane]) - row_max[0], acc_dtype, half_results=True
            )
            exps[vector * T.int64(2 * lanes) + T.int64(lanes) + lane] = _exp(
                _bfloat16_odd(words[word0 + vector * T.int64(lanes) + lane]) - row_max[0], acc_dtype, half_results=True
            )
            partial[lane] = (
                partial[lane]
                + exps[vector * T.int64(2 * lanes) + lane]
                + exps[vector * T.int64(2 * lanes) + T.int64(lanes) + lane]
            )
    for vector in range(vectors):
        for lane in T.vectorized(lanes):
            exps[paired * T.int64(2 * lanes) + vector * T.int64(lanes) + lane] = _exp(
                T.Cast(acc_dtype, scores[b, i, h, values_start + vector * T.int64(lanes) + lane]) - row_max[0],
                acc_dtype,
                half_results=True,
            )
            partial[lane] = partial[lane] + exps[paired * T.int64(2 * lanes) + vector * T.int64(lanes) + lane]
    total[0] = T.Cast(acc_dtype, 0)
    _add_lanes(total, partial, lanes)
    lead_exp[0] = T.Cast(acc_dtype, 0)
    for j in range(first[0], first[0] + lead):
        lead_exp[0] = _exp(T.Cast(acc_dtype, scores[b, i, h, j]) - row_max[0], acc_dtype, half_results=True)
        total[0] = total[0] + lead_exp[0]
    for j in range(tail, stop[0]):
        exps[j - first[0] - lead] = _exp(
            T.Cast(acc_dtype, scores[b, i, h, j]) - row_max[0], acc_dtype, half_results=True
        )
        total[0] = total[0] + exps[j - first[0] - lead]
    lse[b, i, h] = row_max[0] + T.log(total[0])  # log(0) = -inf: a row with no key
    total[0] = T.Select(total[0] == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 1) / total[0])
    for vector in range(paired):
        for lane in T.vectorized(lanes):
            exps[vector * T.int64(2 * lanes) + lane] = exps[vector * T.int64(2 * lanes) + lane] * total[0]
            exps[vector * T.int64(2 * lanes) + T.int64(lanes) + lane] = (
                exps[vector * T.int64(2 * lanes) + T.int64(lanes) + lane] * total[0]
            )
            words[word0 + vector * T.int64(lanes) + lane] = _bfloat16_pair(
                exps[vector * T.int64(2 * lanes) + lane], exps[vector * T.int64(2 * lanes) + T.int64(lanes) + lane]
            )
    for vector in range(vectors):
        for lane in T.vectorized(lanes):
            scores[b, i, h, values_start + vector * T.int64(lanes) + lane] = _rounded(
                dtype, exps[paired * T.int64(2 * lanes) + vector * T.int64(lanes) + lane] * total[0]
            )
    for j in range(first[0], first[0] + lead):
        scores[b, i, h, j] = _rounded(dtype, lead_exp[0] * total[0])
    for j in range(tail, stop[0]):
        scores[b, i, h, j] = _rounded(dtype, exps[j - first[0] - lead] * total[0])


def softmax(dtype: str, autoregressive: bool, isa: str):
    """In place: each row of ``band [b, n, h, c]`` becomes the softmax of its scores over the row's
    valid keys (exactly 0 at the others), and ``lse [b, n, h]`` (accumulation dtype) gets the row's
    log-sum-exp. ``key_bias [b, n]`` (accumulation dtype; read only when ``with_bias`` is nonzero)
    is added to the scores of each key first: -inf removes the key (padding). A row with no key
    left (every score -inf) gets 0 and lse -inf, not NaN. Per row: a max pass (adding the bias and
    storing the biased scores, exact for 0 and -inf), a pass storing exp(score - max) and summing
    it, and a pass scaling by 1 / sum. Half types keep the exponentials in a row of the accumulation
    dtype instead of the band, so that they round once with one exp per score, as float32 (they used
    to recompute them in the last pass: bench/NOTES.md, "The band softmax in the half types"; a row
    stays in L1 either way), and take exp's cheaper polynomial for results rounded to a half type
    (microkernels._EXP_HALF, 2.7e-6 relative: 1/180 of float16's unit roundoff; the log-sum-exp,
    float32, is within that of the exact one, where float32's is within a few units of 2^-24).
    bfloat16 on AVX2 takes its scores as 32-bit pairs (:func:`_row_on_pairs`), its sum in another
    order than the other libraries' (as exact).
    """
    acc_dtype = accumulation_dtype(dtype)
    lanes = tiles_for(isa).vector_bits // (64 if acc_dtype == "float64" else 32)
    pairs = tiles_for(isa).pairs_for(dtype)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)
    store_exp = dtype == acc_dtype

    @T.prim_func
    def main(
        band_handle: T.handle,
        key_bias_handle: T.handle,
        with_bias: T.int64,
        dilation_handle: T.handle,
        lse_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        width = T.int64()
        scores = T.match_buffer(band_handle, (batch, n, heads, width), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        words = _flat_pair_view(scores, pairs)
        w: T.let = T.int64(causal) * (width - T.int64(1)) + T.int64(1 - causal) * ((width - T.int64(1)) // T.int64(2))
        for bi in T.parallel(batch * n):
            b: T.let = bi // n
            i: T.let = bi % n
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            row_max = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            first = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            stop = T.alloc_local((1,), "int64", annotations=_ON_STACK)
            lead_exp = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK) if pairs else ()
            # Half types: the row's exponentials in the accumulation dtype (a workspace of TVM's pool,
            # per row: a runtime size cannot live on the stack).
            exps = () if store_exp else T.decl_buffer((width,), acc_dtype)
            for h in range(heads):
                d: T.let = T.Cast("int64", dilation[h])
                _row_span(first, stop, i, d, w, n, width)
                if with_bias != T.int64(0):
                    for j in range(first[0], stop[0]):
                        scores[b, i, h, j] = _rounded(
                            dtype, T.Cast(acc_dtype, scores[b, i, h, j]) + key_bias[b, i + d * (j - w)]
                        )
                if pairs:
                    _row_on_pairs(
                        scores,
                        words,
                        exps,
                        lead_exp,
                        partial,
                        row_max,
                        total,
                        lse,
                        b,
                        i,
                        h,
                        first,
                        stop,
                        ((b * n + i) * heads + h) * width,
                        lanes,
                        acc_dtype,
                        dtype,
                        minus_inf,
                    )
                else:
                    vectors, tail = _row_vectors(first[0], stop[0], lanes)
                    for lane in T.vectorized(lanes):
                        partial[lane] = minus_inf
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            partial[lane] = T.max(
                                partial[lane],
                                T.Cast(acc_dtype, scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]),
                            )
                    _max_of_lanes(row_max, partial, lanes, minus_inf)
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
                                    scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] - row_max[0], acc_dtype
                                )
                                partial[lane] = (
                                    partial[lane] + scores[b, i, h, first[0] + vector * T.int64(lanes) + lane]
                                )
                    else:
                        for vector in range(vectors):
                            for lane in T.vectorized(lanes):
                                exps[vector * T.int64(lanes) + lane] = _exp(
                                    T.Cast(acc_dtype, scores[b, i, h, first[0] + vector * T.int64(lanes) + lane])
                                    - row_max[0],
                                    acc_dtype,
                                    half_results=True,
                                )
                                partial[lane] = partial[lane] + exps[vector * T.int64(lanes) + lane]
                    total[0] = T.Cast(acc_dtype, 0)
                    _add_lanes(total, partial, lanes)
                    for j in range(tail, stop[0]):
                        if store_exp:
                            scores[b, i, h, j] = _exp(scores[b, i, h, j] - row_max[0], acc_dtype)
                            total[0] = total[0] + scores[b, i, h, j]
                        else:
                            exps[j - first[0]] = _exp(
                                T.Cast(acc_dtype, scores[b, i, h, j]) - row_max[0], acc_dtype, half_results=True
                            )
                            total[0] = total[0] + exps[j - first[0]]
                    lse[b, i, h] = row_max[0] + T.log(total[0])  # log(0) = -inf: a row with no key
                    # 1 / sum, 0 for a row with no key; a NaN sum (a NaN score) stays NaN, so the whole row is NaN.
                    total[0] = T.Select(
                        total[0] == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 1) / total[0]
                    )
                    if store_exp:
                        for vector in range(vectors):
                            for lane in T.vectorized(lanes):
                                scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] = (
                                    scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] * total[0]
                                )
                        for j in range(tail, stop[0]):
                            scores[b, i, h, j] = scores[b, i, h, j] * total[0]
                    else:
                        for vector in range(vectors):
                            for lane in T.vectorized(lanes):
                                scores[b, i, h, first[0] + vector * T.int64(lanes) + lane] = _rounded(
                                    dtype, exps[vector * T.int64(lanes) + lane] * total[0]
                                )
                        for j in range(tail, stop[0]):
                            scores[b, i, h, j] = _rounded(dtype, exps[j - first[0]] * total[0])
                for j in range(first[0]):
                    scores[b, i, h, j] = T.Cast(dtype, 0)
                for j in range(stop[0], width):
                    scores[b, i, h, j] = T.Cast(dtype, 0)

    return main


@T.macro
def _gradient_row_on_pairs(
    probs,
    grad,
    out,
    probs_words,
    grad_words,
    out_words,
    partial,
    shift,
    grad_lse,
    b,
    i,
    h,
    first,
    stop,
    row_start,
    lanes,
    acc_dtype,
    dtype,
):
    """:func:`softmax_backward` over a row's span in bfloat16 on pairs, cut as :func:`_row_on_pairs`
    cuts it (the three bands share their layout, so their flat pair views their word indices): the
    row sum of ``P dP`` with a vector of pairs' even and odd products in the same partial sums (in
    another order than the other libraries', as exact), then the results rounded as pairs. Without
    the rounding's NaN guard: the shift, float32 from a caller's ``grad_lse`` of any bit pattern, has
    its NaNs quieted once (:func:`_quieted`), and the other operands are bfloat16, so a NaN result is
    one of theirs (low half zero) or x86's default NaN, neither of which carries when rounded."""
    # The cut's six bindings as in _row_on_pairs: from a helper returning them as a tuple, each let
    # carries the earlier ones' expressions inlined, and the forward took 2.2x its time so.
    lead: T.let = T.min((row_start + first[0]) % T.int64(2), stop[0] - first[0])
    word0: T.let = (row_start + first[0] + lead) // T.int64(2)
    paired: T.let = (stop[0] - first[0] - lead) // T.int64(2 * lanes)
    values_start: T.let = first[0] + lead + paired * T.int64(2 * lanes)
    vectors: T.let = (stop[0] - values_start) // T.int64(lanes)
    tail: T.let = values_start + vectors * T.int64(lanes)
    for lane in T.vectorized(lanes):
        partial[lane] = T.Cast(acc_dtype, 0)
    for vector in range(paired):
        for lane in T.vectorized(lanes):
            partial[lane] = (
                partial[lane]
                + _bfloat16_even(probs_words[word0 + vector * T.int64(lanes) + lane])
                * _bfloat16_even(grad_words[word0 + vector * T.int64(lanes) + lane])
                + _bfloat16_odd(probs_words[word0 + vector * T.int64(lanes) + lane])
                * _bfloat16_odd(grad_words[word0 + vector * T.int64(lanes) + lane])
            )
    for vector in range(vectors):
        for lane in T.vectorized(lanes):
            partial[lane] = partial[lane] + T.Cast(
                acc_dtype, probs[b, i, h, values_start + vector * T.int64(lanes) + lane]
            ) * T.Cast(acc_dtype, grad[b, i, h, values_start + vector * T.int64(lanes) + lane])
    shift[0] = T.Cast(acc_dtype, 0) - grad_lse[b, i, h]
    _add_lanes(shift, partial, lanes)
    for j in range(first[0], first[0] + lead):
        shift[0] = shift[0] + T.Cast(acc_dtype, probs[b, i, h, j]) * T.Cast(acc_dtype, grad[b, i, h, j])
    for j in range(tail, stop[0]):
        shift[0] = shift[0] + T.Cast(acc_dtype, probs[b, i, h, j]) * T.Cast(acc_dtype, grad[b, i, h, j])
    shift[0] = T.reinterpret(acc_dtype, _quieted(T.reinterpret("uint32", shift[0])))
    for vector in range(paired):
        for lane in T.vectorized(lanes):
            out_words[word0 + vector * T.int64(lanes) + lane] = _bfloat16_pair(
                _bfloat16_even(probs_words[word0 + vector * T.int64(lanes) + lane])
                * (_bfloat16_even(grad_words[word0 + vector * T.int64(lanes) + lane]) - shift[0]),
                _bfloat16_odd(probs_words[word0 + vector * T.int64(lanes) + lane])
                * (_bfloat16_odd(grad_words[word0 + vector * T.int64(lanes) + lane]) - shift[0]),
            )
    for vector in range(vectors):
        for lane in T.vectorized(lanes):
            out[b, i, h, values_start + vector * T.int64(lanes) + lane] = _rounded(
                dtype,
                T.Cast(acc_dtype, probs[b, i, h, values_start + vector * T.int64(lanes) + lane])
                * (T.Cast(acc_dtype, grad[b, i, h, values_start + vector * T.int64(lanes) + lane]) - shift[0]),
            )
    for j in range(first[0], first[0] + lead):
        out[b, i, h, j] = _rounded(
            dtype, T.Cast(acc_dtype, probs[b, i, h, j]) * (T.Cast(acc_dtype, grad[b, i, h, j]) - shift[0])
        )
    for j in range(tail, stop[0]):
        out[b, i, h, j] = _rounded(
            dtype, T.Cast(acc_dtype, probs[b, i, h, j]) * (T.Cast(acc_dtype, grad[b, i, h, j]) - shift[0])
        )


def softmax_backward(dtype: str, autoregressive: bool, isa: str):
    """The gradient of :func:`softmax`'s scores: ``out = P * (dP - rowsum(dP * P) + dlse)`` at each
    row's valid keys (d lse / d score = P), 0 at the others. Arguments: probs ``P`` and ``grad``
    ``dP`` ``[b, n, h, c]``, ``grad_lse [b, n, h]`` (accumulation dtype), dilation, out
    ``[b, n, h, c]`` (not aliasing the others). bfloat16 on AVX2 takes its bands as 32-bit pairs
    (:func:`_gradient_row_on_pairs`; bench/NOTES.md, "bfloat16's global-merge and band softmax
    backwards on pairs")."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = tiles_for(isa).vector_bits // (64 if acc_dtype == "float64" else 32)
    pairs = tiles_for(isa).pairs_for(dtype)
    causal = 1 if autoregressive else 0

    @T.prim_func
    def main(
        probs_handle: T.handle,
        grad_handle: T.handle,
        grad_lse_handle: T.handle,
        dilation_handle: T.handle,
        out_handle: T.handle,
    ):
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
        probs_words = _flat_pair_view(probs, pairs)
        grad_words = _flat_pair_view(grad, pairs)
        out_words = _flat_pair_view(out, pairs)
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
                if pairs:
                    _gradient_row_on_pairs(
                        probs,
                        grad,
                        out,
                        probs_words,
                        grad_words,
                        out_words,
                        partial,
                        shift,
                        grad_lse,
                        b,
                        i,
                        h,
                        first,
                        stop,
                        ((b * n + i) * heads + h) * width,
                        lanes,
                        acc_dtype,
                        dtype,
                    )
                else:
                    vectors, tail = _row_vectors(first[0], stop[0], lanes)
                    for lane in T.vectorized(lanes):
                        partial[lane] = T.Cast(acc_dtype, 0)
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            partial[lane] = partial[lane] + T.Cast(
                                acc_dtype, probs[b, i, h, first[0] + vector * T.int64(lanes) + lane]
                            ) * T.Cast(acc_dtype, grad[b, i, h, first[0] + vector * T.int64(lanes) + lane])
                    shift[0] = T.Cast(acc_dtype, 0) - grad_lse[b, i, h]
                    _add_lanes(shift, partial, lanes)
                    for j in range(tail, stop[0]):
                        shift[0] = shift[0] + T.Cast(acc_dtype, probs[b, i, h, j]) * T.Cast(acc_dtype, grad[b, i, h, j])
                    for vector in range(vectors):
                        for lane in T.vectorized(lanes):
                            out[b, i, h, first[0] + vector * T.int64(lanes) + lane] = _rounded(
                                dtype,
                                T.Cast(acc_dtype, probs[b, i, h, first[0] + vector * T.int64(lanes) + lane])
                                * (
                                    T.Cast(acc_dtype, grad[b, i, h, first[0] + vector * T.int64(lanes) + lane])
                                    - shift[0]
                                ),
                            )
                    for j in range(tail, stop[0]):
                        out[b, i, h, j] = _rounded(
                            dtype,
                            T.Cast(acc_dtype, probs[b, i, h, j]) * (T.Cast(acc_dtype, grad[b, i, h, j]) - shift[0]),
                        )
                for j in range(first[0]):
                    out[b, i, h, j] = T.Cast(dtype, 0)
                for j in range(stop[0], width):
                    out[b, i, h, j] = T.Cast(dtype, 0)

    return main
