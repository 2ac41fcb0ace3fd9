"""The parameters: their shapes and initialization, quantization, and their placement on the
mesh (sharding)."""
