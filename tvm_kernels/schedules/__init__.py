"""Schedules: *how* each banded product runs on a target. One module per target.

Each module exposes ``schedule(op, func) -> tvm.IRModule`` that takes a PrimFunc
from :mod:`tvm_kernels.compute` and returns it scheduled, and optionally
``COMPUTE_OPTIONS`` (op -> keyword arguments of the definition) when it expects
another formulation of the same product (e.g. rows packed for the CPU). The math
is never changed here, only loop structure, parallelism and vectorisation.

A module may also write an op's kernel directly in TIR when schedule primitives
cannot express the loop nest it needs: ``HAND_WRITTEN`` (op -> function of
``(dtype, autoregressive, vector_bits)`` returning a PrimFunc with the same
arguments and results as the definition), and ``PASS_CONFIG`` (TVM pass options
for compiling the module's kernels).
"""
