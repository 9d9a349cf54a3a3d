"""Layer normalisation (longformer_ops.nn.layer_norm): the CPU kernels against float64 torch (forward,
the saved statistics, the three gradients), gradcheck, the module against torch's, the fallbacks,
and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unaligned, unit_roundoff, without_kernels
from torch import nn

from longformer_ops.nn.layer_norm import LayerNorm, layer_norm

ops = torch.ops.longformer_ops

# Odd widths (vector tails), widths under one vector, a 1-D tensor, the encoder's hidden width,
# rows of 1 (a constant row: variance 0, rstd = 1 / sqrt(eps)), and 190 (AVX2's bfloat16 forward
# on pairs: 11 vectors of 16, one vector of 8, a tail of 6; microkernels.py).
SHAPES = [(1,), (7,), (3, 5), (2, 37, 19), (4, 16), (2, 3, 65), (3, 190), (70, 768)]
EPS = 1e-5


def _inputs(dtype, shape, *parts):
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), shape, *parts))
    x = (3 * torch.randn(shape, generator=generator, dtype=torch.float64) + 1).to(dtype)
    weight, bias = (torch.randn(shape[-1], generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return x, weight, bias, grad


def _slack(dtype) -> float:
    """The unit of the arithmetic the kernels compute in: float32 for float32 and the half types."""
    return unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)


def _exact(x, weight, bias, grad):
    """float64 torch: output, mean, rstd, the three gradients, and xhat."""
    x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, weight, bias))
    y = nn.functional.layer_norm(x64, x.shape[-1:], w64, b64, EPS)
    grads = torch.autograd.grad(y, (x64, w64, b64), grad.double())
    mean = x64.detach().mean(-1)
    rstd = (x64.detach().var(-1, unbiased=False) + EPS).rsqrt()
    xhat = (x64.detach() - mean[..., None]) * rstd[..., None]
    return y.detach(), mean, rstd, grads, xhat


def _bounds(dtype, x, weight, bias, grad, exact):
    """Bounds per element: each output rounded once (u |value|, or a subnormal spacing), and the
    statistics' sums over the row's ``cols`` terms in the arithmetic's dtype (``cols + 8`` of its
    units, relative, on xhat and everything computed from it); the parameters' gradients are sums
    over ``rows`` more. The float64 reference's own rounding of x - mean, amplified by rstd (4 u64
    |x| rstd on xhat: a constant row's xhat is 0, torch's a few units of that), is added where
    xhat enters."""
    y, mean, rstd, (grad_x, grad_w, grad_b), xhat = exact
    cols = x.shape[-1]
    rows = x.numel() // cols
    u, spacing = unit_roundoff(dtype), torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    relative = (cols + 8) * _slack(dtype)
    w64, g64 = weight.double(), grad.double()
    reference = 4 * unit_roundoff(torch.float64) * x.double().abs() * rstd[..., None]
    xhat_abs = xhat.abs() + reference
    out = u * y.abs() + relative * (xhat_abs * w64.abs() + bias.double().abs()) + reference * w64.abs() + spacing
    gw = (g64 * w64).abs()
    terms = gw + gw.mean(-1, keepdim=True) + xhat_abs * (gw * xhat_abs).mean(-1, keepdim=True)
    dx = u * grad_x.abs() + (relative + 4 * unit_roundoff(torch.float64)) * rstd[..., None] * terms + spacing
    flat_g, flat_xhat = g64.reshape(rows, cols), xhat_abs.reshape(rows, cols)
    dw = (
        u * grad_w.abs()
        + (rows + cols + 8) * _slack(dtype) * (flat_g * flat_xhat).abs().sum(0)
        + (flat_g.abs() * reference.reshape(rows, cols)).sum(0)
    )
    db = u * grad_b.abs() + (rows + 8) * _slack(dtype) * flat_g.abs().sum(0)
    return out, dx, dw, db


def _assert_within(got, exact, bound, what):
    error = (got.double() - exact).abs()
    assert not got.isnan().any(), f"{what}: NaN"
    worst = (error - bound).max().item() if error.numel() else -1.0
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3e} (largest error {error.max().item():.3e})"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernels_match_float64(cpu_library, dtype, shape):
    x, weight, bias, grad = _inputs(dtype, shape)
    exact = _exact(x, weight, bias, grad)
    y, mean, rstd, (grad_x, grad_w, grad_b), _ = exact
    out_bound, dx_bound, dw_bound, db_bound = _bounds(dtype, x, weight, bias, grad, exact)
    got, got_mean, got_rstd = ops.layer_norm(x, weight, bias, EPS)
    assert got.shape == x.shape and got.dtype == dtype and got_mean.shape == got_rstd.shape == x.shape[:-1]
    _assert_within(got, y, out_bound, f"layer_norm {shape} {dtype}")
    cols = shape[-1]
    _assert_within(got_mean, mean, (cols + 2) * _slack(dtype) * x.double().abs().mean(-1), "mean")
    _assert_within(got_rstd, rstd, 2 * (cols + 8) * _slack(dtype) * rstd, "rstd")
    got_x, got_w, got_b = ops.layer_norm_backward(grad, x, weight, got_mean, got_rstd)
    assert got_x.shape == x.shape and got_w.shape == got_b.shape == weight.shape and got_x.dtype == got_w.dtype == dtype
    _assert_within(got_x, grad_x, dx_bound, f"d x {shape} {dtype}")
    _assert_within(got_w, grad_w, dw_bound, f"d weight {shape} {dtype}")
    _assert_within(got_b, grad_b, db_bound, f"d bias {shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fault", ["one-percent-off", "negated", "zeroed", "no-weight"])
def test_the_bounds_catch_faults(fault, dtype):
    """Each bound above rejects a result or gradient off by the usual faults."""
    x, weight, bias, grad = _inputs(dtype, (70, 768), fault)
    exact = _exact(x, weight, bias, grad)
    bounds = _bounds(dtype, x, weight, bias, grad, exact)
    out, mean, rstd = ops.layer_norm(x, weight, bias, EPS)
    got = [out, *ops.layer_norm_backward(grad, x, weight, mean, rstd)]
    if fault == "no-weight":  # the kernels run with weight 1: every result and gradient but d bias changes
        out, mean, rstd = ops.layer_norm(x, torch.ones_like(weight), bias, EPS)
        got = [
            out,
            ops.layer_norm_backward(grad, x, torch.ones_like(weight), mean, rstd)[0],
        ]  # (d weight: no weight in it)
    faulty = {
        "one-percent-off": lambda t: t.double() * 1.01,
        "negated": lambda t: -t,
        "zeroed": torch.zeros_like,
        "no-weight": lambda t: t,
    }[fault]
    expected = [exact[0], *exact[3]]
    for i, (result, want, bound) in enumerate(zip(got, expected, bounds)):
        with pytest.raises(AssertionError, match="exceeds its bound"):
            _assert_within(faulty(result), want, bound, f"{fault}, output {i}")


def test_gradcheck_float64():
    x = torch.randn(3, 2, 21, dtype=torch.float64, requires_grad=True)
    weight, bias = (torch.randn(21, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(layer_norm, (x, weight, bias))


def test_module_is_torchs_layer_norm_on_the_kernel(monkeypatch):
    """Same parameters and state dict as nn.LayerNorm; the kernel runs for affine normalisation over
    the last dimension, torch's forward otherwise."""
    calls = []
    op = ops.layer_norm
    monkeypatch.setattr(ops, "layer_norm", lambda *args: calls.append(1) or op(*args))
    torch.manual_seed(3)
    ours, theirs = LayerNorm(40, eps=1e-6), nn.LayerNorm(40, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(5, 40)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    for module in (LayerNorm(40, elementwise_affine=False), LayerNorm(40, bias=False), LayerNorm((5, 40))):
        torch.testing.assert_close(
            module(x), nn.functional.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
        )
    assert calls == [1]


@pytest.mark.parametrize("case", ["no-kernel", "autocast", "float32-parameters"])
def test_falls_back_to_torch(monkeypatch, case):
    if case == "no-kernel":
        without_kernels(monkeypatch, "layer_norm")
    monkeypatch.setattr(ops, "layer_norm", lambda *args: pytest.fail("kernel called"))
    x, weight, bias, _ = _inputs(torch.bfloat16 if case == "float32-parameters" else torch.float32, (6, 30))
    if case == "float32-parameters":
        weight, bias = weight.float(), bias.float()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        got = layer_norm(x, weight, bias)
        expected = nn.functional.layer_norm(x, x.shape[-1:], weight, bias, EPS)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_at_any_address_and_empty(dtype):
    """Tensors one element into their storage: the kernels may not assume vector-aligned data, nor
    (bfloat16 on pairs) 4-byte-aligned data; and no rows."""
    x, weight, bias, grad = _inputs(dtype, (3, 64))

    expected = ops.layer_norm(x, weight, bias, EPS)
    for got, want in zip(ops.layer_norm(unaligned(x), unaligned(weight), unaligned(bias), EPS), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(
        ops.layer_norm_backward(unaligned(grad), unaligned(x), unaligned(weight), *expected[1:]),
        ops.layer_norm_backward(grad, x, weight, *expected[1:]),
        strict=True,
    ):
        assert torch.equal(got, want)
    empty = torch.empty(0, 64, dtype=dtype, requires_grad=True)
    out = layer_norm(empty, weight, bias)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert empty.grad.shape == (0, 64)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("x", torch.ones(3), torch.ones(3)), TypeError, "x must be a floating-point torch.Tensor, got str"),
        ((torch.tensor(1.0), torch.ones(1), torch.ones(1)), ValueError, "x must have at least one dimension"),
        ((torch.ones(2, 3), [1.0], torch.ones(3)), TypeError, "weight must be a torch.Tensor, got list"),
        (
            (torch.ones(2, 3), torch.ones(2), torch.ones(3)),
            ValueError,
            r"weight must have shape \[3\] \(x's last dimension\), got \[2\]",
        ),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(3, 1)),
            ValueError,
            r"bias must have shape \[3\] \(x's last dimension\), got \[3, 1\]",
        ),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(3, device="meta")),
            ValueError,
            "bias must be on x's device cpu, got meta",
        ),
        ((torch.ones(2, 3), torch.ones(3), torch.ones(3), -1.0), ValueError, r"eps must be a number >= 0, got -1.0"),
    ],
)
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        layer_norm(*args)


def test_compiles_without_graph_break():
    x, weight, bias, _ = _inputs(torch.float32, (8, 24))
    compiled = torch.compile(lambda *args: layer_norm(*args) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, weight, bias), ops.layer_norm(x, weight, bias, EPS)[0] * 2)
