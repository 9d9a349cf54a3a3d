"""What the CUDA kernels share: tile sizes and shared-memory strides (``FEATURE_MULTIPLE``, the
runtime's contract on head_dim, among them), packed positions (:func:`_packed_row`), each block's
ids and its tile's row tables, the logit soft-cap (:func:`_cap_tanh`), and the float32 micro-kernel
of a 64 x 64 chunk of Q.K^T (:func:`_qk_chunk`) that qk and the FMA attention kernels run.
"""

from __future__ import annotations

from tvm.script import tirx as T

# head_dim's multiple (the runtime zero-pads to it): qk stages features 16 at a time, unguarded, and
# the tensor-core kernels' deltas sum 16 features per pair of threads (_dot8), their staging 8.
FEATURE_MULTIPLE = 16
THREADS = 256
TILE_ROWS = 64  # packed rows per thread block
QK_KEYS = 64  # qk: keys per chunk
QK_FEATURES = 16  # qk: features per shared-memory stage
INNER = 32  # pv / transposed: packed rows per chunk
OUT_FEATURES = 64  # pv / transposed: output features per pass over the chunks
# Shared-memory row strides, 4 floats past the row: the staging stores spread over more banks,
# and rows keep the 16-byte alignment of the compute loop's 4-float reads.
Q_STRIDE = TILE_ROWS + 4
K_STRIDE = QK_KEYS + 4
F_STRIDE = OUT_FEATURES + 4
S_STRIDE = QK_KEYS + 4  # attention: the chunk's scores, [row, key]
SPAN = 16  # threads along each axis of a 64 x 64 sub-product: 16 x 16 threads of 4 x 4 results
ROW_PARTS = THREADS // TILE_ROWS  # threads per tile row in the row-wise passes (softmax, deltas): 4
PER_PART = QK_KEYS // ROW_PARTS  # the softmax's columns of a chunk per thread


def _packed_row(p, n, d):
    """(sequence row, index in its residue class, class size) of packed position ``p`` in
    ``[0, n)`` for dilation ``d`` >= 1, as int64 (a plain Python helper building the expressions).
    The divisions run in int32 (a sequence is shorter than 2^31 rows; a GPU divides int64 in
    software, several times slower), so they cost the staging little."""
    p, n, d = (T.Cast("int32", x) for x in (p, n, d))
    per_class = n // d
    big_classes = n % d  # classes 0 .. n % d - 1 hold one row more
    in_big = p < big_classes * (per_class + 1)
    rest = p - big_classes * (per_class + 1)
    small = T.max(per_class, 1)  # no division by zero where every class is big
    r = T.Select(in_big, p // (per_class + 1), big_classes + rest // small)
    s = T.Select(in_big, p % (per_class + 1), rest % small)
    m = T.Select(in_big, per_class + 1, per_class)
    return T.Cast("int64", r + d * s), T.Cast("int64", s), T.Cast("int64", m)


def _windows(band, autoregressive: bool):
    """(w, w_upper) of a band of width ``band`` (see :mod:`tvm_kernels.compute`)."""
    if autoregressive:
        return band - T.int64(1), T.int64(0)
    return (band - T.int64(1)) // T.int64(2), (band - T.int64(1)) // T.int64(2)


@T.macro
def _block_ids(ids, bh, heads, dilation):
    """ids = (batch, head, the head's dilation) of block row ``bh``, once per thread into registers.
    Let-bound instead, TVM substitutes their expressions into every index that uses them, and the
    staging loops then divided bh by heads in int64 (software on a GPU) for every element."""
    ids[0] = bh // heads
    ids[1] = bh % heads
    ids[2] = T.Cast("int64", dilation[bh % heads])


@T.macro
def _key_head(ids, heads, kv_heads):
    """ids[3] = the key/value head of block row's query head ids[1] (grouped heads: kv_heads divides
    heads, each key/value head serving heads // kv_heads consecutive query heads, as transformers'
    repeat_kv), once per thread (int64 divisions are software on a GPU)."""
    ids[3] = ids[1] // (heads // kv_heads)


def _cap_tanh(acc, scale, softcap, acc_dtype):
    """tanh(score / softcap) of the scaled score ``acc * scale``: Gemma 2's logit soft-cap makes the
    score ``softcap`` times it (before the key's bias: a padding key's -inf stays -inf), and a
    backward's dS takes its derivative, 1 - tanh^2. The kernels branch on ``softcap > 0`` (0: none)
    outside their score loops, so the uncapped code is as before (but for one multiply per score in
    the FMA backward, :func:`_soft_cap_fma`)."""
    return T.tanh(acc * T.Cast(acc_dtype, scale / softcap))


def _score_scale(scale, softcap, acc_dtype):
    """What the kernels multiply a chunk's accumulators by for its scores: ``scale``, or 1 where the
    soft-cap (applied to them first, :func:`_cap_tanh`) has scaled them."""
    return T.Cast(acc_dtype, T.Select(softcap > T.float64(0), T.float64(1), scale))


@T.macro
def _tile_rows(row_of, valid_from, valid_to, tx, p0, n, d, before, band, base=0):
    """Tile row tx (packed p0 + tx), at ``base + tx`` of each table: its sequence row (-1 outside
    the sequence) and the band-column distances x - tx with a valid partner, [valid_from,
    valid_to): the other row's class index index + x - tx - before must lie in [0, size), the band
    column in [0, band)."""
    if tx < TILE_ROWS:
        row_of[base + tx] = T.int64(-1)
        if p0 + tx >= T.int64(0) and p0 + tx < n:
            row, index, size = _packed_row(p0 + tx, n, d)
            row_of[base + tx] = row
            valid_from[base + tx] = T.max(before - index, T.int64(0))
            valid_to[base + tx] = T.min(before + size - index, band)


@T.macro
def _chunk_rows(row_of, count, tx, first, n, d, base=0):
    """row_of[base + x] = the sequence row of packed position first + x, -1 outside the sequence
    (x < count)."""
    if tx < count:
        row_of[base + tx] = T.int64(-1)
        if first + tx >= T.int64(0) and first + tx < n:
            row_of[base + tx] = _packed_row(first + tx, n, d)[0]


@T.macro
def _qk_chunk(acc, queries, keys, t1, t2, query_row, key_row, b, h1, h2, head_dim, tx, acc_dtype):
    """acc = the 4 x 4 results of this thread in the tile's queries . the chunk's keys^T, the
    features staged 16 at a time (feature-major; rows and keys of -1 give 0); t1 read at head h1, t2
    at head h2 (grouped key/value heads: another)."""
    for i in T.unroll(4):
        for u in T.unroll(4):
            acc[i, u] = T.Cast(acc_dtype, 0)
    T.tvm_storage_sync("shared")
    for g in range(head_dim // T.int64(QK_FEATURES)):
        for e in T.unroll(TILE_ROWS * QK_FEATURES // THREADS):
            a: T.let = (tx + e * THREADS) // QK_FEATURES
            f: T.let = (tx + e * THREADS) % QK_FEATURES
            queries[f * Q_STRIDE + a] = T.Select(
                query_row[a] >= T.int64(0),
                T.Cast(acc_dtype, t1[b, T.max(query_row[a], T.int64(0)), h1, g * T.int64(QK_FEATURES) + f]),
                T.Cast(acc_dtype, 0),
            )
        for e in T.unroll(QK_KEYS * QK_FEATURES // THREADS):
            kk: T.let = (tx + e * THREADS) // QK_FEATURES
            f: T.let = (tx + e * THREADS) % QK_FEATURES
            keys[f * K_STRIDE + kk] = T.Select(
                key_row[kk] >= T.int64(0),
                T.Cast(acc_dtype, t2[b, T.max(key_row[kk], T.int64(0)), h2, g * T.int64(QK_FEATURES) + f]),
                T.Cast(acc_dtype, 0),
            )
        T.tvm_storage_sync("shared")
        for f in T.unroll(QK_FEATURES):
            for i in T.unroll(4):
                for u in T.unroll(4):
                    acc[i, u] = (
                        acc[i, u]
                        + queries[f * Q_STRIDE + tx // SPAN * 4 + i] * keys[f * K_STRIDE + tx % SPAN + u * SPAN]
                    )
        T.tvm_storage_sync("shared")
