"""Build-time CUDA support: device code as a multi-arch fatbin, on machines with no GPU.

TVM only routes CUDA code through its compile callback when its CUDA runtime
library (``libtvm_runtime_cuda.so``) is loaded, and that library links the
driver (``libcuda.so.1``) and ``libcudart.so.13``. Without a driver TVM would
store CUDA *source* in the library, which needs a compiler at load time. So on a
build machine without a driver we compile a stand-in ``libcuda.so.1`` whose
functions all return CUDA_ERROR_NO_DEVICE (the role of the toolkit's "stubs"),
preload it and the toolkit's cudart, and then let
``tvm_callback_cuda_compile`` call nvcc for a fatbin: SASS for every listed
arch plus PTX of the newest, for GPUs newer than the list. Nothing here is
used at run time.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Driver entry points libtvm_runtime_cuda.so imports (nm -D --undefined-only).
_DRIVER_SYMBOLS = (
    "cuInit",
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)
_CUDA_ERROR_NO_DEVICE = 100


def find_nvcc() -> Path:
    # The toolkit's own nvcc first: its location tells where libcudart lives (PATH may hold a wrapper).
    candidates = [os.environ.get("CUDA_HOME", "") + "/bin/nvcc", "/usr/local/cuda/bin/nvcc", shutil.which("nvcc") or ""]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    raise FileNotFoundError(
        "nvcc not found (looked at $CUDA_HOME/bin, PATH, /usr/local/cuda/bin): CUDA kernels need the "
        "CUDA 13 toolkit at build time. Build CPU kernels only with `make kernels TARGETS=cpu`."
    )


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _find_cudart(nvcc: Path) -> Path:
    root = nvcc.parent.parent
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        path = root / sub / "libcudart.so.13"
        if path.exists():
            return path
    raise FileNotFoundError(f"libcudart.so.13 not found under {root}: a CUDA 13 toolkit is required")


def _build_driver_stand_in(directory: Path) -> Path:
    source = directory / "cuda_stand_in.c"
    body = "\n".join(f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for name in _DRIVER_SYMBOLS)
    source.write_text("/* Build-time stand-in for libcuda.so.1: no device. */\n" + body + "\n")
    library = directory / "libcuda.so.1"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)], check=True)
    return library


_prepared = False


def prepare_tvm_for_cuda_builds() -> None:
    """Make ``import tvm`` register its CUDA runtime on this machine. Call before importing tvm."""
    global _prepared
    if _prepared:
        return
    import sys

    if "tvm" in sys.modules:
        raise RuntimeError("prepare_tvm_for_cuda_builds() must run before `import tvm`")
    nvcc = find_nvcc()
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)  # a real driver, if there is one
    except OSError:
        stand_in = _build_driver_stand_in(Path(tempfile.mkdtemp(prefix="longformer-cuda-stand-in-")))
        ctypes.CDLL(str(stand_in), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(_find_cudart(nvcc)), mode=ctypes.RTLD_GLOBAL)
    _prepared = True


def compile_fatbin(code: str, archs: list[str]) -> bytes:
    """nvcc ``code`` into a fatbin with SASS for each ``sm_XY`` in ``archs`` and PTX for the newest."""
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="longformer-nvcc-") as tmp:
        source, fatbin = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        source.write_text(code)
        command = [str(nvcc), "--fatbin", "-O3", "-o", str(fatbin), str(source)]
        for arch in archs:
            number = arch.removeprefix("sm_")
            command += ["-gencode", f"arch=compute_{number},code=sm_{number}"]
        newest = max(archs, key=lambda a: int(a.removeprefix("sm_"))).removeprefix("sm_")
        command += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(command)}):\n{result.stderr}")
        return fatbin.read_bytes()


_FATBIN_MAGIC = 0xBA55ED50
_FATBIN_KINDS = {1: "ptx", 2: "sass"}


def device_code_in(library: Path) -> list[tuple[str, str]]:
    """``[(kind, arch)]`` of every fatbin entry embedded in a shared library, e.g. ``("sass", "sm_90")``.

    Reads the fatbin container format directly (cuobjdump is not always installed):
    a 16-byte header (magic, version, header size, payload size) followed by
    entries whose headers give the kind (1 PTX, 2 ELF/SASS), their own size, the
    payload size and, at byte 28, the SM version.
    """
    import struct

    data = Path(library).read_bytes()
    entries = []
    start = data.find(struct.pack("<I", _FATBIN_MAGIC))
    while start != -1:
        _, _, header_size, payload_size = struct.unpack_from("<IHHQ", data, start)
        position, end = start + header_size, start + header_size + payload_size
        while position < end:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, position)
            (sm,) = struct.unpack_from("<I", data, position + 28)
            entries.append((_FATBIN_KINDS.get(kind, f"kind{kind}"), f"sm_{sm}"))
            position += entry_header + entry_size
        start = data.find(struct.pack("<I", _FATBIN_MAGIC), end)
    return entries
