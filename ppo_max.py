"""PPO-max: how a reward-model score becomes per-token rewards (this half), and the training recipe (below it).

Implements (equation numbers of Zheng et al. 2023, arXiv 2307.04964):
    RunningMoments                                                   → historical mean/std used by Eq. 18
    normalize_and_clip_rewards(scores, moments, clip_delta)          → Eq. 18  r̃ = clip((r − mean)/std, −δ, δ)
    scale_rewards(scores, moments)                                   → "reward scaling" ablation (Fig. 6): r / std
    shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl) → Eq. 19  r_t = −η KL_t, + score on the last token
                                                                       (its inputs checked by check_shaping_inputs)
  the recipe (section 5.4; train.py runs the loop):
    PPOConfig, PRESETS, apply_preset                                 → every trick as a field; ppo-max and vanilla
    rollout(policy, query, ...)                                      → step (1): sample with the KV cache, stop at EOS
    make_experience(...)                                             → steps (2)–(5): score, Eq. 18, Eq. 19, GAE (Eq. 9)
    ppo_update(...)                                                  → step (6): Eq. 15 + 16 + 17, global grad clip
    pretrain_critic(...)                                             → §5.3.3: fit V_φ (Eq. 16) before any policy update
    AdaptiveKLController                                             → adaptive η (Ziegler et al. 2019), an ablation

Run: python ppo_max.py        (prints the worked example of the score half)

Order used by the recipe, once per rollout batch (section 5.4, steps 1–2):
    1. scores = reward_model(prompt + response)                      # (B,)
    2. moments.update(scores)                                        # history now includes this batch
    3. scores = normalize_and_clip_rewards(scores, moments, δ)       # Eq. 18, with the updated moments
    4. rewards = shape_rewards(scores, logprobs, ref_logprobs, mask, η)  # Eq. 19, (B, T) → gae.compute_gae

References:
    Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", sections 5.3.1 and 5.4.
    Chan, Golub, LeVeque 1979/1983, "Updating formulae and a pairwise algorithm for computing sample variances"
      (the parallel merge of means and variances).
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (the KL-shaped reward, Eq. 3/19).
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# the recipe half (below the score half) builds on the two equation files, and steps its models through engine.py
from cli import arg  # a dataclass field whose help text becomes `--help` (cli.py: the flags' plumbing)
import critic_free
from engine import all_mean, all_sum, any_rank, backward_step, gather_batch, world_size
from gae import compute_gae
from data import position_ids_from_mask
from ppo_loss import (aggregate, entropy, entropy_bonus_loss, kl_full, kl_sampled, logprobs_from_logits, masked_mean,
                      masked_whiten, policy_loss, ptx_loss, value_loss)

# ======================================================================================================
# Score half: reward normalization, scaling and KL shaping (Eq. 18–19)
# ======================================================================================================


class RunningMoments:
    """Mean and variance of every value passed to `update` so far, merged batch by batch (no history kept).

    `.std` is the population standard deviation (ddof = 0, divide by the count, as numpy's default): it is the
    spread of the scores seen, not an estimate of a wider population, and it is what the merge formula keeps
    exactly. Before any update: count 0, mean 0.0, var 1.0 (so std 1.0), which makes Eq. 18 and reward scaling
    the identity (up to the clip) until the first batch arrives. A history with no spread yet (one score, or
    scores all equal: std 0 up to rounding) says nothing about the scale either, so Eq. 18 and scaling keep the
    scale at 1 then (they centre, they do not divide by ~0), until a batch brings a spread.

    Under data parallelism every rank must call `update` with the same values (gather the scores of all ranks
    first), or the ranks' moments drift apart.
    """

    def __init__(self) -> None:
        self.count: int = 0
        self.mean: float = 0.0
        self.var: float = 1.0  # population variance (ddof = 0)

    @property
    def std(self) -> float:
        """Population standard deviation √var (ddof = 0); 1.0 before any update."""
        return math.sqrt(self.var)

    def update(self, x: Tensor) -> None:
        """Merge the batch `x` (any shape, all elements count) into the running mean and variance.

        Chan et al.'s parallel merge of (n_a, mean_a, M2_a) with (n_b, mean_b, M2_b), M2 = n·var:
            n = n_a + n_b,  Δ = mean_b − mean_a,  mean = mean_a + Δ·n_b/n,  M2 = M2_a + M2_b + Δ²·n_a·n_b/n
        """
        x = x.detach().to(torch.float64).flatten()  # (N,) float64 so long histories do not lose precision
        n_b = x.numel()
        if n_b == 0:
            return
        mean_b = x.mean().item()
        var_b = x.var(unbiased=False).item()  # ddof = 0
        n_a, n = self.count, self.count + n_b
        delta = mean_b - self.mean  # Δ = mean_b − mean_a
        m2 = self.var * n_a + var_b * n_b + delta**2 * n_a * n_b / n  # M2 = M2_a + M2_b + Δ² n_a n_b / n
        self.mean = self.mean + delta * n_b / n  # mean = mean_a + Δ n_b / n
        self.var = m2 / n
        self.count = n

    def state_dict(self) -> dict:
        """Plain python numbers, so a checkpoint can store them as JSON or in a torch.save dict."""
        return {"count": int(self.count), "mean": float(self.mean), "var": float(self.var)}

    def load_state_dict(self, d: dict) -> None:
        self.count, self.mean, self.var = int(d["count"]), float(d["mean"]), float(d["var"])

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count}, mean={self.mean:.6g}, std={self.std:.6g})"


def normalize_and_clip_rewards(
    scores: Tensor, moments: RunningMoments, clip_delta: float | None, eps: float = 1e-8
) -> Tensor:
    """Eq. 18: r̃ = clip((r − mean(r)) / std(r), −δ, δ) with the running (historical) mean and std, (B,).

    scores: reward-model scores r, any shape (usually (B,)). moments: the history; this function only reads
    it; the recipe calls `moments.update(scores)` first, so the batch is normalized with moments that include
    it. clip_delta: δ > 0 (the paper tries 0.3 and 0.8), or None for normalization without a clip.
    eps: the smallest std that counts as a spread. A history without one (std ≤ eps: one score, or all scores
    equal, as on a first batch of one response) leaves the scale at 1, as before any update: r̃ = clip(r − mean),
    not (r − mean)/eps, which would magnify differences below eps (rounding) into rewards of order one.
    """
    if clip_delta is not None and clip_delta <= 0:
        raise ValueError(f"ppo_max.py: clip_delta (δ of Eq. 18) must be > 0 or None, got {clip_delta}")
    std = moments.std if moments.std > eps else 1.0  # no spread seen yet: nothing to measure the scale by
    normalized = (scores - moments.mean) / std  # (r − mean) / std   (Eq. 18)
    if clip_delta is None:
        return normalized
    return normalized.clamp(-clip_delta, clip_delta)  # clip(·, −δ, δ)   (Eq. 18)


def scale_rewards(scores: Tensor, moments: RunningMoments, eps: float = 1e-8) -> Tensor:
    """Reward scaling, the paper's ablation (Fig. 6): r / std(r) with the running std, no centring, no clip.

    This is what the authors' released scripts enable (see README, notes); the paper finds it ≈ vanilla PPO.
    Same order as Eq. 18: update the moments with the batch first, then scale; this function only reads them.
    eps: the smallest std that counts as a spread, as in normalize_and_clip_rewards: a history without one (one
    score, or all scores equal) leaves the scores as they are (a score of 2.0 stays 2.0, not 2.0 / eps = 2e8).
    """
    std = moments.std if moments.std > eps else 1.0  # no spread seen yet: nothing to measure the scale by
    return scores / std  # r / std


def shape_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    kl: Tensor | None = None,
) -> Tensor:
    """Eq. 19: per-token rewards r_t = −η·KL_t on every response token, plus the sequence score on the last one.

    scores: r(x, y), one (normalized) score per sequence, (B,).
    logprobs, ref_logprobs: log π_RL(y_t|·) and log π_SFT(y_t|·) of the sampled tokens, (B, T).
    mask: (B, T), 1.0 on real response tokens, contiguous from 0, right-padded; every row needs one real token.
    kl_coef: η (0.05 in the paper's Fig. 7; 0.05/0.1/0.2 in Fig. 15).
    kl: optional per-token KL_t (B, T), e.g. ppo_loss.kl_full(logits, ref_logits); if None,
        KL_t = logprobs − ref_logprobs, the sampled-token log-ratio ("k1", unbiased for the sequence KL).
    Returns rewards (B, T), 0 where mask is 0, whatever logprobs, ref_logprobs or kl hold there (even inf or NaN).

    Where the score goes: on the LAST REAL response token, index mask.sum(1) − 1, because that token is the
    action that ended the episode and the score judges the whole sequence it completed. Some peers (e.g. some
    trl versions) put the score one position later, on the pad/EOS-following slot; with a right-padded mask
    that position is masked out (the score is silently lost to GAE and the loss), and making it count needs a
    terminal pseudo-token whose value the critic must also learn. We do not.
    """
    check_shaping_inputs(scores, logprobs, ref_logprobs, mask, kl)  # a silent broadcast would corrupt Eq. 19
    B = mask.shape[0]
    last = mask.sum(dim=1).long() - 1  # (B,) index of the last real response token
    if kl is None:
        kl = logprobs - ref_logprobs  # (B, T) KL_t ≈ log π_RL(y_t) − log π_SFT(y_t)   (k1)
    non_score_reward = torch.where(mask != 0, -kl_coef * kl, 0.0)  # (B, T) −η KL_t   (Eq. 19), 0 at padding
    score_reward = torch.zeros_like(non_score_reward)  # (B, T)
    score_reward[torch.arange(B, device=mask.device), last] = scores.to(score_reward)  # r(x, y) at the end
    rewards = non_score_reward + score_reward  # r_t = r(x, y)·[t = last] − η KL_t   (Eq. 19)
    return rewards


def check_shaping_inputs(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                         kl: Tensor | None = None) -> None:
    """shape_rewards' inputs, or a ValueError naming what is wrong: logprobs, ref_logprobs, mask (and kl) all (B, T),
    scores (B,), mask 0/1, contiguous from 0 and right-padded, with at least one real token per row."""
    if logprobs.dim() != 2 or not (logprobs.shape == ref_logprobs.shape == mask.shape):
        raise ValueError(
            f"ppo_max.py: logprobs, ref_logprobs and mask must all be (B, T) with the same shape; got "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    B, T = mask.shape
    if scores.shape != (B,):
        raise ValueError(f"ppo_max.py: scores must be (B,) = ({B},), one per sequence; got {tuple(scores.shape)}")
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"ppo_max.py: kl must be (B, T) = {tuple(mask.shape)}; got {tuple(kl.shape)}")
    if ((mask != 0) & (mask != 1)).any() or (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError("ppo_max.py: mask must hold 0/1, contiguous from position 0 and right-padded (1 … 1 0 … 0)")
    if (mask.sum(dim=1) == 0).any():
        empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
        raise ValueError(f"ppo_max.py: rows {empty} of mask have no real response token; drop them before shaping")


# ====================================== end of the score half =========================================
# =========================================================================================================
# The recipe: configuration, presets, and the pieces of one PPO iteration (train.py runs the loop)
# =========================================================================================================


@dataclass
class PPOConfig:
    """Every trick of the paper is a field; presets (below) are named sets of overrides. Defaults = PPO-max (§5.4)
    at the synthetic world's scale. Field docs become `python train.py --help`."""
    # --- sampling (rollouts) ---
    rollout_batch: int = arg(64, "responses per PPO iteration ('sampling batch'; paper 128): prompts × --group-size",
                             ">=1")
    group_size: int = arg(1, "G: responses sampled per prompt, kept together (on one rank under DeepSpeed); the group "
                             "estimators (grpo, dr-grpo, rloo, reinforce++-baseline) need G ≥ 2", ">=1")
    minibatch: int = arg(16, "sequences per gradient step (paper 32)", ">=1")
    ppo_epochs: int = arg(2, "passes over each rollout batch ('small experience buffer', §5.4)", ">=1")
    max_new_tokens: int = arg(24, "response length cap T", ">=1")
    temperature: float = arg(1.0, "rollout sampling temperature T: samples from π^(1/T), and the log-probs of the "
                                  "ratio and the KL are those of π^(1/T) too (1 = π itself)", ">0")
    # --- optimisation ---
    policy_lr: float = arg(7e-5, "α for π_θ (paper 5e-7 at 7B); chosen with the synthetic world so that vanilla PPO "
                                 "needs tens of steps to find the reward model's errors (docs/findings.md)", ">=0")
    critic_lr: float = arg(5e-4, "α for V_φ (paper 1.65e-6 at 7B)", ">=0")
    warmup_frac: float = arg(0.0, "linear LR warm-up fraction (paper 0.1; PPO-max replaces it by critic "
                                  "pre-training)", "[0,1]")
    grad_clip: float = arg(1.0, "global gradient-norm clip; 0 = off (Fig. 18)", ">=0")
    # --- score reparameterisation (Fig. 6, 14) ---
    reward_norm: bool = arg(True, "Eq. 18: normalise scores with running mean/std")
    reward_clip: float = arg(5.0, "δ of Eq. 18 (clip after normalising); 0 = no clip", ">=0")
    reward_scale: bool = arg(False, "reward scaling: r / running std (ablation)")
    adv_norm: bool = arg(False, "whiten advantages per minibatch")
    adv_clip: float = arg(0.0, "clip whitened advantages to ±δ; 0 = off", ">=0")
    # --- policy constraints (Fig. 7, 15, 16) ---
    kl_coef: float = arg(0.05, "η of Eq. 19 (token-level KL penalty); 0 = off. The paper: 0.05 (Fig. 7), 0.05/0.1/0.2 "
                               "(Fig. 15)", ">=0")
    kl_estimator: str = arg("k1", "per-token KL in the penalty: k1 (sampled log-ratio, Eq. 19) | k2 | k3 | full "
                                  "(exact)", "k1|k2|k3|full")
    kl_target: float = arg(0.0, "adaptive KL controller target, in nats PER TOKEN (kl/ref; Ziegler et al. 2019 "
                                "state it per sequence: divide by the mean response length); 0 = fixed η", ">=0")
    kl_horizon: int = arg(10000, "adaptive KL horizon (in sequences)", ">=1")
    importance_sampling: bool = arg(False, "ratio against π_ref instead of π_old: the 'infinite buffer' of §5.3.2")
    entropy_coef: float = arg(0.0, "entropy bonus weight (paper 0.01)", ">=0")
    entropy_clip: float = arg(0.0, "the bonus stops acting above this mean entropy (Fig. 16); 0 = no clip", ">=0")
    # --- the advantage estimator (gae.py: Eq. 9 with the critic; critic_free.py without one) ---
    advantage: str = arg("gae", "advantage estimator: gae (Eq. 9, a critic V_φ) or, with no critic at all (none is "
                                "built, pre-trained or checkpointed): grpo, dr-grpo (also sets --loss-agg "
                                "seq-mean-token-sum-norm), rloo, reinforce++, reinforce++-baseline (docs/methods.md)",
                         "gae|grpo|dr-grpo|rloo|reinforce++|reinforce++-baseline")
    kl_in: str = arg("reward", "where the KL to π_SFT acts: 'reward' (Eq. 19: −η·KL_t in every r_t) or 'loss' "
                               "(GRPO: + η·KL_t added to the policy loss; --kl-estimator k3 unless given: GRPO's, "
                               "whose gradient is that of KL(π_SFT‖π); k2's is that of KL(π‖π_SFT))", "reward|loss")
    # --- conventions of other implementations (docs/differences.md); the defaults are ours ---
    loss_agg: str = arg("token-mean", "policy-loss aggregation (verl loss_agg_mode): token-mean (ours, OpenRLHF "
                                      "token_level_loss, TRL bnpo) | seq-mean-token-mean (TRL grpo, OpenRLHF "
                                      "--no-token_level_loss) | seq-mean-token-sum-norm (Dr. GRPO: Σ / (batch × "
                                      "--max-new-tokens); TRL dr_grpo)",
                        "token-mean|seq-mean-token-mean|seq-mean-token-sum-norm")
    dual_clip: float = arg(0.0, "dual-clip PPO c > 1: for Â < 0 the objective is at least c·Â (verl clip_ratio_c, on "
                                "by default there at 3; OpenRLHF --dual_clip); 0 = off", ">=0")
    log_ratio_clamp: float = arg(0.0, "clamp log(π_θ/π_θold) to ±C before exp (OpenRLHF and verl: 20); 0 = off",
                                 ">=0")
    kl_clamp: float = arg(0.0, "clamp every sampled KL_t (k1, k2, k3) to ±C (OpenRLHF compute_approx_kl: 10 for every "
                               "estimator; verl kl_penalty: 10 for k3 only); 0 = off", ">=0")
    # --- PPO core (Eq. 15, 16) ---
    clip_eps: float = arg(0.2, "ε of PPO-clip (Fig. 17)", ">=0")
    value_clip: float = arg(0.2, "value-loss clip range; 0 = off", ">=0")
    vf_coef: float = arg(1.0, "critic loss weight (critic has its own optimiser; kept for parity)", ">=0")
    gamma: float = arg(1.0, "γ", "[0,1]")
    lam: float = arg(0.9, "GAE λ (Fig. 19)", "[0,1]")
    # --- ptx (Eq. 17) ---
    ptx_coef: float = arg(0.5, "λ_ptx: weight of the LM loss on SFT text; 0 = off", ">=0")
    ptx_batch: int = arg(16, "SFT sequences per ptx term", ">=1")
    ptx_data: str = arg("pretrain", "D of Eq. 17: 'pretrain' (the synthetic world's pretraining text, responses "
                                    "without prompts: the paper's D_pretrain; the default, set by the operating "
                                    "point's rule in notebooks/claims.py) or 'sft' (the SFT demonstrations; on real "
                                    "data the only one: --sft-data or --data)", "sft|pretrain")
    # --- initialisation (Fig. 8) ---
    critic_pretrain_steps: int = arg(30, "max rollout batches of critic pre-training (stops early on plateau); "
                                         "0 = off", ">=0")
    critic_init: str = arg("rm", "initialise the critic from the reward model ('rm') or the SFT model ('sft')",
                           "rm|sft")
    policy_init: str = arg("sft", "'sft' or 'pretrained' (the non-SFT LM; Fig. 8)", "sft|pretrained")


# Presets: named overrides of PPOConfig, printed at start-up.
PRESETS: dict[str, dict] = {
    "ppo-max": {},
    "vanilla": dict(reward_norm=False, reward_clip=0.0, kl_coef=0.0, critic_pretrain_steps=0, ptx_coef=0.0,
                    value_clip=0.0, grad_clip=0.0),
    # the settings of the scripts released with the paper (docs/differences.md): reward scaling by the running std
    # (no centring, no clip), η = 0.01 (its English runs), no critic pre-training, no ptx, no advantage
    # normalisation, and one optimizer step per rollout batch (its per-GPU batches of 2: the ratio is 1, the clip
    # never binds)
    "moss-release": dict(reward_norm=False, reward_clip=0.0, reward_scale=True, kl_coef=0.01, critic_pretrain_steps=0,
                         ptx_coef=0.0, adv_norm=False, minibatch=64, ppo_epochs=1),
}


def apply_preset(name: str, **overrides) -> PPOConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PPOConfig(), **{**PRESETS[name], **overrides})


class AdaptiveKLController:
    """η_{k+1} = η_k (1 + clip(KL/target − 1, ±0.2) · n/horizon)  (Ziegler et al. 2019, used by the paper's code)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target <= 0:
            return
        proportional_error = max(min(current_kl / self.target - 1, 0.2), -0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# ---------------------------------------------------------------------------------------------------------
# Sequences: a left-padded prompt (B, P) followed by a right-padded response (B, T)
# ---------------------------------------------------------------------------------------------------------
def policy_logits(model, query, query_mask, response, response_mask, temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token: position P−1+t predicts response[t], divided by the sampling
    temperature T, so that log-softmax of them is log π^(1/T), the distribution the rollout sampled from (it enters
    the ratio and the KL). Returns (B, T, V)."""
    P = query.shape[1]
    input_ids = torch.cat([query, response], dim=1)                    # (B, L)
    attention_mask = torch.cat([query_mask, response_mask], dim=1)     # (B, L)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.logits[:, P - 1:-1].float() / temperature               # (B, T, V)  logits / T


def critic_values(critic, query, query_mask, response, response_mask) -> torch.Tensor:
    """V(s_t) for every response token t, read at the position that predicts it (the state before the action)."""
    P = query.shape[1]
    values = critic(torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1))  # (B, L)
    return values[:, P - 1:-1].float()                                                         # (B, T)


@torch.no_grad()
def rollout(policy, query, query_mask, max_new_tokens: int, eos_id: int, pad_id: int, temperature: float = 1.0,
            top_p: float = 1.0, repetition_penalty: float = 1.0):
    """Step 1: sample responses with the KV cache, stopping at EOS. Returns response (B, T), response_mask (B, T),
    finished (B,) — T ≤ max_new_tokens; the mask covers every token up to and including the first EOS.
    Sampling draws from softmax(logits / temperature) over the whole vocabulary (top_p and repetition_penalty as
    given, 1.0: off), whatever the model's generation_config.json says: its own settings (no_repeat_ngram_size,
    min_new_tokens, typical_p, forced_eos_token_id, ...) are set aside for the call, so the log-probs of steps (4)
    and (6) are those of the distribution that was sampled."""
    from transformers import GenerationConfig
    hf = [mod for mod in policy.modules() if isinstance(vars(mod).get("generation_config"), GenerationConfig)]
    saved = [mod.generation_config for mod in hf]
    for mod in hf:
        mod.generation_config = GenerationConfig()  # the library's defaults; the call's arguments set the rest
    try:
        seq = policy.generate(input_ids=query, attention_mask=query_mask, do_sample=True, top_k=0, top_p=top_p,
                              temperature=temperature, repetition_penalty=repetition_penalty,
                              max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True)
    finally:
        for mod, config in zip(hf, saved):
            mod.generation_config = config
    response = seq[:, query.shape[1]:]                                          # (B, T)
    is_eos = response == eos_id
    # positions strictly after the first EOS are padding
    after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0                   # (B, T)
    response_mask = (~after_eos).float()
    response = response.masked_fill(after_eos, pad_id)
    finished = is_eos.any(1)
    return response, response_mask, finished


@torch.no_grad()
def make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                    moments: "RunningMoments", cfg: PPOConfig, kl_coef: float) -> dict:
    """Steps (2)-(5) of a PPO iteration on one rollout batch, computed once, without grad. Returns the batch's
    tensors (query, response, mask, logprobs, ref_logprobs, values, advantages, returns, scores, kl_coef), "stats"
    (the logged numbers) and "nonfinite" (None, or the name of the first NaN/inf value: the update is then skipped).
    With W data-parallel ranks "all_scores" (W·B,) is every rank's scores, so Eq. 18's moments see them all.
    With a critic-free --advantage, `critic` is None and "values" too: step (5) is critic_free.advantages."""
    mask = response_mask                                                               # (B, T)
    full_ids = torch.cat([query, response], 1)                                         # (B, L)
    full_mask = torch.cat([query_mask, response_mask], 1)                              # (B, L)
    # (2) score: the reward model reads the last real token of prompt + response
    scores = reward_model.score(full_ids, full_mask).float()                           # (B,)
    all_scores = gather_batch(scores, cfg.group_size)  # (W·B,) every rank's scores (W = 1: scores itself)
    if bad := check_finite({"reward/score": all_scores}):  # before Eq. 18: one NaN would poison the moments for good
        return {"nonfinite": bad, "scores": scores, "all_scores": all_scores, "stats": {}}
    # (3) reward normalisation and clipping with historical moments (Eq. 18), or scaling (ablation)
    if cfg.reward_norm or cfg.reward_scale:
        moments.update(all_scores)
    if cfg.reward_norm:
        rewards_seq = normalize_and_clip_rewards(scores, moments, cfg.reward_clip or None)  # (B,)
    elif cfg.reward_scale:
        rewards_seq = scale_rewards(scores, moments)
    else:
        rewards_seq = scores
    # (4) token-level KL penalty against the frozen SFT reference (Eq. 19); with --kl-in loss it acts in step (6)
    logits = policy_logits(policy, query, query_mask, response, response_mask, cfg.temperature)   # (B, T, V)
    ref_logits = policy_logits(ref, query, query_mask, response, response_mask, cfg.temperature)  # (B, T, V)
    logprobs = logprobs_from_logits(logits, response)                                  # (B, T)
    ref_logprobs = logprobs_from_logits(ref_logits, response)                          # (B, T)
    kl_exact = kl_full(logits, ref_logits)                                             # (B, T)
    if cfg.kl_estimator == "full":
        kl_pen = kl_exact
    else:
        kl_pen = sampled_kl(logprobs, ref_logprobs, cfg)
    eta = kl_coef if cfg.kl_in == "reward" else 0.0                                    # η of Eq. 19
    rewards = shape_rewards(rewards_seq, logprobs, ref_logprobs, mask, eta, kl=kl_pen)  # (B, T)
    # (5) advantages: values and GAE (Eq. 9), returns = advantages + values the critic's targets (Eq. 16);
    #     or without a critic, from the group of G responses per prompt or the batch (critic_free.py)
    if cfg.advantage == "gae":
        values = critic_values(critic, query, query_mask, response, response_mask) * mask  # (B, T)
        advantages, returns = compute_gae(rewards, values, mask, cfg.gamma, cfg.lam)
    else:
        values = None
        advantages, returns = critic_free.advantages(cfg.advantage, rewards, mask, cfg.group_size, cfg.gamma,
                                                     all_sum)  # (B, T), (B, T)
    exp = {"query": query, "query_mask": query_mask, "response": response, "mask": mask, "logprobs": logprobs,
           "ref_logprobs": ref_logprobs, "values": values, "advantages": advantages, "returns": returns,
           "scores": scores, "all_scores": all_scores, "kl_coef": kl_coef, "nonfinite": None}
    # the guard (every rank skips together) and the logged numbers; neither changes the batch
    if bad := check_finite({"logprobs": logprobs, "values": values, "advantages": advantages}):
        return {**exp, "nonfinite": bad, "stats": {}}
    exp["stats"] = experience_stats(exp, logits, kl_exact, rewards_seq, rewards)
    return exp


def ppo_update(policy, critic, policy_opt, critic_opt, exp: dict, cfg: PPOConfig, ptx_batch) -> dict:
    """Step (6): `ppo_epochs` passes over the rollout batch in shuffled minibatches. Returns the mean stats.

    With W data-parallel ranks each rank holds B = rollout_batch / W sequences and takes minibatch / W of them per
    step; the engines average the gradients, so each optimizer step still sees `minibatch` sequences."""
    B = exp["response"].shape[0]
    # the ratio's denominator: π_θold (PPO) or, with importance sampling against the reference, π_SFT
    old_logprobs = exp["ref_logprobs"] if cfg.importance_sampling else exp["logprobs"]
    stats, nonfinite = [], []   # per-minibatch numbers to log; names of non-finite losses/norms (steps skipped)
    for _ in range(cfg.ppo_epochs):
        for idx in torch.randperm(B).split(cfg.minibatch // world_size()):
            q, qm, r, m = exp["query"][idx], exp["query_mask"][idx], exp["response"][idx], exp["mask"][idx]
            advantages = exp["advantages"][idx]
            if cfg.adv_norm:
                advantages = masked_whiten(advantages, m)
                if cfg.adv_clip:
                    advantages = advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
            # policy: PPO-clip (Eq. 15) + entropy bonus (Fig. 16) + ptx (Eq. 17)
            logits = policy_logits(policy, q, qm, r, m, cfg.temperature)                # (b, T, V)
            logprobs = logprobs_from_logits(logits, r)                                  # (b, T)
            pg_loss, pg_stats = policy_loss(logprobs, old_logprobs[idx], advantages, m, cfg.clip_eps or None,
                                            **loss_conventions(cfg))
            loss = pg_loss
            kl_loss = torch.zeros(())
            if cfg.kl_in == "loss":  # GRPO: + η·KL_t(π_θ ‖ π_SFT) in the loss, aggregated like the policy loss
                kl_loss = aggregate(sampled_kl(logprobs, exp["ref_logprobs"][idx], cfg), m, cfg.loss_agg,
                                    cfg.max_new_tokens)
                loss = loss + exp["kl_coef"] * kl_loss
            if cfg.entropy_coef:
                ent_loss, _ = entropy_bonus_loss(logits, m, cfg.entropy_coef, cfg.entropy_clip or None)
                loss = loss + ent_loss
            ptx = torch.zeros(())
            if cfg.ptx_coef:
                ids, attn, resp = ptx_batch()
                ptx_logits = policy(input_ids=ids, attention_mask=attn, use_cache=False).logits  # (b, L, V)
                ptx, _ = ptx_loss(ptx_logits, ids, resp)
                loss = loss + cfg.ptx_coef * ptx
            grad_norm = backward_step(policy, policy_opt, loss, cfg.grad_clip, "policy", nonfinite)
            # critic: value loss (Eq. 16), clipped around the rollout's values (none without a critic)
            vf_loss = None
            if critic is not None:
                values = critic_values(critic, q, qm, r, m)                             # (b, T)
                vf_loss, _ = value_loss(values, exp["values"][idx], exp["returns"][idx], m, cfg.value_clip or None)
                backward_step(critic, critic_opt, cfg.vf_coef * vf_loss, cfg.grad_clip, "critic", nonfinite)
            stats.append(minibatch_stats(pg_loss, vf_loss, ptx, kl_loss, pg_stats, grad_norm, cfg))
    return update_stats(stats, nonfinite, exp["scores"].device)


def pretrain_critic(policy, ref, reward_model, critic, critic_opt, moments, prompt_batch, cfg: PPOConfig,
                    eos_id: int, pad_id: int, kl_coef: float, progress=lambda steps: steps) -> list[dict]:
    """PPO-max §5.3.3: before any policy update, fit V_φ to the returns of the initial policy's rollouts
    (same rewards and GAE targets PPO will use), one fresh rollout batch per round, until the loss plateaus
    (mean of the last 3 rounds within 5% of the 3 before) or `critic_pretrain_steps` rounds. `progress` wraps
    the rounds (a progress bar)."""
    log: list[dict] = []
    for it in progress(range(cfg.critic_pretrain_steps)):
        _, query, query_mask = prompt_batch()
        response, response_mask, _ = rollout(policy, query, query_mask, cfg.max_new_tokens, eos_id, pad_id,
                                             cfg.temperature)
        exp = make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                              moments, cfg, kl_coef)
        if exp["nonfinite"]:
            continue
        losses = []
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(len(response)).split(cfg.minibatch // world_size()):
                values = critic_values(critic, exp["query"][idx], exp["query_mask"][idx], exp["response"][idx],
                                       exp["mask"][idx])
                vf_loss, _ = value_loss(values, exp["values"][idx], exp["returns"][idx], exp["mask"][idx], None)
                backward_step(critic, critic_opt, vf_loss, cfg.grad_clip, "critic", [])
                losses.append(vf_loss.item())
        # averaged over the ranks, so that every rank takes the same early-stopping decision below
        log.append({"round": it, **all_mean({"loss/vf": sum(losses) / len(losses), "loss/vf_first": losses[0]},
                                            response.device)})
        l = [x["loss/vf"] for x in log]
        if len(l) >= 6 and sum(l[-3:]) > 0.95 * sum(l[-6:-3]):
            break
    return log


# ---------------------------------------------------------------------------------------------------------
# Plumbing of the recipe (skip on a first reading): the non-finite check every rank agrees on, and the logged
# numbers of steps (2)-(6). Nothing here changes what is trained.
# ---------------------------------------------------------------------------------------------------------
def sampled_kl(logprobs: Tensor, ref_logprobs: Tensor, cfg: PPOConfig) -> Tensor:
    """KL_t by --kl-estimator (k1/k2/k3 of ppo_loss.kl_sampled), clamped to ±--kl-clamp as OpenRLHF does; (B, T)."""
    kl = kl_sampled(logprobs, ref_logprobs, cfg.kl_estimator)                          # (B, T)
    return kl.clamp(-cfg.kl_clamp, cfg.kl_clamp) if cfg.kl_clamp else kl


def loss_conventions(cfg: PPOConfig) -> dict:
    """policy_loss's keyword arguments for the peers' conventions (--dual-clip, --log-ratio-clamp, --loss-agg)."""
    return dict(dual_clip=cfg.dual_clip or None, log_ratio_clamp=cfg.log_ratio_clamp or None, agg=cfg.loss_agg,
                max_len=cfg.max_new_tokens)


def check_finite(named: dict[str, Tensor | None]) -> str | None:
    """The name of the first tensor holding a NaN/inf (None when all are finite; None entries are skipped), the same
    on every rank: a rank that skipped an update alone would deadlock the others ("on another rank" where only
    another one saw it)."""
    named = {k: x for k, x in named.items() if x is not None}
    device = next(iter(named.values())).device
    bad = next((name for name, x in named.items() if not torch.isfinite(x).all()), None)
    return (bad or "on another rank") if any_rank(bad is not None, device) else None


@torch.no_grad()
def experience_stats(exp: dict, logits: Tensor, kl_exact: Tensor, rewards_seq: Tensor, rewards: Tensor) -> dict:
    """metrics.jsonl's numbers of steps (2)-(5) (docs/metrics.md defines each), averaged over the ranks."""
    mask, all_scores, advantages = exp["mask"], exp["all_scores"], exp["advantages"]
    stats = {
        "reward/score": all_scores.mean().item(),
        "reward/score_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
        "reward/normalized": rewards_seq.mean().item(),
        "reward/total": (rewards * mask).sum(1).mean().item(),
        "kl/ref": masked_mean(kl_exact, mask).item(),
        "kl/ref_k1": masked_mean(exp["logprobs"] - exp["ref_logprobs"], mask).item(),
        "kl/ref_seq": (kl_exact * mask).sum(1).mean().item(),
        "policy/perplexity": math.exp(-masked_mean(exp["logprobs"], mask).item()),
        "policy/entropy": masked_mean(entropy(logits), mask).item(),
        "response/length": mask.sum(1).mean().item(),
        "adv/mean": masked_mean(advantages, mask).item(),
        "adv/std": masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt().item(),
        "returns/mean": masked_mean(exp["returns"], mask).item(),
    }
    if exp["values"] is not None:  # a critic-free estimator has no values
        stats["values/mean"] = masked_mean(exp["values"], mask).item()
    return all_mean(stats, mask.device)


def minibatch_stats(pg_loss, vf_loss, ptx, kl_loss, pg_stats: dict, grad_norm, cfg: PPOConfig) -> dict:
    """Step (6)'s numbers of one minibatch; loss/vf only with a critic, loss/kl only with --kl-in loss."""
    stats = {"loss/pg": pg_loss.item(), **({"loss/vf": vf_loss.item()} if vf_loss is not None else {}),
             "loss/ptx": ptx.item(), "ppo/clipfrac": pg_stats["clipfrac"], "ppo/approx_kl": pg_stats["approx_kl"],
             "ppo/ratio": pg_stats["ratio"], "grad/norm": float(grad_norm)}
    if cfg.kl_in == "loss":
        stats["loss/kl"] = kl_loss.item()
    if "dual_clipfrac" in pg_stats:
        stats["ppo/dual_clipfrac"] = pg_stats["dual_clipfrac"]
    return stats  # the same numbers on every rank (the KL controller and the logs read them)


def update_stats(per_minibatch: list[dict], nonfinite: list[str], device) -> dict:
    """Step (6)'s logged numbers: each averaged over the minibatches and over the ranks, the count of skipped
    optimizer steps, and "guard/nonfinite" (what was NaN/inf, on any rank) when there were some."""
    stats = {k: sum(s[k] for s in per_minibatch) / len(per_minibatch) for k in per_minibatch[0]}
    stats["guard/skipped_updates"] = float(len(nonfinite))
    stats = all_mean(stats, device)
    if any_rank(bool(nonfinite), device):
        return {**stats, "guard/nonfinite": sorted(set(nonfinite)) or ["on another rank"]}
    return stats


if __name__ == "__main__":
    torch.set_printoptions(precision=5, sci_mode=False)
    # 1. Two rollout batches of reward-model scores; the second is the current one.
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))  # an earlier batch
    scores = torch.tensor([2.5, 5.0], dtype=torch.float64)  # this batch, B = 2
    moments.update(scores)  # update first, then normalize (the recipe's order)
    print(moments)
    print("Eq. 18, δ=0.8:", normalize_and_clip_rewards(scores, moments, 0.8))
    print("no clip:      ", normalize_and_clip_rewards(scores, moments, None))
    print("scaling:      ", scale_rewards(scores, moments))
    # 2. Eq. 19 on a 3-token and a 2-token response (T = 3), η = 0.05, k1 KL from the sampled log-probs.
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -9.0]], dtype=torch.float64)
    ref_logprobs = torch.tensor([[-1.2, -0.5, -1.0], [-0.4, -1.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    r_tilde = normalize_and_clip_rewards(scores, moments, 0.8)
    print("rewards:\n", shape_rewards(r_tilde, logprobs, ref_logprobs, mask, kl_coef=0.05))
    # Printed (tests/test_ppo_max_scores.py checks these numbers):
    # RunningMoments(count=5, mean=2.7, std=1.32665)
    # Eq. 18, δ=0.8: tensor([-0.15076,  0.80000], dtype=torch.float64)
    # no clip:       tensor([-0.15076,  1.73369], dtype=torch.float64)
    # scaling:       tensor([1.88445, 3.76889], dtype=torch.float64)
    # rewards:
    #  tensor([[-0.01000,  0.00000, -0.10076],
    #         [-0.01000,  0.82500,  0.00000]], dtype=torch.float64)
