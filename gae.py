"""Advantages and returns for the response tokens of a batch: k-step estimates and GAE(γ, λ).

Implements (equation numbers of Zheng et al. 2023, arXiv 2307.04964):
    k_step_return(rewards, values, mask, gamma, k)       → Eq. 7   R̂ᵏ_t = Σ_{l<k} γ^l r_{t+l} + γ^k V(s_{t+k})
    k_step_advantage(rewards, values, mask, gamma, k)    → Eq. 8   Âᵏ_t = Σ_{l<k} γ^l δ_{t+l} = R̂ᵏ_t − V(s_t)
    compute_gae(rewards, values, mask, gamma, lam)       → Eq. 9   Â_t = Σ_l (γλ)^l δ_{t+l};  R̂_t = Â_t + V(s_t)
                                                           Eq. 10  λ = 0 → Â_t = δ_t (TD)
                                                           Eq. 11  λ = 1 → Â_t = Σ_l γ^l r_{t+l} − V(s_t) (Monte Carlo)
    compute_gae_decoupled(..., lam_policy, lam_critic)   → Eq. 9 twice: Â_t with λ_policy, R̂_t with λ_critic (VC-PPO)
    adaptive_lam(lengths, alpha)                         → λ_policy = 1 − 1/(α·l), one per response (VAPO)

Run: python gae.py        (prints the worked example at the bottom of this file)

Conventions (all tensors (B, T), T = response tokens; prompts are never part of these tensors):
    * `mask` is 1.0 on real response tokens, contiguous from position 0 and right-padded with 0.0.
    * The episode ends after the last real token: the value after it is 0 (terminal), and beyond the end of
      the response rewards and values count as 0. Whatever sits in `rewards` / `values` at padded positions
      is ignored, even inf or NaN (padding is selected away with torch.where, never multiplied by 0).
    * Every output is 0 where `mask` is 0.
    * These are regression / policy-gradient *targets*: call them on detached tensors (the rollout computes
      values under torch.no_grad()); nothing here is meant to be differentiated through.

References:
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation" (GAE).
    Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", section 3.2.2.
    Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret" (VC-PPO,
      arXiv 2503.01491): decoupled λ. Yue et al. 2025, "VAPO" (arXiv 2504.05118): length-adaptive λ_policy.
"""
import torch
from torch import Tensor


def _check_inputs(rewards: Tensor, values: Tensor, mask: Tensor) -> None:
    """Raise a ValueError a person can act on when shapes or the mask break the conventions above."""
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"gae.py: rewards, values and mask must all be (B, T) with the same shape; got "
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        )
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("gae.py: mask must hold only 0.0 and 1.0")
    if (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError(
            "gae.py: mask must be contiguous from position 0 and right-padded (1 … 1 0 … 0) in every row; "
            "left-padded or gapped masks would put the terminal state in the wrong place"
        )


def k_step_return(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, k: int) -> Tensor:
    """k-step return R̂ᵏ_t of Eq. 7, (B, T), 0 where mask is 0.

    R̂ᵏ_t = r_t + γ r_{t+1} + … + γ^{k−1} r_{t+k−1} + γ^k V(s_{t+k}), with r and V taken as 0 beyond the last
    real token, so a window that runs past the end of the response becomes the full (Monte Carlo) return.

    rewards: r_t, (B, T). values: V(s_t), (B, T). mask: (B, T). gamma: discount γ. k: number of steps, k ≥ 1.
    """
    _check_inputs(rewards, values, mask)
    if k < 1:
        raise ValueError(f"gae.py: k_step_return needs k >= 1, got k={k}")
    B, T = rewards.shape
    pad = rewards.new_zeros(B, k)
    r = torch.cat([torch.where(mask != 0, rewards, 0.0), pad], dim=1)  # (B, T + k), r = 0 beyond the end
    v = torch.cat([torch.where(mask != 0, values, 0.0), pad], dim=1)  # (B, T + k), V = 0 beyond the end (terminal)
    ret = rewards.new_zeros(B, T)  # (B, T)
    for l in range(k):
        ret = ret + gamma**l * r[:, l : l + T]  # Σ_{l<k} γ^l r_{t+l}   (Eq. 7)
    ret = ret + gamma**k * v[:, k : k + T]  # + γ^k V(s_{t+k})   (Eq. 7)
    return ret * mask


def k_step_advantage(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, k: int) -> Tensor:
    """k-step advantage Âᵏ_t of Eq. 8, (B, T), 0 where mask is 0.

    Âᵏ_t = Σ_{l=0}^{k−1} γ^l δ_{t+l} = R̂ᵏ_t − V(s_t) (the sum of TD errors telescopes). k = 1 gives δ_t; k ≥ the
    remaining length gives the Monte Carlo advantage Σ_l γ^l r_{t+l} − V(s_t). Same conventions as k_step_return.
    """
    advantages = k_step_return(rewards, values, mask, gamma, k) - values  # Âᵏ_t = R̂ᵏ_t − V(s_t)   (Eq. 8)
    return torch.where(mask != 0, advantages, 0.0)  # (B, T), 0 at padding whatever `values` holds there


def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """GAE(γ, λ) advantages and the returns the critic regresses on (Eq. 9), both (B, T), 0 where mask is 0.

    Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ V(s_{t+1}) − V(s_t),  V(s_{t+1}) = 0 after the last real token.
    Equivalently Â_t = (1−λ)(Â¹_t + λ Â²_t + λ² Â³_t + …), the exponential average of the k-step advantages.
    λ = 0 gives δ_t (Eq. 10, TD); λ = 1 gives Σ_l γ^l r_{t+l} − V(s_t) (Eq. 11, Monte Carlo).

    rewards: r_t, shaped per-token rewards (B, T), e.g. from ppo_max.shape_rewards (Eq. 19).
    values: V(s_t) from the critic at the rollout, (B, T). mask: (B, T), 1.0 on real response tokens.
    gamma: discount γ. lam: GAE parameter λ ∈ [0, 1] (the paper uses 0.9), or a (B,) tensor of one λ per response
    (row i then recurs with its own λ_i: VAPO's length-adaptive λ, adaptive_lam).
    Returns (advantages Â_t, returns R̂_t = Â_t + V(s_t)); whitening, if any, is the caller's job and must not
    touch the returns.
    """
    _check_inputs(rewards, values, mask)
    B, T = rewards.shape
    if isinstance(lam, Tensor):  # one λ_i per row: (B,), broadcast against Â_{t+1} (B,) below
        if lam.shape != (B,) or not ((lam >= 0) & (lam <= 1)).all():
            raise ValueError(f"gae.py: a tensor lam must be (B,) = ({B},) with every λ in [0, 1]; got shape "
                             f"{tuple(lam.shape)}, values {lam.tolist()}")
        lam = lam.to(rewards)
    rewards = torch.where(mask != 0, rewards, 0.0)  # (B, T), padding contributes nothing (not even a NaN)
    values = torch.where(mask != 0, values, 0.0)  # (B, T), so V(s_{t+1}) = 0 after the last real token: terminal
    advantages = torch.zeros_like(rewards)  # (B, T)
    last_gae = rewards.new_zeros(B)  # (B,) Â_{t+1}, 0 beyond the end of the tensor
    # The next lines implement GAE-λ as one backward pass: Â_t = δ_t + γλ Â_{t+1}.
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else rewards.new_zeros(B)  # (B,) V(s_{t+1})
        delta = rewards[:, t] + gamma * next_values - values[:, t]  # δ_t = r_t + γV(s_{t+1}) − V(s_t)   (Eq. 8)
        last_gae = delta + gamma * lam * last_gae  # Â_t = δ_t + γλ Â_{t+1} = Σ_l (γλ)^l δ_{t+l}   (Eq. 9)
        advantages[:, t] = last_gae
    # At padded positions r = V = 0 and Â_{t+1} = 0, so δ = 0 and Â stays 0 there; the product below only
    # makes that explicit.
    advantages = advantages * mask  # (B, T)
    returns = (advantages + values) * mask  # R̂_t = Â_t + V(s_t), the critic's target   (Eq. 16)
    return advantages, returns


def compute_gae_decoupled(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam_policy: float | Tensor, lam_critic: float
) -> tuple[Tensor, Tensor]:
    """Decoupled λ (VC-PPO; VAPO): the advantages of GAE(γ, λ_policy) and the returns of GAE(γ, λ_critic), (B, T) each.

    The critic's targets R̂_t = Â^{λ_critic}_t + V(s_t) use their own λ: λ_critic = 1 makes them the Monte Carlo
    returns Σ_l γ^l r_{t+l} (Eq. 11), which do not lean on V(s_{t+1}) and so carry no bias from an untrained critic
    (VC-PPO's reason); the policy keeps a smaller λ_policy for lower-variance advantages. λ_policy may be a (B,)
    tensor (adaptive_lam). λ_policy = λ_critic gives compute_gae's pair exactly.
    """
    advantages = compute_gae(rewards, values, mask, gamma, lam_policy)[0]  # Â_t = Σ_l (γλ_policy)^l δ_{t+l}   (Eq. 9)
    returns = compute_gae(rewards, values, mask, gamma, lam_critic)[1]  # R̂_t = Â^{λ_critic}_t + V(s_t)   (Eq. 9, 11)
    return advantages, returns


def adaptive_lam(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive λ_policy = 1 − 1/(α·l) for a response of l tokens, (B,) from lengths (B,) (e.g.
    mask.sum(1)), so that Σ_t λ^t ≈ 1/(1 − λ) = α·l grows with the response. VAPO: α = 0.05, for responses of
    thousands of tokens. Below l = 1/α the formula is ≤ 0: such rows (and empty ones) get λ = 0 (TD advantages), as
    AReaL's vapo_length_adaptive_gae does; with α = 0.05 that is every response shorter than 20 tokens.
    """
    if not alpha > 0:
        raise ValueError(f"gae.adaptive_lam: alpha must be > 0, got {alpha}")
    lam = 1.0 - 1.0 / (alpha * lengths.to(torch.get_default_dtype()).clamp_min(1.0))  # λ_policy = 1 − 1/(α·l)   (VAPO)
    return lam.clamp_min(0.0)  # (B,) in [0, 1)


if __name__ == "__main__":
    # One 3-token response (T = 4: the last position is padding, its value 9.0 is ignored).
    # The only reward is the score 1.0 on the last real token; γ = 0.9, λ = 0.5.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    gamma, lam = 0.9, 0.5
    # By hand: δ_2 = 1 + 0.9·0 − 0.7 = 0.3,  δ_1 = 0 + 0.9·0.7 − 0.6 = 0.03,  δ_0 = 0 + 0.9·0.6 − 0.5 = 0.04
    #          Â_2 = 0.3,  Â_1 = 0.03 + 0.45·0.3 = 0.165,  Â_0 = 0.04 + 0.45·0.165 = 0.11425
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)

    def show(name: str, x: Tensor) -> None:
        print(f"{name:13s}", [round(v, 6) + 0.0 for v in x[0].tolist()])  # + 0.0 turns −0.0 into 0.0

    show("advantages", adv)
    show("returns", ret)
    show("λ=0 (TD δ_t)", compute_gae(rewards, values, mask, gamma, 0.0)[0])
    show("λ=1 (MC)", compute_gae(rewards, values, mask, gamma, 1.0)[0])
    for k in (1, 2, 3):
        show(f"Â^{k}_t", k_step_advantage(rewards, values, mask, gamma, k))
    # Decoupled λ (VC-PPO): the critic's targets with λ_critic = 1 are the discounted returns 0.81, 0.9, 1.0
    show("R̂, λ_critic=1", compute_gae_decoupled(rewards, values, mask, gamma, lam, 1.0)[1])
    # Printed (tests/test_gae.py checks these numbers):
    # advantages    [0.11425, 0.165, 0.3, 0.0]
    # returns       [0.61425, 0.765, 1.0, 0.0]
    # λ=0 (TD δ_t)  [0.04, 0.03, 0.3, 0.0]
    # λ=1 (MC)      [0.31, 0.3, 0.3, 0.0]
    # Â^1_t         [0.04, 0.03, 0.3, 0.0]
    # Â^2_t         [0.067, 0.3, 0.3, 0.0]
    # Â^3_t         [0.31, 0.3, 0.3, 0.0]
    # R̂, λ_critic=1 [0.81, 0.9, 1.0, 0.0]
