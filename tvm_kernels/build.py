"""Ahead-of-time build of every kernel library into ``prebuilt/`` (what ``make kernels`` runs).

    python -m tvm_kernels.build [--targets cpu-avx2,cpu-avx512,cuda] [--dtypes float32,...]
                                [--out prebuilt] [--force] [--jobs N]

For each (target, dtype) in :data:`tvm_kernels.variants.TARGETS` it schedules
(or takes hand-written) the PrimFuncs of the target's ops, compiles them into one shared
library and records it in ``manifest.json``. A library is rebuilt only when its
inputs changed: the sources it is built from (hashed), the TVM version, and for
CUDA the nvcc version. It also copies TVM's small runtime libraries next to the
kernels (``runtime/``), so that loading needs only ``apache-tvm-ffi``, not the
TVM compiler, and compiles ``openmp_launch.c`` there (the CPU kernels' parallel
loops on torch's OpenMP threads; see that file).

TVM compiles on one core, so the libraries are compiled by a pool of worker processes
(``--jobs``, default: the cores this process may use, at most 8), and each CPU library in
:data:`CPU_LIBRARY_PIECES` pieces of its functions, one object file each, linked into the one
shared library as TVM's own export links its single object: a lone library (one dtype after
an edit) is then no slower to rebuild than a full set per core. The split does not depend on
the machine, so neither do the libraries' bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from longformer_ops.runtime import manifest as _manifest
from tvm_kernels import variants
from tvm_kernels.variants import function_name

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


# A CPU library's functions are compiled in this many groups, each in a worker process of its own
# (TVM compiles on one core): a fixed number, so that the objects linked, and the library's bytes,
# do not depend on the machine that built it. CUDA libraries stay whole (one device blob each).
CPU_LIBRARY_PIECES = 4
MAX_DEFAULT_JOBS = 8  # each worker holds a TVM compiler (0.55-0.6 GiB at its peak, measured)


class PieceError(Exception):
    """A worker's failure, with its message and traceback as text (TVM's errors do not pickle)."""


def _functions_of(target: variants.KernelTarget) -> list[tuple[str, str, bool | None]]:
    """(symbol, op, autoregressive) of every function a library of ``target`` holds, in build order;
    autoregressive None for the ops without a band variant (one function each)."""
    entries = []
    for op in target.ops:
        if op in _manifest.UNBANDED_OPS:
            entries.append((op, op, None))
        else:
            entries += [(function_name(op, autoregressive), op, autoregressive) for autoregressive in (False, True)]
    return entries


def _pieces_of(target: variants.KernelTarget) -> list[list[tuple[str, str, bool | None]]]:
    """The library's functions in the groups compiled apart: every CPU_LIBRARY_PIECES-th function in
    one (a band op's symmetric and causal variants, which cost about the same, in different ones)."""
    entries = _functions_of(target)
    if target.device == "cuda":
        return [entries]
    count = min(CPU_LIBRARY_PIECES, len(entries))
    return [entries[start::count] for start in range(count)]


def _compile_piece(target_name: str, dtype: str, entries: list, destination: str) -> float:
    """In a worker: compile ``entries`` of one library to ``destination``, an object file (CPU) or the
    whole shared library (CUDA, which TVM's export packs with its device code). Returns seconds."""
    started = time.perf_counter()
    try:
        import tvm

        from tvm_kernels.compute import DEFINITIONS

        target = variants.TARGETS[target_name]
        schedules = _schedule_module(target)
        hand_written = getattr(schedules, "HAND_WRITTEN", {})  # ops whose kernel the module writes in TIR itself
        functions = {}
        for name, op, autoregressive in entries:
            if autoregressive is None:  # no band, no variants: hand-written, (dtype, isa)
                scheduled = hand_written[op](dtype, target.isa)
            elif op in hand_written:
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
        if target.device == "cuda":
            executable.export_library(destination)
        else:
            # What export_library writes for a host module without imports, before it links it.
            assert not executable.mod.imports, "a CPU library with device code"
            executable.mod.write_to_file(destination)
    except Exception as error:
        raise PieceError(
            f"{variants.library_name(variants.TARGETS[target_name], dtype)} "
            f"({', '.join(name for name, _, _ in entries)}): {type(error).__name__}: {error}\n"
            f"{traceback.format_exc()}"
        ) from None
    return time.perf_counter() - started


def _start_worker(cuda_target: str | None) -> None:
    if cuda_target is not None:  # before the worker imports tvm
        _prepare_cuda_callback(variants.TARGETS[cuda_target])


def _link(objects: list[Path], path: Path) -> None:
    """A CPU library's pieces into one shared library, as TVM's export_library links its object."""
    from tvm.support import cc

    tmp = path.with_name(path.name + ".tmp.so")
    cc.create_shared(str(tmp), [str(p) for p in objects])
    tmp.replace(path)


def default_jobs() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_JOBS))


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
        subprocess.run(
            [compiler, "-O2", "-fPIC", "-shared", "-fopenmp", str(HERE / "openmp_launch.c"), "-o", str(built)],
            check=True,
        )
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


def build(targets: list[str], dtypes: list[str] | None, out: Path, force: bool = False, jobs: int | None = None) -> int:
    """Build the stale libraries of ``targets`` x ``dtypes`` into ``out`` with ``jobs`` worker processes
    (default :func:`default_jobs`); returns how many were built."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest.read(out) or {}
    libraries = manifest.get("libraries", {})
    chosen = [variants.TARGETS[name] for name in targets]
    wanted = [(t, d) for t in chosen for d in t.dtypes if dtypes is None or d in dtypes]

    nvcc_version = None
    if any(t.device == "cuda" for t in chosen):
        from tvm_kernels import cuda_toolchain

        nvcc_version = cuda_toolchain.nvcc_version(cuda_toolchain.find_nvcc())

    def up_to_date(name, target, dtype) -> bool:
        entry, path = libraries.get(name), out / name
        return (
            not force
            and entry is not None
            and entry.get("inputs") == _inputs_of(target, dtype, nvcc_version)
            and path.exists()
            and entry.get("sha256") == _manifest.file_sha256(path)
        )

    stale = []  # (label, manifest key, target, dtype) of each library to build
    for index, (target, dtype) in enumerate(wanted, start=1):
        name = variants.library_name(target, dtype)
        label = f"[{index}/{len(wanted)}] {name}"
        if up_to_date(name, target, dtype):
            print(f"{label}: up to date", flush=True)
        else:
            stale.append((label, name, target, dtype))
    if stale:
        jobs = jobs or default_jobs()
        cuda_stale = [target.name for _, _, target, _ in stale if target.device == "cuda"]
        started = time.perf_counter()
        with (
            tempfile.TemporaryDirectory(prefix="longformer-kernels-") as scratch,
            concurrent.futures.ProcessPoolExecutor(
                max_workers=jobs,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(cuda_stale[0] if cuda_stale else None,),
            ) as pool,
        ):
            pending = {}  # library index -> futures of its pieces, in order
            # CUDA's libraries first: each is one long piece (nvcc), which would otherwise end the build alone.
            stale.sort(key=lambda library: library[2].device != "cuda")
            for index, (label, name, target, dtype) in enumerate(stale):
                pieces = _pieces_of(target)
                path = out / name
                path.parent.mkdir(parents=True, exist_ok=True)
                destinations = (
                    [path.with_name(path.name + ".tmp.so")]
                    if target.device == "cuda"
                    else [Path(scratch) / f"{index}-{piece}.o" for piece in range(len(pieces))]
                )
                print(
                    f"{label}: building {sum(map(len, pieces))} functions for {target.tvm_target} "
                    f"({len(pieces)} piece{'s' * (len(pieces) > 1)}) ...",
                    flush=True,
                )
                pending[index] = (
                    [
                        pool.submit(_compile_piece, target.name, dtype, entries, str(destination))
                        for entries, destination in zip(pieces, destinations)
                    ],
                    destinations,
                )
            remaining = {future: index for index, (futures, _) in pending.items() for future in futures}
            try:
                while remaining:
                    done, _ = concurrent.futures.wait(remaining, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in done:
                        future.result()  # a worker's PieceError stops the build here
                        index = remaining.pop(future)
                        futures, destinations = pending[index]
                        if any(f in remaining for f in futures):
                            continue
                        label, name, target, dtype = stale[index]
                        if target.device == "cuda":
                            destinations[0].replace(out / name)
                        else:
                            _link(destinations, out / name)
                        libraries[name] = _entry(target, dtype, out / name, _inputs_of(target, dtype, nvcc_version))
                        _write_manifest(out, manifest, libraries)  # keep progress if a later build fails
                        seconds = sum(f.result() for f in futures)
                        print(
                            f"{label}: built ({seconds:.1f} s of compiling; {time.perf_counter() - started:.0f} s "
                            f"since the start)",
                            flush=True,
                        )
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    need_cuda = any(entry["device"] == "cuda" for entry in libraries.values())
    manifest["runtime"] = _prepare_runtime(out, need_cuda)
    manifest["openmp_launch_source_sha256"] = _manifest.file_sha256(HERE / "openmp_launch.c")
    _write_manifest(out, manifest, libraries)
    print(
        f"{len(stale)} built, {len(wanted) - len(stale)} up to date; manifest: {out / _manifest.MANIFEST_NAME}",
        flush=True,
    )
    return len(stale)


def _entry(target: variants.KernelTarget, dtype: str, path: Path, inputs: dict) -> dict:
    """A built library's manifest entry."""
    return {
        "target": target.name,
        "device": target.device,
        "dtype": dtype,
        "functions": [symbol for symbol, _, _ in _functions_of(target)],
        # The schedule's contract on head_dim (its feature loops are split without a guard).
        "feature_multiple": _schedule_module(target).FEATURE_MULTIPLE,
        "preference": target.preference,
        "cpu_flags": list(target.cpu_flags),
        "cpu_vendors": list(target.cpu_vendors),
        "cuda_archs": list(target.cuda_archs),
        "inputs": inputs,
        "sha256": _manifest.file_sha256(path),
    }


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
    parser.add_argument(
        "--targets", default=",".join(variants.TARGETS), help="comma-separated targets (default: %(default)s)"
    )
    parser.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: all of each target)")
    parser.add_argument("--out", type=Path, default=_manifest.DEFAULT_PREBUILT, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"worker processes (default: this machine's cores, at most {MAX_DEFAULT_JOBS})",
    )
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in variants.TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {list(variants.TARGETS)}")
    try:
        build(targets, args.dtypes.split(",") if args.dtypes else None, args.out, args.force, args.jobs)
    except PieceError as error:  # a worker's: its message and traceback as text
        print(f"\n{error}", file=sys.stderr)
        return 1
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
