"""Bump one distribution's version and open its changelog section.

Example::

    python tools/bump_version.py dcomm-ddp minor      # 0.1.0 -> 0.2.0
    python tools/bump_version.py dcomm-core 0.1.1     # an explicit version

A 0.x minor bump is breaking: dependants' pins (``dcomm-core>=0.1,<0.2``) then exclude the new
version and the pin checker says which to widen, so each dependant opts in on purpose.
Release by pushing the tag this prints, e.g. ``dcomm-ddp-v0.2.0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from check_pins import sibling_problems
from packaging.version import InvalidVersion, Version
from workspace import ROOT, VERSION_RE, load_packages, package_named

PARTS = ("major", "minor", "patch")


def next_version(current: str, part: str) -> str:
    """``part`` is major/minor/patch or an explicit version greater than ``current``."""
    now = Version(current)
    if part in PARTS:
        major, minor, patch = ([*list(now.release), 0, 0])[:3]
        if part == "major":
            return f"{major + 1}.0.0"
        if part == "minor":
            return f"{major}.{minor + 1}.0"
        return f"{major}.{minor}.{patch + 1}"
    try:
        wanted = Version(part)
    except InvalidVersion:
        raise ValueError(f"part: {part!r} is neither one of {PARTS} nor a version like 0.2.0") from None
    if wanted <= now:
        raise ValueError(f"part: {part} is not greater than the current version {current}")
    return str(wanted)


def bump(name: str, part: str, root: Path = ROOT) -> str:
    """Write the new version of package ``name`` and a changelog heading; return the version."""
    package = package_named(name, root)
    new = next_version(package.version, part)
    text = package.version_file.read_text()
    package.version_file.write_text(VERSION_RE.sub(f'__version__ = "{new}"', text, count=1))
    changelog = package.folder / "CHANGELOG.md"
    lines = changelog.read_text().splitlines(keepends=True)
    first_section = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    lines[first_section:first_section] = [f"## {new} — unreleased\n", "\n", "- \n", "\n"]
    changelog.write_text("".join(lines))
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Bump one dcomm distribution's version.")
    parser.add_argument("package", help="e.g. dcomm-ddp")
    parser.add_argument("part", help="major, minor, patch or an explicit version")
    args = parser.parse_args(argv)
    try:
        new = bump(args.package, args.part)
    except ValueError as error:
        print(f"bump: {error}", file=sys.stderr)
        return 2
    print(f"{args.package} is now {new}; release tag: {args.package}-v{new}")
    for problem in sibling_problems(load_packages()):
        print(f"  dependant to update: {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
