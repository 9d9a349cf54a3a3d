"""The one place that touches compiled kernels: find, check and load ``prebuilt/`` libraries.

Loading needs ``apache-tvm-ffi`` (which calls the kernels with torch tensors,
zero-copy through DLPack) and TVM's small runtime library shipped in
``prebuilt/runtime/`` (workspace for the CPU kernels, module loader for the CUDA
ones). The CPU kernels' parallel loops run on torch's OpenMP threads through
``prebuilt/runtime/liblongformer_openmp_launch.so`` (TVM's own thread pool when
torch does not use OpenMP, or with ``LONGFORMER_OPS_THREAD_POOL=tvm``). It never
imports the TVM compiler (``import tvm``) and never compiles anything. Libraries
are loaded lazily, on the first call for a (device, dtype), and cached.

Where the libraries are (:func:`prebuilt_dir`), first match wins:

1. ``$LONGFORMER_OPS_PREBUILT``, a directory holding ``manifest.json``;
2. the repository's ``<repo>/prebuilt/`` when the package sits in a checkout, i.e.
   ``<package>/../prebuilt/manifest.json`` and ``<package>/../tvm_kernels/`` exist
   (in the repository and with the editable install);
3. else the copy a wheel carries, ``<package>/prebuilt/`` (``site-packages/longformer_ops/prebuilt``).

Every library's sha256 is checked against the manifest before it is loaded. In a
checkout the libraries are also checked against the ``tvm_kernels/`` sources
(:class:`StaleKernelError`); an installed wheel has no sources, so the wheel build
refuses to package stale libraries instead (``setup.py``, :func:`_manifest.problems`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from longformer_ops.runtime import manifest as _manifest

PREBUILT_ENV = "LONGFORMER_OPS_PREBUILT"  # directory holding manifest.json (default: see above)
CPU_TARGET_ENV = "LONGFORMER_OPS_CPU_TARGET"  # force a CPU library, e.g. cpu-avx2 (default: best that runs)
THREAD_POOL_ENV = "LONGFORMER_OPS_THREAD_POOL"  # "openmp" (default, when torch uses OpenMP) or "tvm"
_FIX = "Run `make kernels` in the repository root to (re)build them."


class KernelNotAvailableError(NotImplementedError):
    """No usable prebuilt kernel for this device/dtype/machine (missing, foreign or not built)."""


class StaleKernelError(RuntimeError):
    """The prebuilt library was built from other sources than the ones in tvm_kernels/."""


@dataclass(frozen=True)
class KernelLibrary:
    name: str  # relative path in prebuilt/, e.g. "cpu-avx512/longformer_float32.so"
    device: str
    dtype: str
    feature_multiple: int  # head_dim the kernels accept must be a multiple of this
    module: object  # tvm_ffi.Module
    functions: frozenset[str] = frozenset()  # exported kernel names, from the manifest
    # Looked up once per name: a lookup makes a new function object each time (and, on CUDA, one with
    # an empty per-device kernel-handle cache).
    _looked_up: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def function(self, name: str):
        found = self._looked_up.get(name)
        if found is None:
            found = self._looked_up[name] = self.module[name]
        return found

    def has(self, name: str) -> bool:
        return name in self.functions


def prebuilt_dir() -> Path:
    """The directory the kernel libraries are loaded from (the rule is in the module docstring)."""
    override = os.environ.get(PREBUILT_ENV)
    return Path(override) if override else _default_prebuilt()


@functools.lru_cache(maxsize=None)
def _default_prebuilt() -> Path:
    return _manifest.default_prebuilt()  # (file checks: once, not on every kernel call)


@functools.lru_cache(maxsize=None)
def _manifest_or_raise(directory: Path) -> dict:
    manifest = _manifest.read(directory)
    if manifest is None:
        raise KernelNotAvailableError(
            f"no kernel manifest: expected {directory / _manifest.MANIFEST_NAME}, found nothing. {_FIX}"
        )
    if manifest.get("format") != _manifest.FORMAT_VERSION:
        raise KernelNotAvailableError(
            f"kernel manifest format {manifest.get('format')!r} in {directory}, expected "
            f"{_manifest.FORMAT_VERSION}. {_FIX}"
        )
    here = f"{sys.platform}-{platform.machine()}"
    if manifest.get("platform") != here:
        raise KernelNotAvailableError(
            f"prebuilt kernels in {directory} are for {manifest.get('platform')}, this machine is {here}. {_FIX}"
        )
    return manifest


def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo ("" if unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """CPU feature flags of this machine, as /proc/cpuinfo names them (empty if unknown)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo's vendor_id names it (GenuineIntel, AuthenticAMD; "" if unknown)."""
    return _cpuinfo("vendor_id")


# AMX's tile data is a state the Linux kernel gives a process only on request (since 5.16):
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); an AMX instruction before it is SIGILL.
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
AMX_FLAG = "amx_tile"  # a library listing it among its cpu_flags runs AMX instructions


@functools.lru_cache(maxsize=None)
def amx_permitted() -> bool:
    """Ask the kernel for this process's permission to use AMX tiles (once); whether it was given.
    Refused on kernels before 5.16 and where a hypervisor or seccomp forbids it."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def runs_here(entry: dict, flags: frozenset[str]) -> bool:
    """Whether a CPU library of the manifest runs on a CPU with ``flags``; for an AMX library
    this asks for (and needs) the permission to use the tiles (:func:`amx_permitted`)."""
    if not set(entry["cpu_flags"]) <= flags:
        return False
    return AMX_FLAG not in entry["cpu_flags"] or amx_permitted()


def _check_fresh(name: str, entry: dict) -> None:
    """Stale if the tvm_kernels/ sources next to us differ from those the library was built from."""
    inputs = entry.get("inputs", {})
    files = inputs.get("sources", [])
    if not files or not all((_manifest.KERNEL_SOURCES / f).exists() for f in files):
        return  # installed without sources: nothing to compare against (the wheel build checked)
    current = _manifest.sources_digest(_manifest.KERNEL_SOURCES, files)
    if current != inputs.get("sources_sha256"):
        raise StaleKernelError(
            f"prebuilt kernel {name} is stale: built from tvm_kernels sources with sha256 "
            f"{inputs.get('sources_sha256', '?')[:12]}, the sources here hash to {current[:12]}. {_FIX}"
        )


def _candidates(manifest: dict, device: str, dtype: str) -> list[tuple[str, dict]]:
    return [(n, e) for n, e in manifest["libraries"].items() if e["device"] == device and e["dtype"] == dtype]


def choose_library(
    manifest: dict, device: str, dtype: str, cuda_capability: tuple[int, int] | None = None
) -> tuple[str, dict]:
    """Pick the library for (device, dtype) that runs on this machine; raise saying why none does."""
    candidates = _candidates(manifest, device, dtype)
    if not candidates:
        have = sorted({(e["device"], e["dtype"]) for e in manifest["libraries"].values()})
        raise KernelNotAvailableError(
            f"no prebuilt kernel for device={device!r}, dtype={dtype}; available (device, dtype): {have}"
        )
    if device == "cpu":
        forced = os.environ.get(CPU_TARGET_ENV)
        if forced:
            chosen = [(n, e) for n, e in candidates if e["target"] == forced]
            if not chosen:
                raise KernelNotAvailableError(
                    f"{CPU_TARGET_ENV}={forced!r} but no such CPU library for {dtype}; "
                    f"have {[e['target'] for _, e in candidates]}"
                )
            candidates = chosen
        flags = cpu_flags()
        runnable = [(n, e) for n, e in candidates if set(e["cpu_flags"]) <= flags]
        if not runnable:
            missing = {e["target"]: sorted(set(e["cpu_flags"]) - flags) for _, e in candidates}
            raise KernelNotAvailableError(
                f"no prebuilt CPU kernel runs on this CPU: missing instruction sets per library {missing} "
                f"(the minimum is x86-64 with AVX2/FMA/F16C)"
            )
        if not forced:  # a library meant for other vendors' CPUs (its cpu_vendors) only where nothing else runs
            vendor = cpu_vendor()
            for_this_vendor = [(n, e) for n, e in runnable if not e.get("cpu_vendors") or vendor in e["cpu_vendors"]]
            runnable = for_this_vendor or runnable
        # Best first; an AMX library only once the kernel lets this process use the tiles.
        for name, entry in sorted(runnable, key=lambda item: -item[1]["preference"]):
            if runs_here(entry, flags):
                return name, entry
        raise KernelNotAvailableError(
            f"{[e['target'] for _, e in runnable]} need AMX, and Linux refused this process the permission to use "
            f"its tiles (arch_prctl ARCH_REQ_XCOMP_PERM: kernel 5.16 or newer, not forbidden by a hypervisor or "
            f"seccomp); unset {CPU_TARGET_ENV} to use another library"
        )
    if device == "cuda":
        name, entry = candidates[0]
        archs = sorted(int(a.removeprefix("sm_")) for a in entry["cuda_archs"])
        if cuda_capability is not None and cuda_capability[0] * 10 + cuda_capability[1] < archs[0]:
            raise KernelNotAvailableError(
                f"{name} holds code for {entry['cuda_archs']} (and PTX for newer GPUs); this GPU is "
                f"sm_{cuda_capability[0]}{cuda_capability[1]}, older than sm_{archs[0]}"
            )
        return name, entry
    raise KernelNotAvailableError(f"no prebuilt kernels for device type {device!r}; supported: cpu, cuda")


_lock = threading.Lock()
_runtime_loaded: set[str] = set()


THREADS_ENV = "TVM_NUM_THREADS"


def _match_torch_threads() -> None:
    """Give TVM's CPU thread pool as many threads as torch uses, unless the user chose.

    TVM reads ``TVM_NUM_THREADS`` when its pool starts (the first parallel kernel call).
    Without it, TVM assumes x86 cores are hyper-threaded and takes half of them, so on a
    2-core machine every kernel ran on one core.
    """
    if THREADS_ENV not in os.environ:
        import torch

        os.environ[THREADS_ENV] = str(torch.get_num_threads())


def _load_runtime(directory: Path, manifest: dict, cuda: bool) -> None:
    """Load TVM's runtime libraries globally, once, before any kernel library."""
    import tvm_ffi  # noqa: F401  (provides libtvm_ffi.so, which the runtime links)

    _match_torch_threads()

    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if cuda else [])
    for name in names:
        if name in _runtime_loaded:
            continue
        path = directory / "runtime" / name
        if name not in manifest.get("runtime", {}) or not path.exists():
            raise KernelNotAvailableError(f"TVM runtime library missing: expected {path}. {_FIX}")
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded.add(name)


def thread_pool() -> str:
    """Where the CPU kernels' parallel loops run: "openmp" (torch's threads) or "tvm" (TVM's pool)."""
    choice = os.environ.get(THREAD_POOL_ENV, "openmp")
    if choice not in ("openmp", "tvm"):
        raise ValueError(f"{THREAD_POOL_ENV} must be 'openmp' or 'tvm', got {choice!r}")
    if choice == "openmp":
        import torch

        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return "tvm"  # nothing to share: torch runs its ops on another thread pool
    return choice


def _run_on_torch_openmp(directory: Path, library: Path) -> None:
    """Point a CPU library's parallel-launch slot at our OpenMP launcher (see openmp_launch.c).

    TVM's pool and torch's OpenMP workers on the same cores contend: right after a torch op
    its workers spin for milliseconds while TVM's run. The launcher links
    libgomp.so.1, which resolves to the copy torch already loaded, so both share one pool.
    """
    launcher = directory / "runtime" / _manifest.OPENMP_LAUNCH_LIBRARY
    if not launcher.exists():
        raise KernelNotAvailableError(
            f"OpenMP launcher missing: expected {launcher}. {_FIX} (or set {THREAD_POOL_ENV}=tvm)"
        )
    launch = ctypes.cast(ctypes.CDLL(str(launcher)).longformer_parallel_launch, ctypes.c_void_p).value
    # The same file is already open (tvm_ffi loaded it): dlopen returns that handle.
    slot = ctypes.c_void_p.in_dll(ctypes.CDLL(str(library)), "__TVMBackendParallelLaunch")
    slot.value = launch


@functools.lru_cache(maxsize=None)
def _load(directory: Path, name: str) -> object:
    import tvm_ffi

    module = tvm_ffi.load_module(str(directory / name))
    if name.startswith("cpu-") and thread_pool() == "openmp":
        _run_on_torch_openmp(directory, directory / name)
    return module


def library_for(device, dtype_name: str) -> KernelLibrary:
    """The loaded kernel library for a torch device and a dtype name like 'float32' (cached)."""
    return _library_for(prebuilt_dir(), device.type, device.index, dtype_name, os.environ.get(CPU_TARGET_ENV))


@functools.lru_cache(maxsize=None)
def _library_for(directory: Path, device_type: str, device_index, dtype_name: str, _forced_cpu) -> KernelLibrary:
    manifest = _manifest_or_raise(directory)
    capability = None
    if device_type == "cuda":
        import torch

        torch.cuda.init()  # also puts torch's libcudart.so.13 in the process for libtvm_runtime_cuda
        capability = torch.cuda.get_device_capability(device_index)
    name, entry = choose_library(manifest, device_type, dtype_name, capability)
    _check_fresh(name, entry)
    path = directory / name
    if not path.exists():
        raise KernelNotAvailableError(f"prebuilt kernel library missing: expected {path}. {_FIX}")
    if _manifest.file_sha256(path) != entry["sha256"]:
        raise KernelNotAvailableError(
            f"{path} does not match its manifest entry (sha256 {entry['sha256'][:12]}...): "
            f"it was replaced or corrupted. {_FIX}"
        )
    with _lock:
        _load_runtime(directory, manifest, cuda=device_type == "cuda")
        module = _load(directory, name)
    return KernelLibrary(
        name, device_type, dtype_name, entry["feature_multiple"], module, frozenset(entry["functions"])
    )
