"""Named crash points: a process SIGKILLs or SIGSTOPs itself at an exact step, on request.

This module owns deterministic fault injection. Code that must survive a death at a given
step calls ``crash_point("owner.store.after_consume")`` there; when the environment of that
process names the point, it stops dead right there, so a test can walk every point of a
protocol instead of hoping a random soak hits a narrow window.

    KVSHM_CRASH_AT=owner.store.after_consume        # SIGKILL on the first hit
    KVSHM_CRASH_AT=owner.store.after_consume:3      # ... on the third hit
    KVSHM_CRASH_SIGNAL=STOP                         # SIGSTOP instead (a frozen process)

Unset (production), ``crash_point`` is a function that returns at once: the variable is
read once, at import. Every point in the code base is listed in ``POINTS``; naming an
unknown point is an error, so a renamed point cannot silently stop being tested. It must
never do anything but stop its own process.
"""
from __future__ import annotations

import os
import signal

# Every crash point, grouped by the operation it belongs to. Tests walk this tuple.
POINTS = (
    # owner: one request, from the ring to the reply
    "owner.request.after_consume",  # request recorded as consumed, nothing executed
    "owner.request.after_execute",  # index changed (and mirrored), no reply yet
    "owner.request.after_reply",  # reply on the ring, request frame not yet released
    "owner.one_way.after_begin",  # a one-way frame (touch, publish) recorded as begun,
    #                               nothing executed
    # owner: eviction inside prepare_store
    "owner.evict.after_mark",  # victims marked EVICTING, leases not yet re-read
    "owner.evict.after_drop",  # victims freed, their keys gone from the index
    # owner: block grants (store without a round trip)
    "owner.grant.before_count",  # granted blocks GRANTED and their ids in the ring, count not
    #                              yet stored: the client cannot take them
    "owner.publish.mid",  # a Publish frame's blocks READY in the table, not yet indexed
    "owner.publish.merged",  # Publish frames queued behind each other applied as one,
    #                          none released from the ring yet
    "owner.offer.after_choose",  # victims chosen to offer (out of the policy, still READY),
    #                              not yet marked offered in the table
    "owner.publish.after_forget",  # a claimed block's old key gone from the index, its new
    #                                key not yet written
    "owner.free.after_holds",  # blocks a reader may hold (READY, EVICTING) freed: FREE in
    #                            the table, the holds read, not yet parked or on the free list
    "owner.unclaimed.settled",  # a dead client's offers settled (its copier lives), not yet
    #                             ended (cached again, or freed)
    # owner: entry writes
    "owner.recall.lowered",  # an idle client's granted count lowered to take its untaken
    #                          ids back, its intent word not yet read
    "owner.recall.mid",  # of the blocks recalled, the ones at the highest ring positions
    #                      ended (freed, or cached again), the others still granted
    "table.write.odd",  # entry sequence odd, body half written
    "table.write_many.odd",  # a batch's entries all odd, half their bodies written
    "table.offer.mid",  # offered entries odd, their ring positions stored, not the writer
    "table.offer.odd",  # offered entries odd, their writer fields stored
    "table.claim.odd",  # (a client) the entries it claims odd, their state not yet stored
    # owner: takeover
    "owner.rebuild.mid",  # half the table adopted
    "owner.rebuild.torn",  # an entry a dead owner left mid-rewrite found, not yet freed
    "owner.rebuild.index",  # the predecessor's key index cut down to what is kept of it,
    #                         nothing indexed again yet
    "owner.reclaim.mid",  # a dead client's stores freed, its slot not yet cleared
    "owner.goodbye.mid",  # a leaving client's slot LEAVING, its stores freed, no reply yet
    # client
    "client.slot.after_lock",  # (a client taking a slot) a slot's lock taken, its
    #                            record not yet read
    "client.connect.after_activate",  # slot CLIENT, owner has not adopted it yet
    "client.store.after_prepare",  # blocks granted, nothing copied
    "client.store.after_take",  # blocks taken from the grant ring, the count not yet stored
    "client.take.after_intent",  # the ring positions it is taking announced (intent), the
    #                              granted count not yet read again
    "client.claim.before_check",  # offered blocks CLAIMED, other clients' holds not yet read
    "client.store.after_copy",  # blocks copied, complete_store not sent
    "client.load.after_pin",  # blocks pinned, not yet copied out
    "client.load.wait_decision",  # a pinned block found mid-eviction (EVICTING): waiting
    #                               for its evictor to decide, which must see our hold
    "client.shutdown.before_bye",  # about to say goodbye
    "owner.launch.before_pid",  # (a client's owner launcher) the owner forked, its pid not
    #                             yet written to the client
    # named objects
    "object.before_link",  # a tier area made under a name of its own, its mode
    #                        set, not yet linked under its name
    # segment creation
    "segment.create.after_open",  # object exists (exclusive open), creation lock not taken
    "segment.create.after_lock",  # creation lock held, nothing reserved
    "segment.create.after_reserve",  # space reserved, header (magic) not written
    # copy workers
    "worker.store.mid_copy",  # a store job half copied into the segment
    # the lower tier's mover
    "mover.fill.after_prepare",  # fetched keys WRITING in the segment, nothing fetched
    "mover.fill.after_get",  # values fetched into their blocks, not verified or completed
    "mover.spill.after_pin",  # blocks pinned for their put, nothing put
    "mover.area.after_open",  # the tier area open (perhaps created), the segment not yet
    #                           checked for removal
)

_ENV = os.environ.get("KVSHM_CRASH_AT")
_SIG = signal.SIGSTOP if os.environ.get("KVSHM_CRASH_SIGNAL", "KILL").upper() == "STOP" \
    else signal.SIGKILL
_AT, _HITS = None, 0
if _ENV:
    _AT, _, n = _ENV.partition(":")
    _HITS = int(n or 1)
    if _AT not in POINTS:
        raise ValueError(f"KVSHM_CRASH_AT names {_AT!r}, which is no crash point; "
                         f"known: {', '.join(POINTS)}")

ARMED = _AT is not None  # hot paths may test this before building a point's name


def crash_point(name: str) -> None:
    """Stop this process here if ``KVSHM_CRASH_AT`` names ``name`` (and its hit count is up)."""
    global _HITS
    if name != _AT:
        return
    _HITS -= 1
    if _HITS == 0:  # once: a SIGSTOPped process that is let go runs on
        os.kill(os.getpid(), _SIG)
