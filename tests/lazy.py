"""Heavy modules that test files name at their top but import on first use.

Collecting the suite imports every test file, whatever ``-m`` or ``-k`` then selects; torch
alone took a third of that. ``from lazy import torch`` gives a stand-in whose first attribute
read imports torch, so only a run that reaches a test using it pays.
"""
from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module ``name``: the first read of a public attribute imports it.

    A name starting with "_" is never looked up in the module: pytest probes every object
    of a test file for such names (``__test__``, fixture markers) while collecting it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch = LazyModule("torch")
