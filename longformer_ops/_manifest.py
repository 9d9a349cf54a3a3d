"""The format of ``prebuilt/manifest.json``, shared by the builder and the runtime.

Pure Python (no TVM, no torch): the builder writes it, the loader and
``python -m longformer_ops.info`` read it, and ``setup.py`` checks it (:func:`problems`)
before packaging ``prebuilt/`` into a wheel.

Two layouts hold the libraries (:func:`default_prebuilt` picks):

- a repository checkout: ``<repo>/prebuilt/``, beside ``<repo>/longformer_ops/`` and the
  kernel sources ``<repo>/tvm_kernels/`` (``make kernels`` writes there; the editable
  install and the tests use it);
- an installed wheel: ``site-packages/longformer_ops/prebuilt/``, a copy made at wheel
  build time (no kernel sources are installed).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
DEFAULT_PREBUILT = REPO_ROOT / "prebuilt"       # the repository's prebuilt/: where `make kernels` writes
KERNEL_SOURCES = REPO_ROOT / "tvm_kernels"
PACKAGED_PREBUILT_NAME = "prebuilt"             # the wheel's copy: longformer_ops/prebuilt/
OPENMP_LAUNCH_LIBRARY = "liblongformer_openmp_launch.so"  # in runtime/, built from tvm_kernels/openmp_launch.c


def default_prebuilt(package_dir: Path = PACKAGE_DIR) -> Path:
    """The repository's prebuilt/ when the package sits in a checkout (``<package>/../prebuilt/manifest.json``
    and ``<package>/../tvm_kernels/`` exist), else the packaged copy ``<package>/prebuilt/``.

    Both conditions, so that a stray ``site-packages/prebuilt`` or ``tvm_kernels`` beside an
    installed package is never taken for a checkout.
    """
    root = Path(package_dir).parent
    if (root / "prebuilt" / MANIFEST_NAME).is_file() and (root / "tvm_kernels").is_dir():
        return root / "prebuilt"
    return Path(package_dir) / PACKAGED_PREBUILT_NAME


def function_name(op: str, autoregressive: bool) -> str:
    """Symbol under which a library exports band op ``op`` ('qk', 'pv', 'transposed'), e.g. ``qk_causal``."""
    return f"{op}_{'causal' if autoregressive else 'symmetric'}"


# Ops without a band (no symmetric / causal pair): exported under their own name.
UNBANDED_OPS = ("dropout", "bias_dropout_add", "dropout_column_sums", "bias_gelu", "bias_gelu_backward",
                "global_merge", "global_merge_backward", "layer_norm", "layer_norm_backward",
                "few_rows_mm", "few_rows_mm_nt")


def function_names(op: str) -> tuple[str, ...]:
    """Every symbol a library exports for ``op``: a band op's two variants, an unbanded op's name."""
    return (op,) if op in UNBANDED_OPS else (function_name(op, False), function_name(op, True))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sources_digest(root: Path, files) -> str:
    """One sha256 over the named files under ``root`` (names and contents, sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + (Path(root) / name).read_bytes() + b"\0")
    return digest.hexdigest()


def all_kernel_sources(root: Path = KERNEL_SOURCES) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*.py"))


def problems(prebuilt: Path = DEFAULT_PREBUILT, sources: Path = KERNEL_SOURCES) -> list[str]:
    """Why ``prebuilt`` is not a faithful build of the kernel sources in ``sources`` (empty: it is).

    Every library and runtime file must exist with its manifest sha256, and each library (and the
    OpenMP launcher) must have been built from the sources present now. The wheel build runs this:
    an installed wheel has no sources left to detect stale kernels with.
    """
    manifest = read(prebuilt)
    if manifest is None:
        return [f"no manifest: {Path(prebuilt) / MANIFEST_NAME}"]
    found = []
    files = [(name, entry["sha256"]) for name, entry in manifest["libraries"].items()]
    files += [(f"runtime/{name}", digest) for name, digest in manifest["runtime"].items()]
    for name, digest in files:
        path = Path(prebuilt) / name
        if not path.is_file():
            found.append(f"{name}: missing")
        elif file_sha256(path) != digest:
            found.append(f"{name}: sha256 differs from the manifest's")
    for name, entry in manifest["libraries"].items():
        inputs = entry["inputs"]
        missing = [f for f in inputs["sources"] if not (Path(sources) / f).is_file()]
        if missing or sources_digest(sources, inputs["sources"]) != inputs["sources_sha256"]:
            found.append(f"{name}: stale, built from other tvm_kernels sources than those present")
    launcher = Path(sources) / "openmp_launch.c"
    if not launcher.is_file() or file_sha256(launcher) != manifest.get("openmp_launch_source_sha256"):
        found.append(f"runtime/{OPENMP_LAUNCH_LIBRARY}: stale, built from another openmp_launch.c")
    return found


def read(prebuilt: Path = DEFAULT_PREBUILT) -> dict | None:
    path = Path(prebuilt) / MANIFEST_NAME
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write(prebuilt: Path, manifest: dict) -> None:
    path = Path(prebuilt) / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
