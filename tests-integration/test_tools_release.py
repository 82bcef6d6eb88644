"""The release tools: pin checker, version bump, and the layout rules they enforce."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("current", "part", "expected"),
    [
        ("0.1.0", "minor", "0.2.0"),
        ("0.1.3", "patch", "0.1.4"),
        ("0.9.1", "major", "1.0.0"),
        ("0.1.0", "0.1.5", "0.1.5"),
    ],
)
def test_next_version(current: str, part: str, expected: str) -> None:
    assert bump_version.next_version(current, part) == expected


@pytest.mark.parametrize(("part", "message"), [("0.0.9", "not greater"), ("sideways", "neither one of")])
def test_next_version_rejects(part: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bump_version.next_version("0.1.0", part)


def test_bump_writes_version_and_changelog_then_pins_flag_dependants(repo: Path) -> None:
    assert bump_version.bump("dcomm-core", "minor", root=repo) == "0.2.0"
    core = repo / "packages/dcomm-core"
    assert '__version__ = "0.2.0"' in (core / "src/dcomm/core/__about__.py").read_text()
    assert "## 0.2.0 — unreleased" in (core / "CHANGELOG.md").read_text()
    problems = check_pins.sibling_problems(load_packages(repo))
    assert sorted(p.split(":")[0] for p in problems) == ["dcomm-averaging", "dcomm-ddp", "dcomm-fsdp"]
