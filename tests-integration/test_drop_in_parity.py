"""Every public name of each torch module dcomm replaces exists in dcomm with torch's signature.

The signatures are compared with ``inspect`` (like opentelemetry-python's ``griffe_check.py``
guards its API): parameter names, kinds and defaults of every public function, class constructor
and public method. What dcomm deliberately does differently (an added keyword, an added method, a
name not there yet) is listed in one table of the migration guide (docs/migration.md),
"Deliberate differences from torch"; this test reads that table. A difference not in the table
fails, and so does a row that no longer describes a difference. The guide also names every
public name of every dcomm package: torch's in its module table, dcomm's own in "What dcomm adds".
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "migration.md"
TABLE_HEADING = "## Deliberate differences from torch"
ADDED_HEADING = "## What dcomm adds"
PACKAGES = ("dcomm.core", "dcomm.ddp", "dcomm.fsdp", "dcomm.averaging")

# torch module -> the dcomm package that re-exports its replacements.
MIRRORED = {
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks": "dcomm.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook": "dcomm.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook": "dcomm.ddp",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook": "dcomm.ddp",
    "torch.distributed.algorithms.model_averaging.averagers": "dcomm.averaging",
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": "dcomm.averaging",
    "torch.distributed.algorithms.model_averaging.utils": "dcomm.averaging",
    "torch.distributed.optim.post_localSGD_optimizer": "dcomm.averaging",
    "torch.distributed.algorithms._comm_hooks.default_hooks": "dcomm.fsdp",
}


def public_names(module: object) -> list[str]:
    """The module's ``__all__``, else the functions and classes it defines without a leading _."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__
        ]
    return sorted(names)


def parameters(obj: object) -> dict[str, tuple[str, str | None]] | None:
    """name -> (kind, default) of ``obj``'s signature; None when it has none."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return {
        p.name: (p.kind.name, None if p.default is p.empty else repr(p.default)) for p in signature.parameters.values()
    }


def signature_differences(theirs: object, ours: object) -> list[str]:
    """The parameters that differ: torch's missing or changed, dcomm's added (each as a name)."""
    t, o = parameters(theirs), parameters(ours)
    if t is None or o is None:
        return [] if t == o else ["(signature)"]
    differing = [name for name in t if o.get(name) != t[name]]
    if [n for n in o if n in t] != list(t):
        differing.append("(parameter order)")
    return differing + [name for name in o if name not in t]


def member_names(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def differences() -> dict[str, set[str]]:
    """torch's qualified name -> the names (parameters, members) where dcomm differs."""
    found: dict[str, set[str]] = {}
    for torch_module, dcomm_module in MIRRORED.items():
        theirs_module, ours_module = importlib.import_module(torch_module), importlib.import_module(dcomm_module)
        for name in public_names(theirs_module):
            key = f"{torch_module}.{name}"
            theirs, ours = getattr(theirs_module, name), getattr(ours_module, name, None)
            if ours is None or name not in ours_module.__all__:
                found[key] = {"(missing)"}
                continue
            diff = set(signature_differences(theirs, ours))
            if inspect.isclass(theirs):
                diff |= member_names(theirs) ^ member_names(ours)
                for member in member_names(theirs) & member_names(ours):
                    theirs_member, ours_member = getattr(theirs, member), getattr(ours, member)
                    if callable(theirs_member) and signature_differences(theirs_member, ours_member):
                        diff.add(member)
            if diff:
                found[key] = diff
    return found


def section_rows(heading: str) -> dict[str, str]:
    """The table under ``heading`` in the guide: its first column's `name` -> the rest of the row."""
    text = GUIDE.read_text()
    assert heading in text, f"{GUIDE.name}: no {heading!r} section"
    rows: dict[str, str] = {}
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        match = re.match(r"\|\s*`([\w.]+)`\s*\|(.*)\|\s*$", line)
        if match:
            assert match.group(1) not in rows, f"{GUIDE.name} table: {match.group(1)} has two rows; use one"
            rows[match.group(1)] = match.group(2)
    assert rows, f"{GUIDE.name}: the {heading!r} section has no table rows"
    return rows


def table() -> dict[str, str]:
    """The differences table: torch's qualified name (first column) -> the row's text."""
    return section_rows(TABLE_HEADING)


def is_expected_later(row: str) -> bool:
    return "expected later" in row


def test_every_difference_is_in_the_migration_table() -> None:
    rows = table()
    problems = []
    for key, diff in sorted(differences().items()):
        row = rows.get(key)
        if row is None:
            problems.append(f"{key}: differs from torch in {sorted(diff)}; add a row to the table in docs/migration.md")
            continue
        if is_expected_later(row):
            continue
        unnamed = sorted(d for d in diff if not d.startswith("(") and not re.search(rf"`{re.escape(d)}\b", row))
        if unnamed:
            problems.append(f"{key}: the migration row does not name {unnamed} (as `name`, `name=...` or `name(...)`)")
        if "(missing)" in diff:
            problems.append(f"{key}: missing from dcomm; add it or mark the row 'expected later'")
    assert not problems, "\n".join(problems)


def test_no_stale_rows_in_the_migration_table() -> None:
    current = differences()
    stale = [key for key, row in table().items() if key not in current and not is_expected_later(row)]
    assert not stale, f"docs/migration.md rows that no longer differ from torch: {stale}; delete them"
    unknown = [key for key in table() if not key.startswith(tuple(MIRRORED))]
    assert not unknown, f"docs/migration.md rows for names outside the mirrored modules: {unknown}"


# Positional parameters added after torch's would shift a positional call; keyword-only ones do not.
@pytest.mark.parametrize("torch_module", sorted(MIRRORED))
def test_added_parameters_are_keyword_only(torch_module: str) -> None:
    theirs_module = importlib.import_module(torch_module)
    ours_module = importlib.import_module(MIRRORED[torch_module])
    positional = []
    for name in public_names(theirs_module):
        theirs, ours = getattr(theirs_module, name), getattr(ours_module, name, None)
        t, o = parameters(theirs), parameters(ours) if ours is not None else None
        if t is None or o is None:
            continue
        added = [p for p, (kind, _) in o.items() if p not in t and kind not in ("KEYWORD_ONLY", "VAR_KEYWORD")]
        positional += [f"{name}({p})" for p in added]
    assert not positional, f"{torch_module}: added parameters that are not keyword-only: {positional}"


def public_dcomm_names() -> dict[str, list[str]]:
    """package -> the names of its ``__all__`` a user imports (not ``__version__``)."""
    return {
        package: [name for name in importlib.import_module(package).__all__ if not name.startswith("__")]
        for package in PACKAGES
    }


def test_every_public_name_is_in_the_migration_guide() -> None:
    text = GUIDE.read_text()
    missing = [
        f"{package}.{name}"
        for package, names in public_dcomm_names().items()
        for name in names
        if not re.search(rf"`{re.escape(name)}\b", text)
    ]
    assert not missing, (
        f"public names missing from docs/migration.md: {missing}; add each to its torch module's row "
        f"or to the {ADDED_HEADING!r} table"
    )


def added_rows() -> list[tuple[str, str]]:
    """(name, package) of each row of the guide's "What dcomm adds" table (a name may be in two packages)."""
    text = GUIDE.read_text()
    assert ADDED_HEADING in text, f"{GUIDE.name}: no {ADDED_HEADING!r} section"
    rows = []
    for line in text.split(ADDED_HEADING, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        match = re.match(r"\|\s*`([\w.]+)`\s*\|\s*`([\w.]+)`\s*\|", line)
        if match:
            rows.append((match.group(1), match.group(2)))
    assert rows, f"{GUIDE.name}: the {ADDED_HEADING!r} section has no table rows"
    return rows


def test_added_names_exist_where_the_guide_says() -> None:
    public = public_dcomm_names()
    stale = [f"{name} ({package})" for name, package in added_rows() if name not in public.get(package, [])]
    assert not stale, f"docs/migration.md, {ADDED_HEADING!r}: rows naming no public name of that package: {stale}"
