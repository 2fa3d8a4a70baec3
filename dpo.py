"""DPO as its own stage: the policy trained on the preference pairs directly, with no reward model and no sampling.

Implements (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"):
    dpo_loss(pi_w, pi_l, ref_w, ref_l, beta)      → Eq. 7: −log σ(β[(log π(y_w|x) − log π_ref(y_w|x))
                                                                    − (log π(y_l|x) − log π_ref(y_l|x))])
                                                      and its implicit rewards r̂ = β·log(π(y|x)/π_ref(y|x)) (Eq. 5)
    sequence_logprobs(model, ids, attn, response_mask) → log π(y|x) = Σ_t log π(y_t | x, y_<t) over response tokens
    DPOConfig                                     → --dpo-beta β (0.1, as the paper and TRL), --dpo-lr, --dpo-epochs,
                                                      --dpo-batch
    train_dpo(model, tokenizer, pairs, heldout, cfg, seed, ds=)
                                                  → the stage: π_ref = the SFT model the policy starts from (its
                                                      log-probs computed once, before the first step, from the model
                                                      itself), AdamW with cosine decay, gradient clip 1.0; the
                                                      held-out implicit-reward accuracy along the way

Run: python train.py --method dpo        (SFT and the reward model as always; DPO instead of critic + PPO; the same
                                          held-out evaluation under gold)
     python dpo.py                       (prints the worked example at the end of this file)

The pairs are the ones the reward model of stage 2 trains on (the synthetic world's pairs_train, or --data's proxy
split), so DPO and PPO see the same preferences; the judge (gold, or the held-out reward model) never trains
either. The file has two halves, like reward_model.py: the loss half imports only torch; the stage half, below its
banner, uses the project's batching and DeepSpeed plumbing. Any Hugging Face causal LM, LoRA (the reference is then
the same weights with the adapters at B = 0, i.e. the SFT model) and DeepSpeed engines, like sft.py.

References: Rafailov et al. 2023 (DPO), Eq. 5 and 7; TRL trl/trainer/dpo_trainer.py (loss_type "sigmoid", the
reference log-probs precomputed); OpenRLHF openrlhf/models/loss.py DPOLoss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, beta: float) -> tuple[Tensor, dict[str, float]]:
    """Eq. 7 as a loss to minimise, mean over the B pairs; every argument is log π(y|x) summed over the response, (B,).

    logits = β·[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))]; loss = −log σ(logits), computed with
    logsigmoid (finite for any margin). At π = π_ref the loss is log 2. stats: the implicit rewards' accuracy
    (r̂_w > r̂_l, ties ½ as reward_model.accuracy), their mean margin, and the two means.
    """
    shapes = {t.shape for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"dpo.dpo_loss: expected four (B,) tensors of one shape, got {sorted(map(tuple, shapes))}")
    chosen = beta * (policy_chosen_logps - ref_chosen_logps.detach())        # r̂(x, y_w) = β log π/π_ref   (Eq. 5)
    rejected = beta * (policy_rejected_logps - ref_rejected_logps.detach())  # r̂(x, y_l)
    logits = chosen - rejected                                               # β[(…)_w − (…)_l]
    loss = -F.logsigmoid(logits).mean()                                      # −log σ(·)   (Eq. 7)
    with torch.no_grad():
        margin = logits.detach()
        stats = {"accuracy": ((margin > 0).double() + 0.5 * (margin == 0).double()).mean().item(),
                 "margin": margin.mean().item(), "chosen_reward": chosen.mean().item(),
                 "rejected_reward": rejected.mean().item()}
    return loss, stats


def response_logprob_sum(logits: Tensor, input_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Σ_t log π(y_t | x, y_<t) over the response tokens of each sequence, (B,): logits[:, t] predict input_ids[:, t+1]
    and the mask is read on the predicted token (as reward_model.response_lm_loss). Padding never reaches the sum,
    even when its logits are inf or NaN. (B, L, V), (B, L), (B, L) → (B,)."""
    logp = F.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (B, L−1, V)
    token = torch.gather(logp, -1, input_ids[:, 1:, None]).squeeze(-1)      # (B, L−1) log π(x_{t+1} | x_≤t)
    return torch.where(response_mask[:, 1:] != 0, token, 0.0).sum(dim=1)     # (B,)


# ======================================================================================================
# Stage half: the DPO stage on a Hugging Face causal LM (one process or a DeepSpeed engine)
# ======================================================================================================
from pathlib import Path  # noqa: E402

from plumbing import data, engine, lora  # noqa: E402
from plumbing.config import DPOConfig  # noqa: E402  (--dpo-beta, --dpo-lr, --dpo-epochs, --dpo-batch)
from plumbing.data import position_ids_from_mask  # noqa: E402
from plumbing.engine import supervised_stage  # noqa: E402


def sequence_logprobs(model, ids: Tensor, attn: Tensor, response_mask: Tensor) -> Tensor:
    """log π(y|x) of right-padded (prompt + response) rows, (B,); position ids from the mask."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                   use_cache=False).logits                                   # (B, L, V)
    return response_logprob_sum(logits, ids, response_mask)                  # (B,)


@torch.no_grad()
def pair_logprobs(model, tokenizer, rows: list[dict], batch: int = 64) -> tuple[Tensor, Tensor]:
    """(log π(y_w|x), log π(y_l|x)) of {"prompt", "chosen", "rejected"} rows, each (N,), in eval mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ids, attn, resp = (t.to(device) for t in data.pair_batch(chunk, tokenizer))  # (2b, L): chosen, then rejected
        s = sequence_logprobs(model, ids, attn, resp).float()                         # (2b,)
        chosen.append(s[:len(chunk)])
        rejected.append(s[len(chunk):])
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def train_dpo(model, tokenizer, pairs: list[dict], heldout: list[dict], cfg: DPOConfig, seed: int,
              ds: dict | None = None, out_dir: str | Path | None = None, progress=None) -> list[dict]:
    """The DPO stage on {"prompt", "chosen", "rejected"} rows. π_ref is `model` as it comes in (the SFT model, or
    LoRA adapters at B = 0 on it): its log-probs of every pair are computed once before the first step, so no second
    copy is held. Returns the log [{"step", "heldout_accuracy", "heldout_loss", "train": [stats per step]}]; the
    model is trained in place, left in eval mode, and saved with its tokenizer at `out_dir` when one is given."""
    # π_ref's log-probs of every pair, once, in eval mode (dropout does not act): π_ref = π_SFT, (N,) each
    ref_w, ref_l = pair_logprobs(model, tokenizer, pairs)
    held_ref = pair_logprobs(model, tokenizer, heldout)
    encoded = data.encode_pairs(pairs, tokenizer)  # every pair encoded once: (query, chosen, rejected) ids
    # dropout off (log π and log π_ref from one deterministic network), AdamW, the engine, seeded epochs of pair
    # batches: ids, attn, resp (2B, L), chosen first
    stage = supervised_stage(model, encoded, cfg.dpo_epochs, cfg.dpo_batch, cfg.dpo_lr, seed, data.pair_batch_of_ids,
                             tokenizer.pad_token_id, ds)
    steps, log = stage.steps, []
    bar = (progress or (lambda r, *_: r))(range(steps + 1), "DPO")
    for step in bar:
        if step % cfg.dpo_eval_every == 0 or step == steps:  # held-out pairs: how often r̂_w > r̂_l
            pol = pair_logprobs(model, tokenizer, heldout)
            loss, stats = dpo_loss(pol[0], pol[1], held_ref[0].to(pol[0]), held_ref[1].to(pol[0]), cfg.dpo_beta)
            log.append({"step": step, "heldout_accuracy": stats["accuracy"], "heldout_loss": loss.item()})
        if step == steps:
            break
        stage.trained.train()
        idx, ids, attn, resp = next(stage.batches)                                                       # (2B, L)
        B = len(idx)
        logps = sequence_logprobs(stage.trained, ids, attn, resp)                                        # (2B,)
        loss, stats = dpo_loss(logps[:B], logps[B:], ref_w[idx].to(logps), ref_l[idx].to(logps), cfg.dpo_beta)
        engine.set_lr(stage.opt, engine.cosine_lr(step, steps, cfg.dpo_lr))
        engine.backward_step(stage.trained, stage.opt, loss, 1.0, "dpo", [])
        log[-1].setdefault("train", []).append(engine.all_mean({"loss": loss.item(), **stats}, stage.device))
    engine.release(stage.trained)  # under DeepSpeed: the engine's memory back before the next stage
    model.eval()
    if out_dir is not None and stage.rank == 0:  # LoRA: out_dir/adapter/ and the merged model
        lora.save(model, out_dir, tokenizer)
    return log


if __name__ == "__main__":
    # Two pairs; log-probs summed over each response. Pair 1: the policy moved towards y_w; pair 2: towards y_l.
    pi_w, pi_l = torch.tensor([-4.0, -6.0], dtype=torch.float64), torch.tensor([-7.0, -3.5], dtype=torch.float64)
    ref_w, ref_l = torch.tensor([-5.0, -5.0], dtype=torch.float64), torch.tensor([-6.0, -4.0], dtype=torch.float64)
    loss, stats = dpo_loss(pi_w, pi_l, ref_w, ref_l, beta=0.1)
    # By hand: logits = 0.1·[(−4 + 5) − (−7 + 6)] = 0.2 and 0.1·[(−6 + 5) − (−3.5 + 4)] = −0.15;
    #          loss = (−log σ(0.2) − log σ(−0.15)) / 2 = (0.598139 + 0.770957) / 2 = 0.684548
    print(f"loss={loss.item():.6f} accuracy={stats['accuracy']:.2f} margin={stats['margin']:.2f} "
          f"chosen={stats['chosen_reward']:.2f} rejected={stats['rejected_reward']:.2f}")
    loss, _ = dpo_loss(ref_w, ref_l, ref_w, ref_l, beta=0.1)
    print(f"at π = π_ref: loss={loss.item():.6f} (log 2 = 0.693147)")
    # Printed (tests/test_dpo.py checks these numbers):
    # loss=0.684548 accuracy=0.50 margin=0.02 chosen=0.00 rejected=-0.03
    # at π = π_ref: loss=0.693147 (log 2 = 0.693147)
