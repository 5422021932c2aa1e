"""The configuration half of kvshm's vLLM integration, testable without vLLM.

This module owns: parsing kvshm's keys of ``kv_connector_extra_config`` (``KvshmOptions``);
the kvshm ``Layout`` derived from vLLM's ``OffloadingConfig`` (it decides which engines may
share a segment); and creating or attaching the segment with an explanation when the layouts
differ. The scheduler's state is ``core.py``, the worker half ``jobs.py``.

Inputs from vLLM are duck-typed (attributes only), so tests pass plain objects.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvshm.errors import InvalidArgumentError, LayoutMismatchError, SegmentNotFoundError
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment

POLICIES = ("lru", "arc")


_NAME = r"^(?!\.+$)[A-Za-z0-9_.-]{1,128}$"  # a segment name (kvshm.shm.names.shm_name)


class KvshmOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """kvshm's own keys in ``kv_connector_extra_config``, with their constraints.

    ``from_extra`` picks them (and any other ``kvshm_*`` key, a likely typo) out of the dict
    and validates them here; an invalid value is an ``InvalidArgumentError`` naming the key.
    """
    segment: Annotated[str, msgspec.Meta(pattern=_NAME, description=(
        "name of the shared segment every vLLM instance of this model uses (e.g. \"llama8b\")"
    ))] = msgspec.field(name="kvshm_segment")
    nbytes: Annotated[int, msgspec.Meta(gt=0, description=(
        "bytes of KV data, used when creating the segment; without it, attach only"
    ))] | None = msgspec.field(default=None, name="cpu_bytes_to_use")
    policy: Annotated[str, msgspec.Meta(pattern="^(" + "|".join(POLICIES) + ")$", description=(
        "eviction policy, recorded in the segment at creation"))] = msgspec.field(
        default="lru", name="eviction_policy")
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o777, description=(
        "permission bits of a segment this instance creates (an octal string such as \"0660\")"
    ))] = msgspec.field(default=0o600, name="kvshm_mode")
    model_id: Annotated[str, msgspec.Meta(description=(
        "model identity in the layout, instead of vLLM's model name"))] | None = msgspec.field(
        default=None, name="kvshm_model_id")
    hold_capacity: Annotated[int, msgspec.Meta(ge=16, description=(
        "leases + pins per client, at creation"))] = msgspec.field(
        default=16384, name="kvshm_hold_capacity")
    tier: Annotated[bool, msgspec.Meta(description=(
        "look up misses in the lower tier through the host's kvshm mover (docs/tier.md)"
    ))] = msgspec.field(default=False, name="kvshm_tier")
    quota: Annotated[float, msgspec.Meta(gt=0, description=(
        "this instance's share of the cache: a fraction (up to 1) or a number of blocks "
        "(above 1); within it no other instance's stores evict its blocks (docs/cotenancy.md)"
    ))] | None = msgspec.field(default=None, name="kvshm_quota")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> KvshmOptions:
        ours = {k: v for k, v in extra.items() if k in _OPTION_KEYS or k.startswith("kvshm_")}
        if isinstance(ours.get("eviction_policy"), str):
            ours["eviction_policy"] = ours["eviction_policy"].lower()
        mode = ours.get("kvshm_mode")
        if isinstance(mode, str):  # permission bits are written in octal
            try:
                ours["kvshm_mode"] = int(mode, 8)
            except ValueError:
                pass  # left a str: refused below, naming the key
        model_id = ours.pop("kvshm_model_id", None)
        if model_id:
            ours["kvshm_model_id"] = str(model_id)
        try:
            opts = msgspec.convert(ours, cls, strict=False)
        except msgspec.ValidationError as e:
            raise InvalidArgumentError(
                f"kv_connector_extra_config: {e} (kvshm's keys: {', '.join(_OPTION_KEYS)})"
            ) from None
        quota_arg(opts.quota)  # a quota above 1 must be whole blocks
        return opts


def quota_arg(quota: float | None) -> int | float | None:
    """``kvshm_quota`` as ``connect``'s ``quota``: above 1, a number of blocks."""
    if quota is None or quota <= 1:
        return quota
    if quota != int(quota):
        raise InvalidArgumentError(f"kv_connector_extra_config: kvshm_quota={quota!r} is "
                                   "neither a fraction of the cache (up to 1) nor a number "
                                   "of blocks")
    return int(quota)


_OPTION_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(KvshmOptions))


def _short(name: str, limit: int = 120) -> str:
    """Keep the layout description small: a long model path becomes its tail plus a hash."""
    if len(name) <= limit:
        return name
    return "..." + name[-(limit - 20):] + "#" + hashlib.sha256(name.encode()).hexdigest()[:12]


def layout_for(config: Any, model_id: str | None = None) -> Layout:
    """The kvshm layout of a vLLM ``OffloadingConfig``: one plane per worker rank.

    Deterministic in everything that decides what a block's bytes mean (model, cache dtype,
    KV cache layout, block and chunk sizes, bytes per block, parallel shape) and free of
    anything per-engine (engine id, rank, memory sizes), so every instance of the same model
    and configuration agrees and any other is refused by the segment's fingerprint.
    """
    if getattr(config, "canonical_layout", False):
        raise InvalidArgumentError(
            "kvshm does not support vLLM's 'canonical_layout'; remove it from "
            "kv_connector_extra_config")
    per_block = int(config.worker_kv_bytes_per_block)
    if per_block <= 0:
        raise InvalidArgumentError(
            f"vLLM reports {per_block} KV bytes per block for this worker; kvshm needs the "
            "KV cache to be allocated (is this a model without attention KV?)")
    bpc = int(config.cache.blocks_per_chunk)
    par = config.parallel
    groups = [(int(g.tokens_per_block), len(g.layer_names)) for g in config.groups]
    return Layout(
        page_bytes=(per_block * bpc,) * int(par.world_size),
        tokens_per_block=groups[0][0] * bpc if groups else int(config.cache.tokens_per_hash),
        model=_short(model_id or str(config.model.name)),
        extra={
            "engine": "vllm",
            "dtype": str(config.model.dtype),
            "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
            "groups": groups,  # (tokens per block, layers) per KV cache group
            "blocks_per_chunk": bpc,
            "tokens_per_hash": int(config.cache.tokens_per_hash),
            "kv_bytes_per_block": per_block,
            "parallel": [int(par.tp_size), int(par.pp_size), int(par.pcp_size),
                         int(par.dcp_size)],
        })


def num_blocks_for(layout: Layout, nbytes: int) -> int:
    """Segment blocks (chunks) that fit ``nbytes`` of data, like vLLM's cpu_bytes_to_use."""
    n = nbytes // layout.block_bytes
    if n < 1:
        raise InvalidArgumentError(
            f"cpu_bytes_to_use={nbytes} cannot hold one chunk of {layout.block_bytes} bytes "
            f"(all ranks); give kvshm more memory")
    return n


def explain_mismatch(e: LayoutMismatchError, name: str) -> LayoutMismatchError:
    """The segment's refusal, with what it means for a vLLM instance."""
    return LayoutMismatchError(
        f"this vLLM instance cannot share kvshm segment {name!r}: its KV layout (model, "
        f"dtype, block/chunk size, bytes per block, parallelism) differs from the one the "
        f"segment was created for, so its blocks would be misread. {e}")


def check_layout(opts: KvshmOptions, layout: Layout) -> None:
    """Refuse ``layout`` now if segment ``opts.segment`` exists with another one.

    Called at spec construction, before the engine allocates its KV cache; a segment that
    does not exist yet is checked again when it is created or attached."""
    try:
        Segment.attach(opts.segment, layout).close()
    except LayoutMismatchError as e:
        raise explain_mismatch(e, opts.segment) from None
    except SegmentNotFoundError:
        pass


def open_segment(opts: KvshmOptions, layout: Layout) -> Segment:
    """Create-or-attach the segment for a worker (it may come up before the scheduler)."""
    try:
        if opts.nbytes is None:
            return Segment.attach(opts.segment, layout)
        return Segment.create(opts.segment, layout, num_blocks_for(layout, opts.nbytes),
                              mode=opts.mode, policy=opts.policy,
                              hold_capacity=opts.hold_capacity, exist_ok=True)
    except LayoutMismatchError as e:
        raise explain_mismatch(e, opts.segment) from None
    except SegmentNotFoundError as e:
        raise SegmentNotFoundError(f"{e} (or set 'cpu_bytes_to_use' so that this instance "
                                   "creates it)") from None
