"""Packaging of the prebuilt kernels (the rest of the metadata is in pyproject.toml).

The wheel carries the repository's ``prebuilt/`` as ``longformer_ops/prebuilt/``. A custom
``build_py`` copies it, rather than a ``package-dir`` mapping of ``longformer_ops.prebuilt``
onto ``prebuilt/``, because the copy is the one place that can also refuse stale kernels, and
because the editable install then needs nothing: it skips the copy and the loader finds
``<repo>/prebuilt`` itself (see longformer_ops/runtime/loader.py). The libraries are x86-64 Linux
binaries that don't link libpython, so the wheel is tagged ``py3-none-<platform>``.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent

# By file path: importing the package would run longformer_ops/__init__.py, which needs torch.
_spec = importlib.util.spec_from_file_location("_manifest", ROOT / "longformer_ops" / "runtime" / "manifest.py")
_manifest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _manifest  # its dataclasses look their module up there
_spec.loader.exec_module(_manifest)


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # the checkout's prebuilt/ is used in place (and may be rebuilt later)
            return
        problems = _manifest.problems(_manifest.DEFAULT_PREBUILT, _manifest.KERNEL_SOURCES)
        if problems:
            raise SystemExit(
                "prebuilt/ does not match tvm_kernels/; run `make kernels` (and commit prebuilt/) "
                "before building a wheel:\n  " + "\n  ".join(problems)
            )
        target = Path(self.build_lib) / "longformer_ops" / _manifest.PACKAGED_PREBUILT_NAME
        shutil.rmtree(target, ignore_errors=True)  # nothing left from an earlier build
        shutil.copytree(_manifest.DEFAULT_PREBUILT, target, ignore=shutil.ignore_patterns("*.tmp*"))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True  # the wheel holds binaries: platlib (not purelib), Root-Is-Purelib: false


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        # The platform the libraries were built for ("linux-x86_64" -> "linux_x86_64"), not the build machine's.
        manifest = _manifest.read(_manifest.DEFAULT_PREBUILT)
        if manifest is None:  # editable install before any `make kernels`: nothing packaged, any tag does
            return super().get_tag()
        return "py3", "none", manifest["platform"].replace("-", "_")


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
