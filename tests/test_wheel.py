"""The wheel carries its kernels: built from the repository, installed into a fresh venv, used from outside.

Also the layout rule of the loader (repository's prebuilt/ in a checkout, else the packaged copy)
and the wheel build's refusal to package kernels that don't match tvm_kernels/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from longformer_ops.runtime import manifest as _manifest

REPO = _manifest.REPO_ROOT
TORCH_SPEC = "torch==2.13.0"  # as the Makefile's: pinned, or pip pulls the CUDA build (gigabytes)


def _run(command, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _explain(result: subprocess.CompletedProcess) -> str:
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def _clean_env() -> dict:
    """This environment without what would put the repository's package or kernels in a child's way."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "LONGFORMER_OPS_PREBUILT", "LONGFORMER_OPS_CPU_TARGET"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _copy_checkout(target: Path) -> Path:
    """What a clean clone has: the files git tracks (and untracked ones it doesn't ignore), as they are now.

    Building from a copy leaves no build/ or egg-info in the repository, and no earlier build's
    leftovers can slip into the wheel.
    """
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # skips files deleted in the working tree
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def _build_wheel(source: Path, out: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source], cwd=source, env=_clean_env())


# ---------------------------------------------------------------------------------------------
# The layout rule and the build-time check, without building a wheel.


def test_default_prebuilt_rule(tmp_path):
    package = tmp_path / "longformer_ops"
    package.mkdir()
    assert _manifest.default_prebuilt(package) == package / "prebuilt"  # nothing beside: packaged copy
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / "manifest.json").write_text("{}")
    assert _manifest.default_prebuilt(package) == package / "prebuilt", "no tvm_kernels/: not a checkout"
    (tmp_path / "tvm_kernels").mkdir()
    assert _manifest.default_prebuilt(package) == tmp_path / "prebuilt", "a checkout: the repository's prebuilt/"
    (tmp_path / "prebuilt" / "manifest.json").unlink()
    assert _manifest.default_prebuilt(package) == package / "prebuilt", "no manifest beside: not a checkout"
    assert _manifest.default_prebuilt() == _manifest.DEFAULT_PREBUILT  # this repository is a checkout


_PACKAGED_PROBE = textwrap.dedent("""
    import torch, longformer_ops
    from longformer_ops.runtime import loader as _loader
    print(longformer_ops.__file__)
    print(_loader.prebuilt_dir())
    q = torch.randn(1, 33, 2, 16)
    longformer_ops.diagonaled_mm(q, q, 4, 1)
    print("ran")
""")


def test_installed_layout_finds_the_packaged_kernels(tmp_path):
    """The package with prebuilt/ inside it and no checkout around it, as a wheel installs it."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "longformer_ops", site / "longformer_ops", ignore=shutil.ignore_patterns("__pycache__"))
    packaged = site / "longformer_ops" / "prebuilt"
    shutil.copytree(_manifest.DEFAULT_PREBUILT, packaged, ignore=shutil.ignore_patterns("*.tmp*"))
    env = {**_clean_env(), "PYTHONPATH": str(site)}
    result = _run([sys.executable, "-c", _PACKAGED_PROBE], cwd=tmp_path, env=env)
    assert result.returncode == 0, _explain(result)
    module_file, directory, ran = result.stdout.split()
    assert Path(module_file).parent == site / "longformer_ops", _explain(result)
    assert Path(directory) == packaged, _explain(result)
    assert ran == "ran"

    # No sources to compare with there, but a library that isn't the manifest's is still refused.
    for path in packaged.glob("cpu-*/longformer_float32.so"):
        shutil.copy(packaged / "cpu-avx2" / "longformer_float64.so", path)
    result = _run([sys.executable, "-c", _PACKAGED_PROBE], cwd=tmp_path, env=env)
    assert (
        result.returncode != 0
        and "KernelNotAvailableError" in result.stderr
        and "does not match its manifest entry" in result.stderr
    ), _explain(result)


def _tamper_sources_hash(prebuilt: Path, sources: Path) -> str:
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    name = "cpu-avx2/longformer_float32.so"
    manifest["libraries"][name]["inputs"]["sources_sha256"] = "0" * 64
    (prebuilt / "manifest.json").write_text(json.dumps(manifest))
    return name


def _tamper_library(prebuilt: Path, sources: Path) -> str:
    shutil.copy(prebuilt / "cpu-avx2" / "longformer_float64.so", prebuilt / "cpu-avx2" / "longformer_float32.so")
    return "cpu-avx2/longformer_float32.so"


def _remove_runtime(prebuilt: Path, sources: Path) -> str:
    (prebuilt / "runtime" / "libtvm_runtime.so").unlink()
    return "runtime/libtvm_runtime.so"


def _edit_a_source(prebuilt: Path, sources: Path) -> str:
    with open(sources / "schedules" / "cpu" / "band_times_rows.py", "a") as f:
        f.write("\n# edited after the kernels were built\n")
    return "cpu-avx2/longformer_float32.so"


@pytest.mark.parametrize("tamper", [_tamper_sources_hash, _tamper_library, _remove_runtime, _edit_a_source])
def test_build_check_finds_stale_or_changed_kernels(tmp_path, tamper):
    prebuilt, sources = tmp_path / "prebuilt", tmp_path / "tvm_kernels"
    shutil.copytree(_manifest.DEFAULT_PREBUILT, prebuilt)
    shutil.copytree(_manifest.KERNEL_SOURCES, sources, ignore=shutil.ignore_patterns("__pycache__"))
    assert _manifest.problems(prebuilt, sources) == []
    culprit = tamper(prebuilt, sources)
    found = _manifest.problems(prebuilt, sources)
    assert any(p.startswith(culprit + ":") for p in found), found


def test_wheel_build_refuses_stale_kernels(tmp_path):
    source = _copy_checkout(tmp_path / "src")
    culprit = _tamper_sources_hash(source / "prebuilt", source / "tvm_kernels")
    result = _build_wheel(source, tmp_path / "dist")
    output = result.stdout + result.stderr
    assert result.returncode != 0, "a wheel was built from stale kernels\n" + _explain(result)
    assert "make kernels" in output and f"{culprit}: stale" in output, _explain(result)
    assert not list((tmp_path / "dist").glob("*.whl"))


# ---------------------------------------------------------------------------------------------
# The real thing: build, install into a fresh venv, use from outside the repository.

_INSTALLED_CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    import longformer_ops
    from longformer_ops import LongformerConfig, LongformerModel, diagonaled_mm, sliding_window_attention
    from longformer_ops.runtime import loader as _loader
    from longformer_ops.ops import reference

    site_packages, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    assert Path(longformer_ops.__file__).resolve().is_relative_to(site_packages), longformer_ops.__file__
    assert not any(p and Path(p).resolve().is_relative_to(repo) for p in sys.path), sys.path
    assert _loader.prebuilt_dir() == site_packages / "longformer_ops" / "prebuilt", _loader.prebuilt_dir()

    g = torch.Generator().manual_seed(0)
    b, n, h, f, w, d = 2, 70, 2, 32, 5, [1, 2]
    q, k, v = (torch.randn(b, n, h, f, generator=g) for _ in range(3))
    tight = dict(rtol=1e-5, atol=1e-5)
    scores = diagonaled_mm(q, k, w, d)
    torch.testing.assert_close(scores, reference.diagonaled_mm_reference(q, k, w, d), **tight)
    probs = torch.softmax(torch.randn(b, n, h, 2 * w + 1, generator=g), -1)
    torch.testing.assert_close(diagonaled_mm(probs, v, w, d, True), reference.diagonaled_mm_reference(probs, v, w, d, True),
                               **tight)
    for causal in (False, True):
        torch.testing.assert_close(sliding_window_attention(q, k, v, w, d, causal),
                                   reference.sliding_window_attention_reference(q, k, v, w, d, causal), **tight)

    def model(mode):
        config = LongformerConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=64, attention_window=[3, 4],
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_mode=mode)
        torch.manual_seed(0)
        return LongformerModel(config).eval()
    ids = torch.randint(2, 50, (2, 30), generator=g)
    with torch.no_grad():
        ours, dense = model("tvm")(ids).last_hidden_state, model("full")(ids).last_hidden_state
    torch.testing.assert_close(ours, dense, rtol=1e-4, atol=1e-4)

    assert "tvm" not in sys.modules, "the TVM compiler was imported"
    print("installed wheel ok")
""")


def test_wheel_installs_and_runs_outside_the_repository(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    timings, start = {}, time.perf_counter()

    def lap(name):
        nonlocal start
        timings[name] = time.perf_counter() - start
        start = time.perf_counter()

    source = _copy_checkout(work / "src")
    result = _build_wheel(source, work / "dist")
    assert result.returncode == 0, "pip wheel failed\n" + _explain(result)
    (wheel,) = (work / "dist").glob("*.whl")
    lap("build")

    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), f"not tagged for the kernels' platform: {wheel.name}"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        wheel_meta = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: false" in wheel_meta, wheel_meta
    manifest = _manifest.read(_manifest.DEFAULT_PREBUILT)
    expected = {"longformer_ops/prebuilt/manifest.json", "longformer_ops/prebuilt/runtime/LICENSE.tvm"}
    expected |= {f"longformer_ops/prebuilt/{name}" for name in manifest["libraries"]}
    expected |= {f"longformer_ops/prebuilt/runtime/{name}" for name in manifest["runtime"]}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"longformer_ops", "longformer_ops-0.1.0.dist-info"}, f"other top-level entries: {top_level}"

    # A fresh venv without pip of its own (faster); this pip installs into it. Torch pinned (CPU build).
    venv = work / "venv"
    result = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    assert result.returncode == 0, _explain(result)
    python = venv / "bin" / "python"
    result = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", TORCH_SPEC, wheel],
        cwd=work,
        env=_clean_env(),
    )
    assert result.returncode == 0, "installing the wheel failed\n" + _explain(result)
    lap("venv + install")

    site_packages = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"], cwd=work).stdout.strip()
    ).resolve()
    outside = work / "elsewhere"
    outside.mkdir()
    (outside / "check.py").write_text(_INSTALLED_CHECK)
    # -I: no PYTHONPATH, no user site, not even the script's directory on sys.path.
    result = _run([python, "-I", "check.py", site_packages, REPO], cwd=outside, env=_clean_env())
    assert result.returncode == 0 and "installed wheel ok" in result.stdout, _explain(result)
    lap("ops and model")

    result = _run([python, "-I", "-m", "longformer_ops.info"], cwd=outside, env=_clean_env())
    assert result.returncode == 0, _explain(result)
    assert f"prebuilt:  {site_packages / 'longformer_ops' / 'prebuilt'}" in result.stdout, _explain(result)
    lap("info")
    print(
        f"\n{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB; "
        + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items())
    )
