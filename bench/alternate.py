"""One of the encoder's kernels against the torch ops it replaced, in one process:
``python -m bench.alternate --switch ffn|global-merge|layer-norm|residual|all [--dtypes float32,bfloat16]
[--passes forward,forward+backward] [--rounds 4] [--seq-len 4096]``.

The bench's base encoder (``--ops model``: 12 layers, hidden 768, n = 4096, token 0 global) runs
each pass alternately as shipped and with one part on torch's ops, the order flipped every round.
Processes on these machines differ by up to 15% in speed, rounds within one process far less, so
the figure is the median of the per-round ratios. The switches:

- ``ffn``: ``LongformerIntermediate`` as shipped (``linear_gelu``: a bias-free GEMM, then the bias
  and GELU in one kernel pass) or as torch runs it (``addmm`` with the bias, then GELU; without
  autograd into recycled memory and in place, as the encoder ran it before);
- ``global-merge``: the layer's global-key merge on its kernels or on torch's ops (the layer's own
  fallback where no library has them);
- ``layer-norm``: the layer norms (embeddings' and each block's two) on our kernels or on torch's
  ``layer_norm``;
- ``residual``: each block's ``LayerNorm(x + dropout(dense(h)))`` with the bias, the dropout and
  the residual in one kernel pass after a bias-free GEMM, or as ``addmm`` with the bias, the
  dropout kernel and torch's add;
- ``all``: every switch above at once.

Writes ``bench/results/<machine kind>/<cpu>-<switch>.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from pathlib import Path

import torch


def _torch_ffn_forward(self, x):
    """``LongformerIntermediate.forward`` on torch's ops (the encoder's before the bias-GELU kernel)."""
    from longformer_ops.models.model import _ACTIVATE_IN_PLACE
    from longformer_ops.runtime.output_cache import new_output

    if torch.is_grad_enabled():
        return self.act(self.dense(x))
    h = new_output(x, (*x.shape[:-1], self.dense.out_features))
    torch.addmm(self.dense.bias, x.reshape(-1, x.shape[-1]), self.dense.weight.t(), out=h.view(-1, h.shape[-1]))
    return _ACTIVATE_IN_PLACE[type(self.act)](self.act, h)


@contextlib.contextmanager
def _torch_ffn():
    from longformer_ops.models.model import LongformerIntermediate

    shipped = LongformerIntermediate.forward
    LongformerIntermediate.forward = _torch_ffn_forward
    try:
        yield
    finally:
        LongformerIntermediate.forward = shipped


def _torch_residual_forward(self, h, x):
    """``_DenseResidualNorm.forward`` on torch's ops (the encoder's before the bias-dropout-residual
    kernel): ``addmm`` with the bias, the dropout kernel, the residual's add (in place without autograd)."""
    y = self.dropout(self.dense(h))
    return self.LayerNorm(y.add_(x) if not torch.is_grad_enabled() else x + y)


@contextlib.contextmanager
def _torch_residual():
    from longformer_ops.models.model import _DenseResidualNorm

    shipped = _DenseResidualNorm.forward
    _DenseResidualNorm.forward = _torch_residual_forward
    try:
        yield
    finally:
        _DenseResidualNorm.forward = shipped


@contextlib.contextmanager
def _without_kernel(family: str):
    """The encoder with ``kernels.available`` answering False for kernel ``family``: the callers' own
    fallback to torch's ops."""
    from longformer_ops.runtime import kernels

    shipped = kernels.available
    kernels.available = lambda name, device, dtype: name != family and shipped(name, device, dtype)
    try:
        yield
    finally:
        kernels.available = shipped


# switch -> (what it compares, a context manager putting torch's ops in its place)
SWITCHES = {
    "ffn": ("The encoder's FFN: bias-GELU kernel against torch's addmm + GELU", _torch_ffn),
    "global-merge": (
        "The layer's global-key merge: its kernels against torch's ops",
        functools.partial(_without_kernel, "global_merge"),
    ),
    "layer-norm": (
        "The layer norms: our kernels against torch's layer_norm",
        functools.partial(_without_kernel, "layer_norm"),
    ),
    "residual": (
        "The blocks' way back into the residual stream: the bias-dropout-residual kernel against "
        "torch's addmm, dropout and add",
        _torch_residual,
    ),
}


@contextlib.contextmanager
def _torch_everywhere():
    with contextlib.ExitStack() as stack:
        for name, (_, switch) in SWITCHES.items():
            if name != "all":
                stack.enter_context(switch())
        yield


SWITCHES["all"] = ("Every switch above at once: our kernels against torch's ops for all of them", _torch_everywhere)


def alternate(
    switch: str, dtype: torch.dtype, backward: bool, rounds: int, seq_len: int = 4096
) -> dict[str, list[float]]:
    """Seconds per pass of the bench's encoder as shipped ("ours") and with ``switch`` on torch's
    ops ("torch"), ``rounds`` rounds after a warm-up."""
    from bench import methods

    (x,) = methods.make_inputs("model", 1, seq_len, 12, 64, 256, dtype, "cpu", backward)
    run = methods.runner("model", "tvm", (x,), 256, (1,) * 12, backward)
    times = {"ours": [], "torch": []}
    variants = [("ours", contextlib.nullcontext), ("torch", SWITCHES[switch][1])]
    for round_ in range(rounds + 1):
        for name, context in variants if round_ % 2 else variants[::-1]:
            with context():
                start = time.perf_counter()
                run()
                if round_:
                    times[name].append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.alternate", description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--passes", default="forward,forward+backward")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    args = parser.parse_args(argv)
    from bench.machine import cpu_results_name, results_dir, source_commit

    args.out = args.out or results_dir()
    lines = [
        f"# {SWITCHES[args.switch][0]} ({cpu_results_name()})",
        "",
        f"Command: `python -m bench.alternate --switch {args.switch} --dtypes {args.dtypes} --passes {args.passes} "
        f"--rounds {args.rounds} --seq-len {args.seq_len}` (commit {source_commit()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads). Base encoder, n = {args.seq_len}, batch 1, token 0 global; one "
        "process, the two alternating, seconds per pass.",
        "",
        "| dtype | pass | ours (s) | torch's (s) | median ours / torch's |",
        "|---|---|---|---|---:|",
    ]
    for dtype in args.dtypes.split(","):
        for pass_ in args.passes.split(","):
            times = alternate(
                args.switch, getattr(torch, dtype), pass_ == "forward+backward", args.rounds, args.seq_len
            )
            ratio = statistics.median(o / t for o, t in zip(times["ours"], times["torch"]))
            cells = [" ".join(f"{t:.2f}" for t in times[name]) for name in ("ours", "torch")]
            lines.append(f"| {dtype} | {pass_} | {cells[0]} | {cells[1]} | {ratio:.3f} |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{cpu_results_name()}-{args.switch}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
