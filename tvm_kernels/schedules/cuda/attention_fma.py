"""Fused local attention on float32 FMAs: the forward (:func:`attention_fma`, FlashAttention's
online softmax over qk's chunks) and the backward's two kernels, dQ per query tile and dK, dV per
key tile (:func:`_query_tile_grads_fma`, :func:`_key_tile_grads_fma`; the PrimFunc holding them is
attention.py's :func:`attention_backward`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, dropout_factor, dropout_row_key
from tvm_kernels.schedules.cuda.common import (
    K_STRIDE,
    OUT_FEATURES,
    PER_PART,
    Q_STRIDE,
    QK_FEATURES,
    QK_KEYS,
    ROW_PARTS,
    S_STRIDE,
    SPAN,
    THREADS,
    TILE_ROWS,
    _block_ids,
    _cap_tanh,
    _chunk_rows,
    _key_head,
    _qk_chunk,
    _score_scale,
    _tile_rows,
)


@T.macro
def _online_softmax(
    scores, row_max, row_sum, rescale, part_max, part_sum, query_row, tx, chunk, bh, seed, dropout, acc_dtype, minus_inf
):
    """FlashAttention's online softmax over one chunk of the tile's scores ([row, key] in shared
    memory, -inf off the band), four threads per row: each row's new maximum over its four parts of
    the chunk, then its probabilities (in place, dropout applied after the sum) and their sum;
    rescale[row] is what the row's earlier results are to be multiplied by. -inf rows stay at 0."""
    mine: T.let = tx // ROW_PARTS  # this thread's row, and its part of the chunk
    part: T.let = tx % ROW_PARTS
    top = T.alloc_buffer((1,), acc_dtype, scope="local")
    top[0] = minus_inf
    for x in range(PER_PART):
        top[0] = T.max(top[0], scores[mine * S_STRIDE + part * PER_PART + x])
    part_max[tx] = top[0]
    T.tvm_storage_sync("shared")
    old_max: T.let = row_max[mine]
    new_max: T.let = T.max(
        T.max(
            T.max(old_max, part_max[mine * ROW_PARTS]),
            T.max(part_max[mine * ROW_PARTS + 1], part_max[mine * ROW_PARTS + 2]),
        ),
        part_max[mine * ROW_PARTS + 3],
    )
    shift: T.let = T.Select(new_max == minus_inf, T.Cast(acc_dtype, 0), new_max)
    total = T.alloc_buffer((1,), acc_dtype, scope="local")
    kept = T.alloc_buffer((PER_PART,), acc_dtype, scope="local")
    total[0] = T.Cast(acc_dtype, 0)
    for x in T.unroll(PER_PART):
        kept[x] = T.exp(scores[mine * S_STRIDE + part * PER_PART + x] - shift)
        total[0] = total[0] + kept[x]
    my_row: T.let = query_row[mine]
    if dropout > T.float64(0):
        # The same mask as the CPU's (band column j = chunk column - row), after
        # the sum. (Registers only in here: TVM cannot place a sync in a branch.)
        row_key: T.let = dropout_row_key(seed, bh, my_row, bind=True)
        for x in T.unroll(PER_PART):
            # (Columns off the band, where the probability is 0, clamped to 0.)
            kept[x] = kept[x] * dropout_factor(
                row_key,
                T.max(chunk * T.int64(QK_KEYS) + T.Cast("int64", part * PER_PART + x - mine), T.int64(0)),
                dropout,
                acc_dtype,
                bind=True,
            )
    for x in T.unroll(PER_PART):
        scores[mine * S_STRIDE + part * PER_PART + x] = kept[x]
    part_sum[tx] = total[0]
    T.tvm_storage_sync("shared")
    if part == 0:
        rescale[mine] = T.exp(old_max - shift)
        row_sum[mine] = row_sum[mine] * T.exp(old_max - shift) + (
            part_sum[tx] + part_sum[tx + 1] + part_sum[tx + 2] + part_sum[tx + 3]
        )
        row_max[mine] = new_max
    T.tvm_storage_sync("shared")


def attention_fma(dtype: str, autoregressive: bool):
    """Fused local attention forward on float32 FMAs; same arguments and results as the CPU's
    (:func:`tvm_kernels.schedules.cpu.attention`): ``out = softmax(scale * Q.K^T + key_bias on the
    band) . V`` (dropout after the softmax's sum), and each row's log-sum-exp, with no band in memory.

    Per tile of 64 packed queries, FlashAttention's online softmax over the qk kernel's chunks of
    64 packed keys: the chunk's scores (the qk micro-kernel) go to shared memory, masked to -inf
    outside each row's band; four threads per row update its running maximum and sum and turn the
    scores into probabilities; the 64 output features in registers are rescaled and accumulate
    probabilities times the chunk's values. A head_dim over 64 takes one such pass per 64 features.
    """
    acc_dtype = accumulation_dtype(dtype)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)

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
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    queries = T.alloc_buffer((QK_FEATURES * Q_STRIDE,), acc_dtype, scope="shared")  # [feature, row]
                    keys = T.alloc_buffer((QK_FEATURES * K_STRIDE,), acc_dtype, scope="shared")  # [feature, key]
                    scores = T.alloc_buffer((TILE_ROWS * S_STRIDE,), acc_dtype, scope="shared")  # [row, key]
                    values = T.alloc_buffer((QK_KEYS * OUT_FEATURES,), acc_dtype, scope="shared")  # [key, feature]
                    query_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                    valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    key_row = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                    row_max = T.alloc_buffer((TILE_ROWS,), acc_dtype, scope="shared")
                    row_sum = T.alloc_buffer((TILE_ROWS,), acc_dtype, scope="shared")
                    rescale = T.alloc_buffer((TILE_ROWS,), acc_dtype, scope="shared")
                    part_max = T.alloc_buffer((THREADS,), acc_dtype, scope="shared")
                    part_sum = T.alloc_buffer((THREADS,), acc_dtype, scope="shared")
                    acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                    context = T.alloc_buffer((4, 4), acc_dtype, scope="local")
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
                    ty: T.let = tx // SPAN
                    tc: T.let = tx % SPAN
                    _tile_rows(query_row, valid_from, valid_to, tx, p0, n, d, w, band)
                    for f0 in range((head_dim + T.int64(OUT_FEATURES - 1)) // T.int64(OUT_FEATURES)):
                        T.tvm_storage_sync("shared")
                        if tx < TILE_ROWS:
                            row_max[tx] = minus_inf
                            row_sum[tx] = T.Cast(acc_dtype, 0)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                context[i, u] = T.Cast(acc_dtype, 0)
                        for chunk in range(
                            (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                        ):
                            _chunk_rows(key_row, QK_KEYS, tx, p0 - w + chunk * T.int64(QK_KEYS), n, d)
                            _qk_chunk(acc, queries, keys, q, k, query_row, key_row, b, h, kv_h, head_dim, tx, acc_dtype)
                            if softcap > T.float64(0):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        acc[i, u] = T.Cast(acc_dtype, softcap) * _cap_tanh(
                                            acc[i, u], scale, softcap, acc_dtype
                                        )
                            for i in T.unroll(4):
                                for u in T.unroll(4):
                                    # Band column j of row a is chunk column a + j (see qk).
                                    a: T.let = ty * 4 + i
                                    j: T.let = chunk * T.int64(QK_KEYS) + T.Cast("int64", tc + u * SPAN - a)
                                    scores[a * S_STRIDE + tc + u * SPAN] = T.Select(
                                        j >= valid_from[a] and j < valid_to[a],
                                        acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                        + key_bias[b, T.max(key_row[tc + u * SPAN], T.int64(0))],
                                        minus_inf,
                                    )
                            for e in T.unroll(QK_KEYS * OUT_FEATURES // THREADS):
                                kk: T.let = (tx + e * THREADS) // OUT_FEATURES
                                f: T.let = (tx + e * THREADS) % OUT_FEATURES
                                values[kk * OUT_FEATURES + f] = T.Select(
                                    key_row[kk] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
                                    T.Cast(
                                        acc_dtype,
                                        v[
                                            b,
                                            T.max(key_row[kk], T.int64(0)),
                                            kv_h,
                                            T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1)),
                                        ],
                                    ),
                                    T.Cast(acc_dtype, 0),
                                )
                            T.tvm_storage_sync("shared")
                            _online_softmax(
                                scores,
                                row_max,
                                row_sum,
                                rescale,
                                part_max,
                                part_sum,
                                query_row,
                                tx,
                                chunk,
                                bh,
                                seed,
                                dropout,
                                acc_dtype,
                                minus_inf,
                            )
                            for i in T.unroll(4):
                                for u in T.unroll(4):
                                    context[i, u] = context[i, u] * rescale[ty * 4 + i]
                            for kk in T.unroll(QK_KEYS):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        context[i, u] = (
                                            context[i, u]
                                            + scores[(ty * 4 + i) * S_STRIDE + kk]
                                            * values[kk * OUT_FEATURES + tc + u * SPAN]
                                        )
                            T.tvm_storage_sync("shared")
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                f: T.let = f0 * T.int64(OUT_FEATURES) + T.Cast("int64", tc + u * SPAN)
                                row: T.let = query_row[a]
                                total_a: T.let = row_sum[a]  # 0: a row with no key (== 0, so that a NaN sum stays NaN)
                                if row >= T.int64(0) and f < head_dim:
                                    out[b, row, h, f] = T.Cast(
                                        dtype,
                                        T.Select(
                                            total_a == T.Cast(acc_dtype, 0),
                                            T.Cast(acc_dtype, 0),
                                            context[i, u] / total_a,
                                        ),
                                    )
                        if tx < TILE_ROWS:
                            row: T.let = query_row[tx]
                            if row >= T.int64(0):
                                lse[b, row, h] = T.Select(
                                    row_sum[tx] == T.Cast(acc_dtype, 0), minus_inf, row_max[tx] + T.log(row_sum[tx])
                                )

    return main


@T.macro
def _row_deltas(delta, row_lse, part_sum, rows_of, grad, out, lse, grad_lse, b, h, head_dim, tx, acc_dtype, minus_inf):
    """For the 64 packed rows ``rows_of`` (-1: none), four threads each: delta = rowsum(dO * O) less
    the log-sum-exp's gradient (the backward's dS = P * (dP - delta)), and the row's log-sum-exp
    (0 where it is -inf: a row with no key, whose P is then exp(-inf) = 0 at every column)."""
    mine: T.let = tx // ROW_PARTS
    part: T.let = tx % ROW_PARTS
    row = T.alloc_buffer((1,), "int64", scope="local")
    total = T.alloc_buffer((1,), acc_dtype, scope="local")
    row[0] = rows_of[mine]
    total[0] = T.Cast(acc_dtype, 0)
    for x in range(head_dim // T.int64(ROW_PARTS)):
        total[0] = total[0] + T.Select(
            row[0] >= T.int64(0),
            T.Cast(acc_dtype, grad[b, T.max(row[0], T.int64(0)), h, x * T.int64(ROW_PARTS) + T.Cast("int64", part)])
            * T.Cast(acc_dtype, out[b, T.max(row[0], T.int64(0)), h, x * T.int64(ROW_PARTS) + T.Cast("int64", part)]),
            T.Cast(acc_dtype, 0),
        )
    part_sum[tx] = total[0]
    T.tvm_storage_sync("shared")
    if part == 0:
        delta[mine] = (
            part_sum[tx]
            + part_sum[tx + 1]
            + part_sum[tx + 2]
            + part_sum[tx + 3]
            - T.Select(row[0] >= T.int64(0), grad_lse[b, T.max(row[0], T.int64(0)), h], T.Cast(acc_dtype, 0))
        )
        row_lse[mine] = T.Select(
            row[0] >= T.int64(0) and lse[b, T.max(row[0], T.int64(0)), h] != minus_inf,
            lse[b, T.max(row[0], T.int64(0)), h],
            T.Cast(acc_dtype, 0),
        )
    T.tvm_storage_sync("shared")


@T.macro
def _dropout_factors(factors, rows, seed, bh, first_column, column_step, row_step, rows_along_u, dropout, acc_dtype):
    """factors[i, u] = the dropout factor (0 or 1/(1-p)) at band column first_column + column_step * u
    + row_step * i (clamped to 0: off the band, where P is 0) of the sequence row rows[i] (rows[u]
    where ``rows_along_u``: the key-major kernel's queries), 1 without dropout. Registers only (a
    branch cannot hold a barrier)."""
    for i in T.unroll(4):
        for u in T.unroll(4):
            factors[i, u] = T.Cast(acc_dtype, 1)
    if dropout > T.float64(0):
        for i in T.unroll(4):
            for u in T.unroll(4):
                column: T.let = T.max(first_column + T.Cast("int64", column_step * u + row_step * i), T.int64(0))
                if rows_along_u:
                    factors[i, u] = dropout_factor(
                        dropout_row_key(seed, bh, rows[u], bind=True), column, dropout, acc_dtype, bind=True
                    )
                else:
                    factors[i, u] = dropout_factor(
                        dropout_row_key(seed, bh, rows[i], bind=True), column, dropout, acc_dtype, bind=True
                    )


@T.macro
def _stage_rows(rows, t, row_of, b, h, f0, head_dim, tx, acc_dtype):
    """rows[x, f] = t[row_of[x]] at features f0 * 64 + f (0 outside the sequence or past head_dim)."""
    for e in T.unroll(QK_KEYS * OUT_FEATURES // THREADS):
        x: T.let = (tx + e * THREADS) // OUT_FEATURES
        f: T.let = (tx + e * THREADS) % OUT_FEATURES
        rows[x * OUT_FEATURES + f] = T.Select(
            row_of[x] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
            T.Cast(
                acc_dtype,
                t[b, T.max(row_of[x], T.int64(0)), h, T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1))],
            ),
            T.Cast(acc_dtype, 0),
        )


@T.macro
def _accumulate_rows(acc, weights, rows, tx):
    """acc[i, u] += sum over x of weights[ty * 4 + i, x] * rows[x, tc + 16 u]: 64 x 64 weights
    ([row, x], S_STRIDE apart) times 64 staged rows of 64 features."""
    for x in T.unroll(QK_KEYS):
        for i in T.unroll(4):
            for u in T.unroll(4):
                acc[i, u] = (
                    acc[i, u]
                    + weights[(tx // SPAN * 4 + i) * S_STRIDE + x] * rows[x * OUT_FEATURES + tx % SPAN + u * SPAN]
                )


@T.macro
def _soft_cap_fma(acc, derivatives, scale, softcap, acc_dtype):
    """The FMA backward kernels' soft-cap of this thread's 4 x 4 scores: acc becomes the capped score
    (scaled: see :func:`_score_scale`), derivatives its derivative, which dS takes (1 without a
    cap: a multiply in a store loop that cannot sit in a branch, as it writes shared memory)."""
    for i in T.unroll(4):
        for u in T.unroll(4):
            acc[i, u] = _cap_tanh(acc[i, u], scale, softcap, acc_dtype)
            derivatives[i, u] = T.Cast(acc_dtype, 1) - acc[i, u] * acc[i, u]
            acc[i, u] = T.Cast(acc_dtype, softcap) * acc[i, u]


@T.macro
def _query_tile_grads_fma(
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
):
    """dQ, per query tile: the first kernel of :func:`attention_backward` on float32 FMAs."""
    for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
        for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                queries = T.alloc_buffer((QK_FEATURES * Q_STRIDE,), acc_dtype, scope="shared")  # [feature, row]
                keys = T.alloc_buffer((QK_FEATURES * K_STRIDE,), acc_dtype, scope="shared")  # [feature, key]
                scores = T.alloc_buffer((TILE_ROWS * S_STRIDE,), acc_dtype, scope="shared")  # [row, key]: P, then dS
                key_rows = T.alloc_buffer((QK_KEYS * OUT_FEATURES,), acc_dtype, scope="shared")  # [key, feature]
                query_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                key_row = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                row_lse = T.alloc_buffer((TILE_ROWS,), acc_dtype, scope="shared")
                delta = T.alloc_buffer((TILE_ROWS,), acc_dtype, scope="shared")
                part_sum = T.alloc_buffer((THREADS,), acc_dtype, scope="shared")
                acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                grad_acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                factors = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                derivatives = T.alloc_buffer((4, 4), acc_dtype, scope="local")  # of the soft-cap
                my_rows = T.alloc_buffer((4,), "int64", scope="local")
                ids = T.alloc_buffer((4,), "int64", scope="local")
                _block_ids(ids, bh, heads, dilation)
                _key_head(ids, heads, k.shape[2])
                b: T.let = ids[0]
                h: T.let = ids[1]
                d: T.let = ids[2]
                kv_h: T.let = ids[3]
                w: T.let = window
                band: T.let = T.int64(2 - causal) * window + T.int64(1)
                for i in T.unroll(4):
                    for u in T.unroll(4):
                        derivatives[i, u] = T.Cast(acc_dtype, 1)  # (no soft-cap: dS unchanged)
                p0: T.let = tile * T.int64(TILE_ROWS)
                ty: T.let = tx // SPAN
                tc: T.let = tx % SPAN
                _tile_rows(query_row, valid_from, valid_to, tx, p0, n, d, w, band)
                T.tvm_storage_sync("shared")
                _row_deltas(
                    delta,
                    row_lse,
                    part_sum,
                    query_row,
                    grad,
                    out,
                    lse,
                    grad_lse,
                    b,
                    h,
                    head_dim,
                    tx,
                    acc_dtype,
                    minus_inf,
                )
                for i in T.unroll(4):
                    my_rows[i] = query_row[ty * 4 + i]
                for f0 in range((head_dim + T.int64(OUT_FEATURES - 1)) // T.int64(OUT_FEATURES)):
                    for i in T.unroll(4):
                        for u in T.unroll(4):
                            grad_acc[i, u] = T.Cast(acc_dtype, 0)
                    for chunk in range(
                        (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                    ):
                        _chunk_rows(key_row, QK_KEYS, tx, p0 - w + chunk * T.int64(QK_KEYS), n, d)
                        _qk_chunk(acc, queries, keys, q, k, query_row, key_row, b, h, kv_h, head_dim, tx, acc_dtype)
                        if softcap > T.float64(0):
                            _soft_cap_fma(acc, derivatives, scale, softcap, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                # Band column j of row a is chunk column a + j (see qk).
                                a: T.let = ty * 4 + i
                                j: T.let = chunk * T.int64(QK_KEYS) + T.Cast("int64", tc + u * SPAN - a)
                                scores[a * S_STRIDE + tc + u * SPAN] = T.Select(
                                    j >= valid_from[a] and j < valid_to[a],
                                    T.exp(
                                        acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                        + key_bias[b, T.max(key_row[tc + u * SPAN], T.int64(0))]
                                        - row_lse[a]
                                    ),
                                    T.Cast(acc_dtype, 0),
                                )
                        _qk_chunk(acc, queries, keys, grad, v, query_row, key_row, b, h, kv_h, head_dim, tx, acc_dtype)
                        _dropout_factors(
                            factors,
                            my_rows,
                            seed,
                            bh,
                            chunk * T.int64(QK_KEYS) + T.Cast("int64", tc - ty * 4),
                            SPAN,
                            -1,
                            False,
                            dropout,
                            acc_dtype,
                        )
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                scores[a * S_STRIDE + tc + u * SPAN] = (
                                    scores[a * S_STRIDE + tc + u * SPAN]
                                    * (acc[i, u] * factors[i, u] - delta[a])
                                    * derivatives[i, u]
                                )
                        _stage_rows(key_rows, k, key_row, b, kv_h, f0, head_dim, tx, acc_dtype)
                        T.tvm_storage_sync("shared")
                        _accumulate_rows(grad_acc, scores, key_rows, tx)
                        T.tvm_storage_sync("shared")
                    for i in T.unroll(4):
                        for u in T.unroll(4):
                            f: T.let = f0 * T.int64(OUT_FEATURES) + T.Cast("int64", tc + u * SPAN)
                            if my_rows[i] >= T.int64(0) and f < head_dim:
                                grad_q[b, my_rows[i], h, f] = T.Cast(dtype, grad_acc[i, u] * T.Cast(acc_dtype, scale))


@T.macro
def _key_tile_grads_fma(
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
):
    """dK and dV, per key tile: the second kernel of :func:`attention_backward` (float32 FMAs)."""
    for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
        for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                keys_t = T.alloc_buffer((QK_FEATURES * Q_STRIDE,), acc_dtype, scope="shared")  # [feature, key]
                queries_t = T.alloc_buffer((QK_FEATURES * K_STRIDE,), acc_dtype, scope="shared")  # [feature, query]
                # [key, query]: P * Z, then dS
                weights = T.alloc_buffer((TILE_ROWS * S_STRIDE,), acc_dtype, scope="shared")
                # [query, feature]: dO, then Q
                query_rows = T.alloc_buffer((QK_KEYS * OUT_FEATURES,), acc_dtype, scope="shared")
                key_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                query_row = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                valid_from = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # the queries' valid band columns
                valid_to = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")
                row_lse = T.alloc_buffer((QK_KEYS,), acc_dtype, scope="shared")
                delta = T.alloc_buffer((QK_KEYS,), acc_dtype, scope="shared")
                part_sum = T.alloc_buffer((THREADS,), acc_dtype, scope="shared")
                acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                probs = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                grad_k_acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                grad_v_acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                factors = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                derivatives = T.alloc_buffer((4, 4), acc_dtype, scope="local")  # of the soft-cap
                their_rows = T.alloc_buffer((4,), "int64", scope="local")
                ids = T.alloc_buffer((4,), "int64", scope="local")
                _block_ids(ids, bh, heads, dilation)
                _key_head(ids, heads, k.shape[2])
                b: T.let = ids[0]
                h: T.let = ids[1]
                d: T.let = ids[2]
                kv_h: T.let = ids[3]
                w: T.let = window
                band: T.let = T.int64(2 - causal) * window + T.int64(1)
                for i in T.unroll(4):
                    for u in T.unroll(4):
                        derivatives[i, u] = T.Cast(acc_dtype, 1)  # (no soft-cap: dS unchanged)
                p0: T.let = tile * T.int64(TILE_ROWS)
                ty: T.let = tx // SPAN
                tc: T.let = tx % SPAN
                _chunk_rows(key_row, TILE_ROWS, tx, p0, n, d)
                for f0 in range((head_dim + T.int64(OUT_FEATURES - 1)) // T.int64(OUT_FEATURES)):
                    for i in T.unroll(4):
                        for u in T.unroll(4):
                            grad_k_acc[i, u] = T.Cast(acc_dtype, 0)
                            grad_v_acc[i, u] = T.Cast(acc_dtype, 0)
                    for chunk in range(
                        (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                    ):
                        # Chunk queries x: packed p0 - w_upper + 64 chunk + x, whose band column for
                        # tile key kk is kk - x + band - 1 - 64 chunk.
                        T.tvm_storage_sync("shared")
                        _tile_rows(
                            query_row,
                            valid_from,
                            valid_to,
                            tx,
                            p0 - (band - T.int64(1) - w) + chunk * T.int64(QK_KEYS),
                            n,
                            d,
                            w,
                            band,
                        )
                        T.tvm_storage_sync("shared")
                        _row_deltas(
                            delta,
                            row_lse,
                            part_sum,
                            query_row,
                            grad,
                            out,
                            lse,
                            grad_lse,
                            b,
                            h,
                            head_dim,
                            tx,
                            acc_dtype,
                            minus_inf,
                        )
                        for u in T.unroll(4):
                            their_rows[u] = query_row[tc + u * SPAN]
                        _qk_chunk(acc, keys_t, queries_t, k, q, key_row, query_row, b, kv_h, h, head_dim, tx, acc_dtype)
                        if softcap > T.float64(0):
                            _soft_cap_fma(acc, derivatives, scale, softcap, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                x: T.let = tc + u * SPAN
                                j: T.let = (
                                    T.Cast("int64", ty * 4 + i - x) + band - T.int64(1) - chunk * T.int64(QK_KEYS)
                                )
                                probs[i, u] = T.Select(
                                    query_row[x] >= T.int64(0)
                                    and key_row[ty * 4 + i] >= T.int64(0)
                                    and j >= valid_from[x]
                                    and j < valid_to[x],
                                    T.exp(
                                        acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                        + key_bias[b, T.max(key_row[ty * 4 + i], T.int64(0))]
                                        - row_lse[x]
                                    ),
                                    T.Cast(acc_dtype, 0),
                                )
                        _qk_chunk(
                            acc, keys_t, queries_t, v, grad, key_row, query_row, b, kv_h, h, head_dim, tx, acc_dtype
                        )
                        _dropout_factors(
                            factors,
                            their_rows,
                            seed,
                            bh,
                            T.Cast("int64", ty * 4 - tc) + band - T.int64(1) - chunk * T.int64(QK_KEYS),
                            -SPAN,
                            1,
                            True,
                            dropout,
                            acc_dtype,
                        )
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                weights[(ty * 4 + i) * S_STRIDE + tc + u * SPAN] = probs[i, u] * factors[i, u]
                        _stage_rows(query_rows, grad, query_row, b, h, f0, head_dim, tx, acc_dtype)
                        T.tvm_storage_sync("shared")
                        _accumulate_rows(grad_v_acc, weights, query_rows, tx)
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                weights[(ty * 4 + i) * S_STRIDE + tc + u * SPAN] = (
                                    probs[i, u] * (acc[i, u] * factors[i, u] - delta[tc + u * SPAN]) * derivatives[i, u]
                                )
                        _stage_rows(query_rows, q, query_row, b, h, f0, head_dim, tx, acc_dtype)
                        T.tvm_storage_sync("shared")
                        _accumulate_rows(grad_k_acc, weights, query_rows, tx)
                    for i in T.unroll(4):
                        for u in T.unroll(4):
                            row: T.let = key_row[ty * 4 + i]
                            f: T.let = f0 * T.int64(OUT_FEATURES) + T.Cast("int64", tc + u * SPAN)
                            if row >= T.int64(0) and f < head_dim:
                                grad_k[b, row, h, f] = T.Cast(dtype, grad_k_acc[i, u] * T.Cast(acc_dtype, scale))
                                grad_v[b, row, h, f] = T.Cast(dtype, grad_v_acc[i, u])
