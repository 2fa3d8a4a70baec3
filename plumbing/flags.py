"""The flags of train.py: the parser built from plumbing/config.py's dataclasses, every value and combination checked
before any work, the presets layered in, the run's record for --resume, and --plan's memory bill.

Implements (no equation):
    configure(argv)        → the run's argv (with --resume: the recorded flags too) and its six configurations,
                             every layer of plumbing/config.py applied, every flag checked (validate)
    build_parser(full)     → argparse from the dataclasses: `--help` shows config.FIRST_READING, `--help-all` all
    startup_line(...)      → what a run prints first: its preset and what differs from it
    write_record(...)      → run_config.json: the flags and the resolved configuration, read back by --resume
    print_plan(argv)       → --plan: plumbing/scale.py's per-GPU memory plan of the run these flags describe
A mistake is one line `error: …`, exit 2 (cli.fail), before anything is trained, loaded or written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import os
from pathlib import Path

import torch

import critic_free
import toy_world
from plumbing import checkpoint, cli, data, lora, scale
from plumbing.cli import fail
from plumbing.pipeline import STAGES, data_source, write_json
from sft import tiny_llama_config
from plumbing.config import (FIRST_READING, PRESETS, DPOConfig, PPOConfig, RMConfig, RunConfig, SFTConfig,
                             apply_preset, context_presets, implied)

CONFIGS = (("run", RunConfig), ("SFT", SFTConfig), ("reward model", RMConfig), ("PPO", PPOConfig),
           ("DPO (--method dpo; dpo.py)", DPOConfig))


FILE_FLAGS = ("data", "sft_data", "prompts", "deepspeed_config")  # must be existing files when given


def validate(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, cfg: PPOConfig,
             world_cfg: toy_world.WorldConfig, dpo_cfg: DPOConfig, world: int | None = None) -> None:
    """Every flag against its range or choices, the files it names, and the combinations the loop needs: one line
    naming the flag, its value and what is allowed (exit 2), before anything is trained, loaded or written. `world`:
    the number of processes (default: the launcher's WORLD_SIZE; --plan: its --num-gpus)."""
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
    validate_launch(run, cfg, launch_world() if world is None else world)
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
    if run.lora_bits != 16 and not run.plan:  # bitsandbytes: a CUDA GPU, one process (--plan bills it anywhere)
        lora.check_bits(run, "cuda" if torch.cuda.is_available() else "cpu")
        if run.deepspeed or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            fail(f"--lora-bits {run.lora_bits}: quantized frozen weights run in one process here, not under DeepSpeed "
                 f"engines; drop --deepspeed / the launcher, or use --lora-bits 16")
    if Path(run.out).exists() and not Path(run.out).is_dir():
        fail(f"--out {run.out}: exists and is not a directory")


def launch_world() -> int:
    """The number of processes this run will have: the `deepspeed` launcher's WORLD_SIZE (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def fit_to_launch(run: RunConfig, cfg: PPOConfig, given: set[str], world: int) -> tuple[RunConfig, PPOConfig]:
    """The launch settings of a preset (config.PAPER_LLAMA) where this launch cannot take them, for the flags not
    given: ZeRO-3 frozen models need DeepSpeed (the launcher or --deepspeed) and LoRA's frozen models are the trained
    ones with adapters off, so those runs keep a copy (--frozen-zero-stage 0); --generate-batch becomes the largest
    divisor of the rollout batch per process that is not above it."""
    if "frozen_zero_stage" not in given and not (run.deepspeed or world > 1) or run.lora_r and "frozen_zero_stage" \
            not in given:
        run = dataclasses.replace(run, frozen_zero_stage=0)
    per = cfg.rollout_batch // world
    if cfg.generate_batch and "generate_batch" not in given and per and cfg.rollout_batch % world == 0:
        cfg = dataclasses.replace(cfg, generate_batch=max(d for d in range(1, min(cfg.generate_batch, per) + 1)
                                                          if per % d == 0))
    return run, cfg


def validate_launch(run: RunConfig, cfg: PPOConfig, world: int) -> None:
    """The frozen models' sharding and the micro-batches against the launch: one line, exit 2."""
    frozen = ("--frozen-offload" if run.frozen_offload else "") or \
        (f"--frozen-zero-stage {run.frozen_zero_stage}" if run.frozen_zero_stage else "")
    if frozen and not (run.deepspeed or world > 1):
        fail(f"{frozen}: ZeRO-3 inference engines for the frozen models run under the `deepspeed` launcher (or with "
             f"--deepspeed); one process keeps a copy of each (--frozen-zero-stage 0)")
    if frozen and run.lora_r:
        fail(f"{frozen} with --lora-r {run.lora_r}: under LoRA the reference and the reward model are the policy's "
             f"and the critic's own frozen weights with the adapters off; there is no copy to shard")
    if frozen and cfg.dynamic_sampling:
        fail(f"{frozen} with --dynamic-sampling: each rank refills its batch a different number of times, and a "
             f"ZeRO-3 model's every forward needs all ranks; use --frozen-zero-stage 0")
    per = cfg.rollout_batch // world
    if cfg.generate_batch and cfg.rollout_batch % world == 0 and per % cfg.generate_batch:
        fail(f"--generate-batch {cfg.generate_batch}: must divide the rollout batch per process, --rollout-batch "
             f"{cfg.rollout_batch} / {world} = {per} (equal micro-batches), e.g. "
             f"{max(d for d in range(1, min(cfg.generate_batch, per) + 1) if per % d == 0)}")


def from_preset(run: RunConfig, name: str, value) -> str:
    """" (--preset P sets it)" when the run's preset gives field `name` this value: a refusal then names what the user
    typed, not only a flag they never wrote."""
    return f" (--preset {run.preset} sets it)" if PRESETS.get(run.preset, {}).get(name, object()) == value else ""


def validate_estimator(run: RunConfig, cfg: PPOConfig) -> None:
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
    if cfg.dynamic_sampling and (a not in critic_free.GROUPED or G < 2):
        fail(f"--dynamic-sampling with --advantage {a} --group-size {G}: it drops groups of G responses whose rewards "
             f"do not differ, which needs a grouped estimator (--advantage grpo, dr-grpo, rloo, reinforce++-baseline) "
             f"and G ≥ 2")
    if cfg.overlong_buffer > cfg.max_new_tokens:
        fail(f"--overlong-buffer {cfg.overlong_buffer}: the last L tokens before --max-new-tokens "
             f"{cfg.max_new_tokens}; L must be ≤ {cfg.max_new_tokens}")
    if cfg.clip_eps_high is not None and not cfg.clip_eps:
        fail(f"--clip-eps-high {cfg.clip_eps_high:g}{from_preset(run, 'clip_eps_high', cfg.clip_eps_high)} with "
             f"--clip-eps {cfg.clip_eps:g}: ε_high raises the upper bound "
             f"of PPO's clip, and --clip-eps 0 clips nothing; give --clip-eps > 0 or drop --clip-eps-high")
    if cfg.policy_loss == "cispo" and cfg.ratio == "sequence":
        fail("--policy-loss cispo with --ratio sequence: CISPO weights each token by its own clipped ratio; GSPO's "
             "sequence ratio belongs to PPO-clip's loss (--policy-loss ppo-clip)")
    if cfg.policy_loss == "cispo" and (cfg.dual_clip or cfg.clip_eps_high is not None):
        name = "dual_clip" if cfg.dual_clip else "clip_eps_high"
        fail(f"--policy-loss cispo with --{name.replace('_', '-')} {getattr(cfg, name):g}"
             f"{from_preset(run, name, getattr(cfg, name))}: CISPO has its own "
             f"bounds on the weight (--cispo-eps-low, --cispo-eps-high) and no PPO clip to change")
    if cfg.critic_pretrain_target == "returns" and a == "gae" and cfg.critic_pretrain_steps == 0:
        fail("--critic-pretrain-target returns with --critic-pretrain-steps 0: it sets what pre-training fits, and "
             "there is no pre-training; give --critic-pretrain-steps > 0 or drop it")
    if a != "gae":
        if run.critic_model:
            fail(f"--critic-model {run.critic_model}: --advantage {a} trains no critic (drop one of them)")
        if [x.strip() for x in run.stages.split(",") if x.strip()][-1:] == ["critic"]:
            fail(f"--stages {run.stages}: --advantage {a} has no critic to pre-train; end the stages with ppo or rm")


# What each kind of run reads; config.py's docstring states the rule these tables implement.
BUDGET = ("steps", "rollout_batch", "minibatch", "critic_pretrain_steps")  # PPO's budget: unused flags said once
DPO_BUDGET = ("dpo_epochs", "dpo_batch")                                   # DPO's: the same
LOOP = ("break_at", "save_every", "keep_last", "heldout_every", "heldout_samples", "max_bad_steps", "on_collapse",
        "alarm_kl_max", "alarm_patience", "log_with", "critic_model")   # the PPO loop's own run flags
SAMPLING = ("max_new_tokens",)    # every method's evaluation samples with it
CRITIC = ("critic_lr", "critic_init", "value_clip", "vf_coef", "lam", "lam_critic", "lam_adaptive",
          "critic_pretrain_target")                                   # what only a critic (GAE's) reads
DATA_ONLY = ("data_split", "data_config", "skip_bad", "heldout_frac", "vocab_size", "max_prompt_tokens",
             "max_response_tokens", "judge_frac")                    # what only real text reads
OFF_UNLESS = (  # (flag, what turns it on when given, the setting it needs, whether that setting is on)
    ("kl_target", lambda c: c.kl_target > 0, "--kl-coef > 0 (the adaptive controller scales η)",
     lambda c: c.kl_coef > 0),
    ("kl_horizon", lambda c: True, "--kl-target > 0 (the adaptive controller's horizon)", lambda c: c.kl_target > 0),
    ("entropy_clip", lambda c: c.entropy_clip > 0, "--entropy-coef > 0 (it clips the entropy bonus)",
     lambda c: c.entropy_coef > 0),
    ("adv_clip", lambda c: c.adv_clip > 0, "--adv-norm (it clips whitened advantages)", lambda c: c.adv_norm),
    ("reward_clip", lambda c: c.reward_clip > 0, "--reward-norm (δ of Eq. 18 clips normalised scores)",
     lambda c: c.reward_norm),
    ("ptx_data", lambda c: True, "--ptx-coef > 0 (λ_ptx of Eq. 17)", lambda c: c.ptx_coef > 0),
    ("overlong_penalty", lambda c: True, "--overlong-buffer > 0 (the penalty at its end)",
     lambda c: c.overlong_buffer > 0),
    ("cispo_eps_low", lambda c: True, "--policy-loss cispo (its weight clip)", lambda c: c.policy_loss == "cispo"),
    ("cispo_eps_high", lambda c: True, "--policy-loss cispo (its weight clip)", lambda c: c.policy_loss == "cispo"),
    ("rollout_correction_cap", lambda c: True, "--rollout-correction tis|mis (its C)",
     lambda c: c.rollout_correction != "none"),
    ("rollout_correction_level", lambda c: True, "--rollout-correction mis (what it masks)",
     lambda c: c.rollout_correction == "mis"),
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_combinations(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, cfg: PPOConfig,
                          world_cfg: toy_world.WorldConfig, dpo_cfg: DPOConfig, given: set[str]) -> None:
    """A flag given on the command line that this run would ignore (config.py's docstring: "Flags a run ignores"),
    and the combinations the PPO loop cannot run as asked: one line naming the flags, exit 2, before any work. The
    budget flags (BUDGET, DPO_BUDGET) that a method or estimator does not use are accepted (ignored_budget says them
    once)."""
    preset_given = "preset" in given and run.preset != "ppo-max"
    if run.method != "ppo":
        if preset_given:
            fail(f"--preset {run.preset} with --method {run.method}: a preset names PPO's settings and "
                 f"--method {run.method} trains no PPO; drop --preset")
        uses = set(SAMPLING) | ({"policy_init"} if run.method == "dpo" else set())
        ppo_only = [n for n in [f.name for f in dataclasses.fields(PPOConfig)] + list(LOOP)
                    if n in given and n not in uses and n not in BUDGET]
        if ppo_only:
            fail(f"{', '.join(flag(n) for n in ppo_only)} with --method {run.method}: only PPO reads "
                 f"{'it' if len(ppo_only) == 1 else 'them'} ({run.method} reads "
                 f"{', '.join(flag(n) for n in sorted(uses))} of PPO's flags); drop "
                 f"{'it' if len(ppo_only) == 1 else 'them'}")
    other = [n for n in [f.name for f in dataclasses.fields(DPOConfig)]
             if n in given and run.method != "dpo" and n not in DPO_BUDGET]
    other += ["bon_n"] if "bon_n" in given and run.method != "best-of-n" else []
    if other:
        fail(f"{', '.join(flag(n) for n in other)} with --method {run.method}: "
             f"{'--method dpo' if other[0] != 'bon_n' else '--method best-of-n'} reads "
             f"{'it' if len(other) == 1 else 'them'}; drop {'it' if len(other) == 1 else 'them'} or choose that method")
    if run.resume and "rebuild_base" in given:
        fail(f"--rebuild-base with --resume {run.resume}: a resumed run continues on the SFT and reward model it "
             f"trained with; rebuilding them would change what it continues")
    real = bool(run.data) or run.model != "tiny"
    world = sorted(n for n in given if n.startswith("world_") or n == "world")
    if world and real:
        fail(f"{flag(world[0])}: the synthetic world's flag, and this run trains on "
             f"{'--data ' + run.data if run.data else '--model ' + run.model}; drop it")
    other_world = [n for n in (toy_world.B_ONLY if run.world == "a" else toy_world.A_ONLY) if "world_" + n in given]
    if other_world:
        fail(f"{flag('world_' + other_world[0])}: a knob of world {'b' if run.world == 'a' else 'a'}, and this run's "
             f"is world {run.world} (--world); drop it")
    data_only = [n for n in DATA_ONLY if n in given]
    if data_only and not (real or run.prompts or run.sft_data):
        fail(f"{flag(data_only[0])}: reads --data, --prompts or --sft-data (real text), and this run is the "
             f"synthetic world's; add --data PAIRS or drop it")
    lora_only = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if n in given]
    if lora_only and not run.lora_r:
        fail(f"{flag(lora_only[0])}: sets LoRA's adapters, and without --lora-r R there are none; add --lora-r "
             f"(e.g. 16) or drop it")
    if run.method != "ppo":
        return
    if cfg.advantage != "gae":  # the critic's flags, and its pre-training unless 0 (off is always accepted)
        critic = [n for n in CRITIC if n in given] + (["critic_pretrain_steps"] if "critic_pretrain_steps" in given
                                                      and cfg.critic_pretrain_steps else [])
        if critic:
            fail(f"{', '.join(flag(n) for n in critic)} with --advantage {cfg.advantage}: "
                 f"{'it sets' if len(critic) == 1 else 'they set'} the critic, and --advantage {cfg.advantage} has "
                 f"none; drop {'it' if len(critic) == 1 else 'them'}")
    for name, set_on, needs, needed_on in OFF_UNLESS:
        if name in given and set_on(cfg) and not needed_on(cfg):
            fail(f"{flag(name)} {getattr(cfg, name)!r}: acts only with {needs}, which is off in this run"
                 + (f" (--preset {run.preset})" if run.preset != "ppo-max" else ""))
    if "heldout_samples" in given and not run.heldout_every:
        fail(f"--heldout-samples {run.heldout_samples}: the held-out curve's samples, and --heldout-every 0 turns "
             f"the curve off")
    if cfg.rollout_batch % cfg.minibatch:
        fail(f"--minibatch {cfg.minibatch}: must divide --rollout-batch {cfg.rollout_batch} (each PPO epoch takes "
             f"the rollout batch in equal minibatches; e.g. --minibatch "
             f"{max(d for d in range(1, cfg.minibatch + 1) if cfg.rollout_batch % d == 0)})")
    if run.break_at >= run.steps:
        fail(f"--break-at {run.break_at}: the run's steps are 0 … {run.steps - 1} (--steps {run.steps}); "
             f"-1 = never")


def ignored_budget(run: RunConfig, cfg: PPOConfig, given: set[str], dpo_cfg: DPOConfig | None = None) -> str | None:
    """One line on the budget flags given that this run does not use (PPO's with a method without PPO; DPO's without
    --method dpo), or None: they are accepted, so that one budget can be passed to every method (notebooks/runs.py,
    the tests' TINY lists). Critic pre-training with a critic-free --advantage is a critic flag instead, refused
    (validate_combinations) unless 0."""
    unused, why = [], []
    if run.method != "ppo" and (ppo := [n for n in BUDGET + ("preset",) if n in given]):
        unused += ppo
        why.append(f"--method {run.method} trains no PPO")
    if run.method != "dpo" and (dpo := [n for n in DPO_BUDGET if n in given]):
        unused += dpo
        why.append(f"--method {run.method} trains no DPO")
    if not unused:
        return None
    values = {**dataclasses.asdict(run), **dataclasses.asdict(cfg), **dataclasses.asdict(dpo_cfg or DPOConfig())}
    return f"[flags] {' and '.join(why)}: {', '.join(f'{flag(n)} {values[n]}' for n in unused)} not used"


class HelpAll(argparse.Action):
    """--help-all: every flag of every configuration, then exit (as --help does)."""

    def __call__(self, parser, namespace, values, option_string=None):
        build_parser(full=True).print_help()
        parser.exit()


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """Every field of config.py's dataclasses as a flag (`--field-name`), with its help, allowed range and default.
    `--help` shows the flags of config.FIRST_READING grouped by stage; `--help-all` (full=True) every flag, grouped by
    configuration. PPO's parser defaults are None: its defaults come from the preset (config.py's layers)."""
    p = cli.OneLineParser(prog="train.py", description=" ".join(__doc__.split("\n\n")[0].split()) if full else
                          "RLHF with PPO-max: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964)",
                          epilog=None if full else "--help-all lists every flag (about 130); defaults and presets: "
                                                   "plumbing/config.py", formatter_class=cli.DefaultsHelpFormatter)
    p.add_argument("--help-all", action=HelpAll, nargs=0, default=argparse.SUPPRESS,
                   help="every flag, by configuration, and exit")
    first = {name: title for title, names in FIRST_READING.items() for name in names}
    stage_groups = {} if full else {title: p.add_argument_group(title) for title in FIRST_READING}
    for title, cls in CONFIGS:
        group = p.add_argument_group(title) if full else None
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-")]
            if f.name == "deepspeed_config":
                flags.append("--deepspeed_config")  # DeepSpeed's own spelling of the flag
            help_ = f.metadata.get("help", "")
            spec = f.metadata.get("allowed")
            if spec:
                help_ += f" (allowed: {spec.replace('|', ', ')})"
            if cls is PPOConfig:  # PPO defaults come from the preset, so the parser's default is None
                kw = dict(default=None, help=f"{help_} [PPO-max: {f.default}]")
            else:
                kw = dict(default=f.default, help=help_)
            target = group or stage_groups.get(first.get(f.name)) or p
            if not full and f.name not in first:
                kw["help"] = argparse.SUPPRESS  # still a flag; listed by --help-all
            if f.type in (bool, "bool"):
                target.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            else:
                typ = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
                target.add_argument(*flags, type=typ, **kw)
    g = p.add_argument_group("synthetic world (toy_world.WorldConfig)") if full else p
    for f in dataclasses.fields(toy_world.WorldConfig):
        if f.name not in ("seed", "name"):  # set by --seed and --world
            spec = f.metadata.get("allowed")
            g.add_argument("--world-" + f.name.replace("_", "-"), dest="world_" + f.name, type=type(f.default),
                           default=f.default, help=(f.metadata.get("help", "") + (
                               f" (allowed: {spec.replace('|', ', ')})" if spec else "")) if full else argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def given_flags(argv) -> set[str]:
    """The dest names of the flags actually on the command line."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS      # parse again: only the flags actually given survive
    return set(vars(p.parse_args(argv)))


def parse_configs(argv=None, world: int | None = None):
    """(RunConfig, SFTConfig, RMConfig, PPOConfig, WorldConfig, DPOConfig) of a command line: config.py's layers
    (field defaults, the preset, the presets of what the run trains on, the implied flags) under the flags given, and
    --out defaulting to runs/<name>-seed<seed> (or the resumed run's directory); every value checked (validate).
    `world`: the processes the run will have (default: the launcher's WORLD_SIZE; --plan: its --num-gpus)."""
    world = launch_world() if world is None else world
    args = build_parser().parse_args(argv)
    given = given_flags(argv)
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # noqa: E731
    run, sft_cfg, rm_cfg, dpo_cfg = pick(RunConfig), pick(SFTConfig), pick(RMConfig), pick(DPOConfig)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PPOConfig) if f.name in given}
    try:
        ppo = apply_preset(run.preset, **overrides)                                          # layers 1-2
    except ValueError as e:
        fail(f"--preset: {e}")
    named = given | set(PRESETS[run.preset])   # what a context preset leaves alone: the flags and the named preset's
    for _, preset in context_presets(run.data, run.model, run.world):                        # layer 3
        run, sft_cfg, rm_cfg, ppo = (dataclasses.replace(c, **{k: v for k, v in preset.items() if k not in named and
                                                                k in {f.name for f in dataclasses.fields(c)}})
                                     for c in (run, sft_cfg, rm_cfg, ppo))
    ppo = implied(ppo, given | set(PRESETS[run.preset]))                                     # layer 4
    run, ppo = fit_to_launch(run, ppo, given, world)
    world_cfg = toy_world.WorldConfig(seed=run.seed, name=run.world, **{
        f.name: getattr(args, "world_" + f.name) for f in dataclasses.fields(toy_world.WorldConfig)
        if f.name not in ("seed", "name")})
    if run.resume and not run.out:  # --resume alone continues in the run's own directory
        p = Path(run.resume)
        if p.exists() and not p.is_dir():
            fail(f"--resume {run.resume}: not a run or checkpoint directory (a file)")
        run.out = str(p.parent.parent if p.name.startswith("step-") else p.parent if p.name == "checkpoints" else p)
    if not run.out:  # runs of other estimators, data or LoRA never share a directory with the default run
        data_tag = f"-{Path(run.data).name.split('.')[0]}" if run.data and run.model == "tiny" else ""
        world_tag = "-world-b" if run.world == "b" else ""
        run.out = f"runs/{run_name(run, ppo)}{data_tag}{lora_tag(run)}{world_tag}-seed{run.seed}"
    validate(run, sft_cfg, rm_cfg, ppo, world_cfg, dpo_cfg, world)
    validate_combinations(run, sft_cfg, rm_cfg, ppo, world_cfg, dpo_cfg, given)
    return run, sft_cfg, rm_cfg, ppo, world_cfg, dpo_cfg


def startup_line(run: RunConfig, configs: tuple) -> str:
    """What a run prints first: its preset, the presets of what it trains on, and every flag whose value differs
    from the preset's (config.py), not every field."""
    base = (RunConfig(), SFTConfig(), RMConfig(), apply_preset(run.preset),
            toy_world.WorldConfig(seed=run.seed, name=run.world),
            DPOConfig())
    changed = {}
    for prefix, old, new in zip(("", "", "", "", "world-", ""), base, configs):
        for name, value in dataclasses.asdict(new).items():
            if value != getattr(old, name) and name not in ("preset", "out", "seed"):
                changed[prefix + name.replace("_", "-")] = value
    layers = [name for name, _ in context_presets(run.data, run.model, run.world)]
    return (f"preset {run.preset!r}" + "".join(f" + {name!r}" for name in layers) + f", seed {run.seed}, out "
            f"{run.out} (plumbing/config.py); changed: " + (json.dumps(changed, ensure_ascii=False) if changed else
                                                            "nothing"))


def run_name(run: RunConfig, cfg: PPOConfig) -> str:
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


RUN_RECORD = "run_config.json"  # in the run directory: the flags and the resolved configuration of the run
SAFE_ON_RESUME = {"steps", "break_at", "save_every", "keep_last", "threads", "eval_samples", "max_bad_steps",
                  "on_collapse", "alarm_kl_max", "alarm_patience", "resume", "out", "deepspeed",
                  "overwrite"}  # what --resume may change


def configure(argv) -> tuple[list[str], RunConfig, SFTConfig, RMConfig, PPOConfig, toy_world.WorldConfig,
                              DPOConfig]:
    """The run's flags and every configuration, presets and defaults applied. With --resume DIR the flags are the
    run's recorded ones (RUN_RECORD) plus those given now, which may only change SAFE_ON_RESUME."""
    run = parse_configs(argv)[0]
    if run.resume:
        try:  # before anything is built: a resume with nothing intact to resume from stops now
            refused: list[str] = []
            if checkpoint.find_intact(run.resume, log=refused.append) is None:
                fail(nothing_to_resume(run, refused))
        except ValueError as e:
            fail(str(e))
        argv = resumed_argv(argv, run)
    configs = resolve(argv)
    note = ignored_budget(configs[0], configs[3], given_flags(argv), configs[5])
    if note and int(os.environ.get("RANK", "0")) == 0:  # once, by the process that prints
        print(note)
    return (argv, *configs)


def nothing_to_resume(run: RunConfig, refused: list[str]) -> str:
    """--resume's one line when no checkpoint there is intact: the newest refused one with its file and reason
    (checkpoint.find_intact's lines), or, for a run stopped before its first PPO checkpoint, that a plain rerun of its
    command continues from what it finished (stages 1-2 are cached: runs/_base/, or a real model's --out/sft/ ...)."""
    if refused:
        newest = refused[0].removeprefix("[resume] ").split("; trying")[0]
        more = f" (and {len(refused) - 1} older)" if len(refused) > 1 else ""
        return f"--resume {run.resume}: no intact checkpoint there; the newest is refused{more}: {newest}"
    record = Path(run.out) / RUN_RECORD
    try:
        argv = json.loads(record.read_text())["argv"]
    except (OSError, ValueError, KeyError, TypeError):
        return (f"--resume {run.resume}: no intact checkpoint there (a run writes its first at the end of its first "
                f"PPO step)")
    out = [] if "--out" in argv else ["--out", run.out]
    return (f"--resume {run.resume}: the run stopped before its first PPO checkpoint; what it finished (SFT, the "
            f"reward model) is cached, and a plain rerun continues from there: python train.py "
            f"{shlex.join(argv + out)}")


def resumed_argv(argv: list[str], run: RunConfig) -> list[str]:
    """The resumed run's recorded flags, then the ones given with --resume (argparse: the last one wins). A given
    flag that changes anything but SAFE_ON_RESUME is refused with one line naming it."""
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
    recorded = [a for a in recorded if a != "--rebuild-base"]  # the run's stages 1-2 were built; a resume reuses them
    combined = recorded + argv + ["--out", run.out]
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



def write_record(out: Path, argv: list[str], *configs) -> None:
    """RUN_RECORD: the run's flags (without --resume) and every resolved configuration."""
    flags = [a for i, a in enumerate(argv) if a not in ("--resume", "--overwrite", "--no-overwrite")
             and (i == 0 or argv[i - 1] != "--resume")]  # --overwrite acted once, at the start
    write_json(out / RUN_RECORD, {"argv": flags, "configs": {name: dataclasses.asdict(c) for name, c in
                                                             zip(("run", "sft", "rm", "ppo", "world", "dpo"), configs)}})


def check_data_files(run: RunConfig) -> None:
    """Read every data file once now, so a bad line stops the run (one line naming file and line, exit 2) before any
    stage; the stages read them again, which costs well under a second for files of this size."""
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
        config = tiny_llama_config(run.vocab_size if run.data else len(toy_world.world(run.world).VOCAB), sft_cfg)
    else:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(dirs["sft"] or dirs["model"], trust_remote_code=False)
    lora.check_targets(config, run)



def plan_inputs(argv: list[str]) -> tuple[dict, dict, dict]:
    """What --plan bills for these flags: (plan_memory's settings, the models {"model", "reward", "critic_model"},
    stages 1-2's batches per GPU), read from the run's own parsed configuration (parse_configs, the run's parser, with
    the world the plan's --num-gpus describes), so the plan bills the run that `deepspeed train.py ARGV` would start:
    its lengths (--max-prompt-tokens P, --max-new-tokens T), its batches per GPU (--rollout-batch, --minibatch,
    --ptx-batch, --sft-batch, --rm-batch over G), --generate-batch, gradient checkpointing, the ZeRO stage, the frozen
    models' sharding and offload, LoRA, the judge (on real data with --judge-frac > 0), the critic's start. Only the
    machine (--num-gpus, --gpu-mem, --overhead-gb, --engine, --no-flash-attention, --offload-optimizer) is the plan's
    own; its shape flags (--micro-batch, --rollout-batch-per-gpu, --ptx-batch-per-gpu, --prompt-len, --response-len,
    --no-grad-ckpt) override the run's when given."""
    plan_parser = scale.add_plan_args(argparse.ArgumentParser(allow_abbrev=False, add_help=False), train=True)
    plan_args, rest = plan_parser.parse_known_args(argv)
    cli.check_flags(plan_args, {"num_gpus": ">=1", "gpu_mem": ">0", "micro_batch": ">=1",
                                "rollout_batch_per_gpu": ">=1", "ptx_batch_per_gpu": ">=0", "prompt_len": ">=1",
                                "response_len": ">=1", "overhead_gb": ">=0"})
    G = plan_args.num_gpus
    engines = plan_args.engine == "deepspeed" or plan_args.engine == "auto" and (G > 1 or "--deepspeed" in rest)
    run, sft_cfg, rm_cfg, cfg, *_ = parse_configs(rest, world=G if engines else 1)  # a typo is still an error
    real = run.model != "tiny"
    if real:
        model, reward, critic_model = run.sft_model or run.model, run.reward_model or None, run.critic_model or None
    else:
        model = reward = tiny_llama_config(run.vocab_size if run.data else len(toy_world.world(run.world).VOCAB),
                                           sft_cfg)
        critic_model = None
    if run.fp32:
        beta = 4
    elif run.bf16 or engines:  # DeepSpeed on an accelerator with bf16 (pipeline.use_bf16)
        beta = 2
    else:  # one process without --bf16: from_pretrained loads the weights as saved (the tiny world trains in fp32)
        beta = scale.saved_dtype_bytes(model) if real else 4
    per_gpu = lambda n: max(1, n // G)  # noqa: E731
    shapes = dict(micro_batch=per_gpu(cfg.minibatch), rollout_batch_per_gpu=per_gpu(cfg.rollout_batch),
                  ptx_batch_per_gpu=per_gpu(cfg.ptx_batch) if cfg.ptx_coef else 0,
                  prompt_len=run.max_prompt_tokens, response_len=cfg.max_new_tokens, grad_ckpt=run.grad_ckpt)
    for key in ("micro_batch", "rollout_batch_per_gpu", "ptx_batch_per_gpu", "prompt_len", "response_len"):
        if f"--{key.replace('_', '-')}" in argv:  # the plan's own shape flag, given: it wins
            shapes[key] = getattr(plan_args, key)
    if "--no-grad-ckpt" in argv:
        shapes["grad_ckpt"] = False
    offload_optimizer = plan_args.offload_optimizer
    if run.deepspeed_config:  # the engines' own JSON: its ZeRO stage and optimizer offload are what the run uses
        zero = json.loads(Path(run.deepspeed_config).read_text()).get("zero_optimization", {})
        offload_optimizer = offload_optimizer or bool(zero.get("offload_optimizer"))
    judge = bool(run.data and run.judge_frac) and (not real or "rm" in run.stages.split(","))
    settings = dict(num_gpus=G, gpu_mem_gb=plan_args.gpu_mem, zero_stage=run.zero_stage,
                    engine="deepspeed" if engines else "torch", dtype_bytes=beta,
                    offload_optimizer=offload_optimizer, ref_reward_offload=run.frozen_offload,
                    frozen_zero_stage=3 if run.frozen_offload else run.frozen_zero_stage,
                    flash_attention=not plan_args.no_flash_attention, overhead_gb=plan_args.overhead_gb,
                    lora_r=run.lora_r, lora_targets=run.lora_targets, lora_bits=run.lora_bits,
                    generate_batch=cfg.generate_batch, critic_init="model" if critic_model else cfg.critic_init,
                    policy_init=cfg.policy_init, judge=judge, critic=cfg.advantage == "gae", **shapes)
    if settings["generate_batch"] and settings["rollout_batch_per_gpu"] % settings["generate_batch"]:
        fail(f"--generate-batch {cfg.generate_batch}: must divide the rollout batch per GPU "
             f"({settings['rollout_batch_per_gpu']})")
    stage_batch = {f"{k}_batch": per_gpu(getattr(c, f"{k}_batch")) for k, c in (("sft", sft_cfg), ("rm", rm_cfg))}
    return settings, dict(model=model, reward=reward, critic_model=critic_model, tiny=not real,
                          advantage=cfg.advantage), stage_batch


def print_plan(argv: list[str]) -> "scale.MemoryPlan":
    """--plan: plumbing/scale.py's per-GPU memory plan of the run these flags describe (plan_inputs), loading no
    weights. The plan comes back with its stages 1-2 in plan.stages."""
    settings, models, stage_batch = plan_inputs(argv)
    model, reward, critic_model, real = models["model"], models["reward"], models["critic_model"], not models["tiny"]
    try:
        plan = scale.plan_memory(model, reward_cfg=reward, critic_cfg=critic_model, **settings)
        # the tiny world and --data alone train stages 1-2 from scratch, in full (plumbing/lora.py)
        plan.stages = scale.stage_plans(model, settings if real else {**settings, "lora_r": 0, "lora_bits": 16},
                                        **stage_batch)
    except (scale.ModelNotFound, ValueError) as e:
        fail(str(e))
    if not real:
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
        print(f"--advantage {models['advantage']} holds no critic: {(other.total_bytes - plan.total_bytes) / scale.GiB:.2f} GiB "
              f"per GPU less than PPO with GAE's critic ({other.total_bytes / scale.GiB:.2f} GiB)")
    return plan

