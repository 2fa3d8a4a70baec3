"""Our equations against the peers' own formulas, on ragged float64 batches: where the conventions match they agree
to 1e-6; where they do not (docs/differences.md), the flag that gives the peer's convention makes them agree, and
the default stays ours.

The peers are not installed here, so each of their functions is re-implemented below from its source, short and
faithful (the lines that compute, in their order; their `.float()` casts become float64 so that a 1e-6 comparison
means something). Sources read:
    OpenRLHF  openrlhf/models/utils.py                        compute_approx_kl, compute_reward, compute_entropy
              openrlhf/models/loss.py                         PolicyLoss, ValueLoss, PairWiseLoss, aggregate_loss,
                                                              GPTLMLoss
              openrlhf/trainer/ppo_utils/experience_maker.py  get_advantages_and_returns, get_cumulative_returns,
                                                              compute_advantages_and_returns (group baselines, the
                                                              global advantage whitening)
              (github.com/OpenRLHF/OpenRLHF at 3c3be62)
    verl      verl/trainer/ppo/core_algos.py                  compute_gae_advantage_return, compute_grpo_outcome_
                                                              advantage, compute_rloo_outcome_advantage, compute_
                                                              reinforce_plus_plus(_baseline)_outcome_advantage,
                                                              compute_rewards, agg_loss, compute_policy_loss_vanilla,
                                                              compute_value_loss, kl_penalty_forward
              verl/utils/torch_functional.py                  masked_mean, masked_var, masked_whiten,
                                                              entropy_from_logits
              (github.com/volcengine/verl at b178a3c)
    TRL       trl/trainer/grpo_trainer.py                     the group advantage (scale_rewards="group", nanstd),
                                                              _compute_loss (loss_type grpo, bnpo, dr_grpo)
              (github.com/huggingface/trl at f2cd577)
"""
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import critic_free
import gae
import ppo_loss
import ppo_max
from reward_model import bradley_terry_loss

F64 = torch.float64
TOL = dict(rtol=0, atol=1e-6)


def batch(seed: int, B: int = 8, T: int = 7, V: int = 11):
    """A ragged float64 batch: log-probs of π, π_old, π_ref, advantages, values, returns, logits; right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=F64) * scale  # noqa: E731
    return dict(mask=mask, logprobs=-r(B, T).abs(), old=-r(B, T).abs(), ref=-r(B, T).abs(), adv=r(B, T),
                values=r(B, T), returns=r(B, T), scores=r(B), logits=r(B, T, V, scale=3.0), ids=torch.randint(
                    0, V, (B, T), generator=g))


# ====================================================================================== OpenRLHF, re-implemented
def orl_compute_approx_kl(log_probs, log_probs_base, kl_estimator="k1"):  # openrlhf/models/utils.py
    log_ratio = log_probs.to(F64) - log_probs_base.to(F64)
    if kl_estimator == "k1":
        pass
    elif kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def orl_compute_reward(r, kl_coef, kl, action_mask):  # openrlhf/models/utils.py (reward_clip_range None)
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def orl_gae(values, rewards, action_mask, gamma, lambd):  # experience_maker.get_advantages_and_returns
    lastgaelam, advantages_reversed, response_length = 0, [], rewards.size(1)
    values, rewards = action_mask * values, action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def orl_cumulative_returns(rewards, action_mask, gamma):  # experience_maker.get_cumulative_returns
    returns, cumulative_return = torch.zeros_like(rewards), torch.zeros(rewards.size(0), dtype=rewards.dtype)
    rewards = action_mask * rewards
    for t in reversed(range(rewards.size(1))):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return
    return returns


def orl_whiten_all(advantages, action_mask):  # experience_maker.compute_advantages_and_returns, the last block
    num_actions = action_mask.sum()
    mean = (advantages * action_mask).sum() / num_actions
    var = ((advantages - mean).pow(2) * action_mask).sum() / num_actions
    return (advantages - mean) * var.clamp(min=1e-8).rsqrt()


def orl_masked_mean(tensor, mask, dim=None):  # openrlhf/models/utils.py
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def orl_aggregate_loss(loss, loss_mask, token_level_loss=True):  # openrlhf/models/loss.py (one rank, no totals)
    if token_level_loss:
        return orl_masked_mean(loss, loss_mask, dim=None)
    token_counts = loss_mask.sum(dim=-1)
    seq_loss = (loss * loss_mask).sum(dim=-1) / (token_counts + 1e-8)
    seq_mask = (token_counts > 0).to(loss.dtype)
    return orl_masked_mean(seq_loss, seq_mask, dim=None)


def orl_policy_loss(log_probs, old_log_probs, advantages, action_mask, clip_eps=0.2, dual_clip=None,
                    token_level_loss=True):  # openrlhf/models/loss.py PolicyLoss.forward (policy_loss_type "ppo")
    ratio = (log_probs - old_log_probs).clamp(min=-20.0, max=20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * advantages)
        loss = -torch.where(advantages < 0, clip2, clip1)
    return orl_aggregate_loss(loss, action_mask, token_level_loss)


def orl_value_loss(values, old_values, returns, action_mask, clip_eps=None):  # openrlhf/models/loss.py ValueLoss
    if clip_eps is not None:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        loss = torch.max((values_clipped - returns) ** 2, (values - returns) ** 2)
    else:
        loss = (values - returns) ** 2
    return 0.5 * orl_aggregate_loss(loss, action_mask)


def orl_pairwise_loss(chosen_reward, reject_reward):  # openrlhf/models/loss.py PairWiseLoss
    return (-F.logsigmoid(chosen_reward - reject_reward)).mean()


def orl_entropy(logits):  # openrlhf/models/utils.py compute_entropy
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def orl_gpt_lm_loss(logits, labels):  # openrlhf/models/loss.py GPTLMLoss (IGNORE_INDEX = -100)
    shift_logits, shift_labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss(ignore_index=-100)(shift_logits.view(-1, shift_logits.size(-1)),
                                                        shift_labels.view(-1))


def orl_group_rewards(rewards, n, estimator):  # experience_maker.compute_advantages_and_returns, reward shaping
    rewards = rewards.reshape(-1, n)
    if estimator == "rloo":
        rewards = rewards - (rewards.sum(-1, keepdim=True) - rewards) / (n - 1)
    elif estimator in ["reinforce_baseline", "dr_grpo"]:
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    return rewards.reshape(-1)


# ========================================================================================== verl, re-implemented
def verl_masked_mean(values, mask, axis=None):  # verl/utils/torch_functional.py
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def verl_masked_whiten(values, mask):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):  # core_algos.compute_gae_advantage_return
    nextvalues, lastgaelam, advantages_reversed = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, response_mask), returns


def verl_group_scores(token_level_rewards, index):
    scores, id2score = token_level_rewards.sum(dim=-1), defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    return scores.clone(), id2score


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores, id2score = verl_group_scores(token_level_rewards, index)  # core_algos.compute_grpo_outcome_advantage
    id2mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    id2std = {k: torch.std(torch.stack(v)) for k, v in id2score.items()}
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_rloo(token_level_rewards, response_mask, index):  # core_algos.compute_rloo_outcome_advantage
    scores, id2score = verl_group_scores(token_level_rewards, index)
    id2mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_reinforce_pp(token_level_rewards, response_mask, gamma):  # compute_reinforce_plus_plus_outcome_advantage
    returns, running_return = torch.zeros_like(token_level_rewards), 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    return verl_masked_whiten(returns, response_mask) * response_mask, returns


def verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):  # ..._baseline_outcome_advantage
    scores, id2score = verl_group_scores(token_level_rewards, index)
    id2mean = {k: torch.mean(torch.stack(v)) for k, v in id2score.items()}
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return verl_masked_whiten(scores, response_mask) * response_mask


def verl_compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio):  # core_algos.compute_rewards
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):  # core_algos.agg_loss (one rank: dp_size 1, no totals)
    if loss_agg_mode == "token-mean":
        return (torch.where(loss_mask.bool(), loss_mat, 0.0) * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).to(loss_mat.dtype)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / loss_mask.shape[-1]


def verl_policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2, clip_ratio_c=3.0,
                     loss_agg_mode="token-mean"):  # core_algos.compute_policy_loss_vanilla
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):  # core_algos.compute_value_loss
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    clipped_vf_losses = torch.max((vpreds - returns) ** 2, (vpredclipped - returns) ** 2)
    return 0.5 * verl_agg_loss(clipped_vf_losses, response_mask, "token-mean")


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):  # core_algos.kl_penalty_forward
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


# =========================================================================================== TRL, re-implemented
def trl_nanstd(tensor, dim):  # trl/trainer/utils.py nanstd
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    return torch.sqrt(variance * count / (count - 1)).squeeze(dim)


def trl_grpo_advantages(rewards, num_generations):  # grpo_trainer.py, scale_rewards="group"
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    return (rewards - mean_grouped) / (std_rewards + 1e-4)


def trl_loss(per_token_loss, mask, loss_type, max_completion_length=None):  # grpo_trainer.py _compute_loss
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


# ================================================================================== where the conventions match
SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_openrlhf_and_verl(seed):
    b = batch(seed)
    rewards = b["adv"] * b["mask"]
    adv, ret = gae.compute_gae(rewards, b["values"], b["mask"], 0.95, 0.9)
    o_adv, o_ret = orl_gae(b["values"], rewards, b["mask"], 0.95, 0.9)
    assert_close(adv, o_adv * b["mask"], **TOL)
    assert_close(ret, o_ret * b["mask"], **TOL)
    v_adv, v_ret = verl_gae(rewards, b["values"] * b["mask"], b["mask"], 0.95, 0.9)
    assert_close(ret, v_ret * b["mask"], **TOL)
    # verl whitens inside its GAE, with Bessel's variance: our advantages whitened that way are its advantages
    m, var = ppo_loss.masked_mean(adv, b["mask"]), ppo_loss.masked_var(adv, b["mask"], unbiased=True)
    assert_close((adv - m) * torch.rsqrt(var + 1e-8) * b["mask"], v_adv * b["mask"], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_clip_matches_openrlhf_token_mean(seed):
    b = batch(seed)
    ours, _ = ppo_loss.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], 0.2)
    assert_close(ours, orl_policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"]), **TOL)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_openrlhf_and_verl(kind, seed):
    b = batch(seed)
    logprobs, ref = b["logprobs"] * 0.5, b["ref"] * 0.5
    ours = ppo_loss.kl_sampled(logprobs, ref, kind)
    assert ours.abs().max() < 10  # inside the peers' clamps: where the conventions match
    assert_close(ours, verl_kl_penalty_forward(logprobs, ref, kind), **TOL)
    assert_close(ours, orl_compute_approx_kl(logprobs, ref, kind), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_shaped_reward_matches_openrlhf_and_verl(seed):
    b = batch(seed)
    ours = ppo_max.shape_rewards(b["scores"], b["logprobs"], b["ref"], b["mask"], kl_coef=0.05)
    kl = b["logprobs"] - b["ref"]
    assert_close(ours, orl_compute_reward(b["scores"], 0.05, kl, b["mask"]) * b["mask"], **TOL)
    last = b["mask"].sum(1).long() - 1
    token_level_scores = torch.zeros_like(kl)
    token_level_scores[torch.arange(len(last)), last] = b["scores"]  # verl's reward manager: the last valid token
    assert_close(ours, verl_compute_rewards(token_level_scores, b["logprobs"], b["ref"], 0.05) * b["mask"], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_bradley_terry_matches_openrlhf(seed):
    b = batch(seed)
    ours, _ = bradley_terry_loss(b["scores"], b["values"][:, 0])
    assert_close(ours, orl_pairwise_loss(b["scores"], b["values"][:, 0]), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_openrlhf_and_verl(seed):
    b = batch(seed)
    assert_close(ppo_loss.entropy(b["logits"]), orl_entropy(b["logits"]), **TOL)
    assert_close(ppo_loss.entropy(b["logits"]), verl_entropy_from_logits(b["logits"]), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_ptx_matches_openrlhf_lm_loss(seed):
    b = batch(seed)
    target = b["mask"].clone()
    target[:, 0] = 0.0  # the first token is never predicted
    labels = torch.where(target != 0, b["ids"], -100)
    ours, _ = ppo_loss.ptx_loss(b["logits"], b["ids"], target)
    assert_close(ours, orl_gpt_lm_loss(b["logits"], labels), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_estimators_match_the_peers(seed):
    b, G = batch(seed), 4
    scores, mask = b["scores"], b["mask"]
    token_level = torch.zeros_like(mask)
    token_level[torch.arange(8), mask.sum(1).long() - 1] = scores  # the score on the last real token, 0 elsewhere
    index = np.repeat(np.arange(2), G)
    ours = lambda name: critic_free.advantages(name, token_level, mask, G)[0]  # noqa: E731
    assert_close(ours("rloo"), verl_rloo(token_level, mask, index), **TOL)
    assert_close(ours("rloo"), orl_group_rewards(scores, G, "rloo")[:, None] * mask, **TOL)
    assert_close(ours("dr-grpo"), verl_grpo(token_level, mask, index, norm_adv_by_std_in_grpo=False), **TOL)
    assert_close(ours("dr-grpo"), orl_group_rewards(scores, G, "dr_grpo")[:, None] * mask, **TOL)
    # GRPO: the peers' Bessel std is our unbiased=True, with each one's ε
    assert_close(critic_free.grpo(scores, G, eps=1e-6, unbiased=True)[:, None] * mask,
                 verl_grpo(token_level, mask, index), **TOL)
    assert_close(critic_free.grpo(scores, G, eps=1e-4, unbiased=True), trl_grpo_advantages(scores, G), **TOL)
    assert_close(critic_free.grpo(scores, G, eps=1e-9, unbiased=True), orl_group_rewards(scores, G, "group_norm"),
                 **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_matches_openrlhf_whitening(seed):
    b = batch(seed)
    rewards = ppo_max.shape_rewards(b["scores"], b["logprobs"], b["ref"], b["mask"], kl_coef=0.05)
    adv, ret = critic_free.reinforce_pp(rewards, b["mask"], gamma=0.99)
    o_ret = orl_cumulative_returns(orl_compute_reward(b["scores"], 0.05, b["logprobs"] - b["ref"], b["mask"]),
                                   b["mask"], 0.99)
    assert_close(ret, o_ret * b["mask"], **TOL)
    assert_close(adv, orl_whiten_all(o_ret, b["mask"]) * b["mask"], **TOL)  # ddof 0 over every token, as ours


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_pair_against_verl_differs_by_bessel_only(seed):
    """verl whitens with Bessel's variance over the n real tokens, we with ddof 0: its advantages are ours ×
    √((n−1)/n), exactly."""
    b, G = batch(seed), 4
    mask = b["mask"]
    token_level = torch.zeros_like(mask)
    token_level[torch.arange(8), mask.sum(1).long() - 1] = b["scores"]
    n = mask.sum()
    ours, ret = critic_free.reinforce_pp(token_level, mask, gamma=1.0)
    v_adv, v_ret = verl_reinforce_pp(token_level, mask, 1.0)
    assert_close(ret, v_ret * mask, **TOL)
    assert_close(ours * torch.sqrt((n - 1) / n), v_adv, **TOL)
    base = critic_free.advantages("reinforce++-baseline", token_level, mask, G)[0]
    assert_close(base * torch.sqrt((n - 1) / n), verl_reinforce_pp_baseline(token_level, mask, np.repeat([0, 1], G)),
                 **TOL)


# ==================================================================== where they do not: one flag each, default ours
@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_has_no_half_factor_and_vf_coef_half_gives_the_peers(seed):
    b = batch(seed)
    ours, _ = ppo_loss.value_loss(b["values"], b["returns"] * 0.5, b["returns"], b["mask"], 0.2)
    assert_close(0.5 * ours, orl_value_loss(b["values"], b["returns"] * 0.5, b["returns"], b["mask"], 0.2), **TOL)
    assert_close(0.5 * ours, verl_value_loss(b["values"], b["returns"], b["returns"] * 0.5, b["mask"], 0.2), **TOL)
    assert ppo_max.PPOConfig().vf_coef == 1.0  # ours: Eq. 16 as written; --vf-coef 0.5 is the peers' ½


@pytest.mark.parametrize("seed", SEEDS)
def test_dual_clip_flag_gives_verls_default_and_openrlhfs_dual_clip(seed):
    b = batch(seed)
    b["logprobs"] = b["old"] + torch.randn(b["old"].shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 2
    kw = ppo_max.loss_conventions(ppo_max.PPOConfig(dual_clip=3.0, log_ratio_clamp=20.0))
    ours, stats = ppo_loss.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], 0.2, **kw)
    assert_close(ours, verl_policy_loss(b["old"], b["logprobs"], b["adv"], b["mask"], 0.2, 3.0), **TOL)
    assert_close(ours, orl_policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], 0.2, dual_clip=3.0), **TOL)
    assert stats["dual_clipfrac"] > 0  # the bound binds somewhere in this batch (ρ up to e^4)
    default, _ = ppo_loss.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], 0.2,
                                      **ppo_max.loss_conventions(ppo_max.PPOConfig()))
    assert not torch.allclose(default, ours)  # ours is off by default: verl's c = 3 changes the loss here
    assert ppo_max.PPOConfig().dual_clip == 0.0


def test_log_ratio_clamp_flag_caps_the_ratio_as_the_peers():
    old = torch.zeros(1, 3, dtype=F64)
    logprobs = torch.tensor([[25.0, -30.0, 0.5]], dtype=F64, requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64), torch.ones(1, 3, dtype=F64)
    kw = ppo_max.loss_conventions(ppo_max.PPOConfig(log_ratio_clamp=20.0, clip_eps=0.0))
    loss, stats = ppo_loss.policy_loss(logprobs, old, adv, mask, None, **kw)  # unclipped: the clamp alone acts
    assert stats["ratio"] == pytest.approx((np.exp(20.0) + np.exp(-20.0) + np.exp(0.5)) / 3)
    assert_close(loss, orl_policy_loss(logprobs, old, adv, mask, clip_eps=1e30), **TOL)
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] == 0 and logprobs.grad[0, 2] != 0  # 0 beyond ±20
    _, s = ppo_loss.policy_loss(logprobs, old, adv, mask, None, **ppo_max.loss_conventions(ppo_max.PPOConfig()))
    assert s["ratio"] > np.exp(23)  # default: no clamp (mean of e^25, e^-30, e^0.5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_clamp_flag_gives_openrlhfs_clamp_of_every_estimator(kind):
    logprobs = torch.tensor([[-0.1, -14.0, -1.0, -0.2]], dtype=F64)
    ref = torch.tensor([[-13.0, -0.5, -1.2, -25.0]], dtype=F64)  # log ratios 12.9, −13.5, 0.2, 24.8
    clamped = ppo_max.sampled_kl(logprobs, ref, ppo_max.PPOConfig(kl_estimator=kind, kl_clamp=10.0))
    assert_close(clamped, orl_compute_approx_kl(logprobs, ref, kind), **TOL)
    if kind == "k3":
        assert_close(clamped, verl_kl_penalty_forward(logprobs, ref, "k3"), **TOL)  # verl clamps k3 only
    default = ppo_max.sampled_kl(logprobs, ref, ppo_max.PPOConfig(kl_estimator=kind))
    assert_close(default, ppo_loss.kl_sampled(logprobs, ref, kind), rtol=0, atol=0)  # ours: no clamp
    assert default.abs().max() > 10


@pytest.mark.parametrize("mode,peer", [("token-mean", ("bnpo", True)), ("seq-mean-token-mean", ("grpo", False)),
                                       ("seq-mean-token-sum-norm", ("dr_grpo", None))])
@pytest.mark.parametrize("seed", SEEDS)
def test_loss_agg_flag_gives_each_peers_aggregation(mode, peer, seed):
    b = batch(seed)
    mat, mask, T_max = b["adv"], b["mask"], 24
    ours = ppo_loss.aggregate(mat, mask, mode, max_len=T_max)
    assert_close(ours, trl_loss(mat, mask, peer[0], T_max), **TOL)
    if peer[1] is not None:
        assert_close(ours, orl_aggregate_loss(mat, mask, token_level_loss=peer[1]), **TOL)
    verl = verl_agg_loss(mat, mask, mode)
    # verl divides seq-mean-token-sum-norm by the tensor's width only: B times ours (the width is T_max there)
    want = verl / mat.shape[0] * mat.shape[1] / T_max if mode == "seq-mean-token-sum-norm" else verl
    assert_close(ours, want, **TOL)
    kw = ppo_max.loss_conventions(ppo_max.PPOConfig(loss_agg=mode, max_new_tokens=T_max))
    loss, _ = ppo_loss.policy_loss(b["logprobs"], b["old"], b["adv"], mask, 0.2, **kw)
    ratio = torch.exp(b["logprobs"] - b["old"])
    objective = torch.minimum(ratio * b["adv"], ratio.clamp(0.8, 1.2) * b["adv"])
    assert_close(loss, trl_loss(-objective, mask, peer[0], T_max), **TOL)  # the flag reaches the PPO loss
    assert ppo_max.PPOConfig().loss_agg == "token-mean"


def test_whitening_uses_ddof_zero_where_verl_uses_bessel():
    b = batch(0)
    ours = ppo_loss.masked_whiten(b["adv"], b["mask"])
    n = b["mask"].sum()
    assert_close(ours * b["mask"] * torch.sqrt((n - 1) / n), verl_masked_whiten(b["adv"], b["mask"]) * b["mask"],
                 rtol=0, atol=1e-6)
