"""Under torch.autocast the ops and the layer run our half-precision kernels (not a float32
fallback) and stay within that dtype's error of float32; outside autocast mixed dtypes are refused.

The bound for the layer follows flash-attn's rule: our error against float32 is at most twice the
error of the plain-PyTorch reference (the layer's "full" mode) run under the same autocast.
"""

from __future__ import annotations

import pytest
import torch

from longformer_ops import (
    AttentionMode,
    LongformerConfig,
    LongformerSelfAttention,
    diagonaled_mm,
    sliding_window_attention,
)
from longformer_ops.ops.reference import sliding_window_attention_reference
from longformer_ops.runtime import kernels

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def kernel_dtypes(monkeypatch):
    """The dtypes of the kernel libraries each call loads."""
    seen = []
    real = kernels.library_for

    def spy(device, dtype_name):
        seen.append(dtype_name)
        return real(device, dtype_name)

    monkeypatch.setattr(kernels, "library_for", spy)
    return seen


def _inputs(seed, b=2, n=45, h=4, f=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, f, generator=g) for _ in range(3)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_sliding_window_attention_runs_the_half_kernels(dtype, kernel_dtypes):
    q, k, v = _inputs(0)
    with torch.autocast("cpu", dtype):
        out = sliding_window_attention(q, k, v, 4, [1, 2, 3, 1])
    assert out.dtype == dtype
    assert set(kernel_dtypes) == {str(dtype).removeprefix("torch.")}, kernel_dtypes
    # What the kernels got: the inputs rounded to the half type; the reference in float64 on those.
    rounded = [x.to(dtype).double() for x in (q, k, v)]
    ref = sliding_window_attention_reference(*rounded, 4, [1, 2, 3, 1])
    # The output's own rounding (measured: <= 0.99 units here), and where a kernel rounds the
    # probabilities to the half type (the bfloat16 dot product) one unit per probability: at
    # most a unit of P.|v| (measured: 0.48 of it beyond the first term); float32 accumulation
    # adds ~1e-7.
    unit = torch.finfo(dtype).eps / 2
    terms = sliding_window_attention_reference(rounded[0], rounded[1], rounded[2].abs(), 4, [1, 2, 3, 1])
    bound = 1.5 * unit * ref.abs() + unit * terms
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_two_step_with_float32_probabilities(dtype, kernel_dtypes):
    """A float32 band of probabilities and half-type values: autocast casts both, as it does for matmul."""
    q, k, v = _inputs(1)
    with torch.autocast("cpu", dtype):
        scores = diagonaled_mm(q, k, 3, 2, padding=float("-inf"))
        assert scores.dtype == dtype
        out = diagonaled_mm(scores.float().softmax(-1), v.to(dtype), 3, 2, is_t1_diagonaled=True)
    assert out.dtype == dtype and set(kernel_dtypes) == {str(dtype).removeprefix("torch.")}


def test_float64_is_not_autocast(kernel_dtypes):
    q, k, v = (x.double() for x in _inputs(2))
    with torch.autocast("cpu", torch.bfloat16):
        assert sliding_window_attention(q, k, v, 4).dtype == torch.float64
    assert set(kernel_dtypes) == {"float64"}


def test_mixed_dtypes_outside_autocast_are_refused():
    q, k, v = _inputs(3)
    with pytest.raises(
        TypeError,
        match=r"t1 and t2 must have the same dtype, got t1.dtype=torch.float32, "
        r"t2.dtype=torch.bfloat16",
    ):
        diagonaled_mm(q, k.bfloat16(), 3, 1)
    with pytest.raises(TypeError, match=r"v must have q's dtype torch.float32, got v.dtype=torch.bfloat16"):
        sliding_window_attention(q, k, v.bfloat16(), 3)


def _layer(mode: AttentionMode) -> LongformerSelfAttention:
    config = LongformerConfig(
        vocab_size=50,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=80,
        attention_window=[4],
        attention_dilation=[[1, 2, 1, 3]],
        attention_probs_dropout_prob=0.0,
        attention_mode=mode,
    )
    torch.manual_seed(0)
    return LongformerSelfAttention(config, 0)


def _layer_run(layer, x, mask, autocast_dtype=None):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = layer(x, mask)[0]
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach().float(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
def test_layer_under_autocast(dtype, globals_, kernel_dtypes):
    """Forward and backward of the layer (padding; a global token or none): our half kernels only, and
    output and every gradient within twice the error of the dense reference under the same autocast."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 45, 64, generator=g)
    mask = torch.zeros(2, 45, dtype=torch.long)
    mask[1, 38:] = -1
    if globals_:
        mask[0, 0] = mask[1, 5] = 1
    ours = _layer(AttentionMode.TVM)
    dense = _layer(AttentionMode.FULL)
    exact = _layer_run(ours, x, mask)
    kernel_dtypes.clear()
    got = _layer_run(ours, x, mask, dtype)
    assert set(kernel_dtypes) == {str(dtype).removeprefix("torch.")}, kernel_dtypes
    reference = _layer_run(dense, x, mask, dtype)
    names = ["output", "grad x"] + [name for name, _ in ours.named_parameters()]
    for name, a, r, e in zip(names, got, reference, exact):
        if e is None:
            continue
        ours_error, reference_error = (a - e).abs().max(), (r - e).abs().max()
        assert ours_error <= 2 * reference_error + 1e-6 * e.abs().max(), (
            name,
            float(ours_error),
            float(reference_error),
        )
