"""Show that one distribution installs alone: dcomm-ddp + dcomm-core, nothing else of ours.

Builds the two wheels with ``hatch build`` (wheel + sdist, as a release would), installs the wheels
into a fresh virtual environment that sees torch but none of the editable dcomm packages, and
checks that ``dcomm.ddp`` imports there while ``dcomm.fsdp`` and ``dcomm.averaging`` do not exist.

Example::

    python tools/check_selective_install.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import torch
from workspace import ROOT

PROBE = """
import importlib.util, sys
import dcomm.ddp, dcomm.core
assert dcomm.ddp.__file__.startswith(sys.prefix), dcomm.ddp.__file__
missing = [m for m in ("dcomm.fsdp", "dcomm.averaging") if importlib.util.find_spec(m) is not None]
assert not missing, f"installed without being asked for: {missing}"
print("selective install: dcomm.ddp", dcomm.ddp.__version__, "imports; dcomm.fsdp and dcomm.averaging absent")
"""


def run(*cmd: str, cwd: Path | None = None) -> None:
    # Outside the calling hatch environment: its name means nothing to the package's own project.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HATCH_ENV")}
    subprocess.run(cmd, cwd=cwd, check=True, env=env)


def build(package: str, out: Path) -> list[Path]:
    """``hatch build`` inside the package folder (wheel and sdist) into ``out``."""
    hatch = shutil.which("hatch") or "hatch"
    run(hatch, "build", "-t", "wheel", "-t", "sdist", str(out), cwd=ROOT / "packages" / package)
    return sorted(out.glob("*.whl"))


def main() -> int:
    torch_site = Path(torch.__file__).resolve().parent.parent
    if (torch_site / "dcomm").exists():
        print(f"selective install: {torch_site} holds a dcomm install; run from an editable env", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dcomm-selective-") as tmp:
        tmp_path = Path(tmp)
        dist_dir = tmp_path / "dist"
        for package in ("dcomm-core", "dcomm-ddp"):
            build(package, dist_dir)
        sdists = sorted(p.name for p in dist_dir.glob("*.tar.gz"))
        assert len(sdists) == 2, f"expected two sdists, got {sdists}"
        env_dir = tmp_path / "env"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        python = env_dir / "bin" / "python"
        site = Path(
            subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
            .decode()
            .strip()
        )
        # torch (and only the directory holding it) without reinstalling a 700 MB wheel: a path
        # line in a .pth file adds the folder; .pth files inside it (editable dcomm) are not run.
        (site / "torch_only.pth").write_text(f"{torch_site}\n")
        wheels = [str(w) for w in dist_dir.glob("*.whl")]
        run(str(python), "-m", "pip", "install", "-q", "--no-deps", *wheels)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([str(python), "-c", PROBE], check=True, env=env, cwd=tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
