"""Train RLHF with PPO-max end to end: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964).

Run:
  python train.py                       # the synthetic world on the CPU, every stage, a few minutes
  python train.py --preset vanilla      # the same world with vanilla PPO: watch it collapse (Fig. 4)
  python train.py --rebuild-base        # stages 1-2 again, even when runs/_base holds them (step into SFT, Eq. 2)
  python train.py --help                # every flag, with its paper symbol and default
  python train.py --model DIR --data PAIRS [--stages sft,rm]       # a real Hugging Face model through every stage
  python train.py --model llama-7b --plan [--num-gpus 8 --gpu-mem 80 ...]   # per-GPU memory bill; loads nothing
  python train.py --advantage grpo --group-size 4   # no critic: GRPO's group baseline (critic_free.py), same loop
  python train.py --method dpo | --method best-of-n # DPO (dpo.py) or best-of-n (best_of_n.py) instead of stages 3-4
  deepspeed --num_gpus 8 train.py --model llama-7b --data hh.jsonl  # the paper's set-up: DeepSpeed engines (ZeRO-2)
  deepspeed --num_gpus 2 train.py ...   # on a CPU-only machine too: DeepSpeed picks its CPU accelerator and gloo

Stages, each in its own file, each writing a Hugging Face directory under --out or runs/_base/:
  1. SFT (sft.train_sft): on the demonstrations (the chosen responses); also the frozen reference π_SFT.
  2. Reward model (reward_model.train_reward_model) from the SFT model with Eq. 2 (Bradley-Terry + LM on chosen);
     on real data also the judge, a second reward model on pairs the first never saw.
  3. Critic pre-training (ppo_max.pretrain_critic), from the reward model, before any policy update (§5.3.3).
  4. PPO: the numbered loop of `ppo` below, one iteration = ppo_max.rollout, make_experience, ppo_update.
In the synthetic world and with --data alone the model is a from-scratch tiny LLaMA and stages 1-2 are cached under
runs/_base/<name>-<hash>/ (pipeline.build_base), shared by every preset with the same seed. A real --model (a
local Hugging Face directory, a hub id already in the local cache, or an alias of scale.py) trains stages 1-2
into --out/sft/ and --out/reward_model/ (reused on a second start), unless --sft-model / --reward-model give them.

The plumbing sits behind one call each: engine.py (one process or DeepSpeed engines: wrap, step, gather),
checkpoint.py (atomic checkpoints, exact resume, the non-finite guard), monitor.py (metrics.jsonl, samples.jsonl,
the §5.2 collapse alarm), data.py (tokenization and batches), eval.py (the held-out comparison with SFT).
Under the `deepspeed` launcher the global batch stays --rollout-batch prompts and --minibatch sequences per
optimizer step whatever the number of ranks W: rank r takes prompts r, r + W, … of every batch.

References: Ouyang et al. 2022 (InstructGPT); Ziegler et al. 2019; CleanRL ppo.py; lm-human-preference-details.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import best_of_n
import checkpoint
import cli
import critic_free
import data
import dpo
import engine
import eval as evaluation
import lm
import lora
import monitor as collapse
import ppo_max
import scale
import toy_world
from cli import arg, fail
from pipeline import (STAGES, Inputs, check_models, fit_context, last_stage, load_lm, ppo_inputs, preference_pairs,
                      real_model_records, real_model_stages, resolve_real_models, stage_ds, stage_records,
                      stop_after_stages, use_bf16, write_json, write_stage_records)
from reward_model import RMConfig, ScalarHeadModel
from sft import SFTConfig, tiny_llama_config


# =========================================================================================================
# Configuration: one dataclass per stage; every field is a flag (`--field-name`)
# =========================================================================================================
@dataclass
class RunConfig:
    preset: str = arg("ppo-max", f"named set of PPO flags: {', '.join(ppo_max.PRESETS)}")
    seed: int = arg(0, "seed of the world, every model init and every sample", "[0,2147483647]")
    steps: int = arg(80, "PPO iterations (each: one rollout batch, then PPO epochs over it)", ">=1")
    out: str = arg("", "output directory (default runs/<preset>-seed<seed>; with --lora-r R: "
                       "runs/<preset>-loraR-seed<seed>)")
    model: str = arg("tiny", "policy/SFT model: 'tiny' (synthetic world), an alias, a hub id or a local HF directory")
    eval_samples: int = arg(4, "samples per held-out prompt for the final evaluation and win rate", ">=1")
    heldout_every: int = arg(8, "the held-out curve: every N PPO steps (at the top of steps 0, N, 2N, ...: step 0 is "
                                "the SFT policy) sample the held-out prompts as the final evaluation does and log "
                                "metrics.jsonl's heldout/* (the judge's mean, the proxy's, KL, length); training is "
                                "unchanged (the samples draw from a stream of their own); 0 = off", ">=0")
    heldout_samples: int = arg(1, "samples per held-out prompt at each --heldout-every point", ">=1")
    threads: int = arg(1, "torch CPU threads (0 = torch's default); the tiny models gain nothing from more, and on a "
                          "shared machine extra threads mostly wait for each other", ">=0")
    break_at: int = arg(-1, "call breakpoint() at the top of PPO step STEP (pdb: `n` walks steps (0)-(7)); with "
                            "--critic-pretrain-steps 0 it stops within seconds; -1 = never", ">=-1")
    rebuild_base: bool = arg(False, "train stages 1-2 (SFT, reward model) again even when runs/_base or --out holds "
                                    "them")
    stages: str = arg("sft,rm,critic,ppo", "the stages to run, in order (sft, rm, critic, ppo); the run stops after "
                                           "the last one listed, e.g. sft,rm trains only a reward model")
    method: str = arg("ppo", "what follows SFT and the reward model, in place of critic + PPO: 'ppo' (the numbered "
                             "loop; --advantage picks GAE or a critic-free estimator), 'dpo' (dpo.py: Eq. 7 on the "
                             "reward model's own pairs, no sampling, no critic) or 'best-of-n' (no training: the best "
                             "of --bon-n SFT samples by the proxy). A method, not a stage, because it replaces stages "
                             "3-4 rather than following them; every method ends with the same held-out evaluation",
                      "ppo|dpo|best-of-n")
    bon_n: int = arg(16, "--method best-of-n: candidates per response; KL to SFT = log n − (n − 1)/n nats", ">=1")
    # long runs (checkpoint.py, monitor.py)
    save_every: int = arg(20, "write a checkpoint every N PPO steps (and at the end); 0 = only at the end", ">=0")
    keep_last: int = arg(3, "checkpoints kept under <out>/checkpoints (older ones are deleted)", ">=0")
    resume: str = arg("", "continue a run exactly: its directory or one of its checkpoints (same flags as the run)")
    max_bad_steps: int = arg(3, "stop after this many consecutive steps with a non-finite score/advantage/gradient",
                             ">=1")
    on_collapse: str = arg("warn", "when the §5.2 collapse alarm fires: 'warn' (log it) or 'stop' (checkpoint, stop)",
                           "warn|stop")
    alarm_kl_max: float = arg(collapse.KL_MAX, "collapse alarm: KL to the reference (nats/token) that makes a step "
                                               "bad; higher is quieter and later (`python monitor.py sweep runs/*`)",
                              ">=0")
    alarm_patience: int = arg(collapse.PATIENCE, "collapse alarm: consecutive bad steps before it fires", ">=1")
    log_with: str = arg("none", "also log every metric (PPO steps, the SFT and reward-model stages) to 'tensorboard' "
                                "(<out>/tensorboard) or 'wandb' (offline with WANDB_MODE=offline); metrics.jsonl is "
                                "always written", "none|tensorboard|wandb")
    # real preference data instead of the synthetic world (data.py reads and checks it)
    data: str = arg("", "preference pairs (HH-RLHF, {prompt,chosen,rejected} or chat messages) as .jsonl[.gz], .json, "
                        ".parquet, a Dataset.save_to_disk folder or a hub dataset id in the local cache: real text "
                        "instead of the synthetic world (flags not given take REAL_DATA_DEFAULTS)")
    data_split: str = arg("train", "with --data as a hub id or a folder of several splits: the split to read")
    data_config: str = arg("", "with --data as a hub id: its configuration (name), if it has several")
    skip_bad: bool = arg(False, "with --data: skip bad lines, count them by reason, report at the end (else exit 2)")
    heldout_frac: float = arg(0.1, "with --data: fraction of pairs held out for RM accuracy and evaluation prompts",
                              "(0,1)")
    vocab_size: int = arg(2000, "with --data: byte-level BPE vocabulary, trained on the training split only "
                                 "(at least its 256 bytes and 4 special tokens)", ">=260")
    max_prompt_tokens: int = arg(128, "with --data: P limit on the query as the model reads it (BOS or chat template "
                                      "included); longer prompts keep their latest turns; lowered to fit a real "
                                      "--model's positions", ">=1")
    max_response_tokens: int = arg(64, "with --data: T limit (EOS included); longer pairs are dropped and counted; "
                                       "lowered to fit a real --model's positions",
                                   ">=2")
    judge_frac: float = arg(0.5, "with --data: fraction of the training pairs held back for a second reward model, "
                                 "the judge of the win rate, which PPO never optimises; 0 = judge by the proxy",
                            "[0,1)")
    # real models and scale (scale.py, engine.py): `--plan`, `deepspeed train.py ...`
    plan: bool = arg(False, "print the per-GPU memory plan of --model and exit, loading no weights (more flags: "
                            "--num-gpus --gpu-mem --micro-batch --prompt-len ...; see `python scale.py --help`)")
    sft_model: str = arg("", "real --model: an SFT model, so stage 1 is skipped (policy and reference init); without "
                             "it, stage sft trains --model on --sft-data or --data, and with neither --model itself is "
                             "the SFT model")
    sft_data: str = arg("", "SFT and ptx data ({prompt,response}, {prompt,chosen}, {messages} or {text} lines) "
                            "instead of the chosen responses of --data")
    reward_model: str = arg("", "real --model: a reward model directory, so stage 2 is skipped (ours, or an "
                                "AutoModelForSequenceClassification with num_labels 1)")
    critic_model: str = arg("", "real --model: the critic init (default: the reward model, as PPO-max)")
    prompts: str = arg("", "a .jsonl[.gz] of {\"prompt\"} lines for the rollouts instead of --data's training prompts "
                           "(lines that are --data's held-out or judge prompts are left out); without --data it is "
                           "split by --heldout-frac into rollout and evaluation prompts")
    deepspeed: bool = arg(False, "DeepSpeed engines even in one process (automatic under the `deepspeed` launcher)")
    deepspeed_config: str = arg("", "DeepSpeed JSON for policy and critic (e.g. ds_config_zero2.json) instead of the "
                                    "one built from these flags; its micro batch is set to minibatch / ranks")
    zero_stage: int = arg(2, "ZeRO stage of the policy and critic engines: 0, 1 or 2 (the paper: 2)", "0|1|2")
    grad_ckpt: bool = arg(False, "gradient checkpointing in policy and critic (on in the llama presets)")
    fp32: bool = arg(False, "fp32 where bf16 would be used (DeepSpeed on an accelerator with bf16; never the CPU)")
    bf16: bool = arg(False, "bf16 for every model even on the CPU (the accelerator's dtype path, testable here)")
    # one GPU (lora.py): low-rank adapters through peft instead of full weights
    lora_r: int = arg(0, "LoRA rank r: train adapters (peft) instead of full weights, in SFT, the reward model, the "
                         "critic and the policy (the synthetic world: critic and policy); 0 = full fine-tuning", ">=0")
    lora_alpha: float = arg(16.0, "LoRA α: the update is (α/r)·B·A", ">0")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input in SFT and reward-model training (PPO switches it "
                                   "off with every dropout: ρ = 1 on the first minibatch)", "[0,1)")
    lora_targets: str = arg("auto", "layers that get adapters: 'auto' (peft's default for the architecture: "
                                    "q_proj,v_proj for LLaMA, c_attn for GPT-2), 'all-linear', or names, e.g. "
                                    "q_proj,k_proj,v_proj,o_proj")
    lora_bits: int = arg(16, "frozen base weights under LoRA: 16 (bf16 / as saved), 8 or 4 (bitsandbytes NF4, "
                             "QLoRA; CUDA only, one process)", "4|8|16")


# Every field of the five configs declares its allowed range or choices (cli.arg), and validate() checks them all
# before any stage runs; paths must exist and --out must be writable.
FILE_FLAGS = ("data", "sft_data", "prompts", "deepspeed_config")  # must be existing files when given


def validate(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, cfg: ppo_max.PPOConfig,
             world_cfg: toy_world.WorldConfig, dpo_cfg: dpo.DPOConfig) -> None:
    """Every flag against its range or choices, the files it names, and the combinations the loop needs: one line
    naming the flag, its value and what is allowed (exit 2), before anything is trained, loaded or written."""
    for obj, prefix in ((run, ""), (sft_cfg, ""), (rm_cfg, ""), (cfg, ""), (world_cfg, "world-"), (dpo_cfg, "")):
        for name, spec in cli.allowed(type(obj)).items():
            value = getattr(obj, name)
            problem = cli.check_value(value, spec)
            if problem:
                fail(f"--{prefix}{name.replace('_', '-')} {value!r}: {problem}")
    for name in FILE_FLAGS:  # a data flag may also name a save_to_disk folder or a hub dataset id (data.source)
        path = getattr(run, name)
        if path and not Path(path).exists() and (name == "deepspeed_config" or data.looks_like_a_path(path)):
            fail(f"--{name.replace('_', '-')} {path}: no such file")
    if run.deepspeed_config:
        try:
            ds = json.loads(Path(run.deepspeed_config).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            fail(f"--deepspeed_config {run.deepspeed_config}: not valid JSON ({str(e).splitlines()[0]})")
        zero = ds.get("zero_optimization", {}) if isinstance(ds, dict) else None
        if not isinstance(zero, dict):
            fail(f"--deepspeed_config {run.deepspeed_config}: expected a JSON object with a zero_optimization "
                 f"object, if any, got {type(ds if zero is None else zero).__name__}")
        if zero.get("stage", 0) not in (0, 1, 2):
            fail(f"--deepspeed_config {run.deepspeed_config}: zero_optimization.stage {zero.get('stage')!r}: the loop "
                 f"runs ZeRO stages 0, 1 and 2")
        if not run.deepspeed and int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # one process: no engine reads it
            fail(f"--deepspeed_config {run.deepspeed_config}: DeepSpeed engines run under the `deepspeed` launcher "
                 f"with more than one process, or with --deepspeed")
    if run.resume and not Path(run.resume).exists():
        fail(f"--resume {run.resume}: no such run or checkpoint directory")
    if cfg.minibatch > cfg.rollout_batch:
        fail(f"--minibatch {cfg.minibatch}: must be ≤ --rollout-batch {cfg.rollout_batch} (a minibatch is a part of "
             f"the rollout batch)")
    validate_estimator(run, cfg)
    if run.method != "ppo" and run.resume:
        fail(f"--resume with --method {run.method}: only the PPO loop checkpoints; a {run.method} run is one short "
             f"stage, start it again")
    if sft_cfg.sft_hidden % sft_cfg.sft_heads:
        fail(f"--sft-hidden {sft_cfg.sft_hidden}: must be divisible by --sft-heads {sft_cfg.sft_heads}")
    if rm_cfg.rm_hidden % sft_cfg.sft_heads:
        fail(f"--rm-hidden {rm_cfg.rm_hidden}: must be divisible by --sft-heads {sft_cfg.sft_heads}")
    sized = [f for f in ("rm_hidden", "rm_layers", "rm_pairs") if getattr(rm_cfg, f)]
    if sized and run.model != "tiny":
        fail(f"--{sized[0].replace('_', '-')}: sizes the reward model the synthetic world and --data train here; a "
             f"real --model's reward model is its own (pass it with --reward-model DIR)")
    if run.bf16 and run.fp32:
        fail("--bf16 and --fp32: choose one")
    if run.log_with == "wandb":
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            fail("--log-with wandb: wandb is not installed here (pip install wandb; with WANDB_MODE=offline it needs "
                 "no network); metrics.jsonl is written either way, and --log-with tensorboard needs nothing more")
    if run.lora_r:
        try:
            lora.target_modules("", run.lora_targets)
        except ValueError as e:
            fail(str(e))
    if run.lora_bits != 16:  # bitsandbytes: a CUDA GPU, one process
        lora.check_bits(run, "cuda" if torch.cuda.is_available() else "cpu")
        if run.deepspeed or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            fail(f"--lora-bits {run.lora_bits}: quantized frozen weights run in one process here, not under DeepSpeed "
                 f"engines; drop --deepspeed / the launcher, or use --lora-bits 16")
    if Path(run.out).exists() and not Path(run.out).is_dir():
        fail(f"--out {run.out}: exists and is not a directory")


def validate_estimator(run: RunConfig, cfg: ppo_max.PPOConfig) -> None:
    """--advantage, --group-size, --kl-in and the peers' conventions: the combinations that cannot work, one line."""
    a, G = cfg.advantage, cfg.group_size
    if a in critic_free.GROUPED and G < 2:
        fail(f"--advantage {a}: needs --group-size G ≥ 2 (its baseline comes from the other responses to the same "
             f"prompt); e.g. --group-size 4")
    if cfg.rollout_batch % G:
        fail(f"--rollout-batch {cfg.rollout_batch}: must be a multiple of --group-size {G} (it counts responses: "
             f"prompts × G)")
    if a == "dr-grpo" and cfg.loss_agg != "seq-mean-token-sum-norm":
        fail(f"--advantage dr-grpo with --loss-agg {cfg.loss_agg}: Dr. GRPO is its advantage r − mean_G r AND its loss "
             f"divided by the constant batch × --max-new-tokens (seq-mean-token-sum-norm), which it implies: leave "
             f"--loss-agg out")
    if cfg.kl_in == "loss" and cfg.kl_estimator in ("k1", "full"):
        why = ("k1 = log π/π_SFT has zero expected gradient on samples of π (E_π[∇ log π] = 0)" if cfg.kl_estimator == "k1"
               else "the exact KL in the loss would need the reference's logits in every minibatch")
        fail(f"--kl-in loss with --kl-estimator {cfg.kl_estimator}: {why}; use k3 (GRPO's) or k2")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        fail(f"--dual-clip {cfg.dual_clip:g}: must be > 1 (for Â < 0 the objective is bounded below by c·Â) or 0 = off")
    if a != "gae":
        if run.critic_model:
            fail(f"--critic-model {run.critic_model}: --advantage {a} trains no critic (drop one of them)")
        if [x.strip() for x in run.stages.split(",") if x.strip()][-1:] == ["critic"]:
            fail(f"--stages {run.stages}: --advantage {a} has no critic to pre-train; end the stages with ppo or rm")


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineParser(prog="train.py", description=__doc__.split("\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for title, cls in [("run", RunConfig), ("SFT", SFTConfig), ("reward model", RMConfig), ("PPO", ppo_max.PPOConfig),
                       ("DPO (--method dpo; dpo.py)", dpo.DPOConfig)]:
        g = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-")]
            if f.name == "deepspeed_config":
                flags.append("--deepspeed_config")  # DeepSpeed's own spelling of the flag
            help_ = f.metadata.get("help", "")
            spec = f.metadata.get("allowed")
            if spec:
                help_ += f" (allowed: {spec.replace('|', ', ')})"
            if cls is ppo_max.PPOConfig:  # PPO defaults come from the preset, so the parser's default is None
                kw = dict(default=None, help=f"{help_} [PPO-max: {f.default}]")
            else:
                kw = dict(default=f.default, help=help_)
            if f.type in (bool, "bool"):
                g.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            else:
                typ = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
                g.add_argument(*flags, type=typ, **kw)
    g = p.add_argument_group("synthetic world (toy_world.WorldConfig)")
    for f in dataclasses.fields(toy_world.WorldConfig):
        if f.name != "seed":
            spec = f.metadata.get("allowed")
            g.add_argument("--world-" + f.name.replace("_", "-"), dest="world_" + f.name, type=type(f.default),
                           default=f.default, help=f.metadata.get("help", "") + (
                               f" (allowed: {spec.replace('|', ', ')})" if spec else ""))
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def parse_configs(argv=None):
    """(RunConfig, SFTConfig, RMConfig, PPOConfig, WorldConfig, DPOConfig) of a command line: the preset's PPO flags
    with the given ones on top, and --out defaulting to runs/<preset>-seed<seed> (or the resumed run's directory)."""
    args = build_parser().parse_args(argv)
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # noqa: E731
    run, sft_cfg, rm_cfg, dpo_cfg = pick(RunConfig), pick(SFTConfig), pick(RMConfig), pick(dpo.DPOConfig)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ppo_max.PPOConfig)
                 if getattr(args, f.name) is not None}
    try:
        ppo = implied(ppo_max.apply_preset(run.preset, **overrides), {**ppo_max.PRESETS.get(run.preset, {}),
                                                                       **overrides})
    except ValueError as e:
        fail(f"--preset: {e}")
    world = toy_world.WorldConfig(seed=run.seed, **{f.name: getattr(args, "world_" + f.name)
                                                     for f in dataclasses.fields(toy_world.WorldConfig) if f.name != "seed"})
    if run.resume and not run.out:  # --resume alone continues in the run's own directory
        p = Path(run.resume)
        if p.exists() and not p.is_dir():
            fail(f"--resume {run.resume}: not a run or checkpoint directory (a file)")
        run.out = str(p.parent.parent if p.name.startswith("step-") else p.parent if p.name == "checkpoints" else p)
    if not run.out:  # runs of other estimators or LoRA never share a directory with the default run
        run.out = f"runs/{run_name(run, ppo)}{lora_tag(run)}-seed{run.seed}"
    validate(run, sft_cfg, rm_cfg, ppo, world, dpo_cfg)
    return run, sft_cfg, rm_cfg, ppo, world, dpo_cfg


def implied(cfg: ppo_max.PPOConfig, given: dict) -> ppo_max.PPOConfig:
    """What an estimator implies for the flags not given: Dr. GRPO is its advantage AND its constant loss divisor
    (--loss-agg seq-mean-token-sum-norm); the KL in the loss is GRPO's k3 (--kl-estimator k3). A flag given that
    contradicts them is refused by validate()."""
    changes = {}
    if cfg.advantage == "dr-grpo" and "loss_agg" not in given:
        changes["loss_agg"] = "seq-mean-token-sum-norm"
    if cfg.kl_in == "loss" and "kl_estimator" not in given:
        changes["kl_estimator"] = "k3"
    return dataclasses.replace(cfg, **changes)


def run_name(run: RunConfig, cfg: ppo_max.PPOConfig) -> str:
    """The default --out's name: the method (dpo, best-of-16), or the preset and the estimator and group size when
    they are not GAE's (runs/ppo-max-grpo-g4-seed0)."""
    if run.method == "dpo":
        return "dpo"
    if run.method == "best-of-n":
        return f"best-of-{run.bon_n}"
    name = run.preset
    if cfg.advantage != "gae":
        name += f"-{cfg.advantage}"
    return name + (f"-g{cfg.group_size}" if cfg.group_size > 1 else "")


def lora_tag(run: RunConfig) -> str:
    """The default --out's mark of a LoRA run ("-lora8"), empty for full weights."""
    return f"-lora{run.lora_r}" if run.lora_r else ""


def given_flags(argv) -> set[str]:
    """The dest names of the flags actually on the command line."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS      # parse again: only the flags actually given survive
    return set(vars(p.parse_args(argv)))


# --data: the same stages on real text. A small budget so that the whole run (PPO included) takes minutes on
# 2 CPU cores; each value applies only when its flag is not given on the command line. Measured on
# harmless-base-test.dev.jsonl.gz --skip-bad --threads 1, 2 cores shared with another job: 5 min 30 s in all (data
# 3 s, SFT 36 s, RM 39 s, judge 43 s, critic pre-training 18 s, PPO 145 s, eval 38 s); held-out RM accuracy 0.457 on
# 94 pairs.
REAL_DATA_DEFAULTS = dict(sft_hidden=128, sft_epochs=2.0, sft_batch=32, rm_epochs=1.0, rm_lr=5e-4,
                          steps=10, rollout_batch=32, max_new_tokens=32, critic_pretrain_steps=4, eval_samples=1,
                          ptx_data="sft")  # real text has no pretraining split: ptx reads --sft-data or --data

# --model llama-7b / llama-13b: the paper's hyperparameters (section 5 and its appendix) for the flags not given.
# bf16 comes with DeepSpeed on an accelerator that has it; the final evaluation always samples as the paper
# evaluates (eval.EVAL_SAMPLING). Printed at start-up.
# The reward model: lr 5e-6, about 1.06 epochs, β_rm = 1 (the paper's dynamic batches of 4-128 sequences: 64 pairs).
# The paper reports no SFT settings; these are Alpaca's for LLaMA-7B (Taori et al. 2023): lr 2e-5, 3 epochs, batch 128.
PAPER_LLAMA = dict(policy_lr=5e-7, critic_lr=1.65e-6, warmup_frac=0.1, rollout_batch=128, minibatch=32, lam=0.9,
                   clip_eps=0.2, kl_coef=0.05, grad_ckpt=True, rm_lr=5e-6, rm_epochs=1.06, rm_batch=64, rm_lm_coef=1.0,
                   sft_lr=2e-5, sft_epochs=3.0, sft_batch=128)
MODEL_PRESETS = {"llama-7b": PAPER_LLAMA, "llama-13b": PAPER_LLAMA}


def with_defaults(argv, defaults: dict, *configs) -> list:
    """`configs` with the fields of `defaults` whose flag is not on the command line replaced."""
    given = given_flags(argv)
    names = lambda c: {f.name for f in dataclasses.fields(c)}  # noqa: E731
    return [dataclasses.replace(c, **{k: v for k, v in defaults.items() if k in names(c) and k not in given})
            for c in configs]


def real_data_configs(argv, *configs):
    """Apply REAL_DATA_DEFAULTS to the fields of `configs` whose flag is not on the command line."""
    given = given_flags(argv)
    out = with_defaults(argv, REAL_DATA_DEFAULTS, *configs)
    if "out" not in given and isinstance(out[0], RunConfig) and not out[0].resume:
        name = run_name(out[0], next((c for c in out if isinstance(c, ppo_max.PPOConfig)), ppo_max.PPOConfig()))
        out[0].out = f"runs/{name}-{Path(out[0].data).name.split('.')[0]}{lora_tag(out[0])}-seed{out[0].seed}"
    print("[data] real-data defaults for flags not given: "
          + json.dumps({k: v for k, v in REAL_DATA_DEFAULTS.items() if k not in given}))
    return out


def model_preset_configs(argv, run: RunConfig, cfg: ppo_max.PPOConfig, sft_cfg: SFTConfig | None = None,
                        rm_cfg: RMConfig | None = None):
    """Apply MODEL_PRESETS[run.model] to the fields of run, cfg and the SFT / RM configs whose flag is not given."""
    sft_cfg, rm_cfg = sft_cfg or SFTConfig(), rm_cfg or RMConfig()
    given = given_flags(argv)
    run, cfg, sft_cfg, rm_cfg = with_defaults(argv, MODEL_PRESETS[run.model], run, cfg, sft_cfg, rm_cfg)
    print(f"[model] {run.model}: the paper's hyperparameters for the flags not given: "
          f"{json.dumps({k: v for k, v in MODEL_PRESETS[run.model].items() if k not in given})}; bf16 "
          f"where the accelerator has it; evaluation sampling {json.dumps(evaluation.EVAL_SAMPLING)}")
    return run, cfg, sft_cfg, rm_cfg


RUN_RECORD = "run_config.json"  # in the run directory: the flags and the resolved configuration of the run
SAFE_ON_RESUME = {"steps", "break_at", "save_every", "keep_last", "threads", "eval_samples", "max_bad_steps",
                  "on_collapse", "alarm_kl_max", "alarm_patience", "resume", "out", "deepspeed"}  # what --resume may change


def configure(argv) -> tuple[list[str], RunConfig, SFTConfig, RMConfig, ppo_max.PPOConfig, toy_world.WorldConfig,
                              dpo.DPOConfig]:
    """The run's flags and every configuration, presets and defaults applied. With --resume DIR the flags are the
    run's recorded ones (RUN_RECORD) plus those given now, which may only change SAFE_ON_RESUME."""
    run = parse_configs(argv)[0]
    if run.resume:
        try:  # before anything is built: a resume with nothing intact to resume from stops now
            if checkpoint.find_intact(run.resume, log=lambda line: None) is None:
                fail(f"--resume {run.resume}: no intact checkpoint there")
        except ValueError as e:
            fail(str(e))
        argv = resumed_argv(argv, run)
    return (argv, *resolve(argv))


def resumed_argv(argv: list[str], run: RunConfig) -> list[str]:
    """The resumed run's recorded flags, then the ones given with --resume (argparse: the last one wins). A given
    flag that changes anything but SAFE_ON_RESUME is refused with one line naming it."""
    import contextlib
    import io
    record = Path(run.out) / RUN_RECORD
    if not record.is_file():
        print(f"[resume] no {record} (a run from before runs recorded their flags): using the flags given now")
        return argv
    try:
        recorded = json.loads(record.read_text())["argv"]
        if not (isinstance(recorded, list) and all(isinstance(a, str) for a in recorded)):
            raise ValueError("argv is not a list of strings")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        fail(f"{record}: damaged run record ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
             f"restore it, or delete it to resume with the flags given now")
    combined = recorded + argv + ["--out", run.out]
    with contextlib.redirect_stdout(io.StringIO()):  # the presets' messages, printed once by the real resolve
        before, after = resolve(recorded + ["--out", run.out]), resolve(combined)
    for prefix, old, new in zip(("", "", "", "", "world-", ""), before, after):
        for name, value in dataclasses.asdict(new).items():
            if value != getattr(old, name) and name not in SAFE_ON_RESUME:
                flag = f"--{prefix}{name.replace('_', '-')}"
                fail(f"{flag} {value!r} contradicts the run's {flag} {getattr(old, name)!r} (recorded in {record}): "
                     f"--resume continues the run as configured; leave it out (only "
                     f"{', '.join('--' + s.replace('_', '-') for s in sorted(SAFE_ON_RESUME - {'resume', 'out'}))} "
                     f"may change)")
    return combined


def resolve(argv):
    """(run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg) of a command line, presets and defaults applied and checked."""
    run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg = parse_configs(argv)
    if run.data and run.model == "tiny":  # real text: a smaller budget for the flags not given, and no gold judge
        run, sft_cfg, rm_cfg, cfg = real_data_configs(argv, run, sft_cfg, rm_cfg, cfg)
    if run.model in MODEL_PRESETS:
        run, cfg, sft_cfg, rm_cfg = model_preset_configs(argv, run, cfg, sft_cfg, rm_cfg)
    if run.model != "tiny" and "ptx_data" not in given_flags(argv):  # a real model: ptx on its SFT text, not given
        cfg = dataclasses.replace(cfg, ptx_data="sft")                # the synthetic world's pretraining text
    if cfg.policy_init != "sft" and (run.data or run.model != "tiny"):
        fail("--policy-init pretrained needs the synthetic world")
    if cfg.ptx_data != "sft" and (run.data or run.model != "tiny"):
        fail("--ptx-data pretrain needs the synthetic world (its pretraining text); on real data ptx uses --sft-data "
             "or --data")
    stages = [s.strip() for s in run.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages) or stages != sorted(set(stages), key=STAGES.index):
        fail(f"--stages {run.stages}: expected stages from {','.join(STAGES)}, each once, in that order (e.g. sft,rm)")
    if run.model == "tiny":  # the synthetic world (or --data's tiny model) trains every model it uses itself
        for name in ("sft_model", "reward_model", "critic_model"):
            if getattr(run, name):
                fail(f"--{name.replace('_', '-')} {getattr(run, name)}: needs a real --model DIR; the tiny model "
                     f"trains its own")
        for name in ("prompts", "sft_data"):
            if getattr(run, name) and not run.data:
                fail(f"--{name.replace('_', '-')} {getattr(run, name)}: needs --data or a real --model; the "
                     f"synthetic world makes its own prompts and demonstrations")
    return run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg


def resume(run: RunConfig, ckpts: checkpoint.RunCheckpoints, state: LoopState,
           out: Path) -> tuple[int, list[dict], list[dict]]:
    """The newest intact checkpoint restored into the models, optimizers, RNG streams and `state`: (its step, the
    metrics.jsonl and samples.jsonl rows of the steps before it)."""
    try:
        ckpt, saved = ckpts.resume(run.resume)
    except ValueError as e:
        fail(str(e))
    state.load_state_dict(saved["extra_state"])
    print(f"[resume] {ckpt}: continuing at step {saved['step']}")
    if saved["step"] >= run.steps:
        print(f"[resume] the run has {saved['step']} steps and --steps is {run.steps}: no step left to train, only "
              f"the evaluation (a larger --steps continues the run)")
    step, logs = saved["step"], [out / "metrics.jsonl", out / "samples.jsonl"]
    metrics, samples = (data.read_records(f) if f.is_file() else [] for f in logs)
    return step, metrics[:step], [s for s in samples if s["step"] < step]


def run_checkpoints(m: Models, out: Path, batches: data.RolloutBatches, run: RunConfig,
                    rank: int) -> checkpoint.RunCheckpoints:
    """The run's checkpoints: what trains (the policy, and the critic when there is one) with its optimizer, and the
    prompt stream; a critic-free run checkpoints no critic."""
    trained = {k: v for k, v in {"policy": (m.policy, m.policy_opt), "critic": (m.critic, m.critic_opt)}.items()
               if v[0] is not None}
    return checkpoint.RunCheckpoints(out, {k: v[0] for k, v in trained.items()}, {k: v[1] for k, v in trained.items()},
                                     {"prompt": batches.rng}, batches.tokenizer, run.keep_last, rank, engine.barrier)


def save_critic(m: Models, inp: Inputs, run: RunConfig, out: Path, rank: int) -> dict:
    """--stages ...,critic: the pre-trained critic, as a Hugging Face directory, is the run's result."""
    if rank == 0:
        lora.save(m.critic, out / "critic", inp.tokenizer, inp.critic)
        print(f"[stages] {run.stages}: the pre-trained critic is in {out / 'critic'}")
    return {"stages": run.stages, "critic": str(out / "critic")}


def tracker(run: RunConfig, inp: Inputs, out: Path, rank: int) -> collapse.Tracker:
    """--log-with: the external log of this run, with stages 1-2's curves first (SFT loss per step; the reward
    model's held-out accuracy and Eq. 2 terms), read from the logs those stages wrote."""
    t = collapse.Tracker(run.log_with if rank == 0 else "none", out, out.name)
    sft_log = (inp.base or Path(inp.ref)) / "sft_log.json"
    rm_log = (inp.base or Path(inp.reward)) / "rm_log.json"
    if sft_log.is_file():
        for i, loss in enumerate(json.loads(sft_log.read_text())["loss"]):
            t.log({"sft/loss": loss}, i)
    if rm_log.is_file():
        n = 0
        for row in json.loads(rm_log.read_text()):
            t.log({"rm/heldout_accuracy": row["heldout_accuracy"]}, row["step"])
            for stats in row.get("train", []):
                t.log({f"rm/{k}": v for k, v in stats.items()}, n)
                n += 1
    return t


def write_record(out: Path, argv: list[str], *configs) -> None:
    """RUN_RECORD: the run's flags (without --resume) and every resolved configuration."""
    flags = [a for i, a in enumerate(argv) if a != "--resume" and (i == 0 or argv[i - 1] != "--resume")]
    write_json(out / RUN_RECORD, {"argv": flags, "configs": {name: dataclasses.asdict(c) for name, c in
                                                             zip(("run", "sft", "rm", "ppo", "world", "dpo"), configs)}})


def check_data_files(run: RunConfig) -> None:
    """Read every data file once now, so a bad line stops the run (one line naming file and line, exit 2) before any
    stage; the stages read them again, which costs well under a second for files of this size."""
    from pipeline import data_source
    if run.data:
        data.load_pairs(data_source(run, run.data), skip_bad=run.skip_bad)
    if run.sft_data:
        data.load_texts(data_source(run, run.sft_data), skip_bad=run.skip_bad)
    if run.prompts:
        data.load_prompts(data_source(run, run.prompts), skip_bad=run.skip_bad)


def check_lora(run: RunConfig, sft_cfg: SFTConfig, dirs: dict | None) -> None:
    """--lora-targets must name layers of the model (the tiny LLaMA, or the real --model's architecture)."""
    if not lora.enabled(run):
        return
    if dirs is None:
        print("[lora] stages 1-2 train the tiny model from scratch, in full (adapters on random weights learn nothing "
              "useful); the critic and the policy train adapters")
        config = tiny_llama_config(run.vocab_size if run.data else len(toy_world.VOCAB), sft_cfg)
    else:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(dirs["sft"] or dirs["model"], trust_remote_code=False)
    lora.check_targets(config, run)


def replace_earlier_run(run: RunConfig, out: Path, rank: int) -> None:
    """A new run (no --resume) in a directory that holds an earlier run's checkpoints: a finished earlier run (its
    summary.json written) is replaced, its checkpoints removed so that a later --resume can only continue this run;
    an unfinished one is refused with one line, since --resume would continue it and starting afresh would lose it."""
    steps = sorted((out / checkpoint.CKPT_SUBDIR).glob("step-*")) if not run.resume else []
    if not steps:
        return
    if not (out / "summary.json").is_file():
        fail(f"--out {out} holds an unfinished run (newest checkpoint {steps[-1].name}): --resume {out} continues "
             f"it; to start afresh delete that directory or pass another --out")
    if rank == 0:
        print(f"[out] {out} held a finished run: this run replaces it (its checkpoints and summary are removed)")
        shutil.rmtree(out / checkpoint.CKPT_SUBDIR)
        (out / "summary.json").unlink()  # until this run writes its own, the directory holds no finished run
    engine.barrier()


def make_out_dir(run: RunConfig) -> Path:
    """The run's own directory, the first thing written, so that an unwritable --out fails before any stage."""
    try:
        Path(run.out).mkdir(parents=True, exist_ok=True)
        # a probe of its own: under the launcher every rank probes the same --out at once, and with one shared name
        # one rank's unlink removed the other's probe (FileNotFoundError, read as "cannot write": exit 2)
        with tempfile.NamedTemporaryFile(dir=run.out, prefix=".write-test-"):
            pass
    except OSError as e:
        fail(f"--out {run.out}: cannot write there ({e.strerror or e})")
    return Path(run.out)


# =========================================================================================================
# Stages 1-2 (pipeline.py: the cached base, a real model's stage directories) and the memory plan
# =========================================================================================================
def print_plan(argv: list[str]) -> "scale.MemoryPlan":
    """--plan: scale.py's per-GPU memory plan of the run these flags describe, loading no weights: --model (for
    `tiny`, its LlamaConfig) and its reward model, the critic's start (--critic-init, --critic-model), the judge (on
    real data with --judge-frac > 0), LoRA and the sharing load_models does, DeepSpeed engines (more than one GPU, or
    --deepspeed) or one process with torch AdamW, and the weights' dtype as the run loads them (--bf16 or DeepSpeed's
    bf16; else as saved). The shapes are the plan's flags (--micro-batch, --rollout-batch-per-gpu, --prompt-len, ...,
    the paper's set-up by default), or this run's own --minibatch, --rollout-batch, --ptx-batch, --max-prompt-tokens,
    --max-new-tokens, --sft-batch and --rm-batch (over the GPUs) when those are on the command line. The plan comes
    back with its stages 1-2 in plan.stages."""
    plan_args, rest = scale.add_plan_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    run, sft_cfg, rm_cfg, cfg, *_ = parse_configs(rest)  # everything else is train.py's: a typo is still an error
    real = run.model != "tiny"
    if real:
        model, reward, critic_model = run.sft_model or run.model, run.reward_model or None, run.critic_model or None
    else:
        model = reward = tiny_llama_config(run.vocab_size if run.data else len(toy_world.VOCAB), sft_cfg)
        critic_model = None
    G = plan_args.num_gpus
    engines = run.deepspeed or G > 1 if plan_args.engine == "auto" else plan_args.engine == "deepspeed"
    if plan_args.fp32:
        beta = 4
    elif run.bf16 or engines:  # DeepSpeed on an accelerator with bf16 (pipeline.use_bf16)
        beta = 2
    else:  # one process without --bf16: from_pretrained loads the weights as saved (the tiny world trains in fp32)
        beta = scale.saved_dtype_bytes(model) if real else 4
    given, shapes = given_flags(rest), {}
    for flag, key, per_gpu in (("minibatch", "micro_batch", True), ("rollout_batch", "rollout_batch_per_gpu", True),
                               ("ptx_batch", "ptx_batch_per_gpu", True), ("max_prompt_tokens", "prompt_len", False),
                               ("max_new_tokens", "response_len", False)):
        if flag in given and f"--{key.replace('_', '-')}" not in argv:  # the plan's own flag wins
            value = getattr(cfg if hasattr(cfg, flag) else run, flag)
            shapes[key] = max(1, value // G) if per_gpu else value
    stage_batch = {f"{k}_batch": max(1, getattr(c, f"{k}_batch") // G) if f"{k}_batch" in given else None
                   for k, c in (("sft", sft_cfg), ("rm", rm_cfg))}  # stages 1-2: sequences / pairs per GPU per step
    judge = bool(run.data and run.judge_frac) and (not real or "rm" in run.stages.split(","))
    settings = scale.plan_settings(plan_args, engine="deepspeed" if engines else "torch", dtype_bytes=beta,
                                   critic_init="model" if critic_model else cfg.critic_init,
                                   policy_init=cfg.policy_init, judge=judge, critic=cfg.advantage == "gae", **shapes)
    if not cfg.ptx_coef:
        settings["ptx_batch_per_gpu"] = 0
    try:
        plan = scale.plan_memory(model, reward_cfg=reward, critic_cfg=critic_model, **settings)
        # the tiny world and --data alone train stages 1-2 from scratch, in full (lora.py)
        plan.stages = scale.stage_plans(model, settings if real else {**settings, "lora_r": 0, "lora_bits": 16},
                                        **stage_batch)
    except (scale.ModelNotFound, ValueError) as e:
        fail(str(e))
    if run.model == "tiny":
        plan.name = "tiny (the synthetic world's LLaMA)"
    print(scale.format_stage_plans(plan.stages))
    print(scale.format_plan(plan))
    other = scale.plan_memory(model, reward_cfg=reward, critic_cfg=critic_model, suggest=False,
                              **{**settings, "critic": not settings["critic"]})  # the same run with / without a critic
    if settings["critic"]:
        print(f"A critic-free run (--advantage {'|'.join(critic_free.CRITIC_FREE)}) holds no critic: "
              f"{other.total_bytes / scale.GiB:.2f} GiB per GPU, {(plan.total_bytes - other.total_bytes) / scale.GiB:.2f} "
              f"GiB less")
    else:
        print(f"--advantage {cfg.advantage} holds no critic: {(other.total_bytes - plan.total_bytes) / scale.GiB:.2f} GiB "
              f"per GPU less than PPO with GAE's critic ({other.total_bytes / scale.GiB:.2f} GiB)")
    return plan


# =========================================================================================================
# The PPO stage's models (from pipeline.ppo_inputs), its judge and its state
# =========================================================================================================
@dataclass
class Models:
    """PPO's four models: policy and critic trained (DeepSpeed engines under the launcher), reference and reward
    model frozen (replicated on every rank for inference), and the two optimizers. A critic-free --advantage has
    three: critic and critic_opt are None."""
    policy: object
    ref: object
    reward_model: object
    critic: object
    policy_opt: object
    critic_opt: object
    bf16: bool = False


def load_models(inp: Inputs, run: RunConfig, cfg: ppo_max.PPOConfig, device: torch.device, ds: dict | None) -> Models:
    """The four models from their directories, in bf16 when the DeepSpeed config (or --bf16) says so, else as
    saved, with dropout off in every one of them (rollouts, experience and updates see one deterministic network).
    With --lora-r the policy and the critic train adapters on frozen weights, and the frozen models are those same
    weights with the adapters off (lora.AdaptersOff): the reference is the policy's base when both start from one
    directory (π_SFT), the reward model the critic's when the critic starts from it (PPO-max); no second copy."""
    bf16 = bool(ds.get("bf16", {}).get("enabled", False)) if ds else run.bf16
    kw = lora.load_kwargs(run, bf16)  # dtype, and --lora-bits' quantization of frozen weights
    place = (lambda m: m) if "quantization_config" in kw else (lambda m: m.to(device))  # quantized: placed on load
    with_critic = cfg.advantage == "gae"  # the critic-free estimators build no critic at all (critic_free.py)
    share_ref = lora.enabled(run) and Path(inp.ref) == Path(inp.policy)
    share_rm = with_critic and lora.enabled(run) and Path(inp.critic) == Path(inp.reward)
    load = lambda path: place(lm.causal_lm_class(path).from_pretrained(path, **kw))  # noqa: E731 (Mllama, Emu3: lm.py)
    policy = load(inp.policy)
    ref = None if share_ref else load(inp.ref).eval().requires_grad_(False)
    head_kw = {"torch_dtype": torch.bfloat16} if bf16 else {}
    frozen_q = {} if with_critic else {"quantization": lora.quantization(run)}  # no critic: the RM is frozen alone
    try:  # a reward model without a trained head stops here: it never becomes a random one
        reward_model = None if share_rm else ScalarHeadModel.from_pretrained(inp.reward, require_head=True, **head_kw,
                                                                             **frozen_q)
        critic = ScalarHeadModel.from_pretrained(inp.critic, require_head=share_rm, **head_kw,
                                                 quantization=lora.quantization(run)) if with_critic else None
    except ValueError as e:
        fail(f"--reward-model {e}")
    critic = place(critic) if critic is not None else None
    if reward_model is not None:
        reward_model = reward_model.eval().requires_grad_(False)
        reward_model = reward_model if frozen_q.get("quantization") else reward_model.to(device)
    if run.grad_ckpt:  # recompute activations in backward (the paper trains with it); generation is unaffected
        for m in (policy, critic):
            if m is not None:
                lm.gradient_checkpointing(m)
    if lora.enabled(run):  # adapters (B = 0: the models start as their directories), dropout 0 as everywhere in PPO
        policy = lora.add_adapters(policy, run, seed=run.seed, dropout=0.0)
        ref = ref or lora.AdaptersOff(policy)
        if with_critic:
            reward_head = copy.deepcopy(critic.head)  # the reward model's own head; the critic's head trains
            critic = lora.add_adapters(critic, run, seed=run.seed + 1, dropout=0.0)
            reward_model = reward_model or lora.reward_beside_critic(critic, reward_head)
    for model in (policy, ref, reward_model, critic):  # ρ = 1 on the first minibatch needs a deterministic network
        if model is not None and not isinstance(model, lora.AdaptersOff):  # (the policy's and critic's own weights)
            lm.disable_dropout(model)
    policy_opt = torch.optim.AdamW(lora.trainable(policy), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(lora.trainable(critic), lr=cfg.critic_lr, weight_decay=0.0) if critic else None
    if ds is not None:
        print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, policy and critic engines: "
              f"{json.dumps(ds)}")
        print("[deepspeed] reference and reward model: inference only, replicated on every rank (if they do not fit: "
              "ZeRO-3 / CPU offload with scale.inference_deepspeed_config; see --plan)")
    if lora.enabled(run):
        critic_n = f" / critic {sum(p.numel() for p in lora.trainable(critic)):,}" if critic else ""
        print(f"[lora] r {run.lora_r}, α {run.lora_alpha:g}, targets {run.lora_targets}: policy "
              f"{sum(p.numel() for p in lora.trainable(policy)):,}{critic_n} "
              f"trainable parameters; reference = {'the policy with adapters off' if share_ref else inp.ref}, reward "
              f"model = {'the critic with adapters off' if share_rm else inp.reward}")
    if critic is None:
        print(f"[advantage {cfg.advantage}] no critic: not built, not pre-trained (stage 3), no value loss, not "
              f"checkpointed")
    policy, policy_opt = engine.wrap(policy, policy_opt, ds, cfg.policy_lr)
    if critic is not None:
        critic, critic_opt = engine.wrap(critic, critic_opt, ds, cfg.critic_lr)
    return Models(policy, ref, reward_model, critic, policy_opt, critic_opt, bf16)


@dataclass
class Judge:
    """What decides "better" in the logs and the win rate, never optimised by PPO: the synthetic world's gold
    reward, or on real data a second reward model trained on pairs the proxy never saw."""
    name: str                                   # "gold" | "held-out reward model"
    key: str                                    # its metrics.jsonl key: "reward/gold" | "reward/judge"
    score: Callable                             # an eval.py judge: (prompts, texts, finished, ids, mask) → rewards
    model: object | None = None                 # the judge's reward model, if it is one


def make_judge(inp: Inputs, synthetic: bool, bf16: bool, device: torch.device, quantization: dict | None = None
               ) -> Judge | None:
    """Gold in the synthetic world; on real data the held-out reward model, one more frozen model (quantized like
    the others under --lora-bits)."""
    if synthetic:
        return Judge("gold", "reward/gold", toy_world.gold_judge)
    if not inp.judge:
        return None
    rm = ScalarHeadModel.from_pretrained(inp.judge, require_head=True, **({"torch_dtype": torch.bfloat16} if bf16 else {}),
                                         quantization=quantization)
    rm = lm.disable_dropout(rm).eval().requires_grad_(False)
    rm = rm if quantization else rm.to(device)
    return Judge("held-out reward model", "reward/judge", evaluation.rm_judge(rm), rm)


@dataclass
class LoopState:
    """What a resumed run restores besides weights, optimizers and RNG streams, to continue exactly."""
    moments: ppo_max.RunningMoments
    kl_ctl: ppo_max.AdaptiveKLController
    monitor: collapse.CollapseMonitor
    guard: checkpoint.NonFiniteGuard

    @classmethod
    def new(cls, run: RunConfig, cfg: ppo_max.PPOConfig) -> "LoopState":
        return cls(ppo_max.RunningMoments(), ppo_max.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon),
                   collapse.CollapseMonitor(kl_max=run.alarm_kl_max, patience=run.alarm_patience),
                   checkpoint.NonFiniteGuard(run.max_bad_steps, log=tqdm.write))

    def state_dict(self) -> dict:
        return {"moments": self.moments.state_dict(), "kl_coef": self.kl_ctl.value,
                "monitor": self.monitor.state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.moments.load_state_dict(d["moments"])
        self.kl_ctl.value = d["kl_coef"]
        self.monitor.load_state_dict(d["monitor"])
        self.guard.load_state_dict(d["guard"])


# =========================================================================================================
# Stage 4: PPO, one iteration per step, numbered as the paper's recipe (§5.4)
# =========================================================================================================
def ppo(m: Models, batches: data.RolloutBatches, state: LoopState, plumbing: "LoopPlumbing",
        cfg: ppo_max.PPOConfig, run: RunConfig) -> dict:
    """Steps start … run.steps − 1 of PPO-max, each the paper's steps (0)-(7). Everything that is not the
    algorithm — the progress bar, the non-finite guard, the judge, gathering across ranks, metrics, the collapse
    alarm, signals, checkpoints — sits behind the `plumbing` calls (LoopPlumbing, below), each one line.
    Returns how the loop ended: {"stop_reason", "signal", "path"}."""
    tokenizer = batches.tokenizer
    eos, pad_id = batches.stop_id, tokenizer.pad_token_id  # eos: EOS or the template's end of turn (data.stop_id)
    # the arguments every iteration passes unchanged, named here so that each numbered call is one line in pdb
    sampling = dict(max_new_tokens=cfg.max_new_tokens, eos_id=eos, pad_id=pad_id, temperature=cfg.temperature)
    models = (m.policy, m.ref, m.reward_model, m.critic)  # π_θ, π_SFT, the reward model, V_φ (None: critic-free)
    ptx_batch = functools.partial(batches.ptx, cfg.ptx_batch)  # Eq. 17's SFT rows, drawn by step (6) when it needs them
    warmup_steps = math.ceil(cfg.warmup_frac * run.steps)
    for step in plumbing.steps():  # PLUMBING: the bar; ends early on a signal, the guard or --on-collapse stop
        if step == run.break_at:
            breakpoint()  # --break-at STEP: step through this iteration in pdb (`n` next line, `s` step into)
        # (0) linear learning-rate warm-up over the first warmup_frac of the iterations (paper: 10%), then flat
        lr_scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        engine.set_lr(m.policy_opt, cfg.policy_lr * lr_scale)
        if m.critic_opt is not None:  # none with a critic-free --advantage
            engine.set_lr(m.critic_opt, cfg.critic_lr * lr_scale)
        prompts, query, query_mask = batches.prompts(cfg.rollout_batch, cfg.group_size)  # (B, P): G rows per prompt
        # (1) sample responses with the KV cache, stopping at EOS: response, response_mask (B, T), finished (B,)
        m.policy.eval()
        response, response_mask, finished = ppo_max.rollout(m.policy, query, query_mask, **sampling)
        # (2)-(5): score, normalise and clip (Eq. 18), KL-shape (Eq. 19) with η = kl_coef, values and GAE (Eq. 9) or,
        # without a critic, the group's or the batch's baseline (critic_free.py)
        kl_coef = state.kl_ctl.value  # η of Eq. 19 (it adapts only with --kl-target)
        exp = ppo_max.make_experience(*models, query, query_mask, response, response_mask, state.moments, cfg, kl_coef)
        if plumbing.skip(step, exp["nonfinite"]):  # PLUMBING: a NaN/inf in (2)-(5) skips the update (the guard)
            continue
        # (6) PPO epochs over minibatches: clipped policy loss, clipped value loss, ptx, global grad clip
        m.policy.train()
        if m.critic is not None:
            m.critic.train()
        upd = ppo_max.ppo_update(m.policy, m.critic, m.policy_opt, m.critic_opt, exp, cfg, ptx_batch)
        state.kl_ctl.update(exp["stats"]["kl/ref"], cfg.rollout_batch)  # adaptive η (only with --kl-target)
        # (7) log: the judge (gold: the synthetic human) is never seen by training; then checkpoint
        plumbing.end_step(step, exp, upd, prompts, finished)  # PLUMBING: judge, ranks, metrics, alarm, checkpoints
    return plumbing.ended


# ---------------------------------------------------------------------------------------------------------
# The loop's plumbing (skip on a first reading): nothing here changes what is trained
# ---------------------------------------------------------------------------------------------------------
class LoopPlumbing:
    """What a PPO step does besides the algorithm, behind three calls: steps() (the progress bar and the stopping
    rules), skip() (the non-finite guard) and end_step() (the judge, gathering across ranks, metrics.jsonl and
    samples.jsonl, the §5.2 collapse alarm, signals, checkpoints)."""

    def __init__(self, m: Models, state: LoopState, log: collapse.RunLog, ckpts: checkpoint.RunCheckpoints,
                 judge: Judge | None, interrupt: checkpoint.GracefulExit, run: RunConfig, start: int, tokenizer,
                 device: torch.device, group: int = 1, heldout: Callable[[int], dict] | None = None):
        self.m, self.state, self.log, self.ckpts, self.judge, self.interrupt = m, state, log, ckpts, judge, interrupt
        self.run, self.start, self.tokenizer, self.device, self.group = run, start, tokenizer, device, group
        self.heldout, self.point = heldout, {}
        self.ended = {"stop_reason": None, "signal": None, "path": None}

    def steps(self):
        """start … steps − 1 under the progress bar, until a stop reason or a signal ends the loop; at every
        --heldout-every step, first the held-out point of the policy as it is (logged with that step)."""
        for step in self.log.steps(self.start, self.run.steps):
            if self.ended["stop_reason"] or self.ended["signal"]:
                return
            every = self.run.heldout_every
            self.point = self.heldout(step) if self.heldout and every and step % every == 0 else {}
            self.t0 = time.time()
            yield step

    def skip(self, step: int, bad: str | None) -> bool:
        """The non-finite guard: True when `bad` names a NaN/inf of this step (its update is, or was, skipped);
        after --max-bad-steps such steps in a row, stop with the last good checkpoint intact."""
        if bad is None or not self.state.guard.step(step, bad):
            return False
        if self.state.guard.should_stop:
            self.ended["stop_reason"] = (f"{self.run.max_bad_steps} consecutive steps with non-finite values; last "
                                         f"good checkpoint: {checkpoint.find_latest(self.run.out)}")
        return True

    def end_step(self, step: int, exp: dict, upd: dict, prompts: list[str], finished: torch.Tensor) -> None:
        """Step (7): the judge's rewards, every metric (lists are the global batch), the alarm; then a signal or
        --save-every checkpoints the run."""
        if self.skip(step, (upd.get("guard/nonfinite") or [None])[0]):  # an optimizer step was NaN/inf
            return
        self.state.guard.ok()  # a step with everything finite: the count of bad steps in a row starts again
        judge, m = self.judge, self.m
        texts = [self.tokenizer.decode(r[k.bool()], skip_special_tokens=True)
                 for r, k in zip(exp["response"], exp["mask"])]
        with torch.no_grad():  # a reward-model judge reads the very ids (B, L) the proxy scored, with the same mask
            judged = judge.score(prompts, texts, finished, torch.cat([exp["query"], exp["response"]], 1),
                                 torch.cat([exp["query_mask"], exp["mask"]], 1)) if judge else None
        G = self.group  # the global batch in prompt order, each group of G responses whole
        prompts, texts = engine.gather_list(prompts, G), engine.gather_list(texts, G)
        judged = engine.gather_list(judged, G) if judge else None
        gold = judged if judge and judge.key == "reward/gold" else None
        metrics = {"step": step, **exp["stats"], **upd, **self.point,
                   "reward/gold": float(np.mean(gold)) if gold else None,
                   "kl/coef": self.state.kl_ctl.value, "lr/policy": m.policy_opt.param_groups[0]["lr"],
                   "response/finished": engine.gather_batch(finished.float()).mean().item(),
                   "time/step": time.time() - self.t0}
        if judge and not gold:
            metrics[judge.key] = float(np.mean(judged))  # the proxy's score vs the judge's: over-optimisation
        alarm = self.log.record(step, metrics, exp["all_scores"].tolist(), judged, prompts, texts,
                                judge.key if judge else "reward/gold")
        if alarm is not None and self.run.on_collapse == "stop":
            self.ended["stop_reason"] = f"collapse alarm at step {step}"
        if engine.any_rank(self.interrupt.requested, self.device):  # every rank stops at the same step
            self.ended["signal"] = self.interrupt.signal_name or "signal on another rank"
        done = step + 1
        every = self.run.save_every
        if self.ended["stop_reason"] or self.ended["signal"] or (every and done % every == 0):
            self.ended["path"] = self.ckpts.save(done, self.state.state_dict())


def heldout_points(m: Models, inp: Inputs, run: RunConfig, cfg: ppo_max.PPOConfig, judge: Judge | None
                   ) -> Callable[[int], dict]:
    """The held-out curve's point at a step (--heldout-every): the policy sampled on the held-out prompts as the
    final evaluation samples (top-p 0.9, temperature 0.8; --heldout-samples each, from a seed of the step's own),
    judged like it: the judge's mean (heldout/gold or heldout/judge), the proxy's (heldout/score), KL to the
    reference per token (heldout/kl) and the response length (heldout/length)."""
    prompts = [r["prompt"] for r in inp.rows["eval"]]
    proxy = evaluation.rm_judge(m.reward_model)
    key = {"reward/gold": "heldout/gold", "reward/judge": "heldout/judge"}[judge.key] if judge else None

    def point(step: int) -> dict:
        policy = engine.unwrap(m.policy)
        was_training = policy.training
        policy.eval()
        samples = evaluation.sample(policy, inp.tokenizer, prompts, run.heldout_samples, 10_007 * run.seed + step + 1,
                                    cfg.max_new_tokens)
        r, _ = evaluation.measure(policy, m.ref, m.reward_model, samples, judge.score if judge else proxy)
        policy.train(was_training)
        return {**({key: r["gold_reward"]} if key else {}), "heldout/score": r["reward"], "heldout/kl": r["kl"],
                "heldout/length": r["response_length"]}
    return point


def evaluate(m: Models, inp: Inputs, run: RunConfig, cfg: ppo_max.PPOConfig, history: list[dict],
             judge: Judge | None, device: torch.device) -> dict:
    """The held-out comparison of the final policy with the SFT model, sampled as the paper evaluates, judged by
    gold in the synthetic world; on real data by the held-out judge and, side by side, by the proxy reward model
    PPO optimised (optimistic by construction); the summary's numbers. Only the held-out part of the run's one
    split is sampled (inp.rows["eval"], pipeline.stage_records), and every judge scores the sampled ids with the
    masks of training, as in step (2) of the loop."""
    from transformers import AutoModelForCausalLM
    sft_model = AutoModelForCausalLM.from_pretrained(inp.base / "sft").to(device).eval() if inp.base else m.ref
    heldout = [r["prompt"] for r in inp.rows["eval"]]
    proxy = evaluation.rm_judge(m.reward_model)
    report = evaluation.compare(engine.unwrap(m.policy).eval(), sft_model, m.ref, m.reward_model, inp.tokenizer,
                                heldout, run.eval_samples, seed=run.seed, max_new_tokens=cfg.max_new_tokens,
                                judge=judge.score if judge else proxy,
                                extra_judges={"reward model (proxy)": proxy} if judge and judge.name != "gold" else None)
    peak = max(history, key=lambda h: h["reward/gold"]) if judge and judge.name == "gold" and history else None
    out = {"sft": report["sft"], "final": report["policy"],
           "peak": {"gold_reward": peak["reward/gold"], "step": peak["step"]} if peak else None,
           "win_rate_vs_sft": report["win_rate"], "judge": judge.name if judge else "reward model"}
    if report.get("win_rates"):
        out["win_rate_vs_sft_by_judge"] = {out["judge"]: report["win_rate"], **report["win_rates"]}
        out["judge_model"] = str(inp.judge)
    # the policy as itself (temperature 1): gold and proxy against d = √KL(π ‖ π_SFT), the over-optimisation curve
    out["frontier"] = evaluation.frontier_point(engine.unwrap(m.policy).eval(), sft_model, m.reward_model,
                                                inp.tokenizer, heldout, run.eval_samples, run.seed + 1,
                                                cfg.max_new_tokens, judge.score if judge else proxy)
    return out


def base_summary(inp: Inputs, run: RunConfig, dirs: dict | None) -> dict:
    """What summary.json says of stages 1-2: the RM's held-out accuracy (and length bias), or the given models."""
    dirs = {k: str(v) if v else None for k, v in (dirs or {}).items()}
    rm_log = (inp.base or Path(inp.reward)) / "rm_log.json"  # a real model's stage 2 keeps it in reward_model/
    if not rm_log.is_file():
        return {"models": dirs}
    rm = {"accuracy": json.loads(rm_log.read_text())[-1]["heldout_accuracy"]}
    if not inp.base:
        return {"models": dirs, "rm": rm}
    if not run.data:
        bias = json.loads((inp.base / "rm_length_bias.json").read_text())
        rm.update(length_slope=bias["rm_slope"], gold_length_slope=bias["gold_slope"])
    return {"rm": rm}


# =========================================================================================================
# The run: configure, stages 1-2 (cached), models, stage 3 (or resume), stage 4, evaluation
# =========================================================================================================
def start_processes(run: RunConfig, cfg: ppo_max.PPOConfig) -> tuple[int, int, torch.device]:
    """Threads, quiet libraries, and data parallelism: (rank, world size W, device); W = 1 and the CPU without the
    `deepspeed` launcher. Only rank 0 prints."""
    if run.threads:
        torch.set_num_threads(run.threads)
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards": one bar per model, every stage
    disable_progress_bars()
    if not (run.deepspeed or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        # without DeepSpeed, accelerate still imports it when a model is saved, and DeepSpeed then warns that it
        # found no GPU: say which accelerator it is (what it would pick itself) so that it stays quiet
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = engine.setup_distributed(run.deepspeed)
    if rank != 0:  # only rank 0 prints (and later: writes files, evaluates)
        sys.stdout = open(os.devnull, "w")
    for name, n in (("rollout_batch", cfg.rollout_batch), ("minibatch", cfg.minibatch)):
        if n % world:
            fail(f"--{name.replace('_', '-')} {n} must be divisible by the number of processes ({world}): the global "
                 f"batch is split evenly across ranks")
    if cfg.rollout_batch % (cfg.group_size * world):
        fail(f"--rollout-batch {cfg.rollout_batch} must be divisible by --group-size × processes ({cfg.group_size} × "
             f"{world}): each rank takes whole groups, so no group of G responses is split across ranks")
    return rank, world, device


def deepspeed_config(run: RunConfig, cfg: ppo_max.PPOConfig, world: int, device: torch.device) -> dict | None:
    """The engines' DeepSpeed JSON under the launcher or --deepspeed (None otherwise). It decides the dtype of the
    engines, and so of the frozen models beside them: bf16 where the accelerator has it, unless --fp32."""
    if not (run.deepspeed or world > 1):
        return None
    try:
        return engine.engine_config(run.deepspeed_config, run.zero_stage, use_bf16(run, device), cfg.minibatch // world,
                                    cfg.grad_clip)
    except engine.ConfigError as e:
        fail(str(e))


def write_summary(m: Models, inp: Inputs, run: RunConfig, cfg: ppo_max.PPOConfig, log: collapse.RunLog,
                  ended: dict, timings: dict, t_start: float, dirs: dict | None, judge: Judge | None,
                  device) -> dict:
    """Rank 0 at the end: the final policy and critic as Hugging Face directories, the held-out evaluation, and
    summary.json (printed as a table)."""
    out = Path(run.out)
    lora.save(m.policy, out / "policy", inp.tokenizer, inp.policy)  # LoRA: adapter/ and the merged model
    if m.critic is not None:
        lora.save(m.critic, out / "critic", inp.tokenizer, inp.critic)
    t0 = time.time()
    report = evaluate(m, inp, run, cfg, log.history, judge, device)
    timings["eval"] = time.time() - t0
    pretrain = out / "critic_pretrain.json"  # what the run sampled: critic pre-training rounds and PPO steps
    rounds = len(json.loads(pretrain.read_text())) if pretrain.is_file() else 0
    summary = {"method": "ppo", "preset": run.preset, "seed": run.seed, "steps": run.steps,
               "seconds": time.time() - t_start, "config": dataclasses.asdict(cfg),
               "base": str(inp.base) if inp.base else None, "timings": timings,
               **base_summary(inp, run, dirs), **report,
               "budget": {"policy_samples": (rounds + len(log.history)) * cfg.rollout_batch, "preference_pairs": 0},
               "collapse_alarm": log.alarm_info, "stopped": ended["stop_reason"]}
    if run.data and inp.base:
        summary["data"] = json.loads((inp.base / "data_report.json").read_text())
    write_json(out / "summary.json", summary)
    print(evaluation.format_table(summary))
    print("stage seconds: " + "  ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    print(f"curves: python eval.py plot {out} --out {out / 'curves.png'}")
    if run.data and inp.base:
        print(f"[data] {run.data}: {summary['data']['summary']}")
    return summary


def other_method(run: RunConfig, cfg: ppo_max.PPOConfig, dpo_cfg: dpo.DPOConfig, inp: Inputs, dirs: dict | None,
                 rank: int, world: int, device: torch.device, t_start: float) -> dict | None:
    """--method dpo (dpo.train_dpo on the reward model's own pairs, from the SFT model) or best-of-n (no training),
    then the held-out evaluation PPO gets: the same judge, prompts, sampling and summary.json layout."""
    checkpoint.seed_everything(run.seed + rank)
    out, timings, bf16 = Path(run.out), dict(inp.timings), use_bf16(run, device)
    head_kw = {"torch_dtype": torch.bfloat16} if bf16 else {}
    reward_model = lm.disable_dropout(ScalarHeadModel.from_pretrained(inp.reward, require_head=True, **head_kw))
    reward_model = reward_model.eval().requires_grad_(False).to(device)
    sft = lm.disable_dropout(lm.causal_lm_class(inp.ref).from_pretrained(inp.ref, **lora.load_kwargs(None, bf16)))
    sft = sft.to(device).eval().requires_grad_(False)
    judge = make_judge(inp, not (run.data or dirs), bf16, device, lora.quantization(run))
    heldout = [r["prompt"] for r in inp.rows["eval"]]
    t0 = time.time()
    if run.method == "dpo":
        pairs, heldout_pairs = preference_pairs(run, inp, dirs)
        policy = load_lm(inp.policy, bf16, device, run.grad_ckpt, run)
        log = dpo.train_dpo(policy, inp.tokenizer, pairs, heldout_pairs, dpo_cfg, run.seed,
                            ds=stage_ds(run, dpo_cfg.dpo_batch // world, device), out_dir=out / "policy",
                            progress=lambda r, d: collapse.progress(r, d, leave=False, disable=rank != 0))
        timings["dpo"] = time.time() - t0
        print(f"[DPO] {timings['dpo']:.1f} s; held-out implicit-reward accuracy {log[-1]['heldout_accuracy']:.3f}")
        if rank != 0:
            return None
        write_json(out / "dpo_log.json", log)
        t0 = time.time()
        report = evaluate(Models(policy, sft, reward_model, None, None, None), inp, run, cfg, [], judge, device)
        config, budget = {**dataclasses.asdict(dpo_cfg), "max_new_tokens": cfg.max_new_tokens}, {
            "policy_samples": 0, "preference_pairs": len(pairs), "pair_epochs": dpo_cfg.dpo_epochs}
    else:
        if rank != 0:
            return None
        score = judge.score if judge else evaluation.rm_judge(reward_model)
        rep = best_of_n.evaluate(sft, reward_model, inp.tokenizer, heldout, run.bon_n, run.eval_samples, run.seed,
                                 cfg.max_new_tokens, score)
        plain = best_of_n.sample(sft, reward_model, inp.tokenizer, heldout, run.bon_n, run.eval_samples, run.seed + 1,
                                 cfg.max_new_tokens, evaluation.PLAIN_SAMPLING)
        m_plain, _ = evaluation.measure(sft, sft, reward_model, plain, score)
        kl = best_of_n.bon_kl(run.bon_n)  # exact for continuous scores: no per-token KL to estimate
        report = {"sft": rep["sft"], "final": rep["policy"], "peak": None, "win_rate_vs_sft": rep["win_rate"],
                  "judge": judge.name if judge else "reward model",
                  "frontier": {"gold_reward": m_plain["gold_reward"], "reward": m_plain["reward"], "kl_seq": kl,
                               "d": kl ** 0.5, "response_length": m_plain["response_length"],
                               "samples": len(plain["texts"])}}
        config, budget = {"bon_n": run.bon_n, "max_new_tokens": cfg.max_new_tokens}, {
            "policy_samples": 0, "preference_pairs": 0, "samples_per_response": run.bon_n}
    timings["eval"] = time.time() - t0
    summary = {"method": run.method, "preset": run.method, "seed": run.seed, "steps": 0,
               "seconds": time.time() - t_start, "config": config, "base": str(inp.base) if inp.base else None,
               "timings": timings, **base_summary(inp, run, dirs), **report, "budget": budget}
    write_json(out / "summary.json", summary)
    print(evaluation.format_table(summary))
    print("stage seconds: " + "  ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return summary


def critic_stage(m: Models, batches: data.RolloutBatches, state: LoopState, inp: Inputs, cfg: ppo_max.PPOConfig,
                 out: Path, rank: int, timings: dict) -> None:
    """Stage 3, critic pre-training (§5.3.3): V fitted to the initial policy's returns before any policy update,
    its log in critic_pretrain.json; nothing (and no line) when --critic-pretrain-steps is 0."""
    if not cfg.critic_pretrain_steps:
        return
    t0 = time.time()
    critic_log = ppo_max.pretrain_critic(
        m.policy, m.ref, m.reward_model, m.critic, m.critic_opt, state.moments,
        lambda: batches.prompts(cfg.rollout_batch, cfg.group_size), cfg, data.stop_id(inp.tokenizer),
        inp.tokenizer.pad_token_id, state.kl_ctl.value,
        progress=lambda r: collapse.progress(r, "3. critic pre-training", leave=False, disable=rank != 0))
    timings["critic_pretrain"] = time.time() - t0
    print(f"[3. critic pre-training] {timings['critic_pretrain']:.1f} s")
    if rank == 0:
        write_json(out / "critic_pretrain.json", critic_log)


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # before parsing: the plan's flags (--num-gpus, ...) are scale.py's
        print_plan(argv)
        return None
    argv, run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg = configure(argv)  # with --resume: the recorded flags too
    dirs = resolve_real_models(run, cfg) if run.model != "tiny" else None  # fails at once, before anything loads
    if dirs:  # every id of the tokenizer must have an embedding, every text a stage builds fit every model's positions
        check_models(dirs)
        run, cfg = fit_context(run, cfg, dirs)
    check_data_files(run)
    check_lora(run, sft_cfg, dirs)
    out = make_out_dir(run)
    rank, world, device = start_processes(run, cfg)
    replace_earlier_run(run, out, rank)
    if rank == 0:  # --resume DIR alone continues from this record
        write_record(out, argv, run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg)
    print(f"preset {run.preset!r}: " + json.dumps(dataclasses.asdict(cfg)))
    t_start = time.time()

    # 1-2. SFT and reward model (cached), or the given models
    stage_timings, records = {}, None
    if dirs:  # one split of --data for every stage (pipeline.run_records); the tiny model's: in the cached base
        records = real_model_records(run, dirs)
        if rank == 0:  # records.json: what each stage reads (pipeline.stage_records), before the first one runs
            write_stage_records(out, stage_records(records, run, cfg))
        dirs = real_model_stages(run, cfg, sft_cfg, rm_cfg, dirs, rank, world, device, stage_timings, records)
    if last_stage(run) in ("sft", "rm"):
        return stop_after_stages(run, sft_cfg, rm_cfg, world_cfg, dirs, rank, cfg)
    inp = ppo_inputs(run, cfg, sft_cfg, rm_cfg, world_cfg, dirs, rank == 0, records)
    inp.timings.update(stage_timings)
    if run.method != "ppo":  # DPO or best-of-n in the place of stages 3-4, evaluated as PPO is
        return other_method(run, cfg, dpo_cfg, inp, dirs, rank, world, device, t_start)
    if cfg.ptx_coef and not inp.rows["ptx"]:
        print("[ptx] no SFT text (--prompts only): the ptx term (Eq. 17) is off; pass --data pairs to keep it")
        cfg = dataclasses.replace(cfg, ptx_coef=0.0)
    checkpoint.seed_everything(run.seed + rank)  # rank r samples its own stream; rank 0's is the single-process one
    ds = deepspeed_config(run, cfg, world, device)
    m = load_models(inp, run, cfg, device, ds)
    judge = make_judge(inp, not (run.data or dirs), m.bf16, device, lora.quantization(run))  # gold: the synthetic human
    batches = data.RolloutBatches([r["prompt"] for r in inp.rows["ppo"]],  # as records.json lists them
                                  [(r["prompt"], r["response"]) for r in inp.rows["ptx"]], inp.tokenizer,
                                  seed=run.seed, rank=rank, world=world, device=device)
    state = LoopState.new(run, cfg)
    ckpts = run_checkpoints(m, out, batches, run, rank)
    timings, start, history, samples = dict(inp.timings), 0, [], []
    if run.resume:  # exact resume: weights, optimizers, RNG streams, moments, η, monitor, guard, logs so far
        start, history, samples = resume(run, ckpts, state, out)
    elif "critic" in run.stages.split(",") and m.critic is not None:  # a critic-free --advantage has no stage 3
        critic_stage(m, batches, state, inp, cfg, out, rank, timings)  # 3. critic pre-training (§5.3.3)
        if last_stage(run) == "critic":  # --stages ...,critic: the pre-trained critic is the result
            return save_critic(m, inp, run, out, rank)

    # 4. PPO
    t0 = time.time()
    log = collapse.RunLog(out, state.monitor, history, samples, main_rank=rank == 0,
                          tracker=tracker(run, inp, out, rank))
    with checkpoint.GracefulExit() as interrupt:  # SIGINT/SIGTERM: finish the step, checkpoint, exit; not under pdb
        plumbing = LoopPlumbing(m, state, log, ckpts, judge, interrupt, run, start, inp.tokenizer, device,
                                cfg.group_size, heldout_points(m, inp, run, cfg, judge))
        ended = ppo(m, batches, state, plumbing, cfg, run)
    log.close()
    timings["ppo"] = time.time() - t0
    if ended["signal"]:
        print(f"[{ended['signal']}] checkpoint written to {ended['path']}; continue with: "
              f"{'deepspeed' if world > 1 else 'python'} train.py --resume {out}")
        raise SystemExit(0)
    if ended["stop_reason"] and not log.alarm_info:  # non-finite values: stop with the last good checkpoint intact
        print(f"error: stopped: {ended['stop_reason']}", file=sys.stderr)
        raise SystemExit(1)
    if not ended["stop_reason"] and (not run.save_every or run.steps % run.save_every):
        ckpts.save(run.steps, state.state_dict())
    engine.close_distributed()  # the last collective is behind us (under DeepSpeed)
    if rank != 0:  # rank 0 alone saves the final models, evaluates and writes the summary
        return None
    return write_summary(m, inp, run, cfg, log, ended, timings, t_start, dirs, judge, device)


if __name__ == "__main__":
    cli.cli_guard(main)()  # bad --data input: one line naming file, line and problem; exit 2
