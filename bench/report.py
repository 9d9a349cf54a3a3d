"""Results as CSV (one row per measurement), a Markdown table and a PNG plot."""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ["op", "pass", "method", "seq_len", "window", "dilation", "heads", "head_dim", "batch", "dtype", "device",
           "time_ms", "gflops", "gemm_share", "peak_mib", "first_call_ms", "status", "reason"]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in COLUMNS})


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return f"skipped: {row['reason']}"
    memory = f" / {row['peak_mib']:.0f} MiB" if row.get("peak_mib") not in (None, "") else ""
    return f"{row['time_ms']:.1f} ms{memory}"


def groups(rows: list[dict]):
    """(op, pass, dilation) -> rows, in first-seen order."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["op"], row["pass"], row["dilation"]), []).append(row)
    return grouped


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    for (op, pass_name, dilation), members in groups(rows).items():
        method_names = list(dict.fromkeys(r["method"] for r in members))
        lengths = sorted({r["seq_len"] for r in members})
        lines += [f"### {op}, {pass_name}, dilation {dilation}", "",
                  "| seq_len | " + " | ".join(method_names) + " |",
                  "|---:|" + "---|" * len(method_names)]
        by_key = {(r["seq_len"], r["method"]): r for r in members}
        for n in lengths:
            lines.append(f"| {n} | " + " | ".join(_cell(by_key.get((n, m))) for m in method_names) + " |")
        lines.append("")
    lines.append("Cells: median time per call / peak extra memory of one call (fresh process).")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = groups(rows)
    figure, axes = plt.subplots(len(grouped), 2, figsize=(11, 3.6 * len(grouped)), squeeze=False)
    for (op, pass_name, dilation), (time_axis, memory_axis) in zip(grouped, axes):
        members = grouped[(op, pass_name, dilation)]
        for method in dict.fromkeys(r["method"] for r in members):
            ok = sorted((r for r in members if r["method"] == method and r["status"] == "ok"), key=lambda r: r["seq_len"])
            if not ok:
                continue
            time_axis.plot([r["seq_len"] for r in ok], [r["time_ms"] for r in ok], marker="o", label=method)
            with_memory = [r for r in ok if r.get("peak_mib") not in (None, "")]
            if with_memory:
                memory_axis.plot([r["seq_len"] for r in with_memory], [max(r["peak_mib"], 0.1) for r in with_memory],
                                 marker="o", label=method)
        for axis, label in ((time_axis, "time per call (ms)"), (memory_axis, "peak extra memory (MiB)")):
            if not axis.lines:  # e.g. memory with --no-memory
                axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
                continue
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("sequence length")
            axis.set_ylabel(label)
            axis.set_title(f"{op}, {pass_name}, dilation {dilation}", fontsize=9)
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
