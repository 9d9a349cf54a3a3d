"""Schedules: *how* each banded product runs on a target. One module per target.

Each module exposes ``schedule(op, func) -> tvm.IRModule`` that takes a PrimFunc
from :mod:`tvm_kernels.compute` and returns it scheduled. The math is never
changed here, only loop structure, parallelism and vectorisation.
"""
