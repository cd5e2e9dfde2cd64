"""A stand-in for vLLM (see ../README.md): the call sites torpor's plugin meets, nothing else."""
