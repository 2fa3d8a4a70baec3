"""Running at real scale: name a model, count its parameters, and see PPO's GPU memory bill before launching.

Implements (no equation of Zheng et al. 2023 here: the paper reports only its set-up, "8 × A100-80GB,
ZeRO-2 and gradient checkpointing", section 5; this file turns that set-up into numbers):
    resolve_model(name)              --model: alias | hub id (local HF cache only, never the network) | local dir
    llama_config_numbers(name)       the LlamaConfig numbers, from the alias table or a config.json (no weights)
    llama_param_count(cfg)           N = V·h + ℓ·(h·a·d + 2·h·k·d + a·d·h + 3·h·i + 2·h) + h + V·h·[untied]: the
                                     worked example of what arch_numbers counts (tested equal for the aliases)
    arch_numbers(cfg)                N, t tensors, the output head, the quantizable weights and the widths of any
                                     causal LM transformers builds, counted on a meta-device copy (no weights)
    plan_memory(cfg, ...)            per-GPU bytes of PPO's models as train.py holds them (policy, critic,
                                     reference, reward model, judge): one process with torch AdamW (exact), or
                                     DeepSpeed under ZeRO-0/1/2/3 (the ZeRO formula); the phases of an iteration as
                                     train.py runs them; suggestions, each recomputed, when it does not fit
    format_plan(plan)                the table `python train.py --model llama-7b --plan` prints
    plan_memory(cfg, lora_r=R, ...)  with LoRA (lora.py): the frozen backbones train.load_models shares (bf16, 8 or 4
                                     bits) + fp32 adapters, n = lora_trainable(cfg, R, targets)
    plan_memory(cfg, critic=False)   without a critic: the critic-free estimators (GRPO, RLOO, ...)
    one_gpu_table(cfg, ...)          LoRA on one GPU: 24 / 48 / 80 GiB × frozen 16 / 8 / 4 bits, the peak stage's bytes
    deepspeed_config(...)            DeepSpeed JSON of a trained engine (paper preset = ds_config_zero2.json)
    inference_deepspeed_config(...)  DeepSpeed JSON of a frozen engine (reference, reward model)

Run: python -m plumbing.scale --model llama-7b [--num-gpus 8 --gpu-mem 80 --zero-stage 2 --micro-batch 4 ...]
     (defaults = the paper preset; prints the plan; `--ds-config` also prints the DeepSpeed JSON)
     python -m plumbing.scale --model llama-7b --num-gpus 1 --gpu-mem 24 --lora-r 16 [--lora-bits 4]   (one GPU, LoRA)

Symbols: N parameters, t parameter tensors, ℓ layers, h hidden size, i MLP size, a attention heads, k key/value heads
(GQA), d = h/a head size, V vocabulary, G GPUs, β bytes per number of the weights' dtype (2 for bf16), b micro batch,
B prompts per GPU per iteration (generated and scored at once), x ptx rows per GPU per step, L = P + T tokens of a
sequence (prompt + response).

The plan's static part is checked to the byte against a real run's tensors, its phases against the torch profiler,
on the CPU (tools/memory_check.py, docs/real-scale.md); no GPU has measured them yet.

References:
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
        (2 + 2 + 12 bytes per parameter for mixed-precision Adam; what stages 1/2/3 shard).
    Ren et al. 2021, "ZeRO-Offload" (optimizer states on the CPU).
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
        (activations of one layer: s·b·h·(34 + 5·a·s/h) bytes at 16 bits).
    Dao et al. 2022, "FlashAttention" (the a·s² attention matrices are never stored).
    Hu et al. 2021, "LoRA"; Dettmers et al. 2022, "LLM.int8()"; Dettmers et al. 2023, "QLoRA" (NF4, double
        quantization: 4.127 bits per weight).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

GiB = 2**30

# ---------------------------------------------------------------------------------------------------------
# Model names
# ---------------------------------------------------------------------------------------------------------
# --model takes an alias below, any hub id ("org/name", looked up in the local Hugging Face cache only), or a
# local directory holding config.json (+ weights). `tiny` is the synthetic model train.py builds and trains.
ALIASES: dict[str, str | None] = {
    "tiny": None,  # nothing to download: train.py trains it itself
    "llama-7b": "huggyllama/llama-7b",
    "llama-13b": "huggyllama/llama-13b",
}

# The LlamaConfig numbers of the aliases (Touvron et al. 2023, Table 2), so a plan needs no download.
LLAMA_CONFIGS: dict[str, dict[str, int | bool]] = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048,
                     tie_word_embeddings=False, head_dim=128),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, vocab_size=32000, max_position_embeddings=2048,
                      tie_word_embeddings=False, head_dim=128),
}


class ModelNotFound(FileNotFoundError):
    """--model names nothing usable on this machine; the message says what to do."""


def _download_hint(repo_id: str) -> str:
    return (f"download it with `hf download {repo_id}` (older huggingface_hub: `huggingface-cli download "
            f"{repo_id}`) on a machine with network and pass --model /path (the folder holding config.json), "
            f"or pass a local directory")


def resolve_model(name: str | None, *, cache_dir: str | Path | None = None) -> str | None:
    """Turn --model into a local directory holding config.json; None for `tiny` (train it yourself).

    Order: an existing path → used as is; an alias → its hub id; a hub id → the local Hugging Face cache
    (`cache_dir`, default $HF_HUB_CACHE), with local_files_only=True, so this never touches the network and
    returns at once. Anything else raises ModelNotFound saying what to do: never a silent fallback.
    """
    if name is None or name == "tiny":
        return None
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"--model {name}: {path} is a file; pass the directory that holds config.json")
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {name}: the directory {path.resolve()} has no config.json; a model "
                                f"directory needs config.json and its weights (*.safetensors)")
        return str(path.resolve())
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/"):
        raise ModelNotFound(f"--model {name}: no such directory ({path.absolute()}); pass a directory that holds config.json, "
                            f"a hub id, or one of the aliases {sorted(ALIASES)}")
    repo_id = ALIASES.get(name, name)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)  # no network, ever
    except HFValidationError:
        raise ModelNotFound(f"--model {name}: not an alias ({sorted(ALIASES)}), not an existing directory and "
                            f"not a valid hub id; pass a local directory that holds config.json") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        where = cache_dir or constants.HF_HUB_CACHE
        alias = f" (alias of {repo_id})" if repo_id != name else ""
        raise ModelNotFound(f"--model {name}{alias} is neither a local directory nor in the Hugging Face cache "
                            f"{where}, and runs never use the network: "
                            + _download_hint(repo_id)) from None
    if not (Path(folder) / "config.json").is_file():
        raise ModelNotFound(f"--model {name}: the cached snapshot {folder} has no config.json (incomplete "
                            f"download?); " + _download_hint(repo_id))
    return str(folder)


# ---------------------------------------------------------------------------------------------------------
# Config numbers and parameter count
# ---------------------------------------------------------------------------------------------------------
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def llama_config_numbers(name_or_path: str | Mapping[str, Any] | Any) -> dict[str, int | bool]:
    """The numbers a plan needs, from an alias (no download), a model directory / config.json, a hub id in
    the local cache, a dict, or a LlamaConfig. Reads config.json only; never loads weights.

    Keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads
    (absent → = heads, no GQA), vocab_size, max_position_embeddings, tie_word_embeddings (absent → False,
    LlamaConfig's default), head_dim (absent → hidden_size // heads).
    """
    source = "config"
    if isinstance(name_or_path, Mapping):
        raw = dict(name_or_path)
    elif not isinstance(name_or_path, (str, Path)):  # a transformers config object
        raw = {k: getattr(name_or_path, k, None) for k in (*_REQUIRED, "num_key_value_heads", "head_dim",
                                                            "max_position_embeddings", "tie_word_embeddings")}
    elif str(name_or_path) in LLAMA_CONFIGS:
        return dict(LLAMA_CONFIGS[str(name_or_path)])
    elif str(name_or_path) == "tiny":
        raise ValueError("llama_config_numbers: `tiny` is the synthetic model train.py builds; pass its "
                         "LlamaConfig (or a dict of its numbers) instead of the name")
    else:
        p = Path(name_or_path).expanduser()
        config_file = p if p.is_file() else Path(resolve_model(str(name_or_path))) / "config.json"
        source = str(config_file)
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}, line {e.lineno}: not valid JSON ({e.msg})") from None
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing}; a LLaMA-style config.json needs {list(_REQUIRED)}")
    h, a = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    return dict(
        hidden_size=h,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=a,
        num_key_value_heads=int(raw.get("num_key_value_heads") or a),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings") or False),
        head_dim=int(raw.get("head_dim") or h // a),
    )


def hf_config(name_or_path: str | Path):
    """A transformers config for an alias (its LlamaConfig numbers, no download), a model directory or a hub id in
    the local cache: what a meta-device copy of the architecture needs (lora.count_trainable). No weights."""
    if str(name_or_path) in LLAMA_CONFIGS:
        from transformers import LlamaConfig
        return LlamaConfig(**LLAMA_CONFIGS[str(name_or_path)])
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(resolve_model(str(name_or_path)), trust_remote_code=False)


def saved_dtype_bytes(name_or_path) -> int:
    """Bytes per weight as a model directory saved them (config.json's dtype / torch_dtype: what from_pretrained
    loads without a dtype): 4 for float32 or none stated, 2 for bfloat16 / float16. An alias: its hub config's
    float16, 2."""
    if str(name_or_path) in LLAMA_CONFIGS:
        return 2
    raw = json.loads((Path(resolve_model(str(name_or_path))) / "config.json").read_text())
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    return 4 if dtype.endswith("float32") else 2


def _layer_params(c: Mapping[str, Any]) -> int:
    """Parameters of one decoder layer (no biases, as in LLaMA: attention_bias = mlp_bias = False)."""
    h, i, a, k, d = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                     c["num_key_value_heads"], c["head_dim"])
    attn = h * a * d + 2 * h * k * d + a * d * h  # W_q (h → a·d), W_k and W_v (h → k·d, GQA), W_o (a·d → h)
    mlp = 3 * h * i                                # gate, up (h → i), down (i → h): SwiGLU
    return attn + mlp + 2 * h                      # + input and post-attention RMSNorm weights


def llama_param_count(cfg: Mapping[str, Any] | str | Any, *, value_head: bool = False) -> int:
    """N of LlamaForCausalLM by the formula at the top of this file, the worked example of what arch_numbers counts
    on the model itself (tests/test_scale.py checks both agree for the aliases). value_head=True: of
    LlamaForSequenceClassification with one label (the backbone plus a bias-free h → 1 `score` head, no lm_head)."""
    c = llama_config_numbers(cfg)
    h, V, n_layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    backbone = V * h + n_layers * _layer_params(c) + h  # embeddings + layers + final RMSNorm
    if value_head:
        return backbone + h
    return backbone + (0 if c["tie_word_embeddings"] else V * h)  # lm_head shares the embedding when tied


# ---------------------------------------------------------------------------------------------------------
# Counts from the model itself: a meta-device copy of the architecture (shapes only, no weights, no memory)
# ---------------------------------------------------------------------------------------------------------
_ARCH: dict[str, dict] = {}  # arch_numbers' counts, once per architecture


def model_config(cfg):
    """A transformers config for cfg: an alias (its LlamaConfig numbers, no download), a model directory or a hub id
    in the local cache, a dict of LlamaConfig numbers, or a transformers config (returned as it is)."""
    if isinstance(cfg, Mapping):
        from transformers import LlamaConfig
        return LlamaConfig(**llama_config_numbers(cfg))
    if isinstance(cfg, (str, Path)):
        if str(cfg) == "tiny":
            llama_config_numbers("tiny")  # raises: the synthetic model has no directory
        return hf_config(cfg)
    return cfg


def arch_numbers(cfg) -> dict:
    """What a plan needs of a causal LM, counted on a meta-device copy of its architecture (any model transformers'
    AutoModelForCausalLM builds: LLaMA, Qwen2, Mistral, GPT-2, GPT-NeoX, ...; shapes only, so a 70B model costs no
    memory and no time), once per architecture:
        n_params N, n_tensors t      the parameters (a tied output head once) and the parameter tensors
        output_params N_o, t_o       the output head's parameters and tensors when it is not tied (else 0)
        quantized Q                  the Linear / Conv1D weights but the output head's: what 8-/4-bit loading
                                     quantizes (biases, norms, embeddings and the output head stay unquantized)
        layer_params                 one decoder layer's parameters (ZeRO-3 gathers a layer at a time)
        hidden_size h, num_hidden_layers ℓ, num_attention_heads a, num_key_value_heads k (= a without GQA),
        head_dim d (= h/a unless the config says), vocab_size V, tie_word_embeddings, model_type
    cfg: what model_config takes; a dict these numbers came from is returned as it is."""
    if isinstance(cfg, Mapping) and "n_params" in cfg:
        return dict(cfg)
    config = model_config(cfg)
    key = config.to_json_string(use_diff=False)
    if key not in _ARCH:
        import copy

        import torch
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):  # from_config writes its dtype into the config: a copy leaves the caller's alone
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        params = list(model.parameters())                         # tied parameters once
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        out_params = [] if out is None or out.weight is emb.weight else list(out.parameters())
        linear = [m for m in model.modules() if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
                  and m is not out]
        n_layers = config.num_hidden_layers
        blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)
        h, a = config.hidden_size, config.num_attention_heads
        _ARCH[key] = dict(
            model_type=config.model_type, hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=a,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or a,
            head_dim=getattr(config, "head_dim", None) or h // a, vocab_size=config.vocab_size,
            tie_word_embeddings=not out_params, n_params=sum(p.numel() for p in params), n_tensors=len(params),
            output_params=sum(p.numel() for p in out_params), output_tensors=len(out_params),
            quantized=sum(m.weight.numel() for m in linear),
            layer_params=sum(p.numel() for p in blocks[0].parameters()) if blocks is not None else 0)
    return dict(_ARCH[key])


def param_count(cfg, *, value_head: bool = False) -> int:
    """N of the causal LM (arch_numbers); value_head=True: of reward_model.ScalarHeadModel, which keeps the LM's
    output head (Eq. 2's LM term reads it) and adds the h → 1 head with its bias: N + h + 1. The reward model, the
    critic and the judge are such models."""
    a = arch_numbers(cfg)
    return a["n_params"] + (a["hidden_size"] + 1 if value_head else 0)


# ---------------------------------------------------------------------------------------------------------
# Memory plan
# ---------------------------------------------------------------------------------------------------------
MODELS = ("policy", "critic", "reference", "reward", "judge")
# The phases of one PPO iteration in train.py's order: each holds its rows only while it runs, so the peak is the
# largest. make_experience's three (reward score, log-probs, critic values) see the whole rollout batch at once.
PHASES = ("generate", "reward score", "log-probs", "critic values", "policy train", "policy step", "critic train",
          "critic step", "judge score")
ENGINES = ("deepspeed", "torch")  # DeepSpeed engines (the launcher or --deepspeed) | one process, torch.optim.AdamW

# The paper's set-up (section 5): 8 × A100-80GB, ZeRO-2, bf16, gradient checkpointing; 128 prompts per PPO
# iteration = 16 per GPU, minibatch 32 = micro batch 4 per GPU; max length 2048 = 1024 prompt + 1024 response.
# train.py's PPO-max preset adds the ptx term (λ_ptx 0.5) on 16 SFT rows per step = 2 per GPU. train.py generates
# a GPU's 16 prompts at once (ppo_max.rollout) and scores them in one batch (make_experience).
PAPER_PRESET: dict[str, Any] = dict(num_gpus=8, gpu_mem_gb=80, zero_stage=2, dtype_bytes=2, micro_batch=4,
                                    rollout_batch_per_gpu=16, ptx_batch_per_gpu=2, prompt_len=1024,
                                    response_len=1024, grad_ckpt=True, offload_optimizer=False,
                                    ref_reward_offload=False, engine="deepspeed")


@dataclass
class Row:
    model: str                # policy | critic | reference | reward | judge
    component: str            # held: weights | frozen | adapters | gradients | optimizer
                              # in a phase: kv_cache | hidden_states | activations | logits | temporaries |
                              #             step | gathered
    bytes: int
    device: str               # gpu | cpu
    phases: tuple[str, ...]   # () = held for the whole run; else held only while one of these phases runs
    formula: str


@dataclass
class Suggestion:
    change: str               # what to do, in words
    overrides: dict           # the plan_memory keyword arguments that do it
    total_bytes: int          # the recomputed peak per GPU
    saves_bytes: int
    fits: bool


@dataclass
class MemoryPlan:
    name: str
    cfg: dict                 # arch_numbers of the policy
    reward_cfg: dict          # arch_numbers of the reward model
    settings: dict
    n_params: dict[str, int]  # of each model present (a shared model: the weights it reads)
    rows: list[Row]
    resident_bytes: int       # GPU bytes held the whole run
    phase_bytes: dict[str, int]  # extra GPU bytes while each phase runs (the phases this run has)
    peak_phase: str
    overhead_bytes: int
    total_bytes: int          # = resident + max(phase) + overhead
    capacity_bytes: int
    fits: bool
    cpu_bytes: int            # host RAM per GPU process (offloaded optimizer / frozen weights)
    suggestions: list[Suggestion] = field(default_factory=list)
    lora: dict | None = None  # with --lora-r R > 0: r, targets, modules, bits, trainable {"policy", "critic"}
    one_gpu: list[dict] = field(default_factory=list)  # one_gpu_table's cells (LoRA on one GPU)
    held_by: dict[str, str] = field(default_factory=dict)  # each model: its own weights, or whose it reads
    stages: list[dict] = field(default_factory=list)  # train.py --plan: stages 1-2 (plan_stage_memory) of the run

    def get(self, model: str, component: str, device: str = "gpu") -> int:
        """Bytes of one row (0 when the plan has no such row)."""
        return sum(r.bytes for r in self.rows if (r.model, r.component, r.device) == (model, component, device))

    def static(self, model: str) -> dict[str, int]:
        """What `model` holds the whole run, GPU and host together: {"weights" (frozen + trainable), "gradients",
        "optimizer"}, the numbers tools/memory_check.py measures on a real run's tensors."""
        rows = [r for r in self.rows if r.model == model and not r.phases]
        pick = lambda *names: sum(r.bytes for r in rows if r.component in names)  # noqa: E731
        return {"weights": pick("weights", "frozen", "adapters"), "gradients": pick("gradients"),
                "optimizer": pick("optimizer")}


def _working_set(a: Mapping[str, Any], n: int, s: int, beta: int, flash: bool, name: str = "n") -> tuple[int, str]:
    """One layer's activations while it runs for n sequences of s tokens: Korthikanti et al. 2022, eq. 1,
    s·n·h·(34 + 5·a·s/h) bytes at 16 bits (scaled by β/2 otherwise). 34·s·n·h assumes an MLP of width 4h with dropout
    masks; LLaMA's SwiGLU (i ≈ 2.7h, three i-wide tensors, no dropout) stores about as much. With flash-style
    attention (SDPA / FlashAttention) the a·s² scores are never stored: the 5·a·s²·n term is dropped."""
    h, heads = a["hidden_size"], a["num_attention_heads"]
    x = 34 * s * n * h + (0 if flash else 5 * heads * s * s * n)
    formula = f"34·{name}·L·h" + ("" if flash else f" + 5·a·L²·{name}")
    return x * beta // 2, formula + ("" if beta == 2 else f" ×{beta}/2")


NOGRAD_COEF = 17  # bytes per token per hidden unit at 16 bits that one decoder layer holds at its peak without grad:
                  # 13-17 measured on the CPU (docs/real-scale.md), against Korthikanti et al.'s 34 with grad


def _nograd_set(a: Mapping[str, Any], n: int, s: int, beta: int, flash: bool, name: str = "n") -> tuple[int, str]:
    """One layer's working set in a pass without grad (generation's prefill, scoring, log-probs): nothing is kept
    for a backward, so the layer's live temporaries only, NOGRAD_COEF·s·n·h at 16 bits (+ 5·a·s²·n without flash
    attention), scaled by β/2 otherwise."""
    h, heads = a["hidden_size"], a["num_attention_heads"]
    x = NOGRAD_COEF * s * n * h + (0 if flash else 5 * heads * s * s * n)
    formula = f"{NOGRAD_COEF}·{name}·L·h" + ("" if flash else f" + 5·a·L²·{name}")
    return x * beta // 2, formula + ("" if beta == 2 else f" ×{beta}/2")


def _hidden_states(a: Mapping[str, Any], n: int, s: int, beta: int) -> int:
    """(ℓ + 1)·n·s·h·β: every layer's output of a forward pass with output_hidden_states=True (reward_model.
    ScalarHeadModel reads the last one), all kept until the pass returns. Without grad this is what the pass holds;
    with grad the same tensors are the stored activations, so a training pass adds nothing for it."""
    return (a["num_hidden_layers"] + 1) * n * s * a["hidden_size"] * beta


# ---------------------------------------------------------------------------------------------------------
# LoRA (lora.py): a frozen backbone and its adapters
# ---------------------------------------------------------------------------------------------------------
LORA_BITS = (16, 8, 4)
KBIT_REST_BYTES = 4  # at 8 / 4 bits, per unquantized weight of a trained model (peft's prepare_model_for_kbit_training
                     # upcasts embeddings, norms and the output head to fp32): frozen_bytes
_BITS_WORDS = {16: "bf16", 8: "8-bit (int8)", 4: "4-bit (NF4)"}  # 16: fp32 when planned with --fp32 (β = 4)
ADAPTER_BYTES = 16  # per trainable parameter under DeepSpeed: weight + gradient + Adam m, v, all fp32 (4+4+8)
_TARGETS: dict[tuple, dict] = {}  # _lora_targets' counts, per architecture and --lora-targets


def _frozen_words(bits: int, beta: int) -> str:
    return ("fp32" if beta == 4 else "bf16") if bits == 16 else _BITS_WORDS[bits]


def check_lora(lora_r: int, lora_targets: str, lora_bits: int) -> None:
    """The LoRA flags' ranges, one line naming the flag (the names in --lora-targets: by _lora_targets)."""
    if lora_r < 0:
        raise ValueError(f"--lora-r {lora_r}: must be ≥ 0 (0 = full fine-tuning, R > 0 = adapters of rank R)")
    if lora_bits not in LORA_BITS:
        raise ValueError(f"--lora-bits {lora_bits}: must be 16, 8 or 4 (frozen weights in bf16, int8 or 4-bit NF4)")
    if lora_bits != 16 and lora_r == 0:
        raise ValueError(f"--lora-bits {lora_bits}: quantized frozen weights are for LoRA; add --lora-r R (e.g. 16)")


def _lora_targets(cfg, spec: str) -> dict:
    """{"per_rank": Σ over adapted layers (d_in + d_out), "layers", "output_per_rank", "output_layers" (the adapters
    on the output head itself), "modules", "model_type", "hidden_size"} for --lora-targets on cfg's architecture
    (what model_config takes), counted by lora.count_trainable on a meta-device copy (no weights), once per
    architecture and spec. Each name of a comma-separated spec must match a linear layer, as training requires."""
    from plumbing import lora

    config = model_config(cfg)
    key = (config.to_json_string(use_diff=False), spec)
    if key not in _TARGETS:
        modules = lora.target_modules(config.model_type, spec)
        for name in modules if isinstance(modules, list) else ():
            try:
                lora.count_trainable(config, 1, name)
            except ValueError:
                raise ValueError(f"--lora-targets {spec}: {name} matches no linear layer of this "
                                 f"{config.model_type} model") from None
        n = lora.count_trainable(config, 1, spec)  # at r = 1: Σ (d_in + d_out)
        _TARGETS[key] = dict(per_rank=n["adapters"], layers=n["layers"], output_per_rank=n["output_adapters"],
                             output_layers=n["output_layers"], model_type=config.model_type,
                             modules=modules if isinstance(modules, str) else ",".join(modules),
                             hidden_size=config.hidden_size)
    return _TARGETS[key]


def lora_trainable(cfg, r: int, spec: str = "auto", heads: int = 0) -> int:
    """n, the trainable parameters of LoRA rank r on cfg: the adapters A (r, d_in) and B (d_out, r) of every adapted
    layer, n = r·Σ(d_in + d_out), plus `heads` scalar heads of h + 1 (the reward model's, the critic's), trained in
    full. What the plan counts, and what peft's get_nb_trainable_parameters() reports."""
    t = _lora_targets(cfg, spec)
    return r * t["per_rank"] + heads * (t["hidden_size"] + 1)


def frozen_bytes(cfg, bits: int, beta: int, prepared: bool = True) -> tuple[int, str]:
    """Bytes of one frozen causal LM (N = arch_numbers(cfg)'s n_params; cfg as model_config takes, or its numbers),
    and the formula.

    16 bits: β·N. At 8 and 4 bits bitsandbytes quantizes the Linear weights but the output head's, Q; it loads the
    rest, N − Q (embeddings, norms, biases, the output head), in bf16. A model that trains adapters goes through
    peft's prepare_model_for_kbit_training (lora.add_adapters, `prepared`), which upcasts that rest to fp32,
    KBIT_REST_BYTES each; a frozen model loaded on its own (the reference when it is not the policy's base, the
    judge) keeps it in bf16.
    8 bits (LLM.int8): Q bytes (its fp32 scale per output row, < 0.1 %, is not counted).
    4 bits (NF4 with double quantization, Dettmers et al. 2023): 4 bits + an 8-bit absmax per block of 64 + an fp32
    constant per 256 blocks = 4 + 8/64 + 32/16384 = 4.127 bits per weight, Q/2 + Q/64 + Q/4096 bytes."""
    a = arch_numbers(cfg)
    N, Q = a["n_params"], a["quantized"]
    if bits == 16:
        return beta * N, f"{beta}·N"
    q = Q if bits == 8 else Q // 2 + Q // 64 + Q // 4096
    rest = KBIT_REST_BYTES if prepared else beta
    return q + rest * (N - Q), ("Q" if bits == 8 else "4.127/8·Q") + f" + {rest}·(N − Q)"


# ---------------------------------------------------------------------------------------------------------
# The plan of PPO's models
# ---------------------------------------------------------------------------------------------------------
def plan_memory(cfg: Mapping[str, Any] | str | Any, *, num_gpus: int = 8, gpu_mem_gb: float = 80,
                zero_stage: int = 2, dtype_bytes: int = 2, micro_batch: int = 4, rollout_batch_per_gpu: int = 16,
                ptx_batch_per_gpu: int = 2, prompt_len: int = 1024, response_len: int = 1024, grad_ckpt: bool = True,
                offload_optimizer: bool = False, ref_reward_offload: bool = False, flash_attention: bool = True,
                overhead_gb: float = 2.0, engine: str = "deepspeed", lora_r: int = 0, lora_targets: str = "auto",
                lora_bits: int = 16, critic: bool = True, critic_init: str = "rm", policy_init: str = "sft",
                judge: bool = False, frozen_zero_stage: int = 0, generate_batch: int = 0, reward_cfg=None,
                critic_cfg=None, judge_cfg=None, suggest: bool = True) -> MemoryPlan:
    """Per-GPU memory of PPO's models as train.py holds them: policy and critic (trained), reference, reward model
    and, on real data, the judge (frozen).

    cfg: the policy's (= the reference's) architecture, anything arch_numbers takes (alias, directory, dict,
    config); reward_cfg the reward model's (default cfg); critic_cfg the critic's (default: the reward model's for
    critic_init="rm", PPO-max's choice, cfg's for "sft"; critic_init="model" is a --critic-model of its own);
    judge_cfg the judge's (default cfg). critic=False: no critic (the critic-free estimators: GRPO, RLOO, ...).
    gpu_mem_gb is in GiB as nvidia-smi reports it (an A100-80GB shows 81920 MiB = 80 GiB). Defaults = PAPER_PRESET.

    Held the whole run. N = arch_numbers(cfg)["n_params"] of the causal LM; the critic, reward model and judge are
    reward_model.ScalarHeadModel: N + h + 1 (they keep the LM's output head). β = dtype_bytes.
      engine="torch" (one process, torch.optim.AdamW, what `python train.py` runs): exact, to the byte, for the
      tensors of a run (tests/test_scale.py checks it on real runs, full weights and LoRA, fp32 and bf16):
        weights      β·N
        gradients    β·n  over the parameters that get one: every one of the policy's; the critic's but its untied
                     output head (its values never read the logits): n = N + h + 1 − N_o
        optimizer    2·β·n + 4·t   Adam's m and v in the weights' dtype, and a 4-byte step count per tensor
      engine="deepspeed" (DeepSpeed engines; the ZeRO paper's mixed-precision formula, not measured here):
        weights      β·N              ÷G with ZeRO-3; frozen models on the CPU with ref_reward_offload
        gradients    β·N              trained models only; ÷G with ZeRO-2 and 3
        optimizer    12·N             fp32 master + m + v (8·N in pure fp32, β = 4); ÷G with ZeRO ≥ 1; on the CPU
                                      with offload_optimizer (ZeRO-Offload); every trainable parameter, used or not
      LoRA (lora_r = R > 0), see _lora_rows: the frozen backbones, shared where train.load_models shares them.
    Held while one phase runs, with B = rollout_batch_per_gpu, g = generate_batch (0: B) prompts generated and
    scored at a time (--generate-batch), b = micro_batch, x = ptx_batch_per_gpu, L = P + T, u = g·T·V·4 (fp32
    logits over the responses of one micro-batch), and a pass without grad holding one layer's temporaries,
    _nograd_set = NOGRAD_COEF·g·L·h (17, measured 13-17 on the CPU; 34 with grad):
        generate       kv_cache       2·ℓ·g·L·k·d·β   K and V of every layer, one micro-batch at a time
                       prefill        the no-grad set of the g prompts' first forward (17·g·P·h)
        reward score   hidden_states  g·L·h·β (the last hidden state, read by a hook: no output_hidden_states) +
                                      the no-grad set
        log-probs      logprobs       2·u             π's and π_ref's fp32 logits of one micro-batch
                       temporaries    max(5·u, u + g·L·V·β, no-grad set): kl_full's log-softmaxes, exp and
                                      product; a forward's logits and their fp32 copy
        critic values  hidden_states  as the reward score
        policy train   activations    with checkpointing ℓ·(b+x)·L·h·β + one layer's working set (Korthikanti
                                      et al. 2022, _working_set); without, ℓ × the working set, for b and x
                       logits         max(4·b·T·V·4 + 2·x·L·V·β, 2·b·T·V·4 + x·L·V·(3β+4)): the PPO loss's fp32
                                      log-probs (4 tensors at its backward's peak) and the ptx loss's (3 in the
                                      weights' dtype and one fp32), whichever backward runs while the other's graph
                                      is held; the bf16 logits b·L·V·β + 2·b·T·V·4 when the prompt is long
        policy step    step           β·n  (engine torch) foreach AdamW's √v of every tensor at once (on a GPU)
        critic train   activations    as the policy's, b sequences
        critic step    step           as the policy's
        judge score    hidden_states  as the reward score, the judge's architecture
        gathered       with ZeRO-3 or offloaded weights, 2 blocks of full bf16 weights live at a time (current +
                       prefetched; a block = the larger of one layer and the V·h embedding), in every phase of that
                       model
    Held always besides, under DeepSpeed: grad_fp32 4·N/G (÷1 at ZeRO-0) per trained model in mixed precision,
    the step's fp32 copy of the gradients (DeepSpeed's estimate_zero2_model_states_mem_needs counts it), and at
    ZeRO ≥ 1 buckets β·2·BUCKET_ELEMENTS (the reduce and all-gather buckets); frozen_zero_stage=3: the frozen models'
    weights β·N/G and their gathered blocks. Plus overhead_gb (CUDA context, NCCL, allocator fragmentation: a stated
    guess, 2 GiB).
    The experience buffer (ids, log-probs, values, advantages: ~36 bytes per token) is ignored.
    total = resident + max over phases + overhead; fits = total ≤ gpu_mem_gb GiB. The phases' coefficients come from
    the code's order of operations and are measured against the torch profiler in docs/real-scale.md.
    """
    settings = dict(num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, zero_stage=zero_stage, dtype_bytes=dtype_bytes,
                    micro_batch=micro_batch, rollout_batch_per_gpu=rollout_batch_per_gpu,
                    ptx_batch_per_gpu=ptx_batch_per_gpu, prompt_len=prompt_len, response_len=response_len,
                    grad_ckpt=grad_ckpt, offload_optimizer=offload_optimizer, ref_reward_offload=ref_reward_offload,
                    flash_attention=flash_attention, overhead_gb=overhead_gb, engine=engine, lora_r=lora_r,
                    lora_targets=lora_targets, lora_bits=lora_bits, critic=critic, critic_init=critic_init,
                    policy_init=policy_init, judge=judge, frozen_zero_stage=frozen_zero_stage,
                    generate_batch=generate_batch)
    _check_settings(settings, critic_cfg)
    src = {"policy": cfg, "reference": cfg, "reward": cfg if reward_cfg is None else reward_cfg}
    if critic:
        src["critic"] = critic_cfg if critic_init == "model" else src["reward"] if critic_init == "rm" else cfg
    if judge:
        src["judge"] = cfg if judge_cfg is None else judge_cfg
    arch = {role: arch_numbers(c) for role, c in src.items()}
    rows, held_by, lora_info = _static_rows(src, arch, settings)
    rows += _phase_rows(arch, settings) + (_step_rows(rows) if engine == "torch" else [])
    rows.sort(key=lambda row: MODELS.index(row.model))  # stable: each model's rows in the order they were added
    phases = [p for p in PHASES if any(p in r.phases for r in rows)]
    resident = sum(r.bytes for r in rows if r.device == "gpu" and not r.phases)
    phase_bytes = {p: sum(r.bytes for r in rows if r.device == "gpu" and p in r.phases) for p in phases}
    peak_phase = max(phases, key=lambda p: phase_bytes[p])
    overhead = int(overhead_gb * GiB)
    total = resident + phase_bytes[peak_phase] + overhead
    capacity = int(gpu_mem_gb * GiB)
    n_params = {role: param_count(arch[role], value_head=role in ("critic", "reward", "judge")) for role in arch}
    plan = MemoryPlan(name=cfg if isinstance(cfg, str) else "custom", cfg=arch["policy"], reward_cfg=arch["reward"],
                      settings=settings, n_params=n_params, rows=rows, resident_bytes=resident,
                      phase_bytes=phase_bytes, peak_phase=peak_phase, overhead_bytes=overhead, total_bytes=total,
                      capacity_bytes=capacity, fits=total <= capacity,
                      cpu_bytes=sum(r.bytes for r in rows if r.device == "cpu"), lora=lora_info, held_by=held_by)
    cfgs = dict(reward_cfg=reward_cfg, critic_cfg=critic_cfg, judge_cfg=judge_cfg)
    if suggest and not plan.fits:
        plan.suggestions = _suggestions(lambda s: plan_memory(cfg, suggest=False, **cfgs, **s).total_bytes,
                                        settings, total, capacity)
    if suggest and lora_r and num_gpus == 1:
        plan.one_gpu = one_gpu_table(cfg, **cfgs, **settings)
    return plan


def _check_settings(s: dict, critic_cfg=None) -> None:
    check_lora(s["lora_r"], s["lora_targets"], s["lora_bits"])
    if s["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"plan_memory: zero_stage must be 0, 1, 2 or 3, got {s['zero_stage']}")
    if s["dtype_bytes"] not in (2, 4):
        raise ValueError(f"plan_memory: dtype_bytes must be 2 (bf16) or 4 (fp32), got {s['dtype_bytes']}")
    for k in ("num_gpus", "micro_batch", "rollout_batch_per_gpu", "prompt_len", "response_len"):
        if s[k] < 1:
            raise ValueError(f"plan_memory: {k} must be ≥ 1, got {s[k]}")
    if s["ptx_batch_per_gpu"] < 0:
        raise ValueError(f"plan_memory: ptx_batch_per_gpu must be ≥ 0 (0 = no ptx term), got "
                         f"{s['ptx_batch_per_gpu']}")
    g, B = s.get("generate_batch", 0), s["rollout_batch_per_gpu"]
    if g < 0 or g and B % g:
        raise ValueError(f"plan_memory: generate_batch {g} must divide rollout_batch_per_gpu {B} (0 = all at once)")
    if s.get("frozen_zero_stage", 0) not in (0, 3):
        raise ValueError(f"plan_memory: frozen_zero_stage must be 0 or 3, got {s['frozen_zero_stage']}")
    if s["engine"] not in ENGINES:
        raise ValueError(f"plan_memory: engine must be one of {ENGINES}, got {s['engine']!r}")
    if s["engine"] == "torch" and s["num_gpus"] > 1:
        raise ValueError(f"plan_memory: {s['num_gpus']} GPUs run DeepSpeed engines (the launcher); engine='torch' is "
                         f"one process")
    if s["critic_init"] not in ("rm", "sft", "model") or (s["critic_init"] == "model" and critic_cfg is None):
        raise ValueError(f"plan_memory: critic_init must be 'rm', 'sft' or 'model' (with critic_cfg), got "
                         f"{s['critic_init']!r}")
    if s["policy_init"] not in ("sft", "pretrained"):
        raise ValueError(f"plan_memory: policy_init must be 'sft' or 'pretrained', got {s['policy_init']!r}")


def _static_rows(src: dict, arch: dict, s: dict) -> tuple[list[Row], dict[str, str], dict | None]:
    """The rows held the whole run (plan_memory's docstring), and how each model is held."""
    if s["lora_r"]:
        return _lora_rows(src, arch, s)
    beta, G, z, torch_engine = s["dtype_bytes"], s["num_gpus"], s["zero_stage"], s["engine"] == "torch"
    rows: list[Row] = []
    for role in MODELS:
        if role not in arch:
            continue
        a = arch[role]
        head = a["hidden_size"] + 1 if role in ("critic", "reward", "judge") else 0   # the h → 1 head and its bias
        N = a["n_params"] + head
        n_formula = f"N = {N:,}" + (" with the h+1 head" if head else "")

        def add(comp: str, n: int, formula: str, device: str = "gpu"):
            rows.append(Row(role, comp, int(n), device, (), formula))

        frozen_sharded = role not in ("policy", "critic") and s.get("frozen_zero_stage", 0) == 3 and not torch_engine
        if role not in ("policy", "critic") and s["ref_reward_offload"]:
            add("weights", beta * N // G, f"{beta}·N/{G} (ZeRO-3 offload)   ({n_formula})", "cpu")
        elif z == 3 and not torch_engine or frozen_sharded:
            add("weights", beta * N // G, f"{beta}·N/{G}" + ("   (a frozen ZeRO-3 engine)" if frozen_sharded else "")
                + f"   ({n_formula})")
        else:
            add("weights", beta * N, f"{beta}·N   ({n_formula})")
        if role not in ("policy", "critic"):
            continue
        if torch_engine:  # the parameters that get a gradient, and so an Adam state
            unused = a["output_params"] if role == "critic" else 0
            n = N - unused
            t = a["n_tensors"] + (2 if head else 0) - (a["output_tensors"] if role == "critic" else 0)
            why = " (no gradient for the untied output head)" if unused else ""
            add("gradients", beta * n, f"{beta}·n   (n = {n:,}{why})")
            add("optimizer", 2 * beta * n + 4 * t, f"2·{beta}·n + 4·t   (Adam m, v; a 4-byte step for each of "
                                                   f"t = {t})")
        else:
            gd = G if z >= 2 else 1  # ZeRO-Offload copies each reduced part of the gradients to the CPU
            add("gradients", beta * N // gd, f"{beta}·N" + (f"/{G}" if gd > 1 else ""),
                "cpu" if s["offload_optimizer"] and z >= 1 else "gpu")
            opt_per_param = 12 if beta < 4 else 8  # fp32 master + m + v in mixed precision; m + v in pure fp32
            od = G if z >= 1 else 1
            where = "cpu" if s["offload_optimizer"] else "gpu"
            add("optimizer", opt_per_param * N // od, f"{opt_per_param}·N" + (f"/{od}" if od > 1 else ""), where)
            if beta < 4:  # mixed precision: the step reads the 16-bit gradients as an fp32 copy of this rank's part
                add("grad_fp32", 4 * N // od, f"4·N" + (f"/{od}" if od > 1 else "") + "   (the step's fp32 gradients,"
                    " as DeepSpeed's estimator counts them)", where)
            if z >= 1:  # the engine's reduce (IPG) and all-gather buckets, in the weights' dtype
                add("buckets", beta * 2 * BUCKET_ELEMENTS, f"{beta}·(reduce + allgather bucket)   "
                    f"(2 × {BUCKET_ELEMENTS:,} elements, deepspeed_config)")
    return rows, {role: "its own weights" for role in arch}, None


def _lora_rows(src: dict, arch: dict, s: dict) -> tuple[list[Row], dict[str, str], dict]:
    """The rows held the whole run under LoRA, per GPU (every GPU holds all of it: data parallel, nothing sharded),
    as train.load_models holds them:
        policy     frozen    frozen_bytes(N, bits) of its base (8/4 bits: prepared, the rest in fp32)
        critic     frozen    the same for its base
        reference  nothing of its own when it starts from the policy's directory (policy_init "sft": the policy with
                   its adapters off); else its own frozen copy, quantized like the others
        reward     its own frozen head, h + 1, when the critic starts from it (critic_init "rm": the critic's
                   backbone with the critic's adapters off); else its own copy β·(N + h + 1), which train.load_models
                   loads unquantized
        judge      its own frozen copy (quantized like the reference) + its head β·(h + 1)
    and the trainable parameters, n adapters (fp32: peft keeps them so) of the policy, n adapters + the h + 1 value
    head (in the weights' dtype; fp32 at 8/4 bits) of the critic:
        engine torch       adapters 4·n (+ the head), gradients for all but adapters on the critic's output head,
                           optimizer 2× the gradients' bytes + 4 bytes per tensor (Adam's m, v and step)
        engine deepspeed   ADAPTER_BYTES = 16 per trainable parameter: weight, gradient (4 + 4) and Adam m, v (8)"""
    beta, r, spec, bits = s["dtype_bytes"], s["lora_r"], s["lora_targets"], s["lora_bits"]
    torch_engine = s["engine"] == "torch"
    share_ref = s["policy_init"] == "sft"
    share_rm = "critic" in arch and s["critic_init"] == "rm"
    hb = 4 if bits != 16 else beta  # the value head's bytes per number: lora.add_adapters makes it fp32 at 8/4 bits
    rows: list[Row] = []
    held_by = {role: "its own weights" for role in arch}
    trainable = {}

    def add(model: str, comp: str, n: int, formula: str):
        rows.append(Row(model, comp, int(n), "gpu", (), formula))

    for role in ("policy", "critic"):
        if role not in arch:
            continue
        a, t = arch[role], _lora_targets(src[role], spec)
        h = a["hidden_size"]
        fb, formula = frozen_bytes(a, bits, beta)
        if role == "policy":
            add(role, "frozen", fb, formula + ("   (= the reference: adapters off)" if share_ref else ""))
        else:
            add(role, "frozen", fb, formula + ("   (= the reward model's backbone: adapters off)" if share_rm else ""))
        n_a, t_a = r * t["per_rank"], 2 * t["layers"]  # each adapted layer: A and B
        n_o, t_o = (r * t["output_per_rank"], 2 * t["output_layers"]) if role == "critic" else (0, 0)
        n_head, t_head = (h + 1, 2) if role == "critic" else (0, 0)
        trainable[role] = n_a + n_head
        if not torch_engine:
            n = n_a + n_head
            add(role, "adapters", 4 * n, f"4·n   (n = {n:,}: fp32 weights)")
            add(role, "gradients", 4 * n, "4·n")
            add(role, "optimizer", 8 * n, "8·n   (Adam m, v)")
            continue
        head_words = f" + {hb}·(h+1) head" if n_head else ""
        add(role, "adapters", 4 * n_a + hb * n_head, f"4·n{head_words}   (n = {n_a:,} fp32 adapter weights)")
        g = 4 * (n_a - n_o) + hb * n_head
        unused = "; none for the adapters on the output head" if n_o else ""
        add(role, "gradients", g, f"4·n{head_words}{unused}")
        add(role, "optimizer", 2 * g + 4 * (t_a - t_o + t_head),
            f"2 × the gradients + 4·t   (Adam m, v; a 4-byte step for each of t = {t_a - t_o + t_head})")
    if share_ref:
        held_by["reference"] = "the policy with its adapters off"
    else:
        fb, formula = frozen_bytes(arch["reference"], bits, beta, prepared=False)
        add("reference", "frozen", fb, formula + "   (its own copy: policy_init pretrained)")
    a = arch["reward"]
    if share_rm:
        held_by["reward"] = "the critic's backbone with its adapters off, and its own head"
        add("reward", "frozen", hb * (a["hidden_size"] + 1), f"{hb}·(h+1)   (its own frozen head)")
    else:
        N = a["n_params"] + a["hidden_size"] + 1
        add("reward", "frozen", beta * N, f"{beta}·(N+h+1)   (its own copy, loaded unquantized)")
    if "judge" in arch:
        a = arch["judge"]
        fb, formula = frozen_bytes(a, bits, beta, prepared=False)
        add("judge", "frozen", fb + beta * (a["hidden_size"] + 1), formula + f" + {beta}·(h+1)   (its own copy)")
    t = _lora_targets(src["policy"], spec)
    info = dict(r=r, targets=spec, modules=t["modules"] + (" (auto)" if spec == "auto" else ""), bits=bits,
                trainable=trainable, layers=t["layers"], share_ref=share_ref, share_rm=share_rm)
    return rows, held_by, info


def _phase_rows(arch: dict, s: dict) -> list[Row]:
    """The rows held while one phase runs (plan_memory's docstring)."""
    beta, flash = s["dtype_bytes"], s["flash_attention"]
    B, b, x = s["rollout_batch_per_gpu"], s["micro_batch"], s["ptx_batch_per_gpu"]
    g = s.get("generate_batch") or B  # prompts generated and scored at once (--generate-batch; 0: all B)
    T, L = s["response_len"], s["prompt_len"] + s["response_len"]
    critic = "critic" in arch
    rows: list[Row] = []
    at_once = f"g = {g} of B = {B} at once" if g < B else f"B = {B} at once"

    def add(model: str, comp: str, n: int, formula: str, phases: tuple[str, ...]):
        rows.append(Row(model, comp, int(n), "gpu", phases, formula))

    pa = arch["policy"]
    V, n_layers, h = pa["vocab_size"], pa["num_hidden_layers"], pa["hidden_size"]
    k, d = pa["num_key_value_heads"], pa["head_dim"]
    add("policy", "kv_cache", 2 * n_layers * g * L * k * d * beta, f"2·ℓ·g·L·k·d·{beta}   ({at_once})",
        ("generate",))
    ws, wf = _nograd_set(pa, g, s["prompt_len"], beta, flash, "g")
    add("policy", "prefill", ws, wf.replace("L", "P") + "   (the first forward, over g prompts, no grad)", ("generate",))
    for role, phase in (("reward", "reward score"), ("critic", "critic values"), ("judge", "judge score")):
        if role in arch:
            ws, wf = _nograd_set(arch[role], g, L, beta, flash, "g")
            add(role, "hidden_states", g * L * arch[role]["hidden_size"] * beta + ws,
                f"g·L·h·{beta} + {wf}   (the last hidden state only; no grad)", (phase,))
    u = g * T * V * 4
    add("policy", "logprobs", 2 * u, "2·g·T·V·4   (π's and π_ref's fp32 logits of the responses, one micro-batch)",
        ("log-probs",))
    ws, _ = _nograd_set(pa, g, L, beta, flash)
    add("policy", "temporaries", max(5 * u, u + g * L * V * beta, ws), f"max(5·g·T·V·4, g·T·V·4 + g·L·V·{beta}, "
        f"no-grad set)   (kl_full; a forward's logits)", ("log-probs",))
    for role in ("policy", "critic") if critic else ("policy",):
        a = arch[role]
        n = b + (x if role == "policy" else 0)
        ws, wf = _working_set(a, max(b, x) if role == "policy" else b, L, beta, flash,
                              "max(b,x)" if role == "policy" and x else "b")
        seqs = "(b+x)" if role == "policy" and x else "b"
        if s["grad_ckpt"]:
            add(role, "activations", a["num_hidden_layers"] * n * L * a["hidden_size"] * beta + ws,
                f"ℓ·{seqs}·L·h·{beta} + {wf}", (f"{role} train",))
        else:
            every = sum(_working_set(a, m, L, beta, flash)[0] for m in ((b, x) if role == "policy" and x else (b,)))
            add(role, "activations", a["num_hidden_layers"] * every, f"ℓ·({wf}) for {seqs}", (f"{role} train",))
    pg = max(4 * b * T * V * 4, b * L * V * beta + 2 * b * T * V * 4)   # the PPO loss's log-probs at their peak
    if x:
        held_ptx, peak_ptx = 2 * x * L * V * beta, x * L * V * (3 * beta + 4)
        add("policy", "logits", max(pg + held_ptx, 2 * b * T * V * 4 + peak_ptx),
            f"max(4·b·T·V·4 + 2·x·L·V·{beta}, 2·b·T·V·4 + x·L·V·{3 * beta + 4})   (PPO and ptx losses)",
            ("policy train",))
    else:
        add("policy", "logits", pg, f"max(4·b·T·V·4, b·L·V·{beta} + 2·b·T·V·4)   (the PPO loss)",
            ("policy train",))
    frozen3 = s.get("frozen_zero_stage", 0) == 3 and s["engine"] == "deepspeed"
    if s["zero_stage"] == 3 and s["engine"] == "deepspeed" or s["ref_reward_offload"] or frozen3:
        phases_of = {"policy": ("generate", "log-probs", "policy train"), "critic": ("critic values", "critic train"),
                     "reference": ("log-probs",), "reward": ("reward score",), "judge": ("judge score",)}
        for role, a in arch.items():
            sharded = (s["zero_stage"] == 3 and s["engine"] == "deepspeed") or role not in ("policy", "critic") and \
                (s["ref_reward_offload"] or frozen3)
            if sharded and not s["lora_r"]:
                block = max(a["layer_params"], a["vocab_size"] * a["hidden_size"])
                add(role, "gathered", 2 * block * beta, f"2·{beta}·max(layer, V·h)", phases_of[role])
    return rows


def _step_rows(rows: list[Row]) -> list[Row]:
    """engine torch: foreach AdamW (a GPU's default) computes √v of every tensor in one temporary as large as the
    gradients, while they are held (on the CPU torch steps one tensor at a time)."""
    return [Row(r.model, "step", r.bytes, "gpu", (f"{r.model} step",), "the gradients' bytes   (foreach AdamW's √v)")
            for r in rows if r.component == "gradients" and not r.phases]


def plan_stage_memory(cfg, stage: str, *, num_gpus: int = 8, gpu_mem_gb: float = 80, zero_stage: int = 2,
                      dtype_bytes: int = 2, micro_batch: int = 4, prompt_len: int = 1024, response_len: int = 1024,
                      grad_ckpt: bool = True, offload_optimizer: bool = False, flash_attention: bool = True,
                      overhead_gb: float = 2.0, engine: str = "deepspeed", lora_r: int = 0,
                      lora_targets: str = "auto", lora_bits: int = 16, suggest: bool = True, **_ignored) -> dict:
    """Per-GPU memory of stage 1 (stage="sft") or stage 2 ("rm"): one trained model and nothing beside it.

    Same terms as plan_memory's policy: weights β·N, gradients β·N (÷G with ZeRO ≥ 2), AdamW 12·N (÷G with ZeRO ≥ 1;
    on the CPU with offload; engine "torch": 2·β·N + 4·t), activations with checkpointing ℓ·s·L·h·β + one layer's
    working set, where s sequences of L = P + T tokens go through per step: s = b for SFT, s = 2b for the reward
    model (chosen and rejected of b pairs in one batch). Logits: SFT's loss is ppo_loss.ptx_loss on the model's
    logits, b·L·V·(3β + 4) at its backward's peak (measured for the ptx term, plan_memory); the reward model computes
    them for all 2b sequences (2b·L·V·β) and upcasts the chosen half for Eq. 2's LM term (b·L·V·4, the plan's reading
    of reward_model.py, not measured). The reward model keeps its LM head (Eq. 2 needs it): N = the causal LM's
    parameters + the h + 1 of the scalar head.

    lora_r = R > 0: the weights are frozen, frozen_bytes(N, bits) (bf16, or 8 / 4 bits), held once per GPU with no
    gradient and no optimizer state; the n = lora_trainable(cfg, R, targets) adapters (+ the reward model's h + 1
    head) cost 8·n for their fp32 weights and gradients and 8·n for Adam's m and v (engine "torch": + 4 bytes of step
    per tensor). Every GPU holds all of it (ZeRO and offload do not apply). With suggest, "suggestions" when it does
    not fit."""
    if stage not in ("sft", "rm"):
        raise ValueError(f"plan_stage_memory: stage must be 'sft' or 'rm', got {stage!r}")
    check_lora(lora_r, lora_targets, lora_bits)
    a = arch_numbers(cfg)
    G, beta, b, L = num_gpus, dtype_bytes, micro_batch, prompt_len + response_len
    h, n_layers, V = a["hidden_size"], a["num_hidden_layers"], a["vocab_size"]
    N = a["n_params"] + (h + 1 if stage == "rm" else 0)
    t = a["n_tensors"] + (2 if stage == "rm" else 0)
    s = b if stage == "sft" else 2 * b
    ws, _ = _working_set(a, s, L, beta, flash_attention)
    activations = (n_layers * s * L * h * beta + ws) if grad_ckpt else n_layers * ws
    logits = b * L * V * (3 * beta + 4) if stage == "sft" else s * L * V * beta + b * L * V * 4
    torch_engine = engine == "torch"
    settings = dict(num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, zero_stage=zero_stage, dtype_bytes=dtype_bytes,
                    micro_batch=micro_batch, prompt_len=prompt_len, response_len=response_len, grad_ckpt=grad_ckpt,
                    offload_optimizer=offload_optimizer, flash_attention=flash_attention, overhead_gb=overhead_gb,
                    engine=engine, lora_r=lora_r, lora_targets=lora_targets, lora_bits=lora_bits)
    if not lora_r:
        if torch_engine:
            rows = {"weights": beta * N, "gradients": beta * N, "optimizer": 2 * beta * N + 4 * t}
        else:
            od = G if zero_stage >= 1 else 1
            rows = {"weights": beta * N // (G if zero_stage == 3 else 1),
                    "gradients": beta * N // (G if zero_stage >= 2 else 1),
                    "optimizer": 0 if offload_optimizer else (12 if beta < 4 else 8) * N // od,
                    "grad_fp32": 0 if offload_optimizer or beta == 4 else 4 * N // od,  # the step's fp32 gradients
                    "buckets": beta * 2 * BUCKET_ELEMENTS if zero_stage >= 1 else 0}    # reduce + all-gather
            rows = {k: v for k, v in rows.items() if v or k in ("weights", "gradients", "optimizer")}
        rows.update(activations=activations, logits=logits, overhead=int(overhead_gb * GiB))
        total = sum(rows.values())
        plan = {"stage": stage, "n_params": N, "sequences_per_step": s, "rows": rows, "total_bytes": total,
                "capacity_bytes": int(gpu_mem_gb * GiB), "fits": total <= gpu_mem_gb * GiB, "suggestions": []}
    else:
        tg = _lora_targets(cfg, lora_targets)
        n_a = lora_r * tg["per_rank"]
        n = n_a + (h + 1 if stage == "rm" else 0)
        frozen, _ = frozen_bytes(a, lora_bits, beta)
        if torch_engine:  # fp32 adapters; the head in the weights' dtype (fp32 at 8/4 bits)
            hb = 4 if lora_bits != 16 else beta
            head = (h + 1) * hb if stage == "rm" else 0
            tensors = 2 * tg["layers"] + (2 if stage == "rm" else 0)
            rows = {"frozen": frozen, "adapters": 8 * n_a + 2 * head, "optimizer": 8 * n_a + 2 * head + 4 * tensors}
        else:
            rows = {"frozen": frozen, "adapters": 8 * n, "optimizer": 8 * n}  # 16 bytes per trainable parameter
        rows.update(activations=activations, logits=logits, overhead=int(overhead_gb * GiB))
        total = sum(rows.values())
        plan = {"stage": stage, "n_params": N, "sequences_per_step": s, "rows": rows, "total_bytes": total,
                "capacity_bytes": int(gpu_mem_gb * GiB), "fits": total <= gpu_mem_gb * GiB, "trainable": n,
                "lora": dict(r=lora_r, targets=lora_targets, bits=lora_bits, dtype_bytes=beta), "suggestions": []}
    if suggest and not plan["fits"]:
        plan["suggestions"] = _suggestions(
            lambda x: plan_stage_memory(cfg, stage, suggest=False, **x)["total_bytes"], settings, total,
            plan["capacity_bytes"])
    return plan


def format_stage_plans(plans: list[dict]) -> str:
    """Stages 1-2 of plan_stage_memory, one line each (GiB per GPU)."""
    lines = ["Stages 1-2 per GPU (one trained model each; same GPUs, ZeRO stage, dtype and micro batch b):"]
    for p in plans:
        parts = "  ".join(f"{k} {v / GiB:.2f}" for k, v in p["rows"].items())
        name = "1. SFT" if p["stage"] == "sft" else "2. reward model"
        lora = (f"; LoRA r={p['lora']['r']}, {p['trainable']:,} trainable, frozen weights "
                f"{_frozen_words(p['lora']['bits'], p['lora']['dtype_bytes'])}" if p.get("lora") else "")
        lines.append(f"  {name:16s} {p['total_bytes'] / GiB:8.2f} GiB of {p['capacity_bytes'] / GiB:.2f} → "
                     f"{'fits' if p['fits'] else 'DOES NOT FIT'}   ({p['sequences_per_step']} sequences per step; "
                     f"{parts}{lora})")
        for x in p.get("suggestions", ()):
            lines.append(f"    - {x.change}: saves {x.saves_bytes / GiB:.2f} GiB → {x.total_bytes / GiB:.2f} GiB"
                         f" ({'fits' if x.fits else 'still too big'})")
    return "\n".join(lines)


def _candidates(s: dict) -> list[tuple[str, dict, bool]]:
    """(change in words, overrides, changes the experiment?) for every single step that could save memory and that
    train.py can run. Under LoRA nothing is sharded or offloaded: the steps are the rank, the frozen weights' bits
    and the batch shapes. The frozen models' ZeRO-3 and offload (--frozen-zero-stage 3, --frozen-offload) and the
    micro-batches (--generate-batch) are suggested; ZeRO-3 for the trained models is not (train.py refuses it)."""
    if s.get("lora_r"):
        return _lora_candidates(s) + _shape_candidates(s)
    out = []
    if s.get("engine") == "torch":
        out.append(("DeepSpeed engine with the optimizer states on the CPU (--deepspeed --deepspeed_config with "
                    "zero_optimization.offload_optimizer: ZeRO-Offload)",
                    {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": True}, False))
        out.append(("LoRA adapters instead of full weights (--lora-r 16; changes what trains)", {"lora_r": 16}, True))
        return out + _shape_candidates(s)
    if s.get("frozen_zero_stage", 0) != 3 and s["num_gpus"] > 1 and "frozen_zero_stage" in s:
        out.append(("frozen models sharded over the GPUs (--frozen-zero-stage 3: ZeRO-3 inference engines)",
                    {"frozen_zero_stage": 3}, False))
    if not s.get("ref_reward_offload") and "frozen_zero_stage" in s:
        out.append(("frozen models' parameters on the CPU (--frozen-offload)", {"ref_reward_offload": True}, False))
    out.append(("LoRA adapters instead of full weights (--lora-r 16; changes what trains)", {"lora_r": 16}, True))
    if not s["offload_optimizer"]:
        out.append(("optimizer states on the CPU (ZeRO-Offload: zero_optimization.offload_optimizer in "
                    "--deepspeed_config)", {"offload_optimizer": True}, False))
    if s["zero_stage"] < 2:
        out.append(("ZeRO-2 (--zero-stage 2: shards gradients and optimizer states)", {"zero_stage": 2}, False))
    return out + _shape_candidates(s)


def _shape_candidates(s: dict) -> list[tuple[str, dict, bool]]:
    out = []
    B = s.get("rollout_batch_per_gpu", 1)
    g = s.get("generate_batch") or B
    if g > 1 and "generate_batch" in s:  # the micro-batches of generation and scoring: the same experiment
        smaller = max(d for d in range(1, g) if B % d == 0)
        out.append((f"generate and score {smaller} prompts per GPU at a time instead of {g} (--generate-batch "
                    f"{smaller}; the update still takes the whole batch)", {"generate_batch": smaller}, False))
    if not s["grad_ckpt"]:
        out.append(("turn on gradient checkpointing (--grad-ckpt)", {"grad_ckpt": True}, False))
    if s["micro_batch"] > 1:
        m = s["micro_batch"]
        out.append((f"micro batch {m} → {m // 2} (a smaller --minibatch, or twice the GPUs)",
                    {"micro_batch": m // 2}, False))
    if s.get("rollout_batch_per_gpu", 1) > 1:
        B = s["rollout_batch_per_gpu"]
        import math
        over = {"rollout_batch_per_gpu": B // 2}
        if s.get("generate_batch"):
            over["generate_batch"] = math.gcd(s["generate_batch"], B // 2)
        out.append((f"{B} → {B // 2} prompts per GPU per iteration (twice the GPUs; or a smaller --rollout-batch, "
                    f"which changes the experiment)", over, True))
    if s.get("ptx_batch_per_gpu", 0) > 1:
        x = s["ptx_batch_per_gpu"]
        out.append((f"ptx rows per GPU {x} → {x // 2} (--ptx-batch; changes the experiment)",
                    {"ptx_batch_per_gpu": x // 2}, True))
    if s["response_len"] > 1:
        t = s["response_len"]
        out.append((f"shorter rollouts: response_len {t} → {t // 2} (changes the experiment)",
                    {"response_len": t // 2}, True))
    return out


def _lora_candidates(s: dict) -> list[tuple[str, dict, bool]]:
    out = []
    if s["lora_r"] > 1:
        r = s["lora_r"]
        out.append((f"LoRA rank {r} → {r // 2} (--lora-r {r // 2}: half the adapter parameters)",
                    {"lora_r": r // 2}, False))
    for bits in (8, 4):
        if bits < s["lora_bits"]:
            out.append((f"{_BITS_WORDS[bits]} frozen weights (--lora-bits {bits}; needs bitsandbytes on a CUDA GPU)",
                        {"lora_bits": bits}, False))
    return out


def _suggestions(run: Callable[[dict], int], settings: dict, total: int, capacity: int) -> list[Suggestion]:
    """Each single change, recomputed by run(settings) → total bytes (plan_memory's or plan_stage_memory's); then
    greedy combinations (largest saving first, changes that keep the experiment before the others, none that saves
    less than 0.5 % of the total) until the plan fits."""
    out = []

    def try_run(s: dict) -> int | None:  # a candidate these settings cannot take (e.g. --lora-targets naming no layer)
        try:
            return run(s)
        except ValueError:
            return None

    for change, over, _ in _candidates(settings):
        t = try_run({**settings, **over})
        if t is None:
            continue
        if t < total:
            out.append(Suggestion(change, over, t, total - t, t <= capacity))
    keeps = {change: not changes for change, _, changes in _candidates(settings)}
    out.sort(key=lambda x: (not keeps[x.change], -x.saves_bytes))  # what keeps the experiment first (LoRA does not)
    if any(x.fits for x in out):
        return out
    s, steps, cur = dict(settings), [], total
    for allow_experiment in (False, True):
        for _ in range(20):
            best = None
            for change, over, changes_experiment in _candidates(s):
                if changes_experiment and not allow_experiment:
                    continue
                t = try_run({**s, **over})
                if t is not None and t < cur - total // 200 and (best is None or t < best[2]):  # a step that saves < 0.5 %: not worth it
                    best = (change, over, t)
            if best is None:
                break
            steps.append(best[0])
            s.update(best[1])
            cur = best[2]
            if cur <= capacity:
                break
        if cur <= capacity:
            break
    if steps:
        over = {k: v for k, v in s.items() if settings[k] != v}
        out.append(Suggestion("together: " + "; ".join(steps), over, cur, total - cur, cur <= capacity))
    return out


def _engine_words(s: dict) -> str:
    if s["engine"] == "torch":
        return "one process, torch AdamW (states in the weights' dtype: exact)"
    return (f"{s['num_gpus']} GPU{'s' if s['num_gpus'] > 1 else ''} × DeepSpeed ZeRO-{s['zero_stage']} "
            f"(mixed-precision Adam, 12 bytes/param: the ZeRO formula)")


def _shape_words(s: dict) -> str:
    x = s["ptx_batch_per_gpu"]
    on = lambda flag: "on" if s[flag] else "off"  # noqa: E731
    return (f"grad ckpt {on('grad_ckpt')}, flash attention {on('flash_attention')}, "
            f"micro batch b={s['micro_batch']}, B={s['rollout_batch_per_gpu']} prompts/GPU per iteration, "
            f"g={s.get('generate_batch') or s['rollout_batch_per_gpu']} generated and scored at a time, "
            f"{f'ptx x={x}' if x else 'no ptx'}, L = {s['prompt_len']} + {s['response_len']}")


def _models_words(plan: MemoryPlan) -> str:
    """Which models the run holds, their parameters, and which share another's weights."""
    n, s, words = plan.n_params, plan.settings, []
    for role in MODELS:
        if role in n:
            held = plan.held_by.get(role, "its own weights")
            size = f"{n[role] / 1e9:.2f} B" if n[role] >= 1e8 else f"{n[role] / 1e6:.2f} M"
            words.append(f"{role} {size}" + ("" if held == "its own weights" else f" (= {held})"))
    if "critic" in n:
        words.append("critic from " + {"rm": "the reward model", "sft": "the SFT model",
                                       "model": "its own directory"}[s["critic_init"]])
    else:
        words.append("no critic")
    return "  models: " + "; ".join(words)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table (GiB per GPU), the total, fits yes/no, and the suggestions (LoRA on one GPU: and the
    one-GPU table)."""
    s, c = plan.settings, plan.cfg
    gib = lambda n: f"{n / GiB:8.2f}"  # noqa: E731
    dtype = "bf16" if s["dtype_bytes"] == 2 else "fp32"
    arch = (f"h={c['hidden_size']}, ℓ={c['num_hidden_layers']}, a={c['num_attention_heads']}, "
            f"k={c['num_key_value_heads']}, V={c['vocab_size']}")
    if plan.lora:
        lo, n = plan.lora, plan.lora["trainable"]
        engine = "one process, torch AdamW" if s["engine"] == "torch" else "DeepSpeed engines"
        gpus = f"{s['num_gpus']} GPU{'s' if s['num_gpus'] > 1 else ''}"
        lines = [f"Memory plan per GPU: {plan.name} ({c['model_type']}: {arch}) with LoRA r={lo['r']} on "
                 f"{lo['modules']} ({lo['layers']} adapted layers), frozen weights "
                 f"{_frozen_words(lo['bits'], s['dtype_bytes'])}",
                 f"  {gpus} × {s['gpu_mem_gb']} GiB, each holding every model (LoRA: ZeRO and offload flags do not "
                 f"apply), {engine}, {_shape_words(s)}",
                 f"  trainable: policy {n['policy']:,}"
                 + (f"; critic {n['critic']:,} (adapters + the h+1 value head)" if "critic" in n else "")]
    else:
        lines = [f"Memory plan per GPU: {plan.name} ({c['model_type']}: {arch})",
                 f"  {s['gpu_mem_gb']} GiB per GPU, {_engine_words(s)}, {dtype}, {_shape_words(s)}, optimizer offload "
                 f"{'on' if s['offload_optimizer'] else 'off'}, frozen models "
                 + ("on the CPU (ZeRO-3 offload)" if s['ref_reward_offload'] else "ZeRO-3, sharded" if
                    s.get('frozen_zero_stage') == 3 and s['engine'] == 'deepspeed' else "a copy per GPU")]
    lines.append(_models_words(plan))
    lines.append(f"  {'model':10s} {'component':13s} {'GiB':>8s}  {'held':26s} formula")
    for r in plan.rows:
        if r.device == "gpu":
            held = "always" if not r.phases else ", ".join(r.phases)
            lines.append(f"  {r.model:10s} {r.component:13s} {gib(r.bytes)}  {held:26s} {r.formula}")
    lines.append(f"  {'held always':24s} {gib(plan.resident_bytes)}")
    for p, n in plan.phase_bytes.items():
        mark = "  ← peak" if p == plan.peak_phase else ""
        lines.append(f"  {'+ while ' + p:24s} {gib(n)}{mark}")
    lines.append(f"  {'+ overhead':24s} {gib(plan.overhead_bytes)}  (CUDA context, NCCL/ZeRO buffers, fragmentation)")
    lines.append(f"  {'peak per GPU':24s} {gib(plan.total_bytes)}  of {plan.capacity_bytes / GiB:.2f} GiB → "
                 + ("fits" if plan.fits else "DOES NOT FIT"))
    cpu = [r for r in plan.rows if r.device == "cpu"]
    if cpu:
        what = ", ".join(f"{r.model} {r.component} {r.bytes / GiB:.2f}" for r in cpu)
        lines.append(f"  host RAM per GPU process {plan.cpu_bytes / GiB:.2f} GiB ({what}); "
                     f"× {s['num_gpus']} GPUs = {plan.cpu_bytes * s['num_gpus'] / GiB:.1f} GiB")
    if plan.suggestions:
        lines.append("  To make it fit (each recomputed):")
        for x in plan.suggestions:
            lines.append(f"    - {x.change}: saves {x.saves_bytes / GiB:.2f} GiB → {x.total_bytes / GiB:.2f} GiB"
                         f" ({'fits' if x.fits else 'still too big'})")
    if plan.one_gpu:
        lines.append(format_one_gpu_table(plan.one_gpu, s, plan.lora["modules"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# One GPU with LoRA: which GPU holds PPO-max, at which bits
# ---------------------------------------------------------------------------------------------------------
ONE_GPU_MEMS = (24, 48, 80)  # GiB: RTX 4090 / A10-class, A6000 / L40S, A100-80GB / H100


def one_gpu_table(cfg, *, reward_cfg=None, critic_cfg=None, judge_cfg=None, gpu_mems: tuple = ONE_GPU_MEMS,
                  bits: tuple = LORA_BITS, **settings) -> list[dict]:
    """PPO-max with LoRA on one GPU: for each GPU memory M (GiB) and frozen-weight bits, the peak over its stages,
    max(SFT, reward model, PPO) total bytes, at the settings' rank, targets, micro batch and lengths (plan_memory's
    keywords; lora_r > 0). Critic pre-training holds PPO's models and trains only the critic: never above PPO.

    Returns cells {"gpu_mem_gb", "lora_bits", "total_bytes", "peak_stage", "stage_bytes", "fits"}, row by row
    (M ascending, bits descending); fits = total_bytes ≤ M GiB."""
    s = {k: v for k, v in settings.items() if k not in ("lora_bits", "gpu_mem_gb", "num_gpus")}
    if s.get("lora_r", 0) < 1:
        raise ValueError(f"--lora-r {s.get('lora_r', 0)}: the one-GPU table is for LoRA; pass --lora-r R (e.g. 16)")
    cfgs = dict(reward_cfg=reward_cfg, critic_cfg=critic_cfg, judge_cfg=judge_cfg)
    cells = []
    for q in bits:
        stage_bytes = {
            "SFT": plan_stage_memory(cfg, "sft", num_gpus=1, lora_bits=q, suggest=False, **s)["total_bytes"],
            "reward model": plan_stage_memory(cfg, "rm", num_gpus=1, lora_bits=q, suggest=False, **s)["total_bytes"],
            "PPO": plan_memory(cfg, **cfgs, num_gpus=1, lora_bits=q, suggest=False, **s).total_bytes}
        peak = max(stage_bytes, key=stage_bytes.get)
        for m in gpu_mems:
            cells.append(dict(gpu_mem_gb=m, lora_bits=q, total_bytes=stage_bytes[peak], peak_stage=peak,
                              stage_bytes=stage_bytes, fits=stage_bytes[peak] <= m * GiB))
    return sorted(cells, key=lambda x: (x["gpu_mem_gb"], -x["lora_bits"]))


def format_one_gpu_table(cells: list[dict], settings: Mapping[str, Any], modules: str = "") -> str:
    """one_gpu_table as rows of GPU memory × columns of frozen-weight bits, each cell "fits (X GiB)" or "no (X GiB)"."""
    s = settings
    bits = sorted({x["lora_bits"] for x in cells}, reverse=True)
    mems = sorted({x["gpu_mem_gb"] for x in cells})
    cell = {(x["gpu_mem_gb"], x["lora_bits"]): x for x in cells}
    words = {q: "frozen " + _frozen_words(q, s.get("dtype_bytes", 2)).split(" ")[0] for q in bits}
    x = s.get("ptx_batch_per_gpu", 0)
    lines = [f"One GPU, LoRA r={s['lora_r']}{' on ' + modules if modules else ''}, micro batch b={s['micro_batch']}, "
             f"B={s.get('rollout_batch_per_gpu', 1)} prompts at once, {f'ptx x={x}' if x else 'no ptx'}, "
             f"L = {s['prompt_len']} + {s['response_len']}: PPO-max's peak stage (max of SFT, reward model, PPO), GiB",
             (f"  {'GPU':8s}" + "".join(f"{words[q]:18s}" for q in bits)).rstrip()]
    for m in mems:
        row = [f"{'fits' if cell[m, q]['fits'] else 'no'} ({cell[m, q]['total_bytes'] / GiB:.2f} GiB)" for q in bits]
        lines.append((f"  {f'{m} GiB':8s}" + "".join(f"{x:18s}" for x in row)).rstrip())
    lines.append((f"  {'peak':8s}" + "".join(f"{cell[mems[0], q]['peak_stage']:18s}" for q in bits)).rstrip())
    if any(q != 16 for q in bits):
        lines.append("  (8-bit and 4-bit frozen weights load through bitsandbytes, which needs a CUDA GPU)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed configs
# ---------------------------------------------------------------------------------------------------------
# The paper preset's training engine (8 GPUs: minibatch 32 = 4 per GPU × 1 accumulation step), written to
# ds_config_zero2.json. No "train_batch_size" (DeepSpeed derives it = micro × accumulation × world size, so
# the file works at any world size) and no "optimizer" (train.py builds AdamW per engine: the policy and the
# critic have different learning rates; pass lr= to put an AdamW block in, which DeepSpeed needs to pick its
# CPU Adam when the optimizer is offloaded).
BUCKET_ELEMENTS = 200_000_000  # deepspeed_config's reduce_bucket_size and allgather_bucket_size (elements each)
PAPER_DS_KWARGS: dict[str, Any] = dict(zero_stage=2, bf16=True, train_micro_batch_size_per_gpu=4,
                                       gradient_accumulation_steps=1, gradient_clipping=1.0)


def deepspeed_config(*, zero_stage: int = 2, bf16: bool = True, train_micro_batch_size_per_gpu: int,
                     gradient_accumulation_steps: int, gradient_clipping: float, offload_optimizer: bool = False,
                     lr: float | None = None, weight_decay: float = 0.0) -> dict:
    """DeepSpeed JSON for a trained engine (policy or critic): ZeRO stage, bf16 (fp32 when bf16=False, e.g. on
    the CPU), global gradient-norm clipping (paper section 5.4), optional optimizer offload to the CPU."""
    zero: dict[str, Any] = {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000,
                    stage3_max_live_parameters=1_000_000_000)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": gradient_clipping,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,  # train.py prints its own one line per step
        "wall_clock_breakdown": False,
    }
    if lr is not None:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": weight_decay}}
    return cfg


def inference_deepspeed_config(zero_stage: int = 0, offload: bool = False, *, bf16: bool = True) -> dict:
    """DeepSpeed JSON for a frozen engine (reference, reward model): replicated for ZeRO 0–2; sharded with
    ZeRO-3; offload=True keeps the weights on the CPU, which DeepSpeed allows only with stage 3 (forced)."""
    stage = 3 if (offload or zero_stage == 3) else 0
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=10_000, stage3_prefetch_bucket_size=50_000_000)
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1,  # DeepSpeed requires it; no training happens
            "bf16": {"enabled": bf16}, "fp16": {"enabled": False}, "zero_optimization": zero,
            "steps_per_print": 1_000_000, "wall_clock_breakdown": False}


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------
TRAIN_HAS = ("zero_stage", "fp32", "ref_reward_offload", "frozen_zero_stage", "lora_r", "lora_targets", "lora_bits",
             "generate_batch")


def add_plan_args(parser: argparse.ArgumentParser, train: bool = False) -> argparse.ArgumentParser:
    """The plan's flags (defaults = PAPER_PRESET). train=True: `train.py --plan`'s, without TRAIN_HAS, the settings
    train.py's own flags give (--zero-stage, --fp32, --frozen-offload, --lora-*, --generate-batch): the plan reads
    those from the run's parsed configuration, as the run does."""
    p = PAPER_PRESET
    keep = (lambda name: name not in TRAIN_HAS) if train else (lambda name: True)

    def a(flag, **kw):
        if keep(flag[2:].replace("-", "_")):
            parser.add_argument(flag, **kw)

    a("--num-gpus", type=int, default=p["num_gpus"], help="GPUs in the whole job (G)")
    a("--gpu-mem", type=float, default=p["gpu_mem_gb"], help="memory of one GPU in GiB (A100-80GB = 80)")
    a("--zero-stage", type=int, default=p["zero_stage"], choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage (3: what "
      "it would save; train.py refuses it for the trained models)")
    a("--engine", default="auto", choices=("auto",) + ENGINES, help="deepspeed (engines: the launcher or --deepspeed) "
      "or torch (one process, torch AdamW); auto = deepspeed on more than one GPU")
    a("--fp32", action="store_true", help="plan for fp32 instead of bf16 (β = 4)")
    a("--micro-batch", type=int, default=p["micro_batch"], help="training sequences per GPU per step (b)")
    a("--rollout-batch-per-gpu", type=int, default=p["rollout_batch_per_gpu"], help="prompts per GPU per PPO "
      "iteration (B), generated and scored at once")
    a("--ptx-batch-per-gpu", type=int, default=p["ptx_batch_per_gpu"], help="SFT rows per GPU in the ptx term of "
      "each step (x; 0 = no ptx term)")
    a("--prompt-len", type=int, default=p["prompt_len"], help="prompt tokens (P)")
    a("--response-len", type=int, default=p["response_len"], help="response tokens (T)")
    a("--no-grad-ckpt", action="store_true", help="plan without gradient checkpointing")
    a("--offload-optimizer", action="store_true", help="optimizer states on the CPU (ZeRO-Offload)")
    a("--ref-reward-offload", action="store_true", help="frozen models' weights on the CPU (train.py "
      "--frozen-offload)")
    a("--frozen-zero-stage", type=int, default=0, choices=(0, 3), help="frozen models as ZeRO-3 inference engines, "
      "sharded over the GPUs (train.py --frozen-zero-stage)")
    a("--generate-batch", type=int, default=0, help="prompts per GPU generated and scored at a time (g; 0 = all B)")
    a("--no-flash-attention", action="store_true", help="count the a·L² attention scores")
    a("--overhead-gb", type=float, default=2.0, help="CUDA context, buffers, fragmentation (GiB)")
    a("--lora-r", type=int, default=0, help="LoRA rank r: plan frozen weights + adapters (0 = full fine-tuning)")
    a("--lora-targets", default="auto", help="layers with adapters: 'auto' (peft's default: q_proj,v_proj for "
      "LLaMA), 'all-linear', or names such as q_proj,k_proj,v_proj,o_proj")
    a("--lora-bits", type=int, default=16, help="frozen weights under LoRA: 16 (bf16), 8 or 4 (NF4, QLoRA); "
      "8 and 4 need bitsandbytes on a CUDA GPU")
    return parser


def plan_settings(args: argparse.Namespace, **run) -> dict:
    """plan_memory's keywords from the plan's flags, each in its range (else one line naming the flag, exit 2);
    `run` (train.py --plan: the run's own choices) wins."""
    from plumbing.cli import check_flags
    check_flags(args, {"num_gpus": ">=1", "gpu_mem": ">0", "micro_batch": ">=1", "rollout_batch_per_gpu": ">=1",
                       "ptx_batch_per_gpu": ">=0", "prompt_len": ">=1", "response_len": ">=1", "overhead_gb": ">=0",
                       "lora_r": ">=0", "lora_bits": "4|8|16"})
    engine = args.engine if args.engine != "auto" else "deepspeed" if args.num_gpus > 1 else "torch"
    s = dict(num_gpus=args.num_gpus, gpu_mem_gb=args.gpu_mem, zero_stage=args.zero_stage, engine=engine,
             dtype_bytes=4 if args.fp32 else 2, micro_batch=args.micro_batch,
             rollout_batch_per_gpu=args.rollout_batch_per_gpu, ptx_batch_per_gpu=args.ptx_batch_per_gpu,
             prompt_len=args.prompt_len, response_len=args.response_len, grad_ckpt=not args.no_grad_ckpt,
             offload_optimizer=args.offload_optimizer, ref_reward_offload=args.ref_reward_offload,
             flash_attention=not args.no_flash_attention, overhead_gb=args.overhead_gb, lora_r=args.lora_r,
             lora_targets=args.lora_targets, lora_bits=args.lora_bits, frozen_zero_stage=args.frozen_zero_stage,
             generate_batch=args.generate_batch)
    return {**s, **run}


_STAGE_KEYS = ("num_gpus", "gpu_mem_gb", "zero_stage", "dtype_bytes", "micro_batch", "prompt_len", "response_len",
               "grad_ckpt", "offload_optimizer", "flash_attention", "overhead_gb", "engine", "lora_r", "lora_targets",
               "lora_bits")


def stage_plans(model, settings: dict, sft_batch: int | None = None, rm_batch: int | None = None) -> list[dict]:
    """Stages 1 and 2 (plan_stage_memory) at the PPO plan's settings; sft_batch (sequences) and rm_batch (pairs)
    per GPU per step, when given, instead of its micro batch."""
    keep = {k: settings[k] for k in _STAGE_KEYS}
    return [plan_stage_memory(model, stage, **{**keep, "micro_batch": n or keep["micro_batch"]})
            for stage, n in (("sft", sft_batch), ("rm", rm_batch))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-7b", help="alias, hub id (local cache) or model directory")
    parser.add_argument("--reward-model", default=None, help="reward model (= critic) if it differs from --model")
    parser.add_argument("--judge", action="store_true", help="one more frozen reward model during PPO: the held-out "
                                                             "judge train.py trains on real data (--judge-frac)")
    parser.add_argument("--ds-config", action="store_true", help="also print the DeepSpeed JSON for a trained engine")
    args = add_plan_args(parser).parse_args(argv)
    try:
        settings = plan_settings(args, judge=args.judge)
        plan = plan_memory(args.model, reward_cfg=args.reward_model, **settings)
        stages = stage_plans(args.model, settings) if args.lora_r else []
    except (ModelNotFound, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if stages:  # LoRA: the reward model's 2b sequences per step can make stage 2 the peak
        print(format_stage_plans(stages))
    print(format_plan(plan))
    if args.ds_config:
        print(json.dumps(deepspeed_config(zero_stage=args.zero_stage, bf16=not args.fp32,
                                          train_micro_batch_size_per_gpu=args.micro_batch,
                                          gradient_accumulation_steps=1, gradient_clipping=1.0,
                                          offload_optimizer=args.offload_optimizer), indent=2))


if __name__ == "__main__":
    # Worked example: `python -m plumbing.scale` = the paper's set-up with this file's own shapes (8 × A100-80GB,
    # ZeRO-2, bf16, gradient checkpointing, micro batch 4, 16 prompts per GPU generated and scored at once, 2 ptx rows
    # per GPU, L = 1024 + 1024, the frozen models replicated). Printed (tests/test_scale.py checks 79.94, 99.00, 70.76):
    #   policy     weights          12.55  always                     2·N   (N = 6,738,415,616)
    #   policy     gradients         1.57  always                     2·N/8
    #   policy     optimizer         9.41  always                     12·N/8
    #   policy     grad_fp32         3.14  always                     4·N/8   (the step's fp32 gradients, ...)
    #   policy     buckets           0.75  always                     2·(reduce + allgather bucket)
    #   policy     kv_cache         16.00  generate                   2·ℓ·g·L·k·d·2   (B = 16 at once)
    #   ... (the critic as the policy with N + h + 1; reference 12.55, reward model 12.55)
    #   held always                 79.94
    #   + while generate            17.06  ← peak
    #   + overhead                   2.00
    #   peak per GPU                99.00  of 80.00 GiB → DOES NOT FIT
    # Each of --frozen-zero-stage 3 (77.03), --frozen-offload (73.90) and optimizer offload (70.76) makes it fit;
    # `train.py --model llama-7b --plan` bills the alias's own run instead (1536 + 512, 4 prompts generated at a time,
    # the frozen models ZeRO-3): 67.31 GiB with --data's judge (docs/real-scale.md).
    # With LoRA on one GPU (`--num-gpus 1 --gpu-mem 24 --lora-r 16`): two frozen bf16 backbones of 12.55 GiB, the same
    # phases, peak 44.42 GiB; `--lora-bits 4` 27.49 GiB; with 8 prompts generated at a time as well 18.96 GiB, which fits
    # (tests/test_scale.py; docs/one-gpu.md).
    main(sys.argv[1:])
