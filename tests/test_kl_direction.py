"""Which KL each estimator estimates, and which gradient it gives in the reward (Eq. 19) or in the loss (--kl-in loss),
on a small categorical policy where every expectation is an exact sum over its 5 outcomes.

Direction: with samples a ~ π and log r = log π(a) − log π_ref(a), E_π[k1] = E_π[k3] = KL(π ‖ π_ref) exactly, not
KL(π_ref ‖ π) (rlhf-book's approx_kl3 slip uses the ratio the other way round). k2 = ½(log r)² is symmetric in its
two arguments: its direction is only that of the samples (from π).
Gradient: in the reward, k1 enters the policy gradient as a reward, E_π[k1 · ∇log π] = ∇KL(π ‖ π_ref) exactly. In
the loss, the term is differentiated with the samples held fixed (the rollout's tokens, π_old = π on the first
minibatch): k2 gives ∇KL(π ‖ π_ref) exactly, k1 gives 0, and k3 (GRPO's) gives ∇KL(π_ref ‖ π), the REVERSE KL's
gradient: biased for the KL it estimates (verl "k3+", TRL use_bias_correction_kl, OpenRLHF PR 1101).
Each is checked against autograd of the exact KL (ppo_loss.kl_full) on the same logits.
The KL matrix (the second half; its table in docs/methods.md, which the test reads): the same on a policy over
sequences of two tokens (9 outcomes), every --kl-estimator × --kl-in against the exact gradient. With more than one
token, the loss placements give the per-token KL's gradient with the states held fixed: for one token (above) that is
the KL's own, for a sequence it misses how an earlier token moves the KL of the later ones.
"""
import itertools
from pathlib import Path

import pytest
import torch
from torch.distributions import Categorical, kl_divergence
from torch.testing import assert_close

import critic_free
import ppo_loss
import ppo_max

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
THETA = torch.tensor([1.5, -0.3, 0.2, -2.0, 0.7], dtype=F64)
REF = torch.tensor([-0.5, 0.8, 0.1, 1.2, -1.0], dtype=F64)  # far from π: the two KL directions differ by ≈ 30 %
A = torch.arange(5)


def exact(theta, ref, reverse=False):
    """KL(π ‖ π_ref) (or KL(π_ref ‖ π)) by ppo_loss.kl_full on one position."""
    a, b = (ref, theta) if reverse else (theta, ref)
    return ppo_loss.kl_full(a[None, None], b[None, None])[0, 0]


def per_outcome(theta, kind):
    """k(a) for every outcome a, the way the loop computes it: log-probs of the sampled tokens (B = 5 'samples')."""
    logits, ref_logits = theta.expand(5, 5)[:, None], REF.expand(5, 5)[:, None]   # (5, 1, V)
    lp = ppo_loss.logprobs_from_logits(logits, A[:, None])                        # (5, 1) log π(a)
    ref_lp = ppo_loss.logprobs_from_logits(ref_logits, A[:, None])                # (5, 1) log π_ref(a)
    return ppo_loss.kl_sampled(lp, ref_lp, kind)[:, 0], lp[:, 0]                  # (5,), (5,)


def test_the_two_directions_differ_here():
    assert abs(exact(THETA, REF) - exact(THETA, REF, reverse=True)) > 0.3 * exact(THETA, REF)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_estimate_kl_of_the_policy_to_the_reference(kind):
    pi = torch.softmax(THETA, -1)
    k, _ = per_outcome(THETA, kind)
    assert_close((pi * k).sum(), exact(THETA, REF), rtol=0, atol=1e-12)                # E_π[k] = KL(π ‖ π_ref)
    assert abs((pi * k).sum() - exact(THETA, REF, reverse=True)) > 0.3                 # and not the reverse


def test_k3_reversed_ratio_is_caught():
    """The slip of using π/π_ref inside k3: its expectation under π is not KL(π ‖ π_ref)."""
    pi = torch.softmax(THETA, -1)
    _, lp = per_outcome(THETA, "k1")
    ref_lp = torch.log_softmax(REF, -1)
    slip = torch.expm1(lp - ref_lp) - (lp - ref_lp)                                    # (π/π_ref − 1) − log(π/π_ref)
    assert abs((pi * slip).sum() - exact(THETA, REF)) > 0.5


def test_k2_is_symmetric_so_its_direction_is_that_of_the_samples():
    k, lp = per_outcome(THETA, "k2")
    ref_lp = torch.log_softmax(REF, -1)
    assert_close(ppo_loss.kl_sampled(ref_lp[None], lp[None], "k2")[0], k, rtol=0, atol=0)
    pi = torch.softmax(THETA, -1)
    assert (pi * k).sum() > 0


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_monte_carlo_with_torch_distributions_agrees(kind):
    """Samples of torch.distributions.Categorical(π): the sample mean of k is within 4 standard errors of the KL."""
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(torch.softmax(THETA, -1), 200_000, replacement=True, generator=g)
    dist = torch.distributions.Categorical(logits=THETA)
    ref = torch.distributions.Categorical(logits=REF)
    lr = dist.log_prob(a) - ref.log_prob(a)
    k = lr if kind == "k1" else torch.expm1(-lr) + lr
    assert abs(k.mean() - torch.distributions.kl_divergence(dist, ref)) < 4 * k.std() / len(k) ** 0.5


def test_k1_in_the_reward_gives_the_exact_kl_gradient():
    """Eq. 19's penalty is a reward: the policy gradient E_π[k1(a) ∇log π(a)], with k1 a constant (no grad)."""
    theta = THETA.clone().requires_grad_(True)
    k, lp = per_outcome(theta, "k1")
    pi = torch.softmax(theta, -1).detach()
    (grad,) = torch.autograd.grad((pi * k.detach() * lp).sum(), theta)                 # REINFORCE with reward k1
    (want,) = torch.autograd.grad(exact(theta, REF), theta)
    assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind,target", [("k2", "forward"), ("k3", "reverse"), ("k1", "zero")])
def test_kl_in_the_loss_gradient_of_each_estimator(kind, target):
    """--kl-in loss: ∇ of E_{a~π_old}[k(a)] with the samples fixed, at π_old = π (the first minibatch)."""
    theta = THETA.clone().requires_grad_(True)
    k, _ = per_outcome(theta, kind)
    pi = torch.softmax(theta, -1).detach()                                             # the sampling distribution
    (grad,) = torch.autograd.grad((pi * k).sum(), theta)
    if target == "zero":
        assert_close(grad, torch.zeros(5, dtype=F64), rtol=0, atol=1e-12)
        return
    (want,) = torch.autograd.grad(exact(theta, REF, reverse=target == "reverse"), theta)
    assert_close(grad, want, rtol=0, atol=1e-12)
    (forward,) = torch.autograd.grad(exact(theta, REF), theta)
    assert (target == "forward") == torch.allclose(grad, forward)


def test_the_loops_kl_term_is_the_estimator_of_the_sampled_tokens():
    """ppo_max.sampled_kl (what make_experience and the --kl-in loss term call) is kl_sampled with the same
    arguments, in the same order: log π first, log π_ref second."""
    k, lp = per_outcome(THETA, "k3")
    ref_lp = torch.log_softmax(REF, -1)
    cfg = ppo_max.PPOConfig(kl_estimator="k3")
    assert_close(ppo_max.sampled_kl(lp[None], ref_lp[None], cfg)[0], k, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["k3", "k2"])
def test_kl_in_the_loss_lowers_the_kl_to_the_reference_in_one_update(kind):
    """ppo_update with the KL term alone on (advantages 0, so PPO-clip has no gradient; no critic, no ptx, no entropy
    bonus): one optimizer step on η·KL_t must bring π_θ closer to π_SFT, both by the exact KL at the sampled positions
    and by the estimator itself. The term enters the loss with a + sign; with a − it would push π_θ away."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plumbing import models
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    ref = models.disable_dropout(LlamaForCausalLM(config)).eval()
    policy = models.disable_dropout(LlamaForCausalLM(config))      # another init: KL(π ‖ π_SFT) > 0
    cfg = ppo_max.PPOConfig(advantage="grpo", group_size=4, kl_in="loss", kl_estimator=kind, rollout_batch=8,
                            minibatch=8, ppo_epochs=1, max_new_tokens=6, ptx_coef=0.0, entropy_coef=0.0)
    query = torch.tensor([[1, 5, 6], [1, 7, 8]]).repeat_interleave(4, 0)       # (8, 3)
    query_mask = torch.ones_like(query, dtype=torch.float)
    torch.manual_seed(1)
    response, mask, _ = ppo_max.rollout(policy.eval(), query, query_mask, 6, 2, 0)

    @torch.no_grad()
    def kl_to_ref():
        """(exact KL, the estimator's KL) per response token, and the two log-probs of the sampled tokens."""
        logits = ppo_max.policy_logits(policy, query, query_mask, response, mask)     # (B, T, V)
        ref_logits = ppo_max.policy_logits(ref, query, query_mask, response, mask)   # (B, T, V)
        lp = ppo_loss.logprobs_from_logits(logits, response)
        ref_lp = ppo_loss.logprobs_from_logits(ref_logits, response)
        return (ppo_loss.masked_mean(ppo_loss.kl_full(logits, ref_logits), mask).item(),
                ppo_loss.masked_mean(ppo_loss.kl_sampled(lp, ref_lp, kind), mask).item(), lp, ref_lp)

    exact_before, sampled_before, logprobs, ref_logprobs = kl_to_ref()
    exp = {"query": query, "query_mask": query_mask, "response": response, "mask": mask, "logprobs": logprobs,
           "ref_logprobs": ref_logprobs, "advantages": torch.zeros_like(mask), "scores": torch.zeros(8),
           "kl_coef": 1.0}
    policy.train()
    upd = ppo_max.ppo_update(policy, None, torch.optim.SGD(policy.parameters(), lr=0.5), None, exp, cfg, None)
    assert upd["loss/pg"] == 0.0 and upd["loss/ptx"] == 0.0 and upd["loss/kl"] == pytest.approx(sampled_before)
    exact_after, sampled_after, _, _ = kl_to_ref()
    assert sampled_after < 0.8 * sampled_before, (sampled_before, sampled_after)
    assert exact_after < 0.97 * exact_before, (exact_before, exact_after)


# ----------------------------------------------------------------------------------------------------
# The KL matrix: every --kl-estimator × --kl-in on a policy over sequences, by exact enumeration
# ----------------------------------------------------------------------------------------------------
# π(y1, y2) = softmax(θ1)[y1] · softmax(θ2[y1])[y2] over V = 3: the 9 sequences of two tokens are every outcome, so an
# expectation under π is an exact sum. π_SFT has the logits φ1, φ2. The gradients are over the 12 logits (θ1, θ2).
TH1 = torch.tensor([1.0, -0.5, 0.3], dtype=F64)
TH2 = torch.tensor([[0.2, 1.1, -0.7], [-1.0, 0.4, 0.9], [0.5, -0.3, 0.0]], dtype=F64)
PH1 = torch.tensor([-0.2, 0.6, 0.1], dtype=F64)
PH2 = torch.tensor([[0.9, -0.4, 0.2], [0.3, 0.3, -1.2], [-0.6, 1.0, 0.4]], dtype=F64)
Y = torch.tensor(list(itertools.product(range(3), repeat=2)))                       # (9, 2) every sequence
ONES = torch.ones(9, 2, dtype=F64)                                                  # every token is real


def sequence_probs(t1, t2):
    """π(y) for the 9 sequences, a product of the two softmaxes (no project code), (9,)."""
    return torch.stack([torch.softmax(t1, -1)[a] * torch.softmax(t2[a], -1)[b] for a, b in Y.tolist()])


def gradient(f):
    """∇ of f(θ1, θ2) over the 12 logits, by autograd."""
    t1, t2 = TH1.clone().requires_grad_(True), TH2.clone().requires_grad_(True)
    return torch.cat([g.flatten() for g in torch.autograd.grad(f(t1, t2), (t1, t2))])


def forward_kl(t1, t2):
    """KL(π ‖ π_SFT) = Σ_y π(y) log(π(y)/π_SFT(y)), enumerated."""
    p, q = sequence_probs(t1, t2), sequence_probs(PH1, PH2)
    return (p * (p / q).log()).sum()


def reverse_kl(t1, t2):
    p, q = sequence_probs(t1, t2), sequence_probs(PH1, PH2)
    return (q * (q / p).log()).sum()


def per_token_kl_states_fixed(t1, t2, reverse):
    """Σ_t E_{s_t ~ π}[KL_t] with the state distribution held fixed (detached): KL at the first position plus the
    π(y1)-weighted KL of the second position's distributions (torch.distributions.kl_divergence)."""
    def kl(a, b):
        a, b = Categorical(logits=a), Categorical(logits=b)
        return kl_divergence(b, a) if reverse else kl_divergence(a, b)
    p1 = torch.softmax(t1, -1).detach()
    return kl(t1, PH1) + sum(p1[a] * kl(t2[a], PH2[a]) for a in range(3))


EXACT_GRADIENTS = {
    "∇KL(π‖π_SFT)": lambda: gradient(forward_kl),
    "∇KL(π_SFT‖π)": lambda: gradient(reverse_kl),
    "per-token ∇KL(π‖π_SFT), states fixed": lambda: gradient(lambda a, b: per_token_kl_states_fixed(a, b, False)),
    "per-token ∇KL(π_SFT‖π), states fixed": lambda: gradient(lambda a, b: per_token_kl_states_fixed(a, b, True)),
    "∇KL(π‖π_SFT) − per-token ∇KL(π_SFT‖π), states fixed":
        lambda: gradient(forward_kl) - gradient(lambda a, b: per_token_kl_states_fixed(a, b, True)),
    "0": lambda: torch.zeros(12, dtype=F64),
}


def token_terms(t1, t2, kind):
    """The loop's per-token quantities on the 9 sequences: log π(y_t), log π_SFT(y_t) and k_t, each (9, 2)."""
    logits = torch.stack([t1.expand(9, 3), t2[Y[:, 0]]], 1)                         # (9, 2, V)
    ref_logits = torch.stack([PH1.expand(9, 3), PH2[Y[:, 0]]], 1)                   # (9, 2, V)
    lp = ppo_loss.logprobs_from_logits(logits, Y)
    ref_lp = ppo_loss.logprobs_from_logits(ref_logits, Y)
    return lp, ref_lp, ppo_loss.kl_sampled(lp, ref_lp, kind)


def expected_gradient(kind, kl_in, whole_sequence=False):
    """The exact expected gradient of the KL term at π_old = π (the first minibatch), as a loss to descend.

    reward: Eq. 19's rewards r_t = −η k_t (η = 1, score 0; ppo_max.shape_rewards) enter the policy gradient as a
            reward: E_π[Σ_t (−G_t) ∇log π(y_t|s_t)] with G_t the reward-to-go (critic_free.discounted_returns, γ = 1),
            or, whole_sequence, every token's return Σ_s r_s as the group estimators give it (GRPO, RLOO).
    loss:   the term η·Σ_t k_t added to the loss, differentiated with the sampled tokens fixed: E_π[Σ_t ∇k_t]. (The
            loop's token-mean divides it by T = 2 here: the same direction.)"""
    def surrogate(t1, t2):
        lp, ref_lp, k = token_terms(t1, t2, kind)
        pi = lp.sum(1).exp().detach()                                               # π(y), the sampling weights
        if kl_in == "loss":
            return (pi[:, None] * k).sum()
        rewards = ppo_max.shape_rewards(torch.zeros(9, dtype=F64), lp, ref_lp, ONES, 1.0, kl=k)   # −k_t   (Eq. 19)
        G = rewards.sum(1, keepdim=True).expand(9, 2) if whole_sequence else \
            critic_free.discounted_returns(rewards, ONES, 1.0)
        return (pi[:, None] * (-G).detach() * lp).sum()                             # −E[Σ_t G_t ∇log π(y_t|s_t)]
    return gradient(surrogate)


def kl_matrix_table():
    """The rows of docs/methods.md's KL-matrix table: (estimator, kl-in) → the cells after those two."""
    text = (ROOT / "docs" / "methods.md").read_text().split("## The KL matrix")[1].split("\n## ")[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in ("k1", "k2", "k3"):
            rows[cells[0], cells[1]] = cells[2:]
    return rows


# estimator, --kl-in → the exact gradient its expected gradient equals, or None where it equals none of them
KL_MATRIX = {("k1", "reward"): "∇KL(π‖π_SFT)", ("k2", "reward"): None,
             ("k3", "reward"): "∇KL(π‖π_SFT) − per-token ∇KL(π_SFT‖π), states fixed",
             ("k1", "loss"): "0", ("k2", "loss"): "per-token ∇KL(π‖π_SFT), states fixed",
             ("k3", "loss"): "per-token ∇KL(π_SFT‖π), states fixed"}


@pytest.mark.parametrize("kind,kl_in", list(KL_MATRIX))
def test_kl_matrix_expected_gradient_of_each_estimator_and_placement(kind, kl_in):
    """Each cell of docs/methods.md's table: which exact gradient the expected gradient equals (to 1e-12), and its
    distance from ∇KL(π‖π_SFT) (relative, over all logits, θ1's and θ2's) and cosine with it, as printed there."""
    g = expected_gradient(kind, kl_in)
    exact = {name: f() for name, f in EXACT_GRADIENTS.items()}
    equal = [name for name, e in exact.items() if torch.allclose(g, e, rtol=0, atol=1e-12)]
    assert equal == ([KL_MATRIX[kind, kl_in]] if KL_MATRIX[kind, kl_in] else []), equal
    want = exact["∇KL(π‖π_SFT)"]
    rel = lambda s: ((g[s] - want[s]).norm() / want[s].norm()).item()
    cos = "—" if g.norm() < 1e-12 else f"{(g @ want / (g.norm() * want.norm())).item():.4f}"
    row = kl_matrix_table()[kind, kl_in]
    assert row[0] == (KL_MATRIX[kind, kl_in] or "none of them"), row
    assert row[1:5] == [f"{rel(slice(None)):.4f}", f"{rel(slice(0, 3)):.4f}", f"{rel(slice(3, None)):.4f}", cos], row
    assert row[5] == ("yes" if KL_MATRIX[kind, kl_in] == "∇KL(π‖π_SFT)" else "no"), row


def test_kl_matrix_reward_and_loss_halves_add_up_to_the_kl_gradient_for_the_unbiased_estimators():
    """Why k3 in the reward fails: for an estimator whose value is unbiased (k1, k3), ∇E_π[Σ_t k_t] = ∇KL splits into
    the reward half (score function) and the loss half (pathwise). k1's loss half is 0, so its reward half is all of
    ∇KL; k3's loss half is not, so its reward half misses it. k2's value is biased: its halves add up to ∇E_π[Σ_t k2_t],
    not to ∇KL."""
    want = gradient(forward_kl)
    for kind in ("k1", "k3"):
        assert_close(expected_gradient(kind, "reward") + expected_gradient(kind, "loss"), want, rtol=0, atol=1e-12)
    def expected_k2(t1, t2):
        lp, _, k = token_terms(t1, t2, "k2")
        return (lp.sum(1).exp()[:, None] * k).sum()                                 # E_π[Σ_t k2_t], π not detached
    both = expected_gradient("k2", "reward") + expected_gradient("k2", "loss")
    assert_close(both, gradient(expected_k2), rtol=0, atol=1e-12)
    assert (both - want).norm() > 0.1 * want.norm()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matrix_reward_to_go_and_the_whole_return_give_the_same_expected_gradient(kind):
    """GAE / REINFORCE++ weigh log π(y_t) by the reward-to-go, GRPO / RLOO by the whole return: the earlier rewards
    add 0 in expectation, so the expected gradients are equal for every estimator."""
    assert_close(expected_gradient(kind, "reward", whole_sequence=True), expected_gradient(kind, "reward"),
                 rtol=0, atol=1e-12)


def test_kl_matrix_k2_of_the_sequence_log_ratio_in_the_loss_follows_the_kl():
    """What would follow ∇KL(π‖π_SFT) in the loss: ½(Σ_t log r_t)², k2 of the whole sequence's log-ratio (its gradient
    (Σ_t log r_t) Σ_t ∇log π(y_t) is k1 in the reward with the whole return), not Σ_t ½(log r_t)²."""
    def surrogate(t1, t2):
        lp, ref_lp, _ = token_terms(t1, t2, "k1")
        return (lp.sum(1).exp().detach() * 0.5 * (lp - ref_lp).sum(1) ** 2).sum()
    assert_close(gradient(surrogate), gradient(forward_kl), rtol=0, atol=1e-12)


def test_kl_matrix_policy_is_far_enough_from_the_reference_to_tell_the_gradients_apart():
    """The enumeration is a distribution; the two directions' gradients, and the state-fixed one, differ here."""
    assert sequence_probs(TH1, TH2).sum().item() == pytest.approx(1.0, abs=1e-15)
    fwd, rev = gradient(forward_kl), gradient(reverse_kl)
    fixed = gradient(lambda a, b: per_token_kl_states_fixed(a, b, False))
    assert (rev - fwd).norm() > 0.5 * fwd.norm() and (fixed - fwd).norm() > 0.05 * fwd.norm()
    assert_close(fixed[3:], fwd[3:], rtol=0, atol=1e-12)   # the last position's logits: the states are all there is
