"""Timing (interleaved across methods, medians) and memory (one call in a fresh process)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from bench import methods


@dataclass(frozen=True)
class Case:
    """One measured configuration (everything but the method)."""
    op: str
    backward: bool
    seq_len: int
    window: int
    dilation: tuple[int, ...]
    heads: int
    head_dim: int
    batch: int
    dtype: str
    device: str

    @property
    def pass_name(self) -> str:
        return "forward+backward" if self.backward else "forward"

    def inputs(self):
        return methods.make_inputs(self.op, self.batch, self.seq_len, self.heads, self.head_dim, self.window,
                                   getattr(torch, self.dtype), self.device, self.backward)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clear_grads(inputs) -> None:
    for x in inputs:
        x.grad = None


def time_interleaved(case: Case, method_names: list[str], repeats: int) -> dict[str, float]:
    """Median seconds per call of each method: one warm-up each, then ``repeats`` rounds A, B, C, A, B, C..."""
    inputs = case.inputs()
    runs = {m: methods.runner(case.op, m, inputs, case.window, case.dilation, case.backward) for m in method_names}
    samples = {m: [] for m in method_names}
    for rounds in range(repeats + 1):
        for name, run in runs.items():
            _clear_grads(inputs)
            synchronize(case.device)
            started = time.perf_counter()
            run()
            synchronize(case.device)
            if rounds:  # round 0 is the warm-up
                samples[name].append(time.perf_counter() - started)
    return {m: statistics.median(s) for m, s in samples.items()}


def gemm_gflops(device: str, size: int = 4096, repeats: int = 3) -> float:
    """Same-run float32 matmul rate: the practical ceiling the band products are compared with."""
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times) / 1e9


# ---------------------------------------------------------------------------
# Memory: a fresh process per (case, method), so that nothing cached by earlier calls counts.
# ---------------------------------------------------------------------------

def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def probe_in_this_process(case: Case, method: str) -> dict:
    """First-call latency (includes loading or compiling), then the peak extra memory of a second call."""
    inputs = case.inputs()
    run = methods.runner(case.op, method, inputs, case.window, case.dilation, case.backward)
    synchronize(case.device)
    started = time.perf_counter()
    run()
    synchronize(case.device)
    first_call_ms = (time.perf_counter() - started) * 1e3
    _clear_grads(inputs)
    if case.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM (peak RSS) to the current RSS
            handle.write("5")
        before = _rss_kib("VmRSS")
        run()
        peak = (_rss_kib("VmHWM") - before) * 1024
    return {"first_call_ms": first_call_ms, "peak_mib": peak / 2**20}


def probe_in_fresh_process(case: Case, method: str, timeout_s: float) -> dict:
    request = json.dumps({"case": asdict(case), "method": method})
    try:
        result = subprocess.run([sys.executable, "-m", "bench.measure", request], capture_output=True, text=True,
                                timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"error": f"memory probe exceeded {timeout_s:.0f} s"}
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"memory probe failed: {last[:200]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the fresh process of probe_in_fresh_process
    request = json.loads(sys.argv[1])
    case_fields = request["case"]
    case_fields["dilation"] = tuple(case_fields["dilation"])
    print(json.dumps(probe_in_this_process(Case(**case_fields), request["method"])))
