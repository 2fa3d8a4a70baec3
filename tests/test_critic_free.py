"""critic_free.py against independent computations (python loops over groups, a brute-force double sum, numpy), its
worked example, the group split across two real torch.distributed ranks, and the first update's ratio of every
estimator in the PPO loop (exactly 1 with one minibatch and one epoch)."""
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import critic_free
import ppo_loss
import plumbing.config
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def ragged(seed: int, B: int = 8, T: int = 6):
    """A ragged float64 batch: rewards (B, T) with NaN on the padding, mask with lengths 1 … T."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    return torch.where(mask != 0, rewards, torch.nan), mask


# -------------------------------------------------------------------------------------------------- the worked example
def test_worked_example_prints_the_numbers_in_its_comments():
    out = subprocess.run([sys.executable, "critic_free.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src = (ROOT / "critic_free.py").read_text().split("# Printed (tests/test_critic_free.py checks these numbers):")[1]
    expected = [l.strip().lstrip("# ").strip() for l in src.splitlines() if l.strip().startswith("#")]
    assert [l.strip() for l in out.splitlines()] == expected


# -------------------------------------------------------------------------------------- group estimators against loops
@pytest.mark.parametrize("G", [2, 3, 4])
def test_grpo_against_a_loop_with_population_and_bessel_std(G):
    scores = torch.randn(5 * G, generator=torch.Generator().manual_seed(G), dtype=F64)
    for unbiased, std in ((False, statistics.pstdev), (True, statistics.stdev)):
        want = []
        for i in range(0, len(scores), G):
            r = scores[i:i + G].tolist()
            want += [(x - statistics.fmean(r)) / (std(r) + critic_free.EPS) for x in r]
        assert_close(critic_free.grpo(scores, G, unbiased=unbiased), torch.tensor(want, dtype=F64), rtol=0, atol=1e-12)


def test_grpo_population_std_gives_unit_mean_square_per_group():
    A = critic_free.grpo(torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0, 3.0, 3.0, 5.0], dtype=F64), 4, eps=0.0).view(2, 4)
    assert_close(A.mean(1), torch.zeros(2, dtype=F64), atol=1e-12, rtol=0)
    assert_close((A ** 2).mean(1), torch.ones(2, dtype=F64), atol=1e-12, rtol=0)


def test_grpo_group_of_equal_scores_gets_zero_advantage():
    A = critic_free.grpo(torch.tensor([2.0, 2.0, 2.0, 1.0, 3.0, 2.0], dtype=F64), 3)
    assert torch.equal(A[:3], torch.zeros(3, dtype=F64))
    assert A[3] < 0 < A[4]


def test_grpo_epsilon_is_verls_1e_6_where_it_matters():
    """ε = 1e-6 (verl's), added to the std: on a group whose std is itself about 1e-6 the advantages are of order 1
    and depend on ε, so this loop with ε written out pins it (at ε = 1e-2 they would be 10⁴ times smaller)."""
    scores = torch.tensor([1.0, 1.0 + 2e-6, 1.0 - 2e-6, 1.0, 0.0, 1.0, 2.0, 3.0], dtype=F64)
    want = []
    for i in range(0, 8, 4):
        r = scores[i:i + 4].tolist()
        want += [(x - statistics.fmean(r)) / (statistics.pstdev(r) + 1e-6) for x in r]
    A = critic_free.grpo(scores, 4)                                    # the default ε, as make_experience calls it
    assert_close(A, torch.tensor(want, dtype=F64), rtol=1e-9, atol=0)
    assert 0.5 < A[1].item() < 1.0                                     # 2e-6 / (√2·1e-6 + 1e-6) = 0.83


def test_dr_grpo_against_a_loop():
    scores = torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=F64)
    want = [x - statistics.fmean(scores[i // 4 * 4:i // 4 * 4 + 4].tolist()) for i, x in enumerate(scores.tolist())]
    assert_close(critic_free.dr_grpo(scores, 4), torch.tensor(want, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("G", [2, 5])
def test_rloo_leaves_each_response_out_of_its_own_baseline(G):
    scores = torch.randn(4 * G, generator=torch.Generator().manual_seed(G), dtype=F64)
    want = []
    for i in range(0, len(scores), G):
        r = scores[i:i + G].tolist()
        want += [r[k] - sum(r[j] for j in range(G) if j != k) / (G - 1) for k in range(G)]
    A = critic_free.rloo(scores, G)
    assert_close(A, torch.tensor(want, dtype=F64), rtol=0, atol=1e-12)
    assert_close(A, G / (G - 1) * critic_free.dr_grpo(scores, G), rtol=0, atol=1e-12)  # = G/(G−1)·(r − mean)


def test_rloo_baseline_does_not_depend_on_the_response_itself():
    """∂A_i/∂r_i = 1 exactly: the baseline is a function of the other responses only (unbiased gradient)."""
    scores = torch.randn(8, dtype=F64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda s: critic_free.rloo(s, 4), scores)
    assert_close(torch.diagonal(jac), torch.ones(8, dtype=F64))
    assert_close(jac[0, 1:4], torch.full((3,), -1 / 3, dtype=F64))  # and −1/(G−1) for the others of its group
    assert torch.equal(jac[0, 4:], torch.zeros(4, dtype=F64))        # nothing from another prompt's group


def test_group_estimators_refuse_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of the group size"):
        critic_free.grpo(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="G ≥ 2"):
        critic_free.rloo(torch.zeros(4), 1)


# ------------------------------------------------------------------------------------------ dynamic sampling (DAPO)
def test_dynamic_sampling_keeps_the_groups_whose_scores_spread_against_a_loop():
    """A group is kept when max − min of its G scores exceeds tol (a loop over groups); equal scores are dropped at
    tol = 0, also those whose float mean is not exactly their value (0.1 three times)."""
    scores = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1, 0.5, 0.5, 0.5001, -1.0, 1.0, 0.0], dtype=F64)
    for tol in (0.0, 1e-3):
        want = [max(scores[i:i + 3].tolist()) - min(scores[i:i + 3].tolist()) > tol for i in range(0, 12, 3)]
        assert critic_free.dynamic_sampling(scores, 3, tol).tolist() == want
    assert critic_free.dynamic_sampling(scores, 3).tolist() == [True, False, True, True]
    assert critic_free.dynamic_sampling(scores, 3, 1e-3).tolist() == [True, False, False, True]
    assert critic_free.grpo(scores, 3)[3:6].abs().max() < 1e-9   # what a dropped group would have given: nothing
    with pytest.raises(ValueError, match="G ≥ 2"):
        critic_free.dynamic_sampling(scores, 1)


# --------------------------------------------------------------------------------------- returns, whitening, REINFORCE++
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_against_a_double_sum(gamma):
    rewards, mask = ragged(0)
    got = critic_free.discounted_returns(rewards, mask, gamma)
    for i in range(rewards.shape[0]):
        n = int(mask[i].sum())
        for t in range(rewards.shape[1]):
            want = sum(gamma ** (s - t) * rewards[i, s].item() for s in range(t, n)) if t < n else 0.0
            assert got[i, t].item() == pytest.approx(want, abs=1e-12)


def test_masked_whiten_over_ranks_against_numpy_over_the_real_tokens():
    """The REINFORCE++ pair whitens with ppo_loss.masked_whiten over every rank's real tokens (all_sum): against
    numpy on the real tokens; W ranks holding the same batch (all_sum multiplies every sum by W) whiten as one."""
    x, mask = ragged(1)
    real = x[mask != 0].numpy()
    want = (real - real.mean()) / np.sqrt(real.var(ddof=0) + 1e-8)
    for all_sum in (None, lambda s: 3 * s):
        got = ppo_loss.masked_whiten(x, mask, all_sum=all_sum)
        assert_close(got[mask != 0], torch.from_numpy(want), rtol=0, atol=1e-12)
        assert torch.equal(got[mask == 0].isnan(), x[mask == 0].isnan())  # padding returned as it came


def test_reinforce_pp_whitens_the_kl_shaped_returns_over_the_batch():
    rewards, mask = ragged(2)
    adv, ret = critic_free.reinforce_pp(rewards, mask, gamma=0.95)
    assert_close(ret, critic_free.discounted_returns(rewards, mask, 0.95))
    assert abs(adv[mask != 0].mean().item()) < 1e-12
    assert adv[mask != 0].var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_pp_baseline_against_a_loop():
    _, mask = ragged(3, B=6)
    scores = torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=F64)
    centred = [s - statistics.fmean(scores[i // 3 * 3:i // 3 * 3 + 3].tolist()) for i, s in enumerate(scores.tolist())]
    tokens = [c for c, n in zip(centred, mask.sum(1).tolist()) for _ in range(int(n))]  # every token of response i
    mu, var = statistics.fmean(tokens), statistics.pvariance(tokens)
    want = torch.tensor(centred, dtype=F64)[:, None].sub(mu).div(math.sqrt(var + 1e-8)) * mask
    assert_close(critic_free.reinforce_pp_baseline(scores, mask, 3), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dr-grpo", "rloo", "reinforce++-baseline"])
def test_group_methods_score_a_response_by_its_return_and_give_every_token_one_value(name):
    rewards, mask = ragged(4)
    adv, ret = critic_free.advantages(name, rewards, mask, group_size=4)
    scores = torch.stack([rewards[i, mask[i] != 0].sum() for i in range(8)])  # r_i = Σ_t r_t, by a loop
    if name == "reinforce++-baseline":
        want = critic_free.reinforce_pp_baseline(scores, mask, 4)
    else:
        want = {"grpo": critic_free.grpo, "dr-grpo": critic_free.dr_grpo, "rloo": critic_free.rloo}[name](scores, 4)
        want = want[:, None] * mask
    assert_close(adv, want, rtol=0, atol=1e-12)
    for i in range(8):  # the same advantage on each real token of a response, 0 on its padding
        real = adv[i, mask[i] != 0]
        assert torch.equal(real, real[:1].expand_as(real)) and not adv[i, mask[i] == 0].any()
    assert_close(ret, critic_free.discounted_returns(rewards, mask, 1.0))


# ------------------------------------------------------------------------------- two ranks: whole groups, global whitening
WORKER = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import critic_free
from plumbing import engine
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
full = torch.load(sys.argv[4], weights_only=True)
G = 4
B = full["rewards"].shape[0]
groups = [list(range(i, i + G)) for i in range(0, B, G)][rank::2]   # whole groups r, r + W, ... (data.RolloutBatches)
rows = [i for g in groups for i in g]
rewards, mask = full["rewards"][rows], full["mask"][rows]
out = {}
for name in critic_free.CRITIC_FREE:
    out[name] = engine.gather_batch(critic_free.advantages(name, rewards, mask, G, 1.0, engine.all_sum)[0], G)
out["order"] = engine.gather_list(rows, G)
if rank == 0:
    torch.save(out, sys.argv[5])
dist.barrier()
dist.destroy_process_group()  # without it, gloo's threads can abort the process at exit (SIGABRT, exit status -6)
"""


def test_two_ranks_give_the_single_process_advantages_of_every_estimator(tmp_path):
    """Each rank holds whole groups (so the group baselines need nothing from the other rank) and the REINFORCE++
    whitening sums over both ranks' tokens: gathered back in prompt order, every estimator's advantages equal the
    one-process computation on the whole batch."""
    rewards, mask = ragged(5, B=16)
    torch.save({"rewards": rewards, "mask": mask}, tmp_path / "batch.pt")
    (tmp_path / "worker.py").write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r), str(tmp_path / "rdv"), str(ROOT),
                               str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")], env={**os.environ,
                              "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["order"] == list(range(16))  # the global batch in prompt order, groups whole
    for name in critic_free.CRITIC_FREE:
        assert_close(out[name], critic_free.advantages(name, rewards, mask, 4)[0], rtol=0, atol=1e-12), name


# ------------------------------------------------------------------------------ the loop: ρ = 1 on the first update
def tiny_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from plumbing import models
    from reward_model import ScalarHeadModel
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(0)
    policy, ref = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    ref.load_state_dict(policy.state_dict())
    rm, critic = ScalarHeadModel(LlamaForCausalLM(cfg)), ScalarHeadModel(LlamaForCausalLM(cfg))
    return [models.disable_dropout(m) for m in (policy, ref.eval(), rm.eval(), critic)]


@pytest.mark.parametrize("name,kl_in", [(n, "reward") for n in critic_free.ESTIMATORS] + [("grpo", "loss")])
def test_first_update_ratio_is_exactly_one_for_every_estimator(name, kl_in):
    import ppo_max
    policy, ref, rm, critic = tiny_models()
    G = 1 if name in ("gae", "reinforce++") else 4
    cfg = ppo_max.PPOConfig(advantage=name, group_size=G, kl_in=kl_in, kl_estimator="k3" if kl_in == "loss" else "k1",
                            rollout_batch=8, minibatch=8, ppo_epochs=1, ptx_coef=0.0, max_new_tokens=6)
    query = torch.tensor([[1, 5, 6], [1, 7, 8]]).repeat_interleave(4, 0)       # (8, 3): two prompts, 4 responses each
    query_mask = torch.ones_like(query, dtype=torch.float)
    torch.manual_seed(1)
    response, response_mask, _ = ppo_max.rollout(policy.eval(), query, query_mask, 6, 2, 0)
    critic = critic if name == "gae" else None
    exp = ppo_max.make_experience(policy, ref, rm, critic, query, query_mask, response, response_mask,
                                  ppo_max.RunningMoments(), cfg, 0.1)
    assert exp["nonfinite"] is None and (exp["values"] is None) == (name != "gae")
    policy.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) if m is not None else None for m in (policy, critic)]
    upd = ppo_max.ppo_update(policy, critic, opts[0], opts[1], exp, cfg, None)
    assert upd["ppo/ratio"] == 1.0 and upd["ppo/clipfrac"] == 0.0 and upd["ppo/approx_kl"] == 0.0
    assert ("loss/vf" in upd) == (name == "gae") and ("loss/kl" in upd) == (kl_in == "loss")


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_first_update_ratio_is_one_without_a_critic_on_architectures_with_dropout(arch):
    """GPT-2 and GPT-NeoX carry dropout 0.1 in their configs; with it off (models.disable_dropout, as plumbing.run.load_models
    does) a GRPO update's first ratio is exactly 1 too."""
    import transformers

    from plumbing import models
    import ppo_max
    from reward_model import ScalarHeadModel
    from test_architectures import EOS, PAD, config, prompts
    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_config(config(arch))
    ref = transformers.AutoModelForCausalLM.from_config(config(arch))
    ref.load_state_dict(policy.state_dict())
    rm = ScalarHeadModel(transformers.AutoModelForCausalLM.from_config(config(arch)))
    for m in (policy, ref, rm):
        models.disable_dropout(m)
    query, query_mask = (t.repeat_interleave(2, 0) for t in prompts(arch))     # 3 prompts × G = 2
    cfg = ppo_max.PPOConfig(advantage="grpo", group_size=2, rollout_batch=6, minibatch=6, ppo_epochs=1,
                            ptx_coef=0.0, max_new_tokens=8)
    torch.manual_seed(2)
    response, response_mask, _ = ppo_max.rollout(policy.eval(), query, query_mask, 8, EOS, PAD[arch])
    exp = ppo_max.make_experience(policy, ref.eval(), rm.eval(), None, query, query_mask, response, response_mask,
                                  ppo_max.RunningMoments(), cfg, 0.05)
    policy.train()
    upd = ppo_max.ppo_update(policy, None, torch.optim.AdamW(policy.parameters(), lr=1e-3), None, exp, cfg, None)
    assert upd["ppo/ratio"] == 1.0 and upd["ppo/clipfrac"] == 0.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random LLaMA's directory and a reward model's beside it (tests/test_lora.py build): (sft, rm)."""
    from test_lora import build
    return build("llama", tmp_path_factory.mktemp("critic-free"))


@pytest.mark.parametrize("name", critic_free.ESTIMATORS)
def test_load_models_builds_a_critic_for_gae_only(name, model_dirs):
    """plumbing.run.load_models: GAE gets a critic (from the reward model, PPO-max) and its optimizer; a critic-free
    estimator gets neither, and its frozen reward model is the saved one."""
    from plumbing import data
    import ppo_max
    import train
    from plumbing.pipeline import Inputs
    sft, rm = model_dirs
    inp = Inputs(sft, sft, rm, rm, data.load_tokenizer(sft), {})
    m = plumbing.run.load_models(inp, plumbing.config.RunConfig(), ppo_max.PPOConfig(advantage=name), torch.device("cpu"), None)
    assert (m.critic is None, m.critic_opt is None) == (name != "gae",) * 2
    assert m.policy is not None and m.ref is not None and m.reward_model is not None
    if name == "gae":
        assert_close(m.critic.head.weight, m.reward_model.head.weight, rtol=0, atol=0)  # both start from the RM
