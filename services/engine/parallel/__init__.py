"""Tensor parallelism: one engine replica as N processes (ranks), one per GPU, under torch.distributed.

    rank 0 (the engine process)                         ranks 1..N-1 (worker.py)
    ───────────────────────────                         ────────────────────────
    scheduler, Redis I/O, heartbeat, sampling
    ModelRunner.launch ── StepSender.send ──(gloo)──►   StepReceiver.recv -> follow_step
         forward shard  ◄────── all-reduce / all-gather (NCCL | gloo) ──────►  forward shard

Modules: state (process groups, collectives), linear / embedding (the sharded layers), sharding
(rewrites a family's meta model into its rank's shard), loading (per-rank slices of safetensors
files, or random weights), step_broadcast (one packed tensor per step), launcher (rank 0 spawns and
watches the workers), worker (the other ranks' loop).
"""
