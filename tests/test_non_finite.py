"""Non-finite inputs: a NaN or an infinity reaches every output a plain dense computation carries it
to, in every dtype, so that a diverged input is never hidden behind a finite result (a NaN score
once gave its row probabilities of 0 in float32 and the half types: the fast exp's clamp turned
NaN into its lower bound; and bfloat16 rounding turned some NaNs into 0). Also the GELU's far tails,
where the fast erf once gave GELU(x) > 0 for large negative x.

Masks are compared with the float64 references of :mod:`longformer_ops.ops.reference` on the same
rounded inputs. Known, documented excess: a non-finite value of ``v`` also reaches the rows of the
same tile of queries whose band does not hold its key (the kernels multiply its row by their
probability 0, and 0 * NaN is NaN), so ``v``'s masks are checked to hold the reference's."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_DTYPES, stable_seed, unit_roundoff
from test_layer import explicit_attention, layer_for, layer_inputs, tiny_config

from longformer_ops import band_softmax_, diagonaled_mm, sliding_window_attention
from longformer_ops.ops.reference import (
    diagonaled_mm_reference,
    sliding_window_attention_reference,
    sliding_window_lse_reference,
)

ops = torch.ops.longformer_ops

BATCH, N, HEADS, HEAD_DIM, W = 1, 37, 2, 16, 5
BAD_ROW = 17  # the sequence position of the non-finite element (head 0, feature 3)


def _inputs(dtype, which, bad, *parts):
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), which, bad, *parts))
    q, k, v = (
        torch.randn(BATCH, N, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype) for _ in range(3)
    )
    dict(q=q, k=k, v=v)[which][0, BAD_ROW, 0, 3] = bad
    return q, k, v


def _rows_not_finite(x: torch.Tensor) -> torch.Tensor:
    """[b, n, h]: where a row of the last dimension holds a NaN or an infinity."""
    return ~torch.isfinite(x.double()).all(-1)


def _diverged(lse: torch.Tensor) -> torch.Tensor:
    """Where a log-sum-exp is NaN or +inf (-inf is a row with no key)."""
    return lse.isnan() | (lse == float("inf"))


def _described(mask: torch.Tensor) -> str:
    return str(mask.nonzero().tolist())


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "autoregressive"])
@pytest.mark.parametrize("d", [1, [1, 3]], ids=["undilated", "dilations-1-3"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_attention_carries_non_finite_inputs(cpu_library, dtype, which, bad, d, autoregressive):
    """The result's and the log-sum-exp's non-finite rows: those of the float64 reference for q and
    k (with the key padding mask's flagged keys too, added as -inf as torch's attention adds its
    masks); for v at least those."""
    q, k, v = _inputs(dtype, which, bad, str(d), autoregressive)
    flagged = torch.zeros(BATCH, N, dtype=torch.bool)
    flagged[0, BAD_ROW::4] = True  # the non-finite key among them
    for mask in (None, flagged):
        ref = sliding_window_attention_reference(
            q.double(), k.double(), v.double(), W, d, autoregressive, key_padding_mask=mask
        )
        ref_lse = sliding_window_lse_reference(q.double(), k.double(), W, d, autoregressive, key_padding_mask=mask)
        out, lse = sliding_window_attention(q, k, v, W, d, autoregressive, key_padding_mask=mask, return_lse=True)
        expected, got = _rows_not_finite(ref), _rows_not_finite(out)
        what = f"{which}[{BAD_ROW}] = {bad}, {dtype}, d = {d}, mask {mask is not None}"
        if which == "v":
            assert (got | ~expected).all(), f"{what}: rows {_described(expected & ~got)} came out finite"
            assert torch.equal(_diverged(lse), _diverged(ref_lse)), what
        else:
            if bad != bad:  # (an infinity's scores may all be -inf or finite: no premise then)
                assert expected.any(), f"{what}: the reference has no non-finite row (the test's premise)"
            assert torch.equal(got, expected), (
                f"{what}: non-finite rows {_described(got)}, expected {_described(expected)}"
            )
            assert torch.equal(_diverged(lse), _diverged(ref_lse)), (
                f"{what}: NaN or +inf lse at {_described(_diverged(lse))}, expected {_described(_diverged(ref_lse))}"
            )


# NaN and infinities in every dtype, and bfloat16's NaNs by their bits: quiet, negative, every payload
# bit set, signalling (x86 quiets it, keeping the payload).
SCORE_BAD_INPUTS = [(dtype, bad) for dtype in CPU_DTYPES for bad in (float("nan"), float("inf"), -float("inf"))] + [
    (torch.bfloat16, bits) for bits in (0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF, 0x7F81)
]


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "autoregressive"])
@pytest.mark.parametrize("d", [1, [1, 3]], ids=["undilated", "dilations-1-3"])
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize(
    "dtype,bad",
    SCORE_BAD_INPUTS,
    ids=[f"{dtype}-{hex(bad) if isinstance(bad, int) else bad}" for dtype, bad in SCORE_BAD_INPUTS],
)
def test_scores_carry_non_finite_inputs(cpu_library, dtype, bad, which, d, autoregressive):
    """Q.K^T's band holds NaN, +inf and -inf exactly where the float64 reference on the same inputs
    does. bfloat16 stores its scores rounded without the NaN guard of the other kernels' roundings
    (qk.py says why that is safe): checked on the registers' direct path (a window of 40, wider than
    a register tile's keys) and on the row buffer's (the band's ends)."""
    n, heads, head_dim, w, row = 150, 2, 16, 40, 70
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), which, str(bad), str(d), autoregressive))
    q, k = (torch.randn(1, n, heads, head_dim, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    target = dict(q=q, k=k)[which]
    if isinstance(bad, int):
        target.view(torch.int16)[0, row, 0, 3] = torch.tensor(bad, dtype=torch.int32).to(torch.int16)
    else:
        target[0, row, 0, 3] = bad
    ref = diagonaled_mm_reference(q.double(), k.double(), w, d, False, 0.0, autoregressive)
    got = diagonaled_mm(q, k, w, d, False, 0.0, autoregressive)
    what = f"{which}[{row}] = {bad}, {dtype}, d = {d}, autoregressive {autoregressive}"
    assert not torch.isfinite(ref).all(), f"{what}: the reference is finite (the test's premise)"
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(got), test(ref)), (
            f"{what}: {name} at {_described(test(got))}, expected at {_described(test(ref))}"
        )


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_attention_gradients_carry_a_nan(cpu_library, dtype, which):
    """Backward: every gradient row the float64 reference's autograd makes NaN is NaN (never a finite
    gradient hiding the input). The kernels may make more rows NaN: a NaN row's log-sum-exp gives
    NaN probabilities at every column of its tile, and those reach the tile's dK and dV rows, as V's
    NaN reaches its tile in the forward; a NaN forward makes the loss NaN anyway."""
    q, k, v = _inputs(dtype, which, float("nan"), "backward")
    grad = torch.randn(
        q.shape, generator=torch.Generator().manual_seed(stable_seed("grad", str(dtype), which)), dtype=torch.float64
    )
    ours = [x.clone().requires_grad_(True) for x in (q, k, v)]
    sliding_window_attention(*ours, W, [1, 2]).backward(grad.to(dtype))
    exact = [x.double().requires_grad_(True) for x in (q, k, v)]
    sliding_window_attention_reference(*exact, W, [1, 2]).backward(grad)
    assert any((~torch.isfinite(x.grad)).any() for x in exact), (
        "the reference's gradients are finite (the test's premise)"
    )
    for name, mine, theirs in zip("qkv", ours, exact):
        expected, got = _rows_not_finite(theirs.grad), _rows_not_finite(mine.grad)
        assert (got | ~expected).all(), (
            f"d{name} with a NaN in {which}, {dtype}: rows {_described(expected & ~got)} came out finite"
        )


# float32 NaNs by bit pattern: the quiet NaNs x86 makes (0xffc00000) and one of each sign with
# every low bit set, which torch's exp makes of its bfloat16 GEMMs' NaN (see the layer test below).
NAN_PATTERNS = [0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF8000FF]


def _float32_nans(patterns) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("pattern", NAN_PATTERNS, ids=hex)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_attention_gradients_carry_a_nan_lse_gradient(cpu_library, dtype, pattern):
    """A NaN in the log-sum-exp's gradient (float32 but in float64; a caller's merge with global
    attention gives it, from torch's ops) makes dQ of its row and dK of every key in its band NaN, as
    the float64 reference's autograd does, whatever its bits: the half types' dK and dV are summed in
    float32 and rounded at the end, where bfloat16's rounding once carried 0xffffffff into 0."""
    generator = torch.Generator().manual_seed(stable_seed("lse gradient", str(dtype), pattern))
    q, k, v = (
        torch.randn(BATCH, N, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype) for _ in range(3)
    )
    grad_lse = torch.zeros(BATCH, N, HEADS, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    grad_lse[0, BAD_ROW, 0] = _float32_nans([pattern])[0]
    ours = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = sliding_window_attention(*ours, W, [1, 2], return_lse=True)
    torch.autograd.backward([out, lse], [torch.zeros_like(out), grad_lse])
    exact = [x.double().requires_grad_(True) for x in (q, k, v)]
    sliding_window_lse_reference(*exact[:2], W, [1, 2]).backward(grad_lse.double())
    expected_k = _rows_not_finite(exact[1].grad)
    assert expected_k.sum() > 1, "the reference's dK is NaN in one row or none (the test's premise)"
    for name, mine, theirs in zip("qk", ours, exact):
        expected, got = _rows_not_finite(theirs.grad), _rows_not_finite(mine.grad)
        assert (got | ~expected).all(), (
            f"d{name} with the lse gradient NaN {pattern:#x}, {dtype}: rows {_described(expected & ~got)} came out finite"
        )


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_band_softmax_carries_a_nan_score(cpu_library, dtype):
    """A NaN score makes its whole row NaN (every probability, and the log-sum-exp), as torch's
    softmax does; the other rows stay finite."""
    generator = torch.Generator().manual_seed(stable_seed("band softmax", str(dtype)))
    q, k = (torch.randn(BATCH, N, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    scores = diagonaled_mm_reference(q, k, W, 1, False, 0, False).to(dtype)
    scores[0, BAD_ROW, 1, W] = float("nan")
    probs, lse = band_softmax_(scores, W, 1, return_lse=True)
    expected = torch.zeros(BATCH, N, HEADS, dtype=torch.bool)
    expected[0, BAD_ROW, 1] = True
    assert torch.equal(_rows_not_finite(probs), expected), _described(_rows_not_finite(probs))
    assert probs[0, BAD_ROW, 1].isnan().all(), f"a NaN row holds numbers: {probs[0, BAD_ROW, 1].tolist()}"
    assert torch.equal(lse.isnan(), expected), _described(lse.isnan())


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_band_softmax_carries_nan_on_every_path(cpu_library, dtype):
    """NaN scores of six bit patterns, each in a row of its own and on another path of the kernel
    (w = 20, rows of 41 that start inside a 32-bit pair every other row, as AVX2's bfloat16 takes them:
    the lone value before the first pair, vectors of pairs, the vector of values after them, the
    tail): that row's probabilities and log-sum-exp NaN, every other row's finite."""
    generator = torch.Generator().manual_seed(stable_seed("band softmax nan paths", str(dtype)))
    n, heads, w = 60, 2, 20
    scores = (3 * torch.randn(1, n, heads, 2 * w + 1, generator=generator, dtype=torch.float64)).to(dtype)
    expected = torch.zeros(1, n, heads, dtype=torch.bool)
    for k, (bits, column) in enumerate(zip(NAN_BITS, [0, 1, 16, 34, 40, 33], strict=True)):
        row, head = 20 + k, (k + 1) % 2  # (head 1's rows start inside a pair: column 0 is the lone value)
        if dtype == torch.bfloat16:
            scores.view(torch.int16)[0, row, head, column] = bits
        else:
            scores[0, row, head, column] = float("nan")
        expected[0, row, head] = True
    probs, lse = band_softmax_(scores, w, 1, return_lse=True)
    assert torch.equal(probs.isnan().all(-1), expected) and torch.equal(probs.isnan().any(-1), expected), _described(
        probs.isnan().any(-1) ^ expected
    )
    assert torch.equal(lse.isnan(), expected), _described(lse.isnan() ^ expected)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_band_softmax_gradient_carries_a_nan_lse_gradient(cpu_library, dtype):
    """A NaN lse gradient of each of six bit patterns (float32; a caller's merge with global attention
    gives it), each in a row of its own, half of them in rows that start inside a 32-bit pair (w = 20,
    rows of 41, as AVX2's bfloat16 takes them): that row's score gradient NaN at every key, as the
    float64 definition's (P * NaN), every other row's finite."""
    generator = torch.Generator().manual_seed(stable_seed("band softmax lse gradient", str(dtype)))
    n, heads, w = 60, 2, 20
    scores = (3 * torch.randn(1, n, heads, 2 * w + 1, generator=generator, dtype=torch.float64)).to(dtype)
    grad_lse = torch.zeros(1, n, heads, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    expected = torch.zeros(1, n, heads, dtype=torch.bool)
    for k, pattern in enumerate(NAN_PATTERNS):
        row, head = 20 + k, k % 2  # rows 20..25, all of whose keys are in the sequence
        grad_lse[0, row, head] = _float32_nans([pattern])[0].to(grad_lse.dtype)
        expected[0, row, head] = True
    leaf = scores.clone().requires_grad_()
    probs, lse = band_softmax_(leaf.clone(), w, 1, return_lse=True)
    (got,) = torch.autograd.grad(
        [probs, lse], leaf, [torch.randn(probs.shape, generator=generator).to(dtype), grad_lse]
    )
    wrong = (got.isnan().all(-1) ^ expected) | (got.isnan().any(-1) ^ expected)
    assert not wrong.any(), f"{dtype}: score gradients NaN in part or in the wrong rows: {_described(wrong)}"


# Far tails of x, each representable in every CPU dtype (float16's largest is 65504).
TAILS = [-6e4, -1e3, -40.0, -20.0, -9.0, -6.0, -5.7, 5.7, 9.0, 40.0, 6e4]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_gelu_far_tails(cpu_library, dtype):
    """GELU(x) = x Phi(x) and its derivative in the far tails, within one rounding plus Phi's
    truncation where the fast erf stops (|x| = 4 sqrt 2: |x| Phi(x) <= 4.3e-8, Phi(x) <= 7.6e-9);
    not positive for negative x (the clamped erf once landed an ulp below -1: GELU(-1e3) = +6e-5)."""
    x = torch.tensor(TAILS, dtype=torch.float64).to(dtype)
    bias, grad = torch.zeros(len(TAILS), dtype=dtype), torch.ones(len(TAILS), dtype=dtype)
    exact = torch.nn.functional.gelu(x.double())
    exact_derivative = (
        torch.special.ndtr(x.double()) + x.double() * torch.exp(-0.5 * x.double() ** 2) / (2 * torch.pi) ** 0.5
    )
    got = ops.bias_gelu(x[None], bias)[0]
    got_derivative = ops.bias_gelu_backward(grad[None], x[None], bias)[0][0]
    u = unit_roundoff(dtype)
    for what, mine, theirs, truncation in (
        ("gelu", got, exact, 4.3e-8),
        ("gelu'", got_derivative, exact_derivative, 7.6e-9),
    ):
        error = (mine.double() - theirs).abs()
        bound = 2 * u * theirs.abs() + truncation + torch.finfo(dtype).tiny
        assert (error <= bound).all(), (
            f"{what} {dtype}: at x = {x[error > bound].tolist()} got {mine[error > bound].tolist()}"
        )
    assert (got[x < 0] <= 0).all(), f"{dtype}: GELU positive at negative x: {got.tolist()}"


# NaN bit patterns as 16-bit integers: quiet and signalling, both signs, every mantissa bit set
# (0x7fff, 0xffff: a rounding that adds 0x7fff to a NaN with low bits set carries into the sign);
# for the wider dtypes the NaN they convert to.
NAN_BITS = [0x7FC0, 0x7FFF, -1, 0x7F81, -127, -64]
# Where they go in a row of 190 (test_gelu.SHAPES): AVX2's bfloat16 pairs (even and odd positions, a
# run and the vectors after the runs), the vector of 8 after the pairs, the tail of six.
NAN_COLUMNS = [0, 5, 70, 131, 177, 188]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_gelu_carries_nan(cpu_library, dtype):
    """A NaN of h reaches its GELU, its gradient and its column's bias gradient, whatever its bits,
    on every path of the kernels; nothing else turns NaN."""
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), "gelu-nan"))
    h = (4 * torch.randn(3, 190, generator=generator, dtype=torch.float64)).to(dtype)
    grad = torch.randn(3, 190, generator=generator, dtype=torch.float64).to(dtype)
    bias = torch.randn(190, generator=generator, dtype=torch.float64).to(dtype)
    for bits, column in zip(NAN_BITS, NAN_COLUMNS, strict=True):
        if dtype == torch.bfloat16:
            h.view(torch.int16)[1, column] = bits
        else:
            h[1, column] = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).item()
    assert h.isnan().sum() == len(NAN_COLUMNS)
    assert torch.equal(ops.bias_gelu(h, bias).isnan(), h.isnan())
    grad_h, bias_grad = ops.bias_gelu_backward(grad, h, bias)
    assert torch.equal(grad_h.isnan(), h.isnan())
    assert torch.equal(bias_grad.isnan(), h.isnan().any(0))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_dropout_kernels_carry_nan(cpu_library, dtype):
    """A NaN of the input reaches the dropout's output whether its element is kept or dropped (NaN
    times 0 is NaN, as in torch's dropout), the column sums of its column, and bias_dropout_add's
    output where h or the residual holds it; whatever its bits, on every path of the kernels."""
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), "dropout-nan"))
    x, residual = (torch.randn(3, 190, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    bias = torch.randn(190, generator=generator, dtype=torch.float64).to(dtype)
    for tensor, row in ((x, 1), (residual, 2)):
        for bits, column in zip(NAN_BITS, NAN_COLUMNS, strict=True):
            if dtype == torch.bfloat16:
                tensor.view(torch.int16)[row, column] = bits
            else:
                tensor[row, column] = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).item()
    seed = torch.tensor(1234)
    assert torch.equal(ops.dropout(x, seed, 0.5).isnan(), x.isnan())
    out, sums = ops.dropout_column_sums(x, seed, 0.5)
    assert torch.equal(out.isnan(), x.isnan()) and torch.equal(sums.isnan(), x.isnan().any(0))
    assert torch.equal(ops.bias_dropout_add(x, bias, residual, seed, 0.5).isnan(), x.isnan() | residual.isnan())


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_layer_norm_carries_nan(cpu_library, dtype):
    """A NaN of x, whatever its bits and wherever in the row (every path of the kernels), makes its
    row's statistics and outputs NaN and no other row's."""
    generator = torch.Generator().manual_seed(stable_seed(str(dtype), "layer-norm-nan"))
    x = torch.randn(len(NAN_COLUMNS) + 1, 190, generator=generator, dtype=torch.float64).to(dtype)
    weight, bias = (torch.randn(190, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2))
    for row, (bits, column) in enumerate(zip(NAN_BITS, NAN_COLUMNS, strict=True)):
        if dtype == torch.bfloat16:
            x.view(torch.int16)[row, column] = bits
        else:
            x[row, column] = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).item()
    out, mean, rstd = ops.layer_norm(x, weight, bias, 1e-5)
    nan_rows = torch.arange(len(NAN_COLUMNS) + 1) < len(NAN_COLUMNS)
    assert torch.equal(out.isnan().all(-1), nan_rows) and torch.equal(out.isnan().any(-1), nan_rows)
    assert torch.equal(mean.isnan(), nan_rows) and torch.equal(rstd.isnan(), nan_rows)
    grad_x = ops.layer_norm_backward(torch.ones_like(x), x, weight, mean, rstd)[0]
    assert torch.equal(grad_x.isnan().all(-1), nan_rows) and torch.equal(grad_x.isnan().any(-1), nan_rows)


@pytest.mark.parametrize("globals_", [[], [(0, 3)]], ids=["local", "a-global-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_carries_a_nan_hidden_state(dtype, globals_):
    """A NaN in one token's hidden state: every output row the float64 definition makes NaN is NaN.
    In bfloat16 torch's GEMMs give the NaN 0xffff and its exp then 0xffffffff, which TVM's rounding
    to bfloat16 (integer arithmetic) once carried into the sign bit: the global-key merge returned
    finite rows there."""
    cfg = tiny_config(attention_window=4)
    x, mask = layer_inputs(1, 1, 40, 32, globals_=globals_)
    x[0, 17, 5] = float("nan")
    expected = explicit_attention(layer_for(cfg), x, mask, 4, (1,) * 4, False).isnan().any(-1)
    with torch.no_grad():
        got = layer_for(cfg, dtype=dtype)(x.to(dtype), mask)[0].isnan().any(-1)
    assert expected.any()
    assert (got | ~expected).all(), f"{dtype}: rows {(expected & ~got).nonzero()[:, 1].tolist()} came out finite"


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_bfloat16_outputs_keep_any_nan(cpu_library, dtype):
    """A float32 NaN of any bit pattern reaches a bfloat16 output as NaN (the global-key merge's
    float32 weights into a bfloat16 result, forward and the context's gradient; the layer norm
    backward's rstd), on every path of a row of 190 (AVX2's pairs, a vector, a tail): 0x7fffffff
    and 0xffffffff came out -0 and 0."""
    a = _float32_nans(NAN_PATTERNS).view(1, len(NAN_PATTERNS), 1)
    context = torch.ones(1, len(NAN_PATTERNS), 1, 190, dtype=dtype)
    values = torch.ones(1, 1, 1, 190, dtype=dtype)
    out = ops.global_merge(context, a, torch.zeros(1, len(NAN_PATTERNS), 1, 1), values)
    grad_context = ops.global_merge_backward(torch.ones_like(context), context, values, a)[0]
    rows = context.view(len(NAN_PATTERNS), 190)
    grad_x = ops.layer_norm_backward(
        torch.ones_like(rows), rows, torch.ones(190, dtype=dtype), torch.zeros(len(NAN_PATTERNS)), a.view(-1)
    )[0]
    for name, x in (("output", out), ("context gradient", grad_context), ("layer norm's input gradient", grad_x)):
        per_pattern = x.reshape(len(NAN_PATTERNS), -1)
        assert x.isnan().all(), (
            f"finite {name} for the NaNs {[hex(p) for p, row in zip(NAN_PATTERNS, per_pattern) if not row.isnan().all()]}"
        )
