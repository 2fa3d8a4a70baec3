"""best_of_n.py: the analytic KL log n − (n − 1)/n against a Monte Carlo estimate on a small categorical policy with
continuous scores (exact there), and against the exact KL of a discrete policy with ties (an upper bound there); the
worked example; `train.py --method best-of-n` end to end."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import best_of_n
import plumbing.config
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]


def test_worked_example_prints_the_numbers_in_its_comments():
    out = subprocess.run([sys.executable, "best_of_n.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src = (ROOT / "best_of_n.py").read_text().split("# Printed (tests/test_best_of_n.py checks these numbers):")[1]
    assert [l.strip() for l in out.splitlines()] == [l.strip()[2:] for l in src.splitlines() if l.strip()]


@pytest.mark.parametrize("n", [2, 4, 16])
def test_bon_kl_against_monte_carlo_with_continuous_scores(n):
    """π: a categorical over K = 6 responses; each response y also draws u ~ U(0, 1), and the proxy scores it
    s = g(y) + u, so no two candidates tie. The best of n has density ratio n·F(s)^(n−1) to π (F: the exact CDF of
    s under π), so KL = E_bon[log(n F(s)^(n−1))]: its Monte Carlo mean over the selected candidates must be within
    4 standard errors of bon_kl(n)."""
    g = torch.Generator().manual_seed(n)
    q = torch.tensor([0.30, 0.25, 0.15, 0.15, 0.10, 0.05], dtype=torch.float64)
    base = torch.tensor([0.0, 0.4, 1.1, 1.3, 2.0, 2.2], dtype=torch.float64)    # g(y): overlapping score ranges
    N = 40_000
    y = torch.multinomial(q.expand(N * n, 6), 1, replacement=True, generator=g).view(N, n)
    s = base[y] + torch.rand(N, n, generator=g, dtype=torch.float64)             # (N, n) continuous proxy scores
    best = s.gather(1, best_of_n.select_best(s)[:, None]).squeeze(1)             # (N,) the chosen candidates' scores
    F = (q[None] * (best[:, None] - base[None]).clamp(0, 1)).sum(1)              # F(s) = Σ_k q_k P(u ≤ s − g_k)
    log_ratio = math.log(n) + (n - 1) * torch.log(F)                             # log p_bon(y, u) / π(y, u)
    se = log_ratio.std().item() / math.sqrt(N)
    assert abs(log_ratio.mean().item() - best_of_n.bon_kl(n)) < 4 * se, (log_ratio.mean().item(), best_of_n.bon_kl(n))


def test_bon_kl_is_an_upper_bound_when_responses_repeat():
    """A discrete policy whose responses repeat among the n draws (distinct scores per response, but the same response
    can be drawn twice): the exact best-of-n distribution P(y_k) = F_k^n − F_{k−1}^n (responses sorted by score)
    has a KL strictly below log n − (n − 1)/n."""
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)                       # sorted by score, lowest first
    for n in (2, 4, 8):
        F = q.cumsum(0)
        p = F ** n - torch.cat([torch.zeros(1, dtype=torch.float64), F[:-1]]) ** n
        exact = (p * (p / q).log()).sum().item()
        assert 0 < exact < best_of_n.bon_kl(n)


def test_select_best_never_picks_a_nonfinite_score():
    """argmax alone takes a NaN for the largest; a NaN or ±inf proxy score is skipped, the best finite one chosen."""
    nan, inf = math.nan, math.inf
    scores = torch.tensor([[nan, 1.0, 2.0], [3.0, nan, inf], [-inf, -5.0, nan], [0.5, 0.5, nan]])
    assert best_of_n.select_best(scores).tolist() == [2, 0, 1, 0]


def test_select_best_row_without_a_finite_score_is_an_error():
    with pytest.raises(ValueError, match=r"row 1 has no finite proxy score among its 2 candidates"):
        best_of_n.select_best(torch.tensor([[1.0, 2.0], [math.nan, math.inf]]))


def test_sample_skips_candidates_with_a_nonfinite_proxy_score(tmp_path, capsys):
    """best_of_n.sample with a proxy that returns NaN for the first of every n candidates and otherwise a score that
    grows along the batch: each prompt gets its last candidate, with that candidate's (finite) score, and the skipped
    candidates are counted and reported."""
    from plumbing import data
    import eval as evaluation
    import tiny_model
    from transformers import AutoModelForCausalLM
    prompts, n = ["how do I cook rice ?", "how do I boil it ?"], 4

    class Proxy:  # r = the row's index in its batch (the candidates of a prompt are consecutive), NaN on each first
        def score(self, ids, mask):
            r = torch.arange(len(ids), dtype=torch.float32)
            return torch.where(r % n == 0, math.nan, r)

    model_dir = tiny_model.build_model("llama", ["how do I cook rice ? rinse it , then boil it ."] * 20,
                                       tmp_path / "m", hidden=16, layers=1, heads=2, vocab_size=300)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), data.load_tokenizer(model_dir)
    cand = evaluation.sample(model, tok, prompts, n, seed=5, max_new_tokens=3)  # the candidates best-of-n draws
    capsys.readouterr()
    out = best_of_n.sample(model, Proxy(), tok, prompts, n, per_prompt=1, seed=5, max_new_tokens=3)
    assert out["scores"] == [3.0, 7.0] and out["nonfinite"] == 2
    assert out["texts"] == [cand["texts"][3], cand["texts"][7]] and out["prompts"] == prompts
    assert "[best-of-n] 2 of 8 candidates had a NaN/inf proxy score; none was chosen" in capsys.readouterr().err


def test_select_best_takes_the_first_of_equal_scores_and_n_one_is_the_policy():
    assert best_of_n.select_best(torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]])).tolist() == [1, 0]
    assert best_of_n.bon_kl(1) == 0.0
    with pytest.raises(ValueError):
        best_of_n.bon_kl(0)


# ------------------------------------------------------------------------------- the wiring, on a tiny LLaMA
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random LLaMA (tools/tiny_model.py) and a reward model from it with a random head (the proxy here):
    (sft dir, reward-model dir, tokenizer, policy, reward model)."""
    from transformers import AutoModelForCausalLM

    from plumbing import data
    from reward_model import ScalarHeadModel
    from test_lora import build
    sft, rm_dir = build("llama", tmp_path_factory.mktemp("bon"))
    policy = AutoModelForCausalLM.from_pretrained(sft).eval()
    return sft, rm_dir, data.load_tokenizer(sft), policy, ScalarHeadModel.from_pretrained(rm_dir).eval()


def test_sample_keeps_the_best_of_each_prompts_own_candidates(tiny):
    """best_of_n.sample: response j of prompt i is the best, by the proxy, of the j-th block of n among the
    candidates eval.sample draws for prompt i with the same seed (scored here one sequence at a time, unpadded),
    never of another prompt's; its proxy score comes back beside it."""
    import eval as evaluation
    from test_lora import PROMPTS
    _, _, tokenizer, policy, rm = tiny
    prompts, n, per_prompt = PROMPTS[:3], 3, 2
    got = best_of_n.sample(policy, rm, tokenizer, prompts, n, per_prompt, seed=5, max_new_tokens=6)
    cand = evaluation.sample(policy, tokenizer, prompts, per_prompt * n, 5, 6)
    rows = [(q[qm != 0], r[m != 0]) for Q, QM, R, M in zip(cand["query"], cand["query_mask"], cand["response"],
                                                           cand["mask"]) for q, qm, r, m in zip(Q, QM, R, M)]
    with torch.no_grad():
        scores = [rm.score(torch.cat([q, r])[None], torch.ones(1, len(q) + len(r))).item() for q, r in rows]
    want = []
    for p in prompts:
        own = [k for k, c in enumerate(cand["prompts"]) if c == p]       # prompt p's per_prompt · n candidates
        assert len(own) == per_prompt * n
        want += [max(own[j * n:(j + 1) * n], key=lambda k: scores[k]) for j in range(per_prompt)]
    assert got["prompts"] == [p for p in prompts for _ in range(per_prompt)]
    assert [r[m != 0].tolist() for r, m in zip(got["response"][0], got["mask"][0])] == [rows[k][1].tolist()
                                                                                         for k in want]
    assert got["scores"] == pytest.approx([scores[k] for k in want], abs=1e-5)


def test_method_best_of_n_samples_only_the_heldout_prompts(tiny, tmp_path, monkeypatch):
    """train.py --method best-of-n (plumbing.run.other_method) on a tiny model: every prompt it samples, for the comparison
    with SFT and for the frontier point, is a held-out one; none is a training prompt."""
    import time

    import dpo
    import eval as evaluation
    import ppo_max
    import train
    from plumbing.pipeline import Inputs
    from test_lora import PROMPTS
    sft, rm_dir, tokenizer, _, _ = tiny
    sampled = []
    original = evaluation.sample
    monkeypatch.setattr(evaluation, "sample", lambda model, tok, prompts, *a, **k: sampled.append(list(prompts))
                        or original(model, tok, prompts, *a, **k))
    train_prompts, heldout = PROMPTS[:2], PROMPTS[2:]
    from plumbing.pipeline import stage_records
    records = {"prompts_train": [{"prompt": p} for p in train_prompts],
               "prompts_heldout": [{"prompt": p} for p in heldout]}
    run = plumbing.config.RunConfig(method="best-of-n", bon_n=2, eval_samples=1, out=str(tmp_path))
    cfg = ppo_max.PPOConfig(max_new_tokens=4)
    # what each consumer reads, taken as train.py takes it (pipeline.stage_records)
    inp = Inputs(sft, sft, rm_dir, rm_dir, tokenizer, records, rows=stage_records(records, run, cfg))
    s = plumbing.run.Setup([], run, plumbing.config.SFTConfig(), plumbing.config.RMConfig(), cfg, None,
                           dpo.DPOConfig(), {"sft": str(sft)}, tmp_path, 0, 1, torch.device("cpu"), time.time())
    summary = plumbing.run.other_method(s, inp)
    assert summary["method"] == "best-of-n" and summary["frontier"]["kl_seq"] == best_of_n.bon_kl(2)
    assert len(sampled) == 3 and all(sorted(set(p)) == sorted(heldout) for p in sampled), sampled
