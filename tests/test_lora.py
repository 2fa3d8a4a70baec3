"""LoRA (lora.py, --lora-r): only adapters and heads train; the reference is the policy with its adapters off and the
reward model the critic's backbone with the critic's adapters off, equal to the saved SFT and reward models bit for
bit; ρ = 1 on the first minibatch; a resumed LoRA run writes the uninterrupted run's metrics; the merged export loads
with plain AutoModelForCausalLM and gives the adapter model's logits; in the synthetic world LoRA PPO-max beats SFT
under the gold judge. The invariants run on every architecture tools/tiny_model.py builds."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plumbing import data
from plumbing import models as lm
from plumbing import lora
import ppo_max
import tiny_model
import train
from plumbing.pipeline import Inputs
from reward_model import ScalarHeadModel
import plumbing.config
import plumbing.flags
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Human: how do I bake bread?\n\nAssistant:", "Human: what is a good name for a cat?\n\nAssistant:",
           "Human: tell me a joke\n\nAssistant:", "Human: is the sea salty?\n\nAssistant:"]
RESPONSES = [" Mix flour, water and yeast.", " Maybe Tom.", " A horse walks into a bar.", " Yes, quite."]


def lora_run(**kw) -> plumbing.config.RunConfig:
    return plumbing.config.RunConfig(lora_r=4, lora_alpha=8.0, seed=0, **kw)


def build(arch: str, root: Path) -> tuple[Path, Path]:
    """A tiny random-init SFT model of `arch` and a reward model from it (a random head with a non-zero bias)."""
    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)] * 8
    sft = tiny_model.build_model(arch, texts, root / "sft", hidden=32, layers=2, heads=4, vocab_size=300)
    torch.manual_seed(1)
    rm = ScalarHeadModel.from_pretrained(sft, seed=3)
    with torch.no_grad():
        rm.head.bias.fill_(0.25)
    rm.save_pretrained(root / "rm")
    data.load_tokenizer(sft).save_pretrained(root / "rm")
    return sft, root / "rm"


def models(arch: str, root: Path, cfg: ppo_max.PPOConfig):
    sft, rm = build(arch, root)
    tokenizer = data.load_tokenizer(sft)
    inp = Inputs(sft, sft, rm, rm, tokenizer, {})
    m = plumbing.run.load_models(inp, lora_run(), cfg, torch.device("cpu"), None)
    batches = data.RolloutBatches(PROMPTS, list(zip(PROMPTS, RESPONSES)), tokenizer, seed=0)
    return m, batches, tokenizer, sft, rm


def ppo_step(m, batches, tokenizer, cfg, moments):
    """One PPO iteration, as train.ppo runs it: rollout, experience, update. Returns (experience, update stats)."""
    _, query, query_mask = batches.prompts(cfg.rollout_batch)
    m.policy.eval()
    response, response_mask, _ = ppo_max.rollout(m.policy, query, query_mask, cfg.max_new_tokens,
                                                 data.stop_id(tokenizer), tokenizer.pad_token_id, cfg.temperature)
    exp = ppo_max.make_experience(m.policy, m.ref, m.reward_model, m.critic, query, query_mask, response,
                                  response_mask, moments, cfg, cfg.kl_coef)
    m.policy.train(); m.critic.train()
    upd = ppo_max.ppo_update(m.policy, m.critic, m.policy_opt, m.critic_opt, exp, cfg, lambda: batches.ptx(2))
    return exp, upd


CFG = ppo_max.PPOConfig(rollout_batch=4, minibatch=4, ppo_epochs=1, max_new_tokens=6, policy_lr=5e-2,
                        critic_lr=5e-2, ptx_batch=2)


@pytest.mark.parametrize("arch", tiny_model.ARCHS)
def test_lora_only_adapters_and_heads_train_and_the_base_is_bit_identical(arch, tmp_path):
    m, batches, tokenizer, _, _ = models(arch, tmp_path, CFG)
    named = {f"policy.{n}": p for n, p in m.policy.named_parameters()}
    named.update({f"critic.{n}": p for n, p in m.critic.named_parameters()})
    before = {n: p.detach().clone() for n, p in named.items()}
    reward_head = {k: v.clone() for k, v in m.reward_model.model.head.state_dict().items()}
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("critic.head.") for n in trainable), sorted(trainable)
    assert {"critic.head.weight", "critic.head.bias"} <= trainable
    # the optimizers step exactly the trainable parameters
    for opt, model in ((m.policy_opt, m.policy), (m.critic_opt, m.critic)):
        assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()
                                                                        if p.requires_grad}
    for _ in range(2):
        ppo_step(m, batches, tokenizer, CFG, ppo_max.RunningMoments())
    changed = {n for n, p in named.items() if not torch.equal(p, before[n])}
    frozen = set(named) - trainable
    assert not changed & frozen, sorted(changed & frozen)[:5]                 # the base weights: bit-identical
    assert all(named[n].grad is None for n in frozen)                          # and never received a gradient
    assert any("policy." in n and "lora_B" in n for n in changed)              # the adapters did learn
    assert any("critic." in n and "lora_B" in n for n in changed) and "critic.head.weight" in changed
    for k, v in m.reward_model.model.head.state_dict().items():               # the reward model's own head: frozen
        assert torch.equal(v, reward_head[k])


@pytest.mark.parametrize("arch", tiny_model.ARCHS)
def test_lora_reference_and_reward_model_are_the_saved_models_and_the_first_ratio_is_one(arch, tmp_path):
    m, batches, tokenizer, sft_dir, rm_dir = models(arch, tmp_path, CFG)
    ppo_step(m, batches, tokenizer, CFG, ppo_max.RunningMoments())  # the adapters move away from B = 0
    from transformers import AutoModelForCausalLM
    sft = lm.disable_dropout(AutoModelForCausalLM.from_pretrained(sft_dir)).eval()
    rm = lm.disable_dropout(ScalarHeadModel.from_pretrained(rm_dir, require_head=True)).eval()
    _, query, query_mask = batches.prompts(4)
    response, response_mask, _ = ppo_max.rollout(m.policy, query, query_mask, 6, data.stop_id(tokenizer),
                                                 tokenizer.pad_token_id)
    args = (query, query_mask, response, response_mask, 0.7)
    with torch.no_grad():
        ref_logits = ppo_max.policy_logits(m.ref, *args)
        assert torch.equal(ref_logits, ppo_max.policy_logits(sft, *args))          # π_ref = the saved π_SFT, exactly
        assert not torch.equal(ppo_max.policy_logits(m.policy, *args), ref_logits)  # while the policy has moved
        ids, mask = torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1)
        assert torch.equal(m.reward_model.score(ids, mask), rm.score(ids, mask))    # r(x, y) = the saved RM's
        assert not torch.equal(m.critic(ids, mask), rm(ids, mask))                  # while the critic has moved
    # a new rollout batch, one epoch of one minibatch: the update's ratio is exactly 1 (train mode, dropout off)
    _, upd = ppo_step(m, batches, tokenizer, CFG, ppo_max.RunningMoments())
    assert upd["ppo/ratio"] == pytest.approx(1.0, abs=1e-6) and upd["ppo/clipfrac"] == 0.0


def test_lora_dropout_acts_in_sft_and_is_off_in_ppo(tmp_path):
    sft, rm = build("gpt2", tmp_path)  # GPT-2 also has its own dropout of 0.1, which every stage turns off
    run = plumbing.config.RunConfig(lora_r=4, lora_dropout=0.3)
    from plumbing.pipeline import load_lm
    from sft import SFTConfig, train_sft
    model = load_lm(sft, False, torch.device("cpu"), False, run)
    tokenizer = data.load_tokenizer(sft)
    train_sft(model, tokenizer, list(zip(PROMPTS, RESPONSES)), SFTConfig(sft_epochs=1.0, sft_batch=4), 0)
    ps = {n: mod.p for n, mod in model.named_modules() if isinstance(mod, torch.nn.Dropout)}
    assert ps and all(p == 0.3 for n, p in ps.items() if "lora_dropout" in n)
    assert all(p == 0.0 for n, p in ps.items() if "lora_dropout" not in n)
    m = plumbing.run.load_models(Inputs(sft, sft, rm, rm, tokenizer, {}), run, CFG, torch.device("cpu"), None)
    for model in (m.policy, m.critic):
        assert all(mod.p == 0.0 for mod in model.modules() if isinstance(mod, torch.nn.Dropout))


def test_lora_counts_match_peft(tmp_path):
    """lora.count_trainable (a meta-device copy, no weights) against peft's own count of the loaded model."""
    for arch in ("llama", "gpt2", "gpt_neox"):
        sft, _ = build(arch, tmp_path / arch)
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(sft)
        for r, spec in ((1, "auto"), (4, "all-linear"), (8, "auto")):
            model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(sft),
                                      plumbing.config.RunConfig(lora_r=r, lora_targets=spec), seed=0)
            assert lora.count_trainable(config, r, spec)["adapters"] == model.get_nb_trainable_parameters()[0]


# ------------------------------------------------------------------------------------------- the synthetic world
TINY = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
        "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "4",
        "--eval-samples", "1", "--threads", "1", "--save-every", "3", "--lora-r", "4"]


def metrics(path):
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("time/")}
            for l in Path(path, "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    old = os.getcwd()
    os.chdir(d)
    train.main(TINY + ["--steps", "6", "--out", "full"])
    yield d
    os.chdir(old)


@pytest.mark.slow
def test_lora_resume_matches_uninterrupted(work):
    train.main(TINY + ["--steps", "4", "--out", "part"])       # checkpoints at 3 and 4
    ckpt = work / "part" / "checkpoints" / "step-000003" / "policy"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()  # adapters only
    train.main(["--resume", "part", "--steps", "6"])
    assert metrics(work / "part") == metrics(work / "full")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's read
def test_lora_merged_export_loads_plainly_and_gives_the_adapter_models_logits(work):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = work / "full" / "policy"
    assert not (out / "adapter_config.json").exists()        # a plain directory: no peft needed to read it
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert any(p.abs().max() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)  # it learnt something
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not hasattr(merged, "peft_config")
    ids = torch.randint(3, merged.config.vocab_size, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
        plain_base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])  # (peft adapted `base`
        assert not torch.allclose(plain_base(ids).logits, merged(ids).logits, atol=1e-4)      # in place)
    # the merge itself, by hand for every adapted layer: W = W₀ + (α/r)·B·A   (LoRA, Hu et al. 2021, Eq. 3)
    from safetensors.torch import load_file
    ab = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    w0, w = plain_base.state_dict(), merged.state_dict()
    scale = config["lora_alpha"] / config["r"]
    layers = [k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in ab if "lora_A" in k]
    assert layers
    for layer in layers:
        A, B = ab[f"base_model.model.{layer}.lora_A.weight"], ab[f"base_model.model.{layer}.lora_B.weight"]
        torch.testing.assert_close(w[f"{layer}.weight"], w0[f"{layer}.weight"] + scale * B @ A, atol=1e-6, rtol=0)
    # the critic's merged export: its value head included
    critic_cfg = json.loads((work / "full" / "critic" / "adapter" / "adapter_config.json").read_text())
    critic = ScalarHeadModel.from_pretrained(work / "full" / "critic", require_head=True).eval()
    lm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(critic_cfg["base_model_name_or_path"]),
                                   work / "full" / "critic" / "adapter")
    adapted_critic = ScalarHeadModel.from_pretrained(work / "full" / "critic", require_head=True)
    adapted_critic.lm = lm.eval()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(critic(ids, mask), adapted_critic(ids, mask), atol=1e-5, rtol=1e-5)
    # the command writes the same merged weights
    proc = subprocess.run([sys.executable, "-m", "plumbing.lora", "merge", str(out / "adapter"), "--out", "again"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    again = AutoModelForCausalLM.from_pretrained("again")
    for (k, a), (_, b) in zip(sorted(merged.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), k


@pytest.mark.slow
@pytest.mark.background(["train.py", "--lora-r", "8", "--threads", "1"])
def test_lora_ppo_max_trains_its_adapters_from_a_fresh_folder(background):
    """The default world and PPO-max budget with adapters on the policy and critic (rank 8), from a fresh folder: the
    run ends, writes adapters, and the adapters move the policy away from SFT (held-out KL > 0.001 nats/token;
    untrained adapters, B = 0, leave it exactly 0; seed 0 measured 0.0056 at η 0.2). Whether
    that raises the proxy or gold is a measurement (docs/one-gpu.md: at the current default it does neither on seed
    0), not a property of LoRA to assert."""
    work, returncode, output = background
    assert returncode == 0, output[-3000:]
    run = work / "runs" / "ppo-max-lora8-seed0"
    assert (run / "policy" / "adapter").is_dir()  # never a full-weight run's dir
    s = json.loads((run / "summary.json").read_text())
    assert s["judge"] == "gold" and s["final"]["kl"] > 0.001, s["final"]
    assert all(math.isfinite(s["final"][k]) for k in ("reward", "gold_reward", "kl", "perplexity")), s["final"]


# ------------------------------------------------------------------------------------------- a real model, every stage
@pytest.mark.slow
def test_lora_runs_every_stage_of_a_real_model(tmp_path, monkeypatch):
    """SFT, the reward model, the judge, the critic and the policy each write adapters (peft's format) and the merged
    model; the --model directory itself is never written; the merged SFT model is what PPO's reference computes."""
    from test_real_data import hh_pairs, write_jsonl
    from test_real_models import BUDGET
    monkeypatch.chdir(tmp_path)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", hh_pairs(96))
    model = tiny_model.build_model("qwen2", [p + r for p, r in data.load_texts(pairs)], tmp_path / "model", hidden=32,
                                   layers=2, heads=4, vocab_size=300)
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    summary = train.main(["--model", str(model), "--data", str(pairs), "--out", "run", "--lora-r", "4",
                          "--lora-targets", "all-linear", *BUDGET])
    out = tmp_path / "run"
    bases = {}
    for stage in ("sft", "reward_model", "judge_model", "policy", "critic"):
        adapter = out / stage / "adapter"
        assert (adapter / "adapter_model.safetensors").is_file() and (out / stage / "config.json").is_file(), stage
        bases[stage] = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
        assert (adapter / "value_head.safetensors").is_file() == (stage in ("reward_model", "judge_model", "critic"))
    assert bases == {"sft": model.resolve(), "reward_model": (out / "sft").resolve(), "judge_model": (out / "sft").resolve(),
                     "policy": (out / "sft").resolve(), "critic": (out / "reward_model").resolve()}
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["ppo/ratio"] == pytest.approx(1.0, abs=1e-6) and m["ppo/clipfrac"] == 0.0
    assert summary["models"]["sft"] == str(Path("run") / "sft")


def test_lora_with_a_sequence_classification_reward_model(tmp_path, monkeypatch):
    """A reward model from another library (AutoModelForSequenceClassification) under LoRA: the critic starts from
    it and the reward model is its backbone with the critic's adapters off, scoring exactly as transformers does."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    monkeypatch.chdir(tmp_path)
    sft, _ = build("llama", tmp_path)
    cfg = AutoConfig.from_pretrained(sft)
    cfg.num_labels, cfg.pad_token_id = 1, 2  # HF pools at the last token that is not the pad id: use a distinct one
    torch.manual_seed(0)
    seq = AutoModelForSequenceClassification.from_config(cfg).eval()
    seq.save_pretrained(tmp_path / "seq-rm")
    tokenizer = data.load_tokenizer(sft)
    tokenizer.save_pretrained(tmp_path / "seq-rm")
    m = plumbing.run.load_models(Inputs(sft, sft, tmp_path / "seq-rm", tmp_path / "seq-rm", tokenizer, {}), lora_run(), CFG,
                          torch.device("cpu"), None)
    assert isinstance(m.reward_model, lora.AdaptersOff)
    ids, attn, _ = data.lm_batch(list(zip(PROMPTS, RESPONSES)), tokenizer)      # right-padded
    ids = ids.masked_fill(attn == 0, 2)
    with torch.no_grad():
        torch.testing.assert_close(m.reward_model.score(ids, attn), seq(input_ids=ids, attention_mask=attn).logits[:, 0],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_adapters_get_gradients_under_gradient_checkpointing(arch, tmp_path):
    """Checkpointed layers whose inputs carry no gradient would silently leave the adapters untrained (reentrant
    checkpointing): with --grad-ckpt every adapter must still receive a non-zero gradient."""
    sft, _ = build(arch, tmp_path)
    from plumbing.pipeline import load_lm
    model = load_lm(sft, False, torch.device("cpu"), True, lora_run())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()          # B = 0 would zero A's gradient whatever checkpointing does
    model.train()
    tokenizer = data.load_tokenizer(sft)
    ids, attn, _ = data.lm_batch(list(zip(PROMPTS, RESPONSES)), tokenizer)
    model(input_ids=ids, attention_mask=attn, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_lora_plan_counts_the_judge(capsys):
    """On real data the held-out judge is one more frozen model during PPO, quantized like the reference: the plan
    holds it, and scores with it in a phase of its own."""
    from plumbing import scale
    argv = ["--model", "llama-7b", "--plan", "--num-gpus", "1", "--gpu-mem", "24", "--lora-r", "16", "--lora-bits", "4"]
    without = plumbing.flags.print_plan(argv)
    capsys.readouterr()
    hh = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"
    judged = plumbing.flags.print_plan(argv + ["--data", str(hh), "--skip-bad"])
    printed = capsys.readouterr().out
    assert "judge" not in without.n_params and "judge score" in judged.phase_bytes
    weights, _ = scale.frozen_bytes("llama-7b", 4, 2, prepared=False)
    assert judged.static("judge")["weights"] == weights + 2 * (4096 + 1) and 3.5 < weights / scale.GiB < 4.5
    assert judged.resident_bytes == without.resident_bytes + judged.static("judge")["weights"]
    assert "judge      frozen" in printed


def test_lora_stage_under_bf16_writes_bf16(tmp_path):
    """--bf16: the merged stage directory is bf16, as a full-weight stage's is (the merge itself runs in fp32)."""
    sft, _ = build("llama", tmp_path)
    from plumbing.pipeline import load_lm
    from sft import SFTConfig, train_sft
    from transformers import AutoModelForCausalLM
    model = load_lm(sft, True, torch.device("cpu"), False, lora_run())
    train_sft(model, data.load_tokenizer(sft), list(zip(PROMPTS, RESPONSES)), SFTConfig(sft_epochs=1.0, sft_batch=4),
              0, out_dir=tmp_path / "out")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.bfloat16
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
