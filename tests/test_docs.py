"""The docs' code runs as shown: README.md and docs/*.md.

Every fenced ```python block runs in a fresh interpreter, with each segment name it passes to
``kvshm.connect`` replaced by a unique one (removed afterwards). A block that cannot run
standalone (vLLM configuration, API signatures) is marked in the markdown by a preceding
``<!-- not-run: why -->`` line whose reason names vLLM; those, and only those, are skipped,
each by name. Every command
line in a ```bash block (or after ``$ `` in an output block) that runs ``kvshm-inspect`` or
``python tools/...`` must parse: kvshm-inspect's through its real parser, a tool's ``--help``
must work.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvshm.inspect.cli import build_parser
from kvshm.shm.segment import Segment

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$")


def blocks(lang: str) -> list[tuple[str, str, str | None]]:
    """(where, code, why-not-run) of every fenced block in language ``lang``."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) != lang:
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            why = NOT_RUN.match(before)
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(2),
                        why.group(1) if why else None))
    return out


PY = blocks("python")


@pytest.mark.parametrize("where,code,why", PY, ids=[w for w, _, _ in PY])
def test_python_block_runs(where, code, why, tmp_path):
    if why is not None:
        pytest.skip(f"{where} marked not-run: {why}")
    names = set(re.findall(r"""connect\(\s*["']([\w.-]+)["']""", code))
    fresh = {n: f"docs-{n}-{uuid.uuid4().hex[:8]}" for n in names}
    for old, new in fresh.items():
        code = re.sub(rf"""(["'])({re.escape(old)})\1""", rf"\g<1>{new}\g<1>", code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)}
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    finally:
        for new in fresh.values():
            Segment.unlink(new)  # its idle owner sees the segment gone and exits
    assert p.returncode == 0, f"{where} failed:\n{p.stderr[-3000:]}"


@pytest.mark.unit
def test_only_marked_blocks_are_skipped():
    skipped = [f"{w} ({why})" for w, _, why in PY if why is not None]
    assert len(skipped) < len(PY), "every python block is marked not-run"
    print("not run:", *skipped, sep="\n  ")
    assert all("vLLM" in why for _, _, why in PY if why is not None), skipped


def command_lines() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line0 = text.count("\n", 0, m.start()) + 2
            for i, line in enumerate(m.group(2).splitlines()):
                cmd = line[2:] if line.startswith("$ ") else line if m.group(1) == "bash" else ""
                if cmd.startswith(("kvshm-inspect", "python tools/")):
                    out.append((f"{path.relative_to(ROOT)}:{line0 + i}", cmd.split("&&")[0]))
    return out


CMDS = command_lines()


# kvshm-inspect's command lines parse in this process (unit); a tool's --help runs the tool.
@pytest.mark.parametrize("where,cmd", [
    pytest.param(w, c, id=w, marks=pytest.mark.unit if c.startswith("kvshm-inspect") else ())
    for w, c in CMDS])
def test_command_lines_parse(where, cmd):
    argv = shlex.split(cmd)
    if argv[0] == "kvshm-inspect":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as e:
            pytest.fail(f"{where}: {cmd!r} does not parse (exit {e.code})")
    else:
        assert (ROOT / argv[1]).is_file(), f"{where}: no {argv[1]}"
        p = subprocess.run([sys.executable, argv[1], "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 0 and "usage:" in p.stdout, f"{where}: {p.stderr[-2000:]}"


@pytest.mark.unit
def test_there_are_command_lines_to_check():
    assert any(c.startswith("python tools/") for _, c in CMDS)
    assert any(c.startswith("kvshm-inspect") for _, c in CMDS)
