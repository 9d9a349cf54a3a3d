"""Dropout of hidden states on the CPU: the fused attention's counter-based mask (compute.py) over
any ``[rows, cols]`` tensor, in one pass.

Why a kernel: torch's CPU dropout draws its mask with ``bernoulli_`` on one thread (n = 4096 x 768:
~18 ms, against ~1 ms for this pass), 25 times per training step of the base encoder; and a mask
that is a function of (seed, row, column) need not be kept for the backward, which is the same
kernel on the gradient (dropout is x times a fixed factor per element).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, column_step, dropout_factor, dropout_factor_of, dropout_row_key
from tvm_kernels.schedules.cpu.microkernels import _ON_STACK
from tvm_kernels.schedules.cpu.tiles import tiles_for


@T.macro
def lane_column_steps(steps, lanes):
    """steps[l] = :func:`tvm_kernels.compute.column_step` (l): lane l's term of the hash input. A
    vector of columns is then one scalar's step plus this constant vector, where a vector of int64
    columns in the hash would be narrowed and shuffled lane by lane (10 more instructions a vector)."""
    for lane in T.vectorized(lanes):
        steps[lane] = column_step(lane)


def dropout(dtype: str, isa: str):
    """``out[r, c] = x[r, c] * factor(seed, r, c)``: the factor ``1 / (1 - p)`` or 0 of
    :func:`tvm_kernels.compute.dropout_factor`, row ``r``'s key that of the attention mask's row
    ``r`` in batch-head 0 (``longformer_ops.reference.dropout_factor_reference(seed, 1, rows, 1,
    cols, p)``). Arguments: x ``[rows, cols]``, p (float64), seed (int64), out ``[rows, cols]``
    (not x). The product is taken in the accumulation dtype and rounded once."""
    acc_dtype = accumulation_dtype(dtype)
    lanes = tiles_for(isa).vector_bits // (64 if acc_dtype == "float64" else 32)

    @T.prim_func
    def main(x_handle: T.handle, p: T.float64, seed: T.int64, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        rows = T.int64()
        cols = T.int64()
        x = T.match_buffer(x_handle, (rows, cols), dtype)
        out = T.match_buffer(out_handle, (rows, cols), dtype)
        for r in T.parallel(rows):
            key: T.let = dropout_row_key(seed, T.int64(0), r)
            lane_steps = T.alloc_local((lanes,), "uint32", annotations=_ON_STACK)
            lane_column_steps(lane_steps, lanes)
            for vector in range(cols // T.int64(lanes)):
                hashed_start: T.let = key + column_step(vector * T.int64(lanes))
                for lane in T.vectorized(lanes):
                    out[r, vector * T.int64(lanes) + lane] = T.Cast(dtype, T.Cast(acc_dtype, x[r, vector * T.int64(lanes) + lane])
                                                                    * dropout_factor_of(hashed_start + lane_steps[lane], p, acc_dtype))
            for c in range(cols // T.int64(lanes) * T.int64(lanes), cols):
                out[r, c] = T.Cast(dtype, T.Cast(acc_dtype, x[r, c]) * dropout_factor(key, c, p, acc_dtype))

    return main
