"""Upstream slime's helpers that plugins call, under upstream's names: the pure parts (mask lengths, IcePop, the CP
helpers outside context parallelism, the router's launch args). Servers, processes, sockets and CP ranks:
tests/integration/test_upstream_contract_processes.py."""

import math
from argparse import Namespace

import pytest
import torch

from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp
from slime.backends.megatron_utils.loss import icepop_function
from slime.utils.http_utils import router_launch_args
from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths


def test_get_response_lengths_counts_from_the_first_trainable_token():
    masks = [[0, 0, 1, 1, 0, 1], [0, 0, 0], [1], [0, 1, 0, 0]]
    # By hand: from index 2 to the end of 6 tokens is 4 (the 0 between the turns counts), none, 1, 3.
    assert get_response_lengths(masks) == [4, 0, 1, 3]


def test_the_generator_method_gives_the_module_function(tiny_model_dir):
    from transformers import AutoTokenizer

    generator = MultiTurnLossMaskGenerator(AutoTokenizer.from_pretrained(tiny_model_dir))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sure"},
    ]
    _, mask = generator.get_loss_mask(messages)
    first = mask.index(1)
    assert 0 in mask[first:]  # two turns: the second user turn is masked out between them
    assert generator.get_response_lengths([mask]) == get_response_lengths([mask]) == [len(mask) - first]


def test_icepop_drops_tokens_outside_the_band_and_keeps_the_ratio_inside():
    ratios = [1.2, 10.0, 0.3, 0.9, 5.0]  # the last token is masked out of the loss
    rollout = torch.tensor([-2.0, -4.6, -1.0, -0.5, -3.0])
    train = rollout + torch.tensor([math.log(r) for r in ratios])
    pg_loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    masks = [torch.tensor([1, 1, 1]), torch.tensor([1, 0])]
    args = Namespace(tis_clip=2.0, tis_clip_low=0.5)

    weighted, out_masks, metrics = icepop_function(
        args,
        pg_loss=pg_loss,
        train_log_probs=[train[:3], train[3:]],
        rollout_log_probs=[rollout[:3], rollout[3:]],
        loss_masks=masks,
        total_lengths=[7, 4],
        response_lengths=[3, 2],
    )
    # Inside [0.5, 2]: the loss times the ratio; outside: 0 (truncation would give 2.0 * 2 and 0.5 * 3).
    expected = [1.0 * 1.2, 0.0, 0.0, 4.0 * 0.9, 0.0]
    assert weighted.tolist() == pytest.approx(expected, rel=1e-5)
    assert out_masks is masks
    assert metrics["tis_clipfrac"].item() == pytest.approx(2 / 4)  # 2 of the 4 trainable tokens dropped
    assert metrics["tis_weight_mean"].item() == pytest.approx((1.2 + 0.9) / 4, rel=1e-5)
    assert metrics["tis_raw_weight_mean"].item() == pytest.approx((1.2 + 10.0 + 0.3 + 0.9) / 4, rel=1e-5)


def test_cp_helpers_without_context_parallelism_return_their_input():
    log_probs = torch.tensor([-0.1, -0.2, -0.3])
    assert slice_log_prob_with_cp(log_probs, 10, 3) is log_probs
    as_list = [-0.1, -0.2]
    assert slice_log_prob_with_cp(as_list, 10, 2) is as_list
    assert all_gather_with_cp(log_probs, 10, 3) is log_probs
    with pytest.raises(ValueError, match="4 values for a response of 3 tokens"):
        slice_log_prob_with_cp([0.0] * 4, 10, 3)


def test_run_router_binds_the_loopback_unless_told_otherwise():
    from sglang_router.router_args import RouterArgs

    given = Namespace(port=30000, prometheus_port=29000)
    launched = RouterArgs.from_cli_args(router_launch_args(given))
    assert (launched.host, launched.prometheus_host, launched.port) == ("127.0.0.1", "127.0.0.1", 30000)
    assert not hasattr(given, "host")  # the caller's namespace is left as it was

    unset = RouterArgs.from_cli_args(router_launch_args(Namespace(port=30000, host=None, prometheus_host=None)))
    assert (unset.host, unset.prometheus_host) == ("127.0.0.1", "127.0.0.1")
    chosen = RouterArgs.from_cli_args(router_launch_args(Namespace(host="0.0.0.0", prometheus_host="10.0.0.5")))
    assert (chosen.host, chosen.prometheus_host) == ("0.0.0.0", "10.0.0.5")

    # A RouterArgs always names its host; only its metrics host can be missing.
    router_args = RouterArgs(host="10.0.0.7", port=30000)
    assert router_launch_args(router_args).host == "10.0.0.7"
    assert router_launch_args(router_args).prometheus_host == "127.0.0.1" and router_args.prometheus_host is None
    assert router_launch_args(RouterArgs(prometheus_host="0.0.0.0")).prometheus_host == "0.0.0.0"
