"""docs/dependencies.md says why each package is there: every package of requirements.lock and of
pyproject.toml (dependencies and the dev extra) has a row, and every row names a pinned package."""
from __future__ import annotations

import re
import tomllib

from tests.docs.blocks import ROOT

DEPENDENCIES_PAGE = ROOT / "docs" / "dependencies.md"


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_packages() -> set[str]:
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    return {normalized(line.split("==")[0].strip()) for line in lines if line.strip() and not line.startswith("#")}


def declared_packages() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(requirement for extra in extras for requirement in extra)]
    return {normalized(re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0]) for requirement in requirements}


def explained_packages() -> set[str]:
    """The package names of the first column of the page's table ("fastapi, uvicorn", "import-linter (grimp)")."""
    names = set()
    for line in DEPENDENCIES_PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("package", "---"):
            continue
        names.update(normalized(name) for name in re.split(r"[,()]", cells[0]) if name.strip())
    return {name.strip() for name in names}


def test_every_locked_and_declared_package_is_explained():
    assert sorted((locked_packages() | declared_packages()) - explained_packages()) == []


def test_every_explained_package_is_locked():
    assert sorted(explained_packages() - locked_packages()) == []
