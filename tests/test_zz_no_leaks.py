"""Runs last (file name sorts last): this test session left nothing in /dev/shm, nor in the
temp dir or ``$XDG_RUNTIME_DIR`` (where auto-started owners log).

Every segment the tests create carries the session-unique prefix from ``conftest`` (other
people's concurrent runs use other prefixes), so a leftover segment (``kvshm-<prefix>…``),
semaphore (``sem.kvshm-<prefix>…``) or owner log (``kvshm-<prefix>…-owner.log``) can only
be ours.
"""
from __future__ import annotations

import os
import tempfile


def test_no_shared_memory_object_of_this_session_remains(seg_prefix):
    leftovers = sorted(e for e in os.listdir("/dev/shm") if seg_prefix in e)
    assert leftovers == [], f"tests left these in /dev/shm: {leftovers}"


def test_no_file_of_this_session_remains_in_the_temp_dirs(seg_prefix):
    dirs = {tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()}
    leftovers = sorted(os.path.join(d, e) for d in dirs for e in os.listdir(d)
                       if seg_prefix in e)
    assert leftovers == [], f"tests left these behind: {leftovers}"


def test_no_process_of_this_session_outlives_it():
    import multiprocessing
    for p in multiprocessing.active_children():
        p.join(30)
    assert multiprocessing.active_children() == []
