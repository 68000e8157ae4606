"""Write poetry.lock at the versions uv.lock holds, or check that the two locks agree.

    python dev/lock_poetry.py           # re-lock for Poetry (dev/update_lock.sh runs it after `uv lock`)
    python dev/lock_poetry.py --check   # exit 1 naming each package where the locks differ (needs no Poetry)

uv.lock is the source of truth; poetry.lock follows it. Poetry's resolver takes the newest versions pyproject.toml
allows, not uv's, so the lock is written in two steps, in scratch folders: Poetry first locks a project that asks for
exactly the pins of requirements/constraints.txt (uv.lock's export), then re-locks the real pyproject.toml beside that
lock, keeping every locked version it allows. The result is checked against uv.lock before it replaces poetry.lock.

The locks agree when every package poetry.lock holds is in uv.lock at the same versions, and the only packages of
uv.lock that poetry.lock lacks are those torch needs only on Linux (the CUDA build's packages): pyproject.toml leaves
Linux's torch out of Poetry's lock, for pip to install the build of one's choice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from packaging.markers import Marker
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pytest brings tomli there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = "cleanrlhf"
LINUX = {"sys_platform": "linux", "platform_system": "Linux"}


def locked_versions(lock: Path) -> dict[str, set[Version]]:
    """Each package a lock (uv.lock or poetry.lock: both TOML, one [[package]] per version) holds, by name, with its
    versions, the project itself left out."""
    versions = defaultdict(set)
    for package in tomllib.loads(lock.read_text())["package"]:
        if package["name"] != PROJECT:
            versions[package["name"]].add(Version(package["version"]))
    return dict(versions)


def only_on_linux(marker: str) -> bool:
    """Whether a dependency marker holds on Linux and nowhere else (for any Python and machine)."""
    if not any(key in marker for key in LINUX):
        return False
    parsed = Marker(marker)
    other = {"sys_platform": "darwin", "platform_system": "Darwin"}
    return not parsed.evaluate(other) and not parsed.evaluate({"sys_platform": "win32", "platform_system": "Windows"})


def packages_poetry_locks(uv_lock: Path) -> set[str]:
    """The packages of uv.lock that Poetry's lock must hold: everything the project and its extras reach, except
    through torch's Linux-only dependencies."""
    packages = tomllib.loads(uv_lock.read_text())["package"]
    edges = defaultdict(list)
    for package in packages:
        dependencies = list(package.get("dependencies", []))
        for extra in package.get("optional-dependencies", {}).values():
            dependencies += extra
        for dependency in dependencies:
            if package["name"] == "torch" and only_on_linux(dependency.get("marker", "")):
                continue
            edges[package["name"]].append(dependency["name"])
    reached, stack = set(), [PROJECT]
    while stack:
        name = stack.pop()
        for dependency in edges[name]:
            if dependency not in reached:
                reached.add(dependency)
                stack.append(dependency)
    return reached


def disagreements(uv_lock: Path, poetry_lock: Path) -> list[str]:
    """One line per package where poetry.lock does not hold what uv.lock says it should; empty when they agree."""
    uv, poetry = locked_versions(uv_lock), locked_versions(poetry_lock)
    expected = packages_poetry_locks(uv_lock)
    problems = []
    for name in sorted(expected | set(poetry)):
        want, have = uv.get(name, set()), poetry.get(name, set())
        if name not in expected:
            held = ", ".join(map(str, sorted(have)))
            why = "uv.lock needs it only for torch on Linux, which Poetry leaves to pip" if name in uv else "uv.lock does not"
            problems.append(f"{name}: poetry.lock holds {held}; {why}")
        elif want != have:
            shown = ", ".join(map(str, sorted(have))) or "missing"
            problems.append(f"{name}: poetry.lock {shown}, uv.lock {', '.join(map(str, sorted(want)))}")
    return problems


def pins(constraints: Path, keep: set[str]) -> list[str]:
    """The constraints file's requirement lines (`name==version ; marker`) for the packages in keep."""
    lines = [line.strip() for line in constraints.read_text().splitlines() if re.match(r"[A-Za-z0-9]", line)]
    return [line for line in lines if re.split(r"[=;\s]", line, maxsplit=1)[0] in keep]


def poetry_lock(poetry: str, folder: Path) -> None:
    environment = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    environment["POETRY_VIRTUALENVS_IN_PROJECT"] = "true"  # Poetry's venv for the folder goes away with it
    result = subprocess.run([poetry, "lock"], cwd=folder, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: poetry lock failed in {folder}:\n{result.stdout}{result.stderr}")


def write_lock(poetry: str) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = pins(REPO / "requirements" / "constraints.txt", packages_poetry_locks(REPO / "uv.lock"))
    with tempfile.TemporaryDirectory() as scratch:
        pinned, real = Path(scratch) / "pinned", Path(scratch) / "real"
        pinned.mkdir()
        listed = "".join(f"    {json.dumps(requirement)},\n" for requirement in requirements)  # a TOML string
        (pinned / "pyproject.toml").write_text(
            f'[project]\nname = "pinned"\nversion = "0"\nrequires-python = "{pyproject["project"]["requires-python"]}"\n'
            f"dependencies = [\n{listed}]\n\n[tool.poetry]\npackage-mode = false\n"
        )
        print(f"locking {len(requirements)} pins from requirements/constraints.txt with Poetry (minutes)", flush=True)
        poetry_lock(poetry, pinned)
        real.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, real / name)
        shutil.copy(pinned / "poetry.lock", real / "poetry.lock")
        print("re-locking pyproject.toml beside it (minutes)", flush=True)
        poetry_lock(poetry, real)
        problems = disagreements(REPO / "uv.lock", real / "poetry.lock")
        if problems:
            sys.exit("error: Poetry's lock does not agree with uv.lock:\n  " + "\n  ".join(problems))
        shutil.copy(real / "poetry.lock", REPO / "poetry.lock")
    print("updated poetry.lock: it agrees with uv.lock")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that poetry.lock agrees with uv.lock")
    args = parser.parse_args(argv)
    if args.check:
        problems = disagreements(REPO / "uv.lock", REPO / "poetry.lock")
        for problem in problems:
            print(f"disagrees: {problem}", file=sys.stderr)
        return 1 if problems else 0
    poetry = shutil.which("poetry")
    if poetry is None:
        sys.exit("error: poetry is not on PATH (bash dev/install_test_deps.sh installs it)")
    write_lock(poetry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
