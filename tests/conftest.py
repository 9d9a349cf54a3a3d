"""Shared test helpers: devices, dtypes, the comparison rules and their per-dtype bounds, seeds.

Two rules, both tested against injected faults in test_tolerances.py: band products elementwise
against the products on |inputs| (TOLERANCE) and norm-wise; attention results and gradients
norm-wise (NORMWISE_UNITS, in units of the dtype's unit roundoff). Every test's torch generator is
seeded from its id (printed on failure); generators made in tests take stable_seed of their case.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from longformer_ops.nn import dense
from longformer_ops.runtime import kernels
from longformer_ops.runtime import loader as _loader

CUDA = torch.cuda.is_available()

# Tolerance per dtype, relative to the sum of |terms| of each output (the natural scale of a
# dot product's rounding error); the single table every kernel test uses.
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.float16: 2e-3,  # output rounding 2^-11, float32 accumulation
    torch.bfloat16: 1e-2,  # output rounding 2^-8, float32 accumulation
}

CPU_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# Norm-wise bounds for attention results and gradients against the float64 reference on the same
# (rounded) inputs, in units of the dtype's unit roundoff u = eps / 2: (results, gradients).
# Measured worst over test_attention's grid (dilations 1..8, both modes, key padding, dropout,
# return_lse, n up to 700): results float64 7.1 u, float32 15.6 u (accumulation over the band's
# hundreds of terms; the float64 reference's own rounding counts at float64), float16 / bfloat16
# 0.46 u (the output's own rounding: the kernels accumulate in float32); gradients float64 29.9 u,
# float32 23.3 u, float16 3.8 u, bfloat16 4.1 u (dS rounded to the input type inside the backward,
# then summed: rows that cancel keep that rounding). Each bound is 2-3x the worst seen.
NORMWISE_UNITS = {torch.float64: (16, 64), torch.float32: (32, 64), torch.float16: (1.5, 8), torch.bfloat16: (1.5, 8)}


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` one element into a storage of its own: not vector-aligned, and for the 16-bit
    types not 4-byte aligned either (the kernels that view bfloat16 as 32-bit pairs)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    assert view.data_ptr() % 8 != 0
    return view.copy_(t)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def normwise_bound(dtype: torch.dtype, gradients: bool = False) -> float:
    """The largest relative error ``||got - ref|| / ||ref||`` the attention checks accept in ``dtype``."""
    return NORMWISE_UNITS[dtype][gradients] * unit_roundoff(dtype)


def assert_normwise_close(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, zero_scale: float, gradients: bool = False
):
    """``||got - ref|| <= normwise_bound(dtype, gradients) * ||ref||`` (Frobenius norms, in float64); no NaN.

    A reference that is exactly zero (every row cancels: a query with a single key has dQ = dK = 0)
    is the one case checked against another scale: ``||got|| <= bound * zero_scale``, the caller's
    size of the terms that cancel.
    """
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    got64, ref64 = got.detach().double().cpu(), ref.detach().double().cpu()
    assert not torch.isnan(got64).any(), f"{what}: NaN"
    bound, ref_norm = normwise_bound(dtype, gradients), float(ref64.norm())
    if ref_norm == 0:
        assert float(got64.norm()) <= bound * zero_scale, (
            f"{what}: reference is 0, got norm {float(got64.norm()):.3e} > {bound:.1e} x {zero_scale:.3e} ({dtype})"
        )
        return
    relative = float((got64 - ref64).norm()) / ref_norm
    units = NORMWISE_UNITS[dtype][gradients]
    assert relative <= bound, (
        f"{what}: norm-wise relative error {relative:.3e} = {relative / unit_roundoff(dtype):.2f} u > {units} u ({dtype})"
    )


def stable_seed(*parts) -> int:
    """A seed from stable values (not ``hash()``, which Python randomises per process)."""
    return zlib.crc32(repr(parts).encode())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (registered in pyproject.toml) need a CUDA GPU: skipped without one."""
    if not CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs a worker per core), one intra-op thread per worker:
    the workers already fill the cores, and OpenMP threads spinning against another process's
    only slow both. Tests about thread counts set their own, or run a fresh interpreter."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded_torch(request):
    """torch's default generator seeded from the test id, so a test drawing from it is reproducible;
    the seed is printed with any failure (see pytest_runtest_makereport)."""
    seed = stable_seed(request.node.nodeid)
    torch.manual_seed(seed)
    request.node.user_properties.append(("torch.manual_seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        seeds = [value for name, value in item.user_properties if name == "torch.manual_seed"]
        report.sections.append(
            (
                "seed",
                f"torch.manual_seed({seeds[0] if seeds else '?'}) from the test id; "
                "generators made in the test are seeded by their stable case values",
            )
        )


CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cpu_targets() -> list[str]:
    """Every CPU library of the manifest (each is tested where it runs, not only the preferred one)."""
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    return sorted({e["target"] for e in manifest["libraries"].values() if e["device"] == "cpu"})


def _why_not_here(target: str) -> str | None:
    """None where the CPU library ``target`` runs on this machine, else what it needs (a skip reason)."""
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    entry = next(e for e in manifest["libraries"].values() if e["target"] == target)
    missing = sorted(set(entry["cpu_flags"]) - _loader.cpu_flags())
    if missing:
        return f"{target} needs a CPU with {' '.join(missing)}, which this one lacks"
    if not _loader.runs_here(entry, _loader.cpu_flags()):
        return f"{target} needs the permission to use AMX tiles, which Linux refused this process"
    return None


def _target_dtypes() -> dict[str, set[str]]:
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    dtypes: dict[str, set[str]] = {}
    for entry in manifest["libraries"].values():
        dtypes.setdefault(entry["target"], set()).add(entry["dtype"])
    return dtypes


@pytest.fixture(params=cpu_targets())
def cpu_library(request, monkeypatch):
    """Runs a test once per CPU library this machine can run (each forced in turn). A library
    that holds some dtypes only (cpu-avx512-bf16: bfloat16) is skipped for the others: a test's
    ``dtype`` parameter names its dtype; a test without one runs float32 or float64."""
    not_here = _why_not_here(request.param)
    if not_here:
        pytest.skip(not_here)
    held = _target_dtypes()[request.param]
    params = getattr(request.node, "callspec", None)
    dtype = params.params.get("dtype") if params else None
    wanted = {str(dtype).removeprefix("torch.")} if dtype is not None else {"float32", "float64"}
    if not wanted <= held:
        pytest.skip(f"{request.param} holds {sorted(held)} kernels only")
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, request.param)
    return request.param


# torch's native half-type GEMM (oneDNN: AVX-512 or AMX for bfloat16, AVX512-FP16 or AMX-FP16 for
# float16) or dense.py's float32 products, as the CPU decides: every test that takes this fixture runs
# both ways on every CPU, through the table dense.computes_in_float32 reads at each call.
HALF_GEMMS = {"torch_half_gemm": True, "float32_products": False}


def without_kernels(monkeypatch, *families: str) -> None:
    """``kernels.available`` answering False for the kernel ``families``: their callers' own fallback
    to torch's ops, as where a library lacks them (CUDA)."""
    shipped = kernels.available
    monkeypatch.setattr(
        kernels, "available", lambda family, device, dtype: family not in families and shipped(family, device, dtype)
    )


def force_half_gemm(monkeypatch, native: bool) -> None:
    """Make dense.py see (``native``) or not see torch's own half-type GEMMs on this CPU."""
    for dtype in dense.HALF_TYPES:
        monkeypatch.setitem(dense.CPU_HAS_HALF_GEMM, dtype, native)


@pytest.fixture(params=list(HALF_GEMMS))
def half_gemm(request, monkeypatch):
    """Runs a test once with torch's half-type GEMMs and once with dense.py's float32 products."""
    force_half_gemm(monkeypatch, HALF_GEMMS[request.param])
    return request.param


@pytest.fixture
def float32_products(monkeypatch):
    """Every CPU takes dense.py's float32 path for the half types, as an AVX2 CPU does."""
    force_half_gemm(monkeypatch, False)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """|out - ref| <= tol[dtype] * scale elementwise (scale: the reference on |inputs|), NaN never passes;
    and norm-wise within :func:`normwise_bound` (measured worst for the band products: float64 2.7 u,
    float32 6.3 u, float16 0.75 u, bfloat16 0.55 u), which catches what the elementwise bound cannot
    where sums cancel (a result scaled by 1 + 2 tol)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out64 = out.detach().to(torch.float64).cpu()
    ref64, scale64 = ref.detach().to(torch.float64).cpu(), scale.detach().to(torch.float64).cpu()
    assert not torch.isnan(out64).any(), "NaN in kernel output"
    error = (out64 - ref64).abs()
    bound = TOLERANCE[dtype] * scale64 + torch.finfo(dtype).tiny
    worst = (error - bound).max() if error.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"{dtype}: max error {error.max():.3e} exceeds tolerance {TOLERANCE[dtype]:.1e} x scale"
    assert_normwise_close(out64, ref64, dtype, "band product", zero_scale=float(scale64.norm()))
