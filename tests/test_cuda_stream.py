"""CUDA only: kernels launch on PyTorch's current stream, with no hidden device synchronisation."""

from __future__ import annotations

import pytest
import torch

from longformer_ops import diagonaled_mm
from longformer_ops.ops.reference import diagonaled_mm_reference

pytestmark = pytest.mark.gpu


def test_runs_on_a_non_default_stream_without_synchronising():
    """A slow producer on a side stream, then our kernel, with no synchronisation in between:
    if the kernel ran on another stream it would read its input before the producer wrote it."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 3001, 4, 64, device="cuda", generator=generator)
    k = torch.randn(2, 3001, 4, 64, device="cuda", generator=generator)
    big = torch.randn(4096, 4096, device="cuda", generator=generator)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(20):  # keep the side stream busy for a while
            big = (big @ big).tanh()  # (bounded: squaring a matrix 20 times overflows to inf, and inf * 0 is NaN)
        shifted = q + big[0, 0] * 0  # written on the side stream, after the matmuls
        scores = diagonaled_mm(shifted, k, 37, [1, 2, 3, 4])
        context = diagonaled_mm(torch.softmax(scores, -1), k, 37, [1, 2, 3, 4], True)
    side.synchronize()
    expected = diagonaled_mm_reference(q.double(), k.double(), 37, [1, 2, 3, 4])
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-4)
    probs = torch.softmax(expected, -1)
    torch.testing.assert_close(
        context.double(), diagonaled_mm_reference(probs, k.double(), 37, [1, 2, 3, 4], True), rtol=1e-4, atol=1e-4
    )


def test_no_hidden_synchronisation_per_call():
    q = torch.randn(1, 513, 4, 64, device="cuda", requires_grad=True)
    k = torch.randn(1, 513, 4, 64, device="cuda", requires_grad=True)
    # First call: loads the library and caches the dilations on the device (both may synchronise).
    diagonaled_mm(torch.softmax(diagonaled_mm(q, k, 16, [1, 2, 4, 8]), -1), k, 16, [1, 2, 4, 8], True).sum().backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scores = diagonaled_mm(q, k, 16, [1, 2, 4, 8])
        context = diagonaled_mm(torch.softmax(scores, -1), k, 16, [1, 2, 4, 8], True)
        context.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
