"""CUDA schedules: one thread per output element, 256 threads per block.

Every output element (b, i, h, j) or (b, i, h, f) is flattened into one index
and spread over blocks of 256 threads; each thread keeps its accumulator in a
register and loops over the reduction (head_dim for qk, the band for pv and
transposed). Consecutive threads write consecutive outputs, so stores are
coalesced. "Correct first": tiling through shared memory is a later step.
"""

from __future__ import annotations

import tvm
from tvm import s_tir

THREADS_PER_BLOCK = 256
FEATURE_MULTIPLE = 1  # no constraint on head_dim


def schedule(op: str, func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.set_scope(acc, 0, "local")
    element = sch.fuse(*sch.get_loops(out))
    block, thread = sch.split(element, [None, THREADS_PER_BLOCK])
    sch.bind(block, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    sch.compute_at(acc, thread)
    return sch.mod
