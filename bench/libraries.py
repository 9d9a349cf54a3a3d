"""The fused local-attention kernels of several CPU libraries against each other, in one process:
``python -m bench.libraries --libraries cpu-avx512:float32,cpu-amx:bfloat16 [--seq-len 4096]
[--window 256] [--dilated] [--seconds 40]``.

Each library is ``[DIR:]TARGET:DTYPE[@SOFTCAP]``: ``TARGET/longformer_DTYPE.so`` of the prebuilt
directory ``DIR`` (default: the one the package loads, ``prebuilt/``), so that a library as built
before a change can stand next to the current one (``git worktree add /tmp/old REV``, then
``/tmp/old/prebuilt:cpu-avx512:float32``), its kernels called with the logit soft-cap ``SOFTCAP``
(default none; a library may be listed with and without one). The
kernels' forward and backward are called directly (batch 1, 12 heads of 64, random inputs of
each library's dtype), alternating one call of each per round for ``--seconds``; the figures are
medians per call and each one's median per-round ratio to the first library's. Processes on these
machines differ in speed by up to 2x from minute to minute, rounds within one process far less:
this is the measure to trust for a change of a few percent (bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from longformer_ops.runtime import kernels
from longformer_ops.runtime import loader as _loader

HEADS, HEAD_DIM = 12, 64
DILATED = (1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 4, 8)


def _library(spec: str) -> tuple[str, Path, str, torch.dtype, float]:
    """``[DIR:]TARGET:DTYPE[@SOFTCAP]`` -> (label, prebuilt directory, file name in it, dtype, soft-cap)."""
    library, _, cap = spec.partition("@")
    try:
        softcap = float(cap) if cap else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"the soft-cap after '@' in {spec!r} is not a number") from None
    parts = library.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected [DIR:]TARGET:DTYPE[@SOFTCAP], got {spec!r}")
    directory = Path(parts[0]) if len(parts) == 3 else _loader.prebuilt_dir()
    target, dtype_name = parts[-2:]
    if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
        raise argparse.ArgumentTypeError(f"{dtype_name!r} in {spec!r} is not a torch dtype")
    name = f"{target}/longformer_{dtype_name}.so"
    if not (directory / name).is_file():
        raise argparse.ArgumentTypeError(f"no library {name} in {directory} (from {spec!r})")
    return spec, directory, name, getattr(torch, dtype_name), softcap


def _calls(directory: Path, name: str, dtype: torch.dtype, n: int, w: int, dilation: torch.Tensor, softcap: float):
    """The library's fused forward and backward on fixed random inputs, as two argument-less calls.
    A library built before the kernels took a soft-cap (the argument after the scale) is called
    without one, where ``softcap`` is 0."""
    module = _loader._load(directory, name)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, n, HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(4))
    out, grad_q, grad_k, grad_v = (torch.empty_like(q) for _ in range(4))
    lse, grad_lse = torch.empty(1, n, HEADS), torch.zeros(1, n, HEADS)
    key_bias = torch.zeros(1, n)
    scale = HEAD_DIM**-0.5
    runs = kernels.query_runs(HEADS, n, w, torch.get_num_threads())
    cap = (softcap,)

    def forward():
        module["attention_symmetric"](q, k, v, key_bias, dilation, w, scale, *cap, 0.0, 0, out, lse, runs)

    def backward():
        module["attention_backward_symmetric"](
            grad, q, k, v, key_bias, out, lse, grad_lse, dilation, w, scale, *cap, 0.0, 0, grad_q, grad_k, grad_v, runs
        )

    try:
        forward()  # out and lse for the backward, and the first call's costs out of the timing
    except Exception:  # (tvm_ffi's error for a wrong argument count)
        if softcap:
            raise
        cap = ()
        forward()
    backward()
    return forward, backward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.libraries", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--libraries",
        required=True,
        type=lambda text: [_library(spec) for spec in text.split(",") if spec],
        help="comma-separated [DIR:]TARGET:DTYPE[@SOFTCAP], the first the reference of the ratios",
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256, help="one-sided window w")
    parser.add_argument("--dilated", action="store_true", help=f"per-head dilations {DILATED} instead of 1")
    parser.add_argument("--seconds", type=float, default=40.0, help="time spent alternating the calls")
    args = parser.parse_args(argv)

    prebuilt = _loader.prebuilt_dir()
    _loader._load_runtime(prebuilt, json.loads((prebuilt / "manifest.json").read_text()), cuda=False)
    if any("amx" in name for _, _, name, _, _ in args.libraries):
        _loader.amx_permitted()  # the tiles' permission, as the loader asks it before choosing cpu-amx
    dilation = torch.tensor(DILATED if args.dilated else (1,) * HEADS, dtype=torch.int32)
    cases = []  # (label, pass, call); the first library's forward and backward are cases 0 and 1
    for label, directory, name, dtype, softcap in args.libraries:
        forward, backward = _calls(directory, name, dtype, args.seq_len, args.window, dilation, softcap)
        cases += [(label, "forward", forward), (label, "backward", backward)]

    rounds = []  # per round, each case's time (by position: a library may be listed twice)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline or not rounds:
        times = []
        for _, _, call in cases:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rounds.append(times)

    first = args.libraries[0][0]
    print(
        f"n = {args.seq_len}, w = {args.window}, {HEADS} heads of {HEAD_DIM}, "
        f"{'dilated' if args.dilated else 'undilated'}, {torch.get_num_threads()} threads, {len(rounds)} rounds"
    )
    for index, (label, pass_name, _) in enumerate(cases):
        median = statistics.median(r[index] for r in rounds)
        ratio = statistics.median(r[index] / r[index % 2] for r in rounds)
        print(f"{label:48s} {pass_name:8s} {median * 1e3:9.2f} ms  {ratio:5.3f} of {first}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
