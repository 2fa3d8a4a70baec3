"""Tests for gae.py: GAE and the k-step estimates (Eq. 7–11), each against an independent python-loop computation."""

import pytest
import torch

import gae

ATOL = RTOL = 1e-12  # float64 throughout


def ragged_batch(seed: int = 0, B: int = 5, T: int = 7):
    """Random float64 rewards/values and a right-padded mask with lengths 1 … T (one row full, one of length 1).

    Padded positions hold large junk so that any leak of padding into the result is visible.
    """
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [T, 1] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e3))
    values = torch.where(mask.bool(), values, torch.full_like(values, -1e3))
    return rewards, values, mask, lengths


def td_errors(r: list[float], v: list[float], gamma: float) -> list[float]:
    """δ_t = r_t + γ V(s_{t+1}) − V(s_t) for one episode of python floats, V after the end = 0."""
    n = len(r)
    return [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]


def rows(rewards, values, lengths, b):
    n = lengths[b]
    return rewards[b, :n].tolist(), values[b, :n].tolist()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.9), (0.9, 0.5), (0.99, 0.95), (0.7, 1.0), (0.8, 0.0)])
def test_compute_gae_eq9_equals_explicit_double_sum(gamma, lam):
    rewards, values, mask, lengths = ragged_batch(seed=1)
    adv, ret = gae.compute_gae(rewards, values, mask, gamma, lam)
    expected_adv = torch.zeros_like(adv)
    for b in range(len(lengths)):
        r, v = rows(rewards, values, lengths, b)
        n = len(r)
        delta = td_errors(r, v, gamma)
        for t in range(n):
            expected_adv[b, t] = sum((gamma * lam) ** l * delta[t + l] for l in range(n - t))  # Eq. 9
    torch.testing.assert_close(adv, expected_adv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret, (expected_adv + values) * mask, atol=ATOL, rtol=RTOL)


def test_compute_gae_eq10_lambda0_is_td_error():
    gamma = 0.9
    rewards, values, mask, lengths = ragged_batch(seed=2)
    adv, _ = gae.compute_gae(rewards, values, mask, gamma, 0.0)
    expected = torch.zeros_like(adv)
    for b in range(len(lengths)):
        r, v = rows(rewards, values, lengths, b)
        expected[b, : len(r)] = torch.tensor(td_errors(r, v, gamma), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=RTOL)


def test_compute_gae_eq11_lambda1_is_discounted_return_minus_value():
    gamma = 0.95
    rewards, values, mask, lengths = ragged_batch(seed=3)
    adv, ret = gae.compute_gae(rewards, values, mask, gamma, 1.0)
    expected_ret = torch.zeros_like(adv)
    for b in range(len(lengths)):
        r, _ = rows(rewards, values, lengths, b)
        for t in range(len(r)):
            expected_ret[b, t] = sum(gamma**l * r[t + l] for l in range(len(r) - t))  # Σ_l γ^l r_{t+l}
    torch.testing.assert_close(adv, (expected_ret - values) * mask, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret, expected_ret, atol=ATOL, rtol=RTOL)  # λ=1: the returns are Monte Carlo


@pytest.mark.parametrize("k", [1, 2, 3, 7, 10])
def test_k_step_return_eq7_equals_explicit_sum(k):
    gamma = 0.9
    rewards, values, mask, lengths = ragged_batch(seed=4)
    got = gae.k_step_return(rewards, values, mask, gamma, k)
    expected = torch.zeros_like(got)
    for b in range(len(lengths)):
        r, v = rows(rewards, values, lengths, b)
        n = len(r)
        for t in range(n):
            total = sum(gamma**l * r[t + l] for l in range(k) if t + l < n)
            total += gamma**k * (v[t + k] if t + k < n else 0.0)  # V = 0 at and beyond the terminal state
            expected[b, t] = total
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 10])
def test_k_step_advantage_eq8_sum_of_td_errors_equals_return_minus_value(k):
    gamma = 0.8
    rewards, values, mask, lengths = ragged_batch(seed=5)
    got = gae.k_step_advantage(rewards, values, mask, gamma, k)
    expected = torch.zeros_like(got)
    for b in range(len(lengths)):
        r, v = rows(rewards, values, lengths, b)
        n = len(r)
        delta = td_errors(r, v, gamma)
        for t in range(n):
            expected[b, t] = sum(gamma**l * delta[t + l] for l in range(k) if t + l < n)  # Σ_{l<k} γ^l δ_{t+l}
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # and Âᵏ_t = R̂ᵏ_t − V(s_t) (Eq. 8, the telescoped form)
    torch.testing.assert_close(
        got, (gae.k_step_return(rewards, values, mask, gamma, k) - values) * mask, atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.9), (0.9, 0.5), (0.95, 0.0), (0.9, 1.0)])
def test_compute_gae_is_exponential_average_of_k_step_advantages(gamma, lam):
    """Â_t = (1−λ) Σ_{k≥1} λ^{k−1} Âᵏ_t. For an episode with n_t = n − t steps left, Âᵏ_t = Âⁿᵗ_t for every
    k ≥ n_t, so the infinite tail (1−λ) Σ_{k≥n_t} λ^{k−1} = λ^{n_t−1} goes to the full-return advantage."""
    rewards, values, mask, lengths = ragged_batch(seed=6)
    T = mask.shape[1]
    k_adv = {k: gae.k_step_advantage(rewards, values, mask, gamma, k) for k in range(1, T + 1)}
    expected = torch.zeros_like(mask)
    for b in range(len(lengths)):
        n = lengths[b]
        for t in range(n):
            left = n - t
            total = sum((1 - lam) * lam ** (k - 1) * k_adv[k][b, t].item() for k in range(1, left))
            total += lam ** (left - 1) * k_adv[left][b, t].item()  # tail weight → full-return advantage
            expected[b, t] = total
    adv, _ = gae.compute_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, expected, atol=1e-10, rtol=1e-10)


def nonfinite_padding(seed: int):
    """ragged_batch with NaN rewards and ±inf values at every padded position, and the same batch with zeros there."""
    rewards, values, mask, lengths = ragged_batch(seed=seed)
    pad = mask == 0
    assert pad.any()
    clean = (rewards.masked_fill(pad, 0.0), values.masked_fill(pad, 0.0))
    values = values.masked_fill(pad, float("inf"))
    b, t = pad.nonzero()[0].tolist()
    values[b, t] = float("-inf")  # one −inf among the +inf
    return rewards.masked_fill(pad, float("nan")), values, clean, mask


def assert_padding_ignored(fn, seed: int):
    """The module docstring's promise: every output is 0 where mask is 0, and whatever sits in rewards / values
    at padded positions (±1e3 junk, NaN, ±inf) never reaches a real position."""
    rewards, values, mask, _ = ragged_batch(seed=seed)  # padding holds ±1e3 junk
    pad = mask == 0
    out = fn(rewards, values, mask)
    assert (out[pad] == 0).all(), f"expected 0 at every padded position, got {out[pad].tolist()}"
    assert out.abs().max() < 100, f"junk (±1e3) at padded positions leaked into real ones: max |out| {out.abs().max()}"
    nan_rewards, inf_values, (r0, v0), mask = nonfinite_padding(seed)
    got = fn(nan_rewards, inf_values, mask)
    assert torch.isfinite(got).all(), f"NaN / inf at padded positions leaked: expected finite, got {got.tolist()}"
    torch.testing.assert_close(got, fn(r0, v0, mask), atol=0, rtol=0)


def test_compute_gae_outputs_zero_after_mask_and_ignores_padding_values():
    assert_padding_ignored(lambda r, v, m: gae.compute_gae(r, v, m, 0.9, 0.9)[0], seed=7)
    assert_padding_ignored(lambda r, v, m: gae.compute_gae(r, v, m, 0.9, 0.9)[1], seed=7)


def test_k_step_return_outputs_zero_after_mask_and_ignores_padding_values():
    for k in (1, 3):
        assert_padding_ignored(lambda r, v, m: gae.k_step_return(r, v, m, 0.9, k), seed=7)


def test_k_step_advantage_outputs_zero_after_mask_and_ignores_padding_values():
    for k in (1, 3):
        assert_padding_ignored(lambda r, v, m: gae.k_step_advantage(r, v, m, 0.9, k), seed=7)


def test_compute_gae_padding_does_not_change_result():
    """The same episodes, padded to a longer T, give the same numbers on the real tokens."""
    rewards, values, mask, _ = ragged_batch(seed=8)
    extra = torch.zeros(mask.shape[0], 3, dtype=torch.float64)
    adv, ret = gae.compute_gae(rewards, values, mask, 0.95, 0.9)
    adv2, ret2 = gae.compute_gae(
        torch.cat([rewards, extra + 5], 1), torch.cat([values, extra - 5], 1), torch.cat([mask, extra], 1), 0.95, 0.9
    )
    torch.testing.assert_close(adv2[:, : mask.shape[1]], adv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret2[:, : mask.shape[1]], ret, atol=ATOL, rtol=RTOL)


def worked_example():
    """The inputs of `python gae.py`'s worked example: one 3-token response, padded to T = 4 (its 9.0 is ignored)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    return rewards, values, mask


def f64(xs):
    return torch.tensor([xs], dtype=torch.float64)


def test_compute_gae_worked_example_numbers():
    """The numbers printed by `python gae.py` and pasted at the bottom of the file (γ = 0.9, λ = 0.5)."""
    rewards, values, mask = worked_example()
    adv, ret = gae.compute_gae(rewards, values, mask, 0.9, 0.5)
    torch.testing.assert_close(adv, f64([0.11425, 0.165, 0.3, 0.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, f64([0.61425, 0.765, 1.0, 0.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(gae.compute_gae(rewards, values, mask, 0.9, 0.0)[0], f64([0.04, 0.03, 0.3, 0.0]),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(gae.compute_gae(rewards, values, mask, 0.9, 1.0)[0], f64([0.31, 0.3, 0.3, 0.0]),
                               atol=1e-12, rtol=0)


def test_decoupled_lambda_worked_example_numbers():
    """`python gae.py`'s last line: the value targets with λ_critic = 1 are the discounted returns (γ = 0.9)."""
    rewards, values, mask = worked_example()
    torch.testing.assert_close(gae.compute_gae_decoupled(rewards, values, mask, 0.9, 0.5, 1.0)[1],
                               f64([0.81, 0.9, 1.0, 0.0]), atol=1e-12, rtol=0)


def test_k_step_advantage_worked_example_numbers():
    rewards, values, mask = worked_example()
    for k, expected in [(1, [0.04, 0.03, 0.3, 0.0]), (2, [0.067, 0.3, 0.3, 0.0]), (3, [0.31, 0.3, 0.3, 0.0])]:
        torch.testing.assert_close(gae.k_step_advantage(rewards, values, mask, 0.9, k), f64(expected),
                                   atol=1e-12, rtol=0)


def test_k_step_return_worked_example_numbers():
    rewards, values, mask = worked_example()
    # by hand, k = 2: R̂²_0 = 0 + 0.9·0 + 0.81·0.7 = 0.567;  R̂²_1 = 0 + 0.9·1 + 0.81·0 = 0.9;  R̂²_2 = 1
    torch.testing.assert_close(gae.k_step_return(rewards, values, mask, 0.9, 2), f64([0.567, 0.9, 1.0, 0.0]),
                               atol=1e-12, rtol=0)


def test_compute_gae_float32_matches_float64():
    rewards, values, mask, _ = ragged_batch(seed=9)
    adv64, ret64 = gae.compute_gae(rewards, values, mask, 0.99, 0.9)
    adv32, ret32 = gae.compute_gae(rewards.float(), values.float(), mask.float(), 0.99, 0.9)
    assert adv32.dtype == torch.float32, f"float32 inputs: expected float32 advantages, got {adv32.dtype}"
    torch.testing.assert_close(adv32.double(), adv64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret32.double(), ret64, atol=1e-4, rtol=1e-4)


def test_compute_gae_rejects_bad_shapes_and_masks():
    rewards, values, mask, _ = ragged_batch(seed=10)
    with pytest.raises(ValueError, match="same shape"):
        gae.compute_gae(rewards, values[:, :-1], mask, 0.9, 0.9)
    with pytest.raises(ValueError, match="same shape"):
        gae.compute_gae(rewards[0], values[0], mask[0], 0.9, 0.9)
    with pytest.raises(ValueError, match="contiguous"):
        gae.compute_gae(rewards, values, mask.flip(1), 0.9, 0.9)  # left-padded
    with pytest.raises(ValueError, match="only 0.0 and 1.0"):
        gae.compute_gae(rewards, values, 0.5 * mask, 0.9, 0.9)


def check_k_step_rejects_bad_inputs(fn):
    rewards, values, mask, _ = ragged_batch(seed=10)
    with pytest.raises(ValueError, match="k >= 1"):
        getattr(gae, fn)(rewards, values, mask, 0.9, 0)
    with pytest.raises(ValueError, match="same shape"):
        getattr(gae, fn)(rewards, values[:, :-1], mask, 0.9, 2)
    with pytest.raises(ValueError, match="contiguous"):
        getattr(gae, fn)(rewards, values, mask.flip(1), 0.9, 2)


def test_k_step_return_rejects_bad_inputs():
    check_k_step_rejects_bad_inputs("k_step_return")


def test_k_step_advantage_rejects_bad_inputs():
    check_k_step_rejects_bad_inputs("k_step_advantage")


# ----------------------------------------------------------------------------------------------------
# Since the paper: per-row λ, decoupled λ (VC-PPO), length-adaptive λ (VAPO)
# ----------------------------------------------------------------------------------------------------

def test_per_row_lambda_eq9_equals_explicit_double_sum():
    """A (B,) tensor λ: row b is Eq. 9 with its own λ_b (a python double sum per row)."""
    gamma = 0.95
    rewards, values, mask, lengths = ragged_batch(seed=11)
    lam = torch.tensor([0.0, 1.0, 0.5, 0.9, 0.7], dtype=torch.float64)
    adv, ret = gae.compute_gae(rewards, values, mask, gamma, lam)
    expected_adv = torch.zeros_like(adv)
    for b in range(len(lengths)):
        r, v = rows(rewards, values, lengths, b)
        delta = td_errors(r, v, gamma)
        for t in range(len(r)):
            expected_adv[b, t] = sum((gamma * lam[b].item()) ** l * delta[t + l] for l in range(len(r) - t))
    torch.testing.assert_close(adv, expected_adv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret, (expected_adv + values) * mask, atol=ATOL, rtol=RTOL)


def test_per_row_lambda_all_equal_is_bitwise_the_scalar_path():
    rewards, values, mask, _ = ragged_batch(seed=12)
    adv, ret = gae.compute_gae(rewards, values, mask, 0.99, 0.9)
    adv_t, ret_t = gae.compute_gae(rewards, values, mask, 0.99, torch.full((5,), 0.9, dtype=torch.float64))
    assert torch.equal(adv, adv_t) and torch.equal(ret, ret_t)


def test_per_row_lambda_rejects_a_tensor_of_the_wrong_shape_or_range():
    rewards, values, mask, _ = ragged_batch(seed=13)
    for lam in (torch.full((4,), 0.9), torch.full((5, 1), 0.9), torch.tensor([0.9, 0.9, 1.2, 0.9, 0.9])):
        with pytest.raises(ValueError, match="tensor lam"):
            gae.compute_gae(rewards, values, mask, 0.9, lam)


def test_decoupled_lambda_critic_one_gives_monte_carlo_returns():
    """VC-PPO: the advantages are those of λ_policy, the value targets with λ_critic = 1 are Σ_l γ^l r_{t+l} (a loop),
    whatever the critic's values; λ_policy = λ_critic gives compute_gae's pair bitwise."""
    gamma = 0.9
    rewards, values, mask, lengths = ragged_batch(seed=14)
    adv, ret = gae.compute_gae_decoupled(rewards, values, mask, gamma, 0.6, 1.0)
    assert torch.equal(adv, gae.compute_gae(rewards, values, mask, gamma, 0.6)[0])
    expected_ret = torch.zeros_like(ret)
    for b in range(len(lengths)):
        r, _ = rows(rewards, values, lengths, b)
        for t in range(len(r)):
            expected_ret[b, t] = sum(gamma**l * r[t + l] for l in range(len(r) - t))  # Eq. 11
    torch.testing.assert_close(ret, expected_ret, atol=ATOL, rtol=RTOL)
    other_values = torch.where(mask != 0, values + 3.0, values)
    torch.testing.assert_close(gae.compute_gae_decoupled(rewards, other_values, mask, gamma, 0.6, 1.0)[1], ret,
                               atol=ATOL, rtol=RTOL)
    same = gae.compute_gae_decoupled(rewards, values, mask, gamma, 0.9, 0.9)
    want = gae.compute_gae(rewards, values, mask, gamma, 0.9)
    assert torch.equal(same[0], want[0]) and torch.equal(same[1], want[1])


def test_adaptive_lam_vapo_formula_by_hand():
    """λ = 1 − 1/(α·l): α = 0.05 gives 0.8 at l = 100, 0.95 at l = 400, 0 at l = 20; below 1/α and at l = 0, 0."""
    lam = gae.adaptive_lam(torch.tensor([100, 400, 20, 10, 0]), 0.05)
    torch.testing.assert_close(lam, torch.tensor([0.8, 0.95, 0.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    assert gae.adaptive_lam(torch.tensor([9]), 1.0).item() == pytest.approx(8 / 9)
    with pytest.raises(ValueError, match="alpha"):
        gae.adaptive_lam(torch.tensor([9]), 0.0)
