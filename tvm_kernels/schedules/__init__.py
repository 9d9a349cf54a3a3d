"""Schedules: *how* each banded product runs on a target. One module per target.

Each module exposes ``schedule(op, func) -> tvm.IRModule`` that takes a PrimFunc
from :mod:`tvm_kernels.compute` and returns it scheduled, and optionally
``COMPUTE_OPTIONS`` (op -> keyword arguments of the definition) when it expects
another formulation of the same product (e.g. keys packed for the CPU). The math
is never changed here, only loop structure, parallelism and vectorisation.
"""
