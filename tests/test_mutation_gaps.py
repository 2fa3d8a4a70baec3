"""Tests for the wrong edits that mutation testing (tools/mutation.py, docs/testing.md) found the other fast tests let
through: each checks the method file against an independent computation (a python loop, autograd,
torch.distributions, an exhaustive enumeration)."""
import itertools
import json
import math
import statistics
import threading
import types

import pytest
import safetensors.torch
import torch
from torch.testing import assert_close

import best_of_n
import critic_free
import dpo
import gae
import ppo_loss
import ppo_max

# The stage tests' libraries, imported here rather than inside the tests: mutmut's fork server collects this file once,
# so every mutant's run starts with them loaded (the model classes alone take seconds to import).
from plumbing import data
from plumbing import engine
from plumbing import lora
import reward_model
import tiny_model
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM, OPTForCausalLM  # noqa: F401 (loaded)
from test_ppo_max_update import B as PB, FixedScores, T as PT, batch, reseeded_prompts, tiny_lm, tiny_models
from plumbing import models

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
    # the reward-to-go is GAE's (λ = 1, V = 0): its shape check names the tensors
    with pytest.raises(ValueError, match=r"must all be \(B, T\) with the same shape; got rewards \(2, 3\), "
                                         r"values \(2, 3\), mask \(2, 4\)"):
        critic_free.discounted_returns(torch.zeros(2, 3), torch.ones(2, 4), 1.0)
    with pytest.raises(ValueError, match=r"same shape; got rewards \(3,\), values \(3,\), mask \(3,\)"):
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
    from plumbing import data
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


# dpo.py's stage, on a tiny GPT-2 (dropout 0.1 by default, learned absolute positions), in float64
DPO_ROWS = [("Human: how do I bake bread?\n\nAssistant:", " Mix flour, water and yeast.", " No."),
            ("Human: what is a good name for a cat?\n\nAssistant:", " Maybe Tom.", " I do not know."),
            ("Human: tell me a joke\n\nAssistant:", " A horse walks into a bar.", " No."),
            ("Human: is the sea salty?\n\nAssistant:", " Yes, quite.", " Who cares."),
            ("Human: how far is the moon?\n\nAssistant:", " About 384,000 km.", " Far."),
            ("Human: can I eat raw rice?\n\nAssistant:", " Better not: cook it first.", " Sure."),
            ("Human: why is the sky blue?\n\nAssistant:", " Blue light scatters more.", " It is not."),
            ("Human: how do I tie a knot?\n\nAssistant:", " Cross, loop and pull.", " Ask someone.")]
DPO_PAIRS = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in DPO_ROWS]
DPO_TRAIN, DPO_HELDOUT = DPO_PAIRS[:5], DPO_PAIRS[5:]


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A random-init GPT-2 (one layer, H = 32) and its tokenizer, trained on the pairs' texts."""
    from plumbing import data
    import tiny_model
    path = tmp_path_factory.mktemp("gpt2")
    tiny_model.build_model("gpt2", [p + y for p, c, r in DPO_ROWS for y in (c, r)] * 4, path, hidden=32, layers=1,
                           heads=4, vocab_size=300)
    return path, data.load_tokenizer(path)


def gpt2_model(path):
    """A fresh float64 copy of the tiny GPT-2, in train mode (as a stage hands it over)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=F64).train()


def logprob_by_loop(model, query: list[int], response: list[int]) -> torch.Tensor:
    """log π(y|x) of one unpadded sequence: Σ over the response tokens y_t of log softmax(logits at t − 1)[y_t]."""
    ids = torch.tensor([query + response])
    logits = model(input_ids=ids).logits[0]                                   # (L, V)
    return sum(torch.log_softmax(logits[t - 1], -1)[ids[0, t]] for t in range(len(query), ids.shape[1]))


def dpo_by_hand(model, tokenizer, pairs, heldout, cfg, seed, rank=0, world=1):
    """train_dpo written out on copies of `model` in eval mode (no dropout): π_ref a frozen copy, every log-prob a
    loop over one unpadded pair at a time, Eq. 7 written out and differentiated by autograd, torch's AdamW
    (no weight decay) at α·½(1 + cos(π·step/steps)) after a gradient clip to norm 1, rank r of W taking positions
    r, r + W, … of data.shuffled_batches' minibatches. Returns the log train_dpo should return, the trained copy and
    the gradient norms before clipping."""
    import copy

    from plumbing import data
    ref, pol = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    train, held = data.encode_pairs(pairs, tokenizer), data.encode_pairs(heldout, tokenizer)

    def logps(m, rows):  # (N,) each; float32 as pair_logprobs hands them back where no gradient is needed
        return (torch.stack([logprob_by_loop(m, q, w) for q, w, _ in rows]),
                torch.stack([logprob_by_loop(m, q, l) for q, _, l in rows]))

    def eq7(pw, pl, rw, rl):  # −mean log σ(β[(log π_w − log π_ref,w) − (log π_l − log π_ref,l)]) and its stats
        chosen, rejected = cfg.dpo_beta * (pw - rw), cfg.dpo_beta * (pl - rl)
        z = chosen - rejected
        acc = statistics.fmean(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in z.tolist())
        return -torch.log(torch.sigmoid(z)).mean(), {"accuracy": acc, "margin": z.mean().item(),
                                                     "chosen_reward": chosen.mean().item(),
                                                     "rejected_reward": rejected.mean().item()}

    with torch.no_grad():
        ref_w, ref_l = (x.float().double() for x in logps(ref, train))
        held_w, held_l = (x.float().double() for x in logps(ref, held))
    opt = torch.optim.AdamW(pol.parameters(), lr=cfg.dpo_lr, weight_decay=0.0)
    steps = max(1, int(cfg.dpo_epochs * len(pairs) / cfg.dpo_batch))
    order = data.shuffled_batches(len(pairs), cfg.dpo_batch, steps, seed)
    log, norms = [], []
    for step in range(steps + 1):
        if step % cfg.dpo_eval_every == 0 or step == steps:
            with torch.no_grad():
                pw, pl = (x.float().double() for x in logps(pol, held))
            loss, stats = eq7(pw, pl, held_w, held_l)
            log.append({"step": step, "heldout_accuracy": stats["accuracy"], "heldout_loss": loss.item()})
        if step == steps:
            break
        idx = next(order)[rank::world]
        pw, pl = logps(pol, [train[i] for i in idx])
        loss, stats = eq7(pw, pl, ref_w[idx], ref_l[idx])
        for group in opt.param_groups:
            group["lr"] = cfg.dpo_lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(pol.parameters(), 1.0).item())
        opt.step()
        log[-1].setdefault("train", []).append({"loss": loss.item(), **stats})
    return log, pol, norms


def assert_same_log(got: list[dict], want: list[dict]) -> None:
    assert [(r["step"], len(r.get("train", []))) for r in got] == [(r["step"], len(r.get("train", []))) for r in want]
    for g, w in zip(got, want):
        assert g["heldout_accuracy"] == w["heldout_accuracy"]
        assert g["heldout_loss"] == pytest.approx(w["heldout_loss"], abs=1e-6)  # float32 log-probs
        for gs, ws in zip(g.get("train", []), w.get("train", [])):
            assert gs == pytest.approx(ws, abs=1e-9), (g["step"], gs, ws)
        assert set(g) == set(w)


def assert_same_weights(got, want) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert_close(p, q, rtol=0, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_train_dpo_against_a_hand_written_loop(tiny_gpt2, tmp_path):
    """train_dpo on a tiny GPT-2 against dpo_by_hand: the same log (held-out loss and accuracy at steps 0, 3 and 4
    with eval_every 3; the stats of every step), the same weights after four AdamW steps at β = 0.5, the minibatches
    of seed 3 (crossing an epoch: 5 pairs, 2 a step), the gradient clip acting; training forward passes in train mode
    (where --lora-dropout acts) yet free of GPT-2's dropout 0.1, evaluations in eval mode, the model left in eval
    mode and saved with its tokenizer; the bar spans steps 0..4."""
    from transformers import AutoModelForCausalLM

    from plumbing import data
    path, tok = tiny_gpt2
    model = gpt2_model(path)
    cfg = dpo.DPOConfig(dpo_beta=0.5, dpo_lr=3e-3, dpo_epochs=1.6, dpo_batch=2, dpo_eval_every=3)
    want, by_hand, norms = dpo_by_hand(model, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=3)
    assert max(norms) > 1.0, norms  # the clip acts
    modes, bars = [], []
    model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    log = dpo.train_dpo(model, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=3, out_dir=tmp_path / "dpo",
                        progress=lambda r, desc: bars.append((list(r), desc)) or r)
    assert_same_log(log, want)
    assert [r["step"] for r in log] == [0, 3, 4] and log[0]["heldout_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert_same_weights(model, by_hand)
    assert bars == [([0, 1, 2, 3, 4], "DPO")]
    #           π_ref of the pairs, of the held-out pairs; eval at 0; steps 0-2; eval at 3; step 3; eval at 4
    assert modes == [False, False, False, True, True, True, False, True, False] and not model.training
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "dpo", dtype=F64)
    assert_same_weights(saved, by_hand)
    assert data.load_tokenizer(tmp_path / "dpo").get_vocab() == tok.get_vocab()


def test_train_dpo_on_rank_1_of_2_trains_on_its_slice_and_saves_nothing(tiny_gpt2, tmp_path, monkeypatch):
    """Rank 1 of a two-rank DeepSpeed run (engine's rank and world size set, its wrap and all_mean recorded): the
    DeepSpeed config and the learning rate reach engine.wrap, the rank trains on positions 1 and 3 of every minibatch
    of 4 (dpo_by_hand with rank 1 of 2), its batches and stats go to the model's device, and only rank 0 saves."""
    from plumbing import data
    from plumbing import engine
    path, tok = tiny_gpt2
    model = gpt2_model(path)
    cfg = dpo.DPOConfig(dpo_beta=0.5, dpo_lr=3e-3, dpo_epochs=2.0, dpo_batch=4, dpo_eval_every=1)
    want, by_hand, _ = dpo_by_hand(model, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=1, rank=1, world=2)
    ds, wrapped, devices, minibatches = {"zero_optimization": {"stage": 2}}, [], [], data.minibatches
    monkeypatch.setattr(engine, "rank", lambda: 1)
    monkeypatch.setattr(engine, "world_size", lambda: 2)
    monkeypatch.setattr(engine, "wrap", lambda m, opt, config, lr: wrapped.append((m, config, lr)) or (m, opt))
    monkeypatch.setattr(engine, "all_mean", lambda stats, device="cpu": devices.append(device) or stats)
    monkeypatch.setattr(data, "minibatches", lambda *args: devices.append(args[6]) or minibatches(*args))
    log = dpo.train_dpo(model, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=1, ds=ds, out_dir=tmp_path / "dpo")
    assert_same_log(log, want)
    assert_same_weights(model, by_hand)
    assert len(wrapped) == 1 and wrapped[0][0] is model and wrapped[0][1:] == (ds, cfg.dpo_lr)
    assert devices == [torch.device("cpu")] * 3  # the minibatches, then the stats of steps 0 and 1
    assert not (tmp_path / "dpo").exists()


def test_train_dpo_keeps_lora_dropout_and_takes_at_least_one_step(tiny_gpt2):
    """Under LoRA with --lora-dropout the adapters' dropout stays (the rest of GPT-2's is switched off), only the
    adapters train, and fewer pairs than one minibatch (5 < 8) still make one step."""
    from types import SimpleNamespace

    from plumbing import lora
    path, tok = tiny_gpt2
    run = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=0.5, lora_targets="auto", lora_bits=16)
    model = lora.add_adapters(gpt2_model(path), run, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = dpo.train_dpo(model, tok, DPO_TRAIN, DPO_HELDOUT, dpo.DPOConfig(dpo_lr=1e-2, dpo_batch=8), seed=0)
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 1), (1, 0)]
    p = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert {q for n, q in p.items() if "lora_dropout" in n} == {0.5} and {q for n, q in p.items()
                                                                         if "lora_dropout" not in n} == {0.0}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)


def test_train_dpo_skips_a_step_whose_loss_is_not_finite(tiny_gpt2):
    """A NaN in the weights makes every log-prob NaN: each step is skipped (the weights stay as they were) and the
    stage runs to its end, logging the NaN losses."""
    path, tok = tiny_gpt2
    model = gpt2_model(path)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")                  # the logit of token 0, everywhere
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = dpo.train_dpo(model, tok, DPO_TRAIN, DPO_HELDOUT, dpo.DPOConfig(dpo_batch=2, dpo_epochs=0.8), seed=0)
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 2), (2, 0)]
    assert all(math.isnan(s["loss"]) for s in log[0]["train"])
    for n, p in model.named_parameters():  # (GPT-2's LM head is its token embedding)
        assert_close(p, before[n], rtol=0, atol=0, equal_nan=True, msg=n)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_logprobs_of_padded_rows_against_a_token_loop(tiny_gpt2, side):
    """log π(y|x) of padded rows equals the loop over each sequence alone, left padding included (GPT-2's positions
    are absolute, so they must come from the mask, and the padding must be masked)."""
    from plumbing import data
    path, tok = tiny_gpt2
    model = gpt2_model(path).eval()
    rows = [(q, y) for q, w, l in data.encode_pairs(DPO_PAIRS[:3], tok) for y in (w, l)]
    ids, attn = data.pad([q + y for q, y in rows], 0, side)
    resp, _ = data.pad([[0] * len(q) + [1] * len(y) for q, y in rows], 0, side)
    with torch.no_grad():
        got = dpo.sequence_logprobs(model, ids, attn, resp)
        want = torch.stack([logprob_by_loop(model, q, y) for q, y in rows])
    assert_close(got, want, rtol=0, atol=1e-10)


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


# ---------------------------------------------------------------------------------------------------------------
# reward_model.py's stage, on the tiny GPT-2 of dpo.py's tests with a scalar head
# ---------------------------------------------------------------------------------------------------------------
def score_by_loop(rm, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """r(x, y) of one unpadded sequence: the head on the last hidden state (after the final norm) at the last
    position whose id is not rm.score_pad_id (any id when None); and the LM logits (L, V) of the same pass."""
    out = rm.lm(input_ids=torch.tensor([seq]), output_hidden_states=True)
    t = max(i for i, x in enumerate(seq) if x != rm.score_pad_id)
    return out.hidden_states[-1][0, t] @ rm.head.weight[0] + rm.head.bias[0], out.logits[0]


def rm_by_hand(rm, tokenizer, pairs, heldout, cfg, seed, rank=0, world=1):
    """train_reward_model written out on a copy of `rm` in eval mode (no dropout): each score and each token's NLL by
    a loop over one unpadded sequence, Eq. 2 written out (−mean log σ(r_w − r_l) + β_rm·the chosen responses' NLL
    per token) and differentiated by autograd, torch's AdamW (no weight decay) at α·½(1 + cos(π·step/steps)) after
    a gradient clip to norm 1, rank r of W taking positions r, r + W, … of data.shuffled_batches' minibatches; the
    held-out accuracy counts a tie ½, on float32 scores. Returns the expected log and the trained copy."""
    import copy

    from plumbing import data
    pol = copy.deepcopy(rm).eval()
    train, held = data.encode_pairs(pairs, tokenizer), data.encode_pairs(heldout, tokenizer)

    def heldout_accuracy():
        with torch.no_grad():
            margins = [(score_by_loop(pol, q + w)[0].float() - score_by_loop(pol, q + l)[0].float()).item()
                       for q, w, l in held]
        return statistics.fmean(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins)

    opt = torch.optim.AdamW(pol.parameters(), lr=cfg.rm_lr, weight_decay=0.0)
    steps = max(1, int(cfg.rm_epochs * len(pairs) / cfg.rm_batch))
    order = data.shuffled_batches(len(pairs), cfg.rm_batch, steps, seed)
    log = []
    for step in range(steps + 1):
        if step % cfg.rm_eval_every == 0 or step == steps:
            log.append({"step": step, "heldout_accuracy": heldout_accuracy()})
        if step == steps:
            break
        rows = [train[i] for i in next(order)[rank::world]]
        r_w, r_l, nll = [], [], []
        for q, w, l in rows:
            score, logits = score_by_loop(pol, q + w)
            r_w.append(score)
            r_l.append(score_by_loop(pol, q + l)[0])
            seq = q + w
            nll += [-torch.log_softmax(logits[t - 1], -1)[seq[t]] for t in range(len(q), len(seq))]
        r_w, r_l = torch.stack(r_w), torch.stack(r_l)
        bt, lm = -torch.log(torch.sigmoid(r_w - r_l)).mean(), torch.stack(nll).mean()
        loss = 1.0 * bt + cfg.rm_lm_coef * lm                                        # Eq. 2
        margins = (r_w - r_l).tolist()
        for group in opt.param_groups:
            group["lr"] = cfg.rm_lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(pol.parameters(), 1.0)
        opt.step()
        log[-1].setdefault("train", []).append({
            "bt": bt.item(), "lm": lm.item(), "margin": statistics.fmean(margins),
            "accuracy": statistics.fmean(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins)})
    return log, pol


def scalar_head_gpt2(path, tokenizer, score_pad_id=None):
    import reward_model
    return reward_model.ScalarHeadModel(gpt2_model(path), seed=0, score_pad_id=score_pad_id).train()


class Bar:
    """What monitor.progress returns, recorded: the steps it spans and every postfix set on it."""
    def __init__(self, iterable, desc, **kwargs):
        self.iterable, self.desc, self.kwargs, self.postfix = list(iterable), desc, kwargs, []

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **kwargs):
        self.postfix.append(kwargs)


def test_train_reward_model_against_a_hand_written_loop(tiny_gpt2, tmp_path, monkeypatch):
    """train_reward_model on a tiny GPT-2 with a scalar head that reads before the final EOS (score_pad_id, as a
    sequence-classification reward model) against rm_by_hand: the same log (held-out accuracy at steps 0, 3 and 4,
    the stats of every step), the same weights after four AdamW steps on Eq. 2 with β_rm = 0.5; training forward
    passes in train mode yet free of GPT-2's dropout, evaluations in eval mode, the model left in eval mode and
    saved (head, where it reads, tokenizer); the bar spans steps 0..4 and shows each held-out accuracy."""
    from plumbing import data
    import reward_model
    path, tok = tiny_gpt2
    rm = scalar_head_gpt2(path, tok, score_pad_id=tok.eos_token_id)
    cfg = reward_model.RMConfig(rm_epochs=1.6, rm_lr=3e-3, rm_batch=2, rm_lm_coef=0.5, rm_eval_every=3)
    want, by_hand = rm_by_hand(rm, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=3)
    bars, modes = [], []
    monkeypatch.setattr(reward_model, "progress", lambda *args, **kwargs: bars.append(Bar(*args, **kwargs)) or bars[-1])
    rm.lm.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    log = reward_model.train_reward_model(rm, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=3, out_dir=tmp_path / "rm")
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 3), (3, 1), (4, 0)]
    for g, w in zip(log, want):
        assert g["heldout_accuracy"] == w["heldout_accuracy"] and set(g) == set(w)
        for gs, ws in zip(g.get("train", []), w.get("train", [])):
            assert gs == pytest.approx(ws, abs=1e-9), (g["step"], gs, ws)
    assert_same_weights(rm, by_hand)
    assert modes == [False, True, True, True, False, True, False] and not rm.training
    assert [(b.iterable, b.desc, b.kwargs) for b in bars] == [([0, 1, 2, 3, 4], "2. reward model",
                                                               {"leave": False, "disable": False})]
    assert bars[0].postfix == [{"acc": f"{r['heldout_accuracy']:.3f}", "refresh": False} for r in log]
    saved = reward_model.ScalarHeadModel.from_pretrained(tmp_path / "rm", torch_dtype=F64)
    assert saved.score_pad_id == tok.eos_token_id
    assert_same_weights(saved.lm, by_hand.lm)
    head = safetensors.torch.load_file(str(tmp_path / "rm" / models.VALUE_HEAD_WEIGHTS))  # (from_pretrained
    assert_close(head, by_hand.head.state_dict(), rtol=0, atol=1e-9)  # reads a head through float32)
    assert data.load_tokenizer(tmp_path / "rm").get_vocab() == tok.get_vocab()


def test_train_reward_model_on_rank_1_of_2_trains_on_its_slice_and_saves_nothing(tiny_gpt2, tmp_path, monkeypatch):
    """Rank 1 of a two-rank DeepSpeed run (engine's rank and world size set, its wrap and all_mean recorded): the
    config and the learning rate reach engine.wrap, the rank trains on positions 1 and 3 of every minibatch of 4
    (rm_by_hand with rank 1 of 2), its batches and stats go to the model's device, its bar is off, it saves nothing."""
    from plumbing import data
    from plumbing import engine
    import reward_model
    path, tok = tiny_gpt2
    rm = scalar_head_gpt2(path, tok)
    cfg = reward_model.RMConfig(rm_epochs=2.0, rm_lr=3e-3, rm_batch=4, rm_lm_coef=1.0, rm_eval_every=1)
    want, by_hand = rm_by_hand(rm, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=1, rank=1, world=2)
    ds, wrapped, devices, bars, minibatches = {"zero_optimization": {"stage": 2}}, [], [], [], data.minibatches
    monkeypatch.setattr(engine, "rank", lambda: 1)
    monkeypatch.setattr(engine, "world_size", lambda: 2)
    monkeypatch.setattr(engine, "wrap", lambda m, opt, config, lr: wrapped.append((m, config, lr)) or (m, opt))
    monkeypatch.setattr(engine, "all_mean", lambda stats, device="cpu": devices.append(device) or stats)
    monkeypatch.setattr(data, "minibatches", lambda *args: devices.append(args[6]) or minibatches(*args))
    monkeypatch.setattr(reward_model, "progress", lambda *args, **kwargs: bars.append(Bar(*args, **kwargs)) or bars[-1])
    log = reward_model.train_reward_model(rm, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=1, ds=ds, out_dir=tmp_path / "rm")
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 1), (1, 1), (2, 0)]
    for g, w in zip(log, want):
        assert g["heldout_accuracy"] == w["heldout_accuracy"]
        for gs, ws in zip(g.get("train", []), w.get("train", [])):
            assert gs == pytest.approx(ws, abs=1e-9), (g["step"], gs, ws)
    assert_same_weights(rm, by_hand)
    assert len(wrapped) == 1 and wrapped[0][0] is rm and wrapped[0][1:] == (ds, cfg.rm_lr)
    assert devices == [torch.device("cpu")] * 3  # the minibatches, then the stats of steps 0 and 1
    assert bars[0].kwargs["disable"] is True and not (tmp_path / "rm").exists()


def test_train_reward_model_keeps_lora_dropout_and_takes_at_least_one_step(tiny_gpt2):
    """Under LoRA with --lora-dropout the adapters' dropout stays (the rest of GPT-2's is switched off), only the
    adapters and the head train, and fewer pairs than one minibatch (5 < 8) still make one step."""
    from types import SimpleNamespace

    from plumbing import lora
    import reward_model
    path, tok = tiny_gpt2
    run = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=0.5, lora_targets="auto", lora_bits=16)
    rm = lora.add_adapters(scalar_head_gpt2(path, tok), run, seed=0)
    before = {n: p.detach().clone() for n, p in rm.named_parameters()}
    log = reward_model.train_reward_model(rm, tok, DPO_TRAIN, DPO_HELDOUT, reward_model.RMConfig(rm_batch=8), seed=0)
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 1), (1, 0)]
    p = {n: m.p for n, m in rm.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert {q for n, q in p.items() if "lora_dropout" in n} == {0.5} and {q for n, q in p.items()
                                                                         if "lora_dropout" not in n} == {0.0}
    changed = {n for n, p in rm.named_parameters() if not torch.equal(p, before[n])}
    assert "head.weight" in changed and all("lora_" in n or n.startswith("head.") for n in changed)


def test_train_reward_model_skips_a_step_whose_loss_is_not_finite(tiny_gpt2):
    """A NaN in the head's weight makes every score NaN: each step is skipped (the weights stay as they were) and
    the stage runs to its end."""
    import reward_model
    path, tok = tiny_gpt2
    rm = scalar_head_gpt2(path, tok)
    with torch.no_grad():
        rm.head.weight[0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in rm.named_parameters()}
    cfg = reward_model.RMConfig(rm_batch=2, rm_epochs=0.8)
    log = reward_model.train_reward_model(rm, tok, DPO_TRAIN, DPO_HELDOUT, cfg, seed=0)
    assert [(r["step"], len(r.get("train", []))) for r in log] == [(0, 2), (2, 0)]
    assert all(math.isnan(s["bt"]) for s in log[0]["train"])
    for n, p in rm.named_parameters():
        assert_close(p, before[n], rtol=0, atol=0, equal_nan=True, msg=n)


def test_score_pairs_scores_each_sequence_alone(tiny_gpt2):
    """score_pairs of {"prompt", "chosen", "rejected"} rows: r(x, y_w) and r(x, y_l) of each pair, as the loop scores
    the sequence alone, in batches of any size."""
    from plumbing import data
    import reward_model
    path, tok = tiny_gpt2
    rm = scalar_head_gpt2(path, tok).eval()
    with torch.no_grad():
        want = [torch.stack([score_by_loop(rm, q + y)[0] for q, w, l in data.encode_pairs(DPO_PAIRS, tok)
                             for y in [(w, l)[k]]]).float() for k in (0, 1)]
        for batch in (1, 3, 256):
            got = reward_model.score_pairs(rm, tok, DPO_PAIRS, batch=batch)
            assert_close(got, tuple(want), rtol=0, atol=1e-6)
        assert_close(reward_model.score_pairs(rm, tok, DPO_PAIRS), tuple(want), rtol=0, atol=1e-6)


def tiny_opt():
    """An OPT whose backbone projects its 32-wide states to 16 before the LM head (as OPT-350m: 1024 → 512)."""
    import transformers
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=50, hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64))


def test_head_width_measures_what_the_lm_head_reads_and_leaves_the_model_as_it_was():
    """OPT's LM head reads 16-wide states, not config.hidden_size 32: head_width measures it on one token, leaving
    torch's RNG, the model's mode and its hooks as they were; the scalar head then reads the very state the LM head
    reads. A backbone that cannot run one token alone measures None (the config's width then), leaving the same."""
    import reward_model
    torch.manual_seed(0)
    lm = tiny_opt().train()
    rng = torch.get_rng_state()
    assert models.head_width(lm) == 16 == lm.lm_head.in_features != lm.config.hidden_size
    assert torch.equal(torch.get_rng_state(), rng) and lm.training
    assert not [m for m in lm.modules() if m._forward_hooks]
    assert models.measured_width(lm.eval()) == 16 and not lm.training
    rm = reward_model.ScalarHeadModel(lm, seed=0).double().eval()
    read = []
    rm.lm.lm_head.register_forward_pre_hook(lambda m, args: read.append(args[0]))
    ids, mask = torch.tensor([[5, 9, 11, 3, 0], [8, 2, 4, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        values, logits = rm(ids, mask, return_logits=True)
    assert_close(values, read[0] @ rm.head.weight[0] + rm.head.bias[0], rtol=0, atol=1e-12)

    def refuse(*args, **kwargs):
        raise RuntimeError("needs more than one token")

    lm = tiny_opt().train()
    lm.model.decoder.forward = refuse
    assert models.measured_width(lm) is None and models.head_width(lm) == 32
    assert lm.training and not [m for m in lm.modules() if m._forward_hooks]


class TupleBackbone(torch.nn.Module):
    """A backbone that hands back a plain tuple (hidden states,), 24 wide, as transformers' return_dict=False did."""
    def forward(self, input_ids, **kwargs):
        return (torch.zeros(*input_ids.shape, 24),)


class BareLM(torch.nn.Module):
    """The least a causal LM needs for measured_width: a device, a forward, and a base model (or none)."""
    device = torch.device("cpu")

    def __init__(self, base_model):
        super().__init__()
        self.base_model = base_model

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return self.base_model(input_ids) if self.base_model is not None else input_ids


def test_measured_width_reads_a_tuple_backbone_and_is_none_without_a_backbone():
    """A backbone's output that is a plain tuple is measured by its first element; an LM with no backbone to hook
    measures None (head_width then takes the config's width), with no hook left behind."""
    lm = BareLM(TupleBackbone())
    assert models.measured_width(lm) == 24 and not lm.base_model._forward_hooks
    assert models.measured_width(BareLM(None)) is None


# ---------------------------------------------------------------------------------------------------------------
# ppo_max.py
# ---------------------------------------------------------------------------------------------------------------
def test_a_running_std_at_the_floor_counts_as_no_spread():
    """The docstrings' rule, std ≤ eps: the scale stays 1 (Eq. 18 and scaling); just above the floor it divides."""
    scores = torch.tensor([2.0, -1.0], dtype=F64)
    at = types.SimpleNamespace(mean=0.5, std=1e-8)
    assert ppo_max.scale_rewards(scores, at).tolist() == [2.0, -1.0]
    assert ppo_max.normalize_and_clip_rewards(scores, at, None).tolist() == [1.5, -1.5]
    above = types.SimpleNamespace(mean=0.5, std=2e-8)
    assert ppo_max.scale_rewards(scores, above).tolist() == pytest.approx([1e8, -5e7])
    assert ppo_max.normalize_and_clip_rewards(scores, above, None).tolist() == pytest.approx([7.5e7, -7.5e7])


def test_shape_rewards_checks_a_given_kl_and_takes_scores_of_another_dtype():
    """shape_rewards itself refuses a per-token KL of the wrong shape, and a bf16 score (a bf16 reward model) lands
    on the last real token of float32 rewards, rounded only by bf16 itself."""
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]])
    ref = torch.tensor([[-1.2, -0.5, -1.0], [-0.4, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match=r"kl must be \(B, T\) = \(2, 3\); got \(2, 2\)"):
        ppo_max.shape_rewards(torch.zeros(2), lp, ref, mask, 0.1, kl=torch.zeros(2, 2))
    scores = torch.tensor([1.5, -0.25], dtype=torch.bfloat16)
    got = ppo_max.shape_rewards(scores, lp, ref, mask, 0.1)
    want = [[-0.1 * (lp[b, t] - ref[b, t]).item() * mask[b, t].item() for t in range(3)] for b in range(2)]
    want[0][2] += 1.5
    want[1][1] += -0.25
    assert got.dtype == torch.float32
    assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)


class Recording(torch.nn.Module):
    """A model that records the keyword arguments of every forward call, then runs the wrapped one."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return self.model(**kwargs)


def test_policy_logits_hands_the_model_the_mask_of_prompt_and_response():
    """Padding is known by the mask: the model gets the left-padded prompt's and the right-padded response's mask,
    and positions counted from it. (transformers' own LLaMA and GPT-2 give the same logits without the mask when
    positions restart at each padded token, by their packed-sequence detection, so only the call itself tells; an
    architecture without that detection would attend to the padding.)"""
    policy, _, _ = tiny_models()
    query, query_mask, response, mask = batch(4)
    model = Recording(policy)
    with torch.no_grad():
        ppo_max.policy_logits(model, query, query_mask, response, mask)
    (call,) = model.calls
    attn = torch.cat([query_mask, mask], 1)
    assert torch.equal(call["attention_mask"], attn) and torch.equal(call["input_ids"], torch.cat([query, response], 1))
    assert torch.equal(call["position_ids"], (attn.long().cumsum(1) - 1).clamp(min=0))


def pretrain_inputs():
    policy, ref, critic = tiny_models()
    query, query_mask, _, _ = batch(3)
    cfg = ppo_max.PPOConfig(critic_pretrain_steps=3, rollout_batch=PB, minibatch=3, ppo_epochs=1, max_new_tokens=PT)
    return policy, ref, critic, query, query_mask, cfg


def test_pretrain_critic_rolls_out_with_the_prompts_mask_and_skips_a_non_finite_round(monkeypatch):
    """Critic pre-training samples with the prompt batch's own mask, and a round whose experience is not finite is
    skipped (no step, no log line) while the rounds after it still run."""
    policy, ref, critic, query, query_mask, cfg = pretrain_inputs()
    masks, calls = [], {"n": 0}
    rollout, make_experience = ppo_max.rollout, ppo_max.make_experience

    def recorded_rollout(policy, query, query_mask, *args, **kwargs):
        masks.append(query_mask)
        return rollout(policy, query, query_mask, *args, **kwargs)

    def first_round_nonfinite(*args):
        exp = make_experience(*args)
        calls["n"] += 1
        return {**exp, "nonfinite": "reward/score"} if calls["n"] == 1 else exp

    monkeypatch.setattr(ppo_max, "rollout", recorded_rollout)
    monkeypatch.setattr(ppo_max, "make_experience", first_round_nonfinite)
    log = ppo_max.pretrain_critic(policy, ref, FixedScores(torch.ones(PB), [1.0, 2.0, 3.0]), critic,
                                  torch.optim.AdamW(critic.parameters(), lr=1e-2), ppo_max.RunningMoments(),
                                  reseeded_prompts(query, query_mask), cfg, eos_id=2, pad_id=0, kl_coef=0.1)
    assert len(masks) == 3 and all(m is query_mask for m in masks)
    assert [r["round"] for r in log] == [1, 2]


def test_pretrain_critic_skips_a_non_finite_value_loss_and_goes_on(monkeypatch):
    """A NaN value loss in pre-training skips that optimizer step (the critic keeps its weights) instead of failing;
    the next minibatch steps as usual."""
    policy, ref, critic, query, query_mask, cfg = pretrain_inputs()
    cfg.critic_pretrain_steps = 1
    value_loss, calls, weights = ppo_max.value_loss, {"n": 0}, []

    def nan_first(values, *args):
        loss, stats = value_loss(values, *args)
        calls["n"] += 1
        weights.append(critic.head.weight.detach().clone())
        return (loss * float("nan"), stats) if calls["n"] == 1 else (loss, stats)

    monkeypatch.setattr(ppo_max, "value_loss", nan_first)
    log = ppo_max.pretrain_critic(policy, ref, FixedScores(torch.ones(PB), [1.0]), critic,
                                  torch.optim.AdamW(critic.parameters(), lr=1e-2), ppo_max.RunningMoments(),
                                  reseeded_prompts(query, query_mask), cfg, eos_id=2, pad_id=0, kl_coef=0.1)
    assert calls["n"] == 2 and len(log) == 1 and math.isnan(log[0]["loss/vf_first"])
    assert torch.equal(weights[0], weights[1])                                  # the NaN step was not taken
    assert not torch.equal(weights[1], critic.head.weight.detach())             # the finite one was


# ---------------------------------------------------------------------------------------------------------------
# reward_model.py: the model half (ScalarHeadModel, its files, the read positions)
# ---------------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0, cls=LlamaForCausalLM, **config_extra):
    """test_ppo_max_update's tiny LLaMA (hidden 16, vocabulary 32) as `cls`, in eval mode."""
    return tiny_lm(seed, cls, **config_extra).eval()


def test_last_token_index_names_the_rows_without_a_real_token():
    mask = torch.tensor([[1, 1, 0, 0, 0], [0] * 5, [0, 1, 1, 1, 0], [0] * 5])
    with pytest.raises(ValueError, match=r"^last_token_index: rows \[1, 3\] of attention_mask have no real token"):
        reward_model.last_token_index(mask)


def test_a_fresh_head_is_seeded_and_scaled_as_documented():
    """N(0, 1/(H + 1)) weights drawn from a generator seeded with `seed` (0 by default, also in from_pretrained),
    or from torch's global RNG with seed=None; zero bias."""
    lm = tiny_llama()
    for seed in (0, 3):
        want = torch.randn((1, 16), generator=torch.Generator().manual_seed(seed)) / math.sqrt(17)
        rm = reward_model.ScalarHeadModel(lm) if seed == 0 else reward_model.ScalarHeadModel(lm, seed=seed)
        assert_close(rm.head.weight, want, rtol=0, atol=0)
        assert rm.head.bias.item() == 0.0
    torch.manual_seed(5)
    torch.nn.Linear(16, 1)  # the head's own default init draws first
    want = torch.randn((1, 16)) / math.sqrt(17)
    torch.manual_seed(5)
    assert_close(reward_model.ScalarHeadModel(lm, seed=None).head.weight, want, rtol=0, atol=0)


def test_forward_asks_the_lm_for_one_row_of_logits_and_no_cache_and_returns_them_when_asked():
    """Without return_logits the (B, L, V) logits are skipped (logits_to_keep = 1) and no KV cache is built; with it
    the full logits come back, the LM's own."""
    rm = reward_model.ScalarHeadModel(tiny_llama())
    calls = []
    rm.lm.register_forward_pre_hook(lambda m, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    ids, mask = torch.tensor([[5, 9, 11, 3], [0, 8, 2, 4]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    with torch.no_grad():
        rm(ids, mask)
        values, logits = rm(ids, mask, return_logits=True)
        want = rm.lm(input_ids=ids, attention_mask=mask, position_ids=data.position_ids_from_mask(mask)).logits
    assert calls[0]["logits_to_keep"] == 1 and calls[0]["use_cache"] is False
    assert "logits_to_keep" not in calls[1] and calls[1]["use_cache"] is False
    assert logits.shape == (2, 4, 32)
    assert_close(logits, want, rtol=0, atol=1e-6)


class Bypass(LlamaForCausalLM):
    """A causal LM that runs its named backbone without calling it as a module (no forward hook sees it)."""
    seen: list = []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None,
                output_hidden_states=None, logits_to_keep=0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        self.seen.append((output_hidden_states, logits_to_keep))
        out = self.model.forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=use_cache, output_hidden_states=output_hidden_states)
        h = out.last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(h[:, -logits_to_keep:]), hidden_states=out.hidden_states)


def test_forward_falls_back_to_the_last_hidden_state_when_the_named_backbone_is_not_called():
    """No hook caught the backbone: a second call with output_hidden_states, whose last entry (after the final
    norm) is what the LM head reads; the values are the head on it."""
    lm = tiny_llama(cls=Bypass)
    rm = reward_model.ScalarHeadModel(lm)
    ids, mask = torch.tensor([[5, 9, 11, 3], [0, 8, 2, 4]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    Bypass.seen = []
    with torch.no_grad():
        values = rm(ids, mask)
        pos = data.position_ids_from_mask(mask)
        h = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    assert Bypass.seen == [(False, 1), (True, 1)]
    assert_close(values, (h @ rm.head.weight[0]) + rm.head.bias[0], rtol=0, atol=1e-6)


def test_forward_names_a_hidden_state_of_another_width_than_the_head():
    rm = reward_model.ScalarHeadModel(tiny_llama(), head=torch.nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"^ScalarHeadModel: LlamaForCausalLM's last hidden state is \(1, 3, 16\), "
                                         r"not \(B, L, H\) = \(1, 3, 8\)$"):
        rm(torch.tensor([[4, 5, 6]]), torch.tensor([[1, 1, 1]]))


def test_value_head_json_says_what_the_head_reads(tmp_path):
    lm = tiny_llama()
    for pad_id, reads in ((None, "score(): the last position where attention_mask == 1"),
                          (7, "score(): the last position where attention_mask == 1 and the id is not 7 "
                              "(transformers' sequence-classification pooling)")):
        reward_model.ScalarHeadModel(lm, score_pad_id=pad_id).double().save_head(tmp_path)
        assert json.loads((tmp_path / "value_head.json").read_text()) == {
            "hidden_size": 16, "dtype": "float64", "reads": reads + "; forward(): every position",
            "score_pad_id": pad_id, "weights": "value_head.safetensors"}
        assert models.reward_model_kind(tmp_path) == "scalar-head"


def test_from_pretrained_checks_the_head_file_loads_without_its_json_and_takes_a_dtype(tmp_path):
    """A head file with another key or shape is a ValueError naming the file and what it holds; a head file without
    value_head.json loads (reading the last real token); a plain LM is refused as a reward model, naming the directory,
    and gets the default seed's head as a critic; torch_dtype reaches the LM and the head."""
    d = tmp_path / "rm"
    tiny_llama().save_pretrained(d)
    assert models.reward_model_kind(d) is None
    with pytest.raises(ValueError, match=rf"^{d}: not a reward model"):
        reward_model.ScalarHeadModel.from_pretrained(d, require_head=True)
    fresh = reward_model.ScalarHeadModel.from_pretrained(d)
    assert_close(fresh.head.weight, reward_model.ScalarHeadModel(tiny_llama()).head.weight, rtol=0, atol=0)
    wide = reward_model.ScalarHeadModel.from_pretrained(d, torch_dtype=F64)
    assert wide.lm.dtype == F64 and wide.head.weight.dtype == F64
    for state in ({"weight": torch.zeros(1, 16), "bias": torch.zeros(1), "scale": torch.ones(1)},
                  {"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}):
        safetensors.torch.save_file(state, str(d / "value_head.safetensors"))
        shapes = {k: tuple(state[k].shape) for k in sorted(state)}  # as the file lists them
        with pytest.raises(ValueError, match=r"^ScalarHeadModel\.from_pretrained: '.*value_head\.safetensors' holds "
                                             + __import__("re").escape(str(shapes)) + r"; expected weight \(1, 16\)"):
            reward_model.ScalarHeadModel.from_pretrained(d)
    safetensors.torch.save_file({"weight": torch.full((1, 16), 0.5), "bias": torch.ones(1)},
                                str(d / "value_head.safetensors"))
    rm = reward_model.ScalarHeadModel.from_pretrained(d, require_head=True)
    assert rm.score_pad_id is None and rm.head.weight.eq(0.5).all() and rm.head.bias.item() == 1.0


def test_reward_models_and_critics_are_loaded_without_remote_code(tmp_path, monkeypatch):
    """Every from_pretrained of a reward model or critic passes trust_remote_code=False (and the dtype asked for)."""
    import transformers
    seen = []

    def recorded(original):
        def load(path, *args, **kwargs):
            seen.append(kwargs)
            return original(path, *args, **kwargs)
        return load

    causal, seqcls = tmp_path / "causal", tmp_path / "seqcls"
    tiny_llama().save_pretrained(causal)
    tiny_llama(cls=transformers.LlamaForSequenceClassification, num_labels=1).save_pretrained(seqcls)
    monkeypatch.setattr(models, "causal_lm_class", lambda path: types.SimpleNamespace(
        from_pretrained=recorded(LlamaForCausalLM.from_pretrained)))
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        recorded(transformers.AutoModelForSequenceClassification.from_pretrained))
    for path in (causal, seqcls):
        rm = reward_model.ScalarHeadModel.from_pretrained(path, torch_dtype=F64)
        assert seen[-1] == {"trust_remote_code": False, "dtype": F64} and rm.lm.dtype == F64


def test_a_sequence_classification_rm_keeps_its_dtype_and_needs_one_label(tmp_path):
    """Saved in bf16 and loaded without a dtype, its backbone stays bf16 (the causal LM built around it too) and the
    head is its score's; num_labels = 2 is refused, naming the count."""
    import transformers
    seq = tiny_llama(cls=transformers.LlamaForSequenceClassification, num_labels=1).to(torch.bfloat16)
    seq.save_pretrained(tmp_path / "bf16")
    rm = reward_model.ScalarHeadModel.from_pretrained(tmp_path / "bf16")
    assert rm.lm.dtype == torch.bfloat16 == rm.head.weight.dtype and rm.score_pad_id == 0
    assert torch.equal(rm.head.weight, seq.score.weight)
    tiny_llama(cls=transformers.LlamaForSequenceClassification, num_labels=2).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match=r"a sequence-classification model with num_labels = 2; a reward model has "
                                         r"one output"):
        reward_model.ScalarHeadModel.from_pretrained(tmp_path / "two")


def test_head_width_of_an_lm_whose_output_embeddings_are_not_a_linear_is_the_configs():
    """No Linear LM head to read a width from (get_output_embeddings None, or a module without in_features): the
    text config's hidden size."""
    lm = tiny_llama()
    lm.get_output_embeddings = lambda: None
    assert models.head_width(lm) == 16
    lm.get_output_embeddings = lambda: torch.nn.Identity()
    assert models.head_width(lm) == 16
