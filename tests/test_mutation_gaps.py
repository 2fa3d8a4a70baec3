"""Tests for the wrong edits that mutation testing (tools/mutation.py, docs/testing.md) found the other fast tests let
through: each checks the method file against an independent computation (a python loop, autograd,
torch.distributions, an exhaustive enumeration)."""
import itertools
import math
import statistics
import threading

import pytest
import torch
from torch.testing import assert_close

import critic_free
import gae

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# gae.py
# ---------------------------------------------------------------------------------------------------------------
def contiguous(row: list[float]) -> bool:
    """1 … 1 0 … 0: no real token after a padded one (a python loop over the row)."""
    seen_pad = False
    for m in row:
        if m == 0.0:
            seen_pad = True
        elif seen_pad:
            return False
    return True


@pytest.mark.parametrize("fn", ["compute_gae", "k_step_return", "k_step_advantage"])
def test_gae_mask_check_rejects_every_gapped_mask_and_accepts_every_right_padded_one(fn):
    """Every 0/1 mask of 4 tokens: a gap anywhere (1 0 1 1, 1 1 0 1), not only a missing first token, is rejected."""
    args = (0.9, 0.9) if fn == "compute_gae" else (0.9, 2)
    for row in itertools.product([0.0, 1.0], repeat=4):
        mask = torch.tensor([row, [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
        rewards, values = torch.ones_like(mask), torch.ones_like(mask)
        if contiguous(list(row)):
            getattr(gae, fn)(rewards, values, mask, *args)
        else:
            with pytest.raises(ValueError, match="contiguous"):
                getattr(gae, fn)(rewards, values, mask, *args)


# ---------------------------------------------------------------------------------------------------------------
# critic_free.py
# ---------------------------------------------------------------------------------------------------------------
def ragged_rewards(seed: int, B: int = 6, T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float64 per-token rewards (NaN on padding) and a right-padded mask with lengths 1 … T."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 1] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=F64)
    rewards = torch.where(mask != 0, torch.randn(B, T, generator=g, dtype=F64), math.nan)
    return rewards, mask


def loop_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> list[list[float]]:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over each row's real tokens, by a python loop."""
    out = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        n = int(sum(m))
        out.append([sum(gamma ** (s - t) * r[s] for s in range(t, n)) for t in range(n)])
    return out


def on_two_ranks(fn, halves: list[tuple]) -> list:
    """fn(*halves[rank], all_sum) on two threads that play two ranks: all_sum adds the other rank's tensor (an
    all-reduce). Returns [rank 0's result, rank 1's]."""
    barrier, box, out = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def rank(r: int) -> None:
        def all_sum(t: torch.Tensor) -> torch.Tensor:
            box[r] = t.clone()
            barrier.wait()
            total = box[0] + box[1]
            barrier.wait()
            return total
        out[r] = fn(*halves[r], all_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_reinforce_pp_default_gamma_is_one():
    rewards, mask = ragged_rewards(20)
    _, returns = critic_free.reinforce_pp(rewards, mask)
    for i, row in enumerate(loop_returns(rewards, mask, 1.0)):
        assert returns[i, :len(row)].tolist() == pytest.approx(row, abs=1e-12)


def test_reinforce_pp_whitens_over_every_ranks_tokens():
    """Two ranks holding halves of a batch: each one's advantages are its returns whitened with the mean and variance
    of ALL the batch's real tokens (python statistics over both halves), not of its own half."""
    rewards, mask = ragged_rewards(21, B=6)
    rewards[3:] += 5.0  # the halves differ in mean: whitening per rank would be visibly wrong
    returns = loop_returns(rewards, mask, 0.9)
    tokens = [g for row in returns for g in row]
    mu, var = statistics.fmean(tokens), statistics.pvariance(tokens)
    out = on_two_ranks(lambda r, m, all_sum: critic_free.reinforce_pp(r, m, 0.9, all_sum),
                       [(rewards[:3], mask[:3]), (rewards[3:], mask[3:])])
    adv = torch.cat([out[0][0], out[1][0]])
    for i, row in enumerate(returns):
        assert adv[i, :len(row)].tolist() == pytest.approx([(g - mu) / math.sqrt(var + 1e-8) for g in row], abs=1e-12)
        assert not adv[i, len(row):].any()


def test_group_estimators_with_one_response_per_prompt_give_zero_advantages():
    """G = 1: each response is its own group, so nothing to compare with: A = 0 (also with Bessel's std, whose 0/0 a
    group of one would otherwise turn into NaN)."""
    scores = torch.tensor([1.0, -2.0, 3.5], dtype=F64)
    for unbiased in (False, True):
        assert critic_free.grpo(scores, 1, unbiased=unbiased).tolist() == [0.0, 0.0, 0.0]
    assert critic_free.dr_grpo(scores, 1).tolist() == [0.0, 0.0, 0.0]


def test_critic_free_rejects_bad_shapes_and_names_with_a_message():
    with pytest.raises(ValueError, match=r"scores must be \(B,\) with B a multiple of the group size G = 2"):
        critic_free.grpo(torch.zeros(4, 1, dtype=F64), 2)  # (B, 1): a column, not a vector of scores
    with pytest.raises(ValueError, match=r"must be \(B, T\) with the same shape; got \(2, 3\), \(2, 4\)"):
        critic_free.discounted_returns(torch.zeros(2, 3), torch.ones(2, 4), 1.0)
    with pytest.raises(ValueError, match=r"same shape; got \(3,\), \(3,\)"):
        critic_free.discounted_returns(torch.zeros(3), torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        critic_free.advantages("ppo", torch.zeros(2, 3), torch.ones(2, 3), 2)
