"""GAE and discounted returns: chunked parallel scan vs the sequential recursion vs a scalar loop."""

import time

import pytest
import torch

from slime.algorithms.gae import (
    chunked_discounted_returns,
    chunked_gae,
    get_advantages_and_returns_batch,
    vanilla_gae,
)


def scalar_gae(rewards, values, gamma, lambd):
    """Textbook GAE on Python floats for one sequence."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_vanilla_and_chunked_match_scalar_loop(gamma, lambd):
    torch.manual_seed(0)
    rewards = torch.randn(3, 7, dtype=torch.float64)
    values = torch.randn(3, 7, dtype=torch.float64)
    expected = [scalar_gae(r, v, gamma, lambd) for r, v in zip(rewards.tolist(), values.tolist())]
    expected_advantages = torch.tensor([e[0] for e in expected], dtype=torch.float64)
    expected_returns = torch.tensor([e[1] for e in expected], dtype=torch.float64)
    for gae in (vanilla_gae, lambda r, v, g, lam: chunked_gae(r, v, g, lam, chunk_size=3)):
        advantages, returns = gae(rewards, values, gamma, lambd)
        assert max_diff(advantages, expected_advantages) < 1e-12
        assert max_diff(returns, expected_returns) < 1e-12


def test_gae_by_hand():
    # gamma = 0.5, lambd = 0.5, rewards [0, 1], values [1, 2]:
    # delta_1 = 1 + 0.5 * 0 - 2 = -1            A_1 = -1
    # delta_0 = 0 + 0.5 * 2 - 1 = 0             A_0 = 0 + 0.25 * (-1) = -0.25
    # returns = A + V = [0.75, 1.0]
    rewards, values = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 2.0]])
    for gae in (vanilla_gae, chunked_gae):
        advantages, returns = gae(rewards, values, 0.5, 0.5)
        assert advantages.tolist() == [[-0.25, -1.0]]
        assert returns.tolist() == [[0.75, 1.0]]


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
@pytest.mark.parametrize("batch,length", [(1, 1), (2, 63), (3, 64), (4, 257), (16, 4096), (8, 5000)])
def test_chunked_matches_vanilla(batch, length, chunk_size):
    torch.manual_seed(batch * 7 + length)
    rewards, values = torch.randn(batch, length), torch.randn(batch, length)
    advantages, returns = vanilla_gae(rewards, values, 0.99, 0.95)
    chunked_advantages, chunked_returns = chunked_gae(rewards, values, 0.99, 0.95, chunk_size=chunk_size)
    assert chunked_advantages.shape == (batch, length) and chunked_advantages.dtype == torch.float32
    assert max_diff(advantages, chunked_advantages) < 1e-5
    assert max_diff(returns, chunked_returns) < 1e-5


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_chunked_matches_vanilla_without_discount(chunk_size):
    # With gamma = lambd = 1 the advantages are plain suffix sums of magnitude ~sqrt(T), and the
    # float32 recursion itself drifts from the exact value by ~1e-5 relative to that magnitude.
    # float64 checks the algebra tightly; float32 gets a tolerance scaled to the magnitude.
    torch.manual_seed(chunk_size)
    rewards, values = torch.randn(4, 3000, dtype=torch.float64), torch.randn(4, 3000, dtype=torch.float64)
    advantages, returns = vanilla_gae(rewards, values, 1.0, 1.0)
    chunked_advantages, chunked_returns = chunked_gae(rewards, values, 1.0, 1.0, chunk_size=chunk_size)
    assert max_diff(advantages, chunked_advantages) < 1e-9
    assert max_diff(returns, chunked_returns) < 1e-9

    advantages, _ = vanilla_gae(rewards.float(), values.float(), 1.0, 1.0)
    chunked_advantages, _ = chunked_gae(rewards.float(), values.float(), 1.0, 1.0, chunk_size=chunk_size)
    assert max_diff(advantages, chunked_advantages) < 1e-5 * advantages.abs().max().item()


def test_chunked_rejects_bad_shapes_and_chunk_size():
    with pytest.raises(ValueError, match="batch, time"):
        chunked_gae(torch.zeros(5), torch.zeros(5), 1.0, 1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_gae(torch.zeros(1, 5), torch.zeros(1, 5), 1.0, 1.0, chunk_size=0)


@pytest.fixture(scope="module")
def big_case():
    """256 x 131072 float32, the upstream stress size; the vanilla reference is computed once."""
    torch.manual_seed(0)
    rewards, values = torch.randn(256, 131072), torch.randn(256, 131072)
    start = time.perf_counter()
    advantages, returns = vanilla_gae(rewards, values, 0.99, 0.95)
    print(f"\nvanilla_gae 256x131072: {time.perf_counter() - start:.2f} s")
    return rewards, values, advantages, returns


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_chunked_matches_vanilla_at_256x131072(big_case, chunk_size):
    rewards, values, advantages, returns = big_case
    start = time.perf_counter()
    chunked_advantages, chunked_returns = chunked_gae(rewards, values, 0.99, 0.95, chunk_size=chunk_size)
    print(f"\nchunked_gae 256x131072 chunk {chunk_size}: {time.perf_counter() - start:.2f} s")
    assert max_diff(advantages, chunked_advantages) < 1e-5
    assert max_diff(returns, chunked_returns) < 1e-5


def test_batch_helper_handles_unequal_lengths():
    torch.manual_seed(3)
    lengths = [5, 1, 300]
    values_list = [torch.randn(n) for n in lengths]
    rewards_list = [torch.randn(n) for n in lengths]
    for chunked in (True, False):
        advantages, returns = get_advantages_and_returns_batch(values_list, rewards_list, 0.9, 0.8, chunked=chunked)
        for adv, ret, v, r in zip(advantages, returns, values_list, rewards_list):
            expected_advantages, expected_returns = scalar_gae(r.tolist(), v.tolist(), 0.9, 0.8)
            assert max_diff(adv, torch.tensor(expected_advantages)) < 1e-5
            assert max_diff(ret, torch.tensor(expected_returns)) < 1e-5


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_chunked_discounted_returns_match_loop(gamma):
    torch.manual_seed(4)
    rewards = torch.randn(3, 200, dtype=torch.float64)
    expected = []
    for row in rewards.tolist():
        returns, running = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            running = row[t] + gamma * running
            returns[t] = running
        expected.append(returns)
    got = chunked_discounted_returns(rewards, gamma, chunk_size=16)
    assert max_diff(got, torch.tensor(expected, dtype=torch.float64)) < 1e-10
