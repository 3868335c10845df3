"""Rank -> data-parallel rank mapping of `RayTrainGroup` (which rollout shard each training rank gets)."""

from argparse import Namespace

import pytest

from slime.ray.actor_group import data_parallel_rank, data_parallel_ranks


def test_fsdp_rank_is_dp_rank():
    args = Namespace(train_backend="fsdp", tensor_model_parallel_size=4)  # Megatron flags are ignored under FSDP
    assert data_parallel_ranks(args, 4) == [0, 1, 2, 3]


def test_hand_worked_layout():
    # 8 ranks, tp=2, cp=1, pp=2 -> dp=2. Rank order tp fastest, then cp, dp, pp:
    # rank = tp_rank + 2 * (dp_rank + 2 * pp_rank)
    # pp stage 0: ranks 0,1 -> dp 0; ranks 2,3 -> dp 1. pp stage 1: ranks 4,5 -> dp 0; ranks 6,7 -> dp 1.
    args = Namespace(
        train_backend="megatron", tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=1
    )
    assert data_parallel_ranks(args, 8) == [0, 0, 1, 1, 0, 0, 1, 1]
    # tp=1, cp=2, pp=1 over 4 ranks: rank = cp_rank + 2 * dp_rank -> [0, 0, 1, 1]
    assert [data_parallel_rank(rank, 4, cp=2) for rank in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "world_size,tp,pp,cp",
    [(1, 1, 1, 1), (4, 2, 1, 1), (8, 2, 2, 1), (8, 1, 2, 2), (16, 2, 2, 2), (12, 3, 1, 2), (24, 2, 3, 1)],
)
def test_matches_megatron_rank_generator(world_size, tp, pp, cp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    dp = world_size // (tp * pp * cp)
    # megatron-core's own grouping with the default order of initialize_model_parallel
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expected = {}
    for group in generator.get_ranks("dp"):
        for dp_rank, rank in enumerate(group):
            expected[rank] = dp_rank
    assert [data_parallel_rank(rank, world_size, tp, pp, cp) for rank in range(world_size)] == [
        expected[rank] for rank in range(world_size)
    ]


def test_world_size_not_divisible_names_the_flags():
    with pytest.raises(ValueError, match="model-parallel groups"):
        data_parallel_rank(0, 6, tp=4)
