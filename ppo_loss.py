"""The terms of the RLHF PPO objective, one pure function each: clipped policy loss, value loss, KL, entropy, ptx.

Implements (Zheng et al., "Secrets of RLHF in Large Language Models Part I: PPO", arXiv 2307.04964):
    policy_loss                 PPO-clip surrogate, ρ_t = π_θ/π_θold                        (Eq. 15)
                                (+ clip-higher, GSPO's sequence ratio, dual-clip, log-ratio clamp, rollout weights)
    sequence_log_ratio          GSPO-token's ratio: s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|), gradient per token
    cispo_loss                  CISPO: −sg(clip(ρ_t, 1−ε_low, 1+ε_high)) Â_t log π_θ(y_t)
    rollout_mismatch            how far the sampler's log π_rollout is from the trainer's log π_old
    rollout_correction          TIS weights min(π_old/π_rollout, C), or MIS masks (token or sequence)
    aggregate                   token-mean (Eq. 15 here), or per-sequence means, or Dr. GRPO's constant divisor
    value_loss                  critic loss (V − R̂)², optional value clipping              (Eq. 16)
    ptx_loss                    pretraining LM term of PPO-ptx, as a token NLL              (Eq. 17)
    kl_full, kl_sampled         per-token KL(π_RL ‖ π_SFT) for the KL penalty               (Eq. 3, 19)
    entropy, entropy_bonus_loss entropy bonus with an optional clip region                  (App. B.3, Fig. 16)
    masked_mean, masked_var, masked_whiten   token-level statistics; advantage normalization (Fig. 6)
    logprobs_from_logits        log π(a_t | s_t) of the sampled tokens, the ρ_t of          (Eq. 15)

Run: python ppo_loss.py        (prints the worked example at the end of this file)

Shapes: B batch, T response tokens, L = P + T full sequence (P prompt tokens), V vocabulary.
Masks are explicit float tensors of the same shape as the tensor they mask: 1.0 on real tokens, 0.0 on
padding. Every loss is a token-level mean: the sum over all real tokens of the batch divided by their
count, so a long response weighs more than a short one (as in the authors' code, DeepSpeed-Chat and
lm-human-preference-details; a per-sequence mean first would weigh every response equally).
Losses are to be MINIMIZED: each is the negative of the paper's maximized objective where the signs differ.

References:
    Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (2017).
    Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html (2020): k1, k2, k3.
    Ouyang et al., "Training language models to follow instructions with human feedback" (2022): PPO-ptx.
    Huang et al., "The N Implementation Details of RLHF with PPO" (lm-human-preference-details, 2023).
    Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476 (2025): clip-higher.
    Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (2025): GSPO, GSPO-token.
    MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585: CISPO.
    Yao, Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (2025): TIS;
      arXiv 2512.23075 (token and sequence MIS); Ling team, IcePop, arXiv 2510.18855 (masking outside [α, β]).
How the peers (OpenRLHF, verl, TRL, NeMo-RL) name and place each of these: docs/differences.md.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _check_shapes(fn: str, ref_name: str, ref: Tensor, **others: Tensor) -> None:
    """Raise a ValueError naming the argument whose shape differs (a silent broadcast would corrupt the mean)."""
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"ppo_loss.{fn}: `{name}` has shape {tuple(t.shape)}, expected {tuple(ref.shape)} "
                f"(the shape of `{ref_name}`)"
            )


# ----------------------------------------------------------------------------------------------------
# Masked statistics
# ----------------------------------------------------------------------------------------------------

def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ mask·x / Σ mask over all entries (dim=None, a scalar) or along `dim`.

    Entries where mask == 0 never reach the sum, even if they hold inf or NaN (e.g. padding logprobs).
    An all-zero mask (or an all-zero row along `dim`) gives 0, not NaN: an empty minibatch adds nothing.
    """
    _check_shapes("masked_mean", "x", x, mask=mask)
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x, torch.zeros_like(x))
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-12)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1e-12)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of the entries where mask == 1 (a scalar).

    unbiased=False (ddof = 0, divide by n) is the default: it is what the paper's released code
    (MOSS-RLHF `whiten`) uses, and it makes the whitened entries have variance exactly 1. unbiased=True is
    Bessel's n/(n−1) (some peers': docs/differences.md); over the thousands of tokens of a minibatch the two
    differ by a factor 1 + 1/(n−1), which does not matter; it matters for tiny tests.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)  # σ² = Σ m (x − μ)² / Σ m
    if unbiased:
        n = float(mask.sum())
        if n <= 1:
            raise ValueError(f"ppo_loss.masked_var: unbiased=True needs at least 2 real entries, the mask has {n:g}")
        var = var * n / (n - 1)  # Bessel's correction
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  all_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """(x − μ) / sqrt(σ² + eps) with μ, σ² over the real entries only (ddof = 0, see masked_var).

    shift_mean=False adds μ back (scale only), as lm-human-preference-details does for rewards.
    eps = 1e-8 (the authors' code uses 1e-6: docs/differences.md); it only matters when σ² is tiny.
    all_sum: a function that sums a tensor over the data-parallel ranks (engine.all_sum), so that μ and σ² are
    those of every rank's real entries (REINFORCE++ whitens the whole batch); None: this process's entries.
    Masked entries are returned unchanged (output == input where mask == 0), so the zeros that
    compute_gae writes after the last real token stay zero; they never enter μ or σ².
    """
    all_sum = all_sum or (lambda t: t)
    m = mask.to(x.dtype)
    x0 = torch.where(mask != 0, x, torch.zeros_like(x))
    n = all_sum(m.sum()).clamp_min(1e-12)                            # Σ mask (of every rank)
    mean = all_sum((x0 * m).sum()) / n                               # μ = Σ m·x / Σ m
    var = all_sum(((x0 - mean) ** 2 * m).sum()) / n                  # σ² = Σ m (x − μ)² / Σ m
    whitened = (x - mean) * torch.rsqrt(var + eps)  # Â ← (Â − mean(Â)) / std(Â), per minibatch
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, x)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log π(tokens | context): log_softmax over V, then pick the sampled token. (B, T, V), (B, T) -> (B, T)."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"ppo_loss.logprobs_from_logits: `logits` has shape {tuple(logits.shape)}, expected "
            f"{tuple(tokens.shape)} + (V,) to match `tokens`"
        )
    logp = F.log_softmax(logits, dim=-1)  # (B, T, V)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)


# ----------------------------------------------------------------------------------------------------
# Policy and value losses
# ----------------------------------------------------------------------------------------------------

def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float | None, *,
    clip_eps_high: float | None = None, ratio_level: str = "token", weights: Tensor | None = None,
    dual_clip: float | None = None, log_ratio_clamp: float | None = None, agg: str = "token-mean",
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip loss −mean_t min(ρ_t Â_t, clip(ρ_t, 1−ε, 1+ε) Â_t), ρ_t = π_θ(a_t|s_t) / π_θold(a_t|s_t) (Eq. 15).

    logprobs      log π_θ(a_t|s_t) of the sampled tokens under the policy being trained   (B, T)
    old_logprobs  the same under the policy that sampled them (treated as a constant)     (B, T)
    advantages    Â_t, e.g. from gae.compute_gae, whitened or not (treated as a constant) (B, T)
    mask          1.0 on real response tokens                                              (B, T)
    clip_eps      ε (paper: 0.2); None gives the unclipped surrogate ρ_t Â_t, whose gradient at ρ = 1 is Eq. 12

    stats: clipfrac = fraction of real tokens where the clipped term is the minimum, i.e. where the clip
    binds and the token's gradient is zero (A>0 and ρ>1+ε, or A<0 and ρ<1−ε); approx_kl = k3 estimate of
    KL(π_old ‖ π_θ) on the sampled tokens, mean of (ρ − 1) − log ρ; ratio = mean ρ.

    Keyword-only, each off by default (Eq. 15 as above; the peers' names for them: docs/differences.md):
      clip_eps_high    ε_high: clip(ρ, 1−ε, 1+ε_high), DAPO's clip-higher (ε 0.2, ε_high 0.28); None = ε. stats
                       gain clip_higher_frac, the fraction of tokens it frees (Â > 0, 1+ε < ρ ≤ 1+ε_high).
      ratio_level      "sequence": ρ_t replaced by GSPO-token's s_{i,t} (sequence_log_ratio), one clip per sequence.
      weights          a constant per-token weight multiplying the clipped objective (rollout_correction's TIS/MIS).
      dual_clip        c > 1: where Â < 0 the objective is max(min(ρÂ, clip(ρ)Â), c·Â) (dual-clip PPO, Ye et al.
                       2020); stats gain dual_clipfrac, the fraction where c·Â binds.
      log_ratio_clamp  C: log ρ clamped to ±C before exp; its gradient is 0 beyond ±C.
      agg, max_len     how the per-token objective becomes one number: "token-mean" (here), or aggregate()'s
                       "seq-mean-token-mean" / "seq-mean-token-sum-norm" (Dr. GRPO's constant, max_len = T_max).
    """
    _check_shapes("policy_loss", "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                  **({} if weights is None else {"weights": weights}))
    if clip_eps is not None and clip_eps < 0:
        raise ValueError(f"ppo_loss.policy_loss: clip_eps must be >= 0 or None, got {clip_eps}")
    if clip_eps_high is not None and (clip_eps is None or clip_eps_high < 0):
        raise ValueError(f"ppo_loss.policy_loss: clip_eps_high must be >= 0 and needs a clip_eps, got "
                         f"{clip_eps_high} with clip_eps={clip_eps}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ppo_loss.policy_loss: ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    advantages = advantages.detach()
    if ratio_level == "sequence":  # GSPO-token: the value of log s_i, the gradient of log π_θ(y_t)
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)
    else:
        log_ratio = logprobs - old_logprobs.detach()  # (B, T)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)  # log ρ ∈ [−C, C] before exp
    ratio = torch.exp(log_ratio)  # ρ_t = π_θ / π_θold
    surr1 = ratio * advantages  # ρ_t Â_t
    if clip_eps is None:
        objective = surr1
        clipped = torch.zeros_like(surr1)
    else:
        if clip_eps_high is None:
            surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages  # clip(ρ_t, 1−ε, 1+ε) Â_t
        else:  # clip-higher (DAPO): the ratio may rise to 1 + ε_high, fall to 1 − ε
            surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high) * advantages
        objective = torch.minimum(surr1, surr2)  # min(ρÂ, clip(ρ)Â)   (Eq. 15)
        clipped = (surr2 < surr1).to(surr1.dtype)
    dual = None
    if dual_clip is not None:  # dual-clip: for Â < 0, max(min(ρÂ, clip(ρ)Â), c·Â)
        dual = ((advantages < 0) & (dual_clip * advantages > objective)).to(surr1.dtype)
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    if weights is not None:  # w_t · min(ρÂ, clip(ρ)Â): the rollout correction acts after the clip
        objective = objective * weights.detach()
    loss = -masked_mean(objective, mask)  # token-level mean over every real token of the batch
    if agg != "token-mean":  # a peer's aggregation (aggregate, below): per-sequence means, or Dr. GRPO's constant
        loss = -aggregate(objective, mask, agg, max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped, mask).item(),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),  # k3 of KL(π_old ‖ π_θ)
            "ratio": masked_mean(ratio, mask).item(),
        }
        if dual is not None:
            stats["dual_clipfrac"] = masked_mean(dual, mask).item()
        if clip_eps_high is not None:  # what clip-higher changes: Â > 0 and 1+ε < ρ ≤ 1+ε_high, clipped by Eq. 15
            freed = (advantages > 0) & (ratio > 1.0 + clip_eps) & (ratio <= 1.0 + clip_eps_high)
            stats["clip_higher_frac"] = masked_mean(freed.to(surr1.dtype), mask).item()
    return loss, stats


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's log-ratio log s_{i,t} = sg[log s_i] + log π_θ(y_{i,t}) − sg[log π_θ(y_{i,t})], (B, T), where

        log s_i = (1/|y_i|) Σ_t log(π_θ(y_{i,t}) / π_old(y_{i,t})),  s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|)

    is GSPO's length-normalised sequence ratio. Every token of row i holds the value log s_i, so clipping s_{i,t}
    clips the whole sequence at once, and its gradient is that of log π_θ(y_{i,t}) alone:
    ∇s_{i,t} = s_i ∇log π_θ(y_{i,t}).
    With the same Â_i on every token and the per-sequence mean (aggregate "seq-mean-token-mean", GSPO's own), the
    loss has GSPO's gradient −(1/B) Σ_i s_i Â_i (1/|y_i|) Σ_t ∇log π_θ(y_{i,t}) (tests/test_ppo_loss.py, autograd).
    """
    _check_shapes("sequence_log_ratio", "logprobs", logprobs, old_logprobs=old_logprobs, mask=mask)
    log_s = masked_mean(logprobs.detach() - old_logprobs.detach(), mask, dim=1)  # (B,) log s_i, a constant
    return log_s[:, None] + logprobs - logprobs.detach()  # (B, T) value log s_i, gradient ∇log π_θ(y_{i,t})


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float,
    clip_eps_high: float, *, weights: Tensor | None = None, agg: str = "token-mean", max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): −mean_t sg(clip(ρ_t, 1−ε_low, 1+ε_high)) Â_t log π_θ(a_t|s_t). (B, T) inputs as policy_loss.

    The clip acts on a detached importance weight, not on the objective, so no token loses its gradient:
    ∂/∂log π_θ = −clip(ρ_t) Â_t on every token (PPO-clip gives 0 where its clip binds). ε_low = 1 means no lower
    bound (ρ ≥ 0). weights, agg and max_len as in policy_loss.
    stats: clipfrac = fraction of real tokens whose weight was clipped (ρ outside [1−ε_low, 1+ε_high]); approx_kl
    and ratio as in policy_loss.
    """
    _check_shapes("cispo_loss", "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                  **({} if weights is None else {"weights": weights}))
    if not 0 <= clip_eps_low <= 1 or clip_eps_high < 0:
        raise ValueError(f"ppo_loss.cispo_loss: need 0 <= clip_eps_low <= 1 and clip_eps_high >= 0, got "
                         f"{clip_eps_low}, {clip_eps_high}")
    log_ratio = (logprobs - old_logprobs).detach()  # (B, T) log ρ_t, a constant here
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # sg(clip(ρ_t, 1−ε_low, 1+ε_high))
    objective = weight * advantages.detach() * logprobs  # sg(clip(ρ_t)) Â_t log π_θ(a_t|s_t)   (CISPO)
    if weights is not None:
        objective = objective * weights.detach()
    loss = -aggregate(objective, mask, agg, max_len)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((weight != ratio).to(ratio.dtype), mask).item(),
                 "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
                 "ratio": masked_mean(ratio, mask).item()}
    return loss, stats


def rollout_mismatch(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler's per-token log π_rollout is from the trainer's log π_old on the same tokens (B, T), as
    detached floats over the real tokens (mask): 0, 0, 1 and 0 when the two agree exactly.

        mean_abs_logp_diff     mean_t |log π_rollout − log π_old|
        max_abs_logp_diff      max_t  |log π_rollout − log π_old|
        token_mult_prob_error  mean_t exp(|log π_rollout − log π_old|): NeMo-RL's metric, the mean multiplicative
                               error of a token's probability (1.01 = the two disagree by 1 % on average)
        kl                     k3 estimate of KL(π_rollout ‖ π_old): the tokens were sampled by π_rollout, so
                               kl_sampled(log π_rollout, log π_old, "k3"), as NeMo-RL's gen_kl_error
    """
    _check_shapes("rollout_mismatch", "old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    with torch.no_grad():
        diff = torch.where(mask != 0, (rollout_logprobs - old_logprobs).abs(), 0.0)  # (B, T) |Δ log π|, 0 at padding
        return {"mean_abs_logp_diff": masked_mean(diff, mask).item(),
                "max_abs_logp_diff": diff.max().item() if diff.numel() else 0.0,
                "token_mult_prob_error": masked_mean(torch.exp(diff), mask).item(),  # mean exp|Δ|
                "kl": masked_mean(kl_sampled(rollout_logprobs, old_logprobs, "k3"), mask).item()}


def rollout_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, mode: str, cap: float, level: str = "token"
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Weights and mask that correct the loss for tokens sampled by π_rollout ≠ π_old. (B, T) → (weights, mask, stats).

    ρ_t = π_old(y_t) / π_rollout(y_t), computed in log space; C = cap ≥ 1.
      "tis", level "token"     w_t = min(ρ_t, C): truncated importance sampling; mask unchanged
      "mis", level "token"     w_t = ρ_t on the tokens with ρ_t ∈ [1/C, C]; the others leave the mask
      "mis", level "sequence"  w_t = ρ_i = Π_t ρ_t (verl's sequence ratio: the product, not a mean) on the sequences
                               with ρ_i ∈ [1/C, C]; the others leave the mask whole
    The weights are constants (detached) that multiply the token's clipped objective (policy_loss / cispo_loss
    `weights`), and the caller aggregates over the returned mask, so a masked token leaves the denominator too.
    They are exactly 1 where π_rollout = π_old. Weights are 0 at padding.
    stats: weight_mean, weight_max (over the kept real tokens), masked_frac (real tokens masked), capped_frac (TIS:
    real tokens with ρ_t > C).
    """
    _check_shapes("rollout_correction", "old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if (mode, level) not in (("tis", "token"), ("mis", "token"), ("mis", "sequence")) or not cap >= 1:
        raise ValueError(f"ppo_loss.rollout_correction: expected mode 'tis' (level 'token') or 'mis' (level 'token' "
                         f"or 'sequence') and cap >= 1, got {mode!r}, {level!r}, {cap}")
    m = mask.to(old_logprobs.dtype)
    log_rho = torch.where(mask != 0, old_logprobs - rollout_logprobs, 0.0).detach()  # (B, T) log ρ_t, 0 at padding
    if level == "sequence":
        log_rho = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)  # (B, T) log Π_t ρ_t on every token of i
    rho = torch.exp(log_rho)
    if mode == "tis":
        weights, keep = torch.clamp(rho, max=cap), m  # w_t = min(ρ_t, C)   (TIS)
    else:
        keep = m * (log_rho.abs() <= math.log(cap)).to(m.dtype)  # ρ ∈ [1/C, C]   (MIS)
        weights = rho
    weights = torch.where(keep != 0, weights, 0.0)  # (B, T) 0 at padding and where masked (even where ρ = inf)
    with torch.no_grad():
        stats = {"weight_mean": masked_mean(weights, keep).item(),
                 "weight_max": weights.max().item() if weights.numel() else 0.0,
                 "masked_frac": masked_mean(1.0 - keep, m).item(),
                 "capped_frac": masked_mean((rho > cap).to(m.dtype), m).item() if mode == "tis" else 0.0}
    return weights, keep, stats


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", max_len: int | None = None) -> Tensor:
    """A per-token loss (B, T) as one number, the way one of the implementations in use does it (verl's names;
    the other peers' names for each: docs/differences.md):

        token-mean               Σ_{i,t} m·ℓ / Σ m            every token weighs the same (ours, the paper's code)
        seq-mean-token-mean      mean_i (Σ_t m·ℓ / Σ_t m)     every response weighs the same: a token of a short
                                                              response weighs more (GRPO's and GSPO's papers);
                                                              empty rows skipped
        seq-mean-token-sum-norm  Σ_{i,t} m·ℓ / (B · max_len)  a constant divisor, B rows × the response length cap,
                                                              so neither length nor batch content changes a token's
                                                              weight (Dr. GRPO)
    max_len: the cap T_max (PPOConfig.max_new_tokens), needed by seq-mean-token-sum-norm; a constant, not the
    batch's longest response, or the divisor would move with the batch.
    """
    _check_shapes("aggregate", "loss_mat", loss_mat, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    m = mask.to(loss_mat.dtype)
    tokens = torch.where(mask != 0, loss_mat, torch.zeros_like(loss_mat)) * m  # (B, T) 0 at padding
    if mode == "seq-mean-token-mean":
        lengths = m.sum(dim=1)                                                 # (B,)
        per_seq = tokens.sum(dim=1) / lengths.clamp_min(1e-12)                 # (B,) Σ_t m·ℓ / Σ_t m
        real = (lengths > 0).to(loss_mat.dtype)                                # rows with a real token
        return (per_seq * real).sum() / real.sum().clamp_min(1.0)              # mean_i over those rows
    if mode == "seq-mean-token-sum-norm":
        if not max_len or max_len < 1:
            raise ValueError("ppo_loss.aggregate: seq-mean-token-sum-norm needs max_len, the response length cap")
        return tokens.sum() / (loss_mat.shape[0] * max_len)                    # Σ m·ℓ / (B · T_max)
    raise ValueError(f"ppo_loss.aggregate: unknown mode {mode!r}, expected one of {AGGREGATIONS}")


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Critic loss mean_t (V_φ(s_t) − R̂_t)² (Eq. 16), optionally with value clipping.

    values      V_φ(s_t) from the critic being trained      (B, T)
    old_values  the critic's values at rollout time (const)  (B, T)
    returns     R̂_t = Â_t + V_old(s_t) from GAE (const)     (B, T)
    clip_range  c: with it, max((V − R̂)², (V_old + clip(V − V_old, −c, c) − R̂)²) elementwise, so the
                critic gains nothing by moving more than c from its rollout value (PPO2 / PPO-max).
    No ½ factor, as in Eq. 16 (the authors' code and the peers multiply by 0.5; that only rescales the
    critic's learning rate / loss weight).

    stats: vf_clipfrac = fraction of real tokens where the clipped term is the larger one (its gradient
    is then zero); vf_explained_var = 1 − Var[R̂ − V] / Var[R̂] over real tokens (1 = perfect, ≤ 0 = no better
    than a constant; NaN when the returns are constant).
    """
    _check_shapes("value_loss", "values", values, old_values=old_values, returns=returns, mask=mask)
    old_values, returns = old_values.detach(), returns.detach()
    vf_loss1 = (values - returns) ** 2  # (V − R̂)²   (Eq. 16)
    if clip_range is None:
        vf_loss = vf_loss1
        clipped = torch.zeros_like(vf_loss1)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)  # (B, T)
        vf_loss2 = (values_clipped - returns) ** 2
        vf_loss = torch.maximum(vf_loss1, vf_loss2)
        clipped = (vf_loss2 > vf_loss1).to(vf_loss1.dtype)
    loss = masked_mean(vf_loss, mask)
    with torch.no_grad():
        var_returns = masked_var(returns, mask).item()
        residual_var = masked_var(returns - values, mask).item()
        stats = {
            "vf_clipfrac": masked_mean(clipped, mask).item(),
            "vf_explained_var": 1.0 - residual_var / var_returns if var_returns > 0 else float("nan"),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------------
# KL to the reference policy, entropy
# ----------------------------------------------------------------------------------------------------

def kl_full(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """Exact KL(π ‖ π_ref) = Σ_v π(v) log(π(v) / π_ref(v)) at each position. (B, T, V), (B, T, V) -> (B, T).

    Computed from log_softmax (no softmax then log), so it is stable for large logits. Logits must be
    finite: pass the raw model logits, not top-k / top-p filtered ones (−inf would give 0·∞ = NaN).
    """
    _check_shapes("kl_full", "logits", logits, ref_logits=ref_logits)
    logp = F.log_softmax(logits, dim=-1)  # (B, T, V)
    ref_logp = F.log_softmax(ref_logits, dim=-1)  # (B, T, V)
    return (logp.exp() * (logp - ref_logp)).sum(-1)  # Σ_v π log(π/π_ref)   (B, T)


def kl_sampled(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from the sampled tokens only. (B, T), (B, T) -> (B, T).

    With a_t ~ π and log r = log π(a_t) − log π_ref(a_t) (Schulman 2020; his r is π_ref/π = exp(−log r)):
        k1 = log r                      unbiased; can be negative per token; high variance.
                                        What the authors' code and most RLHF code use in the penalty (Eq. 19).
        k2 = ½ (log r)²                 biased (exact to second order when π ≈ π_ref); ≥ 0; low variance.
        k3 = (exp(−log r) − 1) + log r  unbiased; ≥ 0 (since eˣ ≥ 1 + x); low variance when π ≈ π_ref.
    Averaged over tokens sampled from π, k1 and k3 converge to kl_full; from another policy they do not.
    """
    _check_shapes("kl_sampled", "logprobs", logprobs, ref_logprobs=ref_logprobs)
    log_r = logprobs - ref_logprobs  # log π/π_ref   (B, T)
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.expm1(-log_r) + log_r  # (π_ref/π − 1) − log(π_ref/π)
    raise ValueError(f"ppo_loss.kl_sampled: unknown kind {kind!r}, expected 'k1', 'k2' or 'k3'")


def entropy(logits: Tensor) -> Tensor:
    """H(π(·|s_t)) = −Σ_v π(v) log π(v) at each position, in nats. (B, T, V) -> (B, T). Finite logits only."""
    logp = F.log_softmax(logits, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def entropy_bonus_loss(
    logits: Tensor, mask: Tensor, coef: float, clip: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The entropy bonus (App. B.3, Fig. 16) as a loss term to ADD to the PPO loss. (B, T, V), (B, T).

    H̄ = token-level mean entropy of the policy over the real tokens.
        clip=None:  loss = −coef · H̄               (maximizes entropy without bound: Fig. 16 diverges)
        clip=δ:     loss = coef · max(0, δ − H̄)    (a hinge: below δ its gradient is exactly that of
                                                    −coef·H̄; at or above δ the term is 0 with zero gradient)
    The hinge is the one-sided version of the authors' code, which uses coef · |H̄ − δ| and so also
    pushes the entropy DOWN once it is above δ. A token-mean entropy in nats is at most log V
    (≈ 10.4 for V = 32k), so δ must lie below log V to ever bind. Paper: coef = 0.01.

    stats: entropy = H̄; entropy_bonus_active = 1.0 when the bonus acts (no clip, or H̄ < δ), else 0.0.
    """
    _check_shapes("entropy_bonus_loss", "logits[..., 0]", logits[..., 0], mask=mask)
    mean_entropy = masked_mean(entropy(logits), mask)  # H̄
    if clip is None:
        loss = -coef * mean_entropy
    else:
        loss = coef * torch.relu(clip - mean_entropy)  # coef · max(0, δ − H̄)
    h = mean_entropy.item()
    stats = {"entropy": h, "entropy_bonus_active": float(clip is None or h < clip)}
    return loss, stats


# ----------------------------------------------------------------------------------------------------
# Pretraining (ptx) loss
# ----------------------------------------------------------------------------------------------------

def ptx_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Mean next-token NLL on pretraining / SFT text: the λ_ptx term of PPO-ptx (Eq. 17), as a loss.

    logits     the policy's logits on the full sequences   (B, L, V)
    input_ids  the token ids                                (B, L)
    loss_mask  1.0 on the tokens of input_ids to predict    (B, L)

    Alignment: logits[:, i] predict input_ids[:, i+1], so the loss pairs logits[:, :-1] with
    input_ids[:, 1:] and uses loss_mask[:, 1:]: loss_mask marks TARGET tokens in input_ids' own positions
    (like Hugging Face `labels`); loss_mask[:, 0] is never used (nothing predicts the first token).
    Sign: Eq. 17 maximizes L_clip + λ_ptx E[log π_RL(x)]; as a minimized loss that is
    pg_loss + λ_ptx · NLL, so the caller ADDS λ_ptx · ptx_loss(...) to the PPO loss.

    stats: ptx_loss = the mean NLL; ptx_ppl = exp(mean NLL) (a token-level perplexity); ptx_tokens.
    """
    _check_shapes("ptx_loss", "input_ids", input_ids, loss_mask=loss_mask)
    if logits.shape[:-1] != input_ids.shape:
        raise ValueError(
            f"ppo_loss.ptx_loss: `logits` has shape {tuple(logits.shape)}, expected {tuple(input_ids.shape)} + (V,)"
        )
    nll = -logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])  # −log π(x_{i+1} | x_≤i)   (B, L−1)
    target_mask = loss_mask[:, 1:].to(nll.dtype)  # (B, L−1)
    loss = masked_mean(nll, target_mask)  # −E[log π_RL(x)] per token   (Eq. 17)
    stats = {"ptx_loss": loss.item(), "ptx_ppl": loss.detach().double().exp().item(),  # inf, not OverflowError
             "ptx_tokens": float(target_mask.sum())}
    return loss, stats


if __name__ == "__main__":
    torch.set_printoptions(precision=6)
    # 1. PPO-clip on a ragged batch, ε = 0.2: the four textbook cases, one more clipped A>0 token, one padded slot.
    old_logprobs = torch.log(torch.full((2, 3), 0.5, dtype=torch.float64))
    ratio = torch.tensor([[1.1, 1.5, 0.9], [0.5, 1.3, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = policy_loss(old_logprobs + ratio.log(), old_logprobs, advantages, mask, clip_eps=0.2)
    print(f"policy_loss    loss={loss.item():.6f} clipfrac={stats['clipfrac']:.6f} "
          f"approx_kl={stats['approx_kl']:.6f} ratio={stats['ratio']:.6f}")
    loss, _ = policy_loss(old_logprobs + ratio.log(), old_logprobs, advantages, mask, clip_eps=None)
    print(f"unclipped      loss={loss.item():.6f}")
    # the same with clip-higher (ε_high = 0.28: ρ = 1.3 and 1.5 clip at 1.28), and CISPO's detached clipped weight
    loss, stats = policy_loss(old_logprobs + ratio.log(), old_logprobs, advantages, mask, 0.2, clip_eps_high=0.28)
    print(f"clip-higher    loss={loss.item():.6f} clipfrac={stats['clipfrac']:.6f}")
    loss, stats = cispo_loss(old_logprobs + ratio.log(), old_logprobs, advantages, mask, 0.2, 0.28)
    print(f"cispo          loss={loss.item():.6f} clipfrac={stats['clipfrac']:.6f}")
    # 2. value loss with and without clipping, c = 0.2
    values = torch.tensor([[1.0, 0.5, -0.3]], dtype=torch.float64)
    old_values = torch.tensor([[0.5, 0.6, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, 0.2]], dtype=torch.float64)
    vmask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = value_loss(values, old_values, returns, vmask, clip_range=0.2)
    print(f"value_loss     loss={loss.item():.6f} vf_clipfrac={stats['vf_clipfrac']:.6f}")
    loss, _ = value_loss(values, old_values, returns, vmask)
    print(f"unclipped      loss={loss.item():.6f}")
    # 3. KL to the reference and entropy, V = 3; the sampled token is token 0
    logits = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=torch.float64)
    ref_logits = torch.zeros(1, 1, 3, dtype=torch.float64)
    tok = torch.zeros(1, 1, dtype=torch.long)
    lp, ref_lp = logprobs_from_logits(logits, tok), logprobs_from_logits(ref_logits, tok)
    print(f"kl_full={kl_full(logits, ref_logits).item():.6f} k1={kl_sampled(lp, ref_lp, 'k1').item():.6f} "
          f"k2={kl_sampled(lp, ref_lp, 'k2').item():.6f} k3={kl_sampled(lp, ref_lp, 'k3').item():.6f}")
    print(f"entropy={entropy(logits).item():.6f} uniform={entropy(ref_logits).item():.6f} (log 3 = {math.log(3):.6f})")
    loss, _ = entropy_bonus_loss(logits, torch.ones(1, 1, dtype=torch.float64), coef=0.01, clip=1.0)
    print(f"entropy_bonus  clip=1.0 loss={loss.item():.6f}")
    # 4. ptx: one sequence of 4 tokens, predict tokens 2 and 3 only
    ptx_logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]]],
                              dtype=torch.float64)
    input_ids = torch.tensor([[0, 1, 2, 0]])
    loss, stats = ptx_loss(ptx_logits, input_ids, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    print(f"ptx_loss       loss={loss.item():.6f} ppl={stats['ptx_ppl']:.6f} tokens={stats['ptx_tokens']:.0f}")

# Output of `python ppo_loss.py`:
#   policy_loss    loss=-0.240000 clipfrac=0.600000 approx_kl=0.067074 ratio=1.060000
#   unclipped      loss=-0.370000
#   clip-higher    loss=-0.264000 clipfrac=0.600000
#   cispo          loss=-0.105228 clipfrac=0.600000
#   value_loss     loss=0.730000 vf_clipfrac=0.333333
#   unclipped      loss=0.500000
#   kl_full=0.266217 k1=0.691006 k2=0.238745 k3=0.192078
#   entropy=0.832396 uniform=1.098612 (log 3 = 1.098612)
#   entropy_bonus  clip=1.0 loss=0.001676
#   ptx_loss       loss=2.239545 ppl=9.389056 tokens=2
