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

Modules: ``common`` (tile sizes, packed positions, the tile's row tables, the soft-cap, the float32
qk micro-kernel), ``band`` (qk, pv, transposed), ``attention_fma`` (the float32 fused forward and
backward kernels), ``mma`` (the tensor-core kernels' fragment layouts, PTX device functions and
staging), ``attention_mma`` (the half types' fused kernels on tensor cores) and ``attention`` (the
fused ops, choosing between the two). This package re-exports every public name of the single
module it was split from (``schedules/cuda.py``).
"""

from __future__ import annotations

from tvm_kernels.schedules.cuda.attention import attention, attention_backward
from tvm_kernels.schedules.cuda.attention_fma import attention_fma  # noqa: F401  (re-exported)
from tvm_kernels.schedules.cuda.attention_mma import attention_mma  # noqa: F401  (re-exported)
from tvm_kernels.schedules.cuda.band import pv, qk, transposed

# FEATURE_MULTIPLE: the build's contract on head_dim; the other constants re-exported.
from tvm_kernels.schedules.cuda.common import (  # noqa: F401
    F_STRIDE,
    FEATURE_MULTIPLE,
    INNER,
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
)
from tvm_kernels.schedules.cuda.mma import (  # noqa: F401  (re-exported)
    COPY_FUNCTION,
    COPY_SOURCE,
    DOT8_SOURCE,
    DOT8_TYPES,
    DYNAMIC_OPERAND_ROWS,
    EXP2_SOURCE,
    FEATURE_BLOCK,
    LN2,
    LOG2E,
    MMA_PTX_TYPE,
    MMA_THREADS,
    OP_STRIDE,
    QUAD_SOURCE,
    VECTOR,
    WARP,
    WARP_ROWS,
    dynamic_shared_bytes,
)

HAND_WRITTEN = {
    "qk": qk,
    "pv": pv,
    "transposed": transposed,
    "attention": attention,
    "attention_backward": attention_backward,
}
