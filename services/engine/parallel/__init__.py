"""Tensor parallelism's building blocks: one engine replica as N ranks, one per GPU, under torch.distributed.

Modules: state (process groups, collectives), linear / embedding (the sharded layers), sharding
(rewrites a family's meta model into its rank's shard), loading (per-rank slices of safetensors
files, or random weights), step_broadcast (one packed tensor per step). Starting and running the
ranks is the executor's (services/engine/executor/): MultiprocExecutor spawns and watches them,
executor/worker.py is every rank's build and the other ranks' step loop.
"""
