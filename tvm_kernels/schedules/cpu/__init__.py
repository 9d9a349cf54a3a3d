"""x86-64 CPU kernels: the three banded products and fused local attention, hand-written in TIR,
GEMM-like tiles for any dilation.

Why not TE schedules: the fast loop nests run over *residue classes* whose size
depends on each head's runtime dilation, compute dense tiles wider than the band
and store them skewed into the band layout. Schedule primitives cannot reorder a
TE output that way (bench/NOTES.md has the schedules tried first), so these kernels
are written directly in TIR (TVMScript). Each computes exactly its definition in
:mod:`tvm_kernels.compute` and is tested against the same plain references.

Common structure: the parallel loop's tasks are (batch, head, run), a run being a range of
consecutive query tiles (one per (batch, head) unless there are more threads than pairs:
``microkernels._run_tiles``). Each task packs the part of the second operand it reads
residue-major (dilation d: rows r, r+d, r+2d, ... for r = 0..d-1, with zero
margins). In packed order every query's band is a run of consecutive rows, for
any dilation: dilation d is d interleaved undilated problems laid end to end.
Then tiles of ``rows`` consecutive packed queries run a register-blocked
micro-kernel (bench/NOTES.md has every variant measured):

- qk (16 rows x 1 vector of accumulators on AVX-512, 6 x 2 on AVX2): keys packed in
  blocks of ``cols`` (one tile width), transposed so that for a fixed feature a
  block's keys are contiguous. Per feature: one broadcast per row, one load per
  vector, one FMA per row and vector. A block's result for a row whose columns there
  are all valid is stored straight into the output row (those stores overlap the next
  blocks' FMAs); the rest goes, skewed by its row, into a small row buffer, from which
  the row's remaining columns are copied, ``padding`` outside the sequence.
- pv / transposed (8 x 2 vectors on AVX-512, 4 x 4 for half types when head_dim is a
  multiple of 64; 6 x 2 on AVX2): for a tile whose rows are consecutive in one residue
  class, the keys inside the sequence are the same packed rows for every row, so the
  FMA loop reads its weights straight from the band
  (for transposed: from *other* rows' bands) with loop bounds instead of masks. Tiles
  across classes or past the end first gather their weights, zeroed at invalid keys,
  into a small buffer. The output features accumulate in registers while the packed
  rows the tile touches stream through once. On AVX2 the direct loop runs in chunks of 32
  steps, every feature tile of a chunk before the next one (a chunk's band lines stay in
  L1), and half types convert a chunk's weights once into a small float32 buffer.
- attention: the qk micro-kernel writes a tile's scores into a buffer that stays in cache, the
  softmax runs there, and the pv micro-kernel streams the value rows once; no band in memory
  (see :func:`attention`). Its backward recomputes each tile's probabilities from the forward's
  row log-sum-exp and accumulates dK and dV in packed rows (:func:`attention_backward`).
- bfloat16 on CPUs with AVX512-BF16 (the ``avx512-bf16`` ISA, library ``cpu-avx512-bf16``): the
  three products take two features (Q.K^T) or two keys (probs.V, transposed) per step with
  ``vdpbf16ps``, operands packed as 32-bit pairs (bf16_dot.py); so do the fused kernels' products
  (two in the forward, five in the backward), their probabilities and dS rounded to bfloat16.
- dropout of hidden states: the attention dropout's counter-based mask over a ``[rows, cols]``
  tensor in one vectorised pass; with a dense layer's bias and the residual added in the same
  pass, and, backward, with the gradient's column sums (dropout.py).
- the FFN's bias and exact GELU over a ``[rows, cols]`` GEMM output, and its backward, one
  vectorised pass each with a rational erf (gelu.py).
- the layer's merge of global keys into the band's attention, and its backward's sums, one pass
  each over ``[b, n, h, d]`` (global_merge.py).
- layer normalisation over a ``[rows, cols]`` tensor's rows, and its backward with the weight's
  and bias's gradients summed on the way (layer_norm.py).
- products of a few rows with a matrix, ``a @ b`` and ``a @ b^T``, half types widened in registers:
  a generation step's attention over its key/value cache (few_rows.py).

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``
(feature loops run over whole vectors or register tiles; the runtime zero-pads,
which is exact). Scratch per task: the packed rows (about one run's share
of a head's slice of the input; the attention backward also its dK and dV sums, and
with several runs the parts of them at the runs' edges), a row table and a per-tile buffer;
accumulators live in registers.
"""

from __future__ import annotations

from tvm_kernels.schedules.cpu.attention import attention, attention_backward
from tvm_kernels.schedules.cpu.band_times_rows import pv, transposed
from tvm_kernels.schedules.cpu.dropout import bias_dropout_add, dropout, dropout_column_sums
from tvm_kernels.schedules.cpu.few_rows import few_rows_mm, few_rows_mm_nt
from tvm_kernels.schedules.cpu.gelu import bias_gelu, bias_gelu_backward
from tvm_kernels.schedules.cpu.global_merge import global_merge, global_merge_backward
from tvm_kernels.schedules.cpu.layer_norm import layer_norm, layer_norm_backward
from tvm_kernels.schedules.cpu.qk import qk
from tvm_kernels.schedules.cpu.softmax import softmax, softmax_backward

FEATURE_MULTIPLE = 32  # head_dim: whole vectors for qk, whole 2-vector tiles for pv / transposed (32 float32 lanes on AVX-512; the others divide it)
# The per-tile buffers stay on the stack only with StorageRewrite off (microkernels._ON_STACK).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}

HAND_WRITTEN = {
    "qk": qk,
    "pv": pv,
    "transposed": transposed,
    "attention": attention,
    "attention_backward": attention_backward,
    "softmax": softmax,
    "softmax_backward": softmax_backward,
    "dropout": dropout,
    "bias_dropout_add": bias_dropout_add,
    "dropout_column_sums": dropout_column_sums,
    "bias_gelu": bias_gelu,
    "bias_gelu_backward": bias_gelu_backward,
    "global_merge": global_merge,
    "global_merge_backward": global_merge_backward,
    "layer_norm": layer_norm,
    "layer_norm_backward": layer_norm_backward,
    "few_rows_mm": few_rows_mm,
    "few_rows_mm_nt": few_rows_mm_nt,
}
# (the dropouts, the GELU, the merge, the layer norm and the few-row products have no band: (dtype, isa),
# one function each)
