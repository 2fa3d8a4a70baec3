"""Every causal LM of the pinned transformers through every stage: each model type of its causal-LM mapping is built
small on the CPU, sampled from, and run through SFT, the reward model, critic pre-training and PPO by `train.main`,
and docs/architectures.md says, per architecture and stage, what works, what fails and why.

Implements (no equation: the real-model path's coverage):
    model_types()                → transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, every model type it lists
    small_config(type, tok)      → the architecture's own config class at its defaults, shrunk (hidden 64, 2 layers,
                                   4 heads, 2 KV heads, head dim 16, 4 experts of which 2 per token, sliding window
                                   32, one layer of each kind in a layer-type list), plus OVERRIDES where an
                                   architecture needs a detail of its own; the vocabulary is the tokenizer's
    probe(model, tok)            → what transformers itself can do with it on the CPU: sample from a left-padded
                                   batch of text (else the stages are not applicable)
    run_stages(type, work)       → `train.main(["--model", DIR, "--data", PAIRS, ...])` with one rollout minibatch and
                                   one PPO epoch; per stage ok / fails (one line) / not reached, and the first
                                   update's ppo/ratio and ppo/approx_kl, which must be 1 and 0
    write_doc(results, path)     → docs/architectures.md: the counts, then one row per model type

Run: python tools/architectures.py                         (all of them; resumable, results in runs/architectures/)
     python tools/architectures.py --only llama,gpt2 --redo  (again, for these two)
     python tools/architectures.py --doc-only               (docs/architectures.md from the results so far)

Each architecture runs in its own process with a timeout, so a hang or a crash ends that row, not the sweep. Slow
(about a minute per architecture on one core): it is not part of the test suite, which runs a fixed sample of five
(tests/test_architectures.py).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))  # tiny_model

STAGES = ("sft", "rm", "critic", "ppo", "eval")
HH = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"

# The shrunk sizes, and the names configs give them (only fields the config class has, with an int default, are set)
SIZES = {
    "hidden": (64, ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim", "dim", "emb_dim",
                    "embedding_dim")),
    "layers": (2, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_blocks")),
    "heads": (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")),
    "kv_heads": (2, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")),
    "head_dim": (16, ("head_dim", "attention_head_dim", "kv_channels", "dim_head", "qk_head_dim", "v_head_dim",
                      "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                      "swa_head_dim")),
    "intermediate": (128, ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "d_ff", "dim_ff", "dff",
                           "ffn_hidden_size")),
    "expert_intermediate": (64, ("moe_intermediate_size", "shared_expert_intermediate_size",
                                 "shared_intermediate_size", "shared_experts_intermediate_size",
                                 "expert_ffn_hidden_size")),
    "positions": (512, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")),
    "experts": (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    "zero_experts": (2, ("zero_expert_num",)),  # LongCat's identity experts, on top of the routed ones
    "experts_per_token": (2, ("num_experts_per_tok", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_k")),
    "groups": (1, ("n_group", "topk_group", "num_expert_group")),
    "shared_experts": (1, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")),
    "dense_first": (1, ("first_k_dense_replace", "num_dense_layers")),
    "window": (32, ("sliding_window", "sliding_window_size", "local_attention_window_len", "window_size")),
    "mla_rank": (32, ("kv_lora_rank", "q_lora_rank", "o_lora_rank")),
    "rope_head_dim": (8, ("qk_rope_head_dim", "qk_nope_head_dim")),
    "state": (8, ("state_size", "mamba_d_state", "ssm_state_size", "d_state")),
    "linear_heads": (2, ("linear_num_key_heads", "linear_num_value_heads", "index_n_heads", "swa_num_key_value_heads")),
    "swa_heads": (4, ("swa_num_attention_heads", "linear_num_heads")),
    "index_topk": (16, ("index_topk",)),
    "time_step_rank": (8, ("time_step_rank", "mamba_dt_rank")),
    "rotary_dim": (8, ("rotary_dim",)),
    "kv_shared_layers": (0, ("num_kv_shared_layers",)),
    "lru_width": (64, ("lru_width",)),
    "attention_window": (32, ("attention_window_size",)),
    "mamba_head_dim": (16, ("mamba_d_head",)),
}

# Per-architecture details the generic shrink gets wrong (a field of the config class: value), found by the sweep
OVERRIDES: dict[str, dict] = {
    "mamba2": dict(num_heads=8, n_groups=1),          # num_heads · head_dim = expand · hidden (2 · 64)
    "zaya": dict(num_experts_per_tok=1),              # ZAYA routes each token to one expert only
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # DbrxAttention reads both; no usable default
    "bamba": dict(attn_layer_indices=[1]),            # layer 0 Mamba-2, layer 1 attention (default: none)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),           # layer 0 Mamba dense, layer 1 attention MoE; no CUDA kernels
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # default: Mamba-2 layers only
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # None by default, which the model indexes
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),  # the sparse-attention indexer of its indexed layers
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=128, attention_head_dim=32, use_mamba_kernels=False),  # the shared block
    # of the hybrid layers is tied across them: transformers finds nothing to tie with a single hybrid layer
    "xlstm": dict(qk_dim_factor=1.0),  # at its default 0.5 transformers' recurrent step fails (a square state assumed)
    "xmod": dict(default_language="en_XX"),           # its language adapters: one must be chosen
    "xlm": dict(causal=True),                         # XLM's LM head, as a left-to-right model
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32], attention_head_size=16,
                     feed_forward_size=128, local_attn_chunk_length=16, lsh_attn_chunk_length=16, num_buckets=8),
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,  # input, looped
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "dots3_note_text": dict(head_dim=16),             # its sliding-window layers: head_dim = nope + rope dims
    "blt": dict(encoder_hash_byte_group_vocab=1024, encoder_config=dict(hidden_size_global=64),
                decoder_config=dict(hidden_size_global=64)),  # byte n-gram hash tables and the global model's width
    "falcon_h1": dict(mamba_d_ssm=128),               # the Mamba-2 width: n_heads · d_head = 8 · 16
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # None by default
}
OVERRIDES["qwen4_exp"] = {"text_config": OVERRIDES["qwen4_exp_text"]}
OVERRIDES["dots3_note"] = {"text_config": OVERRIDES["dots3_note_text"],  # the encoders' adapters: into hidden 64
                           "vision_config": dict(adapter_in_dim=64, adapter_out_dim=64),
                           "audio_config": dict(adapter_input_size=64, adapter_out_dim=64)}

# Which tokenizer conventions (tools/tiny_model.STYLES) each family gets: a pad token or none, BOS or none, a template
GPT2_STYLE = {"gpt2", "gpt-sw3", "gpt_bigcode", "gpt_neo", "gptj", "codegen", "bloom", "opt", "falcon", "mpt", "xglm",
              "biogpt", "ctrl", "openai-gpt", "rwkv", "mamba", "mamba2", "falcon_mamba", "gpt_neox_japanese",
              "persimmon", "phi", "stablelm", "starcoder2", "mellum", "xlstm"}


def style(model_type: str) -> str:
    if model_type in GPT2_STYLE:
        return "gpt2"
    if model_type in ("gpt_neox", "olmo", "olmoe", "olmo2", "olmo3", "olmo_hybrid", "flex_olmo"):
        return "gpt_neox"
    if model_type.startswith("qwen"):
        return "qwen2"
    if model_type.startswith(("mistral", "mixtral", "ministral")):
        return "mistral"
    return "llama"


def model_types() -> dict[str, str]:
    """{model type: the class name transformers builds for it} of the pinned transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ---------------------------------------------------------------------------------------------------------
# A small config of each architecture
# ---------------------------------------------------------------------------------------------------------
def shrunk(config_cls, extra: dict, token_ids: dict | None) -> dict:
    """The keyword arguments that make `config_cls` small: every field of SIZES it has (with an int default), one
    layer of each kind from a per-layer list, its sub-configs shrunk too, the tokenizer's ids; `extra` last."""
    default = config_cls()
    d = default.to_dict()
    kw = {}
    for value, names in SIZES.values():
        for name in names:
            if isinstance(d.get(name), int) and not isinstance(d.get(name), bool):
                kw[name] = value
    if any(n in kw for n in SIZES["experts"][1]):  # a mixture of experts: its routing fields, even where None
        for key in ("experts_per_token", "groups"):
            kw.update({n: SIZES[key][0] for n in SIZES[key][1] if n in d and d[n] is None})
    heads = next((d[n] for n in SIZES["heads"][1] if isinstance(d.get(n), int)), None)
    for name in SIZES["kv_heads"][1]:
        if name in d and d[name] in (heads, None):  # multi-head attention stays so: as many KV heads as heads
            kw[name] = SIZES["heads"][0]
    if d.get("head_dim", 0) is None:  # None: hidden / heads for some classes, a crash for others; the same 16
        kw["head_dim"] = SIZES["head_dim"][0]
    if "mamba_n_heads" in d:  # Mamba-2 heads: n_heads · d_head = expand · hidden
        kw["mamba_n_heads"] = d.get("mamba_expand", 2) * SIZES["hidden"][0] // SIZES["mamba_head_dim"][0]
    if "qk_rope_head_dim" in kw:  # multi-head latent attention: RoPE acts on the qk_rope_head_dim slice of a head
        kw.update({k: kw["qk_rope_head_dim"] for k in ("head_dim",) if k in kw})
        kw.update({k: kw["qk_rope_head_dim"] + kw.get("qk_nope_head_dim", 0) for k in ("qk_head_dim",) if k in kw})
    n_default = next((d[n] for n in SIZES["layers"][1] if isinstance(d.get(n), int)), None)
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and n_default and len(v) == n_default > 2}
    if per_layer:  # keep layer 0 and the first layer that differs from it, so both kinds of layer are built
        j = max(range(1, n_default), key=lambda i: (sum(v[i] != v[0] for v in per_layer.values()), -i))
        kw.update({k: [v[0], v[j]] for k, v in per_layer.items()})
    for name in getattr(config_cls, "sub_configs", {}):  # text_config, vision_config, attn_config, ...
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict") and not isinstance(sub, dict):
            kw[name] = (type(sub), shrunk(type(sub), extra.get(name, {}),
                                          token_ids if name in ("text_config", "decoder") else None))
    if isinstance(d.get("per_layer_config"), dict):
        kw["per_layer_config"] = {}  # per-layer sizes of the full model's layers: the two built here take the defaults
    if token_ids:  # a tokenizer without a pad (or BOS) token: EOS, as data.load_tokenizer pads, where an id is required
        kw.update({k: token_ids["eos_token_id"] if v is None and isinstance(d.get(k), int) else v
                   for k, v in token_ids.items() if k in d or k == "vocab_size"})
        for name in ("vocab_size_per_layer_input", "unpadded_vocab_size"):  # other names of the same vocabulary
            if name in d:
                kw[name] = token_ids["vocab_size"]
    if "is_decoder" in d:
        kw["is_decoder"] = True  # encoder families listed as causal LMs (BERT, RoBERTa, ...) as decoders
    kw.update({k: v for k, v in extra.items() if k not in getattr(config_cls, "sub_configs", {})})
    return kw


def small_config(model_type: str, tokenizer):
    """The architecture's config class at its defaults, shrunk (SIZES), with OVERRIDES[model_type] on top."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    kw = shrunk(cls, OVERRIDES.get(model_type, {}), ids)
    try:  # sub-configs as dicts, as config.json gives them to from_pretrained
        return cls(**as_dicts(kw))
    except Exception:  # noqa: BLE001 - some classes want config objects instead; that error is the one to report
        return cls(**as_objects(kw))


def as_dicts(kw: dict) -> dict:
    return {k: as_dicts(v[1]) if isinstance(v, tuple) else v for k, v in kw.items()}


def as_objects(kw: dict) -> dict:
    return {k: v[0](**as_objects(v[1])) if isinstance(v, tuple) else v for k, v in kw.items()}


def tokenizer_for(model_type: str, work: Path):
    """A byte-level BPE with the family's conventions (tiny_model.STYLES), trained once per style on the HH sample."""
    from plumbing import data
    import tiny_model
    name = style(model_type)
    path = work / "tokenizers" / name
    if not (path / "tokenizer.json").exists():
        tmp = work / "tokenizers" / f".{name}-{os.getpid()}"
        texts = [p + r for p, r in data.load_texts(HH, skip_bad=True)]
        tiny_model.build_tokenizer(name, texts, tmp, vocab_size=1000)
        with contextlib.suppress(OSError):
            tmp.rename(path)  # another worker may have won the race: its files are the same
        shutil.rmtree(tmp, ignore_errors=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)), name


def probe(model, tokenizer) -> None:
    """Sample 4 tokens from a left-padded batch of two texts, as transformers does it (no code of ours)."""
    import torch
    from plumbing import data
    seqs = [data.query_ids("\n\nHuman: Hi there.\n\nAssistant:", tokenizer), data.query_ids("\n\nHuman: Why?", tokenizer)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = data.pad(seqs, pad_id, "left")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, max_new_tokens=4,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id)
    if out.shape[1] <= ids.shape[1]:
        raise RuntimeError("generate returned no new token")


# ---------------------------------------------------------------------------------------------------------
# One architecture, in its own process
# ---------------------------------------------------------------------------------------------------------
MAX_PARAMETERS = 30_000_000  # a "small" config above this kept a size field SIZES does not know


def check_size(config) -> None:
    """Count the parameters on the meta device (no memory) before building for real."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception:  # noqa: BLE001 - the real build below says what is wrong
        return
    if n > MAX_PARAMETERS:
        raise RuntimeError(f"the small config still has {n / 1e6:.0f} M parameters (a size field the shrink "
                           f"does not know)")


def reason(e: BaseException, err_text: str = "") -> str:
    """One line: the exception and where it was raised (innermost frame, and the innermost one of this project)."""
    if isinstance(e, SystemExit):
        lines = [l for l in err_text.splitlines() if l.startswith("error: ")]
        return f"exit {e.code}: {lines[-1][7:] if lines else '(no message)'}"[:300]
    lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()] or [""]
    msg = (" ".join(lines[:2]) if lines[0].endswith(":") else lines[0])[:200]  # a validation error's cause is line 2
    frames = traceback.extract_tb(e.__traceback__)

    def where(f) -> str:
        path = Path(f.filename)
        parts = path.parts
        short = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else path.name
        return f"{short}:{f.lineno}"
    ours = [f for f in frames if str(ROOT) in f.filename and "site-packages" not in f.filename]
    at = f" at {where(frames[-1])}" if frames else ""
    via = f" (via {where(ours[-1])})" if ours and ours[-1] is not frames[-1] else ""
    return f"{type(e).__name__}: {msg}{at}{via}"


class Tee(io.TextIOBase):
    """stderr both to the worker's log and to a buffer (cli.fail's one-line message is read from it)."""

    def __init__(self, stream):
        self.stream, self.buffer_text = stream, io.StringIO()

    def write(self, s):
        self.buffer_text.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


def budget(pairs: Path, model_dir: Path, out: Path) -> list[str]:
    return ["--model", str(model_dir), "--data", str(pairs), "--skip-bad", "--out", str(out), "--steps", "2",
            "--sft-epochs", "1", "--sft-batch", "8", "--rm-epochs", "1", "--rm-batch", "8", "--rm-eval-every", "4",
            "--max-prompt-tokens", "48", "--max-response-tokens", "40", "--max-new-tokens", "8",
            "--rollout-batch", "4", "--minibatch", "4", "--ppo-epochs", "1", "--ptx-batch", "4",
            "--critic-pretrain-steps", "1", "--eval-samples", "1", "--heldout-frac", "0.2", "--threads", "1"]


def stage_outcomes(out: Path, failure: str | None) -> dict:
    """Which stages finished, read from what train.main wrote; the first unfinished one carries `failure`."""
    done = {"sft": (out / "sft" / "DONE").exists(),
            "rm": (out / "reward_model" / "DONE").exists() and (out / "judge_model" / "DONE").exists(),
            "critic": (out / "critic_pretrain.json").exists(),
            "ppo": (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()),
            "eval": (out / "summary.json").exists()}
    result, failed = {}, False
    for s in STAGES:
        if done[s] and not failed:
            result[s] = "ok"
        elif not failed:
            result[s], failed = f"fails: {failure or 'did not finish'}", True
        else:
            result[s] = "not reached"
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()] \
        if (out / "metrics.jsonl").exists() else []
    for i, m in enumerate(metrics[:2]):
        result[f"ratio_{i}"], result[f"approx_kl_{i}"] = m.get("ppo/ratio"), m.get("ppo/approx_kl")
    return result


def worker(model_type: str, work: Path, probe_only: bool = False) -> dict:
    """Build, probe and run the stages of one model type; the row of results.json."""
    import torch
    row = {"type": model_type, "class": model_types()[model_type]}
    t0 = time.time()
    err = Tee(sys.stderr)
    try:
        tokenizer, row["style"] = tokenizer_for(model_type, work)
        config = small_config(model_type, tokenizer)
        from transformers import AutoModelForCausalLM
        check_size(config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        model_dir = work / "models" / model_type
        shutil.rmtree(model_dir, ignore_errors=True)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        row["build"] = "ok"
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table
        row["build"] = reason(e)
        return {**row, "seconds": time.time() - t0}
    try:
        probe(model.eval(), tokenizer)
        row["generate"] = "ok"
    except Exception as e:  # noqa: BLE001
        row["generate"] = reason(e)
        return {**row, "seconds": time.time() - t0}
    if probe_only:
        return {**row, "seconds": time.time() - t0}
    import train
    out = work / "runs" / model_type
    shutil.rmtree(out, ignore_errors=True)
    failure = None
    cwd = os.getcwd()
    os.chdir(work)  # train.py writes runs/_base and friends relative to the working directory
    try:
        with contextlib.redirect_stderr(err):
            train.main(budget(work / "pairs.jsonl", model_dir, out))
    except BaseException as e:  # noqa: BLE001 - SystemExit from cli.fail included
        failure = reason(e, err.buffer_text.getvalue()).replace(f"{work}/", "")  # the table names no machine's paths
        traceback.print_exc()
    finally:
        os.chdir(cwd)
    row.update(stage_outcomes(out, failure))
    return {**row, "seconds": time.time() - t0}


def pairs_file(work: Path, n: int = 64, max_chars: int = 600) -> Path:
    """The first n pairs of the HH sample whose whole text is short (every text fits 512 positions untruncated)."""
    from plumbing import data
    path = work / "pairs.jsonl"
    if path.exists():
        return path
    rows = []
    for _, obj in data.records(HH, skip_bad=True):
        if len(obj.get("chosen", "")) <= max_chars and len(obj.get("rejected", "")) <= max_chars:
            rows.append(obj)
        if len(rows) == n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------
def run_one(model_type: str, work: Path, timeout: float, probe_only: bool = False) -> dict:
    """The worker in its own process group; a timeout or a crash becomes the row."""
    log = work / "logs" / f"{model_type}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    result = work / "rows" / f"{model_type}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", model_type, "--work", str(work)]
                                + (["--probe-only"] if probe_only else []), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout)
            why = None if code == 0 else f"the process died (exit {code}; see logs/{model_type}.log)"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group
            proc.wait()
            why = f"timeout after {timeout:.0f} s"
    if result.exists():
        return {**json.loads(result.read_text()), "wall_s": time.time() - t0}
    row = {"type": model_type, "class": model_types()[model_type], "wall_s": time.time() - t0}
    model_dir = work / "models" / model_type
    row["build"] = "ok" if (model_dir / "config.json").exists() else f"fails: {why}"
    if row["build"] == "ok":
        out = work / "runs" / model_type
        row["generate"] = "ok" if out.exists() else f"fails: {why}"
        if out.exists():
            row.update(stage_outcomes(out, why))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="tools/architectures.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--only", default="", help="comma-separated model types (default: every one in the mapping)")
    p.add_argument("--jobs", type=int, default=1, help="architectures run at once (each in its own process)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one architecture may take")
    p.add_argument("--work", default="runs/architectures", help="models, runs, logs and results.json")
    p.add_argument("--redo", action="store_true", help="run again the types already in results.json")
    p.add_argument("--doc", default=str(ROOT / "docs" / "architectures.md"), help="the table to write")
    p.add_argument("--doc-only", action="store_true", help="write the table from results.json, run nothing")
    p.add_argument("--probe-only", action="store_true", help="build and sample only, no stage (fast)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    work = Path(a.work).resolve()
    if a.worker:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        row = worker(a.worker, work, a.probe_only)
        tmp = work / "rows" / f".{a.worker}.json"
        tmp.write_text(json.dumps(row, indent=1))
        tmp.replace(work / "rows" / f"{a.worker}.json")
        return
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if not a.doc_only:
        types = model_types()
        wanted = [t.strip() for t in a.only.split(",") if t.strip()] or list(types)
        unknown = [t for t in wanted if t not in types]
        if unknown:
            raise SystemExit(f"error: --only {','.join(unknown)}: not in the causal-LM mapping")
        todo = [t for t in wanted if a.redo or t not in results]
        pairs_file(work)
        import tiny_model  # noqa: F401  (fail here, not in every worker, if the tools cannot import)
        lock = threading.Lock()
        t_start = time.time()

        def one(t: str) -> None:
            row = run_one(t, work, a.timeout, a.probe_only)
            with lock:
                results[t] = row
                tmp = results_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
                tmp.replace(results_path)
                print(f"[{len(results)}/{len(types)}] {t}: {summary_line(row)} ({row.get('seconds', 0):.0f} s, "
                      f"{time.time() - t_start:.0f} s so far)", flush=True)
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            list(pool.map(one, todo))
        if todo and not a.probe_only and not a.only:  # a whole sweep's wall time, summed over its resumptions
            meta_path = work / "meta.json"
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"wall_s": 0.0}
            seconds = sorted(r.get("wall_s", r.get("seconds", 0)) for r in results.values())
            meta.update(wall_s=meta["wall_s"] + time.time() - t_start, jobs=a.jobs,
                        median_s=seconds[len(seconds) // 2], when=time.strftime(", %Y-%m-%d"))
            meta_path.write_text(json.dumps(meta, indent=1))
    if a.probe_only:
        return
    write_doc(results, Path(a.doc), json.loads((work / "meta.json").read_text()) if (work / "meta.json").exists() else None)
    print(f"{a.doc}: {len(results)} model types")


def summary_line(row: dict) -> str:
    for key in ("build", "generate", *STAGES):
        if row.get(key, "ok") != "ok":
            return f"{key}: {row[key]}"
    return f"every stage ok, ratio {row.get('ratio_0')}, approx_kl {row.get('approx_kl_0')}"


# Why a model type that does not build or sample here is not applicable, and whose a stage's failure is: read off
# each failure's reason and the architecture's code (a note shows only while its row still fails or is flagged)
NOT_APPLICABLE: dict[str, str] = {
    "musicgen": "a text-to-audio decoder over audio codebooks, which transformers cannot build from its own default "
                "config",
    "musicgen_melody": "a text-to-audio decoder over audio codebooks, which transformers cannot build from its own "
                       "default config",
    "gemma3n": "its vision tower needs the timm package, not installed here; gemma3n_text is the same text model",
    "gemma4_assistant": "a speculative-decoding drafter: every layer reads the target model's KV cache (its config "
                        "requires it), so it cannot run alone",
    "gemma4_unified_assistant": "a speculative-decoding drafter: every layer reads the target model's KV cache, so "
                                "it cannot run alone",
    "blt": "byte-level patches with its own byte tokenizer; transformers' generate fails on its config",
    "prophetnet": "the decoder of an encoder-decoder; transformers' generate fails on a left-padded batch",
}
NOTES: dict[str, str] = {
    "cpmant": "the architecture's: CPM-Ant lets every token of its input (its context) attend to every other, so a "
              "position's logits read the tokens after it; lm.check_causal refuses it (it trained before the check)",
    "xlnet": "the architecture's: XLNet's permutation LM attends both ways unless a perm_mask is passed, so a "
             "position's logits read the tokens after it; lm.check_causal refuses it (it trained before the check)",
    "reformer": "the architecture's: in training its sequence length must be a multiple of its chunk length (16), and "
                "the pipeline pads a batch to its longest sequence only",
    "phimoe": "the architecture's: in train mode PhiMoE's SparseMixer router samples the experts (Gumbel noise), so the "
              "update's network is not the one that sampled; the update's forward in eval mode would make ρ exactly 1",
    "xlstm": "ours: the ptx forward in ppo_max.ppo_update builds a KV cache (no use_cache=False), and xLSTM updates its "
             "cached states in place, which backward then cannot use; with use_cache=False every stage passes",
    "emu3": "ours: plumbing.run.load_models loads with AutoModelForCausalLM, which cannot load back the text config Emu3 "
            "saves; with plumbing.models.causal_lm_class every stage passes",
    "mllama": "ours: plumbing.run.load_models loads with AutoModelForCausalLM, which cannot load back the text config Mllama "
              "saves; with plumbing.models.causal_lm_class every stage passes",
}


def ratio_flag(row: dict) -> str | None:
    """What is wrong with the first updates' ρ and approx_kl (None: exactly 1 and 0, as bit-exact recomputation of one
    network gives)."""
    bad = [f"step {i}: ρ {row[f'ratio_{i}']:.9f}, approx_kl {row[f'approx_kl_{i}']:.2e}" for i in (0, 1)
           if row.get(f"ratio_{i}") is not None and (row[f"ratio_{i}"] != 1.0 or row[f"approx_kl_{i}"] != 0.0)]
    return "; ".join(bad) or None


def cell(value: str | None) -> str:
    return "ok" if value == "ok" else "fails" if value and value.startswith("fails") else "—"


def first_failure(row: dict) -> tuple[str, str] | None:
    for key in ("build", "generate", *STAGES):
        if row.get(key, "ok") != "ok" and row.get(key) != "not reached":
            return key, row[key].removeprefix("fails: ")
    return None


def write_doc(results: dict, path: Path, meta: dict | None = None) -> None:
    """docs/architectures.md: how it was measured, the counts, one row per model type, the failures grouped."""
    import torch
    import transformers
    rows = [results[t] for t in sorted(results)]
    built = [r for r in rows if r.get("build") == "ok"]
    samples = [r for r in built if r.get("generate") == "ok"]
    passed = [r for r in samples if all(r.get(s) == "ok" for s in STAGES)]
    flagged = [r for r in samples if ratio_flag(r)]
    meta = meta or {}
    failing = [r for r in samples if r not in passed or ratio_flag(r)]
    whose = {kind: [r["type"] for r in failing if NOTES.get(r["type"], "").startswith(kind)]
             for kind in ("ours", "the architecture's")}
    unclassified = [r["type"] for r in failing if not any(r["type"] in v for v in whose.values())]
    lines = [
        "# Every causal LM of the pinned transformers, through every stage",
        "",
        f"Measured by `python tools/architectures.py` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}, CPU, one thread per architecture{meta.get('when', '')}). Each model type of "
        "transformers' causal-LM mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) is built from its own config class's "
        "defaults shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads where the architecture has grouped KV, head dim "
        "16, intermediate 128, 4 experts of which 2 per token, sliding window 32, one layer of each kind of a "
        "layer-type list; `OVERRIDES` in the script lists the per-architecture details), with a byte-level BPE of "
        "the family's conventions (`tools/tiny_model.py`: no pad token, EOS as BOS, no BOS, a chat template) "
        "trained on the HH-RLHF sample, saved as a local Hugging Face directory, sampled from with transformers' "
        "own `generate` on a left-padded batch (**generate**), and then run through `train.main` on the real-model "
        "path:",
        "",
        "```",
        "python train.py " + " ".join(budget(Path("PAIRS"), Path("DIR"), Path("OUT"))),
        "```",
        "",
        "`PAIRS` is the first 64 pairs of `data/hh-rlhf/harmless-base-test.dev.jsonl.gz` whose texts are at most "
        "600 characters. Stages: **SFT**, **RM** (the reward model and the held-out judge, Eq. 2), **critic** "
        "(pre-training, §5.3.3), **PPO** (2 steps) and **eval** (the held-out comparison with SFT). A stage is "
        "*ok* when its output is written, *fails* with the one-line reason of the first stage that did not finish, "
        "and *—* after it (not reached) or where the model does not build or sample here (not applicable).",
        "",
        "**ρ and approx_kl.** With one rollout minibatch (`--rollout-batch 4 --minibatch 4`) and one PPO epoch, the "
        "first update's policy is the very network that sampled and scored the batch, so `ppo/ratio` must be "
        "exactly 1 and `ppo/approx_kl` exactly 0, in both PPO steps (a recomputation of one network in float32 is "
        "bit-exact: every row not flagged shows 1 and 0 to the last bit). Any other value is a "
        "token-bookkeeping bug (dropout left on, positions or padding read differently in the rollout's log-probs "
        "and the update's, a temperature applied once but not twice), ours or the architecture's; such rows are "
        "flagged ⚠ below.",
        "",
        "## Counts",
        "",
        f"- **{len(rows)}** model types in the mapping"
        + (f" ({len(model_types())} in transformers {transformers.__version__})" if len(rows) != len(model_types())
           else ""),
        f"- **{len(built)}** build from a small config on the CPU",
        f"- **{len(samples)}** sample text with transformers' `generate` on the CPU from a left-padded batch: the "
        "text decoders this project can train here",
        f"- **{len(passed)}** pass every stage (SFT, RM, critic, PPO, eval)",
        f"- **{len(flagged)}** with ρ ≠ 1 or approx_kl ≠ 0 on the first update"
        + (": " + ", ".join(r["type"] for r in flagged) if flagged else ""),
        f"- of the {len(samples)} that sample, {len(failing)} fail a stage or are flagged: "
        f"{len(whose['ours'])} for a reason of this project's ({', '.join(whose['ours']) or 'none'}), "
        f"{len(whose['the architecture' + chr(39) + 's'])} for a reason of the architecture's "
        f"({', '.join(whose['the architecture' + chr(39) + 's']) or 'none'})"
        + (f", {len(unclassified)} not yet classified ({', '.join(unclassified)})" if unclassified else ""),
        f"- {len(rows) - len(samples)} do not build or sample here (not applicable): "
        + ", ".join(r["type"] for r in rows if r not in samples),
    ]
    if meta.get("wall_s"):
        lines.append(f"- the sweep's wall time: {meta['wall_s'] / 60:.0f} min (`--jobs {meta.get('jobs', 1)}` on a "
                     f"shared 2-core machine); per architecture {meta.get('median_s', 0):.0f} s median, its process's "
                     f"start included")
    lines += ["", "## Per architecture", "",
              "| model type | class | generate | SFT | RM | critic | PPO | eval | ρ (step 0) | approx_kl (step 0) | "
              "what fails, or what the config needed |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fail = first_failure(r)
        gen = cell(r.get("generate")) if r.get("build") == "ok" else "—"
        stages = [cell(r.get(s)) for s in STAGES] if r.get("generate") == "ok" else ["—"] * len(STAGES)
        ratio = f"{r['ratio_0']:.9f}" if r.get("ratio_0") is not None else ""
        kl = f"{r['approx_kl_0']:.1e}" if r.get("approx_kl_0") is not None else ""
        note = ""
        if fail:
            stage, why = fail
            na = NOT_APPLICABLE.get(r["type"])
            note = (f"not applicable: {na}. " if na else "") + f"{stage}: {why}"
        flag = ratio_flag(r)
        if flag:
            note = f"⚠ {flag}. " + note
        if (fail or flag) and NOTES.get(r["type"]):
            note += f" ({NOTES[r['type']]})"
        if OVERRIDES.get(r["type"]):
            note += (" " if note else "") + "config: " + ", ".join(
                f"{k}={v}" for k, v in OVERRIDES[r["type"]].items())
        lines.append(f"| {r['type']} | {r.get('class', '')} | {gen} | " + " | ".join(stages)
                     + f" | {ratio} | {kl} | {note.replace('|', '/')} |")
    groups: dict[str, list[str]] = {}
    for r in rows:
        fail = first_failure(r)
        if fail:
            groups.setdefault(f"{fail[0]}: {fail[1]}", []).append(r["type"])
    lines += ["", "## What fails, by stage and reason", ""]
    lines += [f"- {why} — {', '.join(types)}" for why, types in sorted(groups.items())] or ["nothing"]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
