"""No public call holds more memory than its outputs, the kernels' per-thread scratch and a small
margin: each measured in a fresh process (tests/memory_probe.py) at a length where one hidden tensor
of the band's shape would be several times the margin (12 heads x 64, w = 256, per-head dilations
1..8: a float32 band is 403 MiB at n = 16384, 1.6 GiB at 65536).

Margin: 32 MiB (allocator arenas, torch's small tensors, the mask of a band's edge rows); the
kernels' scratch is the packed operands of the head each thread works on (memory_probe.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("memory_probe.py")
MARGIN = 32 * 2**20

CASES = [
    ("qk", 16384),
    ("pv", 16384),
    ("transposed", 16384),
    ("mask", 16384),
    ("softmax", 16384),
    ("attention", 65536),
    ("attention_backward", 16384),
]


@pytest.mark.parametrize("call,n", CASES, ids=[c for c, _ in CASES])
def test_peak_memory_is_outputs_and_scratch(call, n):
    run = subprocess.run([sys.executable, str(PROBE), call, str(n)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    allowed = result["outputs"] + result["scratch"] + MARGIN
    mib = {
        key: round(value / 2**20, 1) for key, value in result.items() if key in ("growth", "outputs", "scratch", "band")
    }
    assert result["growth"] <= allowed, f"{call} at n={n}: peak RSS grew beyond outputs + scratch + 32 MiB: {mib}"
    # The margin is far below one band: a hidden band-shaped tensor (even a bool one) could not pass.
    assert MARGIN + result["scratch"] < result["band"] / 4
