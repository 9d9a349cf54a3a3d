"""diagonaled_mm and mask_invalid_locations against the plain-PyTorch reference.

Every mode x dtype x {symmetric, autoregressive} x {one dilation, per-head dilations}
at awkward sizes, on every CPU library this machine runs, and on CUDA when present.
The reference runs in float64 on the same (rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, CUDA_DTYPES, assert_close_to_reference, stable_seed

from longformer_ops import diagonaled_mm, mask_invalid_locations
from longformer_ops.ops.diagonaled import transposed_product
from longformer_ops.ops.reference import diagonaled_mm_reference
from longformer_ops.runtime import kernels
from longformer_ops.runtime.band import invalid_locations

# (batch, seq_len, heads, head_dim, w): n in {1, 2, 17, 513}, w in {0, 1, >= n}, head_dim in {1, 31, 64}.
SIZES = [
    (2, 1, 3, 31, 0),
    (1, 1, 2, 64, 1),
    (2, 1, 2, 1, 3),  # w >= n
    (2, 2, 3, 1, 1),
    (1, 2, 2, 31, 2),  # w >= n
    (2, 17, 3, 64, 1),
    (1, 17, 4, 31, 20),  # w >= n
    (2, 17, 2, 1, 0),
    (1, 513, 4, 64, 16),
    (1, 513, 2, 31, 1),
    (1, 513, 2, 1, 600),  # w >= n
]
DILATIONS = ["single", "per-head"]


def _dilation(kind: str, heads: int, generator):
    if kind == "single":
        return int(torch.randint(1, 4, (1,), generator=generator))
    return torch.randint(1, 9, (heads,), generator=generator, dtype=torch.int32)


def _random(shape, dtype, device, generator):
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)


def _transposed_reference(band, rows, w, d, autoregressive):
    """The transposed product in float64: the gradient of probs.V (the reference) at its values."""
    values = torch.zeros(rows.shape, dtype=torch.float64, requires_grad=True)
    (out,) = torch.autograd.grad(diagonaled_mm_reference(band, values, w, d, True, 0, autoregressive), values, rows)
    return out


def _check_forward(device, dtype, size, autoregressive, dilation_kind, mode):
    """One mode ("qk", "pv" or "transposed") against the float64 reference, elementwise against
    the products on |inputs| and norm-wise (conftest)."""
    b, n, h, f, w = size
    generator = torch.Generator().manual_seed(stable_seed(size, autoregressive, dilation_kind, str(dtype)))
    d = _dilation(dilation_kind, h, generator)
    c = w + (0 if autoregressive else w) + 1
    is_t1_diagonaled = mode != "qk"
    t1 = _random((b, n, h, c if is_t1_diagonaled else f), dtype, device, generator)
    t2 = _random((b, n, h, f), dtype, device, generator)
    padding = -3.5
    exact, magnitudes = (t1.double().cpu(), t2.double().cpu()), (t1.double().abs().cpu(), t2.double().abs().cpu())
    if mode == "transposed":
        out = transposed_product(t1, t2, w, d, autoregressive)
        ref = _transposed_reference(*exact, w, d, autoregressive)
        scale = _transposed_reference(*magnitudes, w, d, autoregressive)
    else:
        out = diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, padding, autoregressive)
        ref = diagonaled_mm_reference(*exact, w, d, is_t1_diagonaled, padding, autoregressive)
        scale = diagonaled_mm_reference(*magnitudes, w, d, is_t1_diagonaled, 0, autoregressive)
    assert out.dtype == dtype and out.device.type == torch.device(device).type
    if not is_t1_diagonaled:
        invalid = invalid_locations(n, w, torch.as_tensor(d).expand(h) if isinstance(d, int) else d, autoregressive)
        assert (out.cpu()[:, invalid] == torch.tensor(padding, dtype=dtype)).all(), (
            "padding positions must hold exactly `padding`"
        )
    assert_close_to_reference(out, ref, scale, dtype)


@pytest.mark.parametrize("mode", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("dilation_kind", DILATIONS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_cpu_matches_reference(cpu_library, size, dtype, autoregressive, dilation_kind, mode):
    _check_forward("cpu", dtype, size, autoregressive, dilation_kind, mode)


# (b, n, h, f, w): several runs of 2w + 1 queries and more, a short last run, w = 0; head_dim 64
# takes the AVX-512 library's wide half-type tiles.
RUN_SIZES = [(1, 300, 2, 16, 20), (2, 1000, 3, 64, 64), (1, 1200, 2, 32, 33), (1, 500, 1, 16, 0)]


@pytest.mark.parametrize("runs", [2, 3, 64])
@pytest.mark.parametrize("mode", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("size", RUN_SIZES, ids=str)
def test_cpu_runs_of_queries(cpu_library, size, dtype, autoregressive, mode, runs, monkeypatch):
    """Each (batch, head) split into runs of queries (kernels.query_runs, from the thread count):
    the band products' results are those of one run, bit for bit (each run packs the rows it
    reads), and the reference's, per-head dilations."""
    b, n, h, f, w = size
    generator = torch.Generator().manual_seed(stable_seed(size, autoregressive, str(dtype), mode, "runs"))
    d = _dilation("per-head", h, generator)
    c = w + (0 if autoregressive else w) + 1
    t1 = _random((b, n, h, f if mode == "qk" else c), dtype, "cpu", generator)
    t2 = _random((b, n, h, f), dtype, "cpu", generator)
    results = []
    for count in (1, runs):
        monkeypatch.setattr(kernels, "query_runs", lambda *args, count=count: count)
        if mode == "transposed":
            results.append(transposed_product(t1, t2, w, d, autoregressive))
        else:
            results.append(diagonaled_mm(t1, t2, w, d, mode == "pv", -3.5, autoregressive))
    assert torch.equal(results[1], results[0]), f"{mode} with {runs} runs differs from one run"
    _check_forward("cpu", dtype, size, autoregressive, "per-head", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("dilation_kind", DILATIONS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_cuda_matches_reference(size, dtype, autoregressive, dilation_kind, mode):
    _check_forward("cuda", dtype, size, autoregressive, dilation_kind, mode)


def _check_gradients(device, dtype, autoregressive, is_t1_diagonaled):
    """Both input gradients (which run the transposed mode) against autograd through the reference."""
    b, n, h, f, w = 2, 37, 4, 31, 5
    generator = torch.Generator().manual_seed(7)
    d = torch.tensor([1, 2, 3, 8], dtype=torch.int32)
    c = w + (0 if autoregressive else w) + 1
    t1 = _random((b, n, h, c if is_t1_diagonaled else f), dtype, device, generator).requires_grad_()
    t2 = _random((b, n, h, f), dtype, device, generator).requires_grad_()
    out = diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, 0, autoregressive)
    grad = _random(out.shape, dtype, device, generator)
    g1, g2 = torch.autograd.grad(out, (t1, t2), grad)
    r1, r2 = (t1.detach().double().cpu().requires_grad_(), t2.detach().double().cpu().requires_grad_())
    ref = diagonaled_mm_reference(r1, r2, w, d, is_t1_diagonaled, 0, autoregressive)
    e1, e2 = torch.autograd.grad(ref, (r1, r2), grad.double().cpu())
    a1, a2 = (r1.detach().abs().requires_grad_(), r2.detach().abs().requires_grad_())
    s1, s2 = torch.autograd.grad(
        diagonaled_mm_reference(a1, a2, w, d, is_t1_diagonaled, 0, autoregressive), (a1, a2), grad.double().abs().cpu()
    )
    assert_close_to_reference(g1, e1, s1, dtype)
    assert_close_to_reference(g2, e2, s2, dtype)


@pytest.mark.parametrize("is_t1_diagonaled", [False, True], ids=["qk", "pv"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_cpu_gradients_match_reference(cpu_library, dtype, autoregressive, is_t1_diagonaled):
    _check_gradients("cpu", dtype, autoregressive, is_t1_diagonaled)


@pytest.mark.gpu
@pytest.mark.parametrize("is_t1_diagonaled", [False, True], ids=["qk", "pv"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_gradients_match_reference(dtype, autoregressive, is_t1_diagonaled):
    _check_gradients("cuda", dtype, autoregressive, is_t1_diagonaled)


@pytest.mark.parametrize("is_t1_diagonaled", [False, True], ids=["qk", "pv"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_gradcheck_float64(is_t1_diagonaled, autoregressive):
    b, n, h, f, w = 2, 9, 3, 5, 2
    d = torch.tensor([1, 2, 4])
    c = w + (0 if autoregressive else w) + 1
    t1 = torch.randn(b, n, h, c if is_t1_diagonaled else f, dtype=torch.float64, requires_grad=True)
    t2 = torch.randn(b, n, h, f, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, bb: diagonaled_mm(a, bb, w, d, is_t1_diagonaled, 0, autoregressive), (t1, t2)
    )


@pytest.mark.parametrize("op", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_gradgradcheck_float64(op, autoregressive):
    """Second derivatives: each op's backward is made of the band ops, whose own autograd then runs."""
    torch.manual_seed(3)
    b, n, h, f, w, d = 1, 9, 2, 5, 2, torch.tensor([1, 3], dtype=torch.int32)
    c = w + (0 if autoregressive else w) + 1
    t1 = torch.randn(b, n, h, f if op == "qk" else c, dtype=torch.float64, requires_grad=True)
    t2 = torch.randn(b, n, h, f, dtype=torch.float64, requires_grad=True)
    ops = torch.ops.longformer_ops
    fn = {
        "qk": lambda a, bb: ops.band_qk(a, bb, w, d, autoregressive, 0.0),
        "pv": lambda a, bb: ops.band_pv(a, bb, w, d, autoregressive),
        "transposed": lambda a, bb: ops.band_transposed(a, bb, w, d, autoregressive),
    }[op]
    assert torch.autograd.gradcheck(fn, (t1, t2))
    assert torch.autograd.gradgradcheck(fn, (t1, t2))


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_band_entries_at_invalid_keys_are_ignored(cpu_library, autoregressive):
    """NaN in the band where the key lies outside the sequence never reaches a result.

    Covers both CPU code paths of probs.V and transposed: tiles of one residue class read
    the band directly (and must skip invalid keys by their loop bounds), tiles across
    classes or past the end gather masked weights. Also checks all gradients in float64 at a
    size with many whole tiles, dilations 1, 3 and 8.
    """
    b, n, h, f, w = 1, 301, 3, 64, 24
    d = torch.tensor([1, 3, 8])
    c = w + (0 if autoregressive else w) + 1
    g = torch.Generator().manual_seed(11)
    invalid = invalid_locations(n, w, d, autoregressive)
    band = torch.randn(b, n, h, c, generator=g, dtype=torch.float64)
    q, k = (torch.randn(b, n, h, f, generator=g, dtype=torch.float64) for _ in range(2))
    expected_context = diagonaled_mm_reference(band, k, w, d, True, 0, autoregressive)
    poisoned = band.clone()
    poisoned[:, invalid] = float("nan")
    torch.testing.assert_close(diagonaled_mm(poisoned, k, w, d, True, 0, autoregressive), expected_context)

    # Backward of Q.K^T: dQ = pv(dS, K), dK = transposed(dS, Q), with NaN in dS at invalid keys.
    q.requires_grad_(), k.requires_grad_()
    scores = diagonaled_mm(q, k, w, d, False, 0, autoregressive)
    dq, dk = torch.autograd.grad(scores, (q, k), poisoned)
    eq, ek = torch.autograd.grad(diagonaled_mm_reference(q, k, w, d, False, 0, autoregressive), (q, k), band)
    torch.testing.assert_close(dq, eq)
    torch.testing.assert_close(dk, ek)

    # Backward of probs.V (dP = qk(dO, V), dV = transposed(P, dO)).
    band.requires_grad_()
    grad = torch.randn(b, n, h, f, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(diagonaled_mm(band, k, w, d, True, 0, autoregressive), (band, k), grad)
    want = torch.autograd.grad(diagonaled_mm_reference(band, k, w, d, True, 0, autoregressive), (band, k), grad)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_probs_v_ignores_band_entries_at_invalid_keys_in_every_dtype(cpu_library, dtype, autoregressive):
    """Each dtype's probs.V kernel (bfloat16's takes two keys per step where the CPU has a bfloat16
    dot product) returns exactly the same with NaN as with 0 in the band where the key lies outside
    the sequence: weights there are never read, or selected away, in every code path (tiles of one
    residue class, tiles across classes or past the end; the first and last steps of each)."""
    b, n, h, f, w = 1, 301, 4, 64, 24
    d = torch.tensor([1, 2, 3, 8])
    c = w + (0 if autoregressive else w) + 1
    g = torch.Generator().manual_seed(13)
    invalid = invalid_locations(n, w, d, autoregressive)
    band = _random((b, n, h, c), dtype, "cpu", g)
    values = _random((b, n, h, f), dtype, "cpu", g)
    band[:, invalid] = 0
    poisoned = band.clone()
    poisoned[:, invalid] = float("nan")
    expected = diagonaled_mm(band, values, w, d, True, 0, autoregressive)
    assert not expected.isnan().any()
    assert torch.equal(diagonaled_mm(poisoned, values, w, d, True, 0, autoregressive), expected)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_transposed_product_is_the_gradient_of_probs_v(cpu_library, autoregressive):
    b, n, h, f, w = 2, 97, 3, 40, 9
    d = torch.tensor([1, 2, 5])
    c = w + (0 if autoregressive else w) + 1
    g = torch.Generator().manual_seed(5)
    band = torch.randn(b, n, h, c, generator=g, dtype=torch.float64)
    rows = torch.randn(b, n, h, f, generator=g, dtype=torch.float64)
    v = torch.zeros(b, n, h, f, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(diagonaled_mm_reference(band, v, w, d, True, 0, autoregressive), v, rows)
    torch.testing.assert_close(transposed_product(band, rows, w, d, autoregressive), expected)
    with pytest.raises(ValueError, match=r"t1 \(the band\) must have last dimension"):
        transposed_product(rows, rows, w, d, autoregressive)


def test_positional_call_form_of_the_original():
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)
    scores = diagonaled_mm(q, k, 2, 1, False, 0, False)
    probs = torch.softmax(mask_invalid_locations(scores, 2, 1, False), dim=-1)
    context = diagonaled_mm(probs, k, 2, 1, True, 0, False)
    ref_scores = diagonaled_mm_reference(q.double(), k.double(), 2, 1, False, float("-inf"), False)
    expected = diagonaled_mm_reference(torch.softmax(ref_scores, dim=-1), k.double(), 2, 1, True, 0, False)
    torch.testing.assert_close(context.double(), expected, rtol=1e-5, atol=1e-6)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 19, 16, generator=g).permute(0, 2, 1, 3)  # [b, n=19, h=4, f] non-contiguous
    k = torch.randn(2, 19, 16, 4, generator=g).permute(0, 1, 3, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = diagonaled_mm(q, k, 3, 2)
    torch.testing.assert_close(out, diagonaled_mm_reference(q, k, 3, 2), rtol=1e-5, atol=1e-5)
    probs = torch.randn(2, 19, 4, 14, generator=g)[..., ::2]
    out = diagonaled_mm(probs, k, 3, 2, True)
    torch.testing.assert_close(out, diagonaled_mm_reference(probs, k, 3, 2, True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("size", SIZES + [(0, 5, 2, 4, 1), (2, 5, 2, 0, 1)], ids=str)
def test_out_holds_the_same_result(cpu_library, size, op):
    """``out=`` writes exactly what a fresh call returns (head_dims the kernels pad included),
    under no_grad with inputs that require grad, and returns ``out`` itself."""
    b, n, h, f, w = size
    generator = torch.Generator().manual_seed(n * 31 + f)
    d = torch.randint(1, 9, (h,), generator=generator)
    t1 = _random((b, n, h, f if op == "qk" else 2 * w + 1), torch.float32, "cpu", generator).requires_grad_()
    t2 = _random((b, n, h, f), torch.float32, "cpu", generator).requires_grad_()
    call = transposed_product if op == "transposed" else lambda *a, **kw: diagonaled_mm(*a[:4], op == "pv", -2.0, **kw)
    expected = call(t1, t2, w, d)
    out = torch.full(expected.shape, float("nan"))
    with torch.no_grad():
        assert call(t1, t2, w, d, out=out) is out
    assert torch.equal(out, expected.detach())


@pytest.mark.parametrize("shape", [(0, 5, 2, 4), (2, 0, 2, 4), (2, 5, 0, 4), (2, 5, 2, 0)])
def test_empty_inputs(shape):
    b, n, h, f = shape
    q, k = torch.randn(b, n, h, f, requires_grad=True), torch.randn(b, n, h, f, requires_grad=True)
    d = torch.ones(h, dtype=torch.int64)
    scores = diagonaled_mm(q, k, 1, d, False, -1.0)
    torch.testing.assert_close(scores, diagonaled_mm_reference(q, k, 1, d, False, -1.0))
    context = diagonaled_mm(torch.softmax(scores, -1), k, 1, d, True)
    assert context.shape == (b, n, h, f)
    context.sum().backward()


@pytest.mark.parametrize("autoregressive", [False, True])
def test_mask_invalid_locations(autoregressive):
    n, h, w = 11, 3, 4
    d = torch.tensor([1, 2, 5])
    c = w + (0 if autoregressive else w) + 1
    scores = torch.randn(2, n, h, c)
    original = scores.clone()
    returned = mask_invalid_locations(scores, w, d, autoregressive)
    assert returned is scores
    for i in range(n):
        for head in range(h):
            for j in range(c):
                key = i + int(d[head]) * (j - w)
                expected = original[:, i, head, j] if 0 <= key < n else torch.full((2,), float("-inf"))
                assert torch.equal(scores[:, i, head, j], expected), (i, head, j)


@pytest.mark.parametrize("with_grad", [False, True], ids=["in-blocks", "autograd"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_mask_invalid_locations_at_large_dilations(autoregressive, with_grad):
    """Edge rows past one block (EDGE_BLOCK_ROWS) without autograd, and whole edges with it: the same
    -inf positions as the key-index reference, everything else untouched, gradient 0 at masked ones."""
    n, h, w = 1500, 3, 90
    d = [1, 3, 8]  # reach 720 rows: three blocks per edge
    c = w + (0 if autoregressive else w) + 1
    leaf = torch.randn(1, n, h, c, requires_grad=with_grad)
    scores = leaf.clone()
    with torch.set_grad_enabled(with_grad):
        mask_invalid_locations(scores, w, d, autoregressive)
    invalid = invalid_locations(n, w, torch.tensor(d), autoregressive)[None]
    assert torch.equal(scores.detach(), leaf.detach().masked_fill(invalid, float("-inf")))
    if with_grad:
        (grad,) = torch.autograd.grad(scores.masked_fill(invalid, 0).sum(), leaf)
        assert torch.equal(grad, (~invalid).to(grad.dtype).expand_as(grad))
