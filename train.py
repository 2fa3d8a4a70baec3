"""Train RLHF with PPO-max end to end: SFT -> reward model -> critic pre-training -> PPO (arXiv 2307.04964).

Run:
  python train.py                       # the synthetic world on the CPU, every stage, a few minutes
  python train.py --preset vanilla      # the same world with vanilla PPO: watch it collapse (Fig. 4)
  python train.py --help                # every flag, with its paper symbol and default
  python train.py --model llama-7b --plan [--num-gpus 8 --gpu-mem 80 ...]   # per-GPU memory bill; loads nothing
  deepspeed --num_gpus 8 train.py --model llama-7b --reward-model RM_DIR --prompts prompts.jsonl
                                        # the paper's set-up: DeepSpeed engines (ZeRO-2), paper hyperparameters
  deepspeed --num_gpus 2 train.py ...   # on a CPU-only machine too: DeepSpeed picks its CPU accelerator and gloo

Stages (each writes a Hugging Face directory under --out):
  1. SFT: a tiny LLaMA-architecture model on the demonstrations; it is also the frozen reference π_SFT.
  2. Reward model from the SFT model with Eq. 2 (Bradley-Terry + LM loss on the chosen response).
  3. Critic from the reward model, pre-trained on value prediction before any policy update (§5.3.3).
  4. PPO: the numbered loop at the bottom of this file.
SFT and reward model depend only on the world and their own settings, so they are cached under
runs/_base/<hash>/ and shared by every preset with the same seed. A real --model (a local Hugging Face directory,
a hub id already in the local cache, or an alias of scale.py) skips stages 1-2: --reward-model is required.

Under the `deepspeed` launcher (WORLD_SIZE > 1, or --deepspeed) policy and critic are DeepSpeed engines (ZeRO-2 by
default, AdamW, bf16 where the accelerator has it, global gradient clipping); reference and reward model run for
inference only, replicated on every rank. The global batch stays --rollout-batch prompts and --minibatch sequences
per optimizer step whatever the number of ranks W: rank r takes prompts r, r + W, … of every batch. Scores are
gathered for Eq. 18's moments, metrics averaged over ranks; only rank 0 prints and writes files.

References: Ouyang et al. 2022 (InstructGPT); Ziegler et al. 2019; CleanRL ppo.py; lm-human-preference-details.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import eval as evaluation
import monitor as collapse
import ppo_max
import scale
import toy_world
from ppo_loss import entropy, kl_full, logprobs_from_logits, masked_mean, ptx_loss
from reward_model import ScalarHeadModel, reward_model_loss, accuracy


from ppo_max import arg  # a dataclass field whose help text becomes `--help`


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
    # long runs (checkpoint.py, monitor.py)
    save_every: int = arg(20, "write a checkpoint every N PPO steps (and at the end); 0 = only at the end")
    keep_last: int = arg(3, "checkpoints kept under <out>/checkpoints (older ones are deleted)")
    resume: str = arg("", "continue a run exactly: its directory or one of its checkpoints (same flags as the run)")
    max_bad_steps: int = arg(3, "stop after this many consecutive steps with a non-finite score/advantage/gradient")
    on_collapse: str = arg("warn", "when the §5.2 collapse alarm fires: 'warn' (log it) or 'stop' (checkpoint, stop)")
    alarm_kl_max: float = arg(collapse.KL_MAX, "collapse alarm: KL to the reference (nats/token) that makes a step "
                                               "bad; higher is quieter and later (`python monitor.py sweep runs/*`)")
    alarm_patience: int = arg(collapse.PATIENCE, "collapse alarm: consecutive bad steps before it fires")
    # real preference data instead of the synthetic world (build_base_real; data.py reads and checks it)
    data: str = arg("", "HH-RLHF or {prompt,chosen,rejected} .jsonl[.gz]: train on real text with a from-scratch "
                        "model instead of the synthetic world (flags not given take REAL_DATA_DEFAULTS)")
    skip_bad: bool = arg(False, "with --data: skip bad lines, count them by reason, report at the end (else exit 2)")
    heldout_frac: float = arg(0.1, "with --data: fraction of pairs held out for RM accuracy and evaluation prompts")
    vocab_size: int = arg(2000, "with --data: byte-level BPE vocabulary, trained on the training split only")
    max_prompt_tokens: int = arg(128, "with --data: P limit; longer prompts keep their latest turns")
    max_response_tokens: int = arg(64, "with --data: T limit (EOS included); longer pairs are dropped and counted")
    # real models and scale (scale.py): `--plan`, `deepspeed train.py ...`
    plan: bool = arg(False, "print the per-GPU memory plan of --model and exit, loading no weights (more flags: "
                            "--num-gpus --gpu-mem --micro-batch --prompt-len ...; see `python scale.py --help`)")
    sft_model: str = arg("", "real --model: the SFT model, policy and reference init (default: --model itself)")
    reward_model: str = arg("", "real --model: the reward model directory (ScalarHeadModel: value_head.safetensors)")
    critic_model: str = arg("", "real --model: the critic init (default: the reward model, as PPO-max)")
    prompts: str = arg("", "real --model: a .jsonl[.gz] of {\"prompt\"} lines for the rollouts (or use --data's)")
    deepspeed: bool = arg(False, "DeepSpeed engines even in one process (automatic under the `deepspeed` launcher)")
    deepspeed_config: str = arg("", "DeepSpeed JSON for policy and critic (e.g. ds_config_zero2.json) instead of the "
                                    "one built from these flags; its micro batch is set to minibatch / ranks")
    zero_stage: int = arg(2, "ZeRO stage of the policy and critic engines: 0, 1 or 2 (the paper: 2)")
    grad_ckpt: bool = arg(False, "gradient checkpointing in policy and critic (on in the llama presets)")
    fp32: bool = arg(False, "fp32 where bf16 would be used (DeepSpeed on an accelerator with bf16; never the CPU)")


@dataclass
class SFTConfig:
    sft_hidden: int = arg(64, "hidden size of the tiny LLaMA")
    sft_layers: int = arg(2, "transformer layers of the tiny LLaMA")
    sft_heads: int = arg(4, "attention heads of the tiny LLaMA")
    sft_epochs: float = arg(3.0, "epochs over the SFT demonstrations")
    sft_lr: float = arg(3e-3, "SFT learning rate (AdamW, cosine decay)")
    sft_batch: int = arg(64, "SFT batch size (sequences)")


@dataclass
class RMConfig:
    rm_epochs: float = arg(2.0, "epochs over the training preference pairs (paper ~1.06)")
    rm_lr: float = arg(1e-3, "reward-model learning rate (paper 5e-6 at 7B)")
    rm_batch: int = arg(32, "pairs per step")
    rm_lm_coef: float = arg(1.0, "β_rm of Eq. 2: weight of the LM loss on the chosen response (paper 1)")
    rm_eval_every: int = arg(10, "steps between held-out accuracy evaluations (Fig. 3)")


def ppo_config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(ppo_max.PPOConfig))


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
    args = build_parser().parse_args(argv)
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    run, sft, rm = pick(RunConfig), pick(SFTConfig), pick(RMConfig)
    overrides = {f.name: getattr(args, f.name) for f in ppo_config_fields() if getattr(args, f.name) is not None}
    ppo = ppo_max.apply_preset(run.preset, **overrides)
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
    return run, sft, rm, ppo, world


# =========================================================================================================
# Boilerplate: seeding, batching, saving
# =========================================================================================================
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return [tokenizer.bos_token_id] + encode(tokenizer, prompt)


def encode_response(tokenizer, response: str) -> list[int]:
    return encode(tokenizer, response) + [tokenizer.eos_token_id]


def pad(seqs: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad id lists to one length. Returns ids (B, L) and the 0/1 mask (B, L) as float."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), L)
    for i, s in enumerate(seqs):
        sl = slice(L - len(s), L) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1.0
    return ids, mask


def lm_batch(tokenizer, rows: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt, response) pairs -> right-padded ids (B, L), attention mask (B, L), response-token mask (B, L)."""
    seqs, resp = [], []
    for prompt, response in rows:
        p, r = encode_prompt(tokenizer, prompt), encode_response(tokenizer, response)
        seqs.append(p + r)
        resp.append([0] * len(p) + [1] * len(r))
    ids, attn = pad(seqs, tokenizer.pad_token_id, "right")
    response_mask, _ = pad(resp, 0, "right")
    return ids, attn, response_mask.float()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def config_hash(*objs) -> str:
    blob = json.dumps([dataclasses.asdict(o) for o in objs], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cosine_lr(step: int, total: int, base: float, warmup: int = 0) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total, 1)))


# =========================================================================================================
# Stage 1: SFT
# =========================================================================================================
def tiny_llama_config(vocab_size: int, cfg: SFTConfig):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.sft_hidden, intermediate_size=4 * cfg.sft_hidden,
                       num_hidden_layers=cfg.sft_layers, num_attention_heads=cfg.sft_heads,
                       num_key_value_heads=cfg.sft_heads, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def tiny_llama(vocab_size: int, cfg: SFTConfig):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(tiny_llama_config(vocab_size, cfg))


def train_lm(model, tokenizer, rows: list[tuple[str, str]], epochs: float, lr: float, batch: int, seed: int,
             desc: str) -> list[float]:
    """Next-token NLL on the response tokens (prompt tokens are context, not targets). Returns per-step losses."""
    rng = random.Random(seed)
    steps = max(1, int(epochs * len(rows) / batch))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, order = [], []
    model.train()
    for step in (bar := tqdm(range(steps), desc=desc, leave=False)):
        if len(order) < batch:
            order += rng.sample(range(len(rows)), len(rows))
        idx, order = order[:batch], order[batch:]
        ids, attn, resp_mask = lm_batch(tokenizer, [rows[i] for i in idx])
        logits = model(input_ids=ids, attention_mask=attn).logits                     # (B, L, V)
        loss, _ = ptx_loss(logits, ids, resp_mask)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


# =========================================================================================================
# Stage 2: reward model (Eq. 1-2)
# =========================================================================================================
def pair_batch(tokenizer, rows: list[dict]):
    """Chosen and rejected stacked in one batch of 2B sequences: [chosen_0..B-1, rejected_0..B-1]."""
    ids, attn, resp = lm_batch(tokenizer, [(r["prompt"], r["chosen"]) for r in rows]
                               + [(r["prompt"], r["rejected"]) for r in rows])
    return ids, attn, resp


@torch.no_grad()
def score_pairs(rm: ScalarHeadModel, tokenizer, rows: list[dict], batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    rc, rr = [], []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ids, attn, _ = pair_batch(tokenizer, chunk)
        s = rm.score(ids, attn)
        rc.append(s[:len(chunk)])
        rr.append(s[len(chunk):])
    return torch.cat(rc), torch.cat(rr)


def train_reward_model(rm: ScalarHeadModel, tokenizer, train_rows, heldout_rows, cfg: RMConfig, seed: int):
    rng = random.Random(seed)
    steps = max(1, int(cfg.rm_epochs * len(train_rows) / cfg.rm_batch))
    opt = torch.optim.AdamW(rm.parameters(), lr=cfg.rm_lr, weight_decay=0.0)
    log, order = [], []
    for step in (bar := tqdm(range(steps + 1), desc="2. reward model", leave=False)):
        if step % cfg.rm_eval_every == 0 or step == steps:   # Fig. 3: held-out accuracy vs step
            rm.eval()
            rc, rr = score_pairs(rm, tokenizer, heldout_rows)
            log.append({"step": step, "heldout_accuracy": accuracy(rc, rr)})
            bar.set_postfix(acc=f"{log[-1]['heldout_accuracy']:.3f}")
        if step == steps:
            break
        rm.train()
        if len(order) < cfg.rm_batch:
            order += rng.sample(range(len(train_rows)), len(train_rows))
        idx, order = order[:cfg.rm_batch], order[cfg.rm_batch:]
        B = len(idx)
        ids, attn, resp = pair_batch(tokenizer, [train_rows[i] for i in idx])
        values, logits = rm(ids, attn, return_logits=True)                          # (2B, L), (2B, L, V)
        scores = values.gather(1, _last_index(attn)[:, None]).squeeze(1)             # (2B,)
        loss, stats = reward_model_loss(scores[:B], scores[B:], logits[:B], ids[:B], resp[:B],
                                        lam=1.0, beta_rm=cfg.rm_lm_coef)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, cfg.rm_lr)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        log[-1].setdefault("train", []).append({k: float(v) for k, v in stats.items()})
    rm.eval()
    return log


def _last_index(attention_mask: torch.Tensor) -> torch.Tensor:
    from reward_model import last_token_index
    return last_token_index(attention_mask)


# =========================================================================================================
# Stages 1-2 together, cached: the world, its tokenizer, the SFT model and the reward model
# =========================================================================================================
def sft_and_reward_model(tmp: Path, tokenizer, sft_rows: list[dict], pairs_train: list[dict], pairs_heldout: list[dict],
                         sft_cfg: SFTConfig, rm_cfg: RMConfig, seed: int, timings: dict,
                         max_positions: int | None = None) -> ScalarHeadModel:
    """Stages 1-2 into `tmp`: SFT on {prompt, response} rows (tmp/sft), then the reward model initialised from it with
    a fresh scalar head and trained with Eq. 2 (tmp/reward_model), plus the logs of Fig. 2 and Fig. 3."""
    # 1. SFT
    t0 = time.time()
    seed_everything(seed)
    sft = tiny_llama(len(tokenizer), sft_cfg)
    if max_positions:
        sft.config.max_position_embeddings = max_positions  # RoPE: no table to resize
    rows = [(r["prompt"], r["response"]) for r in sft_rows]
    sft_losses = train_lm(sft, tokenizer, rows, sft_cfg.sft_epochs, sft_cfg.sft_lr, sft_cfg.sft_batch, seed, "1. SFT")
    sft.save_pretrained(tmp / "sft")
    tokenizer.save_pretrained(tmp / "sft")
    timings["sft"] = time.time() - t0

    # 2. reward model, initialised from SFT with a fresh scalar head (Eq. 2), held-out accuracy along the way (Fig. 3)
    t0 = time.time()
    seed_everything(seed)
    rm = ScalarHeadModel.from_pretrained(tmp / "sft")
    rm_log = train_reward_model(rm, tokenizer, pairs_train, pairs_heldout, rm_cfg, seed)
    rm.save_pretrained(tmp / "reward_model")
    tokenizer.save_pretrained(tmp / "reward_model")
    rc, rr = score_pairs(rm, tokenizer, pairs_heldout)
    timings["reward_model"] = time.time() - t0
    write_json(tmp / "sft_log.json", {"loss": sft_losses})
    write_json(tmp / "rm_log.json", rm_log)                                                      # Fig. 3
    write_json(tmp / "rm_heldout_scores.json", {"chosen": rc.tolist(), "rejected": rr.tolist()})  # Fig. 2
    return rm


def build_base(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig) -> Path:
    from transformers import AutoTokenizer
    base = Path("runs/_base") / f"seed{run.seed}-{config_hash(world_cfg, sft_cfg, rm_cfg)}"
    if (base / "DONE").exists():
        print(f"[base] reusing {base} (world, SFT and reward model for this seed and config)")
        return base
    tmp = Path(str(base) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    timings = {}

    t0 = time.time()
    data = toy_world.make_dataset(world_cfg)
    toy_world.write_dataset(data, tmp / "data")
    toy_world.build_tokenizer(tmp / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp / "tokenizer")
    timings["world"] = time.time() - t0

    rm = sft_and_reward_model(tmp, tokenizer, data["sft"], data["pairs_train"], data["pairs_heldout"], sft_cfg, rm_cfg,
                              run.seed, timings)
    bias = length_bias(rm, tokenizer, data["prompts_heldout"], run.seed)
    write_json(tmp / "rm_length_bias.json", bias)
    write_json(tmp / "timings.json", timings)
    write_json(tmp / "config.json", {"world": dataclasses.asdict(world_cfg), "sft": dataclasses.asdict(sft_cfg),
                                     "rm": dataclasses.asdict(rm_cfg), "seed": run.seed})
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(base, ignore_errors=True)
    tmp.rename(base)
    return base


# --data: the same stages on real text. A small budget so that the whole run (PPO included) takes minutes on
# 2 CPU cores; each value applies only when its flag is not given on the command line. Measured on
# harmless-base-test.dev.jsonl.gz --skip-bad, 2 shared (loaded) cores: 3 min 19 s in all (data 2 s, SFT 74 s,
# RM 27 s, critic pre-training 58 s, PPO 27 s, eval 5 s); held-out RM accuracy 0.614 on 83 pairs.
REAL_DATA_DEFAULTS = dict(sft_hidden=128, sft_epochs=2.0, sft_batch=32, rm_epochs=1.0, rm_lr=5e-4,
                          steps=10, rollout_batch=32, max_new_tokens=32, critic_pretrain_steps=4, eval_samples=1)


def given_flags(argv) -> set[str]:
    """The dest names of the flags actually on the command line."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS      # parse again: only the flags actually given survive
    return set(vars(p.parse_args(argv)))


def real_data_configs(argv, *configs):
    """Apply REAL_DATA_DEFAULTS to the fields of `configs` whose flag is not on the command line."""
    given = given_flags(argv)
    out = []
    for c in configs:
        names = {f.name for f in dataclasses.fields(c)}
        out.append(dataclasses.replace(c, **{k: v for k, v in REAL_DATA_DEFAULTS.items() if k in names and k not in given}))
    if "out" not in given and isinstance(out[0], RunConfig) and not out[0].resume:
        out[0].out = f"runs/{out[0].preset}-{Path(out[0].data).name.split('.')[0]}-seed{out[0].seed}"
    print("[data] real-data defaults for flags not given: "
          + json.dumps({k: v for k, v in REAL_DATA_DEFAULTS.items() if k not in given}))
    return out


def real_pair_rows(pairs, tokenizer, max_prompt_tokens: int, max_response_tokens: int, skip_bad: bool,
                   report) -> list[dict]:
    """Preference pairs as the text records {"prompt","chosen","rejected","source"} that lm_batch/pair_batch read.

    data.encode_pair applies the limits (latest turns kept, over-long responses dropped and counted,
    prompt_too_long raised or skipped); the kept prompt ids are then decoded back to TEXT, so the rest of
    the pipeline (lm_batch, PPO, eval) re-encodes exactly those tokens: [BOS] + prompt + response + [EOS],
    L ≤ 1 + max_prompt_tokens + max_response_tokens. eval.py score uses this same function.
    """
    import data
    encoded = data.encode_pairs(pairs, tokenizer, max_prompt_tokens, max_response_tokens, skip_bad=skip_bad,
                                report=report)
    by_source = {p.source: p for p in pairs}
    return [{"prompt": prompt_text(e["prompt_ids"], tokenizer, max_prompt_tokens),
             "chosen": by_source[e["source"]].chosen, "rejected": by_source[e["source"]].rejected,
             "source": e["source"]} for e in encoded]


def prompt_text(prompt_ids: list[int], tokenizer, max_prompt_tokens: int) -> str:
    """The text of truncated prompt ids, re-encoding to at most max_prompt_tokens tokens.

    Byte-level BPE decodes losslessly, so an untruncated prompt, or one cut at a "\\n\\nHuman:" turn, comes
    back character for character. A token-level cut (a single over-long last turn) can start inside a word
    or a UTF-8 character and re-encode differently: drop one more leading token until it fits.
    """
    ids = list(prompt_ids)
    while True:
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if len(encode(tokenizer, text)) <= max_prompt_tokens:
            return text
        ids = ids[1:]


def build_base_real(run: RunConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig) -> Path:
    """Stages 1-2 on real preference pairs (--data), cached like build_base under runs/_base/real-seed<s>-<hash>/.

    Writes the same files as build_base (tokenizer, sft, reward_model, data/{prompts_train, prompts_heldout,
    sft}.jsonl, rm_log.json, rm_heldout_scores.json, timings.json, DONE), so the PPO stage runs unchanged, plus
    data_report.json (kept / skipped / truncated / dropped) and data_limits.json (also in reward_model/, for
    `eval.py score`). No "pretrained" model and no length-bias probe: both need the synthetic world.
    """
    import data
    t0 = time.time()
    report = data.DataReport()
    pairs = data.load_pairs(run.data, skip_bad=run.skip_bad, report=report)  # DataError: one line, exit 2
    stat = Path(run.data).stat()
    limits = {"max_prompt_tokens": run.max_prompt_tokens, "max_response_tokens": run.max_response_tokens,
              "bos": True, "note": "ids = [BOS] + prompt (latest turns kept) + response + [EOS]"}
    key = {"data": {"path": str(Path(run.data).resolve()), "size": stat.st_size, "mtime": stat.st_mtime},
           "limits": limits, "vocab_size": run.vocab_size, "heldout_frac": run.heldout_frac, "skip_bad": run.skip_bad,
           "seed": run.seed, "sft": dataclasses.asdict(sft_cfg), "rm": dataclasses.asdict(rm_cfg)}
    base = Path("runs/_base") / f"real-seed{run.seed}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"
    if (base / "DONE").exists():
        print(f"[base] reusing {base} (tokenizer, SFT and reward model for this data file and config)")
        return base
    tmp = Path(str(base) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    timings = {}

    # 0. split, tokenizer on the training split only, limits applied once, text records written
    train_pairs, heldout_pairs = data.train_heldout_split(pairs, run.heldout_frac, run.seed)
    tokenizer = data.train_bpe_tokenizer([p.prompt + p.chosen for p in train_pairs] + [p.rejected for p in train_pairs],
                                         tmp / "tokenizer", run.vocab_size)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)  # tiny_llama's ids
    lim = (run.max_prompt_tokens, run.max_response_tokens)
    pairs_train = real_pair_rows(train_pairs, tokenizer, *lim, run.skip_bad, report)
    pairs_heldout = real_pair_rows(heldout_pairs, tokenizer, *lim, run.skip_bad, report)
    print(f"[data] {run.data}: {len(pairs_train)} train / {len(pairs_heldout)} held-out pairs; {report.summary()}")
    if not pairs_train or not pairs_heldout:
        raise data.DataError(run.data, None, None, "all_skipped",
                             f"no {'training' if not pairs_train else 'held-out'} pairs left within the limits "
                             f"({report.summary()}); raise --max-response-tokens or give more pairs")
    data_files = {"prompts_train": [{"prompt": r["prompt"]} for r in pairs_train],
                  "prompts_heldout": [{"prompt": r["prompt"]} for r in pairs_heldout],
                  "sft": [{"prompt": r["prompt"], "response": r["chosen"]} for r in pairs_train],  # SFT on y_w
                  "pairs_train": pairs_train, "pairs_heldout": pairs_heldout}
    (tmp / "data").mkdir()
    for name, rows in data_files.items():
        (tmp / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_json(tmp / "data_report.json", {**report.to_dict(), "summary": report.summary(), "file": run.data,
                                          "pairs_train": len(pairs_train), "pairs_heldout": len(pairs_heldout)})
    write_json(tmp / "data_limits.json", limits)
    timings["data"] = time.time() - t0

    # a from-scratch tiny LLaMA whose context holds [BOS] + P + T, SFT on the chosen responses
    rm = sft_and_reward_model(tmp, tokenizer, data_files["sft"], pairs_train, pairs_heldout, sft_cfg, rm_cfg, run.seed,
                              timings, max_positions=1 + run.max_prompt_tokens + run.max_response_tokens)
    write_json(tmp / "reward_model" / "data_limits.json", limits)
    print(f"[base] reward model held-out accuracy {json.loads((tmp / 'rm_log.json').read_text())[-1]['heldout_accuracy']:.3f}"
          f" on {len(pairs_heldout)} pairs")
    write_json(tmp / "timings.json", timings)
    write_json(tmp / "config.json", {"data": key["data"], "limits": limits, "vocab_size": run.vocab_size,
                                     "heldout_frac": run.heldout_frac, "skip_bad": run.skip_bad,
                                     "sft": dataclasses.asdict(sft_cfg), "rm": dataclasses.asdict(rm_cfg), "seed": run.seed})
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(base, ignore_errors=True)
    tmp.rename(base)
    return base


def pretrained_dir(base: Path, run: RunConfig, sft_cfg: SFTConfig) -> Path:
    """The "pretrained, not SFT" policy of Fig. 8: the same LM trained on raw word streams of the world's
    vocabulary with no instruction format. Built on first use and cached in the base directory."""
    from transformers import AutoTokenizer
    out = base / "pretrained"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    seed_everything(run.seed + 1)
    pre = tiny_llama(len(tokenizer), sft_cfg)
    rng = random.Random(run.seed + 1)
    raw = [("", " ".join(rng.choice(toy_world.RESPONSE_WORDS) for _ in range(rng.randint(3, 12))))
           for _ in range(toy_world.WorldConfig().n_sft)]
    train_lm(pre, tokenizer, raw, 1.0, sft_cfg.sft_lr, sft_cfg.sft_batch, run.seed + 1, "1b. pretrained (no SFT)")
    tmp = Path(str(out) + ".tmp")
    pre.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@torch.no_grad()
def length_bias(rm: ScalarHeadModel, tokenizer, prompt_rows: list[dict], seed: int) -> dict:
    """RM score vs gold as filler words are added to a correct answer (same content, longer): the RM's
    length bias beyond gold's. Slopes are per added token, averaged over held-out helpful prompts."""
    rng = random.Random(seed)
    prompts = [toy_world.parse_prompt(r["prompt"]) for r in prompt_rows]
    prompts = [p for p in prompts if not p.harmful]
    out = {"extra_tokens": [], "rm": [], "gold": []}
    for extra in range(0, 7):
        rows, golds = [], []
        for p in prompts:
            base, padded = toy_world.length_probe_responses(p, rng, extra)
            rows.append((p.text, padded))
            golds.append(toy_world.gold_reward(p.text, padded))
        ids, attn, _ = lm_batch(tokenizer, rows)
        out["extra_tokens"].append(extra)
        out["rm"].append(rm.score(ids, attn).mean().item())
        out["gold"].append(float(np.mean(golds)))
    out["rm_slope"] = float(np.polyfit(out["extra_tokens"], out["rm"], 1)[0])
    out["gold_slope"] = float(np.polyfit(out["extra_tokens"], out["gold"], 1)[0])
    return out


# =========================================================================================================
# Scale: --plan, real models (--model), DeepSpeed (scale.py holds the numbers; this is the wiring)
# =========================================================================================================
# --model llama-7b / llama-13b: the paper's hyperparameters (section 5 and its appendix) for the flags not given.
# bf16 comes with DeepSpeed on an accelerator that has it; the final evaluation always samples as the paper
# evaluates (eval.EVAL_SAMPLING). Printed at start-up.
PAPER_LLAMA = dict(policy_lr=5e-7, critic_lr=1.65e-6, warmup_frac=0.1, rollout_batch=128, minibatch=32, lam=0.9,
                   clip_eps=0.2, kl_coef=0.05, grad_ckpt=True)
MODEL_PRESETS = {"llama-7b": PAPER_LLAMA, "llama-13b": PAPER_LLAMA}


def fail(message: str) -> None:
    """A user's mistake: one line on stderr, exit 2 (as data.cli_guard)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_preset_configs(argv, run: RunConfig, cfg: ppo_max.PPOConfig):
    """Apply MODEL_PRESETS[run.model] to the fields of run and cfg whose flag is not on the command line."""
    given = given_flags(argv)
    preset = {k: v for k, v in MODEL_PRESETS[run.model].items() if k not in given}
    names = lambda c: {f.name for f in dataclasses.fields(c)}  # noqa: E731
    run = dataclasses.replace(run, **{k: v for k, v in preset.items() if k in names(run)})
    cfg = dataclasses.replace(cfg, **{k: v for k, v in preset.items() if k in names(cfg)})
    print(f"[model] {run.model}: the paper's hyperparameters for the flags not given: {json.dumps(preset)}; bf16 "
          f"where the accelerator has it; evaluation sampling {json.dumps(evaluation.EVAL_SAMPLING)}")
    return run, cfg


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
    except (scale.ModelNotFound, ValueError) as e:
        fail(str(e))
    if run.model == "tiny":
        plan.name = "tiny (the synthetic world's LLaMA)"
    print(scale.format_plan(plan))
    return plan


def resolve_real_models(run: RunConfig, cfg: ppo_max.PPOConfig) -> dict[str, str]:
    """Local directories of a real --model's SFT model (policy and reference), reward model and critic.
    A name not on this machine ends the run with scale.py's message (download it, or pass a local directory)."""
    def resolve(flag: str, name: str) -> str:
        try:
            return scale.resolve_model(name)
        except scale.ModelNotFound as e:
            fail(str(e).replace("--model", flag, 1))

    sft = resolve("--sft-model" if run.sft_model else "--model", run.sft_model or run.model)
    if not run.reward_model:
        fail(f"--model {run.model}: a real model runs PPO only (SFT and reward-model training are for the synthetic "
             f"world and --data): pass --reward-model DIR, a reward model written by ScalarHeadModel.save_pretrained")
    reward = resolve("--reward-model", run.reward_model)
    critic = resolve("--critic-model", run.critic_model) if run.critic_model else (
        reward if cfg.critic_init == "rm" else sft)
    if not (run.prompts or run.data):
        fail(f"--model {run.model}: no prompts; pass --prompts FILE.jsonl ({{\"prompt\": ...}} lines) or --data PAIRS")
    return {"sft": sft, "reward": reward, "critic": critic}


def real_model_data(run: RunConfig, tokenizer) -> dict[str, list[dict]]:
    """Prompts (train / held-out split) and SFT text (the ptx term) for a real --model: --prompts {"prompt"} lines,
    or the prompts and chosen responses of --data pairs. Long prompts keep their latest turns (data.encode_prompt)."""
    import data
    prompts = data.load_prompts(run.prompts or run.data, skip_bad=run.skip_bad)
    texts = data.load_texts(run.data, skip_bad=run.skip_bad) if run.data else []
    prompts = [prompt_text(data.encode_prompt(p, tokenizer, run.max_prompt_tokens), tokenizer, run.max_prompt_tokens)
               for p in prompts]
    train, heldout = data.train_heldout_split(prompts, run.heldout_frac, run.seed)
    return {"prompts_train": [{"prompt": p} for p in train], "prompts_heldout": [{"prompt": p} for p in heldout],
            "sft": [{"prompt": p, "response": r} for p, r in texts]}


def setup_distributed(run: RunConfig) -> tuple[int, int, torch.device]:
    """(rank, world size W, device). Under the `deepspeed` launcher (WORLD_SIZE > 1) or with --deepspeed:
    deepspeed.init_distributed() (gloo on DeepSpeed's CPU accelerator, nccl on GPUs). Otherwise (0, 1, cpu)
    and nothing is initialised: the single-process run of every test."""
    if not (run.deepspeed or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return 0, 1, torch.device("cpu")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        os.environ.setdefault(k, v)  # --deepspeed without the launcher: a world of one
    import logging

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    deepspeed.utils.logger.setLevel(logging.WARNING)  # train.py prints its own config and one line per step
    deepspeed.init_distributed()
    accelerator, local_rank = get_accelerator(), int(os.environ["LOCAL_RANK"])
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    device = torch.device(accelerator.device_name(local_rank))
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def engine_config(run: RunConfig, cfg: ppo_max.PPOConfig, world: int, bf16: bool) -> dict:
    """DeepSpeed JSON of the policy and critic engines: --deepspeed_config, or scale.deepspeed_config from the flags
    (ZeRO stage, bf16, gradient_clipping = --grad-clip). Either way one optimizer step is one minibatch:
    train_micro_batch_size_per_gpu = minibatch / W, no gradient accumulation."""
    if run.deepspeed_config:
        try:
            ds = json.loads(Path(run.deepspeed_config).read_text())
        except FileNotFoundError:
            fail(f"--deepspeed_config {run.deepspeed_config}: no such file")
        except json.JSONDecodeError as e:
            fail(f"{run.deepspeed_config}, line {e.lineno}: not valid JSON ({e.msg})")
    else:
        ds = scale.deepspeed_config(zero_stage=run.zero_stage, bf16=bf16, train_micro_batch_size_per_gpu=1,
                                    gradient_accumulation_steps=1, gradient_clipping=cfg.grad_clip)
    ds.pop("train_batch_size", None)
    ds.update(train_micro_batch_size_per_gpu=cfg.minibatch // world, gradient_accumulation_steps=1)
    if ds.get("zero_optimization", {}).get("stage", 0) not in (0, 1, 2):
        fail("ZeRO-3 for the policy and critic is not wired in this loop (rollouts would need generate(synced_gpus="
             "True) and rank 0's evaluation all ranks); use --zero-stage 0-2 (the paper: 2) and, if they do not "
             "fit, optimizer offload in --deepspeed_config (see --plan)")
    return ds


def deepspeed_engine(model, optimizer, ds: dict, lr: float):
    """deepspeed.initialize for one trained model: with our AdamW, or with the JSON's own optimizer block (e.g.
    DeepSpeed's CPU Adam for offload) at this model's learning rate. Returns (engine, its optimizer)."""
    import deepspeed
    if "optimizer" in ds:
        block = ds["optimizer"]
        ds = {**ds, "optimizer": {**block, "params": {**block.get("params", {}), "lr": lr}}}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    else:
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, opt


# =========================================================================================================
# Stage 3: critic pre-training (§5.3.3)
# =========================================================================================================
# (see ppo_max.pretrain_critic)


# =========================================================================================================
# Stage 4: PPO
# =========================================================================================================
def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # before parsing: the plan's flags (--num-gpus, ...) are scale.py's
        print_plan(argv)
        return None
    run, sft_cfg, rm_cfg, cfg, world_cfg = parse_configs(argv)
    if run.plan:
        print_plan(argv)
        return None
    real_model = run.model != "tiny"  # a real --model: PPO only, on the directories it names
    if run.data and not real_model:  # real text: a smaller budget for the flags not given, and no gold judge
        run, sft_cfg, rm_cfg, cfg = real_data_configs(argv, run, sft_cfg, rm_cfg, cfg)
    if run.model in MODEL_PRESETS:
        run, cfg = model_preset_configs(argv, run, cfg)
    if cfg.policy_init != "sft" and (run.data or real_model):
        fail("--policy-init pretrained needs the synthetic world")
    dirs = resolve_real_models(run, cfg) if real_model else None  # fails at once, before anything is loaded
    gold_judge = None if (run.data or real_model) else evaluation.gold_judge  # the synthetic human; real data has none
    if run.threads:
        torch.set_num_threads(run.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    # data parallelism: rank, world size W and device; W = 1 and the CPU without the `deepspeed` launcher
    rank, world, device = setup_distributed(run)
    engines = run.deepspeed or world > 1  # policy and critic become DeepSpeed engines
    main_rank = rank == 0
    if not main_rank:  # only rank 0 prints (and below: writes files, evaluates)
        sys.stdout = open(os.devnull, "w")
        hf_logging.disable_progress_bar()
    for name, n in (("rollout_batch", cfg.rollout_batch), ("minibatch", cfg.minibatch)):
        if n % world:
            fail(f"--{name.replace('_', '-')} {n} must be divisible by the number of processes ({world}): the global "
                 f"batch is split evenly across ranks")
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"preset {run.preset!r}: " + json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()}))
    t_start = time.time()

    # stages 1-2, cached: rank 0 builds them while the other ranks wait at the barrier, then they read the cache
    if not main_rank:
        ppo_max.barrier()
    if real_model:
        base, bias, timings = None, None, {}
        tokenizer = AutoTokenizer.from_pretrained(dirs["sft"])
        if tokenizer.pad_token_id is None:  # LLaMA's tokenizer has none; padding is masked everywhere
            tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
        data = real_model_data(run, tokenizer)
        policy_dir, ref_dir, reward_dir, critic_dir = dirs["sft"], dirs["sft"], dirs["reward"], dirs["critic"]
    else:
        base = build_base_real(run, sft_cfg, rm_cfg) if run.data else build_base(run, sft_cfg, rm_cfg, world_cfg)
        timings = json.loads((base / "timings.json").read_text())
        bias = None if run.data else json.loads((base / "rm_length_bias.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
        data = {k: read_jsonl(base / "data" / f"{k}.jsonl") for k in ["prompts_train", "prompts_heldout", "sft"]}
        policy_dir = base / "sft" if cfg.policy_init == "sft" else pretrained_dir(base, run, sft_cfg)
        ref_dir, reward_dir = base / "sft", base / "reward_model"
        critic_dir = base / ("reward_model" if cfg.critic_init == "rm" else "sft")
    if main_rank:
        ppo_max.barrier()
    if bias:
        print(f"[base] reward model length bias: RM {bias['rm_slope']:+.3f}/token vs gold {bias['gold_slope']:+.3f}/token "
              f"(filler tokens added to a correct answer)")
    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if cfg.ptx_coef and not data["sft"]:
        print("[ptx] no SFT text (--prompts only): the ptx term (Eq. 17) is off; pass --data pairs to keep it")
        cfg = dataclasses.replace(cfg, ptx_coef=0.0)

    seed_everything(run.seed + rank)  # rank r samples its own stream; rank 0's is the single-process one
    bf16 = engines and not run.fp32 and device.type != "cpu" and _accelerator_bf16()
    if engines:  # the JSON decides the dtype of the engines, and so of the frozen models beside them
        ds = engine_config(run, cfg, world, bf16)
        bf16 = ds.get("bf16", {}).get("enabled", False)
    load = {"dtype": torch.bfloat16} if bf16 else {}  # the tiny world: fp32, exactly as saved
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, **load)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, **load).eval().requires_grad_(False).to(device)
    reward_model = ScalarHeadModel.from_pretrained(reward_dir, **({"torch_dtype": torch.bfloat16} if bf16 else {}))
    reward_model = reward_model.eval().requires_grad_(False).to(device)
    critic = ScalarHeadModel.from_pretrained(critic_dir, **({"torch_dtype": torch.bfloat16} if bf16 else {}))
    if run.grad_ckpt:  # recompute activations in backward (the paper trains with it); generation is unaffected
        for m in (policy, critic):
            (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    if engines:
        print(f"[deepspeed] {world} process(es) on {device.type}, policy and critic engines: {json.dumps(ds)}")
        print("[deepspeed] reference and reward model: inference only, replicated on every rank (if they do not fit: "
              "ZeRO-3 / CPU offload with scale.inference_deepspeed_config; see --plan)")
        policy, policy_opt = deepspeed_engine(policy, policy_opt, ds, cfg.policy_lr)
        critic, critic_opt = deepspeed_engine(critic, critic_opt, ds, cfg.critic_lr)
    unwrap = lambda m: m.module if engines else m  # noqa: E731  (the HF model inside an engine)
    moments = ppo_max.RunningMoments()
    kl_ctl = ppo_max.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)

    prompt_rng = random.Random(run.seed)  # the same stream on every rank: every rank draws the global batch
    train_prompts = [r["prompt"] for r in data["prompts_train"]]
    sft_rows = [(r["prompt"], r["response"]) for r in data["sft"]]

    def prompt_batch():
        rows = [prompt_rng.choice(train_prompts) for _ in range(cfg.rollout_batch)][rank::world]  # this rank's slice
        query, query_mask = pad([encode_prompt(tokenizer, p) for p in rows], pad_id, "left")
        return rows, query.to(device), query_mask.to(device)

    def ptx_batch():
        rows = [sft_rows[prompt_rng.randrange(len(sft_rows))] for _ in range(cfg.ptx_batch)][rank::world]
        ids, attn, resp = lm_batch(tokenizer, rows)
        return ids.to(device), attn.to(device), resp.to(device)

    # long-run machinery (checkpoint.py, monitor.py): exact resume, non-finite guard, the §5.2 collapse alarm.
    # Under DeepSpeed the engines save themselves (ZeRO shards the optimizer state across ranks) into
    # checkpoints/deepspeed/<policy|critic>/step-N/, every rank its RNG streams into checkpoints/deepspeed/rng/;
    # checkpoint.py (rank 0) writes the rest: from_pretrained-ready weights, the run state, and COMPLETE last.
    models = {"policy": unwrap(policy), "critic": unwrap(critic)}
    optimizers = {"policy": policy_opt, "critic": critic_opt}
    ds_dir = out / checkpoint.CKPT_SUBDIR / "deepspeed"
    guard = checkpoint.NonFiniteGuard(run.max_bad_steps, log=tqdm.write)
    monitor = collapse.CollapseMonitor(kl_max=run.alarm_kl_max, patience=run.alarm_patience)
    history: list[dict] = []
    start = 0
    if run.resume:
        ckpt = checkpoint.find_latest(run.resume)
        if ckpt is None:
            raise FileNotFoundError(f"--resume {run.resume}: no complete checkpoint there")
        ds_src = ckpt.parent / "deepspeed"  # where save() put the engines' states of this checkpoint
        if (ds_src / "policy" / ckpt.name).is_dir() != engines:
            fail(f"--resume {ckpt}: written {'without' if engines else 'by'} DeepSpeed engines; resume it as it ran")
        state = checkpoint.load_checkpoint(ckpt, models={} if engines else models,
                                           optimizers={} if engines else optimizers, rngs={"prompt": prompt_rng})
        if engines:
            for name, engine in (("policy", policy), ("critic", critic)):
                engine.load_checkpoint(str(ds_src / name), tag=ckpt.name, load_lr_scheduler_states=False)
            rng_file = ds_src / "rng" / f"{ckpt.name}-rank{rank}.pt"
            checkpoint.set_rng_state(torch.load(rng_file, weights_only=True), {"prompt": prompt_rng})
        start, extra = state["step"], state["extra_state"]
        moments.load_state_dict(extra["moments"])
        kl_ctl.value = extra["kl_coef"]
        monitor.load_state_dict(extra["monitor"])
        guard.load_state_dict(extra["guard"])
        history = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()[:start]]
        print(f"[resume] {ckpt}: continuing at step {start}")
    else:
        # 3. critic pre-training: fit V to the returns of the initial policy's rollouts before any policy update
        t0 = time.time()
        critic_log = ppo_max.pretrain_critic(policy, ref, reward_model, critic, critic_opt, moments, prompt_batch,
                                             cfg, eos, pad_id, kl_ctl.value)
        timings["critic_pretrain"] = time.time() - t0
        if main_rank:
            write_json(out / "critic_pretrain.json", critic_log)

    def save(n_done: int) -> Path | None:
        extra = {"moments": moments.state_dict(), "kl_coef": kl_ctl.value, "monitor": monitor.state_dict(),
                 "guard": guard.state_dict()}
        tag = f"step-{n_done:06d}"
        if engines:  # every rank: its ZeRO shards and its RNG streams
            for name, engine in (("policy", policy), ("critic", critic)):
                engine.save_checkpoint(str(ds_dir / name), tag=tag)
            (ds_dir / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint.rng_state({"prompt": prompt_rng}), ds_dir / "rng" / f"{tag}-rank{rank}.pt")
            ppo_max.barrier()
        path = None
        if main_rank:
            path = checkpoint.save_checkpoint(out, n_done, models=models, optimizers={} if engines else optimizers,
                                              rngs={"prompt": prompt_rng}, extra_state=extra, tokenizer=tokenizer,
                                              keep_last=run.keep_last)
            if engines:  # the engines' states (and RNG files) of the checkpoints checkpoint.py just deleted go too
                kept = {p.name for p in path.parent.glob("step-*")}
                for old in ds_dir.glob("*/step-*"):       # policy/step-N/, critic/step-N/, rng/step-N-rank<r>.pt
                    if old.name.split("-rank")[0] not in kept:
                        shutil.rmtree(old) if old.is_dir() else old.unlink()
        ppo_max.barrier()
        return path

    # 4. PPO
    t0 = time.time()
    warmup_steps = math.ceil(cfg.warmup_frac * run.steps)
    if main_rank:  # metrics.jsonl holds exactly the completed steps: a resumed run rewrites the lines it will redo
        lines = [json.dumps(h) + "\n" for h in history]
        (out / "metrics.jsonl").write_text("".join(lines))
        if not run.resume:
            (out / "samples.jsonl").write_text("")
    metrics_f = open(out / "metrics.jsonl" if main_rank else os.devnull, "a")
    samples_f = open(out / "samples.jsonl" if main_rank else os.devnull, "a")
    alarm_info, stop_reason, stop_signal = None, None, False
    with checkpoint.GracefulExit() as interrupt:
        for step in (bar := tqdm(range(start, run.steps), desc="4. PPO", initial=start, total=run.steps,
                                 disable=not main_rank)):
            ts = time.time()
            # (0) linear learning-rate warm-up over the first warmup_frac of the iterations (paper: 10%), then flat
            lr_scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
            for opt, lr in ((policy_opt, cfg.policy_lr), (critic_opt, cfg.critic_lr)):
                for g in opt.param_groups:
                    g["lr"] = lr * lr_scale
            prompts, query, query_mask = prompt_batch()
            policy.eval()
            # (1) sample responses with the KV cache, stopping at EOS
            response, response_mask, finished = ppo_max.rollout(policy, query, query_mask, cfg.max_new_tokens, eos,
                                                                pad_id, cfg.temperature)
            # (2)-(5): score, normalise/clip, KL-shape, values and GAE (scores gathered over ranks for Eq. 18)
            exp = ppo_max.make_experience(policy, ref, reward_model, critic, query, query_mask, response,
                                          response_mask, moments, cfg, kl_ctl.value)
            # (6) PPO epochs over minibatches: clipped policy loss, clipped value loss, ptx, global grad clip
            upd = {}
            if not exp["nonfinite"]:
                policy.train(); critic.train()
                upd = ppo_max.ppo_update(policy, critic, policy_opt, critic_opt, exp, cfg, ptx_batch)
                kl_ctl.update(exp["stats"]["kl/ref"], cfg.rollout_batch)
            bad = exp["nonfinite"] or (upd.get("guard/nonfinite") or [None])[0]
            if bad:  # the update was skipped (or partly skipped): logged, never checkpointed as if it were fine
                guard.check(step, {bad: float("nan")})
                if guard.should_stop:
                    last = checkpoint.find_latest(out)
                    stop_reason = f"{run.max_bad_steps} consecutive steps with non-finite values; last good checkpoint: {last}"
                    break
                continue
            guard.ok()
            # (7) log: gold reward is the synthetic human, never seen by training; lists are the global batch
            texts = [tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(response, response_mask)]
            gold = [gold_judge(p, t, bool(f)) for p, t, f in zip(prompts, texts, finished)] if gold_judge else None
            prompts, texts = ppo_max.gather_list(prompts), ppo_max.gather_list(texts)
            gold = ppo_max.gather_list(gold) if gold_judge else None
            scores = exp["all_scores"]                                               # (W·B,) in prompt order
            m = {"step": step, **exp["stats"], **upd, "reward/gold": float(np.mean(gold)) if gold_judge else None,
                 "kl/coef": kl_ctl.value, "lr/policy": cfg.policy_lr * lr_scale,
                 "response/finished": ppo_max.gather_batch(finished.float()).mean().item(),
                 "time/step": time.time() - ts}
            alarm = monitor.update(step, m, scores.tolist())
            m["alarm/collapse"] = alarm is not None
            history.append(m)
            metrics_f.write(json.dumps(m) + "\n")
            metrics_f.flush()
            samples_f.write(json.dumps({"step": step, "scores": scores.tolist(), "gold": gold,
                                        "examples": [[p, t] for p, t in zip(prompts[:4], texts[:4])]}) + "\n")
            samples_f.flush()
            gold_s = "n/a" if m["reward/gold"] is None else f"{m['reward/gold']:+.2f}"
            bar.set_postfix(score=f"{m['reward/score']:.2f}", gold=gold_s, kl=f"{m['kl/ref']:.3f}",
                            len=f"{m['response/length']:.1f}")
            if step % 10 == 0 or step == run.steps - 1:
                tqdm.write(f"step {step:4d}  score {m['reward/score']:+.2f}  gold {gold_s}  "
                           f"kl {m['kl/ref']:.3f}  ppl {m['policy/perplexity']:.2f}  len {m['response/length']:.1f}  "
                           f"e.g. {prompts[0]!r} -> {texts[0]!r}")
            if alarm is not None:
                tqdm.write(f"[collapse alarm] step {step}: " + "; ".join(alarm.reasons))
                alarm_info = alarm_info or {"step": alarm.step, "reasons": alarm.reasons}
                if run.on_collapse == "stop":
                    stop_reason = f"collapse alarm at step {step}"
            stop_signal = ppo_max.any_rank(interrupt.requested, device)  # every rank stops at the same step
            done = step + 1
            if stop_reason or stop_signal or (run.save_every and done % run.save_every == 0):
                path = save(done)
            if stop_signal or stop_reason:
                break
    metrics_f.close(); samples_f.close()
    timings["ppo"] = time.time() - t0
    if stop_signal:
        launcher = "deepspeed" if world > 1 else "python"
        print(f"[{interrupt.signal_name or 'signal on another rank'}] checkpoint written to {path}; continue with: "
              f"{launcher} train.py {' '.join(argv)} --resume {out}")
        raise SystemExit(0)
    if stop_reason and not alarm_info:  # non-finite values: stop with the last good checkpoint intact
        print(f"error: stopped: {stop_reason}", file=sys.stderr)
        raise SystemExit(1)
    if not stop_reason and (not run.save_every or run.steps % run.save_every):
        save(run.steps)
    if not main_rank:  # rank 0 alone saves the final models, evaluates and writes the summary
        return None
    unwrap(policy).save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    unwrap(critic).save_pretrained(out / "critic")

    # final evaluation on held-out prompts, sampled as the paper evaluates
    t0 = time.time()
    sft = AutoModelForCausalLM.from_pretrained(base / "sft").to(device).eval() if base else ref
    heldout = [r["prompt"] for r in data["prompts_heldout"]]
    report = evaluation.compare(unwrap(policy).eval(), sft, ref, reward_model, tokenizer, heldout, run.eval_samples,
                                seed=run.seed, max_new_tokens=cfg.max_new_tokens,
                                judge=gold_judge or evaluation.rm_judge(reward_model, tokenizer))
    timings["eval"] = time.time() - t0
    peak = max(history, key=lambda h: h["reward/gold"]) if gold_judge else None
    summary = {
        "preset": run.preset, "seed": run.seed, "steps": run.steps, "seconds": time.time() - t_start,
        "config": dataclasses.asdict(cfg), "base": str(base) if base else None, "timings": timings,
        **({"rm": {"accuracy": json.loads((base / "rm_log.json").read_text())[-1]["heldout_accuracy"],
                   **({"length_slope": bias["rm_slope"], "gold_length_slope": bias["gold_slope"]} if bias else {})}}
           if base else {"models": dirs}),
        "sft": report["sft"], "final": report["policy"],
        "peak": {"gold_reward": peak["reward/gold"], "step": peak["step"]} if peak else None,
        "win_rate_vs_sft": report["win_rate"], "judge": "gold" if gold_judge else "reward model",
        "collapse_alarm": alarm_info, "stopped": stop_reason,
    }
    if run.data and base:
        summary["data"] = json.loads((base / "data_report.json").read_text())
    write_json(out / "summary.json", summary)
    print(evaluation.format_table(summary))
    print("stage seconds: " + "  ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    if run.data and base:
        print(f"[data] {run.data}: {summary['data']['summary']}")
    return summary


def _accelerator_bf16() -> bool:
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_bf16_supported())


if __name__ == "__main__":
    from data import cli_guard  # bad --data input: one line naming file, line and problem; exit 2
    cli_guard(main)()
