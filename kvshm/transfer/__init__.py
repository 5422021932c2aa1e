"""Block copies between an engine's KV tensors and the segment's planes."""
