"""``python -m bench``: time and memory of local attention and the band products, per method and length.

Writes ``<out>/<device-name>.csv``, ``.md`` (table) and ``.png`` (plot); ``<out>`` is
``bench/results/<machine kind>/`` (``bench.machine.machine_kind``) unless ``--out`` names
another. For each sequence length, the methods of one case, in every dtype asked for, are timed
interleaved (a warm-up round for calls under a second and for FlexAttention, which compiles per
shape; then rounds of every method and dtype and a reference GEMM, each round in a shuffled
order; medians of the times, and of the per-round shares of the GEMM and ratios to float32),
then each method's memory is probed in a fresh process (peak extra RSS, or CUDA
max_memory_allocated, of one call), which also gives its first-call latency. A method predicted
to exceed --max-call-seconds or the memory budget at a length (scaled from the previous length)
is recorded as skipped with the reason, as is one that cannot run the case at all.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bench import methods, report
from bench.machine import default_cpu_memory_budget_bytes, device_name, results_dir, source_commit
from bench.measure import (
    GEMM,
    GEMM_FLOPS,
    GEMM_SIZE,
    Case,
    gemm_key,
    paired_ratio,
    probe_in_fresh_process,
    slow_gemm_reason,
    time_interleaved,
)

DILATED = "1,1,2,2,4,4,8,8,1,2,4,8"
QUADRATIC = {"full", "sdpa"}  # time and memory grow with n^2


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = [x for x in names if x not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
        return names

    return parse


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seq-lens", type=_ints, default=_ints("512,1024,2048,4096,8192,16384,32768"))
    parser.add_argument("--window", type=int, default=256, help="one-sided window w")
    parser.add_argument(
        "--dilation",
        action="append",
        default=None,
        help=f"one int for all heads or one per head; repeat for several configurations (default: 1 and {DILATED})",
    )
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--dtype",
        type=_names(("float32", "float16", "bfloat16", "float64")),
        default=["float32"],
        help="one dtype, or several comma-separated: each its own cases, a case's dtypes timed in the same rounds",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--ops", type=_names(methods.ALL_OPS), default=list(methods.OPS))
    parser.add_argument(
        "--passes", type=_names(("forward", "forward+backward")), default=["forward", "forward+backward"]
    )
    parser.add_argument(
        "--methods",
        type=_names(methods.ALL_METHODS),
        default=None,
        help=f"default: {','.join(methods.METHODS)}; with --ops poolingformer, "
        f"{','.join(methods.POOLINGFORMER_METHODS)}",
    )
    parser.add_argument(
        "--dilated-ops",
        type=_names(methods.ALL_OPS),
        default=list(methods.OPS),
        help="ops that also run the dilated configurations (others run dilation 1 only)",
    )
    parser.add_argument(
        "--backward-ops",
        type=_names(methods.ALL_OPS),
        default=["local_attention", "layer", "poolingformer", *methods.MODEL_OPS],
        help="ops that also run forward+backward when --passes has it (others: forward only)",
    )
    parser.add_argument(
        "--dilated-passes",
        type=_names(("forward", "forward+backward")),
        default=["forward"],
        help="passes that also run the dilated configurations",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per method (medians)")
    parser.add_argument(
        "--max-call-seconds",
        type=float,
        default=5.0,
        help="skip a method at a length where one call is predicted to take longer",
    )
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="skip a method predicted to need more (default: 60%% of available memory)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory probes")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: bench/results/<machine kind>, e.g. amd-epyc-avx512, nvidia-h100)",
    )
    parser.add_argument("--name", default=None, help="results file stem (default: the device name)")
    args = parser.parse_args(argv)
    args.dilation = args.dilation or ["1", DILATED]
    args.methods = args.methods or methods.default_methods(args.ops)
    return args


def memory_budget_bytes(args) -> float:
    if args.memory_budget_gib is not None:
        return args.memory_budget_gib * 2**30
    if args.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return 0.6 * free
    return default_cpu_memory_budget_bytes()


def _dilation_tuple(spec: str, heads: int) -> tuple[int, ...]:
    values = _ints(spec)
    if len(values) == 1:
        return tuple(values) * heads
    if len(values) != heads:
        raise SystemExit(f"--dilation {spec!r}: expected 1 or {heads} values (one per head), got {len(values)}")
    return tuple(values)


def _dilation_label(dilation: tuple[int, ...]) -> str:
    return str(dilation[0]) if len(set(dilation)) == 1 else ",".join(map(str, dilation))


def _scale(method: str, seq_len: int, n0: int) -> float:
    """How time and memory grow from n0 to seq_len: n^2 for dense attention, n otherwise."""
    return (seq_len / n0) ** (2 if method in QUADRATIC else 1)


def _expected_seconds(measured, method: str, seq_len: int) -> float:
    return 0.0 if measured is None else measured[1] * _scale(method, seq_len, measured[0])


def _predicted_limit(measured, method: str, seq_len: int, budget: float, max_seconds: float) -> str | None:
    """Why ``method`` should not run at ``seq_len``, scaled from its last measurement (n or n^2), or None."""
    if measured is None:
        return None
    n0, seconds, peak = measured
    factor = _scale(method, seq_len, n0)
    if peak == math.inf:
        return f"out of memory: already at n={n0}"
    if peak is not None and peak * factor > budget:
        return (
            f"out of memory: predicted {peak * factor / 2**30:.1f} GiB (from {peak / 2**20:.0f} MiB at n={n0}) "
            f"> budget {budget / 2**30:.1f} GiB"
        )
    if seconds * factor > max_seconds:
        return (
            f"too slow: predicted {seconds * factor:.1f} s per call (from {seconds:.2f} s at n={n0}) "
            f"> --max-call-seconds {max_seconds:g}"
        )
    return None


def _gemm_range(rows: list[dict]) -> str:
    rates = [r["gemm_gflops"] for r in rows if r.get("gemm_gflops")]
    return f"{min(rates):.0f}-{max(rates):.0f} GFLOP/s across cases" if rates else "no case timed"


def _case_rows(
    case: Case,
    float32_case: Case | None,
    args,
    skipped: dict,
    samples: dict,
    failures: dict,
    flops: float,
    last: dict,
    progress,
) -> list[dict]:
    """One result row per method of ``case``: its timing from the case's rounds (``samples``, from
    :func:`time_interleaved`) and, unless --no-memory, its peak memory and first call in a fresh
    process; or why it was skipped, or why its timing failed (``failures``). Updates ``last``.

    The share of the GEMM and the ratio to float32 (``float32_case``, timed in the same rounds) are
    medians of per-round ratios: this VM changes speed for seconds at a time, and a ratio within a
    round holds through that where a ratio of two medians does not."""
    op, backward, dilation, dtype, seq_len = case.op, case.backward, case.dilation, case.dtype, case.seq_len
    rows = []
    for method in args.methods:
        row = dict(
            op=op,
            method=method,
            seq_len=seq_len,
            window=args.window,
            dilation=_dilation_label(dilation),
            heads=args.heads,
            head_dim=args.head_dim,
            batch=args.batch,
            dtype=dtype,
            device=args.device,
            **{"pass": case.pass_name},
        )
        if (case, method) in failures:  # ran out of memory while timed: so will every longer length
            last[(op, backward, dilation, dtype, method)] = (seq_len, math.inf, math.inf)
            rows.append(dict(row, status="skipped", reason=failures[(case, method)]))
            progress.write(
                f"  {op:15s} {case.pass_name:16s} d={_dilation_label(dilation):24s} n={seq_len:<6d} "
                f"{dtype:9s} {method:15s} {'out of memory':>13s}"
            )
            continue
        if (case, method) in skipped:
            reason = skipped[(case, method)]
            measured = last.get((op, backward, dilation, dtype, method))
            if (
                not args.no_memory
                and not backward
                and reason.startswith("too slow")
                and _expected_seconds(measured, method, seq_len) <= 2 * args.max_call_seconds
            ):
                # Too slow to time repeatedly, but it fits: one fresh-process call for its memory,
                # so memory comparisons rest on measurements as far as the method can go.
                probe = probe_in_fresh_process(case, method, timeout_s=120 + 40 * args.max_call_seconds)
                if "error" not in probe:
                    last[(op, backward, dilation, dtype, method)] = (
                        seq_len,
                        _expected_seconds(measured, method, seq_len),
                        probe["peak_mib"] * 2**20,
                    )
                    rows.append(
                        dict(
                            row,
                            status="memory only",
                            reason=reason + "; memory measured once",
                            peak_mib=probe["peak_mib"],
                            first_call_ms=probe["first_call_ms"],
                        )
                    )
                    progress.write(
                        f"  {op:15s} {case.pass_name:16s} d={_dilation_label(dilation):24s} "
                        f"n={seq_len:<6d} {dtype:9s} {method:15s} {'(not timed)':>13s}  "
                        f"{probe['peak_mib']:9.1f} MiB"
                    )
                    continue
            rows.append(dict(row, status="skipped", reason=reason))
            continue
        seconds = statistics.median(samples[(case, method)])

        def against(gemm: str) -> tuple[float, float]:  # a GEMM's rate, and this entry's share of it
            return (
                GEMM_FLOPS / statistics.median(samples[gemm]) / 1e9,
                flops / GEMM_FLOPS * paired_ratio(samples[gemm], samples[(case, method)]),
            )

        row.update(status="ok", reason="", time_ms=seconds * 1e3, gflops=flops / seconds / 1e9)
        row["gemm_gflops"], row["gemm_share"] = against(GEMM)
        if dtype != "float32" and gemm_key(dtype) in samples:  # the same dtype's GEMM, same rounds
            row["dtype_gemm_gflops"], row["dtype_gemm_share"] = against(gemm_key(dtype))
        if float32_case not in (None, case) and (float32_case, method) in samples:
            row["vs_float32"] = paired_ratio(samples[(case, method)], samples[(float32_case, method)])
        peak = None
        if not args.no_memory:
            probe = probe_in_fresh_process(case, method, timeout_s=120 + 20 * seconds)
            if "error" in probe:
                row.update(reason=probe["error"])
                if "OutOfMemoryError" in probe["error"]:  # timed, but not more: skip longer lengths
                    peak = math.inf
            else:
                peak = probe["peak_mib"] * 2**20
                row.update(peak_mib=probe["peak_mib"], first_call_ms=probe["first_call_ms"])
        last[(op, backward, dilation, dtype, method)] = (seq_len, seconds, peak)
        rows.append(row)
        progress.write(
            f"  {op:15s} {case.pass_name:16s} d={_dilation_label(dilation):24s} n={seq_len:<6d} "
            f"{dtype:9s} {method:15s} {seconds * 1e3:10.1f} ms  "
            + (f"{row['peak_mib']:9.1f} MiB" if "peak_mib" in row else "")
        )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    command = command_line(sys.argv[1:] if argv is None else argv)  # before loading kernels sets TVM_NUM_THREADS
    commit = source_commit() or "?"  # before this run's own results make the checkout look modified
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    torch.manual_seed(0)
    budget = memory_budget_bytes(args)
    groups = [
        (op, p == "forward+backward", _dilation_tuple(spec, args.heads))
        for spec in args.dilation
        for op in args.ops
        for p in args.passes
        if (set(_dilation_tuple(spec, args.heads)) == {1} or (op in args.dilated_ops and p in args.dilated_passes))
        and (p == "forward" or op in args.backward_ops)
    ]
    dtype_gemms = [d for d in args.dtype if d != "float32" and not slow_gemm_reason(args.device, d)]
    print(
        f"device {device_name(args.device)}: {len(groups) * len(args.dtype)} cases x {len(args.seq_lens)} lengths x "
        f"{len(args.methods)} methods, each case with a float32 GEMM ({GEMM_SIZE}^3)"
        + (" and one in its own dtype" if dtype_gemms else "")
        + " in its rounds",
        flush=True,
    )
    slow_gemms = [slow_gemm_reason(args.device, d) for d in args.dtype if d != "float32" and d not in dtype_gemms]
    for reason in slow_gemms:
        print(reason, flush=True)
    gemm_notes = "".join(f", and torch.mm in {d} in the same rounds" for d in dtype_gemms) + "".join(
        f"; {r}" for r in slow_gemms
    )

    rows = []
    last: dict[tuple, tuple] = {}  # (op, backward, dilation, dtype, method) -> last measured (seq_len, seconds, bytes)
    progress = tqdm(total=len(groups) * len(args.dtype) * len(args.seq_lens), unit="case", dynamic_ncols=True)
    for seq_len in args.seq_lens:
        for op, backward, dilation in groups:
            # A case's dtypes are timed in the same rounds (with one GEMM), so that comparing
            # them holds under the same conditions on this shared machine, as comparing methods does.
            cases = [
                Case(
                    op,
                    backward,
                    seq_len,
                    args.window,
                    dilation,
                    args.heads,
                    args.head_dim,
                    args.batch,
                    dtype,
                    args.device,
                )
                for dtype in args.dtype
            ]
            progress.set_description(
                f"{op} {cases[0].pass_name} d={_dilation_label(dilation)} {','.join(args.dtype)} n={seq_len}"
            )
            runnable, skipped = [], {}
            for case in cases:
                for method in args.methods:
                    reason = methods.unsupported_reason(
                        method, op, backward, dilation, args.device
                    ) or _predicted_limit(
                        last.get((op, backward, dilation, case.dtype, method)),
                        method,
                        seq_len,
                        budget,
                        args.max_call_seconds,
                    )
                    (skipped.__setitem__((case, method), reason) if reason else runnable.append((case, method)))
            expected = {
                (case, m): _expected_seconds(last.get((op, backward, dilation, case.dtype, m)), m, seq_len)
                for case, m in runnable
            }
            failures = {}
            samples = time_interleaved(runnable, args.repeats, expected, failures) if runnable else {}
            flops = methods.useful_flops(op, backward, args.batch, seq_len, args.heads, args.head_dim, args.window)
            float32_case = next((c for c in cases if c.dtype == "float32"), None)
            for case in cases:
                rows.extend(_case_rows(case, float32_case, args, skipped, samples, failures, flops, last, progress))
                progress.update()
    progress.close()

    out = args.out or results_dir(args.device)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (args.name or device_name(args.device))
    report.write_csv(rows, stem.with_suffix(".csv"))
    header = (
        f"# {', '.join(args.ops)} on {device_name(args.device)}\n\n"
        f"Command: `{command}` (commit {commit}, {datetime.date.today()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads). Reference: float32 torch.mm {GEMM_SIZE}^3 timed in the rounds of "
        f"every case ({_gemm_range(rows)})" + gemm_notes + ". "
        f"batch {args.batch}, {args.heads} heads of {args.head_dim}, one-sided window {args.window}, {', '.join(args.dtype)}."
    )
    stem.with_suffix(".md").write_text(report.markdown(rows, header))
    report.plot(rows, stem.with_suffix(".png"), report.plot_title(device_name(args.device), rows))
    print(f"wrote {stem}.csv, .md, .png")
    if report.headline_plot(rows, stem.with_name(f"{stem.name}-headline.png"), device_name(args.device)):
        print(f"wrote {stem}-headline.png (local attention's forward against the dense ways)")
    return 0


# Environment variables that change what the bench measures (threads, kernels, the allocator).
# (MKL_ and ONEDNN_: an instruction-set cap on the reference GEMMs, e.g. to stand in for an AVX2 CPU.)
_RECORDED_ENV_PREFIXES = (
    "LONGFORMER_OPS_",
    "GLIBC_TUNABLES",
    "MALLOC_",
    "LD_PRELOAD",
    "OMP_",
    "TVM_NUM_THREADS",
    "MKL_",
    "ONEDNN_",
)


def command_line(argv: list[str]) -> str:
    """The command as a user would retype it, with the environment variables that change results first."""
    env = [
        f"{name}={shlex.quote(value)}"
        for name, value in sorted(os.environ.items())
        if name.startswith(_RECORDED_ENV_PREFIXES)
    ]
    return " ".join([*env, "python -m bench", *(shlex.quote(a) for a in argv)])


if __name__ == "__main__":
    sys.exit(main())
