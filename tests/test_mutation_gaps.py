"""Tests for the wrong edits that mutation testing (tools/mutation.py, docs/testing.md) found the other fast tests let
through: each checks the method file against an independent computation (a python loop, autograd,
torch.distributions, an exhaustive enumeration)."""
import itertools
import math
import statistics
import threading

import pytest
import torch
from torch.testing import assert_close

import best_of_n
import critic_free
import dpo
import gae
import ppo_loss

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# gae.py
# ---------------------------------------------------------------------------------------------------------------
def contiguous(row: list[float]) -> bool:
    """1 … 1 0 … 0: no real token after a padded one (a python loop over the row)."""
    seen_pad = False
    for m in row:
        if m == 0.0:
            seen_pad = True
        elif seen_pad:
            return False
    return True


@pytest.mark.parametrize("fn", ["compute_gae", "k_step_return", "k_step_advantage"])
def test_gae_mask_check_rejects_every_gapped_mask_and_accepts_every_right_padded_one(fn):
    """Every 0/1 mask of 4 tokens: a gap anywhere (1 0 1 1, 1 1 0 1), not only a missing first token, is rejected."""
    args = (0.9, 0.9) if fn == "compute_gae" else (0.9, 2)
    for row in itertools.product([0.0, 1.0], repeat=4):
        mask = torch.tensor([row, [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
        rewards, values = torch.ones_like(mask), torch.ones_like(mask)
        if contiguous(list(row)):
            getattr(gae, fn)(rewards, values, mask, *args)
        else:
            with pytest.raises(ValueError, match="contiguous"):
                getattr(gae, fn)(rewards, values, mask, *args)


# ---------------------------------------------------------------------------------------------------------------
# critic_free.py
# ---------------------------------------------------------------------------------------------------------------
def ragged_rewards(seed: int, B: int = 6, T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float64 per-token rewards (NaN on padding) and a right-padded mask with lengths 1 … T."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 1] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=F64)
    rewards = torch.where(mask != 0, torch.randn(B, T, generator=g, dtype=F64), math.nan)
    return rewards, mask


def loop_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> list[list[float]]:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over each row's real tokens, by a python loop."""
    out = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        n = int(sum(m))
        out.append([sum(gamma ** (s - t) * r[s] for s in range(t, n)) for t in range(n)])
    return out


def on_two_ranks(fn, halves: list[tuple]) -> list:
    """fn(*halves[rank], all_sum) on two threads that play two ranks: all_sum adds the other rank's tensor (an
    all-reduce). Returns [rank 0's result, rank 1's]."""
    barrier, box, out = threading.Barrier(2, timeout=60), [None, None], [None, None]

    def rank(r: int) -> None:
        def all_sum(t: torch.Tensor) -> torch.Tensor:
            box[r] = t.clone()
            barrier.wait()
            total = box[0] + box[1]
            barrier.wait()
            return total
        out[r] = fn(*halves[r], all_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_reinforce_pp_default_gamma_is_one():
    rewards, mask = ragged_rewards(20)
    _, returns = critic_free.reinforce_pp(rewards, mask)
    for i, row in enumerate(loop_returns(rewards, mask, 1.0)):
        assert returns[i, :len(row)].tolist() == pytest.approx(row, abs=1e-12)


def test_reinforce_pp_whitens_over_every_ranks_tokens():
    """Two ranks holding halves of a batch: each one's advantages are its returns whitened with the mean and variance
    of ALL the batch's real tokens (python statistics over both halves), not of its own half."""
    rewards, mask = ragged_rewards(21, B=6)
    rewards[3:] += 5.0  # the halves differ in mean: whitening per rank would be visibly wrong
    returns = loop_returns(rewards, mask, 0.9)
    tokens = [g for row in returns for g in row]
    mu, var = statistics.fmean(tokens), statistics.pvariance(tokens)
    out = on_two_ranks(lambda r, m, all_sum: critic_free.reinforce_pp(r, m, 0.9, all_sum),
                       [(rewards[:3], mask[:3]), (rewards[3:], mask[3:])])
    adv = torch.cat([out[0][0], out[1][0]])
    for i, row in enumerate(returns):
        assert adv[i, :len(row)].tolist() == pytest.approx([(g - mu) / math.sqrt(var + 1e-8) for g in row], abs=1e-12)
        assert not adv[i, len(row):].any()


def test_group_estimators_with_one_response_per_prompt_give_zero_advantages():
    """G = 1: each response is its own group, so nothing to compare with: A = 0 (also with Bessel's std, whose 0/0 a
    group of one would otherwise turn into NaN)."""
    scores = torch.tensor([1.0, -2.0, 3.5], dtype=F64)
    for unbiased in (False, True):
        assert critic_free.grpo(scores, 1, unbiased=unbiased).tolist() == [0.0, 0.0, 0.0]
    assert critic_free.dr_grpo(scores, 1).tolist() == [0.0, 0.0, 0.0]


def test_critic_free_rejects_bad_shapes_and_names_with_a_message():
    with pytest.raises(ValueError, match=r"scores must be \(B,\) with B a multiple of the group size G = 2"):
        critic_free.grpo(torch.zeros(4, 1, dtype=F64), 2)  # (B, 1): a column, not a vector of scores
    with pytest.raises(ValueError, match=r"must be \(B, T\) with the same shape; got \(2, 3\), \(2, 4\)"):
        critic_free.discounted_returns(torch.zeros(2, 3), torch.ones(2, 4), 1.0)
    with pytest.raises(ValueError, match=r"same shape; got \(3,\), \(3,\)"):
        critic_free.discounted_returns(torch.zeros(3), torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        critic_free.advantages("ppo", torch.zeros(2, 3), torch.ones(2, 3), 2)


# ---------------------------------------------------------------------------------------------------------------
# best_of_n.py
# ---------------------------------------------------------------------------------------------------------------
def test_best_of_n_bad_inputs_are_value_errors_that_name_them():
    with pytest.raises(ValueError, match="n must be ≥ 1, got 0"):
        best_of_n.bon_kl(0)
    with pytest.raises(ValueError, match=r"scores must be \(N, n\), got \(4,\)"):
        best_of_n.select_best(torch.zeros(4))


class LengthProxy(torch.nn.Module):
    """A proxy reward model: r = (Σ ids over the real tokens) mod 11, a deterministic function of the sampled ids."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))  # rm_judge asks for the device of a parameter

    def score(self, ids, mask):
        return ((ids * mask).sum(1) % 11).float()


def text_judge(prompts, texts, finished, ids=None, mask=None) -> list[float]:
    """A judge that is not the proxy: (Σ code points of the response text) mod 13."""
    return [float(sum(map(ord, t)) % 13) for t in texts]


def test_best_of_n_evaluate_compares_the_proxys_best_of_n_with_sft_samples(tmp_path):
    """evaluate against its parts: the SFT row is eval.measure of the SFT model's own samples (seed); the best-of-n
    row is measured on the candidate each group of n (drawn with seed + 1, the given sampling) scores highest by the
    proxy, picked here by a python loop; its kl is None and kl_seq = log n − (n − 1)/n; the win rate is counted by
    hand from the judge's scores."""
    import data
    import eval as evaluation
    import tiny_model
    from transformers import AutoModelForCausalLM
    prompts, n, per_prompt, seed, T = ["how do I cook rice ?", "how do I boil it ?"], 3, 2, 6, 4
    sampling = dict(top_p=0.3, temperature=1.0, repetition_penalty=1.0)  # not EVAL_SAMPLING: it must be passed on
    model_dir = tiny_model.build_model("llama", ["how do I cook rice ? rinse it , then boil it ."] * 20,
                                       tmp_path / "m", hidden=16, layers=1, heads=2, vocab_size=300)
    sft, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), data.load_tokenizer(model_dir)
    proxy = LengthProxy()
    out = best_of_n.evaluate(sft, proxy, tok, prompts, n, per_prompt, seed, T, text_judge, sampling)

    s_sft = evaluation.sample(sft, tok, prompts, per_prompt, seed, T, sampling=sampling)
    assert out["sft"] == evaluation.measure(sft, sft, proxy, s_sft, text_judge)[0]
    cand = evaluation.sample(sft, tok, prompts, per_prompt * n, seed + 1, T, sampling=sampling)
    # the draws depend on the sampling (on this near-uniform tiny model, a milder change of temperature does not)
    assert cand["texts"] != evaluation.sample(sft, tok, prompts, per_prompt * n, seed + 1, T)["texts"]
    ids = [torch.cat([q, r], 1) for q, r in zip(cand["query"], cand["response"])]
    masks = [torch.cat([qm, m], 1) for qm, m in zip(cand["query_mask"], cand["mask"])]
    scores = [proxy.score(i[None], m[None]).item() for I, M in zip(ids, masks) for i, m in zip(I, M)]
    chosen = []
    for g in range(len(prompts) * per_prompt):  # the best of each n consecutive candidates, the first of equal ones
        best = g * n
        for j in range(g * n, g * n + n):
            best = j if scores[j] > scores[best] else best
        chosen.append(best)
    assert out["policy"]["kl"] is None and out["policy"]["kl_seq"] == pytest.approx(math.log(n) - (n - 1) / n)
    assert out["policy"]["reward"] == pytest.approx(statistics.fmean(scores[j] for j in chosen), abs=1e-6)
    bon_gold = text_judge(None, [cand["texts"][j] for j in chosen], None)
    sft_gold = text_judge(None, s_sft["texts"], None)
    assert out["policy"]["gold_reward"] == pytest.approx(statistics.fmean(bon_gold))
    assert out["policy"]["response_length"] == pytest.approx(statistics.fmean(
        cand["mask"][0][j].sum().item() for j in chosen))
    bon = best_of_n.sample(sft, proxy, tok, prompts, n, per_prompt, seed + 1, T, sampling)
    want = evaluation.measure(sft, sft, proxy, bon, text_judge)[0]["perplexity"]
    assert out["policy"]["perplexity"] == pytest.approx(want)
    assert out["win_rate"] == {"win": statistics.fmean(a > b for a, b in zip(bon_gold, sft_gold)),
                               "tie": statistics.fmean(a == b for a, b in zip(bon_gold, sft_gold)),
                               "lose": statistics.fmean(a < b for a, b in zip(bon_gold, sft_gold))}
    assert out["win_rate"]["win"] != out["win_rate"]["lose"]  # so that swapping the two sides shows


# ---------------------------------------------------------------------------------------------------------------
# dpo.py
# ---------------------------------------------------------------------------------------------------------------
def test_dpo_loss_stats_against_a_loop_with_ties_and_a_margin_of_one():
    """accuracy counts r̂_w > r̂_l as 1 and a tie as ½ (as reward_model.accuracy); margin, chosen_reward and
    rejected_reward are the means of β·logratio, each computed by a loop. The margins are 1, −1, 0, 0 and 2.5."""
    beta = 0.5
    pw = torch.tensor([-1.0, -3.0, -2.0, -4.0, -1.0], dtype=F64)
    pl = torch.tensor([-3.0, -1.0, -2.0, -4.0, -6.0], dtype=F64)
    rw, rl = torch.zeros(5, dtype=F64), torch.zeros(5, dtype=F64)
    _, stats = dpo.dpo_loss(pw, pl, rw, rl, beta)
    chosen = [beta * (a - c) for a, c in zip(pw.tolist(), rw.tolist())]
    rejected = [beta * (b - d) for b, d in zip(pl.tolist(), rl.tolist())]
    margins = [w - l for w, l in zip(chosen, rejected)]
    assert margins == [1.0, -1.0, 0.0, 0.0, 2.5]
    assert stats == pytest.approx({"accuracy": statistics.fmean(1.0 if m > 0 else 0.5 if m == 0 else 0.0
                                                                for m in margins),
                                   "margin": statistics.fmean(margins), "chosen_reward": statistics.fmean(chosen),
                                   "rejected_reward": statistics.fmean(rejected)}, abs=1e-12)


def test_dpo_loss_rejects_anything_but_four_vectors_of_one_shape():
    x = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match=r"expected four \(B,\) tensors of one shape, got \[\(3, 1\)\]"):
        dpo.dpo_loss(x[:, None], x[:, None], x[:, None], x[:, None], 0.1)
    with pytest.raises(ValueError, match=r"one shape, got \[\(2,\), \(3,\)\]"):
        dpo.dpo_loss(x, x[:2], x, x, 0.1)


def test_response_logprob_sum_of_bf16_logits_is_computed_in_float32():
    """Half-precision logits (a GPU run) are log-softmaxed in float32: the sum equals the float64 loop over the same
    bf16 values to float32 rounding, not to bf16's 3 digits."""
    g = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(2, 7, 50, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 7), generator=g)
    resp = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]], dtype=F64)
    got = dpo.response_logprob_sum(logits, ids, resp)
    assert got.dtype == torch.float32
    for b in range(2):
        want = sum(torch.log_softmax(logits[b, t - 1].double(), -1)[ids[b, t]].item()
                   for t in range(1, 7) if resp[b, t])
        assert got[b].item() == pytest.approx(want, abs=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# ppo_loss.py
# ---------------------------------------------------------------------------------------------------------------
def bt(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


SHAPE_CHECKS = {  # function: (its arguments of shape (2, 3) or (2, 3, V), the keyword-free extras)
    "masked_mean": (["x", "mask"], ()),
    "policy_loss": (["logprobs", "old_logprobs", "advantages", "mask"], (0.2,)),
    "value_loss": (["values", "old_values", "returns", "mask"], ()),
    "aggregate": (["loss_mat", "mask"], ()),
    "kl_sampled": (["logprobs", "ref_logprobs"], ()),
    "kl_full": (["logits", "ref_logits"], ()),
    "entropy_bonus_loss": (["logits", "mask"], (0.01,)),
    "ptx_loss": (["logits", "input_ids", "loss_mask"], ()),
}


@pytest.mark.parametrize("fn,wrong", [(fn, a) for fn, (args, _) in SHAPE_CHECKS.items() for a in args[1:]])
def test_ppo_loss_shape_errors_name_the_function_and_both_arguments(fn, wrong):
    """Every argument of the wrong shape is a ValueError naming ppo_loss.<fn>, the argument, and the one whose shape
    it must have (never a silent broadcast: a (2, 1) mask would broadcast)."""
    args, extra = SHAPE_CHECKS[fn]
    vocab = {"logits", "ref_logits"}
    ok = {a: (bt(2, 3, 5) if a in vocab else torch.ones(2, 3, dtype=torch.long) if a == "input_ids"
              else torch.ones(2, 3, dtype=F64)) for a in args}
    bad = dict(ok, **{wrong: ok[wrong][:, :1]})  # (2, 1) or (2, 1, V): broadcastable, so only the check catches it
    ref = {"entropy_bonus_loss": r"logits\[\.\.\., 0\]", "ptx_loss": "input_ids"}.get(fn, args[0])
    if fn == "ptx_loss" and wrong == "input_ids":  # checked against loss_mask first, then against the logits
        bad["loss_mask"] = bad["loss_mask"][:, :1]
        match = r"ppo_loss\.ptx_loss: `logits` has shape \(2, 3, 5\), expected \(2, 1\) \+ \(V,\)"
    else:
        v = r", 5" if wrong in vocab else ""
        match = rf"ppo_loss\.{fn}: `{wrong}` has shape \(2, 1{v}\), expected \(2, 3{v}\) \(the shape of `{ref}`\)"
    with pytest.raises(ValueError, match=match):
        getattr(ppo_loss, fn)(*[bad[a] for a in args], *extra)


def test_masked_var_unbiased_needs_two_real_entries():
    x = torch.tensor([1.0, 3.0, 7.0], dtype=F64)
    assert ppo_loss.masked_var(x, torch.tensor([1.0, 1.0, 0.0], dtype=F64), unbiased=True).item() == 2.0  # 2·1²/1
    with pytest.raises(ValueError, match="unbiased=True needs at least 2 real entries, the mask has 1"):
        ppo_loss.masked_var(x, torch.tensor([0.0, 1.0, 0.0], dtype=F64), unbiased=True)


def test_policy_loss_clip_eps_zero_clips_the_ratio_to_one():
    """ε = 0 is allowed (clip_eps >= 0): the clipped term is Â itself, so the objective is min(ρÂ, Â) (a loop)."""
    ratio, adv = [0.5, 1.5, 0.8, 1.2], [1.0, 1.0, -1.0, -1.0]
    logp = torch.log(torch.tensor([ratio], dtype=F64))
    loss, _ = ppo_loss.policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=F64),
                                   torch.ones_like(logp), 0.0)
    assert loss.item() == pytest.approx(-statistics.fmean(min(r * a, a) for r, a in zip(ratio, adv)), abs=1e-12)


def test_policy_loss_dual_clipfrac_against_a_loop():
    """dual_clipfrac: the fraction of real tokens where c·Â binds, i.e. Â < 0 and c·Â > min(ρÂ, clip(ρ)Â). Tokens
    with 0 < Â < 1 and Â > 1 are never counted, whatever ρ."""
    c, eps = 3.0, 0.2
    ratio = [0.5, 1.0, 4.0, 5.0, 1.0, 0.3, 2.0, 6.0]
    adv = [0.5, 0.5, -1.0, -0.4, -2.0, 2.0, 0.9, -0.1]
    logp = torch.log(torch.tensor([ratio], dtype=F64))
    loss, stats = ppo_loss.policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=F64),
                                       torch.ones_like(logp), eps, dual_clip=c)
    objective, binds = [], []
    for r, a in zip(ratio, adv):
        o = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
        binds.append(a < 0 and c * a > o)
        objective.append(max(o, c * a) if a < 0 else o)
    assert stats["dual_clipfrac"] == statistics.fmean(binds) and 0 < statistics.fmean(binds) < 0.5
    assert loss.item() == pytest.approx(-statistics.fmean(objective), abs=1e-12)


def test_aggregate_defaults_and_seq_mean_over_the_rows_with_a_real_token():
    """seq-mean-token-mean averages the per-row means of the rows that have a real token (a loop); an empty row counts
    for nothing, also when it is the only other row; the default mode is token-mean; seq-mean-token-sum-norm needs a
    max_len ≥ 1 (1 is allowed)."""
    x = bt(3, 4, seed=5)
    for rows in ([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]):
        mask = torch.tensor(rows, dtype=F64)
        want = statistics.fmean(statistics.fmean(x[i, t].item() for t in range(4) if rows[i][t])
                                for i in range(3) if any(rows[i]))
        assert ppo_loss.aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(want, abs=1e-12)
        assert ppo_loss.aggregate(x, mask).item() == ppo_loss.masked_mean(x, mask).item()
    mask = torch.ones(3, 4, dtype=F64)
    assert ppo_loss.aggregate(x, mask, "seq-mean-token-sum-norm", 1).item() == pytest.approx(x.sum().item() / 3)
    for max_len in (None, 0, -1):
        with pytest.raises(ValueError, match="seq-mean-token-sum-norm needs max_len, the response length cap"):
            ppo_loss.aggregate(x, mask, "seq-mean-token-sum-norm", max_len)
    with pytest.raises(ValueError, match="unknown mode 'sum'"):
        ppo_loss.aggregate(x, mask, "sum")


def test_kl_sampled_default_is_k1():
    lp, ref = bt(2, 3, seed=6), bt(2, 3, seed=7)
    assert torch.equal(ppo_loss.kl_sampled(lp, ref), lp - ref)


def test_entropy_bonus_is_off_at_exactly_the_clip():
    """At H̄ = δ the hinge max(0, δ − H̄) is 0: the bonus is not active (uniform logits: H̄ = log V exactly)."""
    logits = torch.zeros(1, 2, 4, dtype=F64)
    h = ppo_loss.entropy(logits)[0, 0].item()
    assert h == math.log(4)
    loss, stats = ppo_loss.entropy_bonus_loss(logits, torch.ones(1, 2, dtype=F64), 0.01, clip=h)
    assert loss.item() == 0.0 and stats == {"entropy": h, "entropy_bonus_active": 0.0}


def test_ptx_loss_stats_keys_and_values_against_a_loop():
    logits, ids = bt(2, 4, 6, seed=8), torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    nll = [-torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]].item()
           for b in range(2) for t in range(1, 4) if mask[b, t]]
    _, stats = ppo_loss.ptx_loss(logits, ids, mask)
    assert stats == pytest.approx({"ptx_loss": statistics.fmean(nll), "ptx_ppl": math.exp(statistics.fmean(nll)),
                                   "ptx_tokens": 5.0}, abs=1e-12)
