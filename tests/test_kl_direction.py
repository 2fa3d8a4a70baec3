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
"""
import pytest
import torch
from torch.testing import assert_close

import ppo_loss
import ppo_max

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
