"""Every public name of each torch module dcomm replaces exists in dcomm with torch's signature.

The signatures are compared with ``inspect`` (like opentelemetry-python's ``griffe_check.py``
guards its API): parameter names, kinds and defaults of every public function, class constructor
and public method. What dcomm deliberately does differently (an added keyword, an added method, a
name not there yet) is listed in one table in the root README, "Deliberate differences from
torch"; this test reads that table. A difference not in the table fails, and so does a row that
no longer describes a difference.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADING = "### Deliberate differences from torch"

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


def table() -> dict[str, str]:
    """The README table: torch's qualified name (first column) -> the row's text."""
    text = (ROOT / "README.md").read_text()
    assert TABLE_HEADING in text, f"README.md: no {TABLE_HEADING!r} section"
    rows: dict[str, str] = {}
    for line in text.split(TABLE_HEADING, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        match = re.match(r"\|\s*`([\w.]+)`\s*\|(.*)\|\s*$", line)
        if match:
            assert match.group(1) not in rows, f"README table: {match.group(1)} has two rows; use one"
            rows[match.group(1)] = match.group(2)
    assert rows, f"README.md: the {TABLE_HEADING!r} section has no table rows"
    return rows


def is_expected_later(row: str) -> bool:
    return "expected later" in row


def test_every_difference_is_in_the_readme_table() -> None:
    rows = table()
    problems = []
    for key, diff in sorted(differences().items()):
        row = rows.get(key)
        if row is None:
            problems.append(f"{key}: differs from torch in {sorted(diff)}; add a row to the README table")
            continue
        if is_expected_later(row):
            continue
        unnamed = sorted(d for d in diff if not d.startswith("(") and not re.search(rf"`{re.escape(d)}\b", row))
        if unnamed:
            problems.append(f"{key}: the README row does not name {unnamed} (as `name`, `name=...` or `name(...)`)")
        if "(missing)" in diff:
            problems.append(f"{key}: missing from dcomm; add it or mark the row 'expected later'")
    assert not problems, "\n".join(problems)


def test_no_stale_rows_in_the_readme_table() -> None:
    current = differences()
    stale = [key for key, row in table().items() if key not in current and not is_expected_later(row)]
    assert not stale, f"README table rows that no longer differ from torch: {stale}; delete them"
    unknown = [key for key in table() if not key.startswith(tuple(MIRRORED))]
    assert not unknown, f"README table rows for names outside the mirrored modules: {unknown}"


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
