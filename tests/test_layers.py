"""The packages' layering: every import, lazy ones inside functions included, points down.

core < files < generate < workloads < train < techniques < tuning < {deploy, run, serve} < {ray, cli}: a lower
package never imports a higher one, so a technique can be read (and tested) without the tuner,
and `workloads` without `run`. Packages on the same level may not import each other either, except
where `SIDEWAYS` says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import overdrive

ROOT = Path(overdrive.__file__).parent
LEVEL = {"core": 0, "files": 1, "generate": 2, "workloads": 3, "train": 4, "techniques": 5, "tuning": 6,
         "deploy": 7, "run": 7, "serve": 7, "ray": 8, "cli": 9}
SIDEWAYS = {("serve", "run")}  # serve measures text rows the way run does (run.replica.text_lengths)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(line, m) for line, m in found if m.startswith("overdrive.")]


def _package(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_level():
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and not p.name.startswith("__"))}
    assert packages == set(LEVEL)


def test_no_import_points_up():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if len(rel.parts) == 1 and rel.name.startswith("__"):
            continue  # overdrive/__init__.py and __main__.py sit above everything
        own = rel.parts[0].removesuffix(".py")
        for line, module in _imports(path):
            target = _package(module)
            if target not in LEVEL or target == own:
                continue
            if LEVEL[target] > LEVEL[own] or (LEVEL[target] == LEVEL[own] and (own, target) not in SIDEWAYS):
                wrong.append(f"{rel}:{line} ({own}) imports {module}")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", ["overdrive.techniques", "overdrive.workloads", "overdrive.files.onnx"])
def test_a_lower_package_imports_without_the_higher_ones(module):
    """Importing it loads nothing of tuning, run, serve or the CLI (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in "
            "[['overdrive', p] for p in ('tuning', 'run', 'serve', 'cli', 'deploy', 'ray')])\n"
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
