"""Tests for the wrong edits that mutation testing (tools/mutation.py, docs/testing.md) found the other fast tests let
through: each checks the method file against an independent computation (a python loop, autograd,
torch.distributions, an exhaustive enumeration)."""
import itertools

import pytest
import torch

import gae


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
