"""The encoder's elementwise CPU kernels and the band softmax in the half types against float32, in one process:

    python -m bench.elementwise [--rows 4096] [--hidden 768] [--ffn 3072] [--globals 4] [--window 256] [--rounds 15]

Issue 22's part 2 asks that bfloat16 and float16 be never slower than float32, every op: this times
each elementwise kernel of a base layer's shapes (``rows`` tokens; the FFN's GELU at ``ffn`` wide,
the residual blocks, layer norms and the global-key merge at ``hidden``, 12 heads) and the original
API's band softmax (``band_softmax_`` in place over ``[1, rows, 12, 2 window + 1]``, and its
backward) in the three dtypes, one call of each per round in turn, and prints a markdown table of
the medians and of each half type's median per-round ratio to float32 (under 1: faster). Kernels
this machine's library lacks are left out with a note.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from longformer_ops.runtime import kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADS = 12


def _calls(dtype: torch.dtype, rows: int, hidden: int, ffn: int, globals_: int, window: int) -> dict:
    """Each kernel's call on fixed random inputs of ``dtype`` (argument-less), by name. Gradients are
    tensors of their own, as in a backward (with the forward's input passed as the gradient too,
    float32's memory-bound passes read half their memory: global_merge_backward 1.06 against 1.22 ms)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, accumulation=False):
        x = torch.randn(*shape, generator=generator)
        return x if accumulation else x.to(dtype)

    seed = torch.tensor(3)
    h, ffn_bias, grad_h = randn(rows, ffn), randn(ffn), randn(rows, ffn)
    x, bias, residual, weight = randn(rows, hidden), randn(hidden), randn(rows, hidden), randn(hidden)
    head_dim = hidden // HEADS
    context, values = randn(1, rows, HEADS, head_dim), randn(1, globals_, HEADS, head_dim)
    grad_merged = randn(1, rows, HEADS, head_dim)
    a = torch.rand(1, rows, HEADS, generator=generator)
    omega = torch.rand(1, rows, HEADS, globals_, generator=generator)
    # The softmax runs in place on the same band every round: from the second call on, a softmax of
    # probabilities, the same work.
    band, grad_band = randn(1, rows, HEADS, 2 * window + 1), randn(1, rows, HEADS, 2 * window + 1)
    grad_lse, dilation = torch.randn(1, rows, HEADS, generator=generator), kernels.dilation_argument((1,) * HEADS)
    device = torch.device("cpu")
    # The layer norm's backward takes its forward's row statistics (where the library has it).
    _, mean, rstd = (
        kernels.layer_norm(x, weight, bias, 1e-5)
        if kernels.available("layer_norm", device, dtype)
        else (None, None, None)
    )
    groups = {
        "bias_gelu": {
            "bias_gelu": lambda: kernels.bias_gelu(h, ffn_bias),
            "bias_gelu_backward": lambda: kernels.bias_gelu_backward(grad_h, h, ffn_bias),
        },
        "dropout": {
            "dropout (ffn wide)": lambda: kernels.dropout(h, seed, 0.1),
            "dropout_column_sums": lambda: kernels.dropout_column_sums(x, seed, 0.1),
        },
        "bias_dropout_add": {"bias_dropout_add": lambda: kernels.bias_dropout_add(x, bias, residual, seed, 0.1)},
        "layer_norm": {
            "layer_norm": lambda: kernels.layer_norm(x, weight, bias, 1e-5),
            "layer_norm_backward": lambda: kernels.layer_norm_backward(residual, x, weight, mean, rstd),
        },
        "global_merge": {
            "global_merge": lambda: kernels.global_merge(context, a, omega, values),
            "global_merge_backward": lambda: kernels.global_merge_backward(grad_merged, context, values, a),
        },
        "band_softmax": {
            "band_softmax_": lambda: kernels.band_softmax_(band, None, window, dilation, False),
            "band_softmax_backward": lambda: kernels.band_softmax_backward(
                band, grad_band, grad_lse, window, dilation, False
            ),
        },
    }
    return {
        name: call
        for family, calls in groups.items()
        if kernels.available(family, device, dtype)
        for name, call in calls.items()
    }


def measure(rows: int, hidden: int, ffn: int, globals_: int, window: int, rounds: int) -> dict[str, dict]:
    """Per kernel: each dtype's median seconds and the half types' median per-round ratios to float32."""
    calls = {dtype: _calls(dtype, rows, hidden, ffn, globals_, window) for dtype in DTYPES}
    names = [name for name in calls[torch.float32] if all(name in calls[dtype] for dtype in DTYPES)]
    missing = sorted(set().union(*calls.values()) - set(names))
    if missing:
        print(f"note: not in every dtype's library here, left out: {', '.join(missing)}", file=sys.stderr)
    times = {(name, dtype): [] for name in names for dtype in DTYPES}
    for dtype in DTYPES:  # first calls (recycled memory mapped, pages touched) out of the timing
        for name in names:
            calls[dtype][name]()
    for _ in range(rounds):
        for name in names:
            for dtype in DTYPES:
                start = time.perf_counter()
                calls[dtype][name]()
                times[(name, dtype)].append(time.perf_counter() - start)
    results = {}
    for name in names:
        base = times[(name, torch.float32)]
        results[name] = {
            dtype: (
                statistics.median(times[(name, dtype)]),
                statistics.median(t / b for t, b in zip(times[(name, dtype)], base)),
            )
            for dtype in DTYPES
        }
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elementwise", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="tokens (batch 1)")
    parser.add_argument("--hidden", type=int, default=768, help=f"hidden size ({HEADS} heads)")
    parser.add_argument("--ffn", type=int, default=3072, help="the FFN's width")
    parser.add_argument("--globals", type=int, default=4, dest="globals_", help="global tokens of the merge")
    parser.add_argument("--window", type=int, default=256, help="the band softmax's w (rows of 2w + 1)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if args.hidden % HEADS:
        parser.error(f"--hidden must be a multiple of {HEADS} heads, got {args.hidden}")
    if args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    results = measure(args.rows, args.hidden, args.ffn, args.globals_, args.window, args.rounds)
    print(
        f"Elementwise kernels, {args.rows} rows, hidden {args.hidden}, FFN {args.ffn}, {args.globals_} global "
        f"tokens, band softmax w = {args.window}, {torch.get_num_threads()} threads (medians of {args.rounds} "
        f"rounds; in brackets the median per-round ratio to float32):\n"
    )
    print("| kernel | float32 ms | bfloat16 ms | float16 ms |\n|---|---:|---:|---:|")
    for name, by_dtype in results.items():
        cells = [f"{by_dtype[torch.float32][0] * 1e3:.2f}"]
        cells += [f"{by_dtype[dtype][0] * 1e3:.2f} ({by_dtype[dtype][1]:.2f})" for dtype in DTYPES[1:]]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
