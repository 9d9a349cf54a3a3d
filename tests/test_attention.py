"""sliding_window_attention (fused kernel for inference, the banded products with autograd)
against the plain-PyTorch reference, on every CPU library this machine runs, and on CUDA when present.

The reference runs in float64 on the same (rounded) inputs. The tolerance is the dtype's
(conftest) times the natural scale of the result's rounding: the context's own scale
(probs.V on |v|), widened by the row's largest score scale (|q|.|k|), since an absolute
error e in a score is a relative error e in its probability.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_DTYPES, CUDA_DTYPES, assert_normwise_close, stable_seed, unit_roundoff
from test_diagonaled_mm import DILATIONS, SIZES, _dilation, _random

from longformer_ops import sliding_window_attention
from longformer_ops.ops.dropout import dropout_seed
from longformer_ops.ops.reference import (
    diagonaled_mm_reference,
    dropout_factor_reference,
    sliding_window_attention_reference,
    sliding_window_lse_reference,
    sliding_window_probs_reference,
)
from longformer_ops.runtime import kernels
from longformer_ops.runtime import loader as _loader
from longformer_ops.runtime.band import band_width

# Beyond the shared grid: windows near the sequence length, many whole tiles, dilations 1..8.
LARGER = [(1, 200, 2, 64, 190), (2, 300, 4, 40, 37), (1, 700, 2, 96, 40)]


def _assert_close(
    out,
    q,
    k,
    v,
    w,
    d,
    autoregressive,
    scale,
    dtype,
    key_padding_mask=None,
    dropout_factor=None,
    what="result",
    softcap=None,
):
    """The result against the float64 reference on the same (rounded) inputs, norm-wise (conftest)."""
    q64, k64, v64 = (x.detach().double().cpu() for x in (q, k, v))
    ref = sliding_window_attention_reference(
        q64, k64, v64, w, d, autoregressive, scale, key_padding_mask, dropout_factor, softcap
    )
    assert out.shape == ref.shape and out.dtype == dtype
    assert_normwise_close(out, ref, dtype, what, zero_scale=float(v64.abs().max()) * ref.numel() ** 0.5)


def _check(device, dtype, size, autoregressive, dilation_kind, with_grad):
    b, n, h, f, w = size
    seed = stable_seed(size, autoregressive, dilation_kind, str(dtype))
    generator = torch.Generator().manual_seed(seed)
    d = _dilation(dilation_kind, h, generator)
    q, k, v = (_random((b, n, h, f), dtype, device, generator).requires_grad_(with_grad) for _ in range(3))
    scale = 1 / math.sqrt(f)
    out = sliding_window_attention(q, k, v, w, d, autoregressive)
    assert out.requires_grad == with_grad and out.device.type == torch.device(device).type
    _assert_close(out, q, k, v, w, d, autoregressive, scale, dtype, what=f"result (seed {seed})")


def _check_gradients(
    q, k, v, w, d, autoregressive, scale, dtype=torch.float64, key_padding_mask=None, dropout=None, seed=0, softcap=None
):
    """Gradients of all three inputs against the float64 reference's (same rounded inputs and output
    gradient), norm-wise; ``dropout`` = (p, torch seed): the fused kernels' dropout, its mask from the
    reference generator; ``seed`` seeds the output gradient (and is printed on failure)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        dtype=dtype, device=q.device
    )
    factor = None
    if dropout is not None:
        factor = _dropout_factor(dropout, q.shape, w, d, autoregressive).to(q.device)
        torch.manual_seed(dropout[1])
    out = sliding_window_attention(
        q,
        k,
        v,
        w,
        d,
        autoregressive,
        scale,
        key_padding_mask=key_padding_mask,
        dropout_p=0.0 if dropout is None else dropout[0],
        softcap=softcap,
    )
    got = torch.autograd.grad(out, (q, k, v), grad)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(
        sliding_window_attention_reference(*exact, w, d, autoregressive, scale, key_padding_mask, factor, softcap),
        exact,
        grad.double(),
    )
    # Where every row cancels (one key per query: dQ = dK = 0), the size of the cancelling terms.
    terms = float(grad.double().norm()) * max(float(x.detach().double().abs().max()) for x in (q, k, v)) ** 2
    for name, x, y in zip("qkv", got, want, strict=True):
        assert_normwise_close(x, y, dtype, f"d{name} (seed {seed})", zero_scale=terms, gradients=True)


@pytest.mark.parametrize("with_grad", [False, True], ids=["fused", "autograd"])
@pytest.mark.parametrize("dilation_kind", DILATIONS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES + LARGER, ids=str)
def test_cpu_matches_reference(cpu_library, size, dtype, autoregressive, dilation_kind, with_grad):
    _check("cpu", dtype, size, autoregressive, dilation_kind, with_grad)


@pytest.mark.parametrize("dilation_kind", DILATIONS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", [s for s in SIZES + LARGER if s[3] > 1 and s[1] > 1], ids=str)
def test_cpu_gradients_match_reference(cpu_library, size, dtype, autoregressive, dilation_kind):
    _check_gradients_of_case("cpu", size, dtype, autoregressive, dilation_kind)


def _check_gradients_of_case(device, size, dtype, autoregressive, dilation_kind):
    """:func:`_check_gradients` on random inputs of one grid case, seeded by the case."""
    b, n, h, f, w = size
    seed = stable_seed(size, autoregressive, dilation_kind, str(dtype), "gradients")
    g = torch.Generator().manual_seed(seed)
    d = _dilation(dilation_kind, h, g)
    q, k, v = (_random((b, n, h, f), dtype, device, g) for _ in range(3))
    _check_gradients(q, k, v, w, d, autoregressive, 1 / math.sqrt(f), dtype, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("with_grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES + LARGER, ids=str)
def test_cuda_matches_reference(size, dtype, autoregressive, with_grad):
    _check("cuda", dtype, size, autoregressive, "per-head", with_grad)


# (b, n, h, f, w): runs of 2w + 1 queries and more, a last run shorter than the others, w = 0.
RUN_SIZES = [(1, 300, 2, 16, 20), (2, 1000, 3, 32, 64), (1, 777, 1, 64, 50), (1, 1200, 2, 16, 33), (1, 500, 2, 16, 0)]


@pytest.mark.parametrize("runs", [2, 3, 64])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", RUN_SIZES, ids=str)
def test_cpu_runs_of_queries(cpu_library, size, dtype, autoregressive, runs, monkeypatch):
    """The fused CPU kernels split each (batch, head) into runs of queries when there are more
    threads than batch x heads (kernels.query_runs): the output and dQ are those of one run, bit
    for bit, and all three gradients match the float64 reference (each run packs the keys it
    reads; dK and dV near an edge between runs are the two runs' parts, summed), per-head dilations."""
    b, n, h, f, w = size
    seed = stable_seed(size, autoregressive, str(dtype), runs, "runs")
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(1, 9, (h,), generator=g, dtype=torch.int32)
    q, k, v = (_random((b, n, h, f), dtype, "cpu", g) for _ in range(3))
    grad = _random((b, n, h, f), dtype, "cpu", g)
    results = {}
    for count in (1, runs):
        monkeypatch.setattr(kernels, "query_runs", lambda *args, count=count: count)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = sliding_window_attention(*leaves, w, d, autoregressive)
        results[count] = (out.detach(), *torch.autograd.grad(out, leaves, grad))
    assert torch.equal(results[runs][0], results[1][0]), f"output with {runs} runs (seed {seed})"
    assert torch.equal(results[runs][1], results[1][1]), f"dq with {runs} runs (seed {seed})"
    _check_gradients(q, k, v, w, d, autoregressive, 1 / math.sqrt(f), dtype, seed=seed)


def test_query_runs_spread_the_heads_over_the_threads():
    """The fewest runs per (batch, head) that give every thread the same share (or the least work
    on the busiest), each run at least MIN_QUERIES_PER_RUN and 2w + 1 queries."""
    runs = kernels.query_runs
    assert runs(12, 4096, 256, 2) == 1  # 6 heads a thread already
    assert runs(12, 4096, 256, 8) == 2  # 24 runs: 3 a thread (12 heads: 2, 2, 2, 2, 2, 2, 0, 0)
    assert runs(12, 4096, 256, 16) == 4  # 48 runs: 3 a thread
    assert runs(3, 16384, 256, 2) == 2
    assert runs(1, 4096, 256, 2) == 2
    assert runs(12, 1024, 256, 16) == 1  # runs would be shorter than 2w + 1
    assert runs(1, 300, 0, 8) == 1  # or than MIN_QUERIES_PER_RUN
    assert runs(1, 4096, 0, 64) == 4096 // kernels.MIN_QUERIES_PER_RUN
    assert runs(12, 4096, 256, 1) == 1 and runs(0, 4096, 256, 8) == 1


def test_cpu_runs_follow_the_thread_count(monkeypatch):
    """Without a forced count the kernels get query_runs of torch's thread count: one head on four
    threads runs in several runs, with the reference's result."""
    seen = []
    choose = kernels.query_runs
    monkeypatch.setattr(kernels, "query_runs", lambda *args: seen.append(args) or choose(*args))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        g = torch.Generator().manual_seed(5)
        q, k, v = (_random((1, 1100, 1, 32), torch.float64, "cpu", g) for _ in range(3))
        out = sliding_window_attention(q, k, v, 40)
    finally:
        torch.set_num_threads(threads)
    assert seen == [(1, 1100, 40, 4)] and choose(*seen[0]) > 1
    _assert_close(out, q, k, v, 40, 1, False, 1 / math.sqrt(32), torch.float64)


def test_cpu_runs_the_fused_kernels_only(cpu_library, monkeypatch):
    """On CPU no band product runs, with or without gradients, and training saves no band for the
    backward (q, k, v, the dropout seed, the output and the rows' log-sum-exp only)."""

    def no_band(*args, **kwargs):
        raise AssertionError("a band product ran")

    monkeypatch.setattr(kernels, "_band_kernel", no_band)
    q, k, v = (torch.randn(1, 50, 2, 32, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        sliding_window_attention(q, k, v, 4, [1, 3])
    sliding_window_attention(q.detach(), k.detach(), v.detach(), 4, [1, 3])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = sliding_window_attention(q, k, v, 4, [1, 3])
    # seed, dilations (one int per head), lse, q, k, v, out
    assert sorted(saved) == sorted([(), (2,), (1, 50, 2)] + [(1, 50, 2, 32)] * 4), saved
    out.sum().backward()
    assert all(x.grad is not None for x in (q, k, v))


@pytest.mark.parametrize("needs", ["q", "k", "v", "qk", "kv"])
def test_gradients_of_a_subset_of_inputs(cpu_library, needs):
    """The backward computes only the gradients asked for, each equal to the reference's."""
    g = torch.Generator().manual_seed(4)
    inputs = {
        name: torch.randn(2, 45, 3, 32, generator=g, dtype=torch.float64).requires_grad_(name in needs)
        for name in "qkv"
    }
    grad = torch.randn(2, 45, 3, 32, generator=g, dtype=torch.float64)
    sliding_window_attention(*inputs.values(), 6, [1, 2, 3], scale=0.4).backward(grad)
    wanted = [x for x in inputs.values() if x.requires_grad]
    expected = torch.autograd.grad(
        sliding_window_attention_reference(*inputs.values(), 6, [1, 2, 3], False, 0.4), wanted, grad
    )
    for name, x in inputs.items():
        assert (x.grad is None) == (name not in needs)
    for x, e in zip(wanted, expected, strict=True):
        torch.testing.assert_close(x.grad, e)


def _without_fused_kernels(monkeypatch, band_softmax: bool):
    """Make the libraries look as if they had no fused kernels: the three steps run, their softmax
    on the band softmax kernel when ``band_softmax``, else on torch's ops (CUDA's, which has no
    band softmax kernel)."""
    keep = ("softmax_",) if band_softmax else ()
    monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: name.startswith(keep) if keep else False)


@pytest.mark.parametrize("softmax", ["band-softmax-kernel", "torch-softmax"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
def test_library_without_the_fused_kernels_runs_the_band_products(monkeypatch, autoregressive, masked, softmax):
    """A library without them gives the same results through the three steps."""
    _without_fused_kernels(monkeypatch, softmax == "band-softmax-kernel")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 77, 3, 20, generator=g, dtype=torch.float64) for _ in range(3))
    mask = _padding_mask(2, 77, g) if masked else None
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 9, [1, 2, 5], autoregressive, scale=0.3, key_padding_mask=mask)
    _assert_close(out, q, k, v, 9, [1, 2, 5], autoregressive, 0.3, torch.float64, mask)
    _check_gradients(q, k, v, 9, [1, 2, 5], autoregressive, 0.3, key_padding_mask=mask)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_a_window_past_the_sequence_is_the_narrowest_that_reaches_its_keys(cpu_library, dtype, autoregressive):
    """w far past every key (10^8 at n = 20, where the kernels' scratch, sized by w, had aborted the
    process) gives exactly what (n - 1) // min(d) gives, with and without dropout, values and gradients."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 20, 3, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    d = [2, 1, 5]
    for p in (0.0, 0.3):
        results = []
        for w in (19, 10**8):
            torch.manual_seed(5)
            out = sliding_window_attention(q, k, v, w, d, autoregressive, dropout_p=p)
            results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        for name, x, y in zip(("out", "dq", "dk", "dv"), *results, strict=True):
            assert torch.equal(x, y), f"{name} differs (p={p})"


def _padding_mask(b: int, n: int, generator) -> torch.Tensor:
    """Random masked keys (~30%), and the last example's second half all masked: some of its
    queries keep no key at all (their output must be 0)."""
    mask = torch.rand(b, n, generator=generator) < 0.3
    mask[-1, n // 2 :] = True
    return mask


MASKED_SIZES = [(1, 17, 4, 31, 20), (2, 17, 3, 64, 1), (1, 513, 4, 64, 16)] + LARGER


@pytest.mark.parametrize("with_grad", [False, True], ids=["fused", "autograd"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_key_padding_mask_matches_reference(cpu_library, size, dtype, autoregressive, with_grad):
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "")
    q, k, v = (x.requires_grad_(with_grad) for x in (q, k, v))
    out = sliding_window_attention(q, k, v, w, d, autoregressive, key_padding_mask=mask)
    scale = 1 / math.sqrt(q.shape[-1])
    _assert_close(out, q, k, v, w, d, autoregressive, scale, dtype, mask)
    if with_grad:
        _check_gradients(q, k, v, w, d, autoregressive, scale, dtype, mask)


def _masked_case(size, dtype, autoregressive, tag: str, device="cpu"):
    """Random q, k, v, per-head dilations and a key padding mask (:func:`_padding_mask`) for one grid
    size on ``device``; returns ``(q, k, v, w, d, mask, generator)``, seeded by the case and ``tag``."""
    b, n, h, f, w = size
    g = torch.Generator().manual_seed(stable_seed(size, autoregressive, str(dtype), tag))
    d = _dilation("per-head", h, g)
    mask = _padding_mask(b, n, g).to(device)
    q, k, v = (_random((b, n, h, f), dtype, device, g) for _ in range(3))
    return q, k, v, w, d, mask, g


# A cap near the scores' size (|q|, |k| ~ 1, scale 1 / sqrt(f) or 0.7: |s| up to a few): tanh far
# from linear there, so a kernel without the cap, or with another, fails the comparison.
SOFTCAP = 1.5


@pytest.mark.parametrize("path", ["fused", "three-steps"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_softcap_matches_reference(cpu_library, monkeypatch, size, dtype, autoregressive, path):
    """Logit soft-capping (Gemma 2's ``cap * tanh(s / cap)`` before the padding's -inf and the
    softmax): the result, its log-sum-exp and the three gradients against the float64 reference, with
    per-head dilations and masked keys, on the fused kernels and on the three steps."""
    if path != "fused":
        monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "softcap")
    scale = 4 / math.sqrt(q.shape[-1])  # scores of a few units: the cap bends them
    with torch.no_grad():
        out, lse = sliding_window_attention(
            q, k, v, w, d, autoregressive, scale, key_padding_mask=mask, softcap=SOFTCAP, return_lse=True
        )
    _assert_close(out, q, k, v, w, d, autoregressive, scale, dtype, mask, softcap=SOFTCAP)
    q64, k64 = (x.double() for x in (q, k))
    ref_lse = sliding_window_lse_reference(q64, k64, w, d, autoregressive, scale, mask, SOFTCAP)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert_normwise_close(lse[~empty], ref_lse[~empty], dtype, "lse", zero_scale=1.0)
    if q.shape[-1] > 1 and q.shape[1] > 1:
        _check_gradients(q, k, v, w, d, autoregressive, scale, dtype, mask, softcap=SOFTCAP)


def test_softcap_comparison_fails_on_another_cap(cpu_library):
    """The injected fault: the fused kernels' soft-capped result against the reference with another
    cap, or with none, fails the check test_softcap_matches_reference makes."""
    q, k, v, w, d, mask, _ = _masked_case((1, 513, 4, 64, 16), torch.float32, False, "softcap")
    scale = 4 / math.sqrt(q.shape[-1])
    out = sliding_window_attention(q, k, v, w, d, False, scale, key_padding_mask=mask, softcap=SOFTCAP)
    _assert_close(out, q, k, v, w, d, False, scale, torch.float32, mask, softcap=SOFTCAP)
    for wrong in (SOFTCAP * 1.01, None):
        with pytest.raises(AssertionError):
            _assert_close(out, q, k, v, w, d, False, scale, torch.float32, mask, softcap=wrong)


@pytest.mark.parametrize("softcap", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_softcap_must_be_positive_and_finite(softcap):
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None \(no soft-capping\), got"):
        sliding_window_attention(q, q, q, 2, softcap=softcap)


GROUPED_SIZES = [(1, 17, 4, 31, 20, 2), (2, 40, 6, 64, 5, 3), (1, 513, 4, 64, 16, 1), (1, 200, 2, 64, 190, 1)]


@pytest.mark.parametrize("path", ["fused", "three-steps"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", GROUPED_SIZES, ids=str)
def test_grouped_key_value_heads_match_reference(cpu_library, monkeypatch, size, dtype, autoregressive, path):
    """k and v with fewer heads (``(b, n, heads, f, w, kv_heads)``): the result and the three
    gradients equal the reference's on k and v repeated per query head (head i reads i // group),
    with per-head dilations and masked keys; on the CPU's fused kernels nothing repeats them."""
    if path == "fused":
        monkeypatch.setattr(kernels, "repeat_heads", lambda *args: pytest.fail("repeated on the fused kernels"))
    else:
        monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    *shape, kv_heads = size
    b, n, h, f, w = shape
    q, _, _, w, d, mask, g = _masked_case(tuple(shape), dtype, autoregressive, "grouped")
    k, v = (_random((b, n, kv_heads, f), dtype, "cpu", g).requires_grad_() for _ in range(2))
    q.requires_grad_()
    scale = 1 / math.sqrt(f)
    out = sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask=mask)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    repeated = [x.repeat_interleave(h // kv_heads, dim=2) for x in exact[1:]]
    ref = sliding_window_attention_reference(exact[0], *repeated, w, d, autoregressive, scale, mask)
    assert_normwise_close(out, ref, dtype, "result", zero_scale=float(exact[2].abs().max()) * ref.numel() ** 0.5)
    want = torch.autograd.grad(ref, exact, grad)
    terms = float(grad.norm()) * max(float(x.abs().max()) for x in exact) ** 2
    for name, x, y in zip("qkv", got, want, strict=True):
        assert x.shape == y.shape
        assert_normwise_close(x, y, dtype, f"d{name}", zero_scale=terms, gradients=True)


@pytest.mark.gpu
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_softcap_and_grouped_heads_match_reference(monkeypatch, dtype, autoregressive):
    """On CUDA's fused kernels (nothing repeats k and v): result and gradients with a soft-cap and
    grouped heads."""
    monkeypatch.setattr(kernels, "repeat_heads", lambda *args: pytest.fail("repeated on the fused kernels"))
    b, n, h, f, w, kv_heads = 2, 300, 4, 64, 37, 2
    q, _, _, w, d, mask, g = _masked_case((b, n, h, f, w), dtype, autoregressive, "cuda grouped", device="cuda")
    k, v = (_random((b, n, kv_heads, f), dtype, "cuda", g).requires_grad_() for _ in range(2))
    q.requires_grad_()
    scale = 4 / math.sqrt(f)
    out = sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask=mask, softcap=SOFTCAP)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype=dtype, device="cuda"))
    exact = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    repeated = [x.repeat_interleave(h // kv_heads, dim=2) for x in exact[1:]]
    ref = sliding_window_attention_reference(
        exact[0], *repeated, w, d, autoregressive, scale, mask.cpu(), softcap=SOFTCAP
    )
    assert_normwise_close(out.cpu(), ref, dtype, "result", zero_scale=float(exact[2].abs().max()) * ref.numel() ** 0.5)
    terms = float(grad.norm()) * max(float(x.abs().max()) for x in exact) ** 2
    for name, x, y in zip("qkv", got, torch.autograd.grad(ref, exact, grad), strict=True):
        assert_normwise_close(x.cpu(), y, dtype, f"d{name}", zero_scale=terms, gradients=True)


def test_grouped_heads_one_off_fails_the_comparison(cpu_library):
    """The injected fault: query head i reading key/value head (i + 1) // group instead fails the check."""
    q, k, v = (torch.randn(1, 60, 4 if i == 0 else 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = sliding_window_attention(q, k, v, 6)
    for order in ([0, 0, 1, 1], [0, 1, 1, 0]):
        ref = sliding_window_attention_reference(*(x.double() for x in (q, k[:, :, order], v[:, :, order])), 6, 1)
        if order == [0, 0, 1, 1]:
            assert_normwise_close(out, ref, torch.float32, "result", zero_scale=1.0)
        else:
            with pytest.raises(AssertionError):
                assert_normwise_close(out, ref, torch.float32, "result", zero_scale=1.0)


@pytest.mark.parametrize("kv_heads", [3, 5, 8])
def test_key_value_heads_must_divide_the_query_heads(kv_heads):
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, kv_heads, 16)
    with pytest.raises(
        ValueError,
        match=r"k must have q's shape \(1, 8, 4, 16\) .* or fewer heads dividing q's 4 "
        r"\(grouped key/value heads\), got k.shape",
    ):
        sliding_window_attention(q, k, k, 2)
    with pytest.raises(ValueError, match=r"v must have k's shape \(1, 8, 2, 16\), got v.shape=\(1, 8, 1, 16\)"):
        sliding_window_attention(q, k[:, :, :2], k[:, :, :1], 2)


@pytest.mark.parametrize("kv_heads", [3, 8])
def test_the_fused_ops_refuse_key_heads_that_do_not_divide(cpu_library, kv_heads):
    """The ops called directly: a clear error, not a read past k's heads."""
    q = torch.randn(1, 8, 4, 32)
    k = torch.randn(1, 8, kv_heads, 32)
    args = (None, torch.zeros((), dtype=torch.int64), 2, torch.ones(4, dtype=torch.int32), False, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"kv_heads dividing q's 4 heads, got k \(1, 8, %d, 32\)" % kv_heads):
        torch.ops.longformer_ops.attention(q, k, k, *args)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        torch.ops.longformer_ops.attention_backward(
            q, torch.zeros(1, 8, 4), q, k, k, None, args[1], q, torch.zeros(1, 8, 4), *args[2:]
        )


def _assert_lse_close(lse, q, k, w, d, autoregressive, scale, dtype, key_padding_mask):
    """The rows' log-sum-exp against the float64 reference's: equal -inf at rows with no key, else
    norm-wise within the input dtype's bound for results (measured worst: float64 0, float32 2.4 u,
    float16 and bfloat16 0.6 u: the scores are rounded to the input type)."""
    q64, k64 = (x.detach().double().cpu() for x in (q, k))
    ref = sliding_window_lse_reference(q64, k64, w, d, autoregressive, scale, key_padding_mask)
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.shape == q.shape[:3] and lse.dtype == accumulation
    empty = ref == float("-inf")
    assert torch.equal(lse.cpu() == float("-inf"), empty), "-inf exactly at the rows with no key"
    assert_normwise_close(lse.cpu()[~empty], ref[~empty], dtype, "lse", zero_scale=1.0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three-steps"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_return_lse_matches_reference(cpu_library, monkeypatch, size, dtype, autoregressive, fused):
    """return_lse gives the result unchanged and each row's log-sum-exp, from the fused kernel and
    from the three steps (a library without it), with masked keys and rows left with no key."""
    if not fused:
        monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "lse")
    with torch.no_grad():
        out, lse = sliding_window_attention(q, k, v, w, d, autoregressive, 0.7, key_padding_mask=mask, return_lse=True)
        assert torch.equal(out, sliding_window_attention(q, k, v, w, d, autoregressive, 0.7, key_padding_mask=mask))
    _assert_lse_close(lse, q, k, w, d, autoregressive, 0.7, dtype, mask)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three-steps"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_return_lse_gradients_match_reference(cpu_library, monkeypatch, size, dtype, autoregressive, fused):
    """Gradients through the result and the log-sum-exp together (the layer's global-token merge
    needs both) against the float64 reference's; rows with no key (lse -inf) get no gradient."""
    if not fused:
        monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    q, k, v, w, d, mask, g = _masked_case(size, dtype, autoregressive, "lse-grad")
    grad_out, grad_lse = (
        torch.randn(q.shape, generator=g, dtype=torch.float64),
        torch.randn(q.shape[:3], generator=g, dtype=torch.float64),
    )

    def loss(result, lse):
        return (result.double() * grad_out).sum() + (lse.double().masked_fill(torch.isinf(lse), 0) * grad_lse).sum()

    inputs = [x.requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(
        loss(*sliding_window_attention(*inputs, w, d, autoregressive, 0.7, key_padding_mask=mask, return_lse=True)),
        inputs,
    )
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    reference = (
        sliding_window_attention_reference(*exact, w, d, autoregressive, 0.7, mask),
        sliding_window_lse_reference(exact[0], exact[1], w, d, autoregressive, 0.7, mask),
    )
    want = torch.autograd.grad(loss(*reference), exact)
    terms = (
        float(grad_out.norm() + grad_lse.norm()) * max(float(x.detach().double().abs().max()) for x in (q, k, v)) ** 2
    )
    for name, x, y in zip("qkv", got, want, strict=True):
        assert_normwise_close(x, y, dtype, f"d{name}", zero_scale=terms, gradients=True)


def _dropout_factor(dropout, shape, w, d, autoregressive):
    """The reference factors of the fused kernels' dropout mask for ``dropout`` = (p, torch seed): the
    kernel seed is the call's one draw from torch's generator after ``torch.manual_seed(torch seed)``.
    A window wider than any head reaches (w > (n - 1) // min(d)) draws the mask of the narrowest one
    with the same keys, whose band columns sit in the middle of w's (symmetric) or at its end (causal)."""
    p, torch_seed = dropout
    torch.manual_seed(torch_seed)
    b, n, h, _ = shape
    reachable = _reachable_window(w, d, n)
    return _in_window(
        dropout_factor_reference(int(dropout_seed()), b, n, h, band_width(reachable, autoregressive), p),
        w,
        reachable,
        autoregressive,
    )


def _reachable_window(w, d, n):
    """The narrowest window reaching the same keys as ``w`` in every head: at most (n - 1) // min(d)."""
    return min(w, max(n - 1, 0) // min(int(x) for x in ([d] if isinstance(d, int) else d)))


def _in_window(factor, w, reachable, autoregressive):
    """``factor`` [b, n, h, band(reachable)] as band(w) columns (the same keys), 0 in the others."""
    wide = factor.new_zeros(*factor.shape[:3], band_width(w, autoregressive))
    wide[..., w - reachable : w - reachable + factor.shape[-1]] = factor
    return wide


@pytest.mark.parametrize("with_grad", [False, True], ids=["fused", "autograd"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_dropout_matches_reference(cpu_library, size, dtype, autoregressive, with_grad):
    """The fused kernels' dropout against the reference with the same mask (its generator re-implemented
    in PyTorch), forward and gradients: the backward regenerates the forward's mask."""
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "dropout")
    dropout = (0.3, 1234 + size[1])
    factor = _dropout_factor(dropout, q.shape, w, d, autoregressive)
    torch.manual_seed(dropout[1])
    inputs = [x.requires_grad_(with_grad) for x in (q, k, v)]
    out = sliding_window_attention(*inputs, w, d, autoregressive, key_padding_mask=mask, dropout_p=dropout[0])
    _assert_close(out, q, k, v, w, d, autoregressive, 1 / math.sqrt(q.shape[-1]), dtype, mask, factor)
    if with_grad:
        _check_gradients(q, k, v, w, d, autoregressive, 1 / math.sqrt(q.shape[-1]), dtype, mask, dropout)


@pytest.mark.gpu
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_cuda_dropout_matches_reference(size, dtype, autoregressive):
    """The CUDA fused kernels' dropout: the CPU kernels' mask (the reference re-implements it),
    forward and gradients (the fused backward regenerates it)."""
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "cuda dropout", device="cuda")
    dropout = (0.3, 1234 + size[1])
    factor = _dropout_factor(dropout, q.shape, w, d, autoregressive)
    torch.manual_seed(dropout[1])
    out = sliding_window_attention(q, k, v, w, d, autoregressive, key_padding_mask=mask, dropout_p=dropout[0])
    _assert_close(out, q, k, v, w, d, autoregressive, 1 / math.sqrt(q.shape[-1]), dtype, mask.cpu(), factor)
    _check_gradients(q, k, v, w, d, autoregressive, 1 / math.sqrt(q.shape[-1]), dtype, mask, dropout)


@pytest.mark.gpu
@pytest.mark.parametrize("dilation_kind", DILATIONS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("size", [s for s in SIZES + LARGER if s[3] > 1 and s[1] > 1], ids=str)
def test_cuda_gradients_match_reference(size, dtype, autoregressive, dilation_kind):
    _check_gradients_of_case("cuda", size, dtype, autoregressive, dilation_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("size", MASKED_SIZES, ids=str)
def test_cuda_key_padding_mask_matches_reference(size, dtype, autoregressive):
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "cuda", device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    out = sliding_window_attention(q, k, v, w, d, autoregressive, key_padding_mask=mask)
    _assert_close(out, q, k, v, w, d, autoregressive, scale, dtype, mask.cpu())
    _check_gradients(q, k, v, w, d, autoregressive, scale, dtype, mask)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("size", MASKED_SIZES[:3], ids=str)
def test_three_step_dropout_matches_reference(monkeypatch, device, size, autoregressive):
    """The three steps (forced) drop with torch's dropout on the [b, n, h, c]
    probabilities (c of the narrowest window reaching the same keys): the same mask drawn again from the same seed gives the reference, values and
    gradients (float64, float32 on CUDA, which has no float64 library: the dtypes' bounds are the
    tests above)."""
    monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, w, d, mask, _ = _masked_case(size, dtype, autoregressive, "three-step dropout", device=device)
    b, n, h, _ = q.shape
    torch.manual_seed(77)
    reachable = _reachable_window(w, d, n)
    factor = _in_window(
        torch.nn.functional.dropout(
            torch.ones(b, n, h, band_width(reachable, autoregressive), dtype=dtype, device=device), 0.3
        ),
        w,
        reachable,
        autoregressive,
    )
    inputs = [x.requires_grad_() for x in (q, k, v)]
    torch.manual_seed(77)
    out = sliding_window_attention(*inputs, w, d, autoregressive, key_padding_mask=mask, dropout_p=0.3)
    exact = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref = sliding_window_attention_reference(*exact, w, d, autoregressive, None, mask.cpu(), factor.cpu().double())
    assert_normwise_close(out, ref, dtype, "result", zero_scale=1.0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad(out, inputs, grad.to(device, dtype))
    want = torch.autograd.grad(ref, exact, grad)
    for name, x, y in zip("qkv", got, want, strict=True):
        assert_normwise_close(x, y, dtype, f"d{name}", zero_scale=1.0, gradients=True)


def test_dropout_mask_statistics_and_reproducibility(cpu_library):
    """The generator keeps 1 - p of the probabilities (within 4 standard deviations, for several p),
    without visible correlation between neighbouring columns or rows; one torch seed gives one result."""
    for p in (0.1, 0.5, 0.9):
        kept = dropout_factor_reference(7, 2, 512, 4, 257, p) > 0
        count = kept.numel()
        assert abs(kept.double().mean() - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / count), p
        both = (kept[..., 1:] & kept[..., :-1]).double().mean()  # neighbouring columns independent
        assert abs(both - (1 - p) ** 2) <= 4 * math.sqrt(1 / count), p
        rows = (kept[:, 1:] & kept[:, :-1]).double().mean()  # neighbouring rows independent
        assert abs(rows - (1 - p) ** 2) <= 4 * math.sqrt(1 / count), p
    q, k, v = (torch.randn(1, 64, 2, 32) for _ in range(3))
    results = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        results.append(sliding_window_attention(q, k, v, 8, dropout_p=0.5))
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])
    assert torch.equal(sliding_window_attention(q, k, v, 8, dropout_p=0.0), sliding_window_attention(q, k, v, 8))
    assert not sliding_window_attention(q, k, v, 8, dropout_p=1.0).any()


def test_dropout_on_the_three_steps_is_torch_dropout(monkeypatch):
    """A library without the fused kernels applies torch's dropout to the probabilities: the same result
    as the reference probabilities through torch's dropout under the same torch seed."""
    monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    q, k, v = (torch.randn(2, 40, 3, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.manual_seed(11)
    out = sliding_window_attention(q, k, v, 5, [1, 2, 3], dropout_p=0.4)
    torch.manual_seed(11)
    probs = torch.nn.functional.dropout(sliding_window_probs_reference(q, k, 5, [1, 2, 3]), 0.4)
    torch.testing.assert_close(out, diagonaled_mm_reference(probs, v, 5, [1, 2, 3], True, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["plain", "key-padding-mask", "dropout", "return-lse", "softcap", "grouped"])
@pytest.mark.parametrize("path", ["fused", "three-steps", "three-steps-band-softmax"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_gradcheck_float64(cpu_library, autoregressive, path, variant, monkeypatch):
    """float64 gradcheck of every variant, on each CPU library this machine runs and on both paths
    (the fused kernels, and the three steps a library without them runs). Dropout: the same mask at
    every evaluation (torch's generator re-seeded inside the function)."""
    if path != "fused":
        _without_fused_kernels(monkeypatch, band_softmax=path == "three-steps-band-softmax")
    g = torch.Generator().manual_seed(stable_seed("gradcheck", autoregressive, path, variant))
    q, k, v = (torch.randn(2, 9, 3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    if variant == "grouped":  # (three query heads on one key/value head)
        k, v = (x[:, :, :1].detach().requires_grad_() for x in (k, v))
    mask = torch.rand(2, 9, generator=g) < 0.3 if variant == "key-padding-mask" else None

    def attention(a, b, c):
        torch.manual_seed(5)
        result = sliding_window_attention(
            a,
            b,
            c,
            2,
            [1, 2, 4],
            autoregressive,
            key_padding_mask=mask,
            dropout_p=0.3 if variant == "dropout" else 0.0,
            return_lse=variant == "return-lse",
            softcap=0.8 if variant == "softcap" else None,
        )
        if variant != "return-lse":
            return result
        out, lse = result
        return out, lse.masked_fill(torch.isinf(lse), 0)  # (no row lacks a key here; kept for safety)

    assert torch.autograd.gradcheck(attention, (q, k, v))


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_gradcheck_float64_two_step_path(cpu_library, autoregressive):
    """The original API's attention: diagonaled_mm, mask_invalid_locations, softmax, diagonaled_mm."""
    from longformer_ops import diagonaled_mm, mask_invalid_locations

    g = torch.Generator().manual_seed(stable_seed("gradcheck two-step", autoregressive))
    q, k, v = (torch.randn(2, 11, 3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def two_step(a, b, c):
        scores = diagonaled_mm(a, b, 3, [1, 2, 4], False, 0, autoregressive)
        mask_invalid_locations(scores, 3, [1, 2, 4], autoregressive)
        return diagonaled_mm(scores.softmax(-1), c, 3, [1, 2, 4], True, 0, autoregressive)

    assert torch.autograd.gradcheck(two_step, (q, k, v))


@pytest.mark.parametrize("size", [(1, 50, 2, 32, 4), (2, 33, 3, 20, 40), (0, 5, 2, 4, 1), (2, 5, 2, 0, 1)], ids=str)
def test_out_holds_the_same_result(cpu_library, size):
    b, n, h, f, w = size
    g = torch.Generator().manual_seed(n + f)
    q, k, v = (torch.randn(b, n, h, f, generator=g) for _ in range(3))
    d = torch.randint(1, 5, (h,), generator=g)
    expected = sliding_window_attention(q, k, v, w, d)
    out = torch.full(expected.shape, float("nan"))
    assert sliding_window_attention(q, k, v, w, d, out=out) is out
    assert torch.equal(out, expected)


def test_inf_and_extreme_scores_stay_finite(cpu_library):
    """Scores far below a row's maximum (down to exp underflow) give probability 0, not NaN;
    huge scores do not overflow (the softmax subtracts the row's maximum first)."""
    q = torch.randn(1, 40, 2, 32) * 30
    k, v = torch.randn(1, 40, 2, 32) * 30, torch.randn(1, 40, 2, 32)
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 5, 1)
    _assert_close(out, q, k, v, 5, 1, False, 1 / math.sqrt(32), torch.float32)


def test_row_maximum_over_many_vectors_of_scores(cpu_library):
    """Scores up to a few thousand (exp overflows float32 past 88) over rows of ten vectors of
    scores (w = 70), whose maximum the CPU kernels take in several chains: one chain left out of
    the maximum gives inf and NaN. A score this large carries float32 rounding of ~|score| u (Q.K^T
    in float32), which exp turns into relative errors of that size: the bound is 0.5 |score|max u
    (measured worst 0.035), where a result 1% off is 50x over it."""
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 300, 2, 32, generator=g) * 30, torch.randn(1, 300, 2, 32, generator=g) * 30
    v = torch.randn(1, 300, 2, 32, generator=g)
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 70, 1)
    scale = 1 / math.sqrt(32)
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 70, 1, False, scale)
    largest_score = float(torch.einsum("bihf,bjhf->bhij", q.double(), k.double()).abs().max()) * scale
    assert torch.isfinite(out).all()
    relative = float((out.double() - ref).norm() / ref.norm())
    assert relative <= 0.5 * largest_score * unit_roundoff(torch.float32), (relative, largest_score)


@pytest.mark.parametrize("with_grad", [False, True], ids=["fused", "autograd"])
def test_non_contiguous_inputs(cpu_library, with_grad):
    g = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(2, 3, 40, 24, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_(with_grad)
        for _ in range(3)
    )  # [b, n=40, h=3, f=24] views
    assert not q.is_contiguous()
    out = sliding_window_attention(q, k, v, 5, [1, 2, 3])
    _assert_close(out, q, k, v, 5, [1, 2, 3], False, 1 / math.sqrt(24), torch.float64)
    if with_grad:
        _check_gradients(q, k, v, 5, [1, 2, 3], False, 1 / math.sqrt(24))


@pytest.mark.parametrize("with_grad", [False, True], ids=["fused", "autograd"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inputs_not_16_byte_aligned(device, with_grad):
    """Contiguous views starting 2 bytes into their storage: the CUDA kernels stage 16 bytes per load,
    so the runtime copies such inputs first (a misaligned load there is a fatal CUDA error)."""
    b, n, h, f, w = 1, 70, 2, 32, 9
    storage = torch.randn(4 * b * n * h * f + 1, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    storage = storage.to(device)
    q, k, v, grad = (storage[1 + i * b * n * h * f : 1 + (i + 1) * b * n * h * f].view(b, n, h, f) for i in range(4))
    assert all(x.is_contiguous() and x.data_ptr() % 16 for x in (q, k, v, grad))
    assert kernels._fused_input(q, 16).data_ptr() % 16 == 0
    q, k, v = (x.requires_grad_(with_grad) for x in (q, k, v))
    out = sliding_window_attention(q, k, v, w, [1, 3])
    _assert_close(out, q, k, v, w, [1, 3], False, 1 / math.sqrt(f), torch.bfloat16)
    if with_grad:
        got = torch.autograd.grad(out, (q, k, v), grad)
        exact = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
        want = torch.autograd.grad(
            sliding_window_attention_reference(*exact, w, [1, 3], False, 1 / math.sqrt(f)), exact, grad.double().cpu()
        )
        for name, x, y in zip("qkv", got, want, strict=True):
            assert_normwise_close(x, y, torch.bfloat16, f"d{name}", zero_scale=0.0, gradients=True)
