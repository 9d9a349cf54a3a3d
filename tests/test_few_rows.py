"""The few-row products (``few_rows_mm``: ``a @ b``, ``few_rows_mm_nt``: ``a @ bt^T``, a generation
step's attention over its key/value cache): every CPU library's kernels against float64 torch,
element by element, at awkward sizes, for every dtype they ship; that the bound catches the usual
faults; and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unit_roundoff

ops = torch.ops.longformer_ops

# (batch, rows, inner, cols): one row (a generation step), a few, odd sizes everywhere (vector and
# register-block tails), a single term or column, more keys than a task's block (256), head sizes.
SHAPES = [
    (1, 1, 1, 1),
    (3, 1, 64, 300),
    (12, 1, 64, 64),
    (2, 2, 7, 17),
    (1, 5, 33, 100),
    (2, 8, 130, 9),
    (1, 3, 96, 96),
    (4, 1, 19, 257),
    (1, 8, 64, 130),
    (2, 1, 0, 5),
]


def _operands(dtype, shape, transposed, *parts):
    batch, rows, inner, cols = shape
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), shape, transposed, *parts))
    a = torch.randn(batch, rows, inner, generator=generator, dtype=torch.float64).to(dtype)
    b_shape = (batch, cols, inner) if transposed else (batch, inner, cols)
    b = torch.randn(b_shape, generator=generator, dtype=torch.float64).to(dtype)
    return a, b


def _exact_and_bound(dtype, a, b, transposed):
    """float64 ``a @ b`` (``b^T``), and per element the bound of one rounding to ``dtype`` of a sum of
    ``inner`` products in the accumulation dtype: ``u |exact| + (inner + 2) u_acc sum |a_k b_k|``."""
    a64, b64 = a.double(), b.double()
    if transposed:
        b64 = b64.transpose(1, 2)
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    bound = unit_roundoff(dtype) * (a64 @ b64).abs() + (a.shape[2] + 2) * unit_roundoff(accumulation) * (
        a64.abs() @ b64.abs()
    )
    return a64 @ b64, bound


def _assert_within(got, exact, bound, what):
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    excess = (got.double() - exact).abs() - bound
    assert not got.isnan().any(), f"{what}: NaN"
    worst = excess.max().item() if excess.numel() else -1.0
    assert worst <= 0, f"{what}: {int((excess > 0).sum())} elements exceed their bound, the worst by {worst:.3e}"


@pytest.mark.parametrize("transposed", [False, True], ids=["a@b", "a@bt^T"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernels_match_float64(cpu_library, dtype, shape, transposed):
    a, b = _operands(dtype, shape, transposed)
    got = (ops.few_rows_mm_nt if transposed else ops.few_rows_mm)(a, b)
    assert got.dtype == dtype
    exact, bound = _exact_and_bound(dtype, a, b, transposed)
    _assert_within(got, exact, bound, f"{'nt' if transposed else 'nn'} {shape} {dtype}")


@pytest.mark.parametrize("transposed", [False, True], ids=["a@b", "a@bt^T"])
def test_strided_operands_are_read_as_their_values(transposed):
    """Views that are not contiguous (every other feature, every other key) give their values' product."""
    a, b = _operands(torch.bfloat16, (2, 3, 80, 100), transposed)
    a, b = a[:, :, ::2], (b[:, ::2, ::2] if transposed else b[:, ::2, ::2])
    got = (ops.few_rows_mm_nt if transposed else ops.few_rows_mm)(a, b)
    _assert_within(got, *_exact_and_bound(torch.bfloat16, a, b, transposed), "strided")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fault", ["one-percent-off", "negated", "zeroed", "one-term-dropped", "rows-swapped"])
def test_the_bound_catches_faults(dtype, fault):
    transposed = True
    a, b = _operands(dtype, (2, 4, 64, 100), transposed, fault)
    exact, bound = _exact_and_bound(dtype, a, b, transposed)
    got = ops.few_rows_mm_nt(a, b)
    faulty = {
        "one-percent-off": lambda: got.double() * 1.01,
        "negated": lambda: -got,
        "zeroed": lambda: torch.zeros_like(got),
        "one-term-dropped": lambda: ops.few_rows_mm_nt(a[..., 1:].contiguous(), b[..., 1:].contiguous()),
        "rows-swapped": lambda: got.flip(1),
    }[fault]()
    _assert_within(got, exact, bound, "the kernel")
    with pytest.raises(AssertionError, match="exceed their bound"):
        _assert_within(faulty, exact, bound, fault)


@pytest.mark.parametrize("op", ["few_rows_mm", "few_rows_mm_nt"])
def test_mismatched_operands_are_refused_by_name(op):
    a = torch.randn(2, 1, 8).bfloat16()
    fits = torch.randn(2, 8, 5).bfloat16() if op == "few_rows_mm" else torch.randn(2, 5, 8).bfloat16()
    for bad in (
        fits[:1],
        fits.float(),
        fits[0],
        fits.transpose(1, 2)[:, :3] if op == "few_rows_mm" else fits[:, :, :3],
    ):
        with pytest.raises(ValueError, match=rf"{op}: expected a \[batch, rows, inner\] and b \[batch, "):
            getattr(ops, op)(a, bad)
