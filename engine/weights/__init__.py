"""Where weights come from and how they are held: checkpoints and GGUF files read tensor by tensor, the per-type table
of GGUF blocks, quantization, and the packed layers the CPU kernels read."""
