"""What PPO gained since the paper, through the numbered loop: every flag of docs/methods.md's newer tricks runs end
to end, on the synthetic world and on a tiny real architecture (LLaMA, its own tokenizer, HH text), logs its numbers,
and keeps the loop's invariants: the first minibatch's ratio is exactly 1 whatever sampled the rollout; without a
mismatch the sampler's log-probs are the trainer's (the rounding measured); with one (bf16, top-p, stale) they
differ measurably, and TIS bounds every weight by C. The equations themselves are tested in test_ppo_loss.py,
test_gae.py, test_critic_free.py and test_overlong_penalty.py."""
import json
from pathlib import Path

import pytest
import torch

import ppo_max
import train
from conftest import two_at_a_time

SMALL = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
         "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--eval-samples", "1", "--threads", "1",
         "--steps", "3", "--critic-pretrain-steps", "2", "--heldout-every", "0"]
# every new flag at least once in each world; each run combines several (one run costs what the base costs)
RUNS = {
    "vapo": ["--preset", "vapo", "--rollout-mismatch", "bf16", "--rollout-correction", "tis",
             "--overlong-buffer", "4", "--overlong-penalty", "0.5"],
    "dapo": ["--preset", "dapo", "--ratio", "sequence", "--rollout-mismatch", "top-p", "--rollout-correction", "mis",
             "--rollout-correction-level", "sequence", "--rollout-correction-cap", "4",
             "--critic-pretrain-steps", "0"],  # GRPO: no critic to pre-train (SMALL's 2 would be refused)
    "stale": ["--rollout-mismatch", "stale", "--rollout-correction", "mis", "--clip-eps-high", "0.28",
              "--lam-critic", "1.0", "--critic-pretrain-target", "returns"],
    "tis-alone": ["--rollout-correction", "tis", "--rollout-correction-cap", "1.5", "--policy-loss", "cispo"],
}


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def world_runs(work) -> dict[str, list[dict]]:
    """Each RUNS entry on the small synthetic world (one cached base), two at a time, in processes of their own."""
    import subprocess
    import sys
    base = subprocess.run([sys.executable, str(Path(train.__file__)), *SMALL, "--stages", "sft,rm"], cwd=work,
                          capture_output=True, text=True, timeout=900)
    assert base.returncode == 0, base.stderr[-2000:]

    def one(name):
        done = subprocess.run([sys.executable, str(Path(train.__file__)), *SMALL, *RUNS[name], "--out", name],
                              cwd=work, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        return rows(work / name)
    return dict(zip(RUNS, two_at_a_time(one, list(RUNS))))


@pytest.mark.slow
def test_every_new_flag_runs_on_the_world_and_logs_its_numbers(world_runs):
    for name, ms in world_runs.items():
        assert len(ms) == 3 and all(m["guard/skipped_updates"] == 0 for m in ms), name
        assert all("mismatch/mean_abs_logp_diff" in m and "correction/weight_mean" in m for m in ms), name
    assert all("dynamic/dropped" in m for m in world_runs["dapo"])
    # a mismatch is measurable; without one the sampler's log-probs are the trainer's to float rounding
    for name in ("vapo", "dapo"):  # bf16, top-p: from the first step
        assert all(m["mismatch/mean_abs_logp_diff"] > 1e-4 and m["mismatch/token_mult_prob_error"] > 1 for m in
                   world_runs[name]), name
    stale = world_runs["stale"]  # the weights of the step before: none before the first update (rounding only)
    assert stale[0]["mismatch/max_abs_logp_diff"] < 1e-5 and all(m["mismatch/mean_abs_logp_diff"] > 1e-4
                                                                 for m in stale[1:])
    for m in world_runs["tis-alone"]:
        assert m["mismatch/max_abs_logp_diff"] < 1e-5 and abs(m["correction/weight_mean"] - 1) < 1e-5, m
        assert m["correction/weight_max"] <= 1.5
    for m in world_runs["vapo"]:  # TIS's cap C = 2 (the default)
        assert m["correction/weight_max"] <= 2.0 + 1e-6


@pytest.mark.slow
def test_every_new_flag_runs_on_a_real_architecture(tmp_path, monkeypatch):
    """The same flags with a tiny random-init LLaMA and its own tokenizer on HH text (what --model DIR runs)."""
    from test_real_models import BUDGET, tiny
    from test_real_data import hh_pairs, write_jsonl
    monkeypatch.chdir(tmp_path)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", hh_pairs(64))
    model = tiny("llama", tmp_path, pairs)
    budget = [x for x in BUDGET]
    budget[budget.index("--steps") + 1] = "2"
    for name in ("vapo", "dapo", "stale"):
        flags = list(RUNS[name])
        summary = train.main(["--model", str(model), "--data", str(pairs), "--out", f"run-{name}", *budget, *flags])
        ms = rows(tmp_path / f"run-{name}")
        assert summary["final"]["kl"] == summary["final"]["kl"] and len(ms) == 2, name
        assert all("mismatch/token_mult_prob_error" in m for m in ms), name


def test_the_first_minibatch_ratio_is_exactly_one_whatever_sampled(monkeypatch):
    """The ratio's denominator is the trainer's own log π_old, never the sampler's: with a bf16 sampler and TIS the
    first minibatch's ρ is exactly 1; the correction's weights are what differ."""
    from test_ppo_max_update import tiny_models, batch
    policy, ref, critic = tiny_models()
    query, query_mask, _, _ = batch(2)
    cfg = ppo_max.PPOConfig(rollout_batch=len(query), minibatch=len(query), ppo_epochs=1, max_new_tokens=5,
                            rollout_mismatch="bf16", rollout_correction="tis", ptx_coef=0.0, critic_pretrain_steps=0)
    torch.manual_seed(0)
    sampler = ppo_max.Sampler(cfg, eos_id=2, pad_id=0)
    response, mask, _, sampled = sampler(policy, query, query_mask)
    assert sampled["logprobs"].dtype == torch.float32 and sampler.copy.dtype == torch.bfloat16
    exp = ppo_max.make_experience(policy, ref, critic, critic, query, query_mask, response, mask,
                                  ppo_max.RunningMoments(), cfg, 0.05, sampled)
    assert exp["stats"]["mismatch/mean_abs_logp_diff"] > 0 and exp["weights"] is not None
    ratios = []
    original = ppo_max.policy_loss

    def record(logprobs, old, *a, **k):
        ratios.append(torch.exp(logprobs - old).detach())
        return original(logprobs, old, *a, **k)
    monkeypatch.setattr(ppo_max, "policy_loss", record)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ppo_max.ppo_update(policy, critic, opt, torch.optim.AdamW(critic.parameters(), lr=1e-3), exp, cfg, None)
    first = ratios[0][exp["mask"][:len(ratios[0])] != 0]
    assert torch.equal(first, torch.ones_like(first))
