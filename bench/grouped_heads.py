"""A sliding layer with grouped key/value heads on "longformer_ops", against the same layer given
its keys and values already repeated per query head: ``python -m bench.grouped_heads [--seq-lens
4096,16384] [--heads 4] [--kv-heads 1] [--head-dim 256] [--window 512] [--dtype float32] [--rounds 5]``.

One causal sliding layer's attention function (:func:`longformer_ops.hf.attention.attention_forward`;
the defaults: Gemma 3 1B's shape) runs on the grouped keys and values as a model hands them over
(``[b, n, H_kv, d]`` in memory, viewed as ``[b, H_kv, n, d]``: the CPU's fused kernels read them in
place, each query head's task packing its group's head), and on keys and values already repeated
in the kernels' layout (``[b, n, H, d]``, read as they lie). The same result; the ratio is what
grouping costs or saves (a ``repeat_kv`` copy of K and V costs its copy, and backward the sum of
the repeated heads' gradients). Forward under ``no_grad``, and forward and backward. Medians of
per-round ratios, the two calls alternated. Prints a Markdown table; ``--out DIR`` also writes
``DIR/<cpu>-grouped-heads.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def _calls(n: int, heads: int, kv_heads: int, head_dim: int, window: int, dtype: torch.dtype, backward: bool):
    """(grouped, repeated): the attention function on grouped keys and values, and on them repeated."""
    from longformer_ops.hf.attention import attention_forward

    generator = torch.Generator().manual_seed(0)
    # As a model's projections give them: [b, n, heads, d] in memory, viewed as [b, heads, n, d].
    query = torch.randn(1, n, heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    key, value = (
        torch.randn(1, n, kv_heads, head_dim, generator=generator).to(dtype).transpose(1, 2) for _ in range(2)
    )
    repeated = [
        x.repeat_interleave(heads // kv_heads, dim=1).transpose(1, 2).contiguous().transpose(1, 2) for x in (key, value)
    ]
    module = type("Layer", (), {"is_causal": True})()

    def call(k, v):
        def run():
            inputs = [x.detach().requires_grad_(backward) for x in (query, k, v)]  # (views: the layouts kept)
            with torch.set_grad_enabled(backward):
                out, _ = attention_forward(module, *inputs, None, scaling=head_dim**-0.5, sliding_window=window)
                if backward:
                    out.float().square().mean().backward()

        return run

    return call(key, value), call(*repeated)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grouped_heads", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096,16384")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--window", type=int, default=512, help="the layer's sliding_window W")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    from bench.machine import cpu_results_name, source_commit

    lines = [
        f"# A sliding layer's attention with {args.heads} query heads on {args.kv_heads} key/value heads of "
        f"{args.head_dim}, window {args.window}, causal ({cpu_results_name()}, {args.dtype}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, at {source_commit()})",
        "",
        f"`python -m bench.grouped_heads --seq-lens {args.seq_lens} --heads {args.heads} --kv-heads {args.kv_heads} "
        f"--head-dim {args.head_dim} --window {args.window} --dtype {args.dtype} --rounds {args.rounds}`; medians of "
        f"{args.rounds} rounds, the two calls alternated.",
        "",
        "| pass | n | grouped K, V ms | repeated K, V ms | grouped / repeated |",
        "|---|---:|---:|---:|---:|",
    ]
    for backward in (False, True):
        for n in (int(x) for x in args.seq_lens.split(",")):
            calls = _calls(
                n, args.heads, args.kv_heads, args.head_dim, args.window, getattr(torch, args.dtype), backward
            )
            for call in calls:
                call()  # (libraries load, buffers warm)
            samples = [[], []]
            for round_ in range(args.rounds):
                for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                    started = time.perf_counter()
                    calls[index]()
                    samples[index].append(time.perf_counter() - started)
            ratio = statistics.median(a / b for a, b in zip(*samples))
            lines.append(
                f"| {'forward+backward' if backward else 'forward'} | {n} | "
                f"{statistics.median(samples[0]) * 1e3:.1f} | {statistics.median(samples[1]) * 1e3:.1f} | "
                f"{ratio:.3f} |"
            )
            print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{cpu_results_name()}-grouped-heads.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
