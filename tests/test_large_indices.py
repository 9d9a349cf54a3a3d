"""Tensors past 2**31 elements: the kernels index in 64 bits. Rows at the end of such tensors (and
where their flat offset crosses 2**31) are checked against a direct float64 computation.

float16 and a small head_dim keep this to a few GiB: the band products' band is 2**20 x 4 heads x
513 = 2.15e9 elements (4 GiB); the fused attention's q, k, v and output are 2**20 x 65 heads x 32
= 2.18e9 elements each (16 GiB together, run only where that much memory is free; its backward,
twice that, is not run here).
"""

from __future__ import annotations

import math

import pytest
import torch

from longformer_ops import band_softmax_, diagonaled_mm, sliding_window_attention
from longformer_ops.ops.diagonaled import transposed_product

N = 2**20
HEADS, HEAD_DIM, W = 4, 32, 256
DILATION = [1, 2, 3, 8]
C = 2 * W + 1
CROSSING = 2**31 // (HEADS * C)  # the row whose band holds flat offset 2**31
ROWS = [CROSSING - 1, CROSSING, CROSSING + 1, N - 2 * W * 8, N - 2, N - 1]


def _available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _keys(i: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Band columns of row i whose key is inside the sequence, and those keys."""
    columns = torch.arange(C)
    keys = i + DILATION[head] * (columns - W)
    valid = (keys >= 0) & (keys < N)
    return columns[valid], keys[valid]


def _assert_close(got: torch.Tensor, expected: torch.Tensor, scale: float, what: str):
    error = float((got.double() - expected).abs().max())
    assert error <= 4e-3 * scale, f"{what}: max error {error:.3e} > {4e-3 * scale:.3e}"


@pytest.mark.skipif(_available_gib() < 8, reason="needs 8 GiB of free memory for a 4 GiB band")
def test_band_products_and_softmax_past_2_31_elements():
    assert N * HEADS * C > 2**31
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(1, N, HEADS, HEAD_DIM, generator=g, dtype=torch.float16) for _ in range(3))
    scores = diagonaled_mm(q, k, W, DILATION)
    sampled = {}
    for i in ROWS:
        for head in range(HEADS):
            columns, keys = _keys(i, head)
            expected = k[0, keys, head].double() @ q[0, i, head].double()
            _assert_close(scores[0, i, head, columns], expected, math.sqrt(HEAD_DIM) * 4, f"Q.K^T row {i} head {head}")
            sampled[i, head] = scores[0, i, head, columns].double()
    probs = band_softmax_(scores, W, DILATION)
    for (i, head), row in sampled.items():
        columns, _ = _keys(i, head)
        _assert_close(probs[0, i, head, columns], torch.softmax(row, 0), 1.0, f"softmax row {i} head {head}")
        assert float(probs[0, i, head].double().sum()) == pytest.approx(1.0, abs=2e-3)
    context = diagonaled_mm(probs, v, W, DILATION, is_t1_diagonaled=True)
    for i, head in sampled:
        columns, keys = _keys(i, head)
        expected = probs[0, i, head, columns].double() @ v[0, keys, head].double()
        _assert_close(context[0, i, head], expected, 4.0, f"probs.V row {i} head {head}")
    del context
    spread = transposed_product(probs, v, W, DILATION)
    for p, head in sampled:  # out[p] = sum of probs[i, j] v[i] over the (i, j) whose key is p
        columns = torch.arange(C)
        rows = p - DILATION[head] * (columns - W)
        inside = (rows >= 0) & (rows < N)
        weights = probs[0, rows[inside], head, columns[inside]].double()
        expected = weights @ v[0, rows[inside], head].double()
        _assert_close(spread[0, p, head], expected, 4.0, f"transposed row {p} head {head}")


@pytest.mark.skipif(_available_gib() < 20, reason="needs 20 GiB of free memory for four 4 GiB tensors")
def test_fused_attention_past_2_31_elements():
    heads, w = 65, 2
    assert N * heads * HEAD_DIM > 2**31
    # Zeros (pages untouched until the kernel reads them) and random rows where the checks look.
    q, k, v = (torch.zeros(1, N, heads, HEAD_DIM, dtype=torch.float16) for _ in range(3))
    g = torch.Generator().manual_seed(32)
    tail = N - 64
    for x in (q, k, v):
        x[0, tail:] = torch.randn(64, heads, HEAD_DIM, generator=g, dtype=torch.float16)
    out = sliding_window_attention(q, k, v, w, 1)
    scale = 1 / math.sqrt(HEAD_DIM)
    for i in (N - 3, N - 2, N - 1):
        for head in (0, heads // 2, heads - 1):  # the last head's rows end at the tensor's last element
            keys = torch.arange(i - w, min(i + w + 1, N))
            probs = torch.softmax(k[0, keys, head].double() @ q[0, i, head].double() * scale, 0)
            _assert_close(out[0, i, head], probs @ v[0, keys, head].double(), 4.0, f"attention row {i} head {head}")
