"""The mini engine's deterministic "model": KV bytes and next tokens as pure functions.

KV of a token is a function of (token id, position, plane) only, so whoever computed a block —
this engine, another engine process, a previous run — every loaded block can be checked byte
for byte against ``kv``. The next token is a function of the previous token and its position,
so a workload generator knows every reply (and so every multi-turn prompt) in advance.
numpy only: importing this never imports torch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

VOCAB = 32_000
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), \
    np.uint64(0x165667B19E3779F9)
_M4, _M5 = np.uint64(0x94D049BB133111EB), np.uint64(0xBF58476D1CE4E5B9)


def kv(tokens: Sequence[int] | np.ndarray, start: int, plane: int,
       token_bytes: int) -> np.ndarray:
    """``(len(tokens), token_bytes)`` uint8: the KV of ``tokens`` at positions ``start...``."""
    t = np.asarray(tokens, dtype=np.uint64)
    pos = np.arange(start, start + t.size, dtype=np.uint64)
    x = (t * _M1) ^ (pos * _M2) ^ (np.uint64(plane + 1) * _M3)
    x = x[:, None] + np.arange(-(-token_bytes // 8), dtype=np.uint64) * _M4
    x ^= x >> np.uint64(31)  # splitmix64 finaliser: every byte depends on every input bit
    x *= _M5
    x ^= x >> np.uint64(29)
    return x.view(np.uint8).reshape(t.size, -1)[:, :token_bytes]


def next_token(prev: int, pos: int) -> int:
    """The token the model emits after ``prev`` at position ``pos``."""
    x = (prev * 0x9E3779B97F4A7C15 + pos * 0xC2B2AE3D27D4EB4F) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) % VOCAB


def generate(tokens: Sequence[int], n: int) -> list[int]:
    """The ``n`` tokens the model replies to ``tokens`` (what the engine must produce)."""
    out: list[int] = []
    prev, pos = tokens[-1], len(tokens)
    for _ in range(n):
        prev = next_token(prev, pos)
        out.append(prev)
        pos += 1
    return out


if __name__ == "__main__":  # a library: say what it is and what to run instead
    from library_help import explain
    explain("mini_model.py", __doc__)
