"""Shared test helpers: devices, dtypes, the per-dtype tolerance table, and the comparison rule."""

from __future__ import annotations

import pytest
import torch

from longformer_ops import _loader

CUDA = torch.cuda.is_available()

# Tolerance per dtype, relative to the sum of |terms| of each output (the natural scale of a
# dot product's rounding error); the single table every kernel test uses.
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.float16: 2e-3,   # output rounding 2^-11, float32 accumulation
    torch.bfloat16: 1e-2,  # output rounding 2^-8, float32 accumulation
}

CPU_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cpu_targets() -> list[str]:
    """The CPU libraries this machine can run (each is tested, not only the preferred one)."""
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    flags = _loader.cpu_flags()
    return sorted({e["target"] for e in manifest["libraries"].values()
                   if e["device"] == "cpu" and set(e["cpu_flags"]) <= flags})


@pytest.fixture(params=cpu_targets())
def cpu_library(request, monkeypatch):
    """Runs a test once per CPU library this machine can run (each forced in turn)."""
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, request.param)
    return request.param


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """|out - ref| <= tol[dtype] * scale elementwise (scale: the reference on |inputs|), NaN never passes."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out64 = out.detach().to(torch.float64).cpu()
    ref64, scale64 = ref.detach().to(torch.float64).cpu(), scale.detach().to(torch.float64).cpu()
    assert not torch.isnan(out64).any(), "NaN in kernel output"
    error = (out64 - ref64).abs()
    bound = TOLERANCE[dtype] * scale64 + torch.finfo(dtype).tiny
    worst = (error - bound).max() if error.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"{dtype}: max error {error.max():.3e} exceeds tolerance {TOLERANCE[dtype]:.1e} x scale"
