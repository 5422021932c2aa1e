"""POSIX names: of a segment, of the objects that belong to it, and how they are found.

This module owns the naming scheme in ``/dev/shm``: a segment is ``kvshm-NAME``; every
other object of it (the tier area; the doorbell semaphores of formats 5 and 6, which removal
still finds) is ``kvshm-NAME@TAG-WHAT``, TAG
naming one incarnation of the segment (its file's inode number in hex). A process still
holding a removed segment then never opens, creates or removes an object of a segment created
since under the same name. '@' is no segment-name character, so "NAME@" begins the objects of
exactly one name. (tmpfs hands out inode numbers from a counter: two live incarnations share
a tag only after it wraps.) It never maps or locks anything.
"""
from __future__ import annotations

import os
import re

import posix_ipc

from kvshm import logs
from kvshm.errors import InvalidArgumentError, SegmentPermissionError

SHM_DIR = "/dev/shm"
PREFIX = "kvshm-"
TAG_SEP = "@"
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # fullmatch: "$" would admit a final newline


def shm_name(name: str) -> str:
    """The POSIX name of segment ``name`` (``/kvshm-<name>``)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or not name.strip("."):
        raise InvalidArgumentError(
            f"segment names are 1-128 characters of letters, digits, '_', '.', '-', not only "
            f"dots; got {name!r}")
    return "/" + PREFIX + name


def object_name(name: str, tag: str, what: str) -> str:
    """POSIX name of object ``what`` of incarnation ``tag`` of segment ``name``."""
    return f"{shm_name(name)}{TAG_SEP}{tag}-{what}"


def list_segments() -> list[str]:
    """Names of every kvshm segment on this host."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(PREFIX):] for e in entries
                  if e.startswith(PREFIX) and TAG_SEP not in e)  # not a segment's object


def _legacy(name: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The objects (tier area; semaphores) that format 4 and before named for the name alone:
    exact names, so that "x" never takes those of "x-2"."""
    n = re.escape(name)
    return (re.compile(rf"kvshmtier-{n}"),
            re.compile(rf"sem\.(kvshm-{n}-(owner|c\d+-(reply|peer_in|peer_out))"
                       rf"|kvshmtier-{n}-bell)"))


def remove_objects(name: str) -> tuple[list[str], list[str]]:
    """Remove the objects of every removed incarnation of segment ``name`` (those of a
    segment now under the name stay). Returns the ``/dev/shm`` entries removed and those
    refused: another user's, which the sticky ``/dev/shm`` lets only that user or root remove.

    Each pass lists before it looks the name up: an object in the listing was made by a
    process that had its incarnation open, so an incarnation still linked then is the one the
    lookup finds (or a later one: removing the objects of one removed meanwhile is right too).
    Objects (the tier area) before semaphores: a semaphore checks the object it belongs to
    once it is open and removes itself if that is gone (``open_object``), else the second
    listing finds it. An object checks the segment (``TierArea``), removed before this.
    """
    stem = PREFIX + name + TAG_SEP
    removed, denied = [], []
    for kind, legacy in zip((stem, "sem." + stem), _legacy(name)):
        entries = [e for e in os.listdir(SHM_DIR) if e.startswith(kind) or legacy.fullmatch(e)]
        try:
            live = format(os.stat(SHM_DIR + shm_name(name)).st_ino, "x")
        except FileNotFoundError:
            live = None
        for entry in entries:
            if entry.startswith(kind) and entry[len(kind):].partition("-")[0] == live:
                continue
            try:
                if entry.startswith("sem."):
                    posix_ipc.unlink_semaphore("/" + entry[4:])
                else:
                    posix_ipc.unlink_shared_memory("/" + entry)
                removed.append(entry)
            except posix_ipc.ExistentialError:
                pass  # removed by somebody else meanwhile
            except posix_ipc.PermissionsError:
                denied.append(entry)
    return removed, denied


def remove(name: str, keep_log: bool = False) -> tuple[bool, list[str]]:
    """Remove segment ``name``, then the objects of its removed incarnations (``remove_objects``,
    which finds them only once the file is gone) and, unless ``keep_log``, its owner log.
    Returns whether the segment existed and the objects refused."""
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
        existed = True
    except posix_ipc.ExistentialError:
        existed = False
    except posix_ipc.PermissionsError as e:
        raise SegmentPermissionError(
            f"permission denied removing segment {name!r} ({e}); run as its owner or "
            "as root") from None
    refused = remove_objects(name)[1]
    if not keep_log:
        logs.remove(name)
    return existed, refused
