"""docs/errors.md is the catalogue of kvshm's errors: complete, and every entry is real."""
from __future__ import annotations

import pathlib
import re

import kvshm.errors as errors

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "errors.md").read_text()
DOCUMENTED = set(re.findall(r"^\| `([A-Za-z]+Error)`", DOC, re.M))
CLASSES = {n for n, v in vars(errors).items()
           if isinstance(v, type) and issubclass(v, errors.KvshmError) and v is not errors.KvshmError}
SOURCE = "\n".join(p.read_text() for p in (ROOT / "kvshm").rglob("*.py")
                   if p.name != "errors.py")


def test_every_error_class_is_documented():
    assert CLASSES - DOCUMENTED == set()


def test_every_documented_error_exists():
    assert DOCUMENTED - CLASSES == set()


def test_every_documented_error_is_raised_somewhere():
    raised = {n for n in DOCUMENTED if re.search(rf"\b{n}\(", SOURCE)}
    bases = {b.__name__ for n in raised for b in getattr(errors, n).__mro__}
    assert DOCUMENTED - raised - bases == set()


def test_a_base_class_never_raised_itself_says_so():
    for n in DOCUMENTED - {n for n in DOCUMENTED if re.search(rf"\b{n}\(", SOURCE)}:
        row = re.search(rf"^\| `{n}`.*$", DOC, re.M).group(0)
        assert "Never raised itself" in row, n
