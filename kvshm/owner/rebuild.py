"""Takeover: an owner rebuilds the index from the block table a predecessor left.

This module owns what a new owner trusts of the table: READY entries whose round is closed
and whose key checksum verifies are adopted (oldest use first, so recency survives a
failover), the unfinished stores of live writers stay pending, blocks granted to live
clients stay granted (an offer still cached and indexed, a claimed one not), completed
stores a dead owner deferred are remembered, and everything else (entries a dead owner left
mid-rewrite, torn keys, dead writers' stores and claims) is freed; a dead client's unclaimed
offer is cached again if the predecessor's index names it (served), else freed. It fills a
fresh ``Entries`` and ``Grants``; it never rewrites a key it keeps and never copies block
data.

A key that two entries hold can only come from damage (a live client's offer counts only
when the predecessor's index named it: one no index names is a claim a predecessor kept,
its key perhaps stored again since), and either copy may be the damaged one (its key,
length and key checksum copied from the other verify all the same): no copy is trusted. Its
ready blocks are freed, an offered copy stays its client's without a key, a store's copy
stays pending only when it is the one store of the key (its writer writes that block and no
other), and copies of two stores are held for their writers, indexed nowhere. The key is
then a miss, the ``duplicate_keys`` header counter counts it and the owner's log
names it, so the evidence outlives the rebuild.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable

from kvshm.crashpoints import crash_point
from kvshm.owner.entries import Entries
from kvshm.owner.grants import Grants
from kvshm.shm import layout as L
from kvshm.shm.keyindex import tags_of

log = logging.getLogger("kvshm.owner")
_LOGGED = 8  # duplicate keys named in the log, at most, per rebuild


def rebuild(entries: Entries, grants: Grants, writer_alive: Callable[[int, int], bool]
            ) -> dict[str, int]:
    """Adopt the table into the empty ``entries`` and ``grants``: ready blocks stay, stores of
    dead writers and torn keys are freed. Returns what it found, by kind.

    It never rewrites a key it keeps: a kept entry only gets its state, writer and pins
    reset by word stores (``reset_ready``), so an owner dying in here cannot tear a key.
    """
    table, by_key = entries.table, entries.by_key
    ready, kept, freed, torn_keys, free = [], 0, 0, 0, []
    writing: list[tuple[int, bytes, tuple[int, int]]] = []
    offers: list[tuple[int, bytes, tuple[int, int], int, tuple[int, int] | None]] = []
    index = entries.index  # the predecessor's until cut below: the offers it served
    for b in range(table.num_blocks):
        e = table.read(b)  # (torn: its sequence number odd, read as it lies)
        client = (e.writer, e.writer_gen)
        if e.state in (L.READY, L.EVICTING, L.CLAIMED) and e.writer >= 0 and \
                writer_alive(*client):
            # An offer of a live client, its claim under way (EVICTING) or done: that client
            # alone writes the entry now, so it is never freed or rewritten here. Its round
            # is never closed here either: the client may be inside it, its state not yet
            # stored (odd until it goes on, a miss meanwhile), and a round closed under it
            # would let that store land outside any round, unseen by a reader that proved
            # the entry READY at the closed sequence number. One never handed over is
            # handed over at adoption, or kept until its client goes (``Grants.settle``).
            # The key of an offer the predecessor served (its index names the block) is
            # indexed again, its round closed and its key intact. Any other is kept as a
            # claim, indexed nowhere: one left odd may be the client's claim round or a dead
            # owner's publish of its claim, a copy killed after the state byte (any subset
            # of a copy's bytes may land: the old key and checksum over the new key's
            # bytes); one no index names is a claim kept so by a predecessor, given back
            # since by its client, its key perhaps stored again elsewhere meanwhile.
            if e.state != L.CLAIMED and e.key and e.key_ok and not e.torn and \
                    index.find(e.key)[0] == b:
                offers.append((b, e.key, client, e.grant_pos, e.stored_by))
            else:
                grants.adopt(b, client, e.grant_pos, claimed=True)
            continue
        # A dead owner may have left an entry mid-rewrite (odd seq: readers would report
        # it torn forever). Never trust its key: a copy killed halfway may have stored any
        # subset of its bytes, a key half rewritten under an unchanged READY state (the
        # checksum tells) or a new READY state over an intact old key and checksum (nothing
        # tells: a claimed block's publish, over the new key's bytes). Nor a key whose
        # checksum fails (damage). Its round stays open until the FREE write below ends it
        # (a write goes on from an odd sequence number): settled first, it would look
        # intact to the next owner if this one died in between.
        torn = e.torn
        if torn:
            crash_point("owner.rebuild.torn")
        if e.state != L.FREE and (torn or not e.key_ok):
            torn_keys += 1  # never published: its key is neither the old nor the new one
        elif e.state in (L.READY, L.EVICTING) and e.key and \
                (e.writer < 0 or index.find(e.key)[0] == b):
            if e.state != L.READY or e.writer != -1 or e.pins:  # a plain ready block from
                table.reset_ready(b)  # now on (a dead client's offer too, whatever dies next)
            ready.append((e.last_use, b, e.key, e.stored_by))
            continue
        elif e.state == L.GRANTED and e.key and e.key not in grants.deferred:
            grants.deferred[e.key] = b  # a completed store a dead owner deferred
            continue
        elif e.state in (L.WRITING, L.GRANTED) and e.writer >= 0 and \
                not (e.state == L.GRANTED and e.key) and writer_alive(e.writer, e.writer_gen):
            if e.state == L.GRANTED:
                grants.adopt(b, (e.writer, e.writer_gen), e.grant_pos)
            else:
                writing.append((b, e.key, (e.writer, e.writer_gen)))
            continue
        # a torn WRITING entry's store was never answered, a dead writer's (or claim's) never
        # ends; a dead client's offer no index names was a claim a predecessor kept, never
        # served since (given back, its key perhaps stored again elsewhere)
        if e.state != L.FREE or torn:
            table.write(b, L.FREE, b"")
            freed += e.state != L.FREE
        free.append(b)
    stores = Counter(key for _, key, _ in writing)
    twice = _held_twice(grants, [key for _, _, key, _ in ready], stores,
                        [key for _, key, *_ in offers])
    # The index is what tells the next owner which offers were served: it is cut down to
    # their slots, never emptied, so that a death anywhere from here on leaves them named.
    served = [(b, key) for b, key, *_ in offers if key not in twice]
    index.retain([b for b, _ in served], tags_of([key for _, key in served]))
    crash_point("owner.rebuild.index")
    for b, key, client, pos, tenant in offers:  # cached and indexed, out of the policy's
        if key in twice:  # order; the client may claim it: it stays theirs, unindexed
            grants.adopt(b, client, pos, claimed=True)
            continue
        # (its slot kept) its tenant's again if the offer ends unclaimed: out of its share
        # meanwhile, as any offer
        entries.adopt_many([b], [key], None, tenant=tenant, indexed=True)
        entries.offered(by_key[key])
        entries.policy.remove(key)
        grants.adopt(b, client, pos, offered=key)
    # oldest first: recency survives failover
    for i, (last_use, b, key, tenant) in enumerate(sorted(ready, key=lambda r: r[:2])):
        if key in twice:
            table.write(b, L.FREE, b"")
            free.append(b)
            continue
        if i == len(ready) // 2:
            crash_point("owner.rebuild.mid")
        entries.adopt(b, key, None, tenant)  # in its client's share, as before
        entries.tick = max(entries.tick, last_use)
    for b, key, writer in writing:
        if stores[key] > 1:  # which store writes the key's bytes? Its writer may go on
            grants.hold(b, writer)  # copying into either block: each stays its writer's
            continue
        entries.adopt(b, key, writer)
        kept += 1
    entries.free = deque(sorted(free))  # low block ids first, like vLLM's CPU backend
    for key in list(grants.deferred):  # deferred behind a store that is over now
        behind = by_key.get(key)
        if behind is None or behind.ready:
            grants.resolve(key)
    return {"ready": len(ready), "pending": kept, "freed": freed, "torn": torn_keys}


def _held_twice(grants: Grants, ready: list[bytes], stores: Counter[bytes],
                offered: list[bytes]) -> set[bytes]:
    """The keys more than one of these entries hold (only damage does that): counted in the
    header and named in the log."""
    seen = Counter(ready) + stores + Counter(offered)
    twice = {k for k, n in seen.items() if n > 1}
    if twice:
        grants.segment.counter_add("duplicate_keys", len(twice))
        for k in sorted(twice)[:_LOGGED]:
            log.warning("rebuild: duplicate key %s… in %d entries (a damaged block table): "
                        "every copy dropped, the key is a miss", k.hex()[:16], seen[k])
        if len(twice) > _LOGGED:
            log.warning("rebuild: %d more duplicate keys dropped", len(twice) - _LOGGED)
    return twice
