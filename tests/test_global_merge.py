"""The layer's global-key merge kernels (torch.ops.longformer_ops.global_merge*, CPU libraries)
against float64 references, for every dtype and library, and the layer's merge (``_GlobalKeyMerge``)
with them against its torch form: outputs, gradients, gradcheck."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unaligned, unit_roundoff, without_kernels

from longformer_ops.models import layer as layer_module
from longformer_ops.runtime import kernels

ops = torch.ops.longformer_ops

# (b, n, h, d, g): features not a multiple of a vector (7, 40) and under one vector, odd lengths,
# one slot and several (the backward takes the slots four at a time, then the 1-3 left in one pass);
# 190 and 18 for AVX2's bfloat16 forward on pairs (microkernels.py): 11 vectors of pairs, a vector
# of 8 and a tail of 6; one vector of pairs and a tail of 2; and no slots at all (no global tokens).
SIZES = [
    (1, 1, 1, 7, 1),
    (2, 37, 3, 40, 2),
    (1, 19, 12, 64, 1),
    (2, 5, 2, 16, 4),
    (2, 4, 3, 9, 5),
    (1, 6, 2, 24, 7),
    (1, 3, 2, 190, 5),
    (2, 5, 3, 18, 3),
    (2, 5, 3, 16, 0),
]


def _inputs(dtype, size, *parts):
    b, n, h, d, g = size
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), size, *parts))
    acc = kernels.accumulation_dtype(dtype)

    def draw(*shape, of=dtype):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(of)

    a = torch.rand(b, n, h, generator=generator, dtype=torch.float64).to(acc)
    omega = torch.rand(b, n, h, g, generator=generator, dtype=torch.float64).to(acc)
    return draw(b, n, h, d), a, omega, draw(b, g, h, d), draw(b, n, h, d)


def _exact(context, a, omega, values, grad):
    c, a, o, v, gr = (t.double() for t in (context, a, omega, values, grad))
    out = a[..., None] * c + torch.einsum("bnhg,bghd->bnhd", o, v)
    return out, gr * a[..., None], (gr * c).sum(-1), torch.einsum("bnhd,bghd->bnhg", gr, v)


def _check(got, exact, bound, what):
    error = (got.double() - exact).abs()
    worst = (error - bound).max().item() if error.numel() else -1.0
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3e} (largest error {error.max().item():.3e})"


def _bounds(dtype, context, a, omega, values, grad):
    """Output: one rounding to ``dtype`` (u |out|) plus (g + 1) products and sums in the
    accumulation dtype (2 (g + 1) u_acc times the sum of magnitudes). u and t: d products and sums
    (d u_acc times the sum of magnitudes). The context's gradient: one rounding plus one product.
    Outputs in ``dtype`` also allow a subnormal spacing (where rounding is absolute)."""
    c, a, o, v, gr = (t.double().abs() for t in (context, a, omega, values, grad))
    u, u_acc, g, d = (
        unit_roundoff(dtype),
        unit_roundoff(kernels.accumulation_dtype(dtype)),
        omega.shape[-1],
        c.shape[-1],
    )
    spacing = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    magnitude = a[..., None] * c + torch.einsum("bnhg,bghd->bnhd", o, v)
    out = u * magnitude + 2 * (g + 1) * u_acc * magnitude + spacing
    return (
        out,
        2 * u * gr * a[..., None] + spacing,
        (d + 1) * u_acc * (gr * c).sum(-1),
        (d + 1) * u_acc * torch.einsum("bnhd,bghd->bnhg", gr, v),
    )


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_kernels_match_float64(cpu_library, dtype, size):
    context, a, omega, values, grad = _inputs(dtype, size)
    exact = _exact(context, a, omega, values, grad)
    bounds = _bounds(dtype, context, a, omega, values, grad)
    out = ops.global_merge(context, a, omega, values)
    assert out.dtype == dtype and out.shape == context.shape
    _check(out, exact[0], bounds[0], f"global_merge {dtype} {size}")
    grad_context, u, t = ops.global_merge_backward(grad, context, values, a)
    assert (grad_context.dtype, u.dtype, t.dtype) == (dtype, a.dtype, a.dtype)
    for got, want, bound, what in zip((grad_context, u, t), exact[1:], bounds[1:], ("grad a", "u", "t")):
        _check(got, want, bound, f"{what} {dtype} {size}")
    in_place = context.clone()
    ops.global_merge_(in_place, a, omega, values)
    assert torch.equal(in_place, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_at_any_address(cpu_library, dtype):
    """Tensors one element into their storage: the kernels may not assume vector-aligned data, nor
    (bfloat16 on pairs) 4-byte-aligned data."""
    context, a, omega, values, grad = _inputs(dtype, (2, 5, 3, 64, 3))

    expected = ops.global_merge(context, a, omega, values)
    assert torch.equal(ops.global_merge(unaligned(context), a, omega, unaligned(values)), expected)
    in_place = unaligned(context)
    ops.global_merge_(in_place, a, omega, unaligned(values))
    assert torch.equal(in_place, expected)
    for got, want in zip(
        ops.global_merge_backward(unaligned(grad), unaligned(context), unaligned(values), a),
        ops.global_merge_backward(grad, context, values, a),
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fault", ["one-percent-off", "slot-dropped", "negated"])
def test_the_bounds_catch_faults(fault):
    size = (2, 37, 3, 40, 2)
    context, a, omega, values, grad = _inputs(torch.float32, size, fault)
    exact = _exact(context, a, omega, values, grad)
    bounds = _bounds(torch.float32, context, a, omega, values, grad)
    if fault == "slot-dropped":
        omega = omega.clone()
        omega[..., 1] = 0
        values = values.clone()
        values[:, 1] = 0
    outputs = (ops.global_merge(context, a, omega, values), *ops.global_merge_backward(grad, context, values, a))
    if fault == "one-percent-off":
        outputs = tuple(x.double() * 1.01 for x in outputs)
    elif fault == "negated":
        outputs = tuple(-x for x in outputs)
    caught = 0
    for got, want, bound in zip(outputs, exact, bounds):
        try:
            _check(got, want, bound, fault)
        except AssertionError:
            caught += 1
    # each output catches a scaled or negated one; a dropped slot shows in the output and in t
    assert caught == (2 if fault == "slot-dropped" else 4), caught


@pytest.mark.parametrize("keep", [False, True], ids=["no-dropout", "dropout"])
def test_layer_merge_on_the_kernels_is_its_torch_form(monkeypatch, keep):
    """_GlobalKeyMerge with the kernels against the same function on torch's ops (float64:
    the same sums in another order), outputs and every input's gradient; and gradcheck."""
    generator = torch.Generator().manual_seed(3)
    b, n, h, d, g = 2, 23, 3, 40, 2

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    context, lse, scores, values = draw(b, n, h, d), draw(b, n, h), draw(b, n, h, g), draw(b, g, h, d)
    keep_factors = (
        (torch.rand(b, n, h, g, generator=generator, dtype=torch.float64) > 0.3).double() / 0.7 if keep else None
    )
    inputs = (context, lse, scores, values)
    grad = torch.randn(b, n, h, d, generator=generator, dtype=torch.float64)

    def run():
        out = layer_module._GlobalKeyMerge.apply(*inputs, keep_factors)
        return (out, *torch.autograd.grad(out, inputs, grad))

    calls = []
    forward, backward = ops.global_merge, ops.global_merge_backward
    monkeypatch.setattr(ops, "global_merge", lambda *args: calls.append("forward") or forward(*args))
    monkeypatch.setattr(ops, "global_merge_backward", lambda *args: calls.append("backward") or backward(*args))
    ours = run()
    assert calls == ["forward", "backward"]
    small = tuple(
        x[index].detach().clone().requires_grad_()
        for x, index in zip(
            inputs,
            (
                (slice(1), slice(7), slice(2), slice(9)),
                (slice(1), slice(7), slice(2)),
                (slice(1), slice(7), slice(2)),
                (slice(1), slice(None), slice(2), slice(9)),
            ),
        )
    )
    small_keep = keep_factors[:1, :7, :2] if keep else None
    assert torch.autograd.gradcheck(lambda *x: layer_module._GlobalKeyMerge.apply(*x, small_keep), small)
    without_kernels(monkeypatch, "global_merge")
    theirs = run()
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
