"""Fused local attention for the half types on tensor cores (``mma.sync``) in FlashAttention-2's
layout: the forward (:func:`attention_mma`) and the backward's two kernels (:func:`_query_tile_grads_mma`,
:func:`_key_tile_grads_mma`; the PrimFunc holding them is attention.py's :func:`attention_backward`).
Built with float32 operands, they are what the CPU harness (tests/cuda_on_cpu.py) runs. Their
building blocks (fragments, device functions, staging) are in mma.py.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, dropout_factor, dropout_row_key
from tvm_kernels.schedules.cuda.common import (
    QK_KEYS,
    TILE_ROWS,
    _block_ids,
    _cap_tanh,
    _chunk_rows,
    _key_head,
    _tile_rows,
)
from tvm_kernels.schedules.cuda.mma import (
    FEATURE_BLOCK,
    LN2,
    LOG2E,
    MMA_THREADS,
    OP_STRIDE,
    VECTOR,
    WARP,
    WARP_ROWS,
    _async,
    _c_element,
    _chunk_column_bounds,
    _chunk_key_bias,
    _dot8,
    _exp2,
    _in_bounds,
    _mma_source,
    _quad,
    _query_key_spans,
    _rows_times_rows,
    _stage_operand,
    _weights_times_rows,
    _whole_chunk_in_band,
)


@T.macro
def _chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype, masked, capped):
    """The forward's scores of a chunk in base 2 (scale x log2 e, the key's bias staged times log2 e),
    soft-capped where ``capped``, -inf off the band where ``masked`` (Python bools: the code without
    the cap or the mask is another branch), and each of this thread's two rows' maximum into
    ``reduced``."""
    for x in T.unroll(QK_KEYS // 8 * 4):
        kk: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        if capped:
            acc[x] = (
                T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * _cap_tanh(acc[x], scale, softcap, acc_dtype)
                + chunk_bias[slot * T.int64(QK_KEYS) + T.Cast("int64", kk)]
            )
        else:
            acc[x] = (
                acc[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E))
                + chunk_bias[slot * T.int64(QK_KEYS) + T.Cast("int64", kk)]
            )
        if masked:
            acc[x] = T.Select(_in_bounds(bounds, x), acc[x], tirx.const(float("-inf"), acc_dtype))
        reduced[x % 4 // 2] = T.max(reduced[x % 4 // 2], acc[x])


@T.macro
def _masked_chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype, capped):
    """:func:`_chunk_scores`, masked only where this thread has an element off the band."""
    if _whole_chunk_in_band(bounds):
        _chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype, False, capped)
    else:
        _chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype, True, capped)


def attention_mma(dtype: str, autoregressive: bool, operand_dtype: str | None = None):
    """Fused local attention forward on tensor cores (``mma.sync``, float32 accumulation), laid out
    as FlashAttention-2: per tile of 64 packed queries, 4 warps of 16 query rows each, and per chunk
    of 64 packed keys (as :func:`attention_fma`) each warp computes its rows' scores against all 64
    keys into registers, so that a row's scores sit in the 4 lanes of one quad: the online softmax
    runs on the accumulators (a row's maximum and sum over its lanes by two shuffles), and the
    probabilities, rounded to the input dtype, are already the A fragments of P.V (the score tiles
    of keys 16s..16s+15 are P.V's step s). Only Q, K and V pass through shared memory, as rows in
    their own dtype, 64 features at a time, staged 16 bytes per load; the warps take their
    fragments with ``ldmatrix`` (V's transposed by its ``.trans``). Where head_dim fits one block of
    64 features the tile's queries are staged once, not per chunk. Keys and values are double
    buffered: the next step's are copied with ``cp.async`` while this step's products run (49152
    bytes of shared memory with the chunks' key biases: the 48 KiB a kernel may declare statically).
    ``operand_dtype`` float32 (only with dtype float32) is for the CPU harness, which emulates the
    instructions."""
    operand = operand_dtype or dtype
    acc_dtype = accumulation_dtype(dtype)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)
    source = _mma_source(operand)
    tiles = QK_KEYS // 8  # mma tiles of 8 columns across a chunk's keys, and across 64 output features

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
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        kv_heads = T.int64()  # grouped key/value heads: dividing heads
        q = T.match_buffer(q_handle, (batch, n, heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (batch, n, kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (batch, n, kv_heads, head_dim), dtype)
        key_bias = T.match_buffer(key_bias_handle, (batch, n), acc_dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        lse = T.match_buffer(lse_handle, (batch, n, heads), acc_dtype)
        for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
            for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
                for tx in T.thread_binding(MMA_THREADS, thread="threadIdx.x"):
                    queries = T.alloc_buffer((TILE_ROWS * OP_STRIDE,), operand, scope="shared")  # [row, feature]
                    # Two slots each (double buffering: the next step's keys, values and key rows
                    # load while this step's products run): [key, feature] x 2, key rows x 2.
                    keys = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared")
                    values = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared")
                    query_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                    valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    key_row = T.alloc_buffer((2 * QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                    # key_bias x log2(e), per key
                    chunk_bias = T.alloc_buffer((2 * QK_KEYS,), acc_dtype, scope="shared")
                    acc = T.alloc_buffer((tiles * 4,), acc_dtype, scope="local")  # scores, then probabilities
                    bounds = T.alloc_buffer((4,), "int32", scope="local")  # this chunk's band, as columns
                    context = T.alloc_buffer((tiles * 4,), acc_dtype, scope="local")
                    row_max = T.alloc_buffer((2,), acc_dtype, scope="local")  # of rows g and g + 8
                    row_sum = T.alloc_buffer((2,), acc_dtype, scope="local")
                    rescale = T.alloc_buffer((2,), acc_dtype, scope="local")
                    reduced = T.alloc_buffer((2,), acc_dtype, scope="local")
                    a_frag = T.alloc_buffer((8,), operand, scope="local")
                    b_frag = T.alloc_buffer((8,), operand, scope="local")  # two tiles' B
                    ids = T.alloc_buffer((4,), "int64", scope="local")
                    # Every barrier below is placed by hand (two a step): TVM's planner would add one
                    # before the products, as it cannot tell the slots apart.
                    with T.attr(0, "hand_threaded", 1):
                        _block_ids(ids, bh, heads, dilation)
                        _key_head(ids, heads, k.shape[2])
                        b: T.let = ids[0]
                        h: T.let = ids[1]
                        d: T.let = ids[2]
                        kv_h: T.let = ids[3]
                        w: T.let = window
                        band: T.let = T.int64(2 - causal) * window + T.int64(1)
                        p0: T.let = tile * T.int64(TILE_ROWS)
                        g: T.let = tx % WARP // 4
                        t2: T.let = tx % 4 * 2
                        warp_row: T.let = tx // WARP * WARP_ROWS  # this warp's first row
                        row0: T.let = warp_row + g  # this thread's rows: row0 and row0 + 8
                        lo: T.let = tx % 8  # ldmatrix's row and matrix of this lane (the ldmatrix note by VECTOR)
                        m1: T.let = tx % WARP // 8 % 2
                        m2: T.let = tx % WARP // 16
                        blocks: T.let = (head_dim + T.int64(FEATURE_BLOCK - 1)) // T.int64(FEATURE_BLOCK)
                        chunks: T.let = (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(
                            QK_KEYS
                        )
                        _tile_rows(query_row, valid_from, valid_to, tx, p0, n, d, w, band)
                        for f0 in range(blocks):
                            for r in T.unroll(2):
                                row_max[r] = minus_inf
                                row_sum[r] = T.Cast(acc_dtype, 0)
                            for x in T.unroll(tiles * 4):
                                context[x] = T.Cast(acc_dtype, 0)
                            # A pass's steps are (chunk, fb): the chunk's keys' feature block fb against the
                            # queries', and after its last block the chunk's softmax and P.V (values: output
                            # features f0). Step u's keys sit in slot u % 2 of ``keys``, its chunk's values
                            # and key rows in slot chunk % 2; step u + 1's are copied in (cp.async) while
                            # step u computes. Two barriers a step, as without the pipeline: after the first,
                            # every warp is done with step u - 1, so the slots step u + 1 takes are free
                            # (and the next chunk's key rows are written); after the second, step u's copies
                            # (each thread waits for its own first) and those rows are in place.
                            T.tvm_storage_sync("shared")  # the last pass is done with keys, values, key rows
                            _chunk_rows(key_row, QK_KEYS, tx, p0 - w, n, d)
                            _chunk_key_bias(chunk_bias, key_bias, key_row, b, tx)
                            T.tvm_storage_sync("shared")
                            _stage_operand(
                                keys, k, key_row, b, kv_h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async"
                            )
                            _stage_operand(
                                values,
                                v,
                                key_row,
                                b,
                                kv_h,
                                f0 * T.int64(FEATURE_BLOCK),
                                head_dim,
                                tx,
                                operand,
                                0,
                                0,
                                "copy_async",
                            )
                            T.evaluate(_async("commit", operand))
                            for chunk in range(chunks):
                                slot: T.let = chunk % T.int64(2)
                                for fb in range(blocks):  # (nested loops: no int64 division by blocks)
                                    step: T.let = chunk * blocks + fb
                                    T.tvm_storage_sync("shared")
                                    if fb == T.int64(0) and chunk + T.int64(1) < chunks:
                                        _chunk_rows(
                                            key_row,
                                            QK_KEYS,
                                            tx,
                                            p0 - w + (chunk + T.int64(1)) * T.int64(QK_KEYS),
                                            n,
                                            d,
                                            (T.int64(1) - slot) * T.int64(QK_KEYS),
                                        )
                                        _chunk_key_bias(
                                            chunk_bias, key_bias, key_row, b, tx, (T.int64(1) - slot) * T.int64(QK_KEYS)
                                        )
                                    if blocks > T.int64(1) or step == T.int64(0):  # else the tile's queries stay
                                        _stage_operand(
                                            queries,
                                            q,
                                            query_row,
                                            b,
                                            h,
                                            fb * T.int64(FEATURE_BLOCK),
                                            head_dim,
                                            tx,
                                            operand,
                                        )
                                    T.evaluate(_async("wait", operand))
                                    T.tvm_storage_sync("shared")
                                    if step + T.int64(1) < chunks * blocks:  # the next step's operands, in flight
                                        next_fb: T.let = T.Select(fb + T.int64(1) < blocks, fb + T.int64(1), T.int64(0))
                                        next_slot: T.let = T.Select(fb + T.int64(1) < blocks, slot, T.int64(1) - slot)
                                        _stage_operand(
                                            keys,
                                            k,
                                            key_row,
                                            b,
                                            kv_h,
                                            next_fb * T.int64(FEATURE_BLOCK),
                                            head_dim,
                                            tx,
                                            operand,
                                            (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                            next_slot * T.int64(QK_KEYS),
                                            "copy_async",
                                        )
                                        if next_fb == T.int64(0):
                                            _stage_operand(
                                                values,
                                                v,
                                                key_row,
                                                b,
                                                kv_h,
                                                f0 * T.int64(FEATURE_BLOCK),
                                                head_dim,
                                                tx,
                                                operand,
                                                next_slot * T.int64(QK_KEYS * OP_STRIDE),
                                                next_slot * T.int64(QK_KEYS),
                                                "copy_async",
                                            )
                                        T.evaluate(_async("commit", operand))
                                    if fb == T.int64(0):
                                        for x in T.unroll(tiles * 4):
                                            acc[x] = T.Cast(acc_dtype, 0)
                                    _rows_times_rows(
                                        acc,
                                        queries,
                                        keys,
                                        a_frag,
                                        b_frag,
                                        warp_row,
                                        lo,
                                        m1,
                                        m2,
                                        operand,
                                        source,
                                        step % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                    )
                                    if fb == blocks - T.int64(1):
                                        # Scores, -inf off the band (band column j of row a is chunk column a + j, see
                                        # qk), and each row's maximum over its quad.
                                        # (The biased score first, unconditionally: inside the Select its load
                                        # would be a branch.)
                                        _chunk_column_bounds(bounds, valid_from, valid_to, row0, chunk, t2)
                                        for r in T.unroll(2):
                                            reduced[r] = minus_inf
                                        if softcap > T.float64(0):
                                            _masked_chunk_scores(
                                                acc,
                                                reduced,
                                                chunk_bias,
                                                bounds,
                                                slot,
                                                t2,
                                                scale,
                                                softcap,
                                                acc_dtype,
                                                True,
                                            )
                                        else:
                                            _masked_chunk_scores(
                                                acc,
                                                reduced,
                                                chunk_bias,
                                                bounds,
                                                slot,
                                                t2,
                                                scale,
                                                softcap,
                                                acc_dtype,
                                                False,
                                            )
                                        for r in T.unroll(2):
                                            # (stored: a let would repeat the shuffles)
                                            reduced[r] = _quad("max", reduced[r])
                                        for r in T.unroll(2):
                                            new_max: T.let = T.max(row_max[r], reduced[r])
                                            shift: T.let = T.Select(new_max == minus_inf, T.Cast(acc_dtype, 0), new_max)
                                            rescale[r] = _exp2(row_max[r] - shift, operand)
                                            row_max[r] = new_max
                                            reduced[r] = shift
                                        for r in T.unroll(2):
                                            row_sum[r] = row_sum[r] * rescale[r]
                                        for x in T.unroll(tiles * 4):
                                            acc[x] = _exp2(acc[x] - reduced[x % 4 // 2], operand)
                                            context[x] = context[x] * rescale[x % 4 // 2]
                                        for r in T.unroll(2):
                                            reduced[r] = T.Cast(acc_dtype, 0)
                                        for x in T.unroll(tiles * 4):
                                            reduced[x % 4 // 2] = reduced[x % 4 // 2] + acc[x]
                                        for r in T.unroll(2):
                                            reduced[r] = _quad("sum", reduced[r])
                                        for r in T.unroll(2):
                                            row_sum[r] = row_sum[r] + reduced[r]
                                        if dropout > T.float64(0):
                                            # The same mask as the CPU's, after the sum (off-band columns, whose
                                            # probability is 0, clamped to column 0).
                                            for r in T.unroll(2):
                                                row_key: T.let = dropout_row_key(
                                                    seed, bh, query_row[row0 + r * 8], bind=True
                                                )
                                                for x in T.unroll(tiles * 2):
                                                    kk: T.let = x // 2 * 8 + t2 + x % 2
                                                    acc[x // 2 * 4 + r * 2 + x % 2] = acc[
                                                        x // 2 * 4 + r * 2 + x % 2
                                                    ] * dropout_factor(
                                                        row_key,
                                                        T.max(
                                                            chunk * T.int64(QK_KEYS)
                                                            + T.Cast("int64", kk - row0 - r * 8),
                                                            T.int64(0),
                                                        ),
                                                        dropout,
                                                        acc_dtype,
                                                        bind=True,
                                                    )
                                        _weights_times_rows(
                                            context,
                                            acc,
                                            values,
                                            a_frag,
                                            b_frag,
                                            lo,
                                            m1,
                                            m2,
                                            operand,
                                            source,
                                            slot * T.int64(QK_KEYS * OP_STRIDE),
                                        )  # P.V
                            for x in T.unroll(tiles * 4):
                                a: T.let = row0 + _c_element(x % 4)[0]
                                f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast(
                                    "int64", x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                )
                                row: T.let = query_row[a]
                                total: T.let = row_sum[x % 4 // 2]  # 0: a row with no key (== 0: a NaN sum stays NaN)
                                if row >= T.int64(0) and f < head_dim:
                                    out[b, row, h, f] = T.Cast(
                                        dtype,
                                        T.Select(
                                            total == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0), context[x] / total
                                        ),
                                    )
                            for r in T.unroll(2):
                                row: T.let = query_row[row0 + r * 8]
                                if t2 == 0 and row >= T.int64(0):
                                    lse[b, row, h] = T.Select(
                                        row_sum[r] == T.Cast(acc_dtype, 0),
                                        minus_inf,
                                        row_max[r] * T.float32(LN2) + T.log(row_sum[r]),
                                    )

    return main


@T.macro
def _chunk_score_grads(
    scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype, operand, masked, capped
):
    """The dQ kernel's dS = P * (dP - delta) of a chunk, P = 2^(score in base 2 - lse), 0 off the band
    where ``masked``; with the soft-cap where ``capped`` (its tanh in ``cap_tanh``, a register), dS
    times the cap's derivative. (Python bools: the code without the mask or the cap is another
    branch.)"""
    for x in T.unroll(QK_KEYS // 8 * 4):
        # P (its exponent unconditionally: inside the Select its load would be a branch).
        kk: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        if capped:
            cap_tanh[0] = _cap_tanh(scores[x], scale, softcap, acc_dtype)
            scores[x] = _exp2(
                T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * cap_tanh[0] + chunk_bias[kk] - row_lse[x % 4 // 2],
                operand,
            )
        else:
            scores[x] = _exp2(
                scores[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E)) + chunk_bias[kk] - row_lse[x % 4 // 2], operand
            )
        if masked:
            scores[x] = T.Select(_in_bounds(bounds, x), scores[x], T.Cast(acc_dtype, 0))
        if capped:
            scores[x] = scores[x] * (grad_p[x] - delta[x % 4 // 2]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])
        else:
            scores[x] = scores[x] * (grad_p[x] - delta[x % 4 // 2])


@T.macro
def _masked_chunk_score_grads(
    scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype, operand, capped
):
    """:func:`_chunk_score_grads`, masked only where this thread has an element off the band."""
    if _whole_chunk_in_band(bounds):
        _chunk_score_grads(
            scores,
            grad_p,
            delta,
            row_lse,
            chunk_bias,
            bounds,
            t2,
            scale,
            softcap,
            cap_tanh,
            acc_dtype,
            operand,
            False,
            capped,
        )
    else:
        _chunk_score_grads(
            scores,
            grad_p,
            delta,
            row_lse,
            chunk_bias,
            bounds,
            t2,
            scale,
            softcap,
            cap_tanh,
            acc_dtype,
            operand,
            True,
            capped,
        )


@T.macro
def _query_tile_grads_mma(
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
):
    """dQ, per query tile, on tensor cores in the forward's layout (:func:`attention_mma`): per chunk
    of 64 keys each warp's 16 rows get S = Q K^T and dP = dO V^T as accumulator tiles, then in
    registers P = exp(S - lse), dS = P (dP Z - delta), and dQ += dS . K with dS as the A fragments
    (K's B fragments by ``ldmatrix.trans`` from its rows). Staging and fragments as the forward's.
    delta = rowsum(dO * O) - d lse per row, over the row's quad."""
    for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
        for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
            for tx in T.thread_binding(MMA_THREADS, thread="threadIdx.x"):
                queries = T.alloc_buffer((TILE_ROWS * OP_STRIDE,), operand, scope="shared")  # [row, feature]
                grads = T.alloc_buffer((TILE_ROWS * OP_STRIDE,), operand, scope="shared")  # dO: [row, feature]
                keys = T.alloc_buffer((QK_KEYS * OP_STRIDE,), operand, scope="shared")  # [key, feature]
                values = T.alloc_buffer((QK_KEYS * OP_STRIDE,), operand, scope="shared")  # [key, feature]
                query_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                key_row = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                chunk_bias = T.alloc_buffer((QK_KEYS,), acc_dtype, scope="shared")  # key_bias x log2(e), per key
                scores = T.alloc_buffer((QK_KEYS // 8 * 4,), acc_dtype, scope="local")  # S, then P, then dS
                bounds = T.alloc_buffer((4,), "int32", scope="local")  # this chunk's band, as columns
                grad_p = T.alloc_buffer((QK_KEYS // 8 * 4,), acc_dtype, scope="local")  # dP
                cap_tanh = T.alloc_buffer((1,), acc_dtype, scope="local")  # a score's soft-cap tanh
                grad_acc = T.alloc_buffer((FEATURE_BLOCK // 8 * 4,), acc_dtype, scope="local")  # dQ / scale
                row_lse = T.alloc_buffer((2,), acc_dtype, scope="local")  # of rows g and g + 8 (0 for no key)
                delta = T.alloc_buffer((2,), acc_dtype, scope="local")
                a_frag = T.alloc_buffer((8,), operand, scope="local")
                b_frag = T.alloc_buffer((8,), operand, scope="local")  # two tiles' B
                ids = T.alloc_buffer((4,), "int64", scope="local")
                _block_ids(ids, bh, heads, dilation)
                _key_head(ids, heads, k.shape[2])
                b: T.let = ids[0]
                h: T.let = ids[1]
                d: T.let = ids[2]
                kv_h: T.let = ids[3]
                w: T.let = window
                band: T.let = T.int64(2 - causal) * window + T.int64(1)
                p0: T.let = tile * T.int64(TILE_ROWS)
                g: T.let = tx % WARP // 4
                t2: T.let = tx % 4 * 2
                warp_row: T.let = tx // WARP * WARP_ROWS  # this warp's first row
                row0: T.let = warp_row + g  # this thread's rows: row0 and row0 + 8
                lo: T.let = tx % 8  # ldmatrix's row and matrix of this lane (the ldmatrix note by VECTOR)
                m1: T.let = tx % WARP // 8 % 2
                m2: T.let = tx % WARP // 16
                blocks: T.let = (head_dim + T.int64(FEATURE_BLOCK - 1)) // T.int64(FEATURE_BLOCK)
                _tile_rows(query_row, valid_from, valid_to, tx, p0, n, d, w, band)
                T.tvm_storage_sync("shared")
                for r in T.unroll(2):
                    # Each lane of the row's quad sums every fourth feature of dO * O.
                    row: T.let = query_row[row0 + r * 8]
                    delta[r] = T.Cast(acc_dtype, 0)
                    for x in range(head_dim // T.int64(4)):
                        feature: T.let = x * T.int64(4) + T.Cast("int64", tx % 4)
                        delta[r] = delta[r] + T.Select(
                            row >= T.int64(0),
                            T.Cast(acc_dtype, grad[b, T.max(row, T.int64(0)), h, feature])
                            * T.Cast(acc_dtype, out[b, T.max(row, T.int64(0)), h, feature]),
                            T.Cast(acc_dtype, 0),
                        )
                    row_lse[r] = T.Select(
                        row >= T.int64(0) and lse[b, T.max(row, T.int64(0)), h] != minus_inf,
                        lse[b, T.max(row, T.int64(0)), h] * T.float32(LOG2E),  # base 2
                        T.Cast(acc_dtype, 0),
                    )
                for r in T.unroll(2):
                    delta[r] = _quad("sum", delta[r])
                for r in T.unroll(2):
                    row: T.let = query_row[row0 + r * 8]
                    delta[r] = delta[r] - T.Select(
                        row >= T.int64(0), grad_lse[b, T.max(row, T.int64(0)), h], T.Cast(acc_dtype, 0)
                    )
                for f0 in range(blocks):
                    for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                        grad_acc[x] = T.Cast(acc_dtype, 0)
                    for chunk in range(
                        (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                    ):
                        T.tvm_storage_sync("shared")  # the last chunk's products are done with the buffers
                        _chunk_rows(key_row, QK_KEYS, tx, p0 - w + chunk * T.int64(QK_KEYS), n, d)
                        _chunk_key_bias(chunk_bias, key_bias, key_row, b, tx)
                        for x in T.unroll(QK_KEYS // 8 * 4):
                            scores[x] = T.Cast(acc_dtype, 0)
                            grad_p[x] = T.Cast(acc_dtype, 0)
                        for fb in range(blocks):
                            T.tvm_storage_sync("shared")
                            feature0: T.let = fb * T.int64(FEATURE_BLOCK)
                            if blocks > T.int64(1) or chunk == T.int64(0):  # else the tile's Q and dO stay
                                _stage_operand(queries, q, query_row, b, h, feature0, head_dim, tx, operand)
                                _stage_operand(grads, grad, query_row, b, h, feature0, head_dim, tx, operand)
                            _stage_operand(keys, k, key_row, b, kv_h, feature0, head_dim, tx, operand)
                            _stage_operand(values, v, key_row, b, kv_h, feature0, head_dim, tx, operand)
                            T.tvm_storage_sync("shared")
                            _rows_times_rows(
                                scores, queries, keys, a_frag, b_frag, warp_row, lo, m1, m2, operand, source
                            )
                            _rows_times_rows(
                                grad_p, grads, values, a_frag, b_frag, warp_row, lo, m1, m2, operand, source
                            )
                        if dropout > T.float64(0):  # dP * Z (off-band columns, where P is 0, clamped to column 0)
                            for r in T.unroll(2):
                                row_key: T.let = dropout_row_key(seed, bh, query_row[row0 + r * 8], bind=True)
                                for x in T.unroll(QK_KEYS // 8 * 2):
                                    kk: T.let = x // 2 * 8 + t2 + x % 2
                                    grad_p[x // 2 * 4 + r * 2 + x % 2] = grad_p[
                                        x // 2 * 4 + r * 2 + x % 2
                                    ] * dropout_factor(
                                        row_key,
                                        T.max(
                                            chunk * T.int64(QK_KEYS) + T.Cast("int64", kk - row0 - r * 8), T.int64(0)
                                        ),
                                        dropout,
                                        acc_dtype,
                                        bind=True,
                                    )
                        _chunk_column_bounds(bounds, valid_from, valid_to, row0, chunk, t2)
                        if softcap > T.float64(0):
                            _masked_chunk_score_grads(
                                scores,
                                grad_p,
                                delta,
                                row_lse,
                                chunk_bias,
                                bounds,
                                t2,
                                scale,
                                softcap,
                                cap_tanh,
                                acc_dtype,
                                operand,
                                True,
                            )
                        else:
                            _masked_chunk_score_grads(
                                scores,
                                grad_p,
                                delta,
                                row_lse,
                                chunk_bias,
                                bounds,
                                t2,
                                scale,
                                softcap,
                                cap_tanh,
                                acc_dtype,
                                operand,
                                False,
                            )
                        if blocks > T.int64(1):  # dQ's features f0 of these keys (one block: already there)
                            T.tvm_storage_sync("shared")
                            _stage_operand(
                                keys, k, key_row, b, kv_h, f0 * T.int64(FEATURE_BLOCK), head_dim, tx, operand
                            )
                            T.tvm_storage_sync("shared")
                        _weights_times_rows(grad_acc, scores, keys, a_frag, b_frag, lo, m1, m2, operand, source)  # dS.K
                    for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                        row: T.let = query_row[row0 + _c_element(x % 4)[0]]
                        f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast("int64", x // 4 * 8 + t2 + _c_element(x % 4)[1])
                        if row >= T.int64(0) and f < head_dim:
                            grad_q[b, row, h, f] = T.Cast(dtype, grad_acc[x] * T.Cast(acc_dtype, scale))


@T.macro
def _delta_halves(
    part_sum,
    part_lse,
    total,
    query_row,
    grad,
    out,
    lse,
    grad_lse,
    b,
    h,
    head_dim,
    tx,
    operand,
    acc_dtype,
    minus_inf,
    base=0,
):
    """Chunk query tx // 2 (row query_row[base + tx // 2]), two threads: part_sum[tx] = half of
    rowsum(dO * O) (the features of every other group of 8, 16 bytes per load), the even thread's
    less d lse, and part_lse[tx] the row's log-sum-exp times log2(e) (the base-2 softmax; 0 for a
    row with none: its P is 2^-inf = 0 everywhere). :func:`_delta_combine` puts them in the chunk's
    tables: reading no table there, the combine shares a barrier interval with the next chunk's rows
    being written."""
    row: T.let = query_row[base + T.Cast("int64", tx // 2)]
    total[0] = T.Cast(acc_dtype, 0)
    for piece in range(head_dim // T.int64(2 * VECTOR)):
        feature: T.let = piece * T.int64(2 * VECTOR) + T.Cast("int64", tx % 2 * VECTOR)
        total[0] = total[0] + T.Select(
            row >= T.int64(0), _dot8(grad, out, b, T.max(row, T.int64(0)), h, feature, operand), T.Cast(acc_dtype, 0)
        )
    part_sum[tx] = total[0] - T.Select(
        row >= T.int64(0) and tx % 2 == 0, grad_lse[b, T.max(row, T.int64(0)), h], T.Cast(acc_dtype, 0)
    )
    part_lse[tx] = T.Select(
        row >= T.int64(0) and lse[b, T.max(row, T.int64(0)), h] != minus_inf,
        lse[b, T.max(row, T.int64(0)), h] * T.float32(LOG2E),
        T.Cast(acc_dtype, 0),
    )


@T.macro
def _delta_combine(delta, row_lse, part_sum, part_lse, tx, base):
    """delta[base + x] = rowsum(dO * O) - d lse of chunk query x, row_lse[base + x] its log-sum-exp,
    from :func:`_delta_halves`."""
    if tx % 2 == 0:
        delta[base + T.Cast("int64", tx // 2)] = part_sum[tx] + part_sum[tx + 1]
        row_lse[base + T.Cast("int64", tx // 2)] = part_lse[tx]


@T.macro
def _key_tile_capped_grads(
    probs,
    grad_p,
    delta,
    row_lse,
    key_spans,
    query_row,
    my_bias,
    cap_tanh,
    row0,
    t2,
    slot,
    chunk,
    band,
    bh,
    seed,
    scale,
    softcap,
    dropout,
    acc_dtype,
    operand,
    with_dropout,
):
    """The dK/dV kernel's soft-capped chunk, in registers (:func:`_key_tile_grads_mma`): from S^T in
    ``probs`` and dP^T in ``grad_p``, P^T = 2^(capped score in base 2 - lse) (0 off the band), dS^T
    = P^T (dP^T Z - delta) (1 - tanh^2) and P^T Z, one pass per score (its tanh in ``cap_tanh``);
    Z = 1 unless ``with_dropout`` (a Python bool: the code without it is another branch)."""
    for x in T.unroll(QK_KEYS // 8 * 4):
        a: T.let = row0 + _c_element(x % 4)[0]
        col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
        cap_tanh[0] = _cap_tanh(probs[x], scale, softcap, acc_dtype)
        probs[x] = _exp2(
            T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * cap_tanh[0] + my_bias[x % 4 // 2] - row_lse[at], operand
        )
        probs[x] = T.Select(
            tirx.all(a >= key_spans[at * T.int64(2)], a < key_spans[at * T.int64(2) + T.int64(1)]),
            probs[x],
            T.Cast(acc_dtype, 0),
        )
        if with_dropout:
            j: T.let = T.Cast("int64", a - col) + band - T.int64(1) - chunk * T.int64(QK_KEYS)
            factor: T.let = dropout_factor(
                dropout_row_key(seed, bh, query_row[at], bind=True), T.max(j, T.int64(0)), dropout, acc_dtype, bind=True
            )
            grad_p[x] = probs[x] * (grad_p[x] * factor - delta[at]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])
            probs[x] = probs[x] * factor
        else:
            grad_p[x] = probs[x] * (grad_p[x] - delta[at]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])


@T.macro
def _key_tile_grads_mma(
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
):
    """dK and dV, per key tile, on tensor cores: 4 warps of 16 keys; per chunk of 64 packed queries
    whose bands reach the tile, S^T = K Q^T and dP^T = V dO^T as accumulator tiles (keys x
    queries), then in registers P^T, P^T Z and dS^T = P^T (dP^T Z - delta), which are the A
    fragments of dV += (P^T Z) dO and dK += dS^T Q (dO's and Q's B fragments by ``ldmatrix.trans``
    from their rows). The tile's K and V are staged once where head_dim fits one block. Each chunk's
    deltas rowsum(dO * O) - d lse two threads per query, 16 bytes per load.

    The chunks' Q and dO are double buffered as the forward's keys and values
    (:func:`attention_mma`): a pass over the chunks is a run of steps (chunk, stage), ``stages`` a
    chunk: its feature blocks for the products, and where head_dim takes more than one block a last
    stage for dV and dK (output features f0); step u + 1's Q and dO are copied (``cp.async``) into
    slot (u + 1) % 2 while step u computes. The chunk tables (query rows, valid columns, deltas)
    have a slot per chunk parity: chunk c + 1's rows are written in chunk c's first step, its
    deltas' halves summed after chunk c's last step's barrier and combined in chunk c + 1's first
    step. Two barriers a step. Shared memory past the 48 KiB a kernel may declare statically:
    the operands are dynamic shared memory (``shared.dyn``). (The dQ kernel is not pipelined this
    way: the loop of steps took its registers from 168 to ~245, three blocks an SM to two, where
    this kernel holds two either way.)"""
    for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
        for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
            for tx in T.thread_binding(MMA_THREADS, thread="threadIdx.x"):
                keys = T.alloc_buffer((TILE_ROWS * OP_STRIDE,), operand, scope="shared.dyn")  # [key, feature]
                values = T.alloc_buffer((TILE_ROWS * OP_STRIDE,), operand, scope="shared.dyn")  # [key, feature]
                # [query, feature] x 2
                queries = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared.dyn")
                # dO: [query, feature] x 2
                grads = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared.dyn")
                key_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                # Per chunk parity:
                query_row = T.alloc_buffer((2 * QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                valid_from = T.alloc_buffer((2 * QK_KEYS,), "int64", scope="shared")  # the queries' valid band columns
                valid_to = T.alloc_buffer((2 * QK_KEYS,), "int64", scope="shared")
                key_spans = T.alloc_buffer((2 * 2 * QK_KEYS,), "int32", scope="shared")  # each query's band: tile keys
                row_lse = T.alloc_buffer((2 * QK_KEYS,), acc_dtype, scope="shared")
                delta = T.alloc_buffer((2 * QK_KEYS,), acc_dtype, scope="shared")
                part_sum = T.alloc_buffer((MMA_THREADS,), acc_dtype, scope="shared")
                part_lse = T.alloc_buffer((MMA_THREADS,), acc_dtype, scope="shared")
                probs = T.alloc_buffer((QK_KEYS // 8 * 4,), acc_dtype, scope="local")  # S^T, then P^T Z
                grad_p = T.alloc_buffer((QK_KEYS // 8 * 4,), acc_dtype, scope="local")  # dP^T, then dS^T
                cap_tanh = T.alloc_buffer((1,), acc_dtype, scope="local")  # a score's soft-cap tanh
                grad_k_acc = T.alloc_buffer((FEATURE_BLOCK // 8 * 4,), acc_dtype, scope="local")  # dK / scale
                grad_v_acc = T.alloc_buffer((FEATURE_BLOCK // 8 * 4,), acc_dtype, scope="local")
                my_key = T.alloc_buffer((2,), "int64", scope="local")  # sequence rows of keys g and g + 8
                my_bias = T.alloc_buffer((2,), acc_dtype, scope="local")
                total = T.alloc_buffer((1,), acc_dtype, scope="local")
                a_frag = T.alloc_buffer((8,), operand, scope="local")
                b_frag = T.alloc_buffer((8,), operand, scope="local")  # two tiles' B
                ids = T.alloc_buffer((4,), "int64", scope="local")
                # Every barrier below is placed by hand (two a step): TVM's planner, which would add its own
                # wherever two accesses of a buffer might overlap, cannot tell the slots apart. The
                # extern scope gives TVM's merging of the shared.dyn buffers a scope that holds the lets
                # reading ``ids`` (a read at the allocations' own level stops it).
                with T.attr(0, "hand_threaded", 1), T.attr(0, "extern_scope", 0):
                    _block_ids(ids, bh, heads, dilation)
                    _key_head(ids, heads, k.shape[2])
                    b: T.let = ids[0]
                    h: T.let = ids[1]
                    d: T.let = ids[2]
                    kv_h: T.let = ids[3]
                    w: T.let = window
                    band: T.let = T.int64(2 - causal) * window + T.int64(1)
                    p0: T.let = tile * T.int64(TILE_ROWS)
                    g: T.let = tx % WARP // 4
                    t2: T.let = tx % 4 * 2
                    warp_row: T.let = tx // WARP * WARP_ROWS  # this warp's first key
                    row0: T.let = warp_row + g  # this thread's keys: row0 and row0 + 8
                    lo: T.let = tx % 8  # ldmatrix's row and matrix of this lane (the ldmatrix note by VECTOR)
                    m1: T.let = tx % WARP // 8 % 2
                    m2: T.let = tx % WARP // 16
                    blocks: T.let = (head_dim + T.int64(FEATURE_BLOCK - 1)) // T.int64(FEATURE_BLOCK)
                    stages: T.let = T.Select(blocks > T.int64(1), blocks + T.int64(1), T.int64(1))
                    chunks: T.let = (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                    # Chunk queries x: packed p0 - w_upper + 64 chunk + x, whose band column for tile key
                    # kk is kk - x + band - 1 - 64 chunk.
                    first_query: T.let = p0 - (band - T.int64(1) - w)
                    _chunk_rows(key_row, TILE_ROWS, tx, p0, n, d)
                    T.tvm_storage_sync("shared")
                    for r in T.unroll(2):
                        my_key[r] = key_row[row0 + r * 8]
                        my_bias[r] = key_bias[b, T.max(my_key[r], T.int64(0))] * T.float32(LOG2E)  # base 2
                    for f0 in range(blocks):
                        for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                            grad_k_acc[x] = T.Cast(acc_dtype, 0)
                            grad_v_acc[x] = T.Cast(acc_dtype, 0)
                        T.tvm_storage_sync("shared")  # the last pass is done with every buffer
                        _tile_rows(query_row, valid_from, valid_to, tx, first_query, n, d, w, band)
                        _query_key_spans(key_spans, query_row, valid_from, valid_to, tx, T.int64(0), band)
                        T.tvm_storage_sync("shared")
                        _delta_halves(
                            part_sum,
                            part_lse,
                            total,
                            query_row,
                            grad,
                            out,
                            lse,
                            grad_lse,
                            b,
                            h,
                            head_dim,
                            tx,
                            operand,
                            acc_dtype,
                            minus_inf,
                        )
                        _stage_operand(
                            queries, q, query_row, b, h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async"
                        )
                        _stage_operand(
                            grads, grad, query_row, b, h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async"
                        )
                        T.evaluate(_async("commit", operand))
                        for chunk in range(chunks):
                            slot: T.let = chunk % T.int64(2)
                            for stage in range(stages):  # (nested loops: no int64 division by stages)
                                step: T.let = chunk * stages + stage
                                T.tvm_storage_sync("shared")
                                if stage == T.int64(0):
                                    # The next chunk's rows into the other slot; this chunk's deltas from the
                                    # halves summed after the last step.
                                    if chunk + T.int64(1) < chunks:
                                        _tile_rows(
                                            query_row,
                                            valid_from,
                                            valid_to,
                                            tx,
                                            first_query + (chunk + T.int64(1)) * T.int64(QK_KEYS),
                                            n,
                                            d,
                                            w,
                                            band,
                                            (T.int64(1) - slot) * T.int64(QK_KEYS),
                                        )
                                        _query_key_spans(
                                            key_spans,
                                            query_row,
                                            valid_from,
                                            valid_to,
                                            tx,
                                            chunk + T.int64(1),
                                            band,
                                            (T.int64(1) - slot) * T.int64(QK_KEYS),
                                        )
                                    _delta_combine(delta, row_lse, part_sum, part_lse, tx, slot * T.int64(QK_KEYS))
                                # (else the tile's K and V stay)
                                if stage < blocks and (blocks > T.int64(1) or step == T.int64(0)):
                                    _stage_operand(
                                        keys, k, key_row, b, kv_h, stage * T.int64(FEATURE_BLOCK), head_dim, tx, operand
                                    )
                                    _stage_operand(
                                        values,
                                        v,
                                        key_row,
                                        b,
                                        kv_h,
                                        stage * T.int64(FEATURE_BLOCK),
                                        head_dim,
                                        tx,
                                        operand,
                                    )
                                T.evaluate(_async("wait", operand))
                                T.tvm_storage_sync("shared")
                                if step + T.int64(1) < chunks * stages:  # the next step's Q and dO, in flight
                                    next_stage: T.let = T.Select(
                                        stage + T.int64(1) < stages, stage + T.int64(1), T.int64(0)
                                    )
                                    next_slot: T.let = T.Select(stage + T.int64(1) < stages, slot, T.int64(1) - slot)
                                    # Its feature block: a product stage's own, the last stage's f0.
                                    next_block: T.let = T.Select(next_stage < blocks, next_stage, f0)
                                    _stage_operand(
                                        queries,
                                        q,
                                        query_row,
                                        b,
                                        h,
                                        next_block * T.int64(FEATURE_BLOCK),
                                        head_dim,
                                        tx,
                                        operand,
                                        (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                        next_slot * T.int64(QK_KEYS),
                                        "copy_async",
                                    )
                                    _stage_operand(
                                        grads,
                                        grad,
                                        query_row,
                                        b,
                                        h,
                                        next_block * T.int64(FEATURE_BLOCK),
                                        head_dim,
                                        tx,
                                        operand,
                                        (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                        next_slot * T.int64(QK_KEYS),
                                        "copy_async",
                                    )
                                    T.evaluate(_async("commit", operand))
                                operands: T.let = step % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE)  # this step's slot
                                if stage == stages - T.int64(1) and chunk + T.int64(1) < chunks:
                                    _delta_halves(
                                        part_sum,
                                        part_lse,
                                        total,
                                        query_row,
                                        grad,
                                        out,
                                        lse,
                                        grad_lse,
                                        b,
                                        h,
                                        head_dim,
                                        tx,
                                        operand,
                                        acc_dtype,
                                        minus_inf,
                                        (T.int64(1) - slot) * T.int64(QK_KEYS),
                                    )
                                if stage == T.int64(0):
                                    for x in T.unroll(QK_KEYS // 8 * 4):
                                        probs[x] = T.Cast(acc_dtype, 0)
                                        grad_p[x] = T.Cast(acc_dtype, 0)
                                if stage < blocks:
                                    _rows_times_rows(
                                        probs,
                                        keys,
                                        queries,
                                        a_frag,
                                        b_frag,
                                        warp_row,
                                        lo,
                                        m1,
                                        m2,
                                        operand,
                                        source,
                                        operands,
                                    )
                                    _rows_times_rows(
                                        grad_p,
                                        values,
                                        grads,
                                        a_frag,
                                        b_frag,
                                        warp_row,
                                        lo,
                                        m1,
                                        m2,
                                        operand,
                                        source,
                                        operands,
                                    )
                                if stage == stages - T.int64(1):
                                    # P^T (0 off the band), then dS^T and P^T Z; with dropout Z at (query, band column).
                                    # (Chunk query col's entries in this chunk's slot of the tables: at.)
                                    # (The exponent unconditionally: inside the Select its load would be a
                                    # branch. Keys outside the sequence need no mask: their rows of dK and
                                    # dV are not stored.)
                                    if softcap > T.float64(0):
                                        if dropout > T.float64(0):
                                            _key_tile_capped_grads(
                                                probs,
                                                grad_p,
                                                delta,
                                                row_lse,
                                                key_spans,
                                                query_row,
                                                my_bias,
                                                cap_tanh,
                                                row0,
                                                t2,
                                                slot,
                                                chunk,
                                                band,
                                                bh,
                                                seed,
                                                scale,
                                                softcap,
                                                dropout,
                                                acc_dtype,
                                                operand,
                                                True,
                                            )
                                        else:
                                            _key_tile_capped_grads(
                                                probs,
                                                grad_p,
                                                delta,
                                                row_lse,
                                                key_spans,
                                                query_row,
                                                my_bias,
                                                cap_tanh,
                                                row0,
                                                t2,
                                                slot,
                                                chunk,
                                                band,
                                                bh,
                                                seed,
                                                scale,
                                                softcap,
                                                dropout,
                                                acc_dtype,
                                                operand,
                                                False,
                                            )
                                    else:
                                        for x in T.unroll(QK_KEYS // 8 * 4):
                                            a: T.let = row0 + _c_element(x % 4)[0]
                                            col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                            at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
                                            probs[x] = _exp2(
                                                probs[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E))
                                                + my_bias[x % 4 // 2]
                                                - row_lse[at],
                                                operand,
                                            )
                                            probs[x] = T.Select(
                                                tirx.all(
                                                    a >= key_spans[at * T.int64(2)],
                                                    a < key_spans[at * T.int64(2) + T.int64(1)],
                                                ),
                                                probs[x],
                                                T.Cast(acc_dtype, 0),
                                            )
                                        if dropout > T.float64(0):
                                            for x in T.unroll(QK_KEYS // 8 * 4):
                                                a: T.let = row0 + _c_element(x % 4)[0]
                                                col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                                at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
                                                j: T.let = (
                                                    T.Cast("int64", a - col)
                                                    + band
                                                    - T.int64(1)
                                                    - chunk * T.int64(QK_KEYS)
                                                )
                                                factor: T.let = dropout_factor(
                                                    dropout_row_key(seed, bh, query_row[at], bind=True),
                                                    T.max(j, T.int64(0)),
                                                    dropout,
                                                    acc_dtype,
                                                    bind=True,
                                                )
                                                grad_p[x] = probs[x] * (grad_p[x] * factor - delta[at])
                                                probs[x] = probs[x] * factor
                                        else:
                                            for x in T.unroll(QK_KEYS // 8 * 4):
                                                at: T.let = slot * T.int64(QK_KEYS) + T.Cast(
                                                    "int64", x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                                )
                                                grad_p[x] = probs[x] * (grad_p[x] - delta[at])
                                    _weights_times_rows(
                                        grad_v_acc, probs, grads, a_frag, b_frag, lo, m1, m2, operand, source, operands
                                    )  # (P^T Z).dO
                                    _weights_times_rows(
                                        grad_k_acc,
                                        grad_p,
                                        queries,
                                        a_frag,
                                        b_frag,
                                        lo,
                                        m1,
                                        m2,
                                        operand,
                                        source,
                                        operands,
                                    )  # dS^T.Q
                        for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                            row: T.let = my_key[x % 4 // 2]
                            f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast(
                                "int64", x // 4 * 8 + t2 + _c_element(x % 4)[1]
                            )
                            if row >= T.int64(0) and f < head_dim:
                                grad_k[b, row, h, f] = T.Cast(dtype, grad_k_acc[x] * T.Cast(acc_dtype, scale))
                                grad_v[b, row, h, f] = T.Cast(dtype, grad_v_acc[x])
