"""How a request used a key: the access kinds both sides of the ring speak.

An engine integration classifies each key a request touched (vLLM's request-finished recency
rules) and sends the kind in a ``Touch`` frame; the owner's eviction policy applies it. This
module owns the kinds' values only; what each one does to the eviction order is the policy's.
"""
from __future__ import annotations

SEEN = 0  # looked at (e.g. offered for a store that was refused): recency only (LRU)
INSERTED = 1  # stored by the request, not reused by it: recency only, no ARC promotion
REUSED = 2  # ready when the request loaded it or offered it again: one ARC frequency hit
MISSED = 3  # a store miss: ARC learns from a ghost-list hit; no recency change
RANKED = 4  # used by a running request: LRU raises the key to the request's provisional rank
ACCESS_KINDS = (SEEN, INSERTED, REUSED, MISSED, RANKED)
