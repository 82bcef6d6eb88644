"""Build every distribution's wheel and sdist and check what PyPI will show and what they carry.

For each package: ``hatch build`` (wheel + sdist), ``twine check --strict`` on both, the LICENSE
in both archives (the BSD license requires the notice to travel with the code; the package's copy
must equal the root LICENSE), a PyPI description whose links are all absolute, and every C++
source under the package's ``src`` in both archives (dcomm-ddp builds its C++ hooks from the
installed ``.cpp``: a wheel without it has no C++ path).

Example::

    hatch run package:check
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from workspace import ROOT, load_packages

RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)]+)\)")


def build(package: Path, out: Path) -> None:
    """``hatch build`` inside the package folder (wheel and sdist) into ``out``."""
    # Outside the calling hatch environment: its name means nothing to the package's own project.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HATCH_ENV")}
    hatch = shutil.which("hatch") or "hatch"
    subprocess.run([hatch, "build", "-t", "wheel", "-t", "sdist", str(out)], cwd=package, check=True, env=env)


def archive_problems(wheel: Path, sdist: Path, license_text: str) -> list[str]:
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        licenses = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        if not licenses or zf.read(licenses[0]).decode() != license_text:
            problems.append(f"{wheel.name}: no .dist-info/licenses/LICENSE equal to the root LICENSE")
        metadata_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(zf.read(metadata_name))
    description = metadata.get_payload()
    for link in RELATIVE_LINK.findall(description):
        problems.append(f"{wheel.name}: relative link {link!r} in the PyPI description (dead on PyPI)")
    urls = {value.split(",")[0] for value in metadata.get_all("Project-URL") or []}
    missing = {"Homepage", "Documentation", "Changelog", "Source", "Issues"} - urls
    if missing:
        problems.append(f"{wheel.name}: no Project-URL for {sorted(missing)}; add them to [project.urls]")
    with tarfile.open(sdist) as tf:
        names = [m.name for m in tf.getmembers() if m.name.count("/") == 1 and m.name.endswith("/LICENSE")]
        if not names:
            problems.append(f"{sdist.name}: no LICENSE at the top of the sdist")
    return problems


def native_source_problems(src: Path, wheel: Path, sdist: Path) -> list[str]:
    """Every ``.cpp`` under ``src`` must be in the wheel (at its import path) and in the sdist."""
    sources = sorted(path.relative_to(src).as_posix() for path in src.rglob("*.cpp"))
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    with tarfile.open(sdist) as tf:
        in_sdist = {member.name.split("/", 1)[-1] for member in tf.getmembers()}
    problems = [
        f"{wheel.name}: no {source} (the C++ path builds from it)" for source in sources if source not in in_wheel
    ]
    problems += [f"{sdist.name}: no src/{source}" for source in sources if f"src/{source}" not in in_sdist]
    return problems


def main() -> int:
    license_text = (ROOT / "LICENSE").read_text()
    problems = []
    with tempfile.TemporaryDirectory(prefix="dcomm-dists-") as tmp:
        for package in load_packages():
            if (package.folder / "LICENSE").read_text() != license_text:
                problems.append(f"{package.folder / 'LICENSE'}: differs from the root LICENSE; copy it")
            out = Path(tmp) / package.name
            build(package.folder, out)
            (wheel,), (sdist,) = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
            problems += archive_problems(wheel, sdist, license_text)
            problems += native_source_problems(package.folder / "src", wheel, sdist)
            subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], check=True)
    for problem in problems:
        print(f"dist check: {problem}", file=sys.stderr)
    if not problems:
        print(
            "dist check: ok (wheels and sdists carry LICENSE, C++ sources, absolute links, project URLs, "
            "twine --strict)"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
