"""``python -m longformer_ops.info``: which (op, device, dtype) kernels work on this machine, and why not.

Reads prebuilt/manifest.json, picks the library each (device, dtype) would use,
loads it and reports the result. Never imports the TVM compiler.
"""

from __future__ import annotations

import argparse
import sys

import torch

from longformer_ops import _loader


def availability() -> list[dict]:
    """One row per (op, device, dtype) the manifest knows of, with its status on this machine."""
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    functions = {(e["device"], e["dtype"]): e["functions"] for e in manifest["libraries"].values()}
    rows = []
    for (device, dtype), names in sorted(functions.items()):
        if device == "cuda" and not torch.cuda.is_available():
            library, status = "-", "no CUDA device visible to torch"
        else:
            try:
                loaded = _loader.library_for(torch.device(device), dtype)
                library, status = loaded.name, "ok"
            except (_loader.KernelNotAvailableError, _loader.StaleKernelError, OSError) as error:
                library, status = "-", f"unavailable: {error}"
        rows += [dict(op=name, device=device, dtype=dtype, library=library, status=status) for name in names]
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m longformer_ops.info", description=__doc__.splitlines()[0]).parse_args(argv)
    directory = _loader.prebuilt_dir()
    try:
        manifest = _loader._manifest_or_raise(directory)
    except _loader.KernelNotAvailableError as error:
        print(error)
        return 1
    print(f"prebuilt:  {directory}  (TVM {manifest['tvm_version']}, tvm-ffi {manifest['tvm_ffi_version']}, "
          f"{manifest['platform']})")
    print(f"torch:     {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    simd = sorted(f for f in _loader.cpu_flags()
                  if f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"))
    amx = ""
    if "amx_tile" in simd:
        amx = ", AMX permitted" if _loader.amx_permitted() else ", AMX refused by Linux (arch_prctl)"
    print(f"CPU:       {_loader.cpu_vendor() or 'vendor unknown'}, flags {' '.join(simd) or 'unknown'}{amx}")
    rows = availability()
    widths = {key: max(len(key), *(len(str(r[key])) for r in rows)) for key in ("op", "device", "dtype", "library")}
    print("  ".join(key.ljust(widths[key]) for key in widths) + "  status")
    for row in rows:
        print("  ".join(str(row[key]).ljust(widths[key]) for key in widths) + "  " + row["status"])
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
