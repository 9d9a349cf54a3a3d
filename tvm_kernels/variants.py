"""The table of what gets built: targets x dtypes, each one library of its target's ops.

A library holds every (op, autoregressive) pair of its target's band ops for one target and one
dtype, named by :func:`function_name` (``qk_symmetric``, ``pv_causal``, ...), and its unbanded ops
under their own names (``dropout``, ``bias_gelu``). Variants are chosen here, at build time, by name; no kernel
switches behaviour on a runtime flag.

This module must stay importable without TVM: the runtime reads the same names
through ``prebuilt/manifest.json``, and the builder and tests read this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from longformer_ops.runtime.manifest import (  # noqa: F401  (the naming contract with the runtime)
    KERNEL_FAMILIES,
    function_name,
    function_names,
    ops_of,
)

# What each library holds comes from the one table of kernel families (longformer_ops/runtime/manifest.py),
# a schedule function per op in each target's schedule module.
OPS = ops_of(["band_products"])  # the three banded products, see tvm_kernels.compute
# Every CPU library builds every family; CUDA those the table marks for it (elsewhere the runtime runs
# torch's ops, or the band products where the fused attention is missing).
CPU_OPS = ops_of(KERNEL_FAMILIES)
CUDA_OPS = ops_of(name for name, family in KERNEL_FAMILIES.items() if family.cuda)


CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")  # SASS for each; PTX of the newest for later GPUs

# /proc/cpuinfo flags each CPU level needs (x86-64-v3 = AVX2 level, x86-64-v4 = AVX-512 level).
_V3_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_V4_FLAGS = _V3_FLAGS + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class KernelTarget:
    name: str  # library directory name and CLI name
    device: str  # torch device type the libraries serve
    tvm_target: dict  # dict-form tvm.target.Target (host in "host" for CUDA)
    schedule_module: str  # tvm_kernels.schedules.<this>
    dtypes: tuple[str, ...]
    preference: int = 0  # higher wins when several targets run on this machine
    cpu_flags: tuple[str, ...] = ()
    # Chosen by itself only on CPUs of these vendors (/proc/cpuinfo's vendor_id; empty: any): where
    # it runs elsewhere but a library of lower preference is faster there. Forcing it still works.
    cpu_vendors: tuple[str, ...] = ()
    cuda_archs: tuple[str, ...] = ()
    isa: str = ""  # CPU instruction set the hand-written kernels tile for (schedules/cpu/tiles.py)
    ops: tuple[str, ...] = OPS  # the functions built: band ops symmetric and causal (function_names)
    extra_sources: tuple[str, ...] = field(default=())
    # Other schedule modules whose kernels its module builds (their files are its sources too).
    uses_schedules: tuple[str, ...] = ()


# Reassociation is not enabled anywhere: partial sums are ordered explicitly by
# the schedules (contraction into FMA is allowed).
_LLVM_COMMON = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "fast-math-contract": True}

TARGETS: dict[str, KernelTarget] = {
    t.name: t
    for t in (
        KernelTarget(
            name="cpu-avx2",
            device="cpu",
            tvm_target={**_LLVM_COMMON, "mcpu": "x86-64-v3"},
            schedule_module="cpu",
            dtypes=("float32", "float64", "float16", "bfloat16"),
            preference=1,
            cpu_flags=_V3_FLAGS,
            isa="avx2",
            ops=CPU_OPS,
        ),
        KernelTarget(
            name="cpu-avx512",
            device="cpu",
            tvm_target={**_LLVM_COMMON, "mcpu": "x86-64-v4"},
            schedule_module="cpu",
            dtypes=("float32", "float64", "float16", "bfloat16"),
            preference=2,
            cpu_flags=_V4_FLAGS,
            isa="avx512",
            ops=CPU_OPS,
        ),
        # bfloat16 only: what differs from cpu-avx512 is bfloat16 arithmetic (vdpbf16ps); the other
        # dtypes' libraries would be cpu-avx512's again. Chosen on AMD only: on the Zen 4 a vdpbf16ps
        # does twice an FMA's products at the FMAs' rate; on an Intel Emerald Rapids it issues once
        # every two cycles where FMAs issue twice a cycle (half the FMAs' products per second), and
        # the fused attention in bfloat16 took 1.2-1.4x float32's time there, 1.3-1.5x cpu-avx512's
        # bfloat16 (bench/NOTES.md; Intel's other AVX512-BF16 cores not measured, assumed alike).
        KernelTarget(
            name="cpu-avx512-bf16",
            device="cpu",
            tvm_target={**_LLVM_COMMON, "mcpu": "x86-64-v4", "mattr": ["+avx512bf16"]},
            schedule_module="cpu",
            dtypes=("bfloat16",),
            preference=3,
            cpu_flags=_V4_FLAGS + ("avx512_bf16",),
            cpu_vendors=("AuthenticAMD",),
            isa="avx512-bf16",
            ops=CPU_OPS,
        ),
        # bfloat16 only, on CPUs with AMX (Intel since Sapphire Rapids): cpu-avx512's kernels with the
        # fused attention and the band products on AMX tiles (schedules/cpu_amx). Needs the process's
        # permission to use tile data, which the loader requests before choosing it (longformer_ops/runtime/loader.py).
        KernelTarget(
            name="cpu-amx",
            device="cpu",
            tvm_target={**_LLVM_COMMON, "mcpu": "x86-64-v4", "mattr": ["+avx512bf16", "+amx-tile", "+amx-bf16"]},
            schedule_module="cpu_amx",
            dtypes=("bfloat16",),
            preference=4,
            cpu_flags=_V4_FLAGS + ("avx512_bf16", "amx_tile", "amx_bf16"),
            isa="amx",
            ops=CPU_OPS,
            uses_schedules=("cpu",),
        ),
        KernelTarget(
            name="cuda",
            device="cuda",
            tvm_target={"kind": "cuda", "arch": CUDA_ARCHS[0]},
            schedule_module="cuda",
            dtypes=("float32", "float16", "bfloat16"),
            cuda_archs=CUDA_ARCHS,
            ops=CUDA_OPS,
            extra_sources=("cuda_toolchain.py",),
        ),
    )
}

_HERE = Path(__file__).resolve().parent

# Source files (relative to tvm_kernels/) whose content decides a target's libraries.
COMMON_SOURCES = ("compute.py", "variants.py", "build.py")


def _schedule_files(module: str) -> tuple[str, ...]:
    """A schedule module's files: the module, or every file of its package."""
    package = _HERE / "schedules" / module
    if package.is_dir():
        return tuple(sorted(f"schedules/{module}/{p.name}" for p in package.glob("*.py")))
    return (f"schedules/{module}.py",)


def sources_of(target: KernelTarget) -> tuple[str, ...]:
    """The files (relative to tvm_kernels/) a target's libraries are built from: the common ones,
    its schedule module's, those of the modules it uses, and its extras."""
    schedules = [f for module in (target.schedule_module, *target.uses_schedules) for f in _schedule_files(module)]
    return COMMON_SOURCES + tuple(schedules) + target.extra_sources


def library_name(target: KernelTarget, dtype: str) -> str:
    return f"{target.name}/longformer_{dtype}.so"
