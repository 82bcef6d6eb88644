"""After ``hatch version``: date the changelog's Unreleased section and widen the dependants' pins.

``hatch version`` (inside the package folder) writes the new version; this tool does the rest of
the release commit:

- the package's ``## [Unreleased]`` entries become ``## [<version>] - <today>`` under a fresh,
  empty ``## [Unreleased]``, and the compare links at the bottom follow;
- every sibling whose pin on the package excludes the new version is re-pinned to the new
  compatible range (``dcomm-core>=0.2,<0.3``): a 0.x minor release is breaking, so widening a
  dependant's pin is a deliberate change that shows up in the diff.

Example::

    cd packages/dcomm-ddp && hatch version minor && cd ../..   # 0.1.0 -> 0.2.0
    python tools/bump_version.py dcomm-ddp                     # changelog and dependants' pins
    git tag dcomm-ddp-v0.2.0                                   # the release workflow does the rest
    python tools/bump_version.py dcomm-ddp --notes             # that version's notes (the workflow's)
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version
from workspace import ROOT, Package, load_packages, package_named

UNRELEASED = "## [Unreleased]"
SECTION_RE = re.compile(r"^## \[", re.MULTILINE)


def compatible_range(version: str) -> str:
    """The pin that admits ``version`` and its compatible successors: ``>=0.2,<0.3``, ``>=1.4,<2``."""
    v = Version(version)
    if v.major == 0:
        return f">=0.{v.minor},<0.{v.minor + 1}"
    return f">={v.major}.{v.minor},<{v.major + 1}"


def release_changelog(text: str, name: str, version: str, today: datetime.date) -> str:
    """``text`` with its Unreleased entries moved under ``## [version] - today`` and links updated."""
    if UNRELEASED not in text:
        raise ValueError(f"CHANGELOG of {name}: no '{UNRELEASED}' section; add one above the releases")
    if f"## [{version}]" in text:
        raise ValueError(f"CHANGELOG of {name}: {version} already has a section; bump with `hatch version` first")
    start = text.index(UNRELEASED) + len(UNRELEASED)
    following = SECTION_RE.search(text, start)
    end = following.start() if following else len(text)
    entries = text[start:end].strip()
    if not re.search(r"^- \S", entries, re.MULTILINE):
        raise ValueError(f"CHANGELOG of {name}: '{UNRELEASED}' has no entries to release; add '- ...' lines under it")
    released = f"{UNRELEASED}\n\n## [{version}] - {today.isoformat()}\n\n{entries}\n\n"
    text = text[: text.index(UNRELEASED)] + released + text[end:].lstrip("\n")
    compare = f"[Unreleased]: https://github.com/dcomm-dev/dcomm/compare/{name}-v{version}...HEAD"
    tag_link = f"[{version}]: https://github.com/dcomm-dev/dcomm/releases/tag/{name}-v{version}"
    lines = [line for line in text.rstrip("\n").split("\n") if not line.startswith("[Unreleased]: ")]
    first_link = next((i for i, line in enumerate(lines) if re.match(r"^\[\d", line)), None)
    if first_link is None:
        lines += ["", compare, tag_link]
    else:
        lines[first_link:first_link] = [compare, tag_link]
    return "\n".join(lines) + "\n"


def release_notes(text: str, version: str) -> str:
    """The entries of ``## [version]`` in a changelog (the GitHub release's notes)."""
    match = re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}\n", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no dated '## [{version}] - YYYY-MM-DD' section; run tools/bump_version.py first")
    following = SECTION_RE.search(text, match.end())
    section = text[match.end() : following.start() if following else len(text)]
    return "\n".join(line for line in section.split("\n") if not re.match(r"^\[.+\]: ", line)).strip() + "\n"


def widen_dependants(packages: list[Package], name: str, version: str) -> list[str]:
    """Re-pin every sibling whose pin on ``name`` excludes ``version``; the names of those changed."""
    changed = []
    for package in packages:
        pyproject = package.folder / "pyproject.toml"
        text = pyproject.read_text()
        for dep in package.dependencies:
            requirement = Requirement(dep)
            if requirement.name != name or requirement.specifier.contains(version, prereleases=True):
                continue
            text = text.replace(f'"{dep}"', f'"{name}{compatible_range(version)}"')
            changed.append(package.name)
        pyproject.write_text(text)
    return changed


def release(name: str, root: Path = ROOT, today: datetime.date | None = None) -> tuple[str, list[str]]:
    """Date ``name``'s changelog for its current version and widen the pins; (version, re-pinned)."""
    package = package_named(name, root)
    version = package.version
    changelog = package.folder / "CHANGELOG.md"
    changelog.write_text(release_changelog(changelog.read_text(), name, version, today or datetime.date.today()))
    return version, widen_dependants(load_packages(root), name, version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Date the changelog and widen dependants' pins after `hatch version`.")
    parser.add_argument("package", help="e.g. dcomm-ddp")
    parser.add_argument("--notes", action="store_true", help="print the current version's release notes instead")
    args = parser.parse_args(argv)
    try:
        if args.notes:
            package = package_named(args.package)
            print(release_notes((package.folder / "CHANGELOG.md").read_text(), package.version), end="")
            return 0
        version, repinned = release(args.package)
    except ValueError as error:
        print(f"bump: {error}", file=sys.stderr)
        return 2
    print(f"{args.package} {version}: CHANGELOG dated; release tag: {args.package}-v{version}")
    for dependant in repinned:
        print(f"  {dependant}: now pins {args.package}{compatible_range(version)} (add a changelog entry)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
