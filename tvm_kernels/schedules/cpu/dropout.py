"""Dropout of hidden states on the CPU: the fused attention's counter-based mask (compute.py) over
any ``[rows, cols]`` tensor, in one pass; with the dense layer's bias and the residual before a
layer norm (``dropout(h + b) + x``), and, for that sum's backward, with the gradient's column sums.

Why a kernel: torch's CPU dropout draws its mask with ``bernoulli_`` on one thread (n = 4096 x 768:
~18 ms, against ~1 ms for this pass), 25 times per training step of the base encoder; and a mask
that is a function of (seed, row, column) need not be kept for the backward, which is the same
kernel on the gradient (dropout is x times a fixed factor per element).

Why the bias and the residual in the same pass: a transformer block's ``LayerNorm(x +
dropout(dense(h)))`` otherwise takes torch's ``addmm`` (which first copies the bias into each fresh
output), the dropout and the residual's add, three passes over ``[rows, hidden]`` where this is
one; and the backward's bias gradient, a sum over rows of the dropped-out gradient, is taken on
the way out instead of by one more pass.

On AVX2 bfloat16 takes its values as 32-bit pairs, as the GELU does (microkernels.py; gelu.py's
docstring says why): a vector of pairs is a vector of even columns and one of odd, each with its
own hash terms, and the column sums are kept in that order until the chunk's last row
(bench/NOTES.md, "bfloat16's dropout kernels on pairs").
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, column_step, dropout_factor, dropout_factor_of, dropout_row_key
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _bfloat16_even,
    _bfloat16_odd,
    _bfloat16_pair,
    _pair_view,
    _paired_vectors,
    _staging,
    _store_rounded,
    _sums_from_pairs,
)
from tvm_kernels.schedules.cpu.tiles import accumulation_lanes, tiles_for


@T.macro
def lane_column_steps(steps, lanes):
    """steps[l] = :func:`tvm_kernels.compute.column_step` (l): lane l's term of the hash input. A
    vector of columns is then one scalar's step plus this constant vector, where a vector of int64
    columns in the hash would be narrowed and shuffled lane by lane (10 more instructions a vector)."""
    for lane in T.vectorized(lanes):
        steps[lane] = column_step(lane)


@T.macro
def pair_column_steps(steps, lanes):
    """With pairs (microkernels.py): ``steps[l]`` the hash term of a vector of pairs' even column
    ``2 l``, ``steps[lanes + l]`` of its odd one."""
    for lane in T.vectorized(lanes):
        steps[lane] = column_step(T.int64(2) * lane)
        steps[lanes + lane] = column_step(T.int64(2) * lane + T.int64(1))


@T.macro
def _dropped_pair(terms, lane, words, hashed_start, pair_steps, p, lanes, acc_dtype):
    """With pairs: ``terms[lane]`` and ``terms[lanes + lane]`` the even and odd values of the pair
    ``words`` times their dropout factors (``hashed_start`` the vector's hash input,
    :func:`pair_column_steps` its columns' terms), unrounded."""
    terms[lane] = _bfloat16_even(words) * dropout_factor_of(hashed_start + pair_steps[lane], p, acc_dtype)
    terms[lanes + lane] = _bfloat16_odd(words) * dropout_factor_of(
        hashed_start + pair_steps[lanes + lane], p, acc_dtype
    )


def _hash_buffers(dtype: str, lanes: int, acc_dtype: str, pairs: bool):
    """The dropout kernels' per-row buffers (call it inside the PrimFunc): :func:`lane_column_steps`'s,
    ``_store_rounded``'s staging (bfloat16), and with pairs :func:`pair_column_steps`'s and a vector
    of pairs' values before their rounding (even, then odd: the rounding reads each twice, so it
    takes them from here, not from the expressions, as ``_store_rounded``)."""
    lane_steps = T.alloc_local((lanes,), "uint32", annotations=_ON_STACK)
    staged = _staging(dtype, lanes, acc_dtype)
    pair_steps = T.alloc_local((2 * lanes,), "uint32", annotations=_ON_STACK) if pairs else ()
    terms = T.alloc_local((2 * lanes,), "float32", annotations=_ON_STACK) if pairs else ()
    return lane_steps, staged, pair_steps, terms


def dropout(dtype: str, isa: str):
    """``out[r, c] = x[r, c] * factor(seed, r, c)``: the factor ``1 / (1 - p)`` or 0 of
    :func:`tvm_kernels.compute.dropout_factor`, row ``r``'s key that of the attention mask's row
    ``r`` in batch-head 0 (``longformer_ops.ops.reference.dropout_factor_reference(seed, 1, rows, 1,
    cols, p)``). Arguments: x ``[rows, cols]``, p (float64), seed (int64), out ``[rows, cols]``
    (not x). The product is taken in the accumulation dtype and rounded once."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)

    @T.prim_func
    def main(x_handle: T.handle, p: T.float64, seed: T.int64, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        x = T.match_buffer(x_handle, (rows, cols), dtype)
        out = T.match_buffer(out_handle, (rows, cols), dtype)
        x_words = _pair_view(x, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for r in T.parallel(rows):
            key: T.let = dropout_row_key(seed, T.int64(0), r)
            lane_steps, staged, pair_steps, terms = _hash_buffers(dtype, lanes, acc_dtype, pairs)
            lane_column_steps(lane_steps, lanes)
            if pairs:
                pair_column_steps(pair_steps, lanes)
                for vector in range(paired):
                    hashed_start: T.let = key + column_step(vector * T.int64(2 * lanes))
                    for lane in T.vectorized(lanes):
                        word: T.let = vector * T.int64(lanes) + lane
                        _dropped_pair(terms, lane, x_words[r, word], hashed_start, pair_steps, p, lanes, acc_dtype)
                        out_words[r, word] = _bfloat16_pair(terms[lane], terms[lanes + lane])
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), cols // T.int64(lanes)):
                hashed_start: T.let = key + column_step(vector * T.int64(lanes))
                for lane in T.vectorized(lanes):
                    _store_rounded(
                        dtype,
                        out,
                        r,
                        vector * T.int64(lanes) + lane,
                        T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane])
                        * dropout_factor_of(hashed_start + lane_steps[lane], p, acc_dtype),
                        staged,
                        lane,
                    )
            for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                _store_rounded(
                    dtype, out, r, c, T.Cast(acc_dtype, x[r, c]) * dropout_factor(key, c, p, acc_dtype), staged, 0
                )

    return main


def bias_dropout_add(dtype: str, isa: str):
    """``out[r, c] = (h[r, c] + bias[c]) * factor(seed, r, c) + residual[r, c]``, the factor
    :func:`dropout`'s (the same mask for the same seed), all in the accumulation dtype, rounded once.
    Arguments: h ``[rows, cols]``, bias ``[cols]``, residual ``[rows, cols]``, p (float64), seed
    (int64), out ``[rows, cols]`` (may be h: each element is read before it is written, by the same
    lane)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    # Buffers aligned to their element only (see gelu.bias_gelu): a bias read from a checkpoint, or a
    # slice of rows, may start anywhere.
    element_bytes = _BITS[dtype] // 8

    @T.prim_func
    def main(
        h_handle: T.handle,
        bias_handle: T.handle,
        residual_handle: T.handle,
        p: T.float64,
        seed: T.int64,
        out_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        h = T.match_buffer(h_handle, (rows, cols), dtype, align=element_bytes)
        bias = T.match_buffer(bias_handle, (cols,), dtype, align=element_bytes)
        residual = T.match_buffer(residual_handle, (rows, cols), dtype, align=element_bytes)
        out = T.match_buffer(out_handle, (rows, cols), dtype, align=element_bytes)
        h_words = _pair_view(h, pairs)
        bias_words = _pair_view(bias, pairs)
        residual_words = _pair_view(residual, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for r in T.parallel(rows):
            key: T.let = dropout_row_key(seed, T.int64(0), r)
            lane_steps, staged, pair_steps, terms = _hash_buffers(dtype, lanes, acc_dtype, pairs)
            lane_column_steps(lane_steps, lanes)
            if pairs:
                pair_column_steps(pair_steps, lanes)
                for vector in range(paired):
                    hashed_start: T.let = key + column_step(vector * T.int64(2 * lanes))
                    for lane in T.vectorized(lanes):
                        word: T.let = vector * T.int64(lanes) + lane
                        terms[lane] = (
                            _bfloat16_even(h_words[r, word]) + _bfloat16_even(bias_words[word])
                        ) * dropout_factor_of(hashed_start + pair_steps[lane], p, acc_dtype) + _bfloat16_even(
                            residual_words[r, word]
                        )
                        terms[lanes + lane] = (
                            _bfloat16_odd(h_words[r, word]) + _bfloat16_odd(bias_words[word])
                        ) * dropout_factor_of(hashed_start + pair_steps[lanes + lane], p, acc_dtype) + _bfloat16_odd(
                            residual_words[r, word]
                        )
                        out_words[r, word] = _bfloat16_pair(terms[lane], terms[lanes + lane])
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), cols // T.int64(lanes)):
                hashed_start: T.let = key + column_step(vector * T.int64(lanes))
                for lane in T.vectorized(lanes):
                    _store_rounded(
                        dtype,
                        out,
                        r,
                        vector * T.int64(lanes) + lane,
                        (
                            T.Cast(acc_dtype, h[r, vector * T.int64(lanes) + lane])
                            + T.Cast(acc_dtype, bias[vector * T.int64(lanes) + lane])
                        )
                        * dropout_factor_of(hashed_start + lane_steps[lane], p, acc_dtype)
                        + T.Cast(acc_dtype, residual[r, vector * T.int64(lanes) + lane]),
                        staged,
                        lane,
                    )
            for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                _store_rounded(
                    dtype,
                    out,
                    r,
                    c,
                    (T.Cast(acc_dtype, h[r, c]) + T.Cast(acc_dtype, bias[c])) * dropout_factor(key, c, p, acc_dtype)
                    + T.Cast(acc_dtype, residual[r, c]),
                    staged,
                    0,
                )

    return main


def dropout_column_sums(dtype: str, isa: str):
    """:func:`dropout` (``out = x * factor``, rounded once) with the column sums of ``out`` as rounded:
    ``sums[k, c]`` is the sum over chunk k's rows, chunk k the rows ``[k * size, (k + 1) * size)``,
    ``size = ceil(rows / chunks)``, in the accumulation dtype, row by row in order. The backward of
    :func:`bias_dropout_add`: the bias's gradient is ``sums`` summed over its chunks. Arguments: x
    ``[rows, cols]``, p (float64), seed (int64), out ``[rows, cols]`` (not x), sums ``[chunks, cols]``
    (accumulation dtype; chunks run in parallel, one a thread at a time, their sums in L1)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    element_bytes = _BITS[dtype] // 8

    @T.prim_func
    def main(x_handle: T.handle, p: T.float64, seed: T.int64, out_handle: T.handle, sums_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        chunks = T.int64()
        x = T.match_buffer(x_handle, (rows, cols), dtype, align=element_bytes)
        out = T.match_buffer(out_handle, (rows, cols), dtype, align=element_bytes)
        sums = T.match_buffer(sums_handle, (chunks, cols), acc_dtype)
        x_words = _pair_view(x, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for chunk in T.parallel(chunks):
            size: T.let = (rows + chunks - T.int64(1)) // chunks
            for c in range(cols):
                sums[chunk, c] = T.Cast(acc_dtype, 0)
            lane_steps, staged, pair_steps, terms = _hash_buffers(dtype, lanes, acc_dtype, pairs)
            rounded = T.alloc_local((lanes,), "uint32", annotations=_ON_STACK) if pairs else ()
            lane_column_steps(lane_steps, lanes)
            if pairs:
                pair_column_steps(pair_steps, lanes)
            for r in range(chunk * size, T.min(rows, chunk * size + size)):
                key: T.let = dropout_row_key(seed, T.int64(0), r)
                if pairs:
                    # The sums of a vector's 2 x lanes columns kept even columns first, odd second
                    # (put back in column order after the chunk's last row).
                    for vector in range(paired):
                        hashed_start: T.let = key + column_step(vector * T.int64(2 * lanes))
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            _dropped_pair(terms, lane, x_words[r, word], hashed_start, pair_steps, p, lanes, acc_dtype)
                            rounded[lane] = _bfloat16_pair(terms[lane], terms[lanes + lane])
                            out_words[r, word] = rounded[lane]
                            even_sum: T.let = T.int64(2) * vector * T.int64(lanes) + lane
                            sums[chunk, even_sum] += _bfloat16_even(rounded[lane])
                            sums[chunk, even_sum + T.int64(lanes)] += _bfloat16_odd(rounded[lane])
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), cols // T.int64(lanes)):
                    hashed_start: T.let = key + column_step(vector * T.int64(lanes))
                    for lane in T.vectorized(lanes):
                        _store_rounded(
                            dtype,
                            out,
                            r,
                            vector * T.int64(lanes) + lane,
                            T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane])
                            * dropout_factor_of(hashed_start + lane_steps[lane], p, acc_dtype),
                            staged,
                            lane,
                        )
                        sums[chunk, vector * T.int64(lanes) + lane] = sums[
                            chunk, vector * T.int64(lanes) + lane
                        ] + T.Cast(acc_dtype, out[r, vector * T.int64(lanes) + lane])
                for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                    _store_rounded(
                        dtype, out, r, c, T.Cast(acc_dtype, x[r, c]) * dropout_factor(key, c, p, acc_dtype), staged, 0
                    )
                    sums[chunk, c] = sums[chunk, c] + T.Cast(acc_dtype, out[r, c])
            if pairs:
                _sums_from_pairs(sums, chunk, terms, paired, lanes)

    return main
