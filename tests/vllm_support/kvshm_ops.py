"""kvshm helpers that the engine subprocess runs between generations ("call" steps).

They run inside the vLLM venv's interpreter (next to a live engine) and return JSON-able
values that end up in the subprocess's result file. Importing this module imports neither
vLLM nor torch; ``self_checks`` imports the vLLM integration when called.
"""

from __future__ import annotations

import pickle
from typing import Any

from kvshm.shm import slots
from kvshm.shm.segment import Segment


def segment_info(name: str) -> dict[str, Any]:
    """What the segment holds: geometry, layout, counters, owner pid."""
    seg = Segment.attach(name)
    try:
        return {
            "num_blocks": seg.geometry.num_blocks,
            "page_bytes": list(seg.geometry.page_bytes),
            "layout": seg.layout.describe(),
            "counters": seg.counters(),
            "owner_pid": seg.owner_record()[0],
            "clients_alive": len(seg.clients_alive()),
            "quotas": sorted(slots.quota(seg, s) for s in seg.clients_alive()),
        }
    finally:
        seg.close()


def corrupt_segment(name: str) -> int:
    """Zero every data byte of the segment (negative control); returns the bytes zeroed.

    The engine is idle between steps, so no copy is racing with this."""
    seg = Segment.attach(name)
    try:
        total = 0
        for plane in seg.planes():
            plane[:] = 0
            total += plane.nbytes
            del plane
        return total
    finally:
        seg.close()


def self_checks() -> dict[str, Any]:
    """Checks that need vLLM but no engine: picklable specs, the version gate."""
    import numpy as np

    from kvshm.integrations.vllm import spec as integ
    from kvshm.integrations.vllm import compat as compat

    spec = integ.KvshmLoadStoreSpec([5, 3, 9], (4, 7))  # with its writer (slot, gen)
    back = pickle.loads(pickle.dumps(spec))
    out = compat.PrepareStoreOutput(
        keys_to_store=[b"k" * 36], store_spec=spec, evicted_keys=[]
    )
    out_back = pickle.loads(pickle.dumps(out))
    real = compat.installed_version
    try:
        compat.installed_version = lambda: "0.34.0"  # type: ignore[assignment]
        try:
            integ.KvshmOffloadingSpec(None)  # type: ignore[arg-type]
            refused = ""
        except RuntimeError as e:
            refused = str(e)
    finally:
        compat.installed_version = real  # type: ignore[assignment]
    return {
        "pickle_ok": type(back) is integ.KvshmLoadStoreSpec
        and back.block_ids.dtype == np.int32 and back.writer == (4, 7)
        and back.block_ids.tolist() == [5, 3, 9]
        and out_back.store_spec.block_ids.tolist() == [5, 3, 9],
        "version": real(),
        "supported": compat.is_supported(real()),
        "refusal": refused,
    }


def layout_refusal(field: str = "dtype", value: str = "bfloat16") -> str:
    """Build a second spec from the live engine's OffloadingConfig with one model field
    changed and attach it to the same segment; returns the refusal message ("" if none).

    Runs in single-process CI mode, where the engine's worker-side connector (and its spec)
    lives in this process."""
    import dataclasses

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvshm.errors import LayoutMismatchError
    from kvshm.integrations.vllm import KvshmOffloadingSpec

    live = get_kv_transfer_group().connector_worker.spec
    assert isinstance(live, KvshmOffloadingSpec), type(live)
    cfg = live.config
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{field: value}))
    try:
        KvshmOffloadingSpec(other).get_manager()
    except LayoutMismatchError as e:
        return str(e)
    return ""


def prometheus_samples(prefix: str = "vllm:k") -> dict[str, float]:
    """This process's Prometheus exposition (what ``vllm serve`` shows on ``/metrics``) as
    ``{"name{labels}": value}`` for the samples whose name starts with ``prefix``, with the
    per-engine labels (model name, engine index) left out."""
    import re

    from prometheus_client import REGISTRY, generate_latest

    out: dict[str, float] = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if not line.startswith(prefix):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        keep = [kv for kv in re.findall(r'(\w+="[^"]*")', labels)
                if not kv.startswith(("model_name=", "engine="))]
        key = name + ("{" + ",".join(keep) + "}" if keep else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def writer_registrations(name: str) -> list[dict[str, Any]]:
    """Live writer registrations of the segment (``kvshm.shm.writers``), each with the pid
    of the client slot it copies for (``slot_pid``)."""
    from kvshm.shm import slots, writers

    seg = Segment.attach(name)
    try:
        return [{**r, "slot_pid": slots.record(seg, r["slot"]).pid}
                for r in writers.registrations(seg)]
    finally:
        seg.close()
