"""What the custom-op layer costs per call: ``python -m bench.overhead [--device cuda] [--compare-with REV]``.

In one process, interleaved rounds (medians), for Q.K^T, probs.V and local attention (forward,
and forward+backward for the public function) at a tiny size (fixed costs dominate), at n = 512
(12 heads of 64, w = 256, float32: the smallest ``make bench`` length) and at n = 4096:

- ``kernel``: the kernel alone, called as the op's implementation calls it (no dispatcher);
- ``custom op``: ``torch.ops.longformer_ops.*`` (dispatcher, autograd and fake registrations);
- ``public``: the public function (argument checks, autocast, then the op);
- ``compiled``: the public function under ``torch.compile(fullgraph=True)``.

``--compare-with REV`` also times the public functions of another commit (a temporary git
worktree), alternating processes of the two trees, to show the change against it.
``--device cuda``: the same on the GPU, where the tiny size's kernels take microseconds, so each
figure is the host's time per call (calls issued back to back, one synchronisation per batch):
the per-call floor that a single call timed with a synchronisation (``python -m bench``) adds.
Writes ``bench/results/<machine kind>/<cpu or gpu>-overhead.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SIZES = {"tiny": (1, 16, 2, 32, 4), "n=512": (1, 512, 12, 64, 256), "n=4096": (1, 4096, 12, 64, 256)}  # (b, n, h, f, w)


def _inputs(size, device="cpu"):
    b, n, h, f, w = SIZES[size]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, f, generator=g).to(device) for _ in range(3))
    band = torch.randn(b, n, h, 2 * w + 1, generator=g).softmax(-1).to(device)
    return q, k, v, band, w, [1] * h


def public_runners(size, device="cpu"):
    """The public functions only: these exist, with these signatures, in every version compared."""
    from longformer_ops import diagonaled_mm, sliding_window_attention

    q, k, v, band, w, d = _inputs(size, device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def forward_backward():
        sliding_window_attention(qg, kg, vg, w, d).sum().backward()
        qg.grad = kg.grad = vg.grad = None

    return {
        ("qk", "public"): lambda: diagonaled_mm(q, k, w, d, False, float("-inf")),
        ("pv", "public"): lambda: diagonaled_mm(band, v, w, d, True),
        ("attention", "public"): lambda: sliding_window_attention(q, k, v, w, d),
        ("attention fwd+bwd", "public"): forward_backward,
    }


def all_runners(size, device="cpu"):
    from longformer_ops import diagonaled_mm, sliding_window_attention
    from longformer_ops.runtime import kernels
    from longformer_ops.runtime.output_cache import new_output

    ops = torch.ops.longformer_ops
    q, k, v, band, w, d = _inputs(size, device)
    c = band.shape[-1]
    seed = torch.zeros((), dtype=torch.int64)
    dt = kernels.dilation_argument(tuple(d))  # (the ops and their kernels take the dilations as a tensor)
    runners = public_runners(size, device)
    runners.update(
        {
            ("qk", "kernel"): lambda: kernels._band_kernel(
                "qk", q, k, w, dt, False, float("-inf"), new_output(k, (*k.shape[:3], c))
            ),
            ("qk", "custom op"): lambda: ops.band_qk(q, k, w, dt, False, float("-inf")),
            ("pv", "kernel"): lambda: kernels._band_kernel("pv", band, v, w, dt, False, 0.0, new_output(v, v.shape)),
            ("pv", "custom op"): lambda: ops.band_pv(band, v, w, dt, False),
            ("attention", "kernel"): lambda: kernels._attention_kernel(
                q, k, v, None, seed, w, dt, False, 0.125, 0.0, new_output(q, q.shape)
            ),
            ("attention", "custom op"): lambda: ops.attention(q, k, v, None, seed, w, dt, False, 0.125, 0.0),
        }
    )
    compiled_qk = torch.compile(lambda: diagonaled_mm(q, k, w, d, False, float("-inf")), fullgraph=True)
    compiled_pv = torch.compile(lambda: diagonaled_mm(band, v, w, d, True), fullgraph=True)
    compiled_attention = torch.compile(lambda: sliding_window_attention(q, k, v, w, d), fullgraph=True)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    compiled_fb_fn = torch.compile(lambda a, b_, c_: sliding_window_attention(a, b_, c_, w, d).sum(), fullgraph=True)

    def compiled_fb():
        compiled_fb_fn(qg, kg, vg).backward()
        qg.grad = kg.grad = vg.grad = None

    runners.update(
        {
            ("qk", "compiled"): compiled_qk,
            ("pv", "compiled"): compiled_pv,
            ("attention", "compiled"): compiled_attention,
            ("attention fwd+bwd", "compiled"): compiled_fb,
        }
    )
    return runners


def time_interleaved(runners, rounds: int, seconds_per_call: float = 0.05, device: str = "cpu") -> dict:
    """Median seconds per call of each runner, over ``rounds`` rounds in a shuffled order; each
    round times a batch of calls long enough to read the clock (``seconds_per_call`` at least),
    on a GPU with one synchronisation after the batch."""
    from bench.measure import synchronize

    def sync():
        synchronize(device)

    for run in runners.values():  # warm-up: library loads, compilation, output cache
        for _ in range(3):
            run()
    sync()
    calls = {}
    for key, run in runners.items():
        start = time.perf_counter()
        run()
        sync()
        calls[key] = max(1, int(seconds_per_call / max(time.perf_counter() - start, 1e-7)))
    samples = {key: [] for key in runners}
    keys = list(runners)
    for _ in range(rounds):
        random.shuffle(keys)
        for key in keys:
            start = time.perf_counter()
            for _ in range(calls[key]):
                runners[key]()
            sync()
            samples[key].append((time.perf_counter() - start) / calls[key])
    return {key: statistics.median(values) for key, values in samples.items()}


def _public_child(size: str, rounds: int) -> None:
    """In a subprocess of one tree: print the public functions' medians as JSON."""
    import longformer_ops

    medians = time_interleaved(public_runners(size), rounds)
    print(json.dumps({"file": longformer_ops.__file__, "medians": {op: t for (op, _), t in medians.items()}}))


def compare_with(rev: str, size: str, alternations: int, rounds: int) -> dict:
    """Public functions of this tree and of ``rev``, in alternating fresh processes; medians of the runs."""
    results = {"this tree": [], rev: []}
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(other), rev], check=True, capture_output=True
        )
        try:
            for i in range(alternations):
                for label, root in (
                    (("this tree", REPO), (rev, other)) if i % 2 == 0 else ((rev, other), ("this tree", REPO))
                ):
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    # This file runs in both trees (the other may not have it); longformer_ops comes from `root`.
                    code = (
                        f"import sys, importlib.util as u; sys.path.insert(0, {str(root)!r}); "
                        f"s = u.spec_from_file_location('overhead', {__file__!r}); m = u.module_from_spec(s); "
                        f"s.loader.exec_module(m); m._public_child({size!r}, {rounds})"
                    )
                    done = subprocess.run(
                        [sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, text=True
                    )
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    assert result["file"].startswith(str(root)), (result["file"], root)  # that tree's package ran
                    results[label].append(result["medians"])
                    print(f"  {label}: {result['medians']}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=False)
    return {
        label: {op: statistics.median(run[op] for run in runs) for op in runs[0]} for label, runs in results.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--compare-with", metavar="REV", help="also time the public functions of this git revision")
    parser.add_argument("--alternations", type=int, default=6, help="processes per tree for --compare-with")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from bench.machine import cpu_results_name, device_name, results_dir, source_commit

    if args.device.startswith("cuda") and args.compare_with:
        parser.error("--compare-with times CPU processes only")
    name = device_name(args.device) if args.device.startswith("cuda") else cpu_results_name()
    args.out = args.out or results_dir(args.device)
    commit = source_commit()
    lines = [
        f"# Per-call cost of the custom-op layer ({name}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, at {commit})",
        "",
        f"`python -m bench.overhead{' --device ' + args.device if args.device != 'cpu' else ''}"
        f"{' --compare-with ' + args.compare_with if args.compare_with else ''}`; "
        f"medians of {args.rounds} interleaved rounds, microseconds per call.",
        "",
    ]
    methods = ["kernel", "custom op", "public", "compiled"]
    for size in SIZES:
        print(f"timing {size} ...", file=sys.stderr)
        medians = time_interleaved(all_runners(size, args.device), args.rounds, device=args.device)
        b, n, h, f, w = SIZES[size]
        lines += [
            f"## {size}: batch {b}, n {n}, {h} heads of {f}, w {w}, float32",
            "",
            "| op | " + " | ".join(methods) + " | custom op - kernel | public - kernel |",
            "|---|" + "---:|" * (len(methods) + 2),
        ]
        for op in ("qk", "pv", "attention", "attention fwd+bwd"):
            cell = {m: medians.get((op, m)) for m in methods}
            fmt = lambda t: "-" if t is None else f"{t * 1e6:.1f}"  # noqa: E731
            diff = lambda a, b_: "-" if a is None or b_ is None else f"{(a - b_) * 1e6:+.1f}"  # noqa: E731
            lines.append(
                f"| {op} | "
                + " | ".join(fmt(cell[m]) for m in methods)
                + f" | {diff(cell['custom op'], cell['kernel'])} | {diff(cell['public'], cell['kernel'])} |"
            )
        lines.append("")
        if args.compare_with:
            print(f"comparing with {args.compare_with} at {size} ...", file=sys.stderr)
            both = compare_with(args.compare_with, size, args.alternations, args.rounds)
            ours, theirs = both["this tree"], both[args.compare_with]
            lines += [
                f"Public functions against `{args.compare_with}` ({args.alternations} alternating processes "
                f"per tree, median of their medians):",
                "",
                f"| op | {args.compare_with} | this tree | ratio |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| {op} | {theirs[op] * 1e6:.1f} | {ours[op] * 1e6:.1f} | {ours[op] / theirs[op]:.3f} |" for op in ours
            ]
            lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}-overhead.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
