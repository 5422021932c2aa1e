"""The index: manager semantics, the owner process and its clients."""
