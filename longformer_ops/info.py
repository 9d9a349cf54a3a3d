"""``python -m longformer_ops.info``: which kernels work on this machine, from which library, and why.

Reads prebuilt/manifest.json, picks the library each (device, dtype) would use, loads it and
prints one screen: per (device, dtype) the library chosen and why (the better ones it passed
over, and what each lacks), then a table of kernel families x (device, dtype). ``--verbose`` lists every
exported kernel function with its status instead of the table. Never imports the TVM compiler.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from longformer_ops.runtime import loader as _loader
from longformer_ops.runtime import manifest as _manifest

_SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


def _libraries(manifest: dict) -> list[tuple[str, str]]:
    """Every (device, dtype) the manifest holds a library for: CPU first, float32 first."""
    order = list(_SHORT_DTYPES)
    pairs = {(e["device"], e["dtype"]) for e in manifest["libraries"].values()}
    return sorted(pairs, key=lambda pair: (pair[0] != "cpu", order.index(pair[1]) if pair[1] in order else 9, pair))


def _load(device: str, dtype: str):
    """``(library or None, status)`` for (device, dtype) on this machine."""
    if device == "cuda" and not torch.cuda.is_available():
        return None, "no CUDA device visible to torch"
    try:
        return _loader.library_for(torch.device(device), dtype), "ok"
    except (_loader.KernelNotAvailableError, _loader.StaleKernelError, OSError) as error:
        return None, f"unavailable: {error}"


def _why(manifest: dict, device: str, dtype: str, chosen: str) -> str:
    """Why ``chosen`` serves (device, dtype): for the CPU, what each library preferred to it lacks here."""
    if device != "cpu":
        return f"the {device} library"
    if os.environ.get(_loader.CPU_TARGET_ENV):
        return f"forced by {_loader.CPU_TARGET_ENV}"
    flags, vendor = _loader.cpu_flags(), _loader.cpu_vendor()
    entries = sorted(
        (e for e in manifest["libraries"].values() if e["device"] == "cpu" and e["dtype"] == dtype),
        key=lambda e: -e["preference"],
    )
    passed_over = []
    for entry in entries:
        if entry["target"] == chosen:
            break
        missing = sorted(set(entry["cpu_flags"]) - flags)
        if missing:
            passed_over.append(f"{entry['target']} needs {' '.join(missing)}")
        elif entry.get("cpu_vendors") and vendor not in entry["cpu_vendors"]:
            passed_over.append(f"{entry['target']} is for {'/'.join(entry['cpu_vendors'])} CPUs")
        elif _loader.AMX_FLAG in entry["cpu_flags"] and not _loader.amx_permitted():
            passed_over.append(f"{entry['target']}: Linux refused AMX")
    return "best that runs here" + (f" ({'; '.join(passed_over)})" if passed_over else "")


def availability() -> list[dict]:
    """One row per (op, device, dtype) the manifest knows of, with its status on this machine."""
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    functions = {(e["device"], e["dtype"]): e["functions"] for e in manifest["libraries"].values()}
    rows = []
    for device, dtype in _libraries(manifest):
        loaded, status = _load(device, dtype)
        library = loaded.name if loaded else "-"
        rows += [
            dict(op=name, device=device, dtype=dtype, library=library, status=status)
            for name in functions[(device, dtype)]
        ]
    return rows


def _print_columns(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _summary(manifest: dict) -> bool:
    """The one-screen listing; whether any library loaded."""
    pairs = _libraries(manifest)
    loaded = {pair: _load(*pair) for pair in pairs}
    rows = [["device", "dtype", "library", "why"]]
    for (device, dtype), (library, status) in loaded.items():
        if library is None:
            rows.append([device, dtype, "-", status])
        else:
            rows.append([device, dtype, library.name, _why(manifest, device, dtype, library.name.split("/")[0])])
    _print_columns(rows)
    print()
    functions = {(e["device"], e["dtype"]): set(e["functions"]) for e in manifest["libraries"].values()}
    header = ["kernel family: its ops"] + [f"{device} {_SHORT_DTYPES.get(dtype, dtype)}" for device, dtype in pairs]
    table = [header]
    for name, family in _manifest.KERNEL_FAMILIES.items():
        members = [f for op in family.ops for f in _manifest.function_names(op)]
        cells = []
        for pair in pairs:
            library = loaded[pair][0]
            if not set(members) <= functions[pair]:
                cells.append(".")  # not in this library: torch's ops serve it
            else:
                cells.append("yes" if library is not None and all(library.has(f) for f in members) else "no")
        table.append([f"{name}: {' '.join(family.ops)}"] + cells)
    _print_columns(table)
    print(
        "yes: runs on the kernels here; no: in a library that does not load here; .: not in the library "
        "(torch's ops serve it)"
    )
    return any(library is not None for library, _ in loaded.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longformer_ops.info", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="every kernel function of every library, one per row")
    args = parser.parse_args(argv)
    directory = _loader.prebuilt_dir()
    try:
        manifest = _loader._manifest_or_raise(directory)
    except _loader.KernelNotAvailableError as error:
        print(error)
        return 1
    print(
        f"prebuilt:  {directory}  (TVM {manifest['tvm_version']}, tvm-ffi {manifest['tvm_ffi_version']}, "
        f"{manifest['platform']})"
    )
    print(f"torch:     {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    simd = sorted(f for f in _loader.cpu_flags() if f in _SIMD_FLAGS)
    amx = ""
    if "amx_tile" in simd:
        amx = ", AMX permitted" if _loader.amx_permitted() else ", AMX refused by Linux (arch_prctl)"
    print(f"CPU:       {_loader.cpu_vendor() or 'vendor unknown'}, flags {' '.join(simd) or 'unknown'}{amx}")
    print()
    if not args.verbose:
        return 0 if _summary(manifest) else 1
    rows = availability()
    _print_columns(
        [["op", "device", "dtype", "library", "status"]]
        + [[r["op"], r["device"], r["dtype"], r["library"], r["status"]] for r in rows]
    )
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
