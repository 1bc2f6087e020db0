"""The typed messages that cross meshserve's process boundaries, one module per protocol.

  worker     master <-> worker: steps, step outputs, a rank's life (`StepBatch`, `ModelRunnerOutput`, ...)
  client     engine client (API server, router, LLM) <-> master: requests, token deltas, stats, admin
  kv         KV connectors (memory pool, prefill -> decode), link states, prefix-cache events
  heartbeat  a TE's registration and load, to job executors and cluster managers
  cluster    job executor / warm TE / CLI <-> cluster manager
  eplb       expert placements and reconfiguration phases
  sampling_params   per-request sampling settings (they travel as themselves)
  codec      frames: encode / decode with validation; receive: a socket's receive with dropped-frame counts

Every message is a msgspec struct; nothing here imports torch, and nothing here imports the processes
that send or receive it (meshserve.core, the router, the cluster manager import this package).
"""
