"""The fused attention ops: :func:`attention` and :func:`attention_backward`, on float32 FMAs
(attention_fma.py) for float32 and on tensor cores (attention_mma.py) for the half types.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, is_half
from tvm_kernels.schedules.cuda.attention_fma import _key_tile_grads_fma, _query_tile_grads_fma, attention_fma
from tvm_kernels.schedules.cuda.attention_mma import _key_tile_grads_mma, _query_tile_grads_mma, attention_mma
from tvm_kernels.schedules.cuda.mma import _mma_source


def attention(dtype: str, autoregressive: bool, isa: str = ""):
    """Fused local attention forward: :func:`attention_mma` (tensor cores) for the half types,
    :func:`attention_fma` for float32."""
    if is_half(dtype):
        return attention_mma(dtype, autoregressive)
    return attention_fma(dtype, autoregressive)


def attention_backward(dtype: str, autoregressive: bool, isa: str = "", operand_dtype: str | None = None):
    """The fused attention's backward; same arguments and results as the CPU's
    (:func:`tvm_kernels.schedules.cpu.attention_backward`): dQ, dK, dV with no band in memory.

    Two kernels, no atomics. Per query tile (as the forward), for each chunk of 64 packed keys:
    the scores again and P = exp(score - lse), dP = dO . V^T (both the qk micro-kernel), dS =
    P * (dP * Z - delta) into shared memory, and dQ += dS . K in registers. Per key tile, for each
    chunk of 64 packed queries whose bands reach it: the same scores and dP transposed (keys as
    the micro-kernel's rows), dV += (P * Z)^T dO and dK += dS^T Q in registers. The scores and dP
    are computed twice, once per kernel: two products more than FlashAttention-2's atomic dQ, in
    exchange for plain stores and sums in a fixed order. delta = rowsum(dO * O) - d lse per row;
    Z the forward's dropout factors, regenerated. That is the float32 kernels' layout (FMAs); for
    the half types both kernels run on tensor cores in the forward's layout
    (:func:`_query_tile_grads_mma`, :func:`_key_tile_grads_mma`); ``operand_dtype`` float32 builds
    those with float operands for the CPU harness, as :func:`attention_mma`.
    """
    acc_dtype = accumulation_dtype(dtype)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)
    operand = operand_dtype or dtype
    tensor_cores = operand_dtype is not None or is_half(dtype)
    source = _mma_source(operand)

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
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        kv_heads = T.int64()  # grouped key/value heads: dividing heads (dK, dV per query head: the op sums them)
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
        # dQ, per query tile.
        if tensor_cores:
            _query_tile_grads_mma(
                grad,
                q,
                k,
                v,
                key_bias,
                out,
                lse,
                grad_lse,
                dilation,
                window,
                scale,
                softcap,
                dropout,
                seed,
                batch,
                n,
                heads,
                head_dim,
                dtype,
                acc_dtype,
                causal,
                minus_inf,
                grad_q,
                operand,
                source,
            )
        else:
            _query_tile_grads_fma(
                grad,
                q,
                k,
                v,
                key_bias,
                out,
                lse,
                grad_lse,
                dilation,
                window,
                scale,
                softcap,
                dropout,
                seed,
                batch,
                n,
                heads,
                head_dim,
                dtype,
                acc_dtype,
                causal,
                minus_inf,
                grad_q,
            )
        # dK and dV, per key tile.
        if tensor_cores:
            _key_tile_grads_mma(
                grad,
                q,
                k,
                v,
                key_bias,
                out,
                lse,
                grad_lse,
                dilation,
                window,
                scale,
                softcap,
                dropout,
                seed,
                batch,
                n,
                heads,
                head_dim,
                dtype,
                acc_dtype,
                causal,
                minus_inf,
                grad_k,
                grad_v,
                operand,
                source,
            )
        else:
            _key_tile_grads_fma(
                grad,
                q,
                k,
                v,
                key_bias,
                out,
                lse,
                grad_lse,
                dilation,
                window,
                scale,
                softcap,
                dropout,
                seed,
                batch,
                n,
                heads,
                head_dim,
                dtype,
                acc_dtype,
                causal,
                minus_inf,
                grad_k,
                grad_v,
            )

    return main
