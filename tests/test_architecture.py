"""The import direction between kvshm's layers holds (import-linter contracts in setup.cfg).

The layers, top to bottom: ``integrations`` > ``inspect`` | ``engine`` > ``tier`` > ``index``
| ``transfer`` > ``shm``; ``errors``, ``crashpoints`` and ``units`` import nothing of kvshm. A
module that reaches upwards fails here with the offending import chain.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 450  # lines: a module that grows past this holds more than one concept


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or pytest.fail("import-linter is not installed; "
                                                      "pip install -e '.[test]'")
    out = subprocess.run([exe, "--config", os.path.join(ROOT, "setup.cfg")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_module_is_longer_than_the_house_limit():
    long = []
    for d, _, files in os.walk(os.path.join(ROOT, "kvshm")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    n = sum(1 for _ in fh)
                if n > LIMIT:
                    long.append(f"{os.path.relpath(os.path.join(d, f), ROOT)}: {n}")
    assert not long, f"modules over {LIMIT} lines (split them by concept): {long}"

