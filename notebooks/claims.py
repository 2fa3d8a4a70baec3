"""The claims registry: every figure claim of the paper this project judges, each with its metric, comparison,
direction, equivalence margin and seeds, written down before the runs that judge it; the one rule that turns a
claim's runs into a verdict; and the small records that let a fresh clone compute every verdict without training.

Implements: no equation of the paper; the evidence behind docs/findings.md's table.
  MARGINS               the smallest difference that matters, one per kind of number, used everywhere
  VARIANTS              every run a claim reads: name → train.py flags (PPO steps: 80 unless it says)
  METRICS               every number a claim reads from a run, and exactly how it is read
  CLAIMS                the registry: Claim(id, figure, sentence, parts, seeds, notebook, why)
  SECOND_STAGE          the claims planned on 20 seeds after their first ten left them undecided (second_stage_rule)
  OPERATING_POINT       the rule that sets train.py's default PPO-max (written before its pilot runs)
  judge(d, margin, direction)    THE rule for one part (below, RULE)
  combine(answers)      a claim from its parts (below, COMBINE)
  LABELS, label(answer) what an answer means: supported / no effect / contradicted / undecided (the counts unchanged)
  qualifiers(verdict)   the descriptions beside a verdict: by construction, setting, direction, engagement, scale
  verdicts(), table(), tally()   every claim from the committed records, docs/findings.md's table, the label tally
  readme_sentence(), presets_brief(), presets_sentence()   the README's and docs' sentences from the records
  show_notebook(name), holds(name)   a figure notebook's claims part by part, and one answer per claim
  runs_for(variants, seeds, notebook)  a figure's runs: in records mode (runs.MODE) the committed records of every
                                seed the notebook's claims judge; in full / small mode trained or reused as --run does
  retrained(variants)           the runs of a panel a record cannot draw (samples, models): trained here, labelled
  twin(variant, seed)           the variant whose run stands for another of the same config (the name --run used)
  heldout_curve(run)            a run's held-out gold curve − SFT's, as hgold_* read it (the figures draw it)
  record(...)           a run's record under notebooks/results/ (config key, seed, code version, commit, metrics)
Run:
  python notebooks/claims.py --run [--claims ID,...]   train (or reuse) every run the registry plans, write records
  python notebooks/claims.py --table                   the verdict table of docs/findings.md (markdown)
  python notebooks/claims.py --tally                   one JSON line: how many claims carry each label
  python notebooks/claims.py --write-docs              the table and tally into docs/findings.md, --summary into README
  python notebooks/claims.py --show ID                 one claim, part by part, with its numbers
  python notebooks/claims.py --operating-point         the pilot runs of OPERATING_POINT and the candidate it picks
  python notebooks/claims.py --summary [--run]         the README's table: SFT, PPO-max, vanilla PPO, best-of-4
  python notebooks/claims.py --records                 every record again from the cached runs (no training)
  python notebooks/claims.py --registry v1 --table     the exploratory registry (v1), as committed; v2 is the default
--run trains through notebooks/runs.py (a pool of single-thread worker processes, one per core; cached runs whose
config and code match are reused) and prints the runs per hour at the end. Everything else reads
notebooks/results/ only.

Why this file exists: a verdict is computed, never typed. Nothing below is edited after the results it judges
without a dated note in docs/findings.md ("Changes to the registry") saying what changed and why, and the verdict
under the original plan is reported beside it.

References: Lakens 2017 (equivalence tests, TOST); Henderson et al. 2018, Agarwal et al. 2021, Colas et al. 2018
(seeds, intervals and power in RL comparisons).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# =====================================================================================================================
# The margins: the smallest difference that would change what a reader does, one per kind of number. Chosen from
# what the numbers mean, never from results.
# =====================================================================================================================
MARGINS = {
    "gold": 0.25,       # gold reward per response: less than one filler word (gold charges 0.3 for it)
    "score": 0.25,      # the proxy reward model's score, on gold's scale of one filler word
    "win-lose": 0.10,   # ten percentage points of held-out comparisons with SFT
    "kl": 0.01,         # nats per token: ~0.1 nats per response of 9 tokens, a sixth of best-of-4's 0.64 nats
    "length": 1.0,      # tokens per response
    "ppl": 0.10,        # perplexity, as a relative change (ratio − 1)
    "entropy": 0.05,    # nats per token
    "vf": 0.05,         # value loss (squared return error)
    "pg": 0.10,         # policy-gradient loss
    "adv": 0.02,        # advantage spread (std over tokens, per step)
    "steps": 8.0,       # a step count (KL onset, the step gold falls below SFT): one held-out-curve interval
    "skew": 0.5,        # skewness of the reward model's scores over a batch
    "share": 0.10,      # a share or fraction (of pairs, of the accuracy gain)
    "acc": 0.03,        # reward-model accuracy
    "slope": 0.05,      # score change per added filler token
}

SEEDS = tuple(range(10))     # every comparison between variants: ten seeds (each its own world, SFT model and RM)
SEEDS20 = tuple(range(20))   # where the pilot sds say ten cannot decide and twenty can (Claim.why says which)
# the seeds whose curves the committed figures draw (runs_for in the notebooks). Any seeds would do: every verdict
# reads the records of all its planned seeds, never the plotted runs. 6-9 are registry seeds, so the figures reuse
# runs the registry has made rather than adding their own.
PLOT_SEEDS = (6, 7, 8, 9)
STEPS = 80                   # train.py's default budget of PPO steps
KL_ONSET = 0.1               # nats/token: the drift threshold of the KL onset (5-step trailing mean)

# =====================================================================================================================
# The variants: train.py flags. "ppo-max" is train.py's default as OPERATING_POINT sets it; every other variant is a
# change of it (or of --preset vanilla) that a figure ablates.
# =====================================================================================================================
V = ("--preset", "vanilla")
ENT_CLIP = 1.0   # the entropy bonus's clip δ, the SFT policy's mean token entropy on its own samples (1.02 in the
#                  pilot): the bonus stops acting above δ, so it acts as soon as the policy is less random than SFT;
#                  ±10 % around it are 0.9 and 1.1 (Fig. 16). A δ far below 1 (0.7) would leave it inert until late.
VARIANTS: dict[str, tuple] = {
    # vanilla PPO and one trick added to it
    "vanilla": V,
    "kl-0.05": V + ("--kl-coef", "0.05"), "kl-0.1": V + ("--kl-coef", "0.1"), "kl-0.2": V + ("--kl-coef", "0.2"),
    "is": V + ("--importance-sampling",),
    "ent-0.01-clip": V + ("--entropy-coef", "0.01", "--entropy-clip", str(ENT_CLIP)),
    "ent-0.01-clip-0.9": V + ("--entropy-coef", "0.01", "--entropy-clip", "0.9"),
    "ent-0.01-clip-1.1": V + ("--entropy-coef", "0.01", "--entropy-clip", "1.1"),
    "ent-0.01-noclip": V + ("--entropy-coef", "0.01"),
    "ent-0.1-clip": V + ("--entropy-coef", "0.1", "--entropy-clip", str(ENT_CLIP)),
    "ent-0.1-clip-0.9": V + ("--entropy-coef", "0.1", "--entropy-clip", "0.9"),
    "ent-0.1-clip-1.1": V + ("--entropy-coef", "0.1", "--entropy-clip", "1.1"),
    "ent-0.1-noclip": V + ("--entropy-coef", "0.1"),
    "rscale": V + ("--reward-scale",),
    "rnorm-0.3": V + ("--reward-norm", "--reward-clip", "0.3"),
    "rnorm-0.8": V + ("--reward-norm", "--reward-clip", "0.8"),
    "rnorm-5": V + ("--reward-norm", "--reward-clip", "5"),          # score reparameterisation as PPO-max has it
    "advnorm-0.12": V + ("--adv-norm", "--adv-clip", "0.12"),
    "advnorm-0.5": V + ("--adv-norm", "--adv-clip", "0.5"),
    "rnorm-advnorm": V + ("--reward-norm", "--reward-clip", "0.8", "--adv-norm", "--adv-clip", "0.5"),
    "rnorm-vclip": V + ("--reward-norm", "--reward-clip", "0.8", "--value-clip", "0.2"),
    "rnorm-advnorm-vclip": V + ("--reward-norm", "--reward-clip", "0.8", "--adv-norm", "--adv-clip", "0.5",
                                "--value-clip", "0.2"),
    "clip-0.1": V + ("--clip-eps", "0.1"), "clip-0.4": V + ("--clip-eps", "0.4"),
    # PPO-max and one part changed or removed
    "ppo-max": (),
    "ppo-max-kl0.1": ("--kl-coef", "0.1"), "ppo-max-kl0.2": ("--kl-coef", "0.2"),
    "no-kl": ("--kl-coef", "0"), "no-rnorm": ("--no-reward-norm", "--reward-clip", "0"), "no-ptx": ("--ptx-coef", "0"),
    "no-vclip": ("--value-clip", "0"), "no-critic-pretrain": ("--critic-pretrain-steps", "0"),
    "gclip-0": ("--grad-clip", "0"), "gclip-0.5": ("--grad-clip", "0.5"),
    "advnorm": ("--adv-norm", "--adv-clip", "0.5"), "advnorm-no-vclip": ("--adv-norm", "--adv-clip", "0.5",
                                                                       "--value-clip", "0"),
    "lam-0": ("--lam", "0"), "lam-1": ("--lam", "1"),
    # Fig. 8: ptx on the world's pretraining text in every run, so that ptx cannot do the missing SFT's job
    "ptx-pretrain": ("--ptx-data", "pretrain"),
    "policy-pretrained": ("--ptx-data", "pretrain", "--policy-init", "pretrained"),
    "critic-sft": ("--ptx-data", "pretrain", "--critic-init", "sft"),
    "ptx-pretrain-no-critic-pretrain": ("--ptx-data", "pretrain", "--critic-pretrain-steps", "0"),
    # the paper's released scripts, and PPO-max over a long run (Fig. 9: 400 steps, a checkpoint every 100)
    "moss-release": ("--preset", "moss-release"),
    "ppo-max-long": ("--save-every", "100", "--keep-last", "1"),
    # no claim reads it: the README's comparison of how far PPO-max travels, and what it gains, with best-of-4
    "bon-4": ("--method", "best-of-n", "--bon-n", "4"),
}
LONG = {"ppo-max-long": 400}   # variants whose PPO budget is not STEPS


def steps_of(variant: str) -> int:
    return R.long.get(variant, STEPS)


# =====================================================================================================================
# The metrics: how each number is read from a run. "Held-out" = the run's held-out prompts, never trained on.
#   final_*   summary.json's final evaluation: the final policy, 4 samples per held-out prompt, sampled as the paper
#             evaluates (top-p 0.9, temperature 0.8), judged by gold (the synthetic human); SFT on the same prompts
#             and sampling seed; win / tie / lose pair them by prompt and sample.
#   hgold_*   the held-out curve (train.py --heldout-every 8: the policy at the top of steps 0, 8, 16, …, one sample
#             per prompt, the same sampling; step 0 is the SFT policy) and, as its last point, the final evaluation.
#             Collapsing variants are read here rather than at the end only: their final gold depends mostly on
#             when a collapse happens to start (sd 2–3 between seeds against effects of 0.1–1), the curve's mean does
#             not hinge on one checkpoint, and no statistic is a maximum over noisy points (a best checkpoint is
#             biased upward by about one noise sd).
#   train windows  metrics.jsonl of the training steps: first5:KEY / first10:KEY (the first 5 / 10 steps), last10:KEY
#             (the last 10), first8th:KEY / last8th:KEY (the first / last eighth of the run: 50 of 400 steps),
#             mean:KEY (every step).
# =====================================================================================================================
TRAIN_KEYS = ("reward/score", "reward/gold", "kl/ref", "policy/perplexity", "response/length", "policy/entropy",
              "loss/pg", "loss/vf", "adv/std")


def _curve(run: dict) -> list[tuple[int, float]]:
    """[(step, held-out gold)]: every --heldout-every point of the run, then the final evaluation at `steps`."""
    pts = [(m["step"], m["heldout/gold"]) for m in run["metrics"] if m.get("heldout/gold") is not None]
    return pts + [(run["summary"]["steps"], run["summary"]["final"]["gold_reward"])]


def _fall_step(run: dict) -> float:
    """The first point of the held-out curve from which gold stays below the SFT policy's (step 0) to the end;
    steps + 8 when it never does (a censored count, 8 = one curve interval past the end)."""
    pts = _curve(run)
    sft = pts[0][1]
    fall = None
    for step, gold in pts[1:]:
        if gold < sft:
            fall = step if fall is None else fall
        else:
            fall = None
    return float(run["summary"]["steps"] + 8 if fall is None else fall)


def _kl_onset(run: dict) -> float:
    """The first training step whose 5-step trailing mean KL (kl/ref) exceeds KL_ONSET; the step count if never."""
    kl = np.array([m["kl/ref"] for m in run["metrics"]], float)
    c = np.cumsum(np.insert(kl, 0, 0.0))
    n = np.arange(1, len(kl) + 1)
    smooth = (c[n] - c[np.maximum(n - 5, 0)]) / np.minimum(n, 5)
    above = np.nonzero(smooth > KL_ONSET)[0]
    return float(above[0] if len(above) else len(kl))


def _skew(x) -> float:
    """Sample skewness m3 / m2^1.5 (population moments)."""
    d = np.asarray(x, float) - np.mean(x)
    return float(np.mean(d ** 3) / np.mean(d ** 2) ** 1.5) if np.mean(d ** 2) > 0 else 0.0


def _window(run: dict, key: str, which: str) -> float:
    y = np.array([np.nan if m.get(key) is None else m[key] for m in run["metrics"]], float)
    k = max(len(y) // 8, 1)
    sl = {"first5": slice(0, 5), "first10": slice(0, 10), "last10": slice(-10, None), "first8th": slice(0, k),
          "last8th": slice(-k, None), "mean": slice(None)}[which]
    return float(np.nanmean(y[sl]))


RUN_METRICS = {
    "final_gold": lambda r: r["summary"]["final"]["gold_reward"],
    "final_gold_vs_sft": lambda r: r["summary"]["final"]["gold_reward"] - r["summary"]["sft"]["gold_reward"],
    "win_lose": lambda r: r["summary"]["win_rate_vs_sft"]["win"] - r["summary"]["win_rate_vs_sft"]["lose"],
    "final_kl": lambda r: r["summary"]["final"]["kl"],
    "final_kl_seq": lambda r: r["summary"]["frontier"]["kl_seq"],   # nats per response, sampled at temperature 1
    "final_length": lambda r: r["summary"]["final"]["response_length"],
    "final_score": lambda r: r["summary"]["final"]["reward"],
    **{k: (lambda r, k=k: r["summary"]["win_rate_vs_sft"][k]) for k in ("win", "tie", "lose")},
    # the held-out curve, each relative to its step-0 point (the SFT policy)
    "hgold_auc": lambda r: float(np.mean([g for _, g in _curve(r)[1:]]) - _curve(r)[0][1]),
    "hgold_early": lambda r: float(np.mean([g for s, g in _curve(r) if 8 <= s <= 32]) - _curve(r)[0][1]),
    "hgold_end": lambda r: float(np.mean([g for _, g in _curve(r)[-3:]]) - _curve(r)[0][1]),
    "hgold_fall": _fall_step,
    "kl_onset": _kl_onset,
    "skew_first": lambda r: _skew(r["samples"][0]["scores"]),
    "skew_last10": lambda r: float(np.mean([_skew(s["scores"]) for s in r["samples"][-10:]])),
    **{f"{w}:{k}": (lambda r, k=k, w=w: _window(r, k, w)) for k in TRAIN_KEYS
       for w in ("first5", "first10", "last10", "first8th", "last8th", "mean")},
}


def _rm_share20(base: dict) -> float:
    """Share of the held-out accuracy gain (final − step 0) reached at 20 % of the reward model's steps (linear
    interpolation between the evaluations around it)."""
    steps = np.array([r["step"] for r in base["rm_log"]], float)
    acc = np.array([r["heldout_accuracy"] for r in base["rm_log"]], float)
    at20 = float(np.interp(0.2 * steps[-1], steps, acc))
    return (at20 - acc[0]) / (acc[-1] - acc[0])


def _rm_after20(base: dict) -> float:
    """Held-out accuracy at the end − at 20 % of the steps: what the remaining 80 % add (a plateau adds ~0)."""
    steps = np.array([r["step"] for r in base["rm_log"]], float)
    acc = np.array([r["heldout_accuracy"] for r in base["rm_log"]], float)
    return float(acc[-1] - np.interp(0.2 * steps[-1], steps, acc))


def _rm_gold_agree(base: dict) -> float:
    """Over held-out pairs of helpful prompts whose gold rewards differ: the share the reward model orders like gold
    (the gold of the base's world, base["world"]: world B has no harmful prompts)."""
    import toy_world
    world = toy_world.world(base.get("world", "a"))
    agree = []
    for r, c, j in zip(base["pairs_heldout"], base["scores"]["chosen"], base["scores"]["rejected"]):
        g = world.gold_reward(r["prompt"], r["chosen"]) - world.gold_reward(r["prompt"], r["rejected"])
        if g != 0 and not getattr(world.parse_prompt(r["prompt"]), "harmful", False):
            agree.append(np.sign(c - j) == np.sign(g))
    return float(np.mean(agree))


FINAL_METRICS = ("final_gold", "final_gold_vs_sft", "win_lose", "final_kl", "final_kl_seq", "final_length",
                 "final_score", "win", "tie", "lose")   # what a run without PPO steps (best-of-n, DPO) has

BASE_METRICS = {
    "rm_acc_final": lambda b: b["rm_log"][-1]["heldout_accuracy"],
    "rm_share20": _rm_share20,
    "rm_after20": _rm_after20,
    "margin_pos": lambda b: float(np.mean(np.array(b["scores"]["chosen"]) > np.array(b["scores"]["rejected"]))),
    "rm_gold_agree": _rm_gold_agree,
    "length_bias": lambda b: b["length_bias"]["rm_slope"] - b["length_bias"]["gold_slope"],
}
METRICS = {**RUN_METRICS, **BASE_METRICS}


# =====================================================================================================================
# The registry
# =====================================================================================================================
@dataclass(frozen=True)
class Part:
    """One test: per seed, metric of variant `a` − the same metric of variant `b` (paired by seed), or − metric
    `minus` of the same run of `a` (a window against another), or − `const`; perplexities (margin "ppl") compare as
    a ratio − 1. Read against the direction the paper claims: "higher", "lower", "alike" (no difference that matters)
    or "differs" (a difference of either sign). `margin` names MARGINS' entry; `what` says it in words."""
    what: str
    metric: str
    a: str
    b: str | None
    direction: str
    margin: str
    const: float = 0.0
    minus: str | None = None


@dataclass(frozen=True)
class Claim:
    id: str
    figure: str
    sentence: str            # the paper's claim, in docs/paper.md's words
    parts: tuple[Part, ...]
    seeds: tuple[int, ...] = SEEDS
    notebook: str = ""
    why: str = ""            # why these metrics and this many seeds (the pilot: the 3-5-seed runs of the old table)
    construction: str = ""   # what the world or a default was tuned to show about this claim ("by construction")


def P(what, metric, a, b, direction, margin, const=0.0, minus=None) -> Part:
    return Part(what, metric, a, b, direction, margin, const, minus)


def W(what, key, a, direction, margin, first="first5", last="last10") -> Part:
    """A run against itself: the training window `last` of metrics.jsonl key `key` − the window `first`."""
    return Part(what, f"{last}:{key}", a, None, direction, margin, minus=f"{first}:{key}")


BASE = "base"   # the variant name of a seed's base (SFT + reward model): the claims on the reward model read it
# what the frozen world was tuned to show (docs/findings.md, "How the world and the defaults were chosen")
VANILLA_TUNED = ("the annotators' length bias (0.7 log-odds per word) and the policy learning rate (7e-5) were "
                 "chosen, with the world, until vanilla PPO's held-out gold peaked after tens of steps and fell below "
                 "SFT within 80 steps on seeds 0-2")

CLAIMS: list[Claim] = [
    # ----------------------------------------------------------------------------------------- the reward model (§4)
    Claim("fig3", "3", "RM accuracy: most of the gain in the first ~20 % of the steps, then a plateau", (
        P("share of the accuracy gain reached by 20 % of the steps − ½", "rm_share20", BASE, None, "higher", "share",
          0.5),
        P("accuracy at the end − at 20 % of the steps", "rm_after20", BASE, None, "alike", "acc"),
    ), notebook="rm", why="held-out accuracy against the labels every 10 reward-model steps (rm_log.json); 'most' "
                          "read as more than half"),
    Claim("fig2", "2", "r(chosen) − r(rejected) on held-out pairs mostly positive; the RM roughly aligned", (
        P("share of held-out margins > 0 − ½", "margin_pos", BASE, None, "higher", "share", 0.5),
        P("share of helpful held-out pairs the RM orders like gold − ½", "rm_gold_agree", BASE, None, "higher",
          "share", 0.5),
    ), notebook="rm", why="'aligned' read against gold, which the paper cannot see: better than chance"),
    Claim("sec4.3", "§4.3", "RMs prefer longer answers beyond their quality", (
        P("RM − gold score change per filler token added to a correct answer", "length_bias", BASE, None, "higher",
          "slope"),
    ), notebook="rm"),
    # ---------------------------------------------------------------------------------- vanilla PPO's collapse (§5.2)
    Claim("fig4-reward", "4", "vanilla PPO: the reward rises and the losses converge", (
        W("RM score, last 10 − first 5 steps", "reward/score", "vanilla", "higher", "score"),
        P("PG loss over the last 10 steps (converged: near 0)", "last10:loss/pg", "vanilla", None, "alike", "pg"),
        W("VF loss, last 10 − first 5 steps", "loss/vf", "vanilla", "lower", "vf"),
    ), notebook="vanilla_collapse"),
    Claim("fig4-winrate", "4", "… while the win rate against SFT peaks, then falls", (
        P("held-out gold over steps 8–32 − SFT's (step 0)", "hgold_early", "vanilla", None, "higher", "gold"),
        P("held-out gold over the last 3 points − SFT's", "hgold_end", "vanilla", None, "lower", "gold"),
    ), notebook="vanilla_collapse", why="the held-out curve's mean over a window, not its best point (biased up)",
        construction=VANILLA_TUNED),
    Claim("fig4-drift", "4", "vanilla PPO: KL ↑, perplexity ↓, length ↑", (
        W("KL, last 10 − first 5 steps", "kl/ref", "vanilla", "higher", "kl"),
        W("perplexity, last 10 / first 5 steps − 1", "policy/perplexity", "vanilla", "lower", "ppl"),
        W("length, last 10 − first 5 steps", "response/length", "vanilla", "higher", "length"),
    ), notebook="vanilla_collapse", construction=VANILLA_TUNED),
    Claim("fig13", "13", "the reward distribution is stable, then grows a long tail after the collapse", (
        P("PPO-max's skewness of the RM scores, last 10 steps − step 0", "skew_last10", "ppo-max", None, "alike",
          "skew", minus="skew_first"),
        P("|Δ skewness| of vanilla − of PPO-max", "skew_delta", "vanilla", "ppo-max", "higher", "skew"),
    ), notebook="vanilla_collapse"),
    # --------------------------------------------------------------------------------------------- PPO-max (§5.4)
    Claim("fig9", "9", "PPO-max over a long run: the reward rises, KL stays small, length and perplexity flat", (
        W("RM score, last − first eighth of 400 steps", "reward/score", "ppo-max-long", "higher", "score",
          "first8th", "last8th"),
        P(f"KL over the last eighth − {KL_ONSET} nats/token (the drift threshold)", "last8th:kl/ref", "ppo-max-long",
          None, "lower", "kl", KL_ONSET),
        W("length, last − first eighth", "response/length", "ppo-max-long", "alike", "length", "first8th",
          "last8th"),
        W("perplexity, last / first eighth − 1", "policy/perplexity", "ppo-max-long", "alike", "ppl", "first8th",
          "last8th"),
    ), notebook="ppo_max", why="'small' read against the KL onset threshold of Fig. 6's drift"),
    Claim("fig10-style", "10-style (new)", "vanilla < score reparameterisation only < KL only ≈ PPO-max (win − lose "
          "against SFT; the paper's argument, never measured by win rate)", (
        P("win − lose, reward norm + clip only − vanilla", "win_lose", "rnorm-5", "vanilla", "higher", "win-lose"),
        P("win − lose, KL only − reward norm + clip only", "win_lose", "kl-0.05", "rnorm-5", "higher", "win-lose"),
        P("win − lose, PPO-max − KL only", "win_lose", "ppo-max", "kl-0.05", "alike", "win-lose"),
    ), seeds=SEEDS20, notebook="win_rates", why="20 seeds: the pilot's PPO-max − KL only (+0.05, sd 0.10) needs ~14 "
                                                 "to show equivalence at ±0.1"),
    Claim("leave-one-out", "leave-one-out (new)", "each of PPO-max's parts is needed", tuple(
        P(f"win − lose, PPO-max − without {what}", "win_lose", "ppo-max", v, "higher", "win-lose")
        for what, v in [("the KL penalty", "no-kl"), ("reward norm + clip", "no-rnorm"), ("ptx", "no-ptx"),
                        ("value clipping", "no-vclip"), ("critic pre-training", "no-critic-pretrain"),
                        ("gradient clipping", "gclip-0")]), notebook="win_rates"),
    # ---------------------------------------------------------------------------- score reparameterisation (§5.3.1)
    Claim("fig6-scale", "6", "reward scaling ≈ vanilla", (
        P("held-out gold over the run (curve mean − SFT), scaling − vanilla", "hgold_auc", "rscale", "vanilla",
          "alike", "gold"),
        P("KL onset step, scaling − vanilla", "kl_onset", "rscale", "vanilla", "alike", "steps"),
    ), notebook="score_reparam"),
    Claim("fig6-rnorm", "6", "reward normalisation + clipping (δ 0.3 / 0.8) delays the drift but does not prevent it",
          tuple(p for d in ("0.3", "0.8") for p in (
              P(f"KL onset, δ {d} − vanilla", "kl_onset", f"rnorm-{d}", "vanilla", "higher", "steps"),
              P(f"KL over the last 10 steps at δ {d} − {KL_ONSET} (it still drifts)", "last10:kl/ref", f"rnorm-{d}",
                None, "higher", "kl", KL_ONSET))), notebook="score_reparam"),
    Claim("fig6-advnorm", "6", "advantage normalisation + clipping (δ 0.12 / 0.5) delays the drift but does not "
          "prevent it", tuple(p for d in ("0.12", "0.5") for p in (
              P(f"KL onset, δ {d} − vanilla", "kl_onset", f"advnorm-{d}", "vanilla", "higher", "steps"),
              P(f"KL over the last 10 steps at δ {d} − {KL_ONSET} (it still drifts)", "last10:kl/ref",
                f"advnorm-{d}", None, "higher", "kl", KL_ONSET))), notebook="score_reparam"),
    Claim("fig14", "14", "mixing clips on the advantage and the value conflicts", (
        P("interaction of advantage norm × value clip on vanilla + reward norm: (A+C − A) − (C − neither), "
          "win − lose", "interaction_vanilla", "rnorm-advnorm-vclip", None, "lower", "win-lose"),
        P("the same on PPO-max", "interaction_ppomax", "advnorm", None, "lower", "win-lose"),
    ), notebook="score_reparam", why="the pilot: +0.09 (sd 0.3) on vanilla, −0.007 (sd 0.03) on PPO-max"),
    # ------------------------------------------------------------------------------------ policy constraints (§5.3.2)
    Claim("fig7-kl", "7", "the KL penalty gives lasting stability", (
        P("KL over the last 10 steps, η 0.05 − vanilla", "last10:kl/ref", "kl-0.05", "vanilla", "lower", "kl"),
        P("held-out gold over the run, η 0.05 − vanilla", "hgold_auc", "kl-0.05", "vanilla", "higher", "gold"),
    ), notebook="policy_constraints"),
    Claim("fig7-is", "7", "importance sampling steadies training but lowers the reward", (
        P("KL over the last 10 steps, IS − vanilla", "last10:kl/ref", "is", "vanilla", "lower", "kl"),
        P("RM score over the last 10 steps, IS − vanilla", "last10:reward/score", "is", "vanilla", "lower", "score"),
    ), notebook="policy_constraints"),
    Claim("fig7-entropy", "7", "the entropy bonus gives stability", (
        P("KL over the last 10 steps, entropy bonus (0.01, clip δ 1.0) − vanilla", "last10:kl/ref", "ent-0.01-clip",
          "vanilla", "lower", "kl"),
        P("held-out gold over the run, entropy bonus − vanilla", "hgold_auc", "ent-0.01-clip", "vanilla", "higher",
          "gold"),
    ), notebook="policy_constraints"),
    Claim("fig15-vanilla", "15", "η 0.05 / 0.1 / 0.2: larger η → lower reward, lower KL (on vanilla PPO, raw RM "
          "scores)", tuple(P(f"{k} over the last 10 steps, η {b} − {a}", f"last10:{key}", f"kl-{b}", f"kl-{a}",
                              "lower", m) for a, b in (("0.05", "0.1"), ("0.1", "0.2"))
                            for k, key, m in (("RM score", "reward/score", "score"), ("KL", "kl/ref", "kl"))),
          notebook="policy_constraints"),
    Claim("fig15-ppomax", "15", "η 0.05 / 0.1 / 0.2: larger η → lower reward, lower KL (on PPO-max, normalised "
          "rewards)", tuple(P(f"{k} over the last 10 steps, η {b} − {a}", f"last10:{key}", vb, va, "lower", m)
                            for (a, va), (b, vb) in ((("0.05", "ppo-max"), ("0.1", "ppo-max-kl0.1")),
                                                     (("0.1", "ppo-max-kl0.1"), ("0.2", "ppo-max-kl0.2")))
                            for k, key, m in (("RM score", "reward/score", "score"), ("KL", "kl/ref", "kl"))),
          notebook="policy_constraints", why="PPO-max's default η is 0.05"),
    *[Claim(f"fig16-diverges-{w}", "16", f"the entropy bonus without its clip diverges (weight {w}"
            f"{', the paper' if w == '0.01' else ''})", (
        P("mean token entropy over the last 10 steps, no clip − clip δ 1.0", "last10:policy/entropy",
          f"ent-{w}-noclip", f"ent-{w}-clip", "higher", "entropy"),
        P("held-out gold over the run, no clip − clip δ 1.0", "hgold_auc", f"ent-{w}-noclip", f"ent-{w}-clip",
          "lower", "gold"),
    ), notebook="policy_constraints") for w in ("0.01", "0.1")],
    *[Claim(f"fig16-sensitive-{w}", "16", f"very sensitive to the clip: a 10 % change of δ fails (weight {w})", (
        P("held-out gold over the run, δ 0.9 − δ 1.0", "hgold_auc", f"ent-{w}-clip-0.9", f"ent-{w}-clip", "differs",
          "gold"),
        P("held-out gold over the run, δ 1.1 − δ 1.0", "hgold_auc", f"ent-{w}-clip-1.1", f"ent-{w}-clip", "differs",
          "gold"),
    ), notebook="policy_constraints") for w in ("0.01", "0.1")],
    # ------------------------------------------------------------------------------------- initialisation (§5.3.3)
    Claim("fig8-policy", "8", "a policy not initialised from SFT collapses: KL and perplexity explode", (
        P("KL over the last 10 steps, pretrained − SFT-initialised", "last10:kl/ref", "policy-pretrained",
          "ptx-pretrain", "higher", "kl"),
        P("perplexity over the last 10 steps, pretrained / SFT-initialised − 1", "last10:policy/perplexity",
          "policy-pretrained", "ptx-pretrain", "higher", "ppl"),
        W("the pretrained policy's KL, last 10 − first 5 steps", "kl/ref", "policy-pretrained", "higher", "kl"),
        W("its perplexity, last 10 / first 5 steps − 1", "policy/perplexity", "policy-pretrained", "higher", "ppl"),
    ), notebook="initialization", why="every run of Fig. 8 has ptx on pretraining text (--ptx-data pretrain)"),
    Claim("fig8-critic", "8", "the critic's initialisation (RM vs SFT) matters only early", (
        P("VF loss over the first 5 steps, critic from SFT − from the RM", "first5:loss/vf", "critic-sft",
          "ptx-pretrain", "higher", "vf"),
        P("VF loss over the last 10 steps, from SFT − from the RM", "last10:loss/vf", "critic-sft", "ptx-pretrain",
          "alike", "vf"),
        P("held-out gold, from SFT − from the RM", "final_gold", "critic-sft", "ptx-pretrain", "alike", "gold"),
    ), notebook="initialization", why="both critics are pre-trained first (PPO-max's recipe), as the paper's"),
    Claim("fig8-pretrain", "8 / §5.4", "pre-training the critic steadies the start", (
        P("VF loss over the first 5 steps, without − with critic pre-training", "first5:loss/vf",
          "ptx-pretrain-no-critic-pretrain", "ptx-pretrain", "higher", "vf"),
    ), notebook="initialization"),
    # ------------------------------------------------------------------------------------ secondary tricks (App. C)
    Claim("fig17", "17", "PPO-clip ε without a KL penalty: ε changes little, and none gives lasting stability", (
        P("held-out gold over the run, ε 0.1 − 0.2", "hgold_auc", "clip-0.1", "vanilla", "alike", "gold"),
        P("held-out gold over the run, ε 0.4 − 0.2", "hgold_auc", "clip-0.4", "vanilla", "alike", "gold"),
        *[P(f"held-out gold over the last 3 points − SFT's, ε {e}", "hgold_end", v, None, "lower", "gold")
          for e, v in (("0.1", "clip-0.1"), ("0.2", "vanilla"), ("0.4", "clip-0.4"))],
    ), seeds=SEEDS20, notebook="secondary_tricks", why="20 seeds: the pilot's ε 0.1 − 0.2 (+2.0 gold, sd 2.1) needs "
                                                        "~12 to decide a direction"),
    Claim("fig18", "18", "global gradient clipping 0 / 0.5 / 1.0: hard to tell apart", (
        P("held-out gold, clip 0 − 1.0", "final_gold", "gclip-0", "ppo-max", "alike", "gold"),
        P("held-out gold, clip 0.5 − 1.0", "final_gold", "gclip-0.5", "ppo-max", "alike", "gold"),
        P("win − lose, clip 0 − 1.0", "win_lose", "gclip-0", "ppo-max", "alike", "win-lose"),
        P("win − lose, clip 0.5 − 1.0", "win_lose", "gclip-0.5", "ppo-max", "alike", "win-lose"),
    ), notebook="secondary_tricks"),
    Claim("fig19", "19", "GAE λ = 0 has low variance but is unstable; λ = 1 has high variance", (
        P("advantage spread (adv/std, mean over steps), λ 0 − 0.9", "mean:adv/std", "lam-0", "ppo-max", "lower", "adv"),
        P("held-out gold, λ 0 − 0.9 (unstable: worse)", "final_gold", "lam-0", "ppo-max", "lower", "gold"),
        P("advantage spread, λ 1 − 0.9", "mean:adv/std", "lam-1", "ppo-max", "higher", "adv"),
    ), notebook="secondary_tricks", why="'unstable' read as one number, the final held-out gold (no OR of tests)"),
    # --------------------------------------------------------------------------------------- the paper's release
    Claim("release", "release (new)", "PPO-max beats the settings of the paper's released scripts (reward scaling, "
          "η 0.01, no critic pre-training, no ptx, one step per rollout batch)", (
        P("win − lose, PPO-max − the release's settings", "win_lose", "ppo-max", "moss-release", "higher",
          "win-lose"),
    ), notebook="win_rates"),
]

# ---------------------------------------------------------------------------------------------------------------------
# The second stage: a change of the plan after results (docs/findings.md, "Changes to the registry", says when and why).
# A claim planned on ten seeds that came out undecided on them, every undecided part of which would be decided by 20
# seeds or fewer at its observed mean and sd (seeds_to_decide), is planned on seeds 0-19 instead: second_stage_rule()
# is that rule, and SECOND_STAGE its answer on the first ten seeds' records, taken once, before any run of seeds
# 10-19 that judges these claims (a test checks that the rule still gives this list). The verdict on 20 seeds is then
# final, whatever it is; table() prints the first stage's answer beside it. Two looks at the same 95 % rule: where
# there is no effect, the chance of a direction at either look is at most about 8 %, not 5 %.
# ---------------------------------------------------------------------------------------------------------------------
SECOND_STAGE = ("leave-one-out", "fig6-rnorm", "fig7-kl", "fig15-vanilla", "fig15-ppomax")
SECOND_STAGE_MAX = 20
FIRST_PLAN = {c.id: c.seeds for c in CLAIMS}   # the seeds each claim was planned on when the registry was committed
CLAIMS = [replace(c, seeds=SEEDS20, why=(c.why + "; " if c.why else "") + "20 seeds: the second stage (SECOND_STAGE)")
          if c.id in SECOND_STAGE else c for c in CLAIMS]

# =====================================================================================================================
# OPERATING_POINT: how train.py's default PPO-max was chosen. Written before its pilot runs; it names no figure claim.
# The target: PPO-max travels at least as far from SFT as best-of-4 does under the same proxy (best-of-n's KL is
# exactly log n − (n − 1)/n nats per response: 0.636 for n = 4), read as the final held-out KL per response at
# temperature 1 (summary.json's frontier.kl_seq), averaged over the pilot seeds.
# =====================================================================================================================
OPERATING_POINT = {
    "target_kl_seq": math.log(4) - 3 / 4,
    "pilot_seeds": (100, 101, 102),        # not among the registry's seeds
    "fixed": "η 0.05 (the paper's), 80 PPO steps (python train.py stays within ~3 minutes), every other flag as is",
    # tried in this order, the first whose pilot mean reaches the target becomes the default: ptx on the world's
    # pretraining text first (Eq. 17's D_pretrain, as the paper means it), with less weight before more; then ptx on
    # the demonstrations with less weight; only then a larger policy learning rate (it changes vanilla PPO too)
    "candidates": [
        ("ptx pretrain 0.5", ("--ptx-data", "pretrain", "--ptx-coef", "0.5")),
        ("ptx pretrain 0.25", ("--ptx-data", "pretrain", "--ptx-coef", "0.25")),
        ("ptx pretrain 0.1", ("--ptx-data", "pretrain", "--ptx-coef", "0.1")),
        ("ptx sft 0.25", ("--ptx-data", "sft", "--ptx-coef", "0.25")),
        ("ptx sft 0.1", ("--ptx-data", "sft", "--ptx-coef", "0.1")),
        ("lr 1.4e-4, ptx pretrain 0.5", ("--policy-lr", "1.4e-4", "--ptx-data", "pretrain", "--ptx-coef", "0.5")),
        ("lr 1.4e-4, ptx pretrain 0.25", ("--policy-lr", "1.4e-4", "--ptx-data", "pretrain", "--ptx-coef", "0.25")),
        ("lr 1.4e-4, ptx pretrain 0.1", ("--policy-lr", "1.4e-4", "--ptx-data", "pretrain", "--ptx-coef", "0.1")),
    ],
    "if_none": "the candidate with the largest pilot mean KL, and the README says the target was missed",
}


def choose_operating_point(kl: dict[str, float]) -> tuple[str, bool]:
    """OPERATING_POINT's rule on the pilot means {candidate: mean kl_seq}: (the candidate, whether it reached the
    target)."""
    for name, _ in OPERATING_POINT["candidates"]:
        if kl[name] >= OPERATING_POINT["target_kl_seq"]:
            return name, True
    return max(kl, key=kl.get), False


# =====================================================================================================================
# THE rule, one function for every part of every claim, and the rule that combines a claim's parts
# =====================================================================================================================
RULE = ("per seed s (each seed its own world, SFT model and reward model) d_s = metric(a) − metric(b) (or − a "
        "constant); with the mean d̄, sd s (ddof 1) and n seeds: 'alike' when the 90 % interval d̄ ± t(0.95, n−1)·s/√n "
        "lies inside ±margin (tested first); else 'higher' / 'lower' when the 95 % interval d̄ ± t(0.975, n−1)·s/√n "
        "excludes 0; else 'undecided', printed with the seeds that would decide it at the observed d̄ and s")
ANSWERS = ("as the paper", "against the paper", "alike", "undecided")
COMBINE = ("a claim is 'against the paper' when any part is; else 'undecided' when any part is; else 'alike' when "
           "any part finds no difference where the paper claims one; else 'as the paper' (every part holds)")


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Numerical Recipes §6.4,
    betai / betacf), switching to 1 − I_{1−x}(b, a) where the fraction converges slowly."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x >= (a + 1) / (a + b + 2):
        return 1.0 - _betai(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        even = m * (b - m) * x / ((a - 1 + m2) * (a + m2))
        odd = -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1 + m2))
        for num in (even, odd):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / (c if abs(c) > tiny else tiny)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h / a


def t_cdf(x: float, df: float) -> float:
    """Student's t distribution function: P(T ≤ x) = 1 − ½ I_{df/(df+x²)}(df/2, ½) for x ≥ 0 (symmetric below)."""
    tail = 0.5 * _betai(df / 2, 0.5, df / (df + x * x))
    return 1.0 - tail if x >= 0 else tail


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom, p in (½, 1): bisection on t_cdf."""
    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def seeds_to_decide(mean: float, sd: float, margin: float) -> int | None:
    """The smallest n at which RULE would decide a part with this observed mean and sd: alike (possible only when
    |mean| < margin) or a direction, whichever comes first; None beyond 10,000 seeds."""
    def decides(n: int) -> bool:
        se = sd / math.sqrt(n)
        return abs(mean) + t_quantile(0.95, n - 1) * se < margin or t_quantile(0.975, n - 1) * se < abs(mean)
    if not decides(10_000):
        return None
    lo, hi = 2, 10_000          # decides(n) is monotone in n: the intervals only shrink
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decides(mid) else (mid + 1, hi)
    return lo


def judge(d, margin: float, direction: str) -> dict:
    """RULE on the paired differences d (one per seed), then the part's answer against the paper's `direction`:
    "as the paper", "against the paper", "alike" (no difference that matters, where the paper claims one) or
    "undecided". Returns the numbers with it: mean, the 95 % interval, the 90 % interval, n, seeds with d > 0, the
    seeds that would decide an undecided part."""
    d = np.asarray(d, float)
    n = len(d)
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else float("inf")
    se = sd / math.sqrt(n) if n > 1 else float("inf")
    h95 = t_quantile(0.975, n - 1) * se if n > 1 else float("inf")
    h90 = t_quantile(0.95, n - 1) * se if n > 1 else float("inf")
    if -margin < mean - h90 and mean + h90 < margin:
        stat = "alike"
    elif mean - h95 > 0:
        stat = "higher"
    elif mean + h95 < 0:
        stat = "lower"
    else:
        stat = "undecided"
    if stat == "undecided":
        answer = "undecided"
    elif direction == "alike":
        answer = "as the paper" if stat == "alike" else "against the paper"
    elif direction == "differs":
        answer = "alike" if stat == "alike" else "as the paper"
    else:
        answer = {direction: "as the paper", "alike": "alike"}.get(stat, "against the paper")
    need = seeds_to_decide(mean, sd, margin) if stat == "undecided" and n > 1 else None
    return {"answer": answer, "stat": stat, "mean": mean, "sd": sd, "n": n, "lo95": mean - h95, "hi95": mean + h95,
            "lo90": mean - h90, "hi90": mean + h90, "above": int((d > 0).sum()), "seeds_to_decide": need}


def combine(answers: list[str]) -> str:
    """COMBINE: the claim's answer from its parts' answers."""
    for a in ("against the paper", "undecided", "alike"):
        if a in answers:
            return a
    return "as the paper"


# ---------------------------------------------------------------------------------------------------------------------
# Labels a reader can act on: the rule's answers renamed by what they mean for the claim, never recomputed. A claim of a
# difference found inside the margin has failed ("no effect"), not agreed. For a part: the claim of a difference
# (direction higher / lower / differs) is supported (beyond the margin in the claimed direction), shows no effect
# (inside it) or is contradicted (beyond it the other way); the claim of no difference (alike) or of no loss
# (not-lower) is supported (inside / not below −margin) or contradicted (beyond). A claim's label is its combined
# answer's: COMBINE already says "against" before "undecided" before "alike" before "as the paper".
# ---------------------------------------------------------------------------------------------------------------------
LABELS = {"as the paper": "supported", "alike": "no effect", "against the paper": "contradicted",
          "undecided": "undecided", "not run": "not run", "not tested": "not tested"}
# "not tested": a registry that declares how much a claim's mechanism must act (v3's engagement, Registry.acts) gives
# this answer where it acted less, whatever the parts say: a mechanism that did not act has no effect to find
LABEL_ORDER = ("supported", "no effect", "contradicted", "undecided")


def label(answer: str) -> str:
    """The label of a rule's answer (a part's or a claim's)."""
    return LABELS[answer]


def how_contradicted(v: dict) -> str:
    """How a contradicted claim failed, from its contradicted parts: "the other way" (a claimed difference found
    beyond the margin with the other sign), "a difference where none was claimed" (a claim of no difference or of no
    loss found beyond the margin), or both."""
    ways = {"a difference where none was claimed" if p["part"].direction in ("alike", "not-lower") else "the other way"
            for p in v["parts"] if p["answer"] == "against the paper"}
    return " and ".join(sorted(ways))


# =====================================================================================================================
# Records: one small JSON per run (and per seed's base) under notebooks/results/, committed, read by the verdicts
# =====================================================================================================================
def record_path(variant: str, seed: int) -> Path:
    return R.results / f"{variant}-seed{seed}.json"


def load_run(run_dir: Path) -> dict:
    """What RUN_METRICS read from a finished run directory."""
    import runs
    pretrain = run_dir / "critic_pretrain.json"
    read = lambda name: runs.read_jsonl(run_dir / name) if (run_dir / name).exists() else []  # noqa: E731
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "metrics": read("metrics.jsonl"), "samples": read("samples.jsonl"),
            "critic_pretrain": json.loads(pretrain.read_text()) if pretrain.exists() else []}


def load_base(base: Path) -> dict:
    import runs
    return {"rm_log": json.loads((base / "rm_log.json").read_text()),
            "scores": json.loads((base / "rm_heldout_scores.json").read_text()),
            "length_bias": json.loads((base / "rm_length_bias.json").read_text()),
            "pairs_heldout": runs.read_jsonl(base / "data" / "pairs_heldout.jsonl")}


def git_commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def world_of(seed: int) -> str:
    """The synthetic world a registry's seed lives in: "b" for the seeds it lists as world B's (v3's), else "a"."""
    return "b" if seed in R.world_b_seeds else "a"


def config_key(variant: str, seed: int) -> str:
    """A hash of what the run's summary.json must say for it to stand for this variant and seed (runs.expected),
    under the selected registry's flags for it, in the seed's world."""
    return _config_key(tuple(R.variants[variant]), R.long.get(variant, STEPS), seed, world_of(seed))


# PPOConfig fields added after the registries' records, at the value that keeps the computation they were trained
# with: left out of a config key, so that a record's key still names its run (runs.mismatch, the same for a cached run)
LATER_FIELDS = {"generate_batch": 0}


@functools.lru_cache(maxsize=None)
def _config_key(flags: tuple, steps: int, seed: int, world: str = "a") -> str:
    import runs
    with runs.in_world(world):
        want = runs.expected(runs.argv_for("key", flags, seed, steps))
    want["config"] = {k: v for k, v in want["config"].items() if LATER_FIELDS.get(k, object()) != v}
    return hashlib.sha256(json.dumps(want, sort_keys=True).encode()).hexdigest()[:16]


def make_record(variant: str, seed: int, run_dir: Path | None, base: Path | None = None) -> dict:
    """The record of one run (or of a seed's base with variant BASE): the numbers METRICS read, with what they came
    from (config, code version, commit and machine)."""
    import runs
    if variant == BASE:
        got = {**load_base(base), "world": world_of(seed)}
        metrics = {k: float(f(got)) for k, f in R.base_metrics.items()}
        key, flags = base.name, ()
    else:
        got = load_run(run_dir)
        names = R.run_metrics if got["metrics"] else R.final_metrics   # DPO, best-of-n: a final evaluation, no PPO steps
        values = {k: R.run_metrics[k](got) for k in names}
        # best-of-n has no per-token KL (summary.json's final kl is None; its KL per response is exact): not recorded
        metrics = {k: float(x) for k, x in values.items() if not (x is None and names is R.final_metrics)}
        key, flags = config_key(variant, seed), R.variants[variant]
    # the machine too: the run under runs/ was trained here, and its last bits depend on the CPU
    rec = {"variant": variant, "flags": list(flags), "seed": seed, "steps": 0 if variant == BASE else steps_of(variant),
           "config": key, "code": runs.code_version(), "commit": git_commit(), "machine": machine(), "metrics": metrics}
    if R.world_b_seeds:   # a registry of two worlds: each record names its own
        rec = {"world": world_of(seed), **rec}
    if R.name != "v1":  # the per-step curve too (metrics.jsonl, or the reward model's log), so that a later question
        # (the §5.2 alarm on every run, a metric not planned here) reads the records without training again
        rec["curve"] = compress(got["rm_log"] if variant == BASE else got["metrics"])
    return rec


def compress(rows: list[dict]) -> str:
    """Rows as gzip-compressed JSON lines in base64: a record's per-step curve (decompress() reads it back)."""
    import base64
    import gzip
    return base64.b64encode(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(), mtime=0)).decode()


def decompress(text: str) -> list[dict]:
    import base64
    import gzip
    return [json.loads(line) for line in gzip.decompress(base64.b64decode(text)).decode().splitlines()]


def records(reg: "Registry | None" = None) -> dict[tuple[str, int], dict]:
    """Every committed record of the selected registry (or of `reg`): {(variant, seed): record}."""
    out = {}
    for p in sorted((reg or R).results.glob("*-seed*.json")):
        r = json.loads(p.read_text())
        out[(r["variant"], r["seed"])] = r
    return out


# =====================================================================================================================
# Verdicts
# =====================================================================================================================
def _value(recs: dict, variant: str, seed: int, metric: str) -> float | None:
    r = recs.get((variant, seed))
    return None if r is None else r["metrics"].get(metric)


INTERACTIONS = {  # Fig. 14's 2 × 2 on a base: (neither, advantage norm only, value clip only, both)
    "interaction_vanilla": ("rnorm-0.8", "rnorm-advnorm", "rnorm-vclip", "rnorm-advnorm-vclip"),
    "interaction_ppomax": ("no-vclip", "advnorm-no-vclip", "ppo-max", "advnorm"),
}


def part_variants(part: Part) -> set[str]:
    return set(INTERACTIONS.get(part.metric, ())) or ({part.a, part.b} - {None})


def difference(part: Part, recs: dict, seed: int) -> float | None:
    """The part's d for one seed (None while a record it needs is missing)."""
    if part.metric in INTERACTIONS:      # (A+C − A) − (C − neither) of win − lose: the interaction of the 2 × 2
        neither, adv, clip, both = (_value(recs, v, seed, "win_lose") for v in INTERACTIONS[part.metric])
        return None if None in (neither, adv, clip, both) else (both - adv) - (clip - neither)
    if part.metric == "skew_delta":      # |Δ skewness| of a − of b, each its last 10 steps − step 0
        x = [_value(recs, v, seed, m) for v in (part.a, part.b) for m in ("skew_last10", "skew_first")]
        return None if None in x else abs(x[0] - x[1]) - abs(x[2] - x[3])
    a = _value(recs, part.a, seed, part.metric)
    if part.b is not None:
        b = _value(recs, part.b, seed, part.metric)
    elif part.minus is not None:
        b = _value(recs, part.a, seed, part.minus)
    else:
        b = part.const
    if a is None or b is None:
        return None
    return a / b - 1 if part.margin == "ppl" else a - b


def verdict(claim: Claim, recs: dict | None = None) -> dict:
    """One claim from the records: each part judged by RULE, the claim's answer by COMBINE ("not run" while a planned
    seed has no record)."""
    recs = records() if recs is None else recs
    parts = []
    for part in claim.parts:
        d = {s: difference(part, recs, s) for s in claim.seeds}
        missing = [s for s, x in d.items() if x is None]
        if missing:   # the seeds run so far, judged as they stand: printed, never the claim's answer
            have = [x for x in d.values() if x is not None]
            interim = R.judge(have, R.margins[part.margin], part.direction) if len(have) > 1 else None
            parts.append({"part": part, "answer": "not run", "missing": missing, "interim": interim})
        else:
            parts.append({"part": part, **R.judge(list(d.values()), R.margins[part.margin], part.direction)})
    answers = [p["answer"] for p in parts]
    answer = "not run" if "not run" in answers else combine(answers)
    acts = R.acts(claim, recs) if R.acts is not None else None   # v3: did the mechanism act where it was judged
    if acts is not None and acts["below"] and answer != "not run":
        answer = "not tested"
    return {"claim": claim, "parts": parts, "answer": answer, "acts": acts}


def verdicts(recs: dict | None = None) -> list[dict]:
    recs = records() if recs is None else recs
    return [verdict(c, recs) for c in R.claims]


def first_stage(claim: Claim, recs: dict | None = None) -> dict | None:
    """The claim's verdict on the seeds it was first planned on (R.first_plan), where the second stage changed them;
    else None."""
    first = R.first_plan[claim.id]
    return None if first == claim.seeds else verdict(replace(claim, seeds=first), recs)


def second_stage_rule(recs: dict | None = None) -> tuple[str, ...]:
    """The claims the second stage plans on seeds 0-19 (SECOND_STAGE): planned on SEEDS, undecided on them, and every
    undecided part decided by SECOND_STAGE_MAX seeds or fewer at its observed mean and sd."""
    recs = records() if recs is None else recs
    out = []
    for c in CLAIMS:
        if FIRST_PLAN[c.id] != SEEDS:
            continue
        v = verdict(replace(c, seeds=SEEDS), recs)
        need = [p["seeds_to_decide"] for p in v["parts"] if p["answer"] == "undecided"]
        if v["answer"] == "undecided" and all(n is not None and n <= SECOND_STAGE_MAX for n in need):
            out.append(c.id)
    return tuple(out)


def rule_tally(recs: dict | None = None) -> dict:
    """How many claims end in each of the rule's answers (COMBINE's), before the labels rename them."""
    out = {a: 0 for a in ANSWERS}
    for v in verdicts(recs):
        out[v["answer"]] = out.get(v["answer"], 0) + 1
    return {k: v for k, v in out.items() if v or k in ANSWERS}


def tally(recs: dict | None = None) -> dict:
    """How many claims carry each label (LABELS: the rule's answers renamed, the counts unchanged)."""
    out = {k: 0 for k in LABEL_ORDER}
    for answer, n in rule_tally(recs).items():
        out[label(answer)] = out.get(label(answer), 0) + n
    return {k: v for k, v in out.items() if v or k in LABEL_ORDER}


def _fmt(x: float) -> str:
    return f"{x:+.3g}" if abs(x) >= 0.01 or x == 0 else f"{x:+.1e}"


def _seed_ranges(seeds: list[int]) -> str:
    """[6, 7, 8, 9, 12] → '6–9, 12'."""
    out, start = [], None
    for i, s in enumerate(seeds):
        start = s if start is None else start
        if i + 1 == len(seeds) or seeds[i + 1] != s + 1:
            out.append(f"{start}–{s}" if s > start else f"{s}")
            start = None
    return ", ".join(out)


def part_text(p: dict) -> str:
    part = p["part"]
    if p["answer"] == "not run":
        text = f"{part.what}: not run (seeds {_seed_ranges(p['missing'])} missing)"
        i = p.get("interim")
        if i:
            text += (f"; so far, {i['n']} seeds: {_fmt(i['mean'])} [{_fmt(i['lo95'])}, {_fmt(i['hi95'])}], "
                     f"{i['above']}/{i['n']} > 0 → {label(i['answer'])} (interim, not a verdict)")
        return text
    text = (f"{part.what}: {_fmt(p['mean'])} [{_fmt(p['lo95'])}, {_fmt(p['hi95'])}], {p['above']}/{p['n']} seeds > 0"
            f" → {label(p['answer'])}")
    if p["answer"] == "undecided":
        need = p["seeds_to_decide"]
        text += f" (~{need} seeds would decide it)" if need else " (more than 10,000 seeds would not decide it)"
    return text


# =====================================================================================================================
# Qualifiers: what a reader needs beside a verdict to act on it, printed on its row. Descriptions, never new verdicts:
# the label stays the rule's. A registry lists them per claim (Registry.qualifiers, {claim id: [qualifier, ...]}):
#   Claim.construction          what the world or a default was tuned to show: "by construction", printed first
#   Setting(text)               the project's weight or setting where the source's differs, or what the claim tests now
#   Stronger(direction, text)   the registered direction is weaker than the source's words: the same rule's answer for
#                               the stronger direction, on the same paired differences
#   Engaged(...)                how much the mechanism acted in the judged runs, read from the records' per-step curves
#                               (metrics.jsonl as the record keeps it); below its threshold the row says "not really
#                               tested here"
#   NoCurve(text)               a mechanism whose action no curve of the records shows: said, not guessed
#   Always(text)                a mechanism with nothing to bind (a λ, an estimator, a target): it acts on every step
#   Scale(part, variant)        the margin against the compared quantity itself (a coarse test sees only large effects)
#   Contrast(what, metric, a, b)  a paired difference of two of the claim's runs that no part registers, no label
# The thresholds, each with its reason, written down before any engagement was tabulated (two figures were known
# beforehand from the review that asked for them: PPO-max's clip binds on 0.07-0.09 % of tokens, its gradient clip on
# 0.8 % of steps; both thresholds are round shares chosen from what a share means, not from those figures):
#   TOKEN_SHARE 1 %   a clip, cap or truncation that binds on fewer than one token in a hundred leaves the two
#                     variants the same loss on more than 99 % of the tokens: the comparison is between two nearly
#                     identical updates, and a verdict on it is about the rest of the recipe, not the mechanism
#   STEP_SHARE 10 %   a mechanism that acts on fewer than one step in ten acts on fewer than 8 of 80 steps, one
#                     held-out-curve interval (--heldout-every 8): less than what moves one point of the curve
#   MARGINS["kl"]     a sampler whose KL to the policy is below the registry's own smallest KL that matters (0.01
#                     nats per token) is, by the registry's standard, the policy's own sampler: no mismatch to correct
# =====================================================================================================================
TOKEN_SHARE = 0.01
STEP_SHARE = 0.10


@dataclass(frozen=True)
class Setting:
    text: str


@dataclass(frozen=True)
class Stronger:
    direction: str
    text: str


@dataclass(frozen=True)
class NoCurve:
    text: str


@dataclass(frozen=True)
class Always:
    """A mechanism that acts wherever it is on, by construction (no clip or filter to bind): said, with no threshold."""
    text: str


@dataclass(frozen=True)
class Contrast:
    """A paired difference of two of the claim's runs that no part registers, printed with its 90 % interval and no
    label (what a reader would ask next, e.g. a correction against no correction)."""
    what: str
    metric: str
    a: str
    b: str


@dataclass(frozen=True)
class Scale:
    part: int       # the index of the claim's part whose margin is compared
    variant: str    # the run whose own value of the part's metric the margin is compared with


@dataclass(frozen=True)
class Engaged:
    """How much a mechanism acted: `measure(rows)` on the per-step curve of each judged run of `variants` (each seed
    of the claim), its mean over those runs against `threshold`. `key` is the curve's key the measure reads (a run
    whose curve lacks it is said to); `unit` is "tokens" or "steps" (printed as a percentage) or a unit of a size."""
    what: str
    variants: tuple
    key: str
    measure: object
    threshold: float
    unit: str


def token_share(key: str = "ppo/clipfrac"):
    """The mean over steps of a per-step share of tokens (metrics.jsonl's ppo/clipfrac: the minibatches' mean)."""
    return lambda rows: float(np.mean([r[key] for r in rows if r.get(key) is not None]))


def step_share(key: str, lo: float = -math.inf, hi: float = math.inf):
    """The share of steps whose `key` lies in [lo, hi)."""
    return lambda rows: float(np.mean([lo <= r[key] < hi for r in rows if r.get(key) is not None]))


def _pct(x: float) -> str:
    return f"{100 * x:.3g} %"


def engagement(q: Engaged, claim: Claim, recs: dict) -> dict:
    """q's measure on every judged run: {"values": [one per run], "missing": [runs whose curve lacks q.key],
    "mean", "below": mean < threshold}."""
    values, missing = [], []
    for v in q.variants:
        for s in claim.seeds:
            r = recs.get((v, s))
            rows = decompress(r["curve"]) if r is not None and r.get("curve") else []
            if not any(row.get(q.key) is not None for row in rows):
                missing.append(f"{v} seed {s}")
                continue
            values.append(q.measure(rows))
    mean = float(np.mean(values)) if values else None
    # rounded: a mean of k/80-step shares that equals the threshold is not below it by a float's last bit
    return {"values": values, "missing": missing, "mean": mean,
            "below": mean is not None and round(mean, 12) < q.threshold}


def _size(x: float, unit: str) -> str:
    return _pct(x) if unit in ("tokens", "steps") else f"{x:.3g} {unit}"


def qualifiers(v: dict, recs: dict | None = None) -> list[str]:
    """The verdict's qualifiers, one string each: by construction, then the registry's list for the claim (Setting,
    Stronger, Engaged, NoCurve, Scale), computed from the records; the first says "not really tested here" when every
    engagement of the claim is below its threshold ("partly tested here" when some are)."""
    recs = records() if recs is None else recs
    c = v["claim"]
    out = [f"by construction: {c.construction}"] if c.construction else []
    a = v.get("acts")   # a registry's declared engagement (v3's): it decides "not tested", so it is printed first
    if a is not None:
        out.insert(0, f"engagement (declared before the runs): {a['what']}: " + (
            "no record yet" if a["value"] is None else f"{a['value']:.3g} over {a['runs']} runs, threshold "
            f"{a['threshold']:.3g}" + (" → not tested" if a["below"] else "")))
    below = []
    for q in getattr(R, "qualifiers", {}).get(c.id, ()):
        if isinstance(q, Setting):
            out.append(f"setting: {q.text}")
        elif isinstance(q, NoCurve):
            out.append(f"engagement: not in the records ({q.text})")
        elif isinstance(q, Always):
            out.append(f"engagement: always acts ({q.text}); no threshold")
        elif isinstance(q, Stronger):
            answers = []
            for p in v["parts"]:
                if "mean" not in p:
                    continue
                d = [difference(p["part"], recs, s) for s in c.seeds]
                answers.append(label(R.judge(d, R.margins[p["part"].margin], q.direction)["answer"]))
            out.append(f"direction: {q.text}; the same rule asked '{q.direction}' of the same differences: "
                       + ", ".join(answers))
        elif isinstance(q, Contrast):
            d = [difference(Part(q.what, q.metric, q.a, q.b, "alike", "gold"), recs, s) for s in c.seeds]
            if None not in d:
                j = R.judge(d, 1.0, "alike")   # the margin is not read: only the mean and the 90 % interval are
                out.append(f"beside it: {q.what}: {_fmt(j['mean'])} [90 %: {_fmt(j['lo90'])}, {_fmt(j['hi90'])}], "
                           f"{j['above']}/{j['n']} seeds > 0 (not a part: no verdict)")
        elif isinstance(q, Scale):
            part = c.parts[q.part]
            levels = [_value(recs, q.variant, s, part.metric) for s in c.seeds]
            levels = [abs(x) for x in levels if x is not None]
            m = R.margins[part.margin]
            if levels:
                out.append(f"scale: the margin ±{m:g} is {_pct(m / max(levels))}–{_pct(m / min(levels))} of "
                           f"{q.variant}'s own {part.metric} ({min(levels):.2g}–{max(levels):.2g} over the seeds)")
        elif isinstance(q, Engaged):
            e = engagement(q, c, recs)
            if e["mean"] is None:
                out.append(f"engagement: {q.what}: the records carry no curve of {q.key}")
                continue
            of = f" of {q.unit}" if q.unit in ("tokens", "steps") else ""
            text = (f"engagement: {q.what}: {_size(e['mean'], q.unit)}{of}, mean of {len(e['values'])} runs (from "
                    f"{_size(min(e['values']), q.unit)} to {_size(max(e['values']), q.unit)}); threshold "
                    f"{_size(q.threshold, q.unit)}")
            if e["missing"]:
                text += f"; no curve of {q.key} in {', '.join(e['missing'])}"
            if e["below"]:   # where the registry declares its own engagement (a), this one is a description
                text += " → below its threshold" if a is not None else " → not really tested here"
                below.append(q)
            out.append(text)
    engaged = [q for q in getattr(R, "qualifiers", {}).get(c.id, ()) if isinstance(q, Engaged)]
    if below and a is None:   # where the registry declares the claim's engagement, that one alone says "not tested"
        out.insert(0, "**not really tested here**" if len(below) == len(engaged) else "**partly tested here**")
    return out


def not_tested(recs: dict | None = None) -> list[str]:
    """The claims whose every engagement is below its threshold ("not really tested here"), in registry order."""
    recs = records() if recs is None else recs
    return [v["claim"].id for v in verdicts(recs) if qualifiers(v, recs)[:1] == ["**not really tested here**"]]


def table(recs: dict | None = None) -> str:
    """docs/findings.md's verdict table, markdown."""
    head = ("the paper's claim", "mean [95 % interval]") if R.name == "v1" else (
        "the claim (the paper's unless it says so)", "mean [90 % interval]; the margins for which it holds")
    lines = [f"| fig | {head[0]} | what was measured (paired by seed; {head[1]}) | seeds | verdict | qualifiers "
             f"(descriptions beside the verdict, not verdicts) | notebook |", "|---|---|---|---|---|---|---|"]
    recs = records() if recs is None else recs
    for v in verdicts(recs):
        c = v["claim"]
        parts = "; ".join(R.part_text(p) for p in v["parts"])
        nb = f"[{c.notebook}](../notebooks/{c.notebook}.ipynb)" if c.notebook else ""
        how = f" ({how_contradicted(v)})" if v["answer"] == "against the paper" else ""
        first = first_stage(c, recs)
        then = f"; on its first {len(first['claim'].seeds)} seeds: {label(first['answer'])}" if first else ""
        quals = "; ".join(qualifiers(v, recs))
        lines.append(f"| {c.figure} | {c.sentence} | {parts} | {len(c.seeds)} | **{label(v['answer'])}**{how}{then} | "
                     f"{quals} | {nb} |")
    return "\n".join(lines)


FINDINGS = ROOT / "docs" / "findings.md"
README = ROOT / "README.md"
SUMMARY_MARKS = ("<!-- claims.py --summary -->", "<!-- end of claims.py --summary -->")
V3_SENTENCE_MARKS = ("<!-- v3 -->", "<!-- /v3 -->")   # the README's v3 sentence (registry_v3.readme_sentence)
TRAVEL_MARKS = ("<!-- claims.py --registry v3 --travel -->", "<!-- end of claims.py --registry v3 --travel -->")
TRAVEL_TALLY_MARKS = ("<!-- claims.py --registry v3 --travel --tally -->",
                      "<!-- end of claims.py --registry v3 --travel --tally -->")


def rule_text() -> str:
    """The rule, the way parts combine and the margins, as docs/findings.md prints them (from RULE, COMBINE, MARGINS,
    SEEDS: never retyped)."""
    margins = ", ".join(f"{k} ±{v:g}" for k, v in MARGINS.items())
    return (f"**The rule, for every part of every claim:** {RULE}.\n\n**A claim from its parts:** {COMBINE}.\n\n"
            f"**The margins** (`MARGINS`, one per kind of number, the same in every claim): {margins}.\n\n"
            f"**Seeds:** {len(SEEDS)} per comparison ({SEEDS[0]}–{SEEDS[-1]}), {len(SEEDS20)} where the registry's "
            f"`why` says the pilot's spread needs them, and for the second stage: a claim undecided on its ten seeds "
            f"whose every undecided part {SECOND_STAGE_MAX} seeds or fewer would decide gets seeds "
            f"{SEEDS[-1] + 1}–{SEEDS20[-1]} ({', '.join(SECOND_STAGE)}); its verdict on {len(SEEDS20)} seeds is final, "
            f"and the table prints its first ten seeds' answer beside it. A claim is *not run* while a planned seed "
            f"has no record; its parts are then printed on the seeds run so far, marked interim.")


def marks(name: str) -> tuple[tuple[str, str], tuple[str, str], tuple[str, str]]:
    """docs/findings.md's marks of a registry's rule, table and tally: v2's plain, v1's with --registry v1."""
    flag = "" if name == "v2" else f" --registry {name}"
    return tuple((f"<!-- claims.py{flag} {what} -->", f"<!-- end of claims.py{flag} {what} -->")
                 for what in ("rule", "--table", "--tally"))


def findings_blocks(recs: dict | None = None) -> dict[tuple[str, str], str]:
    """What docs/findings.md holds between each pair of the selected registry's marks: its rule, table and tally, from
    its records."""
    recs = records() if recs is None else recs
    rule, table_marks, tally_marks = marks(R.name)
    blocks = {rule: R.rule_text(), table_marks: table(recs), tally_marks: f"`{json.dumps(tally(recs))}`"}
    if R.name == "v3":   # and "Does a verdict travel?": v2's verdicts beside v3's world B ones
        import registry_v3
        rows = registry_v3.travel_rows()
        blocks[TRAVEL_MARKS] = registry_v3.travel_table(rows)
        blocks[TRAVEL_TALLY_MARKS] = f"`{json.dumps(registry_v3.travel_tally(rows))}`"
    return blocks


def write_findings(recs: dict | None = None, path: Path = FINDINGS, blocks: dict | None = None) -> None:
    """Replace docs/findings.md's generated blocks (the rule, the verdict table, the tally), or `blocks` of another
    page, with what the records give."""
    text = path.read_text()
    for (start, end), body in (findings_blocks(recs) if blocks is None else blocks).items():
        if start not in text or end not in text:
            raise SystemExit(f"error: {path} has lost the marks {start} … {end}")
        head, rest = text.split(start, 1)
        text = head + start + "\n" + body + "\n" + end + rest.split(end, 1)[1]
    path.write_text(text)


def show(ids: list[str], recs: dict | None = None) -> None:
    """Print each named claim part by part (the notebooks' verdict cells)."""
    recs = records() if recs is None else recs
    by_id = {c.id: c for c in R.claims}
    for i in ids:
        v = verdict(by_id[i], recs)
        print(f"{i}: {by_id[i].sentence}")
        for p in v["parts"]:
            print(f"    {R.part_text(p)}")
        print(f"  → {label(v['answer'])}" + (f" ({how_contradicted(v)})" if v["answer"] == "against the paper" else ""))
        for q in qualifiers(v, recs):
            print(f"    {q.replace('**', '')}")   # the table's markdown bold, not a terminal's
        print()


def of_notebook(name: str) -> list[Claim]:
    """The claims a figure notebook shows (Claim.notebook == name), in the registry's order."""
    out = [c for c in R.claims if c.notebook == name]
    if not out:
        raise ValueError(f"no claim of the registry names the notebook {name!r}")
    return out


def show_notebook(name: str, recs: dict | None = None) -> None:
    """show() for every claim of a figure notebook: its verdict cell."""
    show([c.id for c in of_notebook(name)], recs)


def holds(name: str, recs: dict | None = None) -> None:
    """One line per claim of a figure notebook, its answer by COMBINE, then what would change it: the seeds that would
    decide each undecided part, or the seeds still without a record (the notebook's "What holds here")."""
    recs = records() if recs is None else recs
    for c in of_notebook(name):
        v = verdict(c, recs)
        first = first_stage(c, recs)
        print(f"{c.id}: {c.sentence}\n  → {label(v['answer'])}"
              + (f" ({how_contradicted(v)})" if v["answer"] == "against the paper" else "")
              + (f" (on its first {len(first['claim'].seeds)} seeds: {label(first['answer'])})" if first else ""))
        for q in qualifiers(v, recs):
            print(f"    {q.replace('**', '')}")
        missing = sorted({s for p in v["parts"] if p["answer"] == "not run" for s in p["missing"]})
        if missing:
            print(f"    seeds without a record yet: {missing}")
        for p in v["parts"]:
            if p["answer"] == "undecided":
                need = p["seeds_to_decide"]
                print(f"    undecided: {p['part'].what} ("
                      + (f"~{need} seeds would decide it)" if need else "more than 10,000 seeds would not decide it)"))


# =====================================================================================================================
# Running the registry
# =====================================================================================================================
def planned(claims: list[Claim] | None = None) -> list[tuple[str, int]]:
    """Every (variant, seed) the claims read (all claims by default), bases included, in a stable order."""
    want = {(v, s): None for c in (claims or R.claims) for part in c.parts for v in part_variants(part) for s in c.seeds}
    return sorted(want, key=lambda vs: (vs[0] == BASE, vs[1], vs[0]))


def base_name(seed: int) -> str:
    """The name of a seed's base under runs/_base/ (what runs.base_dir builds when it is missing), built or not."""
    import runs
    with runs.in_world(world_of(seed)):
        return runs.expected(runs.argv_for("ppo-max", (), seed, None))["base"]


def recorded(variant: str, seed: int) -> bool:
    """Whether a committed record already stands for this run: written by this code (runs.code_version) for this
    config. A budget can then span sittings on different machines: --run trains only what no record covers."""
    import runs
    path = record_path(variant, seed)
    if not path.exists():
        return False
    rec = json.loads(path.read_text())
    key = base_name(seed) if variant == BASE else config_key(variant, seed)
    return rec.get("code") == runs.code_version() and rec.get("config") == key


def machine() -> str:
    """The CPU model, the kernels torch picks on it and torch's version: what the last bit of a metric depends on
    besides the code."""
    import platform
    import torch
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"



def run_registry(only: list[str] | None = None, seeds: set[int] | None = None) -> None:
    """Train (or reuse) every planned run of the claims `only` (all by default; on `seeds` only, if given) that no
    committed record stands for (recorded()) through runs.run_each, one run per distinct configuration (two variants
    that are the same flags once the defaults apply share it), and write each record as soon as its run is done (a
    seed's base record with its first run), so that a budget cut short keeps every finished run; then print the runs
    per hour.

    All seeds go to the pool at once, so that no worker waits while another finishes a seed: the long runs first, so
    that none is left alone at the end, then round robin over the seeds (each seed's first run before any seed's
    second), so that a seed without a base has it built by one worker while the others train on other seeds."""
    import runs
    runs.configure(full=True)
    todo = [(v, s) for v, s in planned([c for c in R.claims if not only or c.id in only])
            if (seeds is None or s in seeds) and not recorded(v, s)]
    R.results.mkdir(exist_ok=True)
    worlds = list(dict.fromkeys(world_of(s) for c in R.claims for s in c.seeds))   # in the claims' order
    for w in worlds:   # a registry of two worlds (v3): each world's runs in turn, the first claims' world first
        runs.configure(full=True, world=w)
        _run_todo([(v, s) for v, s in todo if world_of(s) == w])
    runs.configure(full=True)


def _run_todo(todo: list[tuple[str, int]]) -> None:
    """run_registry's work for one world's (variant, seed) pairs (runs.configure has chosen the world)."""
    import runs
    by_config: dict[str, tuple[str, int]] = {}
    for v, s in todo:
        if v != BASE:
            by_config.setdefault(config_key(v, s), (v, s))
    per_seed: dict[int, list] = {}
    # each seed's variants in the order of the first claim reading them, so that a budget cut short has finished
    # whole claims rather than a few runs of every claim
    rank = {v: i for i, v in enumerate(dict.fromkeys(v for c in R.claims for p in c.parts
                                                      for v in sorted(part_variants(p))))}
    for v, s in sorted(by_config.values(), key=lambda vs: (rank.get(vs[0], len(rank)), vs[1])):
        per_seed.setdefault(s, []).append((v, R.variants[v], s, R.long.get(v)))
    rounds = [[per_seed[s][k] for s in sorted(per_seed) if k < len(per_seed[s])]
              for k in range(max(map(len, per_seed.values()), default=0))]
    specs = sorted([spec for r in rounds for spec in r], key=lambda spec: spec[0] not in R.long)   # stable
    waiting = {config_key(v, s): [] for v, s in by_config.values()}   # a run's config → the records it completes
    for v, s in todo:
        if v != BASE:
            waiting[config_key(v, s)].append((v, s))
    bases = {s for v, s in todo if v == BASE}
    t0, n_runs, failed = time.time(), 0, []

    def write(v: str, s: int, run_dir: Path | None) -> None:
        rec = make_record(v, s, None, runs.base_dir(s)) if v == BASE else make_record(v, s, run_dir)
        record_path(v, s).write_text(json.dumps(rec, indent=1) + "\n")

    for s in sorted(bases - {spec[2] for spec in specs}):   # only the base's record: no run to wait for
        write(BASE, s, None)
    for i, run_ in runs.run_each(specs, keep_going=True):
        v, _, seed, _ = specs[i]
        n_runs += 1
        if isinstance(run_, Exception):   # one run's failure is reported; the others still run and get records
            failed.append(f"{v} seed {seed}: {type(run_).__name__}: {run_}")
            print(f"failed: {failed[-1]}", flush=True)
            continue
        mine = waiting[config_key(v, seed)] + ([(BASE, seed)] if seed in bases else [])
        bases.discard(seed)   # the seed's base exists once one of its runs is done
        for name, s in mine:
            write(name, s, run_["dir"])
        print(f"{', '.join(f'{name}-seed{s}' for name, s in mine)}: recorded; {n_runs} of {len(specs)} runs in "
              f"{(time.time() - t0) / 60:.1f} min", flush=True)
    print(runs.report())
    print(f"registry: {len(todo)} planned records, {n_runs} runs in {(time.time() - t0) / 60:.1f} min"
          + (f"; failed: {failed}" if failed else ""))


SUMMARY = ("ppo-max", "vanilla", "bon-4")   # the README's table: SFT (each run's own SFT evaluation) and these


def write_records(variants, seeds) -> None:
    """Train (or reuse) `variants` on `seeds` and write their records (the README's summary runs: --summary)."""
    import runs
    runs.configure(full=True)
    for v, rs in runs_for(list(variants), tuple(seeds)).items():
        for s, r in zip(seeds, rs):
            record_path(v, s).write_text(json.dumps(make_record(v, s, r["dir"]), indent=1) + "\n")


def rewrite_records() -> int:
    """Every record again from the runs this machine has cached (no training): for a metric added to METRICS after
    the runs. Returns how many it wrote."""
    import runs
    runs.configure(full=True)
    reps, n = {}, 0
    for v, s in planned() + [(v, s) for v in R.summary for s in R.seeds]:
        if v == BASE:
            record_path(v, s).write_text(json.dumps(make_record(v, s, None, runs.base_dir(s)), indent=1) + "\n")
            n += 1
            continue
        key = config_key(v, s)
        rep = reps.setdefault(key, (v, s))
        found = runs.cached(rep[0], R.variants[rep[0]], s, R.long.get(rep[0]))
        if found is not None:
            record_path(v, s).write_text(json.dumps(make_record(v, s, found["dir"]), indent=1) + "\n")
            n += 1
    return n


def summary(recs: dict | None = None, seeds: tuple[int, ...] | None = None) -> str:
    """The README's table from the records: held-out gold, win − lose against SFT, KL per response (temperature
    1; best-of-n's is exact, log n − (n − 1)/n) and length of SFT, PPO-max, vanilla PPO and best-of-4 (mean ± sd over
    `seeds`: by default every seed of R.seeds with records of PPO-max and vanilla PPO; a column whose records are
    missing on them says so), and PPO-max − best-of-4 paired by seed."""
    recs = records() if recs is None else recs
    if seeds is None:
        seeds = tuple(s for s in R.seeds if all((v, s) in recs for v in R.summary[:2]))
    if len(seeds) < 2:
        return "no summary yet: fewer than two seeds have records of " + " and ".join(R.summary[:2])
    have = [v for v in R.summary if all((v, s) in recs for s in seeds)]
    get = lambda v, m: np.array([recs[(v, s)]["metrics"][m] for s in seeds])  # noqa: E731
    ms = lambda x: f"{x.mean():.2f} ± {x.std(ddof=1):.2f}"  # noqa: E731
    cell = lambda v, f: f(v) if v in have else "not run"  # noqa: E731
    sft = get("ppo-max", "final_gold") - get("ppo-max", "final_gold_vs_sft")
    names = {"ppo-max": "PPO-max (default)", "vanilla": "vanilla PPO", "bon-4": "best-of-4 (SFT, the same proxy)",
             "dapo": "DAPO (--preset dapo)", "vapo": "VAPO (--preset vapo)"}
    rows = [f"| held-out (seeds {_seed_ranges(list(seeds))}) | SFT | "
            + " | ".join(names.get(v, v) for v in R.summary) + " |", "|---" * (len(R.summary) + 2) + "|",
            "| gold reward | " + ms(sft) + " | " + " | ".join(cell(v, lambda v: ms(get(v, "final_gold")))
                                                          for v in R.summary) + " |",
            "| win − lose vs SFT (gold, held-out pairs) | | " + " | ".join(
                cell(v, lambda v: ms(get(v, "win_lose"))) for v in R.summary) + " |",
            "| win / tie / lose vs SFT (mean shares) | | " + " | ".join(
                cell(v, lambda v: " / ".join(f"{get(v, k).mean():.2f}" for k in ("win", "tie", "lose")))
                for v in R.summary) + " |",
            "| KL to SFT per response (nats) | 0 | " + " | ".join(cell(v, lambda v: ms(get(v, "final_kl_seq")))
                                                                for v in R.summary) + " |",
            "| KL to SFT per token (nats) | 0 | " + " | ".join(
                cell(v, lambda v: ms(get(v, "final_kl")) if v != "bon-4" else "—") for v in R.summary) + " |",
            "| response length (tokens) | | " + " | ".join(cell(v, lambda v: ms(get(v, "final_length")))
                                                          for v in R.summary) + " |"]
    for a, b in (("ppo-max", "bon-4"), ("ppo-max", "vanilla")):
        if b not in have:
            continue
        v = R.judge(get(a, "final_gold") - get(b, "final_gold"), R.margins["gold"], "alike")
        vw = R.judge(get(a, "win_lose") - get(b, "win_lose"), R.margins["win-lose"], "alike")
        rows.append("")
        rows.append(f"{a} − {b}, paired by seed (mean [95 % interval]): gold {_fmt(v['mean'])} [{_fmt(v['lo95'])}, "
                    f"{_fmt(v['hi95'])}], win − lose against SFT {_fmt(vw['mean'])} [{_fmt(vw['lo95'])}, "
                    f"{_fmt(vw['hi95'])}]")
    d = get("ppo-max", "final_gold_vs_sft")
    v = R.judge(d, R.margins["gold"], "higher")
    rows.append("")
    rows.append(f"ppo-max − SFT, gold: {_fmt(v['mean'])} [{_fmt(v['lo95'])}, {_fmt(v['hi95'])}], "
                f"{v['above']}/{v['n']} seeds above SFT; win − lose: "
                + ", ".join(f"{x:+.2f}" for x in get("ppo-max", "win_lose")))
    return "\n".join(rows)


def readme_summary() -> str:
    """The README's summary block: v2's summary() once v2 has records of two seeds, v1's until then; it names which.
    Leaves the selection as it found it."""
    before = R.name
    try:
        for name in ("v2", "v1"):
            select(name)
            text = summary()
            if not text.startswith("no summary yet") or name == "v1":
                return f"Registry {name}'s runs.\n\n" + text
    finally:
        select(before)


def readme_sentence(recs: dict | None = None) -> str:
    """The README's sentence on the selected registry's verdicts, in plain words: how many claims are supported (and how
    many of those carry a qualifier), how many failed and how, how many are undecided, and how many verdicts rest on
    a mechanism that barely acted (a test holds the README to it)."""
    recs = records() if recs is None else recs
    vs = verdicts(recs)
    t = tally(recs)
    ways = sorted({how_contradicted(v) for v in vs if v["answer"] == "against the paper"})
    qualified = [v for v in vs if v["answer"] == "as the paper" and qualifiers(v, recs)]
    return (f"{t['supported']} of its {sum(t.values())} claims are supported ({len(qualified)} of them with a "
            f"qualifier on their row), {t['no effect'] + t['contradicted']} failed ({t['no effect']} no effect: a "
            f"claimed difference not there at the margin's size; {t['contradicted']} contradicted"
            + (f": {'; '.join(ways)}" if ways else "") + f") and {t['undecided']} are undecided; "
            f"{len(not_tested(recs))} verdicts rest on a mechanism that barely acted (not really tested here)")


def presets_sentence(recs: dict | None = None, presets: tuple[str, ...] = ("dapo", "vapo")) -> str:
    """The README's sentence on the newer presets of v2's summary, from the records: what they are here, their win −
    lose against SFT paired by seed with vanilla PPO's (mean [95 % interval]), their KL to SFT per response as the
    median and range over the seeds (skewed: a few collapsed seeds carry the mean), and DAPO's dynamic sampling's
    dropped groups per step from its curves."""
    recs = records() if recs is None else recs
    seeds = R.seeds
    get = lambda v, m: np.array([recs[(v, s)]["metrics"][m] for s in seeds])  # noqa: E731
    diffs = []
    for v in presets:
        j = R.judge(get(v, "win_lose") - get("vanilla", "win_lose"), R.margins["win-lose"], "alike")
        diffs.append(f"{v.upper()} {j['mean']:+.2f} [{j['lo95']:+.2f}, {j['hi95']:+.2f}]")
    kl = lambda v: (f"{np.median(get(v, 'final_kl_seq')):.1f} ({get(v, 'final_kl_seq').min():.1f}–"  # noqa: E731
                    f"{get(v, 'final_kl_seq').max():.1f})")
    dropped = [float(np.mean([r["dynamic/dropped"] for r in decompress(recs[("dapo", s)]["curve"])])) for s in seeds]
    return (f"{' and '.join(v.upper() for v in presets)} here are recipes without a KL penalty, as their sources "
            f"have it, run at the policy learning rate the world was tuned on so that vanilla PPO, also without one, "
            f"collapses; paired by seed with vanilla PPO they cannot be told from it "
            f"(win − lose against SFT, the preset − vanilla, mean [95 % interval] over seeds "
            f"{_seed_ranges(list(seeds))}: {', '.join(diffs)}). Their KL to SFT per response is skewed by the seeds "
            f"that collapse: median (range) {', '.join(f'{v.upper()} {kl(v)}' for v in presets)}, vanilla PPO "
            f"{kl('vanilla')} nats. DAPO's dynamic sampling dropped {np.mean(dropped):.2f} groups per step (by seed "
            f"{min(dropped):.2f}–{max(dropped):.2f}); the records carry no curve of its overlong penalty's share")


def presets_brief(recs: dict | None = None, presets: tuple[str, ...] = ("dapo", "vapo")) -> str:
    """presets_sentence() in one line for the README: what the presets are here, their win − lose against vanilla
    PPO's paired by seed, and the medians and ranges of their KL per response."""
    recs = records() if recs is None else recs
    get = lambda v, m: np.array([recs[(v, s)]["metrics"][m] for s in R.seeds])  # noqa: E731
    js = [R.judge(get(v, "win_lose") - get("vanilla", "win_lose"), R.margins["win-lose"], "alike") for v in presets]
    kls = [get(v, "final_kl_seq") for v in presets]
    return (f"{' and '.join(v.upper() for v in presets)} are recipes without a KL penalty, here at the learning rate "
            f"where vanilla PPO, also without one, collapses: paired by seed, their win − lose against SFT minus "
            f"vanilla's is " + " and ".join(f"{j['mean']:+.2f} [95 %: {j['lo95']:+.2f}, {j['hi95']:+.2f}]" for j in js)
            + ", and their KL per response is skewed (medians " + " and ".join(f"{np.median(k):.1f}" for k in kls)
            + " nats, ranges " + " and ".join(f"{k.min():.1f}–{k.max():.1f}" for k in kls) + ")")


def twin(variant: str, seed: int) -> str:
    """The variant whose run stands for `variant` on `seed`: of the registry's variants with the same config (two
    names, the same flags once the defaults apply), the first by name that has a cached run, else the first by name,
    the one --run trains (run_registry keeps the first of a seed's planned variants, which are sorted by name)."""
    import runs
    same = sorted(v for v in R.variants if config_key(v, seed) == config_key(variant, seed))
    return next((v for v in same if runs.cached(v, R.variants[v], seed, R.long.get(v)) is not None), same[0])


def runs_for(variants: list[str], seeds: tuple[int, ...] | None = None, notebook: str | None = None
             ) -> dict[str, list[dict]]:
    """The runs of `variants` a notebook's figures draw: {variant: [one run per seed]}, each a dict like summary.json.

    records mode (runs.MODE, the default): the committed records, of `seeds` or else of every seed the claims of
    `notebook` that read the variant judge (claim_seeds): the runs the verdicts read; nothing is trained
    (run_of_record).
    full and small: trained or reused through runs.run_many exactly as --run does (trained())."""
    import runs
    if runs.MODE == "records":
        return from_records(variants, seeds, notebook)
    return trained(variants, seeds)


def trained(variants: list[str], seeds: tuple[int, ...] | None = None) -> dict[str, list[dict]]:
    """The runs of `variants` on `seeds` (default R.plot_seeds; the small budget: seed 0 on the small world), each
    summary.json + "dir", trained or reused through runs.run_many exactly as --run does (a variant whose flags give
    the same config as another's reads that one's run: twin()). At the full budget it prints how they compare with
    the records (against_records)."""
    import runs
    seeds = (R.plot_seeds if seeds is None else seeds) if runs.FULL else runs.SMALL_SEEDS
    specs, rep = [], {}
    for v in variants:
        for s in seeds:
            key = config_key(v, s) if runs.FULL else (v, s)
            if key not in rep:
                rep[key] = len(specs)
                name = twin(v, s) if runs.FULL else v
                specs.append((name, R.variants[name], s, R.long.get(name) if runs.FULL else None))
    done = runs.run_many(specs)
    got = {v: [done[rep[config_key(v, s) if runs.FULL else (v, s)]] for s in seeds] for v in variants}
    if runs.FULL:
        print(against_records(got, seeds))
    return got


def retrained(variants: list[str], seeds: tuple[int, ...] | None = None) -> dict[str, list[dict]]:
    """The runs a panel needs that a record does not keep (samples, a model), trained here: in records mode the
    first plot seed alone (or `seeds`) at runs' budget, cached under runs/; in full and small mode the same runs as
    runs_for. Each run carries "retrained": the words its panel shows (retrained_note)."""
    import runs
    if runs.MODE == "records" and seeds is None:
        seeds = R.plot_seeds[:1]
    got = trained(variants, seeds)
    note = runs.retrained_note()
    return {v: [{**r, "retrained": note} for r in rs] for v, rs in got.items()}


def claim_seeds(variant: str, notebook: str | None = None) -> tuple[int, ...]:
    """Every seed that a claim reading `variant` judges (the claims of `notebook`, or of the registry), sorted; the
    variant's recorded seeds when no claim reads it."""
    seeds = {s for c in R.claims if notebook is None or c.notebook == notebook
             if any(variant in part_variants(p) for p in c.parts) for s in c.seeds}
    return tuple(sorted(seeds or {s for v, s in records() if v == variant}))


def run_of_record(rec: dict) -> dict:
    """A record as a run of runs_for: the final evaluation as summary.json words it (final, sft, win_rate_vs_sft,
    frontier's kl_seq), its per-step curve as "rows" (runs.metrics reads it), the collapse alarm replayed on that curve
    under monitor.py's thresholds (plumbing.monitor.replay; a record keeps no per-step scores), and "dir" None."""
    from plumbing import monitor
    m = rec["metrics"]
    rows = decompress(rec["curve"]) if rec.get("curve") else []
    alarm = None
    if rows and rec["steps"]:   # a base (SFT + RM) has no PPO steps: its curve is the reward model's log
        replay = monitor.replay({"run": rec["variant"], "rows": rows, "scores": [None] * len(rows), "gold": []})
        alarm = {"step": replay["alarm"], "reasons": replay["reasons"]} if replay["alarm"] is not None else None
    get = m.get
    return {"variant": rec["variant"], "seed": rec["seed"], "steps": rec["steps"], "dir": None, "rows": rows,
            "final": {"gold_reward": get("final_gold"), "kl": get("final_kl"), "response_length": get("final_length"),
                      "reward": get("final_score")},
            "sft": {"gold_reward": None if get("final_gold") is None else get("final_gold") - get("final_gold_vs_sft")},
            "win_rate_vs_sft": {k: get(k) for k in ("win", "tie", "lose")}, "frontier": {"kl_seq": get("final_kl_seq")},
            "collapse_alarm": alarm,
            "machine": rec.get("machine"), "code": rec.get("code"), "record": True}


def from_records(variants: list[str], seeds: tuple[int, ...] | None = None, notebook: str | None = None
                 ) -> dict[str, list[dict]]:
    """runs_for in records mode: each variant's committed records (of `seeds`, or claim_seeds(variant, notebook)) as
    runs (run_of_record); prints one line saying which. A planned seed without a record is an error naming it; a
    variant no claim reads and without any record is retrained (retrained(): its runs say so), and the line names it."""
    recs = records()
    got, said = {}, []
    unrecorded = [v for v in variants if seeds is None and not claim_seeds(v, notebook)]
    if unrecorded:
        print(f"[records] no record of {', '.join(unrecorded)} in {R.results} (no claim reads it): retrained")
        got.update(retrained(unrecorded))
    for v in variants:
        if v in got:
            continue
        want = tuple(seeds) if seeds is not None else claim_seeds(v, notebook)
        missing = [s for s in want if (v, s) not in recs]
        if missing:
            raise FileNotFoundError(f"{R.results}: no record of {v} on seed(s) {missing}: run "
                                    f"`python notebooks/claims.py --run` or draw with PPO_MAX_MODE=full")
        got[v] = [run_of_record(recs[(v, s)]) for s in want]
        said.append(f"{v} (seeds {_seed_ranges(list(want))})")
    machines = sorted({r["machine"] for rs in got.values() for r in rs if r.get("record") and r["machine"]})
    print(f"[records] drawn from {R.name}'s committed records, nothing trained for them: " + ", ".join(said)
          + (f" (trained on {'; '.join(machines)})" if machines else ""))
    return {v: got[v] for v in variants}


def against_records(got: dict[str, list[dict]], seeds: tuple[int, ...]) -> str:
    """One line: the final held-out gold of runs_for's runs against the committed records of the same config and
    seed. Trained by the records' code on the records' machine they are the same numbers; retrained on another CPU
    they can differ (the last bits differ from the SFT stage on, and a run near a collapse amplifies them), which is
    why every verdict reads the records and never these runs."""
    import runs
    by_config = {(r["config"], r["seed"]): r for r in records().values()}
    rows = {}   # (config, seed) → (|Δ|, variant, seed, recorded, here, the record's machine): a twin counted once
    for v, rs in got.items():
        for s, run in zip(seeds, rs):
            rec = by_config.get((config_key(v, s), s))
            if rec is not None and "final_gold" in rec["metrics"]:
                here, recorded = run["final"]["gold_reward"], rec["metrics"]["final_gold"]
                rows[(rec["config"], s)] = (abs(here - recorded), v, s, recorded, here, rec["machine"])
    if not rows:
        return f"[records] none of these runs has a record in {R.results} to compare with"
    rows = list(rows.values())
    gaps = np.array([row[0] for row in rows])
    d, v, s, recorded, here, where = max(rows, key=lambda row: row[0])
    margin = R.margins["gold"]
    line = (f"[records] final held-out gold of these {len(rows)} runs against {R.name}'s records of the same config "
            f"and seed: {int((gaps < 1e-9).sum())} equal, median |Δ| {np.median(gaps):.3g}, "
            f"{int((gaps > margin).sum())} beyond the gold margin ±{margin:g}")
    if d >= 1e-9:
        line += (f"; the largest, {v} seed {s}: {recorded:+.3f} recorded on {where}, {here:+.3f} here on {machine()}"
                 + (". The panels that say 'retrained' show these runs; every other panel and every verdict reads "
                    "the records" if runs.MODE == "records" else
                    ". The tables and figures show these runs; every verdict reads the records"))
    return line


def heldout_curve(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """A run of runs_for's held-out curve as METRICS' hgold_* read it: (steps, held-out gold − the SFT policy's), each
    (points,); step 0 is the SFT policy (0 by construction), the last point the final evaluation."""
    import runs
    pts = np.array(_curve({"metrics": runs.metrics(run), "summary": run}))   # (points, 2): step, held-out gold
    return pts[:, 0], pts[:, 1] - pts[0, 1]


def run_operating_point() -> dict:
    """OPERATING_POINT's pilot: every candidate on the pilot seeds (train.py's flags as they are plus the
    candidate's), and the rule's choice."""
    import runs
    runs.configure(full=True)
    cands = OPERATING_POINT["candidates"]
    specs = [(f"op-{i}", flags, s, None) for i, (_, flags) in enumerate(cands) for s in OPERATING_POINT["pilot_seeds"]]
    done = runs.run_many(specs)
    kl, rows = {}, {}
    for i, (name, flags) in enumerate(cands):
        rs = [r for (n, *_), r in zip(specs, done) if n == f"op-{i}"]
        kl[name] = float(np.mean([r["frontier"]["kl_seq"] for r in rs]))
        rows[name] = {"flags": list(flags), "kl_seq": [r["frontier"]["kl_seq"] for r in rs],
                      "kl_tok": [r["final"]["kl"] for r in rs],
                      "gold_vs_sft": [r["final"]["gold_reward"] - r["sft"]["gold_reward"] for r in rs],
                      "win_lose": [r["win_rate_vs_sft"]["win"] - r["win_rate_vs_sft"]["lose"] for r in rs]}
    choice, reached = choose_operating_point(kl)
    out = {"target_kl_seq": OPERATING_POINT["target_kl_seq"], "pilot_seeds": list(OPERATING_POINT["pilot_seeds"]),
           "candidates": rows, "choice": choice, "reached": reached, "code": runs.code_version(),
           "commit": git_commit()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "operating-point.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:<32} KL/response {np.mean(row['kl_seq']):.3f} {[round(x, 3) for x in row['kl_seq']]}")
    print(f"choice: {choice} ({'reaches' if reached else 'misses'} {OPERATING_POINT['target_kl_seq']:.3f} nats)")
    print(runs.report())
    return out


def run_operating_point_v2(reuse: bool = False) -> dict:
    """registry_v2.OPERATING_POINT's pilot: every candidate on its pilot seeds, and the rule's choice, written to
    notebooks/results/v2/operating-point.json (with each run's win − lose, KL per token and per response, gold − SFT,
    and the code versions that trained the runs). With `reuse`, the pilot's saved runs are read as they are, whatever
    code trained them (runner.json says which); else runs trained by other code than this tree's are trained again."""
    import registry_v2
    import runs
    op = registry_v2.OPERATING_POINT
    runs.configure(full=True)
    specs = [(f"op2-{i}", flags, s, None) for i, (_, flags) in enumerate(op["candidates"]) for s in op["pilot_seeds"]]
    done = [runs.saved(runs.out_dir(n, s)) for n, _, s, _ in specs] if reuse else runs.run_many(specs)
    rows = {}
    for i, (name, flags) in enumerate(op["candidates"]):
        rs = [r for (n, *_), r in zip(specs, done) if n == f"op2-{i}"]
        rows[name] = {"flags": list(flags), "win_lose": [r["win_rate_vs_sft"]["win"] - r["win_rate_vs_sft"]["lose"]
                                                         for r in rs],
                      "kl_tok": [r["final"]["kl"] for r in rs], "kl_seq": [r["frontier"]["kl_seq"] for r in rs],
                      "gold_vs_sft": [r["final"]["gold_reward"] - r["sft"]["gold_reward"] for r in rs]}
    choice = registry_v2.choose_operating_point(rows)
    trained_by = sorted({json.loads((r["dir"] / "runner.json").read_text())["code"] for r in done})
    out = {"pilot_seeds": list(op["pilot_seeds"]), "tie": op["tie"], "candidates": rows, "choice": choice,
           "trained_by": trained_by, "commit": git_commit(), "machine": machine()}
    (RESULTS / "v2").mkdir(parents=True, exist_ok=True)
    (RESULTS / "v2" / "operating-point.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:<40} win − lose {np.mean(row['win_lose']):+.3f} {[round(x, 3) for x in row['win_lose']]}  "
              f"KL/token {np.mean(row['kl_tok']):.3f}  gold − SFT {np.mean(row['gold_vs_sft']):+.3f}")
    print(f"choice: {choice}")
    print(runs.report())
    return out


def parse_seeds(text: str) -> set[int]:
    """'6-9' or '6,7,8' (or both, comma-separated) → {6, 7, 8, 9}; a bad one is a one-line exit 2."""
    out = set()
    try:
        for item in text.split(","):
            lo, _, hi = item.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        print(f"error: --seeds: {text!r} is not a list of seeds such as 6-9 or 6,7,8", file=sys.stderr)
        raise SystemExit(2) from None
    return out


# =====================================================================================================================
# The registries: v1 (this file's CLAIMS, MARGINS, SEEDS and rule, as committed: exploratory) and v2
# (notebooks/registry_v2.py: confirmatory). Every function above reads the one selected (R); v2 by default.
# =====================================================================================================================
@dataclass
class Registry:
    """What a registry is: its claims, margins, variants (and their PPO budgets), where its records live, the rule
    that judges one part and how a part prints, its rule's text for docs/findings.md, the seeds each claim was first
    planned on (v1's second stage), the metrics its records hold, the README summary's variants and seeds, and the
    seeds its figures draw, and the qualifiers printed beside its verdicts (none for v1: its records keep no curve)."""
    name: str
    claims: list
    margins: dict
    variants: dict
    long: dict
    results: Path
    judge: object
    part_text: object
    rule_text: object
    first_plan: dict
    run_metrics: dict
    base_metrics: dict
    final_metrics: tuple
    summary: tuple
    seeds: tuple
    plot_seeds: tuple
    qualifiers: dict = field(default_factory=dict)
    world_b_seeds: tuple = ()    # the seeds that live in world B (v3's); every other seed is world A's
    acts: object = None          # acts(claim, recs) -> {"below": bool, ...} or None: how much the claim's mechanism
    #                              acted, where the registry declares it (v3); below its threshold → "not tested"


V1 = Registry("v1", CLAIMS, MARGINS, VARIANTS, LONG, RESULTS, judge, part_text, rule_text, FIRST_PLAN, RUN_METRICS,
              BASE_METRICS, FINAL_METRICS, SUMMARY, SEEDS, PLOT_SEEDS)


def registry(name: str) -> Registry:
    """The registry of that name: "v1" (exploratory, as committed), "v2" (confirmatory, notebooks/registry_v2.py) or
    "v3" (does a verdict travel to world B; the claims v2 nearly decided: notebooks/registry_v3.py)."""
    if name == "v1":
        return V1
    if name == "v2":
        import registry_v2
        return registry_v2.REGISTRY
    if name == "v3":
        import registry_v3
        return registry_v3.REGISTRY
    print(f"error: --registry {name}: choose v1, v2 or v3", file=sys.stderr)
    raise SystemExit(2)


class _Selected:
    """R: the selected registry, v2 unless select() chose another (v2 is looked up on first use: registry_v2.py
    imports this file)."""
    registry: Registry | None = None

    def __getattr__(self, name: str):
        if _Selected.registry is None:
            _Selected.registry = registry("v2")
        return getattr(_Selected.registry, name)


def select(name: str) -> Registry:
    """Make `name` the registry every function reads (R)."""
    _Selected.registry = registry(name)
    return _Selected.registry


R = _Selected()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="notebooks/claims.py", description=__doc__.split("\n")[0])
    p.add_argument("--run", action="store_true", help="train (or reuse) the registry's runs and write their records")
    p.add_argument("--claims", default="", help="with --run or --show: comma-separated claim ids (default: all)")
    p.add_argument("--seeds", default="", help="with --run: only these seeds, as 6-9 or 6,7,8 (default: every planned "
                   "seed)")
    p.add_argument("--table", action="store_true", help="print docs/findings.md's verdict table")
    p.add_argument("--tally", action="store_true", help="print the tally as one JSON line")
    p.add_argument("--write-docs", action="store_true", help="write the table and the tally into docs/findings.md, "
                   "and --summary into README.md (between their marks)")
    p.add_argument("--show", action="store_true", help="print every claim (or --claims) part by part")
    p.add_argument("--travel", action="store_true", help="with --registry v3: v2's decided verdicts (world A) beside "
                   "v3's in world B, with the engagement in each (with --tally: the outcomes' counts)")
    p.add_argument("--registry", default="v2", help="v2 (the confirmatory registry, notebooks/registry_v2.py: the "
                   "default), v1 (the exploratory one, this file's, as committed) or v3 (v2's decided claims in world "
                   "B and its nearly decided ones on fresh seeds: notebooks/registry_v3.py)")
    p.add_argument("--operating-point", action="store_true", help="run OPERATING_POINT's pilot and print its choice")
    p.add_argument("--operating-point-v2", action="store_true", help="run registry_v2.OPERATING_POINT's pilot, write "
                   "notebooks/results/v2/operating-point.json and print its choice")
    p.add_argument("--reuse", action="store_true", help="with --operating-point-v2: read the pilot's saved runs as "
                   "they are, whatever code trained them (runner.json names it)")
    p.add_argument("--records", action="store_true", help="write every record again from the cached runs")
    p.add_argument("--summary", action="store_true", help="the README's table of SFT, PPO-max, vanilla and "
                   "best-of-4 from the records (with --run: trains those runs missing on --seeds, or on every seed, "
                   "instead of the registry's)")
    p.add_argument("--successor", action="store_true", help="v2's records as a successor registry's pilot: per cap "
                   "on seeds, how many claims 80 %% power reaches and what it costs (JSON lines; not v2's plan)")
    args = p.parse_args(argv)
    select(args.registry)
    if args.travel and args.registry != "v3":
        print("error: --travel: reads registry v3's world B runs; add --registry v3", file=sys.stderr)
        raise SystemExit(2)
    ids = [c for c in args.claims.split(",") if c]
    unknown = [c for c in ids if c not in {x.id for x in R.claims}]
    if unknown:
        print(f"error: --claims: unknown claim(s) {unknown}", file=sys.stderr)
        raise SystemExit(2)
    if args.operating_point:
        run_operating_point()
    if args.operating_point_v2:
        run_operating_point_v2(reuse=args.reuse)
    if args.run and not args.summary:
        run_registry(ids or None, parse_seeds(args.seeds) if args.seeds else None)
    if args.travel:
        import registry_v3
        print(json.dumps(registry_v3.travel_tally()) if args.tally else registry_v3.travel_table())
    if args.table:
        print(table())
    if args.tally and not args.travel:
        print(json.dumps(tally()))
    if args.show:
        show(ids or [c.id for c in R.claims])
    if args.write_docs:  # both registries' blocks; the README's summary from v2's records, v1's until v2 has some
        for name in ("v1", "v2", "v3"):
            select(name)
            write_findings()
        text = readme_summary()
        import registry_v3
        write_findings(path=README, blocks={SUMMARY_MARKS: text, V3_SENTENCE_MARKS: registry_v3.readme_sentence()})
        select(args.registry)
        print(f"wrote every registry's rules, verdict tables and tallies into {FINDINGS.relative_to(ROOT)}, and "
              f"the summary ({text.splitlines()[0]}) into README.md")
    if args.records:
        print(f"{rewrite_records()} records written from cached runs")
    if args.successor:
        import registry_v2
        for row in registry_v2.successor_plan():
            print(json.dumps(row))
    if args.summary:
        seeds = parse_seeds(args.seeds) if args.seeds else set(R.seeds)
        missing = sorted({s for v in R.summary for s in seeds if not record_path(v, s).exists()})
        if missing and args.run:   # trains (or reuses) the summary's runs of these seeds first
            write_records(R.summary, tuple(missing))
        print(summary())


if __name__ == "__main__":
    sys.modules["claims"] = sys.modules[__name__]   # registry_v2.py's `import claims` is this module, not a second one
    main()
