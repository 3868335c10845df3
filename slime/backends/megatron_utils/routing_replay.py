"""MoE routing replay on megatron-core: every router of a model chunk takes the experts the engines chose.

megatron-core's `TopKRouter` replays given top-k indices when its config has `moe_enable_routing_replay`
(`RouterReplay`, REPLAY_FORWARD): the expert weights are then the router's own scores at those experts, so
the router is still trained. Here each router gets the column of its layer (`layer_number` is global and
1-based) from the micro-batch's `[1, N, num_layers, top_k]` routing, cut as the router sees its tokens: this
context-parallel rank's zig-zag part of the row, then this tensor-parallel rank's slice under sequence
parallelism.
"""

from __future__ import annotations

import torch

from slime.backends.megatron_utils.cp_utils import zigzag_slice


def moe_routers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The chunk's top-k routers that can replay (built with `moe_enable_routing_replay`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def local_routing(routing: torch.Tensor, cu_seqlens: list[int], mpu) -> torch.Tensor:
    """`[n, num_layers, top_k]`: the rows of a `[1, N, num_layers, top_k]` routing this rank's routers see.

    Args:
        routing: The micro-batch's routing, in row order.
        cu_seqlens: The row's sequence boundaries (for the context-parallel split).
        mpu: megatron-core's `parallel_state`.
    """
    cp_size = mpu.get_context_parallel_world_size()
    if cp_size > 1:
        routing = zigzag_slice(routing, cu_seqlens, cp_size, mpu.get_context_parallel_rank(), dim=1)
    tp_size = mpu.get_tensor_model_parallel_world_size()
    if tp_size > 1:  # MoE with TP runs sequence parallel: each TP rank routes its slice of the row
        routing = routing.chunk(tp_size, dim=1)[mpu.get_tensor_model_parallel_rank()]
    return routing[0]


def set_replay(routers: list[torch.nn.Module], routing: torch.Tensor | None) -> None:
    """Make `routers` take `routing` (`[n, num_layers, top_k]`) in their next forwards; None: route freely."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in routers:
        replay = router.router_replay
        replay.clear_indices()  # it keeps every target for backward replay otherwise
        if routing is None:
            replay.clear_router_replay_action()
            continue
        replay.set_target_indices(routing[:, router.layer_number - 1].long().contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
