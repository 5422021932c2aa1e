"""The engine-side flow: hashing, scheduler connector, workers, job channel."""
