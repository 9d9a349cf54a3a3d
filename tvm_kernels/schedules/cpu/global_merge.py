"""The layer's merge of global keys into the band's attention, on the CPU (one pass each way).

The fused attention returns each row's band context ``C`` (normalised) and log-sum-exp; the layer
(``longformer_ops.models.layer._GlobalKeyMerge``) turns those and the global keys' scores into weights,
``a`` for the band part and ``omega_g`` for each global slot, and the output is
``a C + sum_g omega_g V_g`` (``V_g`` slot g's value row). Its backward needs, per row and head,
``G a`` (the context's gradient), ``u = <G, C>`` and ``t_g = <G, V_g>``. In torch these were a
matmul, a mixed-dtype ``addcmul`` and a conversion forward (each a pass over ``[b, n, h, d]``, the
half-type operands converted whole), and as many backward; here one pass each, in the accumulation
dtype, rounded once.

On AVX2 bfloat16 takes its values as 32-bit pairs, as the GELU does (microkernels.py; gelu.py's
docstring says why). The forward: each output the same sum in the same order, bit for bit, rounded
as pairs with the NaN guard (the weights are float32 of any bit pattern: bench/NOTES.md,
"bfloat16's layer norm backward and global merge on pairs"). The backward: the context's gradient
bit for bit but for a NaN's bits, its dot products with a vector of pairs' even and odd products
in the same partial sums (another order, as exact; bench/NOTES.md, "bfloat16's global-merge and
band softmax backwards on pairs").
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cpu.microkernels import (
    _BITS,
    _ON_STACK,
    _bfloat16_even,
    _bfloat16_odd,
    _bfloat16_pair,
    _pair_view,
    _paired_vectors,
    _quieted,
    _rounded,
)
from tvm_kernels.schedules.cpu.tiles import accumulation_lanes, tiles_for


def global_merge(dtype: str, isa: str):
    """``out[b, r, h, :] = a[b, r, h] context[b, r, h, :] + sum_g omega[b, r, h, g] values[b, g, h, :]``
    in the accumulation dtype, rounded once. Arguments: context ``[b, n, h, d]``, a ``[b, n, h]`` and
    omega ``[b, n, h, g]`` (accumulation dtype), values ``[b, g, h, d]``, out ``[b, n, h, d]`` (may be
    context: each element is read before it is written, by the same lane)."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    # Buffers aligned to their element only (see gelu.py): views may start anywhere.
    element, acc_element = _BITS[dtype] // 8, _BITS[acc_dtype] // 8

    @T.prim_func
    def main(
        context_handle: T.handle,
        a_handle: T.handle,
        omega_handle: T.handle,
        values_handle: T.handle,
        out_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        d = T.int64()
        slots = T.int64()
        context = T.match_buffer(context_handle, (batch, n, heads, d), dtype, align=element)
        a = T.match_buffer(a_handle, (batch, n, heads), acc_dtype, align=acc_element)
        omega = T.match_buffer(omega_handle, (batch, n, heads, slots), acc_dtype, align=acc_element)
        values = T.match_buffer(values_handle, (batch, slots, heads, d), dtype, align=element)
        out = T.match_buffer(out_handle, (batch, n, heads, d), dtype, align=element)
        context_words = _pair_view(context, pairs)
        values_words = _pair_view(values, pairs)
        out_words = _pair_view(out, pairs)
        if pairs:  # (a binding only then: the other libraries' code stays as it was)
            paired: T.let = _paired_vectors(d, lanes)
        for row in T.parallel(batch * n):
            b: T.let = row // n
            r: T.let = row % n
            merged = T.alloc_local((2 * lanes if pairs else lanes,), acc_dtype, annotations=_ON_STACK)
            for h in range(heads):
                if pairs:
                    # Even columns in merged[:lanes], odd in merged[lanes:]; each value's sum in the order below.
                    for vector in range(paired):
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            merged[lane] = a[b, r, h] * _bfloat16_even(context_words[b, r, h, word])
                            merged[lanes + lane] = a[b, r, h] * _bfloat16_odd(context_words[b, r, h, word])
                        for g in range(slots):
                            for lane in T.vectorized(lanes):
                                word: T.let = vector * T.int64(lanes) + lane
                                merged[lane] = merged[lane] + omega[b, r, h, g] * _bfloat16_even(
                                    values_words[b, g, h, word]
                                )
                                merged[lanes + lane] = merged[lanes + lane] + omega[b, r, h, g] * _bfloat16_odd(
                                    values_words[b, g, h, word]
                                )
                        for lane in T.vectorized(lanes):
                            out_words[b, r, h, vector * T.int64(lanes) + lane] = _bfloat16_pair(
                                merged[lane], merged[lanes + lane], nan_guard=True
                            )
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), d // T.int64(lanes)):
                    for lane in T.vectorized(lanes):
                        merged[lane] = a[b, r, h] * T.Cast(acc_dtype, context[b, r, h, vector * T.int64(lanes) + lane])
                    for g in range(slots):
                        for lane in T.vectorized(lanes):
                            merged[lane] = merged[lane] + omega[b, r, h, g] * T.Cast(
                                acc_dtype, values[b, g, h, vector * T.int64(lanes) + lane]
                            )
                    for lane in T.vectorized(lanes):
                        out[b, r, h, vector * T.int64(lanes) + lane] = _rounded(dtype, merged[lane])
                for c in range(d // T.int64(lanes) * T.int64(lanes), d):
                    merged[0] = a[b, r, h] * T.Cast(acc_dtype, context[b, r, h, c])
                    for g in range(slots):
                        merged[0] = merged[0] + omega[b, r, h, g] * T.Cast(acc_dtype, values[b, g, h, c])
                    out[b, r, h, c] = _rounded(dtype, merged[0])

    return main


# Slots whose dot products share one pass over the gradient: as many independent accumulator chains in
# registers, the gradient loaded (widened, for the half types) once for them all. (Each dot product in a
# pass of its own was a single chain re-reading the gradient: bfloat16 1.2-1.44x float32's time.)
SLOT_GROUP = 4


@T.macro
def _lanes_summed(result, at, partial, offset, total, lanes):
    """result[at] = partial[offset] + ... + partial[offset + lanes - 1], in that order."""
    total[0] = partial[offset]
    for lane in range(1, lanes):
        total[0] = total[0] + partial[offset + lane]
    result[at] = total[0]


@T.macro
def _slots_pass(
    t,
    grad,
    values,
    grad_words,
    values_words,
    paired,
    b,
    r,
    h,
    first,
    count,
    d,
    widened,
    partial,
    total,
    lanes,
    acc_dtype,
    pairs,
):
    """t[b, r, h, first + j] = <grad[b, r, h, :], values[b, first + j, h, :]> for j < count (a Python
    int: the count's chains unrolled, in registers) in one pass over the features; with ``pairs``
    the first ``paired`` vectors of pairs (``grad_words``, ``values_words``) each add their even and
    odd products to the same partial sums."""
    for j in T.unroll(count):
        for lane in T.vectorized(lanes):
            partial[j * lanes + lane] = T.Cast(acc_dtype, 0)
    if pairs:
        for vector in range(paired):
            for lane in T.vectorized(lanes):
                widened[lane] = _bfloat16_even(grad_words[b, r, h, vector * T.int64(lanes) + lane])
                widened[lanes + lane] = _bfloat16_odd(grad_words[b, r, h, vector * T.int64(lanes) + lane])
            for j in T.unroll(count):
                for lane in T.vectorized(lanes):
                    word: T.let = vector * T.int64(lanes) + lane
                    partial[j * lanes + lane] = (
                        partial[j * lanes + lane]
                        + widened[lane] * _bfloat16_even(values_words[b, first + T.int64(j), h, word])
                        + widened[lanes + lane] * _bfloat16_odd(values_words[b, first + T.int64(j), h, word])
                    )
    for vector in range(paired * T.int64(2) if pairs else T.int64(0), d // T.int64(lanes)):
        for lane in T.vectorized(lanes):
            widened[lane] = T.Cast(acc_dtype, grad[b, r, h, vector * T.int64(lanes) + lane])
        for j in T.unroll(count):
            for lane in T.vectorized(lanes):
                partial[j * lanes + lane] = partial[j * lanes + lane] + widened[lane] * T.Cast(
                    acc_dtype, values[b, first + T.int64(j), h, vector * T.int64(lanes) + lane]
                )
    for c in range(d // T.int64(lanes) * T.int64(lanes), d):
        widened[0] = T.Cast(acc_dtype, grad[b, r, h, c])
        for j in T.unroll(count):
            partial[j * lanes] = partial[j * lanes] + widened[0] * T.Cast(
                acc_dtype, values[b, first + T.int64(j), h, c]
            )
    for j in T.unroll(count):
        _lanes_summed(t, (b, r, h, first + T.int64(j)), partial, j * lanes, total, lanes)


def global_merge_backward(dtype: str, isa: str):
    """From the output's gradient ``grad [b, n, h, d]``: ``grad_context = grad a`` (rounded once to
    the dtype), ``u[b, r, h] = <grad, context>`` and ``t[b, r, h, g] = <grad, values[b, g, h]>`` over
    ``d`` (accumulation dtype; products and sums in it, per lane over the vectors, the tail in lane 0,
    then the lanes in order; with pairs each lane takes a vector of pairs' even product, then its odd
    one). Arguments: grad, context ``[b, n, h, d]``, values ``[b, g, h, d]``, a ``[b, n, h]``, then
    the outputs grad_context ``[b, n, h, d]``, u ``[b, n, h]``, t ``[b, n, h, g]``.

    Each pass over the features serves several outputs (the context's gradient and u, then the slots
    ``SLOT_GROUP`` at a time, then the one to three left), so the gradient is read and widened once
    per pass instead of once per dot product, and the dot products run as independent chains."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = accumulation_lanes(dtype, isa)
    pairs = tiles_for(isa).pairs_for(dtype)
    element, acc_element = _BITS[dtype] // 8, _BITS[acc_dtype] // 8
    group = SLOT_GROUP

    @T.prim_func
    def main(
        grad_handle: T.handle,
        context_handle: T.handle,
        values_handle: T.handle,
        a_handle: T.handle,
        grad_context_handle: T.handle,
        u_handle: T.handle,
        t_handle: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        d = T.int64()
        slots = T.int64()
        grad = T.match_buffer(grad_handle, (batch, n, heads, d), dtype, align=element)
        context = T.match_buffer(context_handle, (batch, n, heads, d), dtype, align=element)
        values = T.match_buffer(values_handle, (batch, slots, heads, d), dtype, align=element)
        a = T.match_buffer(a_handle, (batch, n, heads), acc_dtype, align=acc_element)
        grad_context = T.match_buffer(grad_context_handle, (batch, n, heads, d), dtype, align=element)
        u = T.match_buffer(u_handle, (batch, n, heads), acc_dtype, align=acc_element)
        t = T.match_buffer(t_handle, (batch, n, heads, slots), acc_dtype, align=acc_element)
        grad_words = _pair_view(grad, pairs)
        context_words = _pair_view(context, pairs)
        values_words = _pair_view(values, pairs)
        grad_context_words = _pair_view(grad_context, pairs)
        paired: T.let = _paired_vectors(d, lanes) if pairs else T.int64(0)
        for row in T.parallel(batch * n):
            b: T.let = row // n
            r: T.let = row % n
            widened = T.alloc_local((2 * lanes if pairs else lanes,), acc_dtype, annotations=_ON_STACK)
            partial = T.alloc_local((group * lanes,), acc_dtype, annotations=_ON_STACK)
            total = T.alloc_local((1,), acc_dtype, annotations=_ON_STACK)
            for h in range(heads):
                # The context's gradient and u in one pass.
                for lane in T.vectorized(lanes):
                    partial[lane] = T.Cast(acc_dtype, 0)
                if pairs:
                    # a, float32 of any bit pattern, with its NaNs quieted once (_quieted) in place of
                    # the rounding's guard on every product: then each NaN product is a bfloat16 NaN
                    # (low half zero) or x86's default NaN, which round without carrying (_bfloat16_pair).
                    weight: T.let = T.reinterpret(acc_dtype, _quieted(T.reinterpret("uint32", a[b, r, h])))
                    for vector in range(paired):
                        for lane in T.vectorized(lanes):
                            word: T.let = vector * T.int64(lanes) + lane
                            widened[lane] = _bfloat16_even(grad_words[b, r, h, word])
                            widened[lanes + lane] = _bfloat16_odd(grad_words[b, r, h, word])
                            grad_context_words[b, r, h, word] = _bfloat16_pair(
                                weight * widened[lane], weight * widened[lanes + lane]
                            )
                            partial[lane] = (
                                partial[lane]
                                + widened[lane] * _bfloat16_even(context_words[b, r, h, word])
                                + widened[lanes + lane] * _bfloat16_odd(context_words[b, r, h, word])
                            )
                for vector in range(paired * T.int64(2) if pairs else T.int64(0), d // T.int64(lanes)):
                    for lane in T.vectorized(lanes):
                        widened[lane] = T.Cast(acc_dtype, grad[b, r, h, vector * T.int64(lanes) + lane])
                    for lane in T.vectorized(lanes):
                        grad_context[b, r, h, vector * T.int64(lanes) + lane] = _rounded(
                            dtype, a[b, r, h] * widened[lane]
                        )
                    for lane in T.vectorized(lanes):
                        partial[lane] = partial[lane] + widened[lane] * T.Cast(
                            acc_dtype, context[b, r, h, vector * T.int64(lanes) + lane]
                        )
                for c in range(d // T.int64(lanes) * T.int64(lanes), d):
                    widened[0] = T.Cast(acc_dtype, grad[b, r, h, c])
                    grad_context[b, r, h, c] = _rounded(dtype, a[b, r, h] * widened[0])
                    partial[0] = partial[0] + widened[0] * T.Cast(acc_dtype, context[b, r, h, c])
                _lanes_summed(u, (b, r, h), partial, 0, total, lanes)
                # The slots: groups of SLOT_GROUP, then those left in one pass (SLOT_GROUP - 1 cases).
                for first in range(slots // T.int64(group)):
                    _slots_pass(
                        t,
                        grad,
                        values,
                        grad_words,
                        values_words,
                        paired,
                        b,
                        r,
                        h,
                        first * T.int64(group),
                        group,
                        d,
                        widened,
                        partial,
                        total,
                        lanes,
                        acc_dtype,
                        pairs,
                    )
                if slots % T.int64(group) == T.int64(1):
                    _slots_pass(
                        t,
                        grad,
                        values,
                        grad_words,
                        values_words,
                        paired,
                        b,
                        r,
                        h,
                        slots - T.int64(1),
                        1,
                        d,
                        widened,
                        partial,
                        total,
                        lanes,
                        acc_dtype,
                        pairs,
                    )
                if slots % T.int64(group) == T.int64(2):
                    _slots_pass(
                        t,
                        grad,
                        values,
                        grad_words,
                        values_words,
                        paired,
                        b,
                        r,
                        h,
                        slots - T.int64(2),
                        2,
                        d,
                        widened,
                        partial,
                        total,
                        lanes,
                        acc_dtype,
                        pairs,
                    )
                if slots % T.int64(group) == T.int64(3):
                    _slots_pass(
                        t,
                        grad,
                        values,
                        grad_words,
                        values_words,
                        paired,
                        b,
                        r,
                        h,
                        slots - T.int64(3),
                        3,
                        d,
                        widened,
                        partial,
                        total,
                        lanes,
                        acc_dtype,
                        pairs,
                    )

    return main
