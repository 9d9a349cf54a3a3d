"""Layer normalisation over the last dimension on the CPU, forward and backward, one row at a time
(a row of the encoder's 768 features stays in L1 between its passes).

Why a kernel: torch's CPU ``layer_norm`` and its backward take 1.8-1.9 ms each on the base
encoder's ``[4096, 768]`` bfloat16 rows inside a training step, 25 times each way; and the
backward's weight and bias gradients, sums over the rows, are taken here on the way (per chunk of
rows, as dropout.dropout_column_sums sums), not by more passes.

Statistics and arithmetic in the accumulation dtype (float32 for the half types), the variance
from the deviations (two passes over the row, as torch's), results rounded once.

On AVX2 bfloat16 takes its values as 32-bit pairs, as the GELU and dropout kernels do
(microkernels.py; gelu.py's docstring says why): a vector of pairs is a vector of even columns and
one of odd, both summed into the same partial sums (so the forward's statistics and the backward's
row sums run in another order than the other dtypes' and libraries', as exact), the results rounded
as pairs (bench/NOTES.md, "bfloat16's layer norm on pairs" and "bfloat16's layer norm backward and
global merge on pairs").
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _add_lanes,
    _bfloat16_even,
    _bfloat16_odd,
    _bfloat16_pair,
    _pair_view,
    _paired_vectors,
    _rounded,
    _sums_from_pairs,
)
from tvm_kernels.schedules.cpu.tiles import accumulation_lanes, tiles_for


@T.macro
def _zero(partial, lanes, acc_dtype):
    for lane in T.vectorized(lanes):
        partial[lane] = T.Cast(acc_dtype, 0)


def layer_norm(dtype: str, isa: str):
    """``out[r, c] = (x[r, c] - mean_r) * rstd_r * weight[c] + bias[c]``, ``rstd_r = 1 / sqrt(var_r +
    eps)``, mean and (biased) variance over row r's columns; writes ``mean`` and ``rstd`` ``[rows]``
    (accumulation dtype) for the backward. Arguments: x ``[rows, cols]``, weight, bias ``[cols]``,
    eps (float64), out ``[rows, cols]`` (may be x: a row is read whole before it is written),
    mean, rstd."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    # Buffers aligned to their element only (see gelu.bias_gelu): parameters read from a checkpoint,
    # a slice of rows, may start anywhere.
    element_bytes = _BITS[dtype] // 8

    @T.prim_func
    def main(
        x_handle: T.handle,
        weight_handle: T.handle,
        bias_handle: T.handle,
        eps: T.float64,
        out_handle: T.handle,
        mean_handle: T.handle,
        rstd_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        x = T.match_buffer(x_handle, (rows, cols), dtype, align=element_bytes)
        weight = T.match_buffer(weight_handle, (cols,), dtype, align=element_bytes)
        bias = T.match_buffer(bias_handle, (cols,), dtype, align=element_bytes)
        out = T.match_buffer(out_handle, (rows, cols), dtype, align=element_bytes)
        mean = T.match_buffer(mean_handle, (rows,), acc_dtype)
        rstd = T.match_buffer(rstd_handle, (rows,), acc_dtype)
        vectors = cols // T.int64(lanes)
        x_words = _pair_view(x, pairs)
        weight_words = _pair_view(weight, pairs)
        bias_words = _pair_view(bias, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for r in T.parallel(rows):
            partial = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            terms = T.alloc_local((2 * lanes,), acc_dtype, annotations=_ON_STACK) if pairs else ()
            _zero(partial, lanes, acc_dtype)
            if pairs:
                for vector in range(paired):
                    for lane in T.vectorized(lanes):
                        partial[lane] = (
                            partial[lane]
                            + _bfloat16_even(x_words[r, vector * T.int64(lanes) + lane])
                            + _bfloat16_odd(x_words[r, vector * T.int64(lanes) + lane])
                        )
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), vectors):
                for lane in T.vectorized(lanes):
                    partial[lane] = partial[lane] + T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane])
            total[0] = T.Cast(acc_dtype, 0)
            _add_lanes(total, partial, lanes)
            for c in range(vectors * T.int64(lanes), cols):
                total[0] = total[0] + T.Cast(acc_dtype, x[r, c])
            row_mean: T.let = total[0] / T.Cast(acc_dtype, cols)
            _zero(partial, lanes, acc_dtype)
            if pairs:
                for vector in range(paired):
                    for lane in T.vectorized(lanes):
                        partial[lane] = (
                            partial[lane]
                            + (_bfloat16_even(x_words[r, vector * T.int64(lanes) + lane]) - row_mean)
                            * (_bfloat16_even(x_words[r, vector * T.int64(lanes) + lane]) - row_mean)
                            + (_bfloat16_odd(x_words[r, vector * T.int64(lanes) + lane]) - row_mean)
                            * (_bfloat16_odd(x_words[r, vector * T.int64(lanes) + lane]) - row_mean)
                        )
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), vectors):
                for lane in T.vectorized(lanes):
                    partial[lane] = partial[lane] + (
                        T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean
                    ) * (T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean)
            total[0] = T.Cast(acc_dtype, 0)
            _add_lanes(total, partial, lanes)
            for c in range(vectors * T.int64(lanes), cols):
                total[0] = total[0] + (T.Cast(acc_dtype, x[r, c]) - row_mean) * (T.Cast(acc_dtype, x[r, c]) - row_mean)
            row_rstd: T.let = T.Cast(acc_dtype, 1) / T.sqrt(total[0] / T.Cast(acc_dtype, cols) + T.Cast(acc_dtype, eps))
            mean[r] = row_mean
            rstd[r] = row_rstd
            if pairs:
                for vector in range(paired):
                    for lane in T.vectorized(lanes):
                        word: T.let = vector * T.int64(lanes) + lane
                        terms[lane] = (_bfloat16_even(x_words[r, word]) - row_mean) * row_rstd * _bfloat16_even(
                            weight_words[word]
                        ) + _bfloat16_even(bias_words[word])
                        terms[lanes + lane] = (_bfloat16_odd(x_words[r, word]) - row_mean) * row_rstd * _bfloat16_odd(
                            weight_words[word]
                        ) + _bfloat16_odd(bias_words[word])
                        out_words[r, word] = _bfloat16_pair(terms[lane], terms[lanes + lane])
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), vectors):
                for lane in T.vectorized(lanes):
                    out[r, vector * T.int64(lanes) + lane] = _rounded(
                        dtype,
                        (T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean)
                        * row_rstd
                        * T.Cast(acc_dtype, weight[vector * T.int64(lanes) + lane])
                        + T.Cast(acc_dtype, bias[vector * T.int64(lanes) + lane]),
                    )
            for c in range(vectors * T.int64(lanes), cols):
                out[r, c] = _rounded(
                    dtype,
                    (T.Cast(acc_dtype, x[r, c]) - row_mean) * row_rstd * T.Cast(acc_dtype, weight[c])
                    + T.Cast(acc_dtype, bias[c]),
                )

    return main


def layer_norm_backward(dtype: str, isa: str):
    """The gradients of :func:`layer_norm` from its ``mean`` and ``rstd``: with ``xhat = (x - mean)
    rstd`` and ``gw = grad * weight``, ``grad_x = rstd (gw - mean_c(gw) - xhat mean_c(gw xhat))``
    (rounded once); ``sums_weight[k, c]`` and ``sums_bias[k, c]`` the sums of ``grad * xhat`` and
    ``grad`` over chunk k's rows (as dropout.dropout_column_sums chunks them), unrounded terms in
    the accumulation dtype. Arguments: grad, x ``[rows, cols]``, weight ``[cols]``, mean, rstd
    ``[rows]``, grad_x ``[rows, cols]`` (may be grad), sums_weight, sums_bias ``[chunks, cols]``.

    With pairs (bfloat16 on AVX2) the row sums take both halves of a vector of pairs, as the
    forward's statistics do; the column sums are kept even columns first until the chunk's last
    row, as dropout_column_sums keeps them (so they are the other dtypes' sums, bit for bit); the
    results round as pairs with the NaN guard (mean and rstd are float32 of any bit pattern)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    element_bytes = _BITS[dtype] // 8

    @T.prim_func
    def main(
        grad_handle: T.handle,
        x_handle: T.handle,
        weight_handle: T.handle,
        mean_handle: T.handle,
        rstd_handle: T.handle,
        grad_x_handle: T.handle,
        sums_weight_handle: T.handle,
        sums_bias_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        chunks = T.int64()
        grad = T.match_buffer(grad_handle, (rows, cols), dtype, align=element_bytes)
        x = T.match_buffer(x_handle, (rows, cols), dtype, align=element_bytes)
        weight = T.match_buffer(weight_handle, (cols,), dtype, align=element_bytes)
        mean = T.match_buffer(mean_handle, (rows,), acc_dtype)
        rstd = T.match_buffer(rstd_handle, (rows,), acc_dtype)
        grad_x = T.match_buffer(grad_x_handle, (rows, cols), dtype, align=element_bytes)
        sums_weight = T.match_buffer(sums_weight_handle, (chunks, cols), acc_dtype)
        sums_bias = T.match_buffer(sums_bias_handle, (chunks, cols), acc_dtype)
        vectors = cols // T.int64(lanes)
        grad_words = _pair_view(grad, pairs)
        x_words = _pair_view(x, pairs)
        weight_words = _pair_view(weight, pairs)
        grad_x_words = _pair_view(grad_x, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for chunk in T.parallel(chunks):
            size: T.let = (rows + chunks - T.int64(1)) // chunks
            for c in range(cols):
                sums_weight[chunk, c] = T.Cast(acc_dtype, 0)
                sums_bias[chunk, c] = T.Cast(acc_dtype, 0)
            partial_gw = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            partial_gwx = T.alloc_local((lanes,), acc_dtype, annotations=_ON_STACK)
            total_gw = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            total_gwx = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            terms = T.alloc_local((2 * lanes,), acc_dtype, annotations=_ON_STACK) if pairs else ()
            for r in range(chunk * size, T.min(rows, chunk * size + size)):
                row_mean: T.let = mean[r]
                row_rstd: T.let = rstd[r]
                _zero(partial_gw, lanes, acc_dtype)
                _zero(partial_gwx, lanes, acc_dtype)
                if pairs:
                    for vector in range(paired):
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            partial_gw[lane] = (
                                partial_gw[lane]
                                + _bfloat16_even(grad_words[r, word]) * _bfloat16_even(weight_words[word])
                                + _bfloat16_odd(grad_words[r, word]) * _bfloat16_odd(weight_words[word])
                            )
                            partial_gwx[lane] = (
                                partial_gwx[lane]
                                + _bfloat16_even(grad_words[r, word])
                                * _bfloat16_even(weight_words[word])
                                * ((_bfloat16_even(x_words[r, word]) - row_mean) * row_rstd)
                                + _bfloat16_odd(grad_words[r, word])
                                * _bfloat16_odd(weight_words[word])
                                * ((_bfloat16_odd(x_words[r, word]) - row_mean) * row_rstd)
                            )
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), vectors):
                    for lane in T.vectorized(lanes):
                        partial_gw[lane] = partial_gw[lane] + T.Cast(
                            acc_dtype, grad[r, vector * T.int64(lanes) + lane]
                        ) * T.Cast(acc_dtype, weight[vector * T.int64(lanes) + lane])
                        partial_gwx[lane] = partial_gwx[lane] + T.Cast(
                            acc_dtype, grad[r, vector * T.int64(lanes) + lane]
                        ) * T.Cast(acc_dtype, weight[vector * T.int64(lanes) + lane]) * (
                            (T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean) * row_rstd
                        )
                total_gw[0] = T.Cast(acc_dtype, 0)
                total_gwx[0] = T.Cast(acc_dtype, 0)
                _add_lanes(total_gw, partial_gw, lanes)
                _add_lanes(total_gwx, partial_gwx, lanes)
                for c in range(vectors * T.int64(lanes), cols):
                    total_gw[0] = total_gw[0] + T.Cast(acc_dtype, grad[r, c]) * T.Cast(acc_dtype, weight[c])
                    total_gwx[0] = total_gwx[0] + T.Cast(acc_dtype, grad[r, c]) * T.Cast(acc_dtype, weight[c]) * (
                        (T.Cast(acc_dtype, x[r, c]) - row_mean) * row_rstd
                    )
                mean_gw: T.let = total_gw[0] / T.Cast(acc_dtype, cols)
                mean_gwx: T.let = total_gwx[0] / T.Cast(acc_dtype, cols)
                if pairs:
                    # The column sums of a vector's 2 x lanes columns kept even columns first, odd second.
                    for vector in range(paired):
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            even_sum: T.let = T.int64(2) * vector * T.int64(lanes) + lane
                            sums_weight[chunk, even_sum] += _bfloat16_even(grad_words[r, word]) * (
                                (_bfloat16_even(x_words[r, word]) - row_mean) * row_rstd
                            )
                            sums_weight[chunk, even_sum + T.int64(lanes)] += _bfloat16_odd(grad_words[r, word]) * (
                                (_bfloat16_odd(x_words[r, word]) - row_mean) * row_rstd
                            )
                            sums_bias[chunk, even_sum] += _bfloat16_even(grad_words[r, word])
                            sums_bias[chunk, even_sum + T.int64(lanes)] += _bfloat16_odd(grad_words[r, word])
                            terms[lane] = row_rstd * (
                                _bfloat16_even(grad_words[r, word]) * _bfloat16_even(weight_words[word])
                                - mean_gw
                                - (_bfloat16_even(x_words[r, word]) - row_mean) * row_rstd * mean_gwx
                            )
                            terms[lanes + lane] = row_rstd * (
                                _bfloat16_odd(grad_words[r, word]) * _bfloat16_odd(weight_words[word])
                                - mean_gw
                                - (_bfloat16_odd(x_words[r, word]) - row_mean) * row_rstd * mean_gwx
                            )
                            grad_x_words[r, word] = _bfloat16_pair(terms[lane], terms[lanes + lane], nan_guard=True)
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), vectors):
                    for lane in T.vectorized(lanes):
                        sums_weight[chunk, vector * T.int64(lanes) + lane] = sums_weight[
                            chunk, vector * T.int64(lanes) + lane
                        ] + T.Cast(acc_dtype, grad[r, vector * T.int64(lanes) + lane]) * (
                            (T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean) * row_rstd
                        )
                        sums_bias[chunk, vector * T.int64(lanes) + lane] = sums_bias[
                            chunk, vector * T.int64(lanes) + lane
                        ] + T.Cast(acc_dtype, grad[r, vector * T.int64(lanes) + lane])
                        grad_x[r, vector * T.int64(lanes) + lane] = _rounded(
                            dtype,
                            row_rstd
                            * (
                                T.Cast(acc_dtype, grad[r, vector * T.int64(lanes) + lane])
                                * T.Cast(acc_dtype, weight[vector * T.int64(lanes) + lane])
                                - mean_gw
                                - (T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane]) - row_mean)
                                * row_rstd
                                * mean_gwx
                            ),
                        )
                for c in range(vectors * T.int64(lanes), cols):
                    sums_weight[chunk, c] = sums_weight[chunk, c] + T.Cast(acc_dtype, grad[r, c]) * (
                        (T.Cast(acc_dtype, x[r, c]) - row_mean) * row_rstd
                    )
                    sums_bias[chunk, c] = sums_bias[chunk, c] + T.Cast(acc_dtype, grad[r, c])
                    grad_x[r, c] = _rounded(
                        dtype,
                        row_rstd
                        * (
                            T.Cast(acc_dtype, grad[r, c]) * T.Cast(acc_dtype, weight[c])
                            - mean_gw
                            - (T.Cast(acc_dtype, x[r, c]) - row_mean) * row_rstd * mean_gwx
                        ),
                    )
            if pairs:
                _sums_from_pairs(sums_weight, chunk, terms, paired, lanes)
                _sums_from_pairs(sums_bias, chunk, terms, paired, lanes)

    return main
