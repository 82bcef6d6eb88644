"""The release tools: pin checker, version bump, and the layout rules they enforce."""

from __future__ import annotations

import datetime
import re
import shutil
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import bump_version  # noqa: E402
import check_pins  # noqa: E402
from workspace import ROOT, load_packages  # noqa: E402


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the four packages' metadata, version files and namespace layout."""
    for package in load_packages():
        dest = tmp_path / "packages" / package.folder.name
        shutil.copytree(package.folder / "src", dest / "src", ignore=shutil.ignore_patterns("*.py[co]", "__pycache__"))
        for name in ("pyproject.toml", "CHANGELOG.md"):
            shutil.copy(package.folder / name, dest / name)
    return tmp_path


def test_repository_passes() -> None:
    assert check_pins.check(ROOT) == []
    assert {p.name for p in load_packages()} == {"dcomm-core", "dcomm-ddp", "dcomm-fsdp", "dcomm-averaging"}


def test_every_sibling_pin_is_a_compatible_range() -> None:
    for package in load_packages():
        if package.name != "dcomm-core":
            assert "dcomm-core>=0.1,<0.2" in package.dependencies


def test_sibling_pin_that_excludes_the_sibling(repo: Path) -> None:
    about = repo / "packages/dcomm-core/src/dcomm/core/__about__.py"
    about.write_text('__version__ = "0.2.0"\n')
    problems = check_pins.check(repo)
    assert len(problems) == 3
    assert "dcomm-ddp: pin 'dcomm-core<0.2,>=0.1' excludes dcomm-core 0.2.0" in problems[1]


def test_torch_range_must_be_the_shared_one(repo: Path) -> None:
    pyproject = repo / "packages/dcomm-fsdp/pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"torch>=2.11,<2.16"', '"torch>=2.12"'))
    (problem,) = check_pins.check(repo)
    assert problem == "dcomm-fsdp: torch range '>=2.12' is not the shared '>=2.11,<2.16'; pin 'torch>=2.11,<2.16'"


def test_namespace_init_is_rejected(repo: Path) -> None:
    (repo / "packages/dcomm-ddp/src/dcomm/__init__.py").write_text("")
    (problem,) = check_pins.check(repo)
    assert "dcomm is a PEP 420 namespace package" in problem


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("dcomm-ddp-v0.1.0", None),
        ("dcomm-ddp-v0.2.0", "says 0.2.0 but dcomm-ddp is at 0.1.0"),
        ("dcomm-gpu-v0.1.0", "names 'dcomm-gpu', which is not one of"),
        ("ddp-0.1.0", "is not of the form dcomm-<name>-v<version>"),
    ],
)
def test_tag_must_match_the_package_version(repo: Path, tag: str, message: str | None) -> None:
    problems = check_pins.check(repo, tag)
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1
        assert message in problems[0]


@pytest.mark.parametrize(("version", "pin"), [("0.2.0", ">=0.2,<0.3"), ("0.2.3", ">=0.2,<0.3"), ("1.4.0", ">=1.4,<2")])
def test_compatible_range(version: str, pin: str) -> None:
    assert bump_version.compatible_range(version) == pin


def test_release_dates_the_changelog_and_widens_dependants(repo: Path) -> None:
    core = repo / "packages/dcomm-core"
    about = core / "src/dcomm/core/__about__.py"
    about.write_text(about.read_text().replace('"0.1.0"', '"0.2.0"'))  # what `hatch version minor` does
    assert len(check_pins.sibling_problems(load_packages(repo))) == 3
    changelog = core / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace("## [Unreleased]\n", "## [Unreleased]\n\n- A change.\n", 1))

    version, repinned = bump_version.release("dcomm-core", root=repo, today=datetime.date(2026, 12, 1))
    assert (version, sorted(repinned)) == ("0.2.0", ["dcomm-averaging", "dcomm-ddp", "dcomm-fsdp"])
    assert check_pins.sibling_problems(load_packages(repo)) == []
    assert '"dcomm-core>=0.2,<0.3"' in (repo / "packages/dcomm-ddp/pyproject.toml").read_text()
    text = changelog.read_text()
    assert "## [Unreleased]\n\n## [0.2.0] - 2026-12-01\n\n" in text
    assert "- \n" not in text  # no empty bullet
    assert "[Unreleased]: https://github.com/dcomm-dev/dcomm/compare/dcomm-core-v0.2.0...HEAD" in text
    assert text.count("[Unreleased]: ") == 1
    notes = bump_version.release_notes(text, "0.2.0")
    assert notes.startswith("- A change.\n")
    assert "## [0.1.0]" not in notes


def test_release_refuses_an_empty_unreleased_section(repo: Path) -> None:
    changelog = repo / "packages/dcomm-ddp/CHANGELOG.md"
    text = changelog.read_text()
    start = text.index("## [Unreleased]") + len("## [Unreleased]")
    changelog.write_text(text[:start] + "\n\n" + text[text.index("## [0.1.0]") :])
    about = repo / "packages/dcomm-ddp/src/dcomm/ddp/__about__.py"
    about.write_text(about.read_text().replace('"0.1.0"', '"0.1.1"'))
    with pytest.raises(ValueError, match=r"'## \[Unreleased\]' has no entries to release"):
        bump_version.release("dcomm-ddp", root=repo)
    with pytest.raises(ValueError, match=r"no dated '## \[0.1.1\] - YYYY-MM-DD' section"):
        bump_version.release_notes(changelog.read_text(), "0.1.1")


def test_every_changelog_has_an_unreleased_section_and_dated_releases() -> None:
    for package in load_packages():
        text = (package.folder / "CHANGELOG.md").read_text()
        assert "## [Unreleased]" in text, package.name
        assert bump_version.release_notes(text, "0.1.0").strip(), package.name
        headings = [line for line in text.split("\n") if line.startswith("## ")]
        assert headings[0] == "## [Unreleased]", package.name
        undated = [h for h in headings[1:] if not re.match(r"^## \[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}$", h)]
        assert not undated, f"{package.name}: release headings without a date: {undated}"
