"""The run around the stages (skip on a first reading): start-up, the PPO stage's models and judge, the loop's state
and its plumbing, the evaluation and summary, resume, and the other methods' stage. Nothing here changes what is
trained; train.py calls each piece once, by name.

Implements (no equation):
    start(argv)                → flags checked, real models and data read once, --out made, processes started
    Models, load_models(...)   → PPO's four models (policy and critic trained; reference and reward model frozen)
    Judge, make_judge(...)     → gold in the synthetic world, a held-out reward model on real data
    LoopState                  → what a resumed run restores besides weights: moments, η, the alarm, the guard
    LoopPlumbing               → the loop's three plumbing calls: steps(), skip(), end_step()
    critic_stage(...)          → stage 3's call and its log
    evaluate(...), write_summary(...)  → the held-out comparison with SFT, summary.json
    other_method(...)          → --method dpo | best-of-n in the place of stages 3-4
"""
from __future__ import annotations

import copy
import functools
import dataclasses
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import best_of_n
import dpo
import eval as evaluation
import ppo_max
import toy_world
from plumbing import checkpoint, cli, data, engine, flags, models, lora
from plumbing import monitor as collapse
from plumbing.monitor import LoopPlumbing, LoopState
from plumbing.cli import fail
from plumbing.config import DPOConfig, PPOConfig, RunConfig
from plumbing.pipeline import (Inputs, check_models, fit_context, last_stage, load_lm, ppo_inputs, preference_pairs,
                               real_model_records, real_model_stages, resolve_real_models, stage_ds, stage_records,
                               stop_after_stages, use_bf16, write_json, write_stage_records, closing_data_line)
from reward_model import ScalarHeadModel


# =========================================================================================================
# Start-up and stages 1-2
# =========================================================================================================
@dataclass
class Setup:
    """What start() settled, passed to every later piece: the configurations, the real models' directories (None in
    the synthetic world and with --data alone), the run's directory, this process's rank, the number of ranks and
    its device; `done` and `result` once a --stages list ends the run early."""
    argv: list[str]
    run: RunConfig
    sft: object                     # config.SFTConfig
    rm: object                      # config.RMConfig
    ppo: PPOConfig
    world_cfg: object               # toy_world.WorldConfig
    dpo: DPOConfig
    dirs: dict | None
    out: Path
    rank: int
    world: int
    device: torch.device
    t_start: float = 0.0
    timings: dict = dataclasses.field(default_factory=dict)
    records: dict | None = None     # a real model's split of --data (pipeline.run_records)
    inp: Inputs | None = None       # what the PPO stage reads (pipeline.ppo_inputs)
    judge: "Judge | None" = None
    logs: tuple = dataclasses.field(default_factory=lambda: ([], []))  # a resumed run's earlier metrics.jsonl
    # and samples.jsonl rows
    done: bool = False
    result: dict | None = None
    lock: "OutLock | None" = None   # this run's hold on --out (hold_out_dir), let go of when the Setup goes


def start(argv: list[str]) -> Setup:
    """Every flag and combination checked (plumbing/flags.py), real models resolved and read, the data files read
    once, --out made, probed and held (one run per folder: hold_out_dir), the processes started, a run that --out
    holds refused (replaced with --overwrite; the default --out moves to the next free folder), the run's record
    written and its start-up line printed: all before any stage trains."""
    command = list(argv)
    argv, run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg = flags.configure(argv)  # with --resume: the recorded flags
    run = free_default_out(run, argv)  # the default --out holds a run: the next free one
    dirs = resolve_real_models(run, cfg) if run.model != "tiny" else None  # fails at once, before anything loads
    if dirs:  # every id of the tokenizer must have an embedding, every text a stage builds fit every model's positions
        check_models(dirs)
        run, cfg = fit_context(run, cfg, dirs)
    flags.check_data_files(run)
    flags.check_lora(run, sft_cfg, dirs)
    out = make_out_dir(run)
    lock = hold_out_dir(out)
    rank, world, device = start_processes(run, cfg)
    if not keeps_earlier_run(run, out):   # --stages sft[,rm] beside a run in --out leaves that run as it is
        replace_earlier_run(run, out, rank)
        if rank == 0:  # --resume DIR alone continues from this record
            flags.write_record(out, argv, run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg)
    print(flags.startup_line(run, (run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg)))
    # Ctrl-C or SIGTERM before the PPO loop: one line, what is kept, and this command, which continues from it
    cli.interrupt_note(during="the start-up", kept="nothing of this run yet",
                       again=f"{'deepspeed' if world > 1 else 'python'} train.py {shlex.join(command)}".rstrip())
    return Setup(argv, run, sft_cfg, rm_cfg, cfg, world_cfg, dpo_cfg, dirs, out, rank, world, device, time.time(),
                 lock=lock)


def stages_1_2(s: Setup) -> Inputs | None:
    """Stages 1-2: a real model's SFT and reward model trained into --out (or given), or the synthetic world's (and
    --data's) cached base; then what the PPO stage reads (pipeline.ppo_inputs). None, with s.done, when --stages
    ends the run after sft or rm."""
    if s.dirs:  # one split of --data for every stage (pipeline.run_records); the tiny model's: in the cached base
        cli.interrupt_note(during=f"stages 1-2 of {s.run.model}",
                           kept=f"each stage finished in {s.out} (sft/, reward_model/: a rerun reuses them)")
        s.records = real_model_records(s.run, s.dirs)
        if s.rank == 0 and not keeps_earlier_run(s.run, s.out):  # records.json: what each stage reads, up front
            write_stage_records(s.out, stage_records(s.records, s.run, s.ppo))
        s.dirs = real_model_stages(s.run, s.ppo, s.sft, s.rm, s.dirs, s.rank, s.world, s.device, s.timings, s.records)
    if last_stage(s.run) in ("sft", "rm"):
        s.done, s.result = True, stop_after_stages(s.run, s.sft, s.rm, s.world_cfg, s.dirs, s.rank,
                                                   None if keeps_earlier_run(s.run, s.out) else s.ppo)
        return None
    inp = ppo_inputs(s.run, s.ppo, s.sft, s.rm, s.world_cfg, s.dirs, s.rank == 0, s.records)
    inp.timings.update(s.timings)
    s.inp = inp
    return inp


def ppo_setup(s: Setup, inp: Inputs) -> tuple["Models", data.RolloutBatches, "LoopState",
                                                checkpoint.RunCheckpoints]:
    """Stages 3-4's inputs: the four models (load_models), the judge (s.judge), the prompt and ptx streams of the
    training split (as records.json lists them), the loop's state and the run's checkpoints."""
    if s.ppo.ptx_coef and not inp.rows["ptx"]:
        print("[ptx] no SFT text (--prompts only): the ptx term (Eq. 17) is off; pass --data pairs to keep it")
        s.ppo = dataclasses.replace(s.ppo, ptx_coef=0.0)
    checkpoint.seed_everything(s.run.seed + s.rank)  # rank r samples its own stream; rank 0's: the one-process one
    m = load_models(inp, s.run, s.ppo, s.device, deepspeed_config(s.run, s.ppo, s.world, s.device))
    s.judge = make_judge(inp, not (s.run.data or s.dirs), m.bf16, s.device, lora.quantization(s.run),  # gold
                         m.frozen_ds, world=s.run.world)
    batches = data.RolloutBatches([r["prompt"] for r in inp.rows["ppo"]],
                                  [(r["prompt"], r["response"]) for r in inp.rows["ptx"]], inp.tokenizer,
                                  seed=s.run.seed, rank=s.rank, world=s.world, device=s.device)
    state = new_state(s.run, s.ppo)
    s.timings = dict(inp.timings)
    ckpts = run_checkpoints(m, s.out, batches, s.run, s.rank)
    if s.world == 1:  # a disk without room for one checkpoint: one line now, not after every step has run
        checkpoint.check_room(s.out, ckpts.models, ckpts.optimizers, hint="free some space or pass another --out "
                              "(stages 1-2 are cached: a rerun starts from them)")
    return m, batches, state, ckpts


def resume(s: Setup, ckpts: checkpoint.RunCheckpoints, state: "LoopState") -> int:
    """--resume: the newest intact checkpoint restored into the models, optimizers, RNG streams and `state`; its
    step is returned, and the metrics.jsonl and samples.jsonl rows of the steps before it kept in s.logs."""
    try:
        ckpt, saved = ckpts.resume(s.run.resume)
    except ValueError as e:
        fail(str(e))
    state.load_state_dict(saved["extra_state"])
    print(f"[resume] {ckpt}: continuing at step {saved['step']}")
    if saved["step"] >= s.run.steps:
        print(f"[resume] the run has {saved['step']} steps and --steps is {s.run.steps}: no step left to train, "
              f"only the evaluation (a larger --steps continues the run)")
    step, logs = saved["step"], [s.out / "metrics.jsonl", s.out / "samples.jsonl"]
    metrics, samples = (data.read_records(f) if f.is_file() else [] for f in logs)
    s.logs = (metrics[:step], [x for x in samples if x["step"] < step])
    return step


def critic_stage(s: Setup, m: "Models", batches: data.RolloutBatches, state: "LoopState") -> int:
    """Stage 3, critic pre-training (§5.3.3): ppo_max.pretrain_critic, timed, its log in critic_pretrain.json; nothing
    (and no line) without a critic, without `critic` in --stages or with --critic-pretrain-steps 0. With --stages
    ending in critic, the pre-trained critic is saved as the run's result (s.done). Returns PPO's first step, 0."""
    cfg, tokenizer = s.ppo, batches.tokenizer
    if m.critic is None or "critic" not in s.run.stages.split(","):  # a critic-free --advantage has no stage 3
        return 0
    if cfg.critic_pretrain_steps:
        cli.interrupt_note(during="stage 3 (critic pre-training)")
        t0 = time.time()
        critic_log = ppo_max.pretrain_critic(
            m.policy, m.ref, m.reward_model, m.critic, m.critic_opt, state.moments,
            lambda: batches.prompts(cfg.rollout_batch, cfg.group_size), cfg, data.stop_id(tokenizer),
            tokenizer.pad_token_id, state.kl_ctl.value,
            progress=lambda r: collapse.progress(r, "3. critic pre-training", leave=False, disable=s.rank != 0))
        s.timings["critic_pretrain"] = time.time() - t0
        print(f"[3. critic pre-training] {s.timings['critic_pretrain']:.1f} s")
        if s.rank == 0:
            write_json(s.out / "critic_pretrain.json", critic_log)
    if last_stage(s.run) == "critic":  # --stages ...,critic: the pre-trained critic is the result
        if s.rank == 0:
            lora.save(m.critic, s.out / "critic", tokenizer, s.inp.critic)
            print(f"[stages] {s.run.stages}: the pre-trained critic is in {s.out / 'critic'}")
        s.done, s.result = True, {"stages": s.run.stages, "critic": str(s.out / "critic")}
    return 0


def run_checkpoints(m: Models, out: Path, batches: data.RolloutBatches, run: RunConfig,
                    rank: int) -> checkpoint.RunCheckpoints:
    """The run's checkpoints: what trains (the policy, and the critic when there is one) with its optimizer, and the
    prompt stream; a critic-free run checkpoints no critic."""
    trained = {k: v for k, v in {"policy": (m.policy, m.policy_opt), "critic": (m.critic, m.critic_opt)}.items()
               if v[0] is not None}
    return checkpoint.RunCheckpoints(out, {k: v[0] for k, v in trained.items()}, {k: v[1] for k, v in trained.items()},
                                     {"prompt": batches.rng}, batches.tokenizer, run.keep_last, rank, engine.barrier)


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



def keeps_earlier_run(run: RunConfig, out: Path) -> bool:
    """True when this run trains no PPO (--stages ending at sft or rm) and --out holds a run (its summary or
    checkpoints): such a run only builds stages 1-2 (the synthetic world's into the cached base), so the earlier
    run, its checkpoints, summary and record (run_config.json, records.json) stay as they are."""
    holds = (out / "summary.json").is_file() or any((out / checkpoint.CKPT_SUBDIR).glob("step-*"))
    return last_stage(run) in ("sft", "rm") and not run.resume and holds


def replace_earlier_run(run: RunConfig, out: Path, rank: int) -> None:
    """A new run (no --resume) in a directory that holds an earlier run (checkpoint.held_run: its summary or its PPO
    checkpoints) stops with one line, exit 2, naming the folder and the ways on (--out NEW, --overwrite; --resume for
    an unfinished one): a finished run is never replaced silently. With --overwrite its checkpoints and summary are
    removed, so that a later --resume can only continue this run."""
    held = None if run.resume else checkpoint.held_run(out)
    if held is None:
        return
    if not run.overwrite:
        again = f"--resume {out} continues it, " if "unfinished" in held else ""
        fail(f"--out {out} holds {held}: {again}--out NEW starts this run in another folder, --overwrite replaces it")
    if rank == 0:
        print(f"[out] --overwrite: {out} held {held}; this run replaces it (its checkpoints and summary are removed)")
        shutil.rmtree(out / checkpoint.CKPT_SUBDIR, ignore_errors=True)
        (out / "summary.json").unlink(missing_ok=True)  # until this run writes its own, it holds no finished run
    engine.barrier()


def free_default_out(run: RunConfig, argv: list[str]) -> RunConfig:
    """The default --out (no --out given, no --resume) when it holds a run (checkpoint.held_run): the next free
    runs/<name>-2, -3, ..., said in one line, so that a command run twice never needs --overwrite; a --out given
    is the user's choice, refused in replace_earlier_run when it holds a run."""
    if run.resume or run.overwrite or last_stage(run) in ("sft", "rm") or "out" in flags.given_flags(argv) \
            or checkpoint.held_run(run.out) is None:  # (--stages sft[,rm] leaves the run there as it is)
        return run
    n = 2
    while checkpoint.held_run(f"{run.out}-{n}") is not None:
        n += 1
    print(f"[out] {run.out} holds {checkpoint.held_run(run.out)}: this run writes {run.out}-{n} "
          f"(--out names the folder; --overwrite replaces that run)")
    return dataclasses.replace(run, out=f"{run.out}-{n}")


OUT_LOCK = ".run.lock"  # in --out: the file a live run holds locked (hold_out_dir)


class OutLock:
    """An exclusive flock on <out>/.run.lock, with the holder's pid, host and command written in it for the run it
    turns away. The kernel lets go of it when its file closes: release(), this object's end (the run's Setup that
    holds it is gone), or the process's, even by SIGKILL."""

    held: "weakref.WeakSet[OutLock]" = weakref.WeakSet()  # this process's, at most one: the latest start()'s

    def __init__(self, path: Path, file):
        self.path, self.file = path, file
        OutLock.held.add(self)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __del__(self):
        self.release()


def holder(text: str) -> str:
    """The process named in a lock file's text, as `pid N: its command line` (`pid N on HOST: …` when another
    machine holds it), the live process's own command line when this machine can read it, on one line."""
    try:
        info = json.loads(text)
        pid, host, argv = int(info["pid"]), str(info["host"]), [str(a) for a in info["argv"]]
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
    if host == socket.gethostname():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
        except OSError:
            pass
    command = " ".join(" ".join(argv).split())  # one line, whatever its arguments hold (python -c "…")
    return f"pid {pid}{'' if host == socket.gethostname() else f' on {host}'}: {command[:200]}"


def hold_out_dir(out: Path) -> OutLock | None:
    """One run per output folder: the exclusive lock on <out>/.run.lock (OutLock), taken without waiting. Held, a
    second run on the same --out stops here with one line naming the process that holds it, exit 2, before it writes
    anything there; a killed run's lock goes with it, so it never blocks its own --resume. Under the `deepspeed`
    launcher every rank of one run shares --out, and rank 0 (the launcher's RANK) holds it for them all: a second
    launch's rank 0 is turned away and the launcher then stops its other ranks. A start() in a process that ran a run
    before (the tests, the notebooks' workers) first lets go of that run's lock. None where nothing is locked (ranks
    other than 0; Windows, without fcntl; a file system without locks, said in one line)."""
    for earlier in list(OutLock.held):
        earlier.release()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        import fcntl
    except ImportError:
        return None
    path = out / OUT_LOCK
    try:
        f = open(path, "a+")
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror or e})")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        text = f.read()
        f.close()
        fail(f"--out {out} is in use by another run ({holder(text)}); wait for it to end, or pass another --out")
    except OSError as e:  # e.g. ENOLCK on a network file system without locks
        f.close()
        print(f"[out] {path}: cannot be locked ({e.strerror or e}); nothing keeps a second run out of {out}")
        return None
    try:
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv}) + "\n")
        f.flush()
    except OSError:
        pass  # the lock holds without its note (a full disk); the run turned away names "a process"
    return OutLock(path, f)


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
    frozen_ds: dict | None = None  # the frozen models' ZeRO-3 inference config (--frozen-zero-stage 3), or None


def load_models(inp: Inputs, run: RunConfig, cfg: PPOConfig, device: torch.device, ds: dict | None) -> Models:
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
    load = lambda path: place(models.causal_lm_class(path).from_pretrained(path, **kw))  # noqa: E731 (Mllama, Emu3: plumbing/models.py)
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
                models.gradient_checkpointing(m)
    if lora.enabled(run):  # adapters (B = 0: the models start as their directories), dropout 0 as everywhere in PPO
        policy = lora.add_adapters(policy, run, seed=run.seed, dropout=0.0)
        ref = ref or lora.AdaptersOff(policy)
        if with_critic:
            reward_head = copy.deepcopy(critic.head)  # the reward model's own head; the critic's head trains
            critic = lora.add_adapters(critic, run, seed=run.seed + 1, dropout=0.0)
            reward_model = reward_model or lora.reward_beside_critic(critic, reward_head)
    for model in (policy, ref, reward_model, critic):  # ρ = 1 on the first minibatch needs a deterministic network
        if model is not None and not isinstance(model, lora.AdaptersOff):  # (the policy's and critic's own weights)
            models.disable_dropout(model)
    frozen_ds = frozen_config(run, ds, bf16)  # --frozen-zero-stage 3 / --frozen-offload: ZeRO-3 inference engines
    ref = ref if isinstance(ref, lora.AdaptersOff) else engine.frozen(ref, frozen_ds)
    reward_model = reward_model if lora.enabled(run) else engine.frozen(reward_model, frozen_ds)
    policy_opt = torch.optim.AdamW(engine.trainable(policy), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(engine.trainable(critic), lr=cfg.critic_lr, weight_decay=0.0) if critic else None
    if ds is not None:
        print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, policy and critic engines: "
              f"{json.dumps(ds)}")
        print("[deepspeed] reference, reward model and judge: inference only, " + (
            f"ZeRO-3 engines, their parameters partitioned over the {engine.world_size()} rank(s)"
            + (" and kept on the CPU (--frozen-offload)" if run.frozen_offload else "") + f": {json.dumps(frozen_ds)}"
            if frozen_ds else "replicated on every rank (if they do not fit: --frozen-zero-stage 3, --frozen-offload; "
                              "see --plan)"))
    if lora.enabled(run):
        critic_n = f" / critic {sum(p.numel() for p in engine.trainable(critic)):,}" if critic else ""
        print(f"[lora] r {run.lora_r}, α {run.lora_alpha:g}, targets {run.lora_targets}: policy "
              f"{sum(p.numel() for p in engine.trainable(policy)):,}{critic_n} "
              f"trainable parameters; reference = {'the policy with adapters off' if share_ref else inp.ref}, reward "
              f"model = {'the critic with adapters off' if share_rm else inp.reward}")
    if critic is None:
        print(f"[advantage {cfg.advantage}] no critic: not built, not pre-trained (stage 3), no value loss, not "
              f"checkpointed")
    policy, policy_opt = engine.wrap(policy, policy_opt, ds, cfg.policy_lr)
    if critic is not None:
        critic, critic_opt = engine.wrap(critic, critic_opt, ds, cfg.critic_lr)
    return Models(policy, ref, reward_model, critic, policy_opt, critic_opt, bf16, frozen_ds)


def frozen_config(run: RunConfig, ds: dict | None, bf16: bool) -> dict | None:
    """The frozen models' DeepSpeed JSON under --frozen-zero-stage 3 or --frozen-offload (with engines, full
    weights: flags.validate_launch refuses the rest), in the engines' dtype; None: a copy on every rank."""
    if ds is None or lora.enabled(run) or not (run.frozen_zero_stage == 3 or run.frozen_offload):
        return None
    from plumbing import scale
    return scale.inference_deepspeed_config(3, run.frozen_offload, bf16=bf16)


@dataclass
class Judge:
    """What decides "better" in the logs and the win rate, never optimised by PPO: the synthetic world's gold
    reward, or on real data a second reward model trained on pairs the proxy never saw."""
    name: str                                   # "gold" | "held-out reward model"
    key: str                                    # its metrics.jsonl key: "reward/gold" | "reward/judge"
    score: Callable                             # an eval.py judge: (prompts, texts, finished, ids, mask) → rewards
    model: object | None = None                 # the judge's reward model, if it is one


def make_judge(inp: Inputs, synthetic: bool, bf16: bool, device: torch.device, quantization: dict | None = None,
               frozen_ds: dict | None = None, world: str = "a") -> Judge | None:
    """Gold in the synthetic world; on real data the held-out reward model, one more frozen model (quantized like
    the others under --lora-bits; a ZeRO-3 engine like them with frozen_ds)."""
    if synthetic:
        return Judge("gold", "reward/gold", toy_world.world(world).gold_judge)  # --world's gold
    if not inp.judge:
        return None
    rm = ScalarHeadModel.from_pretrained(inp.judge, require_head=True, **({"torch_dtype": torch.bfloat16} if bf16 else {}),
                                         quantization=quantization)
    rm = models.disable_dropout(rm).eval().requires_grad_(False)
    rm = engine.frozen(rm if quantization else rm.to(device), frozen_ds)
    return Judge("held-out reward model", "reward/judge", evaluation.rm_judge(rm), rm)


def new_state(run: RunConfig, cfg: PPOConfig) -> LoopState:
    """A new run's loop state: Eq. 18's moments, η of Eq. 19, the §5.2 alarm and the non-finite guard."""
    return LoopState(ppo_max.RunningMoments(), ppo_max.AdaptiveKLController(cfg.kl_coef, cfg.kl_target,
                                                                              cfg.kl_horizon),
                     collapse.CollapseMonitor(kl_max=run.alarm_kl_max, patience=run.alarm_patience),
                     collapse.NonFiniteGuard(run.max_bad_steps, log=tqdm.write))


def loop(s: Setup, m: "Models", state: LoopState, ckpts: checkpoint.RunCheckpoints, inp: Inputs,
         start: int) -> LoopPlumbing:
    """Stage 4's plumbing (monitor.LoopPlumbing): the run's logs (metrics.jsonl, samples.jsonl, --log-with), the
    judge, the checkpoints and the held-out curve's point of a step (eval.heldout_point, --heldout-every)."""
    cli.interrupt_note(during="stage 4 (PPO)", kept=f"stages 1-2 (cached) and the PPO checkpoints in {s.out}",
                       again=f"{'deepspeed' if s.world > 1 else 'python'} train.py --resume {s.out}")
    log = collapse.RunLog(s.out, state.monitor, *s.logs, main_rank=s.rank == 0,
                          tracker=tracker(s.run, inp, s.out, s.rank))
    judge, proxy = s.judge, evaluation.rm_judge(m.reward_model)
    key = {"reward/gold": "heldout/gold", "reward/judge": "heldout/judge"}[judge.key] if judge else None
    heldout = functools.partial(evaluation.heldout_point, engine.unwrap(m.policy), m.ref, m.reward_model,
                                inp.tokenizer, [r["prompt"] for r in inp.rows["eval"]], s.run.heldout_samples,
                                10_007 * s.run.seed + 1, s.ppo.max_new_tokens, judge.score if judge else proxy, key)
    log.columns = trick_columns(s.ppo)
    print(step_line_legend(s.run, s.ppo, judge, [c[0] for c in log.columns]))
    return LoopPlumbing(s.run, log, state, ckpts, judge, m.policy_opt, inp.tokenizer, s.device, start,
                        s.ppo.group_size, heldout)


def trick_columns(cfg: PPOConfig) -> list[tuple[str, str, Callable, bool]]:
    """The step line's column for each newer trick the run enabled, its own engagement number: (label, metrics key,
    format, whether it is summed over the steps so far). The clip fraction of clip-higher, GSPO and CISPO (PPO-clip's
    own is always logged: the column appears when one of them changes what clips) and the tokens clip-higher frees,
    the groups dynamic sampling dropped (so far: a line every 10 steps would miss most), the share of responses the
    overlong shaping penalised, and the sampler's mismatch with the trainer."""
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    cols = []
    if cfg.clip_eps_high is not None or cfg.ratio == "sequence" or cfg.policy_loss == "cispo":
        cols.append(("clipped", "ppo/clipfrac", pct, False))
    if cfg.clip_eps_high is not None:
        cols.append(("freed by clip-higher", "ppo/clip_higher_frac", pct, False))
    if cfg.dynamic_sampling:
        cols.append(("groups dropped so far", "dynamic/dropped", lambda x: f"{x:.0f}", True))
    if cfg.overlong_buffer:
        cols.append(("overlong", "overlong/share", pct, False))
    if cfg.rollout_mismatch != "none" or cfg.rollout_correction != "none":
        cols.append(("mismatch |Δlogp|", "mismatch/mean_abs_logp_diff", lambda x: f"{x:.4f}", False))
    return cols


def step_line_legend(run: RunConfig, cfg: PPOConfig, judge: Judge | None, tricks: list[str]) -> str:
    """One line before the first step line: what its numbers are measured on. The step's own samples are the
    training samples (temperature cfg.temperature, nothing cut); the held-out curve samples the held-out prompts as
    the final evaluation does (eval.EVAL_SAMPLING), so only it is comparable with the final table."""
    name = "gold" if judge is None or judge.name == "gold" else "judge"
    ev = evaluation.EVAL_SAMPLING
    lines = [f"[4. PPO] step lines: score (proxy) and train {name}: the step's training samples (temperature "
             f"{cfg.temperature:g})"]
    if judge and run.heldout_every:
        lines.append(f"held-out {name}: the held-out prompts sampled as the final evaluation (top-p {ev['top_p']:g}, "
                     f"temperature {ev['temperature']:g}, {run.heldout_samples} per prompt), the curve's latest "
                     f"point (every {run.heldout_every} steps) and SFT's (step 0)")
    if tricks:
        lines.append(f"{', '.join(tricks)}: the enabled tricks' own numbers (docs/metrics.md)")
    return ";\n    ".join(lines)


def finish(s: Setup, loop: LoopPlumbing, m: "Models", ended: dict) -> dict | None:
    """After the loop: a signal exits 0 with its checkpoint written (--resume continues); non-finite values stop
    with the last good checkpoint intact (exit 1); else the final checkpoint, then rank 0 saves the final models,
    evaluates on the held-out prompts and writes summary.json (returned)."""
    if ended["signal"]:
        print(f"[{ended['signal']}] checkpoint written to {ended['path']}; continue with: "
              f"{'deepspeed' if s.world > 1 else 'python'} train.py --resume {s.out}")
        raise SystemExit(0)
    if ended["stop_reason"] and not loop.log.alarm_info:  # non-finite values: the last good checkpoint stays
        print(f"error: stopped: {ended['stop_reason']}", file=sys.stderr)
        raise SystemExit(1)
    if not ended["stop_reason"] and (not s.run.save_every or s.run.steps % s.run.save_every):
        loop.ckpts.save(s.run.steps, loop.state.state_dict())
    cli.interrupt_note(during="the final evaluation", kept=f"every PPO step, in {s.out / checkpoint.CKPT_SUBDIR}",
                       again=f"{'deepspeed' if s.world > 1 else 'python'} train.py --resume {s.out}")
    s.timings["ppo"] = loop.seconds
    if loop.debugged:
        print(f"[debugger] {loop.debugged:.1f} s of PPO steps under the debugger, not counted in its time")
    for trained in (m.policy, m.critic):  # under DeepSpeed: the engines destroyed, their hooks off, training is over
        engine.release(trained)
    # the optimizers (AdamW's two moments per trained weight) let go before the evaluation samples: every reference
    # to them (the models', the loop's, the checkpoints') dropped, their states are freed
    m.policy_opt = m.critic_opt = loop.policy_opt = None
    loop.ckpts.optimizers.clear()
    if m.frozen_ds:  # ZeRO-3 frozen models need every rank at each forward, and rank 0 evaluates alone: full copies
        engine.release_frozen()
        if s.rank == 0:
            unshard_frozen(s, m)
    engine.close_distributed()  # the last collective is behind us (under DeepSpeed)
    if s.rank != 0:  # rank 0 alone saves the final models, evaluates and writes the summary
        return None
    return write_summary(m, s.inp, s.run, s.ppo, loop.log, ended, s.timings, s.t_start, s.dirs, s.judge, s.device)


def unshard_frozen(s: Setup, m: Models) -> None:
    """Rank 0's final evaluation after a run with ZeRO-3 frozen models: the reference, the reward model and the judge
    loaded again from their directories, whole, on this rank (frozen: the same weights the engines held in parts)."""
    kw = {"torch_dtype": torch.bfloat16} if m.bf16 else {}
    ref = models.causal_lm_class(s.inp.ref).from_pretrained(s.inp.ref, **lora.load_kwargs(s.run, m.bf16))
    m.ref = models.disable_dropout(ref.to(s.device)).eval().requires_grad_(False)
    rm = ScalarHeadModel.from_pretrained(s.inp.reward, require_head=True, **kw)
    m.reward_model = models.disable_dropout(rm.to(s.device)).eval().requires_grad_(False)
    if s.judge is not None and s.judge.model is not None:
        s.judge = make_judge(s.inp, False, m.bf16, s.device)


def evaluate(m: Models, inp: Inputs, run: RunConfig, cfg: PPOConfig, history: list[dict],
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
    out = {"sft": report["sft"], "final": report["policy"],
           "peak": gold_peak(history, run) if judge and judge.name == "gold" else None,
           "win_rate_vs_sft": report["win_rate"], "judge": judge.name if judge else "reward model",
           "eval_sampling": {"samples": run.eval_samples, **evaluation.EVAL_SAMPLING}}
    if report.get("win_rates"):
        out["win_rate_vs_sft_by_judge"] = {out["judge"]: report["win_rate"], **report["win_rates"]}
        out["judge_model"] = str(inp.judge)
    if judge and judge.name != "gold" and (check := collapse.rm_check(Path(inp.judge))):  # monitor.judge_check
        out["judge_check"] = check
    # the policy as itself (temperature 1): gold and proxy against d = √KL(π ‖ π_SFT), the over-optimisation curve
    out["frontier"] = evaluation.frontier_point(engine.unwrap(m.policy).eval(), sft_model, m.reward_model,
                                                inp.tokenizer, heldout, run.eval_samples, run.seed + 1,
                                                cfg.max_new_tokens, judge.score if judge else proxy)
    if judge and judge.name == "gold":  # the alignment tax: pre-training text none of the stages trained on
        texts = toy_world.world(run.world).heldout_pretraining_text(heldout, run.seed)
        out["pretrain_text"] = {"policy_ppl": evaluation.text_perplexity(engine.unwrap(m.policy), inp.tokenizer, texts),
                                "sft_ppl": evaluation.text_perplexity(sft_model, inp.tokenizer, texts),
                                "texts": len(texts)}
    return out


def gold_peak(history: list[dict], run: RunConfig) -> dict | None:
    """The run's best gold along the way: the held-out curve's peak (sampled as the final evaluation, beside its
    step-0 point, the SFT policy); without a curve (--heldout-every 0), the training samples' gold as a mean of 10
    steps (one batch's gold is noisy), at the last step of its window."""
    curve = [h for h in history if h.get("heldout/gold") is not None]
    if curve:
        peak = max(curve, key=lambda h: h["heldout/gold"])
        return {"gold_reward": peak["heldout/gold"], "step": peak["step"], "curve": "held-out",
                "samples": run.heldout_samples, "every": run.heldout_every,
                "sft": curve[0]["heldout/gold"] if curve[0]["step"] == 0 else None}
    gold = [(h["step"], h["reward/gold"]) for h in history if h.get("reward/gold") is not None]
    if not gold:
        return None
    w = min(10, len(gold))
    means = [(gold[i][0], sum(g for _, g in gold[i - w + 1:i + 1]) / w) for i in range(w - 1, len(gold))]
    step, value = max(means, key=lambda x: x[1])
    return {"gold_reward": value, "step": step, "curve": "training", "smoothing": f"mean of {w} steps"}


def base_summary(inp: Inputs, run: RunConfig, dirs: dict | None) -> dict:
    """What summary.json says of stages 1-2: the RM's held-out accuracy (and length bias), or the given models."""
    dirs = {k: str(v) if v else None for k, v in (dirs or {}).items()}
    rm_log = (inp.base or Path(inp.reward)) / "rm_log.json"  # a real model's stage 2 keeps it in reward_model/
    if not rm_log.is_file():
        return {"models": dirs}
    rm = {"accuracy": json.loads(rm_log.read_text())[-1]["heldout_accuracy"]}
    if check := collapse.rm_check(rm_log.parent):  # whether it could judge a win rate (monitor.judge_check)
        rm["check"] = check
    if not inp.base:
        return {"models": dirs, "rm": rm}
    if not run.data:  # world B: the slopes per praise phrase (eval.length_bias), under the same keys
        bias = json.loads((inp.base / "rm_length_bias.json").read_text())
        rm.update(length_slope=bias["rm_slope"], gold_length_slope=bias["gold_slope"])
        return {"rm": rm, "world": run.world}
    return {"rm": rm}



def start_processes(run: RunConfig, cfg: PPOConfig) -> tuple[int, int, torch.device]:
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


def deepspeed_config(run: RunConfig, cfg: PPOConfig, world: int, device: torch.device) -> dict | None:
    """The engines' DeepSpeed JSON under the launcher or --deepspeed (None otherwise). It decides the dtype of the
    engines, and so of the frozen models beside them: bf16 where the accelerator has it, unless --fp32."""
    if not (run.deepspeed or world > 1):
        return None
    try:
        return engine.engine_config(run.deepspeed_config, run.zero_stage, use_bf16(run, device), cfg.minibatch // world,
                                    cfg.grad_clip)
    except engine.ConfigError as e:
        fail(str(e))




def write_summary(m: Models, inp: Inputs, run: RunConfig, cfg: PPOConfig, log: collapse.RunLog,
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
        print(closing_data_line(run.data, summary["data"]))
    return summary


def other_method(s: Setup, inp: Inputs) -> dict | None:
    """--method dpo (dpo.train_dpo on the reward model's own pairs, from the SFT model) or best-of-n (no training),
    then the held-out evaluation PPO gets: the same judge, prompts, sampling and summary.json layout."""
    run, cfg, dpo_cfg, dirs, rank, world, device = s.run, s.ppo, s.dpo, s.dirs, s.rank, s.world, s.device
    cli.interrupt_note(during=f"--method {run.method}")  # what is kept, and the rerun, as stages 1-2 left them
    checkpoint.seed_everything(run.seed + rank)
    out, timings, bf16 = Path(run.out), dict(inp.timings), use_bf16(run, device)
    head_kw = {"torch_dtype": torch.bfloat16} if bf16 else {}
    reward_model = models.disable_dropout(ScalarHeadModel.from_pretrained(inp.reward, require_head=True, **head_kw))
    reward_model = reward_model.eval().requires_grad_(False).to(device)
    sft = models.disable_dropout(models.causal_lm_class(inp.ref).from_pretrained(inp.ref, **lora.load_kwargs(None, bf16)))
    sft = sft.to(device).eval().requires_grad_(False)
    judge = make_judge(inp, not (run.data or dirs), bf16, device, lora.quantization(run), world=run.world)
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
                  "eval_sampling": {"samples": run.eval_samples, **evaluation.EVAL_SAMPLING},
                  **({"judge_check": check} if judge and judge.name != "gold"
                     and (check := collapse.rm_check(Path(inp.judge))) else {}),
                  "frontier": {"gold_reward": m_plain["gold_reward"], "reward": m_plain["reward"], "kl_seq": kl,
                               "d": kl ** 0.5, "response_length": m_plain["response_length"],
                               "samples": len(plain["texts"])}}
        config, budget = {"bon_n": run.bon_n, "max_new_tokens": cfg.max_new_tokens}, {
            "policy_samples": 0, "preference_pairs": 0, "samples_per_response": run.bon_n}
    timings["eval"] = time.time() - t0
    summary = {"method": run.method, "preset": run.method, "seed": run.seed, "steps": 0,
               "seconds": time.time() - s.t_start, "config": config, "base": str(inp.base) if inp.base else None,
               "timings": timings, **base_summary(inp, run, dirs), **report, "budget": budget}
    write_json(out / "summary.json", summary)
    print(evaluation.format_table(summary))
    print("stage seconds: " + "  ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return summary
