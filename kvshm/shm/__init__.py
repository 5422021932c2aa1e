"""Shared memory: the segment, its records and the primitives every layer stands on."""
