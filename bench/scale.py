"""``python -m bench.scale``: how far one CPU goes, time and peak memory per length up to 2**20 tokens.

Each point is one call in a fresh process: a warm-up call at 4096 tokens (loading the kernels),
the memory it freed returned to the system, then one timed call at the point's length, whose peak
RSS growth (VmHWM) is the point's memory (inputs made before, so not counted; outputs and
everything else the call holds are). Forward passes run under ``torch.inference_mode``.

Points (b = 1, 12 heads x 64, w = 256, undilated and per-head dilations 1..8 where given):
local attention forward 2**17 .. 2**20 (float32); forward+backward 2**17 .. 2**19 in float32 and
2**20 in bfloat16 (in float32, q, k, v, output, its gradient and three input gradients alone would
be 24 GiB); one ``LongformerSelfAttention`` with 4 global tokens, forward, float32; the base-size encoder (12 layers, hidden 768) forward at 16384 .. 65536; and
full attention (n x n scores) forward at 2048 and 4096, from which its n**2 line is drawn.

Writes ``<out>/<cpu>-scale.csv``, ``.md`` and ``.png`` (time and memory against n, log-log; ``<out>``:
``bench/results/<machine kind>/`` unless ``--out`` names another).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import datetime
import multiprocessing
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

DILATED = (1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 4, 8)
UNDILATED = (1,) * 12
HEADS, HEAD_DIM, W = 12, 64, 256
COLUMNS = ["op", "pass", "dilation", "dtype", "seq_len", "time_s", "peak_mib", "status", "reason", "commit"]
OPS = ("local_attention", "layer", "model", "full")


def points(quick: bool) -> list[dict]:
    """The runs, cheapest first within each series. ``quick``: every series at small lengths (a test)."""
    powers = [10, 11] if quick else [17, 18, 19, 20]
    chosen = []
    for dilation in (UNDILATED, DILATED):
        chosen += [
            dict(op="local_attention", backward=False, dilation=dilation, dtype="float32", n=2**p) for p in powers
        ]
        chosen += [
            dict(
                op="local_attention",
                backward=True,
                dilation=dilation,
                dtype="bfloat16" if p == 20 else "float32",
                n=2**p,
            )
            for p in powers
        ]
    chosen += [dict(op="layer", backward=False, dilation=UNDILATED, dtype="float32", n=2**p) for p in powers]
    model_lengths = [1024, 2048] if quick else [16384, 32768, 65536]
    chosen += [dict(op="model", backward=False, dilation=UNDILATED, dtype="float32", n=n) for n in model_lengths]
    chosen += [
        dict(op="full", backward=False, dilation=UNDILATED, dtype="float32", n=n)
        for n in ((512, 1024) if quick else (2048, 4096))
    ]
    return chosen


def _call(point: dict, n: int):
    """A no-argument callable running the point's op at length n (inputs made here)."""
    from bench import methods

    op = "local_attention" if point["op"] == "full" else point["op"]
    method = "full" if point["op"] == "full" else "tvm"
    dtype = getattr(torch, point["dtype"])
    inputs = methods.make_inputs(op, 1, n, HEADS, HEAD_DIM, W, dtype, "cpu", point["backward"])
    if op == "layer":
        return _layer_with_globals(inputs[0], point["dilation"], point["backward"])
    run = methods.runner(op, method, inputs, W, point["dilation"], point["backward"])
    if point["backward"]:
        return run

    def forward():
        with torch.inference_mode():
            return run()

    return forward


def _layer_with_globals(x, dilation, backward: bool, globals_: int = 4):
    """The bench's ``layer`` module (:func:`bench.methods._layer_module`, ``tvm`` mode) with ``globals_``
    global tokens spread over the sequence."""
    from bench import methods

    layer = methods._layer_module("tvm", HEADS, HEAD_DIM, W, tuple(dilation), x.dtype, x.device.type, backward)
    mask = torch.zeros(x.shape[:2])
    mask[:, torch.linspace(0, x.shape[1] - 1, globals_).long()] = 1

    def run():
        with torch.inference_mode(not backward):
            return layer(x, mask)[0]

    return run


def _rss_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(point: dict) -> dict:
    """In a fresh process: warm up at 4096 (or the point's length if smaller), then time and memory of one call."""
    import longformer_ops

    _call(point, min(point["n"], 4096))()
    longformer_ops.empty_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    run = _call(point, point["n"])
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = _rss_bytes("VmRSS")
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    return {"time_s": elapsed, "peak_mib": (_rss_bytes("VmHWM") - before) / 2**20, "status": "ok", "reason": ""}


def _run_fresh(point: dict, timeout_s: float) -> dict:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        future = pool.submit(measure, point)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.process.BrokenProcessPool:
            return {"status": "skipped", "reason": "the process died (out of memory)"}
        except concurrent.futures.TimeoutError:
            for process in pool._processes.values():  # no public way to stop a running task
                process.kill()
            return {"status": "skipped", "reason": f"over {timeout_s:.0f} s"}


def _row(point: dict, result: dict, commit: str = "") -> dict:
    return {
        "op": point["op"],
        "pass": "forward+backward" if point["backward"] else "forward",
        "dilation": "1" if set(point["dilation"]) == {1} else "1..8",
        "dtype": point["dtype"],
        "seq_len": point["n"],
        "time_s": result.get("time_s", ""),
        "peak_mib": result.get("peak_mib", ""),
        "status": result["status"],
        "reason": result["reason"],
        "commit": commit,
    }


def read(path: Path) -> list[dict]:
    """Rows of an earlier results CSV, numbers as numbers."""
    import csv

    rows = list(csv.DictReader(open(path)))
    for row in rows:
        row["seq_len"] = int(row["seq_len"])
        for key in ("time_s", "peak_mib"):
            row[key] = float(row[key]) if row[key] else ""
        row.setdefault("commit", "")
    return rows


def write(rows: list[dict], out: Path, name: str, command: str, provenance: str) -> None:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Scale: time and peak memory per length ({name})",
        "",
        f"Last run: `{command}` ({provenance}); the full run is `python -m bench.scale`.",
        "",
        "One call per point in a fresh process; memory is the peak RSS growth of that call (outputs "
        "included, inputs not). b = 1, 12 heads x 64, w = 256. Rows re-run later with `--ops` name "
        "their own commit.",
        "",
        "| op | pass | dilation | dtype | seq_len | time (s) | peak (MiB) | commit |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        time_cell = f"{r['time_s']:.2f}" if r["status"] == "ok" else f"skipped: {r['reason']}"
        peak_cell = f"{r['peak_mib']:.0f}" if r["status"] == "ok" else ""
        lines.append(
            f"| {r['op']} | {r['pass']} | {r['dilation']} | {r['dtype']} | {r['seq_len']} | {time_cell} | "
            f"{peak_cell} | {r.get('commit', '')} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / f"{name}.png", name)


def _plot(rows: list[dict], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            series.setdefault((r["op"], r["pass"], r["dilation"]), []).append(r)
    for (op, pass_name, dilation), members in series.items():
        members.sort(key=lambda r: r["seq_len"])
        n = [r["seq_len"] for r in members]
        dtypes = "/".join(dict.fromkeys(r["dtype"] for r in members))
        style = dict(marker="o", linestyle="--" if op == "full" else "-")
        label = "full attention (measured)" if op == "full" else f"{op} {pass_name}, dilation {dilation} ({dtypes})"
        axes[0].plot(n, [r["time_s"] for r in members], label=label, **style)
        axes[1].plot(n, [r["peak_mib"] for r in members], label=label, **style)
        if op == "full":  # its n^2 line, predicted from its largest measured point out to 2^20
            last = members[-1]
            reach = [last["seq_len"] * 2**k for k in range(0, 20) if last["seq_len"] * 2**k <= 2**20]
            for axis, key in ((axes[0], "time_s"), (axes[1], "peak_mib")):
                axis.plot(
                    reach,
                    [last[key] * (m / last["seq_len"]) ** 2 for m in reach],
                    color="grey",
                    linestyle=":",
                    label="full attention, predicted n^2" if key == "time_s" else None,
                )
    for axis, ylabel in ((axes[0], "time of one call (s)"), (axes[1], "peak memory of one call (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length n")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(f"Longformer on one CPU, to 2^20 tokens ({name})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    parser.add_argument("--name", default=None, help="results' file name (default: <cpu>-scale)")
    parser.add_argument("--quick", action="store_true", help="small lengths only (a smoke test)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per point")
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"series to run (of {','.join(OPS)}); the other series' rows already in the "
        f"results file are kept, so one series can be re-run",
    )
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    if not ops or set(ops) - set(OPS):
        parser.error(f"--ops: choose from {','.join(OPS)}, got {args.ops!r}")
    from bench.machine import cpu_results_name, results_dir, source_commit

    args.out = args.out or results_dir()
    name = args.name or f"{cpu_results_name()}-scale"
    command = "python -m bench.scale " + shlex.join(sys.argv[1:] if argv is None else argv)
    commit = source_commit()  # once, before this run's own results make the checkout look modified
    provenance = (
        f"commit {commit}, {datetime.date.today()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {cpu_results_name()}"
    )
    earlier = args.out / f"{name}.csv"
    kept = [r for r in read(earlier) if r["op"] not in ops] if earlier.exists() and set(ops) != set(OPS) else []
    rows = []
    for point in tqdm([p for p in points(args.quick) if p["op"] in ops], desc="scale points", unit="point"):
        rows.append(_row(point, _run_fresh(point, args.timeout), commit))
        tqdm.write(f"{rows[-1]}")
        # After each point (a long run leaves what it measured), in the series' order.
        merged = sorted(kept + rows, key=lambda r: OPS.index(r["op"]))
        write(merged, args.out, name, command, provenance)
    print(f"wrote {args.out / name}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
