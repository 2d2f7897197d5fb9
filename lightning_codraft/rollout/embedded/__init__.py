"""The embedded engines: speculative decoding in PyTorch with an EAGLE-3 draft (batched, adaptive rounds) or a
block drafter, and the embedded engines' weights."""
