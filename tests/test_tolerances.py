"""The comparison helpers fail on wrong results: each is fed the reference with a known fault.

For every dtype, the attention checks (``assert_normwise_close``, results and gradients) must
accept the kernels' own answer and refuse the reference zeroed, negated, scaled by 1 + 2B, with
one element off by 10 B ||ref||, and computed with the window shifted by one, where B is the
check's bound in that dtype (``conftest.NORMWISE_UNITS``: a few units roundoff). The band
products' check (``assert_close_to_reference``: elementwise within TOLERANCE times the products
on |inputs|, and norm-wise as above) must refuse the same faults, its one element off by
10 TOLERANCE times the largest term.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    CPU_DTYPES,
    TOLERANCE,
    assert_close_to_reference,
    assert_normwise_close,
    normwise_bound,
    stable_seed,
)

from longformer_ops import diagonaled_mm, sliding_window_attention
from longformer_ops.ops.reference import diagonaled_mm_reference, sliding_window_attention_reference

W, DILATION = 5, [1, 2, 4]


def _case(dtype):
    seed = stable_seed("tolerances", str(dtype))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 61, 3, 32, generator=g).to(dtype) for _ in range(3))
    grad = torch.randn(2, 61, 3, 32, generator=g).to(dtype)
    return q, k, v, grad


def _attention_and_gradients(q, k, v, grad, w):
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = sliding_window_attention(*inputs, w, DILATION, False, 1 / math.sqrt(q.shape[-1]))
    return [out.detach()] + list(torch.autograd.grad(out, inputs, grad))


def _reference(q, k, v, grad, w=W):
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = sliding_window_attention_reference(*exact, w, DILATION, False, 1 / math.sqrt(q.shape[-1]))
    return [out.detach()] + list(torch.autograd.grad(out, exact, grad.double()))


def _faults(ref, shifted, bound, element_offset):
    one_off = ref.clone(memory_format=torch.contiguous_format)
    one_off.view(-1)[ref.numel() // 3] += element_offset
    return {
        "zeroed": torch.zeros_like(ref),
        "negated": -ref,
        "scaled by 1 + 2B": ref * (1 + 2 * bound),
        "one element off": one_off,
        "window shifted by one": shifted,
    }


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_attention_checks_fail_on_faults(dtype):
    q, k, v, grad = _case(dtype)
    got = _attention_and_gradients(q, k, v, grad, W)
    ref = _reference(q, k, v, grad)
    shifted = _reference(q, k, v, grad, W + 1)
    for index, name in enumerate(["result", "dq", "dk", "dv"]):
        gradients = index > 0
        assert_normwise_close(got[index], ref[index], dtype, f"kernel {name}", zero_scale=1.0, gradients=gradients)
        bound = normwise_bound(dtype, gradients)
        for fault, wrong in _faults(ref[index], shifted[index], bound, 10 * bound * float(ref[index].norm())).items():
            with pytest.raises(AssertionError):
                assert_normwise_close(wrong, ref[index], dtype, name, zero_scale=1.0, gradients=gradients)
                pytest.fail(f"{dtype} {name}: the check accepted the reference {fault}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_band_product_check_fails_on_faults(dtype):
    q, k, _, _ = _case(dtype)
    got = diagonaled_mm(q, k, W, DILATION)
    q64, k64 = q.double(), k.double()
    ref = diagonaled_mm_reference(q64, k64, W, DILATION)
    scale = diagonaled_mm_reference(q64.abs(), k64.abs(), W, DILATION)
    assert_close_to_reference(got, ref, scale, dtype)
    faults = _faults(
        ref,
        diagonaled_mm_reference(q64.roll(1, dims=1), k64, W, DILATION),
        TOLERANCE[dtype],
        10 * TOLERANCE[dtype] * float(scale.max()),
    )
    for fault, wrong in faults.items():
        with pytest.raises(AssertionError):
            assert_close_to_reference(wrong, ref, scale, dtype)
            pytest.fail(f"{dtype}: the band check accepted the reference {fault}")
