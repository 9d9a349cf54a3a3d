"""The CUDA band products' generated code, run on the CPU (``cuda_on_cpu``), against the references:
odd lengths, a window near and past the sequence length, several dilations (one larger than the
sequence), both window kinds, head_dim not a multiple of the output feature block, batch 2.
On a GPU the same kernels run in ``test_diagonaled_mm`` and under compute-sanitizer."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cuda_on_cpu
from conftest import assert_close_to_reference, stable_seed
from longformer_ops.reference import diagonaled_mm_reference

pytestmark = pytest.mark.skipif(cuda_on_cpu.cxx_compiler() is None, reason="no C++ compiler to build the CUDA code for the CPU")

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
]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    library, _ = cuda_on_cpu.build(tmp_path_factory.mktemp("cuda_on_cpu"))
    return ctypes.CDLL(str(library))


def _run(kernels, name, t1, t2, dilation, band, padding, out_shape):
    out = torch.full(out_shape, float("nan"))
    d = torch.tensor(dilation, dtype=torch.int32)
    batch, n, heads, head_dim = t2.shape
    pointer = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    getattr(kernels, f"run_{name}")(pointer(d), pointer(out), pointer(t1), pointer(t2), *map(ctypes.c_int64, (
        band, batch, head_dim, heads, n)), ctypes.c_double(padding))
    return out


@pytest.mark.parametrize("op", ["qk", "pv", "transposed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
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
    got = _run(kernels, name, first, k if op != "transposed" else q, dilation, band, -7.0,
               (batch, n, heads, band if op == "qk" else head_dim))
    second = k if op != "transposed" else q
    ref = reference(first.double(), second.double(), padding=-7.0)
    scale = reference(first.double().abs(), second.double().abs())  # 0 at padding: it must be exact
    try:
        assert_close_to_reference(got, ref, scale, torch.float32)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None
