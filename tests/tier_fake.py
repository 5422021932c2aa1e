"""An in-memory ``LowerTier`` for unit tests of kvshm's own tier logic (never for integration
tests, which run a real mooncake_master). One ``FakeStore`` may be shared by several
``FakeTier`` clients in one process (two "hosts"); faults are switched on by the test."""
from __future__ import annotations

import ctypes
from typing import Sequence

from kvshm.tier.api import Code, LowerTier


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False          # every call: RPC_FAILED
        self.full = False          # puts: NO_SPACE
        self.corrupt = False       # gets: one flipped byte in the last page
        self.unreadable = False    # gets: TRANSFER_FAILED (a host's share lost)
        self.calls = 0


class FakeTier(LowerTier):
    description = "fake in-memory store"

    def __init__(self, store: FakeStore, reachable: bool = True) -> None:
        self.store, self.reachable = store, reachable
        self.connects = 0

    def connect(self) -> bool:
        self.connects += 1
        return self.reachable and not self.store.down

    def register(self, address: int, length: int) -> bool:
        return True

    def exists(self, keys: Sequence[str]) -> list[Code]:
        self.store.calls += 1
        if self.store.down:
            return [Code.RPC_FAILED] * len(keys)
        return [Code.OK if k in self.store.values else Code.NOT_FOUND for k in keys]

    def put(self, keys, buffers) -> list[Code]:
        self.store.calls += 1
        out = []
        for k, bufs in zip(keys, buffers):
            if self.store.down or self.store.full:
                out.append(Code.RPC_FAILED if self.store.down else Code.NO_SPACE)
                continue
            self.store.values[k] = b"".join(ctypes.string_at(a, n) for a, n in bufs)
            out.append(Code.OK)
        return out

    def get(self, keys, buffers) -> list[int]:
        self.store.calls += 1
        out = []
        for k, bufs in zip(keys, buffers):
            v = self.store.values.get(k)
            if self.store.down:
                out.append(int(Code.RPC_FAILED))
                continue
            if v is None:
                out.append(int(Code.NOT_FOUND))
                continue
            if self.store.unreadable:
                out.append(int(Code.TRANSFER_FAILED))
                continue
            if len(v) != sum(n for _, n in bufs):
                out.append(int(Code.TRANSFER_FAILED))
                continue
            if self.store.corrupt:
                v = v[:-1] + bytes([v[-1] ^ 0xFF])
            pos = 0
            for a, n in bufs:
                ctypes.memmove(a, v[pos:pos + n], n)
                pos += n
            out.append(len(v))
        return out

    def close(self) -> None:
        pass
