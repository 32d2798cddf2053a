"""Prefill/decode disaggregation: moving a finished prefill's KV blocks from one engine to another.

Torch-free bookkeeping (safe to import from the engine core):
- `layout`: the KV layout of an engine and its fingerprint (which engines can exchange blocks);
- `registry`: the source side, transfers pinned under an id with a lease (`KvTransferRegistry`);
- `pull_plan`: the destination side, which blocks to pull and committing them to the prefix cache;
- `errors`: what a transfer can fail with, each with its gRPC status code.

Data movement (torch, grpc):
- `cache_io`: KV cache blocks ↔ KvChunk payload bytes through the ops' gather/scatter;
- `transport`: the `KvTransport` interface a decode engine pulls through;
- `grpc_transport`: its first implementation, bytes over the PullKv RPC (every pull's fallback);
- `shm_segment`, `shm_transport`, `shm_cache`: same-host pulls, straight out of a source's cache in a
  memfd or through a shared-memory segment per pull;
- `nixl_agent`, `nixl_transport`: NIXL (UCX) one-sided reads between registered KV caches;
- `nixl_regions`: a rank's registered cache shard and the read descriptors between two shards (the
  endpoint of an engine whose cache lives in worker processes is the executor's: executor/nixl_workers);
- `setup`: which of them an engine serves and pulls with (--kv-transport), decided at start;
- `puller`: the decode side's pull of one request, through the transport the handle allows;
- `service`: the PullKv and ReleaseKv handlers of the source engine;
- `proto`: KvLayout / KvHandle messages and pull specs from handles.

Nothing here imports torch at package import time.
"""
