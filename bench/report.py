"""Results as CSV (one row per measurement), a Markdown table and a PNG plot."""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = [
    "op",
    "pass",
    "method",
    "seq_len",
    "window",
    "dilation",
    "heads",
    "head_dim",
    "batch",
    "dtype",
    "device",
    "time_ms",
    "vs_float32",
    "gflops",
    "gemm_gflops",
    "gemm_share",
    "dtype_gemm_gflops",
    "dtype_gemm_share",
    "peak_mib",
    "first_call_ms",
    "status",
    "reason",
]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in COLUMNS})


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] == "memory only":
        return f"not timed / {row['peak_mib']:.0f} MiB ({row['reason']})"
    if row["status"] != "ok":
        return f"skipped: {row['reason']}"
    memory = f" / {row['peak_mib']:.0f} MiB" if row.get("peak_mib") not in (None, "") else ""
    return f"{row['time_ms']:.1f} ms{memory}"


def groups(rows: list[dict]):
    """(op, pass, dilation, dtype) -> rows, in first-seen order."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["op"], row["pass"], row["dilation"], row["dtype"]), []).append(row)
    return grouped


def _per_length_table(rows: list[dict], lengths: list[int], cell) -> list[str]:
    """Markdown rows: one line per (op, pass, dilation, dtype, method) of ``rows``, ``cell(row)`` per length."""
    lines = [
        "| op | pass | dilation | dtype | method | " + " | ".join(str(n) for n in lengths) + " |",
        "|---|---|---|---|---|" + "---:|" * len(lengths),
    ]
    for (op, pass_name, dilation, dtype), members in groups(rows).items():
        for method in dict.fromkeys(r["method"] for r in members):
            by_length = {r["seq_len"]: cell(r) for r in members if r["method"] == method}
            lines.append(
                f"| {op} | {pass_name} | {dilation} | {dtype} | {method} | "
                + " | ".join(by_length.get(n, "") for n in lengths)
                + " |"
            )
    return lines


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    for (op, pass_name, dilation, dtype), members in groups(rows).items():
        method_names = list(dict.fromkeys(r["method"] for r in members))
        lengths = sorted({r["seq_len"] for r in members})
        lines += [
            f"### {op}, {pass_name}, dilation {dilation}, {dtype}",
            "",
            "| seq_len | " + " | ".join(method_names) + " |",
            "|---:|" + "---|" * len(method_names),
        ]
        by_key = {(r["seq_len"], r["method"]): r for r in members}
        for n in lengths:
            lines.append(f"| {n} | " + " | ".join(_cell(by_key.get((n, m))) for m in method_names) + " |")
        lines.append("")
    lines.append(
        "Cells: median time per call / peak extra memory of one call (fresh process). "
        "'not timed': too slow to time repeatedly, memory from one call."
    )
    lines += [
        "",
        "### Share of the GEMM rate",
        "",
        "Useful GFLOP/s (2 b h n (2w+1) head_dim per band product; x2 for attention, the layer adds its three "
        "2 b n hidden^2 projections and its global token's 2 x 2 b n hidden h; x3 with backward) "
        "as a share of the float32 GEMM timed in the same rounds (median of the per-round shares), per length:",
        "",
    ]
    lengths = sorted({r["seq_len"] for r in rows if r["status"] == "ok"})
    ok = [r for r in rows if r["status"] == "ok"]
    lines += _per_length_table(ok, lengths, lambda r: f"{100 * r['gemm_share']:.0f}%")
    own = [r for r in ok if r.get("dtype_gemm_share") not in (None, "")]
    if own:
        lines += [
            "",
            "### Share of the same dtype's GEMM",
            "",
            "The same useful GFLOP/s as a share of torch.mm in the case's own dtype (2048^3, timed in the same "
            "rounds; median of the per-round shares) and that GEMM's rate (median), per length:",
            "",
        ]
        lines += _per_length_table(
            own, lengths, lambda r: f"{100 * r['dtype_gemm_share']:.0f}% of {r['dtype_gemm_gflops']:.0f}"
        )
    paired = [r for r in rows if r.get("vs_float32") not in (None, "") and r["dtype"] != "float32"]
    if paired:
        lines += [
            "",
            "### Against float32, round by round",
            "",
            "Time per call over float32's time in the same round (the same method and case), median over the "
            "rounds; under 1: faster than float32. Unlike the ratio of two medians, this holds when the machine "
            "changes speed between rounds:",
            "",
        ]
        lines += _per_length_table(paired, lengths, lambda r: f"{r['vs_float32']:.2f}")
    lines += [
        "",
        "### Rates and first calls",
        "",
        "Useful GFLOP/s and the GEMM rate of the same rounds (medians), the share (median of the per-round shares), and the first call in a fresh process "
        "(library load or compilation included), at the largest length every listed method ran:",
        "",
        "| op | pass | dilation | dtype | n | method | time ms | GFLOP/s | GEMM GFLOP/s | share of GEMM | first call ms |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (op, pass_name, dilation, dtype), members in groups(rows).items():
        ok = [r for r in members if r["status"] == "ok"]
        methods_ok = {r["method"] for r in ok}
        common = [
            n
            for n in sorted({r["seq_len"] for r in ok})
            if {r["method"] for r in ok if r["seq_len"] == n} == methods_ok
        ]
        if not common:
            continue
        for r in (r for r in ok if r["seq_len"] == common[-1]):
            first = f"{r['first_call_ms']:.0f}" if r.get("first_call_ms") not in (None, "") else ""
            lines.append(
                f"| {op} | {pass_name} | {dilation} | {dtype} | {r['seq_len']} | {r['method']} | {r['time_ms']:.1f} | "
                f"{r['gflops']:.1f} | {r['gemm_gflops']:.0f} | {100 * r['gemm_share']:.0f}% | {first} |"
            )
    return "\n".join(lines) + "\n"


def read_csv(path: Path) -> list[dict]:
    """Rows of a results CSV with numbers as numbers (the inverse of write_csv)."""
    numeric = {
        "seq_len": int,
        "window": int,
        "heads": int,
        "head_dim": int,
        "batch": int,
        "time_ms": float,
        "vs_float32": float,
        "gflops": float,
        "gemm_gflops": float,
        "gemm_share": float,
        "dtype_gemm_gflops": float,
        "dtype_gemm_share": float,
        "peak_mib": float,
        "first_call_ms": float,
    }
    rows = []
    for raw in csv.DictReader(open(path)):
        rows.append({k: (numeric[k](v) if k in numeric and v != "" else v) for k, v in raw.items()})
    return rows


# One colour per method in every panel.
METHOD_COLOURS = {
    "tvm": "tab:blue",
    "tvm_out": "tab:cyan",
    "full": "tab:orange",
    "sdpa": "tab:green",
    "sliding_chunks": "tab:red",
    "flex": "tab:purple",
    # bench.hf_model: transformers' model as it is (sliding chunks), and patched onto our kernels
    "transformers": "tab:red",
    "patched": "tab:blue",
    # --ops poolingformer: the Longformer layer at the Poolingformer's level-1 and level-2 windows
    "longformer_w1": "tab:gray",
    "longformer_w2": "tab:brown",
}


def plot_title(device_name: str, rows: list[dict]) -> str:
    row, dtypes = rows[0], ", ".join(dict.fromkeys(r["dtype"] for r in rows))
    return f"{device_name}: w={row['window']}, {row['heads']}x{row['head_dim']}, batch {row['batch']}, {dtypes}"


def log_log_axis(axis, xlabel: str, ylabel: str, title: str | None = None) -> None:
    """A plot panel's look: n in powers of 2 against a log scale, a light grid, a legend."""
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title, fontsize=9)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)


def plot(rows: list[dict], path: Path, title: str, labels: dict[str, str] | None = None) -> None:
    """Time and peak memory against n, a row of two panels per (op, pass, dilation, dtype); ``labels``
    names methods in the legend (default: their names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = groups(rows)
    figure, axes = plt.subplots(len(grouped), 2, figsize=(11, 3.6 * len(grouped)), squeeze=False)
    for (op, pass_name, dilation, dtype), (time_axis, memory_axis) in zip(grouped, axes, strict=True):
        members = grouped[(op, pass_name, dilation, dtype)]
        for method in dict.fromkeys(r["method"] for r in members):
            ok = sorted(
                (r for r in members if r["method"] == method and r["status"] == "ok"), key=lambda r: r["seq_len"]
            )
            measured = sorted(
                (r for r in members if r["method"] == method and r["status"] in ("ok", "memory only")),
                key=lambda r: r["seq_len"],
            )
            if not measured:
                continue
            style = dict(marker="o", label=(labels or {}).get(method, method), color=METHOD_COLOURS.get(method))
            time_axis.plot([r["seq_len"] for r in ok], [r["time_ms"] for r in ok], **style)
            with_memory = [r for r in measured if r.get("peak_mib") not in (None, "")]
            if with_memory:
                memory_axis.plot(
                    [r["seq_len"] for r in with_memory], [max(r["peak_mib"], 0.1) for r in with_memory], **style
                )
        for axis, label in ((time_axis, "time per call (ms)"), (memory_axis, "peak extra memory (MiB)")):
            if not axis.lines:  # e.g. memory with --no-memory
                axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
                continue
            log_log_axis(axis, "sequence length", label, f"{op}, {pass_name}, dilation {dilation}, {dtype}")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(path, dpi=110)
    plt.close(figure)


# The README's plot: local attention's forward, undilated, ours against the dense ways and FlexAttention.
HEADLINE_METHODS = {"tvm": "ours", "full": "full attention", "sdpa": "sdpa + band mask", "flex": "FlexAttention"}


def headline_rows(rows: list[dict]) -> list[dict]:
    """The rows of :func:`headline_plot`: local attention's forward, dilation 1, the first dtype measured."""
    first = [r for r in rows if r["op"] == "local_attention" and r["pass"] == "forward" and str(r["dilation"]) == "1"]
    dtype = first[0]["dtype"] if first else None
    return [r for r in first if r["dtype"] == dtype and r["method"] in HEADLINE_METHODS]


def headline_plot(rows: list[dict], path: Path, device_name: str) -> bool:
    """Time and peak memory against n of :func:`headline_rows`, one figure; False if there are none."""
    chosen = headline_rows(rows)
    if chosen:
        plot(chosen, path, plot_title(device_name, chosen), HEADLINE_METHODS)
    return bool(chosen)


if __name__ == "__main__":
    # `python -m bench.report CSV`: re-render the table and plot of a results CSV (keeping the table's
    # header paragraph). `python -m bench.report --headline CSV`: only its headline plot,
    # <stem>-headline.png, as `make bench` writes it.
    import sys

    headline_only = sys.argv[1] == "--headline"
    csv_path = Path(sys.argv[-1])
    rows = read_csv(csv_path)
    headline = csv_path.with_name(f"{csv_path.stem}-headline.png")
    if headline_plot(rows, headline, csv_path.stem):
        print(f"wrote {headline}")
    if not headline_only:
        table = csv_path.with_suffix(".md")
        header = table.read_text().split("\n\n###", 1)[0] if table.exists() else f"# {csv_path.stem}"
        table.write_text(markdown(rows, header))
        plot(rows, csv_path.with_suffix(".png"), plot_title(csv_path.stem, rows))
        print(f"wrote {table} and {csv_path.with_suffix('.png')}")
