"""What the engine side and the owner both speak: the manager API, the wire protocol, the
access kinds and how an owner is launched. The two processes' code lives in
``kvshm.client`` and ``kvshm.owner``."""
