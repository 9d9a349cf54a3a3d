"""Schedules: *how* each banded product runs on a target. One module (or package) per target.

A module either schedules the definitions of :mod:`tvm_kernels.compute` with
``schedule(op, func) -> tvm.IRModule`` (loop structure, parallelism and
vectorisation only, never the math), or, where schedule primitives cannot express
the loop nest it needs, writes an op's kernel directly in TIR: ``HAND_WRITTEN``
maps an op to a function of ``(dtype, autoregressive, isa)`` returning a
PrimFunc with the same arguments and results as the definition. Both targets do the
latter today: the ``cpu`` package (one module per kernel family and one of shared
micro-kernel macros; there also the fused local-attention ops, which compose the
definitions) and the ``cuda`` package (shared-memory tiles of the three products, and the
fused local attention on FMAs and on tensor cores; one module per kernel family, shared tiles
and helpers in ``common.py``). ``FEATURE_MULTIPLE`` is the module's contract on head_dim (the
runtime zero-pads to it); optional ``PASS_CONFIG`` holds TVM pass options for compiling the
module's kernels.
"""
