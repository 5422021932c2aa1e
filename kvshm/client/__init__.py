"""The engine side of a shared segment: ``connect()`` and the ``SharedManager`` proxy.

``manager`` (the manager API of a client process), ``owner_link`` (calls to the owner,
exactly-once, failover), ``holds`` and ``runs`` (leases and pins of lookups and loads),
``own_stores`` (reading back this client's own completed stores). It reaches the owner only
through the wire protocol (``kvshm.index.protocol``) and the segment, and starts one by the
entry point ``kvshm.index.launch`` names; nothing here imports ``kvshm.owner``.
"""
