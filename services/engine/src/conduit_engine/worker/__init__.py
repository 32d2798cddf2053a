"""The device side: the model runner, its KV cache and CUDA graphs, the worker process."""
