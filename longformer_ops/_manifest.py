"""The format of ``prebuilt/manifest.json``, shared by the builder and the runtime.

Pure Python (no TVM, no torch): the builder writes it, the loader and
``python -m longformer_ops.info`` read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PREBUILT = REPO_ROOT / "prebuilt"
KERNEL_SOURCES = REPO_ROOT / "tvm_kernels"
OPENMP_LAUNCH_LIBRARY = "liblongformer_openmp_launch.so"  # in runtime/, built from tvm_kernels/openmp_launch.c


def function_name(op: str, autoregressive: bool) -> str:
    """Symbol under which a library exports ``op`` ('qk', 'pv', 'transposed'), e.g. ``qk_causal``."""
    return f"{op}_{'causal' if autoregressive else 'symmetric'}"


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
