"""The three banded products on CUDA: qk (dense 64 x 64 chunks of Q.K^T, their in-band entries
stored into the band) and pv / transposed (per chunk of ``INNER`` packed rows, the band weights
gathered into shared memory and multiplied with those rows), one thread block per tile of
``TILE_ROWS`` packed rows, each thread a 4 x 4 register tile (the package's docstring).
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype
from tvm_kernels.schedules.cuda.common import (
    F_STRIDE,
    INNER,
    K_STRIDE,
    OUT_FEATURES,
    Q_STRIDE,
    QK_FEATURES,
    QK_KEYS,
    SPAN,
    THREADS,
    TILE_ROWS,
    _block_ids,
    _chunk_rows,
    _qk_chunk,
    _tile_rows,
    _windows,
)


def qk(dtype: str, autoregressive: bool, isa: str = ""):
    """The Q.K^T PrimFunc; same arguments as :func:`tvm_kernels.compute.qk`."""
    acc_dtype = accumulation_dtype(dtype)

    @T.prim_func
    def main(
        t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, padding: T.float64, out_handle: T.handle
    ):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, head_dim), dtype)
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, band), dtype)
        for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
            for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    queries = T.alloc_buffer((QK_FEATURES * Q_STRIDE,), acc_dtype, scope="shared")  # [feature, row]
                    keys = T.alloc_buffer((QK_FEATURES * K_STRIDE,), acc_dtype, scope="shared")  # [feature, key]
                    query_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                    valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    key_row = T.alloc_buffer((QK_KEYS,), "int64", scope="shared")  # -1 outside the sequence
                    acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                    ids = T.alloc_buffer((3,), "int64", scope="local")
                    _block_ids(ids, bh, heads, dilation)
                    b: T.let = ids[0]
                    h: T.let = ids[1]
                    d: T.let = ids[2]
                    w: T.let = _windows(band, autoregressive)[0]
                    p0: T.let = tile * T.int64(TILE_ROWS)
                    ty: T.let = tx // SPAN
                    tc: T.let = tx % SPAN
                    _tile_rows(query_row, valid_from, valid_to, tx, p0, n, d, w, band)
                    T.tvm_storage_sync("shared")
                    # Chunk k covers packed keys p0 - w + 64k + [0, 64): band column j of tile row a
                    # is packed key p0 + a + j - w, i.e. chunk column 64k + kk = a + j.
                    for chunk in range(
                        (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
                    ):
                        _chunk_rows(key_row, QK_KEYS, tx, p0 - w + chunk * T.int64(QK_KEYS), n, d)
                        _qk_chunk(acc, queries, keys, t1, t2, query_row, key_row, b, h, h, head_dim, tx, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                j: T.let = chunk * T.int64(QK_KEYS) + T.Cast("int64", tc + u * SPAN - a)
                                # (Shared memory may not be read in an if's condition: TVM's ThreadSync.)
                                row: T.let = query_row[a]
                                if row >= T.int64(0) and j >= T.int64(0) and j < band:
                                    out[b, row, h, j] = T.Select(
                                        j >= valid_from[a] and j < valid_to[a],
                                        T.Cast(dtype, acc[i, u]),
                                        T.Cast(dtype, padding),
                                    )

    return main


def _weight_row(e, transposed: bool):
    """The tile row whose weight thread-element ``e`` stages: consecutive threads read consecutive
    band columns (probs.V: along the inner rows of one band row; transposed: along the tile rows)."""
    return e % TILE_ROWS if transposed else e // INNER


def _weight_inner(e, transposed: bool):
    return e // TILE_ROWS if transposed else e % INNER


def _band_times_rows(dtype: str, autoregressive: bool, transposed: bool):
    acc_dtype = accumulation_dtype(dtype)
    side = 1 if transposed else 0  # the inner rows start w_upper (transposed) or w (probs.V) before the tile

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True})
        batch = T.int64()
        n = T.int64()
        heads = T.int64()
        head_dim = T.int64()
        band = T.int64()
        t1 = T.match_buffer(t1_handle, (batch, n, heads, band), dtype)
        t2 = T.match_buffer(t2_handle, (batch, n, heads, head_dim), dtype)
        dilation = T.match_buffer(dilation_handle, (heads,), "int32")
        out = T.match_buffer(out_handle, (batch, n, heads, head_dim), dtype)
        for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
            for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    weights = T.alloc_buffer((INNER * Q_STRIDE,), acc_dtype, scope="shared")  # [inner row, tile row]
                    rows = T.alloc_buffer((INNER * F_STRIDE,), acc_dtype, scope="shared")  # [inner row, feature]
                    out_row = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")  # -1 past the end
                    valid_from = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    valid_to = T.alloc_buffer((TILE_ROWS,), "int64", scope="shared")
                    inner_row = T.alloc_buffer((INNER,), "int64", scope="shared")  # -1 outside the sequence
                    acc = T.alloc_buffer((4, 4), acc_dtype, scope="local")
                    ids = T.alloc_buffer((3,), "int64", scope="local")
                    _block_ids(ids, bh, heads, dilation)
                    b: T.let = ids[0]
                    h: T.let = ids[1]
                    d: T.let = ids[2]
                    p0: T.let = tile * T.int64(TILE_ROWS)
                    # The tile's inner packed rows: x = 0, 1, ... is packed row p0 - before + x.
                    # probs.V: keys of tile row a at band column j = x - a. Transposed: output
                    # row a (a key) receives from query x at that query's band column w + w_upper + a - x.
                    before: T.let = _windows(band, autoregressive)[side]
                    ty: T.let = tx // SPAN
                    tc: T.let = tx % SPAN
                    _tile_rows(out_row, valid_from, valid_to, tx, p0, n, d, before, band)
                    T.tvm_storage_sync("shared")
                    for f0 in range((head_dim + T.int64(OUT_FEATURES - 1)) // T.int64(OUT_FEATURES)):
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                acc[i, u] = T.Cast(acc_dtype, 0)
                        for chunk in range(
                            (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(INNER - 1)) // T.int64(INNER)
                        ):
                            x0: T.let = chunk * T.int64(INNER)
                            _chunk_rows(inner_row, INNER, tx, p0 - before + x0, n, d)
                            T.tvm_storage_sync("shared")
                            for v in T.unroll(INNER * TILE_ROWS // THREADS):
                                # Weights, inner-major, zero where invalid.
                                e: T.let = tx + v * THREADS
                                a: T.let = _weight_row(e, transposed)
                                x: T.let = _weight_inner(e, transposed)
                                offset: T.let = x0 + x - a  # the band-column distance: valid in [valid_from, valid_to)
                                ok: T.let = (
                                    out_row[a] >= T.int64(0) and offset >= valid_from[a] and offset < valid_to[a]
                                )
                                if transposed:
                                    weights[x * Q_STRIDE + a] = T.Select(
                                        ok and inner_row[x] >= T.int64(0),
                                        T.Cast(
                                            acc_dtype,
                                            t1[
                                                b,
                                                T.max(inner_row[x], T.int64(0)),
                                                h,
                                                T.max(T.min(band - T.int64(1) - offset, band - T.int64(1)), T.int64(0)),
                                            ],
                                        ),
                                        T.Cast(acc_dtype, 0),
                                    )
                                else:
                                    weights[x * Q_STRIDE + a] = T.Select(
                                        ok,
                                        T.Cast(
                                            acc_dtype,
                                            t1[
                                                b,
                                                T.max(out_row[a], T.int64(0)),
                                                h,
                                                T.max(T.min(offset, band - T.int64(1)), T.int64(0)),
                                            ],
                                        ),
                                        T.Cast(acc_dtype, 0),
                                    )
                            for v in T.unroll(INNER * OUT_FEATURES // THREADS):
                                x: T.let = (tx + v * THREADS) // OUT_FEATURES
                                f: T.let = (tx + v * THREADS) % OUT_FEATURES
                                rows[x * F_STRIDE + f] = T.Select(
                                    inner_row[x] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
                                    T.Cast(
                                        acc_dtype,
                                        t2[
                                            b,
                                            T.max(inner_row[x], T.int64(0)),
                                            h,
                                            T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1)),
                                        ],
                                    ),
                                    T.Cast(acc_dtype, 0),
                                )
                            T.tvm_storage_sync("shared")
                            for x in T.unroll(INNER):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        acc[i, u] = (
                                            acc[i, u]
                                            + weights[x * Q_STRIDE + ty * 4 + i] * rows[x * F_STRIDE + tc + u * SPAN]
                                        )
                            T.tvm_storage_sync("shared")
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                f: T.let = f0 * T.int64(OUT_FEATURES) + T.Cast("int64", tc + u * SPAN)
                                row: T.let = out_row[a]
                                if row >= T.int64(0) and f < head_dim:
                                    out[b, row, h, f] = T.Cast(dtype, acc[i, u])

    return main


def pv(dtype: str, autoregressive: bool, isa: str = ""):
    """The probs.V PrimFunc; same arguments as :func:`tvm_kernels.compute.pv`."""
    return _band_times_rows(dtype, autoregressive, transposed=False)


def transposed(dtype: str, autoregressive: bool, isa: str = ""):
    """The transposed (backward) PrimFunc; same arguments as :func:`tvm_kernels.compute.transposed`."""
    return _band_times_rows(dtype, autoregressive, transposed=True)
