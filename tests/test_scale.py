"""Tests of scale.py: parameter counts against real transformers models, the memory plan against hand
arithmetic, model resolution without network, the DeepSpeed config against ds_config_zero2.json, and the LoRA plan's
trainable parameters against peft's own count."""
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import plumbing.flags
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from plumbing import scale
from plumbing.scale import GiB, ModelNotFound
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]

# The small config of the hand arithmetic: h=64, i=128, ℓ=2, a=4, k=2 (GQA), d=16, V=100, untied.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, tie_word_embeddings=False)
# By hand: embedding 100·64 = 6400; one layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 = 12288,
# MLP 3·64·128 = 24576, norms 2·64 = 128 → 36992; two layers 73984; final norm 64; lm_head 6400.
N_POL = 6400 + 73984 + 64 + 6400  # 86848
N_RM = 6400 + 73984 + 64 + 64     # 80512: LlamaForSequenceClassification, score head h → 1 instead of the lm_head
LAYER = 36992


def _n(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------- param count
@pytest.mark.parametrize("over", [
    {},                                                                   # untied, GQA 4/2
    {"tie_word_embeddings": True, "num_key_value_heads": 4},              # tied, MHA
    {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 200,
     "num_hidden_layers": 3, "vocab_size": 77},                           # MQA, odd sizes
])
def test_param_count_matches_transformers(over):
    config = LlamaConfig(**{**SMALL, **over})
    assert scale.llama_param_count(config) == _n(LlamaForCausalLM(config))
    config.num_labels = 1
    assert scale.llama_param_count(config, value_head=True) == _n(LlamaForSequenceClassification(config))


def test_param_count_small_by_hand():
    assert scale.llama_param_count(SMALL) == N_POL == 86848
    assert scale.llama_param_count(SMALL, value_head=True) == N_RM == 80512


@pytest.mark.parametrize("alias", ["llama-7b", "llama-13b"])
def test_param_count_aliases_match_meta_models(alias):
    """The LLaMA formula (scale.py's worked example) against the meta-device count the plans use, and both against
    LlamaForCausalLM itself on the meta device."""
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(LlamaConfig(**scale.LLAMA_CONFIGS[alias]))
    assert scale.llama_param_count(alias) == scale.arch_numbers(alias)["n_params"] == _n(model)
    assert scale.llama_param_count(alias) == {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320}[alias]


# Five architectures as tools/tiny_model.py builds them: GPT-2 and GPT-NeoX configs have no intermediate_size, GPT-2
# ties its output head and uses Conv1D, GPT-NeoX has biases, Qwen2 has q/k/v biases, Mistral GQA.
def _configs():
    import tiny_model

    class Tok:  # the special-token ids model_config reads
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def __len__(self):
            return 97
    return {arch: tiny_model.model_config(arch, Tok(), hidden=32, layers=3, heads=4) for arch in tiny_model.ARCHS}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox"])
def test_arch_numbers_match_the_built_model(arch):
    config = _configs()[arch]
    model = transformers.AutoModelForCausalLM.from_config(config)   # real weights: what the counts must match
    a = scale.arch_numbers(config)
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out.weight is emb.weight
    assert a["n_params"] == _n(model) and a["n_tensors"] == len(list(model.parameters()))
    assert a["tie_word_embeddings"] == tied == (arch == "gpt2")
    assert a["output_params"] == (0 if tied else sum(p.numel() for p in out.parameters()))
    weights = [m.weight for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D") and m is not out]
    assert a["quantized"] == sum(w.numel() for w in weights) > 0
    assert (a["hidden_size"], a["num_hidden_layers"], a["num_attention_heads"], a["vocab_size"]) == (32, 3, 4, 97)
    assert a["head_dim"] == 8 and a["num_key_value_heads"] == (2 if arch in ("llama", "qwen2", "mistral") else 4)
    assert scale.param_count(config, value_head=True) == _n(model) + 33  # ScalarHeadModel: + the h → 1 head, bias
    assert config.to_json_string() == _configs()[arch].to_json_string()  # counting left the config as it was


# ----------------------------------------------------------------------------------------------- config numbers
def test_config_numbers_from_directory_without_weights(tmp_path):
    LlamaConfig(**SMALL).save_pretrained(tmp_path)  # writes config.json only
    numbers = scale.llama_config_numbers(tmp_path)
    assert {k: numbers[k] for k in SMALL} == SMALL
    assert numbers["head_dim"] == 16
    assert scale.llama_config_numbers(str(tmp_path / "config.json")) == numbers
    assert scale.arch_numbers(tmp_path)["n_params"] == N_POL  # a directory: config.json alone, no weights


def test_config_numbers_defaults_and_errors(tmp_path):
    raw = {k: v for k, v in SMALL.items() if k not in ("num_key_value_heads", "tie_word_embeddings")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    numbers = scale.llama_config_numbers(tmp_path)
    assert numbers["num_key_value_heads"] == 4 and numbers["tie_word_embeddings"] is False
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config\.json: missing field.*intermediate_size"):
        scale.llama_config_numbers(tmp_path)
    with pytest.raises(ValueError, match="tiny"):
        scale.llama_config_numbers("tiny")


# ----------------------------------------------------------------------------------------------- memory plan
# B = 6 prompts per GPU, b = 2, L = 16 + 16, no ptx unless a test adds it.
SMALL_RUN = dict(micro_batch=2, rollout_batch_per_gpu=6, ptx_batch_per_gpu=0, prompt_len=16, response_len=16,
                 overhead_gb=0.0, gpu_mem_gb=1.0)
N_SH = N_POL + 65               # 86913: reward_model.ScalarHeadModel keeps the lm_head and adds h → 1 with a bias
T_POL = 1 + 2 * 9 + 1 + 1       # 21 tensors: embedding; per layer q, k, v, o, gate, up, down, 2 norms; norm; lm_head
KV = 2 * 2 * 6 * 32 * 2 * 16 * 2             # 2·ℓ·B·L·k·d·β = 24576
PREFILL = 17 * 6 * 16 * 64                   # the prompts' first forward without grad: 17·B·P·h = 104448
HID = 6 * 32 * 64 * 2 + 17 * 6 * 32 * 64     # the last hidden state B·L·h·β + no-grad 17·B·L·h = 24576 + 208896
U = 6 * 16 * 100 * 4                         # B·T·V·4 = 38400
TEMP = max(5 * U, U + 6 * 32 * 100 * 2, 17 * 6 * 32 * 64)  # = the no-grad working set 208896
ACT = 2 * 2 * 32 * 64 * 2 + 34 * 2 * 32 * 64  # ℓ·b·L·h·β + 34·b·L·h = 16384 + 139264 = 155648
PG = max(4 * 2 * 16 * 100 * 4, 2 * 32 * 100 * 2 + 2 * 2 * 16 * 100 * 4)  # = 4·b·T·V·4 = 51200


def test_plan_memory_zero0_one_gpu_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=1, zero_stage=0, **SMALL_RUN)
    expect = {
        ("policy", "weights"): 2 * N_POL, ("policy", "gradients"): 2 * N_POL, ("policy", "optimizer"): 12 * N_POL,
        ("policy", "grad_fp32"): 4 * N_POL,
        ("policy", "kv_cache"): KV, ("policy", "prefill"): PREFILL, ("policy", "logprobs"): 2 * U,
        ("policy", "temporaries"): TEMP,
        ("policy", "activations"): ACT, ("policy", "logits"): PG,
        ("critic", "weights"): 2 * N_SH, ("critic", "gradients"): 2 * N_SH, ("critic", "optimizer"): 12 * N_SH,
        ("critic", "grad_fp32"): 4 * N_SH, ("critic", "hidden_states"): HID, ("critic", "activations"): ACT,
        ("reference", "weights"): 2 * N_POL,
        ("reward", "weights"): 2 * N_SH, ("reward", "hidden_states"): HID,
    }
    assert {(r.model, r.component): r.bytes for r in p.rows} == expect
    resident = 2 * N_POL * 3 + 16 * N_POL + 2 * N_SH * 3 + 16 * N_SH  # ZeRO-0: the step's fp32 gradients whole
    assert p.resident_bytes == resident == 3127698 + 4 * N_POL + 4 * N_SH
    assert p.phase_bytes == {"generate": KV + PREFILL, "reward score": HID, "log-probs": 2 * U + TEMP,
                             "critic values": HID, "policy train": ACT + PG, "critic train": ACT}
    assert p.peak_phase == "log-probs" and p.total_bytes == resident + 2 * U + TEMP
    assert p.fits and p.suggestions == [] and p.cpu_bytes == 0


def test_plan_memory_torch_engine_by_hand():
    """One process with torch AdamW: Adam's m and v in the weights' dtype, a 4-byte step per tensor, and no gradient
    (so no state) for the critic's untied lm_head, which its values never read."""
    for beta in (2, 4):
        p = scale.plan_memory(SMALL, num_gpus=1, engine="torch", dtype_bytes=beta, **SMALL_RUN)
        n_c = N_SH - 6400                            # the critic's parameters that get a gradient: 80513
        assert p.static("policy") == {"weights": beta * N_POL, "gradients": beta * N_POL,
                                      "optimizer": 2 * beta * N_POL + 4 * T_POL}
        assert p.static("critic") == {"weights": beta * N_SH, "gradients": beta * n_c,
                                      "optimizer": 2 * beta * n_c + 4 * (T_POL + 2 - 1)}
        assert p.static("reference") == {"weights": beta * N_POL, "gradients": 0, "optimizer": 0}
        assert p.static("reward") == {"weights": beta * N_SH, "gradients": 0, "optimizer": 0}
        assert p.phase_bytes["policy step"] == beta * N_POL and p.phase_bytes["critic step"] == beta * n_c
    with pytest.raises(ValueError, match="one process"):
        scale.plan_memory(SMALL, num_gpus=2, engine="torch", **SMALL_RUN)


def test_plan_memory_ptx_term_by_hand():
    x, L, V, b, T = 3, 32, 100, 2, 16
    p = scale.plan_memory(SMALL, num_gpus=1, **{**SMALL_RUN, "ptx_batch_per_gpu": x})
    assert p.get("policy", "logits") == max(4 * b * T * V * 4 + 2 * x * L * V * 2, 2 * b * T * V * 4 + x * L * V * 10)
    assert p.get("policy", "activations") == 2 * (b + x) * L * 64 * 2 + 34 * max(b, x) * L * 64


def test_plan_memory_models_critic_judge_and_inits():
    """The models a run holds: no critic for the critic-free estimators, the judge on real data, the critic from
    the SFT model (then under LoRA the reward model needs its own backbone), the reference of a pretrained policy."""
    base = scale.plan_memory(SMALL, num_gpus=1, **SMALL_RUN)
    free = scale.plan_memory(SMALL, num_gpus=1, critic=False, **SMALL_RUN)
    assert {r.model for r in free.rows} == {"policy", "reference", "reward"} and "critic values" not in free.phase_bytes
    assert base.resident_bytes - free.resident_bytes == (2 * N_SH + 2 * N_SH + 12 * N_SH + 4 * N_SH   # + fp32 grads
                                                         + 2 * 2 * scale.BUCKET_ELEMENTS)          # its buckets
    judged = scale.plan_memory(SMALL, num_gpus=1, judge=True, **SMALL_RUN)
    assert judged.static("judge") == {"weights": 2 * N_SH, "gradients": 0, "optimizer": 0}
    assert judged.phase_bytes["judge score"] == HID
    assert judged.resident_bytes == base.resident_bytes + 2 * N_SH
    other = dict(SMALL, hidden_size=32, num_attention_heads=2, num_key_value_heads=2)  # a smaller reward model
    n_other = scale.arch_numbers(other)["n_params"] + 33
    sft = scale.plan_memory(SMALL, reward_cfg=other, num_gpus=1, critic_init="sft", **SMALL_RUN)
    rm = scale.plan_memory(SMALL, reward_cfg=other, num_gpus=1, critic_init="rm", **SMALL_RUN)
    assert sft.get("critic", "weights") == 2 * N_SH and rm.get("critic", "weights") == 2 * n_other
    lora = dict(SMALL_RUN, num_gpus=1, engine="torch", lora_r=4)
    shared = scale.plan_memory(SMALL, **lora)
    assert shared.static("reward") == {"weights": 2 * 65, "gradients": 0, "optimizer": 0}  # its own head only
    assert shared.static("reference")["weights"] == 0 and "adapters off" in shared.held_by["reference"]
    own = scale.plan_memory(SMALL, critic_init="sft", policy_init="pretrained", **lora)
    assert own.static("reward")["weights"] == 2 * N_SH and own.static("reference")["weights"] == 2 * N_POL
    assert own.held_by["reward"] == own.held_by["reference"] == "its own weights"
    alone = scale.plan_memory(SMALL, critic=False, **lora)  # nothing to share the reward model's backbone with
    assert alone.static("reward")["weights"] == 2 * N_SH


def test_plan_memory_lora_torch_engine_by_hand():
    """LoRA r = 4 on q_proj, v_proj (peft's default for LLaMA): per layer q (64 → 64) and v (64 → 32)."""
    n = 4 * ((64 + 64) + (64 + 32)) * 2          # 1792 adapter parameters, 8 tensors (A and B of 4 layers)
    p = scale.plan_memory(SMALL, num_gpus=1, engine="torch", lora_r=4, **SMALL_RUN)
    assert p.static("policy") == {"weights": 2 * N_POL + 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * 8}
    head = 2 * 65                                 # the critic's value head, bf16 like the weights it reads
    assert p.static("critic") == {"weights": 2 * N_POL + 4 * n + head, "gradients": 4 * n + head,
                                  "optimizer": 2 * (4 * n + head) + 4 * 10}
    assert p.lora["trainable"] == {"policy": n, "critic": n + 65}


def test_plan_memory_zero2_two_gpus_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=2, **SMALL_RUN)
    assert p.get("policy", "weights") == 2 * N_POL          # replicated
    assert p.get("policy", "gradients") == 2 * N_POL // 2   # sharded
    assert p.get("policy", "optimizer") == 12 * N_POL // 2  # sharded
    assert p.get("critic", "gradients") == N_SH and p.get("critic", "optimizer") == 6 * N_SH
    assert p.get("policy", "grad_fp32") == 4 * N_POL // 2                   # the step's fp32 copy of its part
    assert p.get("policy", "buckets") == p.get("critic", "buckets") == 2 * 2 * scale.BUCKET_ELEMENTS
    assert p.get("reference", "weights") == 2 * N_POL and p.get("reward", "weights") == 2 * N_SH
    assert p.resident_bytes == (2 * N_POL * 2 + N_POL + 6 * N_POL + 2 * N_POL + 2 * N_SH * 2 + N_SH + 6 * N_SH
                                + 2 * N_SH + 2 * 4 * scale.BUCKET_ELEMENTS)
    sharded = scale.plan_memory(SMALL, num_gpus=2, zero_stage=2, frozen_zero_stage=3, **SMALL_RUN)
    assert sharded.get("reference", "weights") == N_POL and sharded.get("reward", "weights") == N_SH
    assert sharded.get("reward", "gathered") == 4 * LAYER and sharded.get("policy", "gathered") == 0
    assert sharded.phase_bytes["log-probs"] == 2 * U + TEMP + 4 * LAYER   # the reference's blocks
    zero1 = scale.plan_memory(SMALL, num_gpus=2, zero_stage=1, **SMALL_RUN)
    assert zero1.get("policy", "gradients") == 2 * N_POL and zero1.get("policy", "optimizer") == 6 * N_POL


def test_plan_memory_zero3_two_gpus_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=3, **SMALL_RUN)
    for model, n in (("policy", N_POL), ("critic", N_SH), ("reference", N_POL), ("reward", N_SH)):
        assert p.get(model, "weights") == 2 * n // 2
        assert p.get(model, "gathered") == 2 * 2 * LAYER     # 2 blocks · β · max(layer 36992, V·h 6400)
    assert p.get("policy", "gradients") == N_POL and p.get("policy", "optimizer") == 6 * N_POL
    gathered = 4 * LAYER
    assert p.phase_bytes["generate"] == KV + PREFILL + gathered
    assert p.phase_bytes["policy train"] == ACT + PG + gathered
    assert p.phase_bytes["log-probs"] == 2 * U + TEMP + 2 * gathered      # the policy's and the reference's blocks
    assert p.phase_bytes["critic values"] == HID + gathered               # the critic's blocks
    assert p.resident_bytes == (N_POL + N_POL + 6 * N_POL + 2 * N_POL + N_SH + N_SH + 6 * N_SH + 2 * N_SH + N_POL
                                + N_SH + 2 * 4 * scale.BUCKET_ELEMENTS)


def test_plan_memory_offload_fp32_no_ckpt_no_flash_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=2, offload_optimizer=True, ref_reward_offload=True,
                          **SMALL_RUN)
    assert p.get("policy", "optimizer") == 0 and p.get("policy", "optimizer", "cpu") == 6 * N_POL
    assert p.get("reference", "weights") == 0 and p.get("reference", "weights", "cpu") == N_POL
    assert p.get("reward", "gathered") == 4 * LAYER and p.get("policy", "gathered") == 0
    assert p.get("policy", "gradients") == 0 and p.get("policy", "gradients", "cpu") == N_POL  # ZeRO-Offload
    assert p.cpu_bytes == 6 * N_POL + 6 * N_SH + 2 * N_POL + 2 * N_SH + N_POL + N_SH + N_POL + N_SH
    q = scale.plan_memory(SMALL, num_gpus=1, zero_stage=0, dtype_bytes=4, grad_ckpt=False,
                          flash_attention=False, **SMALL_RUN)
    ws = (34 * 32 * 2 * 64 + 5 * 4 * 32 * 32 * 2) * 4 // 2  # Korthikanti: 34·s·b·h + 5·a·s²·b, ×β/2
    assert q.get("policy", "activations") == 2 * ws                             # ℓ × working set
    assert q.get("policy", "weights") == 4 * N_POL and q.get("policy", "optimizer") == 8 * N_POL  # fp32: m + v
    assert q.get("policy", "kv_cache") == 2 * 2 * 6 * 32 * 2 * 16 * 4


def test_plan_memory_suggestions_are_recomputed():
    run = dict(SMALL_RUN, num_gpus=2, zero_stage=0)
    run["gpu_mem_gb"] = (scale.plan_memory(SMALL, **run).total_bytes - 1) / GiB  # one byte short
    p = scale.plan_memory(SMALL, **run)
    assert not p.fits and p.suggestions
    for s in p.suggestions:
        again = scale.plan_memory(SMALL, **{**run, **s.overrides})
        assert again.total_bytes == s.total_bytes and s.saves_bytes == p.total_bytes - s.total_bytes > 0
        assert s.fits == again.fits


# llama-7b, the paper's set-up as train.py runs it: N, and the critic's and reward model's N + h + 1
N7, H7, L7, V7, B7 = 6_738_415_616, 4096, 2048, 32000, 16
N7_SH = N7 + H7 + 1


def test_plan_memory_llama7b_paper_preset_by_hand():
    """8 × 80 GiB, ZeRO-2, bf16, b = 4, B = 16 prompts per GPU generated and scored at once, L = 1024 + 1024, the
    frozen models replicated (scale.PAPER_PRESET, the shapes of `python -m plumbing.scale`): the peak is the
    generation of all 16 (a 16 GiB KV cache and the prompts' first forward), and it does not fit; sharding or
    offloading the frozen models, or the optimizer, each makes it fit, and those come before LoRA's suggestion."""
    p = scale.plan_memory("llama-7b", **scale.PAPER_PRESET)
    buckets = 2 * 2 * scale.BUCKET_ELEMENTS
    trained = lambda n: 2 * n + 2 * n // 8 + 12 * n // 8 + 4 * n // 8 + buckets  # noqa: E731  (+ fp32 grads, buckets)
    resident = trained(N7) + trained(N7_SH) + 2 * N7 + 2 * N7_SH
    generate = 2 * 32 * B7 * L7 * H7 * 2 + 17 * B7 * 1024 * H7
    critic_values = B7 * L7 * H7 * 2 + 17 * B7 * L7 * H7          # the last hidden state, no grad
    assert p.resident_bytes == resident and p.peak_phase == "generate" and generate > critic_values
    assert p.phase_bytes["critic values"] == critic_values
    assert p.total_bytes == resident + generate + 2 * GiB
    assert round(p.total_bytes / GiB, 2) == 99.00 and round(p.resident_bytes / GiB, 2) == 79.94  # scale.py's example
    assert p.get("policy", "kv_cache") == 2 * 32 * B7 * L7 * H7 * 2 == 16 * GiB
    assert not p.fits
    offload = next(x for x in p.suggestions if x.overrides == {"offload_optimizer": True})
    moved = lambda n: 2 * n // 8 + 12 * n // 8 + 4 * n // 8  # noqa: E731  (gradients, Adam, fp32 gradients: the CPU)
    assert offload.total_bytes == resident - moved(N7) - moved(N7_SH) + generate + 2 * GiB
    assert offload.fits and round(offload.total_bytes / GiB, 2) == 70.76
    order = [x.overrides for x in p.suggestions]
    assert order.index({"frozen_zero_stage": 3}) < order.index({"lora_r": 16})
    assert order.index({"generate_batch": 8}) < order.index({"lora_r": 16})
    text = scale.format_plan(p)
    assert "DOES NOT FIT" in text and "kv_cache" in text and "critic values" in text


def test_plan_model_states_agree_with_deepspeeds_estimator():
    """The plan's model states of a trained LLaMA-7B under ZeRO-2 on 8 GPUs (bf16 weights, their ZeRO-2 part of the
    gradients, fp32 master weights and Adam's moments, the step's fp32 gradients) against DeepSpeed's own
    estimate_zero2_model_states_mem_needs, which charges 2N + 18N/G on the GPU: within 5 % (equal here, the
    plan's rows being the estimator's terms), and with the optimizer offloaded (2N: the rest on the CPU)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    for offload in (False, True):
        p = scale.plan_memory("llama-7b", **{**scale.PAPER_PRESET, "offload_optimizer": offload}, suggest=False)
        states = sum(p.get("policy", c) for c in ("weights", "gradients", "optimizer", "grad_fp32"))  # on the GPU
        _, gpu = estimate_zero2_model_states_mem_needs(N7, num_gpus_per_node=8, cpu_offload=offload)
        assert abs(states - gpu) <= 0.05 * gpu, (offload, states / GiB, gpu / GiB)
        assert round(states / GiB, 2) == (12.55 if offload else 26.67)


def test_plan_memory_llama7b_on_8x24_suggests():
    p = scale.plan_memory("llama-7b", **{**scale.PAPER_PRESET, "gpu_mem_gb": 24})
    assert not p.fits
    changes = " | ".join(s.change for s in p.suggestions)
    assert "offload_optimizer" in changes and "--lora-r 16" in changes
    assert "--zero-stage 3" not in changes  # train.py refuses ZeRO-3 for the trained models, not for the frozen ones
    assert "--frozen-zero-stage 3" in changes and "--frozen-offload" in changes and "--generate-batch 8" in changes
    assert p.suggestions[-1].change.startswith("together:")
    text = scale.format_plan(p)
    assert "DOES NOT FIT" in text and "saves" in text


# ----------------------------------------------------------------------------------------------- resolve_model
def test_resolve_model_local_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert scale.resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    assert scale.resolve_model("tiny") is None and scale.resolve_model(None) is None


def test_resolve_model_dir_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json") as e:
        scale.resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ModelNotFound, match="no such directory"):
        scale.resolve_model(str(tmp_path / "missing"))


@pytest.mark.parametrize("name, repo", [("llama-7b", "huggyllama/llama-7b"),
                                        ("nobody-ppo-max/made-up-model-31337", "nobody-ppo-max/made-up-model-31337")])
def test_resolve_model_not_cached_fails_fast_with_instructions(tmp_path, name, repo):
    for cache_dir in (tmp_path, None):  # an empty cache, and this machine's real cache
        if cache_dir is None and name == "llama-7b":
            continue  # this machine might really have it cached
        start = time.perf_counter()
        with pytest.raises(ModelNotFound) as e:
            scale.resolve_model(name, cache_dir=cache_dir)
        assert time.perf_counter() - start < 5.0
        msg = str(e.value)
        assert f"download {repo}" in msg and "or pass a local directory" in msg and "--model /path" in msg


def test_resolve_model_invalid_hub_id():
    with pytest.raises(ModelNotFound, match="not a valid hub id"):
        scale.resolve_model("not a valid id!!")


def test_resolve_model_finds_cached_snapshot(tmp_path):
    repo = tmp_path / "models--huggyllama--llama-7b"  # the layout huggingface_hub writes
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(scale.LLAMA_CONFIGS["llama-7b"]))
    assert Path(scale.resolve_model("llama-7b", cache_dir=tmp_path)) == snap


# ----------------------------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_config_matches_repo_json():
    on_disk = json.loads((ROOT / "ds_config_zero2.json").read_text())
    assert on_disk == scale.deepspeed_config(**scale.PAPER_DS_KWARGS)
    assert on_disk["zero_optimization"]["stage"] == 2 and on_disk["bf16"]["enabled"] is True
    assert "train_batch_size" not in on_disk  # DeepSpeed derives it from the world size


def test_deepspeed_configs_are_valid_zero_configs():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # pydantic: unknown keys are errors

    cpu = scale.deepspeed_config(zero_stage=3, bf16=False, train_micro_batch_size_per_gpu=2,
                                 gradient_accumulation_steps=4, gradient_clipping=0.5, offload_optimizer=True)
    assert cpu["bf16"]["enabled"] is False and cpu["fp16"]["enabled"] is False  # fp32 on the CPU
    assert DeepSpeedZeroConfig(**cpu["zero_optimization"]).offload_optimizer.device == "cpu"
    frozen = scale.inference_deepspeed_config(2, True)
    z = DeepSpeedZeroConfig(**frozen["zero_optimization"])
    assert z.stage == 3 and z.offload_param.device == "cpu"  # offload forces stage 3
    assert scale.inference_deepspeed_config(2, False)["zero_optimization"] == {"stage": 0}


def test_cli_prints_plan():
    out = subprocess.run([sys.executable, "-m", "plumbing.scale", "--model", "llama-7b", "--gpu-mem", "24"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "DOES NOT FIT" in out and "together:" in out


def test_stage_plans_sft_and_rm_against_a_hand_sum():
    """Stages 1-2 for llama-7b on the paper's set-up (8 GPUs, ZeRO-2, bf16, checkpointing, b = 4, L = 2048),
    component by component, from N and the config alone."""
    N = scale.llama_param_count("llama-7b")  # 6,738,415,616
    h, layers, V, L, b, G = 4096, 32, 32000, 2048, 4, 8
    # SFT: ptx_loss at its backward's peak, 3 bf16 tensors and one fp32 of b·L·V; the reward model: 2b sequences'
    # bf16 logits and the chosen half's fp32 upcast
    logits = {"sft": b * L * V * (3 * 2 + 4), "rm": 2 * b * L * V * 2 + b * L * V * 4}
    for stage, s, extra in (("sft", b, 0), ("rm", 2 * b, h + 1)):
        p = scale.plan_stage_memory("llama-7b", stage)
        n = N + extra
        want = {"weights": 2 * n, "gradients": 2 * n // G, "optimizer": 12 * n // G, "grad_fp32": 4 * n // G,
                "buckets": 2 * 2 * scale.BUCKET_ELEMENTS,   # the step's fp32 gradients; reduce + all-gather buckets
                "activations": layers * s * L * h * 2 + 34 * s * L * h,   # inputs of each layer + one working set
                "logits": logits[stage], "overhead": 2 * 1024 ** 3}
        assert p["rows"] == want and p["total_bytes"] == sum(want.values()) and p["fits"]
    with pytest.raises(ValueError):
        scale.plan_stage_memory("llama-7b", "ppo")


# ----------------------------------------------------------------------------------------------- LoRA
# Tiny random-init models of four architectures: peft's own count of the trainable parameters is the reference.
LORA_ARCHS = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=0),
}
LORA_SPECS = {"llama": ["auto", "all-linear", "q_proj,k_proj,v_proj,o_proj"],
              "qwen2": ["auto", "all-linear", "q_proj,k_proj,v_proj,o_proj"],
              "gpt_neox": ["auto", "all-linear", "query_key_value,dense"],
              "gpt2": ["auto", "all-linear", "c_attn,c_proj"]}
LORA_RUN = dict(SMALL_RUN, num_gpus=1)


def _peft_model(model, r: int, spec: str):
    """peft's own wrapping: 'auto' = target_modules None (peft picks its default for the architecture)."""
    import peft

    targets = None if spec == "auto" else spec if spec == "all-linear" else spec.split(",")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: peft's fan_in_fan_out notice
        return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=16, target_modules=targets))


@pytest.mark.parametrize("r", [1, 4, 8])
@pytest.mark.parametrize("arch, spec", [(a, s) for a in LORA_ARCHS for s in LORA_SPECS[a]])
def test_lora_trainable_matches_peft(arch, spec, r):
    config = LORA_ARCHS[arch]()
    torch.manual_seed(0)
    want = _peft_model(transformers.AutoModelForCausalLM.from_config(config), r, spec).get_nb_trainable_parameters()[0]
    assert want > 0
    assert scale.lora_trainable(config, r, spec) == want
    plan = scale.plan_memory(config, lora_r=r, lora_targets=spec, **LORA_RUN)  # every architecture, GPT-2 too
    assert plan.lora["trainable"]["policy"] == want
    assert sum(plan.get("policy", c) for c in ("adapters", "gradients", "optimizer")) == 16 * want  # DeepSpeed
    assert f"trainable: policy {want:,}" in scale.format_plan(plan)
    assert scale.plan_stage_memory(config, "sft", lora_r=r, lora_targets=spec, **LORA_RUN)["trainable"] == want


@pytest.mark.parametrize("spec", ["auto", "all-linear"])
def test_lora_critic_and_reward_model_trainable_match_peft_with_head(spec):
    """The critic (and the reward model in stage 2): a ScalarHeadModel whose LM carries the adapters and whose
    h → 1 head trains in full."""
    from reward_model import ScalarHeadModel

    config = LORA_ARCHS["llama"]()
    model = ScalarHeadModel(transformers.AutoModelForCausalLM.from_config(config))
    model.lm = _peft_model(model.lm, 8, spec)
    model.head.requires_grad_(True)
    want = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert want == model.lm.get_nb_trainable_parameters()[0] + 32 + 1
    plan = scale.plan_memory(config, lora_r=8, lora_targets=spec, **LORA_RUN)
    assert plan.lora["trainable"]["critic"] == want
    assert scale.plan_stage_memory(config, "rm", lora_r=8, lora_targets=spec, **LORA_RUN)["trainable"] == want


def test_lora_kbit_training_keeps_the_unquantized_weights_in_fp32():
    """Why frozen_bytes counts embeddings, norms and lm_head at 4 bytes under --lora-bits 8/4: lora.add_adapters
    calls peft's prepare_model_for_kbit_training, which upcasts every bf16 weight that is not quantized."""
    import peft

    config = LORA_ARCHS["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert scale.KBIT_REST_BYTES == 4


def test_lora_plan_llama7b_against_a_hand_sum():
    """PPO with LoRA r = 16 on q_proj,v_proj, one GPU, one process (torch AdamW), the paper's lengths (b = 4, B = 16,
    x = 2, L = 2048), from the config alone: two frozen backbones (policy = reference, critic = reward model)."""
    N = N7                                              # llama-7b, with its lm_head
    h, layers, V, i, L, T, b, B, x = 4096, 32, 32000, 11008, 2048, 1024, 4, 16, 2
    n_pol = 16 * layers * 2 * (h + h)                   # r·(d_in + d_out) on q_proj and v_proj of 32 layers
    assert n_pol == 8_388_608
    t = 2 * 2 * layers                                  # A and B of 64 adapted layers
    run = {**scale.PAPER_PRESET, "num_gpus": 1, "gpu_mem_gb": 24, "lora_r": 16, "engine": "torch"}
    p = scale.plan_memory("llama-7b", **run)
    head = 2 * (h + 1)                                  # the critic's value head in bf16
    assert p.static("policy") == {"weights": 2 * N + 4 * n_pol, "gradients": 4 * n_pol,
                                  "optimizer": 8 * n_pol + 4 * t}
    assert p.static("critic") == {"weights": 2 * N + 4 * n_pol + head, "gradients": 4 * n_pol + head,
                                  "optimizer": 8 * n_pol + 2 * head + 4 * (t + 2)}
    assert p.static("reference")["weights"] == 0 and p.static("reward")["weights"] == head  # no second backbone
    act = layers * (b + x) * L * h * 2 + 34 * b * L * h  # checkpointed layer inputs + one layer's working set
    assert p.get("policy", "activations") == act
    assert p.get("policy", "kv_cache") == 2 * layers * B * L * h * 2
    critic_values = B * L * h * 2 + 17 * B * L * h       # the last hidden state and a no-grad layer's temporaries
    generate = 2 * layers * B * L * h * 2 + 17 * B * (L - T) * h
    assert p.phase_bytes["critic values"] == critic_values and p.peak_phase == "generate"
    # two backbones; 16 bytes per adapter parameter in each model; the head's weight, gradient, m, v (4 × head) and
    # the reward model's copy (1 × head); a 4-byte step per trained tensor
    resident = 4 * N + 2 * 16 * n_pol + 5 * head + 4 * (2 * t + 2)
    assert p.resident_bytes == resident
    assert p.total_bytes == resident + generate + 2 * GiB
    assert round(2 * N / GiB, 2) == 12.55               # one bf16 backbone
    # 8 and 4 bits: only the decoder layers' Linear weights Q are quantized; embeddings, lm_head and norms stay
    # unquantized (fp32 after prepare_model_for_kbit_training: 4 bytes), and so does the value head
    rest = 2 * V * h + (2 * layers + 1) * h             # embed_tokens + lm_head + 65 RMSNorm weights
    Q = N - rest
    assert Q == layers * (4 * h * h + 3 * h * i) == scale.arch_numbers("llama-7b")["quantized"]
    q4 = Q // 2 + Q // 64 + Q // 4096                   # NF4 + 8-bit absmax per 64 + fp32 constant per 256 blocks
    assert abs(8 * q4 / Q - 4.127) < 1e-3
    for bits, q in ((8, Q), (4, q4)):
        pb = scale.plan_memory("llama-7b", **{**run, "lora_bits": bits})
        assert pb.get("policy", "frozen") == pb.get("critic", "frozen") == q + 4 * rest
        assert pb.static("reward")["weights"] == 4 * (h + 1)
    # stages 1-2: one frozen backbone + adapters (+ the reward model's head), s = b or 2b sequences
    logits = {"sft": b * L * V * (3 * 2 + 4), "rm": 2 * b * L * V * 2 + b * L * V * 4}
    for stage, s, n in (("sft", b, n_pol), ("rm", 2 * b, n_pol + h + 1)):
        st = scale.plan_stage_memory("llama-7b", stage, **{**run, "engine": "deepspeed"})
        want = {"frozen": 2 * N, "adapters": 8 * n, "optimizer": 8 * n,
                "activations": layers * s * L * h * 2 + 34 * s * L * h, "logits": logits[stage],
                "overhead": 2 * GiB}
        assert st["rows"] == want and st["total_bytes"] == sum(want.values()) and st["trainable"] == n
    # all-linear: q, k, v, o (h → h) and gate, up (h → i), down (i → h) in every layer
    assert scale.lora_trainable("llama-7b", 16, "all-linear") == 16 * layers * (4 * 2 * h + 3 * (h + i))


ONE_GPU = {**scale.PAPER_PRESET, "lora_r": 16, "num_gpus": 1, "engine": "torch"}  # what the one-GPU command plans


def test_lora_llama7b_one_gpu_table():
    """PPO-max with LoRA r = 16 on llama-7b, the paper's lengths, as train.py runs it (B = 16 prompts generated and
    scored at once): bf16 frozen weights need more than 24 GiB and fit 48, so does 4-bit."""
    cells = scale.one_gpu_table("llama-7b", **ONE_GPU)
    cell = {(x["gpu_mem_gb"], x["lora_bits"]): x for x in cells}
    assert sorted(cell) == sorted((m, q) for m in (24, 48, 80) for q in (16, 8, 4))
    assert not cell[24, 16]["fits"] and not cell[24, 4]["fits"] and cell[48, 16]["fits"] and cell[48, 4]["fits"]
    for x in cells:  # each cell is the largest of its stages, each recomputed on its own
        s = {**ONE_GPU, "lora_bits": x["lora_bits"]}
        stages = {"SFT": scale.plan_stage_memory("llama-7b", "sft", **s)["total_bytes"],
                  "reward model": scale.plan_stage_memory("llama-7b", "rm", **s)["total_bytes"],
                  "PPO": scale.plan_memory("llama-7b", **s).total_bytes}
        assert x["stage_bytes"] == stages and x["total_bytes"] == max(stages.values())
        assert x["fits"] == (x["total_bytes"] <= x["gpu_mem_gb"] * GiB)
    assert cell[24, 16]["total_bytes"] > cell[24, 8]["total_bytes"] > cell[24, 4]["total_bytes"]
    assert [round(cell[24, q]["total_bytes"] / GiB, 2) for q in (16, 4)] == [44.42, 27.49]  # scale.py's example
    text = scale.format_one_gpu_table(cells, ONE_GPU)
    assert f"no ({cell[24, 16]['total_bytes'] / GiB:.2f} GiB)" in text
    assert f"fits ({cell[48, 4]['total_bytes'] / GiB:.2f} GiB)" in text and "bitsandbytes" in text
    together = scale.plan_memory("llama-7b", **{**ONE_GPU, "gpu_mem_gb": 24}).suggestions[-1]
    assert together.overrides == {"lora_bits": 4, "generate_batch": 8} and round(together.total_bytes / GiB, 2) == 18.96


def test_lora_suggestions_are_recomputed():
    run = {**ONE_GPU, "gpu_mem_gb": 24}
    p = scale.plan_memory("llama-7b", **run)
    assert not p.fits and p.one_gpu
    changes = " | ".join(x.change for x in p.suggestions)
    assert "--lora-bits 4" in changes and "--lora-bits 8" in changes and "--lora-r 8" in changes
    assert "prompts per GPU" in changes and "response_len" in changes and "CUDA GPU" in changes
    assert "ZeRO" not in changes and "offload" not in changes  # nothing is sharded under LoRA
    for x in p.suggestions:
        again = scale.plan_memory("llama-7b", **{**run, **x.overrides})
        assert again.total_bytes == x.total_bytes and x.saves_bytes == p.total_bytes - x.total_bytes > 0
        assert x.fits == again.fits
    together = p.suggestions[-1]
    assert together.change.startswith("together:") and together.fits and "--lora-bits 4" in together.change
    assert together.change.count("--lora-r") <= 1  # no string of rank halvings that save nothing
    rm = scale.plan_stage_memory("llama-7b", "rm", **{**run, "gpu_mem_gb": 16})
    assert not rm["fits"] and rm["suggestions"]
    for x in rm["suggestions"]:
        again = scale.plan_stage_memory("llama-7b", "rm", **{**run, "gpu_mem_gb": 16, **x.overrides})
        assert again["total_bytes"] == x.total_bytes


def test_lora_r0_is_the_full_fine_tuning_plan():
    full = scale.plan_memory(SMALL, **LORA_RUN)
    same = scale.plan_memory(SMALL, lora_r=0, lora_targets="nosuchlayer", **LORA_RUN)  # targets unused at r = 0
    assert same.rows == full.rows and same.total_bytes == full.total_bytes and same.lora is None
    before = lambda p: scale.format_plan(p).split("To make it fit")[0]  # noqa: E731  (its LoRA suggestion reads them)
    assert before(same) == before(full)
    assert scale.plan_stage_memory(SMALL, "rm", lora_r=0) == scale.plan_stage_memory(SMALL, "rm")
    cli = lambda *a: subprocess.run([sys.executable, "-m", "plumbing.scale", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60, check=True).stdout
    assert cli("--gpu-mem", "24") == cli("--gpu-mem", "24", "--lora-r", "0")


def test_lora_cli_prints_the_one_gpu_table():
    out = subprocess.run([sys.executable, "-m", "plumbing.scale", "--model", "llama-7b", "--num-gpus", "1",
                          "--gpu-mem", "24", "--lora-r", "16"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    table = scale.format_one_gpu_table(scale.one_gpu_table("llama-7b", **ONE_GPU), ONE_GPU, "q_proj,v_proj (auto)")
    assert table in out
    assert "2. reward model" in out and "DOES NOT FIT" in out and "--lora-bits 4" in out


def test_lora_docs_show_what_the_code_prints():
    """docs/one-gpu.md pastes the table `python -m plumbing.scale --num-gpus 1 --lora-r 16` prints for llama-7b (the
    paper's shapes); the README gives `train.py --plan`'s command, whose table is the alias's run's (its own batches)."""
    table = scale.format_one_gpu_table(scale.one_gpu_table("llama-7b", **ONE_GPU), ONE_GPU, "q_proj,v_proj (auto)")
    doc = (ROOT / "docs" / "one-gpu.md").read_text()
    assert "## What fits one GPU" in doc and table in doc
    assert "python -m plumbing.scale --model llama-7b --num-gpus 1 --gpu-mem 24 --lora-r 16" in doc
    cli = subprocess.run([sys.executable, "-m", "plumbing.scale", "--model", "llama-7b", "--num-gpus", "1",
                          "--gpu-mem", "24", "--lora-r", "16"], capture_output=True, text=True, timeout=120,
                         check=True, cwd=ROOT).stdout
    assert table in cli
    readme = (ROOT / "README.md").read_text()  # the front door shows the command that prints it
    assert "--plan --num-gpus 1 --gpu-mem 24 --lora-r 16" in readme
    argv = ["--model", "llama-7b", "--plan", "--num-gpus", "1", "--gpu-mem", "24", "--lora-r", "16"]
    printed = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    settings, _, _ = plumbing.flags.plan_inputs(argv)
    run_table = scale.format_one_gpu_table(scale.one_gpu_table("llama-7b", **settings), settings, "q_proj,v_proj (auto)")
    assert run_table in printed and "L = 1536 + 512" in run_table


@pytest.mark.parametrize("argv, flag", [
    (["plumbing/scale.py", "--lora-r", "-1"], "--lora-r -1"),
    (["plumbing/scale.py", "--lora-r", "16", "--lora-bits", "3"], "--lora-bits 3"),
    (["plumbing/scale.py", "--lora-bits", "4"], "--lora-bits 4"),             # quantized weights without adapters
    (["plumbing/scale.py", "--lora-r", "16", "--lora-targets", "nosuchlayer"], "--lora-targets nosuchlayer"),
    (["plumbing/scale.py", "--lora-r", "16", "--lora-targets", "q_proj,nosuchlayer"], "nosuchlayer"),
    (["train.py", "--model", "llama-7b", "--plan", "--lora-r", "16", "--lora-bits", "3"], "--lora-bits 3"),
])
def test_lora_bad_flags_are_one_line_and_exit_2(argv, flag, tmp_path):
    script = ["-m", "plumbing.scale"] if argv[0] == "plumbing/scale.py" else [str(ROOT / argv[0])]
    proc = subprocess.run([sys.executable, *script, *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                                       "PYTHONPATH": str(ROOT),
                                                       "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")})
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], lines
    assert proc.stdout == ""


@pytest.mark.parametrize("flags, message", [(["--gpu-mem", "-5"], "--gpu-mem -5.0: must be > 0"),
                                            (["--gpu-mem", "nan"], "--gpu-mem nan: must be a finite number"),
                                            (["--num-gpus", "0"], "--num-gpus 0: must be ≥ 1"),
                                            (["--micro-batch", "-1"], "--micro-batch -1: must be ≥ 1")])
def test_plan_flags_out_of_range_are_one_line_naming_the_flag(flags, message, capsys):
    """A plan for -5 GiB per GPU is not a plan: the flag, not the function's keyword, is named."""
    with pytest.raises(SystemExit) as e:
        scale.main(["--model", "llama-7b", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"error: {message}"]


# ----------------------------------------------------------------------------------------------- plan = a real run
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny model of every architecture tools/tiny_model.py builds, and a reward model (fresh head) beside it."""
    from plumbing import data
    import memory_check
    import tiny_model
    texts = [p + r for p, r in data.load_texts(memory_check.HH, skip_bad=True)][:200]
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in tiny_model.ARCHS:
        sft = tiny_model.build_model(arch, texts, root / arch, hidden=32, layers=2, heads=4, vocab_size=300)
        out[arch] = (sft, memory_check.reward_dir(sft, root / f"{arch}-rm"))
    return out


# every architecture with full fp32 weights and with bf16 LoRA; LLaMA and GPT-2 (tied, Conv1D) in every combination,
# the critic from the SFT model too (then LoRA gives the reward model a backbone of its own). ~20 s on 2 cores.
STATIC_CASES = ([(a, False, 0, "rm") for a in ("llama", "qwen2", "mistral", "gpt2", "gpt_neox")]
                + [(a, True, 4, "rm") for a in ("llama", "qwen2", "mistral", "gpt2", "gpt_neox")]
                + [(a, *v) for a in ("llama", "gpt2") for v in ((True, 0, "rm"), (False, 4, "rm"), (True, 4, "sft"))])


@pytest.mark.parametrize("arch, bf16, lora_r, critic_init", STATIC_CASES)
def test_plan_static_bytes_equal_a_runs_tensors(tiny_dirs, arch, bf16, lora_r, critic_init):
    """`train.py --model DIR --plan` for a run, against that run's own tensors: the models built by plumbing.run.load_models
    and make_judge from the same flags, one optimizer step of the policy and of the critic taken, then Σ numel ×
    element_size of each model's parameters, gradients and AdamW states, to the byte. LoRA shares the policy's base
    with the reference and, when the critic starts from the reward model, the critic's with the reward model."""
    import memory_check
    sft, rm = tiny_dirs[arch]
    flags = memory_check.run_argv(sft, rm, bf16=bf16, lora_r=lora_r, critic_init=critic_init)
    plan = memory_check.plan_of(flags)
    m, judge, _, _ = memory_check.load_run(sft, rm, flags)
    memory_check.one_step(m, memory_check.random_batch(m.policy.config.vocab_size, 2, 6, 5))
    held = memory_check.held_bytes(memory_check.measured_models(m, judge), {"policy": m.policy_opt,
                                                                              "critic": m.critic_opt})
    assert set(held) == set(plan.n_params) == {"policy", "critic", "reference", "reward", "judge"}
    for name, h in held.items():
        assert plan.static(name) == {k: h[k] for k in ("weights", "gradients", "optimizer")}, name
    assert held["policy"]["gradients"] > 0 and held["critic"]["optimizer"] > 0
    shared = bool(lora_r)
    assert (held["reference"]["weights"] == 0) == shared            # the policy with its adapters off
    assert (held["reward"]["weights"] < 1000) == (shared and critic_init == "rm")  # only its own head


# ----------------------------------------------------------------------------------------------- LLaMA-7B's widths
# Slow, never in CI (pytest.ini deselects `heavy`): `pytest -m heavy tests/test_scale.py -s`, one at a time, with
# PPO_MAX_WIDE_OUT=DIR to keep the model, the runs and their JSON (default: a temporary directory). About 50 minutes
# on 2 cores, up to ~18 GiB of RAM (full weights; skipped when the machine has too little) and ~25 GB of disk.
def _available_gib() -> float:
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(meminfo["MemAvailable"].split()[0]) / 2 ** 20


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    import os

    import memory_check
    out = Path(os.environ.get("PPO_MAX_WIDE_OUT") or tmp_path_factory.mktemp("wide7b"))
    return out, memory_check.build_wide(out / "model")


@pytest.mark.heavy
@pytest.mark.parametrize("lora_r", [16, 0])
def test_wide_plan_equals_the_runs_tensors(wide, lora_r):
    """LLaMA-7B's widths, 2 layers (0.67 B parameters, vocabulary 32,000), bf16: `--plan`'s static bytes against
    the tensors of the models plumbing.run.load_models builds, after one step, to the byte (in a process of its own)."""
    out, model = wide
    if not lora_r and _available_gib() < 18:
        pytest.skip(f"full weights hold ~15 GiB of tensors; {_available_gib():.1f} GiB available here")
    report = out / f"static-{'lora' if lora_r else 'full'}.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "memory_check.py"), "static", "--model", str(model),
                    "--bf16", "--lora-r", str(lora_r), "--json", str(report)], check=True, timeout=3600)
    got = json.loads(report.read_text())
    assert set(got["measured"]) == {"policy", "critic", "reference", "reward", "judge"}
    for name, h in got["measured"].items():
        assert got["plan"][name] == {k: h[k] for k in ("weights", "gradients", "optimizer")}, name
    assert got["measured"]["policy"]["weights"] > 1.3e9  # 0.67 B parameters in bf16


@pytest.mark.heavy
@pytest.mark.parametrize("lora", [True, False])
def test_wide_every_stage_on_the_cpu(wide, lora):
    """SFT, the reward model (and the judge), critic pre-training and PPO, 2 steps each, in bf16, one process, on
    LLaMA-7B's widths: every stage completes, within this machine's 24 GiB (peak RSS of the process)."""
    import memory_check
    out, _ = wide
    if not lora and _available_gib() < 20:
        pytest.skip(f"full weights need ~16 GiB; {_available_gib():.1f} GiB available here")
    result = memory_check.wide_run(out, lora=lora)
    print(json.dumps(result, indent=2))
    log = (out / f"wide-{result['variant']}.log").read_text()
    assert result["returncode"] == 0, log[-3000:]
    assert {"sft", "reward_model", "critic_pretrain", "ppo"} <= set(result["stages_done"]), result
    lines = (out / f"run-{result['variant']}" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics] == [0, 1]
    assert result["params"] == scale.arch_numbers(out / "model")["n_params"] and result["peak_rss_gib"] < 24
