"""GELU with the bias of the linear layer before it, on the CPU: the transformer FFN's
``gelu(x W^T + b)`` after a bias-free GEMM, and its backward, one vectorised pass each.

Why a kernel: torch's ``addmm`` copies the bias into each fresh output before the GEMM, its GELU
is a second pass, and its bfloat16 ``gelu_backward`` takes twice the forward's time (n = 4096 x
3072 on Zen 4: 5.6 ms against 2.8). Here the bias is added in the accumulation dtype on the way
in, so a half-type pre-activation is not rounded before the GELU, and the backward computes
GELU's derivative from the same pre-activation in one pass, summing the bias's gradient on the way.

The exact GELU, ``x Phi(x) = x (1 + erf(x / sqrt 2)) / 2``, as torch's ``gelu(approximate="none")``.
erf and exp are the vectorisable expressions of microkernels.py (float32 arithmetic for float32
and the half types; float64 the library's). Where the results are rounded to a half type (8 or 11
bits) the arithmetic is cheaper, within 2.4e-6 of the exact values, against those types' units of
3.9e-3 and 4.9e-4: the forward's erf a rational fit of lower degree (microkernels.py), the
backward's Phi from the exp that phi needs anyway (Abramowitz and Stegun 7.1.26:
``erfc(z) = tau P(tau) exp(-z^2)``, ``tau = 1 / (1 + p z)``, within 1.5e-7, z = |x| / sqrt 2) with
exp's cheaper polynomial. The half types' kernels are bound by the floating-point pipes on AVX2,
where their widening and rounding add to float32's work; on the Zen 3 this took their share of
float32's time from 1.17-1.38 (bfloat16) and 1.02-1.14 (float16) to 0.96-1.12 and 0.73-0.80 forward,
from 1.31-1.34 and 1.15-1.16 to 0.95-1.03 and 0.78-0.83 backward (the ranges span the VM's slower
and faster states: bench/NOTES.md, "The half types' GELU in less arithmetic").

On AVX2 bfloat16 takes its values as 32-bit pairs: a pair widens to two float32 values with one
shift (the even, low half) and one mask (the odd, high half), and two rounded results pack back
into a pair with a mask and an or, where one value at a time takes a widening and a shift per
operand and a pack that crosses the register's halves per result. The rounding is integer round to
nearest even without the NaN guard of microkernels.py's ``_rounded`` (:func:`_rounded_nearest_even`). The forward runs
in two passes over each run of ``_RUN`` vectors of pairs: the GELUs into a float32 buffer on the
stack, then their rounding; in one pass the erf's constants and the rounding's do not fit AVX2's 16
registers together, and LLVM shuffles and reloads them every vector. On the Zen 3 this took
bfloat16 from over float32's time to under it in both directions (bench/NOTES.md, "bfloat16's
GELU on pairs"). Rows of odd length (which start inside a pair) go one value at a time.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _bfloat16_even,
    _bfloat16_odd,
    _bfloat16_pair,
    _exp,
    _one_plus_erf,
    _pair_view,
    _paired_vectors,
    _staging,
    _store_rounded,
    _sums_from_pairs,
)
from tvm_kernels.schedules.cpu.tiles import accumulation_lanes, tiles_for

_SQRT_HALF = math.sqrt(0.5)
_RUN = 4  # vectors of pairs (each two float32 vectors) per run of bias_gelu's two passes (the module docstring)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
# Abramowitz and Stegun 7.1.26 (Hastings): erfc(z) = tau (a1 + tau (a2 + ... + tau a5)) exp(-z^2) for
# z >= 0, tau = 1 / (1 + p z), within 1.5e-7 absolutely; the half types' GELU derivative (module docstring).
_ERFC_P = 0.3275911
_ERFC_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _half_results(dtype: str) -> bool:
    """Whether ``dtype``'s results are rounded to a half type: the cheaper arithmetic (module docstring)."""
    return dtype in ("bfloat16", "float16")


def _gelu(x, acc_dtype, half_results):
    """The expression gelu(x); ``half_results``: rounded to a half type (the cheaper erf)."""
    return T.Cast(acc_dtype, 0.5) * x * _one_plus_erf(x * T.Cast(acc_dtype, _SQRT_HALF), acc_dtype, half_results)


def _gelu_derivative(x, acc_dtype, half_results):
    """The expression gelu'(x) = Phi(x) + x phi(x); ``half_results``: rounded to a half type, Phi
    from phi's exp (the module docstring)."""
    one_half = T.Cast(acc_dtype, 0.5)
    if not half_results:
        phi = T.Cast(acc_dtype, _INV_SQRT_2PI) * _exp(-(one_half * x * x), acc_dtype)
        return one_half * _one_plus_erf(x * T.Cast(acc_dtype, _SQRT_HALF), acc_dtype) + x * phi
    gauss = _exp(-(one_half * x * x), acc_dtype, True)  # exp(-z^2), z = x / sqrt 2
    tau = T.float32(1) / (T.float32(1) + T.float32(_ERFC_P * _SQRT_HALF) * T.fabs(x))
    poly = T.float32(_ERFC_A[-1] / 2)
    for c in reversed(_ERFC_A[:-1]):
        poly = poly * tau + T.float32(c / 2)
    tail = tau * poly * gauss  # erfc(|z|) / 2 = Phi(-|x|)
    return T.Select(x < T.float32(0), tail, T.float32(1) - tail) + x * T.float32(_INV_SQRT_2PI) * gauss


def bias_gelu(dtype: str, isa: str):
    """``out[r, c] = gelu(h[r, c] + bias[c])``, the sum and the GELU in the accumulation dtype,
    rounded once. Arguments: h ``[rows, cols]``, bias ``[cols]``, out ``[rows, cols]`` (may be h:
    each element is read before it is written, by the same lane)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    half = _half_results(dtype)
    # bfloat16, where the ISA asks for it (tiles.py): pairs, two passes per run (the module docstring).
    pairs = tiles_for(isa).pairs_for(dtype)
    # Buffers aligned to their element only: a contiguous tensor (a slice of rows, a bias read from
    # a checkpoint file) may start anywhere, and with TVM's default 64-byte alignment the bias's
    # vector loads, at offsets that are multiples of a vector, are emitted as aligned loads (a fault).
    element_bytes = _BITS[dtype] // 8

    @T.macro
    def gelu_pairs(h_words, bias_words, out_words, staged, r, first, vectors):
        """``vectors`` vectors of pairs from pair ``first`` on: their GELUs (even values, then odd)
        into ``staged``, then rounded back into pairs."""
        for vector in range(vectors):
            for lane in T.vectorized(lanes):
                word: T.let = first + vector * T.int64(lanes) + lane
                staged[2 * vector * lanes + lane] = _gelu(
                    _bfloat16_even(h_words[r, word]) + _bfloat16_even(bias_words[word]), acc_dtype, half
                )
                staged[(2 * vector + 1) * lanes + lane] = _gelu(
                    _bfloat16_odd(h_words[r, word]) + _bfloat16_odd(bias_words[word]), acc_dtype, half
                )
        for vector in range(vectors):
            for lane in T.vectorized(lanes):
                out_words[r, first + vector * T.int64(lanes) + lane] = _bfloat16_pair(
                    staged[2 * vector * lanes + lane], staged[(2 * vector + 1) * lanes + lane]
                )

    @T.prim_func
    def main(h_handle: T.handle, bias_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        h = T.match_buffer(h_handle, (rows, cols), dtype, align=element_bytes)
        bias = T.match_buffer(bias_handle, (cols,), dtype, align=element_bytes)
        out = T.match_buffer(out_handle, (rows, cols), dtype, align=element_bytes)
        h_words = _pair_view(h, pairs)
        bias_words = _pair_view(bias, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for r in T.parallel(rows):
            staged = (
                T.alloc_local((2 * _RUN * lanes,), acc_dtype, annotations=_ON_STACK)
                if pairs
                else _staging(dtype, lanes, acc_dtype)
            )
            if pairs:
                for run in range(paired // T.int64(_RUN)):
                    gelu_pairs(h_words, bias_words, out_words, staged, r, run * T.int64(_RUN * lanes), _RUN)
                gelu_pairs(
                    h_words,
                    bias_words,
                    out_words,
                    staged,
                    r,
                    paired // T.int64(_RUN) * T.int64(_RUN * lanes),
                    paired % T.int64(_RUN),
                )
            # The vectors after the pairs', then the columns after the last vector.
            for vector in range(paired * T.int64(2) if pairs else T.int64(0), cols // T.int64(lanes)):
                for lane in T.vectorized(lanes):
                    _store_rounded(
                        dtype,
                        out,
                        r,
                        vector * T.int64(lanes) + lane,
                        _gelu(
                            T.Cast(acc_dtype, h[r, vector * T.int64(lanes) + lane])
                            + T.Cast(acc_dtype, bias[vector * T.int64(lanes) + lane]),
                            acc_dtype,
                            half,
                        ),
                        staged,
                        lane,
                    )
            for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                _store_rounded(
                    dtype,
                    out,
                    r,
                    c,
                    _gelu(T.Cast(acc_dtype, h[r, c]) + T.Cast(acc_dtype, bias[c]), acc_dtype, half),
                    staged,
                    0,
                )

    return main


def bias_gelu_backward(dtype: str, isa: str):
    """``grad_h[r, c] = grad[r, c] * gelu'(h[r, c] + bias[c])`` in the accumulation dtype, rounded
    once, with the column sums of ``grad_h`` as rounded (the bias's gradient): ``sums[k, c]`` over
    chunk k's rows, as :func:`tvm_kernels.schedules.cpu.dropout.dropout_column_sums` sums them.
    Arguments: grad, h ``[rows, cols]``, bias ``[cols]``, grad_h ``[rows, cols]`` (may be grad),
    sums ``[chunks, cols]`` (accumulation dtype)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    half = _half_results(dtype)
    pairs = tiles_for(isa).pairs_for(dtype)  # see bias_gelu
    element_bytes = _BITS[dtype] // 8  # see bias_gelu

    @T.prim_func
    def main(
        grad_handle: T.handle, h_handle: T.handle, bias_handle: T.handle, grad_h_handle: T.handle, sums_handle: T.handle
    ):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        chunks = T.int64()
        grad = T.match_buffer(grad_handle, (rows, cols), dtype, align=element_bytes)
        h = T.match_buffer(h_handle, (rows, cols), dtype, align=element_bytes)
        bias = T.match_buffer(bias_handle, (cols,), dtype, align=element_bytes)
        grad_h = T.match_buffer(grad_h_handle, (rows, cols), dtype, align=element_bytes)
        sums = T.match_buffer(sums_handle, (chunks, cols), acc_dtype)
        grad_words = _pair_view(grad, pairs)
        h_words = _pair_view(h, pairs)
        bias_words = _pair_view(bias, pairs)
        grad_h_words = _pair_view(grad_h, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(cols, lanes)
        for chunk in T.parallel(chunks):
            size: T.let = (rows + chunks - T.int64(1)) // chunks
            for c in range(cols):
                sums[chunk, c] = T.Cast(acc_dtype, 0)
            staged = _staging(dtype, lanes, acc_dtype)
            # With pairs: a vector's even and odd values, and their rounded pairs (the sums' terms).
            terms = T.alloc_local((2 * lanes,), acc_dtype, annotations=_ON_STACK) if pairs else ()
            rounded = T.alloc_local((lanes,), "uint32", annotations=_ON_STACK) if pairs else ()
            for r in range(chunk * size, T.min(rows, chunk * size + size)):
                if pairs:
                    # Pairs: the sums of a vector's 2 x lanes columns stored even columns first, odd
                    # second (reordered after the chunk's last row).
                    for vector in range(paired):
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            terms[lane] = _bfloat16_even(grad_words[r, word]) * _gelu_derivative(
                                _bfloat16_even(h_words[r, word]) + _bfloat16_even(bias_words[word]), acc_dtype, half
                            )
                            terms[lanes + lane] = _bfloat16_odd(grad_words[r, word]) * _gelu_derivative(
                                _bfloat16_odd(h_words[r, word]) + _bfloat16_odd(bias_words[word]), acc_dtype, half
                            )
                            rounded[lane] = _bfloat16_pair(terms[lane], terms[lanes + lane])
                            grad_h_words[r, word] = rounded[lane]
                            even_sum: T.let = T.int64(2) * vector * T.int64(lanes) + lane
                            sums[chunk, even_sum] += _bfloat16_even(rounded[lane])
                            sums[chunk, even_sum + T.int64(lanes)] += _bfloat16_odd(rounded[lane])
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), cols // T.int64(lanes)):
                    for lane in T.vectorized(lanes):
                        _store_rounded(
                            dtype,
                            grad_h,
                            r,
                            vector * T.int64(lanes) + lane,
                            T.Cast(acc_dtype, grad[r, vector * T.int64(lanes) + lane])
                            * _gelu_derivative(
                                T.Cast(acc_dtype, h[r, vector * T.int64(lanes) + lane])
                                + T.Cast(acc_dtype, bias[vector * T.int64(lanes) + lane]),
                                acc_dtype,
                                half,
                            ),
                            staged,
                            lane,
                        )
                        sums[chunk, vector * T.int64(lanes) + lane] = sums[
                            chunk, vector * T.int64(lanes) + lane
                        ] + T.Cast(acc_dtype, grad_h[r, vector * T.int64(lanes) + lane])
                for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                    _store_rounded(
                        dtype,
                        grad_h,
                        r,
                        c,
                        T.Cast(acc_dtype, grad[r, c])
                        * _gelu_derivative(T.Cast(acc_dtype, h[r, c]) + T.Cast(acc_dtype, bias[c]), acc_dtype, half),
                        staged,
                        0,
                    )
                    sums[chunk, c] = sums[chunk, c] + T.Cast(acc_dtype, grad_h[r, c])
            if pairs:
                _sums_from_pairs(sums, chunk, terms, paired, lanes)

    return main
