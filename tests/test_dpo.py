"""dpo.py: Eq. 7 against a python loop, its gradient against the closed form, the peers' DPO losses re-implemented
(TRL dpo_trainer.py loss_type "sigmoid", OpenRLHF loss.py DPOLoss), the response log-probs against a per-token loop,
and `train.py --method dpo` end to end (tiny world; a real architecture with LoRA; DeepSpeed engines)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import dpo

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def logps(seed, B=6):
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(B, generator=g, dtype=F64) * 20) for _ in range(4)]  # π_w, π_l, ref_w, ref_l


def test_worked_example_prints_the_numbers_in_its_comments():
    out = subprocess.run([sys.executable, "dpo.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src = (ROOT / "dpo.py").read_text().split("# Printed (tests/test_dpo.py checks these numbers):")[1]
    assert [l.strip() for l in out.splitlines()] == [l.strip()[2:] for l in src.splitlines() if l.strip()]


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_eq7_against_a_loop(beta):
    pw, pl, rw, rl = logps(0)
    loss, stats = dpo.dpo_loss(pw, pl, rw, rl, beta)
    terms = [math.log1p(math.exp(-beta * ((a - c) - (b - d)))) for a, b, c, d in
             zip(pw.tolist(), pl.tolist(), rw.tolist(), rl.tolist())]      # −log σ(z) = log(1 + e^−z)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    margins = [beta * ((a - c) - (b - d)) for a, b, c, d in zip(pw.tolist(), pl.tolist(), rw.tolist(), rl.tolist())]
    assert stats["accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))


def test_dpo_accuracy_counts_a_tie_as_half():
    """The implicit rewards' accuracy counts r̂_w = r̂_l as ½ (as reward_model.accuracy): 0.5 at π = π_ref, where
    every margin is 0, and (1 + 1 + ½ + 0) / 4 on a win, a win, a tie and a loss."""
    pw, pl, rw, rl = logps(4, B=4)
    _, stats = dpo.dpo_loss(rw, rl, rw, rl, 0.1)
    assert stats["accuracy"] == 0.5
    chosen = rw + torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=F64)            # log π(y_w) moved by +1, +2, 0, −1
    _, stats = dpo.dpo_loss(chosen, rl, rw, rl, 0.1)
    margins = [0.1 * d for d in (1.0, 2.0, 0.0, -1.0)]
    assert stats["accuracy"] == sum(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins) / 4 == 0.625


def test_dpo_loss_is_log2_at_the_reference_and_its_gradient_is_the_closed_form():
    pw, pl, rw, rl = logps(1)
    loss, _ = dpo.dpo_loss(rw, rl, rw, rl, 0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    pw, pl = pw.clone().requires_grad_(True), pl.clone().requires_grad_(True)
    loss, _ = dpo.dpo_loss(pw, pl, rw, rl, 0.3)
    loss.backward()
    z = 0.3 * ((pw - rw) - (pl - rl)).detach()
    # ∂L/∂log π(y_w) = −β σ(−z) / B, ∂L/∂log π(y_l) = +β σ(−z) / B (Rafailov et al. 2023, section 4)
    assert_close(pw.grad, -0.3 * torch.sigmoid(-z) / 6, rtol=0, atol=1e-12)
    assert_close(pl.grad, 0.3 * torch.sigmoid(-z) / 6, rtol=0, atol=1e-12)


def test_dpo_loss_matches_trl_and_openrlhf():
    """TRL trl/trainer/dpo_trainer.py _compute_loss, loss_type "sigmoid": delta_score = chosen_logratios −
    rejected_logratios, per_sequence_loss = −logsigmoid(β·delta_score); OpenRLHF openrlhf/models/loss.py DPOLoss
    (label_smoothing 0): logits = (π_w − π_l) − (ref_w − ref_l), −logsigmoid(β·logits)."""
    pw, pl, rw, rl = logps(2)
    ours, _ = dpo.dpo_loss(pw, pl, rw, rl, 0.1)
    trl = (-F.logsigmoid(0.1 * ((pw - rw) - (pl - rl)))).mean()
    logits = (pw - pl) - (rw - rl)
    orl = (-F.logsigmoid(0.1 * logits) * (1 - 0.0) - F.logsigmoid(-0.1 * logits) * 0.0).mean()
    assert_close(ours, trl, rtol=0, atol=1e-12)
    assert_close(ours, orl, rtol=0, atol=1e-12)


def test_response_logprob_sum_against_a_token_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 9, generator=g, dtype=F64)
    ids = torch.randint(0, 9, (2, 6), generator=g)
    resp = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=F64)  # row 0 right-padded at the end
    logits[0, 5] = torch.nan                                                      # padding's logits never count
    got = dpo.response_logprob_sum(logits, ids, resp)
    for b in range(2):
        want = sum(torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]].item() for t in range(1, 6) if resp[b, t])
        assert got[b].item() == pytest.approx(want, abs=1e-12)


# ------------------------------------------------------------------------------------ the stage on a tiny model
PROMPTS = ["Human: how do I bake bread?\n\nAssistant:", "Human: what is a good name for a cat?\n\nAssistant:",
           "Human: tell me a joke\n\nAssistant:", "Human: is the sea salty?\n\nAssistant:"]
CHOSEN = [" Mix flour, water and yeast.", " Maybe Tom.", " A horse walks into a bar.", " Yes, quite."]
REJECTED = [" No.", " I do not know.", " No.", " Who cares."]


def test_train_dpo_keeps_the_sft_model_as_the_reference(tmp_path):
    """train_dpo on a tiny LLaMA: π_ref is the model as it came in, frozen. Its held-out loss at the end equals Eq. 7
    computed here with a copy of the starting model as π_ref, and after the first step the training margins move
    away from 0 (a reference that followed the policy would keep every margin at 0 and the loss at log 2)."""
    import copy

    from transformers import AutoModelForCausalLM

    from plumbing import data
    import tiny_model
    pairs = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]
    sft = tiny_model.build_model("llama", [p + r for p, r in zip(PROMPTS * 2, CHOSEN + REJECTED)] * 4,
                                 tmp_path / "sft", hidden=32, layers=1, heads=4, vocab_size=300)
    tokenizer = data.load_tokenizer(sft)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(sft)
    ref = copy.deepcopy(model).eval()
    cfg = dpo.DPOConfig(dpo_lr=1e-2, dpo_epochs=3.0, dpo_batch=4, dpo_eval_every=1)
    log = dpo.train_dpo(model, tokenizer, pairs * 2, pairs, cfg, seed=0)
    assert log[0]["heldout_accuracy"] == 0.5 and log[0]["heldout_loss"] == pytest.approx(math.log(2), abs=1e-6)
    pol_w, pol_l = dpo.pair_logprobs(model, tokenizer, pairs)
    ref_w, ref_l = dpo.pair_logprobs(ref, tokenizer, pairs)
    loss, stats = dpo.dpo_loss(pol_w, pol_l, ref_w, ref_l, cfg.dpo_beta)
    assert log[-1]["heldout_loss"] == pytest.approx(loss.item(), abs=1e-5) and loss.item() < math.log(2) - 0.1
    assert log[-1]["heldout_accuracy"] == stats["accuracy"]
    train = [s for row in log for s in row.get("train", [])]
    assert len(train) == 6 and train[0]["margin"] == 0.0
    assert all(abs(s["margin"]) > 0.1 and s["loss"] < math.log(2) - 0.05 for s in train[1:]), train


# ------------------------------------------------------------------------------------------------ end to end
TINY = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
        "--rm-epochs", "1", "--eval-samples", "1", "--threads", "1", "--dpo-epochs", "1"]


@pytest.mark.slow
def test_method_dpo_trains_on_the_reward_models_pairs_and_is_evaluated_like_ppo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = train_main(TINY + ["--method", "dpo", "--out", "dpo"])
    log = json.loads((tmp_path / "dpo" / "dpo_log.json").read_text())
    assert log[0]["heldout_accuracy"] == 0.5 and log[0]["heldout_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert log[-1]["heldout_accuracy"] > 0.5, "DPO learns the held-out preferences"
    assert summary["method"] == "dpo" and summary["budget"] == {"policy_samples": 0, "preference_pairs": 300,
                                                                 "pair_epochs": 1.0}
    assert set(summary["final"]) >= {"reward", "gold_reward", "kl", "kl_seq"} and summary["frontier"]["kl_seq"] > 0
    assert (tmp_path / "dpo" / "policy" / "config.json").is_file() and not (tmp_path / "dpo" / "critic").exists()
    bon = train_main(TINY + ["--method", "best-of-n", "--bon-n", "4", "--out", "bon"])
    import best_of_n
    assert bon["frontier"]["kl_seq"] == best_of_n.bon_kl(4) and bon["final"]["kl"] is None
    assert bon["base"] == summary["base"], "every method reuses the same SFT and reward model"


def train_main(argv):
    import train
    return train.main(argv)


@pytest.mark.slow
def test_method_dpo_on_a_real_architecture_with_lora(tmp_path):
    """A GPT-2-architecture model through SFT, the reward model and DPO, all with LoRA adapters: the reference is the
    SFT model with the adapters at B = 0, the adapters alone train."""
    from plumbing import data
    import tiny_model
    from test_real_data import hh_pairs, write_jsonl
    pairs = write_jsonl(tmp_path / "pairs.jsonl", hh_pairs(64))
    model = tiny_model.build_model("gpt2", [p + r for p, r in data.load_texts(pairs)], tmp_path / "model", hidden=32,
                                   vocab_size=300)
    summary = train_main(["--model", str(model), "--data", str(pairs), "--method", "dpo", "--lora-r", "4",
                          "--sft-epochs", "1", "--sft-batch", "8", "--rm-epochs", "1", "--rm-batch", "8",
                          "--dpo-epochs", "1", "--dpo-batch", "8", "--max-prompt-tokens", "48",
                          "--max-response-tokens", "40", "--max-new-tokens", "8", "--eval-samples", "1",
                          "--threads", "1", "--out", str(tmp_path / "out")])
    assert summary["method"] == "dpo" and (tmp_path / "out" / "policy" / "adapter" / "adapter_config.json").is_file()
    log = json.loads((tmp_path / "out" / "dpo_log.json").read_text())
    assert log[0]["heldout_accuracy"] == 0.5  # π = π_ref before the first step: every margin is 0


@pytest.mark.deepspeed
@pytest.mark.slow
def test_method_dpo_through_a_deepspeed_engine(tmp_path):
    """--deepspeed in one process: the DPO model trains as a ZeRO-2 engine (the path `deepspeed train.py` takes)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "--method", "dpo", "--deepspeed",
                           "--out", "ds"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stage engine: ZeRO-2" in proc.stdout
    log = json.loads((tmp_path / "ds" / "dpo_log.json").read_text())
    assert log[-1]["heldout_accuracy"] > 0.5
