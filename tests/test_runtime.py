"""The loader: lazy, compiler-free loading, and clear errors for missing, stale or foreign libraries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from longformer_ops import diagonaled_mm
from longformer_ops.runtime import loader as _loader
from longformer_ops.runtime import manifest as _manifest


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with this environment plus ``env``, less the TVM thread count
    the loader exported in this process (from torch's thread count when a library was first
    loaded here, 1 if that was inside a single-threaded test module): the child chooses its own."""
    inherited = {k: v for k, v in os.environ.items() if k != _loader.THREADS_ENV}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**inherited, **env}, cwd=_manifest.REPO_ROOT
    )


def test_import_and_kernel_run_never_load_the_tvm_compiler():
    result = _run_python(
        "import sys, torch, longformer_ops\n"
        "assert 'tvm' not in sys.modules and 'tvm_ffi' not in sys.modules, 'import must load nothing compiled'\n"
        "q = torch.randn(1, 33, 2, 16)\n"
        "longformer_ops.diagonaled_mm(q, q, 4, 1)\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'tvm' not in sys.modules, 'the TVM compiler package was imported'\n"
        "assert 'libtvm_compiler' not in maps, 'libtvm_compiler.so was mapped'\n"
        "assert 'libtvm_runtime.so' in maps\n"
        "print('ok')\n"
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


_THREADS_PROBE = (
    "import torch, tvm_ffi, longformer_ops\n"
    "q = torch.randn(1, 64, 4, 16)\n"
    "longformer_ops.diagonaled_mm(q, q, 4, 1)\n"
    "print(torch.get_num_threads(), tvm_ffi.get_global_func('runtime.NumThreads')())\n"
)


def test_kernels_use_as_many_threads_as_torch():
    # TVM on its own takes half the cores on x86 (it assumes hyper-threading).
    result = _run_python(_THREADS_PROBE)
    assert result.returncode == 0, result.stderr
    torch_threads, tvm_threads = map(int, result.stdout.split())
    assert tvm_threads == min(torch_threads, os.cpu_count()) > 0


def test_an_explicit_tvm_thread_count_is_respected():
    result = _run_python(_THREADS_PROBE, **{_loader.THREADS_ENV: "1"})
    assert result.returncode == 0 and result.stdout.split()[1] == "1", result.stderr


_POOL_PROBE = (
    "import ctypes, os, torch, longformer_ops\n"
    "from longformer_ops.runtime import loader as _loader, manifest as _manifest\n"
    "torch.randn(1 << 20).mul_(2)  # torch's OpenMP threads exist from here on\n"
    "threads_before = len(os.listdir('/proc/self/task'))\n"
    "q = torch.randn(1, 64, 4, 16)\n"
    "longformer_ops.diagonaled_mm(q, q, 4, 1)\n"
    "library = _loader.library_for(q.device, 'float32')\n"
    "path = str(_loader.prebuilt_dir() / library.name)\n"
    "slot = ctypes.c_void_p.in_dll(ctypes.CDLL(path), '__TVMBackendParallelLaunch').value\n"
    "ours = ctypes.CDLL(str(_loader.prebuilt_dir() / 'runtime' / _manifest.OPENMP_LAUNCH_LIBRARY))\n"
    "print(slot == ctypes.cast(ours.longformer_parallel_launch, ctypes.c_void_p).value,\n"
    "      len(os.listdir('/proc/self/task')) - threads_before,\n"
    "      len({line.split()[-1] for line in open('/proc/self/maps') if 'libgomp' in line}))\n"
)


def test_cpu_kernels_run_on_torchs_openmp_threads():
    """Our launcher, not TVM's pool (which contends with torch's spinning OpenMP workers): no new
    thread is started, and the launcher shares torch's libgomp (one copy in the process)."""
    result = _run_python(_POOL_PROBE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0", "1"]


@pytest.mark.skipif(os.cpu_count() < 2, reason="TVM starts no worker thread on one core")
def test_tvm_thread_pool_on_request():
    result = _run_python(_POOL_PROBE, **{_loader.THREAD_POOL_ENV: "tvm"})
    assert result.returncode == 0, result.stderr
    ours, new_threads, _ = result.stdout.split()
    assert ours == "False" and int(new_threads) > 0


def test_thread_pool_setting_is_checked(monkeypatch):
    monkeypatch.setenv(_loader.THREAD_POOL_ENV, "tbb")
    with pytest.raises(ValueError, match=r"LONGFORMER_OPS_THREAD_POOL must be 'openmp' or 'tvm', got 'tbb'"):
        _loader.thread_pool()


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 300, 3, 64, generator=g), torch.randn(2, 300, 3, 64, generator=g)
    expected = diagonaled_mm(q, k, 20, [1, 2, 5])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(diagonaled_mm(q, k, 20, [1, 2, 5]), expected)
    finally:
        torch.set_num_threads(threads)


def _copy_prebuilt(tmp_path, edit=None):
    target = tmp_path / "prebuilt"
    shutil.copytree(_manifest.DEFAULT_PREBUILT, target)
    if edit:
        manifest = json.loads((target / "manifest.json").read_text())
        edit(manifest, target)
        (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def _call_with_prebuilt(monkeypatch, directory):
    monkeypatch.setenv(_loader.PREBUILT_ENV, str(directory))
    _loader._library_for.cache_clear()
    _loader._manifest_or_raise.cache_clear()
    try:
        q = torch.randn(1, 9, 2, 16)
        return diagonaled_mm(q, q, 2, 1)
    finally:
        _loader._library_for.cache_clear()
        _loader._manifest_or_raise.cache_clear()


def test_kernel_functions_are_looked_up_once():
    """A lookup in the module makes a new function object (on CUDA with an empty kernel-handle
    cache); the library hands out the first one every time, and still raises for a missing name."""
    library = _loader.library_for(torch.device("cpu"), "float32")
    name = _manifest.function_name("qk", False)
    assert library.function(name) is library.function(name)
    with pytest.raises(AttributeError, match="no_such_kernel"):
        library.function("no_such_kernel")


def test_missing_manifest(tmp_path, monkeypatch):
    with pytest.raises(
        _loader.KernelNotAvailableError, match=r"no kernel manifest: expected .*manifest.json.*make kernels"
    ):
        _call_with_prebuilt(monkeypatch, tmp_path)


def test_missing_library(tmp_path, monkeypatch):
    directory = _copy_prebuilt(tmp_path)
    for path in directory.glob("cpu-*/longformer_float32.so"):
        path.unlink()
    with pytest.raises(
        _loader.KernelNotAvailableError,
        match=r"prebuilt kernel library missing: expected .*longformer_float32.so.*make kernels",
    ):
        _call_with_prebuilt(monkeypatch, directory)


def test_stale_library(tmp_path, monkeypatch):
    def edit(manifest, _):
        for entry in manifest["libraries"].values():
            entry["inputs"]["sources_sha256"] = "0" * 64

    directory = _copy_prebuilt(tmp_path, edit)
    with pytest.raises(
        _loader.StaleKernelError,
        match=r"is stale: built from tvm_kernels sources with sha256 000000000000.*make kernels",
    ):
        _call_with_prebuilt(monkeypatch, directory)


def test_missing_openmp_launcher(tmp_path, monkeypatch):
    directory = _copy_prebuilt(tmp_path)
    (directory / "runtime" / _manifest.OPENMP_LAUNCH_LIBRARY).unlink()
    _loader._load.cache_clear()
    with pytest.raises(
        _loader.KernelNotAvailableError,
        match=r"OpenMP launcher missing: expected .*liblongformer_openmp_launch.so.*make kernels.*THREAD_POOL=tvm",
    ):
        _call_with_prebuilt(monkeypatch, directory)


def test_foreign_platform(tmp_path, monkeypatch):
    directory = _copy_prebuilt(tmp_path, lambda m, _: m.update(platform="darwin-arm64"))
    with pytest.raises(_loader.KernelNotAvailableError, match=r"are for darwin-arm64, this machine is linux-x86_64"):
        _call_with_prebuilt(monkeypatch, directory)


def test_foreign_cpu(tmp_path, monkeypatch):
    def edit(manifest, _):
        for entry in manifest["libraries"].values():
            entry["cpu_flags"].append("imaginary_isa")

    directory = _copy_prebuilt(tmp_path, edit)
    with pytest.raises(
        _loader.KernelNotAvailableError, match=r"no prebuilt CPU kernel runs on this CPU: missing .*imaginary_isa"
    ):
        _call_with_prebuilt(monkeypatch, directory)


def test_replaced_library(tmp_path, monkeypatch):
    directory = _copy_prebuilt(tmp_path)
    for path in directory.glob("cpu-*/longformer_float32.so"):
        shutil.copy(directory / "cpu-avx2" / "longformer_float64.so", path)
    with pytest.raises(_loader.KernelNotAvailableError, match=r"does not match its manifest entry"):
        _call_with_prebuilt(monkeypatch, directory)


def test_old_gpu_is_named():
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    with pytest.raises(_loader.KernelNotAvailableError, match=r"this GPU is sm_75, older than sm_80"):
        _loader.choose_library(manifest, "cuda", "float32", cuda_capability=(7, 5))
    name, _ = _loader.choose_library(manifest, "cuda", "float32", cuda_capability=(10, 0))  # newer: PTX
    assert name == "cuda/longformer_float32.so"


_AVX2_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    "vendor, flags, dtype, expected",
    [
        ("AuthenticAMD", _AVX2_FLAGS, "float32", "cpu-avx2"),
        (
            "AuthenticAMD",
            _AVX2_FLAGS | {"avx512_bf16"},
            "bfloat16",
            "cpu-avx2",
        ),  # BF16 without AVX-512 foundation: not enough
        ("GenuineIntel", _AVX512_FLAGS, "float32", "cpu-avx512"),
        ("GenuineIntel", _AVX512_FLAGS, "bfloat16", "cpu-avx512"),  # Skylake-X / Ice Lake: AVX-512 without BF16
        ("AuthenticAMD", _AVX512_FLAGS | {"avx512_bf16"}, "bfloat16", "cpu-avx512-bf16"),  # Zen 4 and 5
        (
            "AuthenticAMD",
            _AVX512_FLAGS | {"avx512_bf16"},
            "float32",
            "cpu-avx512",
        ),  # the bf16 library holds bfloat16 only
        # Emerald Rapids (measured; Intel's other AVX512-BF16 cores assumed alike): vdpbf16ps at half the FMAs' rate
        ("GenuineIntel", _AVX512_FLAGS | {"avx512_bf16", "avx512_fp16"}, "bfloat16", "cpu-avx512"),
        ("", _AVX512_FLAGS | {"avx512_bf16"}, "bfloat16", "cpu-avx512"),  # vendor unknown: the library for any
        ("GenuineIntel", _AVX512_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"}, "float16", "cpu-avx512"),
        ("GenuineIntel", _AVX512_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"}, "float32", "cpu-avx512"),
        (
            "GenuineIntel",
            _AVX512_FLAGS | {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"},
            "bfloat16",
            "cpu-amx",
        ),
        (
            "GenuineIntel",
            _AVX512_FLAGS | {"avx512_bf16", "amx_int8", "amx_tile"},
            "bfloat16",
            "cpu-avx512",
        ),  # tiles without bf16
    ],
)
def test_loader_picks_the_library_for_the_cpu(monkeypatch, vendor, flags, dtype, expected):
    monkeypatch.setattr(_loader, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(_loader, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(_loader, "amx_permitted", lambda: True)  # as Linux 5.16+ answers on such a CPU
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    name, _ = _loader.choose_library(manifest, "cpu", dtype)
    assert name == f"{expected}/longformer_{dtype}.so"


def test_a_library_for_other_vendors_runs_where_it_is_the_only_one_or_forced(monkeypatch):
    """cpu_vendors is a preference, not a requirement: forced, or the only library that runs, it runs."""
    monkeypatch.setattr(_loader, "cpu_flags", lambda: frozenset(_AVX512_FLAGS | {"avx512_bf16"}))
    monkeypatch.setattr(_loader, "cpu_vendor", lambda: "GenuineIntel")
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-avx512-bf16")
    assert _loader.choose_library(manifest, "cpu", "bfloat16")[0] == "cpu-avx512-bf16/longformer_bfloat16.so"
    monkeypatch.delenv(_loader.CPU_TARGET_ENV)
    only = {
        **manifest,
        "libraries": {n: e for n, e in manifest["libraries"].items() if e["target"] == "cpu-avx512-bf16"},
    }
    assert _loader.choose_library(only, "cpu", "bfloat16")[0] == "cpu-avx512-bf16/longformer_bfloat16.so"


_AMX_FLAGS = _AVX512_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"}


def test_amx_library_only_with_the_kernels_permission(monkeypatch):
    """Flags are not enough for AMX: Linux must give the process the tiles' state (else SIGILL).
    Refused, the next library runs; forced, the error says why."""
    monkeypatch.setattr(_loader, "cpu_flags", lambda: frozenset(_AMX_FLAGS))
    monkeypatch.setattr(_loader, "cpu_vendor", lambda: "GenuineIntel")
    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    asked = []
    monkeypatch.setattr(_loader, "amx_permitted", lambda: asked.append(1) or False)
    assert _loader.choose_library(manifest, "cpu", "bfloat16")[0] == "cpu-avx512/longformer_bfloat16.so"
    assert asked
    asked.clear()
    assert _loader.choose_library(manifest, "cpu", "float32")[0] == "cpu-avx512/longformer_float32.so"
    assert not asked  # no AMX library for float32: not asked
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-amx")
    with pytest.raises(
        _loader.KernelNotAvailableError, match=r"\['cpu-amx'\] need AMX, and Linux refused this process"
    ):
        _loader.choose_library(manifest, "cpu", "bfloat16")


@pytest.mark.skipif("amx_tile" not in _loader.cpu_flags(), reason="this CPU has no AMX")
def test_amx_permission_is_given_on_an_amx_cpu():
    assert _loader.amx_permitted()  # the syscall, for real (Linux 5.16+)
    assert _loader.amx_permitted()  # asked once, remembered


def test_forced_cpu_target_is_used(monkeypatch):
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-avx2")
    library = _loader.library_for(torch.device("cpu"), "float32")
    assert library.name == "cpu-avx2/longformer_float32.so"
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-sse2")
    with pytest.raises(
        _loader.KernelNotAvailableError, match=r"LONGFORMER_OPS_CPU_TARGET='cpu-sse2' but no such CPU library"
    ):
        _loader.library_for(torch.device("cpu"), "float32")


def _info(*args):
    result = subprocess.run(
        [sys.executable, "-m", "longformer_ops.info", *args], capture_output=True, text=True, cwd=_manifest.REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_info_fits_one_screen():
    """Per (device, dtype) the library chosen and why, then kernel families x (device, dtype): one screen."""
    out = _info()
    assert len(out.splitlines()) <= 40, out
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        assert re.search(
            rf"^cpu +{dtype} +cpu-[a-z0-9-]+/longformer_{dtype}\.so +best that runs here", out, re.MULTILINE
        )
    assert (
        re.search(r"^cuda +float32 +- +no CUDA device visible to torch", out, re.MULTILINE) or torch.cuda.is_available()
    )
    assert re.search(r"^band_products: qk pv transposed +yes +yes +yes +yes ", out, re.MULTILINE), out
    assert (
        re.search(r"^layer_norm: layer_norm layer_norm_backward +yes +yes +yes +yes +\. +\. +\.$", out, re.MULTILINE)
        or torch.cuda.is_available()
    ), out
    if "amx_tile" in _loader.cpu_flags():  # whether the AMX library can run here, said up front
        assert re.search(r"^CPU: .*amx_tile.*, AMX (permitted|refused by Linux)", out, re.MULTILINE)


def test_info_verbose_lists_every_kernel():
    out = _info("--verbose")
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        assert re.search(rf"^qk_symmetric +cpu +{dtype} ", out, re.MULTILINE)
        assert re.search(rf"^attention_backward_causal +cpu +{dtype} ", out, re.MULTILINE)
    assert "transposed_causal" in out and "cuda" in out


def test_info_says_why_better_libraries_were_passed_over(monkeypatch):
    """Each reason the loader has, whatever this CPU: missing instructions, another vendor's library,
    AMX refused by Linux, a forced target."""
    from longformer_ops import info

    manifest = _loader._manifest_or_raise(_loader.prebuilt_dir())
    monkeypatch.setattr(_loader, "cpu_flags", lambda: frozenset(_AVX2_FLAGS))
    assert (
        info._why(manifest, "cpu", "float32", "cpu-avx2")
        == "best that runs here (cpu-avx512 needs avx512bw avx512cd avx512dq avx512f avx512vl)"
    )
    monkeypatch.setattr(_loader, "cpu_flags", lambda: frozenset(_AMX_FLAGS))
    monkeypatch.setattr(_loader, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(_loader, "amx_permitted", lambda: False)
    assert (
        info._why(manifest, "cpu", "bfloat16", "cpu-avx512")
        == "best that runs here (cpu-amx: Linux refused AMX; cpu-avx512-bf16 is for AuthenticAMD CPUs)"
    )
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-avx2")
    assert info._why(manifest, "cpu", "bfloat16", "cpu-avx2") == f"forced by {_loader.CPU_TARGET_ENV}"


def test_committed_prebuilt_matches_sources():
    """prebuilt/ must be rebuilt (`make kernels`) and committed whenever tvm_kernels/ changes."""
    manifest = _manifest.read(_manifest.DEFAULT_PREBUILT)
    sources = _manifest.KERNEL_SOURCES
    assert manifest["sources_sha256"] == _manifest.sources_digest(sources, _manifest.all_kernel_sources(sources))
    for name, entry in manifest["libraries"].items():
        inputs = entry["inputs"]
        assert inputs["sources_sha256"] == _manifest.sources_digest(sources, inputs["sources"]), name
        assert entry["sha256"] == _manifest.file_sha256(_manifest.DEFAULT_PREBUILT / name), name
    for name, digest in manifest["runtime"].items():
        assert digest == _manifest.file_sha256(_manifest.DEFAULT_PREBUILT / "runtime" / name)
    assert manifest["openmp_launch_source_sha256"] == _manifest.file_sha256(sources / "openmp_launch.c")
    assert _manifest.OPENMP_LAUNCH_LIBRARY in manifest["runtime"]
    expected = {
        f"{t}/longformer_{d}.so"
        for t in ("cpu-avx2", "cpu-avx512")
        for d in ("float32", "float64", "float16", "bfloat16")
    }
    expected |= {"cpu-avx512-bf16/longformer_bfloat16.so", "cpu-amx/longformer_bfloat16.so"}
    expected |= {f"cuda/longformer_{d}.so" for d in ("float32", "float16", "bfloat16")}
    assert set(manifest["libraries"]) == expected


def test_each_library_holds_whole_kernel_families():
    """The kernel-family table is the one list of what libraries export: every function of every
    library belongs to a family, and a library has all of a family's functions or none; CPU libraries
    have every family, CUDA libraries those the table builds for CUDA."""
    families = {
        name: {f for op in family.ops for f in _manifest.function_names(op)}
        for name, family in _manifest.KERNEL_FAMILIES.items()
    }
    for name, entry in _manifest.read(_loader.prebuilt_dir())["libraries"].items():
        functions = set(entry["functions"])
        assert functions <= set().union(*families.values()), f"{name}: functions of no family"
        has = {family for family, members in families.items() if members <= functions}
        partial = {family for family, members in families.items() if members & functions} - has
        assert not partial, f"{name}: part of families {partial}"
        expected = {f for f, family in _manifest.KERNEL_FAMILIES.items() if entry["device"] == "cpu" or family.cuda}
        assert has == expected, name


def test_kernel_families_are_asked_for_by_name():
    from longformer_ops.runtime import kernels

    cpu = torch.device("cpu")
    assert all(kernels.available(family, cpu, torch.float32) for family in _manifest.KERNEL_FAMILIES)
    with pytest.raises(ValueError, match=r"family must be one of \['band_products', .*got 'atention'"):
        kernels.available("atention", cpu, torch.float32)
    # No library for (device, dtype): a family with a fallback to torch's ops says False, the others
    # raise the loader's error naming what exists.
    meta = torch.device("meta")
    assert not kernels.available("layer_norm", meta, torch.float32)
    with pytest.raises(_loader.KernelNotAvailableError, match=r"no prebuilt kernel for device='meta'"):
        kernels.available("attention", meta, torch.float32)
