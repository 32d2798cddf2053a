"""Engine workers and tensor parallelism: the engine process schedules, worker processes run model shards.

- `sharding`: which heads, MLP columns and vocabulary rows a rank holds; reading only those from
  safetensors; the start-up check that the tensor-parallel size fits the model (no torch at import);
- `comm`: the collectives a sharded model needs (all-reduce, gather to rank 0) behind one interface,
  on torch.distributed (gloo on CPU, NCCL on CUDA);
- `wire`: the compact binary frames (no pickling) the engine and the workers exchange;
- `step_codec`: a step's inputs and the sampling rank's answer as frames;
- `worker`: the worker process: load a shard, allocate its KV cache, run every broadcast step;
- `worker_group`: the engine's side of the processes: spawn, handshake, broadcast, failure detection,
  and no orphans either way;
- `worker_runner`: the runner the engine steps when the model runs in workers.
"""
