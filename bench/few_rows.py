"""A generation step's attention products in a half type on the CPU, in one process, rotating order:
the few-row kernels against the float32 path they replaced and against float32 itself.

    python -m bench.few_rows [--dtype bfloat16] [--keys 4096] [--layers 6] [--rounds 11] [--led-rounds 3]

``products``: one query row against each layer's own cache of ``keys`` keys and values (12 heads x
64; distinct caches, so that they come from memory as in a generation), Q.K^T and P.V per layer,
milliseconds per step: the few-row kernels (``dense.matmul``), the float32 path (the cache widened
for torch's float32 ``bmm``, as before the kernels), torch's float32 ``bmm`` on float32 caches, and
float32 caches under autocast to the half type both ways.
``--led-rounds N``: also N rounds of transformers' LED generating 64 tokens (``bench.hf_model``'s
model and generation, patched) in float32 and in the half type with and without the few-row kernels,
seconds per call. Prints a markdown table (medians; LED per round)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock

import torch

from longformer_ops.nn import dense

HEADS, HEAD_DIM = 12, 64


def _without_kernels():
    """The float32 path as it was: the few-row kernels never serve."""
    return mock.patch.object(dense, "_few_row_kernels_serve", lambda *args: False)


def products(dtype: torch.dtype, keys: int, layers: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per step of each way (see the module docstring)."""
    query = torch.randn(HEADS, 1, HEAD_DIM).to(dtype)
    probs = torch.softmax(torch.randn(HEADS, 1, keys), -1).to(dtype)
    caches = [
        (torch.randn(HEADS, keys, HEAD_DIM).to(dtype), torch.randn(HEADS, keys, HEAD_DIM).to(dtype))
        for _ in range(layers)
    ]
    wide = [(k.float(), v.float()) for k, v in caches]

    def step(query, probs, caches):
        for k, v in caches:
            dense.bmm(query, k.transpose(1, 2))
            dense.bmm(probs, v)

    def float32_path():
        with _without_kernels():
            step(query, probs, caches)

    def float32_step():
        step(query.float(), probs.float(), wide)

    def under_autocast(kernels: bool):
        """A float32 model generating under autocast to ``dtype``: float32 caches."""
        with torch.autocast("cpu", dtype), contextlib.nullcontext() if kernels else _without_kernels():
            float32_step()

    ways = {
        "few-row kernels": lambda: step(query, probs, caches),
        "float32 path": float32_path,
        "float32 bmm, float32 caches": float32_step,
        "autocast, float32 caches: few-row kernels": lambda: under_autocast(True),
        "autocast, float32 caches: float32 path": lambda: under_autocast(False),
    }
    samples = {name: [] for name in ways}
    for round_index in range(rounds + 1):
        names = list(ways) if round_index % 2 else list(reversed(ways))
        for name in names:
            started = time.perf_counter()
            for _ in range(10):
                ways[name]()
            if round_index:  # round 0 warms up
                samples[name].append((time.perf_counter() - started) / 10 * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def led_generation(dtype: str, rounds: int) -> dict[str, list[float]]:
    """Seconds per 64-token generation of a patched LED at n = 4096, per round, each way."""
    from bench import hf_model
    from longformer_ops import hf

    models = {}
    for model_dtype in ("float32", dtype):
        models[model_dtype], inputs = hf_model.build(4096, 6, model_dtype, "led")
        hf.patch(models[model_dtype])
    ways = {
        "float32": ("float32", contextlib.nullcontext),
        f"{dtype}, few-row kernels": (dtype, contextlib.nullcontext),
        f"{dtype}, float32 path": (dtype, _without_kernels),
    }
    seconds = {name: [] for name in ways}
    for round_index in range(rounds + 1):
        for name in list(ways) if round_index % 2 else list(reversed(ways)):
            model_dtype, context = ways[name]
            run = hf_model.runner(models[model_dtype], inputs, "generation")
            with context():
                started = time.perf_counter()
                run()
            if round_index:
                seconds[name].append(time.perf_counter() - started)
            print(f"round {round_index}: {name} {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.few_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--led-rounds", type=int, default=0, help="rounds of LED generation (0: none)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not dense.computes_in_float32(dtype, "cpu"):
        print(
            f"note: torch has a {args.dtype} GEMM on this CPU; the few-row kernels serve only where it has none",
            file=sys.stderr,
        )
    print(
        f"One step's attention products, {args.layers} layers, 1 query row x {args.keys} keys, {HEADS} heads x "
        f"{HEAD_DIM}, {args.dtype} caches, {torch.get_num_threads()} threads (median of {args.rounds} rounds):\n"
    )
    print("| way | ms per step |\n|---|---:|")
    for name, ms in products(dtype, args.keys, args.layers, args.rounds).items():
        print(f"| {name} | {ms:.2f} |")
    if args.led_rounds:
        print("\nLED (base shape, n = 4096, patched) generating 64 tokens, seconds per round:\n")
        print("| way | " + " | ".join(f"round {i + 1}" for i in range(args.led_rounds)) + " |")
        print("|---|" + "---:|" * args.led_rounds)
        for name, values in led_generation(args.dtype, args.led_rounds).items():
            print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
