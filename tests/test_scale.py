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
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

import scale
from scale import GiB, ModelNotFound

ROOT = Path(__file__).resolve().parents[1]

# The small config of the hand arithmetic: h=64, i=128, ℓ=2, a=4, k=2 (GQA), d=16, V=100, untied.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, tie_word_embeddings=False)
# By hand: embedding 100·64 = 6400; one layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 = 12288,
# MLP 3·64·128 = 24576, norms 2·64 = 128 → 36992; two layers 73984; final norm 64; lm_head 6400.
N_POL = 6400 + 73984 + 64 + 6400  # 86848
N_RM = 6400 + 73984 + 64 + 64     # 80512: score head h → 1 instead of the lm_head
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
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(LlamaConfig(**scale.LLAMA_CONFIGS[alias]))
    assert scale.llama_param_count(alias) == _n(model)
    assert scale.llama_param_count(alias) == {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320}[alias]


# ----------------------------------------------------------------------------------------------- config numbers
def test_config_numbers_from_directory_without_weights(tmp_path):
    LlamaConfig(**SMALL).save_pretrained(tmp_path)  # writes config.json only
    numbers = scale.llama_config_numbers(tmp_path)
    assert {k: numbers[k] for k in SMALL} == SMALL
    assert numbers["head_dim"] == 16
    assert scale.llama_config_numbers(str(tmp_path / "config.json")) == numbers


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
SMALL_RUN = dict(micro_batch=2, rollout_batch_per_gpu=6, generate_batch_per_gpu=3, prompt_len=16,
                 response_len=16, overhead_gb=0.0, gpu_mem_gb=1.0)  # L = 32


def _ws():
    return 34 * 32 * 2 * 64  # one layer's working set 34·L·b·h = 139264 (bf16, flash attention)


def test_plan_memory_zero0_one_gpu_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=1, zero_stage=0, **SMALL_RUN)
    act = 2 * 2 * 32 * 64 * 2 + _ws()            # ℓ·b·L·h·β + working set = 16384 + 139264 = 155648
    logits = 2 * 32 * 100 * 4                    # b·L·V·4 = 25600
    kv = 2 * 2 * 3 * 32 * 2 * 16 * 2             # 2·ℓ·g·L·k·d·β = 24576
    expect = {
        ("policy", "weights"): 173696, ("policy", "gradients"): 173696, ("policy", "optimizer"): 12 * 86848,
        ("policy", "activations"): act, ("policy", "logits"): logits, ("policy", "kv_cache"): kv,
        ("critic", "weights"): 161024, ("critic", "gradients"): 161024, ("critic", "optimizer"): 12 * 80512,
        ("critic", "activations"): act,
        ("reference", "weights"): 173696, ("reference", "activations"): _ws(), ("reference", "logits"): logits,
        ("reward", "weights"): 161024, ("reward", "activations"): _ws(),
    }
    assert {(r.model, r.component): r.bytes for r in p.rows} == expect
    resident = 173696 * 3 + 12 * 86848 + 161024 * 3 + 12 * 80512  # = 3012480
    assert p.resident_bytes == resident == 3012480
    assert p.phase_bytes == {"generate": kv, "policy train": act + logits, "critic train": act,
                             "reference fwd": _ws() + logits, "reward fwd": _ws()}
    assert p.peak_phase == "policy train"
    assert p.total_bytes == resident + act + logits == 3193728
    assert p.fits and p.suggestions == [] and p.cpu_bytes == 0


def test_plan_memory_zero2_two_gpus_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=2, **SMALL_RUN)
    assert p.get("policy", "weights") == 2 * 86848          # replicated
    assert p.get("policy", "gradients") == 2 * 86848 // 2   # sharded
    assert p.get("policy", "optimizer") == 12 * 86848 // 2  # sharded
    assert p.get("critic", "gradients") == 80512 and p.get("critic", "optimizer") == 6 * 80512
    assert p.get("reference", "weights") == 173696 and p.get("reward", "weights") == 161024
    assert p.resident_bytes == 173696 * 2 + 86848 + 6 * 86848 + 161024 * 2 + 80512 + 6 * 80512
    zero1 = scale.plan_memory(SMALL, num_gpus=2, zero_stage=1, **SMALL_RUN)
    assert zero1.get("policy", "gradients") == 173696 and zero1.get("policy", "optimizer") == 6 * 86848


def test_plan_memory_zero3_two_gpus_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=3, **SMALL_RUN)
    for model, n in (("policy", 86848), ("critic", 80512), ("reference", 86848), ("reward", 80512)):
        assert p.get(model, "weights") == 2 * n // 2
        assert p.get(model, "gathered") == 2 * 2 * LAYER     # 2 blocks · β · max(layer 36992, V·h 6400)
    assert p.get("policy", "gradients") == 86848 and p.get("policy", "optimizer") == 6 * 86848
    act, logits, kv, gathered = 155648, 25600, 24576, 4 * LAYER
    assert p.phase_bytes["generate"] == kv + gathered
    assert p.phase_bytes["policy train"] == act + logits + gathered
    assert p.phase_bytes["reference fwd"] == _ws() + logits + gathered
    assert p.resident_bytes == 86848 + 86848 + 6 * 86848 + 80512 + 80512 + 6 * 80512 + 86848 + 80512
    assert p.total_bytes == p.resident_bytes + act + logits + gathered


def test_plan_memory_offload_fp32_no_ckpt_no_flash_by_hand():
    p = scale.plan_memory(SMALL, num_gpus=2, zero_stage=2, offload_optimizer=True, ref_reward_offload=True,
                          **SMALL_RUN)
    assert p.get("policy", "optimizer") == 0 and p.get("policy", "optimizer", "cpu") == 6 * 86848
    assert p.get("reference", "weights") == 0 and p.get("reference", "weights", "cpu") == 86848
    assert p.get("reward", "gathered") == 4 * LAYER and p.get("policy", "gathered") == 0
    assert p.cpu_bytes == 6 * 86848 + 6 * 80512 + 86848 + 80512
    q = scale.plan_memory(SMALL, num_gpus=1, zero_stage=0, dtype_bytes=4, grad_ckpt=False,
                          flash_attention=False, **SMALL_RUN)
    ws = (34 * 32 * 2 * 64 + 5 * 4 * 32 * 32 * 2) * 4 // 2  # Korthikanti: 34·s·b·h + 5·a·s²·b, ×β/2
    assert q.get("policy", "activations") == 2 * ws                             # ℓ × working set
    assert q.get("policy", "weights") == 4 * 86848 and q.get("policy", "optimizer") == 8 * 86848  # fp32: m + v
    assert q.get("policy", "kv_cache") == 2 * 2 * 3 * 32 * 2 * 16 * 4


def test_plan_memory_suggestions_are_recomputed():
    run = dict(SMALL_RUN, num_gpus=2, zero_stage=0)
    run["gpu_mem_gb"] = (scale.plan_memory(SMALL, **run).total_bytes - 1) / GiB  # one byte short
    p = scale.plan_memory(SMALL, **run)
    assert not p.fits and p.suggestions
    for s in p.suggestions:
        again = scale.plan_memory(SMALL, **{**run, **s.overrides})
        assert again.total_bytes == s.total_bytes and s.saves_bytes == p.total_bytes - s.total_bytes > 0
        assert s.fits == again.fits


def test_plan_memory_llama7b_paper_preset_fits_on_8x80():
    p = scale.plan_memory("llama-7b", **scale.PAPER_PRESET)
    assert p.fits and p.suggestions == []
    assert round(p.total_bytes / GiB, 2) == 77.51  # the worked example at the bottom of scale.py
    assert round(p.resident_bytes / GiB, 2) == 71.47
    text = scale.format_plan(p)
    assert "fits" in text and "kv_cache" in text and "DOES NOT FIT" not in text
    # All 16 prompts per GPU at once: 16 GiB of KV cache do not fit beside four replicated 7B models.
    assert not scale.plan_memory("llama-7b", **{**scale.PAPER_PRESET, "generate_batch_per_gpu": 16}).fits


def test_plan_memory_llama7b_on_8x24_suggests():
    p = scale.plan_memory("llama-7b", **{**scale.PAPER_PRESET, "gpu_mem_gb": 24})
    assert not p.fits
    changes = " | ".join(s.change for s in p.suggestions)
    assert "ZeRO-3" in changes and "offload optimizer" in changes and "reference and reward model on CPU" in changes
    assert p.suggestions[-1].change.startswith("together:") and p.suggestions[-1].fits
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
    out = subprocess.run([sys.executable, str(ROOT / "scale.py"), "--model", "llama-7b", "--gpu-mem", "24"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "DOES NOT FIT" in out and "together:" in out


def test_stage_plans_sft_and_rm_against_a_hand_sum():
    """Stages 1-2 for llama-7b on the paper's set-up (8 GPUs, ZeRO-2, bf16, checkpointing, b = 4, L = 2048),
    component by component, from N and the config alone."""
    N = scale.llama_param_count("llama-7b")  # 6,738,415,616
    h, layers, V, L, b, G = 4096, 32, 32000, 2048, 4, 8
    for stage, s, extra in (("sft", b, 0), ("rm", 2 * b, h + 1)):
        p = scale.plan_stage_memory("llama-7b", stage)
        n = N + extra
        want = {"weights": 2 * n, "gradients": 2 * n // G, "optimizer": 12 * n // G,
                "activations": layers * s * L * h * 2 + 34 * s * L * h,   # inputs of each layer + one working set
                "logits": s * L * V * 2 + b * L * V * 4, "overhead": 2 * 1024 ** 3}
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
    if arch == "gpt2":  # no LLaMA-style numbers (no intermediate_size): the plan itself is for LLaMA-like models
        return
    plan = scale.plan_memory(config, lora_r=r, lora_targets=spec, **LORA_RUN)
    assert plan.lora["trainable"]["policy"] == want
    assert plan.get("policy", "adapters") + plan.get("policy", "optimizer") == 16 * want
    assert f"policy adapters {want:,}" in scale.format_plan(plan)
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
    """PPO with LoRA r = 16 on q_proj,v_proj, one GPU, the paper's lengths (b = 4, g = 4, L = 2048), from the config
    alone: two frozen backbones (policy = reference, critic = reward model), 16 bytes per trainable parameter."""
    N = 6_738_415_616                                   # llama-7b, with its lm_head
    h, layers, V, i, L, b, g = 4096, 32, 32000, 11008, 2048, 4, 4
    n_pol = 16 * layers * 2 * (h + h)                   # r·(d_in + d_out) on q_proj and v_proj of 32 layers
    n_crit = n_pol + h + 1                              # + the critic's value head
    assert n_pol == 8_388_608
    run = {**scale.PAPER_PRESET, "num_gpus": 1, "gpu_mem_gb": 24, "lora_r": 16}
    p = scale.plan_memory("llama-7b", **run)
    act = layers * b * L * h * 2 + 34 * b * L * h       # checkpointed layer inputs + one layer's working set
    logits = b * L * V * 4
    assert p.get("policy", "frozen") == 2 * N
    assert p.get("critic", "frozen") == 2 * N + 2 * (h + 1)       # + the reward model's frozen head
    assert p.get("reference", "frozen") == p.get("reward", "frozen") == 0  # no second copy
    assert p.get("policy", "adapters") == 8 * n_pol and p.get("policy", "optimizer") == 8 * n_pol
    assert p.get("critic", "adapters") == 8 * n_crit and p.get("critic", "optimizer") == 8 * n_crit
    assert p.get("policy", "activations") == p.get("critic", "activations") == act
    assert p.get("policy", "kv_cache") == 2 * layers * g * L * h * 2
    assert p.resident_bytes == 4 * N + 2 * (h + 1) + 16 * (n_pol + n_crit)
    assert p.peak_phase == "policy train"
    assert p.total_bytes == p.resident_bytes + act + logits + 2 * GiB
    assert round(2 * N / GiB, 2) == 12.55               # one bf16 backbone
    # 8 and 4 bits: only the decoder layers' Linear weights Q are quantized; embeddings, lm_head and norms stay
    # unquantized (fp32 after prepare_model_for_kbit_training: 4 bytes)
    rest = 2 * V * h + (2 * layers + 1) * h             # embed_tokens + lm_head + 65 RMSNorm weights
    Q = N - rest
    assert Q == layers * (4 * h * h + 3 * h * i)
    q4 = Q // 2 + Q // 64 + Q // 4096                   # NF4 + 8-bit absmax per 64 + fp32 constant per 256 blocks
    assert abs(8 * q4 / Q - 4.127) < 1e-3
    for bits, q in ((8, Q), (4, q4)):
        pb = scale.plan_memory("llama-7b", **{**run, "lora_bits": bits})
        assert pb.get("policy", "frozen") == q + 4 * rest
        assert pb.get("critic", "frozen") == q + 4 * rest + 2 * (h + 1)
        assert pb.total_bytes == 2 * (q + 4 * rest) + 2 * (h + 1) + 16 * (n_pol + n_crit) + act + logits + 2 * GiB
    # stages 1-2: one frozen backbone + adapters (+ the reward model's head), s = b or 2b sequences
    for stage, s, n in (("sft", b, n_pol), ("rm", 2 * b, n_pol + h + 1)):
        st = scale.plan_stage_memory("llama-7b", stage, **run)
        want = {"frozen": 2 * N, "adapters": 8 * n, "optimizer": 8 * n,
                "activations": layers * s * L * h * 2 + 34 * s * L * h, "logits": s * L * V * 2 + b * L * V * 4,
                "overhead": 2 * GiB}
        assert st["rows"] == want and st["total_bytes"] == sum(want.values()) and st["trainable"] == n
    # all-linear: q, k, v, o (h → h) and gate, up (h → i), down (i → h) in every layer
    assert scale.lora_trainable("llama-7b", 16, "all-linear") == 16 * layers * (4 * 2 * h + 3 * (h + i))


def test_lora_llama7b_one_gpu_table():
    """PPO-max with LoRA r = 16 on llama-7b: bf16 frozen weights do not fit 24 GiB but fit 80; 4-bit fits 24."""
    run = {**scale.PAPER_PRESET, "lora_r": 16}
    cells = scale.one_gpu_table("llama-7b", **run)
    cell = {(x["gpu_mem_gb"], x["lora_bits"]): x for x in cells}
    assert sorted(cell) == sorted((m, q) for m in (24, 48, 80) for q in (16, 8, 4))
    assert not cell[24, 16]["fits"] and cell[24, 4]["fits"] and cell[80, 16]["fits"]
    for x in cells:  # each cell is the largest of its stages, each recomputed on its own
        s = {**run, "num_gpus": 1, "lora_bits": x["lora_bits"]}
        stages = {"SFT": scale.plan_stage_memory("llama-7b", "sft", **s)["total_bytes"],
                  "reward model": scale.plan_stage_memory("llama-7b", "rm", **s)["total_bytes"],
                  "PPO": scale.plan_memory("llama-7b", **s).total_bytes}
        assert x["stage_bytes"] == stages and x["total_bytes"] == max(stages.values())
        assert x["fits"] == (x["total_bytes"] <= x["gpu_mem_gb"] * GiB)
    # bf16: two 12.55 GiB backbones + activations: more than 24, less than 48; 4-bit: less than 16
    assert 2 * 12.55 < cell[24, 16]["total_bytes"] / GiB < 48 and cell[24, 4]["total_bytes"] / GiB < 16
    assert cell[24, 16]["total_bytes"] > cell[24, 8]["total_bytes"] > cell[24, 4]["total_bytes"]
    assert [round(cell[24, q]["total_bytes"] / GiB, 2) for q in (16, 4)] == [31.39, 14.47]  # scale.py's example
    text = scale.format_one_gpu_table(cells, run)
    assert f"no ({cell[24, 16]['total_bytes'] / GiB:.2f} GiB)" in text
    assert f"fits ({cell[24, 4]['total_bytes'] / GiB:.2f} GiB)" in text and "bitsandbytes" in text


def test_lora_suggestions_are_recomputed():
    run = {**scale.PAPER_PRESET, "num_gpus": 1, "gpu_mem_gb": 24, "lora_r": 16}
    p = scale.plan_memory("llama-7b", **run)
    assert not p.fits and p.one_gpu
    changes = " | ".join(x.change for x in p.suggestions)
    assert "--lora-bits 4" in changes and "--lora-bits 8" in changes and "--lora-r 8" in changes
    assert "micro batch" in changes and "response_len" in changes and "CUDA GPU" in changes
    assert "ZeRO" not in changes and "offload" not in changes  # nothing is sharded under LoRA
    for x in p.suggestions:
        again = scale.plan_memory("llama-7b", **{**run, **x.overrides})
        assert again.total_bytes == x.total_bytes and x.saves_bytes == p.total_bytes - x.total_bytes > 0
        assert x.fits == again.fits
    assert next(x for x in p.suggestions if x.overrides == {"lora_bits": 4}).fits
    rm = scale.plan_stage_memory("llama-7b", "rm", **{**run, "gpu_mem_gb": 16})
    assert not rm["fits"] and rm["suggestions"]
    for x in rm["suggestions"]:
        again = scale.plan_stage_memory("llama-7b", "rm", **{**run, "gpu_mem_gb": 16, **x.overrides})
        assert again["total_bytes"] == x.total_bytes


def test_lora_r0_is_the_full_fine_tuning_plan():
    full = scale.plan_memory(SMALL, **LORA_RUN)
    same = scale.plan_memory(SMALL, lora_r=0, lora_targets="nosuchlayer", **LORA_RUN)  # targets unused at r = 0
    assert same.rows == full.rows and same.total_bytes == full.total_bytes and same.lora is None
    assert scale.format_plan(same) == scale.format_plan(full)
    assert scale.plan_stage_memory(SMALL, "rm", lora_r=0) == scale.plan_stage_memory(SMALL, "rm")
    cli = lambda *a: subprocess.run([sys.executable, str(ROOT / "scale.py"), *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60, check=True).stdout
    assert cli("--gpu-mem", "24") == cli("--gpu-mem", "24", "--lora-r", "0")


def test_lora_cli_prints_the_one_gpu_table():
    out = subprocess.run([sys.executable, str(ROOT / "scale.py"), "--model", "llama-7b", "--num-gpus", "1",
                          "--gpu-mem", "24", "--lora-r", "16"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    run = {**scale.PAPER_PRESET, "lora_r": 16}
    assert scale.format_one_gpu_table(scale.one_gpu_table("llama-7b", **run), run, "q_proj,v_proj (auto)") in out
    assert "2. reward model" in out and "DOES NOT FIT" in out and "--lora-bits 4" in out


def test_lora_docs_show_what_the_code_prints():
    """docs/one-gpu.md pastes the table `train.py --plan --num-gpus 1 --lora-r 16` prints for llama-7b."""
    run = {**scale.PAPER_PRESET, "lora_r": 16}
    table = scale.format_one_gpu_table(scale.one_gpu_table("llama-7b", **run), run, "q_proj,v_proj (auto)")
    doc = (ROOT / "docs" / "one-gpu.md").read_text()
    assert "## What fits one GPU" in doc and table in doc
    assert "python train.py --model llama-7b --plan --num-gpus 1 --gpu-mem 24 --lora-r 16" in doc
    readme = (ROOT / "README.md").read_text()  # the front door shows the same table
    assert table in readme and "--plan --num-gpus 1 --gpu-mem 24 --lora-r 16" in readme


@pytest.mark.parametrize("argv, flag", [
    (["scale.py", "--lora-r", "-1"], "--lora-r -1"),
    (["scale.py", "--lora-r", "16", "--lora-bits", "3"], "--lora-bits 3"),
    (["scale.py", "--lora-bits", "4"], "--lora-bits 4"),             # quantized weights without adapters
    (["scale.py", "--lora-r", "16", "--lora-targets", "nosuchlayer"], "--lora-targets nosuchlayer"),
    (["scale.py", "--lora-r", "16", "--lora-targets", "q_proj,nosuchlayer"], "nosuchlayer"),
    (["train.py", "--model", "llama-7b", "--plan", "--lora-r", "16", "--lora-bits", "3"], "--lora-bits 3"),
])
def test_lora_bad_flags_are_one_line_and_exit_2(argv, flag, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                                       "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")})
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], lines
    assert proc.stdout == ""
