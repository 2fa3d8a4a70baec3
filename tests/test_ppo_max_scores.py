"""Tests for the score half of ppo_max.py: RunningMoments, Eq. 18 (normalize + clip), reward scaling, Eq. 19.

Each is checked against an independent computation: numpy over the whole history, hand arithmetic, python loops.
"""

import math

import numpy as np
import pytest
import torch

import ppo_max
from ppo_max import RunningMoments


def assert_moments(m: RunningMoments, count: int, mean: float, std: float, rel: float, what: str) -> None:
    """count, mean and population std of `m`, each with an "expected …, got …" message."""
    mean, std = float(mean), float(std)
    assert m.count == count, f"{what}: expected count {count}, got {m.count}"
    assert math.isclose(m.mean, mean, rel_tol=rel, abs_tol=rel), f"{what}: expected mean {mean!r}, got {m.mean!r}"
    assert math.isclose(m.std, std, rel_tol=rel, abs_tol=rel), f"{what}: expected std {std!r}, got {m.std!r}"


def history_batches(seed: int = 0):
    """Batches of different sizes (one of size 1, one 2-D) and scales, float64."""
    g = torch.Generator().manual_seed(seed)
    return [
        3.0 + 2.0 * torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(1, generator=g, dtype=torch.float64),
        -1.0 + 0.5 * torch.randn(4, 3, generator=g, dtype=torch.float64),
        10.0 * torch.randn(40, generator=g, dtype=torch.float64),
        torch.randn(2, generator=g, dtype=torch.float64),
    ]


# ------------------------------------------------------------------------------------- RunningMoments


def test_running_moments_update_initial_state_and_empty_batch():
    m = RunningMoments()
    assert (m.count, m.mean, m.std) == (0, 0.0, 1.0)
    m.update(torch.empty(0))  # an empty batch changes nothing
    assert_moments(m, 0, 0.0, 1.0, 0.0, "after an empty batch")


def test_running_moments_update_matches_numpy_over_concatenated_history():
    m = RunningMoments()
    seen = []
    for k, batch in enumerate(history_batches()):
        m.update(batch)
        seen.extend(batch.flatten().tolist())
        history = np.array(seen, dtype=np.float64)
        assert_moments(m, history.size, history.mean(), history.std(ddof=0), 1e-12,  # population std (ddof = 0)
                       f"after batch {k + 1} of shape {tuple(batch.shape)}, over the whole history")


def test_running_moments_update_single_batch_equals_batch_moments():
    x = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
    m = RunningMoments()
    m.update(x)
    # by hand: mean = 14/4 = 3.5; deviations −2.5, −1.5, 0.5, 3.5 → Σ² = 6.25+2.25+0.25+12.25 = 21; var = 21/4
    assert_moments(m, 4, 3.5, math.sqrt(21 / 4), 1e-15, "one batch [1, 2, 4, 7]")


def test_running_moments_update_float32_input_accumulates_in_float64():
    batches = history_batches(seed=1)
    m = RunningMoments()
    for b in batches:
        m.update(b.float())
    history = np.concatenate([b.float().double().flatten().numpy() for b in batches])
    assert_moments(m, history.size, history.mean(), history.std(), 1e-12, "float32 batches, moments in float64")


def test_running_moments_state_dict_round_trip():
    m = RunningMoments()
    for b in history_batches(seed=2)[:3]:
        m.update(b)
    d = m.state_dict()
    assert all(type(v) in (int, float) for v in d.values())  # plain numbers, checkpoint-friendly
    restored = RunningMoments()
    restored.load_state_dict(d)
    assert (restored.count, restored.mean, restored.std) == (m.count, m.mean, m.std)
    # continuing from the restored state gives exactly what continuing the original gives
    nxt = history_batches(seed=3)[3]
    m.update(nxt)
    restored.update(nxt)
    assert restored.state_dict() == m.state_dict()


# ------------------------------------------------------------------------------------- Eq. 18 and scaling


def test_normalize_and_clip_rewards_eq18_within_bounds_and_hand_computed():
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    scores = torch.tensor([2.5, 5.0, -4.0, 2.7], dtype=torch.float64)
    m.update(scores)  # the recipe's order: update with this batch, then normalize
    history = [1.0, 2.0, 3.0, 2.5, 5.0, -4.0, 2.7]
    mean = sum(history) / len(history)
    std = math.sqrt(sum((h - mean) ** 2 for h in history) / len(history))
    delta = 0.8
    expected = torch.tensor([min(max((s - mean) / std, -delta), delta) for s in scores.tolist()], dtype=torch.float64)
    got = ppo_max.normalize_and_clip_rewards(scores, m, delta)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert got.min() == -delta and got.max() == delta, \
        f"both bounds bind here: expected min −{delta} and max {delta}, got {got.min().item()} and {got.max().item()}"


def test_normalize_and_clip_rewards_eq18_without_clip_is_plain_normalization():
    m = RunningMoments()
    scores = torch.tensor([0.0, 1.0, 10.0], dtype=torch.float64)
    m.update(scores)
    got = ppo_max.normalize_and_clip_rewards(scores, m, None)
    expected = (scores - scores.mean()) / scores.std(unbiased=False)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert got.abs().max() > 1.0, f"clip_delta=None clips nothing: expected |r̃| > 1 somewhere, got {got.tolist()}"


def test_normalize_and_clip_rewards_does_not_update_moments():
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    before = m.state_dict()
    ppo_max.normalize_and_clip_rewards(torch.tensor([100.0, -100.0]), m, 0.3)
    assert m.state_dict() == before, f"expected the moments unchanged {before}, got {m.state_dict()}"


def test_scale_rewards_does_not_update_moments():
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    before = m.state_dict()
    ppo_max.scale_rewards(torch.tensor([100.0, -100.0]), m)
    assert m.state_dict() == before, f"expected the moments unchanged {before}, got {m.state_dict()}"


def test_normalize_and_clip_rewards_eq18_before_any_update_is_identity_up_to_clip():
    scores = torch.tensor([-2.0, 0.1, 0.5], dtype=torch.float64)
    torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(scores, RunningMoments(), None), scores, atol=0, rtol=0)
    torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(scores, RunningMoments(), 0.3),
                               torch.tensor([-0.3, 0.1, 0.3], dtype=torch.float64), atol=0, rtol=0)


def test_normalize_and_clip_rewards_eq18_constant_history_does_not_divide_by_zero():
    m = RunningMoments()
    m.update(torch.full((4,), 2.0))
    out = ppo_max.normalize_and_clip_rewards(torch.tensor([2.0, 3.0]), m, 0.5)
    assert torch.isfinite(out).all(), f"a constant history (std 0): expected finite, got {out.tolist()}"
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5]), atol=0, rtol=0)


def test_normalize_and_clip_rewards_eq18_history_without_spread_keeps_the_scale_at_one():
    """One score, or equal ones: Eq. 18 centres (r − mean) and does not divide by ~0; a score away from that mean
    moves by its own distance, as before any update. With a spread, (r − mean)/std of the history (numpy)."""
    for first in ([2.0], [2.0, 2.0, 2.0, 2.0]):
        m = RunningMoments()
        m.update(torch.tensor(first, dtype=torch.float64))
        scores = torch.tensor([2.0, 3.0, 1.5], dtype=torch.float64)
        torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(scores, m, None), scores - 2.0, atol=0, rtol=0)
        torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(scores, m, 0.8),
                                   torch.tensor([0.0, 0.8, -0.5], dtype=torch.float64), atol=0, rtol=0)
        m.update(torch.tensor([1.0, 4.0], dtype=torch.float64))
        history = np.array(first + [1.0, 4.0])
        expected = (scores - history.mean()) / history.std()  # numpy: ddof = 0
        torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(scores, m, None), expected, atol=1e-12, rtol=0)


def test_normalize_and_clip_rewards_eq18_rejects_nonpositive_delta():
    with pytest.raises(ValueError, match="clip_delta"):
        ppo_max.normalize_and_clip_rewards(torch.zeros(2), RunningMoments(), 0.0)


def test_scale_rewards_divides_by_running_std_only():
    m = RunningMoments()
    history = [3.0, 5.0, 9.0, 11.0]  # mean 7, deviations ±4, ±2 → var = (16+4+4+16)/4 = 10
    m.update(torch.tensor(history, dtype=torch.float64))
    scores = torch.tensor([3.0, -1.0, 0.0], dtype=torch.float64)
    expected = torch.tensor([s / math.sqrt(10.0) for s in scores.tolist()], dtype=torch.float64)
    torch.testing.assert_close(ppo_max.scale_rewards(scores, m), expected, atol=1e-12, rtol=0)


def test_scale_rewards_history_without_spread_leaves_the_scores_as_they_are():
    """A first batch of one score, of equal scores, or of equal scores whose float64 mean rounds (var ~1e-34): no
    spread to scale by, so r / 1 (not r / eps = 2e8 for a score of 2.0); once a batch brings a spread, r / std of the
    whole history, as numpy computes it."""
    for first in ([2.0], [2.0, 2.0, 2.0, 2.0], [0.1, 0.1, 0.1]):
        m = RunningMoments()
        m.update(torch.tensor(first, dtype=torch.float64))
        scores = torch.tensor(first, dtype=torch.float64)
        torch.testing.assert_close(ppo_max.scale_rewards(scores, m), scores, atol=0, rtol=0,
                                   msg=lambda s: f"first batch {first} (no spread): expected r unchanged; {s}")
        m.update(torch.tensor([1.0, 4.0], dtype=torch.float64))
        history = np.array(first + [1.0, 4.0])
        expected = torch.tensor([1.0, 4.0], dtype=torch.float64) / history.std()  # numpy: ddof = 0
        torch.testing.assert_close(ppo_max.scale_rewards(torch.tensor([1.0, 4.0], dtype=torch.float64), m),
                                   expected, atol=0, rtol=1e-12)


# ------------------------------------------------------------------------------------- Eq. 19


def ragged_rollout(seed: int = 0, B: int = 5, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref_logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    kl = torch.rand(B, T, generator=g, dtype=torch.float64)
    lengths = [T, 1, 3, 2, 5][:B]
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    return scores, logprobs, ref_logprobs, kl, mask, lengths


def shape_rewards_loop(scores, logprobs, ref_logprobs, lengths, T, kl_coef, kl=None):
    """Eq. 19 by hand: r_t = −η·KL_t for t < n, plus the score at t = n − 1; 0 for t ≥ n."""
    out = []
    for b, n in enumerate(lengths):
        row = []
        for t in range(T):
            if t >= n:
                row.append(0.0)
                continue
            kl_t = kl[b][t] if kl is not None else logprobs[b][t] - ref_logprobs[b][t]
            r = -kl_coef * kl_t
            if t == n - 1:
                r += scores[b]
            row.append(r)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kl_coef", [0.05, 0.2])
def test_shape_rewards_eq19_matches_loop_with_sampled_kl(kl_coef):
    scores, logprobs, ref_logprobs, _, mask, lengths = ragged_rollout(seed=1)
    got = ppo_max.shape_rewards(scores, logprobs, ref_logprobs, mask, kl_coef)
    expected = shape_rewards_loop(scores.tolist(), logprobs.tolist(), ref_logprobs.tolist(), lengths,
                                  mask.shape[1], kl_coef)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_shape_rewards_eq19_matches_loop_with_given_kl():
    scores, logprobs, ref_logprobs, kl, mask, lengths = ragged_rollout(seed=2)
    got = ppo_max.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.1, kl=kl)
    expected = shape_rewards_loop(scores.tolist(), logprobs.tolist(), ref_logprobs.tolist(), lengths,
                                  mask.shape[1], 0.1, kl=kl.tolist())
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_shape_rewards_eq19_kl_coef_zero_leaves_only_score_on_last_real_token():
    scores, logprobs, ref_logprobs, _, mask, lengths = ragged_rollout(seed=3)
    got = ppo_max.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.0)
    expected = torch.zeros_like(mask)
    for b, n in enumerate(lengths):
        expected[b, n - 1] = scores[b]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_shape_rewards_eq19_zero_where_mask_is_zero_and_rejects_empty_rows():
    scores, logprobs, ref_logprobs, kl, mask, _ = ragged_rollout(seed=4)
    got = ppo_max.shape_rewards(scores, logprobs + 50.0, ref_logprobs, mask, 0.1, kl=kl + 50.0)
    assert (got[mask == 0] == 0).all(), f"expected 0 at padding, got {got[mask == 0].tolist()}"
    nonfinite = logprobs.masked_fill(mask == 0, float("-inf")), ref_logprobs.masked_fill(mask == 0, float("-inf"))
    got = ppo_max.shape_rewards(scores, *nonfinite, mask, 0.1)  # e.g. −inf log-probs of padding tokens
    assert (got[mask == 0] == 0).all(), f"expected 0 at padding, got {got[mask == 0].tolist()}"
    got = ppo_max.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.1, kl=kl.masked_fill(mask == 0, float("nan")))
    assert (got[mask == 0] == 0).all(), f"expected 0 at padding, got {got[mask == 0].tolist()}"
    mask[2] = 0.0
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        ppo_max.shape_rewards(scores, logprobs, ref_logprobs, mask, 0.1)
    with pytest.raises(ValueError, match="scores must be"):
        ppo_max.shape_rewards(scores[:-1], logprobs, ref_logprobs, mask, 0.1)


# the worked example of `python ppo_max.py`: an earlier batch of scores, then this batch (B = 2)
WE_HISTORY, WE_SCORES = [1.0, 2.0, 3.0], [2.5, 5.0]


def f64(xs):
    return torch.tensor(xs, dtype=torch.float64)


def worked_example_moments() -> RunningMoments:
    """The worked example's moments, set by hand (not by update): the population moments of the 5 scores."""
    seen = WE_HISTORY + WE_SCORES
    m = RunningMoments()
    m.load_state_dict({"count": len(seen), "mean": float(np.mean(seen)), "var": float(np.var(seen))})
    return m


def test_running_moments_update_worked_example_numbers():
    m = RunningMoments()
    m.update(torch.tensor(WE_HISTORY))
    m.update(f64(WE_SCORES))
    assert m.count == 5 and math.isclose(m.mean, 2.7) and math.isclose(m.std, 1.32665, abs_tol=5e-6), m


def test_normalize_and_clip_rewards_worked_example_numbers():
    m = worked_example_moments()
    torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(f64(WE_SCORES), m, 0.8), f64([-0.15076, 0.8]),
                               atol=5e-6, rtol=0)
    torch.testing.assert_close(ppo_max.normalize_and_clip_rewards(f64(WE_SCORES), m, None), f64([-0.15076, 1.73369]),
                               atol=5e-6, rtol=0)


def test_scale_rewards_worked_example_numbers():
    torch.testing.assert_close(ppo_max.scale_rewards(f64(WE_SCORES), worked_example_moments()), f64([1.88445, 3.76889]),
                               atol=5e-6, rtol=0)


def test_shape_rewards_worked_example_numbers():
    r_tilde = f64([-0.15076, 0.8])  # Eq. 18's output above
    logprobs = f64([[-1.0, -0.5, -2.0], [-0.2, -1.5, -9.0]])
    ref_logprobs = f64([[-1.2, -0.5, -1.0], [-0.4, -1.0, -9.0]])
    mask = f64([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(ppo_max.shape_rewards(r_tilde, logprobs, ref_logprobs, mask, kl_coef=0.05),
                               f64([[-0.01, 0.0, -0.10076], [-0.01, 0.825, 0.0]]), atol=5e-6, rtol=0)
