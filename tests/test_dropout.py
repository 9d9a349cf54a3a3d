"""Hidden-state dropout (longformer_ops.ops.dropout): the CPU kernel against the reference mask of the
fused attention's generator, its gradient, the public function's contract and its errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unit_roundoff, without_kernels

from longformer_ops.ops.dropout import Dropout, dropout, dropout_seed
from longformer_ops.ops.reference import dropout_factor_reference

ops = torch.ops.longformer_ops

# Odd widths (vector tails), widths under one vector, a 1-D tensor, the encoder's hidden width, and
# 190 (AVX2's bfloat16 on pairs: 11 vectors of 16, one vector of 8, a tail of 6; microkernels.py).
SHAPES = [(1,), (7,), (3, 5), (2, 37, 19), (4, 16), (2, 3, 65), (3, 190), (5, 768)]


def _factor(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The reference factors (float64) for ``x`` of ``shape`` viewed as ``[rows, shape[-1]]``."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return dropout_factor_reference(seed, 1, rows, 1, shape[-1], p)[0, :, 0, :].reshape(shape)


def _assert_dropped_as(got: torch.Tensor, x: torch.Tensor, factor: torch.Tensor, what: str) -> None:
    """``got`` is ``x * factor``: zero exactly where the factor is 0, elsewhere within 2 units of
    roundoff of the exact product (the kernel rounds the factor to the accumulation dtype, then
    the product once: float32 for half types, whose own unit is far larger)."""
    dtype = got.dtype
    exact = x.double() * factor
    dropped = factor == 0
    assert torch.equal(got[dropped].double(), torch.zeros_like(exact[dropped])), f"{what}: a dropped element is not 0"
    error = (got.double() - exact).abs()
    bound = 2 * unit_roundoff(dtype) * exact.abs()
    worst = (error - bound).max().item() if error.numel() else -1.0
    assert worst <= 0, f"{what}: |got - x * factor| exceeds 2 u |x * factor| by {worst:.3e} ({dtype})"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernel_matches_reference_mask(cpu_library, dtype, shape, p):
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), shape, p))
    x = torch.randn(shape, generator=generator).to(dtype)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
    got = ops.dropout(x, torch.tensor(seed), p)
    assert got.shape == x.shape and got.dtype == dtype
    _assert_dropped_as(got, x, _factor(seed, shape, p), f"dropout {shape} p={p}")


def test_public_dropout_draws_its_seed_from_torch():
    """The seed is one draw from torch's default generator: torch.manual_seed reproduces the mask."""
    x = torch.randn(6, 40)
    torch.manual_seed(11)
    got = dropout(x, 0.3)
    torch.manual_seed(11)
    seed = int(dropout_seed())
    _assert_dropped_as(got, x, _factor(seed, tuple(x.shape), 0.3), "dropout(x, 0.3)")
    torch.manual_seed(11)
    assert torch.equal(dropout(x, 0.3), got)
    assert not torch.equal(dropout(x, 0.3), got)  # the next call draws another seed


def test_keep_rate_and_scale():
    x = torch.ones(512, 768)
    for p in (0.1, 0.5):
        out = dropout(x, p)
        kept = (out != 0).double().mean().item()
        sigma = (p * (1 - p) / x.numel()) ** 0.5
        assert abs(kept - (1 - p)) < 4 * sigma, (p, kept)
        assert torch.all((out == 0) | (out == torch.tensor(1 / (1 - p), dtype=torch.float32)))


def test_identity_cases_and_p_one():
    x = torch.randn(3, 8)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    module = Dropout(0.25)
    assert module.p == 0.25 and isinstance(module, torch.nn.Dropout) and not list(module.state_dict())
    assert module.eval()(x) is x
    assert torch.equal(dropout(torch.empty(0, 5), 0.5), torch.empty(0, 5))


def test_gradient_is_the_same_mask():
    x = torch.randn(4, 33, requires_grad=True)
    torch.manual_seed(5)
    out = dropout(x, 0.4)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.manual_seed(5)
    factor = _factor(int(dropout_seed()), (4, 33), 0.4)
    _assert_dropped_as(x.grad, grad, factor, "d dropout / dx")


def test_gradcheck_float64():
    x = torch.randn(3, 21, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(1234)
    assert torch.autograd.gradcheck(lambda t: ops.dropout(t, seed, 0.3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ops.dropout(t, seed, 0.3), (x,))


def test_non_contiguous_input():
    x = torch.randn(20, 12).t()  # [12, 20], not contiguous
    torch.manual_seed(2)
    got = dropout(x, 0.5)
    torch.manual_seed(2)
    _assert_dropped_as(got, x, _factor(int(dropout_seed()), (12, 20), 0.5), "dropout of x.t()")


def test_without_a_kernel_it_is_torch_dropout(monkeypatch):
    without_kernels(monkeypatch, "dropout")
    x = torch.randn(16, 16)
    torch.manual_seed(3)
    got = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(got, torch.nn.functional.dropout(x, 0.5, training=True))


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("x", 0.5), TypeError, "x must be a floating-point torch.Tensor, got str"),
        (
            (torch.ones(3, dtype=torch.int64), 0.5),
            TypeError,
            "x must be a floating-point torch.Tensor, got torch.int64",
        ),
        ((torch.ones(3), 1.5), ValueError, r"p must be a probability in \[0, 1\], got 1.5"),
        ((torch.ones(3), -0.1), ValueError, r"p must be a probability in \[0, 1\], got -0.1"),
        ((torch.ones(3), True), ValueError, r"p must be a probability in \[0, 1\], got True"),
        ((torch.ones(3), 0.5, 1), TypeError, "training must be a bool, got int"),
    ],
)
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        dropout(*args)


def test_compiles_without_graph_break():
    x = torch.randn(8, 24)
    compiled = torch.compile(lambda t: dropout(t, 0.2) * 2, fullgraph=True, backend="aot_eager")
    torch.manual_seed(9)
    got = compiled(x)
    torch.manual_seed(9)
    assert torch.equal(got, dropout(x, 0.2) * 2)
