"""The owner process: the one authoritative index of a segment and the loop that serves it.

``manager`` (``LocalManager``: the index, vLLM's offload semantics, mirrored into the segment),
with the parts it composes (``policy``, ``eviction``, ``rebuild``, ``grants``, ``running``);
``server`` (``Owner``: reads every client's request ring, exactly once) with ``requests`` (what
each frame does) and ``spin``. Clients reach it only through the wire protocol
(``kvshm.index.protocol``) and the segment; nothing here imports ``kvshm.client``.
"""
