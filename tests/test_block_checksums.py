"""Optional block checksums: written by the CPU handler on stores, checked on loads and by
``kvshm-inspect verify --data``; a layout without them is unchanged."""
from __future__ import annotations

import hashlib
import json
import zlib

import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from conftest import SMALL_GEOMETRY, unique_name
from kvshm.errors import InvalidArgumentError, LayoutMismatchError, TransferError
from kvshm.inspect.snapshot import verify
from kvshm.shm.checksums import BlockSums
from kvshm.shm.layout import Geometry, Layout
from kvshm.shm.segment import Segment
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import TransferSpec

PAGES = (4096, 8192)
LAYOUT = Layout(PAGES, 16, "sums", checksums=True)


@pytest.fixture
def seg():
    name = unique_name()
    s = Segment.create(name, LAYOUT, 8, **SMALL_GEOMETRY)
    yield s
    s.close()
    Segment.unlink(name)


def _rig(seg: Segment):
    dev = [torch.randint(0, 255, (6, p), dtype=torch.uint8) for p in PAGES]
    h = make_handler(dev, seg.torch_planes(), checksums=BlockSums(seg))
    return dev, h


def _run(h, job_id, spec):
    h.transfer_async(job_id, spec)
    h.wait([job_id])
    (res,) = [r for r in h.get_finished() if r.job_id == job_id]
    return res


def test_store_then_load_verifies(seg):
    dev, h = _rig(seg)
    with h:
        assert _run(h, 1, TransferSpec("store", [0, 1, 2], [3, 4, 5])).success
        sums = BlockSums(seg).sums
        for i, plane in enumerate(seg.planes()):
            assert all(int(sums[b, i]) == zlib.crc32(plane[b]) for b in (3, 4, 5))
        out = [torch.zeros_like(d) for d in dev]
        h2 = make_handler(out, seg.torch_planes(), checksums=BlockSums(seg))
        with h2:
            assert _run(h2, 2, TransferSpec("load", [0, 1, 2], [3, 4, 5])).success
        for d, o in zip(dev, out):
            assert torch.equal(d[:3], o[:3])
    assert seg.counter("checksum_failures") == 0


def test_corrupt_byte_fails_the_load_and_counts(seg):
    dev, h = _rig(seg)
    with h:
        assert _run(h, 1, TransferSpec("store", [0, 1], [2, 6])).success
        seg.plane(1)[6, 100] ^= 0xFF
        res = _run(h, 2, TransferSpec("load", [3, 4], [2, 6]))
        assert not res.success and isinstance(res.error, TransferError)
        assert "corrupt" in str(res.error) and "[6]" in str(res.error)
        assert seg.counter("checksum_failures") == 1
        assert _run(h, 3, TransferSpec("load", [3], [2])).success  # the intact block loads


def test_verify_data_reports_the_corrupt_block(seg):
    from kvshm.owner.manager import LocalManager
    dev, h = _rig(seg)
    mgr = LocalManager(seg, "lru")
    keys = [b"k%d" % i for i in range(2)]
    blocks = [int(b) for b in mgr.prepare_store(keys).block_ids]
    with h:
        assert _run(h, 1, TransferSpec("store", [0, 1], blocks)).success
    mgr.complete_store(keys)
    assert verify(seg, data=True) == []
    seg.plane(0)[blocks[1], 7] ^= 1
    found = verify(seg, data=True)
    assert found == [f"block {blocks[1]} plane 0: its data does not match its block "
                     f"checksum (corrupt)"]
    assert verify(seg) == []  # without --data the data is not read
    from kvshm.inspect.cli import main
    assert main(["verify", seg.name]) == 0
    assert main(["verify", "--data", seg.name]) == 1


def test_layout_without_the_option_is_unchanged():
    lay = Layout(PAGES, 16, "sums")
    old = json.dumps({"model": "sums", "page_bytes": list(PAGES), "tokens_per_block": 16,
                      "extra": {}}, sort_keys=True, separators=(",", ":"))
    assert lay.describe() == old
    assert lay.fingerprint() == hashlib.sha256(old.encode()).digest()
    assert lay != LAYOUT and lay.fingerprint() != LAYOUT.fingerprint()
    assert Layout.from_description(LAYOUT.describe()) == LAYOUT
    g0 = Geometry(8, PAGES, 4, 8192, 64)
    g1 = Geometry(8, PAGES, 4, 8192, 64, checksums=True)
    assert g0.sums_bytes == 0 and g1.sums_bytes == 8 * 2 * 4
    assert g1.sums_offset >= g1.index_offset + g1.index_slots * 8
    assert g1.data_offset >= g1.sums_offset + g1.sums_bytes
    with pytest.raises(InvalidArgumentError):
        Layout(PAGES, 16, checksums=1)


def test_segment_without_checksums_has_no_region():
    name = unique_name()
    with Segment.create(name, Layout(PAGES, 16, "sums"), 8, **SMALL_GEOMETRY) as s:
        try:
            assert not s.geometry.checksums and s.geometry.sums_bytes == 0
            with pytest.raises(InvalidArgumentError):
                BlockSums(s)
            with pytest.raises(InvalidArgumentError):
                verify(s, data=True)
        finally:
            Segment.unlink(name)


def test_layouts_differing_only_in_the_option_cannot_share(seg):
    with pytest.raises(LayoutMismatchError):
        Segment.attach(seg.name, Layout(PAGES, 16, "sums"))
    with Segment.attach(seg.name, LAYOUT) as again:
        assert again.geometry == seg.geometry
