"""x86-64 CPU kernels: Q.K^T and probs.V hand-written in TIR, transposed scheduled from TE.

- qk, pv: GEMM-like register tiles over residue classes, written directly in TIR
  (``cpu_tiled.py``; why there, not as a schedule, is explained in its docstring).
- transposed (rows packed residue-major by ``compute.transposed(pack_rows=True)``):
  per query, a tile of 4 x 16 features stays in registers while the band's rows,
  now consecutive, stream through: one broadcast of the band value and four vector
  FMAs per band column. No reuse across queries yet; see bench/NOTES.md.

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``
(64). Feature loops are split by that factor without a guard, which is what
lets them vectorise with a symbolic head_dim (a guard inside a vectorised loop
scalarises it); the runtime zero-pads features when needed (exact: zero
features add nothing to a dot product, and padded output features are dropped).
"""

from __future__ import annotations

import tvm
from tvm import s_tir

from tvm_kernels.schedules import cpu_tiled

LANES = 16             # float32 lanes of a 512-bit vector (two 256-bit ones on AVX2)
FEATURE_VECTORS = 4    # pv / transposed: features of one register tile, 4 x 16
FEATURE_MULTIPLE = LANES * FEATURE_VECTORS  # head_dim the kernels accept (the runtime zero-pads)
HAND_WRITTEN = {"qk": cpu_tiled.qk, "pv": cpu_tiled.pv}  # GEMM-like tiles over residue classes: see cpu_tiled.py
# cpu_tiled keeps its register tiles on the stack through an allocation annotation that
# StorageRewrite would drop (the tiles would then become heap workspaces, 3x slower).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}
COMPUTE_OPTIONS = {  # the formulation each scheduled op expects (tvm_kernels.compute)
    "pv": {"pack_rows": True},
    "transposed": {"pack_rows": True},
}


def _schedule_packed_rows(sch: s_tir.Schedule) -> None:
    for table in ("key_table", "base"):
        sch.parallel(sch.get_loops(sch.get_sblock(table))[0])
    b, h, t, f = sch.get_loops(sch.get_sblock("packed"))
    sch.parallel(sch.fuse(b, h))
    sch.vectorize(sch.split(f, [None, LANES], disable_predication=True)[1])
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.set_scope(acc, 0, "local")
    b, i, h, f, j = sch.get_loops(acc)
    sch.reorder(h, i)
    sch.parallel(sch.fuse(b, h))
    # 4 x 16 features in registers (4 independent FMA chains), band columns streamed over them.
    tile, vector, lane = sch.split(f, [None, FEATURE_VECTORS, LANES], disable_predication=True)
    sch.reorder(tile, j, vector, lane)
    sch.unroll(vector)
    sch.vectorize(lane)
    sch.reverse_compute_at(out, tile)
    sch.decompose_reduction(acc, j)


def schedule(op: str, func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    _schedule_packed_rows(sch)
    return sch.mod
