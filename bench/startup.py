"""What a process pays before its first result: ``python -m bench.startup [--runs 9]``.

In fresh interpreters (``-X importtime`` off, bytecode caches as the checkout has them), each run
times ``import torch``, then ``import longformer_ops``, then the first and the second call of
``sliding_window_attention`` on a tiny input (the first loads the CPU library for float32: the
runtime ``tvm_ffi``, the manifest, the library's checksum, ``dlopen``), and lists which heavy
modules the process then holds. Two setups, alternating:

- ``runtime dependencies``: as a ``pip install`` of the wheel has them (torch and apache-tvm-ffi);
  ``ml_dtypes``, which only the TVM compiler (``make kernels``, the test extras) brings along, is
  hidden, since ``tvm_ffi`` imports it where it is installed;
- ``this environment``: as it is (in the repository's ``.venv``: with ``ml_dtypes``).

Medians over ``--runs`` runs of each. Writes
``bench/results/<machine kind>/<cpu>-startup.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
if {hide_ml_dtypes}:
    sys.modules["ml_dtypes"] = None  # (an import of it raises ImportError, as where it is not installed)
start = time.perf_counter()
import torch
imported_torch = time.perf_counter()
import longformer_ops
imported = time.perf_counter()
x = torch.randn(1, 64, 2, 16)
longformer_ops.sliding_window_attention(x, x, x, 4)
first = time.perf_counter()
longformer_ops.sliding_window_attention(x, x, x, 4)
second = time.perf_counter()
heavy = sorted(m for m in ("torch._dynamo", "transformers", "tvm", "tvm_ffi", "ml_dtypes") if sys.modules.get(m))
print(json.dumps(dict(torch=imported_torch - start, longformer_ops=imported - imported_torch,
                      first_call=first - imported, second_call=second - first, modules=heavy)))
"""

SETUPS = {"runtime dependencies": True, "this environment": False}


def run_once(hide_ml_dtypes: bool) -> dict:
    code = _CHILD.format(hide_ml_dtypes=hide_ml_dtypes)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per setup (default 9)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    args = parser.parse_args(argv)
    from bench.machine import cpu_results_name, results_dir, source_commit

    args.out = args.out or results_dir()
    runs = {setup: [] for setup in SETUPS}
    for i in range(args.runs):
        for setup, hide in SETUPS.items():
            runs[setup].append(run_once(hide))
        print(
            f"run {i + 1}/{args.runs}: "
            + ", ".join(f"{s}: {r[-1]['first_call'] * 1e3:.0f} ms first call" for s, r in runs.items()),
            file=sys.stderr,
        )
    import torch

    name = cpu_results_name()
    lines = [
        f"# Start-up cost ({name}, torch {torch.__version__}, at {source_commit()})",
        "",
        f"`python -m bench.startup --runs {args.runs}`; medians of {args.runs} fresh processes per setup, "
        "milliseconds; the calls are `sliding_window_attention` on [1, 64, 2, 16] float32, w = 4.",
        "",
        "| setup | import torch | import longformer_ops | first call | second call | first - second | "
        "modules held after |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for setup, results in runs.items():
        median = {
            key: statistics.median(r[key] for r in results) * 1e3
            for key in ("torch", "longformer_ops", "first_call", "second_call")
        }
        modules = sorted({m for r in results for m in r["modules"]})
        lines.append(
            f"| {setup} | {median['torch']:.0f} | {median['longformer_ops']:.0f} | "
            f"{median['first_call']:.1f} | {median['second_call']:.2f} | "
            f"{median['first_call'] - median['second_call']:.1f} | {', '.join(modules) or '-'} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-startup.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
