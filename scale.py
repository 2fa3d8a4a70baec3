"""Running at real scale: name a model, count its parameters, and see PPO's GPU memory bill before launching.

Implements (no equation of Zheng et al. 2023 here: the paper reports only its set-up, "8 × A100-80GB,
ZeRO-2 and gradient checkpointing", section 5; this file turns that set-up into numbers):
    resolve_model(name)              --model: alias | hub id (local HF cache only, never the network) | local dir
    llama_config_numbers(name)       the LlamaConfig numbers, from the alias table or a config.json (no weights)
    llama_param_count(cfg)           N = V·h + ℓ·(h·a·d + 2·h·k·d + a·d·h + 3·h·i + 2·h) + h + V·h·[untied]
    plan_memory(cfg, ...)            per-GPU bytes of the four PPO models (policy, critic, reference, reward)
                                     under ZeRO-0/1/2/3, with suggestions, each recomputed, when it does not fit
    format_plan(plan)                the table `python train.py --model llama-7b --plan` prints
    plan_memory(cfg, lora_r=R, ...)  with LoRA (lora.py): 2 frozen backbones (bf16, 8 or 4 bits) + adapters,
                                     16 bytes per trainable parameter n = lora_trainable(cfg, R, targets)
    one_gpu_table(cfg, ...)          LoRA on one GPU: 24 / 48 / 80 GiB × frozen 16 / 8 / 4 bits, the peak stage's bytes
    deepspeed_config(...)            DeepSpeed JSON of a trained engine (paper preset = ds_config_zero2.json)
    inference_deepspeed_config(...)  DeepSpeed JSON of a frozen engine (reference, reward model)

Run: python scale.py --model llama-7b [--num-gpus 8 --gpu-mem 80 --zero-stage 2 --micro-batch 4 ...]
     (defaults = the paper preset; prints the plan; `--ds-config` also prints the DeepSpeed JSON)
     python scale.py --model llama-7b --num-gpus 1 --gpu-mem 24 --lora-r 16 [--lora-bits 4]   (one GPU, LoRA)

Symbols: N parameters, ℓ layers, h hidden size, i MLP size, a attention heads, k key/value heads (GQA),
d = h/a head size, V vocabulary, G GPUs, β bytes per bf16 number (2), b micro batch,
L = P + T tokens of a sequence (prompt + response), g sequences generated at once per GPU.

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


def _layer_params(c: Mapping[str, Any]) -> int:
    """Parameters of one decoder layer (no biases, as in LLaMA: attention_bias = mlp_bias = False)."""
    h, i, a, k, d = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                     c["num_key_value_heads"], c["head_dim"])
    attn = h * a * d + 2 * h * k * d + a * d * h  # W_q (h → a·d), W_k and W_v (h → k·d, GQA), W_o (a·d → h)
    mlp = 3 * h * i                                # gate, up (h → i), down (i → h): SwiGLU
    return attn + mlp + 2 * h                      # + input and post-attention RMSNorm weights


def llama_param_count(cfg: Mapping[str, Any] | str | Any, *, value_head: bool = False) -> int:
    """N, the parameter count of LlamaForCausalLM (value_head=True: of LlamaForSequenceClassification with one
    label, i.e. the backbone plus a bias-free h → 1 `score` head, the shape of our critic and reward model)."""
    c = llama_config_numbers(cfg)
    h, V, n_layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    backbone = V * h + n_layers * _layer_params(c) + h  # embeddings + layers + final RMSNorm
    if value_head:
        return backbone + h
    return backbone + (0 if c["tie_word_embeddings"] else V * h)  # lm_head shares the embedding when tied


# ---------------------------------------------------------------------------------------------------------
# Memory plan
# ---------------------------------------------------------------------------------------------------------
PHASES = ("generate", "policy train", "critic train", "reference fwd", "reward fwd")

# The paper's set-up (section 5): 8 × A100-80GB, ZeRO-2, bf16, gradient checkpointing; 128 prompts per PPO
# iteration = 16 per GPU, minibatch 32 = micro batch 4 per GPU; max length 2048 = 1024 prompt + 1024 response.
# Generation runs in chunks of 4 prompts per GPU: all 16 at once would need 16 GiB of KV cache for llama-7b
# and the plan says that does not fit next to four replicated 7B models.
PAPER_PRESET: dict[str, Any] = dict(num_gpus=8, gpu_mem_gb=80, zero_stage=2, dtype_bytes=2, micro_batch=4,
                                    rollout_batch_per_gpu=16, generate_batch_per_gpu=4, prompt_len=1024,
                                    response_len=1024, grad_ckpt=True, offload_optimizer=False,
                                    ref_reward_offload=False)


@dataclass
class Row:
    model: str                # policy | critic | reference | reward
    component: str            # weights | gradients | optimizer | activations | logits | kv_cache | gathered
                              # (LoRA: frozen | adapters | optimizer | activations | logits | kv_cache)
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
    cfg: dict
    reward_cfg: dict
    settings: dict
    n_params: dict[str, int]
    rows: list[Row]
    resident_bytes: int       # GPU bytes held the whole run
    phase_bytes: dict[str, int]  # extra GPU bytes while each phase runs
    peak_phase: str
    overhead_bytes: int
    total_bytes: int          # = resident + max(phase) + overhead
    capacity_bytes: int
    fits: bool
    cpu_bytes: int            # host RAM per GPU process (offloaded optimizer / frozen weights)
    suggestions: list[Suggestion] = field(default_factory=list)
    lora: dict | None = None  # with --lora-r R > 0: r, targets, modules, bits, trainable {"policy", "critic"}
    one_gpu: list[dict] = field(default_factory=list)  # one_gpu_table's cells (LoRA on one GPU)

    def get(self, model: str, component: str, device: str = "gpu") -> int:
        """Bytes of one row (0 when the plan has no such row)."""
        return sum(r.bytes for r in self.rows if (r.model, r.component, r.device) == (model, component, device))


def _layer_working_set(c: Mapping[str, Any], b: int, s: int, beta: int, flash: bool) -> tuple[int, str]:
    """One layer's activations while it runs: Korthikanti et al. 2022, eq. 1, s·b·h·(34 + 5·a·s/h) bytes at
    16 bits (scaled by β/2 otherwise). 34·s·b·h assumes an MLP of width 4h with dropout masks; LLaMA's SwiGLU
    (i ≈ 2.7h, three i-wide tensors, no dropout) stores about as much. With flash-style attention (SDPA /
    FlashAttention) the a·s² scores are never stored: the 5·a·s²·b term is dropped."""
    h, a = c["hidden_size"], c["num_attention_heads"]
    n = 34 * s * b * h + (0 if flash else 5 * a * s * s * b)
    return n * beta // 2, "34·b·L·h" + ("" if flash else " + 5·a·L²·b") + ("" if beta == 2 else f" ×{beta}/2")


# ---------------------------------------------------------------------------------------------------------
# LoRA (lora.py): a frozen backbone and its adapters
# ---------------------------------------------------------------------------------------------------------
LORA_BITS = (16, 8, 4)
KBIT_REST_BYTES = 4  # at 8 / 4 bits, per unquantized frozen weight (embeddings, norms, lm_head): fp32, frozen_bytes
_BITS_WORDS = {16: "bf16", 8: "8-bit (int8)", 4: "4-bit (NF4)"}  # 16: fp32 when planned with --fp32 (β = 4)
ADAPTER_BYTES = 16  # per trainable parameter: weight + gradient + Adam m, v (peft keeps adapters in fp32: 4+4+8)
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
    """{"per_rank": Σ over adapted layers (d_in + d_out), "layers", "modules", "model_type", "hidden_size"} for
    --lora-targets on cfg's architecture (alias, directory, dict of LlamaConfig numbers or a transformers config),
    counted by lora.count_trainable on a meta-device copy (no weights), once per architecture and spec. Each name
    of a comma-separated spec must match a linear layer, as training requires."""
    import lora

    if isinstance(cfg, Mapping):
        key: tuple = ("numbers", json.dumps(llama_config_numbers(cfg), sort_keys=True), spec)
    elif isinstance(cfg, (str, Path)):
        key = ("name", str(cfg), spec)
    else:
        key = ("config", cfg.to_json_string(use_diff=False), spec)
    if key not in _TARGETS:
        if isinstance(cfg, Mapping):
            from transformers import LlamaConfig
            config = LlamaConfig(**llama_config_numbers(cfg))
        else:
            config = hf_config(cfg) if isinstance(cfg, (str, Path)) else cfg
        modules = lora.target_modules(config.model_type, spec)
        for name in modules if isinstance(modules, list) else ():
            try:
                lora.count_trainable(config, 1, name)
            except ValueError:
                raise ValueError(f"--lora-targets {spec}: {name} matches no linear layer of this "
                                 f"{config.model_type} model") from None
        n = lora.count_trainable(config, 1, spec)  # at r = 1: Σ (d_in + d_out)
        _TARGETS[key] = dict(per_rank=n["adapters"], layers=n["layers"], model_type=config.model_type,
                             modules=modules if isinstance(modules, str) else ",".join(modules),
                             hidden_size=config.hidden_size)
    return _TARGETS[key]


def lora_trainable(cfg, r: int, spec: str = "auto", heads: int = 0) -> int:
    """n, the trainable parameters of LoRA rank r on cfg: the adapters A (r, d_in) and B (d_out, r) of every adapted
    layer, n = r·Σ(d_in + d_out), plus `heads` scalar heads of h + 1 (the reward model's, the critic's), trained in
    full. What the plan counts 16 bytes each for, and what peft's get_nb_trainable_parameters() reports."""
    t = _lora_targets(cfg, spec)
    return r * t["per_rank"] + heads * (t["hidden_size"] + 1)


def frozen_bytes(c: Mapping[str, Any], bits: int, beta: int) -> tuple[int, str]:
    """Bytes of one frozen causal LM under LoRA (N = llama_param_count(c)), and the formula.

    16 bits: β·N. At 8 and 4 bits bitsandbytes quantizes only the decoder layers' Linear weights,
    Q = ℓ·(h·a·d + 2·h·k·d + a·d·h + 3·h·i); it loads the rest, N − Q (embeddings, RMSNorms, lm_head), in bf16, and
    lora.add_adapters' prepare_model_for_kbit_training (peft) then upcasts that rest to fp32 for stable training:
    KBIT_REST_BYTES·(N − Q), 4 bytes each.
    8 bits (LLM.int8): Q bytes (its fp32 scale per output row, < 0.1 %, is not counted).
    4 bits (NF4 with double quantization, Dettmers et al. 2023): 4 bits + an 8-bit absmax per block of 64 + an fp32
    constant per 256 blocks = 4 + 8/64 + 32/16384 = 4.127 bits per weight, Q/2 + Q/64 + Q/4096 bytes."""
    N = llama_param_count(c)
    if bits == 16:
        return beta * N, f"{beta}·N"
    Q = c["num_hidden_layers"] * (_layer_params(c) - 2 * c["hidden_size"])  # each layer but its two norm weights
    q = Q if bits == 8 else Q // 2 + Q // 64 + Q // 4096
    return q + KBIT_REST_BYTES * (N - Q), ("Q" if bits == 8 else "4.127/8·Q") + f" + {KBIT_REST_BYTES}·(N − Q)"


def plan_memory(cfg: Mapping[str, Any] | str, *, num_gpus: int = 8, gpu_mem_gb: float = 80, zero_stage: int = 2,
                dtype_bytes: int = 2, micro_batch: int = 4, rollout_batch_per_gpu: int = 16,
                generate_batch_per_gpu: int = 4, prompt_len: int = 1024, response_len: int = 1024,
                grad_ckpt: bool = True, offload_optimizer: bool = False, ref_reward_offload: bool = False,
                flash_attention: bool = True, overhead_gb: float = 2.0,
                reward_cfg: Mapping[str, Any] | str | None = None, suggest: bool = True,
                lora_r: int = 0, lora_targets: str = "auto", lora_bits: int = 16) -> MemoryPlan:
    """Per-GPU memory of PPO's four models: policy and critic (trained), reference and reward model (frozen).

    cfg: the policy's (= reference's) config: alias, path, dict or LlamaConfig; reward_cfg: the reward model's
    (= critic's, which starts from it), default cfg. gpu_mem_gb is in GiB as nvidia-smi reports it (an
    A100-80GB shows 81920 MiB = 80 GiB). Defaults = PAPER_PRESET. Every number below is bytes per GPU.

    Held the whole run (N_pol = llama_param_count(cfg), N_rm = ... value_head=True, shards ÷G as noted):
        weights      β·N              ÷G with ZeRO-3 (all four models; frozen ones follow the stage, as in
                                      DeepSpeed-Chat); on the CPU for reference/reward with ref_reward_offload
        gradients    β·N              trained models only; ÷G with ZeRO-2 and 3
        optimizer    12·N             AdamW in mixed precision: fp32 master + m + v (8·N in pure fp32, β = 4);
                                      ÷G with ZeRO ≥ 1; on the CPU with offload_optimizer (ZeRO-Offload)
    Held only while one phase runs (the phases take turns; the peak is the largest):
        generate       kv_cache   2·ℓ·g·L·k·d·β   (K and V of every layer, g sequences grown to L = P + T)
        policy train   activations, with checkpointing: ℓ·b·L·h·β (each layer's input) + one layer's working
                       set while it is recomputed, 34·b·L·h (+ 5·a·L²·b without flash attention), Korthikanti
                       et al. 2022; without checkpointing: ℓ × the working set
                       logits     b·L·V·4         (fp32 for the log-softmax of the log-probs)
        critic train   activations as the policy (its h → 1 head has no V-wide logits)
        reference fwd  one layer's working set + logits b·L·V·4 (no grad: nothing is stored across layers;
                       scoring runs in chunks of b sequences)
        reward fwd     one layer's working set
        gathered       with ZeRO-3 or offloaded weights, 2 blocks of full bf16 weights live at a time
                       (current + prefetched; a block = the larger of one layer and the V·h embedding),
                       counted in every phase of that model
    Plus overhead_gb (CUDA context, NCCL and ZeRO bucket buffers, allocator fragmentation: a stated guess,
    2 GiB). The experience buffer (ids, log-probs, values, advantages: ~36 bytes per token, ~1 MB here) is
    ignored. total = resident + max over phases + overhead; fits = total ≤ gpu_mem_gb GiB.

    lora_r = R > 0 (lora.py): the rows of _lora_rows instead: two frozen backbones (policy = reference, critic =
    reward model), adapters, the same activations, logits and KV cache; with one GPU also plan.one_gpu.
    """
    settings = dict(num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, zero_stage=zero_stage, dtype_bytes=dtype_bytes,
                    micro_batch=micro_batch, rollout_batch_per_gpu=rollout_batch_per_gpu,
                    generate_batch_per_gpu=generate_batch_per_gpu, prompt_len=prompt_len,
                    response_len=response_len, grad_ckpt=grad_ckpt, offload_optimizer=offload_optimizer,
                    ref_reward_offload=ref_reward_offload, flash_attention=flash_attention, overhead_gb=overhead_gb,
                    lora_r=lora_r, lora_targets=lora_targets, lora_bits=lora_bits)
    check_lora(lora_r, lora_targets, lora_bits)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"plan_memory: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"plan_memory: dtype_bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes}")
    for k in ("num_gpus", "micro_batch", "generate_batch_per_gpu", "prompt_len", "response_len"):
        if settings[k] < 1:
            raise ValueError(f"plan_memory: {k} must be ≥ 1, got {settings[k]}")
    name = cfg if isinstance(cfg, str) else "custom"
    c = llama_config_numbers(cfg)
    rc = llama_config_numbers(reward_cfg) if reward_cfg is not None else c
    G, beta, b, g = num_gpus, dtype_bytes, micro_batch, generate_batch_per_gpu
    L = prompt_len + response_len
    opt_per_param = 12 if beta < 4 else 8
    n_params = {"policy": llama_param_count(c), "critic": llama_param_count(rc, value_head=True),
                "reference": llama_param_count(c), "reward": llama_param_count(rc, value_head=True)}
    rows: list[Row] = []
    lora_info = None

    def add(model: str, comp: str, n: int, formula: str, phases: tuple[str, ...] = (), device: str = "gpu"):
        rows.append(Row(model, comp, int(n), device, phases, formula))

    if lora_r:
        rows, n_params, lora_info = _lora_rows(cfg, reward_cfg, c, rc, settings)
    else:
        for model in ("policy", "critic", "reference", "reward"):
            mc = c if model in ("policy", "reference") else rc
            N = n_params[model]
            h, n_layers, V = mc["hidden_size"], mc["num_hidden_layers"], mc["vocab_size"]
            trained = model in ("policy", "critic")
            train_phase = f"{model} train" if trained else f"{model} fwd"
            my_phases = ("generate", "policy train") if model == "policy" else (train_phase,)
            # weights
            if not trained and ref_reward_offload:
                add(model, "weights", beta * N // G, f"{beta}·N/{G} (ZeRO-3 offload)", device="cpu")
            elif zero_stage == 3:
                add(model, "weights", beta * N // G, f"{beta}·N/{G}")
            else:
                add(model, "weights", beta * N, f"{beta}·N")
            sharded = zero_stage == 3 or (not trained and ref_reward_offload)
            if sharded:
                block = max(_layer_params(mc), V * h)
                add(model, "gathered", 2 * block * beta, f"2·{beta}·max(layer, V·h)", my_phases)
            if trained:
                # gradients and optimizer states
                gd = G if zero_stage >= 2 else 1
                add(model, "gradients", beta * N // gd, f"{beta}·N" + (f"/{G}" if gd > 1 else ""))
                od = G if zero_stage >= 1 else 1
                add(model, "optimizer", opt_per_param * N // od, f"{opt_per_param}·N" + (f"/{od}" if od > 1 else ""),
                    device="cpu" if offload_optimizer else "gpu")
                # activations for training
                ws, ws_formula = _layer_working_set(mc, b, L, beta, flash_attention)
                if grad_ckpt:
                    add(model, "activations", n_layers * b * L * h * beta + ws,
                        f"ℓ·b·L·h·{beta} + {ws_formula}", (train_phase,))
                else:
                    add(model, "activations", n_layers * ws, f"ℓ·({ws_formula})", (train_phase,))
            else:
                ws, ws_formula = _layer_working_set(mc, b, L, beta, flash_attention)
                add(model, "activations", ws, ws_formula + " (no grad)", (train_phase,))
            if model in ("policy", "reference"):
                add(model, "logits", b * L * V * 4, "b·L·V·4", (train_phase,))
            if model == "policy":
                k, d = mc["num_key_value_heads"], mc["head_dim"]
                add(model, "kv_cache", 2 * n_layers * g * L * k * d * beta, f"2·ℓ·g·L·k·d·{beta}", ("generate",))

    resident = sum(r.bytes for r in rows if r.device == "gpu" and not r.phases)
    phase_bytes = {p: sum(r.bytes for r in rows if r.device == "gpu" and p in r.phases) for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: phase_bytes[p])
    overhead = int(overhead_gb * GiB)
    total = resident + phase_bytes[peak_phase] + overhead
    capacity = int(gpu_mem_gb * GiB)
    plan = MemoryPlan(name=name, cfg=c, reward_cfg=rc, settings=settings, n_params=n_params, rows=rows,
                      resident_bytes=resident, phase_bytes=phase_bytes, peak_phase=peak_phase,
                      overhead_bytes=overhead, total_bytes=total, capacity_bytes=capacity, fits=total <= capacity,
                      cpu_bytes=sum(r.bytes for r in rows if r.device == "cpu"), lora=lora_info)
    if suggest and not plan.fits:
        plan.suggestions = _suggestions(lambda s: plan_memory(cfg, reward_cfg=reward_cfg, suggest=False, **s).total_bytes,
                                        settings, total, capacity)
    if suggest and lora_r and num_gpus == 1:
        plan.one_gpu = one_gpu_table(cfg, reward_cfg=reward_cfg, **settings)
    return plan


def _lora_rows(cfg, reward_cfg, c: dict, rc: dict, s: dict) -> tuple[list[Row], dict[str, int], dict]:
    """PPO's rows under LoRA, per GPU (every GPU holds all of it: data parallel, nothing sharded).

    Two frozen backbones, not four: the policy's (SFT weights; the reference is the policy with its adapters off)
    and the critic's (the reward model's weights and its frozen h → 1 head; the reward model is the critic with its
    adapters off). Both keep lm_head (reward_model.ScalarHeadModel wraps the causal LM): N = llama_param_count.
        frozen       frozen_bytes(N, bits): β·N, or quantized at 8 / 4 bits; no gradient, no optimizer state
        adapters     8·n   fp32 weight + gradient of the n = lora_trainable(...) trainable parameters
        optimizer    8·n   Adam m and v in fp32 (16 bytes per trainable parameter in all)
    The phases are plan_memory's: activations with gradient checkpointing ℓ·b·L·h·β + one layer's working set
    (the frozen layers still pass gradients to the adapters below them), logits b·L·V·4, KV cache 2·ℓ·g·L·k·d·β."""
    beta, b, g, L = s["dtype_bytes"], s["micro_batch"], s["generate_batch_per_gpu"], s["prompt_len"] + s["response_len"]
    r, spec, bits = s["lora_r"], s["lora_targets"], s["lora_bits"]
    rcfg = cfg if reward_cfg is None else reward_cfg
    n = {"policy": lora_trainable(cfg, r, spec), "critic": lora_trainable(rcfg, r, spec, heads=1)}
    n_params = {"policy": llama_param_count(c), "critic": llama_param_count(rc) + rc["hidden_size"] + 1}
    n_params.update(reference=n_params["policy"], reward=n_params["critic"])  # the same weights, held once
    rows: list[Row] = []

    def add(model: str, comp: str, nbytes: int, formula: str, phases: tuple[str, ...] = ()):
        rows.append(Row(model, comp, int(nbytes), "gpu", phases, formula))

    for model, mc in (("policy", c), ("critic", rc)):
        h, n_layers, V = mc["hidden_size"], mc["num_hidden_layers"], mc["vocab_size"]
        fb, formula = frozen_bytes(mc, bits, beta)
        if model == "policy":
            add(model, "frozen", fb, formula + "   (= the reference: adapters off)")
        else:
            add(model, "frozen", fb + beta * (h + 1), formula + f" + {beta}·(h+1)   (= the reward model + its head)")
        add(model, "adapters", 8 * n[model], f"8·n   (n = {n[model]:,}: fp32 weight + gradient)")
        add(model, "optimizer", 8 * n[model], "8·n   (Adam m, v)")
        ws, ws_formula = _layer_working_set(mc, b, L, beta, s["flash_attention"])
        train, fwd = f"{model} train", "reference fwd" if model == "policy" else "reward fwd"
        if s["grad_ckpt"]:
            add(model, "activations", n_layers * b * L * h * beta + ws, f"ℓ·b·L·h·{beta} + {ws_formula}", (train,))
        else:
            add(model, "activations", n_layers * ws, f"ℓ·({ws_formula})", (train,))
        ref = "reference" if model == "policy" else "reward"
        add(ref, "activations", ws, ws_formula + " (no grad)", (fwd,))
        if model == "policy":
            add(model, "logits", b * L * V * 4, "b·L·V·4", (train,))
            add(ref, "logits", b * L * V * 4, "b·L·V·4", (fwd,))
            k, d = mc["num_key_value_heads"], mc["head_dim"]
            add(model, "kv_cache", 2 * n_layers * g * L * k * d * beta, f"2·ℓ·g·L·k·d·{beta}", ("generate",))
    order = {m: i for i, m in enumerate(("policy", "critic", "reference", "reward"))}
    rows.sort(key=lambda row: order[row.model])
    t = _lora_targets(cfg, spec)
    info = dict(r=r, targets=spec, modules=t["modules"] + (" (auto)" if spec == "auto" else ""), bits=bits,
                trainable=n, layers=t["layers"])
    return rows, n_params, info


def plan_stage_memory(cfg: Mapping[str, Any] | str, stage: str, *, num_gpus: int = 8, gpu_mem_gb: float = 80,
                      zero_stage: int = 2, dtype_bytes: int = 2, micro_batch: int = 4, prompt_len: int = 1024,
                      response_len: int = 1024, grad_ckpt: bool = True, offload_optimizer: bool = False,
                      flash_attention: bool = True, overhead_gb: float = 2.0, lora_r: int = 0,
                      lora_targets: str = "auto", lora_bits: int = 16, suggest: bool = True, **_ignored) -> dict:
    """Per-GPU memory of stage 1 (stage="sft") or stage 2 ("rm"): one trained model and nothing beside it.

    Same terms as plan_memory's policy: weights β·N, gradients β·N (÷G with ZeRO ≥ 2), AdamW 12·N (÷G with ZeRO ≥ 1;
    on the CPU with offload), activations with checkpointing ℓ·s·L·h·β + one layer's working set, where s sequences
    of L = P + T tokens go through per step: s = b for SFT, s = 2b for the reward model (chosen and rejected of b
    pairs in one batch). Logits: SFT b·L·V·β plus the fp32 log-softmax b·L·V·4; the reward model computes them for
    all 2b sequences (2b·L·V·β) and upcasts the chosen half for Eq. 2's LM term (b·L·V·4). The reward model keeps
    its LM head (Eq. 2 needs it): N = the causal LM's parameters + the h + 1 of the scalar head.

    lora_r = R > 0: the weights are frozen, frozen_bytes(N, bits) (bf16, or 8 / 4 bits), held once per GPU with no
    gradient and no optimizer state; the n = lora_trainable(cfg, R, targets) adapters (+ the reward model's h + 1
    head) cost 8·n for their fp32 weights and gradients and 8·n for Adam's m and v. Activations and logits as above.
    Every GPU holds all of it (ZeRO and offload do not apply). With suggest, "suggestions" when it does not fit."""
    if stage not in ("sft", "rm"):
        raise ValueError(f"plan_stage_memory: stage must be 'sft' or 'rm', got {stage!r}")
    check_lora(lora_r, lora_targets, lora_bits)
    c = llama_config_numbers(cfg)
    G, beta, b, L = num_gpus, dtype_bytes, micro_batch, prompt_len + response_len
    h, n_layers, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    N = llama_param_count(c) + (h + 1 if stage == "rm" else 0)
    s = b if stage == "sft" else 2 * b
    ws, _ = _layer_working_set(c, s, L, beta, flash_attention)
    activations = (n_layers * s * L * h * beta + ws) if grad_ckpt else n_layers * ws
    logits = s * L * V * beta + b * L * V * 4
    if not lora_r:
        rows = {"weights": beta * N // (G if zero_stage == 3 else 1),
                "gradients": beta * N // (G if zero_stage >= 2 else 1),
                "optimizer": 0 if offload_optimizer else (12 if beta < 4 else 8) * N // (G if zero_stage >= 1 else 1),
                "activations": activations, "logits": logits, "overhead": int(overhead_gb * GiB)}
        total = sum(rows.values())
        return {"stage": stage, "n_params": N, "sequences_per_step": s, "rows": rows, "total_bytes": total,
                "capacity_bytes": int(gpu_mem_gb * GiB), "fits": total <= gpu_mem_gb * GiB}
    n = lora_trainable(cfg, lora_r, lora_targets, heads=1 if stage == "rm" else 0)
    frozen, _ = frozen_bytes(c, lora_bits, beta)
    rows = {"frozen": frozen, "adapters": 8 * n, "optimizer": 8 * n,  # 16 bytes per trainable parameter
            "activations": activations, "logits": logits, "overhead": int(overhead_gb * GiB)}
    total = sum(rows.values())
    settings = dict(num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, zero_stage=zero_stage, dtype_bytes=dtype_bytes,
                    micro_batch=micro_batch, prompt_len=prompt_len, response_len=response_len, grad_ckpt=grad_ckpt,
                    offload_optimizer=offload_optimizer, flash_attention=flash_attention, overhead_gb=overhead_gb,
                    lora_r=lora_r, lora_targets=lora_targets, lora_bits=lora_bits)
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
    """(change in words, overrides, changes the experiment?) for every single step that could save memory. Under
    LoRA nothing is sharded or offloaded: the steps are the rank, the frozen weights' bits and the batch shapes."""
    out = []
    if s.get("lora_r"):
        return _lora_candidates(s) + _shape_candidates(s)
    if not s["offload_optimizer"]:
        out.append(("offload optimizer states to CPU (ZeRO-Offload, offload_optimizer)",
                    {"offload_optimizer": True}, False))
    for z in (2, 3):
        if s["zero_stage"] < z:
            what = "gradients and optimizer" if z == 2 else "weights of all four models too; generation slows"
            out.append((f"ZeRO-{z} (shards {what})", {"zero_stage": z}, False))
    if not s["ref_reward_offload"]:
        out.append(("keep reference and reward model on CPU (ZeRO-3 parameter offload)",
                    {"ref_reward_offload": True}, False))
    return out + _shape_candidates(s)


def _shape_candidates(s: dict) -> list[tuple[str, dict, bool]]:
    out = []
    if not s["grad_ckpt"]:
        out.append(("turn on gradient checkpointing", {"grad_ckpt": True}, False))
    if s["micro_batch"] > 1:
        m = s["micro_batch"]
        out.append((f"micro batch {m} → {m // 2} (double gradient accumulation: same minibatch)",
                    {"micro_batch": m // 2}, False))
    if s.get("generate_batch_per_gpu", 1) > 1:
        g = s["generate_batch_per_gpu"]
        out.append((f"generate in chunks of {g // 2} prompts per GPU instead of {g}",
                    {"generate_batch_per_gpu": g // 2}, False))
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
    greedy combinations (largest saving first, changes that keep the experiment before shorter rollouts) until the
    plan fits."""
    out = []
    for change, over, _ in _candidates(settings):
        t = run({**settings, **over})
        if t < total:
            out.append(Suggestion(change, over, t, total - t, t <= capacity))
    out.sort(key=lambda x: -x.saves_bytes)
    if any(x.fits for x in out):
        return out
    s, steps, cur = dict(settings), [], total
    for allow_experiment in (False, True):
        for _ in range(20):
            best = None
            for change, over, changes_experiment in _candidates(s):
                if changes_experiment and not allow_experiment:
                    continue
                t = run({**s, **over})
                if t < cur and (best is None or t < best[2]):
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


# ---- hook for the critic-free estimators (critic_free.py): the plan without the critic's rows -------------------
def without_critic(plan: MemoryPlan) -> tuple[int, int]:
    """(peak bytes per GPU, bytes saved) of `plan` for a run with no critic (train.py --advantage grpo, rloo, ...):
    the critic's weights, gradients, optimizer states and training activations go; under LoRA its frozen backbone
    stays, as the reward model it shares weights with. Recomputed as plan_memory sums: resident + the largest phase
    + overhead."""
    keep = [r for r in plan.rows if r.model != "critic" or (plan.lora and r.component == "frozen")]
    resident = sum(r.bytes for r in keep if r.device == "gpu" and not r.phases)
    phase = max(sum(r.bytes for r in keep if r.device == "gpu" and p in r.phases) for p in PHASES)
    total = resident + phase + plan.overhead_bytes
    return total, plan.total_bytes - total


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table (GiB per GPU), the total, fits yes/no, and the suggestions (LoRA on one GPU: and the
    one-GPU table)."""
    s, c = plan.settings, plan.cfg
    gib = lambda n: f"{n / GiB:8.2f}"  # noqa: E731
    lines = _lora_header(plan) if plan.lora else [
        f"Memory plan per GPU: {plan.name} (policy/reference {plan.n_params['policy'] / 1e9:.2f} B params, "
        f"critic/reward {plan.n_params['reward'] / 1e9:.2f} B; h={c['hidden_size']}, ℓ={c['num_hidden_layers']}, "
        f"a={c['num_attention_heads']}, k={c['num_key_value_heads']}, V={c['vocab_size']})",
        f"  {s['num_gpus']} GPUs × {s['gpu_mem_gb']} GiB, ZeRO-{s['zero_stage']}, "
        f"{'bf16' if s['dtype_bytes'] == 2 else 'fp32'}, grad ckpt {'on' if s['grad_ckpt'] else 'off'}, "
        f"flash attention {'on' if s['flash_attention'] else 'off'}, micro batch b={s['micro_batch']}, "
        f"{s['rollout_batch_per_gpu']} prompts/GPU generated g={s['generate_batch_per_gpu']} at a time, "
        f"L = {s['prompt_len']} + {s['response_len']}, optimizer offload {'on' if s['offload_optimizer'] else 'off'}"
        f", ref/reward offload {'on' if s['ref_reward_offload'] else 'off'}",
    ]
    lines.append(f"  {'model':10s} {'component':12s} {'GiB':>8s}  {'held':22s} formula")
    for r in plan.rows:
        if r.device == "gpu":
            held = "always" if not r.phases else ", ".join(r.phases)
            lines.append(f"  {r.model:10s} {r.component:12s} {gib(r.bytes)}  {held:22s} {r.formula}")
    lines.append(f"  {'held always':23s} {gib(plan.resident_bytes)}")
    for p in PHASES:
        mark = "  ← peak" if p == plan.peak_phase else ""
        lines.append(f"  {'+ while ' + p:23s} {gib(plan.phase_bytes[p])}{mark}")
    lines.append(f"  {'+ overhead':23s} {gib(plan.overhead_bytes)}  (CUDA context, NCCL/ZeRO buffers, fragmentation)")
    lines.append(f"  {'peak per GPU':23s} {gib(plan.total_bytes)}  of {plan.capacity_bytes / GiB:.2f} GiB → "
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


def _lora_header(plan: MemoryPlan) -> list[str]:
    s, c, lo = plan.settings, plan.cfg, plan.lora
    n = lo["trainable"]
    h_rm = plan.reward_cfg["hidden_size"]
    return [
        f"Memory plan per GPU: {plan.name} with LoRA r={lo['r']} on {lo['modules']} ({lo['layers']} adapted "
        f"layers), frozen weights {_frozen_words(lo['bits'], s['dtype_bytes'])} (policy = reference "
        f"{plan.n_params['policy'] / 1e9:.2f} B params, critic = reward model {plan.n_params['critic'] / 1e9:.2f} B; "
        f"h={c['hidden_size']}, ℓ={c['num_hidden_layers']}, a={c['num_attention_heads']}, "
        f"k={c['num_key_value_heads']}, V={c['vocab_size']})",
        f"  {s['num_gpus']} GPU{'s' if s['num_gpus'] > 1 else ''} × {s['gpu_mem_gb']} GiB, each holding every model "
        f"(LoRA: ZeRO and offload flags do not apply), grad ckpt {'on' if s['grad_ckpt'] else 'off'}, "
        f"flash attention {'on' if s['flash_attention'] else 'off'}, micro batch b={s['micro_batch']}, "
        f"{s['rollout_batch_per_gpu']} prompts/GPU generated g={s['generate_batch_per_gpu']} at a time, "
        f"L = {s['prompt_len']} + {s['response_len']}",
        f"  trainable, {ADAPTER_BYTES} bytes each with Adam: policy adapters {n['policy']:,}; critic adapters "
        f"{n['critic'] - h_rm - 1:,} + value head {h_rm + 1:,} = {n['critic']:,}. Two frozen backbones, not four: "
        f"the reference is the policy with its adapters off, the reward model the critic's backbone with its adapters "
        f"off and its own frozen head",
    ]


# ---------------------------------------------------------------------------------------------------------
# One GPU with LoRA: which GPU holds PPO-max, at which bits
# ---------------------------------------------------------------------------------------------------------
ONE_GPU_MEMS = (24, 48, 80)  # GiB: RTX 4090 / A10-class, A6000 / L40S, A100-80GB / H100


def one_gpu_table(cfg, *, reward_cfg=None, gpu_mems: tuple = ONE_GPU_MEMS, bits: tuple = LORA_BITS,
                  **settings) -> list[dict]:
    """PPO-max with LoRA on one GPU: for each GPU memory M (GiB) and frozen-weight bits, the peak over its stages,
    max(SFT, reward model, PPO) total bytes, at the settings' rank, targets, micro batch and lengths (plan_memory's
    keywords; lora_r > 0). Critic pre-training holds PPO's models and trains only the critic: never above PPO.

    Returns cells {"gpu_mem_gb", "lora_bits", "total_bytes", "peak_stage", "stage_bytes", "fits"}, row by row
    (M ascending, bits descending); fits = total_bytes ≤ M GiB."""
    s = {k: v for k, v in settings.items() if k not in ("lora_bits", "gpu_mem_gb", "num_gpus")}
    if s.get("lora_r", 0) < 1:
        raise ValueError(f"--lora-r {s.get('lora_r', 0)}: the one-GPU table is for LoRA; pass --lora-r R (e.g. 16)")
    cells = []
    for q in bits:
        stage_bytes = {
            "SFT": plan_stage_memory(cfg, "sft", num_gpus=1, lora_bits=q, suggest=False, **s)["total_bytes"],
            "reward model": plan_stage_memory(cfg, "rm", num_gpus=1, lora_bits=q, suggest=False, **s)["total_bytes"],
            "PPO": plan_memory(cfg, reward_cfg=reward_cfg, num_gpus=1, lora_bits=q, suggest=False, **s).total_bytes}
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
    lines = [f"One GPU, LoRA r={s['lora_r']}{' on ' + modules if modules else ''}, micro batch b={s['micro_batch']}, "
             f"g={s.get('generate_batch_per_gpu', 1)}, L = {s['prompt_len']} + {s['response_len']}: PPO-max's peak "
             f"stage (max of SFT, reward model, PPO), GiB",
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
PAPER_DS_KWARGS: dict[str, Any] = dict(zero_stage=2, bf16=True, train_micro_batch_size_per_gpu=4,
                                       gradient_accumulation_steps=1, gradient_clipping=1.0)


def deepspeed_config(*, zero_stage: int = 2, bf16: bool = True, train_micro_batch_size_per_gpu: int,
                     gradient_accumulation_steps: int, gradient_clipping: float, offload_optimizer: bool = False,
                     lr: float | None = None, weight_decay: float = 0.0) -> dict:
    """DeepSpeed JSON for a trained engine (policy or critic): ZeRO stage, bf16 (fp32 when bf16=False, e.g. on
    the CPU), global gradient-norm clipping (paper section 5.4), optional optimizer offload to the CPU."""
    zero: dict[str, Any] = {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
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
def add_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plan's flags (defaults = PAPER_PRESET), shared with `train.py --plan`."""
    p = PAPER_PRESET
    a = parser.add_argument
    a("--num-gpus", type=int, default=p["num_gpus"], help="GPUs in the whole job (G)")
    a("--gpu-mem", type=float, default=p["gpu_mem_gb"], help="memory of one GPU in GiB (A100-80GB = 80)")
    a("--zero-stage", type=int, default=p["zero_stage"], choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage")
    a("--fp32", action="store_true", help="plan for fp32 instead of bf16 (β = 4)")
    a("--micro-batch", type=int, default=p["micro_batch"], help="training sequences per GPU per step (b)")
    a("--rollout-batch-per-gpu", type=int, default=p["rollout_batch_per_gpu"], help="prompts per GPU per PPO iteration")
    a("--generate-batch-per-gpu", type=int, default=p["generate_batch_per_gpu"], help="prompts generated at once (g)")
    a("--prompt-len", type=int, default=p["prompt_len"], help="prompt tokens (P)")
    a("--response-len", type=int, default=p["response_len"], help="response tokens (T)")
    a("--no-grad-ckpt", action="store_true", help="plan without gradient checkpointing")
    a("--offload-optimizer", action="store_true", help="optimizer states on the CPU (ZeRO-Offload)")
    a("--ref-reward-offload", action="store_true", help="reference and reward weights on the CPU")
    a("--no-flash-attention", action="store_true", help="count the a·L² attention scores")
    a("--overhead-gb", type=float, default=2.0, help="CUDA context, buffers, fragmentation (GiB)")
    a("--lora-r", type=int, default=0, help="LoRA rank r: plan frozen weights + adapters (0 = full fine-tuning)")
    a("--lora-targets", default="auto", help="layers with adapters: 'auto' (peft's default: q_proj,v_proj for "
      "LLaMA), 'all-linear', or names such as q_proj,k_proj,v_proj,o_proj")
    a("--lora-bits", type=int, default=16, help="frozen weights under LoRA: 16 (bf16), 8 or 4 (NF4, QLoRA); "
      "8 and 4 need bitsandbytes on a CUDA GPU")
    return parser


def _lora_args(args: argparse.Namespace) -> dict:
    return dict(lora_r=getattr(args, "lora_r", 0), lora_targets=getattr(args, "lora_targets", "auto"),
                lora_bits=getattr(args, "lora_bits", 16))


def stage_plans_from_args(model: str, args: argparse.Namespace) -> list[dict]:
    return [plan_stage_memory(model, stage, num_gpus=args.num_gpus, gpu_mem_gb=args.gpu_mem,
                              zero_stage=args.zero_stage, dtype_bytes=4 if args.fp32 else 2,
                              micro_batch=args.micro_batch, prompt_len=args.prompt_len, response_len=args.response_len,
                              grad_ckpt=not args.no_grad_ckpt, offload_optimizer=args.offload_optimizer,
                              flash_attention=not args.no_flash_attention, overhead_gb=args.overhead_gb,
                              **_lora_args(args))
            for stage in ("sft", "rm")]


def plan_from_args(model: str, args: argparse.Namespace, reward_model: str | None = None) -> MemoryPlan:
    return plan_memory(model, reward_cfg=reward_model, num_gpus=args.num_gpus, gpu_mem_gb=args.gpu_mem,
                       zero_stage=args.zero_stage, dtype_bytes=4 if args.fp32 else 2, micro_batch=args.micro_batch,
                       rollout_batch_per_gpu=args.rollout_batch_per_gpu,
                       generate_batch_per_gpu=args.generate_batch_per_gpu, prompt_len=args.prompt_len,
                       response_len=args.response_len, grad_ckpt=not args.no_grad_ckpt,
                       offload_optimizer=args.offload_optimizer, ref_reward_offload=args.ref_reward_offload,
                       flash_attention=not args.no_flash_attention, overhead_gb=args.overhead_gb,
                       **_lora_args(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-7b", help="alias, hub id (local cache) or model directory")
    parser.add_argument("--reward-model", default=None, help="reward model (= critic) if it differs from --model")
    parser.add_argument("--ds-config", action="store_true", help="also print the DeepSpeed JSON for a trained engine")
    args = add_plan_args(parser).parse_args(argv)
    try:
        plan = plan_from_args(args.model, args, args.reward_model)
        stage_plans = stage_plans_from_args(args.model, args) if args.lora_r else []
    except (ModelNotFound, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if stage_plans:  # LoRA: the reward model's 2b sequences per step can make stage 2 the peak
        print(format_stage_plans(stage_plans))
    print(format_plan(plan))
    if args.ds_config:
        print(json.dumps(deepspeed_config(zero_stage=args.zero_stage, bf16=not args.fp32,
                                          train_micro_batch_size_per_gpu=args.micro_batch,
                                          gradient_accumulation_steps=1, gradient_clipping=1.0,
                                          offload_optimizer=args.offload_optimizer), indent=2))


if __name__ == "__main__":
    # Worked example: `python scale.py` = the paper preset for llama-7b (8 × A100-80GB, ZeRO-2, bf16, gradient
    # checkpointing, micro batch 4, 16 prompts per GPU generated 4 at a time, L = 1024 + 1024). Printed
    # (tests/test_scale.py checks 71.47 and 77.51):
    #   policy     weights         12.55  always                 2·N          (N = 6,738,415,616)
    #   policy     gradients        1.57  always                 2·N/8
    #   policy     optimizer        9.41  always                 12·N/8
    #   policy     activations      3.06  policy train           ℓ·b·L·h·2 + 34·b·L·h
    #   policy     logits           0.98  policy train           b·L·V·4
    #   policy     kv_cache         4.00  generate               2·ℓ·g·L·k·d·2
    #   critic     weights         12.31  always                 2·N          (N = 6,607,347,712: no lm_head)
    #   ... (critic gradients 1.54, optimizer 9.23, activations 3.06; reference weights 12.55, reward 12.31)
    #   held always                71.47
    #   + while policy train        4.04  ← peak      (generate 4.00, critic train 3.06, reference fwd 2.04)
    #   + overhead                  2.00
    #   peak per GPU               77.51  of 80.00 GiB → fits
    # With `--generate-batch-per-gpu 16` (all 16 prompts at once) the KV cache is 16 GiB and the peak 89.47 GiB:
    # does not fit. With `--gpu-mem 24`, ZeRO-3 + optimizer offload together bring it to 16.11 GiB.
    # With LoRA on one GPU (`--num-gpus 1 --gpu-mem 24 --lora-r 16`): two frozen bf16 backbones of 12.55 GiB, and
    # 8,388,608 + 8,392,705 trainable adapter and head parameters at 16 bytes each (0.25 GiB), peak 31.39 GiB, so it
    # does not fit; `--lora-bits 4` brings it to 14.47 GiB (tests/test_scale.py checks both; docs/one-gpu.md).
    main(sys.argv[1:])
