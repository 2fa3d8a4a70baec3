"""Train RLHF with PPO-max end to end: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964).

Run:
  python train.py                       # the synthetic world on the CPU, every stage, a few minutes
  python train.py --preset vanilla      # the same world with vanilla PPO: watch it collapse (Fig. 4)
  python train.py --rebuild-base        # stages 1-2 again, even when runs/_base holds them (step into SFT, Eq. 2)
  python train.py --help                # every flag, with its paper symbol and default
  python train.py --model DIR --data PAIRS [--stages sft,rm]       # a real Hugging Face model through every stage
  python train.py --model llama-7b --plan [--num-gpus 8 --gpu-mem 80 ...]   # per-GPU memory bill; loads nothing
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
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import cli
import data
import engine
import eval as evaluation
import lm
import lora
import monitor as collapse
import ppo_max
import scale
import toy_world
from cli import arg, fail
from pipeline import (STAGES, Inputs, last_stage, ppo_inputs, real_model_stages, resolve_real_models,
                      stop_after_stages, use_bf16, write_json)
from reward_model import RMConfig, ScalarHeadModel
from sft import SFTConfig, tiny_llama_config


# =========================================================================================================
# Configuration: one dataclass per stage; every field is a flag (`--field-name`)
# =========================================================================================================
@dataclass
class RunConfig:
    preset: str = arg("ppo-max", f"named set of PPO flags: {', '.join(ppo_max.PRESETS)}")
    seed: int = arg(0, "seed of the world, every model init and every sample", ">=0")
    steps: int = arg(80, "PPO iterations (each: one rollout batch, then PPO epochs over it)", ">=1")
    out: str = arg("", "output directory (default runs/<preset>-seed<seed>; with --lora-r R: "
                       "runs/<preset>-loraR-seed<seed>)")
    model: str = arg("tiny", "policy/SFT model: 'tiny' (synthetic world), an alias, a hub id or a local HF directory")
    eval_samples: int = arg(4, "samples per held-out prompt for the final evaluation and win rate", ">=1")
    threads: int = arg(1, "torch CPU threads (0 = torch's default); the tiny models gain nothing from more, and on a "
                          "shared machine extra threads mostly wait for each other", ">=0")
    rebuild_base: bool = arg(False, "train stages 1-2 (SFT, reward model) again even when runs/_base or --out holds "
                                    "them")
    stages: str = arg("sft,rm,critic,ppo", "the stages to run, in order (sft, rm, critic, ppo); the run stops after "
                                           "the last one listed, e.g. sft,rm trains only a reward model")
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
    vocab_size: int = arg(2000, "with --data: byte-level BPE vocabulary, trained on the training split only", ">=1")
    max_prompt_tokens: int = arg(128, "with --data: P limit; longer prompts keep their latest turns", ">=1")
    max_response_tokens: int = arg(64, "with --data: T limit (EOS included); longer pairs are dropped and counted",
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
    sft_data: str = arg("", "real --model: SFT data ({prompt,response}, {messages} or {text} lines) instead of the "
                            "chosen responses of --data")
    reward_model: str = arg("", "real --model: a reward model directory, so stage 2 is skipped (ours, or an "
                                "AutoModelForSequenceClassification with num_labels 1)")
    critic_model: str = arg("", "real --model: the critic init (default: the reward model, as PPO-max)")
    prompts: str = arg("", "real --model: a .jsonl[.gz] of {\"prompt\"} lines for the rollouts (or use --data's)")
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
             world_cfg: toy_world.WorldConfig) -> None:
    """Every flag against its range or choices, the files it names, and the combinations the loop needs: one line
    naming the flag, its value and what is allowed (exit 2), before anything is trained, loaded or written."""
    for obj, prefix in ((run, ""), (sft_cfg, ""), (rm_cfg, ""), (cfg, ""), (world_cfg, "world-")):
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
            json.loads(Path(run.deepspeed_config).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            fail(f"--deepspeed_config {run.deepspeed_config}: not valid JSON ({str(e).splitlines()[0]})")
    if run.resume and not Path(run.resume).exists():
        fail(f"--resume {run.resume}: no such run or checkpoint directory")
    if cfg.minibatch > cfg.rollout_batch:
        fail(f"--minibatch {cfg.minibatch}: must be ≤ --rollout-batch {cfg.rollout_batch} (a minibatch is a part of "
             f"the rollout batch)")
    if sft_cfg.sft_hidden % sft_cfg.sft_heads:
        fail(f"--sft-hidden {sft_cfg.sft_hidden}: must be divisible by --sft-heads {sft_cfg.sft_heads}")
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


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineParser(prog="train.py", description=__doc__.split("\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for title, cls in [("run", RunConfig), ("SFT", SFTConfig), ("reward model", RMConfig), ("PPO", ppo_max.PPOConfig)]:
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
    """(RunConfig, SFTConfig, RMConfig, PPOConfig, WorldConfig) of a command line: the preset's PPO flags with the
    given ones on top, and --out defaulting to runs/<preset>-seed<seed> (or the resumed run's directory)."""
    args = build_parser().parse_args(argv)
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # noqa: E731
    run, sft_cfg, rm_cfg = pick(RunConfig), pick(SFTConfig), pick(RMConfig)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ppo_max.PPOConfig)
                 if getattr(args, f.name) is not None}
    try:
        ppo = ppo_max.apply_preset(run.preset, **overrides)
    except ValueError as e:
        fail(f"--preset: {e}")
    world = toy_world.WorldConfig(seed=run.seed, **{f.name: getattr(args, "world_" + f.name)
                                                     for f in dataclasses.fields(toy_world.WorldConfig) if f.name != "seed"})
    if run.resume and not run.out:  # --resume alone continues in the run's own directory
        p = Path(run.resume)
        run.out = str(p.parent.parent if p.name.startswith("step-") else p.parent if p.name == "checkpoints" else p)
    if not run.out:
        run.out = f"runs/{run.preset}{lora_tag(run)}-seed{run.seed}"  # LoRA runs never share a full-weight run's dir
    validate(run, sft_cfg, rm_cfg, ppo, world)
    return run, sft_cfg, rm_cfg, ppo, world


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
# harmless-base-test.dev.jsonl.gz --skip-bad, 2 shared (loaded) cores: 3 min 19 s in all (data 2 s, SFT 74 s,
# RM 27 s, critic pre-training 58 s, PPO 27 s, eval 5 s); held-out RM accuracy 0.614 on 83 pairs.
REAL_DATA_DEFAULTS = dict(sft_hidden=128, sft_epochs=2.0, sft_batch=32, rm_epochs=1.0, rm_lr=5e-4,
                          steps=10, rollout_batch=32, max_new_tokens=32, critic_pretrain_steps=4, eval_samples=1)

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
        out[0].out = f"runs/{out[0].preset}-{Path(out[0].data).name.split('.')[0]}{lora_tag(out[0])}-seed{out[0].seed}"
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
SAFE_ON_RESUME = {"steps", "save_every", "keep_last", "threads", "eval_samples", "max_bad_steps", "on_collapse",
                  "alarm_kl_max", "alarm_patience", "resume", "out", "deepspeed"}  # what --resume may change


def configure(argv) -> tuple[list[str], RunConfig, SFTConfig, RMConfig, ppo_max.PPOConfig, toy_world.WorldConfig]:
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
    recorded = json.loads(record.read_text())["argv"]
    combined = recorded + argv + ["--out", run.out]
    with contextlib.redirect_stdout(io.StringIO()):  # the presets' messages, printed once by the real resolve
        before, after = resolve(recorded + ["--out", run.out]), resolve(combined)
    for prefix, old, new in zip(("", "", "", "", "world-"), before, after):
        for name, value in dataclasses.asdict(new).items():
            if value != getattr(old, name) and name not in SAFE_ON_RESUME:
                flag = f"--{prefix}{name.replace('_', '-')}"
                fail(f"{flag} {value!r} contradicts the run's {flag} {getattr(old, name)!r} (recorded in {record}): "
                     f"--resume continues the run as configured; leave it out (only "
                     f"{', '.join('--' + s.replace('_', '-') for s in sorted(SAFE_ON_RESUME - {'resume', 'out'}))} "
                     f"may change)")
    return combined


def resolve(argv):
    """(run, sft_cfg, rm_cfg, cfg, world_cfg) of a command line, presets and defaults applied and checked."""
    run, sft_cfg, rm_cfg, cfg, world_cfg = parse_configs(argv)
    if run.data and run.model == "tiny":  # real text: a smaller budget for the flags not given, and no gold judge
        run, sft_cfg, rm_cfg, cfg = real_data_configs(argv, run, sft_cfg, rm_cfg, cfg)
    if run.model in MODEL_PRESETS:
        run, cfg, sft_cfg, rm_cfg = model_preset_configs(argv, run, cfg, sft_cfg, rm_cfg)
    if cfg.policy_init != "sft" and (run.data or run.model != "tiny"):
        fail("--policy-init pretrained needs the synthetic world")
    if cfg.ptx_data != "sft" and (run.data or run.model != "tiny"):
        fail("--ptx-data pretrain needs the synthetic world (its pretraining text); on real data ptx uses --sft-data "
             "or --data")
    stages = [s.strip() for s in run.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages) or stages != sorted(stages, key=STAGES.index):
        fail(f"--stages {run.stages}: expected stages from {','.join(STAGES)}, in that order (e.g. sft,rm)")
    return run, sft_cfg, rm_cfg, cfg, world_cfg


def resume(run: RunConfig, ckpts: checkpoint.RunCheckpoints, state: LoopState, out: Path) -> tuple[int, list[dict]]:
    """The newest intact checkpoint restored into the models, optimizers, RNG streams and `state`: (its step, the
    metrics of the steps before it)."""
    try:
        ckpt, saved = ckpts.resume(run.resume)
    except ValueError as e:
        fail(str(e))
    state.load_state_dict(saved["extra_state"])
    print(f"[resume] {ckpt}: continuing at step {saved['step']}")
    return saved["step"], data.read_records(out / "metrics.jsonl")[:saved["step"]]


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
                                                             zip(("run", "sft", "rm", "ppo", "world"), configs)}})


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


def make_out_dir(run: RunConfig) -> Path:
    """The run's own directory, the first thing written, so that an unwritable --out fails before any stage."""
    try:
        Path(run.out).mkdir(parents=True, exist_ok=True)
        probe = Path(run.out) / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        fail(f"--out {run.out}: cannot write there ({e.strerror or e})")
    return Path(run.out)


# =========================================================================================================
# Stages 1-2 (pipeline.py: the cached base, a real model's stage directories) and the memory plan
# =========================================================================================================
def print_plan(argv: list[str]) -> "scale.MemoryPlan":
    """--plan: scale.py's per-GPU memory plan for --model (for `tiny`, its LlamaConfig), without loading weights.
    The plan's own flags (--num-gpus, --gpu-mem, --zero-stage, --micro-batch, ...) default to the paper's set-up."""
    plan_args, rest = scale.add_plan_args(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    run, sft_cfg, *_ = parse_configs(rest)  # everything else is train.py's: a typo is still an error
    if run.model == "tiny":
        model = reward = tiny_llama_config(run.vocab_size if run.data else len(toy_world.VOCAB), sft_cfg)
    else:
        model, reward = run.sft_model or run.model, run.reward_model or None
    try:
        plan = scale.plan_from_args(model, plan_args, reward)
        stage_plans = scale.stage_plans_from_args(model, plan_args)
    except (scale.ModelNotFound, ValueError) as e:
        fail(str(e))
    if run.model == "tiny":
        plan.name = "tiny (the synthetic world's LLaMA)"
    print(scale.format_stage_plans(stage_plans))
    print(scale.format_plan(plan))
    if run.judge_frac and (run.data or run.model != "tiny"):  # the judge: one more frozen model, on every GPU
        judge, _ = scale.frozen_bytes(scale.llama_config_numbers(model), plan_args.lora_bits, 2)
        print(f"Not counted above: with --data, the held-out judge (--judge-frac {run.judge_frac:g}) is one more frozen "
              f"model during PPO,\n  + {judge / scale.GiB:.2f} GiB per GPU; --judge-frac 0 judges by the proxy "
              f"reward model instead")
    return plan


# =========================================================================================================
# The PPO stage's models (from pipeline.ppo_inputs), its judge and its state
# =========================================================================================================
@dataclass
class Models:
    """PPO's four models: policy and critic trained (DeepSpeed engines under the launcher), reference and reward
    model frozen (replicated on every rank for inference), and the two optimizers."""
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
    from transformers import AutoModelForCausalLM
    bf16 = bool(ds.get("bf16", {}).get("enabled", False)) if ds else run.bf16
    kw = lora.load_kwargs(run, bf16)  # dtype, and --lora-bits' quantization of frozen weights
    place = (lambda m: m) if "quantization_config" in kw else (lambda m: m.to(device))  # quantized: placed on load
    share_ref = lora.enabled(run) and Path(inp.ref) == Path(inp.policy)
    share_rm = lora.enabled(run) and Path(inp.critic) == Path(inp.reward)
    policy = place(AutoModelForCausalLM.from_pretrained(inp.policy, **kw))
    ref = None if share_ref else place(AutoModelForCausalLM.from_pretrained(inp.ref, **kw)).eval().requires_grad_(False)
    head_kw = {"torch_dtype": torch.bfloat16} if bf16 else {}
    try:  # a reward model without a trained head stops here: it never becomes a random one
        reward_model = None if share_rm else ScalarHeadModel.from_pretrained(inp.reward, require_head=True, **head_kw)
        critic = ScalarHeadModel.from_pretrained(inp.critic, require_head=share_rm, **head_kw,
                                                 quantization=lora.quantization(run))
    except ValueError as e:
        fail(f"--reward-model {e}")
    critic = place(critic)
    if reward_model is not None:
        reward_model = reward_model.eval().requires_grad_(False).to(device)
    if run.grad_ckpt:  # recompute activations in backward (the paper trains with it); generation is unaffected
        for m in (policy, critic):
            lm.gradient_checkpointing(m)
    if lora.enabled(run):  # adapters (B = 0: the models start as their directories), dropout 0 as everywhere in PPO
        reward_head = copy.deepcopy(critic.head)  # the reward model's own head; the critic's head trains
        policy = lora.add_adapters(policy, run, seed=run.seed, dropout=0.0)
        critic = lora.add_adapters(critic, run, seed=run.seed + 1, dropout=0.0)
        ref = ref or lora.AdaptersOff(policy)
        reward_model = reward_model or lora.reward_beside_critic(critic, reward_head)
    for model in (policy, ref, reward_model, critic):  # ρ = 1 on the first minibatch needs a deterministic network
        if not isinstance(model, lora.AdaptersOff):  # (those are the policy's and the critic's own weights)
            lm.disable_dropout(model)
    policy_opt = torch.optim.AdamW(lora.trainable(policy), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(lora.trainable(critic), lr=cfg.critic_lr, weight_decay=0.0)
    if ds is not None:
        print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, policy and critic engines: "
              f"{json.dumps(ds)}")
        print("[deepspeed] reference and reward model: inference only, replicated on every rank (if they do not fit: "
              "ZeRO-3 / CPU offload with scale.inference_deepspeed_config; see --plan)")
    if lora.enabled(run):
        print(f"[lora] r {run.lora_r}, α {run.lora_alpha:g}, targets {run.lora_targets}: policy "
              f"{sum(p.numel() for p in lora.trainable(policy)):,} / critic {sum(p.numel() for p in lora.trainable(critic)):,} "
              f"trainable parameters; reference = {'the policy with adapters off' if share_ref else inp.ref}, reward "
              f"model = {'the critic with adapters off' if share_rm else inp.reward}")
    policy, policy_opt = engine.wrap(policy, policy_opt, ds, cfg.policy_lr)
    critic, critic_opt = engine.wrap(critic, critic_opt, ds, cfg.critic_lr)
    return Models(policy, ref, reward_model, critic, policy_opt, critic_opt, bf16)


@dataclass
class Judge:
    """What decides "better" in the logs and the win rate, never optimised by PPO: the synthetic world's gold
    reward, or on real data a second reward model trained on pairs the proxy never saw."""
    name: str                                   # "gold" | "held-out reward model"
    key: str                                    # its metrics.jsonl key: "reward/gold" | "reward/judge"
    score: Callable[[str, str, bool], float]    # (prompt, response text, finished) → reward
    model: object | None = None                 # the judge's reward model: scores the rollout's own ids in one batch

    @torch.no_grad()
    def rewards(self, prompts: list[str], texts: list[str], finished, ids, mask) -> list[float]:
        """The judge's reward of each response of a batch: a reward model reads the very ids (B, L) the proxy
        scored, in one batch; gold reads the text."""
        if self.model is not None:
            return self.model.score(ids, mask).float().tolist()
        return [self.score(p, t, bool(f)) for p, t, f in zip(prompts, texts, finished)]


def make_judge(inp: Inputs, synthetic: bool, bf16: bool, device: torch.device, quantization: dict | None = None
               ) -> Judge | None:
    """Gold in the synthetic world; on real data the held-out reward model, one more frozen model (quantized like
    the others under --lora-bits)."""
    if synthetic:
        return Judge("gold", "reward/gold", evaluation.gold_judge)
    if not inp.judge:
        return None
    rm = ScalarHeadModel.from_pretrained(inp.judge, require_head=True, **({"torch_dtype": torch.bfloat16} if bf16 else {}),
                                         quantization=quantization)
    rm = lm.disable_dropout(rm).eval().requires_grad_(False)
    rm = rm if quantization else rm.to(device)
    return Judge("held-out reward model", "reward/judge", evaluation.rm_judge(rm, inp.tokenizer), rm)


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
# Stage 4: PPO, one iteration per step, numbered as the paper's recipe
# =========================================================================================================
def ppo(m: Models, batches: data.RolloutBatches, state: LoopState, log: collapse.RunLog,
        ckpts: checkpoint.RunCheckpoints, cfg: ppo_max.PPOConfig, run: RunConfig, start: int, tokenizer,
        judge: Judge | None, device: torch.device) -> dict:
    """Steps start … run.steps − 1 of PPO-max. Returns how the loop ended: {"stop_reason", "signal", "path"}."""
    eos, pad_id = data.stop_id(tokenizer), tokenizer.pad_token_id  # eos: EOS or the template's end of turn
    warmup_steps = math.ceil(cfg.warmup_frac * run.steps)
    ended = {"stop_reason": None, "signal": None, "path": None}
    with checkpoint.GracefulExit() as interrupt:
        for step in log.steps(start, run.steps):
            ts = time.time()
            # (0) linear learning-rate warm-up over the first warmup_frac of the iterations (paper: 10%), then flat
            lr_scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
            engine.set_lr(m.policy_opt, cfg.policy_lr * lr_scale)
            engine.set_lr(m.critic_opt, cfg.critic_lr * lr_scale)
            prompts, query, query_mask = batches.prompts(cfg.rollout_batch)                 # (B, P)
            # (1) sample responses with the KV cache, stopping at EOS
            m.policy.eval()
            response, response_mask, finished = ppo_max.rollout(m.policy, query, query_mask, cfg.max_new_tokens, eos,
                                                                pad_id, cfg.temperature)  # (B, T), (B, T), (B,)
            # (2)-(5): score, normalise/clip (Eq. 18), KL-shape (Eq. 19), values and GAE (Eq. 9)
            exp = ppo_max.make_experience(m.policy, m.ref, m.reward_model, m.critic, query, query_mask, response,
                                          response_mask, state.moments, cfg, state.kl_ctl.value)
            # (6) PPO epochs over minibatches: clipped policy loss, clipped value loss, ptx, global grad clip
            upd = {}
            if not exp["nonfinite"]:
                m.policy.train(); m.critic.train()
                upd = ppo_max.ppo_update(m.policy, m.critic, m.policy_opt, m.critic_opt, exp, cfg,
                                         lambda: batches.ptx(cfg.ptx_batch))
                state.kl_ctl.update(exp["stats"]["kl/ref"], cfg.rollout_batch)
            if state.guard.step(step, exp["nonfinite"] or (upd.get("guard/nonfinite") or [None])[0]):
                if state.guard.should_stop:  # the update was skipped; stop with the last good checkpoint intact
                    ended["stop_reason"] = (f"{run.max_bad_steps} consecutive steps with non-finite values; last good "
                                            f"checkpoint: {checkpoint.find_latest(run.out)}")
                    break
                continue
            # (7) log: the judge (gold: the synthetic human) is never seen by training; lists are the global batch
            texts = [tokenizer.decode(r[k.bool()], skip_special_tokens=True) for r, k in zip(response, response_mask)]
            judged = judge.rewards(prompts, texts, finished, torch.cat([query, response], 1),
                                   torch.cat([query_mask, response_mask], 1)) if judge else None
            prompts, texts = engine.gather_list(prompts), engine.gather_list(texts)
            judged = engine.gather_list(judged) if judge else None
            gold = judged if judge and judge.key == "reward/gold" else None
            metrics = {"step": step, **exp["stats"], **upd, "reward/gold": float(np.mean(gold)) if gold else None,
                       "kl/coef": state.kl_ctl.value, "lr/policy": cfg.policy_lr * lr_scale,
                       "response/finished": engine.gather_batch(finished.float()).mean().item(),
                       "time/step": time.time() - ts}
            if judge and not gold:
                metrics[judge.key] = float(np.mean(judged))  # the proxy's score vs the judge's: over-optimisation
            alarm = log.record(step, metrics, exp["all_scores"].tolist(), judged, prompts, texts,
                               judge.key if judge else "reward/gold")
            if alarm is not None and run.on_collapse == "stop":
                ended["stop_reason"] = f"collapse alarm at step {step}"
            if engine.any_rank(interrupt.requested, device):  # every rank stops at the same step
                ended["signal"] = interrupt.signal_name or "signal on another rank"
            done = step + 1
            if ended["stop_reason"] or ended["signal"] or (run.save_every and done % run.save_every == 0):
                ended["path"] = ckpts.save(done, state.state_dict())
            if ended["stop_reason"] or ended["signal"]:
                break
    return ended


def evaluate(m: Models, inp: Inputs, run: RunConfig, cfg: ppo_max.PPOConfig, history: list[dict],
             judge: Judge | None, device: torch.device) -> dict:
    """The held-out comparison of the final policy with the SFT model, sampled as the paper evaluates, judged by
    gold in the synthetic world; on real data by the held-out judge and, side by side, by the proxy reward model
    PPO optimised (optimistic by construction); the summary's numbers."""
    from transformers import AutoModelForCausalLM
    sft_model = AutoModelForCausalLM.from_pretrained(inp.base / "sft").to(device).eval() if inp.base else m.ref
    heldout = [r["prompt"] for r in inp.data["prompts_heldout"]]
    proxy = evaluation.rm_judge(m.reward_model, inp.tokenizer)
    report = evaluation.compare(engine.unwrap(m.policy).eval(), sft_model, m.ref, m.reward_model, inp.tokenizer,
                                heldout, run.eval_samples, seed=run.seed, max_new_tokens=cfg.max_new_tokens,
                                judge=judge.score if judge else proxy,
                                extra_judges={"reward model (proxy)": proxy} if judge and judge.name != "gold" else None)
    peak = max(history, key=lambda h: h["reward/gold"]) if judge and judge.name == "gold" else None
    out = {"sft": report["sft"], "final": report["policy"],
           "peak": {"gold_reward": peak["reward/gold"], "step": peak["step"]} if peak else None,
           "win_rate_vs_sft": report["win_rate"], "judge": judge.name if judge else "reward model"}
    if report.get("win_rates"):
        out["win_rate_vs_sft_by_judge"] = {out["judge"]: report["win_rate"], **report["win_rates"]}
        out["judge_model"] = str(inp.judge)
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
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    rank, world, device = engine.setup_distributed(run.deepspeed)
    if rank != 0:  # only rank 0 prints (and later: writes files, evaluates)
        sys.stdout = open(os.devnull, "w")
        hf_logging.disable_progress_bar()
    for name, n in (("rollout_batch", cfg.rollout_batch), ("minibatch", cfg.minibatch)):
        if n % world:
            fail(f"--{name.replace('_', '-')} {n} must be divisible by the number of processes ({world}): the global "
                 f"batch is split evenly across ranks")
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
    lora.save(m.critic, out / "critic", inp.tokenizer, inp.critic)
    t0 = time.time()
    report = evaluate(m, inp, run, cfg, log.history, judge, device)
    timings["eval"] = time.time() - t0
    summary = {"preset": run.preset, "seed": run.seed, "steps": run.steps, "seconds": time.time() - t_start,
               "config": dataclasses.asdict(cfg), "base": str(inp.base) if inp.base else None, "timings": timings,
               **base_summary(inp, run, dirs), **report,
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


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # before parsing: the plan's flags (--num-gpus, ...) are scale.py's
        print_plan(argv)
        return None
    argv, run, sft_cfg, rm_cfg, cfg, world_cfg = configure(argv)  # with --resume: the run's recorded flags too
    dirs = resolve_real_models(run, cfg) if run.model != "tiny" else None  # fails at once, before anything loads
    check_data_files(run)
    check_lora(run, sft_cfg, dirs)
    out = make_out_dir(run)
    rank, world, device = start_processes(run, cfg)
    if rank == 0:  # --resume DIR alone continues from this record
        write_record(out, argv, run, sft_cfg, rm_cfg, cfg, world_cfg)
    print(f"preset {run.preset!r}: " + json.dumps(dataclasses.asdict(cfg)))
    t_start = time.time()

    # 1-2. SFT and reward model (cached), or the given models
    stage_timings = {}
    if dirs:
        dirs = real_model_stages(run, cfg, sft_cfg, rm_cfg, dirs, rank, world, device, stage_timings)
    if last_stage(run) in ("sft", "rm"):
        return stop_after_stages(run, sft_cfg, rm_cfg, world_cfg, dirs, rank)
    inp = ppo_inputs(run, cfg, sft_cfg, rm_cfg, world_cfg, dirs, rank == 0)
    inp.timings.update(stage_timings)
    if cfg.ptx_coef and not inp.data["sft"]:
        print("[ptx] no SFT text (--prompts only): the ptx term (Eq. 17) is off; pass --data pairs to keep it")
        cfg = dataclasses.replace(cfg, ptx_coef=0.0)
    checkpoint.seed_everything(run.seed + rank)  # rank r samples its own stream; rank 0's is the single-process one
    ds = deepspeed_config(run, cfg, world, device)
    m = load_models(inp, run, cfg, device, ds)
    judge = make_judge(inp, not (run.data or dirs), m.bf16, device, lora.quantization(run))  # gold: the synthetic human
    batches = data.RolloutBatches([r["prompt"] for r in inp.data["prompts_train"]],
                                  [(r["prompt"], r["response"]) for r in inp.data["sft"]], inp.tokenizer,
                                  seed=run.seed, rank=rank, world=world, device=device)
    state = LoopState.new(run, cfg)
    ckpts = checkpoint.RunCheckpoints(out, {"policy": m.policy, "critic": m.critic},
                                      {"policy": m.policy_opt, "critic": m.critic_opt}, {"prompt": batches.rng},
                                      inp.tokenizer, run.keep_last, rank, engine.barrier)
    timings, start, history = dict(inp.timings), 0, []
    if run.resume:  # exact resume: weights, optimizers, RNG streams, moments, η, monitor, guard, metrics so far
        start, history = resume(run, ckpts, state, out)
    elif "critic" in run.stages.split(","):
        # 3. critic pre-training: fit V to the returns of the initial policy's rollouts before any policy update
        t0 = time.time()
        critic_log = ppo_max.pretrain_critic(m.policy, m.ref, m.reward_model, m.critic, m.critic_opt, state.moments,
                                             lambda: batches.prompts(cfg.rollout_batch), cfg,
                                             data.stop_id(inp.tokenizer), inp.tokenizer.pad_token_id, state.kl_ctl.value)
        timings["critic_pretrain"] = time.time() - t0
        print(f"[3. critic pre-training] {timings['critic_pretrain']:.1f} s")
        if rank == 0:
            write_json(out / "critic_pretrain.json", critic_log)
        if last_stage(run) == "critic":  # --stages ...,critic: the pre-trained critic is the result
            return save_critic(m, inp, run, out, rank)

    # 4. PPO
    t0 = time.time()
    log = collapse.RunLog(out, state.monitor, history, resumed=bool(run.resume), main_rank=rank == 0,
                          tracker=tracker(run, inp, out, rank))
    ended = ppo(m, batches, state, log, ckpts, cfg, run, start, inp.tokenizer, judge, device)
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
    if rank != 0:  # rank 0 alone saves the final models, evaluates and writes the summary
        return None
    return write_summary(m, inp, run, cfg, log, ended, timings, t_start, dirs, judge, device)


if __name__ == "__main__":
    cli.cli_guard(main)()  # bad --data input: one line naming file, line and problem; exit 2
