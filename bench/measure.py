"""Timing (interleaved across methods, medians) and memory (one call in a fresh process)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

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


def time_interleaved(case: Case, method_names: list[str], repeats: int,
                     expected_seconds: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds per call of each method: warm-up, then ``repeats`` rounds A, B, C, A, B, C...

    The warm-up round is skipped for a method expected (from a shorter length) to take over a
    second per call, unless it compiles per shape (FlexAttention): the median of the timed
    rounds already discounts one slow first call, and a sweep's long calls dominate its time.
    """
    expected_seconds = expected_seconds or {}
    inputs = case.inputs()
    runs = {m: methods.runner(case.op, m, inputs, case.window, case.dilation, case.backward) for m in method_names}
    warm_up = [m for m in method_names if m in methods.COMPILES_PER_SHAPE or expected_seconds.get(m, 0.0) < 1.0]
    samples = {m: [] for m in method_names}
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            if round_index == 0 and name not in warm_up:
                continue
            _clear_grads(inputs)
            synchronize(case.device)
            started = time.perf_counter()
            run()
            synchronize(case.device)
            if round_index:  # round 0 is the warm-up
                samples[name].append(time.perf_counter() - started)
    return {m: statistics.median(s) for m, s in samples.items()}


def gemm_gflops(device: str, size: int = 4096, repeats: int = 3) -> float:
    """Same-run float32 matmul rate: the practical ceiling the band products are compared with.

    Into a reused output, so that no page faults count against it (a GEMM's 64 MiB output per
    137 GFLOP costs it ~1%; the band products' outputs cost them far more, see NOTES)."""
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    c = torch.mm(a, b)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b, out=c)
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


_FORKSERVER = None


def _fresh_process_context():
    """Processes forked from a server that has imported torch and the bench but run nothing:
    each probe is still a fresh process (its own allocator, no kernel loaded or compiled), without
    paying Python's and torch's start-up (~2.5 s) per probe."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "bench.methods", "bench.measure"])
    return _FORKSERVER


def _probe_child(case: Case, method: str, connection) -> None:
    try:
        connection.send(probe_in_this_process(case, method))
    except BaseException as error:  # reported to the parent, which records the reason
        connection.send({"error": f"memory probe failed: {type(error).__name__}: {str(error)[:200]}"})


def probe_in_fresh_process(case: Case, method: str, timeout_s: float) -> dict:
    context = _fresh_process_context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_probe_child, args=(case, method, sender))
    process.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            process.kill()
            return {"error": f"memory probe exceeded {timeout_s:.0f} s"}
        return receiver.recv()
    except EOFError:  # died without answering: killed for memory, or crashed
        process.join()
        return {"error": f"memory probe process died (exit code {process.exitcode})"}
    finally:
        process.join(timeout=10)
