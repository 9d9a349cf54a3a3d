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
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # longformer_ops/ (this file is in runtime/)
REPO_ROOT = PACKAGE_DIR.parent
DEFAULT_PREBUILT = REPO_ROOT / "prebuilt"  # the repository's prebuilt/: where `make kernels` writes
KERNEL_SOURCES = REPO_ROOT / "tvm_kernels"
PACKAGED_PREBUILT_NAME = "prebuilt"  # the wheel's copy: longformer_ops/prebuilt/
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


@dataclass(frozen=True)
class KernelFamily:
    """Kernels that the runtime uses together: a library has all of a family's ops or none."""

    ops: tuple[str, ...]  # op names; a banded op exports a symmetric and a causal function (function_names)
    banded: bool  # each op computes over the band (two variants); else one function under the op's name
    cuda: bool  # built for CUDA too (every family is built for every CPU target)
    # Where no library serves (device, dtype) at all: True, the callers run torch's ops instead;
    # False, asking for the family raises the loader's KernelNotAvailableError.
    torch_fallback: bool


# The one table of kernel families, in build order. The builder builds each target's families from
# it (tvm_kernels/variants.py: a schedule function per op), the runtime asks for them by name
# (longformer_ops.runtime.kernels.available) and calls their ops.
KERNEL_FAMILIES = {
    # Q.K^T into the band, band times V, and the band transposed times rows (the backward's dV).
    "band_products": KernelFamily(("qk", "pv", "transposed"), banded=True, cuda=True, torch_fallback=False),
    # Fused local attention and its backward from the forward's row log-sum-exp: no band in memory.
    "attention": KernelFamily(("attention", "attention_backward"), banded=True, cuda=True, torch_fallback=False),
    # The unfused path's softmax over the band, in place, and its backward (elsewhere torch's ops).
    "band_softmax": KernelFamily(("softmax", "softmax_backward"), banded=True, cuda=False, torch_fallback=False),
    # Hidden-state dropout with the fused attention's counter-based mask.
    "dropout": KernelFamily(("dropout",), banded=False, cuda=False, torch_fallback=True),
    # A dense layer's bias, dropout and the residual in one pass; the backward's column sums.
    "bias_dropout_add": KernelFamily(
        ("bias_dropout_add", "dropout_column_sums"), banded=False, cuda=False, torch_fallback=True
    ),
    # The FFN's bias and exact GELU after a bias-free GEMM, and its backward.
    "bias_gelu": KernelFamily(("bias_gelu", "bias_gelu_backward"), banded=False, cuda=False, torch_fallback=True),
    # The layer's merge of the global keys into the band's attention, and its backward's sums.
    "global_merge": KernelFamily(
        ("global_merge", "global_merge_backward"), banded=False, cuda=False, torch_fallback=True
    ),
    # Layer normalisation over the last dimension, and its backward with the weight's and bias's gradients.
    "layer_norm": KernelFamily(("layer_norm", "layer_norm_backward"), banded=False, cuda=False, torch_fallback=True),
    # a @ b and a @ b^T for a few rows, half types widened in registers (a generation step's attention).
    "few_row_products": KernelFamily(("few_rows_mm", "few_rows_mm_nt"), banded=False, cuda=False, torch_fallback=True),
}


def ops_of(families) -> tuple[str, ...]:
    """The ops of the named kernel families, in the table's order."""
    families = set(families)
    if families - KERNEL_FAMILIES.keys():
        raise KeyError(
            f"no kernel families {sorted(families - KERNEL_FAMILIES.keys())}; known: {list(KERNEL_FAMILIES)}"
        )
    return tuple(op for name, family in KERNEL_FAMILIES.items() if name in families for op in family.ops)


# Ops without a band (no symmetric / causal pair): exported under their own name.
UNBANDED_OPS = tuple(op for family in KERNEL_FAMILIES.values() if not family.banded for op in family.ops)


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
