"""Imports run one way (docs/architecture.md): cli -> launcher -> control -> rendezvous ->
protocol; worker -> comm -> protocol; console and protocol are leaves; integrations (adapters
of third-party trainers) use only the public ``tmrun`` API (``tmrun.init()``), no package. Read from the sources
(every import statement, also those inside functions), so a new back edge fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tmrun"

ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "console": set(),
    "rendezvous": {"protocol", "console"},
    "control": {"rendezvous", "protocol", "console"},
    "launcher": {"control", "rendezvous", "protocol", "console"},
    "cli": {"launcher", "control", "rendezvous", "protocol", "console"},
    "comm": {"protocol", "console"},
    "worker": {"comm", "protocol", "console"},
    "integrations": set(),
}


def _tmrun_imports(path: Path) -> set[str]:
    """The tmrun packages a module imports (``tmrun.X...`` -> X)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tmrun" and len(parts) > 1 and parts[1] in ALLOWED:
                found.add(parts[1])
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def test_every_package_is_known() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(module: Path) -> None:
    package = module.relative_to(PACKAGE).parts[0]
    back_edges = _tmrun_imports(module) - ALLOWED[package] - {package}
    assert not back_edges, f"{module.relative_to(PACKAGE)} imports tmrun.{sorted(back_edges)} against the arrows"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_every_package_says_what_it_owns(package: str) -> None:
    init = PACKAGE / package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text()))
    assert docstring and len(docstring.split()) >= 8, f"tmrun/{package}/__init__.py needs a docstring"
