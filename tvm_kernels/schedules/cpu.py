"""x86-64 CPU schedules: parallel over (batch, query) rows, 16-lane vectors over head_dim.

Contract with the runtime: ``head_dim`` is a multiple of ``FEATURE_MULTIPLE``.
The feature loop is split by that factor without a guard, which is what lets it
vectorise with a symbolic head_dim; the runtime zero-pads features when needed
(exact: zero features add nothing to a dot product, and padded output features
are dropped).

- qk: each band element is a dot product over head_dim; the reduction is
  rfactored into 16 lanes (vector FMAs), then summed across lanes.
- pv / transposed: one output row [head_dim] per (b, i, h) accumulates band
  column by band column (a vector axpy per column).
These are "correct first" schedules; GEMM-like tiling is a later step.
"""

from __future__ import annotations

import tvm
from tvm import s_tir

FEATURE_MULTIPLE = 16


def schedule(op: str, func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    b, i, h, inner = sch.get_loops(out)
    sch.parallel(sch.fuse(b, i))
    if op == "qk":
        _, lanes = sch.split(sch.get_loops(acc)[-1], [None, FEATURE_MULTIPLE], disable_predication=True)
        partial = sch.rfactor(lanes, 4)  # [b, n, h, c, 16] partial sums
        sch.set_scope(partial, 0, "local")
        sch.set_scope(acc, 0, "local")
        sch.compute_at(acc, inner)
        sch.compute_at(partial, inner)
        lane, chunk = sch.get_loops(partial)[-2:]
        sch.reorder(chunk, lane)
        sch.vectorize(lane)
        sch.decompose_reduction(partial, chunk)
    else:
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
