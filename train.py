"""Train RLHF with PPO-max end to end: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964).

Run:
  python train.py                       # the synthetic world on the CPU, every stage, a few minutes
  python train.py --preset vanilla      # the same world with vanilla PPO: watch it collapse (Fig. 4)
  python train.py --world b             # world B (toy_world_b.py): other questions, another exploit (docs/worlds.md)
  python train.py --rebuild-base        # stages 1-2 again, even when runs/_base holds them (step into SFT, Eq. 2)
  python train.py --help                # the flags of a first reading, by stage (--help-all: every flag)
  python train.py --model DIR --data PAIRS [--stages sft,rm]       # a real Hugging Face model through every stage
  python train.py --model llama-7b --plan [--num-gpus 8 --gpu-mem 80 ...]   # per-GPU memory bill; loads nothing
  python train.py --advantage grpo --group-size 4   # no critic: GRPO's group baseline (critic_free.py), same loop
  python train.py --method dpo | --method best-of-n # DPO (dpo.py) or best-of-n (best_of_n.py) instead of stages 3-4
  deepspeed --num_gpus 8 train.py --model llama-7b --data hh.jsonl  # the paper's set-up: DeepSpeed engines (ZeRO-2)
  deepspeed --num_gpus 2 train.py ...   # on a CPU-only machine too: DeepSpeed picks its CPU accelerator and gloo

The stages, each in its own file, each writing a Hugging Face directory:
  1. SFT (sft.train_sft) on the demonstrations; the SFT model is also the frozen reference π_SFT.
  2. The reward model (reward_model.train_reward_model) from the SFT model with Eq. 2 (Bradley-Terry + LM on the
     chosen response); on real data also the judge, a second reward model on pairs the first never saw.
  3. Critic pre-training (ppo_max.pretrain_critic), from the reward model, before any policy update (§5.3.3).
  4. PPO: the numbered loop `ppo` below; one iteration = ppo_max.rollout, make_experience, ppo_update.
What the flags default to, and every preset: plumbing/config.py. Everything that is not the algorithm (flags, the
cached base of stages 1-2, DeepSpeed, checkpoints, logs, the judge) is in the package plumbing/, one call each.
Under the `deepspeed` launcher the global batch stays --rollout-batch prompts and --minibatch sequences per
optimizer step whatever the number of ranks W: rank r takes prompts r, r + W, … of every batch.

References: Ouyang et al. 2022 (InstructGPT); Ziegler et al. 2019; CleanRL ppo.py; lm-human-preference-details.
"""
from __future__ import annotations

import functools
import sys

import ppo_max
from plumbing import cli, flags
from plumbing import run as plumbing
from plumbing.monitor import LoopPlumbing, LoopState


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # the per-GPU memory bill of these flags, loading no weights (plumbing/scale.py)
        flags.print_plan(argv)
        return None
    s = plumbing.start(argv)  # flags and presets (plumbing/config.py), every check, --out, the processes

    # 1-2. SFT (sft.py) and the reward model (reward_model.py): the cached base of the synthetic world or --data,
    #      or a real --model's stage directories (plumbing/pipeline.py)
    inp = plumbing.stages_1_2(s)
    if s.done:  # --stages sft or sft,rm: those stages' models are the result
        return s.result
    if s.run.method != "ppo":  # DPO (dpo.py) or best-of-n (best_of_n.py) in the place of stages 3-4
        return plumbing.other_method(s, inp)
    m, batches, state, ckpts = plumbing.ppo_setup(s, inp)  # the four models, the prompt stream, the loop's state

    # 3. critic pre-training (§5.3.3): V_φ fitted to the SFT policy's returns before any policy update; or, with
    #    --resume, the interrupted run's weights, optimizers, RNG streams and state instead
    start = plumbing.resume(s, ckpts, state) if s.run.resume else plumbing.critic_stage(s, m, batches, state)
    if s.done:  # --stages ...,critic: the pre-trained critic is the result
        return s.result

    # 4. PPO
    with plumbing.loop(s, m, state, ckpts, inp, start) as loop:  # logs, alarm, signals, the held-out curve
        ended = ppo(m, batches, state, loop, s.ppo, s.run)
    return plumbing.finish(s, loop, m, ended)  # the last checkpoint, final models, held-out evaluation, summary


def ppo(m: plumbing.Models, batches, state: LoopState, loop: LoopPlumbing, cfg: ppo_max.PPOConfig, run) -> dict:
    """Steps start … run.steps − 1 of PPO-max, each the paper's steps (0)-(7). Everything that is not the
    algorithm — the progress bar, the non-finite guard, the judge, gathering across ranks, metrics, the collapse
    alarm, signals, checkpoints — sits behind the `loop` calls (plumbing/monitor.py: LoopPlumbing), each one line.
    Returns how the loop ended: {"stop_reason", "signal", "path"}."""
    tokenizer = batches.tokenizer
    eos, pad_id = batches.stop_id, tokenizer.pad_token_id  # eos: EOS or the template's end of turn (data.stop_id)
    # the arguments every iteration passes unchanged, named here so that each numbered call is one line in pdb
    models = (m.policy, m.ref, m.reward_model, m.critic)  # π_θ, π_SFT, the reward model, V_φ (None: critic-free)
    optimizers = (m.policy_opt, m.critic_opt)             # AdamW (or DeepSpeed engines) of π_θ and V_φ
    moments = state.moments                               # Eq. 18's running mean and std of the scores
    sampler = ppo_max.Sampler(cfg, eos, pad_id)           # step (1): the policy, or a path that differs from it
    ptx_batch = functools.partial(batches.ptx, cfg.ptx_batch)  # Eq. 17's text, drawn by step (6) when it needs it
    for step in loop.steps():  # PLUMBING: the bar; ends early on a signal, the guard or --on-collapse stop
        if step == run.break_at:
            breakpoint()  # --break-at STEP: step through this iteration in pdb (`n` next line, `s` step into)
        # (0) the learning rates' scale (linear warm-up over the first warmup_frac of the steps; paper 10 %), then
        #     B prompts of the training split, left-padded: query, query_mask (B, P), G rows per prompt
        lr_scale = ppo_max.warmup(step, run.steps, cfg.warmup_frac)
        prompts, query, query_mask = batches.prompts(cfg.rollout_batch, cfg.group_size)
        # (1) sample responses with the KV cache, stopping at EOS: response, response_mask (B, T), finished (B,), and
        #     what the sampler saw (its own log-probs, under --rollout-mismatch or --rollout-correction)
        response, response_mask, finished, sampled = sampler(m.policy, query, query_mask)
        if cfg.dynamic_sampling:  # DAPO: groups whose proxy scores do not spread are dropped, the batch refilled
            prompts, query, query_mask, response, response_mask, finished, sampled = sampler.refill(
                m.policy, m.reward_model, batches, prompts, query, query_mask, response, response_mask, finished,
                sampled)
        # (2)-(5) score, normalise and clip (Eq. 18), KL-shape (Eq. 19) with η = kl_coef, values and GAE (Eq. 9) or,
        #         without a critic, the group's or the batch's baseline (critic_free.py)
        eta = state.kl_ctl.value  # η of Eq. 19 (it adapts only with --kl-target)
        exp = ppo_max.make_experience(*models, query, query_mask, response, response_mask, moments, cfg, eta, sampled)
        if loop.skip(step, exp["nonfinite"]):  # PLUMBING: a NaN/inf in (2)-(5) skips the update (the guard)
            continue
        # (6) PPO epochs over minibatches: clipped policy loss, clipped value loss, ptx, global gradient clip; then
        #     the adaptive η (only with --kl-target)
        upd = ppo_max.ppo_update(m.policy, m.critic, *optimizers, exp, cfg, ptx_batch, lr_scale)
        state.kl_ctl.update(exp["stats"]["kl/ref"], cfg.rollout_batch)
        # (7) log: the judge (gold: the synthetic human) is never seen by training; then checkpoint
        loop.end_step(step, exp, upd, prompts, finished)  # PLUMBING: judge, ranks, metrics, alarm, checkpoints
    return loop.ended


if __name__ == "__main__":
    cli.cli_guard(main)()  # a user's mistake: one line naming the file, line, field or flag; exit 2
