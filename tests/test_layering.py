"""The package's imports run one way (docs/architecture.md): runtime -> ops -> nn -> models -> the
integrations (hf, distributed). A module may import its own layer and those below, never above; the
two integrations do not import each other; nothing in longformer_ops imports tvm_kernels (the
builder), and the builder reads only the runtime's manifest format. Checked on the source (every
import statement, also those inside functions), so no import is missed for not being executed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "longformer_ops"

# Layer of each top-level part of the package. The package itself (its __init__: the public names)
# re-exports the models, so importing from it counts as importing layer 4.
LAYERS = {"runtime": 1, "ops": 2, "nn": 3, "models": 4, PACKAGE: 4, "hf": 5, "distributed": 5, "info": 5}
INTEGRATIONS = ("hf", "distributed")
# What the builder (tvm_kernels) may take from the runtime: the manifest's format, pure Python.
BUILDER_MAY_IMPORT = ("longformer_ops.runtime.manifest",)


def _part(module: str) -> str:
    """'longformer_ops.models.layer' -> 'models'; 'longformer_ops' -> 'longformer_ops'."""
    names = module.split(".")
    return names[1] if len(names) > 1 else PACKAGE


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``: ``from a import b`` counts as ``a.b``, except
    ``from longformer_ops import name`` of a public name (the package's facade); relative imports are
    resolved against ``module``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base == PACKAGE:  # `from longformer_ops import x`: a part of the package, or a public name
                found += [(node.lineno, f"{PACKAGE}.{a.name}" if a.name in LAYERS else PACKAGE) for a in node.names]
            else:
                found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Why ``source`` (the text of ``module``) breaks the layering; empty if it does not."""
    found = []
    for line, name in _imported(ast.parse(source), module, is_package):
        top = name.split(".")[0]
        if module.startswith(PACKAGE):
            if top == "tvm_kernels":
                found.append(f"{module}:{line} imports {name}: the runtime never imports the builder")
            elif top == PACKAGE and module != PACKAGE:
                mine, theirs = _part(module), _part(name)
                if LAYERS[theirs] > LAYERS[mine]:
                    found.append(f"{module}:{line} imports {name}: layer {LAYERS[theirs]} from layer {LAYERS[mine]}")
                elif mine in INTEGRATIONS and theirs in INTEGRATIONS and mine != theirs:
                    found.append(f"{module}:{line} imports {name}: one integration from another")
        elif top == PACKAGE and not name.startswith(BUILDER_MAY_IMPORT):
            found.append(f"{module}:{line} imports {name}: the builder reads only {BUILDER_MAY_IMPORT}")
    return found


def _modules(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), path, is_package


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(module) for module, _, _ in _modules(PACKAGE)}
    assert parts <= set(LAYERS), f"parts without a layer in LAYERS: {parts - set(LAYERS)}"


@pytest.mark.parametrize("folder", [PACKAGE, "tvm_kernels"])
def test_imports_run_one_way(folder):
    found = [
        v for module, path, is_package in _modules(folder) for v in violations(path.read_text(), module, is_package)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("longformer_ops.runtime.kernels", "from longformer_ops.models import layer", "layer 4 from layer 1"),
        (
            "longformer_ops.ops.attention",
            "def f():\n    from longformer_ops.nn.dense import linear",
            "layer 3 from layer 2",
        ),
        ("longformer_ops.ops.attention", "from longformer_ops import LongformerConfig", "layer 4 from layer 2"),
        ("longformer_ops.nn.dense", "from ..models import config", "layer 4 from layer 3"),
        ("longformer_ops.runtime.loader", "import tvm_kernels.build", "never imports the builder"),
        ("longformer_ops.distributed", "from longformer_ops import hf", "one integration from another"),
        ("tvm_kernels.build", "from longformer_ops.runtime import kernels", "the builder reads only"),
    ],
)
def test_an_import_against_the_layers_is_found(module, source, expected):
    found = violations(source, module)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "module, source",
    [
        (
            "longformer_ops.models.layer",
            "from longformer_ops.runtime import kernels\nfrom longformer_ops.ops import dropout",
        ),
        ("longformer_ops.hf.attention", "from . import patch"),
        ("longformer_ops.hf", "from longformer_ops import LongformerConfig"),
        ("tvm_kernels.variants", "from longformer_ops.runtime.manifest import function_name"),
    ],
)
def test_imports_along_the_layers_pass(module, source):
    assert violations(source, module) == []
