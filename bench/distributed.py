"""``python -m bench.distributed``: sequence parallelism on this machine, one process against two ranks.

A training step (forward and backward, dropout on) at base size (hidden 768, 12 heads x 64, w = 256,
float32, one global token: the first), run two ways on the same cores: one process with every core's
thread on the whole sequence, and two ranks (gloo over loopback, half the threads each) on half the
sequence each, through ``longformer_ops.distributed.sequence_parallel``. Two workloads: ``layer``
(one encoder layer on given hidden states) and ``model`` (``LongformerModel``, 12 layers; its
position table grows with the sequence and every rank holds all of it).

For each workload the length doubles from ``--start`` until a rank's peak memory passes the budget
(``--memory-budget-gib``, per rank: a rank stands for a machine of its own), or is predicted to from
the previous length. Each point runs in fresh processes: a warm-up step at 2048 tokens, then
``--steps`` timed steps; the median time, the largest rank's peak RSS growth (the step's own:
parameters and inputs are made before), and the bytes each rank sent per layer
(``longformer_ops.distributed.traffic``). Then gloo's loopback latency and bandwidth (a 2-rank ping-pong)
for the scaling model in ``bench/README.md``.

Writes ``<out>/<cpu>-distributed.csv``, ``.md`` and ``.png`` (``<out>``: ``bench/results/<machine kind>/``
unless ``--out`` names another).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

HIDDEN, HEADS, W, LAYERS = 768, 12, 256, 12
WARM_UP_TOKENS = 2048
WORKLOADS = ("layer", "model")
COLUMNS = [
    "workload",
    "ranks",
    "threads_per_rank",
    "seq_len",
    "time_s",
    "us_per_token",
    "peak_mib",
    "halo_kib_per_layer",
    "other_kib_per_layer",
    "communication_share",
    "status",
    "reason",
]
GLOO_TIMEOUT_S = 300


def _rss_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _model(workload: str, seq_len: int):
    import longformer_ops

    # The layer workload never reads the position table: the default size. The model's covers the sequence.
    positions = seq_len + 2 if workload == "model" else 4098
    config = longformer_ops.LongformerConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        attention_window=W,
        num_hidden_layers=1 if workload == "layer" else LAYERS,
        max_position_embeddings=positions,
    )
    return longformer_ops.LongformerModel(config, add_pooling_layer=False).train()


def _step(model, workload: str, seq_len: int, rank: int, ranks: int):
    """A no-argument training step of this rank's slice of ``seq_len`` tokens (inputs made here)."""
    start, stop = seq_len * rank // ranks, seq_len * (rank + 1) // ranks
    is_global = torch.zeros(1, stop - start, dtype=torch.long)
    if rank == 0:
        is_global[0, 0] = 1
    generator = torch.Generator().manual_seed(rank)
    if workload == "layer":
        layer = model.encoder.layer[0]
        x = torch.randn(1, stop - start, HIDDEN, generator=generator, requires_grad=True)

        def step():
            out = layer(x, is_global)[0]
            out.square().sum().div(seq_len).backward()
    else:
        ids = torch.randint(3, model.config.vocab_size, (1, stop - start), generator=generator)

        def step():
            out = model(ids, global_attention_mask=is_global).last_hidden_state
            out.square().sum().div(seq_len).backward()

    def zeroed_step():
        model.zero_grad(set_to_none=True)
        step()

    return zeroed_step


def _rank(rank: int, ranks: int, init_file: str, point: dict, out_dir: str) -> None:
    """One rank of a point (or the one process): its timings, peak and traffic into ``out_dir``."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if ranks > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=ranks,
            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
        )
    import longformer_ops
    from longformer_ops import distributed

    workload, seq_len = point["workload"], point["seq_len"]
    model = _model(workload, seq_len)
    if ranks > 1:
        distributed.sequence_parallel(model)
    _step(model, workload, min(seq_len, WARM_UP_TOKENS), rank, ranks)()
    model.zero_grad(set_to_none=True)
    longformer_ops.empty_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    step = _step(model, workload, seq_len, rank, ranks)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = _rss_bytes("VmRSS")
    distributed.traffic.clear()
    distributed.waited.clear()
    times = []
    for _ in range(point["steps"]):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    layers = len(model.encoder.layer)
    per_layer = {kind: sent / point["steps"] / layers for kind, sent in distributed.traffic.items()}
    result = {
        "time_s": statistics.median(times),
        "peak_mib": (_rss_bytes("VmHWM") - before) / 2**20,
        "traffic": per_layer,
        "communication_share": sum(distributed.waited.values()) / sum(times),
        "waited_ms_per_layer": {
            kind: 1e3 * spent / point["steps"] / layers for kind, spent in distributed.waited.items()
        },
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if ranks > 1:
        dist.destroy_process_group()
    # gloo's threads may release a finished collective's tensors while the interpreter shuts down,
    # which aborts the process (pytorch/pytorch#190489): the result is written, so skip the shutdown.
    os._exit(0)


def _spawn(target, ranks: int, args: tuple, timeout_s: float) -> str:
    """Run ``target(rank, ranks, init_file, *args)`` on ``ranks`` fresh processes; "" when all
    finished, else why not (a rank killed, e.g. out of memory, or over ``timeout_s``)."""
    with tempfile.TemporaryDirectory() as rendezvous:
        context = mp.spawn(target, args=(ranks, os.path.join(rendezvous, "init"), *args), nprocs=ranks, join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    return f"over {timeout_s:.0f} s"
        except mp.ProcessExitedException as error:
            return "a rank was killed (out of memory)" if "SIGKILL" in str(error) else str(error).splitlines()[0]
        except mp.ProcessRaisedException as error:
            return str(error).strip().splitlines()[-1]
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
    return ""


def measure(workload: str, ranks: int, seq_len: int, steps: int, timeout_s: float) -> dict:
    point = {"workload": workload, "seq_len": seq_len, "steps": steps}
    row = {
        "workload": workload,
        "ranks": ranks,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // ranks),
        "seq_len": seq_len,
        "status": "ok",
        "reason": "",
    }
    with tempfile.TemporaryDirectory() as out:
        failure = _spawn(_rank, ranks, (point, out), timeout_s)
        if failure:
            return {**row, "status": "failed", "reason": failure}
        found = [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    time_s = max(entry["time_s"] for entry in found)
    traffic = max(found, key=lambda entry: sum(entry["traffic"].values()))["traffic"]
    halo = sum(sent for kind, sent in traffic.items() if kind.startswith("halo"))
    return {
        **row,
        "time_s": time_s,
        "us_per_token": time_s / seq_len * 1e6,
        "peak_mib": max(entry["peak_mib"] for entry in found),
        "halo_kib_per_layer": halo / 1024,
        "other_kib_per_layer": (sum(traffic.values()) - halo) / 1024,
        "communication_share": max(entry["communication_share"] for entry in found),
        "waited_ms_per_layer": [entry["waited_ms_per_layer"] for entry in found],
    }


def _ping_pong(rank: int, ranks: int, init_file: str, out_dir: str) -> None:
    """Round trips of an 8-byte and a 16 MiB message between two ranks: one-way latency and bandwidth."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks, timeout=datetime.timedelta(seconds=60)
    )
    found = {}
    for size, repeats in ((8, 200), (16 * 2**20, 10)):
        message = torch.zeros(size // 4)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            if rank == 0:
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                dist.send(message, 0)
            times.append((time.perf_counter() - started) / 2)
        found[size] = statistics.median(times[1:])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
    os._exit(0)


def ping_pong() -> dict:
    with tempfile.TemporaryDirectory() as out:
        failure = _spawn(_ping_pong, 2, (out,), 120)
        if failure:
            raise RuntimeError(f"the ping-pong failed: {failure}")
        found = json.loads((Path(out) / "rank0.json").read_text())
    latency = found["8"]
    return {"latency_us": latency * 1e6, "bandwidth_gb_s": 16 * 2**20 / (found[str(16 * 2**20)] - latency) / 1e9}


def summary(rows: list[dict], budget_gib: float) -> list[str]:
    """Per workload: the longest length each rank count fits, its time per token, and the goal's ratio."""
    lines = []
    for workload in WORKLOADS:
        fitted = {}
        for ranks in sorted({row["ranks"] for row in rows}):
            ok = [
                row
                for row in rows
                if row["workload"] == workload
                and row["ranks"] == ranks
                and row["status"] == "ok"
                and row["peak_mib"] <= budget_gib * 1024
            ]
            if ok:
                fitted[ranks] = max(ok, key=lambda row: row["seq_len"])
        if 1 in fitted and 2 in fitted:
            one, two = fitted[1], fitted[2]
            lines.append(
                f"- **{workload}**: one process fits {one['seq_len']} tokens ({one['us_per_token']:.1f} us "
                f"per token), two ranks {two['seq_len']} ({two['seq_len'] / one['seq_len']:.0f}x, "
                f"{two['us_per_token']:.1f} us per token: **{two['us_per_token'] / one['us_per_token']:.2f}x** "
                f"the one process's time per token)"
            )
    return lines


def write(
    rows: list[dict], network: dict | None, out: Path, name: str, command: str, provenance: str, budget_gib: float
) -> None:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Sequence parallelism: one process against two ranks ({name})",
        "",
        f"`{command}` ({provenance}). See `bench/distributed.py` for what is measured; the scaling model "
        f"built on these figures is in `bench/README.md`.",
        "",
        f"Budget: {budget_gib:g} GiB of peak memory per rank (a rank stands for a machine).",
        "",
        *summary(rows, budget_gib),
        "",
        "| workload | ranks | threads per rank | seq_len | time per step (s) | us per token | peak per rank "
        "(MiB) | halo KiB per layer and rank | other KiB per layer and rank | in communication |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(
                f"| {row['workload']} | {row['ranks']} | {row['threads_per_rank']} | {row['seq_len']} | "
                f"{row['status']}: {row['reason']} | | | | | |"
            )
            continue
        over = " (over the budget)" if row["peak_mib"] > budget_gib * 1024 else ""
        lines.append(
            f"| {row['workload']} | {row['ranks']} | {row['threads_per_rank']} | {row['seq_len']} | "
            f"{row['time_s']:.2f} | {row['us_per_token']:.1f} | {row['peak_mib']:.0f}{over} | "
            f"{row['halo_kib_per_layer']:.0f} | {row['other_kib_per_layer']:.1f} | "
            f"{row['communication_share']:.1%} |"
        )
    if network:
        lines += [
            "",
            f"gloo over loopback (2 ranks, ping-pong): {network['latency_us']:.0f} us one way for 8 bytes, "
            f"{network['bandwidth_gb_s']:.2f} GB/s for 16 MiB.",
        ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / f"{name}.png", name)


def _plot(rows: list[dict], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import log_log_axis

    figure, (timing, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for workload, marker in zip(WORKLOADS, "os", strict=True):
        for ranks, style in ((1, "-"), (2, "--")):
            ok = [
                row for row in rows if row["workload"] == workload and row["ranks"] == ranks and row["status"] == "ok"
            ]
            if not ok:
                continue
            label = f"{workload}, {'one process' if ranks == 1 else f'{ranks} ranks'}"
            timing.plot([r["seq_len"] for r in ok], [r["us_per_token"] for r in ok], style, marker=marker, label=label)
            memory.plot([r["seq_len"] for r in ok], [r["peak_mib"] for r in ok], style, marker=marker, label=label)
    log_log_axis(timing, "tokens in the sequence", "us per token (training step)")
    log_log_axis(memory, "tokens in the sequence", "peak memory per rank (MiB)")
    timing.legend(fontsize=8)
    figure.suptitle(f"Sequence parallelism, {name}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    parser.add_argument("--name", default=None, help="results' file name (default: <cpu>-distributed)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    parser.add_argument("--start", default="layer:8192,model:2048", help="each workload's first length")
    parser.add_argument("--memory-budget-gib", type=float, default=4.0, help="peak memory per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point (the median is kept)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per point")
    parser.add_argument("--quick", action="store_true", help="two short lengths per workload (a smoke test)")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {','.join(WORKLOADS)}, got {args.workloads!r}")
    starts = dict((key, int(value)) for key, value in (item.split(":") for item in args.start.split(",")))
    from bench.machine import cpu_results_name, default_cpu_memory_budget_bytes, results_dir, source_commit

    args.out = args.out or results_dir()
    name = args.name or f"{cpu_results_name()}-distributed"
    command = "python -m bench.distributed " + shlex.join(sys.argv[1:] if argv is None else argv)
    provenance = f"commit {source_commit()}, {datetime.date.today()}, torch {torch.__version__}, {cpu_results_name()}"
    budget = args.memory_budget_gib * 2**30
    safe = default_cpu_memory_budget_bytes()  # what this machine's ranks may use together
    rows: list[dict] = []
    progress = tqdm(desc="distributed points", unit="point")
    for workload in workloads:
        seq_len, open_ranks, last = starts.get(workload, 4096), [1, 2], {}
        for _ in range(2 if args.quick else 12):
            for ranks in list(open_ranks):
                # Each rank count runs up to its first length over the budget: measured, not predicted,
                # unless twice the last peak (memory grows about linearly in n) would not fit the machine.
                if ranks in last and last[ranks]["peak_mib"] * 2**20 * 2 * ranks > safe:
                    rows.append(
                        {
                            "workload": workload,
                            "ranks": ranks,
                            "threads_per_rank": "",
                            "seq_len": seq_len,
                            "status": "skipped",
                            "reason": "predicted past this machine's memory",
                        }
                    )
                    open_ranks.remove(ranks)
                    continue
                row = measure(workload, ranks, seq_len, args.steps, args.timeout)
                progress.update()
                tqdm.write(str(row))
                rows.append(row)
                if row["status"] != "ok" or row["peak_mib"] * 2**20 > budget:
                    open_ranks.remove(ranks)
                else:
                    last[ranks] = row
                write(rows, None, args.out, name, command, provenance, args.memory_budget_gib)
            if not open_ranks:
                break
            seq_len *= 2
    progress.close()
    network = ping_pong()
    write(rows, network, args.out, name, command, provenance, args.memory_budget_gib)
    print(f"wrote {args.out / name}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
