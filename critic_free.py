"""Advantages without a critic: a baseline from the other responses to the same prompt, or the batch's whitened returns.

Implements (one function per method; the paper each comes from is named at its line):
    grouped(scores, G)                       → (B,) → (B/G, G): rows i·G … i·G + G − 1 answer the same prompt
    grpo(scores, G)                          → GRPO     A_i = (r_i − mean_G r) / (std_G r + ε)       Shao et al. 2024
    dr_grpo(scores, G)                       → Dr. GRPO A_i = r_i − mean_G r                           Liu et al. 2025
                                               (its other half, the loss summed over tokens ÷ (batch × max length),
                                               is ppo_loss.aggregate "seq-mean-token-sum-norm")
    rloo(scores, G)                          → RLOO     A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j               Ahmadian et al. 2024
    discounted_returns(rewards, mask, γ)     → G_t = Σ_{s≥t} γ^{s−t} r_s (reward-to-go): Eq. 11 with V = 0
    reinforce_pp(rewards, mask, γ)           → REINFORCE++ A_t = whiten_batch(G_t), r_t from Eq. 19        Hu 2025
    reinforce_pp_baseline(scores, mask, G)   → REINFORCE++-baseline A = whiten_batch(r_i − mean_G r)       Hu 2025
    advantages(name, rewards, mask, G, γ)    → what ppo_max.make_experience calls: (advantages, returns), (B, T)
    dynamic_sampling(scores, G, tol)         → DAPO     keep the groups with max_G r − min_G r > tol

Run: python critic_free.py        (prints the worked example at the end of this file)

Shapes: B responses = (B/G prompts) × G, T response tokens. `rewards` (B, T) are Eq. 19's per-token rewards
(ppo_max.shape_rewards): the score on the last real token and −η·KL_t on every token, or the score alone when the KL
sits in the loss (--kl-in loss) or η = 0. The group methods use one number per response, its undiscounted return
r_i = Σ_t r_t (= score − η·Σ_t KL_t); their advantage is the same for every token of the response.

GRPO divides by the population std (ddof = 0), as the whitening (ppo_loss.masked_whiten) and Eq. 18's running
moments do: the advantages of every group that is not constant then have mean 0 and mean square exactly 1, whatever
G; `unbiased=True` gives Bessel's std instead. ε = 1e-6 is added to the std, so a group of equal scores gets A = 0,
not 0/0. How other implementations choose (Bessel's std, other ε, where the KL enters): docs/differences.md.

Groups and ranks: under data parallelism every group sits on one rank (data.RolloutBatches), so the group methods
need no communication; the REINFORCE++ pair whitens over every rank's tokens through `all_sum` (engine.all_sum).

References:
    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models" (GRPO, section 4.1).
    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO, section 3.1, Listing 1).
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
      in LLMs" (RLOO, Eq. 7); Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!".
    Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward Models" (section 3).
    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476 (section 3.2).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gae import compute_gae
from ppo_loss import masked_whiten

ESTIMATORS = ("gae", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline")  # --advantage
CRITIC_FREE = ESTIMATORS[1:]                                   # no critic is built, pre-trained or checkpointed
GROUPED = ("grpo", "dr-grpo", "rloo", "reinforce++-baseline")  # need G ≥ 2 responses per prompt
EPS = 1e-6


def grouped(scores: Tensor, G: int) -> Tensor:
    """(B,) → (B/G, G): row i holds the G responses to prompt i, which sit at rows i·G … i·G + G − 1 of the batch."""
    if scores.dim() != 1 or G < 1 or scores.shape[0] % G:
        raise ValueError(f"critic_free.py: scores must be (B,) with B a multiple of the group size G = {G}; got "
                         f"{tuple(scores.shape)}")
    return scores.view(-1, G)                                          # (B/G, G)


def grpo(scores: Tensor, G: int, eps: float = EPS, unbiased: bool = False) -> Tensor:
    """GRPO's outcome advantage A_i = (r_i − mean_G r) / (std_G r + ε), one per response, (B,). std_G is the
    population std (unbiased=False, see the file's docstring) or Bessel's (unbiased=True, the peers')."""
    r = grouped(scores, G)                                             # (B/G, G)
    mean = r.mean(dim=1, keepdim=True)                                 # (B/G, 1) mean_G r
    std = r.std(dim=1, keepdim=True, unbiased=unbiased) if G > 1 else torch.zeros_like(mean)  # (B/G, 1) std_G r
    return ((r - mean) / (std + eps)).flatten()                        # A_i = (r_i − mean_G r) / (std_G r + ε)


def dr_grpo(scores: Tensor, G: int) -> Tensor:
    """Dr. GRPO's advantage A_i = r_i − mean_G r (no division by the std: no difficulty bias), (B,). Only half of
    Dr. GRPO: the other half is the loss summed over tokens and divided by a constant (ppo_loss.aggregate)."""
    r = grouped(scores, G)                                             # (B/G, G)
    return (r - r.mean(dim=1, keepdim=True)).flatten()                 # A_i = r_i − mean_G r


def rloo(scores: Tensor, G: int) -> Tensor:
    """RLOO's advantage A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j: the baseline of each response is the mean of the OTHER
    G − 1 responses, so it does not depend on r_i and the gradient stays unbiased. Equals G/(G−1)·(r_i − mean_G r)."""
    if G < 2:
        raise ValueError(f"critic_free.rloo: needs G ≥ 2 responses per prompt (leave one out of one), got G = {G}")
    r = grouped(scores, G)                                             # (B/G, G)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (G - 1)              # (1/(G−1)) Σ_{j≠i} r_j
    return (r - baseline).flatten()                                    # A_i = r_i − baseline_i


def dynamic_sampling(scores: Tensor, G: int, tol: float = 0.0) -> Tensor:
    """DAPO's dynamic sampling: which groups to keep, (B/G,) bool, True where the G scores of a prompt spread,
    max_G r − min_G r > tol. A group of equal scores gets advantage 0 on every response under GRPO, Dr. GRPO and RLOO:
    no gradient, only a smaller effective batch; the caller drops it and samples more prompts. The range, not the
    std, so that equal scores give exactly 0 (a float mean of equal values need not equal them); tol > 0 for a
    continuous reward (DAPO's accuracy reward is 0/1, where tol = 0 is its rule)."""
    if G < 2:
        raise ValueError(f"critic_free.dynamic_sampling: needs groups of G ≥ 2 responses, got G = {G}")
    r = grouped(scores, G)                                             # (B/G, G)
    return (r.max(dim=1).values - r.min(dim=1).values) > tol           # spread_G r > tol


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over the real tokens of each response, (B, T), 0 where mask is 0: GAE(γ, 1) with
    V = 0 (Eq. 11), whose returns are exactly the reward-to-go."""
    return compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]   # Σ_l γ^l r_{t+l} − 0   (Eq. 11)


def reinforce_pp(rewards: Tensor, mask: Tensor, gamma: float = 1.0,
                 all_sum: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """REINFORCE++: the per-token rewards of Eq. 19 (KL-shaped: −η·KL_t on every token, the score on the last),
    their discounted returns G_t, whitened over all tokens of the (global) batch. Returns (advantages, returns),
    both (B, T)."""
    returns = discounted_returns(rewards, mask, gamma)                 # G_t = Σ_{s≥t} γ^{s−t} r_s
    return masked_whiten(returns, mask, all_sum=all_sum), returns     # A_t = (G_t − μ) / σ   (batch of tokens)


def reinforce_pp_baseline(scores: Tensor, mask: Tensor, G: int,
                          all_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """REINFORCE++-baseline: the group mean as baseline, then whitening over every token of the batch (the same
    value on each token of a response, so longer responses weigh more in μ and σ, as in verl), (B, T)."""
    centred = dr_grpo(scores, G)                                       # r_i − mean_G r
    return masked_whiten(centred[:, None] * mask, mask, all_sum=all_sum)  # whiten_batch(r_i − mean_G r)


def advantages(name: str, rewards: Tensor, mask: Tensor, group_size: int, gamma: float = 1.0,
               all_sum: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The critic-free estimator `name` (one of CRITIC_FREE) on Eq. 19's per-token rewards (B, T): (advantages,
    returns), both (B, T), 0 at padding. returns = the reward-to-go G_t (logged; nothing regresses on it). The group
    methods score response i by r_i = Σ_t r_t and give every one of its tokens A_i."""
    returns = discounted_returns(rewards, mask, gamma)                 # (B, T)
    if name == "reinforce++":
        return masked_whiten(returns, mask, all_sum=all_sum), returns
    scores = torch.where(mask != 0, rewards, 0.0).sum(dim=1)          # (B,) r_i = Σ_t r_t
    if name == "reinforce++-baseline":
        return reinforce_pp_baseline(scores, mask, group_size, all_sum), returns
    per_response = {"grpo": grpo, "dr-grpo": dr_grpo, "rloo": rloo}
    if name not in per_response:
        raise ValueError(f"critic_free.advantages: unknown estimator {name!r}; expected one of {CRITIC_FREE}")
    return per_response[name](scores, group_size)[:, None] * mask, returns  # (B, T): A_i on every token of i


if __name__ == "__main__":
    # Two prompts, G = 4 responses each: the second group's scores are all equal (no signal: every A is 0).
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    G = 4

    def show(name: str, x: Tensor) -> None:
        print(f"{name:22s}", [round(v, 6) + 0.0 for v in x.tolist()])  # + 0.0 turns −0.0 into 0.0

    # By hand, group 1: mean 3, population std √((4 + 1 + 0 + 9)/4) = √3.5 = 1.870829, Bessel's √(14/3) = 2.160247
    show("GRPO", grpo(scores, G))
    show("GRPO (Bessel's std)", grpo(scores, G, unbiased=True))
    show("Dr. GRPO", dr_grpo(scores, G))
    # RLOO, response 1: 1 − (2 + 3 + 6)/3 = −2.666667 = 4/3 · (1 − 3)
    show("RLOO", rloo(scores, G))
    print(f"{'dynamic sampling keeps':22s}", dynamic_sampling(scores, G).tolist())  # the equal group is dropped
    # REINFORCE++ on a 3-token and a 2-token response (T = 3), γ = 1: KL-shaped rewards, score on the last token.
    rewards = torch.tensor([[-0.1, 0.0, 1.0], [0.2, -1.0, 9.0]], dtype=torch.float64)  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = reinforce_pp(rewards, mask, gamma=1.0)
    show("returns G_t", ret.flatten())
    # By hand: μ = (0.9 + 1 + 1 − 0.8 − 1)/5 = 0.22, σ² = 4.208/5 = 0.8416, A_0 = 0.68/0.917388 = 0.741235
    show("REINFORCE++ A_t", adv.flatten())
    show("REINFORCE++-baseline", reinforce_pp_baseline(torch.tensor([1.0, 0.0], dtype=torch.float64), mask, 2)
         .flatten())
    # Printed (tests/test_critic_free.py checks these numbers):
    # GRPO                   [-1.069044, -0.534522, 0.0, 1.603567, 0.0, 0.0, 0.0, 0.0]
    # GRPO (Bessel's std)    [-0.92582, -0.46291, 0.0, 1.38873, 0.0, 0.0, 0.0, 0.0]
    # Dr. GRPO               [-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    # RLOO                   [-2.666667, -1.333333, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    # dynamic sampling keeps [True, False]
    # returns G_t            [0.9, 1.0, 1.0, -0.8, -1.0, 0.0]
    # REINFORCE++ A_t        [0.741235, 0.85024, 0.85024, -1.111853, -1.329863, 0.0]
    # REINFORCE++-baseline   [0.816497, 0.816497, 0.816497, -1.224745, -1.224745, 0.0]
