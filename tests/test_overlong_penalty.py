"""ppo_max.overlong_penalty (DAPO's overlong reward shaping) against its piecewise formula, evaluated by hand."""
import pytest
import torch

import ppo_max


def r_length(n: int, l_max: int, l_cache: int) -> float:
    """DAPO's R_length(y) for |y| = n: 0, then ((L_max − L_cache) − |y|) / L_cache, then −1 beyond L_max."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


def test_overlong_penalty_against_the_piecewise_formula():
    """L_max = 20, L_cache = 4: 0 up to 16 tokens, then −0.25 per token, −1 at 20 (and beyond), times the penalty."""
    lengths = torch.arange(0, 25)
    got = ppo_max.overlong_penalty(lengths, max_new_tokens=20, buffer=4, penalty=1.0)
    assert got.tolist() == pytest.approx([r_length(n, 20, 4) for n in range(25)], abs=1e-7)
    assert got[[16, 17, 18, 19, 20]].tolist() == pytest.approx([0.0, -0.25, -0.5, -0.75, -1.0], abs=1e-7)
    half = ppo_max.overlong_penalty(lengths, 20, 4, penalty=0.5)
    assert half.tolist() == pytest.approx([0.5 * r_length(n, 20, 4) for n in range(25)], abs=1e-7)
    assert all(str(x) != "-0.0" for x in got.tolist())   # no negative zeros below the buffer


def test_overlong_penalty_buffer_of_the_whole_length_and_refusals():
    got = ppo_max.overlong_penalty(torch.tensor([0, 5, 10]), 10, 10)   # L_cache = L_max: linear from the first token
    assert got.tolist() == pytest.approx([0.0, -0.5, -1.0])
    for buffer, penalty in [(0, 1.0), (11, 1.0), (4, -1.0)]:
        with pytest.raises(ValueError, match="overlong_penalty"):
            ppo_max.overlong_penalty(torch.tensor([3]), 10, buffer, penalty)
