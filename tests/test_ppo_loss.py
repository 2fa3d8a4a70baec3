"""Tests for ppo_loss.py: each loss against an independent computation (python loops, autograd, torch.distributions).

Run: python -m pytest tests/test_ppo_loss.py -q
"""
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

import ppo_loss

D = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-12)  # float64 arithmetic, same formula evaluated two ways
PASTED = dict(rtol=0, atol=1e-6)  # numbers pasted with 6 decimals in ppo_loss.py's worked example


def ragged_mask(lengths, T):
    """(B, T) float mask, 1.0 on the first lengths[b] positions of each row (right-padded)."""
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=D)


# ----------------------------------------------------------------------------------------------------
# PPO-clip (Eq. 15)
# ----------------------------------------------------------------------------------------------------

EPS = 0.2
# (advantage, ratio, expected objective min(ρA, clip(ρ)A), clip binds?)
PPO_CASES = [
    pytest.param(1.0, 1.1, 1.1, False, id="A>0-inside"),
    pytest.param(1.0, 1.5, 1.2, True, id="A>0-above-clipped"),
    pytest.param(1.0, 0.5, 0.5, False, id="A>0-below-unclipped"),  # pessimistic min keeps ρA
    pytest.param(-1.0, 0.9, -0.9, False, id="A<0-inside"),
    pytest.param(-1.0, 0.5, -0.8, True, id="A<0-below-clipped"),
    pytest.param(-1.0, 1.5, -1.5, False, id="A<0-above-unclipped"),  # pessimistic min keeps ρA
]


@pytest.mark.parametrize("adv, ratio, objective, binds", PPO_CASES)
def test_policy_loss_eq15_clip_cases_value_and_gradient(adv, ratio, objective, binds):
    old = torch.tensor([[math.log(0.3)]], dtype=D)
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, stats = ppo_loss.policy_loss(logprobs, old, torch.tensor([[adv]], dtype=D), torch.ones(1, 1, dtype=D), EPS)
    torch.testing.assert_close(loss, torch.tensor(-objective, dtype=D), **EXACT)
    loss.backward()
    # d(−ρA)/d log π = −ρA inside or on the pessimistic side; exactly 0 where the clip binds
    expected_grad = 0.0 if binds else -ratio * adv
    torch.testing.assert_close(logprobs.grad, torch.tensor([[expected_grad]], dtype=D), **EXACT)
    assert stats["clipfrac"] == (1.0 if binds else 0.0), f"clipfrac: expected {float(binds)}, got {stats['clipfrac']}"


def test_policy_loss_eq15_no_clip_is_mean_ratio_times_advantage():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, generator=g, dtype=D)
    logprobs = old + 0.5 * torch.randn(3, 4, generator=g, dtype=D)  # ratios far outside [0.8, 1.2]
    adv = torch.randn(3, 4, generator=g, dtype=D)
    mask = torch.ones(3, 4, dtype=D)
    loss, stats = ppo_loss.policy_loss(logprobs, old, adv, mask, clip_eps=None)
    torch.testing.assert_close(loss, -(torch.exp(logprobs - old) * adv).mean(), **EXACT)
    assert stats["clipfrac"] == 0.0, f"clipfrac without a clip: expected 0.0, got {stats['clipfrac']}"


def test_policy_loss_eq15_token_level_mean_ragged_mask_matches_loop():
    g = torch.Generator().manual_seed(1)
    B, T, lengths = 3, 5, [5, 2, 3]
    old = torch.randn(B, T, generator=g, dtype=D)
    logprobs = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = ragged_mask(lengths, T)
    logprobs[mask == 0] = float("nan")  # padding may hold garbage; it must not leak into the loss
    loss, stats = ppo_loss.policy_loss(logprobs, old, adv, mask, EPS)

    total, n_tok, n_clip, kl_sum, ratio_sum = 0.0, 0, 0, 0.0, 0.0
    for b in range(B):
        for t in range(lengths[b]):
            r = math.exp(logprobs[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            total += min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a)
            n_clip += (a > 0 and r > 1 + EPS) or (a < 0 and r < 1 - EPS)  # textbook condition for "clip binds"
            kl_sum += (r - 1) - math.log(r)
            ratio_sum += r
            n_tok += 1
    torch.testing.assert_close(loss, torch.tensor(-total / n_tok, dtype=D), **EXACT)
    assert n_clip > 0
    assert stats["clipfrac"] == pytest.approx(n_clip / n_tok, abs=1e-12)
    assert stats["approx_kl"] == pytest.approx(kl_sum / n_tok, abs=1e-12)
    assert stats["ratio"] == pytest.approx(ratio_sum / n_tok, abs=1e-12)
    # the token-level mean is not the mean of per-sequence means when lengths differ
    per_seq = []
    for b in range(B):
        r = [math.exp(logprobs[b, t].item() - old[b, t].item()) for t in range(lengths[b])]
        a = [adv[b, t].item() for t in range(lengths[b])]
        per_seq.append(sum(min(ri * ai, min(max(ri, 1 - EPS), 1 + EPS) * ai) for ri, ai in zip(r, a)) / lengths[b])
    assert abs(-sum(per_seq) / B - loss.item()) > 1e-3


def test_policy_loss_eq15_ratio_one_gives_minus_mean_advantage_and_zero_kl():
    old = torch.randn(2, 3, dtype=D)
    adv = torch.randn(2, 3, dtype=D)
    mask = torch.ones(2, 3, dtype=D)
    loss, stats = ppo_loss.policy_loss(old.clone(), old, adv, mask, EPS)
    torch.testing.assert_close(loss, -adv.mean(), **EXACT)
    assert stats["approx_kl"] == 0.0 and stats["ratio"] == pytest.approx(1.0) and stats["clipfrac"] == 0.0


def test_policy_loss_rejects_mismatched_shapes_and_negative_clip_eps():
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss.policy_loss(x, x, torch.zeros(2, 1, dtype=D), torch.ones(2, 3, dtype=D), EPS)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_loss.policy_loss(x, x, x, torch.ones(2, 3, dtype=D), -0.1)


def test_policy_loss_treats_old_logprobs_and_advantages_as_constants():
    """The docstring: old_logprobs and advantages are treated as constants; only logprobs gets a gradient."""
    g = torch.Generator().manual_seed(12)
    old = torch.randn(2, 4, generator=g, dtype=D).requires_grad_(True)
    logprobs = (old.detach() + 0.3 * torch.randn(2, 4, generator=g, dtype=D)).requires_grad_(True)
    adv = torch.randn(2, 4, generator=g, dtype=D).requires_grad_(True)
    loss, _ = ppo_loss.policy_loss(logprobs, old, adv, ragged_mask([4, 2], 4), EPS)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0, "expected a gradient into logprobs, got none"
    assert old.grad is None, f"expected no gradient into old_logprobs (a constant), got {old.grad.tolist()}"
    assert adv.grad is None, f"expected no gradient into advantages (a constant), got {adv.grad.tolist()}"


# ----------------------------------------------------------------------------------------------------
# Since the paper: clip-higher (DAPO), GSPO's sequence ratio, CISPO, rollout/training mismatch (TIS, MIS)
# ----------------------------------------------------------------------------------------------------

LOW, HIGH = 0.2, 0.28  # DAPO's ε_low, ε_high
# (advantage, ratio, expected objective min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A), clip binds?)
CLIP_HIGHER_CASES = [
    pytest.param(1.0, 1.25, 1.25, False, id="A>0-between-1.2-and-1.28-unclipped"),  # symmetric ε = 0.2 would clip
    pytest.param(1.0, 1.4, 1.28, True, id="A>0-above-1.28-clipped"),
    pytest.param(-1.0, 0.75, -0.8, True, id="A<0-below-0.8-clipped"),
    pytest.param(-1.0, 1.25, -1.25, False, id="A<0-above-unclipped"),
    pytest.param(-1.0, 0.9, -0.9, False, id="A<0-inside"),
]


@pytest.mark.parametrize("adv, ratio, objective, binds", CLIP_HIGHER_CASES)
def test_clip_higher_cases_value_and_gradient(adv, ratio, objective, binds):
    old = torch.tensor([[math.log(0.3)]], dtype=D)
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, stats = ppo_loss.policy_loss(logprobs, old, torch.tensor([[adv]], dtype=D), torch.ones(1, 1, dtype=D), LOW,
                                       clip_eps_high=HIGH)
    torch.testing.assert_close(loss, torch.tensor(-objective, dtype=D), **EXACT)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0 if binds else -ratio * adv]], dtype=D), **EXACT)
    assert stats["clipfrac"] == float(binds)


def test_clip_higher_against_a_loop_and_none_is_bitwise_the_symmetric_clip():
    g = torch.Generator().manual_seed(21)
    B, T, lengths = 4, 6, [6, 2, 4, 5]
    old = torch.randn(B, T, generator=g, dtype=D)
    logprobs = (old + 0.3 * torch.randn(B, T, generator=g, dtype=D)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = ragged_mask(lengths, T)
    loss, stats = ppo_loss.policy_loss(logprobs, old, adv, mask, LOW, clip_eps_high=HIGH)
    terms, n_clip = [], 0
    for b in range(B):
        for t in range(lengths[b]):
            r, a = math.exp(logprobs[b, t].item() - old[b, t].item()), adv[b, t].item()
            terms.append(min(r * a, min(max(r, 1 - LOW), 1 + HIGH) * a))
            n_clip += (a > 0 and r > 1 + HIGH) or (a < 0 and r < 1 - LOW)
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), abs=1e-12)
    assert stats["clipfrac"] == pytest.approx(n_clip / len(terms), abs=1e-12) and n_clip > 0
    # clip_eps_high=None is Eq. 15's symmetric clip, bitwise, value and gradient, as clip_eps_high=clip_eps
    (grad_none,) = torch.autograd.grad(ppo_loss.policy_loss(logprobs, old, adv, mask, LOW)[0], logprobs)
    loss_eq = ppo_loss.policy_loss(logprobs, old, adv, mask, LOW, clip_eps_high=LOW)[0]
    (grad_eq,) = torch.autograd.grad(loss_eq, logprobs)
    assert torch.equal(ppo_loss.policy_loss(logprobs, old, adv, mask, LOW)[0], loss_eq)
    assert torch.equal(grad_none, grad_eq)
    with pytest.raises(ValueError, match="clip_eps_high"):
        ppo_loss.policy_loss(logprobs, old, adv, mask, None, clip_eps_high=0.28)


def gspo_batch(seed=31, B=4, T=5, lengths=(5, 2, 4, 3), spread=0.3):
    g = torch.Generator().manual_seed(seed)
    old = torch.log_softmax(torch.randn(B, T, 4, generator=g, dtype=D), -1)[..., 0]   # (B, T) log-probs < 0
    logprobs = old + spread * torch.randn(B, T, generator=g, dtype=D)
    return old, logprobs, ragged_mask(list(lengths), T), list(lengths)


def test_sequence_log_ratio_gspo_value_is_the_length_normalised_sequence_ratio():
    """s_i = (π_θ(y_i|x)/π_old(y_i|x))^(1/|y_i|), the sequence probabilities as products of token probabilities (a
    loop), equals exp of every real token's sequence_log_ratio."""
    old, logprobs, mask, lengths = gspo_batch()
    log_s = ppo_loss.sequence_log_ratio(logprobs, old, mask)
    for b, n in enumerate(lengths):
        p_new = math.prod(math.exp(x) for x in logprobs[b, :n].tolist())
        p_old = math.prod(math.exp(x) for x in old[b, :n].tolist())
        for t in range(n):
            assert math.exp(log_s[b, t].item()) == pytest.approx((p_new / p_old) ** (1 / n), rel=1e-12)


def test_gspo_gradient_equals_gspo_with_equal_advantages_along_each_sequence():
    """ratio_level="sequence" with the same Â_i on every token and GSPO's per-sequence mean has the value and, by
    autograd, the gradient of GSPO's sequence objective −(1/B) Σ_i min(s_i Â_i, clip(s_i) Â_i), where s_i is computed
    independently as exp(Σ_t (log π_θ − log π_old) / |y_i|), a differentiable function of every token. Some sequences
    are clipped (their gradient is 0)."""
    old, logprobs, mask, lengths = gspo_batch(spread=0.4)
    adv_seq = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=D)
    eps = 0.1
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = ppo_loss.policy_loss(lp, old, adv_seq[:, None] * mask, mask, eps, ratio_level="sequence",
                                       agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = logprobs.clone().requires_grad_(True)
    objective = []
    for b, n in enumerate(lengths):
        s = torch.exp((lp2[b, :n] - old[b, :n]).sum() / n)                            # s_i (GSPO)
        a = adv_seq[b]
        objective.append(torch.minimum(s * a, torch.clamp(s, 1 - eps, 1 + eps) * a))
    want = -torch.stack(objective).mean()
    (want_grad,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(loss, want, **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)
    s_all = [math.exp(sum(logprobs[b, :n].tolist()) / n - sum(old[b, :n].tolist()) / n) for b, n in enumerate(lengths)]
    clipped = [(a > 0 and s > 1 + eps) or (a < 0 and s < 1 - eps) for s, a in zip(s_all, adv_seq.tolist())]
    assert any(clipped) and not all(clipped)
    assert stats["clipfrac"] == pytest.approx(sum(c * n for c, n in zip(clipped, lengths)) / sum(lengths), abs=1e-12)


def test_gspo_token_gradient_against_the_papers_formula():
    """GSPO-token with per-token advantages: ∂L/∂log π_θ(y_{i,t}) = −(1/B)(1/|y_i|) s_i Â_{i,t} where the clip does
    not bind (Â > 0 and s_i > 1 + ε, or Â < 0 and s_i < 1 − ε), 0 where it does (a loop)."""
    old, logprobs, mask, lengths = gspo_batch(seed=33, spread=0.25)
    adv = torch.randn(4, 5, generator=torch.Generator().manual_seed(34), dtype=D)
    eps = 0.05
    lp = logprobs.clone().requires_grad_(True)
    loss, _ = ppo_loss.policy_loss(lp, old, adv, mask, eps, ratio_level="sequence", agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    want, n_binds = torch.zeros(4, 5, dtype=D), 0
    for b, n in enumerate(lengths):
        s = math.exp((sum(logprobs[b, :n].tolist()) - sum(old[b, :n].tolist())) / n)
        for t in range(n):
            a = adv[b, t].item()
            binds = (a > 0 and s > 1 + eps) or (a < 0 and s < 1 - eps)
            n_binds += binds
            want[b, t] = 0.0 if binds else -s * a / (n * len(lengths))
    assert 0 < n_binds < sum(lengths)
    torch.testing.assert_close(grad, want, **EXACT)


def test_cispo_loss_value_and_gradient_against_the_formula():
    """L = −(1/N) Σ sg(clip(ρ, 1−ε_low, 1+ε_high)) Â log π_θ over the N real tokens; ∂L/∂log π_θ = −clip(ρ)Â/N on
    every real token, clipped or not (a loop)."""
    g = torch.Generator().manual_seed(41)
    B, T, lengths = 3, 5, [5, 3, 4]
    old = torch.log_softmax(torch.randn(B, T, 4, generator=g, dtype=D), -1)[..., 0]
    logprobs = (old + 0.4 * torch.randn(B, T, generator=g, dtype=D)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = ragged_mask(lengths, T)
    loss, stats = ppo_loss.cispo_loss(logprobs, old, adv, mask, 0.2, 0.28)
    (grad,) = torch.autograd.grad(loss, logprobs)
    n = sum(lengths)
    value, want, n_clip = 0.0, torch.zeros(B, T, dtype=D), 0
    for b in range(B):
        for t in range(lengths[b]):
            r = math.exp(logprobs[b, t].item() - old[b, t].item())
            w = min(max(r, 0.8), 1.28)
            value += -w * adv[b, t].item() * logprobs[b, t].item() / n
            want[b, t] = -w * adv[b, t].item() / n
            n_clip += w != r
    assert loss.item() == pytest.approx(value, abs=1e-12)
    torch.testing.assert_close(grad, want, **EXACT)
    assert stats["clipfrac"] == pytest.approx(n_clip / n, abs=1e-12) and 0 < n_clip < n
    assert (grad[mask != 0] != 0).all()   # every real token keeps its gradient


def test_cispo_loss_keeps_the_gradient_where_ppo_clip_drops_it():
    """A token with Â > 0 and ρ = 1.5 > 1 + ε: PPO-clip's gradient is 0, CISPO's is −(1 + ε_high)·Â."""
    old = torch.tensor([[math.log(0.2)]], dtype=D)
    lp = (old + math.log(1.5)).requires_grad_(True)
    adv, one = torch.tensor([[2.0]], dtype=D), torch.ones(1, 1, dtype=D)
    (ppo_grad,) = torch.autograd.grad(ppo_loss.policy_loss(lp, old, adv, one, 0.2)[0], lp)
    (cispo_grad,) = torch.autograd.grad(ppo_loss.cispo_loss(lp, old, adv, one, 0.2, 0.28)[0], lp)
    assert ppo_grad.item() == 0.0 and cispo_grad.item() == pytest.approx(-1.28 * 2.0, abs=1e-12)
    with pytest.raises(ValueError, match="clip_eps_low"):
        ppo_loss.cispo_loss(lp, old, adv, one, 1.5, 0.28)


def mismatch_batch(seed=51, B=3, T=6, lengths=(6, 2, 4), noise=0.1):
    g = torch.Generator().manual_seed(seed)
    old = torch.log_softmax(torch.randn(B, T, 5, generator=g, dtype=D), -1)[..., 0]
    rollout = old + noise * torch.randn(B, T, generator=g, dtype=D)
    mask = ragged_mask(list(lengths), T)
    return old, torch.where(mask != 0, rollout, torch.nan), mask, list(lengths)   # NaN on the sampler's padding


def test_rollout_mismatch_against_a_loop_and_zero_when_the_two_agree():
    old, rollout, mask, lengths = mismatch_batch()
    stats = ppo_loss.rollout_mismatch(old, rollout, mask)
    d = [rollout[b, t].item() - old[b, t].item() for b, n in enumerate(lengths) for t in range(n)]
    assert stats["mean_abs_logp_diff"] == pytest.approx(statistics.fmean(abs(x) for x in d), abs=1e-12)
    assert stats["max_abs_logp_diff"] == pytest.approx(max(abs(x) for x in d), abs=1e-12)
    assert stats["token_mult_prob_error"] == pytest.approx(statistics.fmean(math.exp(abs(x)) for x in d), abs=1e-12)
    # k3 with samples from π_rollout: (π_old/π_rollout − 1) − log(π_old/π_rollout) = e^{−Δ} − 1 + Δ
    assert stats["kl"] == pytest.approx(statistics.fmean(math.exp(-x) - 1 + x for x in d), abs=1e-12)
    same = ppo_loss.rollout_mismatch(old, torch.where(mask != 0, old, torch.nan), mask)
    assert same == {"mean_abs_logp_diff": 0.0, "max_abs_logp_diff": 0.0, "token_mult_prob_error": 1.0, "kl": 0.0}


def test_rollout_mismatch_kl_estimates_kl_of_the_sampler_to_the_trainer():
    """Tokens drawn from π_rollout (torch.distributions.Categorical, 200k draws): the mean of the `kl` statistic is
    within 4 standard errors of the exact KL(π_rollout ‖ π_old), not of KL(π_old ‖ π_rollout)."""
    p_r = Categorical(logits=torch.tensor([2.5, 0.0, -1.0, 0.0], dtype=D))   # the sampler
    p_o = Categorical(logits=torch.tensor([0.0, 1.5, 0.5, -2.0], dtype=D))    # the trainer
    a = torch.multinomial(p_r.probs, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lr, lo = p_r.log_prob(a)[None], p_o.log_prob(a)[None]
    kl = ppo_loss.rollout_mismatch(lo, lr, torch.ones_like(lr))["kl"]
    k = torch.expm1(lo - lr) - (lo - lr)
    assert abs(kl - kl_divergence(p_r, p_o).item()) < 4 * k.std().item() / len(a) ** 0.5
    assert abs(kl - kl_divergence(p_o, p_r).item()) > 0.15   # the reverse: 1.58 against 1.40


@pytest.mark.parametrize("mode,level", [("tis", "token"), ("mis", "token"), ("mis", "sequence")])
def test_rollout_correction_weights_are_exactly_one_when_the_log_probs_agree(mode, level):
    """π_rollout = π_old: every weight is exactly 1.0 on the real tokens (0 on padding), nothing is masked, and the
    weighted policy loss is bitwise the unweighted one."""
    old, _, mask, _ = mismatch_batch()
    weights, keep, stats = ppo_loss.rollout_correction(old, old.clone(), mask, mode, 2.0, level)
    assert torch.equal(weights, mask) and torch.equal(keep, mask) and stats["masked_frac"] == 0.0
    lp = old + 0.1
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(52), dtype=D)
    assert torch.equal(ppo_loss.policy_loss(lp, old, adv, keep, 0.2, weights=weights)[0],
                       ppo_loss.policy_loss(lp, old, adv, mask, 0.2)[0])


def test_rollout_correction_tis_bounds_every_weight_by_the_cap_against_a_loop():
    old, rollout, mask, lengths = mismatch_batch(noise=0.8)
    C = 1.5
    weights, keep, stats = ppo_loss.rollout_correction(old, rollout, mask, "tis", C)
    n_capped = 0
    for b in range(3):
        for t in range(6):
            if t < lengths[b]:
                rho = math.exp(old[b, t].item() - rollout[b, t].item())
                assert weights[b, t].item() == pytest.approx(min(rho, C), rel=1e-12)
                n_capped += rho > C
            else:
                assert weights[b, t].item() == 0.0
    assert weights.max().item() <= C and torch.equal(keep, mask) and 0 < n_capped
    assert stats["capped_frac"] == pytest.approx(n_capped / sum(lengths), abs=1e-12)
    assert not weights.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_mis_masks_what_leaves_the_interval_against_a_loop(level):
    """MIS keeps a token (level token) or a whole sequence (level sequence, ρ_i = Π_t ρ_t as verl) when its ratio lies
    in [1/C, C], with the weight ρ; the others leave the mask and get weight 0 (a loop)."""
    old, rollout, mask, lengths = mismatch_batch(noise=0.5)
    C = 1.6
    weights, keep, stats = ppo_loss.rollout_correction(old, rollout, mask, "mis", C, level)
    n_masked = 0
    for b, n in enumerate(lengths):
        logs = [old[b, t].item() - rollout[b, t].item() for t in range(n)]
        for t in range(6):
            if t >= n:
                assert keep[b, t].item() == 0.0 and weights[b, t].item() == 0.0
                continue
            rho = math.exp(sum(logs)) if level == "sequence" else math.exp(logs[t])
            kept = 1 / C <= rho <= C
            n_masked += not kept
            assert keep[b, t].item() == float(kept)
            assert weights[b, t].item() == pytest.approx(rho if kept else 0.0, rel=1e-12)
    assert 0 < n_masked < sum(lengths)
    assert stats["masked_frac"] == pytest.approx(n_masked / sum(lengths), abs=1e-12)


def test_rollout_weights_multiply_the_clipped_objective_against_a_loop():
    """With TIS weights w_t and a MIS-style mask, the loss is −Σ w_t min(ρÂ, clip(ρ)Â) / Σ mask (a loop); the weight
    is a constant (no gradient into it) and the masked-out tokens leave the denominator."""
    old, rollout, mask, lengths = mismatch_batch(noise=0.8)
    weights, keep, _ = ppo_loss.rollout_correction(old, rollout, mask, "mis", 1.6, "token")
    w = weights.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(53)
    lp = (old + 0.2 * torch.randn(old.shape, generator=g, dtype=D)).requires_grad_(True)
    adv = torch.randn(old.shape, generator=g, dtype=D)
    loss, _ = ppo_loss.policy_loss(lp, old, adv, keep, EPS, weights=w)
    terms = []
    for b, n in enumerate(lengths):
        for t in range(n):
            if keep[b, t]:
                r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
                terms.append(weights[b, t].item() * min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a))
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), abs=1e-12)
    loss.backward()
    assert w.grad is None


def test_rollout_correction_rejects_what_it_does_not_implement():
    old, rollout, mask, _ = mismatch_batch()
    for mode, cap, level in [("tis", 2.0, "sequence"), ("mis", 0.5, "token"), ("icepop", 2.0, "token")]:
        with pytest.raises(ValueError, match="rollout_correction"):
            ppo_loss.rollout_correction(old, rollout, mask, mode, cap, level)


# ----------------------------------------------------------------------------------------------------
# Value loss (Eq. 16)
# ----------------------------------------------------------------------------------------------------

def test_value_loss_eq16_clipping_matches_loop():
    g = torch.Generator().manual_seed(2)
    B, T, lengths, c = 3, 4, [4, 1, 3], 0.2
    values = torch.randn(B, T, generator=g, dtype=D)
    old_values = values + 0.4 * torch.randn(B, T, generator=g, dtype=D)
    returns = torch.randn(B, T, generator=g, dtype=D)
    mask = ragged_mask(lengths, T)
    loss, stats = ppo_loss.value_loss(values, old_values, returns, mask, clip_range=c)

    total, n_clip, n = 0.0, 0, 0
    for b in range(B):
        for t in range(lengths[b]):
            v, vo, r = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
            v_clipped = vo + min(max(v - vo, -c), c)
            total += max((v - r) ** 2, (v_clipped - r) ** 2)
            n_clip += (v_clipped - r) ** 2 > (v - r) ** 2
            n += 1
    torch.testing.assert_close(loss, torch.tensor(total / n, dtype=D), **EXACT)
    assert n_clip > 0
    assert stats["vf_clipfrac"] == pytest.approx(n_clip / n, abs=1e-12)


def test_value_loss_eq16_no_clip_is_masked_mse_without_half():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2, 5, generator=g, dtype=D)
    returns = torch.randn(2, 5, generator=g, dtype=D)
    mask = ragged_mask([5, 3], 5)
    loss, stats = ppo_loss.value_loss(values, values + 1.0, returns, mask)  # old_values unused without clip
    sel = mask.bool()
    torch.testing.assert_close(loss, F.mse_loss(values[sel], returns[sel]), **EXACT)
    assert stats["vf_clipfrac"] == 0.0, f"vf_clipfrac without a clip: expected 0.0, got {stats['vf_clipfrac']}"
    expected_ev = 1 - torch.var(returns[sel] - values[sel], unbiased=False) / torch.var(returns[sel], unbiased=False)
    assert stats["vf_explained_var"] == pytest.approx(expected_ev.item(), abs=1e-12)


def test_value_loss_eq16_clipping_zero_gradient_outside_clip_region():
    # V moved 0.5 away from V_old (beyond c = 0.2) in the direction away from R: the clipped term wins.
    values = torch.tensor([[1.5]], dtype=D, requires_grad=True)
    loss, _ = ppo_loss.value_loss(values, torch.tensor([[1.0]], dtype=D), torch.tensor([[3.0]], dtype=D),
                                  torch.ones(1, 1, dtype=D), clip_range=0.2)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor((1.2 - 3.0) ** 2, dtype=D), **EXACT)
    assert values.grad.item() == 0.0, f"the clipped term wins: expected gradient 0, got {values.grad.item()}"


def test_value_loss_explained_var_is_nan_for_constant_returns():
    values = torch.tensor([[0.1, 0.4, -0.2]], dtype=D)
    loss, stats = ppo_loss.value_loss(values, values, torch.full((1, 3), 2.0, dtype=D), torch.ones(1, 3, dtype=D))
    assert math.isnan(stats["vf_explained_var"]), f"expected NaN for constant returns, got {stats['vf_explained_var']}"
    torch.testing.assert_close(loss, ((values - 2.0) ** 2).mean(), **EXACT)


def test_value_loss_treats_old_values_and_returns_as_constants():
    g = torch.Generator().manual_seed(13)
    values = torch.randn(2, 3, generator=g, dtype=D).requires_grad_(True)
    old_values = (values.detach() + 0.5 * torch.randn(2, 3, generator=g, dtype=D)).requires_grad_(True)
    returns = torch.randn(2, 3, generator=g, dtype=D).requires_grad_(True)
    loss, _ = ppo_loss.value_loss(values, old_values, returns, torch.ones(2, 3, dtype=D), clip_range=0.2)
    loss.backward()
    assert values.grad is not None and values.grad.abs().sum() > 0, "expected a gradient into values, got none"
    assert old_values.grad is None, f"expected no gradient into old_values (a constant), got {old_values.grad}"
    assert returns.grad is None, f"expected no gradient into returns (a constant), got {returns.grad}"


def test_value_loss_rejects_mismatched_shapes():
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match="returns"):
        ppo_loss.value_loss(x, x, torch.zeros(2, 1, dtype=D), torch.ones(2, 3, dtype=D))


# ----------------------------------------------------------------------------------------------------
# KL (Eq. 3, 19)
# ----------------------------------------------------------------------------------------------------

def test_kl_full_eq19_matches_torch_distributions():
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(2, 5, 7, generator=g, dtype=D)
    ref_logits = 3 * torch.randn(2, 5, 7, generator=g, dtype=D)
    expected = kl_divergence(Categorical(logits=logits), Categorical(logits=ref_logits))  # (2, 5)
    torch.testing.assert_close(ppo_loss.kl_full(logits, ref_logits), expected, rtol=1e-10, atol=1e-12)
    kl = ppo_loss.kl_full(logits, ref_logits)
    assert (kl >= 0).all(), f"an exact KL is ≥ 0: got {kl.min().item()}"


def test_kl_full_eq19_zero_for_equal_logits_and_shift_invariant():
    logits = torch.randn(3, 4, 11, dtype=D)
    torch.testing.assert_close(ppo_loss.kl_full(logits, logits), torch.zeros(3, 4, dtype=D), rtol=0, atol=1e-14)
    torch.testing.assert_close(ppo_loss.kl_full(logits, logits + 100.0), torch.zeros(3, 4, dtype=D), rtol=0, atol=1e-12)


def test_kl_full_eq19_stable_for_large_logits():
    logits = torch.tensor([[[1000.0, 0.0, -1000.0]]], dtype=torch.float32)
    ref_logits = torch.zeros(1, 1, 3)
    kl = ppo_loss.kl_full(logits, ref_logits)
    torch.testing.assert_close(kl, torch.tensor([[math.log(3)]]), rtol=1e-6, atol=1e-6)  # KL(δ_0 ‖ uniform) = log 3


def test_kl_full_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="ref_logits"):
        ppo_loss.kl_full(torch.zeros(1, 2, 5, dtype=D), torch.zeros(1, 2, 4, dtype=D))


def test_kl_sampled_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_loss.kl_sampled(torch.zeros(2, 3, dtype=D), torch.zeros(2, 1, dtype=D), "k3")


def test_kl_sampled_eq19_k2_k3_nonnegative_k1_can_be_negative():
    g = torch.Generator().manual_seed(5)
    logprobs = torch.randn(4, 50, generator=g, dtype=D)
    ref_logprobs = torch.randn(4, 50, generator=g, dtype=D)
    for kind in ("k2", "k3"):
        k = ppo_loss.kl_sampled(logprobs, ref_logprobs, kind)
        assert (k >= 0).all(), f"{kind} is ≥ 0 for every token: got {k.min().item()}"
    k1 = ppo_loss.kl_sampled(logprobs, ref_logprobs, "k1")
    assert (k1 < 0).any(), f"k1 = log π − log π_ref is negative where π < π_ref: got min {k1.min().item()}"
    torch.testing.assert_close(ppo_loss.kl_sampled(logprobs, logprobs, "k3"), torch.zeros(4, 50, dtype=D), **EXACT)


def test_kl_sampled_eq19_k1_k3_monte_carlo_mean_approaches_exact_kl():
    # Tokens sampled from π: the means of k1 and k3 are unbiased for KL(π ‖ π_ref). N = 200,000 samples,
    # fixed seed; tolerance = 4 standard errors of each estimator (measured from the same samples).
    # π_ref is a perturbation of π (KL ≈ 0.06), the regime of RLHF, where k3 has the lower variance.
    g = torch.Generator().manual_seed(6)
    V, N = 6, 200_000
    logits = torch.randn(V, generator=g, dtype=D)
    ref_logits = logits + 0.4 * torch.randn(V, generator=g, dtype=D)
    exact = kl_divergence(Categorical(logits=logits), Categorical(logits=ref_logits)).item()
    tokens = torch.multinomial(torch.softmax(logits, -1), N, replacement=True, generator=g).view(1, N)
    logprobs = torch.log_softmax(logits, -1)[tokens]  # (1, N)
    ref_logprobs = torch.log_softmax(ref_logits, -1)[tokens]  # (1, N)
    for kind in ("k1", "k3"):
        k = ppo_loss.kl_sampled(logprobs, ref_logprobs, kind)
        stderr = (k.std() / math.sqrt(N)).item()
        assert abs(k.mean().item() - exact) < 4 * stderr, \
            f"{kind}: Monte Carlo mean expected {exact:.5f} ± {4 * stderr:.5f} (the exact KL), got {k.mean().item():.5f}"
    assert 0.01 < exact < 0.2
    # k3 has lower variance than k1 when π ≈ π_ref (Schulman 2020); far apart it need not
    k1, k3 = (ppo_loss.kl_sampled(logprobs, ref_logprobs, kind) for kind in ("k1", "k3"))
    assert k3.std() < k1.std(), f"k3 has the lower variance when π ≈ π_ref: std k3 {k3.std():.4f}, k1 {k1.std():.4f}"


def test_kl_sampled_eq19_formulas():
    lp, ref = torch.tensor([[-0.5]], dtype=D), torch.tensor([[-1.25]], dtype=D)
    log_r = 0.75
    torch.testing.assert_close(ppo_loss.kl_sampled(lp, ref, "k1"), torch.tensor([[log_r]], dtype=D), **EXACT)
    torch.testing.assert_close(ppo_loss.kl_sampled(lp, ref, "k2"), torch.tensor([[0.5 * log_r**2]], dtype=D), **EXACT)
    torch.testing.assert_close(ppo_loss.kl_sampled(lp, ref, "k3"),
                               torch.tensor([[math.exp(-log_r) - 1 + log_r]], dtype=D), **EXACT)
    with pytest.raises(ValueError, match="k4"):
        ppo_loss.kl_sampled(lp, ref, "k4")


# ----------------------------------------------------------------------------------------------------
# Entropy and the entropy bonus (App. B.3, Fig. 16)
# ----------------------------------------------------------------------------------------------------

def test_entropy_uniform_is_log_V():
    V = 17
    torch.testing.assert_close(ppo_loss.entropy(torch.full((2, 3, V), 4.2, dtype=D)),
                               torch.full((2, 3), math.log(V), dtype=D), **EXACT)


def test_entropy_matches_torch_distributions():
    logits = 2 * torch.randn(3, 4, 9, dtype=D)
    torch.testing.assert_close(ppo_loss.entropy(logits), Categorical(logits=logits).entropy(), rtol=1e-12, atol=1e-12)


# float32 logits with large gaps, as a peaked policy gives: e^{−150} underflows to 0 in float32, so log(softmax)
# gives log 0 = −inf for the last token, and 0·(−inf) = NaN in the entropy. log_softmax gives −150.
GAP_LOGITS = [30.0, 0.0, -120.0]


def log_softmax_by_hand(logits: list[float]) -> list[float]:
    """log π(v) = l_v − (max + log Σ exp(l − max)) in python floats (float64)."""
    top = max(logits)
    lse = top + math.log(sum(math.exp(l - top) for l in logits))
    return [l - lse for l in logits]


def test_entropy_finite_in_float32_at_large_logit_gaps():
    logp = log_softmax_by_hand(GAP_LOGITS)
    expected = -sum(math.exp(lp) * lp for lp in logp)  # ≈ 30 e^{−30} ≈ 2.8e-12
    h = ppo_loss.entropy(torch.tensor([[GAP_LOGITS]], dtype=torch.float32))
    assert torch.isfinite(h).all(), f"entropy of float32 logits {GAP_LOGITS}: expected {expected:.3g}, got {h.item()}"
    torch.testing.assert_close(h, torch.tensor([[expected]], dtype=torch.float32), rtol=0, atol=1e-6)


def test_entropy_bonus_zero_gradient_above_clip_nonzero_below():
    V = 8
    mask = ragged_mask([3, 1], 3)
    # near-uniform logits: H̄ ≈ log 8 ≈ 2.08 > clip = 1.5 → the term is 0 with zero gradient
    high = (0.01 * torch.randn(2, 3, V, dtype=D)).requires_grad_(True)
    loss, stats = ppo_loss.entropy_bonus_loss(high, mask, coef=0.01, clip=1.5)
    loss.backward()
    assert stats["entropy"] > 1.5, f"near-uniform logits over 8 tokens: expected H̄ ≈ log 8, got {stats['entropy']}"
    assert stats["entropy_bonus_active"] == 0.0
    assert loss.item() == 0.0, f"H̄ above the clip: expected loss 0, got {loss.item()}"
    assert torch.count_nonzero(high.grad) == 0, "H̄ above the clip: expected zero gradient, got a nonzero one"

    # peaked logits: H̄ < clip → the gradient equals that of the unclipped bonus −coef·H̄, nonzero
    low = (5 * torch.randn(2, 3, V, dtype=D)).requires_grad_(True)
    loss, stats = ppo_loss.entropy_bonus_loss(low, mask, coef=0.01, clip=1.5)
    assert stats["entropy"] < 1.5, f"peaked logits: expected H̄ < 1.5, got {stats['entropy']}"
    assert stats["entropy_bonus_active"] == 1.0
    (grad_clipped,) = torch.autograd.grad(loss, low)
    mean_h = (Categorical(logits=low).entropy() * mask).sum() / mask.sum()  # independent H̄
    (grad_unclipped,) = torch.autograd.grad(-0.01 * mean_h, low)
    assert grad_clipped.abs().max() > 0, "H̄ below the clip: expected a gradient, got zero"
    torch.testing.assert_close(grad_clipped, grad_unclipped, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(loss, 0.01 * (1.5 - mean_h.detach()), **EXACT)
    # padding positions (mask 0) get no gradient
    assert torch.count_nonzero(grad_clipped[1, 1:]) == 0, "expected no gradient at padding positions, got some"


def test_entropy_bonus_no_clip_is_minus_coef_mean_entropy():
    logits = torch.randn(2, 4, 5, dtype=D)
    mask = ragged_mask([4, 2], 4)
    loss, _ = ppo_loss.entropy_bonus_loss(logits, mask, coef=0.01)
    h = Categorical(logits=logits).entropy()
    torch.testing.assert_close(loss, -0.01 * h[mask.bool()].mean(), **EXACT)


# ----------------------------------------------------------------------------------------------------
# Masked statistics and log-probs
# ----------------------------------------------------------------------------------------------------

def test_masked_mean_matches_loop():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, generator=g, dtype=D)
    lengths = [6, 2, 4]
    mask = ragged_mask(lengths, 6)
    vals = [x[b, t].item() for b in range(3) for t in range(lengths[b])]
    torch.testing.assert_close(ppo_loss.masked_mean(x, mask), torch.tensor(sum(vals) / len(vals), dtype=D), **EXACT)
    rows = torch.tensor([sum(x[b, :n].tolist()) / n for b, n in enumerate(lengths)], dtype=D)
    torch.testing.assert_close(ppo_loss.masked_mean(x, mask, dim=1), rows, **EXACT)


def test_masked_mean_empty_mask_is_zero_not_nan():
    x = torch.randn(2, 3, dtype=D)
    got = ppo_loss.masked_mean(x, torch.zeros(2, 3, dtype=D))
    assert got.item() == 0.0, f"all-zero mask: expected 0, got {got.item()}"
    rows = ppo_loss.masked_mean(x, ragged_mask([3, 0], 3), dim=1)  # an all-zero row along dim
    expected = torch.tensor([x[0].mean().item(), 0.0], dtype=D)
    assert torch.isfinite(rows).all(), f"all-zero row along dim: expected {expected.tolist()}, got {rows.tolist()}"
    torch.testing.assert_close(rows, expected, **EXACT)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_against_a_loop_with_empty_rows(mode):
    """Each --loss-agg against python loops over rows and tokens, on a batch with rows of no real token (NaN on the
    padding): seq-mean-token-mean averages over the rows that have a token (an empty row has no mean to count),
    seq-mean-token-sum-norm divides by every row B × T_max (a constant), token-mean by the real tokens."""
    g = torch.Generator().manual_seed(11)
    lengths, T, T_max = [4, 0, 2, 0, 5], 5, 8
    mask = ragged_mask(lengths, T)
    x = torch.where(mask != 0, torch.randn(5, T, generator=g, dtype=D), torch.nan)
    rows = [[x[b, t].item() for t in range(n)] for b, n in enumerate(lengths)]
    want = {"token-mean": sum(map(sum, rows)) / sum(lengths),
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows if r) / sum(1 for r in rows if r),
            "seq-mean-token-sum-norm": sum(map(sum, rows)) / (len(rows) * T_max)}[mode]
    got = ppo_loss.aggregate(x, mask, mode, max_len=T_max)
    torch.testing.assert_close(got, torch.tensor(want, dtype=D), **EXACT)
    empty = ppo_loss.aggregate(x, torch.zeros_like(mask), mode, max_len=T_max)  # no real token anywhere: 0, not NaN
    assert empty.item() == 0.0


def test_masked_mean_ignores_nan_and_inf_at_masked_positions():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 4, generator=g, dtype=D)
    mask = ragged_mask([4, 1, 2], 4)
    expected = ppo_loss.masked_mean(x, mask), ppo_loss.masked_mean(x, mask, dim=1)
    junk = x.clone()
    junk[1, 1:] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=D)  # e.g. padding logprobs
    junk[2, 2:] = float("nan")
    got = ppo_loss.masked_mean(junk, mask)
    assert torch.isfinite(got), f"NaN/inf at masked positions leaked: expected {expected[0].item():.6g}, got {got.item()}"
    torch.testing.assert_close(got, expected[0], **EXACT)
    torch.testing.assert_close(ppo_loss.masked_mean(junk, mask, dim=1), expected[1], **EXACT)


def test_masked_mean_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="mask"):
        ppo_loss.masked_mean(torch.zeros(2, 3, dtype=D), torch.ones(2, 1, dtype=D))


def test_masked_var_ddof():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, generator=g, dtype=D)
    mask = ragged_mask([5, 2], 5)
    sel = x[mask.bool()]
    torch.testing.assert_close(ppo_loss.masked_var(x, mask), torch.var(sel, unbiased=False), **EXACT)
    torch.testing.assert_close(ppo_loss.masked_var(x, mask, unbiased=True), torch.var(sel, unbiased=True), **EXACT)


def test_masked_whiten_zero_mean_unit_variance_padding_untouched():
    g = torch.Generator().manual_seed(9)
    x = 3.0 + 2.0 * torch.randn(3, 7, generator=g, dtype=D)
    mask = ragged_mask([7, 3, 5], 7)
    x[mask == 0] = 0.0  # as compute_gae leaves it
    w = ppo_loss.masked_whiten(x, mask)
    sel = w[mask.bool()]
    torch.testing.assert_close(sel.mean(), torch.tensor(0.0, dtype=D), rtol=0, atol=1e-12)
    one = torch.tensor(1.0, dtype=D)
    torch.testing.assert_close(torch.var(sel, unbiased=False), one, rtol=0, atol=1e-7)  # ddof 0; eps = 1e-8
    torch.testing.assert_close(w[mask == 0], x[mask == 0], rtol=0, atol=0)
    # shift_mean=False keeps the mean and only rescales
    w2 = ppo_loss.masked_whiten(x, mask, shift_mean=False)
    xs = x[mask.bool()]
    torch.testing.assert_close(w2[mask.bool()].mean(), xs.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.var(w2[mask.bool()], unbiased=False), one, rtol=0, atol=1e-7)


def test_masked_whiten_padding_unchanged_and_never_in_the_statistics():
    """Masked entries are returned as they are (even NaN / inf) and never enter μ or σ²."""
    g = torch.Generator().manual_seed(15)
    x = 3.0 + 2.0 * torch.randn(2, 5, generator=g, dtype=D)
    mask = ragged_mask([5, 2], 5)
    sel = x[mask.bool()]
    expected = (sel - sel.mean()) / torch.sqrt(torch.var(sel, unbiased=False) + 1e-8)  # μ, σ² of the real entries
    x[1, 2:] = torch.tensor([7.0, float("nan"), float("inf")], dtype=D)
    w = ppo_loss.masked_whiten(x, mask)
    torch.testing.assert_close(w[mask.bool()], expected, **EXACT)
    torch.testing.assert_close(w[mask == 0], x[mask == 0], rtol=0, atol=0, equal_nan=True)


def test_masked_whiten_eps_inside_the_square_root():
    """(x − μ) / sqrt(σ² + eps): with σ² = 2.5e-9 the eps = 1e-8 of the default changes the result a lot."""
    x = torch.tensor([[0.0, 1e-4]], dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    expected = torch.tensor([[-5e-5, 5e-5]], dtype=D) / math.sqrt(2.5e-9 + 1e-8)  # ±0.4472
    torch.testing.assert_close(ppo_loss.masked_whiten(x, mask), expected, rtol=1e-10, atol=0)
    torch.testing.assert_close(ppo_loss.masked_whiten(x, mask, eps=1e-6), expected * math.sqrt(1.25e-8 / 1.0025e-6),
                               rtol=1e-10, atol=0)


def test_logprobs_from_logits_matches_categorical_log_prob():
    g = torch.Generator().manual_seed(10)
    logits = 4 * torch.randn(2, 5, 13, generator=g, dtype=D)
    tokens = torch.randint(0, 13, (2, 5), generator=g)
    torch.testing.assert_close(ppo_loss.logprobs_from_logits(logits, tokens),
                               Categorical(logits=logits).log_prob(tokens), **EXACT)
    with pytest.raises(ValueError, match="logits"):
        ppo_loss.logprobs_from_logits(logits, tokens[:, :4])


def test_logprobs_from_logits_finite_in_float32_at_large_logit_gaps():
    expected = log_softmax_by_hand(GAP_LOGITS)  # ≈ [−9.4e-14, −30, −150]
    logits = torch.tensor([[GAP_LOGITS] * 3], dtype=torch.float32)  # (1, 3, 3): every token of the vocabulary
    got = ppo_loss.logprobs_from_logits(logits, torch.tensor([[0, 1, 2]]))
    assert torch.isfinite(got).all(), f"log π of float32 logits {GAP_LOGITS}: expected {expected}, got {got.tolist()}"
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float32), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# PPO-ptx (Eq. 17)
# ----------------------------------------------------------------------------------------------------

def test_ptx_loss_eq17_matches_cross_entropy_on_unmasked_positions():
    g = torch.Generator().manual_seed(11)
    B, L, V = 3, 6, 10
    logits = torch.randn(B, L, V, generator=g, dtype=D)
    input_ids = torch.randint(0, V, (B, L), generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=D)
    loss, stats = ppo_loss.ptx_loss(logits, input_ids, loss_mask)
    # Hugging Face convention: labels = input_ids with -100 where not predicted; shift by one
    labels = input_ids.clone()
    labels[loss_mask == 0] = -100
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected, **EXACT)
    assert stats["ptx_tokens"] == 4 + 2 + 4  # loss_mask[:, 0] is never a target
    assert stats["ptx_ppl"] == pytest.approx(math.exp(expected.item()), rel=1e-12)
    # the last position's logits predict nothing: changing them leaves the loss unchanged
    logits2 = logits.clone()
    logits2[:, -1] += 5.0
    torch.testing.assert_close(ppo_loss.ptx_loss(logits2, input_ids, loss_mask)[0], loss, **EXACT)


# ----------------------------------------------------------------------------------------------------
# The worked example printed by `python ppo_loss.py`
# ----------------------------------------------------------------------------------------------------

def test_policy_loss_worked_example_numbers():
    old = torch.log(torch.full((2, 3), 0.5, dtype=D))
    ratio = torch.tensor([[1.1, 1.5, 0.9], [0.5, 1.3, 1.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    loss, stats = ppo_loss.policy_loss(old + ratio.log(), old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.240000, abs=1e-6)  # −(1.1 + 1.2 − 0.9 − 0.8 + 0.6) / 5
    assert stats["clipfrac"] == pytest.approx(0.600000, abs=1e-6)
    assert stats["approx_kl"] == pytest.approx(0.067074, abs=1e-6)
    assert stats["ratio"] == pytest.approx(1.060000, abs=1e-6)
    loss, _ = ppo_loss.policy_loss(old + ratio.log(), old, adv, mask, clip_eps=None)
    assert loss.item() == pytest.approx(-0.370000, abs=1e-6)


def test_clip_higher_and_cispo_worked_example_numbers():
    """The same batch with ε_high = 0.28 (clip-higher) and with CISPO's weight (ε_low 0.2, ε_high 0.28)."""
    old = torch.log(torch.full((2, 3), 0.5, dtype=D))
    ratio = torch.tensor([[1.1, 1.5, 0.9], [0.5, 1.3, 1.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    loss, stats = ppo_loss.policy_loss(old + ratio.log(), old, adv, mask, 0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-0.264000, abs=1e-6)  # −(1.1 + 1.28 − 0.9 − 0.8 + 0.64) / 5
    assert stats["clipfrac"] == pytest.approx(0.600000, abs=1e-6)
    loss, stats = ppo_loss.cispo_loss(old + ratio.log(), old, adv, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(-0.105228, abs=1e-6)  # −Σ clip(ρ)·Â·log(0.5ρ) / 5, clip(ρ) 1.1 1.28 0.9 0.8 1.28
    assert stats["clipfrac"] == pytest.approx(0.600000, abs=1e-6)


def test_value_loss_worked_example_numbers():
    values = torch.tensor([[1.0, 0.5, -0.3]], dtype=D)
    old_values = torch.tensor([[0.5, 0.6, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.0, 0.2]], dtype=D)
    vmask = torch.ones(1, 3, dtype=D)
    loss, stats = ppo_loss.value_loss(values, old_values, returns, vmask, clip_range=0.2)
    assert loss.item() == pytest.approx(0.730000, abs=1e-6)  # (1.69 + 0.25 + 0.25) / 3
    assert stats["vf_clipfrac"] == pytest.approx(0.333333, abs=1e-6)
    assert ppo_loss.value_loss(values, old_values, returns, vmask)[0].item() == pytest.approx(0.5, abs=1e-6)


# the worked example's V = 3 distribution; the sampled token is token 0
WE_LOGITS = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=D)
WE_REF_LOGITS = torch.zeros(1, 1, 3, dtype=D)


def test_kl_full_worked_example_numbers():
    assert ppo_loss.kl_full(WE_LOGITS, WE_REF_LOGITS).item() == pytest.approx(0.266217, abs=1e-6)


def test_kl_sampled_worked_example_numbers():
    lp = torch.tensor([[2.0 - math.log(math.exp(2) + math.exp(1) + 1)]], dtype=D)  # log π(0) of logits [2, 1, 0]
    ref_lp = torch.tensor([[-math.log(3)]], dtype=D)  # log π_ref(0), uniform over 3
    assert ppo_loss.kl_sampled(lp, ref_lp, "k1").item() == pytest.approx(0.691006, abs=1e-6)
    assert ppo_loss.kl_sampled(lp, ref_lp, "k2").item() == pytest.approx(0.238745, abs=1e-6)
    assert ppo_loss.kl_sampled(lp, ref_lp, "k3").item() == pytest.approx(0.192078, abs=1e-6)


def test_logprobs_from_logits_worked_example_numbers():
    tok = torch.zeros(1, 1, dtype=torch.long)
    assert ppo_loss.logprobs_from_logits(WE_LOGITS, tok).item() == pytest.approx(-0.407606, abs=1e-6)
    assert ppo_loss.logprobs_from_logits(WE_REF_LOGITS, tok).item() == pytest.approx(-math.log(3), abs=1e-12)


def test_entropy_worked_example_numbers():
    assert ppo_loss.entropy(WE_LOGITS).item() == pytest.approx(0.832396, abs=1e-6)
    assert ppo_loss.entropy(WE_REF_LOGITS).item() == pytest.approx(1.098612, abs=1e-6)
    loss, _ = ppo_loss.entropy_bonus_loss(WE_LOGITS, torch.ones(1, 1, dtype=D), coef=0.01, clip=1.0)
    assert loss.item() == pytest.approx(0.001676, abs=1e-6)


def test_ptx_perplexity_of_a_diverged_policy_is_inf_not_an_error():
    """exp(NLL) past float range (a policy blown up by a huge learning rate) is logged as inf, which the non-finite
    guard and the logs handle; math.exp would raise OverflowError and end the run in a traceback."""
    logits = torch.zeros(1, 3, 4, dtype=D)
    logits[0, :, 0] = 1e4  # all mass on id 0, the targets are id 1: NLL ≈ 1e4 nats per token
    loss, stats = ppo_loss.ptx_loss(logits, torch.tensor([[1, 1, 1]]), torch.ones(1, 3, dtype=D))
    assert loss.item() == pytest.approx(1e4) and stats["ptx_ppl"] == math.inf


def test_ptx_loss_worked_example_numbers():
    ptx_logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]]], dtype=D)
    loss, stats = ppo_loss.ptx_loss(ptx_logits, torch.tensor([[0, 1, 2, 0]]), torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    assert loss.item() == pytest.approx(2.239545, abs=1e-6)  # log(e² + 2)
    assert stats["ptx_ppl"] == pytest.approx(9.389056, abs=1e-6)  # e² + 2
    assert stats["ptx_tokens"] == 2
