"""AMX tile products for the fused local attention, forward and backward (bfloat16 operands,
float32 sums).

An AMX core holds 8 tile registers of up to 16 rows x 64 bytes and multiplies them in one
instruction: ``tdpbf16ps c, a, b`` adds A (16 x 32 bfloat16) times B (32 x 16, stored as 16 rows of
16 bfloat16 pairs) to C (16 x 16 float32): 8192 products where an AVX-512 FMA does 16. The
operands are exactly the AVX512-BF16 kernels' packed pairs (bf16_dot.py): a query tile's rows as
feature pairs is A for Q.K^T, a packed key block (feature pair x 16 keys) is B; the probabilities as
pairs of columns are A for P.V and the value rows as pairs of consecutive rows are B. So the fused
kernels here are cpu/attention.py's bfloat16 kernels with their tile products (:data:`AMX_PRODUCTS`)
moved onto the tiles; the packing, softmax, bounds and dropout are those kernels'. The backward's
products take the same two shapes (dP = dO.V^T as Q.K^T, dQ = dS.K as P.V) and one more, the key
sums dV += P^T dO and dK += dS^T Q, which run transposed (:func:`tile_key_sums`).

How the instructions are reached: LLVM's AMX intrinsics that name tile registers by number
(``llvm.x86.tileloadd64``, ``llvm.x86.tdpbf16ps``, ...) through ``T.call_llvm_intrin``; the target
needs ``+amx-tile,+amx-bf16`` (tvm_kernels/variants.py) and the process the kernel's permission to
use tile data, which the loader requests (longformer_ops/runtime/loader.py). Each task of the parallel
loop loads the tile configuration (:func:`_configure`) before its first tile and releases it after
its last.
"""

from __future__ import annotations

from tvm.script import tirx as T

from tvm_kernels.schedules.cpu.attention import TileProducts
from tvm_kernels.schedules.cpu.microkernels import _ON_STACK, _rounded, _transpose_square

ROWS = 16  # rows of every tile (queries of a Q.K^T or P.V product)
PAIRS = 16  # bfloat16 pairs in a full tile row (64 bytes): the reduction per instruction, 32 values
KEYS = 16  # float32 columns of a result tile: one packed key block, or 16 features

# Every tile register is 16 rows x 64 bytes (:func:`_configure`). Q.K^T: 4 key blocks at a time in
# C = 0..3, A = 4 (32 features of the tile's queries), B = 5..7 in turn (a key block's same
# features). P.V: 64 features at a time in C = 0..3 (32 when head_dim is an odd multiple of 32:
# C = 0, 1), A = 4 (16 key pairs of probabilities), B = 5..7 in turn (the same pairs' value rows).
# Key sums: 64 features of 16 keys in C = 0..3 (or 32), B = 4 (16 row pairs of P or dS), A = 5..7 in
# turn (the same row pairs' features, transposed).
# Four independent sums rather than one chain: no faster on the Emerald Rapids measured, where the
# tile products are a third of the forward's time (bench/NOTES.md, "AMX at last"), but not slower.
_TILES = 8


def _intrinsic(name, *args):
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


@T.macro
def _load(tile, address, stride):
    T.evaluate(_intrinsic("tileloadd64", T.int8(tile), address, T.Cast("int64", stride)))


@T.macro
def _store(tile, address, stride):
    T.evaluate(_intrinsic("tilestored64", T.int8(tile), address, T.Cast("int64", stride)))


@T.macro
def _multiply(c, a, b):
    T.evaluate(_intrinsic("tdpbf16ps", T.int8(c), T.int8(a), T.int8(b)))


@T.macro
def _zero(tile):
    T.evaluate(_intrinsic("tilezero", T.int8(tile)))


@T.macro
def _configure():
    """Load the tiles' shapes (palette 1: bytes 16.. their row widths as 16-bit numbers, 48.. their rows)."""
    config = T.alloc_local((64,), "uint8", annotations=_ON_STACK)
    for i in range(64):
        config[i] = T.uint8(0)
    config[0] = T.uint8(1)
    for tile in T.unroll(_TILES):
        config[16 + 2 * tile] = T.uint8(64)
        config[48 + tile] = T.uint8(ROWS)
    T.evaluate(_intrinsic("ldtilecfg", T.address_of(config[0])))


@T.macro
def _release():
    T.evaluate(_intrinsic("tilerelease"))


@T.macro
def _scale_and_bias(scores, biases, row0, block, block0, acc_dtype, with_bias, scale):
    """scores[row0 + r, block * 16 + c] = the tile's sum times ``scale`` (+ the key's bias), 16 rows."""
    for r in range(ROWS):
        for lane in T.vectorized(KEYS):
            if with_bias:
                scores[row0 + r, block * T.int64(KEYS) + lane] = (
                    scores[row0 + r, block * T.int64(KEYS) + lane] * T.Cast(acc_dtype, scale)
                    + biases[(block0 + block) * T.int64(KEYS) + lane]
                )
            else:
                scores[row0 + r, block * T.int64(KEYS) + lane] = scores[
                    row0 + r, block * T.int64(KEYS) + lane
                ] * T.Cast(acc_dtype, scale)


@T.macro
def _score_blocks(scores, queries, keys, biases, block0, block, row0, head_dim, count, acc_dtype, with_bias, scale):
    """Rows row0 .. row0 + 15 of :func:`tile_scores` for ``count`` (1 to 4) key blocks from ``block``."""
    for j in T.unroll(count):
        _zero(j)
    for chunk in range(head_dim // T.int64(2 * PAIRS)):
        _load(4, T.address_of(queries[row0, chunk * T.int64(PAIRS)]), T.int64(4) * queries.shape[1])
        for j in T.unroll(count):
            _load(
                5 + j % 3, T.address_of(keys[block0 + block + T.int64(j), chunk * T.int64(PAIRS), 0]), T.int64(4 * KEYS)
            )
            _multiply(j, 4, 5 + j % 3)
    for j in T.unroll(count):
        _store(j, T.address_of(scores[row0, (block + T.int64(j)) * T.int64(KEYS)]), T.int64(4) * scores.shape[1])
        if scale is not None:  # (None: the plain product, band.qk)
            _scale_and_bias(scores, biases, row0, block + T.int64(j), block0, acc_dtype, with_bias, scale)


@T.macro
def tile_scores(
    scores,
    acc,
    queries,
    keys,
    biases,
    block0,
    tile_blocks,
    head_dim,
    rows,
    sub_rows,
    cols,
    acc_dtype,
    with_bias,
    dot,
    scale,
    transposed=False,
):
    """:func:`cpu.attention._attention_tile_scores` for the dot product's operands on AMX:
    scores[r, block * 16 + c] = scale * queries[r] . packed key (block0 + block) * 16 + c (+ its bias),
    each block's 16 x 16 sums one tile, four blocks at a time, 32 features per instruction
    (head_dim a multiple of 32)."""
    quads: T.let = (tile_blocks[1] - tile_blocks[0]) // T.int64(4)
    for group in range(rows // ROWS):
        row0: T.let = group * ROWS
        for quad in range(quads):
            _score_blocks(
                scores,
                queries,
                keys,
                biases,
                block0,
                tile_blocks[0] + quad * T.int64(4),
                row0,
                head_dim,
                4,
                acc_dtype,
                with_bias,
                scale,
            )
        for block in range(tile_blocks[0] + quads * T.int64(4), tile_blocks[1]):
            _score_blocks(scores, queries, keys, biases, block0, block, row0, head_dim, 1, acc_dtype, with_bias, scale)


@T.macro
def _context_pass(
    out,
    context,
    probs,
    values,
    padded_probs,
    padded_values,
    row_scale,
    query,
    b,
    h,
    p0,
    n,
    row0,
    first_pair,
    chunks,
    half_chunk,
    pair_row0,
    column,
    width,
    dtype,
):
    """Output rows row0 .. row0 + 15, features [column, column + 16 * width): ``width`` result tiles
    over the full chunks of 16 key pairs from ``first_pair``, then the half chunk (8 pairs) from the
    zero-padded copies (:func:`tile_context`), then times row_scale, rounded, stored."""
    probs_stride: T.let = T.int64(4) * probs.shape[1]
    pair_stride: T.let = T.int64(8) * values.shape[1]  # every other packed row: a pair's first row
    for j in T.unroll(width):
        _zero(j)
    for chunk in range(chunks):
        pair: T.let = first_pair + chunk * T.int64(PAIRS)
        _load(4, T.address_of(probs[row0, pair]), probs_stride)
        for j in T.unroll(width):
            _load(
                5 + j % 3, T.address_of(values[pair_row0 + pair * T.int64(2), column + T.int64(j * KEYS)]), pair_stride
            )
            _multiply(j, 4, 5 + j % 3)
    if half_chunk:
        _load(4, T.address_of(padded_probs[0, 0]), T.int64(4 * PAIRS))
        for j in T.unroll(width):
            _load(
                5 + j % 3,
                T.address_of(padded_values[0, column + T.int64(j * KEYS)]),
                T.int64(4) * padded_values.shape[1],
            )
            _multiply(j, 4, 5 + j % 3)
    for j in T.unroll(width):
        _store(j, T.address_of(context[0, j * KEYS]), T.int64(4 * 4 * KEYS))
    for r in range(ROWS):
        if p0 + row0 + T.int64(r) < n:
            for lane in T.vectorized(width * KEYS):
                out[b, query[row0 + r], h, column + lane] = _rounded(dtype, context[r, lane] * row_scale[row0 + r])


@T.macro
def tile_context(
    out,
    out_acc,
    probs,
    values,
    row_scale,
    span,
    begin,
    end,
    query,
    b,
    h,
    p0,
    n,
    block0,
    tile_blocks,
    head_dim,
    rows,
    cols,
    group,
    features,
    acc_dtype,
    dtype,
    dot,
):
    """:func:`cpu.attention._attention_tile_context` for the dot product's operands on AMX: out row r
    = row_scale[r] * sum over the tile's computed columns of probs . value rows, 16 rows x 64
    features per pass (four result tiles), 32 keys per instruction (the probabilities are 0 outside
    each row's valid keys, the value rows zero outside the sequence). The computed columns are
    whole blocks of 16 keys; an odd count of them ends on half a chunk, which runs from copies
    padded with zeros (probabilities and value rows alike, so that nothing outside is read)."""
    context = T.alloc_local((ROWS, 4 * KEYS), acc_dtype, annotations=_ON_STACK)
    padded_probs = T.alloc_local((ROWS, PAIRS), "int32", annotations=_ON_STACK)
    padded_values = T.decl_buffer((T.int64(PAIRS), head_dim), "int32")
    first_pair: T.let = tile_blocks[0] * T.int64(cols // 2)
    pairs: T.let = (tile_blocks[1] - tile_blocks[0]) * T.int64(cols // 2)
    chunks: T.let = pairs // T.int64(PAIRS)
    half_chunk: T.let = pairs % T.int64(PAIRS) != T.int64(0)
    pair_row0: T.let = block0 * T.int64(cols)  # packed row of probs column 0 (pairs: every other row)
    if half_chunk:
        for i in range(PAIRS):
            for vector in range(head_dim // T.int64(KEYS)):
                for lane in T.vectorized(KEYS):
                    padded_values[i, vector * T.int64(KEYS) + lane] = T.Select(
                        i < PAIRS // 2,
                        values[
                            pair_row0 + (first_pair + chunks * T.int64(PAIRS) + T.int64(i % (PAIRS // 2))) * T.int64(2),
                            vector * T.int64(KEYS) + lane,
                        ],
                        0,
                    )
    for g in range(rows // ROWS):
        row0: T.let = g * ROWS
        if half_chunk:
            for r in range(ROWS):
                for i in T.vectorized(PAIRS):
                    padded_probs[r, i] = T.Select(
                        i < PAIRS // 2,
                        probs[
                            row0 + r, first_pair + chunks * T.int64(PAIRS) + T.Cast("int64", i) % T.int64(PAIRS // 2)
                        ],
                        0,
                    )
        for feature_tile in range(head_dim // T.int64(4 * KEYS)):
            _context_pass(
                out,
                context,
                probs,
                values,
                padded_probs,
                padded_values,
                row_scale,
                query,
                b,
                h,
                p0,
                n,
                row0,
                first_pair,
                chunks,
                half_chunk,
                pair_row0,
                feature_tile * T.int64(4 * KEYS),
                4,
                dtype,
            )
        if head_dim % T.int64(4 * KEYS) != T.int64(0):
            _context_pass(
                out,
                context,
                probs,
                values,
                padded_probs,
                padded_values,
                row_scale,
                query,
                b,
                h,
                p0,
                n,
                row0,
                first_pair,
                chunks,
                half_chunk,
                pair_row0,
                head_dim - T.int64(2 * KEYS),
                2,
                dtype,
            )


@T.macro
def _key_sums_pass(total, weights, tile_rows, operand, square, scratch, first, start, width, rows, column, tiles):
    """Features [column, column + 16 * tiles) of the key sums (:func:`tile_key_sums`): the tile rows'
    pairs for them transposed feature-major (the A tiles; 16 x 16 words at a time in registers,
    ``square`` and ``scratch``), then per block of 16 keys the ``tiles`` result tiles loaded, every
    16 row pairs' product added, stored."""
    weights_stride: T.let = T.int64(4) * weights.shape[1]
    for chunk in range(rows // (2 * PAIRS)):
        for j in range(tiles):
            for i in range(PAIRS):
                for f in T.vectorized(KEYS):
                    square[i, f] = tile_rows[chunk * PAIRS + i, column + T.int64(j * KEYS) + f]
            _transpose_square(square, scratch, KEYS)
            for f in T.unroll(KEYS):
                for i in T.vectorized(PAIRS):
                    operand[chunk, j, f, i] = square[f, i]
    for block in range(width // T.int64(KEYS)):
        key_block: T.let = (first + start) // T.int64(KEYS) + block
        for j in T.unroll(tiles):
            _load(j, T.address_of(total[key_block, column + T.int64(j * KEYS), 0]), T.int64(4 * KEYS))
        for chunk in range(rows // (2 * PAIRS)):
            _load(4, T.address_of(weights[chunk * PAIRS, start + block * T.int64(KEYS)]), weights_stride)
            for j in T.unroll(tiles):
                _load(5 + j % 3, T.address_of(operand[chunk, j, 0, 0]), T.int64(4 * PAIRS))
                _multiply(j, 5 + j % 3, 4)
        for j in T.unroll(tiles):
            _store(j, T.address_of(total[key_block, column + T.int64(j * KEYS), 0]), T.int64(4 * KEYS))


@T.macro
def tile_key_sums(
    total, weights, tile_rows, first, start, width, head_dim, rows, keys, features, key_acc, acc_dtype, dot
):
    """:func:`cpu.attention._accumulate_keys` for the dot product's operands on AMX, into sums laid
    out feature-major per block of 16 keys (``total[t // 16, f, t % 16]``): the backward's dV += P^T dO
    and dK += dS^T Q as dV^T += dO^T P, so that the band-wide operand (P or dS as pairs of tile rows,
    ``weights[i, c]``) is a B tile as it stands and only the tile's own rows (``tile_rows[i, f]``,
    pairs of rows) are transposed, 16 x 16 words per A tile. Each result tile (16 features x 16
    keys, contiguous) is loaded, takes one product per 32 tile rows, and is stored: ``rows`` a
    multiple of 32."""
    operand = T.alloc_local((rows // (2 * PAIRS), 4, KEYS, PAIRS), "int32", annotations=_ON_STACK)
    square = T.alloc_local((KEYS, PAIRS), "int32", annotations=_ON_STACK)
    scratch = T.alloc_local((KEYS, PAIRS), "int32", annotations=_ON_STACK)
    for feature_tile in range(head_dim // T.int64(4 * KEYS)):
        _key_sums_pass(
            total,
            weights,
            tile_rows,
            operand,
            square,
            scratch,
            first,
            start,
            width,
            rows,
            feature_tile * T.int64(4 * KEYS),
            4,
        )
    if head_dim % T.int64(4 * KEYS) != T.int64(0):
        _key_sums_pass(
            total,
            weights,
            tile_rows,
            operand,
            square,
            scratch,
            first,
            start,
            width,
            rows,
            head_dim - T.int64(2 * KEYS),
            2,
        )


AMX_PRODUCTS = TileProducts(
    scores=tile_scores,
    context=tile_context,
    key_sums=tile_key_sums,
    feature_major_sums=True,
    task_begin=_configure,
    task_end=_release,
)
