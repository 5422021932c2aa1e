"""The import direction between kvshm's layers holds (import-linter contracts in setup.cfg).

The layers, top to bottom: ``integrations`` > ``inspect`` | ``engine`` > ``tier`` > ``client`` |
``owner`` > ``index`` | ``transfer`` > ``shm``; ``errors``, ``crashpoints`` and ``units`` import
nothing of kvshm. The engine side (``client``) and the owner share only ``index`` (the API, the
protocol) and the segment. A module that reaches upwards or sideways fails here with the
offending import chain. The other house rules a tool can check run here too: the module
length cap, ruff and mypy (their settings are pyproject.toml's).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 400  # lines: a module that grows past this holds more than one concept


@pytest.mark.procs
def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or pytest.fail("import-linter is not installed; "
                                                      "pip install -e '.[test]'")
    out = subprocess.run([exe, "--config", os.path.join(ROOT, "setup.cfg")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_module_is_longer_than_the_house_limit():
    """No module of kvshm is over ``LIMIT`` lines: one concept, read in one sitting.

    Past that a module holds several concepts. Split it by concept (a class or a protocol
    with the state it owns), never with mixins or one class spread over files: those pass
    the count but make a reader open several files to know one object's state.
    """
    long = []
    for d, _, files in os.walk(os.path.join(ROOT, "kvshm")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    n = sum(1 for _ in fh)
                if n > LIMIT:
                    long.append(f"{os.path.relpath(os.path.join(d, f), ROOT)}: {n}")
    assert not long, f"modules over {LIMIT} lines (split them by concept): {long}"


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed; pip install -e '.[test]' installs it")
    return exe


@pytest.mark.procs  # runs ruff
def test_ruff_finds_nothing_in_the_library():
    """The lint rules pyproject.toml selects hold for every module of kvshm/."""
    out = subprocess.run([_tool("ruff"), "check", "kvshm"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.procs  # runs mypy
def test_mypy_finds_nothing_in_the_library():
    """kvshm/ type-checks under the mypy settings in pyproject.toml."""
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr


def test_clients_start_the_owner_by_the_entry_point_the_owner_package_provides():
    """The one import the checks cannot see (a module path a client runs with ``-m``) is
    named once, in kvshm.index.launch, and names the owner package's ``main``."""
    import importlib.util

    from kvshm.index.launch import OWNER_MODULE
    from kvshm.owner.command import main
    assert OWNER_MODULE.split(".")[:2] == ["kvshm", "owner"]
    spec = importlib.util.find_spec(OWNER_MODULE + ".__main__")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as f:
        assert "from kvshm.owner.command import main" in f.read()
    assert callable(main)


def _cycles(modules: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in modules[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_module_imports_itself_back_through_others():
    """No import cycle, type-checking imports included: a cycle means two modules hold one
    concept between them (or one reaches into the other's privates)."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter")
    graph = grimp.build_graph("kvshm", include_external_packages=False)
    modules = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(modules) == []
