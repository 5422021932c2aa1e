"""The lower tier: blocks shared cluster-wide through a distributed KV store (Mooncake Store).

Layer: above ``kvshm.index`` (the mover and ``TieredManager`` are segment clients), below
``kvshm.engine``/``kvshm.inspect``. ``api`` (the ``LowerTier`` interface and the value format),
``area`` (the shared memory engines, the mover and kvshm-inspect meet in), ``client``
(``TieredManager``: lookups that may answer "not yet"), ``mover`` (the one process per host
that talks to the store) and ``mooncake`` (the first backend; the only module that imports
``mooncake``, lazily). Importing this package imports none of them.
"""
