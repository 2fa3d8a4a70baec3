"""The plumbing every stage calls to run on one process or under `deepspeed`: set-up, wrap a model, step it, gather.

Implements (no equation: what lets the same stage function train the tiny world's model on a laptop and a 7B model
on 8 GPUs):
    setup_distributed(deepspeed)              → (rank, world size W, device); nothing initialised in one process
    engine_config(...) / wrap(model, opt, ..) → a DeepSpeed engine (ZeRO-2 by default, bf16 where the accelerator
                                                has it), or the model and its AdamW as they are
    backward_step(model, opt, loss, clip, ..) → backward, global gradient clip, optimizer step; a non-finite loss
                                                or gradient skips the step (a DeepSpeed engine does this itself)
    set_lr(opt, lr), cosine_lr(step, total, α) → the learning rate of every parameter group; the cosine schedule
    gather_batch / gather_list / all_mean / all_sum / any_rank / barrier
                                              → data parallelism: rank r of W holds rows r, r + W, … of the global
                                                batch (groups r, r + W, … with G responses per prompt); without
                                                torch.distributed every one is the identity
    alone()                                   → a block one rank runs while the others wait (the cached base)
    unwrap(model)                             → the Hugging Face model inside an engine (what save_pretrained needs)
    release(model)                            → the end of a stage: the engine destroyed, its hooks off the module
    frozen(model, ds)                         → a frozen model as a ZeRO-3 inference engine (--frozen-zero-stage 3,
                                                --frozen-offload): its parameters partitioned over the ranks
    in_micro_batches(n, fn, *args)            → fn over the rows of a batch, n at a time (--generate-batch)

Run: deepspeed --num_gpus 2 train.py ...      (on a CPU-only machine DeepSpeed picks its CPU accelerator and gloo)

References: DeepSpeed's `deepspeed.initialize` and ZeRO (Rajbhandari et al. 2020); nanoGPT's train.py (`if ddp:`).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


# ---------------------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------------------
def setup_distributed(deepspeed: bool = False) -> tuple[int, int, torch.device]:
    """(rank, world size W, device). Under the `deepspeed` launcher (WORLD_SIZE > 1) or with deepspeed=True:
    deepspeed.init_distributed() (gloo on DeepSpeed's CPU accelerator, nccl on GPUs). Otherwise (0, 1, cpu)
    and nothing is initialised: the single-process run of every test."""
    if not (deepspeed or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return 0, 1, torch.device("cpu")
    if "MASTER_PORT" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        os.environ["MASTER_PORT"] = str(free_port())  # a world of one: any free port, so two such runs can coexist
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)  # --deepspeed without the launcher: a world of one
    import logging
    import warnings

    import deepspeed as ds
    from deepspeed.accelerator import get_accelerator
    ds.utils.logger.setLevel(logging.WARNING)  # train.py prints its own config and one line per step
    # ZeRO's own all_gather_into_tensor calls: torch's deprecation notice, once per rank, is DeepSpeed's to act on
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    ds.init_distributed()
    if torch.distributed.get_world_size() > 1:
        atexit.register(remove_shm_buffer, torch.distributed.get_rank())
    accelerator, local_rank = get_accelerator(), int(os.environ["LOCAL_RANK"])
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    device = torch.device(accelerator.device_name(local_rank))
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def shm_buffer(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce creates for `rank` when every rank is on one machine
    (deepspeed/ops/csrc/cpu/comm/shm.cpp: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def remove_shm_buffer(rank: int) -> None:
    """At exit, each rank removes its own buffer (every peer mapped it at start-up, so the name is no longer
    needed). DeepSpeed never does: each 2-process CPU run left 2 × 66 MiB in /dev/shm, which is RAM, until reboot."""
    shm_buffer(rank).unlink(missing_ok=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator_bf16() -> bool:
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_bf16_supported())


class ConfigError(ValueError):
    """A DeepSpeed configuration the loop cannot use: train.py prints it as one line and exits 2."""


def engine_config(config_path: str, zero_stage: int, bf16: bool, micro_batch: int, grad_clip: float) -> dict:
    """DeepSpeed JSON of a trained model: the file at `config_path`, or scale.deepspeed_config from the flags (ZeRO
    stage, bf16, gradient_clipping). Either way one optimizer step is one micro batch of `micro_batch` sequences per
    rank: no gradient accumulation."""
    from plumbing import scale
    if config_path:
        try:
            ds = json.loads(Path(config_path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--deepspeed_config {config_path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config_path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    else:
        ds = scale.deepspeed_config(zero_stage=zero_stage, bf16=bf16, train_micro_batch_size_per_gpu=1,
                                    gradient_accumulation_steps=1, gradient_clipping=grad_clip)
    ds.pop("train_batch_size", None)
    ds.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1)
    if ds.get("zero_optimization", {}).get("stage", 0) not in (0, 1, 2):
        raise ConfigError("ZeRO-3 for the trained models is not wired in this loop (rollouts would need generate("
                          "synced_gpus=True) and rank 0's evaluation all ranks); use --zero-stage 0-2 (the paper: 2) "
                          "and, if they do not fit, optimizer offload in --deepspeed_config (see --plan)")
    return ds


def trainable(model) -> list[torch.nn.Parameter]:
    """What an optimizer steps: every parameter for full fine-tuning, the adapters (and head) under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def wrap(model, optimizer, ds: dict | None, lr: float):
    """One trained model, ready for its stage: (engine, its optimizer) from deepspeed.initialize when `ds` is a
    DeepSpeed config (with our AdamW, or with the JSON's own optimizer block, e.g. DeepSpeed's CPU Adam for offload,
    at this model's learning rate), else (model, optimizer) unchanged."""
    if ds is None:
        return model, optimizer
    import deepspeed

    if "optimizer" in ds:
        block = ds["optimizer"]
        ds = {**ds, "optimizer": {**block, "params": {**block.get("params", {}), "lr": lr}}}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model), config=ds)
    else:
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, opt


def is_engine(model) -> bool:
    return hasattr(model, "backward")  # a DeepSpeed engine (a torch module has no .backward)


def unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine (the model itself otherwise)."""
    return model.module if is_engine(model) else model


def release(model) -> None:
    """A stage's trained model after its last step: a DeepSpeed engine is destroyed (DeepSpeed keeps an engine, its
    optimizer states and gradient hooks alive until `destroy()`, and its forward hooks on the module keep it alive
    as long as the module lives, so the next stage would start with this one's memory still allocated) and the
    memory returned; the module inside stays as it is, and works without the engine. Nothing without DeepSpeed."""
    if is_engine(model):
        model.destroy()
        for hook in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
            if getattr(model, hook, None) is not None:  # the engine's hooks on the module reach back to the engine
                getattr(model, hook).remove()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_FROZEN: list = []  # the frozen models' ZeRO-3 engines, alive as long as their modules are used (release_frozen)


def frozen(model, ds: dict | None):
    """A frozen model (the reference, the scoring reward model, the judge) as a DeepSpeed ZeRO-3 inference engine
    when `ds` is one (scale.inference_deepspeed_config: stage 3, offload_param with --frozen-offload): its parameters
    are partitioned over the ranks (or kept on the CPU) and each layer's are gathered for its forward by the hooks
    ZeRO-3 puts on the module, so the module itself is returned and called as before; every rank must then run each
    forward of it together. The model itself when `ds` is None (a copy on every rank)."""
    if ds is None or model is None:
        return model
    import deepspeed
    eng, *_ = deepspeed.initialize(model=model, config=ds)
    _FROZEN.append(eng)
    return eng.module.eval()


def release_frozen() -> None:
    """The frozen ZeRO-3 engines let go (rank 0's final evaluation loads full copies instead: plumbing/run.py)."""
    for eng in _FROZEN:
        eng.destroy()
    _FROZEN.clear()
    gc.collect()


def in_micro_batches(n: int, fn, *args):
    """fn(*args) computed n rows at a time and concatenated along dim 0 (a tuple of results: each one); the
    arguments that are tensors with the batch's rows are split, the others passed as they are. n = 0 or n ≥ the
    batch: one call, fn(*args) itself. Each row's numbers do not depend on the others (dropout off, the rows of one
    padded batch), so the result is the whole batch's up to float rounding of the smaller matmuls."""
    rows = next(a.shape[0] for a in args if isinstance(a, Tensor))
    if not n or n >= rows:
        return fn(*args)
    parts = [fn(*(a[i:i + n] if isinstance(a, Tensor) and a.dim() and a.shape[0] == rows else a for a in args))
             for i in range(0, rows, n)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(list(x)) for x in zip(*parts))
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------------------
# One optimizer step
# ---------------------------------------------------------------------------------------------------------
def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def cosine_lr(step: int, total: int, base: float, warmup: int = 0) -> float:
    """α_step = α · ½(1 + cos(π · step / total)) after a linear warm-up (the SFT and reward-model schedules)."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total, 1)))


def backward_step(model, optimizer, loss: Tensor, grad_clip: float, name: str, nonfinite: list[str]) -> Tensor:
    """loss.backward(), global gradient-norm clip (0 = off), optimizer step, skipped (gradients dropped, `name`
    logged in `nonfinite`) when the loss or the gradient norm is NaN/inf. Returns the norm before clipping.

    A DeepSpeed engine does the same itself (engine_step). (ZeRO-0 has no overflow check: a non-finite step is
    logged there but reaches the weights.)
    """
    if is_engine(model):
        return engine_step(model, loss, name, nonfinite)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    for what, x in ((f"loss/{name}", loss), (f"grad/{name}_norm", grad_norm)):
        if not torch.isfinite(x).all():  # a NaN never reaches the weights
            nonfinite.append(what)
            optimizer.zero_grad()
            return grad_norm
    optimizer.step()
    return grad_norm


def engine_step(model, loss: Tensor, name: str, nonfinite: list[str]) -> Tensor:
    """backward_step for a DeepSpeed engine: engine.backward averages the gradients over the ranks (ZeRO-2:
    reduce-scatter), engine.step clips them to the config's gradient_clipping and steps, skipping (on every rank at
    once, ZeRO 1-2) a step whose gradients overflow; we only read the global norm."""
    model.backward(loss)
    zero0_norm = None if model.zero_optimization() else torch.nn.utils.get_total_norm(  # ZeRO-0 keeps none
        [p.grad for p in model.parameters() if p.grad is not None])
    model.step()
    grad_norm = torch.as_tensor(model.get_global_grad_norm() if zero0_norm is None else zero0_norm).float()
    for what, x in ((f"loss/{name}", loss), (f"grad/{name}_norm", grad_norm)):
        if not torch.isfinite(x).all():
            nonfinite.append(what)
    return grad_norm


# ---------------------------------------------------------------------------------------------------------
# Data parallelism (`deepspeed train.py`): rank r of W holds rows r, r + W, r + 2W, … of the global batch.
# Without torch.distributed (the single-process default) every helper below is the identity.
# ---------------------------------------------------------------------------------------------------------
_ALONE = [False]   # inside alone(): this process works as a world of one, whatever the process group says


def world_size() -> int:
    ok = torch.distributed.is_available() and torch.distributed.is_initialized() and not _ALONE[0]
    return torch.distributed.get_world_size() if ok else 1


def rank() -> int:
    ok = torch.distributed.is_available() and torch.distributed.is_initialized() and not _ALONE[0]
    return torch.distributed.get_rank() if ok else 0


@contextlib.contextmanager
def alone():
    """Work that one rank does while the others wait at a barrier (the synthetic world's stages 1-2, built once and
    cached): inside, world_size() is 1 and rank() 0, so its collectives (all_mean, all_sum) and its batches are
    this process's alone rather than waiting for ranks that are not there."""
    before, _ALONE[0] = _ALONE[0], True
    try:
        yield
    finally:
        _ALONE[0] = before


def gather_batch(x: Tensor, group: int = 1) -> Tensor:
    """Every rank's x (B, …) gathered into the global batch (W·B, …) in prompt order: with groups of `group` rows
    (G responses to one prompt, data.RolloutBatches), group r + W·j of the global batch is rank r's group j."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    blocks = [p.unflatten(0, (-1, group)) for p in parts]               # W × (B/G, G, …)
    return torch.stack(blocks, dim=1).flatten(0, 2)                     # (B/G, W, G, …) → (W·B, …)


def gather_list(xs: list, group: int = 1) -> list:
    """gather_batch for python lists (prompts, texts, gold rewards): the global batch in prompt order."""
    if world_size() == 1:
        return xs
    parts = [None] * world_size()
    torch.distributed.all_gather_object(parts, xs)
    blocks = [[p[i:i + group] for i in range(0, len(p), group)] for p in parts]  # W × [groups]
    return [x for row in zip(*blocks) for block in row for x in block]


def all_mean(stats: dict[str, float], device: torch.device | str = "cpu") -> dict[str, float]:
    """Each value averaged over the ranks (every rank has the same keys). Slices are equal, so a per-sequence mean
    becomes the global batch's mean; a token-level mean becomes the mean of the ranks' token means."""
    if world_size() == 1:
        return stats
    t = torch.tensor([float(v) for v in stats.values()], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return {k: v / world_size() for k, v in zip(stats, t.tolist())}


def all_sum(x: Tensor) -> Tensor:
    """x summed over the ranks, the same sum on every rank (critic_free.batch_whiten's global moments)."""
    if world_size() == 1:
        return x
    x = x.clone()
    torch.distributed.all_reduce(x)
    return x


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank when it is true on one: a rank that skips or stops alone would deadlock the others."""
    if world_size() == 1:
        return bool(flag)
    t = torch.tensor([float(bool(flag))], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def close_distributed() -> None:
    """Every rank of a multi-process run, after the last collective: leave the process group (gloo aborts now and then
    when a process exits with it still open: "terminate called without an active exception"). A world of one keeps
    its group: DeepSpeed caches it, and the next train.main in the same process (tools/gpu_check.py) reuses it."""
    if world_size() > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# What every supervised stage (SFT, the reward model, DPO) sets up before its first step
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Stage:
    """A supervised stage's moving parts: the model to call (its DeepSpeed engine under DeepSpeed), its optimizer,
    the seeded batches (row indices, then the collated tensors on the model's device), the number of steps, the
    device and this process's rank."""
    trained: torch.nn.Module
    opt: object
    batches: object
    steps: int
    device: torch.device
    rank: int


def supervised_stage(model, encoded: list, epochs: float, batch: int, lr: float, seed: int, collate, pad_id,
                     ds: dict | None) -> Stage:
    """The set-up SFT, the reward model and DPO share: epochs × len(encoded) / batch steps (at least one), dropout
    off for good (but --lora-dropout) so the same batch gives the same loss anywhere, AdamW (no weight decay) on what
    trains (under LoRA: the adapters, and a scalar head), the model wrapped into a DeepSpeed engine when `ds` is a
    config, and seeded epochs of batches, each rank taking its slice of every batch (data.minibatches)."""
    from plumbing import data
    from plumbing.models import disable_dropout
    steps = max(1, int(epochs * len(encoded) / batch))
    disable_dropout(model, keep="lora_dropout")
    opt = torch.optim.AdamW(trainable(model), lr=lr, weight_decay=0.0)
    trained, opt = wrap(model, opt, ds, lr)
    device = next(model.parameters()).device
    rank_, world = rank(), world_size()
    batches = data.minibatches(encoded, batch, steps, seed, collate, pad_id, device, rank_, world)
    return Stage(trained, opt, batches, steps, device, rank_)
