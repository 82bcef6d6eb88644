"""The monorepo's distributions as data: name, folder, version, dependencies.

Shared by the release tools (pin checker, version bump, selective-install check).

Example::

    >>> from workspace import load_packages
    >>> sorted(p.name for p in load_packages())
    ['dcomm-averaging', 'dcomm-core', 'dcomm-ddp', 'dcomm-fsdp']
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
VERSION_RE = re.compile(r'^__version__\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)

__all__ = ["ROOT", "Package", "load_packages", "package_named"]


@dataclass(frozen=True)
class Package:
    """One distribution under ``packages/``."""

    name: str  # "dcomm-ddp"
    folder: Path  # packages/dcomm-ddp
    pyproject: dict

    @property
    def import_name(self) -> str:
        """The subpackage under the ``dcomm`` namespace: ``ddp`` for ``dcomm-ddp``."""
        return self.name.removeprefix("dcomm-")

    @property
    def version_file(self) -> Path:
        return self.folder / self.pyproject["tool"]["hatch"]["version"]["path"]

    @property
    def version(self) -> str:
        match = VERSION_RE.search(self.version_file.read_text())
        if match is None:
            raise ValueError(f"{self.version_file}: no __version__ = '...' line")
        return match.group(1)

    @property
    def dependencies(self) -> list[str]:
        return list(self.pyproject["project"].get("dependencies", []))


def load_packages(root: Path = ROOT) -> list[Package]:
    """Every ``packages/*/pyproject.toml`` under ``root``, sorted by name."""
    packages = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        packages.append(Package(data["project"]["name"], pyproject.parent, data))
    return packages


def package_named(name: str, root: Path = ROOT) -> Package:
    """The package called ``name`` (``dcomm-ddp``), or a ValueError listing the valid names."""
    packages = {p.name: p for p in load_packages(root)}
    if name not in packages:
        raise ValueError(f"package: {name!r} is not in packages/; use one of {sorted(packages)}")
    return packages[name]
