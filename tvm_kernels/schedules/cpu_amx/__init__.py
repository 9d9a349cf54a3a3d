"""The bfloat16 library for x86 CPUs with AMX (Intel since Sapphire Rapids): ``cpu-avx512``'s
kernels, with the fused local attention's forward and backward and the band products on AMX tiles
(matrix.py, band.py).

Everything else is the AVX-512 FMA kernels of schedules/cpu, built for this target as they are
for ``cpu-avx512`` (on these Intel cores the FMAs beat ``vdpbf16ps``, which issues at half their
rate: bench/NOTES.md). The fused kernels are schedules/cpu/attention.py's bfloat16 ones with the
AVX512-BF16 operand packing (bf16_dot.py) and their tile products on AMX (the forward's Q.K^T and
P.V; the backward's Q.K^T, dO.V^T, dS.K and the dV, dK sums); the band products (band.py) are
built from the same tile products and packing.
"""

from __future__ import annotations

from tvm_kernels.schedules import cpu
from tvm_kernels.schedules.cpu.attention import attention as _attention
from tvm_kernels.schedules.cpu.attention import attention_backward as _attention_backward
from tvm_kernels.schedules.cpu.tiles import tiles_for
from tvm_kernels.schedules.cpu_amx import band, matrix

FEATURE_MULTIPLE = cpu.FEATURE_MULTIPLE  # head_dim: a multiple of 32, whole AMX reductions too
PASS_CONFIG = cpu.PASS_CONFIG

_VECTOR_ISA = "avx512"  # the kernels not on AMX
_PACKING_ISA = "avx512-bf16"  # the fused kernels' operands: bfloat16 pairs (bf16_dot.py)


def _on_vectors(kernel):
    """``kernel`` (a schedules/cpu builder whose last argument is the ISA) built for AVX-512."""
    return lambda *args: kernel(*args[:-1], _VECTOR_ISA)


def _check_tiles(dtype: str):
    if dtype != "bfloat16":
        raise ValueError(f"AMX kernels take bfloat16 operands, not {dtype}")
    tiles = tiles_for(_PACKING_ISA)
    if tiles.qk_rows % matrix.ROWS or tiles.qk_vectors * 16 != matrix.KEYS:
        raise ValueError(
            f"AMX tiles need query tiles of a multiple of {matrix.ROWS} rows and key blocks of "
            f"{matrix.KEYS} (tiles.py: {tiles})"
        )


def attention(dtype: str, autoregressive: bool, isa: str):
    """The fused forward (cpu/attention.py) with its tile products on AMX; bfloat16 only."""
    _check_tiles(dtype)
    return _attention(dtype, autoregressive, _PACKING_ISA, matrix.AMX_PRODUCTS)


def attention_backward(dtype: str, autoregressive: bool, isa: str):
    """The fused backward (cpu/attention.py) with its five tile products on AMX; bfloat16 only."""
    _check_tiles(dtype)
    rows = tiles_for(_PACKING_ISA).backward_tile_rows
    if rows % (2 * matrix.PAIRS):
        raise ValueError(
            f"AMX key sums need backward tiles of a multiple of {2 * matrix.PAIRS} rows (tiles.py: {rows})"
        )
    return _attention_backward(dtype, autoregressive, _PACKING_ISA, matrix.AMX_PRODUCTS)


def _band_product(op: str):
    """band.py's ``op`` (qk, pv or transposed) as a schedule builder; bfloat16 only."""

    def build(dtype: str, autoregressive: bool, isa: str):
        _check_tiles(dtype)
        return getattr(band, op)(autoregressive)

    return build


HAND_WRITTEN = (
    {op: _on_vectors(kernel) for op, kernel in cpu.HAND_WRITTEN.items()}
    | {op: _band_product(op) for op in ("qk", "pv", "transposed")}
    | {"attention": attention, "attention_backward": attention_backward}
)
