"""Tests for the recipe half of ppo_max.py: step (6) `ppo_update`, critic pre-training, the logged numbers, the adaptive
KL controller, the presets, the read positions and the input checks.

Each is checked against an independent computation on tiny random-init models (a 2-layer LLaMA, hidden size 16,
vocabulary 32; the critic a reward_model.ScalarHeadModel on another one): the PPO losses written out with plain torch
ops (Eq. 15, 16, 17 and the entropy bonus), autograd gradients on deep copies, the global-norm clip and a
torch.optim.AdamW step on those copies, python loops over tokens and prefixes, and the paper's numbers written here.
"""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ppo_max
from reward_model import ScalarHeadModel
from plumbing import config, monitor

B, P, T, V = 6, 3, 5, 32  # rollout batch, prompt tokens (left-padded), response tokens (right-padded), vocabulary
MAX_NEW = 7               # --max-new-tokens: the cap T_max, larger than this batch's T (Dr. GRPO's divisor uses it)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def tiny_lm(seed: int, cls=None, **config_extra):
    """The tiny LLaMA (hidden 16, 2 layers, vocabulary V), as `cls` (LlamaForCausalLM by default; e.g. a
    LlamaForSequenceClassification with num_labels in config_extra)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plumbing import models as lm
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, **config_extra)
    torch.manual_seed(seed)
    return lm.disable_dropout((cls or LlamaForCausalLM)(config))


def tiny_models():
    """policy, ref (another init, so KL > 0), critic (a value head on a third LM)."""
    return tiny_lm(0), tiny_lm(1).eval(), ScalarHeadModel(tiny_lm(2), seed=3)


def batch(seed: int = 0):
    """A left-padded query (B, P) and a right-padded response (B, T) of every length from 1 to T."""
    g = torch.Generator().manual_seed(seed)
    query_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.float)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1]], dtype=torch.float)
    query = torch.randint(3, V, (B, P), generator=g) * query_mask.long()
    response = torch.randint(3, V, (B, T), generator=g) * mask.long()
    return query, query_mask, response, mask


def lm_logits(model, ids, attn):
    """The LM's logits (B, L, V) with positions counted from each row's first real token."""
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits


def response_logits(model, query, query_mask, response, mask, temperature):
    """Logits predicting response[:, t]: the position before it, P − 1 + t; (B, T, V), float32, divided by T°."""
    ids, attn = torch.cat([query, response], 1), torch.cat([query_mask, mask], 1)
    return lm_logits(model, ids, attn)[:, P - 1:P - 1 + T].float() / temperature


def response_values(critic, query, query_mask, response, mask):
    """V(s_t) (B, T): the critic's value at the position before response token t."""
    return critic(torch.cat([query, response], 1), torch.cat([query_mask, mask], 1))[:, P - 1:P - 1 + T].float()


def token_logprobs(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]  # (B, T) log π(a_t | s_t)


def mmean(x, m):
    return (x * m).sum() / m.sum()  # Σ m·x / Σ m over every real token


def ptx_rows(seed: int = 7):
    """Eq. 17's SFT rows: ids (3, 6), attention mask with a left-padded row (the mask then changes the logits), and
    the mask of the tokens to predict."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.long)
    ids = torch.randint(3, V, (3, 6), generator=g) * attn
    resp = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.float)
    return ids, attn, resp


def experience(policy, critic, seed: int = 0) -> dict:
    """A rollout batch as make_experience returns it, with the stored log-probs and values moved off the current
    models' (so ratios leave [1 − ε, 1 + ε] and values leave the clip range) and advantages/returns drawn at random."""
    query, query_mask, response, mask = batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        lp = token_logprobs(response_logits(policy, query, query_mask, response, mask, 0.8), response)
        values = response_values(critic, query, query_mask, response, mask)

    def noise(scale):
        return scale * torch.randn(B, T, generator=g)
    return {"query": query, "query_mask": query_mask, "response": response, "mask": mask,
            "logprobs": (lp + noise(0.4)) * mask, "ref_logprobs": (lp + noise(0.6)) * mask,
            "values": (values + noise(0.5)) * mask, "advantages": (1.0 + noise(1.0)) * mask,
            "returns": noise(1.0) * mask, "scores": torch.randn(B, generator=g), "kl_coef": 0.3, "nonfinite": None,
            "weights": None, "policy_mask": mask}   # no rollout correction: every response token in the policy loss


BASE = dict(rollout_batch=B, minibatch=B, ppo_epochs=1, max_new_tokens=MAX_NEW, temperature=0.8, adv_norm=True,
            adv_clip=0.8, entropy_coef=0.05, entropy_clip=5.0, ptx_coef=0.7, value_clip=0.2, vf_coef=0.5,
            grad_clip=0.05, clip_eps=0.2, kl_in="reward")  # every term on; the entropy clip above H̄ ≈ log 32


# ---------------------------------------------------------------------------------------------------------------
# Step (6) written out: one minibatch's losses, gradients, global-norm clip and AdamW step on copies of the models
# ---------------------------------------------------------------------------------------------------------------
def hand_policy_loss(policy, exp, idx, cfg, ptx):
    """PPO-clip (Eq. 15) on whitened, clipped advantages + KL in the loss + entropy bonus + λ_ptx·NLL (Eq. 17)."""
    q, qm, r, m = exp["query"][idx], exp["query_mask"][idx], exp["response"][idx], exp["mask"][idx]
    logits = response_logits(policy, q, qm, r, m, cfg.temperature)                      # (b, T, V)
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, r[..., None])[..., 0]                                    # (b, T)
    adv = exp["advantages"][idx]
    if cfg.adv_norm:  # whitened over this minibatch's real tokens (ddof 0), then clipped to ±δ
        mu = mmean(adv, m)
        var = mmean((adv - mu) ** 2, m)
        adv = torch.where(m > 0, (adv - mu) / torch.sqrt(var + 1e-8), adv)
        if cfg.adv_clip:
            adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
    old = (exp["ref_logprobs"] if cfg.importance_sampling else exp["logprobs"])[idx]    # ρ's denominator
    log_ratio = logp - old
    if cfg.log_ratio_clamp:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)                                                        # ρ_t
    objective = ratio * adv
    clipped = torch.zeros_like(m)
    if cfg.clip_eps:
        surr2 = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv
        clipped = (surr2 < objective).float()
        objective = torch.minimum(objective, surr2)                                     # Eq. 15
    dual = None
    if cfg.dual_clip:
        dual = ((adv < 0) & (cfg.dual_clip * adv > objective)).float()
        objective = torch.where(adv < 0, torch.maximum(objective, cfg.dual_clip * adv), objective)

    def agg(x):
        if cfg.loss_agg == "seq-mean-token-sum-norm":
            return (x * m).sum() / (len(idx) * cfg.max_new_tokens)                      # Σ m·x / (b · T_max)
        return mmean(x, m)
    pg = -agg(objective)
    loss = pg
    kl = None
    if cfg.kl_in == "loss":
        log_r = logp - exp["ref_logprobs"][idx]
        k = {"k1": log_r, "k2": 0.5 * log_r ** 2, "k3": torch.exp(-log_r) - 1 + log_r}[cfg.kl_estimator]
        if cfg.kl_clamp:
            k = k.clamp(-cfg.kl_clamp, cfg.kl_clamp)
        kl = agg(k)
        loss = loss + exp["kl_coef"] * kl
    entropy = -(logp_all.exp() * logp_all).sum(-1)                                      # (b, T) H(π(·|s_t))
    if cfg.entropy_coef:
        h = mmean(entropy, m)
        loss = loss + (cfg.entropy_coef * torch.relu(cfg.entropy_clip - h) if cfg.entropy_clip
                       else -cfg.entropy_coef * h)
    ptx_nll = torch.zeros(())
    if cfg.ptx_coef:
        ids, attn, resp = ptx
        lg = policy(input_ids=ids, attention_mask=attn).logits                          # (n, L, V)
        nll = -torch.log_softmax(lg[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]   # −log π(x_{i+1} | x_≤i)
        ptx_nll = mmean(nll, resp[:, 1:])
        loss = loss + cfg.ptx_coef * ptx_nll                                            # Eq. 17, as a loss
    with torch.no_grad():
        stats = {"loss/pg": pg.item(), "loss/ptx": ptx_nll.item(), "ppo/clipfrac": mmean(clipped, m).item(),
                 "ppo/approx_kl": mmean(ratio - 1 - log_ratio, m).item(), "ppo/ratio": mmean(ratio, m).item()}
        if kl is not None:
            stats["loss/kl"] = kl.item()
        if dual is not None:
            stats["ppo/dual_clipfrac"] = mmean(dual, m).item()
    return loss, stats


def hand_value_loss(critic, exp, idx, cfg):
    """(V − R̂)², or with value clipping max((V − R̂)², (V_old + clip(V − V_old, ±c) − R̂)²) (Eq. 16), token mean."""
    q, qm, r, m = exp["query"][idx], exp["query_mask"][idx], exp["response"][idx], exp["mask"][idx]
    v = response_values(critic, q, qm, r, m)
    old, ret = exp["values"][idx], exp["returns"][idx]
    loss = (v - ret) ** 2
    if cfg.value_clip:
        loss = torch.maximum(loss, (old + (v - old).clamp(-cfg.value_clip, cfg.value_clip) - ret) ** 2)
    return mmean(loss, m)


def clipped_step(model, opt, loss, grad_clip):
    """Autograd gradients, scaled to a global norm ≤ grad_clip (torch's clip_grad_norm_ rule), one optimizer step;
    returns the norm before the clip."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # the critic's LM head has none: AdamW skips it
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)).item()
    scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip else 1.0
    for p, g in zip(params, grads):
        p.grad = None if g is None else g * scale
    opt.step()
    return norm


def hand_update(policy, critic, exp, cfg, ptx_batch, perms):
    """ppo_update's optimizer steps on copies of the models, minibatch by minibatch in the given orders. Returns the
    copies, each minibatch's numbers, and the last policy and critic gradients (what is left in .grad)."""
    policy, critic = copy.deepcopy(policy), copy.deepcopy(critic)
    popt, copt = torch.optim.AdamW(policy.parameters(), **ADAMW), torch.optim.AdamW(critic.parameters(), **ADAMW)
    stats = []
    for perm in perms:
        for idx in perm.split(cfg.minibatch):
            loss, s = hand_policy_loss(policy, exp, idx, cfg, ptx_batch())
            s["grad/norm"] = clipped_step(policy, popt, loss, cfg.grad_clip)
            vf = hand_value_loss(critic, exp, idx, cfg)
            clipped_step(critic, copt, cfg.vf_coef * vf, cfg.grad_clip)
            stats.append({**s, "loss/vf": vf.item()})
    return policy, critic, stats


def run_update(cfg, exp, seed=11):
    """ppo_update on fresh copies of tiny_models(), counting optimizer steps and ptx batches drawn. Returns the models,
    the stats, the counts and the minibatch orders ppo_update drew (torch's RNG re-seeded the same way)."""
    policy, _, critic = tiny_models()
    popt, copt = torch.optim.AdamW(policy.parameters(), **ADAMW), torch.optim.AdamW(critic.parameters(), **ADAMW)
    steps = {"policy": 0, "critic": 0, "ptx": 0}
    popt.register_step_post_hook(lambda *a: steps.__setitem__("policy", steps["policy"] + 1))
    copt.register_step_post_hook(lambda *a: steps.__setitem__("critic", steps["critic"] + 1))

    def ptx_batch():
        steps["ptx"] += 1
        return ptx_rows()
    before = copy.deepcopy(policy), copy.deepcopy(critic)
    torch.manual_seed(seed)
    out = ppo_max.ppo_update(policy, critic, popt, copt, exp, cfg, ptx_batch)
    torch.manual_seed(seed)
    perms = [torch.randperm(B) for _ in range(cfg.ppo_epochs)]  # the only draws of ppo_update (no dropout)
    return before, (policy, critic), out, steps, perms


def assert_same_weights(got, want, what, atol=2e-6):
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert_close(a, b, rtol=1e-4, atol=atol, msg=lambda m: f"{what} {name}: {m}")


VARIANTS = {  # one switch at a time off BASE, where a wrong edit of ppo_update or its callees' arguments could hide
    "every term on": {},
    "no advantage normalisation": dict(adv_norm=False),
    "advantage normalisation without clip": dict(adv_clip=0.0),
    "no entropy bonus": dict(entropy_coef=0.0),
    "entropy clip below the entropy (term off)": dict(entropy_clip=1.0),
    "entropy bonus without clip": dict(entropy_clip=0.0),
    "no ptx": dict(ptx_coef=0.0),
    "no value clipping": dict(value_clip=0.0),
    "no gradient clipping": dict(grad_clip=0.0),
    "policy clip eps 0": dict(clip_eps=0.0),
    "importance sampling against the reference": dict(importance_sampling=True),
    "kl in the loss, k3 clamped, Dr. GRPO aggregation": dict(kl_in="loss", kl_estimator="k3", kl_clamp=0.3,
                                                             loss_agg="seq-mean-token-sum-norm"),
    "kl in the loss, k2, token mean": dict(kl_in="loss", kl_estimator="k2"),
    "dual clip and log-ratio clamp": dict(dual_clip=1.3, log_ratio_clamp=0.6),
    "temperature 1": dict(temperature=1.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ppo_update_one_minibatch_against_losses_written_out(name):
    """One epoch, one minibatch = the whole batch (the order cannot matter): every weight of the policy and the critic
    after ppo_update equals the hand-written losses' autograd gradients, clipped to the global norm, through AdamW;
    the gradients left in .grad are those clipped gradients; every logged number is the hand computation's."""
    cfg = ppo_max.PPOConfig(**{**BASE, **VARIANTS[name]})
    base_policy, _, base_critic = tiny_models()
    exp = experience(base_policy, base_critic)
    (policy0, critic0), (policy, critic), out, steps, perms = run_update(cfg, exp)
    want_policy, want_critic, stats = hand_update(policy0, critic0, exp, cfg, ptx_rows, perms)
    assert steps == {"policy": 1, "critic": 1, "ptx": 1 if cfg.ptx_coef else 0}
    for got, want, what in ((policy, want_policy, "policy"), (critic, want_critic, "critic")):
        for (n, a), b in zip(got.named_parameters(), want.parameters()):
            assert (a.grad is None) == (b.grad is None), f"{what} {n}"
            if a.grad is not None:
                assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-8, msg=lambda m: f"{what} {n} grad: {m}")
        assert_same_weights(got, want, what)
    want_stats = {**stats[0], "guard/skipped_updates": 0.0}
    assert set(out) == set(want_stats)
    assert out == pytest.approx(want_stats, rel=1e-4, abs=1e-6)


def test_ppo_update_every_term_changes_what_is_trained():
    """The hand computation tells the switches apart on this batch: the clips bind, the terms are not negligible, so a
    dropped term or an ignored switch shows as another gradient."""
    cfg = ppo_max.PPOConfig(**BASE)
    policy, _, critic = tiny_models()
    exp = experience(policy, critic)
    idx = torch.arange(B)
    grads = {}
    for name, over in VARIANTS.items():
        c = ppo_max.PPOConfig(**{**BASE, **over})
        loss, s = hand_policy_loss(policy, exp, idx, c, ptx_rows())
        grads[name] = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(policy.parameters()))])
        if name == "every term on":
            assert 0 < s["ppo/clipfrac"] < 0.5
        if name == "dual clip and log-ratio clamp":
            assert 0 < s["ppo/dual_clipfrac"]
    same = ("no gradient clipping", "no value clipping",  # change the clip or the critic only
            "entropy clip below the entropy (term off)", "entropy bonus without clip")  # = no bonus, = the hinge
    names = [n for n in VARIANTS if n not in same]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(grads[a], grads[b], rtol=1e-3, atol=0), (a, b)
    assert torch.allclose(grads["entropy clip below the entropy (term off)"], grads["no entropy bonus"])
    assert torch.allclose(grads["entropy bonus without clip"], grads["every term on"])  # the hinge acts: H̄ < δ
    # the whitened advantages reach both clip ends; the policy's and the critic's norms exceed grad_clip
    adv = exp["advantages"]
    m = exp["mask"]
    w = (adv - mmean(adv, m)) / torch.sqrt(mmean((adv - mmean(adv, m)) ** 2, m) + 1e-8)
    assert (w[m > 0] > cfg.adv_clip).any() and (w[m > 0] < -cfg.adv_clip).any()
    assert torch.linalg.vector_norm(grads["every term on"]) > 10 * cfg.grad_clip
    vf = hand_value_loss(critic, exp, idx, cfg)
    unclipped = hand_value_loss(critic, exp, idx, ppo_max.PPOConfig(**{**BASE, "value_clip": 0.0}))
    assert vf.item() > 1.05 * unclipped.item()
    vgrad = torch.autograd.grad(cfg.vf_coef * vf, list(critic.parameters()), allow_unused=True)
    assert torch.sqrt(sum((g ** 2).sum() for g in vgrad if g is not None)) > 10 * cfg.grad_clip
    h = mmean(-(torch.softmax(response_logits(policy, exp["query"], exp["query_mask"], exp["response"], m, 0.8), -1)
                * torch.log_softmax(response_logits(policy, exp["query"], exp["query_mask"], exp["response"], m, 0.8),
                                    -1)).sum(-1), m)
    assert 1.0 < h.item() < cfg.entropy_clip


def test_ppo_update_minibatches_and_epochs_in_the_drawn_order():
    """2 epochs × 3 minibatches of 2: six optimizer steps for each model, six ptx batches, each minibatch's advantages
    whitened on its own; the weights after all of them equal the hand loop over the same shuffled orders (each epoch a
    fresh permutation), and every logged number is the mean of the six minibatches' numbers."""
    cfg = ppo_max.PPOConfig(**{**BASE, "minibatch": 2, "ppo_epochs": 2})
    base_policy, _, base_critic = tiny_models()
    exp = experience(base_policy, base_critic)
    (policy0, critic0), (policy, critic), out, steps, perms = run_update(cfg, exp)
    assert steps == {"policy": 6, "critic": 6, "ptx": 6}
    assert not torch.equal(perms[0], perms[1])
    want_policy, want_critic, stats = hand_update(policy0, critic0, exp, cfg, ptx_rows, perms)
    assert len(stats) == 6
    assert_same_weights(policy, want_policy, "policy", atol=1e-5)
    assert_same_weights(critic, want_critic, "critic", atol=1e-5)
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
    assert out == pytest.approx({**mean, "guard/skipped_updates": 0.0}, rel=1e-3, abs=1e-5)
    # another order of the same minibatches gives other weights: the order is part of what is checked
    other = hand_update(policy0, critic0, exp, cfg, ptx_rows, [perms[0].flip(0), perms[1]])[0]
    assert max((a - b).abs().max().item() for a, b in zip(other.parameters(), want_policy.parameters())) > 1e-4


def test_ppo_update_skips_a_non_finite_step_and_names_it():
    """An infinite advantage makes the policy loss non-finite and a NaN return the critic's: neither model moves, and
    the stats count both skipped steps and name them."""
    cfg = ppo_max.PPOConfig(**{**BASE, "adv_norm": False, "ptx_coef": 0.0})
    base_policy, _, base_critic = tiny_models()
    exp = experience(base_policy, base_critic)
    exp["advantages"] = exp["advantages"].clone()
    exp["advantages"][0, 1] = float("inf")
    exp["returns"] = exp["returns"].clone()
    exp["returns"][2, 0] = float("nan")
    (policy0, critic0), (policy, critic), out, steps, _ = run_update(cfg, exp)
    assert steps == {"policy": 0, "critic": 0, "ptx": 0}
    assert_same_weights(policy, policy0, "policy", atol=0)
    assert_same_weights(critic, critic0, "critic", atol=0)
    assert out["guard/skipped_updates"] == 2.0 and out["guard/nonfinite"] == ["loss/critic", "loss/policy"]


# ---------------------------------------------------------------------------------------------------------------
# The logged numbers of steps (2)-(6)
# ---------------------------------------------------------------------------------------------------------------
def test_minibatch_stats_keys_and_values():
    cfg = ppo_max.PPOConfig()
    pg_stats = {"clipfrac": 0.25, "approx_kl": 0.01, "ratio": 1.02}
    args = (torch.tensor(-0.5), torch.tensor(0.7), torch.tensor(2.5), torch.tensor(0.125))
    s = monitor.minibatch_stats(*args, pg_stats, torch.tensor(3.0), cfg)
    assert s == {"loss/pg": -0.5, "loss/vf": pytest.approx(0.7), "loss/ptx": 2.5, "ppo/clipfrac": 0.25,
                 "ppo/approx_kl": 0.01, "ppo/ratio": 1.02, "grad/norm": 3.0}
    s = monitor.minibatch_stats(args[0], None, *args[2:], {**pg_stats, "dual_clipfrac": 0.125}, 3.0,
                                ppo_max.PPOConfig(kl_in="loss"))
    assert s == {"loss/pg": -0.5, "loss/ptx": 2.5, "ppo/clipfrac": 0.25, "ppo/approx_kl": 0.01, "ppo/ratio": 1.02,
                 "grad/norm": 3.0, "loss/kl": 0.125, "ppo/dual_clipfrac": 0.125}


def test_update_stats_means_over_minibatches_and_the_skipped_steps(monkeypatch):
    per = [{"a": 1.0, "b": -2.0}, {"a": 4.0, "b": 0.5}, {"a": 0.5, "b": 7.0}]
    assert monitor.update_stats(per, [], "cpu") == {"a": 5.5 / 3, "b": 5.5 / 3, "guard/skipped_updates": 0.0}
    got = monitor.update_stats(per, ["loss/policy", "grad/critic_norm", "loss/policy"], "cpu")
    assert got == {"a": 5.5 / 3, "b": 5.5 / 3, "guard/skipped_updates": 3.0,
                   "guard/nonfinite": ["grad/critic_norm", "loss/policy"]}
    monkeypatch.setattr(monitor, "any_rank", lambda flag, device: True)  # another rank saw a NaN, this one none
    assert monitor.update_stats(per, [], "cpu")["guard/nonfinite"] == ["on another rank"]


def test_make_experience_stats_against_loops():
    """Every key of make_experience's stats, each recomputed by a python loop over the batch's real tokens from the
    returned tensors and from the logits of the two models read here."""
    policy, ref, critic = tiny_models()
    rm = ScalarHeadModel(tiny_lm(4), seed=5).eval()
    query, query_mask, response, mask = batch(1)
    cfg = ppo_max.PPOConfig(temperature=0.9)
    moments = ppo_max.RunningMoments()
    moments.update(torch.tensor([0.3, -1.0, 2.0]))
    exp = ppo_max.make_experience(policy, ref, rm, critic, query, query_mask, response, mask, moments, cfg, 0.1)
    with torch.no_grad():
        logp = torch.log_softmax(response_logits(policy, query, query_mask, response, mask, 0.9).double(), -1)
        ref_logp = torch.log_softmax(response_logits(ref, query, query_mask, response, mask, 0.9).double(), -1)
    real = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    n = len(real)
    kl = {(b, t): (logp[b, t].exp() * (logp[b, t] - ref_logp[b, t])).sum().item() for b, t in real}
    ent = {(b, t): -(logp[b, t].exp() * logp[b, t]).sum().item() for b, t in real}
    adv = [exp["advantages"][b, t].item() for b, t in real]
    scores = exp["scores"].tolist()
    mean_score = sum(scores) / B
    norm = [min(max((s - moments.mean) / moments.std, -cfg.reward_clip), cfg.reward_clip) for s in scores]
    # Σ_t r_t per row: the normalised score once, −η·k1 at every real token (Eq. 19)
    total = [norm[b] - 0.1 * sum(exp["logprobs"][b, t].item() - exp["ref_logprobs"][b, t].item()
                                 for t in range(T) if mask[b, t]) for b in range(B)]
    want = {
        "reward/score": mean_score,
        "reward/score_std": math.sqrt(sum((s - mean_score) ** 2 for s in scores) / (B - 1)),
        "reward/normalized": sum(norm) / B,
        "reward/total": sum(total) / B,
        "kl/ref": sum(kl.values()) / n,
        "kl/ref_k1": sum(exp["logprobs"][b, t].item() - exp["ref_logprobs"][b, t].item() for b, t in real) / n,
        "kl/ref_seq": sum(kl.values()) / B,
        "policy/perplexity": math.exp(-sum(exp["logprobs"][b, t].item() for b, t in real) / n),
        "policy/entropy": sum(ent.values()) / n,
        "response/length": n / B,
        "adv/mean": sum(adv) / n,
        "adv/std": math.sqrt(sum((a - sum(adv) / n) ** 2 for a in adv) / n),
        "returns/mean": sum(exp["returns"][b, t].item() for b, t in real) / n,
        "values/mean": sum(exp["values"][b, t].item() for b, t in real) / n,
    }
    assert exp["stats"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    for b, t in real:  # the stored log-probs are those of the sampled tokens at temperature 0.9
        assert exp["logprobs"][b, t].item() == pytest.approx(logp[b, t, response[b, t]].item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Critic pre-training (§5.3.3)
# ---------------------------------------------------------------------------------------------------------------
class FixedScores(torch.nn.Module):
    """A reward model whose k-th call scores every row with scales[k]·base (base fixed per row)."""

    def __init__(self, base, scales):
        super().__init__()
        self.base, self.scales, self.calls = base, scales, 0

    def score(self, ids, mask):
        s = self.scales[min(self.calls, len(self.scales) - 1)] * self.base
        self.calls += 1
        return s


def reseeded_prompts(query, query_mask, seed=44):
    """A prompt batch that re-seeds torch's RNG, so every round's rollout draws the same responses."""
    def prompt_batch():
        torch.manual_seed(seed)
        return None, query, query_mask
    return prompt_batch


def test_pretrain_critic_one_round_against_a_hand_computation():
    """One round, 2 epochs × 2 minibatches of 3 in the drawn order: the critic (only it) takes AdamW steps on the
    unclipped Eq. 16 loss (V − R̂)², R̂ = Â + V from GAE (γ, λ) on the rewards of Eq. 18–19 (the score normalised by
    the moments, which now include the batch; −η·k1 at every token), the responses sampled at the run's temperature;
    the log holds the mean and the first of the four losses; the policy and the reference do not move."""
    policy, ref, critic = tiny_models()
    query, query_mask, _, _ = batch(2)
    base = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.3])
    cfg = ppo_max.PPOConfig(critic_pretrain_steps=1, rollout_batch=B, minibatch=3, ppo_epochs=2, max_new_tokens=T,
                            temperature=0.5, gamma=0.95, lam=0.8, reward_clip=1.2, grad_clip=0.5)
    adamw = {**ADAMW, "lr": 5e-2}
    prompt_batch = reseeded_prompts(query, query_mask, seed=52)
    _, q, qm = prompt_batch()  # the responses pre-training will draw, then its minibatch orders
    response, mask, _ = ppo_max.rollout(policy, q, qm, T, 2, 0, 0.5)
    perms = [torch.randperm(B) for _ in range(2)]
    assert 0 < mask.sum() < mask.numel()  # some responses end at EOS before T
    prompt_batch()
    assert not torch.equal(ppo_max.rollout(policy, q, qm, T, 2, 0, 1.0)[0], response)  # the temperature shows
    want = copy.deepcopy(critic)
    with torch.no_grad():
        lp = token_logprobs(response_logits(policy, q, qm, response, mask, 0.5), response)
        ref_lp = token_logprobs(response_logits(ref, q, qm, response, mask, 0.5), response)
        v_old = response_values(critic, q, qm, response, mask) * mask
    scores = base.double()
    mean, std = scores.mean().item(), scores.std(unbiased=False).item()
    rewards = -0.1 * (lp - ref_lp) * mask
    advantages = torch.zeros(B, T)
    for b in range(B):
        last = int(mask[b].sum()) - 1
        rewards[b, last] += min(max((scores[b].item() - mean) / std, -1.2), 1.2)   # Eq. 18 on the last token
        gae = 0.0
        for t in range(last, -1, -1):
            next_v = v_old[b, t + 1].item() if t < last else 0.0
            gae = rewards[b, t].item() + 0.95 * next_v - v_old[b, t].item() + 0.95 * 0.8 * gae  # Eq. 8–9
            advantages[b, t] = gae
    returns = (advantages + v_old) * mask
    opt = torch.optim.AdamW(want.parameters(), **adamw)
    losses, moved = [], 0.0
    for perm in perms:
        for idx in perm.split(3):
            v = response_values(want, q[idx], qm[idx], response[idx], mask[idx])
            moved = max(moved, ((v - v_old[idx]).abs() * mask[idx]).max().item())
            loss = mmean((v - returns[idx]) ** 2, mask[idx])                              # Eq. 16, no clip
            clipped_step(want, opt, loss, cfg.grad_clip)
            losses.append(loss.item())
    assert moved > 0.2  # a value clip of 0.2 would have bound

    frozen = [copy.deepcopy(m) for m in (policy, ref)]
    moments = ppo_max.RunningMoments()
    log = ppo_max.pretrain_critic(policy, ref, FixedScores(base, [1.0]), critic,
                                  torch.optim.AdamW(critic.parameters(), **adamw), moments, prompt_batch, cfg,
                                  eos_id=2, pad_id=0, kl_coef=0.1)
    assert len(log) == 1 and log[0] == pytest.approx({"round": 0, "loss/vf": sum(losses) / 4,
                                                      "loss/vf_first": losses[0]}, rel=1e-5)
    assert moments.count == B and moments.mean == pytest.approx(mean)
    # four AdamW steps of lr 5e-2: a weight whose gradient is near 0 takes m/√v of two roundings' noise, so the last
    # digits of summation order show up to ~lr·1e-3 (1.5e-5 seen on an AVX512 CPU); a wrong step moves a weight ~lr
    assert_same_weights(critic, want, "critic", atol=1e-4)
    for got, was in zip((policy, ref), frozen):
        assert_same_weights(got, was, "frozen", atol=0)


def test_pretrain_critic_stops_when_the_loss_plateaus():
    """With the critic frozen at V ≡ 0 (a zero head, lr 0) and the same responses every round, R̂ = Â is the score
    times a fixed vector, so the loss is (score scale)² × a constant; it
    stops at the first round k ≥ 6 whose last three losses sum to more than 0.95 × the three before (the rule
    written out below), not before and not after (a fall of 7.5% per three rounds is not a plateau, one of 0 is); a
    steady 6% fall per round runs to critic_pretrain_steps."""
    policy, ref, critic = tiny_models()
    with torch.no_grad():
        critic.head.weight.zero_()
        critic.head.bias.zero_()
    query, query_mask, _, _ = batch(3)
    cfg = ppo_max.PPOConfig(critic_pretrain_steps=12, rollout_batch=B, minibatch=3, ppo_epochs=2, max_new_tokens=3,
                            reward_norm=False)

    def run(scales):
        frozen = copy.deepcopy(critic)
        log = ppo_max.pretrain_critic(policy, ref, FixedScores(torch.ones(B), scales), frozen,
                                      torch.optim.AdamW(frozen.parameters(), lr=0.0), ppo_max.RunningMoments(),
                                      reseeded_prompts(query, query_mask), cfg, eos_id=2, pad_id=0, kl_coef=0.0)
        return log
    falling = [0.97 ** k for k in range(12)]  # loss ∝ scale²: 6% per round, 17% per three rounds
    log = run(falling)
    assert [r["round"] for r in log] == list(range(12))
    stop = [8.0 * 0.987 ** min(k, 7) for k in range(12)]  # losses fall 7.5% per three rounds, then not at all
    log = run(stop)
    losses = [r["loss/vf"] for r in log]
    expected = None
    for k in range(len(losses)):  # the rule, on the losses as logged
        if k + 1 >= 6 and sum(losses[k - 2:k + 1]) > 0.95 * sum(losses[k - 5:k - 2]):
            expected = k + 1
            break
    assert expected == 11 and len(log) == expected, (losses, expected)
    # the loss tracks the score's scale², and loss/vf_first is the round's first minibatch (minibatch 3 < B)
    assert losses[1] / losses[0] == pytest.approx(0.987 ** 2, rel=1e-4)
    assert all(r["loss/vf_first"] != r["loss/vf"] for r in log)
    flat = run([1.0] * 12)  # no fall at all: stops at the earliest round the rule can look at, the 6th
    assert len(flat) == 6


# ---------------------------------------------------------------------------------------------------------------
# Adaptive KL controller, presets, read positions, input checks
# ---------------------------------------------------------------------------------------------------------------
def test_adaptive_kl_controller_proportional_error_clipped_at_both_ends():
    """η ← η (1 + clip(KL/target − 1, −0.2, 0.2) · n / horizon), written out with the numbers (Ziegler et al. 2019)."""
    ctl = ppo_max.AdaptiveKLController(0.2, 0.5, 1000)
    assert (ctl.value, ctl.target, ctl.horizon) == (0.2, 0.5, 1000)
    ctl.update(0.55, 50)           # error 0.55/0.5 − 1 = 0.1: ×(1 + 0.1·50/1000) = ×1.005
    assert ctl.value == pytest.approx(0.2 * 1.005, rel=1e-12)
    ctl.update(5.0, 50)            # error 9, clipped to 0.2: ×1.01
    assert ctl.value == pytest.approx(0.2 * 1.005 * 1.01, rel=1e-12)
    ctl.update(0.0, 50)            # error −1, clipped to −0.2: ×0.99
    assert ctl.value == pytest.approx(0.2 * 1.005 * 1.01 * 0.99, rel=1e-12)
    ctl.update(0.45, 200)          # error −0.1, inside the clip: ×(1 − 0.1·0.2) = ×0.98
    assert ctl.value == pytest.approx(0.2 * 1.005 * 1.01 * 0.99 * 0.98, rel=1e-12)
    fixed = ppo_max.AdaptiveKLController(0.05, 0.0, 1000)  # target 0: η stays fixed
    fixed.update(3.0, 64)
    assert fixed.value == 0.05


def test_presets_hold_the_papers_settings():
    """PPO-max (§5.4): reward normalisation and clipping (Eq. 18), token-level KL penalty with k1 (Eq. 19; η 0.2,
    the largest of Fig. 15's, at the operating point), critic from the reward model and pre-trained, global gradient
    clipping, ptx (on the demonstrations at 0.25, the operating point) and value clipping, an SFT policy, ε = 0.2,
    λ = 0.9, γ close to 1. Vanilla PPO: none of the tricks, the same ε and λ. The authors' released scripts: reward
    scaling only, η = 0.01, no critic pre-training, no ptx, one optimizer step per rollout batch."""
    mx = config.apply_preset("ppo-max")
    assert (mx.reward_norm, mx.reward_scale, mx.kl_coef, mx.kl_estimator, mx.kl_in) == (True, False, 0.2, "k1",
                                                                                        "reward")
    assert (mx.ptx_data, mx.ptx_coef) == ("sft", 0.25)
    assert mx.reward_clip > 0 and mx.critic_pretrain_steps > 0 and mx.grad_clip > 0 and mx.ptx_coef > 0
    assert mx.value_clip > 0 and mx.kl_target == 0.0 and not mx.importance_sampling
    assert (mx.critic_init, mx.policy_init, mx.advantage, mx.clip_eps, mx.lam) == ("rm", "sft", "gae", 0.2, 0.9)
    assert 0.99 <= mx.gamma <= 1.0
    assert mx == ppo_max.PPOConfig()  # PPO-max is the default
    va = config.apply_preset("vanilla")
    assert (va.reward_norm, va.reward_clip, va.reward_scale, va.kl_coef, va.critic_pretrain_steps, va.ptx_coef,
            va.value_clip, va.grad_clip, va.adv_norm, va.entropy_coef) == (False, 0.0, False, 0.0, 0, 0.0, 0.0, 0.0,
                                                                           False, 0.0)
    assert (va.clip_eps, va.lam, va.critic_init, va.policy_init) == (0.2, 0.9, "rm", "sft")
    mo = config.apply_preset("moss-release")
    assert (mo.reward_norm, mo.reward_clip, mo.reward_scale, mo.kl_coef, mo.critic_pretrain_steps, mo.ptx_coef,
            mo.adv_norm, mo.ppo_epochs) == (False, 0.0, True, 0.01, 0, 0.0, False, 1)
    assert mo.minibatch == mo.rollout_batch  # one optimizer step per rollout batch
    assert set(config.PRESETS) == {"ppo-max", "vanilla", "moss-release", "dapo", "vapo"}  # dapo, vapo: test_tricks.py


def test_apply_preset_overrides_win_and_unknown_names_are_refused():
    cfg = config.apply_preset("vanilla", kl_coef=0.1, minibatch=4)
    assert (cfg.kl_coef, cfg.minibatch, cfg.reward_norm, cfg.grad_clip) == (0.1, 4, False, 0.0)
    assert config.apply_preset("ppo-max", reward_norm=False).reward_norm is False
    with pytest.raises(ValueError, match=r"^unknown preset 'ppo_max'; choose from \['dapo', 'moss-release', "
                                         r"'ppo-max', 'vanilla', 'vapo'\]$"):
        config.apply_preset("ppo_max")


def tiny_gpt2(seed: int):
    """GPT-2 learns absolute positions: a left-padded row reads the right logits only with positions from the mask
    (LLaMA's rotary attention sees relative positions only, so a uniform shift changes nothing there)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from plumbing import models as lm
    torch.manual_seed(seed)
    return lm.disable_dropout(GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2,
                                                         n_positions=64, bos_token_id=1, eos_token_id=2)))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_policy_logits_and_critic_values_read_the_position_before_each_token(arch):
    """For every real response token t: policy_logits[b, t] is the model's last logits on the unpadded prefix
    prompt + response[:t], divided by the temperature, and critic_values[b, t] the critic's last value on it."""
    policy, _, critic = tiny_models()
    if arch == "gpt2":
        policy, critic = tiny_gpt2(5).eval(), ScalarHeadModel(tiny_gpt2(6), seed=3).eval()
    query, query_mask, response, mask = batch(4)
    with torch.no_grad():
        logits = ppo_max.policy_logits(policy, query, query_mask, response, mask, 0.6)   # (B, T, V)
        values = ppo_max.critic_values(critic, query, query_mask, response, mask)        # (B, T)
        assert logits.shape == (B, T, V) and values.shape == (B, T) and logits.dtype == torch.float32
        for b in range(B):
            prompt = query[b][query_mask[b] > 0]
            for t in range(int(mask[b].sum())):
                prefix = torch.cat([prompt, response[b, :t]])[None]                      # (1, P_b + t)
                ones = torch.ones_like(prefix)
                want = policy(input_ids=prefix, attention_mask=ones).logits[0, -1] / 0.6
                assert_close(logits[b, t], want, rtol=1e-4, atol=1e-5)
                assert_close(values[b, t], critic(prefix, ones)[0, -1], rtol=1e-4, atol=1e-5)
        assert_close(ppo_max.policy_logits(policy, query, query_mask, response, mask), logits * 0.6)  # T° = 1


def test_sampled_kl_clamp_and_loss_conventions():
    g = torch.Generator().manual_seed(9)
    lp, ref_lp = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    for kind in ("k1", "k2", "k3"):
        got = ppo_max.sampled_kl(lp, ref_lp, ppo_max.PPOConfig(kl_estimator=kind, kl_clamp=0.4))
        for b in range(3):
            for t in range(4):
                r = lp[b, t].item() - ref_lp[b, t].item()
                k = {"k1": r, "k2": 0.5 * r * r, "k3": math.exp(-r) - 1 + r}[kind]
                assert got[b, t].item() == pytest.approx(min(max(k, -0.4), 0.4), abs=1e-6)
    assert ppo_max.loss_conventions(ppo_max.PPOConfig()) == dict(dual_clip=None, log_ratio_clamp=None,
                                                                 agg="token-mean", max_len=24, clip_eps_high=None,
                                                                 ratio_level="token")
    cfg = ppo_max.PPOConfig(dual_clip=3.0, log_ratio_clamp=20.0, loss_agg="seq-mean-token-mean", max_new_tokens=9)
    assert ppo_max.loss_conventions(cfg) == dict(dual_clip=3.0, log_ratio_clamp=20.0, agg="seq-mean-token-mean",
                                                 max_len=9, clip_eps_high=None, ratio_level="token")


def test_check_finite_names_the_first_bad_tensor(monkeypatch):
    ok, nan, inf = torch.zeros(2, 3), torch.tensor([[0.0, float("nan")]]), torch.tensor([1.0, -float("inf")])
    assert monitor.check_finite({"a": ok, "b": None, "c": ok}) is None
    assert monitor.check_finite({"values": None, "logprobs": ok, "advantages": nan, "x": inf}) == "advantages"
    assert monitor.check_finite({"a": ok, "reward/score": inf}) == "reward/score"
    monkeypatch.setattr(monitor, "any_rank", lambda flag, device: True)  # only another rank saw one
    assert monitor.check_finite({"a": ok}) == "on another rank"
    assert monitor.check_finite({"a": ok, "b": nan}) == "b"


def shaping_inputs():
    lp = torch.zeros(3, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    return dict(scores=torch.zeros(3), logprobs=lp, ref_logprobs=lp.clone(), mask=mask, kl=None)


SHAPING_ERRORS = {  # a change of the valid inputs: the start of the message that must name it
    "1-D inputs": (dict(logprobs=torch.zeros(3), ref_logprobs=torch.zeros(3), mask=torch.ones(3)),
                   r"logprobs, ref_logprobs and mask must all be \(B, T\) with the same shape; got \(3,\), \(3,\), "
                   r"\(3,\)$"),
    "ref_logprobs": (dict(ref_logprobs=torch.zeros(3, 5)), r"logprobs, .*; got \(3, 4\), \(3, 5\), \(3, 4\)$"),
    "mask shape": (dict(mask=torch.ones(3, 5)), r"logprobs, .*; got \(3, 4\), \(3, 4\), \(3, 5\)$"),
    "logprobs": (dict(logprobs=torch.zeros(2, 4)), r"logprobs, .*; got \(2, 4\), \(3, 4\), \(3, 4\)$"),
    "scores": (dict(scores=torch.zeros(3, 1)), r"scores must be \(B,\) = \(3,\), one per sequence; got \(3, 1\)$"),
    "kl": (dict(kl=torch.zeros(3, 3)), r"kl must be \(B, T\) = \(3, 4\); got \(3, 3\)$"),
    "mask values": (dict(mask=torch.tensor([[1.0, 0.5, 0.0, 0.0]] * 3)), r"mask must hold 0/1, contiguous"),
    "mask gap": (dict(mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])),
                 r"mask must hold 0/1, contiguous from position 0 and right-padded \(1 … 1 0 … 0\)$"),
    "mask left-padded": (dict(mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])),
                         r"mask must hold 0/1, contiguous"),
    "empty rows": (dict(mask=torch.tensor([[0.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4])),
                   r"rows \[0, 2\] of mask have no real response token; drop them before shaping$"),
}


@pytest.mark.parametrize("case", list(SHAPING_ERRORS))
def test_check_shaping_inputs_names_what_is_wrong(case):
    change, message = SHAPING_ERRORS[case]
    args = shaping_inputs()
    ppo_max.check_shaping_inputs(**args)                      # the valid inputs pass
    ppo_max.check_shaping_inputs(**{**args, "kl": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"^ppo_max\.py: " + message):
        ppo_max.check_shaping_inputs(**{**args, **change})


@pytest.mark.parametrize("g", [1, 2, 3])
def test_make_experience_in_micro_batches_equals_the_whole_batch(g):
    """--generate-batch g: make_experience reads the batch g rows at a time (scores, log-probs, KL, entropy, values),
    never the full-vocabulary logits of the whole batch at once, and returns the whole batch's tensors and stats:
    every row's numbers come from its own rows of the same padded tensors, so the micro-batches change only the
    matmuls' batch size, which on this CPU gives the same bits (measured: equal to the last bit for g = 1, 2, 3)."""
    import dataclasses
    policy, ref, critic = tiny_models()
    rm = ScalarHeadModel(tiny_lm(4), seed=5).eval()
    query, query_mask, response, mask = batch(2)
    cfg = ppo_max.PPOConfig(temperature=0.9)
    whole, parts = (ppo_max.make_experience(policy, ref, rm, critic, query, query_mask, response, mask,
                                            ppo_max.RunningMoments(), c, 0.1)
                    for c in (cfg, dataclasses.replace(cfg, generate_batch=g)))
    for key in ("scores", "logprobs", "ref_logprobs", "values", "advantages", "returns"):
        assert torch.equal(parts[key], whole[key]), key
    assert parts["stats"] == whole["stats"]


def test_rollout_in_micro_batches_pads_like_one_batch():
    """rollout(generate_batch=g): the prompts g at a time, each micro-batch its own generate call, stacked with the
    responses right-padded to the longest (pad id, mask 0, log-prob 0), one row per prompt in order; each row is a
    response of its own prompt (the mask covers it up to its first EOS, as one batch's does)."""
    policy = tiny_lm(0)
    query, query_mask, _, _ = batch(3)
    torch.manual_seed(0)
    response, rmask, finished, logp = ppo_max.rollout(policy, query, query_mask, 7, eos_id=2, pad_id=0,
                                                      return_logprobs=True, generate_batch=4)
    assert response.shape[0] == rmask.shape[0] == finished.shape[0] == logp.shape[0] == B
    assert response.shape[1] <= 7 and rmask.shape == response.shape == logp.shape
    assert torch.equal(response[rmask == 0], torch.zeros_like(response[rmask == 0]))
    assert torch.equal(logp[rmask == 0], torch.zeros_like(logp[rmask == 0]))
    # the mask is a prefix of ones, ending at the first EOS for the finished rows
    for row, m, f in zip(response, rmask, finished):
        n = int(m.sum())
        assert torch.equal(m[:n], torch.ones(n)) and (bool(f) == (n > 0 and row[n - 1].item() == 2))


def row_multinomial(probs, num_samples=1, **_):
    """A draw from each row of `probs` that depends on that row alone (inverse CDF at a u read off the row's own
    numbers), where torch.multinomial draws the rows in order from one stream, so that its draws depend on the batch."""
    w = torch.linspace(1.0, 2.0, probs.shape[-1], dtype=torch.float64)
    u = torch.frac((probs.double() * w).sum(-1, keepdim=True) * 9973.0)           # (n, 1) in [0, 1)
    idx = torch.searchsorted(probs.double().cumsum(-1), u).clamp(max=probs.shape[-1] - 1)
    return idx.expand(*idx.shape[:-1], num_samples)


@pytest.mark.slow
def test_a_run_with_generate_batch_gives_the_same_metrics(tmp_path, monkeypatch):
    """The synthetic world with --generate-batch 4 (micro-batches of 4 of the 16 prompts: generation, scores,
    log-probs, values, in critic pre-training and PPO) against the same run without it: every metric of every step
    equal to the last bit. Sampling is the one part whose numbers depend on the batch (torch.multinomial draws the
    rows of a batch in order from one stream), so both runs sample with row_multinomial, a draw that depends on its
    row alone; everything else runs as in a real run."""
    import train
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "multinomial", row_multinomial)
    args = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
            "--rm-epochs", "1", "--eval-samples", "1", "--threads", "1", "--rollout-batch", "16", "--minibatch", "8",
            "--critic-pretrain-steps", "1", "--steps", "2", "--heldout-every", "0"]
    runs = {}
    for name, extra in (("whole", []), ("micro", ["--generate-batch", "4"])):
        train.main(args + extra + ["--out", name])
        runs[name] = [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                      for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["whole"]) == 2 and runs["micro"] == runs["whole"]
    assert runs["whole"][1]["kl/ref"] > 0  # the policy moved: step 1 compares two updated runs
