"""Timing (interleaved across methods, medians) and memory (one call in a fresh process)."""

from __future__ import annotations

import ctypes
import functools
import gc
import random
import statistics
import time
from dataclasses import dataclass

import torch

import longformer_ops
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
        return methods.make_inputs(
            self.op,
            self.batch,
            self.seq_len,
            self.heads,
            self.head_dim,
            self.window,
            getattr(torch, self.dtype),
            self.device,
            self.backward,
        )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clear_grads(inputs) -> None:
    for x in inputs:
        x.grad = None


GEMM = "gemm"  # the reference timed with every case: torch.mm at GEMM_SIZE^3, float32, into a reused output
GEMM_SIZE = 2048  # ~90 ms a call here, like the kernels; its rate matches 3072^3 and 4096^3 within noise (NOTES)
GEMM_FLOPS = 2.0 * GEMM_SIZE**3


def gemm_key(dtype: str) -> str:
    """The samples' key of the GEMM in ``dtype``: :data:`GEMM` for float32 (every case's reference),
    ``gemm-<dtype>`` for the others (each case's own dtype, timed in the same rounds too)."""
    return GEMM if dtype == "float32" else f"{GEMM}-{dtype}"


def gemm_runner(device: str, dtype: str = "float32"):
    """One GEMM (float32: the practical ceiling the band products are compared with; another dtype:
    what the hardware's own GEMM does in that type); into a reused output, so that no page faults
    count against it."""
    generator = torch.Generator().manual_seed(1)
    a, b = (
        torch.randn(GEMM_SIZE, GEMM_SIZE, generator=generator).to(device=device, dtype=getattr(torch, dtype))
        for _ in range(2)
    )
    c = torch.mm(a, b)
    return lambda: torch.mm(a, b, out=c)


# A dtype's GEMM is left out of the rounds when it runs at under 1/SLOW_GEMM_FACTOR of float32's rate:
# torch has no native kernel for it on this CPU (bfloat16 and float16 on AVX2 run a scalar loop at
# ~1 GFLOP/s: ~15 s per 2048^3 call, six minutes a case), so it tells nothing about the hardware.
SLOW_GEMM_FACTOR = 8
_PROBE_SIZE = 256


def _gemm_rate(device: str, dtype: str) -> float:
    """GFLOP/s of the best of three small GEMMs in ``dtype`` (after one untimed call)."""
    a, b = (torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    torch.mm(a, b)
    times = []
    for _ in range(3):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2.0 * _PROBE_SIZE**3 / min(times) / 1e9


@functools.cache
def slow_gemm_reason(device: str, dtype: str) -> str | None:
    """Why the GEMM in ``dtype`` is not timed beside the cases (None: it is; float32's always is)."""
    if dtype == "float32":
        return None
    rate, float32_rate = _gemm_rate(device, dtype), _gemm_rate(device, "float32")
    if rate * SLOW_GEMM_FACTOR >= float32_rate:
        return None
    return (
        f"torch.mm in {dtype} runs at {rate:.1f} GFLOP/s here against float32's {float32_rate:.0f} "
        f"({_PROBE_SIZE}^3): no native {dtype} GEMM on this {device}, so none is timed"
    )


def time_interleaved(
    entries: list[tuple[Case, str]],
    repeats: int,
    expected_seconds: dict[tuple[Case, str], float] | None = None,
    failures: dict[tuple[Case, str], str] | None = None,
) -> dict[object, list[float]]:
    """Seconds per call of each (case, method) entry and of the reference GEMM (key :data:`GEMM`;
    and a GEMM in each other dtype of the entries, key :func:`gemm_key`, unless
    :func:`slow_gemm_reason` leaves it out), one per round (sample i of
    every entry from round i): warm-up, then ``repeats`` rounds of all of them, each round in its
    own shuffled order (seeded).

    Cases that differ only in dtype are meant to be timed together, in the same rounds: the
    dtype comparison then holds under the same machine conditions, as the methods' does, and
    can be made round by round (:func:`paired_ratio`).
    The GEMM runs in the same rounds so that each case's share of it compares rates measured
    under the same machine conditions (this shared machine's speed drifts by 20% within a run).
    The order changes per round because on this VM memory freed by one call (the dense methods
    free gigabytes) is handed back to the host and faults again for whichever call allocates
    about two seconds later: with a fixed order that was the same method in every round.
    The warm-up round is skipped for an entry expected (from a shorter length) to take over a
    second per call, unless its method compiles per shape (FlexAttention): the median of the timed
    rounds already discounts one slow first call, and a sweep's long calls dominate its time.
    An entry that runs out of GPU memory leaves the rounds: it has no samples, and ``failures``
    (when given) says why, so that one dense method at its limit does not end the whole sweep.
    """
    expected_seconds = expected_seconds or {}
    inputs = {case: case.inputs() for case in dict.fromkeys(case for case, _ in entries)}
    first = entries[0][0]
    runs = {
        gemm_key(dtype): (gemm_runner(first.device, dtype), ())
        for dtype in dict.fromkeys(["float32", *(case.dtype for case, _ in entries)])
        if not slow_gemm_reason(first.device, dtype)
    }
    runs.update(
        {
            (case, m): (
                methods.runner(case.op, m, inputs[case], case.window, case.dilation, case.backward),
                inputs[case],
            )
            for case, m in entries
        }
    )
    names = list(runs)
    warm_up = [
        e
        for e in names
        if isinstance(e, str) or e[1] in methods.COMPILES_PER_SHAPE or expected_seconds.get(e, 0.0) < 1.0
    ]
    samples = {e: [] for e in names}
    order = random.Random(first.seq_len)
    for round_index in range(repeats + 1):
        for name in order.sample(names, len(names)):
            run, run_inputs = runs[name]
            if round_index == 0 and name not in warm_up:
                continue
            if name not in samples:  # ran out of memory in an earlier round
                continue
            _clear_grads(run_inputs)
            synchronize(first.device)
            started = time.perf_counter()
            try:
                run()
                synchronize(first.device)
            except torch.OutOfMemoryError as error:
                del samples[name]
                if failures is not None:
                    failures[name] = f"out of memory while timing: {str(error).splitlines()[0][:160]}"
                continue
            if round_index:  # round 0 is the warm-up
                samples[name].append(time.perf_counter() - started)
    if first.device.startswith("cuda"):
        # Hand the blocks cached by these rounds back, so that the memory probes' fresh processes
        # (and the next case) find the GPU as free as it was: on an H100 the probes of the dense
        # methods at n = 16384 failed for the 54 GiB this process still held.
        del runs, inputs, run, run_inputs
        torch.cuda.empty_cache()
    return samples


def paired_ratio(samples: list[float], reference: list[float]) -> float:
    """The median over rounds of ``samples[i] / reference[i]`` (both from :func:`time_interleaved`,
    so from the same rounds). This VM switches between a fast and a slow state for seconds at a
    time (the same kernel at 16384: 81-84 ms or 102-111 ms, in runs of rounds); the ratio of two
    medians then depends on which state each median's rounds fell in, a ratio within a round does not."""
    return statistics.median(s / r for s, r in zip(samples, reference, strict=True))


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
        # Memory our library keeps for reuse (freed outputs, longformer_ops/runtime/output_cache.py) goes back
        # first: the call's outputs then count as in a fresh process, as they would have without it.
        longformer_ops.empty_cache()
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


def _peak_of_call_child(prepare, args: tuple, connection) -> None:
    try:
        warm_up, call = prepare(*args)
        warm_up()
        # What the warm-up freed goes back to the system (our output cache, then glibc's free lists),
        # so that the measured call's memory counts as in a fresh process.
        longformer_ops.empty_cache()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM to the current RSS
            handle.write("5")
        before = _rss_kib("VmRSS")
        call()
        connection.send((_rss_kib("VmHWM") - before) / 1024)
    except BaseException as error:  # reported to the parent, which records the reason
        connection.send(f"{type(error).__name__}: {str(error)[:200]}")


def _answer_of_fresh_process(target, args: tuple, timeout_s: float | None = None):
    """``(answer, None)``: what ``target(*args, connection)`` sent from a fresh process; or ``(None,
    exit code)`` where it died without answering (-9: killed, for memory on this machine), or ``(None,
    "timeout")`` past ``timeout_s`` (then killed)."""
    context = _fresh_process_context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, sender))
    process.start()
    sender.close()
    try:
        if timeout_s is not None and not receiver.poll(timeout_s):
            process.kill()
            return None, "timeout"
        return receiver.recv(), None
    except EOFError:  # died without answering: killed for memory, or crashed
        process.join()
        return None, process.exitcode
    finally:
        process.join(timeout=10)


def peak_of_call_mib(prepare, *args) -> float | str:
    """Peak extra RSS (MiB) of one call in a fresh process, or why it could not be measured:
    ``prepare(*args)`` (a module-level function, run in that process) builds what it needs and returns
    ``(warm_up, call)``; ``warm_up()`` runs first (libraries load), then ``call()`` is measured."""
    answer, exit_code = _answer_of_fresh_process(_peak_of_call_child, (prepare, args))
    if exit_code is None:
        return answer
    if exit_code == -9:
        return "out of memory: killed (SIGKILL, the kernel's OOM killer on this machine)"
    return f"the process died (exit code {exit_code})"


def probe_in_fresh_process(case: Case, method: str, timeout_s: float) -> dict:
    answer, exit_code = _answer_of_fresh_process(_probe_child, (case, method), timeout_s)
    if exit_code == "timeout":
        return {"error": f"memory probe exceeded {timeout_s:.0f} s"}
    if exit_code is not None:
        return {"error": f"memory probe process died (exit code {exit_code})"}
    return answer
