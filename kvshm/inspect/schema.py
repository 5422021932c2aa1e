"""The ``kvshm-inspect --json`` documents as msgspec Structs: the one source of their schema.

This module owns the stable JSON schema of every ``--json`` output (``kvshm.<command>/1``):
``encode()`` turns a command's plain dict into JSON through its Struct (so a key or type that
drifts from the schema is an error, never silent output), and ``render_docs()`` writes the
schema tables that ``docs/inspect.md`` embeds (a test compares them; run
``python -m kvshm.inspect.schema`` to print them). It must never touch a segment.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


def _d(text: str) -> Meta:
    """A field's documented meaning (the third column of the docs' tables), for
    ``Annotated[type, _d("...")]``."""
    return Meta(description=text)


class _Doc(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the documents and their objects: exactly the declared keys, in this order."""


# --- ls -----------------------------------------------------------------------------------
class LsSegment(_Doc):
    """Each of `segments`."""
    name: Annotated[str, _d("segment name (the object is `/dev/shm/kvshm-<name>`)")]
    size_bytes: Annotated[int | None, _d("size of the shm object")]
    format_version: Annotated[int | None, _d(
        "format version in its header (null: no kvshm header)")]
    blocks_used: Annotated[int | None, _d("blocks not free")]
    blocks_total: Annotated[int | None, _d("blocks in the segment")]
    clients_alive: Annotated[int | None, _d("live clients")]
    owner_alive: Annotated[bool | None, _d("whether an owner process is alive")]
    age_s: Annotated[float | None, _d("seconds since creation")]
    error: Annotated[str | None, _d(
        "why the object could not be read (then the kvshm fields are null)")]


class Ls(_Doc):
    """`kvshm-inspect ls`: every kvshm segment on the host."""
    schema: Annotated[Literal["kvshm.ls/1"], _d("its kind and version")]
    segments: Annotated[list[LsSegment], _d("one per `kvshm-*` object")]


# --- show / watch -------------------------------------------------------------------------
class LayoutDoc(_Doc):
    """`header.layout`: what the segment's blocks mean."""
    model: Annotated[str, _d("model name (or the engine's model id)")]
    page_bytes: Annotated[list[int], _d("bytes of a block in each plane")]
    tokens_per_block: Annotated[int, _d("tokens a block holds")]
    extra: Annotated[dict[str, Any], _d("engine-specific layout details")]


class Header(_Doc):
    """`header`: the segment's header."""
    format_version: Annotated[int, _d("segment format version")]
    header_bytes: Annotated[int, _d("size of the header")]
    total_bytes: Annotated[int, _d("size of the segment")]
    created_ns: Annotated[int, _d("when it was created")]
    age_s: Annotated[float, _d("seconds since then")]
    fingerprint: Annotated[str, _d("hex SHA-256 of the layout")]
    policy: Annotated[str, _d("eviction policy")]
    layout: Annotated[LayoutDoc, _d("the layout")]


class Geometry(_Doc):
    """`geometry`: sizes and offsets (ints), and the page sizes."""
    num_blocks: Annotated[int, _d("blocks")]
    max_clients: Annotated[int, _d("client slots")]
    ring_capacity: Annotated[int, _d("bytes of each ring")]
    hold_capacity: Annotated[int, _d("hold entries (leases + pins) per client")]
    index_slots: Annotated[int, _d("key index slots")]
    slot_bytes: Annotated[int, _d("bytes of a client slot")]
    table_offset: Annotated[int, _d("offset of the block table")]
    index_offset: Annotated[int, _d("offset of the key index")]
    data_offset: Annotated[int, _d("offset of the data region")]
    data_bytes: Annotated[int, _d("bytes of the data region")]
    total_bytes: Annotated[int, _d("size of the segment")]
    num_planes: Annotated[int, _d("planes (one per worker rank)")]
    page_bytes: Annotated[list[int], _d("bytes of a block in each plane")]
    block_bytes: Annotated[int, _d("bytes of a block, all planes")]
    tokens_per_block: Annotated[int, _d("tokens a block holds")]


class Blocks(_Doc):
    """`blocks`: blocks by state."""
    total: Annotated[int, _d("blocks in the segment")]
    free: Annotated[int, _d("free")]
    writing: Annotated[int, _d("being stored")]
    ready: Annotated[int, _d("stored, loadable")]
    evicting: Annotated[int, _d("being evicted")]
    granted: Annotated[int, _d("free blocks granted to a client for its next stores")]
    claimed: Annotated[int, _d("offered blocks their client claimed for a store in flight")]
    invalid: Annotated[int, _d("with an unknown state byte")]
    pinned: Annotated[int, _d("with owner pins or a live client's load pin")]
    leased: Annotated[int, _d("leased by a live client, not pinned")]
    used: Annotated[int, _d("not free")]
    usage: Annotated[float, _d("used / total")]


class Owner(_Doc):
    """`owner`: the owner process."""
    pid: Annotated[int, _d("last owner's pid; 0 after a clean shutdown")]
    alive: Annotated[bool, _d("whether an owner holds the owner lock")]
    epoch: Annotated[int, _d("owners so far, 1 again after 2**32 - 1")]
    since_ns: Annotated[int, _d("when the owner took over")]
    age_s: Annotated[float | None, _d("seconds since then (null: none has run)")]
    tick: Annotated[int, _d("last-use clock")]
    log: Annotated[str, _d("where an auto-started owner of this segment logs (see below)")]


class Client(_Doc):
    """Each of `clients`: every taken or locked slot."""
    slot: Annotated[int, _d("slot index")]
    pid: Annotated[int, _d("process id")]
    name: Annotated[str, _d("process name")]
    state: Annotated[int, _d("0 free, 1 client, 2 job channel, 3 leaving")]
    alive: Annotated[bool, _d("its process holds the slot lock")]
    generation: Annotated[int, _d("bumps each time the slot is claimed")]
    attached_ns: Annotated[int, _d("when it attached")]
    age_s: Annotated[float, _d("seconds since then")]
    holds: Annotated[int, _d("occupied hold entries (`pins` + `leases`)")]
    pins: Annotated[int, _d("load pins")]
    leases: Annotated[int, _d("lookup leases")]
    stores_pending: Annotated[int, _d("the client's unfinished stores (WRITING blocks it owns)")]
    granted: Annotated[int, _d(
        "blocks granted or offered to it for its next stores (taken or not)")]
    stranded: Annotated[int, _d(
        "of its unfinished stores, blocks it published in a frame that was dropped after "
        "owners died applying it: kept for it (it may still write them), freed when it goes")]
    quota: Annotated[int, _d("blocks it may keep cached, its quota (0: none)")]
    cached: Annotated[int, _d(
        "with a quota: blocks it stored that are cached, as the owner last counted them "
        "(less any the owner offered to the client's own grants for its next stores: still "
        "cached, but going)")]
    events: Annotated[bool, _d("it takes the cache's store and eviction events")]
    counters: Annotated[dict[str, int], _d(
        "the client's own counters: `lookups`, `hits`, `loads`, `load_blocks`, `bytes_in` "
        "(bytes it loaded), `bytes_out` (bytes it stored)")]
    rings: Annotated[dict[str, int | None], _d(
        "bytes queued in each ring: `request`, `reply`, `peer_in`, `peer_out` (null: never "
        "formatted)")]


class Pinner(_Doc):
    """Each of `pinners`: CUDA pin progress of one process."""
    pid: Annotated[int, _d("process id")]
    alive: Annotated[bool, _d("whether it lives")]
    done_bytes: Annotated[int, _d("bytes pinned so far")]
    total_bytes: Annotated[int, _d("bytes to pin")]
    state: Annotated[str, _d("idle, waiting, running, done or failed")]
    updated_ns: Annotated[int, _d("last progress")]


class Tier(_Doc):
    """`tier`: the host's lower-tier mover and what it moved (its tier area)."""
    mover_pid: Annotated[int, _d("pid of the last mover (0: none yet)")]
    mover_alive: Annotated[bool, _d("whether a mover process holds the mover lock")]
    state: Annotated[Literal["stopped", "connecting", "connected", "down"], _d(
        "`connecting`: the mover has not joined its lower tier yet; `connected`: the lower tier "
        "answers; `down`: it failed, or could not be reached, and the mover backs off; until "
        "`connected` every want is a miss and engines see no tier; `stopped`: no mover alive")]
    backend: Annotated[str, _d("what the mover talks to (e.g. `mooncake master HOST:PORT (tcp)`)")]
    since_ns: Annotated[int, _d("when the last mover started")]
    last_error: Annotated[int, _d(
        "the last failure code the lower tier answered (Mooncake's; 0: none)")]
    last_error_ns: Annotated[int, _d("when (0: never)")]
    wants_queued: Annotated[int, _d("keys engines asked for that the mover has not read yet")]
    counters: Annotated[dict[str, int], _d(
        "the mover's counters (`kvshm.tier.area.COUNTERS`): wants, "
        "gets/get_bytes/get_misses/get_failed/get_rejected/get_no_room, "
        "puts/put_bytes/put_failed/put_refused_space/put_dropped/put_skipped, rpc_failures, "
        "reconnects")]


class Show(_Doc):
    """`kvshm-inspect show` (and each line of `watch --json`)."""
    schema: Annotated[Literal["kvshm.show/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    taken_ns: Annotated[int, _d("when the snapshot was taken")]
    header: Annotated[Header, _d("the header")]
    geometry: Annotated[Geometry, _d("sizes and offsets")]
    blocks: Annotated[Blocks, _d("blocks by state")]
    owner: Annotated[Owner, _d("the owner")]
    clients: Annotated[list[Client], _d("every taken or locked slot")]
    clients_alive: Annotated[int, _d("live clients")]
    clients_dead: Annotated[int, _d("taken slots whose process died (not reclaimed yet)")]
    pinners: Annotated[list[Pinner], _d("CUDA pin progress per process")]
    counters: Annotated[dict[str, int], _d("counters, see below")]
    tier: Annotated[Tier | None, _d("the lower tier (null: no mover ever ran for this segment)")]


# --- blocks, verify, metrics, gc, rm ------------------------------------------------------
class BlockRow(_Doc):
    """Each of `rows`."""
    block: Annotated[int, _d("block id")]
    state: Annotated[str, _d(
        "free, writing, ready, evicting, granted, claimed or invalid")]
    key: Annotated[str, _d("the key, full hex")]
    pinned_by: Annotated[list[int], _d("client slots with a load pin on it")]
    leased_by: Annotated[list[int], _d("client slots with a lookup lease on it")]
    writer: Annotated[int, _d("client slot writing it (-1: the owner)")]
    writer_gen: Annotated[int, _d("that slot's generation")]
    writer_req: Annotated[int, _d("the writer's request id")]
    last_use: Annotated[int, _d("owner tick of last use")]
    stored_ns: Annotated[int, _d("when its store completed")]
    pins: Annotated[int, _d("the owner's in-process pins")]
    tenant: Annotated[int, _d("client slot whose store it holds, whose quota counts it "
                              "(-1: nobody's)")]
    tenant_gen: Annotated[int, _d("that slot's generation")]


class BlocksDoc(_Doc):
    """`kvshm-inspect blocks`."""
    schema: Annotated[Literal["kvshm.blocks/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    states: Annotated[list[str], _d("the filter")]
    matching: Annotated[int, _d("blocks that match, before `--limit`")]
    rows: Annotated[list[BlockRow], _d("one per block shown")]


class Verify(_Doc):
    """`kvshm-inspect verify`."""
    schema: Annotated[Literal["kvshm.verify/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    ok: Annotated[bool, _d("no violations")]
    violations: Annotated[list[str], _d("one sentence each")]


class Sample(_Doc):
    """Each of `samples`: one Prometheus sample (see Metrics)."""
    metric: Annotated[str, _d("the metric name")]
    type: Annotated[Literal["gauge", "counter"], _d("gauge or counter")]
    help: Annotated[str, _d("its help text")]
    labels: Annotated[dict[str, str], _d("its labels, `segment` included")]
    value: Annotated[int | float, _d("the value")]


class Metrics(_Doc):
    """`kvshm-inspect metrics --json`."""
    schema: Annotated[Literal["kvshm.metrics/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    samples: Annotated[list[Sample], _d("one per Prometheus sample")]


class Reclaimed(_Doc):
    """Each of `reclaimed_clients`: a dead slot cleared."""
    slot: Annotated[int, _d("slot index")]
    pid: Annotated[int, _d("its process id")]
    holds: Annotated[int, _d("holds released")]
    name: Annotated[str, _d("process name")]


class Gc(_Doc):
    """`kvshm-inspect gc`."""
    schema: Annotated[Literal["kvshm.gc/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    acted: Annotated[bool, _d("false when an owner was alive (it reclaims by itself)")]
    reason: Annotated[str, _d("what gc did or why not")]
    freed_blocks: Annotated[int, _d("unfinished blocks freed (their writer died)")]
    kept_ready: Annotated[int, _d("ready blocks kept")]
    kept_pending: Annotated[int, _d("blocks still being written by live clients, kept")]
    reclaimed_clients: Annotated[list[Reclaimed], _d("dead slots cleared")]


class LiveClient(_Doc):
    """Each of `live_clients`."""
    slot: Annotated[int, _d("slot index")]
    pid: Annotated[int, _d("process id (0 for a damaged segment)")]


class Rm(_Doc):
    """`kvshm-inspect rm`."""
    schema: Annotated[Literal["kvshm.rm/1"], _d("its kind and version")]
    name: Annotated[str, _d("segment name")]
    removed: Annotated[bool, _d("whether it was removed now")]
    forced: Annotated[bool, _d("`--force` was given")]
    owner_alive: Annotated[bool, _d("whether an owner was alive")]
    live_clients: Annotated[list[LiveClient], _d("live client slots")]
    leftovers: Annotated[list[str], _d(
        "when no segment had the name: the objects a removed one left (a process killed as it "
        "attached it), removed now")]
    refused: Annotated[list[str], _d(
        "objects of another user it may not remove (the sticky /dev/shm): run rm as that user "
        "or root; the exit status is then 1")]
    log_removed: Annotated[str | None, _d(
        "path of the owner log removed now (null: there was none, or `--keep-log`)")]


DOCUMENTS: dict[str, type[_Doc]] = {  # command -> its --json document (watch: show's)
    "ls": Ls, "show": Show, "watch": Show, "blocks": BlocksDoc, "verify": Verify,
    "metrics": Metrics, "gc": Gc, "rm": Rm}
_BY_TAG = {f"kvshm.{c}/1": t for c, t in DOCUMENTS.items() if c != "watch"}
_JSON = msgspec.json.Encoder()


def encode(data: dict[str, Any], indent: int = 2) -> str:
    """``data`` (a document with its ``schema`` tag) as JSON, checked against its Struct."""
    doc = msgspec.convert(data, _BY_TAG[data["schema"]], strict=True)
    out = _JSON.encode(doc)
    return (msgspec.json.format(out, indent=indent) if indent else out).decode()


# --- the docs' tables ---------------------------------------------------------------------
_TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool",
          "null": "null", "object": "object"}


def _type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        return f"object (`{s['$ref'].rsplit('/', 1)[1]}`)"
    if "anyOf" in s:
        return " or ".join(_type(x) for x in s["anyOf"])
    if "enum" in s:
        return " or ".join(f"`{v}`" for v in s["enum"])
    if s.get("type") == "array":
        return "list of " + _type(s["items"])
    if s.get("type") == "object" and isinstance(s.get("additionalProperties"), dict):
        inner = s["additionalProperties"]
        return f"object of {_type(inner)}" if inner else "object"
    return _TYPES.get(s.get("type", ""), "any")


def render_docs() -> str:
    """The markdown tables of every document and the objects in it, from the Structs."""
    out = []
    for cmd in ("ls", "show", "blocks", "verify", "metrics", "gc", "rm"):
        (ref,), defs = msgspec.json.schema_components([DOCUMENTS[cmd]])
        for name in _reachable(ref["$ref"].rsplit("/", 1)[1], defs):
            d = defs[name]
            head = (f"### `{cmd}` — `{d['properties']['schema']['enum'][0]}`"
                    if name == DOCUMENTS[cmd].__name__ else f"`{name}` — {d['description']}")
            out += [head, "", d["description"] if head.startswith("###") else "", "",
                    "| key | type | meaning |", "|---|---|---|"]
            for key, p in d["properties"].items():
                out.append(f"| `{key}` | {_type(p)} | {p.get('description', '')} |")
            out.append("")
    return "\n".join(line for i, line in enumerate(out)
                     if line or (i and out[i - 1])).rstrip() + "\n"


def _reachable(root: str, defs: dict[str, Any]) -> list[str]:
    seen, todo = [], [root]
    while todo:
        name = todo.pop(0)
        if name not in seen:
            seen.append(name)
            todo += [r.rsplit("/", 1)[1] for r in _refs(defs[name])]
    return seen


def _refs(s: Any) -> list[str]:
    if isinstance(s, dict):
        return ([s["$ref"]] if "$ref" in s else []) + [r for v in s.values() for r in _refs(v)]
    return [r for v in s for r in _refs(v)] if isinstance(s, list) else []


if __name__ == "__main__":
    print(render_docs(), end="")
