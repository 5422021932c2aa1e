"""The ``kvshm-inspect --json`` documents as msgspec Structs: the one source of their schema.

This module owns the stable JSON schema of every ``--json`` output (``kvshm.<command>/1``):
``encode()`` turns a command's plain dict into JSON through its Struct (so a key or type that
drifts from the schema is an error, never silent output), and ``render_docs()`` writes the
schema tables that ``docs/inspect.md`` embeds (a test compares them; run
``python -m kvshm.inspect.schema`` to print them). It must never touch a segment.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta


def _d(tp: Any, text: str) -> Any:
    """``tp`` with its documented meaning (the third column of the docs' tables)."""
    return Annotated[tp, Meta(description=text)]


_Opt = Union  # readability: _Opt[int, None]


class _Doc(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the documents and their objects: exactly the declared keys, in this order."""


# --- ls -----------------------------------------------------------------------------------
class LsSegment(_Doc):
    """Each of `segments`."""
    name: _d(str, "segment name (the object is `/dev/shm/kvshm-<name>`)")
    size_bytes: _d(_Opt[int, None], "size of the shm object")
    format_version: _d(_Opt[int, None], "format version in its header (null: no kvshm header)")
    blocks_used: _d(_Opt[int, None], "blocks not free")
    blocks_total: _d(_Opt[int, None], "blocks in the segment")
    clients_alive: _d(_Opt[int, None], "live clients")
    owner_alive: _d(_Opt[bool, None], "whether an owner process is alive")
    age_s: _d(_Opt[float, None], "seconds since creation")
    error: _d(_Opt[str, None], "why the object could not be read (then the kvshm fields are null)")


class Ls(_Doc):
    """`kvshm-inspect ls`: every kvshm segment on the host."""
    schema: _d(Literal["kvshm.ls/1"], "its kind and version")
    segments: _d(list[LsSegment], "one per `kvshm-*` object")


# --- show / watch -------------------------------------------------------------------------
class LayoutDoc(_Doc):
    """`header.layout`: what the segment's blocks mean."""
    model: _d(str, "model name (or the engine's model id)")
    page_bytes: _d(list[int], "bytes of a block in each plane")
    tokens_per_block: _d(int, "tokens a block holds")
    extra: _d(dict[str, Any], "engine-specific layout details")


class Header(_Doc):
    """`header`: the segment's header."""
    format_version: _d(int, "segment format version")
    header_bytes: _d(int, "size of the header")
    total_bytes: _d(int, "size of the segment")
    created_ns: _d(int, "when it was created")
    age_s: _d(float, "seconds since then")
    fingerprint: _d(str, "hex SHA-256 of the layout")
    policy: _d(str, "eviction policy")
    layout: _d(LayoutDoc, "the layout")


class Geometry(_Doc):
    """`geometry`: sizes and offsets (ints), and the page sizes."""
    num_blocks: _d(int, "blocks")
    max_clients: _d(int, "client slots")
    ring_capacity: _d(int, "bytes of each ring")
    hold_capacity: _d(int, "hold entries (leases + pins) per client")
    index_slots: _d(int, "key index slots")
    slot_bytes: _d(int, "bytes of a client slot")
    table_offset: _d(int, "offset of the block table")
    index_offset: _d(int, "offset of the key index")
    data_offset: _d(int, "offset of the data region")
    data_bytes: _d(int, "bytes of the data region")
    total_bytes: _d(int, "size of the segment")
    num_planes: _d(int, "planes (one per worker rank)")
    page_bytes: _d(list[int], "bytes of a block in each plane")
    block_bytes: _d(int, "bytes of a block, all planes")
    tokens_per_block: _d(int, "tokens a block holds")


class Blocks(_Doc):
    """`blocks`: blocks by state."""
    total: _d(int, "blocks in the segment")
    free: _d(int, "free")
    writing: _d(int, "being stored")
    ready: _d(int, "stored, loadable")
    evicting: _d(int, "being evicted")
    granted: _d(int, "free blocks granted to a client for its next stores")
    invalid: _d(int, "with an unknown state byte")
    pinned: _d(int, "with owner pins or a live client's load pin")
    leased: _d(int, "leased by a live client, not pinned")
    used: _d(int, "not free")
    usage: _d(float, "used / total")


class Owner(_Doc):
    """`owner`: the owner process."""
    pid: _d(int, "last owner's pid; 0 after a clean shutdown")
    alive: _d(bool, "whether an owner holds the owner lock")
    epoch: _d(int, "owners so far")
    since_ns: _d(int, "when the owner took over")
    age_s: _d(_Opt[float, None], "seconds since then (null: none has run)")
    tick: _d(int, "last-use clock")
    log: _d(str, "where an auto-started owner of this segment logs (see below)")


class Client(_Doc):
    """Each of `clients`: every taken or locked slot."""
    slot: _d(int, "slot index")
    pid: _d(int, "process id")
    name: _d(str, "process name")
    state: _d(int, "0 free, 1 client, 2 job channel, 3 leaving")
    alive: _d(bool, "its process holds the slot lock")
    generation: _d(int, "bumps each time the slot is claimed")
    attached_ns: _d(int, "when it attached")
    age_s: _d(float, "seconds since then")
    holds: _d(int, "occupied hold entries (`pins` + `leases`)")
    pins: _d(int, "load pins")
    leases: _d(int, "lookup leases")
    stores_pending: _d(int, "the client's unfinished stores (WRITING blocks it owns)")
    granted: _d(int, "blocks granted to it for its next stores (taken or not)")
    counters: _d(dict[str, int], "the client's own counters: `lookups`, `hits`, `loads`, "
                 "`load_blocks`, `bytes_in` (bytes it loaded), `bytes_out` (bytes it stored)")
    rings: _d(dict[str, _Opt[int, None]], "bytes queued in each ring: `request`, `reply`, "
              "`peer_in`, `peer_out` (null: never formatted)")


class Pinner(_Doc):
    """Each of `pinners`: CUDA pin progress of one process."""
    pid: _d(int, "process id")
    alive: _d(bool, "whether it lives")
    done_bytes: _d(int, "bytes pinned so far")
    total_bytes: _d(int, "bytes to pin")
    state: _d(str, "idle, waiting, running, done or failed")
    updated_ns: _d(int, "last progress")


class Tier(_Doc):
    """`tier`: the host's lower-tier mover and what it moved (its tier area)."""
    mover_pid: _d(int, "pid of the last mover (0: none yet)")
    mover_alive: _d(bool, "whether a mover process holds the mover lock")
    state: _d(Literal["stopped", "connecting", "connected", "down"],
              "`connected`: the lower tier answers; `down`: it failed and the mover backs off "
              "(every want is a miss meanwhile); `stopped`: no mover alive")
    backend: _d(str, "what the mover talks to (e.g. `mooncake master HOST:PORT (tcp)`)")
    since_ns: _d(int, "when the last mover started")
    last_error: _d(int, "the last failure code the lower tier answered (Mooncake's; 0: none)")
    last_error_ns: _d(int, "when (0: never)")
    wants_queued: _d(int, "keys engines asked for that the mover has not read yet")
    counters: _d(dict[str, int], "the mover's counters (`kvshm.tier.area.COUNTERS`): wants, "
                 "gets/get_bytes/get_misses/get_failed/get_rejected/get_no_room, puts/put_bytes/"
                 "put_failed/put_refused_space/put_dropped/put_skipped, rpc_failures, reconnects")


class Show(_Doc):
    """`kvshm-inspect show` (and each line of `watch --json`)."""
    schema: _d(Literal["kvshm.show/1"], "its kind and version")
    name: _d(str, "segment name")
    taken_ns: _d(int, "when the snapshot was taken")
    header: _d(Header, "the header")
    geometry: _d(Geometry, "sizes and offsets")
    blocks: _d(Blocks, "blocks by state")
    owner: _d(Owner, "the owner")
    clients: _d(list[Client], "every taken or locked slot")
    clients_alive: _d(int, "live clients")
    clients_dead: _d(int, "taken slots whose process died (not reclaimed yet)")
    pinners: _d(list[Pinner], "CUDA pin progress per process")
    counters: _d(dict[str, int], "counters, see below")
    tier: _d(_Opt[Tier, None], "the lower tier (null: no mover ever ran for this segment)")


# --- blocks, verify, metrics, gc, rm ------------------------------------------------------
class BlockRow(_Doc):
    """Each of `rows`."""
    block: _d(int, "block id")
    state: _d(str, "free, writing, ready, evicting, granted or invalid")
    key: _d(str, "the key, full hex")
    pinned_by: _d(list[int], "client slots with a load pin on it")
    leased_by: _d(list[int], "client slots with a lookup lease on it")
    writer: _d(int, "client slot writing it (-1: the owner)")
    writer_gen: _d(int, "that slot's generation")
    writer_req: _d(int, "the writer's request id")
    last_use: _d(int, "owner tick of last use")
    stored_ns: _d(int, "when its store completed")
    pins: _d(int, "the owner's in-process pins")


class BlocksDoc(_Doc):
    """`kvshm-inspect blocks`."""
    schema: _d(Literal["kvshm.blocks/1"], "its kind and version")
    name: _d(str, "segment name")
    states: _d(list[str], "the filter")
    matching: _d(int, "blocks that match, before `--limit`")
    rows: _d(list[BlockRow], "one per block shown")


class Verify(_Doc):
    """`kvshm-inspect verify`."""
    schema: _d(Literal["kvshm.verify/1"], "its kind and version")
    name: _d(str, "segment name")
    ok: _d(bool, "no violations")
    violations: _d(list[str], "one sentence each")


class Sample(_Doc):
    """Each of `samples`: one Prometheus sample (see Metrics)."""
    metric: _d(str, "the metric name")
    type: _d(Literal["gauge", "counter"], "gauge or counter")
    help: _d(str, "its help text")
    labels: _d(dict[str, str], "its labels, `segment` included")
    value: _d(Union[int, float], "the value")


class Metrics(_Doc):
    """`kvshm-inspect metrics --json`."""
    schema: _d(Literal["kvshm.metrics/1"], "its kind and version")
    name: _d(str, "segment name")
    samples: _d(list[Sample], "one per Prometheus sample")


class Reclaimed(_Doc):
    """Each of `reclaimed_clients`: a dead slot cleared."""
    slot: _d(int, "slot index")
    pid: _d(int, "its process id")
    holds: _d(int, "holds released")
    name: _d(str, "process name")


class Gc(_Doc):
    """`kvshm-inspect gc`."""
    schema: _d(Literal["kvshm.gc/1"], "its kind and version")
    name: _d(str, "segment name")
    acted: _d(bool, "false when an owner was alive (it reclaims by itself)")
    reason: _d(str, "what gc did or why not")
    freed_blocks: _d(int, "unfinished blocks freed (their writer died)")
    kept_ready: _d(int, "ready blocks kept")
    kept_pending: _d(int, "blocks still being written by live clients, kept")
    reclaimed_clients: _d(list[Reclaimed], "dead slots cleared")


class LiveClient(_Doc):
    """Each of `live_clients`."""
    slot: _d(int, "slot index")
    pid: _d(int, "process id (0 for a damaged segment)")


class Rm(_Doc):
    """`kvshm-inspect rm`."""
    schema: _d(Literal["kvshm.rm/1"], "its kind and version")
    name: _d(str, "segment name")
    removed: _d(bool, "whether it was removed now")
    forced: _d(bool, "`--force` was given")
    owner_alive: _d(bool, "whether an owner was alive")
    live_clients: _d(list[LiveClient], "live client slots")
    leftovers: _d(list[str], "when no segment had the name: the objects a removed one left "
                  "(a process killed as it attached it), removed now")
    refused: _d(list[str], "objects of another user it may not remove (the sticky /dev/shm): "
                "run rm as that user or root; the exit status is then 1")


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
