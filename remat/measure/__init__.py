"""The measuring half: a chain's first call, stage by stage, under the storage
meter (or the CUDA allocator), and the ``ChainRecord`` of what it learned."""
