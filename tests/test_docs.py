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


# --- the README's sample output: what the demo and kvshm-inspect print, as they print it ----
# Numbers, names, paths, keys and ages differ from run to run; everything else (every line,
# label, column and counter, the format version) must be what the tools print today.
DEMO_ARGS = ["--engines", "3", "--conversations", "3", "--turns", "2", "--system-prompts", "1",
             "--system-tokens", "64", "--user-tokens", "16", "--reply-tokens", "16",
             "--token-bytes", "64", "--device-blocks", "32", "--cache-mib", "1",
             "--device", "cpu", "--inline-workers"]


def shape(text: str, name: str) -> list[str]:
    t = text.replace(name, "NAME")
    t = re.sub(r"kvshm cache '[^']*'", "kvshm cache 'NAME'", t)
    t = re.sub(r"fingerprint [0-9a-f]+", "fingerprint F", t)
    t = re.sub(r"age [^)]*\)", "age A)", t)
    t = re.sub(r"owner log \S+", "owner log PATH", t)
    t = re.sub(r"[0-9a-f]{16}…", "KEY…", t)
    t = re.sub(r"format \d+", lambda m: m.group(0).replace(" ", "_"), t)  # never a "#"
    return re.sub(r"\d+(\.\d+)?", "#", t).split()


def readme_block(after: str) -> str:
    """The first fenced block after the README line that starts with ``after``."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n" + after)
    return FENCE.search(text, start).group(2)


def test_readme_sample_output_is_what_the_demo_and_inspect_print(tmp_path):
    name = f"docs-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)}

    def run(*argv: str) -> str:
        p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    try:
        printed = run("examples/colocated_engines.py", "--keep", "--cache", name, *DEMO_ARGS)
        sample = readme_block("What the demo prints")
        assert shape(sample, "demo") == shape(printed.split("\nkept: ")[0], name), printed
        session = readme_block("After `python examples/colocated_engines.py --keep")
        for part in session.split("$ ")[1:]:
            command, _, shown = part.partition("\n")
            argv = shlex.split(command)
            assert argv[0] == "kvshm-inspect", command
            out = run("-m", "kvshm.inspect.cli", *[name if a == "demo" else a for a in argv[1:]])
            assert shape(shown, "demo") == shape(out, name), out
    finally:
        Segment.unlink(name)


SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("tools", "examples")
                 for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tool_and_example_teaches_with_help(script):
    """``--help`` of every file in tools/ and examples/ says what it is and how to use it;
    a library module says so and names what to run instead."""
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and p.stdout.startswith("usage:"), (p.stdout, p.stderr[-2000:])
    assert len(p.stdout.splitlines()) >= 5, p.stdout  # a description, not a bare usage line
