"""The static decode step (fixed buffers; compiled on CPU) and its CUDA graphs."""
