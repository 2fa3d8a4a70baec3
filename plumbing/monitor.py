"""The collapse alarm of section 5.2: watch KL, length, perplexity and the reward tail, not the reward itself.

Implements (section and figure numbers of Zheng et al. 2023, arXiv 2307.04964; no equation of its own):
    CollapseMonitor(kl_max, length_growth, ppl_drop, tail_sigmas, tail_frac, warmup, patience)
        .check(metrics, scores)        → the reasons this one step looks collapsed (pure; § 5.2, Fig. 4, Fig. 13)
        .update(step, metrics, scores) → an Alarm once `patience` steps in a row had a reason, else None
        .state_dict() / .load_state_dict(d)  → plain JSON, so a resumed run continues the monitor exactly
    Alarm(step, reasons)               → the step it fired and the numbers behind it

    gold_halfway(gold)                 → the step a collapse has lost half its gain for good (the alarm's yardstick)
    replay(run_dir, **thresholds)      → what the alarm would have done on a finished run (metrics/samples.jsonl)
    outcome(replayed) / verdict(...)   → in time / late / missed / false alarm / quiet, against gold_halfway
    sweep(runs, grid, **thresholds)    → caught in time / late / missed / false alarms for each setting of a grid
    RunLog(out, monitor, history, ...) → the PPO loop's step (7): metrics.jsonl and samples.jsonl, the progress bar,
                                         a printed line every 10 steps, and the alarm on every step
    Tracker(kind, out, name)           → the same metrics to TensorBoard or W&B (--log-with)

Run: python -m plumbing.monitor        (a synthetic drifting run; prints the alarm the tests expect)
     python -m plumbing.monitor replay runs/vanilla-seed0 runs/ppo-max-seed0 [--kl-max 0.05 --patience 1 ...]
     python -m plumbing.monitor sweep runs/*-seed?      (kl_max × patience over every saved run; nothing is retrained)

Why these metrics: section 5.2 finds that the reward and the PPO losses keep looking healthy while the policy
collapses ("pattern collapse": it exploits the reward model). What moves first is (Fig. 4, vanilla PPO):
KL(π_RL ‖ π_SFT) climbs, responses grow long (100–150 → 400–500 tokens), the perplexity of the policy on its own
samples falls toward 1, and (Fig. 13, appendix A) the reward-model scores, identically distributed while training
is stable, develop a long tail. Under PPO-max (Fig. 9) KL stays small and length and perplexity stay flat.

Metrics read from each step's dict (the keys ppo_max.make_experience logs):
    kl/ref              mean per-token KL(π_RL ‖ π_SFT) over response tokens, nats/token
    response/length     mean response length, tokens
    policy/perplexity   exp(mean NLL) of the policy on its own sampled responses
and `scores`: the raw reward-model scores of the step's batch (before Eq. 18's normalization).
A metric that is missing, None or non-finite is not checked (and never enters the baseline, so state_dict() stays
valid JSON): non-finite values are the business of checkpoint.NonFiniteGuard.

The baseline is taken over the first `warmup` steps fed (the policy is still ≈ the SFT model there); the checks
relative to it start after warmup, the absolute KL check starts at once.

References:
    Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", section 5.2, Fig. 4, 9, 13.
    Cantelli's inequality (one-sided Chebyshev): P(X − μ ≥ kσ) ≤ 1/(1 + k²) for any distribution.
"""
import io
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

from plumbing import engine
from plumbing.checkpoint import find_latest
from plumbing.engine import all_mean, any_rank
from ppo_loss import masked_mean


KL_KEY, LENGTH_KEY, PPL_KEY = "kl/ref", "response/length", "policy/perplexity"


@dataclass
class Alarm:
    """Where the alarm fired and why: each reason carries its numbers, e.g. "kl/ref 0.41 > 0.30"."""
    step: int
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"collapse alarm at step {self.step}: " + "; ".join(self.reasons)


def _as_floats(scores: Any) -> list[float]:
    """The finite values of `scores` (None, a list, or a tensor / array of any shape) as a flat list of floats: NaN
    and inf are the non-finite guard's business, and would poison the baseline."""
    if scores is None:
        return []
    flat = scores.flatten().tolist() if hasattr(scores, "flatten") else scores  # a torch tensor or numpy array
    return [float(x) for x in flat if math.isfinite(float(x))]


def _get(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    return None if v is None or not math.isfinite(float(v)) else float(v)


# What each threshold may be (cli.check_value's language; finite numbers only): `python -m plumbing.monitor replay|sweep`
# checks its flags against these before it reads a run.
THRESHOLD_RANGES = {"kl_max": ">=0", "length_growth": ">=0", "ppl_drop": "[0,1)", "tail_sigmas": ">=0",
                    "tail_frac": "[0,1)", "warmup": ">=1", "patience": ">=1"}

# The default thresholds, checked on the synthetic world's runs (docs/long-runs.md, "The collapse alarm");
# `python -m plumbing.monitor sweep runs/*-seed?` shows what other values would have done.
KL_MAX, PATIENCE, PPL_DROP = 0.08, 1, 0.35


class CollapseMonitor:
    """Fires when, for `patience` consecutive steps, ANY of these holds (thresholds are arguments):

    kl_max = 0.08 (nats/token)    KL to the reference > kl_max. Absolute, because the reference is fixed: Fig. 4
        shows vanilla PPO's KL climbing without bound, Fig. 9 PPO-max's staying small under the Eq. 19 penalty.
        In the synthetic world vanilla's KL passes 0.08 at steps 18–28, before its gold reward has fallen halfway
        (gold_halfway), on four of five seeds (the fifth keeps its gold); PPO-max stays below it over 400 steps at
        η = 0.05, 0.1 and 0.2 on seeds 0–2 (docs/long-runs.md). Higher values fire only once a collapse is well
        under way.
    length_growth = 0.5           mean response length > (1 + 0.5) × baseline. Fig. 4's collapse multiplies
        length by 3–4; Fig. 9 keeps it flat; +50 % is a fraction of the collapse and well outside batch noise.
    ppl_drop = 0.35               policy perplexity < (1 − 0.35) × baseline. Fig. 4's perplexity falls toward 1
        (the policy becomes certain of one pattern); Fig. 9's stays flat, but single batches of PPO-max dip by about
        30 % (one, on a stable run, fired a 0.3 threshold). Perplexity is ≥ 1, so with a baseline below 1/(1 − ppl_drop) this check can
        never fire; the other three still do.
    tail_sigmas = 3, tail_frac = 0.2   more than 20 % of the step's raw scores lie above baseline mean + 3 σ
        (baseline: all scores of the warmup steps, population σ). Fig. 13: the distribution is unchanged while
        training is stable and grows a long tail after collapse. For the baseline distribution itself, whatever
        its shape, Cantelli's inequality bounds that fraction by 1/(1 + 3²) = 10 %, so 20 % cannot be the
        stable distribution plus noise.
    patience = 1                  consecutive steps with at least one reason. Vanilla PPO's gold reward in this
        world falls halfway within a few steps of its peak, so waiting for a second bad step is already late; raise
        it (with kl_max) for a quieter alarm that confirms a collapse rather than warns of it.
    warmup = 5                    steps averaged into the baseline (length, perplexity: per-step means averaged;
        scores: pooled).

    update() returns an Alarm on the step a run of bad steps reaches `patience`, then None until a good step
    ends that run (a later run of bad steps fires again). Every alarm is kept in `.alarms`.
    """

    def __init__(self, kl_max: float = KL_MAX, length_growth: float = 0.5, ppl_drop: float = PPL_DROP,
                 tail_sigmas: float = 3.0, tail_frac: float = 0.2, warmup: int = 5, patience: int = PATIENCE):
        if warmup < 1 or patience < 1:
            raise ValueError(f"CollapseMonitor: warmup and patience must be ≥ 1, got {warmup}, {patience}")
        if not 0 <= ppl_drop < 1 or length_growth < 0 or not 0 <= tail_frac < 1:
            raise ValueError("CollapseMonitor: need 0 ≤ ppl_drop < 1, length_growth ≥ 0, 0 ≤ tail_frac < 1")
        self.kl_max, self.length_growth, self.ppl_drop = kl_max, length_growth, ppl_drop
        self.tail_sigmas, self.tail_frac, self.warmup, self.patience = tail_sigmas, tail_frac, warmup, patience
        self._reset_state()

    def _reset_state(self) -> None:
        self.steps_seen = 0
        self.len_sum, self.len_n = 0.0, 0
        self.ppl_sum, self.ppl_n = 0.0, 0
        self.score_n, self.score_mean, self.score_m2 = 0, 0.0, 0.0  # Welford: count, mean, Σ(x − mean)²
        self.streak = 0
        self.alarms: list[Alarm] = []

    # ---- baseline -------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the warmup steps are in the baseline and the relative checks are on."""
        return self.steps_seen >= self.warmup

    def baseline(self) -> dict:
        """The baseline so far: mean length, mean perplexity, score mean and population std (None where unseen)."""
        return {
            "response/length": self.len_sum / self.len_n if self.len_n else None,
            "policy/perplexity": self.ppl_sum / self.ppl_n if self.ppl_n else None,
            "score_mean": self.score_mean if self.score_n else None,
            "score_std": math.sqrt(self.score_m2 / self.score_n) if self.score_n else None,
        }

    def _add_to_baseline(self, metrics: Mapping[str, Any], scores: list[float]) -> None:
        length, ppl = _get(metrics, LENGTH_KEY), _get(metrics, PPL_KEY)
        if length is not None:
            self.len_sum, self.len_n = self.len_sum + length, self.len_n + 1
        if ppl is not None:
            self.ppl_sum, self.ppl_n = self.ppl_sum + ppl, self.ppl_n + 1
        for x in scores:  # Welford's update: exact enough in float64 and mergeable one value at a time
            self.score_n += 1
            delta = x - self.score_mean
            self.score_mean += delta / self.score_n
            self.score_m2 += delta * (x - self.score_mean)

    # ---- the checks -----------------------------------------------------------------------------------
    def check(self, metrics: Mapping[str, Any], scores: Iterable[float] | Any = None) -> list[str]:
        """The reasons this one step looks collapsed, against the current baseline; [] if none. Pure."""
        reasons = []
        kl = _get(metrics, KL_KEY)
        if kl is not None and kl > self.kl_max:  # § 5.2 / Fig. 4: KL to the reference climbs
            reasons.append(f"kl/ref {kl:.3f} > {self.kl_max:.3f}")
        if self.steps_seen < self.warmup:  # not ready: the warmup steps are not all in the baseline
            return reasons
        base = self.baseline()
        length = _get(metrics, LENGTH_KEY)
        if length is not None and base[LENGTH_KEY] is not None:
            limit = (1 + self.length_growth) * base[LENGTH_KEY]  # Fig. 4: responses grow long
            if length > limit:
                reasons.append(f"response/length {length:.1f} > {1 + self.length_growth:g} × baseline "
                               f"{base[LENGTH_KEY]:.1f} = {limit:.1f}")
        ppl = _get(metrics, PPL_KEY)
        if ppl is not None and base[PPL_KEY] is not None:
            limit = (1 - self.ppl_drop) * base[PPL_KEY]  # Fig. 4: perplexity falls toward 1
            if ppl < limit:
                reasons.append(f"policy/perplexity {ppl:.3f} < {1 - self.ppl_drop:g} × baseline "
                               f"{base[PPL_KEY]:.3f} = {limit:.3f}")
        xs = scores if isinstance(scores, list) else _as_floats(scores)  # update() passes its floats
        if xs and base["score_mean"] is not None:
            cut = base["score_mean"] + self.tail_sigmas * base["score_std"]  # Fig. 13: the long tail
            frac = sum(x > cut for x in xs) / len(xs)
            if frac > self.tail_frac:
                reasons.append(f"reward tail {frac:.0%} of scores > baseline mean {base['score_mean']:.2f} + "
                               f"{self.tail_sigmas:g}σ ({base['score_std']:.2f}) = {cut:.2f}, limit "
                               f"{self.tail_frac:.0%}")
        return reasons

    def update(self, step: int, metrics: Mapping[str, Any], scores: Iterable[float] | Any = None) -> Alarm | None:
        """Feed one step; returns an Alarm on the step `patience` bad steps in a row are reached, else None."""
        xs = _as_floats(scores)
        reasons = self.check(metrics, xs)
        if self.steps_seen < self.warmup:  # not ready
            self._add_to_baseline(metrics, xs)
        self.steps_seen += 1
        self.streak = self.streak + 1 if reasons else 0
        if self.streak == self.patience:
            alarm = Alarm(step=int(step), reasons=reasons)
            self.alarms.append(alarm)
            return alarm
        return None

    @property
    def first_alarm(self) -> Alarm | None:
        return self.alarms[0] if self.alarms else None

    # ---- resume ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON: everything update() depends on (thresholds included for the record)."""
        return {
            "thresholds": {"kl_max": self.kl_max, "length_growth": self.length_growth, "ppl_drop": self.ppl_drop,
                           "tail_sigmas": self.tail_sigmas, "tail_frac": self.tail_frac, "warmup": self.warmup,
                           "patience": self.patience},
            "steps_seen": self.steps_seen, "len_sum": self.len_sum, "len_n": self.len_n, "ppl_sum": self.ppl_sum,
            "ppl_n": self.ppl_n, "score_n": self.score_n, "score_mean": self.score_mean, "score_m2": self.score_m2,
            "streak": self.streak, "alarms": [asdict(a) for a in self.alarms],
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore the observations; the thresholds stay those this monitor was built with."""
        self.steps_seen, self.streak = int(d["steps_seen"]), int(d["streak"])
        self.len_sum, self.len_n = float(d["len_sum"]), int(d["len_n"])
        self.ppl_sum, self.ppl_n = float(d["ppl_sum"]), int(d["ppl_n"])
        self.score_n, self.score_mean, self.score_m2 = int(d["score_n"]), float(d["score_mean"]), float(d["score_m2"])
        self.alarms = [Alarm(step=int(a["step"]), reasons=list(a["reasons"])) for a in d["alarms"]]


def gold_halfway(gold: list[float], window: int = 3, hold: int = 10) -> int | None:
    """The step at which a collapse has cost half its gain: from there to the end of the run, the gold reward stays
    at or below halfway between its peak and the SFT level. None if that never happens (the run kept its gain).

    gold: per-step mean gold reward of the training batch (synthetic world only; train.py's samples.jsonl).
    The curve is a centred `window`-step mean, so one lucky or unlucky batch of 64 neither makes the peak nor ends
    the run early; the SFT level is gold[0], the batch sampled before the first update. "Stays to the end" makes
    the step well defined on a noisy curve (a run that dips and recovers has no halfway step); a fall that starts
    fewer than `hold` steps before the end is too short to tell from a dip, and does not count. This is the
    yardstick of the alarm's goal, "fire before the gold reward has fallen halfway from its peak back to the SFT level".
    """
    n, k = len(gold), window // 2
    if n < 2:
        return None
    g = [sum(gold[max(0, i - k):i + k + 1]) / len(gold[max(0, i - k):i + k + 1]) for i in range(n)]
    peak_at = max(range(n), key=g.__getitem__)
    half = (g[peak_at] + gold[0]) / 2
    if g[peak_at] <= gold[0] or g[-1] > half:
        return None
    t = n - 1
    while t > peak_at and g[t - 1] <= half:  # walk back from the end while the curve is still below half
        t -= 1
    return t if n - t >= hold else None


def _log_row(path, line_no: int, raw: bytes) -> dict:
    """One line of a run's log as its JSON object, which has an integer "step"; else a ValueError naming the file and
    line (bytes that are not UTF-8 included)."""
    try:
        row = json.loads(raw.decode("utf-8"))
        int(row["step"])
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{line_no}: bytes that are not UTF-8 at byte {e.start + 1} of the line") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{line_no}: not a JSON object with a 'step' ({type(e).__name__}: {e})") from None
    return row


def load_run(run_dir) -> dict:
    """A finished run's logs: RUN_DIR/metrics.jsonl (the §5.2 metrics of each step) and RUN_DIR/samples.jsonl (each
    step's raw scores, and its gold rewards in the synthetic world). gold is the per-step batch mean, [] without it."""
    from pathlib import Path
    run_dir = Path(run_dir)

    def read(path: Path) -> list[dict]:  # one JSON object with a "step" per line; errors name the file and line
        out = []
        with open(path, "rb") as f:
            for i, raw in enumerate(f, 1):
                if raw.strip():
                    out.append(_log_row(path, i, raw))
        return out

    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a train.py run directory)")
    rows = read(run_dir / "metrics.jsonl")
    samples = {s["step"]: s for s in read(run_dir / "samples.jsonl")} if (run_dir / "samples.jsonl").exists() else {}
    scores = [samples.get(r["step"], {}).get("scores") for r in rows]
    gold = [samples.get(r["step"], {}).get("gold") for r in rows]
    gold = [sum(g) / len(g) for g in gold] if gold and all(gold) else []
    return {"run": run_dir.name, "rows": rows, "scores": scores, "gold": gold}


def replay(run, **thresholds) -> dict:
    """What the alarm would have done on a finished run with these thresholds; nothing is retrained.

    run: a run directory or load_run()'s dict. Returns the first alarm (step, reasons), every alarm step, the
    gold-halfway step (gold_halfway; None without gold) and the number of steps.
    """
    if not isinstance(run, dict):
        run = load_run(run)
    monitor = CollapseMonitor(**thresholds)
    for row, scores in zip(run["rows"], run["scores"]):
        monitor.update(row["step"], row, scores)
    first = monitor.first_alarm
    return {"run": run["run"], "steps": len(run["rows"]), "alarm": first.step if first else None,
            "reasons": first.reasons if first else [], "alarms": [a.step for a in monitor.alarms],
            "gold_halfway": gold_halfway(run["gold"]) if run["gold"] else None, "has_gold": bool(run["gold"])}


def outcome(r: dict) -> str | None:
    """One replay() result against its gold yardstick: 'in_time' (alarm before the halfway step), 'late' (at or
    after it), 'missed', 'false' (an alarm on a run that kept its gold), 'quiet', or None without gold."""
    half, alarm = r["gold_halfway"], r["alarm"]
    if not r["has_gold"]:
        return None
    if half is None:
        return "false" if alarm is not None else "quiet"
    if alarm is None:
        return "missed"
    return "in_time" if alarm < half else "late"


def verdict(r: dict) -> str:
    """outcome() in words, with the lead or lag in steps."""
    kind, half, alarm = outcome(r), r["gold_halfway"], r["alarm"]
    if kind in ("in_time", "late"):
        if alarm == half:
            return "at the halfway step, not before"
        return f"in time, {half - alarm} step(s) early" if kind == "in_time" else f"late, {alarm - half} step(s) after"
    return {None: "(no gold in this run)", "false": "false alarm: the run kept its gold",
            "quiet": "quiet: the run kept its gold", "missed": "missed the collapse"}[kind]


def sweep(runs: list[dict], grid: dict[str, list], **fixed) -> list[dict]:
    """replay() every run under every combination of `grid` (e.g. {"kl_max": [...], "patience": [...]}), the other
    thresholds `fixed`. Per setting: how many collapses were caught in time / late / missed, false alarms on runs
    that kept their gold, and the median lead (halfway step − alarm step; negative = late) over caught collapses."""
    import itertools
    out = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values))
        counts = {"in_time": 0, "late": 0, "missed": 0, "false": 0, "quiet": 0}
        leads = []
        for run in runs:
            r = replay(run, **fixed, **setting)
            kind = outcome(r)
            if kind is None:  # no gold: nothing to measure against
                continue
            counts[kind] += 1
            if kind in ("in_time", "late"):
                leads.append(r["gold_halfway"] - r["alarm"])
        leads.sort()
        out.append({**setting, **counts, "median_lead": leads[len(leads) // 2] if leads else None})
    return out


class Tracker:
    """Every metric also to TensorBoard (<out>/tensorboard) or Weights & Biases (offline with WANDB_MODE=offline),
    under the same names as in metrics.jsonl, which stays the source of truth; "none" does nothing."""

    def __init__(self, kind: str, out, name: str, config: dict | None = None):
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            from pathlib import Path
            self.writer = SummaryWriter(str(Path(out) / "tensorboard"))
        elif kind == "wandb":
            import wandb  # optional: train.py has checked that it is installed
            self.writer = wandb.init(project="ppo-max", name=name, dir=str(out), config=config or {})

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.kind == "tensorboard":
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
        elif self.kind == "wandb":
            self.writer.log(scalars, step=step)

    def close(self) -> None:
        if self.kind == "tensorboard":
            self.writer.close()
        elif self.kind == "wandb":
            self.writer.finish()


# ---------------------------------------------------------------------------------------------------------
# The logged numbers of steps (2)-(6) and the non-finite check every rank agrees on (ppo_max.py calls them;
# nothing here changes what is trained)
# ---------------------------------------------------------------------------------------------------------
def check_finite(named: dict[str, Tensor | None]) -> str | None:
    """The name of the first tensor holding a NaN/inf (None when all are finite; None entries are skipped), the same
    on every rank: a rank that skipped an update alone would deadlock the others ("on another rank" where only
    another one saw it)."""
    named = {k: x for k, x in named.items() if x is not None}
    device = next(iter(named.values())).device
    bad = next((name for name, x in named.items() if not torch.isfinite(x).all()), None)
    return (bad or "on another rank") if any_rank(bad is not None, device) else None


def experience_stats(exp: dict, ent: Tensor, kl_exact: Tensor, rewards_seq: Tensor, rewards: Tensor) -> dict:
    """metrics.jsonl's numbers of steps (2)-(5) (docs/metrics.md defines each), averaged over the ranks; called
    inside make_experience's torch.no_grad(). ent (B, T): the policy's entropy at each response position."""
    mask, all_scores, advantages = exp["mask"], exp["all_scores"], exp["advantages"]
    stats = {
        "reward/score": all_scores.mean().item(),
        "reward/score_std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
        "reward/normalized": rewards_seq.mean().item(),
        "reward/total": (rewards * mask).sum(1).mean().item(),
        "kl/ref": masked_mean(kl_exact, mask).item(),
        "kl/ref_k1": masked_mean(exp["logprobs"] - exp["ref_logprobs"], mask).item(),
        "kl/ref_seq": (kl_exact * mask).sum(1).mean().item(),
        "policy/perplexity": math.exp(-masked_mean(exp["logprobs"], mask).item()),
        "policy/entropy": masked_mean(ent, mask).item(),
        "response/length": mask.sum(1).mean().item(),
        "adv/mean": masked_mean(advantages, mask).item(),
        "adv/std": masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt().item(),
        "returns/mean": masked_mean(exp["returns"], mask).item(),
    }
    if exp["values"] is not None:  # a critic-free estimator has no values
        stats["values/mean"] = masked_mean(exp["values"], mask).item()
    return all_mean(stats, mask.device)


def minibatch_stats(pg_loss, vf_loss, ptx, kl_loss, pg_stats: dict, grad_norm, cfg) -> dict:
    """Step (6)'s numbers of one minibatch; loss/vf only with a critic, loss/kl only with --kl-in loss."""
    stats = {"loss/pg": pg_loss.item(), **({"loss/vf": vf_loss.item()} if vf_loss is not None else {}),
             "loss/ptx": ptx.item(), "ppo/clipfrac": pg_stats["clipfrac"], "ppo/approx_kl": pg_stats["approx_kl"],
             "ppo/ratio": pg_stats["ratio"], "grad/norm": float(grad_norm)}
    if cfg.kl_in == "loss":
        stats["loss/kl"] = kl_loss.item()
    if "dual_clipfrac" in pg_stats:
        stats["ppo/dual_clipfrac"] = pg_stats["dual_clipfrac"]
    if "clip_higher_frac" in pg_stats:  # --clip-eps-high: the tokens clip-higher keeps that Eq. 15 would clip
        stats["ppo/clip_higher_frac"] = pg_stats["clip_higher_frac"]
    return stats  # the same numbers on every rank (the KL controller and the logs read them)


def update_stats(per_minibatch: list[dict], nonfinite: list[str], device) -> dict:
    """Step (6)'s logged numbers: each averaged over the minibatches and over the ranks, the count of skipped
    optimizer steps, and "guard/nonfinite" (what was NaN/inf, on any rank) when there were some."""
    stats = {k: sum(s[k] for s in per_minibatch) / len(per_minibatch) for k in per_minibatch[0]}
    stats["guard/skipped_updates"] = float(len(nonfinite))
    stats = all_mean(stats, device)
    if any_rank(bool(nonfinite), device):
        return {**stats, "guard/nonfinite": sorted(set(nonfinite)) or ["on another rank"]}
    return stats


# A reward model judges a win rate only when its held-out pairwise accuracy is above chance beyond sampling noise: the
# lower end of the 95 % Wilson score interval of that accuracy over its held-out pairs lies above 0.5. Otherwise
# (the interval holds 0.5, or lies below it) its win rate says nothing about which policy is better, and the run
# prints that the judge cannot tell the policies apart instead of the win rate (docs/metrics.md; eval.format_table
# and eval.plot read these).
JUDGE_Z = 1.96  # the 95 % two-sided normal quantile of the interval


def wilson_interval(p: float, n: int, z: float = JUDGE_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion p observed on n trials (Wilson 1927): (lo, hi), the p0 for which
    |p − p0| ≤ z·√(p0(1 − p0)/n). Better than p ± z·√(p(1 − p)/n) near 0 and 1 and on few trials."""
    if n < 1:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return centre - half, centre + half


def judge_check(accuracy: float, pairs: int) -> dict:
    """The rule above for a reward model of held-out `accuracy` on `pairs` held-out pairs: {"accuracy", "pairs",
    "interval": [lo, hi], "can_judge": lo > 0.5}."""
    lo, hi = wilson_interval(accuracy, pairs)
    return {"accuracy": accuracy, "pairs": pairs, "interval": [lo, hi], "can_judge": lo > 0.5}


def judge_of(summary: dict, judge: str) -> dict | None:
    """The judge_check of the reward model that judged a win-rate line of `summary`: the held-out judge
    ("held-out reward model": summary["judge_check"]) or the proxy ("reward model", "reward model (proxy)":
    summary["rm"]["check"]); None for gold or where the run did not record it."""
    if judge == "gold":
        return None
    if judge == "held-out reward model":
        return summary.get("judge_check")
    return (summary.get("rm") or {}).get("check")


def rm_check(model_dir: Path) -> dict | None:
    """judge_check of the reward model whose stage 2 wrote rm_log.json and rm_heldout_scores.json into
    `model_dir` (or, for a base's reward_model/, beside it): its final held-out accuracy and the number of held-out
    pairs; None where they are missing."""
    if not (model_dir / "rm_log.json").is_file() and model_dir.name == "reward_model":
        model_dir = model_dir.parent  # the cached base of the synthetic world or --data keeps them beside it
    log, scores = model_dir / "rm_log.json", model_dir / "rm_heldout_scores.json"
    if not (log.is_file() and scores.is_file()):
        return None
    return judge_check(json.loads(log.read_text())[-1]["heldout_accuracy"],
                       len(json.loads(scores.read_text())["chosen"]))


def cannot_judge(check: dict) -> str:
    """The words that stand in place of a win rate its judge cannot give."""
    lo, hi = check["interval"]
    return (f"the judge cannot tell the policies apart (its held-out accuracy {check['accuracy']:.3f} on "
            f"{check['pairs']} pairs, 95 % interval [{lo:.3f}, {hi:.3f}], is not above chance)")


def progress(iterable, desc: str, total: int | None = None, initial: int = 0, disable: bool = False,
             leave: bool = True, every: float = 10.0):
    """`iterable` under tqdm's progress bar. When stderr is not a terminal (a log file, a pipe) the bar is drawn at
    most every `every` seconds, each time as a whole line (a redraw per item fills a log with kilobytes of bars),
    and a bar that does not stay (leave=False) shows only if it lasts longer than that. Callers set the postfix
    with refresh=False: tqdm's set_postfix otherwise redraws at once, a line per step in a log."""
    from tqdm import tqdm
    if disable or sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, initial=initial, disable=disable, leave=leave)
    return tqdm(iterable, desc=desc, total=total, initial=initial, leave=leave, file=LogLines(), mininterval=every,
                delay=0 if leave else every, ascii=True, ncols=110)


class LogLines(io.TextIOBase):
    """A file for tqdm that writes each redraw as one line on stderr (no carriage returns, no blanking), and leaves
    out a redraw that says nothing new: the same count and postfix as the line before, only the clock and the rate
    moved on (tqdm draws the last state again when the bar closes, and after each tqdm.write)."""

    last: str | None = None  # the state of the line written before

    def write(self, s: str) -> int:
        line = s.replace("\r", "").strip()
        # the state without clock and rate: "| 3/3 [00:01<00:00, 1.67it/s, kl=…]" → "| 3/3 [, kl=…]"
        news = re.sub(r"\[[^\]]*?(?:it/s|s/it)", "[", line)
        if line and news != self.last:
            print(line, file=sys.stderr, flush=True)
            self.last = news
        return len(s)


class RunLog:
    """What the PPO loop writes and prints, behind one call per step (record). metrics.jsonl holds exactly the
    completed steps: a resumed run rewrites it from `history` (the steps before the checkpoint), samples.jsonl from
    `samples` (their rows; [] for a new run), and appends; only rank 0 writes (the other ranks write to os.devnull).
    Each step's rows reach both files whole or not at all: a write that fails (a full disk) cuts both files back to
    where the step began, so neither ends in a cut line, and raises cli.WriteFailed naming the file (a resume reads
    the rows of the steps before its checkpoint, all complete)."""

    def __init__(self, out, monitor: CollapseMonitor, history: list[dict], samples: list[dict], main_rank: bool = True,
                 tracker: Tracker | None = None):
        from pathlib import Path
        out = Path(out)
        self.monitor, self.history, self.main_rank = monitor, history, main_rank
        self.tracker = tracker if main_rank and tracker is not None else Tracker("none", out, "")
        self.alarm_info: dict | None = None
        self.out = out
        # the step line's columns of the tricks a run enabled: (label, metrics key, format, summed over the run's
        # steps so far rather than this step's), set by the run
        self.columns: list[tuple[str, str, Callable[[float], str], bool]] = []
        if main_rank:  # atomic: a crash here loses nothing, and another rank reading metrics.jsonl never sees it torn
            from plumbing.checkpoint import atomic_write_text
            atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
            atomic_write_text(out / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
        self.paths = (out / "metrics.jsonl", out / "samples.jsonl") if main_rank else (os.devnull, os.devnull)
        # unbuffered: what write() took is in the file, so a failed write leaves nothing behind to be flushed later
        self.metrics_f, self.samples_f = (open(path, "ab", buffering=0) for path in self.paths)

    def append(self, rows: list[tuple[Any, Any, str]]) -> None:
        """Each (file, path, text) of one step, all or none: on a failed write every file is cut back to its length
        before this call (ftruncate frees blocks, so it works on a full disk too), then cli.WriteFailed names the path
        that failed, the bytes of the step's rows, and the checkpoint a --resume would continue from."""
        started = []
        for f, path, text in rows:
            data = memoryview(text.encode())
            try:
                started.append((f, f.seek(0, os.SEEK_END)))
                while data:
                    data = data[f.write(data):]
            except Exception as e:
                for g, length in started:
                    try:
                        g.truncate(length)
                    except OSError:
                        pass
                from plumbing.checkpoint import write_failure
                latest = find_latest(self.out)
                failed = write_failure(e, path, sum(len(t.encode()) for _, _, t in rows),
                                       f"its rows end with the step before; `train.py --resume {self.out}` continues "
                                       f"from {latest.name if latest else 'the start'} with more room", writing=True)
                if failed is None:
                    raise
                raise failed from None

    def steps(self, start: int, total: int, bar: bool = True):
        """range(start, total) under a progress bar (rank 0 only; none with bar=False) that starts at `start` of
        `total`."""
        self.total = total
        self.bar = progress(range(start, total), "4. PPO", total=total, initial=start,
                            disable=not (self.main_rank and bar))
        return self.bar

    def record(self, step: int, m: dict, scores: list[float], judged: list[float] | None, prompts: list[str],
               texts: list[str], judge_key: str = "reward/gold") -> Alarm | None:
        """The alarm's verdict on this step (also stored as m["alarm/collapse"]), then m to metrics.jsonl, every
        score and judge's reward (gold, or the held-out reward model's) plus four examples to samples.jsonl, the
        bar's postfix and, every 10 steps, a line."""
        from tqdm import tqdm
        alarm = self.monitor.update(step, m, scores)
        m["alarm/collapse"] = alarm is not None
        gold = judged if judge_key == "reward/gold" else None
        sample = {"step": step, "scores": scores, "gold": gold,
                  **({} if gold is not None or judged is None else {"judge": judged}),
                  "examples": [[p, t] for p, t in zip(prompts[:4], texts[:4])]}
        self.append([(self.metrics_f, self.paths[0], json.dumps(m) + "\n"),
                     (self.samples_f, self.paths[1], json.dumps(sample) + "\n")])
        self.history.append(m)
        if self.tracker.writer is not None:  # --log-with tensorboard / wandb
            self.tracker.log(m, step)
        name = "gold" if judge_key == "reward/gold" else "judge"
        gold_s = "n/a" if m.get(judge_key) is None else f"{m[judge_key]:+.2f}"
        self.bar.set_postfix(score=f"{m['reward/score']:.2f}", **{f"train_{name}": gold_s}, kl=f"{m['kl/ref']:.3f}",
                             len=f"{m['response/length']:.1f}", refresh=False)
        if step % 10 == 0 or step == self.total - 1:
            tricks = "".join(f"  {label} {fmt(sum(h.get(key) or 0 for h in self.history) if total else m[key])}"
                             for label, key, fmt, total in self.columns if m.get(key) is not None)
            tqdm.write(f"step {step:4d}  score {m['reward/score']:+.2f}  train {name} {gold_s}"
                       f"{self.heldout_note(judge_key)}  kl {m['kl/ref']:.3f}  ppl {m['policy/perplexity']:.2f}  "
                       f"len {m['response/length']:.1f}{tricks}  e.g. {prompts[0]!r} -> {texts[0]!r}")
        if alarm is not None:
            tqdm.write(f"[collapse alarm] step {step}: " + "; ".join(alarm.reasons))
            self.alarm_info = self.alarm_info or {"step": alarm.step, "reasons": alarm.reasons}
        return alarm

    def heldout_note(self, judge_key: str) -> str:
        """The held-out curve beside a step line: its latest point and SFT's (the point of step 0, the SFT policy),
        "" before the first point or without a curve."""
        key = {"reward/gold": "heldout/gold", "reward/judge": "heldout/judge"}.get(judge_key)
        points = [h for h in self.history if h.get(key) is not None]
        if not points:
            return ""
        sft = f" (SFT {points[0][key]:+.2f})" if points[0]["step"] == 0 else ""
        return f"  held-out {key.split('/')[1]} {points[-1][key]:+.2f} @{points[-1]['step']}{sft}"

    def close(self) -> None:
        self.metrics_f.close()
        self.samples_f.close()
        self.tracker.close()


# =========================================================================================================
# The loop's plumbing, behind one call each in train.ppo: the progress bar and the stopping rules, the non-finite
# guard, the judge, gathering across ranks, the logs, the alarm, signals, checkpoints (nothing here changes what is
# trained)
# =========================================================================================================
@dataclass
class LoopState:
    """What a resumed run restores besides weights, optimizers and RNG streams, to continue exactly."""
    moments: Any              # ppo_max.RunningMoments: Eq. 18's history
    kl_ctl: Any               # ppo_max.AdaptiveKLController: η of Eq. 19
    monitor: "CollapseMonitor"
    guard: "NonFiniteGuard"

    def state_dict(self) -> dict:
        return {"moments": self.moments.state_dict(), "kl_coef": self.kl_ctl.value,
                "monitor": self.monitor.state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.moments.load_state_dict(d["moments"])
        self.kl_ctl.value = d["kl_coef"]
        self.monitor.load_state_dict(d["monitor"])
        self.guard.load_state_dict(d["guard"])


class LoopPlumbing:
    """What a PPO step does besides the algorithm, behind three calls: steps() (the progress bar and the stopping
    rules), skip() (the non-finite guard) and end_step() (the judge, gathering across ranks, metrics.jsonl and
    samples.jsonl, the §5.2 collapse alarm, signals, checkpoints). As a context manager it opens the logs and takes
    SIGINT/SIGTERM for the loop (a signal finishes the step, checkpoints and exits; under pdb Ctrl-C stays pdb's);
    finish() ends the run after it. Time spent under a debugger is not counted as the PPO stage's."""

    def __init__(self, run, log: "RunLog", state: LoopState, ckpts, judge, policy_opt, tokenizer, device,
                 start: int, group: int = 1, heldout: Callable[[int], dict] | None = None):
        """run: the RunConfig; log: the run's RunLog; ckpts: its checkpoint.RunCheckpoints; judge: the judge
        (plumbing.run.Judge: .score, .key) or None; policy_opt: the policy's optimizer (its learning rate is logged);
        heldout: the held-out point of a step (eval.heldout_point with the run's arguments), or None."""
        self.run, self.log, self.state, self.ckpts, self.judge, self.policy_opt = run, log, state, ckpts, judge, \
            policy_opt
        self.tokenizer, self.device, self.start, self.group, self.heldout = tokenizer, device, start, group, heldout
        self.point, self.debugged = {}, 0.0  # the step's held-out point; seconds of steps spent under a debugger
        self.ended = {"stop_reason": None, "signal": None, "path": None}
        self.seconds = 0.0                   # the PPO stage's time, set on exit (debugged time left out)

    def __enter__(self) -> "LoopPlumbing":
        self.t_stage = time.time()
        self.interrupt = GracefulExit().__enter__()  # SIGINT/SIGTERM: finish the step, checkpoint, exit
        return self

    def __exit__(self, *exc) -> None:
        self.interrupt.__exit__(*exc)
        self.log.close()
        self.seconds = time.time() - self.t_stage - self.debugged

    def steps(self):
        """start … steps − 1 under the progress bar (none with --break-at: it would draw over pdb's prompt), until
        a stop reason or a signal ends the loop; at every --heldout-every step, first the held-out point of the
        policy as it is (logged with that step)."""
        for step in self.log.steps(self.start, self.run.steps, bar=self.run.break_at < 0):
            if self.ended["stop_reason"] or self.ended["signal"]:
                return
            every = self.run.heldout_every
            self.point = self.heldout(step) if self.heldout and every and step % every == 0 else {}
            self.t0 = time.time()
            yield step
            if debugger_active():  # the step ran under pdb: its time is the reader's, not training's
                self.debugged += time.time() - self.t0

    def skip(self, step: int, bad: str | None) -> bool:
        """The non-finite guard: True when `bad` names a NaN/inf of this step (its update is, or was, skipped);
        after --max-bad-steps such steps in a row, stop with the last good checkpoint intact."""
        if bad is None or not self.state.guard.step(step, bad):
            return False
        if self.state.guard.should_stop:
            self.ended["stop_reason"] = (f"{self.run.max_bad_steps} consecutive steps with non-finite values; last "
                                         f"good checkpoint: {find_latest(self.run.out)}")
        return True

    def end_step(self, step: int, exp: dict, upd: dict, prompts: list[str], finished: torch.Tensor) -> None:
        """Step (7): the judge's rewards, every metric (lists are the global batch), the alarm; then a signal or
        --save-every checkpoints the run."""
        if self.skip(step, (upd.get("guard/nonfinite") or [None])[0]):  # an optimizer step was NaN/inf
            return
        self.state.guard.ok()  # a step with everything finite: the count of bad steps in a row starts again
        judge = self.judge
        texts = [self.tokenizer.decode(r[k.bool()], skip_special_tokens=True)
                 for r, k in zip(exp["response"], exp["mask"])]
        with torch.no_grad():  # a reward-model judge reads the very ids (B, L) the proxy scored, with the same mask
            judged = judge.score(prompts, texts, finished, torch.cat([exp["query"], exp["response"]], 1),
                                 torch.cat([exp["query_mask"], exp["mask"]], 1)) if judge else None
        G = self.group  # the global batch in prompt order, each group of G responses whole
        prompts, texts = engine.gather_list(prompts, G), engine.gather_list(texts, G)
        judged = engine.gather_list(judged, G) if judge else None
        gold = judged if judge and judge.key == "reward/gold" else None
        metrics = {"step": step, **exp["stats"], **upd, **self.point,
                   "reward/gold": float(np.mean(gold)) if gold else None,
                   "kl/coef": self.state.kl_ctl.value, "lr/policy": self.policy_opt.param_groups[0]["lr"],
                   "response/finished": engine.gather_batch(finished.float()).mean().item(),
                   "time/step": time.time() - self.t0}
        if judge and not gold:
            metrics[judge.key] = float(np.mean(judged))  # the proxy's score vs the judge's: over-optimisation
        alarm = self.log.record(step, metrics, exp["all_scores"].tolist(), judged, prompts, texts,
                                judge.key if judge else "reward/gold")
        if alarm is not None and self.run.on_collapse == "stop":
            self.ended["stop_reason"] = f"collapse alarm at step {step}"
        if engine.any_rank(self.interrupt.requested, self.device):  # every rank stops at the same step
            self.ended["signal"] = self.interrupt.signal_name or "signal on another rank"
        done = step + 1
        every = self.run.save_every
        if self.ended["stop_reason"] or self.ended["signal"] or (every and done % every == 0):
            self.ended["path"] = self.ckpts.save(done, self.state.state_dict())


class GracefulExit:
    """SIGINT / SIGTERM set `.requested` instead of killing the process, so the loop can finish (or abandon) the
    current step, write a checkpoint and exit 0. A second signal restores the old handlers and re-delivers itself
    (Ctrl-C twice still interrupts at once). Under a debugger (debugger_active()) Ctrl-C stays the debugger's, so it
    breaks into pdb; SIGTERM is still caught.

        with GracefulExit() as stop:
            for step in ...:
                ...
                if stop.requested: save_checkpoint(...); break
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.requested = False
        self.signal_name: str | None = None
        self.installed = False
        self._old: dict[int, Any] = {}

    def install(self) -> "GracefulExit":
        if threading.current_thread() is not threading.main_thread():  # Python only allows handlers there
            return self
        for s in self.signals:
            if s == signal.SIGINT and debugger_active():  # pdb's Ctrl-C breaks into the debugger: leave it there
                continue
            self._old[s] = signal.signal(s, self._handler)
        self.installed = True
        return self

    def _handler(self, signum: int, frame) -> None:
        if self.requested:  # second signal: behave as if we had never been installed
            self.restore()
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        # os.write, not print: a handler can run in the middle of another print (buffered IO is not reentrant)
        os.write(2, f"\n{self.signal_name} received: finishing this step, then checkpoint and exit "
                    f"(send it again to stop at once)\n".encode())

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._old.clear()
        self.installed = False

    def __enter__(self) -> "GracefulExit":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def debugger_active() -> bool:
    """A debugger is tracing this process (sys.gettrace(): pdb stepping, an IDE) or owns Ctrl-C (pdb after
    `continue` with no breakpoint traces nothing, but its SIGINT handler is installed)."""
    import bdb
    return sys.gettrace() is not None or isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), bdb.Bdb)


def _is_finite(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return bool(torch.isfinite(v.detach()).all().item()) if v.is_floating_point() or v.is_complex() else True
    if isinstance(v, (int, float)):
        return math.isfinite(v)
    return bool(np.isfinite(np.asarray(v, dtype=np.float64)).all())


class NonFiniteGuard:
    """Skip an update whose scores / loss / advantages / gradient norm hold NaN or ±inf; stop after K in a row.

    check(step, {"scores": …, "loss": …}) → the name of the first non-finite value (its step is skipped and must
    not reach a checkpoint) or None. Call it as often as needed within a step; the step counts once. Call ok()
    when a step completed with everything finite: that resets the consecutive count. `.should_stop` once K
    consecutive steps were bad; the last good checkpoint is then the one to resume from.
    """

    def __init__(self, max_consecutive: int = 3, log: Callable[[str], Any] = print):
        if max_consecutive < 1:
            raise ValueError(f"NonFiniteGuard: max_consecutive must be ≥ 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.log = log
        self.consecutive = 0
        self.skipped = 0  # bad steps over the whole run
        self.last_bad: tuple[int, str] | None = None

    def check(self, step: int, tensors: Mapping[str, Any]) -> str | None:
        for name, v in tensors.items():
            if v is None or _is_finite(v):
                continue
            if self.last_bad is None or self.last_bad[0] != step:  # a step counts once
                self.consecutive += 1
                self.skipped += 1
            self.last_bad = (step, name)
            self.log(f"step {step}: non-finite {name}; update skipped "
                     f"({self.consecutive}/{self.max_consecutive} consecutive)")
            return name
        return None

    def ok(self) -> None:
        self.consecutive = 0

    def step(self, step: int, bad: str | None) -> bool:
        """The loop's one call: `bad` names the first non-finite value of this step (or None). True when the
        step's update was skipped (logged, counted, never checkpointed as if it were fine); False resets the count."""
        if bad is None:
            self.ok()
            return False
        self.check(step, {bad: float("nan")})
        return True

    @property
    def should_stop(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.consecutive, self.skipped = int(d["consecutive"]), int(d["skipped"])


def parse_args(argv: list[str]):
    """The flags of `replay` and `sweep`, every threshold and grid value checked against THRESHOLD_RANGES: one line
    `error: …` naming the flag, exit 2 (cli.fail), before any run is read. The grids become lists."""
    from plumbing import cli
    p = cli.OneLineParser(prog="monitor.py",
                          description="Replay finished runs' logs through the collapse alarm, without retraining: when "
                                      "would it have fired, and was that before the gold reward had fallen halfway "
                                      "(see gold_halfway)?")
    p.add_argument("command", choices=["replay", "sweep"])
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl and samples.jsonl)")
    defaults = CollapseMonitor()
    for name in ("kl_max", "length_growth", "ppl_drop", "tail_sigmas", "tail_frac"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    for name in ("warmup", "patience"):
        p.add_argument("--" + name, type=int, default=getattr(defaults, name))
    p.add_argument("--grid-kl", default="0.05,0.08,0.1,0.15,0.2,0.3", help="sweep: kl_max values")
    p.add_argument("--grid-patience", default="1,2,3", help="sweep: patience values")
    a = p.parse_args(argv)
    cli.check_flags(a, THRESHOLD_RANGES)
    a.grid_kl = parse_grid("--grid-kl", a.grid_kl, float, THRESHOLD_RANGES["kl_max"])
    a.grid_patience = parse_grid("--grid-patience", a.grid_patience, int, THRESHOLD_RANGES["patience"])
    return a


def parse_grid(flag: str, text: str, kind: type, spec: str) -> list:
    """A comma-separated grid flag ("0.05,0.1") as a list of `kind`, each value within `spec`; else one line naming
    the flag and the value."""
    from plumbing import cli
    values = []
    for item in text.split(","):
        try:
            value = kind(item.strip())
        except ValueError:
            cli.fail(f"{flag} {text!r}: {item.strip()!r} is not {'an integer' if kind is int else 'a number'} "
                     f"(expected comma-separated values, e.g. {'1,2,3' if kind is int else '0.05,0.1'})")
        problem = cli.check_value(value, spec)
        if problem:
            cli.fail(f"{flag} {text!r}: the value {value!r} {problem}")
        values.append(value)
    return values


def main(argv: list[str] | None = None) -> None:
    """`python -m plumbing.monitor`: the worked example. `replay RUN_DIR ...`: each run's first alarm against its gold-halfway
    step. `sweep RUN_DIR ...`: a grid of kl_max × patience over the same runs. Other thresholds: flags. A bad flag,
    a wrong path or a damaged log is one line `error: …`, exit 2."""
    from plumbing import cli
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        return worked_example()
    a = parse_args(argv)
    thresholds = {k: v for k, v in vars(a).items() if k not in ("command", "runs", "grid_kl", "grid_patience")}
    try:
        runs = [load_run(d) for d in a.runs]
    except (OSError, ValueError) as e:  # a wrong path or a damaged log (its message names the file), as train.py's
        cli.fail(str(e).replace("\n", " "))
    if a.command == "replay":
        print("thresholds:", thresholds)
        print(f"{'run':<32}{'steps':>6}{'alarm':>7}{'gold halfway':>14}  verdict [first alarm's reasons]")
        for run in runs:
            r = replay(run, **thresholds)
            print(f"{r['run']:<32}{r['steps']:>6}{str(r['alarm']):>7}{str(r['gold_halfway']):>14}  {verdict(r)}"
                  + (f"  [{'; '.join(r['reasons'])}]" if r["reasons"] else ""))
        return
    grid = {"kl_max": a.grid_kl, "patience": a.grid_patience}
    fixed = {k: v for k, v in thresholds.items() if k not in grid}
    n_collapse = sum(1 for run in runs if run["gold"] and gold_halfway(run["gold"]) is not None)
    n_kept = sum(1 for run in runs if run["gold"]) - n_collapse
    n_none = sum(1 for run in runs if not run["gold"])
    print(f"{len(runs) - n_none} runs with gold ({n_none} without, skipped): {n_collapse} collapse (gold falls "
          f"halfway and stays), {n_kept} keep their gold; fixed: {fixed}")
    print(f"{'kl_max':>7}{'patience':>9}{'in time':>9}{'late':>6}{'missed':>8}{'false alarms':>14}{'median lead':>13}")
    for r in sweep(runs, grid, **fixed):
        print(f"{r['kl_max']:>7g}{r['patience']:>9}{r['in_time']:>9}{r['late']:>6}{r['missed']:>8}{r['false']:>14}"
              f"{str(r['median_lead']):>13}")


def worked_example() -> None:
    # A synthetic vanilla-PPO run: 5 calm steps, then KL climbs 0.1/step and length grows 2 tokens/step.
    monitor = CollapseMonitor()
    for step in range(15):
        drift = max(step - 4, 0)
        metrics = {"kl/ref": 0.02 + 0.1 * drift, "response/length": 10.0 + 2.0 * drift,
                   "policy/perplexity": 2.0 - 0.05 * drift}
        scores = [-1.0, 0.0, 1.0, 2.0] if drift == 0 else [1.0 + 0.5 * drift] * 4
        alarm = monitor.update(step, metrics, scores)
        if alarm:
            print(alarm)
    print("baseline:", {k: round(v, 4) for k, v in monitor.baseline().items()})
    # collapse alarm at step 5: kl/ref 0.120 > 0.080
    # baseline: {'response/length': 10.0, 'policy/perplexity': 2.0, 'score_mean': 0.5, 'score_std': 1.118}


if __name__ == "__main__":
    main()
