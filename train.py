"""Train RLHF with PPO-max end to end: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964).

Run:
  python train.py                       # the synthetic world on the CPU, every stage, a few minutes
  python train.py --preset vanilla      # the same world with vanilla PPO: watch it collapse (Fig. 4)
  python train.py --rebuild-base        # stages 1-2 again, even when runs/_base holds them (step into SFT, Eq. 2)
  python train.py --help                # every flag, with its paper symbol and default
  python train.py --model llama-7b --plan [--num-gpus 8 --gpu-mem 80 ...]   # per-GPU memory bill; loads nothing
  deepspeed --num_gpus 8 train.py --model llama-7b --reward-model RM_DIR --prompts prompts.jsonl
                                        # the paper's set-up: DeepSpeed engines (ZeRO-2), paper hyperparameters
  deepspeed --num_gpus 2 train.py ...   # on a CPU-only machine too: DeepSpeed picks its CPU accelerator and gloo

Stages, each in its own file, each writing a Hugging Face directory under --out or runs/_base/:
  1. SFT (sft.train_sft): a tiny LLaMA-architecture model on the demonstrations; also the frozen reference π_SFT.
  2. Reward model (reward_model.train_reward_model) from the SFT model with Eq. 2 (Bradley-Terry + LM on chosen).
  3. Critic pre-training (ppo_max.pretrain_critic), from the reward model, before any policy update (§5.3.3).
  4. PPO: the numbered loop of `ppo` below, one iteration = ppo_max.rollout, make_experience, ppo_update.
SFT and reward model depend only on the world (or --data) and their own settings, so they are cached under
runs/_base/<name>-<hash>/ (checkpoint.build_once) and shared by every preset with the same seed. A real --model
(a local Hugging Face directory, a hub id already in the local cache, or an alias of scale.py) skips stages 1-2:
--reward-model is required.

The plumbing sits behind one call each: engine.py (one process or DeepSpeed engines: wrap, step, gather),
checkpoint.py (atomic checkpoints, exact resume, the non-finite guard), monitor.py (metrics.jsonl, samples.jsonl,
the §5.2 collapse alarm), data.py (tokenization and batches), eval.py (the held-out comparison with SFT).
Under the `deepspeed` launcher the global batch stays --rollout-batch prompts and --minibatch sequences per
optimizer step whatever the number of ranks W: rank r takes prompts r, r + W, … of every batch.

References: Ouyang et al. 2022 (InstructGPT); Ziegler et al. 2019; CleanRL ppo.py; lm-human-preference-details.
"""
from __future__ import annotations

import argparse
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
import data
import engine
import eval as evaluation
import monitor as collapse
import ppo_max
import scale
import toy_world
from ppo_max import arg  # a dataclass field whose help text becomes `--help`
from reward_model import (RMConfig, ScalarHeadModel, not_a_reward_model, reward_model_kind, score_pairs,
                          train_reward_model)
from sft import SFTConfig, pretrained_model, tiny_llama, tiny_llama_config, train_sft


# =========================================================================================================
# Configuration: one dataclass per stage; every field is a flag (`--field-name`)
# =========================================================================================================
@dataclass
class RunConfig:
    preset: str = arg("ppo-max", f"named set of PPO flags: {', '.join(ppo_max.PRESETS)}")
    seed: int = arg(0, "seed of the world, every model init and every sample")
    steps: int = arg(80, "PPO iterations (each: one rollout batch, then PPO epochs over it)")
    out: str = arg("", "output directory (default runs/<preset>-seed<seed>)")
    model: str = arg("tiny", "policy/SFT model: 'tiny' (synthetic world), an alias, a hub id or a local HF directory")
    eval_samples: int = arg(4, "samples per held-out prompt for the final evaluation and win rate")
    threads: int = arg(1, "torch CPU threads (0 = torch's default); the tiny models gain nothing from more, and on a "
                          "shared machine extra threads mostly wait for each other")
    rebuild_base: bool = arg(False, "train stages 1-2 (SFT, reward model) again even when runs/_base or --out holds "
                                    "them")
    stages: str = arg("sft,rm,critic,ppo", "the stages to run, in order (sft, rm, critic, ppo); the run stops after "
                                           "the last one listed, e.g. sft,rm trains only a reward model")
    # long runs (checkpoint.py, monitor.py)
    save_every: int = arg(20, "write a checkpoint every N PPO steps (and at the end); 0 = only at the end")
    keep_last: int = arg(3, "checkpoints kept under <out>/checkpoints (older ones are deleted)")
    resume: str = arg("", "continue a run exactly: its directory or one of its checkpoints (same flags as the run)")
    max_bad_steps: int = arg(3, "stop after this many consecutive steps with a non-finite score/advantage/gradient")
    on_collapse: str = arg("warn", "when the §5.2 collapse alarm fires: 'warn' (log it) or 'stop' (checkpoint, stop)")
    alarm_kl_max: float = arg(collapse.KL_MAX, "collapse alarm: KL to the reference (nats/token) that makes a step "
                                               "bad; higher is quieter and later (`python monitor.py sweep runs/*`)")
    alarm_patience: int = arg(collapse.PATIENCE, "collapse alarm: consecutive bad steps before it fires")
    # real preference data instead of the synthetic world (data.py reads and checks it)
    data: str = arg("", "HH-RLHF or {prompt,chosen,rejected} .jsonl[.gz]: train on real text with a from-scratch "
                        "model instead of the synthetic world (flags not given take REAL_DATA_DEFAULTS)")
    skip_bad: bool = arg(False, "with --data: skip bad lines, count them by reason, report at the end (else exit 2)")
    heldout_frac: float = arg(0.1, "with --data: fraction of pairs held out for RM accuracy and evaluation prompts")
    vocab_size: int = arg(2000, "with --data: byte-level BPE vocabulary, trained on the training split only")
    max_prompt_tokens: int = arg(128, "with --data: P limit; longer prompts keep their latest turns")
    max_response_tokens: int = arg(64, "with --data: T limit (EOS included); longer pairs are dropped and counted")
    judge_frac: float = arg(0.5, "with --data: fraction of the training pairs held back for a second reward model, "
                                 "the judge of the win rate, which PPO never optimises; 0 = judge by the proxy")
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
    zero_stage: int = arg(2, "ZeRO stage of the policy and critic engines: 0, 1 or 2 (the paper: 2)")
    grad_ckpt: bool = arg(False, "gradient checkpointing in policy and critic (on in the llama presets)")
    fp32: bool = arg(False, "fp32 where bf16 would be used (DeepSpeed on an accelerator with bf16; never the CPU)")
    bf16: bool = arg(False, "bf16 for every model even on the CPU (the accelerator's dtype path, testable here)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for title, cls in [("run", RunConfig), ("SFT", SFTConfig), ("reward model", RMConfig), ("PPO", ppo_max.PPOConfig)]:
        g = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-")]
            if f.name == "deepspeed_config":
                flags.append("--deepspeed_config")  # DeepSpeed's own spelling of the flag
            help_ = f.metadata.get("help", "")
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
            g.add_argument("--world-" + f.name.replace("_", "-"), dest="world_" + f.name, type=type(f.default),
                           default=f.default, help=f.metadata.get("help", ""))
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
    if run.on_collapse not in ("warn", "stop"):
        fail(f"--on-collapse {run.on_collapse!r}: choose 'warn' or 'stop'")
    if run.alarm_patience < 1 or not run.alarm_kl_max >= 0:
        fail(f"--alarm-patience must be ≥ 1 and --alarm-kl-max ≥ 0 (got {run.alarm_patience}, {run.alarm_kl_max})")
    if run.resume and not run.out:  # --resume alone continues in the run's own directory
        p = Path(run.resume)
        run.out = str(p.parent.parent if p.name.startswith("step-") else p.parent if p.name == "checkpoints" else p)
    if not run.out:
        run.out = f"runs/{run.preset}-seed{run.seed}"
    return run, sft_cfg, rm_cfg, ppo, world


def fail(message: str) -> None:
    """A user's mistake: one line on stderr, exit 2 (as data.cli_guard)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


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
        out[0].out = f"runs/{out[0].preset}-{Path(out[0].data).name.split('.')[0]}-seed{out[0].seed}"
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


def configure(argv):
    """Every configuration of a run, presets and defaults applied: (run, sft_cfg, rm_cfg, cfg, world_cfg)."""
    run, sft_cfg, rm_cfg, cfg, world_cfg = parse_configs(argv)
    if run.data and run.model == "tiny":  # real text: a smaller budget for the flags not given, and no gold judge
        run, sft_cfg, rm_cfg, cfg = real_data_configs(argv, run, sft_cfg, rm_cfg, cfg)
    if run.model in MODEL_PRESETS:
        run, cfg, sft_cfg, rm_cfg = model_preset_configs(argv, run, cfg, sft_cfg, rm_cfg)
    if cfg.policy_init != "sft" and (run.data or run.model != "tiny"):
        fail("--policy-init pretrained needs the synthetic world")
    stages = [s.strip() for s in run.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages) or stages != sorted(stages, key=STAGES.index):
        fail(f"--stages {run.stages}: expected stages from {','.join(STAGES)}, in that order (e.g. sft,rm)")
    return run, sft_cfg, rm_cfg, cfg, world_cfg


STAGES = ("sft", "rm", "critic", "ppo")


def last_stage(run: RunConfig) -> str:
    return [s.strip() for s in run.stages.split(",") if s.strip()][-1]


# =========================================================================================================
# Stages 1-2, cached: the data and tokenizer, the SFT model and the reward model ("the base")
# =========================================================================================================
def base_key(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig):
    """(directory name under runs/_base, what it depends on): everything stages 1-2 read, and nothing else."""
    if not run.data:
        key = [dataclasses.asdict(c) for c in (world_cfg, sft_cfg, rm_cfg)]
        return f"seed{run.seed}-{checkpoint.config_hash(key)}", key
    path = Path(run.data)
    if not path.is_file():
        raise data.DataError(path, None, None, "not_found", "no such file")
    stat = path.stat()
    limits = {"max_prompt_tokens": run.max_prompt_tokens, "max_response_tokens": run.max_response_tokens,
              "bos": True, "note": "ids = [BOS] + prompt (latest turns kept) + response + [EOS]"}
    key = {"data": {"path": str(path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime},
           "limits": limits, "vocab_size": run.vocab_size, "heldout_frac": run.heldout_frac, "skip_bad": run.skip_bad,
           "judge_frac": run.judge_frac,
           "seed": run.seed, "sft": dataclasses.asdict(sft_cfg), "rm": dataclasses.asdict(rm_cfg)}
    return f"real-seed{run.seed}-{checkpoint.config_hash(key)}", key


def base_dir(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig) -> Path:
    return Path("runs/_base") / base_key(run, sft_cfg, rm_cfg, world_cfg)[0]


def build_base(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig,
               rebuild: bool = False) -> Path:
    """Stages 1-2 into runs/_base/<name>-<hash>/: data/*.jsonl and the tokenizer, sft/ and reward_model/ (Hugging
    Face directories), sft_log.json, rm_log.json (Fig. 3), rm_heldout_scores.json (Fig. 2), timings.json,
    config.json; in the synthetic world also rm_length_bias.json, with --data data_report.json and
    data_limits.json (also in reward_model/, for `eval.py score`). Reused when built before, unless `rebuild`."""
    name, key = base_key(run, sft_cfg, rm_cfg, world_cfg)

    def build(tmp: Path) -> None:
        timings = {}
        t0 = time.time()
        tokenizer, records, max_positions = real_data(tmp, run, key["limits"]) if run.data else world_data(tmp, world_cfg)
        timings["data" if run.data else "world"] = time.time() - t0
        rm = sft_and_reward_model(tmp, tokenizer, records, sft_cfg, rm_cfg, run.seed, timings, max_positions)
        if run.data and records["pairs_judge"]:  # the judge: the same recipe on pairs the proxy never saw
            t0 = time.time()
            train_judge(tmp / "sft", tokenizer, records, rm_cfg, run.seed, tmp / "judge_model")
            timings["judge_model"] = time.time() - t0
        if run.data:
            write_json(tmp / "reward_model" / "data_limits.json", key["limits"])
            print(f"[base] reward model held-out accuracy "
                  f"{json.loads((tmp / 'rm_log.json').read_text())[-1]['heldout_accuracy']:.3f} "
                  f"on {len(records['pairs_heldout'])} pairs")
        else:
            write_json(tmp / "rm_length_bias.json",
                       evaluation.length_bias(rm, tokenizer, records["prompts_heldout"], run.seed))
        write_json(tmp / "timings.json", timings)
        write_json(tmp / "config.json", key if run.data else {"world": key[0], "sft": key[1], "rm": key[2],
                                                              "seed": run.seed})

    what = ("tokenizer, SFT and reward model for this data file and config" if run.data
            else "world, SFT and reward model for this seed and config")
    return checkpoint.build_once(Path("runs/_base") / name, build, what, rebuild=rebuild)


def world_data(tmp: Path, world_cfg: toy_world.WorldConfig):
    """The synthetic world's records (written to tmp/data) and its word-level tokenizer (tmp/tokenizer)."""
    from transformers import AutoTokenizer
    records = toy_world.make_dataset(world_cfg)
    toy_world.write_dataset(records, tmp / "data")
    toy_world.build_tokenizer(tmp / "tokenizer")
    return AutoTokenizer.from_pretrained(tmp / "tokenizer"), records, None


def split_pairs(run: RunConfig, report: data.DataReport) -> dict[str, list]:
    """--data's pairs in three disjoint parts: held out (RM accuracy, evaluation prompts), the proxy reward model's
    training pairs, and (--judge-frac > 0) the judge's: a second reward model PPO never optimises (Gao et al. 2022)."""
    pairs = data.load_pairs(run.data, skip_bad=run.skip_bad, report=report)  # DataError: one line, exit 2
    train_pairs, heldout = data.train_heldout_split(pairs, run.heldout_frac, run.seed)
    proxy, judge = data.train_heldout_split(train_pairs, run.judge_frac, run.seed + 1) if run.judge_frac else (
        train_pairs, [])
    return {"pairs_train": proxy, "pairs_judge": judge, "pairs_heldout": heldout}


def encode_splits(run: RunConfig, splits: dict[str, list], tokenizer, report: data.DataReport) -> dict[str, list]:
    """The limits applied once to every split (data.pair_records), and a clear error when one is left empty."""
    lim = (run.max_prompt_tokens, run.max_response_tokens)
    out = {name: data.pair_records(pairs, tokenizer, *lim, run.skip_bad, report) for name, pairs in splits.items()}
    print(f"[data] {run.data}: {len(out['pairs_train'])} train / {len(out['pairs_judge'])} judge / "
          f"{len(out['pairs_heldout'])} held-out pairs; {report.summary()}")
    for name, what in (("pairs_train", "training"), ("pairs_heldout", "held-out"), ("pairs_judge", "judge")):
        if not out[name] and (name != "pairs_judge" or run.judge_frac):
            raise data.DataError(run.data, None, None, "all_skipped", f"no {what} pairs left within the limits "
                                 f"({report.summary()}); raise --max-response-tokens or give more pairs")
    return out


def real_data(tmp: Path, run: RunConfig, limits: dict):
    """--data's pairs: split, a byte-level BPE trained on the training splits only, the limits applied once, the
    records written to tmp/data. Returns (tokenizer, records, the model's context [BOS] + P + T)."""
    report = data.DataReport()
    splits = split_pairs(run, report)
    train_pairs = splits["pairs_train"] + splits["pairs_judge"]
    tokenizer = data.train_bpe_tokenizer([p.prompt + p.chosen for p in train_pairs] + [p.rejected for p in train_pairs],
                                         tmp / "tokenizer", run.vocab_size)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)  # tiny_llama's ids
    records = encode_splits(run, splits, tokenizer, report)
    records.update(prompts_train=[{"prompt": r["prompt"]} for r in records["pairs_train"]],
                   prompts_heldout=[{"prompt": r["prompt"]} for r in records["pairs_heldout"]],
                   sft=[{"prompt": r["prompt"], "response": r["chosen"]} for r in records["pairs_train"]])  # SFT on y_w
    toy_world.write_dataset(records, tmp / "data")
    write_json(tmp / "data_report.json", {**report.to_dict(), "summary": report.summary(), "file": run.data,
                                          **{k: len(records[k]) for k in ("pairs_train", "pairs_judge",
                                                                          "pairs_heldout")}})
    write_json(tmp / "data_limits.json", limits)
    return tokenizer, records, 1 + run.max_prompt_tokens + run.max_response_tokens


def sft_and_reward_model(tmp: Path, tokenizer, records: dict, sft_cfg: SFTConfig, rm_cfg: RMConfig, seed: int,
                         timings: dict, max_positions: int | None = None) -> ScalarHeadModel:
    """Stage 1 (tmp/sft) on records["sft"], then stage 2 (tmp/reward_model) from it with a fresh scalar head on
    records["pairs_train"], held-out accuracy on records["pairs_heldout"]; the logs of Fig. 2 and Fig. 3."""
    # 1. SFT: a from-scratch tiny LLaMA on the demonstrations
    t0 = time.time()
    checkpoint.seed_everything(seed)
    model = tiny_llama(len(tokenizer), sft_cfg)
    if max_positions:
        model.config.max_position_embeddings = max_positions  # RoPE: no table to resize
    sft_losses = train_sft(model, tokenizer, [(r["prompt"], r["response"]) for r in records["sft"]], sft_cfg, seed,
                           out_dir=tmp / "sft")
    timings["sft"] = time.time() - t0
    # 2. reward model, initialised from SFT with a fresh scalar head (Eq. 2), held-out accuracy along the way (Fig. 3)
    t0 = time.time()
    checkpoint.seed_everything(seed)
    rm = ScalarHeadModel.from_pretrained(tmp / "sft")
    rm_log = train_reward_model(rm, tokenizer, records["pairs_train"], records["pairs_heldout"], rm_cfg, seed,
                                out_dir=tmp / "reward_model")
    rc, rr = score_pairs(rm, tokenizer, records["pairs_heldout"])
    timings["reward_model"] = time.time() - t0
    write_json(tmp / "sft_log.json", {"loss": sft_losses})
    write_json(tmp / "rm_log.json", rm_log)                                                      # Fig. 3
    write_json(tmp / "rm_heldout_scores.json", {"chosen": rc.tolist(), "rejected": rr.tolist()})  # Fig. 2
    return rm


def train_judge(sft_dir, tokenizer, records: dict, rm_cfg: RMConfig, seed: int, out_dir: Path, ds: dict | None = None,
                bf16: bool = False, device: torch.device = torch.device("cpu"), grad_ckpt: bool = False) -> list[dict]:
    """The judge: stage 2's recipe (Eq. 2 from the SFT model, a fresh head) on records["pairs_judge"], disjoint
    from the proxy's pairs, so the win rate it gives was never the target of PPO (Gao et al. 2022's gold RM)."""
    checkpoint.seed_everything(seed + 1)
    judge = ScalarHeadModel.from_pretrained(sft_dir, seed=seed + 1, **({"torch_dtype": torch.bfloat16} if bf16 else {}))
    judge = judge.to(device)
    if grad_ckpt:
        judge.gradient_checkpointing_enable()
    log = train_reward_model(judge, tokenizer, records["pairs_judge"], records["pairs_heldout"], rm_cfg, seed + 1,
                             ds=ds, out_dir=out_dir)
    if engine.rank() == 0:
        write_json(out_dir / "rm_log.json", log)
    print(f"[judge] held-out accuracy {log[-1]['heldout_accuracy']:.3f} on {len(records['pairs_heldout'])} pairs "
          f"(trained on {len(records['pairs_judge'])} pairs the proxy never saw)")
    return log


def write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


# =========================================================================================================
# Real models and scale: --plan, --model (scale.py holds the numbers; this is the wiring)
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
    return plan


def resolve_real_models(run: RunConfig, cfg: ppo_max.PPOConfig) -> dict[str, str | None]:
    """Local directories of a real --model and of the models given for the stages it skips (--sft-model,
    --reward-model, --critic-model; None where a stage trains it here). A name not on this machine ends the run with
    scale.py's message (download it, or pass a local directory); so does a stage that has no data to train on."""
    def resolve(flag: str, name: str) -> str:
        try:
            return scale.resolve_model(name)
        except scale.ModelNotFound as e:
            fail(str(e).replace("--model", flag, 1))

    stages = run.stages.split(",")
    dirs = {"model": resolve("--model", run.model),
            "sft": resolve("--sft-model", run.sft_model) if run.sft_model else None,
            "reward": resolve("--reward-model", run.reward_model) if run.reward_model else None,
            "critic": resolve("--critic-model", run.critic_model) if run.critic_model else None}
    if dirs["reward"] and reward_model_kind(dirs["reward"]) is None:
        fail(f"--reward-model {not_a_reward_model(dirs['reward'])}")
    if not (run.data or run.sft_data or dirs["reward"]):
        fail(f"--model {run.model}: nothing to train on: pass --data PAIRS (then SFT, the reward model and PPO all "
             f"run), or --reward-model DIR with --prompts FILE for PPO alone")
    if last_stage(run) == "sft" and not (run.data or run.sft_data):
        fail(f"--model {run.model}: stage sft needs data: pass --data PAIRS or --sft-data FILE")
    if dirs["reward"] is None and ("rm" not in stages or not run.data) and last_stage(run) in ("rm", "critic", "ppo"):
        fail(f"--model {run.model}: no reward model: pass --data PAIRS to train one with Eq. 2 (stage rm), or "
             f"--reward-model DIR")
    if last_stage(run) in ("critic", "ppo") and not (run.prompts or run.data):
        fail(f"--model {run.model}: no prompts; pass --prompts FILE.jsonl ({{\"prompt\": ...}} lines) or --data PAIRS")
    for path in (run.data, run.sft_data, run.prompts):
        if path and not Path(path).is_file():
            raise data.DataError(path, None, None, "not_found", "no such file")
    return dirs


def stage_dir(path: Path, build, what: str, rebuild: bool, rank: int) -> Path:
    """A real model's stage directory under --out (sft/, reward_model/): every rank trains (under DeepSpeed each
    holds an engine), rank 0 writes; a directory with DONE is a finished stage, not redone on a second start."""
    return checkpoint.build_once(path, build, what, rebuild=rebuild, rank=rank, barrier=engine.barrier, label="stage")


def real_model_stages(run: RunConfig, cfg: ppo_max.PPOConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, dirs: dict,
                      rank: int, world: int, device: torch.device, timings: dict) -> dict:
    """Stages 1-2 on a real Hugging Face model (the same sft.train_sft and reward_model.train_reward_model as the
    tiny world), each into --out/<stage>/ unless a directory for it was given. Returns every model's directory;
    the stages' seconds go into `timings`."""
    out, stages = Path(run.out), run.stages.split(",")
    tokenizer = data.load_tokenizer(dirs["sft"] or dirs["model"])
    records = real_records(run, tokenizer) if run.data or run.sft_data else {}
    bf16 = use_bf16(run, device)
    if dirs["sft"] is None and "sft" in stages and records.get("sft"):  # without SFT data: --model is the SFT model
        for name, n in (("sft_batch", sft_cfg.sft_batch), ("rm_batch", rm_cfg.rm_batch)):
            if n % world:
                fail(f"--{name.replace('_', '-')} {n} must be divisible by the number of processes ({world})")

        def build_sft(tmp: Path) -> None:
            checkpoint.seed_everything(run.seed)
            model = load_lm(dirs["model"], bf16, device, run.grad_ckpt)
            losses = train_sft(model, tokenizer, [(r["prompt"], r["response"]) for r in records["sft"]], sft_cfg,
                               run.seed, ds=stage_ds(run, sft_cfg.sft_batch // world, device), out_dir=tmp)
            if rank == 0:
                write_json(tmp / "sft_log.json", {"loss": losses})
        t0 = time.time()
        dirs["sft"] = stage_dir(out / "sft", build_sft, f"stage 1, SFT of {run.model}", run.rebuild_base, rank)
        timings["sft"] = time.time() - t0
    dirs["sft"] = dirs["sft"] or dirs["model"]
    if dirs["reward"] is None and "rm" in stages:
        def build_rm(tmp: Path) -> None:
            checkpoint.seed_everything(run.seed)
            rm = ScalarHeadModel.from_pretrained(dirs["sft"], **({"torch_dtype": torch.bfloat16} if bf16 else {}))
            rm = rm.to(device)
            if run.grad_ckpt:
                rm.gradient_checkpointing_enable()
            log = train_reward_model(rm, tokenizer, records["pairs_train"], records["pairs_heldout"], rm_cfg, run.seed,
                                     ds=stage_ds(run, rm_cfg.rm_batch // world, device), out_dir=tmp)
            rc, rr = score_pairs(rm, tokenizer, records["pairs_heldout"])
            print(f"[rm] held-out accuracy {log[-1]['heldout_accuracy']:.3f} on {len(records['pairs_heldout'])} pairs")
            if rank == 0:
                write_json(tmp / "rm_log.json", log)                                                          # Fig. 3
                write_json(tmp / "rm_heldout_scores.json", {"chosen": rc.tolist(), "rejected": rr.tolist()})  # Fig. 2
                write_json(tmp / "data_limits.json", {"max_prompt_tokens": run.max_prompt_tokens,
                                                      "max_response_tokens": run.max_response_tokens})
        t0 = time.time()
        dirs["reward"] = stage_dir(out / "reward_model", build_rm, f"stage 2, the reward model from {dirs['sft']}",
                                   run.rebuild_base, rank)
        timings["reward_model"] = time.time() - t0
    dirs["judge"] = None
    if "rm" in stages and records.get("pairs_judge"):
        t0 = time.time()
        dirs["judge"] = stage_dir(out / "judge_model", lambda tmp: train_judge(
            dirs["sft"], tokenizer, records, rm_cfg, run.seed, tmp, stage_ds(run, rm_cfg.rm_batch // world, device),
            bf16, device, run.grad_ckpt), "the judge, a second reward model on pairs the proxy never saw",
            run.rebuild_base, rank)
        timings["judge_model"] = time.time() - t0
    if dirs["reward"]:
        same_tokenizer(dirs["sft"], dirs["reward"])
    dirs["critic"] = dirs["critic"] or (dirs["reward"] if cfg.critic_init == "rm" else dirs["sft"])
    return dirs


def real_records(run: RunConfig, tokenizer) -> dict[str, list[dict]]:
    """--data's pairs (split_pairs, the limits applied once) and the SFT rows: --sft-data, or the chosen responses
    of the proxy's training pairs."""
    report = data.DataReport()
    lim = (run.max_prompt_tokens, run.max_response_tokens)
    out = encode_splits(run, split_pairs(run, report), tokenizer, report) if run.data else {}
    if run.sft_data:
        rows = data.load_texts(run.sft_data, skip_bad=run.skip_bad, report=report, with_source=True)
        enc = [(p, r, data.encode_text(p, r, tokenizer, *lim, source=src, report=report)) for p, r, src in rows]
        out["sft"] = [{"prompt": data.prompt_text(e["prompt_ids"], tokenizer, lim[0]) if p else "", "response": r}
                      for p, r, e in enc if e is not None]
        if not out["sft"]:
            raise data.DataError(run.sft_data, None, None, "all_skipped", f"no SFT row fits the limits "
                                                                          f"({report.summary()})")
    else:
        out["sft"] = [{"prompt": r["prompt"], "response": r["chosen"]} for r in out["pairs_train"]]  # SFT on y_w
    return out


def load_lm(path, bf16: bool, device: torch.device, grad_ckpt: bool):
    """A causal LM from a local directory (never remote code), in bf16 if asked, on `device`."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False,
                                                 **({"dtype": torch.bfloat16} if bf16 else {})).to(device)
    if grad_ckpt:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


def same_tokenizer(policy_dir, reward_dir) -> None:
    """The policy's token ids go straight into the reward model: both must read them alike."""
    a, b = data.load_tokenizer(policy_dir), data.load_tokenizer(reward_dir)
    if a.get_vocab() != b.get_vocab() or data.stop_id(a) != data.stop_id(b):
        fail(f"--reward-model {reward_dir}: its tokenizer differs from the policy's ({policy_dir}); the reward model "
             f"reads the policy's token ids, so both must share one tokenizer")


def use_bf16(run: RunConfig, device: torch.device) -> bool:
    """bf16 with --bf16 (even on the CPU), or under DeepSpeed on an accelerator that has it (unless --fp32)."""
    engines = run.deepspeed or engine.world_size() > 1
    return run.bf16 or (engines and not run.fp32 and device.type != "cpu" and engine.accelerator_bf16())


def stage_ds(run: RunConfig, micro_batch: int, device: torch.device) -> dict | None:
    """The DeepSpeed config of a trained model of stages 1-2 (None in one process without --deepspeed)."""
    if not (run.deepspeed or engine.world_size() > 1):
        return None
    try:
        ds = engine.engine_config(run.deepspeed_config, run.zero_stage, use_bf16(run, device), micro_batch, 1.0)
    except engine.ConfigError as e:
        fail(str(e))
    print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, stage engine: ZeRO-"
          f"{ds.get('zero_optimization', {}).get('stage', 0)}, bf16 {ds.get('bf16', {}).get('enabled', False)}, "
          f"micro batch {micro_batch} per rank")
    return ds


# =========================================================================================================
# What the PPO stage starts from: the four models' directories, the tokenizer, the prompts; then the models
# =========================================================================================================
@dataclass
class Inputs:
    """The directories the four models load from, their tokenizer, and the PPO stage's records."""
    policy: Path | str
    ref: Path | str
    reward: Path | str
    critic: Path | str
    tokenizer: object
    data: dict
    base: Path | None = None     # runs/_base/<...> when stages 1-2 ran here (None for a real --model)
    timings: dict = dataclasses.field(default_factory=dict)
    judge: Path | str | None = None  # real data: the second reward model that judges the win rate


def ppo_inputs(run: RunConfig, cfg: ppo_max.PPOConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig,
               world_cfg: toy_world.WorldConfig, dirs: dict | None, main_rank: bool) -> Inputs:
    """A real --model: its directories and --prompts/--data. Otherwise stages 1-2 first (cached): rank 0 builds
    them while the other ranks wait at the barrier, then they read the cache."""
    from transformers import AutoTokenizer
    if dirs:
        tokenizer = data.load_tokenizer(dirs["sft"])  # no pad token (LLaMA, GPT-2): pad = EOS; the mask knows padding
        records = data.prompt_records(run.prompts or run.data, run.sft_data or run.data, tokenizer,
                                      run.max_prompt_tokens, run.heldout_frac, run.seed, run.skip_bad)
        return Inputs(dirs["sft"], dirs["sft"], dirs["reward"], dirs["critic"], tokenizer, records,
                      judge=dirs.get("judge"))
    if not main_rank:
        engine.barrier()
    base = build_base(run, sft_cfg, rm_cfg, world_cfg, rebuild=run.rebuild_base and main_rank)
    policy = base / "sft" if cfg.policy_init == "sft" else pretrained_model(base, sft_cfg, run.seed)
    if main_rank:
        engine.barrier()
    if not run.data:
        bias = json.loads((base / "rm_length_bias.json").read_text())
        print(f"[base] reward model length bias: RM {bias['rm_slope']:+.3f}/token vs gold {bias['gold_slope']:+.3f}/token "
              f"(filler tokens added to a correct answer)")
    records = {k: data.read_records(base / "data" / f"{k}.jsonl") for k in ["prompts_train", "prompts_heldout", "sft"]}
    critic = base / ("reward_model" if cfg.critic_init == "rm" else "sft")
    return Inputs(policy, base / "sft", base / "reward_model", critic, AutoTokenizer.from_pretrained(base / "tokenizer"),
                  records, base, json.loads((base / "timings.json").read_text()),
                  judge=base / "judge_model" if (base / "judge_model" / "DONE").exists() or
                  (base / "judge_model" / "value_head.safetensors").exists() else None)


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
    saved, with dropout off in every one of them (rollouts, experience and updates see one deterministic network)."""
    from transformers import AutoModelForCausalLM
    bf16 = bool(ds.get("bf16", {}).get("enabled", False)) if ds else run.bf16
    dtype = {"dtype": torch.bfloat16} if bf16 else {}
    policy = AutoModelForCausalLM.from_pretrained(inp.policy, **dtype).to(device)
    ref = AutoModelForCausalLM.from_pretrained(inp.ref, **dtype).eval().requires_grad_(False).to(device)
    head_dtype = {"torch_dtype": torch.bfloat16} if bf16 else {}
    try:  # a reward model without a trained head stops here: it never becomes a random one
        reward_model = ScalarHeadModel.from_pretrained(inp.reward, require_head=True, **head_dtype)
    except ValueError as e:
        fail(f"--reward-model {e}")
    reward_model = reward_model.eval().requires_grad_(False).to(device)
    critic = ScalarHeadModel.from_pretrained(inp.critic, **head_dtype).to(device)
    for model in (policy, ref, reward_model, critic):  # ρ = 1 on the first minibatch needs a deterministic network
        ppo_max.disable_dropout(model)
    if run.grad_ckpt:  # recompute activations in backward (the paper trains with it); generation is unaffected
        for m in (policy, critic):
            (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    if ds is not None:
        print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, policy and critic engines: "
              f"{json.dumps(ds)}")
        print("[deepspeed] reference and reward model: inference only, replicated on every rank (if they do not fit: "
              "ZeRO-3 / CPU offload with scale.inference_deepspeed_config; see --plan)")
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


def make_judge(inp: Inputs, synthetic: bool, bf16: bool, device: torch.device) -> Judge | None:
    if synthetic:
        return Judge("gold", "reward/gold", evaluation.gold_judge)
    if not inp.judge:
        return None
    rm = ScalarHeadModel.from_pretrained(inp.judge, require_head=True, **({"torch_dtype": torch.bfloat16} if bf16 else {}))
    rm = ppo_max.disable_dropout(rm).eval().requires_grad_(False).to(device)
    return Judge("held-out reward model", "reward/judge", evaluation.rm_judge(rm, inp.tokenizer))


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
            judged = [judge.score(p, t, bool(f)) for p, t, f in zip(prompts, texts, finished)] if judge else None
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
    engine.unwrap(m.policy).save_pretrained(out / "policy")
    inp.tokenizer.save_pretrained(out / "policy")
    engine.unwrap(m.critic).save_pretrained(out / "critic")
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
    if run.data and inp.base:
        print(f"[data] {run.data}: {summary['data']['summary']}")
    return summary


def stop_after_stages(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig,
                      dirs: dict | None, rank: int) -> dict:
    """--stages sft or sft,rm: the trained directories (for the tiny world and --data, the cached base)."""
    if dirs is None:
        if rank == 0:
            build_base(run, sft_cfg, rm_cfg, world_cfg, rebuild=run.rebuild_base)
        engine.barrier()
        base = base_dir(run, sft_cfg, rm_cfg, world_cfg)
        dirs = {"sft": str(base / "sft"), "reward": str(base / "reward_model")}
    result = {"stages": run.stages, "sft": str(dirs["sft"])}
    if "rm" in run.stages.split(","):
        result["reward_model"] = str(dirs["reward"])
        log = Path(dirs["reward"]) / "rm_log.json"
        log = log if log.is_file() else Path(dirs["reward"]).parent / "rm_log.json"  # the tiny world's base
        result["rm_heldout_accuracy"] = json.loads(log.read_text())[-1]["heldout_accuracy"]
    print(f"[stages] {run.stages}: " + json.dumps(result))
    return result


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # before parsing: the plan's flags (--num-gpus, ...) are scale.py's
        print_plan(argv)
        return None
    run, sft_cfg, rm_cfg, cfg, world_cfg = configure(argv)
    dirs = resolve_real_models(run, cfg) if run.model != "tiny" else None  # fails at once, before anything loads
    rank, world, device = start_processes(run, cfg)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
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
    judge = make_judge(inp, not (run.data or dirs), m.bf16, device)  # gold: the synthetic human
    batches = data.RolloutBatches([r["prompt"] for r in inp.data["prompts_train"]],
                                  [(r["prompt"], r["response"]) for r in inp.data["sft"]], inp.tokenizer,
                                  seed=run.seed, rank=rank, world=world, device=device)
    state = LoopState.new(run, cfg)
    ckpts = checkpoint.RunCheckpoints(out, {"policy": m.policy, "critic": m.critic},
                                      {"policy": m.policy_opt, "critic": m.critic_opt}, {"prompt": batches.rng},
                                      inp.tokenizer, run.keep_last, rank, engine.barrier)
    timings, start, history = dict(inp.timings), 0, []
    if run.resume:  # exact resume: weights, optimizers, RNG streams, moments, η, monitor, guard, metrics so far
        try:
            ckpt, saved = ckpts.resume(run.resume)
        except ValueError as e:
            fail(str(e))
        start, history = saved["step"], data.read_records(out / "metrics.jsonl")[:saved["step"]]
        state.load_state_dict(saved["extra_state"])
        print(f"[resume] {ckpt}: continuing at step {start}")
    elif "critic" in run.stages.split(","):
        # 3. critic pre-training: fit V to the returns of the initial policy's rollouts before any policy update
        t0 = time.time()
        critic_log = ppo_max.pretrain_critic(m.policy, m.ref, m.reward_model, m.critic, m.critic_opt, state.moments,
                                             lambda: batches.prompts(cfg.rollout_batch), cfg,
                                             data.stop_id(inp.tokenizer), inp.tokenizer.pad_token_id, state.kl_ctl.value)
        timings["critic_pretrain"] = time.time() - t0
        if rank == 0:
            write_json(out / "critic_pretrain.json", critic_log)
        if last_stage(run) == "critic":  # --stages ...,critic: the pre-trained critic is the result
            if rank == 0:
                engine.unwrap(m.critic).save_pretrained(out / "critic")
                inp.tokenizer.save_pretrained(out / "critic")
                print(f"[stages] {run.stages}: the pre-trained critic is in {out / 'critic'}")
            return {"stages": run.stages, "critic": str(out / "critic")}

    # 4. PPO
    t0 = time.time()
    log = collapse.RunLog(out, state.monitor, history, resumed=bool(run.resume), main_rank=rank == 0)
    ended = ppo(m, batches, state, log, ckpts, cfg, run, start, inp.tokenizer, judge, device)
    log.close()
    timings["ppo"] = time.time() - t0
    if ended["signal"]:
        print(f"[{ended['signal']}] checkpoint written to {ended['path']}; continue with: "
              f"{'deepspeed' if world > 1 else 'python'} train.py {' '.join(argv)} --resume {out}")
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
    data.cli_guard(main)()  # bad --data input: one line naming file, line and problem; exit 2
