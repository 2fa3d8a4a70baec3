"""What a run's numbers say they are: the step line names its samples and shows the held-out curve beside SFT's
point, the final table names its sampling and the held-out curve's peak, `eval.py plot` draws the held-out curve with
SFT's level; a reward-model judge whose held-out accuracy is within sampling noise of 0.5 gives no win rate (the rule:
the 95 % Wilson interval above 0.5, checked against its definition solved by bisection); and the README's examples
of the newer tricks are the ones tools/tricks_engage.py measures, each shown on the step line. All cheap."""
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import eval as evaluation
from plumbing import flags, monitor
from plumbing import run as plumbing_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import tricks_engage  # noqa: E402


def wilson_by_bisection(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The two p0 where |p − p0| = z·√(p0(1 − p0)/n), each found by bisection on its side of p."""
    f = lambda p0: abs(p - p0) - z * math.sqrt(p0 * (1 - p0) / n)  # noqa: E731  ≤ 0 inside the interval
    def root(lo, hi):  # f(lo) and f(hi) of opposite signs
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (f(mid) > 0) == (f(lo) > 0) else (lo, mid)
        return (lo + hi) / 2
    return root(0.0, p), root(p, 1.0)


@pytest.mark.parametrize("p,n", [(0.553, 94), (0.457, 94), (0.765, 200), (0.6, 100), (0.59, 100), (0.3, 17)])
def test_wilson_interval_is_its_definition(p, n):
    lo, hi = monitor.wilson_interval(p, n)
    blo, bhi = wilson_by_bisection(p, n)
    assert abs(lo - blo) < 1e-9 and abs(hi - bhi) < 1e-9


def test_a_judge_judges_only_above_chance_beyond_noise():
    assert not monitor.judge_check(0.59, 100)["can_judge"] and monitor.judge_check(0.60, 100)["can_judge"]
    assert not monitor.judge_check(0.457, 94)["can_judge"]   # below 0.5 within noise
    assert not monitor.judge_check(0.30, 400)["can_judge"]   # reliably reversed: still not a judge of "better"
    assert monitor.judge_check(0.765, 200)["can_judge"]


def summary(judge_acc: float | None, rm_acc: float = 0.457, pairs: int = 94) -> dict:
    row = {k: 1.0 for k in ["reward", "gold_reward", "kl", "perplexity", "response_length"]}
    s = {"sft": row, "final": row, "peak": None, "judge": "held-out reward model",
         "eval_sampling": {"samples": 1, **evaluation.EVAL_SAMPLING},
         "win_rate_vs_sft": {"win": 0.61, "tie": 0.0, "lose": 0.39},
         "win_rate_vs_sft_by_judge": {"held-out reward model": {"win": 0.61, "tie": 0.0, "lose": 0.39},
                                      "reward model (proxy)": {"win": 0.72, "tie": 0.0, "lose": 0.28}},
         "rm": {"accuracy": rm_acc, "check": monitor.judge_check(rm_acc, pairs)}}
    if judge_acc is not None:
        s["judge_check"] = monitor.judge_check(judge_acc, pairs)
    return s


def test_the_table_says_a_judge_at_chance_cannot_tell_the_policies_apart():
    table = evaluation.format_table(summary(0.553))
    assert "top-p 0.9, temperature 0.8" in table.splitlines()[0]
    lines = [line for line in table.splitlines() if line.startswith("win rate")]
    assert len(lines) == 2 and all("cannot tell the policies apart" in line for line in lines)
    assert "0.61" not in table and "0.72" not in table and "on 94 pairs" in lines[0]
    good = evaluation.format_table(summary(0.80, rm_acc=0.85))
    assert "win 0.61" in good and "win 0.72" in good and "cannot tell" not in good


def test_the_peak_is_the_heldout_curves_or_a_smoothed_training_gold():
    hist = [{"step": s, "reward/gold": g, **({"heldout/gold": h} if h is not None else {})}
            for s, g, h in [(0, 1.0, 2.1), (1, 3.0, None), (2, 1.2, 2.4), (3, 1.1, None), (4, 1.3, 2.2)]]
    run = SimpleNamespace(heldout_samples=1, heldout_every=2)
    assert plumbing_run.gold_peak(hist, run) == {"gold_reward": 2.4, "step": 2, "curve": "held-out", "samples": 1,
                                                 "every": 2, "sft": 2.1}
    bare = [{k: v for k, v in h.items() if k != "heldout/gold"} for h in hist]
    peak = plumbing_run.gold_peak(bare, run)  # the one noisy batch (3.0 at step 1) is not "the peak"
    assert peak["curve"] == "training" and peak["gold_reward"] == pytest.approx(sum(h["reward/gold"] for h in hist) / 5)


def test_the_step_line_shows_the_heldout_curve_beside_sfts_point():
    log = SimpleNamespace(history=[{"step": 0, "heldout/gold": 2.17}, {"step": 1}, {"step": 8, "heldout/gold": 2.33},
                                   {"step": 9}])
    assert monitor.RunLog.heldout_note(log, "reward/gold") == "  held-out gold +2.33 @8 (SFT +2.17)"
    assert monitor.RunLog.heldout_note(SimpleNamespace(history=[{"step": 0}]), "reward/gold") == ""


def fake_run(path: Path, judge_acc: float | None) -> Path:
    path.mkdir()
    rows = [{"step": s, "reward/score": 0.1 * s, "reward/gold": 1.0 + 0.05 * s, "kl/ref": 0.01,
             "policy/perplexity": 2.0, "response/length": 9.0, **({"heldout/gold": 2.0 + 0.02 * s} if s % 4 == 0
                                                                  else {})} for s in range(13)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summary(judge_acc)
    s.update(steps=13, judge="gold" if judge_acc is None else s["judge"])
    (path / "summary.json").write_text(json.dumps(s))
    return path


def test_plot_draws_the_heldout_curve_and_says_when_the_judge_cannot_judge(tmp_path):
    res = evaluation.plot([str(fake_run(tmp_path / "gold", None)), str(fake_run(tmp_path / "hh", 0.553)),
                           "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    win = next(p for p in res["panels"] if p.startswith("win rate"))
    assert "hh: the judge cannot tell the policies apart" in win and "gold:" not in win
    gold = next(p for p in res["panels"] if p.startswith("gold reward"))
    assert "held-out" in gold and not gold.endswith(": none")


@pytest.mark.parametrize("trick", list(tricks_engage.EXAMPLES))
def test_the_readme_shows_each_trick_as_measured_and_the_step_line_shows_its_number(trick):
    given, key = tricks_engage.EXAMPLES[trick]
    assert f"`{given}`" in (ROOT / "README.md").read_text(), trick
    configs = flags.resolve(given.split())
    flags.validate(*configs)  # every check of the flags passes
    cfg = configs[3]
    assert key in [k for _, k, _, _ in plumbing_run.trick_columns(cfg)]


def test_the_legend_names_each_numbers_sampling():
    run, cfg = (lambda c: (c[0], c[3]))(flags.resolve(["--preset", "dapo"]))
    legend = plumbing_run.step_line_legend(run, cfg, SimpleNamespace(name="gold"),
                                           [c[0] for c in plumbing_run.trick_columns(cfg)])
    first, held, tricks = legend.splitlines()
    assert "train gold: the step's training samples (temperature 1)" in first
    assert "top-p 0.9, temperature 0.8, 1 per prompt" in held and "every 8 steps" in held
    assert "groups dropped so far" in tricks and "freed by clip-higher" in tricks


def test_clip_higher_frac_counts_the_tokens_clip_higher_frees_by_a_loop():
    """ppo/clip_higher_frac: tokens with Â > 0 and 1+ε < ρ ≤ 1+ε_high (clipped by Eq. 15 at ε, not by clip-higher),
    counted one token at a time over the real tokens; absent without --clip-eps-high."""
    import torch
    import ppo_loss
    g = torch.Generator().manual_seed(0)
    B, T, eps, eps_high = 32, 9, 0.2, 0.28
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)   # ratios well beyond 1 ± ε
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).double()  # ragged
    _, stats = ppo_loss.policy_loss(new, old, adv, mask, eps, clip_eps_high=eps_high)
    freed = real = 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                real += 1
                rho = math.exp(new[b, t].item() - old[b, t].item())
                freed += adv[b, t].item() > 0 and 1 + eps < rho <= 1 + eps_high
    assert freed > 0 and stats["clip_higher_frac"] == pytest.approx(freed / real, abs=1e-12)
    assert "clip_higher_frac" not in ppo_loss.policy_loss(new, old, adv, mask, eps)[1]
