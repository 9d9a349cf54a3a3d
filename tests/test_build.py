"""The ahead-of-time build: `make kernels`' CMake path from scratch, and what the CUDA libraries hold."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from longformer_ops.ops.reference import diagonaled_mm_reference
from longformer_ops.runtime import loader as _loader
from longformer_ops.runtime import manifest as _manifest
from tvm_kernels import build, variants
from tvm_kernels.cuda_toolchain import device_code_in


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_build_from_scratch_produces_working_kernels(tmp_path, monkeypatch):
    """Configure and build a CPU library into an empty directory, then run it against the reference."""
    out, build_dir = tmp_path / "prebuilt", tmp_path / "cmake"
    configure = subprocess.run(
        [
            "cmake",
            "-S",
            str(_manifest.REPO_ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DPREBUILT_DIR={out}",
            "-DKERNEL_TARGETS=cpu-avx2",
            "-DKERNEL_DTYPES=float32",
        ],
        capture_output=True,
        text=True,
    )
    assert configure.returncode == 0, configure.stderr
    first = subprocess.run(["cmake", "--build", str(build_dir), "--target", "kernels"], capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (
        f"[1/1] cpu-avx2/longformer_float32.so: building 25 functions for {variants.TARGETS['cpu-avx2'].tvm_target} "
        f"({build.CPU_LIBRARY_PIECES} pieces)"
    ) in first.stdout, first.stdout
    second = subprocess.run(["cmake", "--build", str(build_dir), "--target", "kernels"], capture_output=True, text=True)
    assert "cpu-avx2/longformer_float32.so: up to date" in second.stdout, second.stdout

    manifest = _manifest.read(out)
    assert set(manifest["libraries"]) == {"cpu-avx2/longformer_float32.so"}
    assert manifest["tvm_version"] and manifest["sources_sha256"]
    monkeypatch.setenv(_loader.PREBUILT_ENV, str(out))
    monkeypatch.setenv(_loader.CPU_TARGET_ENV, "cpu-avx2")
    library = _loader.library_for(torch.device("cpu"), "float32")
    q, k = torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    scores = torch.empty(1, 40, 2, 7)
    dilation = torch.tensor([1, 3], dtype=torch.int32)
    library.function("qk_symmetric")(q, k, dilation, 0.0, scores, 1)  # (1: one run of queries per head)
    torch.testing.assert_close(scores, diagonaled_mm_reference(q, k, 3, dilation), rtol=1e-5, atol=1e-5)
    # A function of the library's last piece (its objects are linked into one library).
    assert [symbol for symbol, _, _ in build._pieces_of(variants.TARGETS["cpu-avx2"])[-1]][:1] == ["pv_causal"]
    context = torch.empty(1, 40, 2, 16)
    library.function("pv_causal")(scores[..., :4].contiguous(), k, dilation, context, 1)
    torch.testing.assert_close(
        context,
        diagonaled_mm_reference(scores[..., :4], k, 3, dilation, True, autoregressive=True),
        rtol=1e-5,
        atol=1e-5,
    )


CUDA_LIBRARIES = sorted(
    n for n, e in _manifest.read(_manifest.DEFAULT_PREBUILT)["libraries"].items() if e["device"] == "cuda"
)


@pytest.mark.parametrize("name", CUDA_LIBRARIES)
def test_cuda_libraries_hold_device_code_not_source(name):
    path = _manifest.DEFAULT_PREBUILT / name
    code = device_code_in(path)
    sass = {arch for kind, arch in code if kind == "sass"}
    ptx = {arch for kind, arch in code if kind == "ptx"}
    # One fatbin per library; a SASS entry per arch, plus PTX of the newest for later GPUs.
    assert sass == set(variants.CUDA_ARCHS) and len(code) == len(variants.CUDA_ARCHS) + 1, code
    assert ptx == {variants.CUDA_ARCHS[-1]}
    blob = path.read_bytes()
    # (blockIdx.x and friends do appear: TVM stores them as launch-parameter tags, not code.)
    for marker in (b"__global__", b'extern "C"', b"#include", b"__device__"):
        assert marker not in blob, f"CUDA source text {marker!r} found in {name}"


def test_fatbin_reader_sees_a_fresh_nvcc_fatbin(tmp_path):
    """The reader itself, on a fatbin nvcc makes now (so a broken reader cannot pass the test above)."""
    from tvm_kernels import cuda_toolchain

    try:
        cuda_toolchain.find_nvcc()
    except FileNotFoundError:
        pytest.skip("nvcc not installed")
    blob = cuda_toolchain.compile_fatbin('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', ["sm_80", "sm_90"])
    (tmp_path / "k.fatbin").write_bytes(blob)
    assert sorted(device_code_in(tmp_path / "k.fatbin")) == [("ptx", "sm_90"), ("sass", "sm_80"), ("sass", "sm_90")]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(key_update_rows=3), "key_update_rows 3 must divide the Q.K^T block of 16 keys"),
        (dict(backward_tile_rows=9), "backward_tile_rows 9 must be a multiple of qk_rows 6 and band_rows 6"),
    ],
)
def test_fused_backward_refuses_tiles_that_would_drop_keys_or_rows(change, message):
    """A tile table whose update group does not divide the key block, or whose backward tile is not
    made of whole register tiles, would skip keys or queries silently: the build says so instead.
    (In a fresh process: the TVM compiler must not share one with the prebuilt runtime.)"""
    code = (
        "import dataclasses, importlib\n"
        "attention = importlib.import_module('tvm_kernels.schedules.cpu.attention')\n"
        "from tvm_kernels.schedules.cpu import tiles\n"
        f"attention.tiles_for = lambda bits: dataclasses.replace(tiles.AVX2, **{change!r})\n"
        "try:\n"
        "    attention.attention_backward('float32', False, 256)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_manifest.REPO_ROOT)
    assert run.returncode == 0 and message in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize(
    "data, bound",
    [
        ("float32", 2 * 2.0**-24),  # within 2 units of float32's roundoff
        ("half", torch.finfo(torch.float16).eps / 2 / 100),  # 1/100 of float16's (the finer half type)
    ],
)
def test_exp_polynomials_are_accurate_for_their_data(data, bound):
    """The CPU kernels' exp(t) polynomials (``microkernels._exp``), evaluated as the kernels do (Horner
    in float32) over the reduced range [-ln2/2, ln2/2]: float32 data's within 2 ulp of float32, the
    half types' (degree 4, results rounded to bfloat16 or float16) far below float16's roundoff.
    (Coefficients read in a fresh process: the TVM compiler must not share one with the runtime.)"""
    code = (
        "import importlib, json\n"
        "m = importlib.import_module('tvm_kernels.schedules.cpu.microkernels')\n"
        f"print(json.dumps(m._EXP_{data.upper()}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_manifest.REPO_ROOT)
    assert run.returncode == 0, run.stderr
    coefficients = json.loads(run.stdout)
    t = torch.linspace(-math.log(2) / 2, math.log(2) / 2, 200_001, dtype=torch.float32)
    poly = torch.full_like(t, coefficients[0])
    for c in coefficients[1:]:
        poly = poly * t + torch.tensor(c, dtype=torch.float32)
    relative = (poly.double() / t.double().exp() - 1).abs().max().item()
    assert relative <= bound, f"{data}: exp polynomial relative error {relative:.3g} > {bound:.3g}"


@pytest.mark.parametrize("target", variants.TARGETS)
def test_a_library_is_compiled_in_pieces_that_hold_each_function_once(target):
    """The pieces a library is compiled in hold its manifest's functions, each once; a CPU library's
    band ops' two variants (which cost about the same to compile) in different pieces; CUDA whole."""
    target = variants.TARGETS[target]
    pieces = build._pieces_of(target)
    symbols = [symbol for piece in pieces for symbol, _, _ in piece]
    assert sorted(symbols) == sorted(name for op in target.ops for name in variants.function_names(op))
    assert len(symbols) == len(set(symbols))
    if target.device == "cuda":
        assert len(pieces) == 1
        return
    assert len(pieces) == build.CPU_LIBRARY_PIECES and all(pieces)
    piece_of = {symbol: index for index, piece in enumerate(pieces) for symbol, _, _ in piece}
    for op in target.ops:
        if op not in _manifest.UNBANDED_OPS:
            assert piece_of[variants.function_name(op, False)] != piece_of[variants.function_name(op, True)], op


def test_build_shows_a_failing_workers_message(tmp_path):
    """A piece that fails in its worker process stops the build with the worker's message (library,
    functions, error) on stderr and exit status 1, not a pickling error or a hang."""
    code = (
        "import sys\n"
        "from tvm_kernels import build\n"
        "build._pieces_of = lambda target: [[('no_such_kernel', 'no_such_kernel', None)]]\n"
        f"sys.exit(build.main(['--targets', 'cpu-avx2', '--dtypes', 'float32', '--out', {str(tmp_path)!r}, "
        "'--jobs', '1']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=_manifest.REPO_ROOT, timeout=300
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "cpu-avx2/longformer_float32.so (no_such_kernel): KeyError: 'no_such_kernel'" in run.stderr, run.stderr
    assert "cpu-avx2/longformer_float32.so" not in (_manifest.read(tmp_path) or {}).get("libraries", {})


def test_build_refuses_a_job_count_under_one(capsys):
    with pytest.raises(SystemExit):
        build.main(["--targets", "cpu-avx2", "--jobs", "0"])
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_build_shows_the_message_of_a_kernel_source_error():
    """A TVMScript error in a kernel source reaches the console: TVM's excepthook would print only a
    note about TVM_BACKTRACE for it."""
    code = (
        "import sys, tvm\n"
        "from tvm_kernels import build\n"
        "def broken(*args):\n"
        "    raise tvm.error.DiagnosticError('error: helper() missing 1 required positional argument')\n"
        "build.build = broken\n"
        "sys.exit(build.main(['--targets', 'cpu-avx2']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_manifest.REPO_ROOT)
    assert run.returncode == 1 and "helper() missing 1 required positional argument" in run.stderr, (
        run.stdout + run.stderr
    )
