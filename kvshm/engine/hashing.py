"""Chained block hashes and offload keys: how engines name a block of KV so that others find it.

This module owns the one hashing rule every engine sharing a segment must agree on. A block's
hash covers its parent's hash and its own tokens, so equal hashes mean equal prefixes (as in
vLLM's prefix cache), and a hit on block ``i`` implies the whole prefix up to ``i``:

    h_0 = sha256(ROOT || tokens_0 || extra)       ROOT = 32 zero bytes (or ``parent``)
    h_i = sha256(h_{i-1} || tokens_i || extra)    tokens as little-endian int32

Only full blocks are hashed. ``extra`` carries what else makes KV differ for equal tokens
(LoRA adapter, multimodal inputs, cache salt); two engines that pass different extras never
share. The layout fingerprint of the segment already separates models and block sizes.

It never touches shared memory.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvshm.errors import InvalidArgumentError

HASH_BYTES = 32
ROOT = bytes(HASH_BYTES)  # the parent of a request's first block


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_tokens: int,
                 parent: bytes | None = None, extra: bytes = b"") -> list[bytes]:
    """The chained sha256 hash of every FULL block of ``token_ids`` (a partial tail is skipped).

    ``parent`` is the hash of the block before ``token_ids[0]`` (to extend a list of hashes
    when more tokens arrive); None starts a new chain.
    """
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if parent is not None and len(parent) != HASH_BYTES:
        raise InvalidArgumentError(f"parent must be a {HASH_BYTES}-byte block hash, got "
                                   f"{len(parent)} bytes")
    n = len(token_ids) // block_tokens
    if n == 0:
        return []
    toks = np.asarray(token_ids[:n * block_tokens])
    if toks.dtype.kind not in "iu" and toks.size:
        raise InvalidArgumentError(f"token ids must be integers, got dtype {toks.dtype}")
    if toks.size and (int(toks.min()) < -2**31 or int(toks.max()) >= 2**31):
        raise InvalidArgumentError("token ids must fit in int32")
    raw = toks.astype("<i4").tobytes()  # one conversion for all blocks; sliced below
    step = 4 * block_tokens
    h = ROOT if parent is None else bytes(parent)
    sha = hashlib.sha256
    out = []
    for i in range(n):
        h = sha(h + raw[i * step:(i + 1) * step] + extra).digest()
        out.append(h)
    return out


def offload_key(block_hash: bytes, group: int = 0) -> bytes:
    """vLLM's 36-byte OffloadKey: the block hash followed by the KV-cache group (4 bytes, BE)."""
    if not 0 <= group < 2**32:
        raise InvalidArgumentError(f"group must fit in 4 bytes, got {group}")
    return bytes(block_hash) + group.to_bytes(4, "big")
