"""x86-64 CPU schedules: parallel over (batch, query) rows, 16-lane vectors over head_dim.

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``.
The feature loop is split by that factor without a guard, which is what lets it
vectorise with a symbolic head_dim; the runtime zero-pads features when needed
(exact: zero features add nothing to a dot product, and padded output features
are dropped).

- qk (keys packed residue-major by ``compute.qk(pack_keys=True)``): per
  (batch, head) and query, the band is a contiguous run of packed keys, so
  tiles of 4 x 16 band columns accumulate in registers with one broadcast of
  the query feature and four vector FMAs per feature.
- pv / transposed: one output row [head_dim] per (b, i, h) accumulates band
  column by band column (a vector axpy per column).
These are "correct first" schedules; GEMM-like tiling is a later step.
"""

from __future__ import annotations

import tvm
from tvm import s_tir

FEATURE_MULTIPLE = 16
LANES = 16          # float32 lanes of a 512-bit vector (two 256-bit ones on AVX2)
BAND_VECTORS = 4    # band columns of one register tile: 4 x 16
COMPUTE_OPTIONS = {"qk": {"pack_keys": True}}  # formulation each op needs (tvm_kernels.compute)


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


def schedule(op: str, func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    if op == "qk":
        _schedule_packed_qk(sch)
        return sch.mod
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    b, i, h, inner = sch.get_loops(out)
    sch.parallel(sch.fuse(b, i))
    # pv / transposed: acc row [head_dim] per (b, i, h), band columns outside, features inside.
    sch.set_scope(acc, 0, "local")
    sch.compute_at(acc, h)
    f, j = sch.get_loops(acc)[-2:]
    sch.reorder(j, f)
    _, lanes = sch.split(f, [None, FEATURE_MULTIPLE], disable_predication=True)
    sch.vectorize(lanes)
    sch.decompose_reduction(acc, j)
    _, out_lanes = sch.split(inner, [None, FEATURE_MULTIPLE], disable_predication=True)
    sch.vectorize(out_lanes)
    return sch.mod
