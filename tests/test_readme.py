"""The README's examples run as written, so the documented API and flags cannot drift."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from overdrive.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
ALL_TEXT = "\n".join([README, *DOCS.values()])  # the front page and the pages it links to
# Options of other programs that README commands pass through (torchrun's) or name in prose (make's targets).
FOREIGN_FLAGS = {"--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--help"}


def _blocks(language: str, text: str = README) -> list[str]:
    """The fenced code blocks of `text` (the README) whose fence names `language` ("" for a bare fence)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), [])
            else:
                if current[0] == language:
                    blocks.append("\n".join(current[1]) + "\n")
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def _commands() -> list[list[str]]:
    """Every `overdrive ...` command in the shell blocks of the README and docs/, as the words after `overdrive`."""
    commands = []
    for block in _blocks("", ALL_TEXT):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if not re.match(r"^(\.venv/bin/overdrive|torchrun|python -m overdrive) ", line):
                continue  # make, curl: not overdrive's
            words = shlex.split(line, comments=True)
            if words[0].endswith("overdrive"):
                commands.append(words[1:])
            elif "-m" in words and words[words.index("-m") + 1:words.index("-m") + 2] == ["overdrive"]:
                commands.append(words[words.index("-m") + 2:])
    return [c for c in commands if "..." not in c]


def test_readme_has_examples():
    assert len(_blocks("python")) >= 1 and len(_commands()) >= 20


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w)[:60])
def test_every_shell_example_parses(words):
    """Each command's verb and flags exist and take the values shown (argparse exits 2 otherwise)."""
    args = build_parser().parse_args(words)
    assert args.command == words[0]


def test_every_flag_the_readme_names_exists():
    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "command").choices
    known = {opt for sub in verbs.values() for action in sub._actions for opt in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", ALL_TEXT))
    assert named - known - FOREIGN_FLAGS == set()


def test_the_front_page_is_short_and_links_every_page():
    assert len(README.splitlines()) <= 150
    for name in DOCS:
        assert f"docs/{name}" in README, f"docs/{name} is not linked from the README"


def test_the_readme_lists_every_technique():
    from overdrive.techniques import list_techniques

    table = README.split("## Techniques", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9:-]+)`", table))
    assert {t.name for t in list_techniques()} <= named


@pytest.mark.parametrize("page", sorted(DOCS))
def test_every_python_block_in_the_docs_parses(page):
    import ast

    for block in _blocks("python", DOCS[page]):
        ast.parse(block)


def test_list_example_runs():
    result = subprocess.run([sys.executable, "-m", "overdrive", "list"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "prune-heads" in result.stdout and "minilm" in result.stdout, result.stderr
    assert "pydoc-lm" in result.stdout and "prompt-lookup" in result.stdout


@pytest.mark.slow
def test_python_example_runs_on_a_torchvision_model_and_on_minilm(tmp_path):
    """The README's Python block, executed as written (in a scratch folder for its out/)."""
    (code,) = _blocks("python")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("baseline (eager fp32) True")
    assert any(line.startswith("channels-last ") for line in lines) and any(line.startswith("bf16 ") for line in lines)
    assert (tmp_path / "out" / "resnet18" / "plan.json").exists() and (tmp_path / "out" / "resnet18" / "report.md").exists()
    bench = [line for line in lines if re.match(r"^(1|8) [0-9.]+ ms [0-9.]+ samples/s$", line)]
    assert [line.split()[0] for line in bench] == ["1", "8"]
    names, _, headline = lines[-1].partition("] ")  # minilm's plan and its speedup, or why it is uncertain
    assert names.startswith("[") and re.match(r"^([0-9.]+× \[|at least [0-9.]+×|speedup uncertain|the baseline)", headline), lines[-1]


def test_the_gpu_check_parses_and_names_every_part_it_has():
    """`make gpu-check` runs only on a lent GPU machine: here, bash parses it, every `want PART` is in the list its
    ONLY comment gives, and docs/gpu-check.md names every part."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
    parts = set(re.findall(r"\bwant ([a-z-]+)", script))
    listed = set(re.search(r"runs just those parts \(([^)]*)\)", script).group(1).split())
    assert parts and parts <= listed, parts - listed
    page = (ROOT / "docs" / "gpu-check.md").read_text()
    extra = {p for p in parts - {"tests", "optimize", "sparsity", "train", "run"} if f"ONLY={p}`" not in page}
    assert not extra, f"docs/gpu-check.md does not name {extra}"
