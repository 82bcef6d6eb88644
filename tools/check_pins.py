"""Check the release rules of the monorepo; exit 1 with one line per violation.

- every ``dcomm-*`` dependency admits the sibling's current version (hatch silently skips an
  editable sibling whose pin excludes it, so nothing else would notice);
- every distribution pins torch to ``TORCH_RANGE``: the oldest torch tested on GPUs up to the
  newest release on the index (CI's matrix tests both ends);
- ``dcomm`` stays a PEP 420 namespace: no ``src/dcomm/__init__.py``; each package ships
  ``src/dcomm/<name>/__init__.py`` and ``py.typed``;
- with ``--tag dcomm-ddp-v0.2.0``: the tag names a package and equals its version.

Example::

    python tools/check_pins.py
    python tools/check_pins.py --tag dcomm-ddp-v0.1.0
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from workspace import ROOT, Package, load_packages

TAG_RE = re.compile(r"^(dcomm-[a-z]+)-v(.+)$")
# Widen the upper bound when a torch release passes CI's newest-torch job.
TORCH_RANGE = ">=2.11,<2.16"


def sibling_problems(packages: list[Package]) -> list[str]:
    versions = {p.name: Version(p.version) for p in packages}
    problems = []
    for package in packages:
        for dep in map(Requirement, package.dependencies):
            if not dep.name.startswith("dcomm-"):
                continue
            if dep.name not in versions:
                problems.append(f"{package.name}: depends on unknown sibling {dep.name!r}")
            elif not dep.specifier:
                problems.append(f"{package.name}: pin {dep.name} to a compatible range, e.g. >=0.1,<0.2")
            elif not dep.specifier.contains(versions[dep.name], prereleases=True):
                problems.append(
                    f"{package.name}: pin '{dep}' excludes {dep.name} {versions[dep.name]}; "
                    f"widen it to admit {versions[dep.name]}"
                )
    return problems


def torch_problems(packages: list[Package]) -> list[str]:
    ranges = {}
    for package in packages:
        pins = [str(Requirement(d).specifier) for d in package.dependencies if Requirement(d).name == "torch"]
        ranges[package.name] = pins[0] if pins else None
    wanted = SpecifierSet(TORCH_RANGE)
    return [
        f"{name}: torch range {r!r} is not the shared {TORCH_RANGE!r}; pin 'torch{TORCH_RANGE}'"
        if r is not None
        else f"{name}: no torch dependency; add 'torch{TORCH_RANGE}'"
        for name, r in ranges.items()
        if r is None or SpecifierSet(r) != wanted
    ]


def namespace_problems(packages: list[Package]) -> list[str]:
    problems = []
    for package in packages:
        src = package.folder / "src" / "dcomm"
        if (src / "__init__.py").exists():
            problems.append(f"{src / '__init__.py'}: delete it; dcomm is a PEP 420 namespace package")
        for required in ("__init__.py", "py.typed"):
            if not (src / package.import_name / required).exists():
                problems.append(f"{package.name}: missing src/dcomm/{package.import_name}/{required}")
    return problems


def tag_problems(packages: list[Package], tag: str) -> list[str]:
    match = TAG_RE.match(tag)
    if not match:
        return [f"--tag: {tag!r} is not of the form dcomm-<name>-v<version>, e.g. dcomm-ddp-v0.2.0"]
    name, version = match.groups()
    by_name = {p.name: p for p in packages}
    if name not in by_name:
        return [f"--tag: {tag!r} names {name!r}, which is not one of {sorted(by_name)}"]
    if Version(version) != Version(by_name[name].version):
        return [
            f"--tag: {tag!r} says {version} but {name} is at {by_name[name].version}; "
            f"bump with `python tools/bump_version.py {name} {version}` or retag"
        ]
    return []


def check(root: Path = ROOT, tag: str | None = None) -> list[str]:
    """All violations under ``root`` (empty when everything holds)."""
    packages = load_packages(root)
    if not packages:
        return [f"{root / 'packages'}: no distributions found"]
    problems = sibling_problems(packages) + torch_problems(packages) + namespace_problems(packages)
    if tag:
        problems += tag_problems(packages, tag)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check sibling pins, the torch range and the namespace rule.")
    parser.add_argument("--tag", help="a release tag to check against its package's version")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problems = check(args.root, args.tag)
    for problem in problems:
        print(f"pin check: {problem}", file=sys.stderr)
    if not problems:
        names = ", ".join(f"{p.name} {p.version}" for p in load_packages(args.root))
        print(f"pin check: ok ({names})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
