"""One public call in this fresh process: its peak RSS growth, its outputs' bytes and the kernels'
per-thread scratch, printed as JSON (run by test_memory.py: ``python tests/memory_probe.py CALL N``).

The call is made once at a small length first (loading the kernels, warming torch), then the memory
that warm-up freed goes back to the system (``malloc_trim``, the output cache emptied) and the peak
RSS (VmHWM, reset through /proc/self/clear_refs) is measured over the call at length N, its inputs
made before the reset.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch

import longformer_ops
from longformer_ops import band_softmax_, diagonaled_mm, mask_invalid_locations, sliding_window_attention
from longformer_ops.ops.diagonaled import transposed_product

HEADS, HEAD_DIM, W = 12, 64, 256
DILATION = [1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 4, 8]
# The kernels' scratch per (batch, head), in head slices (n x head_dim in the accumulation dtype):
# the packed operands each thread holds while it works on one head (tvm_kernels/schedules/cpu/).
# (With more threads than heads a thread works on a run of a head's queries, with less; the fused
# backward then also keeps the dK, dV parts of the keys at the runs' edges: at most 4 head slices
# per head, kernels.query_runs; on 2 threads these 12 heads run whole.)
SCRATCH_HEAD_SLICES = {
    "qk": 1,
    "pv": 1,
    "transposed": 1,
    "mask": 0,
    "softmax": 0,
    "attention": 2,
    "attention_backward": 8,
}


def _inputs(call: str, n: int):
    g = torch.Generator().manual_seed(n)
    rows = [torch.randn(1, n, HEADS, HEAD_DIM, generator=g) for _ in range(3)]
    band = torch.randn(1, n, HEADS, 2 * W + 1, generator=g) if call in ("pv", "transposed", "mask", "softmax") else None
    if call == "attention_backward":
        for x in rows:
            x.requires_grad_(True)
        rows.append(torch.randn(1, n, HEADS, HEAD_DIM, generator=g))
    return rows, band


def _call(call: str, rows, band) -> list[torch.Tensor]:
    """The call; returns its outputs (what it may allocate)."""
    q, k, v = rows[:3]
    if call == "qk":
        return [diagonaled_mm(q, k, W, DILATION)]
    if call == "pv":
        return [diagonaled_mm(band, v, W, DILATION, is_t1_diagonaled=True)]
    if call == "transposed":
        return [transposed_product(band, v, W, DILATION)]
    if call == "mask":
        mask_invalid_locations(band, W, DILATION, False)
        return []
    if call == "softmax":
        return [band_softmax_(band, W, DILATION, return_lse=True)[1]]
    if call == "attention":
        return list(sliding_window_attention(q, k, v, W, DILATION, return_lse=True))
    if call == "attention_backward":
        out = sliding_window_attention(q, k, v, W, DILATION)
        out.backward(rows[3])
        return [out, q.grad, k.grad, v.grad]
    raise ValueError(f"unknown call {call!r}")


def _rss_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main(call: str, n: int) -> dict:
    _call(call, *_inputs(call, 512))
    rows, band = _inputs(call, n)
    longformer_ops.empty_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = _rss_bytes("VmRSS")
    outputs = _call(call, rows, band)
    growth = _rss_bytes("VmHWM") - before
    threads = min(torch.get_num_threads(), HEADS)
    return {
        "call": call,
        "n": n,
        "growth": growth,
        "outputs": sum(x.numel() * x.element_size() for x in outputs),
        "scratch": threads * SCRATCH_HEAD_SLICES[call] * n * HEAD_DIM * 4,
        "band": n * HEADS * (2 * W + 1) * 4,
        "threads": threads,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
