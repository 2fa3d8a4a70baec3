"""PPO-max: how a reward-model score becomes per-token rewards (this half), and the training recipe (below it).

Implements (equation numbers of Zheng et al. 2023, arXiv 2307.04964):
    RunningMoments                                                   → historical mean/std used by Eq. 18
    normalize_and_clip_rewards(scores, moments, clip_delta)          → Eq. 18  r̃ = clip((r − mean)/std, −δ, δ)
    scale_rewards(scores, moments)                                   → "reward scaling" ablation (Fig. 6): r / std
    shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl) → Eq. 19  r_t = −η KL_t, + score on the last token
                                                                       (its inputs checked by check_shaping_inputs)
    overlong_penalty(lengths, max_new_tokens, buffer, penalty)       → DAPO's soft length penalty before T_max
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
    Yu et al. 2025, "DAPO", arXiv 2503.14476 (overlong reward shaping).
"""
import dataclasses
import math

import torch
from torch import Tensor

# the recipe half (below the score half) builds on the equation files; its models step through plumbing/engine.py
# (one process or DeepSpeed) and its logged numbers are plumbing/monitor.py's
import critic_free
from gae import adaptive_lam, compute_gae, compute_gae_decoupled
from plumbing.config import PPOConfig
from plumbing.data import position_ids_from_mask
from plumbing.engine import all_mean, all_sum, backward_step, gather_batch, in_micro_batches, set_lr, world_size
from plumbing.monitor import check_finite, experience_stats, minibatch_stats, update_stats
from reward_model import last_token_index
from ppo_loss import (aggregate, cispo_loss, entropy, entropy_bonus_loss, kl_full, kl_sampled, logprobs_from_logits,
                      masked_whiten, policy_loss, ptx_loss, rollout_correction, rollout_mismatch, value_loss)

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

    This is what the authors' released scripts enable (docs/differences.md); the paper finds it ≈ vanilla PPO.
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
    action that ended the episode and the score judges the whole sequence it completed. Some peers (some trl
    versions; docs/differences.md) put the score one position later, on the pad/EOS-following slot; with a
    right-padded mask that position is masked out (the score is silently lost to GAE and the loss), and making it
    count needs a terminal pseudo-token whose value the critic must also learn. We do not.
    """
    check_shaping_inputs(scores, logprobs, ref_logprobs, mask, kl)  # a silent broadcast would corrupt Eq. 19
    B = mask.shape[0]
    last = last_token_index(mask)  # (B,) index of the last real response token (reward_model.py)
    if kl is None:
        kl = logprobs - ref_logprobs  # (B, T) KL_t ≈ log π_RL(y_t) − log π_SFT(y_t)   (k1)
    non_score_reward = torch.where(mask != 0, -kl_coef * kl, 0.0)  # (B, T) −η KL_t   (Eq. 19), 0 at padding
    score_reward = torch.zeros_like(non_score_reward)  # (B, T)
    score_reward[torch.arange(B, device=mask.device), last] = scores.to(score_reward)  # r(x, y) at the end
    rewards = non_score_reward + score_reward  # r_t = r(x, y)·[t = last] − η KL_t   (Eq. 19)
    return rewards


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, one value per response, (B,) float, to add to its score:

        R_length(y) = 0                                     |y| ≤ L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
                    = −1                                    |y| > L_max
    times `penalty` (1.0 is the paper's R_length). lengths: |y| (B,), e.g. mask.sum(1); max_new_tokens: L_max;
    buffer: L_cache, 1 ≤ L_cache ≤ L_max. The penalty falls linearly from 0 to −penalty over the last L_cache tokens.
    """
    if not 1 <= buffer <= max_new_tokens or penalty < 0:
        raise ValueError(f"ppo_max.overlong_penalty: need 1 <= buffer <= max_new_tokens and penalty >= 0, got "
                         f"buffer={buffer}, max_new_tokens={max_new_tokens}, penalty={penalty}")
    expected = max_new_tokens - buffer  # L_max − L_cache, the length past which the penalty starts
    excess = (lengths.to(torch.get_default_dtype()) - expected) / buffer  # (|y| − (L_max − L_cache)) / L_cache
    return 0.0 - penalty * excess.clamp(0.0, 1.0)  # R_length(y) · penalty   (DAPO); 0.0 − … : +0, not −0, below


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
# The recipe: the pieces of one PPO iteration (train.py runs the loop; plumbing/config.py holds PPOConfig, every
# trick a field, and the presets)
# =========================================================================================================
def warmup(step: int, steps: int, warmup_frac: float) -> float:
    """Step (0): the learning rates' scale at PPO step `step` of `steps`, a linear warm-up over the first
    ⌈warmup_frac·steps⌉ steps (the paper: 10 %; PPO-max replaces it by critic pre-training, warmup_frac 0), then 1."""
    warmup_steps = math.ceil(warmup_frac * steps)
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


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


def response_logprobs(policy, ref, query, query_mask, response, response_mask, temperature: float = 1.0) -> tuple:
    """Step (4)'s per-token numbers of the sampled responses, each (B, T): log π(y_t), log π_ref(y_t), the exact
    KL(π ‖ π_ref) at each position and π's entropy there, from the two models' fp32 logits (B, T, V), which are
    dropped on return: make_experience runs this --generate-batch rows at a time, so the full-vocabulary logits of
    the whole rollout batch never exist at once."""
    logits = policy_logits(policy, query, query_mask, response, response_mask, temperature)   # (B, T, V)
    ref_logits = policy_logits(ref, query, query_mask, response, response_mask, temperature)  # (B, T, V)
    return (logprobs_from_logits(logits, response), logprobs_from_logits(ref_logits, response),
            kl_full(logits, ref_logits), entropy(logits))


def critic_values(critic, query, query_mask, response, response_mask) -> torch.Tensor:
    """V(s_t) for every response token t, read at the position that predicts it (the state before the action)."""
    P = query.shape[1]
    values = critic(torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1))  # (B, L)
    return values[:, P - 1:-1].float()                                                         # (B, T)


def rollout(policy, query, query_mask, max_new_tokens: int, eos_id: int, pad_id: int, temperature: float = 1.0,
            top_p: float = 1.0, repetition_penalty: float = 1.0, return_logprobs: bool = False,
            generate_batch: int = 0):
    """Step 1: sample responses with the KV cache, stopping at EOS, the policy in eval mode (it stays in it).
    Returns response (B, T), response_mask (B, T), finished (B,) — T ≤ max_new_tokens; the mask covers every token
    up to and including the first EOS. Sampling draws from softmax(logits / temperature) over the whole vocabulary
    (top_p and repetition_penalty as given, 1.0: off), whatever the model's generation_config.json says: its own
    settings (no_repeat_ngram_size, min_new_tokens, typical_p, forced_eos_token_id, ...) are set aside for the call,
    so the log-probs of steps (4) and (6) are those of the distribution that was sampled. With return_logprobs, a
    fourth tensor (B, T): the log-probability of each sampled token under the distribution it was drawn from, as the
    sampler computed it (generate's processed scores: temperature, top_p; 0 at padding). generate_batch = n > 0
    (--generate-batch): the prompts n at a time, each micro-batch with its own KV cache, the responses right-padded
    to the longest (a batched sampler's draws depend on the batch, so these are other samples of the same
    distribution)."""
    if 0 < generate_batch < len(query):
        parts = [rollout(policy, q, m, max_new_tokens, eos_id, pad_id, temperature, top_p, repetition_penalty,
                         return_logprobs) for q, m in zip(query.split(generate_batch), query_mask.split(generate_batch))]
        T = max(p[0].shape[1] for p in parts)
        pad = lambda x, fill: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=fill)  # noqa: E731  (n, T)
        return (torch.cat([pad(p[0], pad_id) for p in parts]), torch.cat([pad(p[1], 0.0) for p in parts]),
                torch.cat([p[2] for p in parts]), *([torch.cat([pad(p[3], 0.0) for p in parts])] if return_logprobs
                                                    else []))
    from transformers import GenerationConfig
    policy.eval()
    hf = [mod for mod in policy.modules() if isinstance(vars(mod).get("generation_config"), GenerationConfig)]
    saved = [mod.generation_config for mod in hf]
    for mod in hf:
        mod.generation_config = GenerationConfig()  # the library's defaults; the call's arguments set the rest
    try:
        with torch.no_grad():
            out = policy.generate(input_ids=query, attention_mask=query_mask, do_sample=True, top_k=0, top_p=top_p,
                                  temperature=temperature, repetition_penalty=repetition_penalty,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
                                  use_cache=True, **({"output_scores": True, "return_dict_in_generate": True}
                                                     if return_logprobs else {}))
    finally:
        for mod, config in zip(hf, saved):
            mod.generation_config = config
    seq = out.sequences if return_logprobs else out                             # (B, P + T)
    response = seq[:, query.shape[1]:]                                          # (B, T)
    is_eos = response == eos_id
    # positions strictly after the first EOS are padding
    after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0                   # (B, T)
    response_mask = (~after_eos).float()
    response = response.masked_fill(after_eos, pad_id)
    finished = is_eos.any(1)
    if not return_logprobs:
        return response, response_mask, finished
    scores = torch.stack(out.scores, 1).float()                                 # (B, T, V) what was sampled from
    sampled = logprobs_from_logits(scores, response)                            # (B, T) log π_rollout(y_t)
    return response, response_mask, finished, torch.where(response_mask != 0, sampled, 0.0)


class Sampler:
    """Step (1): responses for a batch of prompts, and what the sampler saw: (response, response_mask (B, T),
    finished (B,), sampled = {"logprobs": the sampler's own log π_rollout(y_t) (B, T) or None, "stats": ...}).

    --rollout-mismatch none: the policy itself (rollout). Otherwise a path that differs from the trainer's in one
    known way, whose own per-token log-probs are kept, so that steps (2)-(6) can measure and correct the mismatch:
      bf16   a bf16 copy of the policy, its weights copied from the policy before every rollout
      top-p  the policy, sampling from its nucleus (p = MISMATCH_TOP_P, renormalised): the trainer's log-probs are
             those of the full distribution
      stale  the weights of the step before (copied before each update), as an asynchronous run samples
    With --rollout-correction alone the sampler's log-probs are the policy's own along generate's KV-cache path:
    the trainer's up to float rounding. refill() is DAPO's dynamic sampling (--dynamic-sampling)."""

    MISMATCH_TOP_P = 0.9

    def __init__(self, cfg: PPOConfig, eos_id: int, pad_id: int):
        self.cfg, self.eos_id, self.pad_id, self.copy = cfg, eos_id, pad_id, None
        self.keep_logprobs = cfg.rollout_mismatch != "none" or cfg.rollout_correction != "none"

    def __call__(self, policy, query, query_mask):
        cfg = self.cfg
        kw = dict(max_new_tokens=cfg.max_new_tokens, eos_id=self.eos_id, pad_id=self.pad_id,
                  temperature=cfg.temperature, generate_batch=cfg.generate_batch)
        if not self.keep_logprobs:  # the default: the policy samples, its log-probs are the trainer's (steps 4, 6)
            return (*rollout(policy, query, query_mask, **kw), {"logprobs": None, "stats": {}})
        sampler = self.sampler_model(policy)
        top_p = self.MISMATCH_TOP_P if cfg.rollout_mismatch == "top-p" else 1.0
        response, response_mask, finished, logprobs = rollout(sampler, query, query_mask, **kw, top_p=top_p,
                                                              return_logprobs=True)
        if cfg.rollout_mismatch == "stale":  # the next step samples with the weights of this one, before its update
            self.copy_weights(policy)
        return response, response_mask, finished, {"logprobs": logprobs, "stats": {}}

    def sampler_model(self, policy):
        """The model that samples: the policy (none, top-p), its bf16 copy refreshed now, or the stale copy."""
        from plumbing.engine import unwrap
        mode = self.cfg.rollout_mismatch
        if mode in ("none", "top-p"):
            return policy
        if self.copy is None:  # the first step: a copy of the policy as it starts (stale: no step before it)
            import copy
            self.copy = copy.deepcopy(unwrap(policy)).to(torch.bfloat16 if mode == "bf16" else None)
        if mode == "bf16":
            self.copy_weights(policy)
        return self.copy

    def copy_weights(self, policy) -> None:
        """The policy's weights into the sampler's copy (cast to its dtype)."""
        from plumbing.engine import unwrap
        with torch.no_grad():
            for dst, src in zip(self.copy.parameters(), unwrap(policy).parameters()):
                dst.copy_(src)

    def refill(self, policy, reward_model, batches, prompts, query, query_mask, response, response_mask, finished,
               sampled, rounds: int = 8):
        """DAPO's dynamic sampling: the groups (G responses to one prompt) whose proxy scores do not spread
        (critic_free.dynamic_sampling, max − min ≤ 1e-6: every advantage of the group would be 0) are dropped, and
        groups of new prompts sampled and scored until the batch is full again, at most `rounds` more rollouts;
        groups still missing then are filled with dropped ones (dynamic/short counts them). Returns (prompts, query,
        query_mask, response, response_mask, finished, sampled) of the same sizes, sampled["stats"] counting
        dynamic/dropped (groups) and dynamic/rounds. Under DeepSpeed each rank refills its own share."""
        G, B = self.cfg.group_size, len(prompts)
        batch = (prompts, query, query_mask, response, response_mask, finished, sampled["logprobs"])
        kept, dropped, n = [], [], 0
        for n in range(rounds + 1):
            p, q, qm, r, rm, f, lp = batch
            with torch.no_grad():
                scores = in_micro_batches(self.cfg.generate_batch, reward_model.score, torch.cat([q, r], 1),
                                          torch.cat([qm, rm], 1)).float()                           # (b,)
            spread = critic_free.dynamic_sampling(scores, G, tol=1e-6)                            # (b/G,)
            for g, ok in enumerate(spread.tolist()):
                rows = slice(g * G, (g + 1) * G)
                (kept if ok else dropped).append((p[rows], q[rows], qm[rows], r[rows], rm[rows], f[rows],
                                                  None if lp is None else lp[rows]))
            if len(kept) * G >= B or n == rounds:
                break
            p, q, qm = batches.prompts(self.cfg.rollout_batch, G)   # this rank's share of a new batch of prompts
            r, rm, f, s = self(policy, q, qm)
            batch = (p, q, qm, r, rm, f, s["logprobs"])
        groups = (kept + dropped)[:B // G]   # groups with spread first; short of them, dropped ones fill the batch
        stats = {"dynamic/dropped": float(len(dropped)), "dynamic/rounds": float(n),
                 "dynamic/short": float(max(0, B // G - len(kept)))}
        prompts, query, query_mask, response, response_mask, finished, logprobs = self.stack(groups)
        return (prompts, query, query_mask, response, response_mask, finished,
                {"logprobs": logprobs, "stats": {**sampled["stats"], **stats}})

    def stack(self, groups: list[tuple]) -> tuple:
        """Groups of (prompts, query, query_mask, response, response_mask, finished, logprobs or None) as one batch:
        queries left-padded to the longest, responses right-padded (padding as rollout's: pad id, mask 0)."""
        import torch.nn.functional as F
        P, T = max(g[1].shape[1] for g in groups), max(g[3].shape[1] for g in groups)
        left = lambda x, fill: F.pad(x, (P - x.shape[1], 0), value=fill)    # noqa: E731  (b, P)
        right = lambda x, fill: F.pad(x, (0, T - x.shape[1]), value=fill)   # noqa: E731  (b, T)
        return ([x for g in groups for x in g[0]], torch.cat([left(g[1], self.pad_id) for g in groups]),
                torch.cat([left(g[2], 0.0) for g in groups]), torch.cat([right(g[3], self.pad_id) for g in groups]),
                torch.cat([right(g[4], 0.0) for g in groups]), torch.cat([g[5] for g in groups]),
                None if groups[0][6] is None else torch.cat([right(g[6], 0.0) for g in groups]))



def make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                    moments: "RunningMoments", cfg: PPOConfig, kl_coef: float, sampled: dict | None = None) -> dict:
    """Steps (2)-(5) of a PPO iteration on one rollout batch, computed once, without grad. Returns the batch's
    tensors (query, response, mask, logprobs, ref_logprobs, values, advantages, returns, scores, kl_coef), "stats"
    (the logged numbers) and "nonfinite" (None, or the name of the first NaN/inf value: the update is then skipped).
    With W data-parallel ranks "all_scores" (W·B,) is every rank's scores, so Eq. 18's moments see them all.
    With a critic-free --advantage, `critic` is None and "values" too: step (5) is critic_free.advantages.
    `sampled` is what the Sampler saw: with its own log-probs (--rollout-mismatch, --rollout-correction) the batch
    also holds the mismatch (mismatch/*) and the correction's "weights" and "policy_mask" (step 6's policy loss).
    The models read the batch --generate-batch rows at a time (g = cfg.generate_batch; 0 = all at once):
    in_micro_batches(g, f, ...) is f on the whole batch, computed g rows at a time."""
    g = cfg.generate_batch
    with torch.no_grad():  # targets and baselines: nothing here is differentiated
        mask = response_mask                                                           # (B, T)
        full_ids = torch.cat([query, response], 1)                                     # (B, L)
        full_mask = torch.cat([query_mask, response_mask], 1)                          # (B, L)
        # (2) score: the reward model reads the last real token of prompt + response
        scores = in_micro_batches(g, reward_model.score, full_ids, full_mask).float()  # (B,)
        all_scores = gather_batch(scores, cfg.group_size)  # (W·B,) every rank's scores (W = 1: scores itself)
        if bad := check_finite({"reward/score": all_scores}):  # before Eq. 18: one NaN would poison the moments
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
        overlong = None
        if cfg.overlong_buffer:  # DAPO's overlong shaping, on the normalised score: −P·(how far into the last L tokens)
            overlong = overlong_penalty(mask.sum(1), cfg.max_new_tokens, cfg.overlong_buffer,
                                        cfg.overlong_penalty).to(rewards_seq)                   # (B,) ≤ 0
            rewards_seq = rewards_seq + overlong
        # (4) token-level KL penalty against the frozen SFT reference (Eq. 19); with --kl-in loss it acts in (6)
        #     log π(y_t), log π_ref(y_t), the exact KL(π ‖ π_ref) and π's entropy at each position: (B, T) each
        logprobs, ref_logprobs, kl_exact, ent = in_micro_batches(
            g, response_logprobs, policy, ref, query, query_mask, response, response_mask, cfg.temperature)
        kl_pen = kl_exact if cfg.kl_estimator == "full" else sampled_kl(logprobs, ref_logprobs, cfg)   # (B, T)
        eta = kl_coef if cfg.kl_in == "reward" else 0.0                                # η of Eq. 19
        rewards = shape_rewards(rewards_seq, logprobs, ref_logprobs, mask, eta, kl=kl_pen)  # (B, T)
        # (5) advantages: values and GAE (Eq. 9), returns = advantages + values the critic's targets (Eq. 16);
        #     or without a critic, from the group of G responses per prompt or the batch (critic_free.py)
        if cfg.advantage == "gae":
            values = in_micro_batches(g, critic_values, critic, query, query_mask, response, response_mask) * mask  # (B, T)
            # λ_policy: --lam, or VAPO's 1 − 1/(α·l) per response; λ_critic of the returns: the same, or --lam-critic
            lam = adaptive_lam(mask.sum(1), cfg.lam_adaptive) if cfg.lam_adaptive else cfg.lam       # scalar or (B,)
            if cfg.lam_critic is None:
                advantages, returns = compute_gae(rewards, values, mask, cfg.gamma, lam)
            else:  # decoupled λ (VC-PPO, VAPO): advantages of λ_policy, value targets of λ_critic
                advantages, returns = compute_gae_decoupled(rewards, values, mask, cfg.gamma, lam, cfg.lam_critic)
        else:
            values = None
            advantages, returns = critic_free.advantages(cfg.advantage, rewards, mask, cfg.group_size, cfg.gamma,
                                                         all_sum)  # (B, T), (B, T)
        exp = {"query": query, "query_mask": query_mask, "response": response, "mask": mask, "logprobs": logprobs,
               "ref_logprobs": ref_logprobs, "values": values, "advantages": advantages, "returns": returns,
               "scores": scores, "all_scores": all_scores, "kl_coef": kl_coef, "nonfinite": None,
               "weights": None, "policy_mask": mask}
        extra = dict((sampled or {}).get("stats", {}))
        if overlong is not None:  # the share of responses the overlong shaping penalised (inside the last L tokens)
            extra["overlong/share"] = (overlong < 0).float().mean().item()
        rollout_logprobs = (sampled or {}).get("logprobs")
        if rollout_logprobs is not None:  # the sampler's log π_rollout against the trainer's log π_old (= logprobs)
            extra.update({f"mismatch/{k}": v for k, v in rollout_mismatch(logprobs, rollout_logprobs, mask).items()})
            if cfg.rollout_correction != "none":  # TIS weights, or MIS's mask, for step (6)'s policy loss
                exp["weights"], exp["policy_mask"], corr = rollout_correction(
                    logprobs, rollout_logprobs, mask, cfg.rollout_correction, cfg.rollout_correction_cap,
                    cfg.rollout_correction_level)
                extra.update({f"correction/{k}": v for k, v in corr.items()})
        # the guard (every rank skips together) and the logged numbers; neither changes the batch
        if bad := check_finite({"logprobs": logprobs, "values": values, "advantages": advantages}):
            return {**exp, "nonfinite": bad, "stats": {}}
        exp["stats"] = experience_stats(exp, ent, kl_exact, rewards_seq, rewards)
        if extra:  # the sampler's and the correction's numbers (the same keys on every rank)
            exp["stats"].update(all_mean(extra, mask.device))
        return exp


def ppo_update(policy, critic, policy_opt, critic_opt, exp: dict, cfg: PPOConfig, ptx_batch,
               lr_scale: float | None = None) -> dict:
    """Step (6): `ppo_epochs` passes over the rollout batch in shuffled minibatches, the models in train mode, the
    learning rates at lr_scale × --policy-lr / --critic-lr (step (0)'s warm-up; None: as the optimizers hold them).
    Returns the mean stats.

    With W data-parallel ranks each rank holds B = rollout_batch / W sequences and takes minibatch / W of them per
    step; the engines average the gradients, so each optimizer step still sees `minibatch` sequences."""
    B = exp["response"].shape[0]
    for model, opt, lr in ((policy, policy_opt, cfg.policy_lr), (critic, critic_opt, cfg.critic_lr)):
        if model is not None:  # no critic with a critic-free --advantage
            model.train()
            if lr_scale is not None:
                set_lr(opt, lr * lr_scale)
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
            # the rollout correction's token weights and the tokens it keeps (none: every response token, weight 1)
            w, pm = exp.get("weights"), exp.get("policy_mask", exp["mask"])[idx]
            weights = None if w is None else w[idx]
            if cfg.policy_loss == "cispo":  # a clipped, detached weight on every token's log π_θ (MiniMax-M1)
                pg_loss, pg_stats = cispo_loss(logprobs, old_logprobs[idx], advantages, pm, cfg.cispo_eps_low,
                                               cfg.cispo_eps_high, weights=weights, agg=cfg.loss_agg,
                                               max_len=cfg.max_new_tokens)
            else:  # Eq. 15, with clip-higher, GSPO's ratio and the rollout correction where the flags ask for them
                pg_loss, pg_stats = policy_loss(logprobs, old_logprobs[idx], advantages, pm, cfg.clip_eps or None,
                                                weights=weights, **loss_conventions(cfg))
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
                vf_loss = critic_step(critic, critic_opt, exp, idx, cfg.value_clip or None, cfg.vf_coef,
                                      cfg.grad_clip, nonfinite)
            stats.append(minibatch_stats(pg_loss, vf_loss, ptx, kl_loss, pg_stats, grad_norm, cfg))
    return update_stats(stats, nonfinite, exp["scores"].device)


def critic_step(critic, critic_opt, exp: dict, idx: Tensor, value_clip: float | None, vf_coef: float,
                grad_clip: float, nonfinite: list[str]) -> Tensor:
    """One optimizer step of the critic on the minibatch `idx` of a rollout batch: Eq. 16's value loss against the
    returns, clipped to ±value_clip around the rollout's values (None: unclipped), weighted by vf_coef. Returns
    the loss. Step (6) and critic pre-training (§5.3.3) both take it."""
    q, qm, r, m = exp["query"][idx], exp["query_mask"][idx], exp["response"][idx], exp["mask"][idx]
    values = critic_values(critic, q, qm, r, m)                                         # (b, T)
    vf_loss, _ = value_loss(values, exp["values"][idx], exp["returns"][idx], m, value_clip)
    backward_step(critic, critic_opt, vf_coef * vf_loss, grad_clip, "critic", nonfinite)
    return vf_loss


def pretrain_critic(policy, ref, reward_model, critic, critic_opt, moments, prompt_batch, cfg: PPOConfig,
                    eos_id: int, pad_id: int, kl_coef: float, progress=lambda steps: steps) -> list[dict]:
    """PPO-max §5.3.3: before any policy update, fit V_φ to the returns of the initial policy's rollouts
    (same rewards and GAE targets PPO will use), one fresh rollout batch per round, until the loss plateaus
    (mean of the last 3 rounds within 5% of the 3 before) or `critic_pretrain_steps` rounds. `progress` wraps
    the rounds (a progress bar). --critic-pretrain-target returns: the targets are the Monte-Carlo returns of the SFT
    policy (λ = 1, VC-PPO), whatever --lam is."""
    log: list[dict] = []
    if cfg.critic_pretrain_target == "returns":  # GAE(γ, 1)'s returns: Σ_l γ^l r_{t+l}   (Eq. 11)
        cfg = dataclasses.replace(cfg, lam_critic=1.0)
    for it in progress(range(cfg.critic_pretrain_steps)):
        _, query, query_mask = prompt_batch()
        response, response_mask, _ = rollout(policy, query, query_mask, cfg.max_new_tokens, eos_id, pad_id,
                                             cfg.temperature, generate_batch=cfg.generate_batch)
        exp = make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                              moments, cfg, kl_coef)
        if exp["nonfinite"]:
            continue
        losses = []
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(len(response)).split(cfg.minibatch // world_size()):
                vf_loss = critic_step(critic, critic_opt, exp, idx, None, 1.0, cfg.grad_clip, [])  # Eq. 16
                losses.append(vf_loss.item())
        # averaged over the ranks, so that every rank takes the same early-stopping decision below
        log.append({"round": it, **all_mean({"loss/vf": sum(losses) / len(losses), "loss/vf_first": losses[0]},
                                            response.device)})
        l = [x["loss/vf"] for x in log]
        if len(l) >= 6 and sum(l[-3:]) > 0.95 * sum(l[-6:-3]):
            break
    return log


# ---------------------------------------------------------------------------------------------------------
# The penalty's estimator and the peers' conventions, as the flags set them
# ---------------------------------------------------------------------------------------------------------
def sampled_kl(logprobs: Tensor, ref_logprobs: Tensor, cfg: PPOConfig) -> Tensor:
    """KL_t by --kl-estimator (k1/k2/k3 of ppo_loss.kl_sampled), clamped to ±--kl-clamp when set; (B, T)."""
    kl = kl_sampled(logprobs, ref_logprobs, cfg.kl_estimator)                          # (B, T)
    return kl.clamp(-cfg.kl_clamp, cfg.kl_clamp) if cfg.kl_clamp else kl


def loss_conventions(cfg: PPOConfig) -> dict:
    """policy_loss's keyword arguments for the peers' conventions (--dual-clip, --log-ratio-clamp, --loss-agg) and the
    newer tricks (--clip-eps-high, --ratio)."""
    return dict(dual_clip=cfg.dual_clip or None, log_ratio_clamp=cfg.log_ratio_clamp or None, agg=cfg.loss_agg,
                max_len=cfg.max_new_tokens, clip_eps_high=cfg.clip_eps_high, ratio_level=cfg.ratio)


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
