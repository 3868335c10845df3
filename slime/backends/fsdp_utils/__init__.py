"""FSDP training backend: HuggingFace models sharded with FSDP2 (`actor.FSDPTrainRayActor`).

Modules: `model` (build, shard, optimizer, forward), `data_packing` (micro-batches), `advantages`,
`loss`, `update_weight` (trainer -> engines), `checkpoint` (save / load / HF export).
"""
