"""The tensor-core kernels' building blocks (attention_mma.py): the fragment layouts of
``mma.sync`` and ``ldmatrix``, the CUDA device functions the kernels call (mma, ldmatrix, quad
shuffles, a base-2 exponential, 16-byte and ``cp.async`` copies, an 8-element dot product; for
float operands each source is a comment, the CPU harness defining the function), the staging of
operands into shared memory, a warp's two products, and a chunk's band as accumulator columns.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call  # a CUDA device function's source, called from TIR
from tvm.script import tirx as T

from tvm_kernels.schedules.cuda.common import QK_KEYS, TILE_ROWS

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
""",
}


# The tensor-core kernels' softmax runs in base 2, as FlashAttention's: scores are scaled by
# scale * log2(e) (the key bias staged times log2(e)), so that each exponential is one
# ``ex2.approx.ftz`` (MUFU.EX2) where expf is eight instructions (its range reduction and
# rounding), and the log-sum-exp is converted back (max * ln 2 + ln(sum)). Its error, 2 ulp, is far
# under the half types' rounding of P. The CPU harness defines its own (std::exp2). (LOG2E and LN2:
# here, above every macro that uses them: a macro sees only the names defined before it.)
LOG2E = 1.4426950408889634  # the tensor-core kernels' base-2 softmax (EXP2_SOURCE)
LN2 = 0.6931471805599453
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
        "}\n"
    )


def _mma(c, c_offset, a, b, b_offset, source: str):
    """c[c_offset:c_offset + 4] += a . b[b_offset:b_offset + 4] on tensor cores (``source``:
    :func:`_mma_source`)."""
    return cuda_func_call(
        "longformer_mma_m16n8k16",
        c.access_ptr("rw", offset=c_offset, extent=4),
        a.access_ptr("r", offset=0, extent=8),
        b.access_ptr("r", offset=b_offset, extent=4),
        source_code=source,
    )


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
        "}\n"
    )


def _ldmatrix(dst, buf, offset, transposed: bool, operand_dtype: str):
    """dst[0:8] = this lane's share of the four matrices whose rows the warp's lanes address, this
    lane's row at buf[offset] (the ldmatrix note by VECTOR)."""
    name = "longformer_ldmatrix_x4" + ("_trans" if transposed else "")
    return cuda_func_call(
        name,
        dst.access_ptr("w", offset=0, extent=8),
        buf.access_ptr("r", offset=offset, extent=8),
        source_code=_ldmatrix_source(operand_dtype, transposed),
    )


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
    "copy": "__device__ __forceinline__ void longformer_copy16("
    "void* dst, const void* row0, int row, int row_bytes) {\n"
    "  const char* src = static_cast<const char*>(row0) + static_cast<long long>(row) * row_bytes;\n"
    "  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);\n}\n",
    "zero": "__device__ __forceinline__ void longformer_zero16(void* dst) {\n"
    "  *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);\n}\n",
    "copy_async": "__device__ __forceinline__ void longformer_copy16_async("
    "void* dst, const void* row0, int row, int row_bytes) {\n"
    "  const char* src = static_cast<const char*>(row0) + static_cast<long long>(row) * row_bytes;\n"
    "  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));\n"
    '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"'
    ' :: "r"(address), "l"(src) : "memory");\n}\n',
    "commit": "__device__ __forceinline__ void longformer_async_commit() {\n"
    '  asm volatile("cp.async.commit_group;" ::: "memory");\n}\n',
    "wait": "__device__ __forceinline__ void longformer_async_wait() {\n"
    '  asm volatile("cp.async.wait_group 0;" ::: "memory");\n}\n',
}
COPY_FUNCTION = {
    "copy": "longformer_copy16",
    "copy_async": "longformer_copy16_async",
    "zero": "longformer_zero16",
    "commit": "longformer_async_commit",
    "wait": "longformer_async_wait",
}


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
    return cuda_func_call(
        "longformer_dot8",
        T.address_of(t1[b, row, h, feature]),
        T.address_of(t2[b, row, h, feature]),
        source_code=source,
        return_type="float32",
    )


@T.macro
def _stage_operand(buf, t, row_of, b, h, feature0, head_dim, tx, operand, base=0, row_base=0, copy="copy"):
    """buf[base + r * OP_STRIDE + f] = t[row_of[row_base + r], feature0 + f] for 64 rows and 64
    features (0 for rows of -1 and features past head_dim, a multiple of FEATURE_MULTIPLE), VECTOR
    elements (16 bytes) per load and store: each row's 8 pieces by 8 consecutive threads (coalesced,
    and in shared memory 8 x 16 bytes of one row per phase: no bank conflict). The inputs' data must
    be 16-byte aligned (longformer_ops.runtime.kernels makes it so). ``copy``: "copy_async" issues the copies
    (the zeros are stored at once); the caller commits and waits (COPY_SOURCE)."""
    for e in T.unroll(QK_KEYS * FEATURE_BLOCK // VECTOR // MMA_THREADS):
        r: T.let = (tx + e * MMA_THREADS) // (FEATURE_BLOCK // VECTOR)
        f: T.let = (tx + e * MMA_THREADS) % (FEATURE_BLOCK // VECTOR) * VECTOR
        feature: T.let = feature0 + T.Cast("int64", f)
        row: T.let = row_of[row_base + r]  # (bound: a condition may not read shared memory)
        if row >= T.int64(0) and feature < head_dim:
            T.evaluate(
                cuda_func_call(
                    COPY_FUNCTION[copy],
                    buf.access_ptr("w", offset=base + r * OP_STRIDE + f, extent=VECTOR),
                    T.address_of(t[b, T.int64(0), h, feature]),
                    T.Cast("int32", row),
                    T.Cast("int32", t.shape[2] * t.shape[3] * T.int64(_element_bytes(t.dtype))),
                    source_code=_copy_source(operand, copy),
                )
            )
        else:
            T.evaluate(
                cuda_func_call(
                    "longformer_zero16",
                    buf.access_ptr("w", offset=base + r * OP_STRIDE + f, extent=VECTOR),
                    source_code=_copy_source(operand, "zero"),
                )
            )


@T.macro
def _rows_times_rows(acc, rows, others, a_frag, b_frag, warp_row, lo, m1, m2, operand, source, others_base=0):
    """acc += this warp's 16 rows of ``rows`` times all 64 rows of ``others`` (from ``others_base``)
    transposed, over one staged block of 64 features (both [row, feature] in shared memory; fragments
    by ldmatrix): 8 accumulator tiles of 16 x 8 (Q.K^T, dO.V^T, and in the key-major kernel K.Q^T,
    V.dO^T)."""
    for step in T.unroll(FEATURE_BLOCK // 16):
        T.evaluate(_ldmatrix(a_frag, rows, (warp_row + m1 * 8 + lo) * OP_STRIDE + step * 16 + m2 * 8, False, operand))
        for pair in T.unroll(QK_KEYS // 16):
            T.evaluate(
                _ldmatrix(
                    b_frag,
                    others,
                    others_base + (pair * 16 + m2 * 8 + lo) * OP_STRIDE + step * 16 + m1 * 8,
                    False,
                    operand,
                )
            )
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
            T.evaluate(
                _ldmatrix(
                    b_frag, rows, rows_base + (step * 16 + m1 * 8 + lo) * OP_STRIDE + pair * 16 + m2 * 8, True, operand
                )
            )
            T.evaluate(_mma(acc, pair * 8, a_frag, b_frag, 0, source))
            T.evaluate(_mma(acc, pair * 8 + 4, a_frag, b_frag, 4, source))


def _quad(reduction: str, x):
    """The maximum or sum of x over this thread's quad."""
    return cuda_func_call(f"longformer_quad_{reduction}", x, source_code=QUAD_SOURCE[reduction], return_type="float32")


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
        spans[(base + tx) * T.int64(2)] = T.Select(
            has_row,
            T.Cast("int32", T.min(T.max(valid_from[base + tx] + shift, T.int64(0)), T.int64(QK_KEYS))),
            T.int32(QK_KEYS),
        )
        spans[(base + tx) * T.int64(2) + T.int64(1)] = T.Select(
            has_row,
            T.Cast("int32", T.min(T.max(valid_to[base + tx] + shift, T.int64(0)), T.int64(QK_KEYS))),
            T.int32(0),
        )


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
