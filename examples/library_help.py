"""What a library module of the examples does when someone runs it: explain itself.

``python examples/mini_model.py --help`` (or any module here that is not a program) prints
the module's own description and names the program to run instead; without ``--help`` it
says the same in one line and exits 1. Standard library only.
"""
from __future__ import annotations

import argparse
from typing import NoReturn

DEMO = "examples/colocated_engines.py"


def explain(prog: str, doc: str | None, instead: str = DEMO) -> NoReturn:
    """The ``__main__`` of library module ``prog`` (``doc``: its docstring)."""
    argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"This file is a library, not a program: {instead} runs what is built from "
        f"it\n(python {instead} --help).").parse_args()
    raise SystemExit(f"{prog} is a library; run {instead} instead (see its --help)")


if __name__ == "__main__":
    explain("library_help.py", __doc__)
