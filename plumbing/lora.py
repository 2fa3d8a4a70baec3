"""LoRA on one GPU: low-rank adapters (through peft) instead of full weights, in every stage that trains a model.

Implements (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Eq. 3 there):
    h = W₀x + (α/r)·B·A·x          W₀ (d_out, d_in) frozen; A (r, d_in), B (d_out, r) trained; B = 0 at the start,
                                   so an adapted model starts as exactly its base model
    target_modules(type, spec)     which Linear layers get adapters: 'auto' (peft's per-architecture default, e.g.
                                   q_proj,v_proj for LLaMA, c_attn for GPT-2), 'all-linear', or a list of names
    add_adapters(model, run, seed) a causal LM → peft.PeftModel; a ScalarHeadModel → its LM wrapped, its head trained
    adapters_off(model) / AdaptersOff
                                   the base model under the adapters, with no second copy in memory: the PPO
                                   reference is the policy with its adapters off, the reward model is the critic's
                                   backbone with the critic's adapters off (when the critic starts from it)
    count_trainable(config, r, spec, heads)
                                   the trainable parameters, Σ over adapted layers r·(d_in + d_out), counted on a
                                   meta-device copy of the architecture (no weights); what --plan reports
    save(model, out_dir, tokenizer, base)
                                   a stage's result: the adapters in peft's format in out_dir/adapter/, and the
                                   merged model in out_dir/ itself, a plain Hugging Face directory any tool loads
    merge(adapter_dir, out_dir)    W = W₀ + (α/r)·B·A written out (also `python -m plumbing.lora merge`)
    load_kwargs(run, bf16)         from_pretrained's keywords for a frozen base: bf16 / as saved, or 8-bit / 4-bit
                                   (bitsandbytes, CUDA only; check_bits says so on any other machine)

Run: python train.py --lora-r 8                      (the synthetic world: stages 3-4 train adapters)
     python train.py --model DIR --data PAIRS --lora-r 16     (a real model: every stage trains adapters)
     python -m plumbing.lora merge runs/x/policy/adapter --out policy-merged   (an adapter → a plain HF directory)

In the synthetic world and with --data alone, stages 1-2 train a from-scratch tiny model, where adapters on random
weights would learn nothing useful; there LoRA applies to the critic and the policy. On a real (pretrained) --model
it applies to SFT, the reward model, the critic and the policy.

Dropout: --lora-dropout acts on the adapters' input in SFT and reward-model training only; PPO switches it off
with every other dropout (models.disable_dropout), since the ratio ρ must be exactly 1 on the first minibatch.

References: Hu et al. 2021 (LoRA); Dettmers et al. 2023 (QLoRA: 4-bit NF4 frozen weights); peft's documentation
(LoraConfig, PeftModel.disable_adapter, merge_and_unload); TRL's PPO with peft (reference = adapters off).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

ADAPTER_DIR = "adapter"           # a stage's adapters, in peft's format, inside the stage's directory
HEAD_FILES = ("value_head.safetensors", "value_head.json")   # reward_model.ScalarHeadModel's head


def enabled(run) -> bool:
    return getattr(run, "lora_r", 0) > 0


# ---------------------------------------------------------------------------------------------------------
# Which layers get adapters
# ---------------------------------------------------------------------------------------------------------
def target_modules(model_type: str, spec: str) -> list[str] | str:
    """--lora-targets as peft takes it: 'auto' is peft's own default for the architecture (the LoRA paper's
    choice: the attention query and value projections), or 'all-linear' where peft has none; 'all-linear' is every
    Linear layer but the output head; otherwise a comma-separated list of module names (matched as name suffixes)."""
    if spec == "auto":
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
        return list(DEFAULTS[model_type]) if model_type in DEFAULTS else "all-linear"
    if spec == "all-linear":
        return "all-linear"
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--lora-targets {spec!r}: expected 'auto', 'all-linear' or module names such as "
                         f"q_proj,v_proj")
    return names


def lora_config(run, model_type: str, dropout: float | None = None):
    """peft.LoraConfig from the --lora-* flags. lora_B starts at zero (peft's default), so the adapted model's
    first forward pass is its base model's, bit for bit."""
    from peft import LoraConfig
    return LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha,
                      lora_dropout=run.lora_dropout if dropout is None else dropout,
                      target_modules=target_modules(model_type, run.lora_targets), bias="none", task_type="CAUSAL_LM")


def _check_targets(model: torch.nn.Module, run, targets) -> None:
    """A name in --lora-targets that matches no Linear layer is a typo: one line listing the names there are."""
    if not isinstance(targets, list):
        return
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in linear]
    if missing:
        from plumbing.cli import fail
        fail(f"--lora-targets {run.lora_targets}: {', '.join(missing)} matches no linear layer of this "
             f"{model.config.model_type} model (its layers: {', '.join(sorted(linear))})")


def check_targets(config, run) -> None:
    """--lora-targets against the architecture of `config` (a meta-device copy: no weights, no time), before any
    stage runs."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _check_targets(model, run, target_modules(config.model_type, run.lora_targets))


def add_adapters(model, run, seed: int, dropout: float | None = None):
    """LoRA adapters on a causal LM (returns the peft.PeftModel) or on a ScalarHeadModel's LM (returns the same
    ScalarHeadModel, its `lm` now a PeftModel, its head trainable). Only adapters and the head require grad.
    lora_A is drawn with `seed` (the same on every rank, and torch's own stream is left where it was); lora_B = 0.
    `dropout` overrides --lora-dropout (PPO: 0)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    head_model = hasattr(model, "head") and hasattr(model, "lm")
    lm = model.lm if head_model else model
    targets = target_modules(lm.config.model_type, run.lora_targets)
    _check_targets(lm, run, targets)
    if run.lora_bits != 16:  # QLoRA: norms in fp32, inputs that carry gradients into checkpointed layers
        ckpt = getattr(lm, "is_activation_checkpointing", None)  # transformers ≥ 5 (is_gradient_checkpointing before)
        lm = prepare_model_for_kbit_training(lm, use_gradient_checkpointing=lm.is_gradient_checkpointing
                                             if ckpt is None else ckpt)
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads transformers' renamed is_gradient_checkpointing
        warnings.filterwarnings("ignore", "fan_in_fan_out")  # GPT-2's Conv1D stores W transposed: peft adapts itself
        torch.manual_seed(seed)
        peft_lm = get_peft_model(lm, lora_config(run, lm.config.model_type, dropout))
    if not head_model:
        return peft_lm
    model.lm = peft_lm
    model.head.requires_grad_(True)     # the reward model's r(x, y) head, the critic's V(s) head: trained in full
    if run.lora_bits != 16:             # prepare_model_for_kbit_training made the last norm, so the hidden state, fp32
        model.head.float()
    return model


def is_lora(model) -> bool:
    from peft import PeftModel
    model = getattr(model, "module", model)          # a DeepSpeed engine's module
    return isinstance(getattr(model, "lm", model), PeftModel)


def peft_model(model):
    """The PeftModel inside a (DeepSpeed-wrapped) causal LM or ScalarHeadModel."""
    model = getattr(model, "module", model)
    return getattr(model, "lm", model)


# ---------------------------------------------------------------------------------------------------------
# The base model under the adapters: the reference, and the reward model beside the critic
# ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def adapters_off(model):
    """Inside: `model` computes W₀x, its base model's function (peft's disable_adapter: the LoRA branch is skipped,
    not multiplied by zero, so the output is bit-identical to the base model's)."""
    with peft_model(model).disable_adapter():
        yield


class AdaptersOff:
    """A frozen model that is another model's base: calls, score() and generate() run `model` with its adapters
    off. Not a torch module on purpose: eval(), train() and requires_grad_() on it must never reach the shared
    weights of the model being trained (they belong to its trainer)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), adapters_off(self.model):
            return self.model(*args, **kwargs)

    def score(self, *args, **kwargs):
        with torch.no_grad(), adapters_off(self.model):
            return self.model.score(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with torch.no_grad(), adapters_off(self.model):
            return self.model.generate(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()

    def modules(self):
        return self.model.modules()

    @property
    def config(self):
        return self.model.config

    def eval(self) -> "AdaptersOff":
        return self

    def requires_grad_(self, flag: bool = True) -> "AdaptersOff":
        return self


def reward_beside_critic(critic, reward_head: torch.nn.Module):
    """The reward model r(x, y) as the critic's backbone with the critic's adapters off and the reward model's own
    frozen head: the critic starts as a copy of the reward model (PPO-max), so under LoRA both share one backbone."""
    dtype = next(critic.head.parameters()).dtype  # the critic's head reads the same hidden state
    head = reward_head.requires_grad_(False).to(dtype)
    reward_model = type(critic)(critic.lm, head=head,  # a ScalarHeadModel (reward_model.py) on the shared LM,
                                score_pad_id=critic.score_pad_id)  # reading its score where the reward model does
    reward_model._has_logits_to_keep = critic._has_logits_to_keep  # (PeftModel's own signature hides it)
    return AdaptersOff(reward_model)


# ---------------------------------------------------------------------------------------------------------
# Counting, without weights (what --plan reports)
# ---------------------------------------------------------------------------------------------------------
def count_trainable(config, r: int, spec: str = "auto", heads: int = 0) -> dict:
    """{"adapters", "heads", "base", "layers", "output_adapters", "output_layers"}: parameters of the adapters,
    Σ over adapted layers r·(d_in + d_out), counted on a meta-device copy of the architecture (shapes only: a 7B model
    costs no memory), matching names as peft does (suffixes; 'all-linear' = every Linear / Conv1D but the output
    head); plus `heads` scalar heads of hidden_size + 1 (the reward model's, the critic's); `base` = the
    architecture's own parameters. Each adapted layer holds two tensors, A and B. output_* are the adapters on the
    output head itself (only when named explicitly): the critic reads hidden states, so those never get a gradient."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = target_modules(config.model_type, spec)
    out_emb = model.get_output_embeddings()
    adapters, layers, out_adapters, out_layers = 0, 0, 0, 0
    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if not (isinstance(module, torch.nn.Linear) or conv1d) or (targets == "all-linear" and module is out_emb):
            continue
        if targets != "all-linear" and not any(name == t or name.endswith("." + t) for t in targets):
            continue
        d_in, d_out = (module.weight.shape if conv1d else module.weight.shape[::-1])  # Conv1D stores (in, out)
        adapters += r * (d_in + d_out)                        # A (r, d_in) + B (d_out, r)
        layers += 1
        if module is out_emb:
            out_adapters, out_layers = out_adapters + r * (d_in + d_out), out_layers + 1
    if not layers:
        raise ValueError(f"--lora-targets {spec}: matches no linear layer of this {config.model_type} model")
    base = sum(p.numel() for p in model.parameters())
    return {"adapters": adapters, "heads": heads * (config.hidden_size + 1), "base": base, "layers": layers,
            "output_adapters": out_adapters, "output_layers": out_layers}


# ---------------------------------------------------------------------------------------------------------
# Saving, merging, loading
# ---------------------------------------------------------------------------------------------------------
def save_adapter(model, out_dir, base_dir=None) -> Path:
    """The adapters in peft's format (adapter_config.json, adapter_model.safetensors) and, for a ScalarHeadModel,
    its head (value_head.*), in out_dir; adapter_config.json names `base_dir` (default: the directory the model was
    loaded from), made absolute, as the base model."""
    out_dir = Path(out_dir)
    pm = peft_model(model)
    config = pm.peft_config["default"]
    config.base_model_name_or_path = str(Path(base_dir or config.base_model_name_or_path).resolve())
    pm.save_pretrained(out_dir)
    m = getattr(model, "module", model)
    if hasattr(m, "save_head"):  # a ScalarHeadModel: its trained head beside the adapters
        m.save_head(out_dir)
    return out_dir


def merge(adapter_dir, out_dir, base_dir=None, dtype: torch.dtype | None = None) -> Path:
    """W = W₀ + (α/r)·B·A: the base model (adapter_config.json's, or `base_dir`) loaded from disk, the adapters
    merged in, written to out_dir as a plain Hugging Face directory (with the head: a ScalarHeadModel directory, as
    reward_model.py saves one), with the base's tokenizer. With `dtype` (the dtype the stage trained in, e.g. bf16)
    the merge is done in fp32 and the result written in `dtype`; without, in the base's dtype as saved."""
    from peft import PeftConfig, PeftModel

    from plumbing.models import causal_lm_class
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    base_dir = Path(base_dir or PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    lm = causal_lm_class(base_dir).from_pretrained(base_dir, trust_remote_code=False,
                                                   **({"dtype": torch.float32} if dtype else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads transformers' renamed is_gradient_checkpointing
        merged = PeftModel.from_pretrained(lm, adapter_dir).merge_and_unload()   # W₀ + (α/r)·B·A, layer by layer
    (merged.to(dtype) if dtype else merged).save_pretrained(out_dir, safe_serialization=True)
    for name in HEAD_FILES:  # a reward model's or critic's head is not an adapter: it is copied as it is
        if (adapter_dir / name).is_file():
            shutil.copyfile(adapter_dir / name, out_dir / name)
    with contextlib.suppress(OSError, ValueError):
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir


def save(model, out_dir, tokenizer, base_dir=None) -> None:
    """A trained stage's result in out_dir: without LoRA the model itself; with LoRA the adapters in
    out_dir/adapter/ (peft's format) and the merged model in out_dir/, so that the next stage, eval.py and any other
    tool read out_dir as one plain Hugging Face directory.
    Written into out_dir.tmp-<pid> and renamed into place, so that a reader never finds a half-written directory: a
    write that fails (a full disk) leaves an earlier out_dir as it was and no temporary directory, and raises
    cli.WriteFailed naming out_dir."""
    from plumbing import checkpoint
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    hint = "the run's checkpoints are intact" if (out_dir.parent / "checkpoints").is_dir() else ""
    for stale in [*out_dir.parent.glob(f"{out_dir.name}.tmp-*"), *out_dir.parent.glob(f"{out_dir.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # saves killed mid-way; one writer per folder, so none is live
    try:
        with checkpoint.writing(out_dir, hint=hint):
            _write(model, tmp, tokenizer, base_dir)
            checkpoint.fsync_tree(tmp)
            old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
            if out_dir.exists():  # saved again (a stage run twice on one folder): the old one aside first
                os.replace(out_dir, old)
            os.replace(tmp, out_dir)  # the atomic step: from here on out_dir is complete
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(model, out_dir: Path, tokenizer, base_dir) -> None:
    m = getattr(model, "module", model)
    if not is_lora(m):
        m.save_pretrained(out_dir)
    else:
        save_adapter(m, out_dir / ADAPTER_DIR, base_dir)
        quantized = getattr(m.config, "quantization_config", None) is not None
        frozen = next(p.dtype for n, p in m.named_parameters() if not p.requires_grad and p.is_floating_point())
        # written in the dtype the stage ran in (bf16 stays bf16, as without LoRA); 8-/4-bit: as the base was saved
        merge(out_dir / ADAPTER_DIR, out_dir, None, None if quantized else frozen)  # the base adapter/ names
    tokenizer.save_pretrained(out_dir)


def load_kwargs(run, bf16: bool) -> dict:
    """from_pretrained's keywords: the dtype, and under LoRA --lora-bits' quantization of the frozen base."""
    return {**({"dtype": torch.bfloat16} if bf16 else {}), **(quantization(run) if run is not None else {})}


def check_bits(run, device_type: str) -> None:
    """--lora-bits 8/4 loads the frozen weights through bitsandbytes, which needs a CUDA GPU (and the package): on
    any other machine, one line saying so, before any work."""
    if run.lora_bits == 16:
        return
    from plumbing.cli import fail
    if not run.lora_r:
        fail(f"--lora-bits {run.lora_bits}: quantized frozen weights are for LoRA; add --lora-r R (e.g. 16)")
    if device_type != "cuda":
        fail(f"--lora-bits {run.lora_bits}: {run.lora_bits}-bit frozen weights load through bitsandbytes, which needs "
             f"a CUDA GPU, and this machine has none; drop the flag here (`train.py --plan --lora-r R --lora-bits "
             f"{run.lora_bits}` shows what it saves on a GPU)")
    import importlib.util
    if importlib.util.find_spec("bitsandbytes") is None:
        fail(f"--lora-bits {run.lora_bits}: bitsandbytes is not installed (pip install bitsandbytes)")


def quantization(run) -> dict:
    """from_pretrained's keyword for --lora-bits: {} at 16 bits; NF4 with bf16 compute at 4 (QLoRA), int8 at 8."""
    if run.lora_bits == 16:
        return {}
    from transformers import BitsAndBytesConfig
    if run.lora_bits == 4:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
    else:
        q = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": q, "device_map": {"": torch.cuda.current_device()}}


# ---------------------------------------------------------------------------------------------------------
# Command line: merge an adapter directory (the trainable-parameter counts: `python -m plumbing.scale --lora-r R`)
# ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    from plumbing.cli import OneLineParser, fail
    p = OneLineParser(prog="lora.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="write an adapter directory merged into its base as a plain HF directory")
    m.add_argument("adapter", help="a directory with adapter_config.json (e.g. runs/x/policy/adapter)")
    m.add_argument("--out", required=True, help="where the merged model goes")
    m.add_argument("--base", default="", help="the base model directory (default: the one adapter_config.json names)")
    args = p.parse_args(argv)
    if args.cmd == "merge":  # the only command
        adapter = Path(args.adapter)
        if not (adapter / "adapter_config.json").is_file():
            fail(f"{adapter}: no adapter_config.json there (a LoRA stage writes its adapters to <stage>/adapter/)")
        try:
            named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        except (ValueError, AttributeError) as e:
            fail(f"{adapter / 'adapter_config.json'}: not a peft adapter config ({str(e).splitlines()[0]})")
        base = Path(args.base or named)
        if not str(base) or str(base) == ".":
            fail(f"{adapter / 'adapter_config.json'}: names no base model; pass --base DIR")
        if not (base / "config.json").is_file():
            fail(f"{base}: the base model is not there (no config.json); pass --base DIR")
        if Path(args.out).resolve() == base.resolve():
            fail(f"--out {args.out}: that is the base model's directory; choose another")
        tmp = Path(args.out + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        merge(adapter, tmp, base)
        shutil.rmtree(args.out, ignore_errors=True)
        tmp.rename(args.out)
        print(f"merged {adapter} into {base}: {args.out} (load it with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    from plumbing.cli import cli_guard
    cli_guard(main)()
