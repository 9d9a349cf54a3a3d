"""Ahead-of-time build of every kernel library into ``prebuilt/`` (what ``make kernels`` runs).

    python -m tvm_kernels.build [--targets cpu-avx2,cpu-avx512,cuda] [--dtypes float32,...]
                                [--out prebuilt] [--force]

For each (target, dtype) in :data:`tvm_kernels.variants.TARGETS` it schedules
(or takes hand-written) the PrimFuncs of the target's ops, compiles them into one shared
library and records it in ``manifest.json``. A library is rebuilt only when its
inputs changed: the sources it is built from (hashed), the TVM version, and for
CUDA the nvcc version. It also copies TVM's small runtime libraries next to the
kernels (``runtime/``), so that loading needs only ``apache-tvm-ffi``, not the
TVM compiler, and compiles ``openmp_launch.c`` there (the CPU kernels' parallel
loops on torch's OpenMP threads; see that file).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longformer_ops import _manifest
from tvm_kernels import variants
from tvm_kernels.variants import function_name, function_names

HERE = Path(__file__).resolve().parent


def _inputs_of(target: variants.KernelTarget, dtype: str, nvcc_version: str | None) -> dict:
    """Everything a library's content depends on; equal inputs mean no rebuild."""
    files = variants.sources_of(target)
    inputs = {
        "sources": list(files),
        "sources_sha256": _manifest.sources_digest(HERE, files),
        "tvm_version": importlib.metadata.version("apache-tvm"),
        "tvm_target": target.tvm_target,
        "dtype": dtype,
    }
    if target.device == "cuda":
        inputs["nvcc_version"] = nvcc_version
        inputs["cuda_archs"] = list(target.cuda_archs)
    return inputs


def _schedule_module(target: variants.KernelTarget):
    return importlib.import_module(f"tvm_kernels.schedules.{target.schedule_module}")


def _compile_library(target: variants.KernelTarget, dtype: str, path: Path) -> None:
    import tvm

    from tvm_kernels.compute import DEFINITIONS

    schedules = _schedule_module(target)
    hand_written = getattr(schedules, "HAND_WRITTEN", {})  # ops whose kernel the module writes in TIR itself
    functions = {}
    for op in target.ops:
        if op in _manifest.UNBANDED_OPS:  # no band, no variants: hand-written, (dtype, isa)
            functions[op] = hand_written[op](dtype, target.isa).with_attr("global_symbol", op)
            continue
        for autoregressive in (False, True):
            name = function_name(op, autoregressive)
            if op in hand_written:
                scheduled = hand_written[op](dtype, autoregressive, target.isa)
            else:
                scheduled = schedules.schedule(op, DEFINITIONS[op](dtype, autoregressive))["main"]
            functions[name] = scheduled.with_attr("global_symbol", name)
    if target.device == "cuda":
        tvm_target = tvm.target.Target(target.tvm_target, host={"kind": "llvm", "mtriple": "x86_64-linux-gnu"})
    else:
        tvm_target = tvm.target.Target(target.tvm_target)
    with tvm.transform.PassContext(config=getattr(schedules, "PASS_CONFIG", {})):
        executable = tvm.compile(tvm.IRModule(functions), target=tvm_target)
    tmp = path.with_name(path.name + ".tmp.so")
    executable.export_library(str(tmp))
    tmp.replace(path)


def _replace_if_changed(source: Path, target: Path) -> None:
    if not target.exists() or _manifest.file_sha256(target) != _manifest.file_sha256(source):
        shutil.copy2(source, target)


def _compile_openmp_launch(runtime_dir: Path) -> None:
    """``openmp_launch.c`` -> ``runtime/<OPENMP_LAUNCH_LIBRARY>`` (a C compiler with OpenMP: TVM's
    own export needs ``cc`` already). Replaced only when the bytes change, so an unchanged build
    leaves the committed file alone."""
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as scratch:
        built = Path(scratch) / _manifest.OPENMP_LAUNCH_LIBRARY
        subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-fopenmp", str(HERE / "openmp_launch.c"), "-o", str(built)],
                       check=True)
        _replace_if_changed(built, runtime_dir / _manifest.OPENMP_LAUNCH_LIBRARY)


def _prepare_runtime(out: Path, need_cuda: bool) -> dict:
    """Copy TVM's runtime libraries (not the compiler) into ``out/runtime``, build the OpenMP launcher there."""
    lib_dir = Path(importlib.util.find_spec("tvm").origin).parent / "lib"  # located, not imported
    runtime_dir = out / "runtime"
    runtime_dir.mkdir(parents=True, exist_ok=True)
    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if need_cuda else [])
    for name in names:
        _replace_if_changed(lib_dir / name, runtime_dir / name)
    _compile_openmp_launch(runtime_dir)
    shutil.copy2(lib_dir.parent / "LICENSE", runtime_dir / "LICENSE.tvm")
    present = sorted(p.name for p in runtime_dir.glob("*.so"))
    return {name: _manifest.file_sha256(runtime_dir / name) for name in present}


def build(targets: list[str], dtypes: list[str] | None, out: Path, force: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest.read(out) or {}
    libraries = manifest.get("libraries", {})
    chosen = [variants.TARGETS[name] for name in targets]
    jobs = [(t, d) for t in chosen for d in t.dtypes if dtypes is None or d in dtypes]

    nvcc_version = None
    if any(t.device == "cuda" for t in chosen):
        from tvm_kernels import cuda_toolchain

        nvcc_version = cuda_toolchain.nvcc_version(cuda_toolchain.find_nvcc())

    def up_to_date(target, dtype) -> bool:
        entry, path = libraries.get(variants.library_name(target, dtype)), out / variants.library_name(target, dtype)
        return (not force and entry is not None and entry.get("inputs") == _inputs_of(target, dtype, nvcc_version)
                and path.exists() and entry.get("sha256") == _manifest.file_sha256(path))

    stale = {(t.name, d) for t, d in jobs if not up_to_date(t, d)}
    cuda_stale = [variants.TARGETS[name] for name, _ in stale if variants.TARGETS[name].device == "cuda"]
    if cuda_stale:
        _prepare_cuda_callback(cuda_stale[0])  # before anything imports tvm

    built = 0
    for index, (target, dtype) in enumerate(jobs, start=1):
        name = variants.library_name(target, dtype)
        path = out / name
        inputs = _inputs_of(target, dtype, nvcc_version)
        label = f"[{index}/{len(jobs)}] {name}"
        if (target.name, dtype) not in stale:
            print(f"{label}: up to date", flush=True)
            continue
        names = [name for op in target.ops for name in function_names(op)]
        print(f"{label}: building {len(names)} functions for {target.tvm_target} ...", end="", flush=True)
        started = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        _compile_library(target, dtype, path)
        print(f" {time.perf_counter() - started:.1f} s", flush=True)
        libraries[name] = {
            "target": target.name,
            "device": target.device,
            "dtype": dtype,
            "functions": names,
            # The schedule's contract on head_dim (its feature loops are split without a guard).
            "feature_multiple": _schedule_module(target).FEATURE_MULTIPLE,
            "preference": target.preference,
            "cpu_flags": list(target.cpu_flags),
            "cpu_vendors": list(target.cpu_vendors),
            "cuda_archs": list(target.cuda_archs),
            "inputs": inputs,
            "sha256": _manifest.file_sha256(path),
        }
        built += 1
        _write_manifest(out, manifest, libraries)  # keep progress if a later build fails
    need_cuda = any(entry["device"] == "cuda" for entry in libraries.values())
    manifest["runtime"] = _prepare_runtime(out, need_cuda)
    manifest["openmp_launch_source_sha256"] = _manifest.file_sha256(HERE / "openmp_launch.c")
    _write_manifest(out, manifest, libraries)
    print(f"{built} built, {len(jobs) - built} up to date; manifest: {out / _manifest.MANIFEST_NAME}", flush=True)
    return built


def _write_manifest(out: Path, manifest: dict, libraries: dict) -> None:
    manifest.update(
        format=_manifest.FORMAT_VERSION,
        platform=f"{sys.platform}-{platform.machine()}",
        tvm_version=importlib.metadata.version("apache-tvm"),
        tvm_ffi_version=importlib.metadata.version("apache-tvm-ffi"),
        sources_sha256=_manifest.sources_digest(HERE, _manifest.all_kernel_sources(HERE)),
        libraries=dict(sorted(libraries.items())),
    )
    _manifest.write(out, manifest)


def _prepare_cuda_callback(target: variants.KernelTarget) -> None:
    """Route TVM's CUDA compilation through nvcc to a multi-arch fatbin (see cuda_toolchain)."""
    from tvm_kernels import cuda_toolchain

    cuda_toolchain.prepare_tvm_for_cuda_builds()
    import tvm  # noqa: F401  (registers TVM's default callback, which ours overrides)
    import tvm_ffi

    @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
    def _compile(code, *_):
        return cuda_toolchain.compile_fatbin(code, list(target.cuda_archs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_kernels.build", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(variants.TARGETS),
                        help="comma-separated targets (default: %(default)s)")
    parser.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: all of each target)")
    parser.add_argument("--out", type=Path, default=_manifest.DEFAULT_PREBUILT, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in variants.TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {list(variants.TARGETS)}")
    try:
        build(targets, args.dtypes.split(",") if args.dtypes else None, args.out, args.force)
    except Exception as error:
        # TVM's excepthook prints only "note: run with TVM_BACKTRACE=1" for a TVMScript parse error
        # (it expects the diagnostic rendered already; in TVM 0.27 it lives only in the exception).
        if type(error).__name__ != "DiagnosticError":
            raise
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
