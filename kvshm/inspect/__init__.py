"""Read-only views of a segment for operators: snapshot, verify, metrics, CLI."""
