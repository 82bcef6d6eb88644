"""What the other dcomm distributions import from dcomm-core is public: in ``__all__`` and documented.

A sibling distribution pins dcomm-core to a compatible range, so the names it reads from dcomm-core
are dcomm-core's API: ``dcomm.core.__all__`` and the ``__all__`` of the submodules listed in
dcomm-core's README (:data:`PUBLIC_MODULES`). This test reads every ``from dcomm.core... import``
of the other distributions' sources and fails on a name outside that, and on an underscore name
imported from another module of dcomm-core or dcomm-averaging.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
PUBLIC_MODULES = (
    "dcomm.core.validation",
    "dcomm.core.environment",
    "dcomm.core.quantization",
    "dcomm.core.quantized_average",
    "dcomm.core.native_build",
    "dcomm.core.torch_private",
)


def _imports(roots: list[Path]) -> list[tuple[Path, str, str]]:
    """``(file, module, name)`` for every ``from module import name`` under ``roots``."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.extend((path, node.module, alias.name) for alias in node.names)
    return found


def test_siblings_import_only_public_names_of_dcomm_core() -> None:
    siblings = [p / "src" for p in sorted(PACKAGES.glob("dcomm-*")) if p.name != "dcomm-core"]
    assert siblings, PACKAGES
    outside = []
    for path, module, name in _imports(siblings):
        if not (module == "dcomm.core" or module.startswith("dcomm.core.")):
            continue
        if module == "dcomm.core" and f"dcomm.core.{name}" in PUBLIC_MODULES:
            continue  # a documented module imported by name
        if module != "dcomm.core" and module not in PUBLIC_MODULES:
            outside.append(f"{path.relative_to(PACKAGES)}: {module} is not a public module of dcomm-core")
        elif name not in importlib.import_module(module).__all__:
            outside.append(f"{path.relative_to(PACKAGES)}: {module}.{name} is not in its __all__")
    assert not outside, "\n".join(outside)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_are_documented(module: str) -> None:
    readme = (PACKAGES / "dcomm-core" / "README.md").read_text()
    assert f"`{module}" in readme, f"{module} is imported by other distributions but not in dcomm-core's README"
    assert importlib.import_module(module).__all__


def test_no_underscore_name_crosses_modules() -> None:
    roots = sorted(PACKAGES.glob("*/src"))
    crossing = [
        f"{path.relative_to(PACKAGES)}: from {module} import {name}"
        for path, module, name in _imports(roots)
        if name.startswith("_") and not name.startswith("__") and module.startswith("dcomm.")
    ]
    assert not crossing, "\n".join(crossing)
