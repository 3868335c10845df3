"""FSDP training backend: HuggingFace models sharded with FSDP2 (`actor.FSDPTrainRayActor`).

Modules: `model` (build, shard, optimizer, forward), `data_packing` (packed micro-batch layout),
`loss` (losses from logits), `update_weight` (full HF-named parameters for the engines), `checkpoint`
(save / load / HF export). Backend-neutral pieces live in `slime.utils`: `advantages`, `losses`,
`micro_batches`, `weight_sync`.
"""
