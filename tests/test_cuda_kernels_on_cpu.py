"""The CUDA kernels' generated code (the band products, the fused attention forward and backward,
and the half types' tensor-core variants built with float operands), run on the CPU
(``cuda_on_cpu``), against the references:
odd lengths, a window near and past the sequence length, several dilations (one larger than the
sequence), both window kinds, head_dim not a multiple of the output feature block, batch 2.
On a GPU the same kernels run in ``test_diagonaled_mm`` and ``test_attention`` and under
compute-sanitizer."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import subprocess
import sys

import cuda_on_cpu
import filelock
import pytest
import torch
from conftest import assert_close_to_reference, assert_normwise_close, stable_seed

from longformer_ops.ops.reference import (
    diagonaled_mm_reference,
    dropout_factor_reference,
    sliding_window_attention_reference,
    sliding_window_lse_reference,
)
from longformer_ops.runtime.band import band_width

pytestmark = [
    pytest.mark.skipif(cuda_on_cpu.cxx_compiler() is None, reason="no C++ compiler to build the CUDA code for the CPU"),
    # Generating the CUDA source needs the TVM compiler (the test extra; a GPU machine's image may lack it).
    pytest.mark.skipif(
        importlib.util.find_spec("tvm") is None, reason="the TVM compiler (apache-tvm) is not installed"
    ),
]

# (batch, n, heads, head_dim, w, dilation per head, autoregressive)
CASES = [
    (1, 70, 2, 16, 3, [1, 2], False),
    (2, 130, 3, 32, 9, [1, 3, 7], True),
    (1, 65, 1, 16, 40, [2], False),
    (1, 100, 2, 80, 60, [1, 5], True),
    (1, 33, 2, 16, 20, [1, 40], False),
    (1, 200, 2, 64, 70, [1, 2], False),
    (1, 1, 1, 16, 5, [1], False),
    (1, 129, 2, 16, 128, [3, 1], True),
    (1, 150, 2, 144, 20, [1, 3], False),  # three feature blocks, the last partly past head_dim
]


def case_id(case) -> str:
    return "-".join(map(str, case)).replace(" ", "")


@contextlib.contextmanager
def _run_wide_directory(tmp_path_factory, name):
    """``name`` in this test run's temporary directory, which every pytest-xdist worker sees (``make
    test`` runs one per core; each has a subdirectory of the run's), held under a file lock: what
    the first worker makes there (the harness's generation and build take minutes), the others reuse."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    directory.mkdir(exist_ok=True)
    with filelock.FileLock(f"{directory}.lock"):
        yield directory


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    with _run_wide_directory(tmp_path_factory, "cuda_source") as directory:
        source = directory / "generated.json"
        return source if source.exists() else cuda_on_cpu.generate(directory)


@pytest.fixture(scope="module")
def kernels(generated, tmp_path_factory):
    with _run_wide_directory(tmp_path_factory, "cuda_on_cpu") as directory:
        library = directory / "kernels.so"
        if not library.exists():
            library, _ = cuda_on_cpu.build(directory, generated)
        return ctypes.CDLL(str(library))


def _call(kernels, name, shape, **arguments):
    """run_<name> with ``arguments`` (tensors by pointer, the rest by value) and ``shape``'s sizes."""
    batch, n, heads, head_dim = shape
    arguments = dict(dict(batch=batch, n=n, heads=heads, kv_heads=heads, head_dim=head_dim), **arguments)
    converted = []
    for argument, ctype in cuda_on_cpu.ARGUMENTS:
        value = arguments.get(argument, 0)
        if ctype.endswith("*"):
            converted.append(ctypes.c_void_p(value.data_ptr() if isinstance(value, torch.Tensor) else 0))
        else:
            converted.append((ctypes.c_double if ctype == "double" else ctypes.c_int64)(value))
    getattr(kernels, f"run_{name}")(*converted)


def _run(kernels, name, t1, t2, dilation, band, padding, out_shape):
    out = torch.full(out_shape, float("nan"))
    _call(
        kernels,
        name,
        t2.shape,
        dilation=torch.tensor(dilation, dtype=torch.int32),
        out=out,
        t1=t1,
        t2=t2,
        band=band,
        padding=padding,
    )
    return out


@pytest.mark.parametrize("op", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_kernel_code_matches_reference(kernels, op, case):
    batch, n, heads, head_dim, w, dilation, autoregressive = case
    band = w + 1 if autoregressive else 2 * w + 1
    seed = stable_seed("cuda_on_cpu", op, str(case))
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(2))
    probs = torch.randn(batch, n, heads, band, generator=g)
    name = f"{op}_{'causal' if autoregressive else 'symmetric'}"

    def reference(a, b, padding=0.0):  # the op on float64 copies; the transposed mode as the qk mode's adjoint
        if op == "qk":
            return diagonaled_mm_reference(a, b, w, dilation, False, padding, autoregressive)
        if op == "pv":
            return diagonaled_mm_reference(a, b, w, dilation, True, 0, autoregressive)
        keys = torch.zeros_like(b, requires_grad=True)  # d(sum(qk(b, keys) * a)) / d keys = transposed(a, b)
        (diagonaled_mm_reference(b, keys, w, dilation, False, 0, autoregressive) * a).sum().backward()
        return keys.grad

    first = q if op == "qk" else probs
    got = _run(
        kernels,
        name,
        first,
        k if op != "transposed" else q,
        dilation,
        band,
        -7.0,
        (batch, n, heads, band if op == "qk" else head_dim),
    )
    second = k if op != "transposed" else q
    ref = reference(first.double(), second.double(), padding=-7.0)
    scale = reference(first.double().abs(), second.double().abs())  # 0 at padding: it must be exact
    try:
        assert_close_to_reference(got, ref, scale, torch.float32)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


@pytest.mark.parametrize("kernel", ["attention", "attention_mma"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_attention_code_matches_reference(kernels, case, dropout, kernel):
    """The fused forward (float32's, and the half types' tensor-core kernel with float operands):
    result and log-sum-exp, with masked keys (one row's keys all masked where the window allows),
    and its dropout mask the CPU kernels' (the reference re-implements it)."""
    batch, n, heads, head_dim, w, dilation, autoregressive = case
    seed = stable_seed("cuda_on_cpu attention", str(case), dropout)  # (the same inputs for both kernels)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(3))
    mask = torch.rand(batch, n, generator=g) < 0.2
    mask[0, : min(n, 3)] = True  # (with w < 3 and no dilation, row 1 sees no key)
    scale = 0.3
    key_bias = torch.zeros(batch, n).masked_fill_(mask, float("-inf"))
    out, lse = torch.full_like(q, float("nan")), torch.full((batch, n, heads), float("nan"))
    _call(
        kernels,
        f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
        q.shape,
        q=q,
        k=k,
        v=v,
        key_bias=key_bias,
        dilation=torch.tensor(dilation, dtype=torch.int32),
        window=w,
        scale=scale,
        dropout=dropout,
        seed=1234,
        out=out,
        lse=lse,
    )
    factor = (
        dropout_factor_reference(1234, batch, n, heads, band_width(w, autoregressive), dropout) if dropout else None
    )
    exact = [x.double() for x in (q, k, v)]
    ref = sliding_window_attention_reference(*exact, w, dilation, autoregressive, scale, mask, factor)
    ref_lse = sliding_window_lse_reference(*exact[:2], w, dilation, autoregressive, scale, mask)
    try:
        assert not out.isnan().any() and not lse.isnan().any()
        terms = float((v.double().abs().amax() * (factor.amax() if dropout else 1)) * n**0.5)
        assert_normwise_close(out.double(), ref, torch.float32, "result", zero_scale=terms)
        finite = ref_lse.isfinite()
        assert torch.equal(lse.isfinite(), finite), "rows with no key: lse must be -inf exactly there"
        assert_normwise_close(
            lse.double()[finite], ref_lse[finite], torch.float32, "lse", zero_scale=float(ref_lse[finite].norm())
        )
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("kernel", ["attention", "attention_mma"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_cuda_attention_code_carries_a_nan(kernels, case, kernel, which):
    """A NaN in q or k: the result's NaN rows and the NaN log-sum-exps are the float64 reference's
    (a NaN score makes its row NaN, never a row of finite numbers), as on the CPU kernels
    (tests/test_non_finite.py)."""
    batch, n, heads, head_dim, w, dilation, autoregressive = case
    g = torch.Generator().manual_seed(stable_seed("cuda_on_cpu nan", str(case), which))
    q, k, v = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(3))
    dict(q=q, k=k)[which][0, n // 2, 0, 1] = float("nan")
    out, lse = torch.full_like(q, 7.0), torch.full((batch, n, heads), 7.0)
    _call(
        kernels,
        f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
        q.shape,
        q=q,
        k=k,
        v=v,
        key_bias=torch.zeros(batch, n),
        dilation=torch.tensor(dilation, dtype=torch.int32),
        window=w,
        scale=0.3,
        dropout=0.0,
        seed=0,
        out=out,
        lse=lse,
    )
    exact = [x.double() for x in (q, k, v)]
    expected = sliding_window_attention_reference(*exact, w, dilation, autoregressive, 0.3).isnan().any(-1)
    assert expected.any()
    assert torch.equal(out.isnan().any(-1), expected), f"NaN rows {out.isnan().any(-1).nonzero().tolist()}"
    assert torch.equal(lse.isnan(), sliding_window_lse_reference(*exact[:2], w, dilation, autoregressive, 0.3).isnan())


@pytest.mark.parametrize("kernel", ["attention_backward", "attention_backward_mma"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_attention_backward_code_matches_reference(kernels, case, dropout, kernel):
    """The fused backward (its two kernels; the half types' on tensor cores, built with float
    operands): dQ, dK, dV through the result and the log-sum-exp together, against autograd of the
    float64 references, with masked keys, a row with no key (no lse gradient there, as the layer
    passes) and the forward's dropout mask."""
    batch, n, heads, head_dim, w, dilation, autoregressive = case
    seed = stable_seed("cuda_on_cpu attention backward", str(case), dropout)
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(4))
    mask = torch.rand(batch, n, generator=g) < 0.2
    mask[0, : min(n, 3)] = True
    scale = 0.3
    factor = (
        dropout_factor_reference(1234, batch, n, heads, band_width(w, autoregressive), dropout) if dropout else None
    )
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = sliding_window_attention_reference(*exact, w, dilation, autoregressive, scale, mask, factor)
    ref_lse = sliding_window_lse_reference(*exact[:2], w, dilation, autoregressive, scale, mask)
    grad_lse = torch.randn(batch, n, heads, generator=g).masked_fill_(ref_lse.isinf(), 0)
    loss = (ref_out * grad.double()).sum() + (ref_lse.masked_fill(ref_lse.isinf(), 0) * grad_lse.double()).sum()
    want = torch.autograd.grad(loss, exact)
    got = [torch.full_like(q, float("nan")) for _ in range(3)]
    _call(
        kernels,
        f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
        q.shape,
        grad=grad,
        q=q,
        k=k,
        v=v,
        key_bias=torch.zeros(batch, n).masked_fill_(mask, float("-inf")),
        out=ref_out.detach().float(),
        lse=ref_lse.detach().float(),
        grad_lse=grad_lse,
        dilation=torch.tensor(dilation, dtype=torch.int32),
        window=w,
        scale=scale,
        dropout=dropout,
        seed=1234,
        grad_q=got[0],
        grad_k=got[1],
        grad_v=got[2],
    )
    terms = float(grad.norm() + grad_lse.norm()) * max(float(x.abs().max()) for x in (q, k, v)) ** 2
    try:
        for name, x, y in zip("qkv", got, want, strict=True):
            assert not x.isnan().any(), f"d{name}: an element was not written"
            assert_normwise_close(x.double(), y, torch.float32, f"d{name}", zero_scale=terms, gradients=True)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


@pytest.mark.parametrize("which", ["q", "k", "grad_lse"])
@pytest.mark.parametrize("kernel", ["attention_backward", "attention_backward_mma"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_cuda_attention_backward_code_carries_a_nan(kernels, case, kernel, which):
    """A NaN in q, k or the log-sum-exp's gradient: every row of dQ, dK and dV that autograd of the
    float64 references makes NaN is NaN (never a finite gradient), given the forward's NaN result
    and lse as the layer passes them. More rows may be NaN (a NaN row's probabilities reach its
    tile's keys, as on the CPU kernels: tests/test_non_finite.py)."""
    batch, n, heads, head_dim, w, dilation, autoregressive = case
    g = torch.Generator().manual_seed(stable_seed("cuda_on_cpu backward nan", str(case), which))
    q, k, v, grad = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(4))
    grad_lse = torch.randn(batch, n, heads, generator=g)
    if which == "grad_lse":
        grad_lse[0, n // 2, 0] = float("nan")
    else:
        dict(q=q, k=k)[which][0, n // 2, 0, 1] = float("nan")
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = sliding_window_attention_reference(*exact, w, dilation, autoregressive, 0.3)
    ref_lse = sliding_window_lse_reference(*exact[:2], w, dilation, autoregressive, 0.3)
    want = torch.autograd.grad((ref_out * grad.double()).sum() + (ref_lse * grad_lse.double()).sum(), exact)
    got = [torch.full_like(q, 7.0) for _ in range(3)]
    _call(
        kernels,
        f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
        q.shape,
        grad=grad,
        q=q,
        k=k,
        v=v,
        key_bias=torch.zeros(batch, n),
        out=ref_out.detach().float(),
        lse=ref_lse.detach().float(),
        grad_lse=grad_lse,
        dilation=torch.tensor(dilation, dtype=torch.int32),
        window=w,
        scale=0.3,
        dropout=0.0,
        seed=0,
        grad_q=got[0],
        grad_k=got[1],
        grad_v=got[2],
    )
    assert any(y.isnan().any() for y in want), "the reference's gradients are finite (the test's premise)"
    for name, x, y in zip("qkv", got, want, strict=True):
        expected, nan_rows = y.isnan().any(-1), x.isnan().any(-1)
        assert (nan_rows | ~expected).all(), (
            f"d{name} with a NaN in {which}: rows {(expected & ~nan_rows).nonzero().tolist()} came out finite"
        )


# (batch, n, heads, head_dim, w, dilation per head, autoregressive, kv_heads, dropout)
CAPPED_CASES = [
    (2, 130, 4, 32, 9, [1, 3, 7, 2], True, 2, 0.0),
    (1, 150, 3, 144, 20, [1, 3, 2], False, 1, 0.0),
    (1, 100, 2, 80, 60, [1, 5], True, 2, 0.3),
    (1, 70, 2, 16, 3, [1, 2], False, 1, 0.3),
]
SOFTCAP = 1.5  # (scale 0.6 on unit features: most scores well into tanh's bend)
SHARD_SEED = 1234 + (5 << 32)  # the dropout mask's rows offset by 5, as a shard's (compute.dropout_row_key)


def _capped_case(case, what):
    batch, n, heads, head_dim, w, dilation, autoregressive, kv_heads, dropout = case
    seed = stable_seed("cuda_on_cpu capped", what, str(case))
    g = torch.Generator().manual_seed(seed)
    q, grad = (torch.randn(batch, n, heads, head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, n, kv_heads, head_dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, n, generator=g) < 0.2
    factor = (
        dropout_factor_reference(SHARD_SEED, batch, n, heads, band_width(w, autoregressive), dropout)
        if dropout
        else None
    )
    return seed, g, q, k, v, grad, mask, factor


def _repeated(x, heads):
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _capped_forward(kernels, kernel, case, q, k, v, mask, softcap):
    batch, n, heads, head_dim, w, dilation, autoregressive, kv_heads, dropout = case
    out, lse = torch.full_like(q, float("nan")), torch.full((batch, n, heads), float("nan"))
    _call(
        kernels,
        f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
        q.shape,
        q=q,
        k=k,
        v=v,
        kv_heads=kv_heads,
        key_bias=torch.zeros(batch, n).masked_fill_(mask, float("-inf")),
        dilation=torch.tensor(dilation, dtype=torch.int32),
        window=w,
        scale=0.6,
        softcap=softcap,
        dropout=dropout,
        seed=SHARD_SEED,
        out=out,
        lse=lse,
    )
    return out, lse


@pytest.mark.parametrize("kernel", ["attention", "attention_mma"])
@pytest.mark.parametrize("case", CAPPED_CASES, ids=case_id)
def test_cuda_attention_code_soft_caps_and_reads_grouped_heads(kernels, case, kernel):
    """The fused forwards with a logit soft-cap and k, v of fewer heads (query head i reads i //
    group), and dropout whose rows are offset by the seed's high half (a shard's): result and
    log-sum-exp against the float64 reference on k and v repeated per query head;
    the same comparison fails without the cap, or with each group's heads read one off."""
    batch, n, heads, head_dim, w, dilation, autoregressive, kv_heads, dropout = case
    seed, g, q, k, v, grad, mask, factor = _capped_case(case, "forward")
    out, lse = _capped_forward(kernels, kernel, case, q, k, v, mask, SOFTCAP)
    exact = [q.double(), _repeated(k.double(), heads), _repeated(v.double(), heads)]
    ref = sliding_window_attention_reference(*exact, w, dilation, autoregressive, 0.6, mask, factor, softcap=SOFTCAP)
    ref_lse = sliding_window_lse_reference(*exact[:2], w, dilation, autoregressive, 0.6, mask, softcap=SOFTCAP)
    terms = float((v.abs().amax() * (factor.amax() if dropout else 1)) * n**0.5)
    finite = ref_lse.isfinite()
    try:
        assert not out.isnan().any() and torch.equal(lse.isfinite(), finite)
        assert_normwise_close(out.double(), ref, torch.float32, "result", zero_scale=terms)
        assert_normwise_close(
            lse.double()[finite], ref_lse[finite], torch.float32, "lse", zero_scale=float(ref_lse[finite].norm())
        )
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None
    uncapped, _ = _capped_forward(kernels, kernel, case, q, k, v, mask, 0.0)
    with pytest.raises(AssertionError):
        assert_normwise_close(uncapped.double(), ref, torch.float32, "result", zero_scale=terms)
    if kv_heads > 1:
        one_off = [x.roll(1, dims=2) for x in exact[1:]]
        wrong = sliding_window_attention_reference(
            exact[0], *one_off, w, dilation, autoregressive, 0.6, mask, factor, softcap=SOFTCAP
        )
        with pytest.raises(AssertionError):
            assert_normwise_close(out.double(), wrong, torch.float32, "result", zero_scale=terms)


@pytest.mark.parametrize("kernel", ["attention_backward", "attention_backward_mma"])
@pytest.mark.parametrize("case", CAPPED_CASES, ids=case_id)
def test_cuda_attention_backward_code_soft_caps_and_reads_grouped_heads(kernels, case, kernel):
    """The fused backwards with a soft-cap and grouped heads: dQ, and dK, dV per query head summed
    over each group, against autograd of the float64 references (result and log-sum-exp) on k and v
    repeated per query head; without the cap the same comparison fails."""
    batch, n, heads, head_dim, w, dilation, autoregressive, kv_heads, dropout = case
    seed, g, q, k, v, grad, mask, factor = _capped_case(case, "backward")
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    repeated = [exact[0], _repeated(exact[1], heads), _repeated(exact[2], heads)]
    ref_out = sliding_window_attention_reference(
        *repeated, w, dilation, autoregressive, 0.6, mask, factor, softcap=SOFTCAP
    )
    ref_lse = sliding_window_lse_reference(*repeated[:2], w, dilation, autoregressive, 0.6, mask, softcap=SOFTCAP)
    grad_lse = torch.randn(batch, n, heads, generator=g).masked_fill_(ref_lse.isinf(), 0)
    loss = (ref_out * grad.double()).sum() + (ref_lse.masked_fill(ref_lse.isinf(), 0) * grad_lse.double()).sum()
    want = torch.autograd.grad(loss, exact)
    terms = float(grad.norm() + grad_lse.norm()) * max(float(x.abs().max()) for x in (q, k, v)) ** 2

    def run(softcap):
        got = [torch.full_like(q, float("nan")) for _ in range(3)]  # dK, dV per query head
        _call(
            kernels,
            f"{kernel}_{'causal' if autoregressive else 'symmetric'}",
            q.shape,
            grad=grad,
            q=q,
            k=k,
            v=v,
            kv_heads=kv_heads,
            key_bias=torch.zeros(batch, n).masked_fill_(mask, float("-inf")),
            out=ref_out.detach().float(),
            lse=ref_lse.detach().float(),
            grad_lse=grad_lse,
            dilation=torch.tensor(dilation, dtype=torch.int32),
            window=w,
            scale=0.6,
            softcap=softcap,
            dropout=dropout,
            seed=SHARD_SEED,
            grad_q=got[0],
            grad_k=got[1],
            grad_v=got[2],
        )
        return [got[0]] + [x.reshape(batch, n, kv_heads, heads // kv_heads, head_dim).sum(3) for x in got[1:]]

    try:
        for name, x, y in zip("qkv", run(SOFTCAP), want, strict=True):
            assert not x.isnan().any(), f"d{name}: an element was not written"
            assert_normwise_close(x.double(), y, torch.float32, f"d{name}", zero_scale=terms, gradients=True)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None
    with pytest.raises(AssertionError):
        assert_normwise_close(run(0.0)[0].double(), want[0], torch.float32, "dq", zero_scale=terms, gradients=True)


def _child_environment(**settings) -> dict:
    """A pytest child process's environment: ours with ``settings``, less pytest-xdist's worker name.
    Inherited, it made the child build its harness in the directory shared by every run of the
    user (``_run_wide_directory`` takes the basetemp's parent for a worker), where another child, or
    an earlier run with older kernels, had left a library built otherwise, which it then reused."""
    environment = dict(os.environ, **settings)
    environment.pop("PYTEST_XDIST_WORKER", None)
    return environment


@pytest.mark.skipif(os.environ.get(cuda_on_cpu.ASYNC_ENV) is not None, reason="the run with deferred copies itself")
def test_tensor_core_kernels_wait_for_their_copies(tmp_path, generated):
    """The tensor-core forward loads each step's keys and values with cp.async while the step
    before computes, the backward's dK/dV kernel each step's queries and dO. With the harness's
    copies deferred to each thread's wait (a process of its own: ``cuda_on_cpu.ASYNC_ENV``), their
    results stay right on three cases (one of three feature blocks), so neither reads an operand
    before waiting for it; without the wait, 16 of the 18 forward cases fail that way, and 16 of
    the 18 backward ones (all pass with the copies done at once, as in the tests above)."""
    environment = _child_environment(**{cuda_on_cpu.ASYNC_ENV: "deferred", cuda_on_cpu.GENERATED_ENV: str(generated)})
    tests = [
        f"{__file__}::test_cuda_attention{part}_code_matches_reference[{case_id(case)}-{dropout}-{kernel}]"
        for case in (CASES[0], CASES[3], CASES[-1])
        for dropout in ("no-dropout", "dropout")
        for part, kernel in (("", "attention_mma"), ("_backward", "attention_backward_mma"))
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=environment,
        capture_output=True,
        text=True,
        cwd=cuda_on_cpu.REPO,
    )
    assert result.returncode == 0 and f"{len(tests)} passed" in result.stdout, result.stdout[-4000:]


@pytest.mark.skipif(os.environ.get(cuda_on_cpu.SANITIZE_ENV) is not None, reason="the run under the sanitizer itself")
@pytest.mark.skipif(cuda_on_cpu.asan_preload() is None, reason="the C++ compiler has no AddressSanitizer runtime")
def test_tensor_core_kernels_stay_inside_their_arrays(tmp_path, generated):
    """The tensor-core kernels hand their device functions (ldmatrix, mma, the 16-byte copies)
    pointers into arrays that TVM sizes from the accesses it sees. Under AddressSanitizer (a
    process of its own, the runtime preloaded), their forward and backward on three cases (one
    head_dim past a feature block) touch nothing outside those arrays. An array sized for a
    pointer's first element only passed every case above on the CPU and failed 206 tests on an H200
    (bench/NOTES.md); this test fails on it."""
    environment = _child_environment(
        **{
            cuda_on_cpu.SANITIZE_ENV: "address",
            "LD_PRELOAD": cuda_on_cpu.asan_preload(),
            cuda_on_cpu.GENERATED_ENV: str(generated),
            "ASAN_OPTIONS": f"detect_leaks=0:log_path={tmp_path / 'asan'}",
        }
    )
    tests = [
        f"{__file__}::test_cuda_attention{part}_code_matches_reference[{case_id(case)}-{dropout}-{kernel}]"
        for case in (CASES[0], CASES[3], CASES[-1])
        for dropout in ("no-dropout", "dropout")
        for part, kernel in (("", "attention_mma"), ("_backward", "attention_backward_mma"))
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=environment,
        capture_output=True,
        text=True,
        cwd=cuda_on_cpu.REPO,
    )
    # The sanitizer warns once that it does not fully support swapcontext (the shim's fibers, whose
    # switches it is told of): that line alone is no finding.
    reports = [
        text
        for text in (report.read_text() for report in sorted(tmp_path.glob("asan*")))
        if any(line and "fully support makecontext/swapcontext" not in line for line in text.splitlines())
    ]
    assert not reports, reports[0][:4000]
    assert result.returncode == 0 and f"{len(tests)} passed" in result.stdout, result.stdout[-4000:]
