"""x86-64 CPU schedules: parallel over (batch, query) rows, 16-lane vectors over head_dim.

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``
(64). The feature loop is split by that factor without a guard, which is what
lets it vectorise with a symbolic head_dim (a guard inside a vectorised loop
scalarises it); the runtime zero-pads features when needed (exact: zero
features add nothing to a dot product, and padded output features are dropped).

- qk (keys packed residue-major by ``compute.qk(pack_keys=True)``): per
  (batch, head) and query, the band is a contiguous run of packed keys, so
  tiles of 4 x 16 band columns accumulate in registers with one broadcast of
  the query feature and four vector FMAs per feature.
- pv / transposed (rows packed residue-major by ``pack_rows=True``): per query,
  a tile of 4 x 16 features stays in registers while the band's rows, now
  consecutive, stream through: one broadcast of the band value and four vector
  FMAs per band column.
GEMM-like tiling (reuse across queries) is the next step; see bench/NOTES.md.
"""

from __future__ import annotations

import tvm
from tvm import s_tir

LANES = 16             # float32 lanes of a 512-bit vector (two 256-bit ones on AVX2)
BAND_VECTORS = 4       # qk: band columns of one register tile, 4 x 16
FEATURE_VECTORS = 4    # pv / transposed: features of one register tile, 4 x 16
FEATURE_MULTIPLE = LANES * FEATURE_VECTORS  # head_dim the kernels accept (the runtime zero-pads)
COMPUTE_OPTIONS = {  # the formulation each op's schedule expects (tvm_kernels.compute)
    "qk": {"pack_keys": True},
    "pv": {"pack_rows": True},
    "transposed": {"pack_rows": True},
}


def _schedule_packed_qk(sch: s_tir.Schedule) -> None:
    for table in ("key_table", "base"):
        sch.parallel(sch.get_loops(sch.get_sblock(table))[0])
    b, h, f, t = sch.get_loops(sch.get_sblock("packed"))
    sch.reorder(t, f)  # read each key row once, contiguously
    sch.parallel(sch.fuse(b, h))
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.set_scope(acc, 0, "local")
    b, i, h, j, f = sch.get_loops(acc)
    sch.reorder(h, i)  # one head's packed keys stay in cache across its queries
    sch.parallel(sch.fuse(b, h))
    # The tile may run past the band's end: those columns read the zero margin and are not stored.
    tile, vector, lane = sch.split(j, [None, BAND_VECTORS, LANES], disable_predication=True)
    sch.reorder(f, vector, lane)
    sch.unroll(vector)
    sch.vectorize(lane)
    sch.reverse_compute_at(out, tile)
    sch.decompose_reduction(acc, f)


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
    if op == "qk":
        _schedule_packed_qk(sch)
    else:
        _schedule_packed_rows(sch)
    return sch.mod
