"""How both engines sample: counter-based noise, the lossless verification rules, the sampling parameters."""
