"""``band_softmax_``: the in-place softmax over each query's band (invalid keys and padding removed)
against a float64 reference, its gradients, its fallback on torch ops, its errors."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, assert_normwise_close, normwise_bound, stable_seed

from longformer_ops import band_softmax_, diagonaled_mm, mask_invalid_locations
from longformer_ops.runtime import loader as _loader
from longformer_ops.runtime.band import band_width, invalid_locations

# exp's relative error where the CPU kernels round its results to a half type (tvm_kernels'
# microkernels._EXP_HALF: a degree-4 fit, 2.7e-6), which the half types' log-sum-exp inherits.
EXP_HALF_ERROR = 2.7e-6

# (batch, seq_len, heads, w): n in {1, 2, 17, 513}, w in {0, 1, >= n}, several heads.
SIZES = [(2, 1, 3, 0), (1, 2, 2, 3), (2, 17, 3, 1), (1, 17, 4, 20), (1, 513, 4, 16), (2, 513, 3, 200)]


def _case(size, dtype, autoregressive, masked, dilation_kind):
    b, n, h, w = size
    g = torch.Generator().manual_seed(
        stable_seed("band softmax", size, str(dtype), autoregressive, masked, dilation_kind)
    )
    d = [int(x) for x in torch.randint(1, 9, (h,), generator=g)] if dilation_kind == "per-head" else 2
    scores = (3 * torch.randn(b, n, h, band_width(w, autoregressive), generator=g, dtype=torch.float64)).to(dtype)
    mask = None
    if masked:  # ~30% of keys, and the last example's second half: some rows keep no key at all
        mask = torch.rand(b, n, generator=g) < 0.3
        mask[-1, n // 2 :] = True
    return scores, w, d, mask


def _removed(n, h, w, d, autoregressive, mask):
    """Bool [b or 1, n, h, c]: band positions whose key is outside the sequence or masked."""
    dilation = torch.tensor([d] * h if isinstance(d, int) else d)
    removed = invalid_locations(n, w, dilation, autoregressive)[None]
    if mask is not None:
        keys = torch.arange(n).view(n, 1, 1) + dilation.view(1, h, 1) * (torch.arange(removed.shape[-1]) - w)
        removed = removed | mask[:, keys.clamp(0, n - 1)]
    return removed


def _reference(scores, w, d, autoregressive, mask):
    """(probs, lse) in float64 from torch's softmax on the masked scores; rows with no key: 0 and -inf."""
    b, n, h, _ = scores.shape
    masked = scores.double().masked_fill(_removed(n, h, w, d, autoregressive, mask), float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    probs = torch.softmax(masked, dim=-1).nan_to_num(0.0)
    return probs, lse


@pytest.mark.parametrize("dilation_kind", ["single", "per-head"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_matches_reference(cpu_library, size, dtype, autoregressive, masked, dilation_kind):
    scores, w, d, mask = _case(size, dtype, autoregressive, masked, dilation_kind)
    ref_probs, ref_lse = _reference(scores, w, d, autoregressive, mask)
    probs, lse = band_softmax_(scores, w, d, autoregressive, key_padding_mask=mask, return_lse=True)
    assert probs is scores, "the softmax is written in place"
    removed = _removed(*size[1:3], w, d, autoregressive, mask).expand_as(probs)
    assert (probs[removed] == 0).all(), "removed keys must get exactly 0"
    assert_normwise_close(probs, ref_probs, dtype, "probabilities", zero_scale=1.0)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    no_key = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), no_key), "lse is -inf exactly for rows with no key"
    # lse's error: the scores' rounding is the inputs' (exact here); the float32 sum and log add a few u,
    # and in the half types the exponentials' cheaper polynomial (the CPU kernels' EXP_HALF_ERROR).
    bound = 8 * torch.finfo(lse.dtype).eps * ref_lse[~no_key].abs().clamp_min(1)
    if dtype in (torch.bfloat16, torch.float16):
        bound = bound + EXP_HALF_ERROR
    assert ((lse[~no_key].double() - ref_lse[~no_key]).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_round_to_nearest(cpu_library, dtype):
    """The half types' probabilities are the float64 ones rounded to nearest, but where the float32
    arithmetic (exp's half-type polynomial: 2.7e-6) lands next to a tie: at most 2% differ among
    probabilities of 0.01 and more (measured 0.04% in bfloat16, 0.14% in float16). The normwise
    check above cannot see the rounding's direction: rounded toward zero instead, about half differ."""
    scores, w, d, _ = _case((1, 513, 4, 16), dtype, False, False, "per-head")
    ref, _ = _reference(scores, w, d, False, None)
    probs = band_softmax_(scores, w, d)
    large = ref >= 0.01
    differ = (probs.double() != ref.to(dtype).double())[large].double().mean().item()
    assert large.sum() > 1000 and differ <= 0.02, (
        f"{dtype}: {differ:.2%} of the probabilities differ from the exact ones rounded"
    )


def test_checks_fail_on_faults():
    """The probability check refuses a zeroed, negated, 1%-off, one-element-off and window-shifted result."""
    scores, w, d, mask = _case((1, 513, 4, 16), torch.float32, False, True, "per-head")
    ref, _ = _reference(scores, w, d, False, mask)
    got = band_softmax_(scores.clone(), w, d, key_padding_mask=mask)
    assert_normwise_close(got, ref, torch.float32, "probabilities", zero_scale=1.0)
    one_off = got.clone()
    one_off.view(-1)[got.numel() // 3 + 7] += 0.01
    shifted = torch.roll(got, 1, dims=-1)
    for fault in (torch.zeros_like(got), -got, got * 1.01, one_off, shifted):
        with pytest.raises(AssertionError):
            assert_normwise_close(fault, ref, torch.float32, "probabilities", zero_scale=1.0)
    assert normwise_bound(torch.float32) < 1e-4


# Rows of 19 or 10 keys; and of 81 or 41 (AVX2's bfloat16 takes rows as 32-bit pairs: vectors of
# them, a lone value first where a row starts inside a pair).
GRADIENT_SIZES = [(2, 67, 4, 9), (1, 90, 3, 40)]


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", GRADIENT_SIZES, ids=str)
def test_gradients_match_reference(cpu_library, size, dtype, autoregressive, masked):
    """d(probs . g + lse . gl) / d scores against autograd through the float64 reference."""
    scores, w, d, mask = _case(size, dtype, autoregressive, masked, "per-head")
    g = torch.Generator().manual_seed(stable_seed("band softmax grad", size, str(dtype), autoregressive, masked))
    grad = torch.randn(scores.shape, generator=g, dtype=torch.float64).to(dtype)
    grad_lse = torch.randn(scores.shape[:3], generator=g, dtype=torch.float64)
    leaf = scores.clone().requires_grad_()
    probs, lse = band_softmax_(leaf.clone(), w, d, autoregressive, key_padding_mask=mask, return_lse=True)
    finite = ~torch.isinf(lse.detach())
    (got,) = torch.autograd.grad((probs * grad).sum() + (lse * grad_lse.to(lse.dtype))[finite].sum(), leaf)
    exact = scores.double().requires_grad_()
    ref_probs, ref_lse = _reference(exact, w, d, autoregressive, mask)
    (expected,) = torch.autograd.grad((ref_probs * grad.double()).sum() + (ref_lse * grad_lse)[finite].sum(), exact)
    assert got.dtype == dtype
    assert_normwise_close(got, expected, dtype, "d scores", zero_scale=1.0, gradients=True)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_gradcheck_float64(cpu_library, autoregressive):
    scores, w, d, mask = _case((2, 11, 3, 3), torch.float64, autoregressive, True, "per-head")

    def softmax(x):
        probs, lse = band_softmax_(x.clone(), w, d, autoregressive, key_padding_mask=mask, return_lse=True)
        return probs, lse.masked_fill(torch.isinf(lse), 0)  # rows with no key: lse -inf whatever the scores

    assert torch.autograd.gradcheck(softmax, (scores.requires_grad_(),))


@pytest.mark.parametrize("with_grad", [False, True], ids=["inference", "autograd"])
def test_torch_fallback_gives_the_same(monkeypatch, with_grad):
    """A library without the kernel (CUDA's today) runs torch's ops: the same probabilities, lse and gradients."""
    scores, w, d, mask = _case((2, 67, 4, 9), torch.float64, False, True, "per-head")
    results = []
    for has in (True, False):
        monkeypatch.setattr(
            _loader.KernelLibrary, "has", lambda self, name, has=has: has or not name.startswith("softmax")
        )
        leaf = scores.clone().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            probs, lse = band_softmax_(
                leaf.clone() if with_grad else leaf, w, d, key_padding_mask=mask, return_lse=True
            )
        outputs = [probs.detach(), lse.detach()]
        if with_grad:
            outputs += torch.autograd.grad((probs * probs.detach().roll(1, -1)).sum(), leaf)
        results.append(outputs)
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_the_original_path_in_one_band():
    """diagonaled_mm -> band_softmax_ -> diagonaled_mm equals the path with mask_invalid_locations and torch.softmax."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 100, 3, 16, generator=g) for _ in range(3))
    d = [1, 2, 5]
    scores = diagonaled_mm(q, k, 7, d)
    expected = diagonaled_mm(torch.softmax(mask_invalid_locations(scores.clone(), 7, d, False), -1), v, 7, d, True)
    torch.testing.assert_close(diagonaled_mm(band_softmax_(scores, 7, d), v, 7, d, True), expected)


def test_compiles():
    """Under torch.compile (an in-place op inside an autograd.Function) it gives eager's result and gradient."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 40, 2, 8, generator=g, requires_grad=True) for _ in range(2))

    def step(a, b):
        return band_softmax_(diagonaled_mm(a, b, 3, [1, 2]), 3, [1, 2]).square().sum()

    eager = step(q, k)
    eager_grads = torch.autograd.grad(eager, (q, k))
    compiled = torch.compile(step, fullgraph=True)(q, k)
    torch.testing.assert_close(compiled, eager)
    for got, expected in zip(torch.autograd.grad(compiled, (q, k)), eager_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_errors_name_the_argument():
    scores = torch.randn(1, 10, 2, 7)
    with pytest.raises(ValueError, match="scores must have last dimension c = 5"):
        band_softmax_(scores, 2, 1)
    with pytest.raises(ValueError, match="scores must be contiguous"):
        band_softmax_(torch.randn(1, 2, 10, 7).transpose(1, 2), 3, 1)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        band_softmax_(scores, 3, 1, key_padding_mask=torch.zeros(1, 10))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, seq_len\] = \(1, 10\)"):
        band_softmax_(scores, 3, 1, key_padding_mask=torch.zeros(1, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="scores must be a floating-point tensor"):
        band_softmax_(torch.zeros(1, 10, 2, 7, dtype=torch.int32), 3, 1)
    with pytest.raises(ValueError, match="dilation"):
        band_softmax_(scores, 3, [1, 0])
