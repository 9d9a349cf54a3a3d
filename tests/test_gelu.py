"""The FFN's bias and GELU (longformer_ops.nn.gelu): the CPU kernels against float64 GELU and its
derivative, gradients, the in-place inference path, ``linear_gelu`` against ``gelu(linear(x))``,
the fallbacks, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unaligned, unit_roundoff, without_kernels
from torch import nn

from longformer_ops.nn.gelu import bias_gelu, linear_gelu

ops = torch.ops.longformer_ops

# Odd widths (vector tails), widths under one vector, a 1-D tensor, the base FFN's width, and AVX2's
# bfloat16 paths (gelu.py): 190 on pairs (runs of 4 vectors of 16 values: two runs, three vectors
# after them, then one vector of 8 values and a tail of six), 16 (one vector of pairs, no run), 157
# (odd: one value at a time); values spread to +-8 so that erf's clamp at |x / sqrt 2| = 4 and both
# tails are crossed.
SHAPES = [(1,), (7,), (3, 5), (2, 37, 19), (4, 16), (2, 3, 65), (3, 157), (3, 190), (5, 3072)]


def _inputs(dtype, shape, *parts):
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), shape, *parts))
    h = (4 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)
    bias = torch.randn(shape[-1], generator=generator, dtype=torch.float64).to(dtype)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return h, bias, grad


def _exact(h, bias, grad):
    """float64 gelu(h + bias) and grad * gelu'(h + bias) on the same (rounded) inputs."""
    x = h.double() + bias.double()
    derivative = 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return nn.functional.gelu(x), grad.double() * derivative, x


def _slack(dtype) -> float:
    """The unit of the arithmetic the kernel computes in: float32 for float32 and the half types."""
    return unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)


def _approximation(dtype) -> float:
    """The kernels' approximation error per unit of |x| (forward) or |g| (backward): 8 units of the
    arithmetic's roundoff (float32's erf is a rational fit within 3.8e-7 = 6.3 units of float32's,
    halved by GELU's 1/2); the half types' cheaper erf and exp (tvm_kernels/schedules/cpu/gelu.py:
    the forward's fit within 3.7e-6, halved, the backward's derivative within 2.1e-6) add 1.85e-6."""
    return 8 * _slack(dtype) + (1.85e-6 if dtype in (torch.bfloat16, torch.float16) else 0)


def _subnormal_spacing(dtype) -> float:
    """The spacing of ``dtype``'s subnormal numbers: where results round absolutely, not relatively."""
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps


def _sums_bound(dtype, terms):
    """Column sums of ``terms`` [rows, cols]: one rounding of the sum (u |sum|) and the accumulation
    in the arithmetic's dtype (rows of its units on the sum of |terms|)."""
    return unit_roundoff(dtype) * terms.sum(0).abs() + terms.shape[0] * _slack(dtype) * terms.abs().sum(0)


def _assert_within(got, exact, bound, what):
    error = (got.double() - exact).abs()
    assert not got.isnan().any(), f"{what}: NaN"
    worst = (error - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3e} (largest error {error.max().item():.3e})"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernels_match_float64(cpu_library, dtype, shape):
    """Forward: within one rounding of the output (2 u |y|, or a subnormal spacing) plus the
    approximations' error times |x| (``_approximation``). Backward: the same with |g gelu'| and |g|.
    A 1% error, a dropped bias or a sign flip is far outside both (test_the_bound_catches_faults)."""
    h, bias, grad = _inputs(dtype, shape)
    y, grad_h, x = _exact(h, bias, grad)
    u, approximation, spacing = unit_roundoff(dtype), _approximation(dtype), _subnormal_spacing(dtype)
    got = ops.bias_gelu(h, bias)
    assert got.shape == h.shape and got.dtype == dtype
    _assert_within(got, y, 2 * u * y.abs() + approximation * x.abs() + spacing, f"bias_gelu {shape} {dtype}")
    got_grad, got_sums = ops.bias_gelu_backward(grad, h, bias)
    assert got_grad.shape == h.shape and got_grad.dtype == got_sums.dtype == dtype and got_sums.shape == bias.shape
    _assert_within(
        got_grad,
        grad_h,
        2 * u * grad_h.abs() + approximation * grad.double().abs() + spacing,
        f"bias_gelu_backward {shape} {dtype}",
    )
    terms = got_grad.double().reshape(-1, shape[-1])  # the bias's gradient: the sums of the rounded terms
    _assert_within(got_sums, terms.sum(0), _sums_bound(dtype, terms), f"bias_gelu_backward's sums {shape} {dtype}")


@pytest.mark.parametrize("fault", ["one-percent-off", "no-bias", "negated", "coarser-erf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_bound_catches_faults(dtype, fault):
    """The forward and backward bounds above reject outputs off by the usual faults, and by an
    approximation ten times as coarse as the half types' (1.85e-5 per unit of |x| or |g|)."""
    h, bias, grad = _inputs(dtype, (5, 3072), fault)
    y, grad_h, x = _exact(h, bias, grad)
    u, approximation = unit_roundoff(dtype), _approximation(dtype)
    faulty = {
        "one-percent-off": lambda t, exact, scale: (exact * 1.01).to(dtype),
        "no-bias": lambda t, exact, scale: t,
        "negated": lambda t, exact, scale: -t,
        "coarser-erf": lambda t, exact, scale: (exact - 1.85e-5 * scale).to(dtype),
    }[fault]
    if fault == "no-bias":
        forward = ops.bias_gelu(h, torch.zeros_like(bias))
        backward = ops.bias_gelu_backward(grad, h, torch.zeros_like(bias))[0]
    else:
        forward = faulty(ops.bias_gelu(h, bias), y, x.abs())
        backward = faulty(ops.bias_gelu_backward(grad, h, bias)[0], grad_h, grad.double().abs())
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(forward, y, 2 * u * y.abs() + approximation * x.abs(), "forward")
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(backward, grad_h, 2 * u * grad_h.abs() + approximation * grad.double().abs(), "backward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_round_to_nearest(cpu_library, dtype):
    """The half types' results are the float64 values rounded to nearest, but where the cheaper
    arithmetic lands next to a tie: among results of magnitude 0.5 and more (where its error is
    under a thousandth of a unit) at most 5% differ (measured 1.6-1.7% forward, under 0.02%
    backward). The bound of test_kernels_match_float64 (two units) cannot see the rounding's
    direction; rounded toward zero instead (the bfloat16 kernels' integer rounding without its
    0x7fff), 49% and 31% differ."""
    h, bias, grad = _inputs(dtype, (64, 3072), "nearest")
    y, grad_h, _ = _exact(h, bias, grad)
    for what, got, exact in (
        ("bias_gelu", ops.bias_gelu(h, bias), y),
        ("bias_gelu_backward", ops.bias_gelu_backward(grad, h, bias)[0], grad_h),
    ):
        large = exact.abs() >= 0.5
        differ = (got.double() != exact.to(dtype).double())[large].double().mean().item()
        assert differ <= 0.05, f"{what} {dtype}: {differ:.1%} of the results differ from the exact ones rounded"


def test_gradcheck_float64():
    h = torch.randn(3, 2, 21, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(21, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(bias_gelu, (h, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autograd_gradients_of_both_inputs(dtype):
    """Through autograd: h's gradient is the backward kernel's, the bias's its sum over the rows:
    within one rounding of the sum (u |sum|) and float32 accumulation (rows u32 sum of |terms|);
    a bias gradient 1% off, or summed without the mask of the derivative, fails that bound."""
    h, bias, grad = _inputs(dtype, (2, 33, 40))
    h.requires_grad_(True)
    bias.requires_grad_(True)
    bias_gelu(h, bias).backward(grad)
    grad_h, _ = ops.bias_gelu_backward(grad, h.detach(), bias.detach())
    assert torch.equal(h.grad, grad_h)
    terms = grad_h.double().flatten(0, 1)
    bound = _sums_bound(dtype, terms)
    _assert_within(bias.grad, terms.sum(0), bound, "bias gradient")
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(bias.grad.double() * 1.01, terms.sum(0), bound, "bias gradient 1% off")
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(grad.double().flatten(0, 1).sum(0), terms.sum(0), bound, "the incoming gradient's sums")


def test_in_place_is_the_same_kernel():
    h, bias, _ = _inputs(torch.float32, (6, 70))
    expected = ops.bias_gelu(h, bias)
    ops.bias_gelu_(h, bias)
    assert torch.equal(h, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_at_any_address(dtype):
    """Tensors that start one element into their storage (a slice of rows; a bias read from a
    checkpoint file at any offset): the kernels may not assume vector-aligned data, nor (bfloat16
    on pairs) 4-byte-aligned data."""
    h, bias, grad = _inputs(dtype, (3, 64))

    assert torch.equal(ops.bias_gelu(unaligned(h), unaligned(bias)), ops.bias_gelu(h, bias))
    for got, expected in zip(
        ops.bias_gelu_backward(unaligned(grad), unaligned(h), unaligned(bias)),
        ops.bias_gelu_backward(grad, h, bias),
        strict=True,
    ):
        assert torch.equal(got, expected)
    in_place = unaligned(h)
    ops.bias_gelu_(in_place, unaligned(bias))
    assert torch.equal(in_place, ops.bias_gelu(h, bias))


def test_non_contiguous_and_empty():
    h, bias, _ = _inputs(torch.float32, (12, 20))
    transposed = h.t().contiguous().t()  # [12, 20], not contiguous
    assert not transposed.is_contiguous()
    assert torch.equal(bias_gelu(transposed, bias), ops.bias_gelu(h, bias))
    assert bias_gelu(torch.empty(0, 20), bias).shape == (0, 20)


def _assert_linear_gelu_close(got, x, linear, dtype, what):
    """``got`` against float64 ``gelu(x W^T + b)`` on ``x``, ``W`` and ``b`` rounded to ``dtype``:
    within the GEMM output's rounding to ``dtype`` carried through GELU (slope <= 1.13) and the
    output's rounding, 2 u (|x W^T| + |y|), plus float32 accumulation, K u32 (|x| |W|^T)."""
    x64, weight, bias = (t.detach().to(dtype).double() for t in (x, linear.weight, linear.bias))
    product = x64 @ weight.t()
    expected = nn.functional.gelu(product + bias)
    accumulation = x.shape[-1] * unit_roundoff(torch.float32) * (x64.abs() @ weight.abs().t())
    bound = 2 * unit_roundoff(dtype) * (product.abs() + expected.abs()) + accumulation
    _assert_within(got, expected, bound, what)
    with pytest.raises(AssertionError, match="exceeds its bound"):  # the bound rejects a result 1% off
        _assert_within(got.double() * 1.01, expected, bound, what + " 1% off")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["training", "inference"])
def test_linear_gelu_is_gelu_of_linear(dtype, grad_enabled):
    torch.manual_seed(5)
    linear = nn.Linear(48, 200).to(dtype)
    x = torch.randn(2, 9, 48, dtype=dtype)
    with torch.set_grad_enabled(grad_enabled):
        got = linear_gelu(x, linear)
    assert got.dtype == dtype and got.requires_grad == grad_enabled
    _assert_linear_gelu_close(got, x, linear, dtype, f"linear_gelu {dtype}")


def test_linear_gelu_under_autocast_runs_in_autocast_dtype():
    torch.manual_seed(6)
    linear = nn.Linear(32, 64)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_gelu(x, linear)
    assert got.dtype == torch.bfloat16
    _assert_linear_gelu_close(got, x, linear, torch.bfloat16, "linear_gelu under autocast")


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("which", ["subclass", "hooked", "own-forward", "no-bias"])
def test_linear_gelu_calls_other_modules_as_they_are(monkeypatch, which):
    """An adapter, a hook, a forward replaced on the instance (as accelerate's offloading does) or a
    missing bias: the module is called, our kernel is not."""
    monkeypatch.setattr(ops, "bias_gelu", lambda *args: pytest.fail("bias_gelu called"))
    torch.manual_seed(7)
    linear = _ScaledLinear(16, 24) if which == "subclass" else nn.Linear(16, 24, bias=which != "no-bias")
    if which == "hooked":
        linear.register_forward_hook(lambda module, args, out: out + 1)
    if which == "own-forward":
        plain_forward = linear.forward
        linear.forward = lambda x: plain_forward(x) - 1
    x = torch.randn(3, 16)
    assert torch.equal(linear_gelu(x, linear), nn.functional.gelu(linear(x)))


def test_without_a_kernel_it_is_torch_gelu(monkeypatch):
    without_kernels(monkeypatch, "bias_gelu")
    h, bias, _ = _inputs(torch.float32, (4, 30))
    assert torch.equal(bias_gelu(h, bias), nn.functional.gelu(h + bias))
    linear = nn.Linear(30, 8)
    assert torch.equal(linear_gelu(h, linear), nn.functional.gelu(linear(h)))


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("h", torch.ones(3)), TypeError, "h must be a floating-point torch.Tensor, got str"),
        (
            (torch.ones(3, dtype=torch.int64), torch.ones(3)),
            TypeError,
            "h must be a floating-point torch.Tensor, got torch.int64",
        ),
        ((torch.tensor(1.0), torch.ones(1)), ValueError, "h must have at least one dimension"),
        ((torch.ones(2, 3), [1.0, 2.0, 3.0]), TypeError, "bias must be a torch.Tensor, got list"),
        (
            (torch.ones(2, 3), torch.ones(2)),
            ValueError,
            r"bias must have shape \[3\] \(h's last dimension\), got \[2\]",
        ),
        (
            (torch.ones(2, 3), torch.ones(2, 3)),
            ValueError,
            r"bias must have shape \[3\] \(h's last dimension\), got \[2, 3\]",
        ),
        (
            (torch.ones(2, 3), torch.ones(3, dtype=torch.float64)),
            TypeError,
            "bias must have h's dtype torch.float32, got torch.float64",
        ),
        ((torch.ones(2, 3), torch.ones(3, device="meta")), ValueError, "bias must be on h's device cpu, got meta"),
    ],
)
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        bias_gelu(*args)


def test_compiles_without_graph_break():
    h, bias, _ = _inputs(torch.float32, (8, 24))
    compiled = torch.compile(lambda t, b: bias_gelu(t, b) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(h, bias), ops.bias_gelu(h, bias) * 2)


def test_in_place_ops_refuse_non_contiguous_tensors():
    h = torch.randn(8, 6).t()
    with pytest.raises(
        ValueError, match=r"h must be contiguous to be written in place, got strides \(1, 6\) for shape \(6, 8\)"
    ):
        ops.bias_gelu_(h, torch.randn(8))
    context = torch.randn(1, 3, 2, 8).transpose(1, 2)
    with pytest.raises(ValueError, match="context must be contiguous to be written in place"):
        ops.global_merge_(context, torch.rand(1, 2, 3), torch.rand(1, 2, 3, 1), torch.randn(1, 1, 3, 8))


def test_without_a_kernel_inference_activates_in_place(monkeypatch):
    """Without a kernel (CUDA) and without autograd, the GELU runs in the GEMM's own output."""
    without_kernels(monkeypatch, "bias_gelu")
    outputs = []
    linear = nn.Linear(10, 20)
    x = torch.randn(3, 10)
    expected = nn.functional.gelu(linear(x)).detach()
    gemm = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda *args: outputs.append(gemm(*args)) or outputs[-1])
    with torch.no_grad():
        got = linear_gelu(x, linear)
    assert len(outputs) == 1 and got.data_ptr() == outputs[0].data_ptr()
    assert torch.equal(got, expected)
