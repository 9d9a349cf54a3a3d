"""A block's dense output into the residual stream (longformer_ops.nn.residual): the CPU kernels
against float64 ``(h + b) * factor + x`` with the dropout's reference mask, the backward's column
sums, gradients, the in-place inference path, ``linear_dropout_add`` against ``drop(linear(x)) +
x``, the fallbacks, and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unaligned, unit_roundoff, without_kernels
from torch import nn

from longformer_ops.nn.residual import bias_dropout_add, linear_dropout_add
from longformer_ops.ops.dropout import Dropout, dropout
from longformer_ops.ops.reference import dropout_factor_reference

ops = torch.ops.longformer_ops

# Odd widths (vector tails), widths under one vector, a 1-D tensor, the encoder's hidden width, and
# 190 (AVX2's bfloat16 on pairs: 11 vectors of 16, one vector of 8, a tail of 6; microkernels.py).
SHAPES = [(1,), (7,), (3, 5), (2, 37, 19), (4, 16), (2, 3, 65), (3, 190), (70, 768)]


def _inputs(dtype, shape, *parts):
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), shape, *parts))
    h, residual, grad = (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(3))
    bias = torch.randn(shape[-1], generator=generator, dtype=torch.float64).to(dtype)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
    return h, bias, residual, grad, seed


def _factor(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The dropout's reference factors (float64) for a tensor of ``shape`` viewed as ``[rows, shape[-1]]``."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return dropout_factor_reference(seed, 1, rows, 1, shape[-1], p)[0, :, 0, :].reshape(shape)


def _slack(dtype) -> float:
    """The unit of the arithmetic the kernels compute in: float32 for float32 and the half types."""
    return unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)


def _forward_bound(dtype, exact, h, bias, factor, residual):
    """One rounding of the output (u |y|, or a subnormal spacing) and three of the arithmetic
    ((h + b), times the factor, plus x: 3 units of its roundoff on the terms' magnitudes)."""
    terms = (h.double() + bias.double()).abs() * factor + residual.double().abs()
    spacing = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    return unit_roundoff(dtype) * exact.abs() + 3 * _slack(dtype) * terms + spacing


def _assert_within(got, exact, bound, what):
    error = (got.double() - exact).abs()
    assert not got.isnan().any(), f"{what}: NaN"
    worst = (error - bound).max().item() if error.numel() else -1.0
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3e} (largest error {error.max().item():.3e})"


def _column_sums_bound(dtype, terms):
    """The column sums of rounded ``terms`` [rows, cols]: one rounding of the sum (u |sum|) and the
    accumulation in the arithmetic's dtype (rows units of its roundoff on the sum of |terms|)."""
    return unit_roundoff(dtype) * terms.sum(0).abs() + terms.shape[0] * _slack(dtype) * terms.abs().sum(0)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernels_match_float64(cpu_library, dtype, shape, p):
    """Forward: ``(h + b) * factor + x`` with the dropout's reference mask; a dropped element is x
    itself. Backward: ``grad * factor`` (the factor and the product rounded in the arithmetic's
    dtype, then once to ``dtype``: u + 2 of the arithmetic's units) and its column sums."""
    h, bias, residual, grad, seed = _inputs(dtype, shape, p)
    factor = _factor(seed, shape, p)
    exact = (h.double() + bias.double()) * factor + residual.double()
    got = ops.bias_dropout_add(h, bias, residual, torch.tensor(seed), p)
    assert got.shape == h.shape and got.dtype == dtype
    _assert_within(
        got, exact, _forward_bound(dtype, exact, h, bias, factor, residual), f"bias_dropout_add {shape} p={p}"
    )
    dropped = factor == 0
    assert torch.equal(got[dropped], residual[dropped]), "a dropped element is not the residual"

    grad_h, sums = ops.dropout_column_sums(grad, torch.tensor(seed), p)
    assert grad_h.shape == grad.shape and grad_h.dtype == sums.dtype == dtype and sums.shape == grad.shape[-1:]
    assert torch.equal(grad_h, ops.dropout(grad, torch.tensor(seed), p)), "not the dropout kernel's output"
    exact_grad = grad.double() * factor
    spacing = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # (subnormal results round absolutely)
    _assert_within(
        grad_h,
        exact_grad,
        (unit_roundoff(dtype) + 2 * _slack(dtype)) * exact_grad.abs() + spacing,
        f"dropped gradient {shape} p={p}",
    )
    terms = grad_h.double().reshape(-1, shape[-1])
    _assert_within(sums, terms.sum(0), _column_sums_bound(dtype, terms), f"column sums {shape} p={p}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_round_to_nearest(cpu_library, dtype):
    """The half types' results are the float64 values rounded to nearest but next to a tie (the
    factor, the product and the sum are rounded to float32 first): at most 2% of the kept elements
    differ (measured 0.4% and 0). The bounds above (a unit and more) cannot see the rounding's
    direction; rounded toward zero instead, 44-48% differ."""
    h, bias, residual, grad, seed = _inputs(dtype, (64, 768), 0.1)
    factor = _factor(seed, (64, 768), 0.1)
    kept = factor != 0
    for what, got, exact in (
        (
            "bias_dropout_add",
            ops.bias_dropout_add(h, bias, residual, torch.tensor(seed), 0.1),
            (h.double() + bias.double()) * factor + residual.double(),
        ),
        ("dropout_column_sums", ops.dropout_column_sums(grad, torch.tensor(seed), 0.1)[0], grad.double() * factor),
    ):
        differ = (got.double() != exact.to(dtype).double())[kept].double().mean().item()
        assert differ <= 0.02, f"{what} {dtype}: {differ:.1%} of the kept results differ from the exact ones rounded"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fault", ["one-percent-off", "no-bias", "no-residual", "negated", "another-mask"])
def test_the_bounds_catch_faults(fault, dtype):
    """The forward and column-sum bounds above reject outputs off by the usual faults."""
    shape, p = (70, 768), 0.1
    h, bias, residual, grad, seed = _inputs(dtype, shape, fault)
    factor = _factor(seed, shape, p)
    exact = (h.double() + bias.double()) * factor + residual.double()
    bound = _forward_bound(dtype, exact, h, bias, factor, residual)
    got = {
        "one-percent-off": lambda: (exact * 1.01).to(dtype),
        "no-bias": lambda: ops.bias_dropout_add(h, torch.zeros_like(bias), residual, torch.tensor(seed), p),
        "no-residual": lambda: ops.bias_dropout_add(h, bias, torch.zeros_like(residual), torch.tensor(seed), p),
        "negated": lambda: -ops.bias_dropout_add(h, bias, residual, torch.tensor(seed), p),
        "another-mask": lambda: ops.bias_dropout_add(h, bias, residual, torch.tensor(seed + 1), p),
    }[fault]()
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(got, exact, bound, fault)
    grad_h, sums = ops.dropout_column_sums(grad, torch.tensor(seed), p)
    terms = grad_h.double()
    # (for the sums: 1% off, zeroed, the gradient's sums without the mask, negated, another mask's)
    faulty_sums = {
        "one-percent-off": sums.double() * 1.01,
        "no-bias": torch.zeros_like(sums),
        "no-residual": grad.sum(0),
        "negated": -sums,
        "another-mask": ops.dropout_column_sums(grad, torch.tensor(seed + 1), p)[1],
    }[fault]
    with pytest.raises(AssertionError, match="exceeds its bound"):
        _assert_within(faulty_sums, terms.sum(0), _column_sums_bound(dtype, terms), fault + " (sums)")


def test_the_mask_is_the_dropouts():
    """With no bias and no residual it is the dropout kernel, element for element."""
    h, bias, residual, _, seed = _inputs(torch.float32, (9, 50))
    got = ops.bias_dropout_add(h, torch.zeros_like(bias), torch.zeros_like(residual), torch.tensor(seed), 0.4)
    assert torch.equal(got, ops.dropout(h, torch.tensor(seed), 0.4))


def test_gradcheck_float64():
    h, bias, residual = (
        torch.randn(shape, dtype=torch.float64, requires_grad=True) for shape in ((3, 2, 21), (21,), (3, 2, 21))
    )
    seed = torch.tensor(77)
    assert torch.autograd.gradcheck(lambda *args: ops.bias_dropout_add(*args, seed, 0.3), (h, bias, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autograd_gradients_of_all_inputs(dtype):
    """Through the public function: h's gradient is the dropped-out gradient (the dropout kernel's,
    exactly), the bias's its sum over the rows, the residual's the gradient itself; the seed is
    one draw from torch's generator."""
    h, bias, residual, grad, _ = _inputs(dtype, (2, 33, 40))
    for t in (h, bias, residual):
        t.requires_grad_(True)
    torch.manual_seed(4)
    out = bias_dropout_add(h, bias, residual, 0.2)
    torch.manual_seed(4)
    seed = torch.randint(0, 2**31 - 1, ())
    assert torch.equal(out, ops.bias_dropout_add(h.detach(), bias.detach(), residual.detach(), seed, 0.2))
    out.backward(grad)
    assert torch.equal(h.grad, ops.dropout(grad, seed, 0.2))
    assert torch.equal(residual.grad, grad)
    terms = h.grad.double().flatten(0, 1)
    _assert_within(bias.grad, terms.sum(0), _column_sums_bound(dtype, terms), "bias gradient")


def test_not_training_or_p_zero_draws_no_seed():
    h, bias, residual, _, _ = _inputs(torch.float32, (5, 24))
    exact = h.double() + bias.double() + residual.double()
    for p, training in ((0.3, False), (0.0, True)):
        state = torch.get_rng_state()
        got = bias_dropout_add(h, bias, residual, p, training)
        assert torch.equal(torch.get_rng_state(), state)
        _assert_within(
            got, exact, _forward_bound(torch.float32, exact, h, bias, 1.0, residual), f"p={p} training={training}"
        )


def test_in_place_is_the_same_kernel():
    h, bias, residual, _, seed = _inputs(torch.float32, (6, 70))
    expected = ops.bias_dropout_add(h, bias, residual, torch.tensor(seed), 0.5)
    ops.bias_dropout_add_(h, bias, residual, torch.tensor(seed), 0.5)
    assert torch.equal(h, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_at_any_address(dtype):
    """Tensors that start one element into their storage: the kernels may not assume vector-aligned
    data, nor (bfloat16 on pairs) 4-byte-aligned data."""
    h, bias, residual, grad, seed = _inputs(dtype, (3, 64))
    seed = torch.tensor(seed)

    expected = ops.bias_dropout_add(h, bias, residual, seed, 0.5)
    assert torch.equal(ops.bias_dropout_add(unaligned(h), unaligned(bias), unaligned(residual), seed, 0.5), expected)
    in_place = unaligned(h)
    ops.bias_dropout_add_(in_place, unaligned(bias), unaligned(residual), seed, 0.5)
    assert torch.equal(in_place, expected)
    for got, want in zip(ops.dropout_column_sums(unaligned(grad), seed, 0.5), ops.dropout_column_sums(grad, seed, 0.5)):
        assert torch.equal(got, want)


def test_non_contiguous_and_empty():
    h, bias, residual, _, seed = _inputs(torch.float32, (12, 20))
    transposed = h.t().contiguous().t()  # [12, 20], not contiguous
    assert not transposed.is_contiguous()
    seed = torch.tensor(seed)
    assert torch.equal(
        ops.bias_dropout_add(transposed, bias, residual.t().contiguous().t(), seed, 0.5),
        ops.bias_dropout_add(h, bias, residual, seed, 0.5),
    )
    assert bias_dropout_add(torch.empty(0, 20), bias, torch.empty(0, 20)).shape == (0, 20)
    grad_h, sums = ops.dropout_column_sums(torch.empty(0, 20), seed, 0.5)
    assert grad_h.shape == (0, 20) and torch.equal(sums, torch.zeros(20))


def _reference_block(x, linear, residual, dtype, factor):
    """float64 ``(x W^T + b) * factor + residual`` on the inputs rounded to ``dtype``, and its bound:
    float32 accumulation over K, one rounding of the GEMM's output to ``dtype`` (before the bias
    meets it) and one of the result (u each), and the kernel's float32 arithmetic."""
    x64, weight, bias = (t.detach().to(dtype).double() for t in (x, linear.weight, linear.bias))
    product = x64 @ weight.t()
    exact = (product + bias) * factor + residual.double()
    accumulation = x.shape[-1] * unit_roundoff(torch.float32) * (x64.abs() @ weight.abs().t())
    terms = ((product + bias).abs() + product.abs()) * factor + residual.double().abs()
    u = unit_roundoff(dtype)
    bound = (accumulation + u * product.abs()) * factor + u * exact.abs() + 3 * _slack(dtype) * terms
    return exact, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["training", "eval", "inference"])
def test_linear_dropout_add_is_dropout_of_linear_plus_residual(dtype, mode):
    torch.manual_seed(5)
    linear = nn.Linear(48, 200).to(dtype)
    drop = Dropout(0.3).train(mode == "training")
    x = torch.randn(2, 9, 48, dtype=dtype)
    residual = torch.randn(2, 9, 200, dtype=dtype)
    torch.manual_seed(8)
    with torch.set_grad_enabled(mode != "inference"):
        got = linear_dropout_add(x, linear, drop, residual)
    torch.manual_seed(8)
    factor = _factor(int(torch.randint(0, 2**31 - 1, ())), (2, 9, 200), 0.3) if mode == "training" else 1.0
    assert got.dtype == dtype and got.requires_grad == (mode != "inference")
    exact, bound = _reference_block(x, linear, residual, dtype, factor)
    _assert_within(got, exact, bound, f"linear_dropout_add {dtype} {mode}")
    with pytest.raises(AssertionError, match="exceeds its bound"):  # the bound rejects a result 1% off
        _assert_within(got.double() * 1.01, exact, bound, "1% off")


def test_linear_dropout_add_under_autocast():
    """The GEMM in autocast's dtype; a float32 residual (autocast's stream) takes torch's ops, a
    residual of autocast's dtype our kernel."""
    torch.manual_seed(6)
    linear, drop = nn.Linear(32, 64), Dropout(0.1).eval()
    x = torch.randn(5, 32)
    for residual in (torch.randn(5, 64), torch.randn(5, 64).to(torch.bfloat16)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = linear_dropout_add(x, linear, drop, residual)
            expected = drop(linear(x)) + residual
        assert got.dtype == expected.dtype == residual.dtype
        exact, bound = _reference_block(x, linear, residual, torch.bfloat16, 1.0)
        _assert_within(got, exact, bound, f"under autocast, residual {residual.dtype}")


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize(
    "which", ["subclass", "hooked", "own-forward", "no-bias", "torch-dropout", "hooked-dropout", "broadcast-residual"]
)
def test_linear_dropout_add_calls_other_modules_as_they_are(monkeypatch, which):
    """An adapter, a hook, a forward replaced on the instance, a missing bias, torch's own dropout or
    a hooked one, a residual that broadcasts: the modules are called, our kernels are not."""
    for name in ("bias_dropout_add", "bias_dropout_add_"):
        monkeypatch.setattr(ops, name, lambda *args: pytest.fail(f"{name} called"))
    torch.manual_seed(7)
    linear = _ScaledLinear(16, 24) if which == "subclass" else nn.Linear(16, 24, bias=which != "no-bias")
    drop = nn.Dropout(0.2) if which == "torch-dropout" else Dropout(0.2)
    if which == "hooked":
        linear.register_forward_hook(lambda module, args, out: out + 1)
    if which == "hooked-dropout":
        drop.register_forward_hook(lambda module, args, out: out * 3)
    if which == "own-forward":
        plain_forward = linear.forward
        linear.forward = lambda x: plain_forward(x) - 1
    x, residual = torch.randn(3, 16), torch.randn(1 if which == "broadcast-residual" else 3, 24)
    torch.manual_seed(1)
    got = linear_dropout_add(x, linear, drop, residual)
    torch.manual_seed(1)
    assert torch.equal(got, drop(linear(x)) + residual)


def test_without_a_kernel_it_is_torchs_ops(monkeypatch):
    without_kernels(monkeypatch, "bias_dropout_add")
    h, bias, residual, _, _ = _inputs(torch.float32, (4, 30))
    torch.manual_seed(2)
    got = bias_dropout_add(h, bias, residual, 0.5)
    torch.manual_seed(2)
    assert torch.equal(got, dropout(h + bias, 0.5) + residual)  # the dropout (on its own kernel) and torch's adds
    linear, drop = nn.Linear(30, 30), Dropout(0.5)
    torch.manual_seed(3)
    got = linear_dropout_add(h, linear, drop, residual)
    torch.manual_seed(3)
    assert torch.equal(got, drop(linear(h)) + residual)


def test_inference_adds_in_place_in_the_gemms_output(monkeypatch):
    """Without autograd, with the kernel or without it (CUDA), the result is the GEMM's own output."""
    linear, drop = nn.Linear(10, 20), Dropout(0.1).eval()
    x, residual = torch.randn(3, 10), torch.randn(3, 20)
    expected = (linear(x) + residual).detach()
    mm, linear_ = torch.mm, nn.functional.linear
    for available in (True, False):
        outputs = []
        if not available:
            without_kernels(monkeypatch, "bias_dropout_add")
        monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: outputs.append(mm(*args, **kwargs)) or outputs[-1])
        monkeypatch.setattr(nn.functional, "linear", lambda *args: outputs.append(linear_(*args)) or outputs[-1])
        with torch.no_grad():
            got = linear_dropout_add(x, linear, drop, residual)
        assert len(outputs) == 1 and got.data_ptr() == outputs[0].data_ptr(), available
        _assert_within(
            got, expected.double(), 4 * unit_roundoff(torch.float32) * (expected.abs().double() + 1), str(available)
        )


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("h", torch.ones(3), torch.ones(3)), TypeError, "h must be a floating-point torch.Tensor, got str"),
        (
            (torch.ones(2, 3), torch.ones(2), torch.ones(2, 3)),
            ValueError,
            r"bias must have shape \[3\] \(h's last dimension\), got \[2\]",
        ),
        ((torch.ones(2, 3), torch.ones(3), [1.0]), TypeError, "residual must be a torch.Tensor, got list"),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(3)),
            ValueError,
            r"residual must have h's shape \[2, 3\], got \[3\]",
        ),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(2, 3, dtype=torch.float64)),
            TypeError,
            "residual must have h's dtype torch.float32, got torch.float64",
        ),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(2, 3, device="meta")),
            ValueError,
            "residual must be on h's device cpu, got meta",
        ),
        (
            (torch.ones(2, 3), torch.ones(3), torch.ones(2, 3), 1.5),
            ValueError,
            r"p must be a probability in \[0, 1\], got 1.5",
        ),
        ((torch.ones(2, 3), torch.ones(3), torch.ones(2, 3), 0.5, 1), TypeError, "training must be a bool, got int"),
    ],
)
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        bias_dropout_add(*args)


def test_in_place_op_refuses_non_contiguous_tensors():
    h = torch.randn(8, 6).t()
    with pytest.raises(
        ValueError, match=r"h must be contiguous to be written in place, got strides \(1, 6\) for shape \(6, 8\)"
    ):
        ops.bias_dropout_add_(h, torch.randn(8), torch.randn(6, 8), torch.tensor(0), 0.0)


def test_compiles_without_graph_break():
    h, bias, residual, _, _ = _inputs(torch.float32, (8, 24))
    compiled = torch.compile(lambda *args: bias_dropout_add(*args, 0.2) * 2, fullgraph=True, backend="aot_eager")
    torch.manual_seed(9)
    got = compiled(h, bias, residual)
    torch.manual_seed(9)
    assert torch.equal(got, bias_dropout_add(h, bias, residual, 0.2) * 2)
