"""CUDA kernels: the three banded products and the fused local-attention forward as
shared-memory tiles with register blocking, hand-written in TIR (TVMScript), for any dilation.

Why hand-written (as on the CPU, ``schedules/cpu``): the reuse that makes a product fast
comes from tiles of queries that share their keys, and with a per-head runtime dilation
only *residue-major* order has that: with rows r, r+d, r+2d, ... of each residue class
r = 0..d-1 laid end to end ("packed" positions), every query's band is a run of
consecutive packed rows, for any dilation. Schedule primitives cannot express that order
(the region a dilated tile reads has a size that depends on d), and the first, scheduled
kernels (one thread per output element) ran at ~1% of an H100's float32 GEMM
(bench/NOTES.md).

One thread block computes a tile of ``TILE_ROWS`` consecutive packed rows, 256 threads,
each a 4 x 4 register tile (rows x columns of the block's 64 x 64 sub-product):

- qk: the tile's queries against the ``TILE_ROWS + c - 1`` packed keys their bands span,
  in chunks of 64 keys; per chunk a dense 64 x 64 product over the features (16 at a time
  through shared memory), whose entries inside a query's band are stored into its band
  row (``padding`` where the key lies outside the query's residue class or the sequence).
  The dense chunks do ``(64 + c - 1) / c`` times the useful work (1.12x at w = 256).
- pv / transposed: per chunk of 32 packed rows, the band weights of the tile's rows for
  them are gathered into shared memory (zero where invalid) and multiplied with those
  rows' features; the output features stay in registers across all chunks.
- attention: qk's chunks with FlashAttention's online softmax between them (:func:`attention`),
  for the half types on tensor cores (``mma.sync``) in FlashAttention-2's layout, 128 threads of
  16 query rows each, the softmax in registers, the next chunk's keys and values loading
  (``cp.async``) while a chunk computes (:func:`attention_mma`);
  attention_backward: dQ per query tile, dK and dV per key tile, two kernels that recompute the
  scores from the log-sum-exp, both on tensor cores for the half types, the dK/dV kernel's queries
  and dO double buffered as the forward's keys and values (:func:`attention_backward`).
  As the CPU's, the fused kernels read grouped key/value heads as they lie (k and v with kv_heads
  dividing the heads; dK and dV per query head, summed by the op) and take a logit soft-cap (a
  runtime argument after the scale, 0: none; :func:`_cap_tanh`).

Packed position p of a head with dilation d belongs to class r at index s of that class;
classes r < n % d hold n // d + 1 rows, the rest n // d (:func:`_packed_row`). A band
column of packed query p (index s, class size m) is valid when its key's class index
s + j - w lies in [0, m).

Every sum runs in float32; inputs are converted when they are staged, except in the tensor-core
kernels, which stage them in their own dtype, 16 bytes per load (so their data must be 16-byte
aligned: the runtime copies any that is not), and round the probabilities and dS to it where
they are an operand. ``head_dim`` must be a multiple of ``FEATURE_MULTIPLE`` (the runtime
zero-pads), feature blocks past it are guarded.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call  # a CUDA device function's source, called from TIR
from tvm.script import tirx as T

from tvm_kernels.compute import accumulation_dtype, dropout_factor, dropout_row_key, is_half

# head_dim's multiple (the runtime zero-pads to it): qk stages features 16 at a time, unguarded, and
# the tensor-core kernels' deltas sum 16 features per pair of threads (_dot8), their staging 8.
FEATURE_MULTIPLE = 16
THREADS = 256
TILE_ROWS = 64      # packed rows per thread block
QK_KEYS = 64        # qk: keys per chunk
QK_FEATURES = 16    # qk: features per shared-memory stage
INNER = 32          # pv / transposed: packed rows per chunk
OUT_FEATURES = 64   # pv / transposed: output features per pass over the chunks
# Shared-memory row strides, 4 floats past the row: the staging stores spread over more banks,
# and rows keep the 16-byte alignment of the compute loop's 4-float reads.
Q_STRIDE = TILE_ROWS + 4
K_STRIDE = QK_KEYS + 4
F_STRIDE = OUT_FEATURES + 4
S_STRIDE = QK_KEYS + 4  # attention: the chunk's scores, [row, key]
SPAN = 16  # threads along each axis of a 64 x 64 sub-product: 16 x 16 threads of 4 x 4 results
ROW_PARTS = THREADS // TILE_ROWS  # threads per tile row in the row-wise passes (softmax, deltas): 4
PER_PART = QK_KEYS // ROW_PARTS  # the softmax's columns of a chunk per thread
LOG2E = 1.4426950408889634  # the tensor-core kernels' base-2 softmax (EXP2_SOURCE)
LN2 = 0.6931471805599453


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
def _chunk_key_bias(bias, key_bias, key_row, b, tx, base=0):
    """bias[base + x] = the key bias at chunk key x's sequence row, times log2(e) for the
    tensor-core kernels' base-2 softmax (x < QK_KEYS; any value for keys outside the sequence, whose
    scores the band masks), by the thread that wrote the row: read once a chunk from global memory,
    not once per score (a 64-bit address and a load the score waits on)."""
    if tx < QK_KEYS:
        bias[base + tx] = key_bias[b, T.max(key_row[base + tx], T.int64(0))] * T.float32(LOG2E)


@T.macro
def _chunk_column_bounds(bounds, valid_from, valid_to, row0, chunk, t2):
    """The band mask of this thread's two rows (row0 + 8 r, an mma accumulator's rows) in this chunk,
    as columns: chunk column t2 + c (c: an accumulator element's column less t2, a constant) is in
    row r's band iff bounds[2 r] <= c < bounds[2 r + 1] (band column j of row a is chunk column
    a + j - 64 chunk, see qk; clamped to [0, 64], so int32). Computed once a chunk, the per-score
    test is two compares of registers with constants, where the band's own 64-bit table lookups
    took ~22 instructions and a branch per score (bench/NOTES.md, fifth GPU run)."""
    for r in T.unroll(2):
        shift: T.let = T.Cast("int64", row0 + r * 8 - t2) - chunk * T.int64(QK_KEYS)
        bounds[2 * r] = T.Cast("int32", T.min(T.max(valid_from[row0 + r * 8] + shift, T.int64(0)), T.int64(QK_KEYS)))
        bounds[2 * r + 1] = T.Cast("int32", T.min(T.max(valid_to[row0 + r * 8] + shift, T.int64(0)), T.int64(QK_KEYS)))


@T.macro
def _query_key_spans(spans, query_row, valid_from, valid_to, tx, chunk, band, base=0):
    """For chunk query x (``base + x`` of the tables, as :func:`_tile_rows` wrote them, by the same
    thread) of the key-major kernel: the tile keys in its band, [spans[2 i], spans[2 i + 1]) with
    i = base + x (tile key a's band column for the chunk's query x is a - x + band - 1 - 64 chunk;
    clamped to [0, 64], so int32; empty for no query). The per-score test is then two compares of
    int32s, as :func:`_chunk_column_bounds` in the query-major kernels."""
    if tx < QK_KEYS:
        shift: T.let = T.Cast("int64", tx) - band + T.int64(1) + chunk * T.int64(QK_KEYS)
        has_row: T.let = query_row[base + tx] >= T.int64(0)
        spans[(base + tx) * T.int64(2)] = T.Select(has_row, T.Cast("int32", T.min(T.max(
            valid_from[base + tx] + shift, T.int64(0)), T.int64(QK_KEYS))), T.int32(QK_KEYS))
        spans[(base + tx) * T.int64(2) + T.int64(1)] = T.Select(has_row, T.Cast("int32", T.min(T.max(
            valid_to[base + tx] + shift, T.int64(0)), T.int64(QK_KEYS))), T.int32(0))


def _in_bounds(bounds, x):
    """Whether accumulator element x lies in its row's band (:func:`_chunk_column_bounds`)."""
    c = x // 4 * 8 + _c_element(x % 4)[1]
    r = x % 4 // 2
    return tirx.all(T.int32(c) >= bounds[2 * r], T.int32(c) < bounds[2 * r + 1])


def _whole_chunk_in_band(bounds):
    """Whether every accumulator element of this thread lies in its row's band (columns c of 0 ..
    57, :func:`_in_bounds`): then the chunk's scores need no mask. At w = 256 that is 7 of a tile's
    9 chunks (all but the first and the last, inside the sequence), and the mask was ~3 of the ~5
    instructions a score left after :func:`_chunk_column_bounds`."""
    last = (QK_KEYS // 8 - 1) * 8 + 1
    return tirx.all(bounds[0] == 0, bounds[1] > last, bounds[2] == 0, bounds[3] > last)


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
                T.Cast(acc_dtype, 0))
        for e in T.unroll(QK_KEYS * QK_FEATURES // THREADS):
            kk: T.let = (tx + e * THREADS) // QK_FEATURES
            f: T.let = (tx + e * THREADS) % QK_FEATURES
            keys[f * K_STRIDE + kk] = T.Select(
                key_row[kk] >= T.int64(0),
                T.Cast(acc_dtype, t2[b, T.max(key_row[kk], T.int64(0)), h2, g * T.int64(QK_FEATURES) + f]),
                T.Cast(acc_dtype, 0))
        T.tvm_storage_sync("shared")
        for f in T.unroll(QK_FEATURES):
            for i in T.unroll(4):
                for u in T.unroll(4):
                    acc[i, u] = acc[i, u] + queries[f * Q_STRIDE + tx // SPAN * 4 + i] * keys[f * K_STRIDE + tx % SPAN + u * SPAN]
        T.tvm_storage_sync("shared")


def qk(dtype: str, autoregressive: bool, isa: str = ""):
    """The Q.K^T PrimFunc; same arguments as :func:`tvm_kernels.compute.qk`."""
    acc_dtype = accumulation_dtype(dtype)

    @T.prim_func
    def main(t1_handle: T.handle, t2_handle: T.handle, dilation_handle: T.handle, padding: T.float64,
             out_handle: T.handle):
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
                    for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)):
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
                                        j >= valid_from[a] and j < valid_to[a], T.Cast(dtype, acc[i, u]),
                                        T.Cast(dtype, padding))

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
                        for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(INNER - 1)) // T.int64(INNER)):
                            x0: T.let = chunk * T.int64(INNER)
                            _chunk_rows(inner_row, INNER, tx, p0 - before + x0, n, d)
                            T.tvm_storage_sync("shared")
                            for v in T.unroll(INNER * TILE_ROWS // THREADS):
                                # Weights, inner-major, zero where invalid.
                                e: T.let = tx + v * THREADS
                                a: T.let = _weight_row(e, transposed)
                                x: T.let = _weight_inner(e, transposed)
                                offset: T.let = x0 + x - a  # the band-column distance: valid in [valid_from, valid_to)
                                ok: T.let = out_row[a] >= T.int64(0) and offset >= valid_from[a] and offset < valid_to[a]
                                if transposed:
                                    weights[x * Q_STRIDE + a] = T.Select(
                                        ok and inner_row[x] >= T.int64(0),
                                        T.Cast(acc_dtype, t1[b, T.max(inner_row[x], T.int64(0)), h,
                                                             T.max(T.min(band - T.int64(1) - offset, band - T.int64(1)), T.int64(0))]),
                                        T.Cast(acc_dtype, 0))
                                else:
                                    weights[x * Q_STRIDE + a] = T.Select(
                                        ok,
                                        T.Cast(acc_dtype, t1[b, T.max(out_row[a], T.int64(0)), h,
                                                             T.max(T.min(offset, band - T.int64(1)), T.int64(0))]),
                                        T.Cast(acc_dtype, 0))
                            for v in T.unroll(INNER * OUT_FEATURES // THREADS):
                                x: T.let = (tx + v * THREADS) // OUT_FEATURES
                                f: T.let = (tx + v * THREADS) % OUT_FEATURES
                                rows[x * F_STRIDE + f] = T.Select(
                                    inner_row[x] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
                                    T.Cast(acc_dtype, t2[b, T.max(inner_row[x], T.int64(0)), h,
                                                         T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1))]),
                                    T.Cast(acc_dtype, 0))
                            T.tvm_storage_sync("shared")
                            for x in T.unroll(INNER):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        acc[i, u] = acc[i, u] + weights[x * Q_STRIDE + ty * 4 + i] * rows[x * F_STRIDE + tc + u * SPAN]
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


@T.macro
def _online_softmax(scores, row_max, row_sum, rescale, part_max, part_sum, query_row, tx, chunk, bh, seed, dropout,
                    acc_dtype, minus_inf):
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
    new_max: T.let = T.max(T.max(T.max(old_max, part_max[mine * ROW_PARTS]), T.max(part_max[mine * ROW_PARTS + 1], part_max[mine * ROW_PARTS + 2])),
                       part_max[mine * ROW_PARTS + 3])
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
                row_key, T.max(chunk * T.int64(QK_KEYS) + T.Cast("int64", part * PER_PART + x - mine), T.int64(0)),
                dropout, acc_dtype, bind=True)
    for x in T.unroll(PER_PART):
        scores[mine * S_STRIDE + part * PER_PART + x] = kept[x]
    part_sum[tx] = total[0]
    T.tvm_storage_sync("shared")
    if part == 0:
        rescale[mine] = T.exp(old_max - shift)
        row_sum[mine] = row_sum[mine] * T.exp(old_max - shift) + (
            part_sum[tx] + part_sum[tx + 1] + part_sum[tx + 2] + part_sum[tx + 3])
        row_max[mine] = new_max
    T.tvm_storage_sync("shared")


def attention(dtype: str, autoregressive: bool, isa: str = ""):
    """Fused local attention forward: :func:`attention_mma` (tensor cores) for the half types,
    :func:`attention_fma` for float32."""
    if is_half(dtype):
        return attention_mma(dtype, autoregressive)
    return attention_fma(dtype, autoregressive)


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
    def main(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle, key_bias_handle: T.handle,
             dilation_handle: T.handle, window: T.int64, scale: T.float64, softcap: T.float64, dropout: T.float64,
             seed: T.int64, out_handle: T.handle, lse_handle: T.handle):
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
                        for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)):
                            _chunk_rows(key_row, QK_KEYS, tx, p0 - w + chunk * T.int64(QK_KEYS), n, d)
                            _qk_chunk(acc, queries, keys, q, k, query_row, key_row, b, h, kv_h, head_dim, tx, acc_dtype)
                            if softcap > T.float64(0):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        acc[i, u] = T.Cast(acc_dtype, softcap) * _cap_tanh(acc[i, u], scale, softcap, acc_dtype)
                            for i in T.unroll(4):
                                for u in T.unroll(4):
                                    # Band column j of row a is chunk column a + j (see qk).
                                    a: T.let = ty * 4 + i
                                    j: T.let = chunk * T.int64(QK_KEYS) + T.Cast("int64", tc + u * SPAN - a)
                                    scores[a * S_STRIDE + tc + u * SPAN] = T.Select(
                                        j >= valid_from[a] and j < valid_to[a],
                                        acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                        + key_bias[b, T.max(key_row[tc + u * SPAN], T.int64(0))],
                                        minus_inf)
                            for e in T.unroll(QK_KEYS * OUT_FEATURES // THREADS):
                                kk: T.let = (tx + e * THREADS) // OUT_FEATURES
                                f: T.let = (tx + e * THREADS) % OUT_FEATURES
                                values[kk * OUT_FEATURES + f] = T.Select(
                                    key_row[kk] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
                                    T.Cast(acc_dtype, v[b, T.max(key_row[kk], T.int64(0)), kv_h,
                                                        T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1))]),
                                    T.Cast(acc_dtype, 0))
                            T.tvm_storage_sync("shared")
                            _online_softmax(scores, row_max, row_sum, rescale, part_max, part_sum, query_row, tx, chunk, bh,
                                            seed, dropout, acc_dtype, minus_inf)
                            for i in T.unroll(4):
                                for u in T.unroll(4):
                                    context[i, u] = context[i, u] * rescale[ty * 4 + i]
                            for kk in T.unroll(QK_KEYS):
                                for i in T.unroll(4):
                                    for u in T.unroll(4):
                                        context[i, u] = context[i, u] + scores[(ty * 4 + i) * S_STRIDE + kk] * values[kk * OUT_FEATURES + tc + u * SPAN]
                            T.tvm_storage_sync("shared")
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                f: T.let = f0 * T.int64(OUT_FEATURES) + T.Cast("int64", tc + u * SPAN)
                                row: T.let = query_row[a]
                                total_a: T.let = row_sum[a]  # 0: a row with no key (== 0, so that a NaN sum stays NaN)
                                if row >= T.int64(0) and f < head_dim:
                                    out[b, row, h, f] = T.Cast(dtype, T.Select(total_a == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0),
                                                                              context[i, u] / total_a))
                        if tx < TILE_ROWS:
                            row: T.let = query_row[tx]
                            if row >= T.int64(0):
                                lse[b, row, h] = T.Select(row_sum[tx] == T.Cast(acc_dtype, 0), minus_inf, row_max[tx] + T.log(row_sum[tx]))

    return main


# Tensor cores: mma.sync m16n8k16 (A, 16 x 16 in bfloat16 or float16, times B, 16 x 8, into float32
# accumulators) for a warp of 32 threads. Lane l holds, with g = l // 4 and t = l % 4 (the PTX ISA's
# "matrix fragments for mma.m16n8k16 with floating point type"):
#   A element i < 8 at row g + 8 ((i // 2) % 2), column 2t + i % 2 + 8 (i // 4);
#   B element i < 4 at row 2t + i % 2 + 8 (i // 2), column g;
#   C element i < 4 at row g + 8 (i // 2), column 2t + i % 2.
# Pairs of consecutive elements are one 32-bit register of the instruction.
WARP = 32
WARP_ROWS = 16  # each warp's query rows: one mma tile
MMA_THREADS = TILE_ROWS // WARP_ROWS * WARP  # 4 warps
FEATURE_BLOCK = 64  # features staged per pass (the scores) and output features per pass (P.V)
# Operand rows in shared memory, 8 elements (16 bytes) past the row: the 8 rows of an ldmatrix
# phase (16 bytes each, 144 bytes apart) then fall into 8 different groups of 4 banks.
OP_STRIDE = FEATURE_BLOCK + 8
VECTOR = 8  # operand elements per staging load: 16 bytes of the half types
# The tensor-core dK/dV kernel keeps its operands in dynamic shared memory: K and V of the tile, Q
# and dO of a chunk double buffered (6 x 64 rows), past the 48 KiB a kernel may declare statically
# (55296 bytes in the half types; the launch asks for it, and TVM's runtime raises the kernel's
# limit to it on its first launch).
DYNAMIC_OPERAND_ROWS = 6 * TILE_ROWS


def _element_bytes(dtype: str) -> int:
    return tvm.DataType(dtype).bits // 8


def dynamic_shared_bytes(operand_dtype: str) -> int:
    """The tensor-core dK/dV kernel's dynamic shared memory with operands of ``operand_dtype``."""
    return DYNAMIC_OPERAND_ROWS * OP_STRIDE * _element_bytes(operand_dtype)

# ldmatrix.x4 (PTX ISA, "warp-level matrix load instruction: ldmatrix"): lane l gives the address of
# row l % 8 of matrix l // 8 (8 elements, 16 bytes) and receives in its register m elements
# (l // 4, 2 (l % 4) + {0, 1}) of matrix m; with .trans elements (2 (l % 4) + {0, 1}, l // 4). So,
# with lo = l % 8, m1 = l // 8 % 2, m2 = l // 16 and k0 the step's first feature (first key for P.V),
# rows counted from the warp's first (A) or the pair's first (B), columns from the pair's first:
#   A fragment of 16 rows from [row, feature]: row 8 m1 + lo, column k0 + 8 m2;
#   B fragments of two tiles of 8 keys from [key, feature] (Q.K^T): row 8 m2 + lo, column k0 + 8 m1;
#   B fragments of two tiles of 8 features from [key, feature] (P.V, dS.K; .trans): row k0 + 8 m1 + lo,
#   column 8 m2 (the first tile's B in dst[0:4], the second's in dst[4:8]).
MMA_PTX_TYPE = {"bfloat16": "bf16", "float16": "f16"}
# The maximum and the sum of a value over the 4 lanes of a quad (one row of an accumulator tile);
# one source per function: TVM emits each function's source once, by name.
QUAD_SOURCE = {
    "max": """__device__ __forceinline__ float longformer_quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
""",
    "sum": """__device__ __forceinline__ float longformer_quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
"""}


# The tensor-core kernels' softmax runs in base 2, as FlashAttention's: scores are scaled by
# scale * log2(e) (the key bias staged times log2(e)), so that each exponential is one
# ``ex2.approx.ftz`` (MUFU.EX2) where expf is eight instructions (its range reduction and
# rounding), and the log-sum-exp is converted back (max * ln 2 + ln(sum)). Its error, 2 ulp, is far
# under the half types' rounding of P. The CPU harness defines its own (std::exp2). (LOG2E and LN2:
# at the top, where the macros find them.)
EXP2_SOURCE = """__device__ __forceinline__ float longformer_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def _exp2(x, operand_dtype: str):
    """2^x in float32 (see EXP2_SOURCE)."""
    source = EXP2_SOURCE if operand_dtype in MMA_PTX_TYPE else "// longformer_exp2: the CPU harness defines it\n"
    return cuda_func_call("longformer_exp2", x, source_code=source, return_type="float32")


def _c_element(i: int):
    """(row, column) offsets from (g, 2t) of accumulator element i."""
    return 8 * (i // 2), i % 2


def _mma_source(operand_dtype: str) -> str:
    """The CUDA device function ``longformer_mma_m16n8k16(c, a, b)``: c[0:4] += a . b, each pointer
    to this thread's fragment. float32 operands have no such instruction: the CPU harness
    (tests/cuda_on_cpu.py) compiles that variant, with its own emulation of the warp's product."""
    if operand_dtype not in MMA_PTX_TYPE:
        return "// longformer_mma_m16n8k16: the CPU harness defines it\n"
    ptx = MMA_PTX_TYPE[operand_dtype]
    return (
        "__device__ __forceinline__ void longformer_mma_m16n8k16(float* c, const void* a, const void* b) {\n"
        "  const unsigned* A = reinterpret_cast<const unsigned*>(a);\n"
        "  const unsigned* B = reinterpret_cast<const unsigned*>(b);\n"
        f'  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 '
        '{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"\n'
        '               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])\n'
        '               : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));\n'
        "}\n")


def _mma(c, c_offset, a, b, b_offset, source: str):
    """c[c_offset:c_offset + 4] += a . b[b_offset:b_offset + 4] on tensor cores (``source``:
    :func:`_mma_source`)."""
    return cuda_func_call("longformer_mma_m16n8k16", c.access_ptr("rw", offset=c_offset, extent=4),
                          a.access_ptr("r", offset=0, extent=8), b.access_ptr("r", offset=b_offset, extent=4),
                          source_code=source)


def _ldmatrix_source(operand_dtype: str, transposed: bool) -> str:
    """The CUDA device function ``longformer_ldmatrix_x4[_trans](dst, src)``: ``ldmatrix`` of four
    8 x 8 matrices of 16-bit elements from shared memory (the ldmatrix note by VECTOR); the CPU harness defines
    the float-operand variant."""
    name = "longformer_ldmatrix_x4" + ("_trans" if transposed else "")
    if operand_dtype not in MMA_PTX_TYPE:
        return f"// {name}: the CPU harness defines it\n"
    return (
        f"__device__ __forceinline__ void {name}(void* dst, const void* src) {{\n"
        "  unsigned* d = reinterpret_cast<unsigned*>(dst);\n"
        "  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(src));\n"
        f'  asm volatile("ldmatrix.sync.aligned.m8n8.x4{".trans" if transposed else ""}.shared.b16 '
        '{%0,%1,%2,%3}, [%4];"\n'
        '               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(address));\n'
        "}\n")


def _ldmatrix(dst, buf, offset, transposed: bool, operand_dtype: str):
    """dst[0:8] = this lane's share of the four matrices whose rows the warp's lanes address, this
    lane's row at buf[offset] (the ldmatrix note by VECTOR)."""
    name = "longformer_ldmatrix_x4" + ("_trans" if transposed else "")
    return cuda_func_call(name, dst.access_ptr("w", offset=0, extent=8), buf.access_ptr("r", offset=offset, extent=8),
                          source_code=_ldmatrix_source(operand_dtype, transposed))


# 16-byte copies between global and shared memory, and zeroing (device functions: TVM's own
# vectorized loop of these copies fails in its CUDA codegen inside these kernels); the CPU harness
# defines the float-operand variants (VECTOR floats). ``copy_async`` is ``cp.async`` (sm_80+: the
# copy runs while the thread goes on; in flight until ``wait``, which waits for all of this thread's;
# ``commit`` closes the group of those issued since the last), so a chunk's operands load while the
# previous chunk's products run.
#
# A copy's source is a row of [batch, n, heads, head_dim] given as the address of row 0's element,
# the row and the row's length in bytes, multiplied here as two 32-bit ints into a 64-bit offset
# (one IMAD.WIDE): TVM's own address of t[b, row, h, f] is three 64-bit multiplies (~20
# instructions), and a chunk's staging has eight such copies a thread (bench/NOTES.md, fifth GPU run).
COPY_SOURCE = {
    "copy": "__device__ __forceinline__ void longformer_copy16(void* dst, const void* row0, int row, int row_bytes) {\n"
            "  const char* src = static_cast<const char*>(row0) + static_cast<long long>(row) * row_bytes;\n"
            "  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);\n}\n",
    "zero": "__device__ __forceinline__ void longformer_zero16(void* dst) {\n"
            "  *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);\n}\n",
    "copy_async": "__device__ __forceinline__ void longformer_copy16_async(void* dst, const void* row0, int row, int row_bytes) {\n"
                  "  const char* src = static_cast<const char*>(row0) + static_cast<long long>(row) * row_bytes;\n"
                  "  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));\n"
                  '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(address), "l"(src) : "memory");\n}\n',
    "commit": "__device__ __forceinline__ void longformer_async_commit() {\n"
              '  asm volatile("cp.async.commit_group;" ::: "memory");\n}\n',
    "wait": "__device__ __forceinline__ void longformer_async_wait() {\n"
            '  asm volatile("cp.async.wait_group 0;" ::: "memory");\n}\n'}
COPY_FUNCTION = {"copy": "longformer_copy16", "copy_async": "longformer_copy16_async", "zero": "longformer_zero16",
                 "commit": "longformer_async_commit", "wait": "longformer_async_wait"}


def _copy_source(operand_dtype: str, kind: str) -> str:
    if operand_dtype not in MMA_PTX_TYPE:
        return f"// {COPY_FUNCTION[kind]}: the CPU harness defines it\n"
    return COPY_SOURCE[kind]


def _async(kind: str, operand_dtype: str):
    """``commit`` or ``wait`` (this thread's ``cp.async`` copies; see COPY_SOURCE)."""
    return cuda_func_call(COPY_FUNCTION[kind], source_code=_copy_source(operand_dtype, kind))


# rowsum(a * b) over 8 elements (16 bytes of a half type per load) in float32: the dK/dV kernel's deltas.
DOT8_SOURCE = """__device__ __forceinline__ float longformer_dot8(const void* a, const void* b) {{
  uint4 x = *reinterpret_cast<const uint4*>(a), y = *reinterpret_cast<const uint4*>(b);
  const {pair}* u = reinterpret_cast<const {pair}*>(&x);
  const {pair}* v = reinterpret_cast<const {pair}*>(&y);
  float sum = 0.0f;
  for (int i = 0; i < 4; ++i) {{
    float2 p = {widen}(u[i]), q = {widen}(v[i]);
    sum += p.x * q.x + p.y * q.y;
  }}
  return sum;
}}
"""
DOT8_TYPES = {"bfloat16": ("nv_bfloat162", "__bfloat1622float2"), "float16": ("half2", "__half22float2")}


def _dot8(t1, t2, b, row, h, feature, operand_dtype: str):
    """sum over f < 8 of t1[b, row, h, feature + f] * t2[b, row, h, feature + f], in float32."""
    if operand_dtype in DOT8_TYPES:
        pair, widen = DOT8_TYPES[operand_dtype]
        source = DOT8_SOURCE.format(pair=pair, widen=widen)
    else:
        source = "// longformer_dot8: the CPU harness defines it\n"
    return cuda_func_call("longformer_dot8", T.address_of(t1[b, row, h, feature]), T.address_of(t2[b, row, h, feature]),
                          source_code=source, return_type="float32")


@T.macro
def _stage_operand(buf, t, row_of, b, h, feature0, head_dim, tx, operand, base=0, row_base=0, copy="copy"):
    """buf[base + r * OP_STRIDE + f] = t[row_of[row_base + r], feature0 + f] for 64 rows and 64
    features (0 for rows of -1 and features past head_dim, a multiple of FEATURE_MULTIPLE), VECTOR
    elements (16 bytes) per load and store: each row's 8 pieces by 8 consecutive threads (coalesced,
    and in shared memory 8 x 16 bytes of one row per phase: no bank conflict). The inputs' data must
    be 16-byte aligned (longformer_ops.kernels makes it so). ``copy``: "copy_async" issues the copies
    (the zeros are stored at once); the caller commits and waits (COPY_SOURCE)."""
    for e in T.unroll(QK_KEYS * FEATURE_BLOCK // VECTOR // MMA_THREADS):
        r: T.let = (tx + e * MMA_THREADS) // (FEATURE_BLOCK // VECTOR)
        f: T.let = (tx + e * MMA_THREADS) % (FEATURE_BLOCK // VECTOR) * VECTOR
        feature: T.let = feature0 + T.Cast("int64", f)
        row: T.let = row_of[row_base + r]  # (bound: a condition may not read shared memory)
        if row >= T.int64(0) and feature < head_dim:
            T.evaluate(cuda_func_call(COPY_FUNCTION[copy], buf.access_ptr("w", offset=base + r * OP_STRIDE + f, extent=VECTOR),
                                      T.address_of(t[b, T.int64(0), h, feature]), T.Cast("int32", row),
                                      T.Cast("int32", t.shape[2] * t.shape[3] * T.int64(_element_bytes(t.dtype))),
                                      source_code=_copy_source(operand, copy)))
        else:
            T.evaluate(cuda_func_call("longformer_zero16", buf.access_ptr("w", offset=base + r * OP_STRIDE + f, extent=VECTOR),
                                      source_code=_copy_source(operand, "zero")))


@T.macro
def _rows_times_rows(acc, rows, others, a_frag, b_frag, warp_row, lo, m1, m2, operand, source, others_base=0):
    """acc += this warp's 16 rows of ``rows`` times all 64 rows of ``others`` (from ``others_base``)
    transposed, over one staged block of 64 features (both [row, feature] in shared memory; fragments
    by ldmatrix): 8 accumulator tiles of 16 x 8 (Q.K^T, dO.V^T, and in the key-major kernel K.Q^T,
    V.dO^T)."""
    for step in T.unroll(FEATURE_BLOCK // 16):
        T.evaluate(_ldmatrix(a_frag, rows, (warp_row + m1 * 8 + lo) * OP_STRIDE + step * 16 + m2 * 8, False, operand))
        for pair in T.unroll(QK_KEYS // 16):
            T.evaluate(_ldmatrix(b_frag, others, others_base + (pair * 16 + m2 * 8 + lo) * OP_STRIDE + step * 16 + m1 * 8,
                                 False, operand))
            T.evaluate(_mma(acc, pair * 8, a_frag, b_frag, 0, source))
            T.evaluate(_mma(acc, pair * 8 + 4, a_frag, b_frag, 4, source))


@T.macro
def _weights_times_rows(acc, weights, rows, a_frag, b_frag, lo, m1, m2, operand, source, rows_base=0):
    """acc += this warp's 16 x 64 weights (accumulator tiles in registers, rounded to the operand
    dtype: the tiles of columns 16s .. 16s + 15, 2s and 2s + 1, are step s's A fragment, element i
    being element i % 4 of tile 2s + i // 4) times the 64 rows of ``rows`` (from ``rows_base``;
    [row, feature] in shared memory, B fragments by ldmatrix.trans): 8 tiles of output features
    (P.V, dS.K, and in the key-major kernel (P^T Z).dO, dS^T.Q)."""
    for step in T.unroll(QK_KEYS // 16):
        for i in T.unroll(8):
            a_frag[i] = T.Cast(operand, weights[(step * 2 + i // 4) * 4 + i % 4])
        for pair in T.unroll(FEATURE_BLOCK // 16):
            T.evaluate(_ldmatrix(b_frag, rows, rows_base + (step * 16 + m1 * 8 + lo) * OP_STRIDE + pair * 16 + m2 * 8,
                                 True, operand))
            T.evaluate(_mma(acc, pair * 8, a_frag, b_frag, 0, source))
            T.evaluate(_mma(acc, pair * 8 + 4, a_frag, b_frag, 4, source))


def _quad(reduction: str, x):
    """The maximum or sum of x over this thread's quad."""
    return cuda_func_call(f"longformer_quad_{reduction}", x, source_code=QUAD_SOURCE[reduction], return_type="float32")


@T.macro
def _chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype, masked, capped):
    """The forward's scores of a chunk in base 2 (scale x log2 e, the key's bias staged times log2 e),
    soft-capped where ``capped``, -inf off the band where ``masked`` (Python bools: the code without
    the cap or the mask is another branch), and each of this thread's two rows' maximum into
    ``reduced``."""
    for x in T.unroll(QK_KEYS // 8 * 4):
        kk: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        if capped:
            acc[x] = T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * _cap_tanh(acc[x], scale, softcap, acc_dtype) + chunk_bias[
                slot * T.int64(QK_KEYS) + T.Cast("int64", kk)]
        else:
            acc[x] = acc[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E)) + chunk_bias[slot * T.int64(QK_KEYS) + T.Cast("int64", kk)]
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
    bytes of shared memory with the chunks' key biases: the 48 KiB a kernel may declare statically). ``operand_dtype`` float32
    (only with dtype float32) is for the CPU harness, which emulates the instructions."""
    operand = operand_dtype or dtype
    acc_dtype = accumulation_dtype(dtype)
    causal = 1 if autoregressive else 0
    minus_inf = tirx.const(float("-inf"), acc_dtype)
    source = _mma_source(operand)
    tiles = QK_KEYS // 8  # mma tiles of 8 columns across a chunk's keys, and across 64 output features

    @T.prim_func
    def main(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle, key_bias_handle: T.handle,
             dilation_handle: T.handle, window: T.int64, scale: T.float64, softcap: T.float64, dropout: T.float64,
             seed: T.int64, out_handle: T.handle, lse_handle: T.handle):
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
                    chunk_bias = T.alloc_buffer((2 * QK_KEYS,), acc_dtype, scope="shared")  # key_bias x log2(e), per key
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
                        chunks: T.let = (T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)
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
                            _stage_operand(keys, k, key_row, b, kv_h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async")
                            _stage_operand(values, v, key_row, b, kv_h, f0 * T.int64(FEATURE_BLOCK), head_dim, tx, operand, 0, 0,
                                           "copy_async")
                            T.evaluate(_async("commit", operand))
                            for chunk in range(chunks):
                                slot: T.let = chunk % T.int64(2)
                                for fb in range(blocks):  # (nested loops: no int64 division by blocks)
                                    step: T.let = chunk * blocks + fb
                                    T.tvm_storage_sync("shared")
                                    if fb == T.int64(0) and chunk + T.int64(1) < chunks:
                                        _chunk_rows(key_row, QK_KEYS, tx, p0 - w + (chunk + T.int64(1)) * T.int64(QK_KEYS), n, d,
                                                    (T.int64(1) - slot) * T.int64(QK_KEYS))
                                        _chunk_key_bias(chunk_bias, key_bias, key_row, b, tx, (T.int64(1) - slot) * T.int64(QK_KEYS))
                                    if blocks > T.int64(1) or step == T.int64(0):  # else the tile's queries stay
                                        _stage_operand(queries, q, query_row, b, h, fb * T.int64(FEATURE_BLOCK), head_dim, tx, operand)
                                    T.evaluate(_async("wait", operand))
                                    T.tvm_storage_sync("shared")
                                    if step + T.int64(1) < chunks * blocks:  # the next step's operands, in flight
                                        next_fb: T.let = T.Select(fb + T.int64(1) < blocks, fb + T.int64(1), T.int64(0))
                                        next_slot: T.let = T.Select(fb + T.int64(1) < blocks, slot, T.int64(1) - slot)
                                        _stage_operand(keys, k, key_row, b, kv_h, next_fb * T.int64(FEATURE_BLOCK), head_dim, tx, operand,
                                                       (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                                       next_slot * T.int64(QK_KEYS), "copy_async")
                                        if next_fb == T.int64(0):
                                            _stage_operand(values, v, key_row, b, kv_h, f0 * T.int64(FEATURE_BLOCK), head_dim, tx, operand,
                                                           next_slot * T.int64(QK_KEYS * OP_STRIDE), next_slot * T.int64(QK_KEYS),
                                                           "copy_async")
                                        T.evaluate(_async("commit", operand))
                                    if fb == T.int64(0):
                                        for x in T.unroll(tiles * 4):
                                            acc[x] = T.Cast(acc_dtype, 0)
                                    _rows_times_rows(acc, queries, keys, a_frag, b_frag, warp_row, lo, m1, m2, operand, source,
                                                     step % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE))
                                    if fb == blocks - T.int64(1):
                                        # Scores, -inf off the band (band column j of row a is chunk column a + j, see
                                        # qk), and each row's maximum over its quad.
                                        # (The biased score first, unconditionally: inside the Select its load
                                        # would be a branch.)
                                        _chunk_column_bounds(bounds, valid_from, valid_to, row0, chunk, t2)
                                        for r in T.unroll(2):
                                            reduced[r] = minus_inf
                                        if softcap > T.float64(0):
                                            _masked_chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype,
                                                                 True)
                                        else:
                                            _masked_chunk_scores(acc, reduced, chunk_bias, bounds, slot, t2, scale, softcap, acc_dtype,
                                                                 False)
                                        for r in T.unroll(2):
                                            reduced[r] = _quad("max", reduced[r])  # (stored: a let would repeat the shuffles)
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
                                                row_key: T.let = dropout_row_key(seed, bh, query_row[row0 + r * 8], bind=True)
                                                for x in T.unroll(tiles * 2):
                                                    kk: T.let = x // 2 * 8 + t2 + x % 2
                                                    acc[x // 2 * 4 + r * 2 + x % 2] = acc[x // 2 * 4 + r * 2 + x % 2] * dropout_factor(
                                                        row_key, T.max(chunk * T.int64(QK_KEYS) + T.Cast("int64", kk - row0 - r * 8), T.int64(0)),
                                                        dropout, acc_dtype, bind=True)
                                        _weights_times_rows(context, acc, values, a_frag, b_frag, lo, m1, m2, operand, source,
                                                            slot * T.int64(QK_KEYS * OP_STRIDE))  # P.V
                            for x in T.unroll(tiles * 4):
                                a: T.let = row0 + _c_element(x % 4)[0]
                                f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast("int64", x // 4 * 8 + t2 + _c_element(x % 4)[1])
                                row: T.let = query_row[a]
                                total: T.let = row_sum[x % 4 // 2]  # 0: a row with no key (== 0: a NaN sum stays NaN)
                                if row >= T.int64(0) and f < head_dim:
                                    out[b, row, h, f] = T.Cast(dtype, T.Select(total == T.Cast(acc_dtype, 0), T.Cast(acc_dtype, 0),
                                                                              context[x] / total))
                            for r in T.unroll(2):
                                row: T.let = query_row[row0 + r * 8]
                                if t2 == 0 and row >= T.int64(0):
                                    lse[b, row, h] = T.Select(row_sum[r] == T.Cast(acc_dtype, 0), minus_inf,
                                                              row_max[r] * T.float32(LN2) + T.log(row_sum[r]))

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
            T.Cast(acc_dtype, 0))
    part_sum[tx] = total[0]
    T.tvm_storage_sync("shared")
    if part == 0:
        delta[mine] = part_sum[tx] + part_sum[tx + 1] + part_sum[tx + 2] + part_sum[tx + 3] - T.Select(
            row[0] >= T.int64(0), grad_lse[b, T.max(row[0], T.int64(0)), h], T.Cast(acc_dtype, 0))
        row_lse[mine] = T.Select(row[0] >= T.int64(0) and lse[b, T.max(row[0], T.int64(0)), h] != minus_inf,
                                 lse[b, T.max(row[0], T.int64(0)), h], T.Cast(acc_dtype, 0))
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
                    factors[i, u] = dropout_factor(dropout_row_key(seed, bh, rows[u], bind=True), column, dropout,
                                                   acc_dtype, bind=True)
                else:
                    factors[i, u] = dropout_factor(dropout_row_key(seed, bh, rows[i], bind=True), column, dropout,
                                                   acc_dtype, bind=True)


@T.macro
def _stage_rows(rows, t, row_of, b, h, f0, head_dim, tx, acc_dtype):
    """rows[x, f] = t[row_of[x]] at features f0 * 64 + f (0 outside the sequence or past head_dim)."""
    for e in T.unroll(QK_KEYS * OUT_FEATURES // THREADS):
        x: T.let = (tx + e * THREADS) // OUT_FEATURES
        f: T.let = (tx + e * THREADS) % OUT_FEATURES
        rows[x * OUT_FEATURES + f] = T.Select(
            row_of[x] >= T.int64(0) and f0 * T.int64(OUT_FEATURES) + f < head_dim,
            T.Cast(acc_dtype, t[b, T.max(row_of[x], T.int64(0)), h, T.min(f0 * T.int64(OUT_FEATURES) + f, head_dim - T.int64(1))]),
            T.Cast(acc_dtype, 0))


@T.macro
def _accumulate_rows(acc, weights, rows, tx):
    """acc[i, u] += sum over x of weights[ty * 4 + i, x] * rows[x, tc + 16 u]: 64 x 64 weights
    ([row, x], S_STRIDE apart) times 64 staged rows of 64 features."""
    for x in T.unroll(QK_KEYS):
        for i in T.unroll(4):
            for u in T.unroll(4):
                acc[i, u] = acc[i, u] + weights[(tx // SPAN * 4 + i) * S_STRIDE + x] * rows[x * OUT_FEATURES + tx % SPAN + u * SPAN]


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
def _query_tile_grads_fma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_q):
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
                _row_deltas(delta, row_lse, part_sum, query_row, grad, out, lse, grad_lse, b, h, head_dim, tx,
                            acc_dtype, minus_inf)
                for i in T.unroll(4):
                    my_rows[i] = query_row[ty * 4 + i]
                for f0 in range((head_dim + T.int64(OUT_FEATURES - 1)) // T.int64(OUT_FEATURES)):
                    for i in T.unroll(4):
                        for u in T.unroll(4):
                            grad_acc[i, u] = T.Cast(acc_dtype, 0)
                    for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)):
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
                                    T.exp(acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                          + key_bias[b, T.max(key_row[tc + u * SPAN], T.int64(0))] - row_lse[a]),
                                    T.Cast(acc_dtype, 0))
                        _qk_chunk(acc, queries, keys, grad, v, query_row, key_row, b, h, kv_h, head_dim, tx, acc_dtype)
                        _dropout_factors(factors, my_rows, seed, bh, chunk * T.int64(QK_KEYS) + T.Cast("int64", tc - ty * 4),
                                         SPAN, -1, False, dropout, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                a: T.let = ty * 4 + i
                                scores[a * S_STRIDE + tc + u * SPAN] = scores[a * S_STRIDE + tc + u * SPAN] * (
                                    acc[i, u] * factors[i, u] - delta[a]) * derivatives[i, u]
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
def _chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype, operand,
                       masked, capped):
    """The dQ kernel's dS = P * (dP - delta) of a chunk, P = 2^(score in base 2 - lse), 0 off the band
    where ``masked``; with the soft-cap where ``capped`` (its tanh in ``cap_tanh``, a register), dS
    times the cap's derivative. (Python bools: the code without the mask or the cap is another
    branch.)"""
    for x in T.unroll(QK_KEYS // 8 * 4):
        # P (its exponent unconditionally: inside the Select its load would be a branch).
        kk: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        if capped:
            cap_tanh[0] = _cap_tanh(scores[x], scale, softcap, acc_dtype)
            scores[x] = _exp2(T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * cap_tanh[0] + chunk_bias[kk]
                              - row_lse[x % 4 // 2], operand)
        else:
            scores[x] = _exp2(scores[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E)) + chunk_bias[kk]
                              - row_lse[x % 4 // 2], operand)
        if masked:
            scores[x] = T.Select(_in_bounds(bounds, x), scores[x], T.Cast(acc_dtype, 0))
        if capped:
            scores[x] = scores[x] * (grad_p[x] - delta[x % 4 // 2]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])
        else:
            scores[x] = scores[x] * (grad_p[x] - delta[x % 4 // 2])


@T.macro
def _masked_chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype,
                              operand, capped):
    """:func:`_chunk_score_grads`, masked only where this thread has an element off the band."""
    if _whole_chunk_in_band(bounds):
        _chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype, operand,
                           False, capped)
    else:
        _chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap, cap_tanh, acc_dtype, operand,
                           True, capped)


@T.macro
def _query_tile_grads_mma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed,
                          batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_q, operand, source):
    """dQ, per query tile, on tensor cores in the forward's layout (:func:`attention_mma`): per chunk
    of 64 keys each warp's 16 rows get S = Q K^T and dP = dO V^T as accumulator tiles, then in
    registers P = exp(S - lse), dS = P (dP Z - delta), and dQ += dS . K with dS as the A fragments
    (K's B fragments by ``ldmatrix.trans`` from its rows). Staging and fragments as the forward's. delta = rowsum(dO * O) - d lse per row, over the row's quad."""
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
                            T.Cast(acc_dtype, 0))
                    row_lse[r] = T.Select(row >= T.int64(0) and lse[b, T.max(row, T.int64(0)), h] != minus_inf,
                                          lse[b, T.max(row, T.int64(0)), h] * T.float32(LOG2E), T.Cast(acc_dtype, 0))  # base 2
                for r in T.unroll(2):
                    delta[r] = _quad("sum", delta[r])
                for r in T.unroll(2):
                    row: T.let = query_row[row0 + r * 8]
                    delta[r] = delta[r] - T.Select(row >= T.int64(0), grad_lse[b, T.max(row, T.int64(0)), h],
                                                   T.Cast(acc_dtype, 0))
                for f0 in range(blocks):
                    for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                        grad_acc[x] = T.Cast(acc_dtype, 0)
                    for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)):
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
                            _rows_times_rows(scores, queries, keys, a_frag, b_frag, warp_row, lo, m1, m2, operand, source)
                            _rows_times_rows(grad_p, grads, values, a_frag, b_frag, warp_row, lo, m1, m2, operand, source)
                        if dropout > T.float64(0):  # dP * Z (off-band columns, where P is 0, clamped to column 0)
                            for r in T.unroll(2):
                                row_key: T.let = dropout_row_key(seed, bh, query_row[row0 + r * 8], bind=True)
                                for x in T.unroll(QK_KEYS // 8 * 2):
                                    kk: T.let = x // 2 * 8 + t2 + x % 2
                                    grad_p[x // 2 * 4 + r * 2 + x % 2] = grad_p[x // 2 * 4 + r * 2 + x % 2] * dropout_factor(
                                        row_key, T.max(chunk * T.int64(QK_KEYS) + T.Cast("int64", kk - row0 - r * 8), T.int64(0)),
                                        dropout, acc_dtype, bind=True)
                        _chunk_column_bounds(bounds, valid_from, valid_to, row0, chunk, t2)
                        if softcap > T.float64(0):
                            _masked_chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap,
                                                      cap_tanh, acc_dtype, operand, True)
                        else:
                            _masked_chunk_score_grads(scores, grad_p, delta, row_lse, chunk_bias, bounds, t2, scale, softcap,
                                                      cap_tanh, acc_dtype, operand, False)
                        if blocks > T.int64(1):  # dQ's features f0 of these keys (one block: already there)
                            T.tvm_storage_sync("shared")
                            _stage_operand(keys, k, key_row, b, kv_h, f0 * T.int64(FEATURE_BLOCK), head_dim, tx, operand)
                            T.tvm_storage_sync("shared")
                        _weights_times_rows(grad_acc, scores, keys, a_frag, b_frag, lo, m1, m2, operand, source)  # dS.K
                    for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                        row: T.let = query_row[row0 + _c_element(x % 4)[0]]
                        f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast("int64", x // 4 * 8 + t2 + _c_element(x % 4)[1])
                        if row >= T.int64(0) and f < head_dim:
                            grad_q[b, row, h, f] = T.Cast(dtype, grad_acc[x] * T.Cast(acc_dtype, scale))


@T.macro
def _key_tile_grads_fma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_k, grad_v):
    """dK and dV, per key tile: the second kernel of :func:`attention_backward` (float32 FMAs)."""
    for bh in T.thread_binding(batch * heads, thread="blockIdx.y"):
        for tile in T.thread_binding((n + T.int64(TILE_ROWS - 1)) // T.int64(TILE_ROWS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                keys_t = T.alloc_buffer((QK_FEATURES * Q_STRIDE,), acc_dtype, scope="shared")  # [feature, key]
                queries_t = T.alloc_buffer((QK_FEATURES * K_STRIDE,), acc_dtype, scope="shared")  # [feature, query]
                weights = T.alloc_buffer((TILE_ROWS * S_STRIDE,), acc_dtype, scope="shared")  # [key, query]: P * Z, then dS
                query_rows = T.alloc_buffer((QK_KEYS * OUT_FEATURES,), acc_dtype, scope="shared")  # [query, feature]: dO, then Q
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
                    for chunk in range((T.int64(TILE_ROWS) + band - T.int64(1) + T.int64(QK_KEYS - 1)) // T.int64(QK_KEYS)):
                        # Chunk queries x: packed p0 - w_upper + 64 chunk + x, whose band column for
                        # tile key kk is kk - x + band - 1 - 64 chunk.
                        T.tvm_storage_sync("shared")
                        _tile_rows(query_row, valid_from, valid_to, tx,
                                   p0 - (band - T.int64(1) - w) + chunk * T.int64(QK_KEYS), n, d, w, band)
                        T.tvm_storage_sync("shared")
                        _row_deltas(delta, row_lse, part_sum, query_row, grad, out, lse, grad_lse, b, h, head_dim, tx,
                                    acc_dtype, minus_inf)
                        for u in T.unroll(4):
                            their_rows[u] = query_row[tc + u * SPAN]
                        _qk_chunk(acc, keys_t, queries_t, k, q, key_row, query_row, b, kv_h, h, head_dim, tx, acc_dtype)
                        if softcap > T.float64(0):
                            _soft_cap_fma(acc, derivatives, scale, softcap, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                x: T.let = tc + u * SPAN
                                j: T.let = T.Cast("int64", ty * 4 + i - x) + band - T.int64(1) - chunk * T.int64(QK_KEYS)
                                probs[i, u] = T.Select(
                                    query_row[x] >= T.int64(0) and key_row[ty * 4 + i] >= T.int64(0)
                                    and j >= valid_from[x] and j < valid_to[x],
                                    T.exp(acc[i, u] * _score_scale(scale, softcap, acc_dtype)
                                          + key_bias[b, T.max(key_row[ty * 4 + i], T.int64(0))] - row_lse[x]),
                                    T.Cast(acc_dtype, 0))
                        _qk_chunk(acc, keys_t, queries_t, v, grad, key_row, query_row, b, kv_h, h, head_dim, tx, acc_dtype)
                        _dropout_factors(factors, their_rows, seed, bh,
                                         T.Cast("int64", ty * 4 - tc) + band - T.int64(1) - chunk * T.int64(QK_KEYS),
                                         -SPAN, 1, True, dropout, acc_dtype)
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                weights[(ty * 4 + i) * S_STRIDE + tc + u * SPAN] = probs[i, u] * factors[i, u]
                        _stage_rows(query_rows, grad, query_row, b, h, f0, head_dim, tx, acc_dtype)
                        T.tvm_storage_sync("shared")
                        _accumulate_rows(grad_v_acc, weights, query_rows, tx)
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(4):
                            for u in T.unroll(4):
                                weights[(ty * 4 + i) * S_STRIDE + tc + u * SPAN] = probs[i, u] * (
                                    acc[i, u] * factors[i, u] - delta[tc + u * SPAN]) * derivatives[i, u]
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


@T.macro
def _delta_halves(part_sum, part_lse, total, query_row, grad, out, lse, grad_lse, b, h, head_dim, tx, operand, acc_dtype,
                  minus_inf, base=0):
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
        total[0] = total[0] + T.Select(row >= T.int64(0), _dot8(grad, out, b, T.max(row, T.int64(0)), h, feature, operand),
                                       T.Cast(acc_dtype, 0))
    part_sum[tx] = total[0] - T.Select(row >= T.int64(0) and tx % 2 == 0, grad_lse[b, T.max(row, T.int64(0)), h],
                                       T.Cast(acc_dtype, 0))
    part_lse[tx] = T.Select(row >= T.int64(0) and lse[b, T.max(row, T.int64(0)), h] != minus_inf,
                            lse[b, T.max(row, T.int64(0)), h] * T.float32(LOG2E), T.Cast(acc_dtype, 0))


@T.macro
def _delta_combine(delta, row_lse, part_sum, part_lse, tx, base):
    """delta[base + x] = rowsum(dO * O) - d lse of chunk query x, row_lse[base + x] its log-sum-exp,
    from :func:`_delta_halves`."""
    if tx % 2 == 0:
        delta[base + T.Cast("int64", tx // 2)] = part_sum[tx] + part_sum[tx + 1]
        row_lse[base + T.Cast("int64", tx // 2)] = part_lse[tx]


@T.macro
def _key_tile_capped_grads(probs, grad_p, delta, row_lse, key_spans, query_row, my_bias, cap_tanh, row0, t2, slot, chunk,
                           band, bh, seed, scale, softcap, dropout, acc_dtype, operand, with_dropout):
    """The dK/dV kernel's soft-capped chunk, in registers (:func:`_key_tile_grads_mma`): from S^T in
    ``probs`` and dP^T in ``grad_p``, P^T = 2^(capped score in base 2 - lse) (0 off the band), dS^T
    = P^T (dP^T Z - delta) (1 - tanh^2) and P^T Z, one pass per score (its tanh in ``cap_tanh``);
    Z = 1 unless ``with_dropout`` (a Python bool: the code without it is another branch)."""
    for x in T.unroll(QK_KEYS // 8 * 4):
        a: T.let = row0 + _c_element(x % 4)[0]
        col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
        at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
        cap_tanh[0] = _cap_tanh(probs[x], scale, softcap, acc_dtype)
        probs[x] = _exp2(T.Cast(acc_dtype, softcap * T.float64(LOG2E)) * cap_tanh[0] + my_bias[x % 4 // 2] - row_lse[at],
                         operand)
        probs[x] = T.Select(tirx.all(a >= key_spans[at * T.int64(2)], a < key_spans[at * T.int64(2) + T.int64(1)]),
                            probs[x], T.Cast(acc_dtype, 0))
        if with_dropout:
            j: T.let = T.Cast("int64", a - col) + band - T.int64(1) - chunk * T.int64(QK_KEYS)
            factor: T.let = dropout_factor(dropout_row_key(seed, bh, query_row[at], bind=True), T.max(j, T.int64(0)),
                                           dropout, acc_dtype, bind=True)
            grad_p[x] = probs[x] * (grad_p[x] * factor - delta[at]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])
            probs[x] = probs[x] * factor
        else:
            grad_p[x] = probs[x] * (grad_p[x] - delta[at]) * (T.Cast(acc_dtype, 1) - cap_tanh[0] * cap_tanh[0])


@T.macro
def _key_tile_grads_mma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed,
                        batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_k, grad_v, operand, source):
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
                queries = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared.dyn")  # [query, feature] x 2
                grads = T.alloc_buffer((2 * QK_KEYS * OP_STRIDE,), operand, scope="shared.dyn")  # dO: [query, feature] x 2
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
                        _delta_halves(part_sum, part_lse, total, query_row, grad, out, lse, grad_lse, b, h, head_dim, tx, operand,
                                      acc_dtype, minus_inf)
                        _stage_operand(queries, q, query_row, b, h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async")
                        _stage_operand(grads, grad, query_row, b, h, T.int64(0), head_dim, tx, operand, 0, 0, "copy_async")
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
                                        _tile_rows(query_row, valid_from, valid_to, tx,
                                                   first_query + (chunk + T.int64(1)) * T.int64(QK_KEYS), n, d, w, band,
                                                   (T.int64(1) - slot) * T.int64(QK_KEYS))
                                        _query_key_spans(key_spans, query_row, valid_from, valid_to, tx, chunk + T.int64(1), band,
                                                         (T.int64(1) - slot) * T.int64(QK_KEYS))
                                    _delta_combine(delta, row_lse, part_sum, part_lse, tx, slot * T.int64(QK_KEYS))
                                if stage < blocks and (blocks > T.int64(1) or step == T.int64(0)):  # else the tile's K and V stay
                                    _stage_operand(keys, k, key_row, b, kv_h, stage * T.int64(FEATURE_BLOCK), head_dim, tx, operand)
                                    _stage_operand(values, v, key_row, b, kv_h, stage * T.int64(FEATURE_BLOCK), head_dim, tx, operand)
                                T.evaluate(_async("wait", operand))
                                T.tvm_storage_sync("shared")
                                if step + T.int64(1) < chunks * stages:  # the next step's Q and dO, in flight
                                    next_stage: T.let = T.Select(stage + T.int64(1) < stages, stage + T.int64(1), T.int64(0))
                                    next_slot: T.let = T.Select(stage + T.int64(1) < stages, slot, T.int64(1) - slot)
                                    # Its feature block: a product stage's own, the last stage's f0.
                                    next_block: T.let = T.Select(next_stage < blocks, next_stage, f0)
                                    _stage_operand(queries, q, query_row, b, h, next_block * T.int64(FEATURE_BLOCK), head_dim, tx,
                                                   operand, (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                                   next_slot * T.int64(QK_KEYS), "copy_async")
                                    _stage_operand(grads, grad, query_row, b, h, next_block * T.int64(FEATURE_BLOCK), head_dim, tx,
                                                   operand, (step + T.int64(1)) % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE),
                                                   next_slot * T.int64(QK_KEYS), "copy_async")
                                    T.evaluate(_async("commit", operand))
                                operands: T.let = step % T.int64(2) * T.int64(QK_KEYS * OP_STRIDE)  # this step's slot
                                if stage == stages - T.int64(1) and chunk + T.int64(1) < chunks:
                                    _delta_halves(part_sum, part_lse, total, query_row, grad, out, lse, grad_lse, b, h, head_dim, tx,
                                                  operand, acc_dtype, minus_inf, (T.int64(1) - slot) * T.int64(QK_KEYS))
                                if stage == T.int64(0):
                                    for x in T.unroll(QK_KEYS // 8 * 4):
                                        probs[x] = T.Cast(acc_dtype, 0)
                                        grad_p[x] = T.Cast(acc_dtype, 0)
                                if stage < blocks:
                                    _rows_times_rows(probs, keys, queries, a_frag, b_frag, warp_row, lo, m1, m2, operand, source,
                                                     operands)
                                    _rows_times_rows(grad_p, values, grads, a_frag, b_frag, warp_row, lo, m1, m2, operand, source,
                                                     operands)
                                if stage == stages - T.int64(1):
                                    # P^T (0 off the band), then dS^T and P^T Z; with dropout Z at (query, band column).
                                    # (Chunk query col's entries in this chunk's slot of the tables: at.)
                                    # (The exponent unconditionally: inside the Select its load would be a
                                    # branch. Keys outside the sequence need no mask: their rows of dK and
                                    # dV are not stored.)
                                    if softcap > T.float64(0):
                                        if dropout > T.float64(0):
                                            _key_tile_capped_grads(probs, grad_p, delta, row_lse, key_spans, query_row, my_bias,
                                                                   cap_tanh, row0, t2, slot, chunk, band, bh, seed, scale, softcap,
                                                                   dropout, acc_dtype, operand, True)
                                        else:
                                            _key_tile_capped_grads(probs, grad_p, delta, row_lse, key_spans, query_row, my_bias,
                                                                   cap_tanh, row0, t2, slot, chunk, band, bh, seed, scale, softcap,
                                                                   dropout, acc_dtype, operand, False)
                                    else:
                                        for x in T.unroll(QK_KEYS // 8 * 4):
                                            a: T.let = row0 + _c_element(x % 4)[0]
                                            col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                            at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
                                            probs[x] = _exp2(probs[x] * T.Cast(acc_dtype, scale * T.float64(LOG2E)) + my_bias[x % 4 // 2]
                                                             - row_lse[at], operand)
                                            probs[x] = T.Select(tirx.all(a >= key_spans[at * T.int64(2)], a < key_spans[at * T.int64(2) + T.int64(1)]),
                                                                probs[x], T.Cast(acc_dtype, 0))
                                        if dropout > T.float64(0):
                                            for x in T.unroll(QK_KEYS // 8 * 4):
                                                a: T.let = row0 + _c_element(x % 4)[0]
                                                col: T.let = x // 4 * 8 + t2 + _c_element(x % 4)[1]
                                                at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", col)
                                                j: T.let = T.Cast("int64", a - col) + band - T.int64(1) - chunk * T.int64(QK_KEYS)
                                                factor: T.let = dropout_factor(dropout_row_key(seed, bh, query_row[at], bind=True),
                                                                               T.max(j, T.int64(0)), dropout, acc_dtype, bind=True)
                                                grad_p[x] = probs[x] * (grad_p[x] * factor - delta[at])
                                                probs[x] = probs[x] * factor
                                        else:
                                            for x in T.unroll(QK_KEYS // 8 * 4):
                                                at: T.let = slot * T.int64(QK_KEYS) + T.Cast("int64", x // 4 * 8 + t2 + _c_element(x % 4)[1])
                                                grad_p[x] = probs[x] * (grad_p[x] - delta[at])
                                    _weights_times_rows(grad_v_acc, probs, grads, a_frag, b_frag, lo, m1, m2, operand, source,
                                                        operands)  # (P^T Z).dO
                                    _weights_times_rows(grad_k_acc, grad_p, queries, a_frag, b_frag, lo, m1, m2, operand, source,
                                                        operands)  # dS^T.Q
                        for x in T.unroll(FEATURE_BLOCK // 8 * 4):
                            row: T.let = my_key[x % 4 // 2]
                            f: T.let = f0 * T.int64(FEATURE_BLOCK) + T.Cast("int64", x // 4 * 8 + t2 + _c_element(x % 4)[1])
                            if row >= T.int64(0) and f < head_dim:
                                grad_k[b, row, h, f] = T.Cast(dtype, grad_k_acc[x] * T.Cast(acc_dtype, scale))
                                grad_v[b, row, h, f] = T.Cast(dtype, grad_v_acc[x])


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
    def main(grad_handle: T.handle, q_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
             key_bias_handle: T.handle, out_handle: T.handle, lse_handle: T.handle, grad_lse_handle: T.handle,
             dilation_handle: T.handle, window: T.int64, scale: T.float64, softcap: T.float64, dropout: T.float64,
             seed: T.int64, grad_q_handle: T.handle, grad_k_handle: T.handle, grad_v_handle: T.handle):
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
            _query_tile_grads_mma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_q, operand, source)
        else:
            _query_tile_grads_fma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_q)
        # dK and dV, per key tile.
        if tensor_cores:
            _key_tile_grads_mma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_k, grad_v, operand, source)
        else:
            _key_tile_grads_fma(grad, q, k, v, key_bias, out, lse, grad_lse, dilation, window, scale, softcap, dropout, seed, batch, n, heads, head_dim, dtype, acc_dtype, causal, minus_inf, grad_k, grad_v)
    return main


HAND_WRITTEN = {"qk": qk, "pv": pv, "transposed": transposed, "attention": attention,
                "attention_backward": attention_backward}
