"""The confirmatory registry (v2): how train.py's default PPO-max is chosen, every claim v2 judges with its metric,
margin and planned seeds, and the one rule that judges them, all committed before any run that judges them.

v1 (notebooks/claims.py's own CLAIMS, MARGINS, SEEDS) stays as committed: an exploratory study, honestly computed,
whose records are v2's pilot. `python notebooks/claims.py --registry v1 --table` prints it; v2 is the default.

Implements: no equation of the paper.
  OPERATING_POINT        the rule that sets PPO-max's default, written before its pilot (it names no figure claim)
  MARGINS                the smallest difference that matters, one per kind of number, each with its reason
  RULE, judge(d, margin, direction)   one standard both ways: a 90 % interval inside ±margin, or wholly beyond it
  VARIANTS, CLAIMS       the runs (train.py flags on top of the default) and the claims: the paper's own, each with
                         its sentence, the project's own (labelled), and the newer tricks' sources' own
  plan_seeds()           the seeds of each claim, from v1's effects and spreads, for 80 % power under RULE
  SEED_PLAN, BUDGET      that plan as committed, and the compute it costs
  REGISTRY               what notebooks/claims.py reads
Every v2 record is under notebooks/results/v2/, trained by one code version (docs/findings.md names its tag), on
seeds from 1000: none of v1's (0-19), v1's pilot (100-102) or this operating point's pilot (300-302).
"""
from __future__ import annotations

import math

import numpy as np

import claims
from claims import BASE, ENT_CLIP, P, W, Claim, V

# =====================================================================================================================
# OPERATING_POINT: a default is chosen for what it achieves. The outcome that matters is the held-out comparison with
# SFT under gold (summary.json's win − lose against SFT: the final policy and SFT on the held-out prompts, the same
# sampling, judged by the synthetic human), averaged over pilot seeds that no registry uses (v1: 0-19, its pilot
# 100-102; v2's claims: from 1000). Candidates: the paper's own settings (η = 0.05, 0.1, 0.2, Fig. 15, with ptx on
# the pre-training text as Eq. 17 means it) and every candidate of v1's operating point (ptx on the pre-training text
# or the demonstrations at three weights, and a doubled policy learning rate). The budget is train.py's (80 PPO
# steps: `python train.py` stays within about 3 minutes on 2 cores).
# Rule: the candidate with the highest pilot mean win − lose; candidates within TIE of it are tied, and of those the
# one with the smallest pilot mean KL to SFT per token (summary.json's final kl) wins. "PPO-max beats SFT" is then
# true by construction of the default, and every statement of it says so.
# =====================================================================================================================
OPERATING_POINT = {
    "pilot_seeds": (300, 301, 302),
    "tie": 0.02,   # two points of held-out comparisons: a fifth of the win − lose margin (MARGINS["win-lose"] 0.10)
    "candidates": [
        ("η 0.05, ptx pretrain 0.5", ("--kl-coef", "0.05", "--ptx-data", "pretrain", "--ptx-coef", "0.5")),
        ("η 0.1, ptx pretrain 0.5", ("--kl-coef", "0.1", "--ptx-data", "pretrain", "--ptx-coef", "0.5")),
        ("η 0.2, ptx pretrain 0.5", ("--kl-coef", "0.2", "--ptx-data", "pretrain", "--ptx-coef", "0.5")),
        ("η 0.05, ptx pretrain 0.25", ("--kl-coef", "0.05", "--ptx-data", "pretrain", "--ptx-coef", "0.25")),
        ("η 0.05, ptx pretrain 0.1", ("--kl-coef", "0.05", "--ptx-data", "pretrain", "--ptx-coef", "0.1")),
        ("η 0.05, ptx sft 0.25", ("--kl-coef", "0.05", "--ptx-data", "sft", "--ptx-coef", "0.25")),
        ("η 0.05, ptx sft 0.1", ("--kl-coef", "0.05", "--ptx-data", "sft", "--ptx-coef", "0.1")),
        ("η 0.1, ptx sft 0.25", ("--kl-coef", "0.1", "--ptx-data", "sft", "--ptx-coef", "0.25")),
        ("η 0.2, ptx sft 0.25", ("--kl-coef", "0.2", "--ptx-data", "sft", "--ptx-coef", "0.25")),
        ("η 0.05, lr 1.4e-4, ptx pretrain 0.5", ("--kl-coef", "0.05", "--policy-lr", "1.4e-4", "--ptx-data", "pretrain",
                                                 "--ptx-coef", "0.5")),
        ("η 0.05, lr 1.4e-4, ptx pretrain 0.25", ("--kl-coef", "0.05", "--policy-lr", "1.4e-4", "--ptx-data",
                                                  "pretrain", "--ptx-coef", "0.25")),
        ("η 0.05, lr 1.4e-4, ptx pretrain 0.1", ("--kl-coef", "0.05", "--policy-lr", "1.4e-4", "--ptx-data",
                                                 "pretrain", "--ptx-coef", "0.1")),
    ],
}


def choose_operating_point(rows: dict[str, dict]) -> str:
    """OPERATING_POINT's rule on the pilot's numbers {candidate: {"win_lose": [per seed], "kl_tok": [per seed]}}:
    the highest mean win − lose; within OPERATING_POINT["tie"] of it, the smallest mean KL per token."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    best = max(mean(r["win_lose"]) for r in rows.values())
    tied = [name for name, r in rows.items() if mean(r["win_lose"]) >= best - OPERATING_POINT["tie"]]
    return min(tied, key=lambda name: (mean(rows[name]["kl_tok"]), name))


# =====================================================================================================================
# The margins: the smallest difference that would change what a reader does, one per kind of number, each with its
# reason, fixed before v2's runs. They are v1's (docs/findings.md says which v1 changed after its pilot and why those
# reasons still stand); the perplexity ratio's margin also judges the pre-training text (the alignment tax).
# =====================================================================================================================
MARGINS = {
    "gold": 0.25,       # gold reward per response: less than one filler word (gold charges 0.3 for it)
    "score": 0.25,      # the proxy reward model's score, on gold's scale of one filler word
    "win-lose": 0.10,   # ten percentage points of held-out comparisons with SFT
    "kl": 0.01,         # nats per token: ~0.1 nats per response of 9 tokens, a sixth of best-of-4's 0.64 nats
    "length": 1.0,      # one token per response: one more or fewer word of an answer
    "ppl": 0.10,        # a perplexity (of the policy's own samples, or of pre-training text), as a ratio − 1: 10 %
    "entropy": 0.05,    # nats per token: 5 % of the SFT policy's ~1 nat of per-token entropy
    "vf": 0.05,         # value loss (squared return error): 5 % of a variance of one normalised reward
    "pg": 0.10,         # policy-gradient loss: a tenth of a whitened advantage's unit
    "adv": 0.02,        # advantage spread (std over tokens, per step): 2 % of a unit spread
    "steps": 8.0,       # a step count (KL onset): one held-out-curve interval (--heldout-every 8)
    "skew": 0.5,        # skewness of the reward model's scores over a batch: half of a unit (a visible tail)
    "share": 0.10,      # a share or fraction (of pairs, of the accuracy gain)
    "acc": 0.03,        # reward-model accuracy: three points, about one standard error on 600 held-out pairs
    "slope": 0.05,      # score change per added filler token: a sixth of gold's −0.3
}

# =====================================================================================================================
# The rule: one standard both ways. Per seed s, d_s = metric(a) − metric(b) (or a constant, or another window of the
# same run; perplexities as a ratio − 1); mean d̄, sd s (ddof 1), n seeds, the 90 % interval d̄ ± t(0.95, n−1)·s/√n.
# =====================================================================================================================
RULE = ("per seed s (each seed its own world, SFT model and reward model) d_s = metric(a) − metric(b) (or − a "
        "constant); with the mean d̄, sd s (ddof 1) and n seeds, the 90 % interval d̄ ± t(0.95, n−1)·s/√n: 'alike' "
        "when it lies inside ±margin (equivalence, TOST at 5 % each side); 'higher' / 'lower' when it lies wholly "
        "beyond +margin / −margin (a minimum-effect test at the same 5 % one side); else 'undecided', printed with "
        "the seeds that would decide it at the observed d̄ and s, and 'different from 0, size undecided' when the 95 % "
        "interval excludes 0. Beside every verdict, the margins for which it holds")
COMBINE = claims.COMBINE


def judge(d, margin: float, direction: str) -> dict:
    """RULE on the paired differences d (one per seed), then the part's answer against the paper's `direction`
    ("higher", "lower", "alike", "differs", or "not-lower": no worse by more than the margin): "as the paper",
    "against the paper", "alike" (no difference that matters where the paper claims one) or "undecided". Returns
    the numbers with it, and the margins for which the verdict holds: "alike_above" (alike for any margin above it)
    and "beyond_below" (higher / lower for any margin below it)."""
    d = np.asarray(d, float)
    n = len(d)
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else float("inf")
    se = sd / math.sqrt(n) if n > 1 else float("inf")
    h90 = claims.t_quantile(0.95, n - 1) * se if n > 1 else float("inf")
    h95 = claims.t_quantile(0.975, n - 1) * se if n > 1 else float("inf")
    lo, hi = mean - h90, mean + h90
    if -margin < lo and hi < margin:
        stat = "alike"
    elif lo > margin:
        stat = "higher"
    elif hi < -margin:
        stat = "lower"
    else:
        stat = "undecided"
    answer = {"alike": {"alike": "as the paper", "higher": "against the paper", "lower": "against the paper"},
              "higher": {"higher": "as the paper", "lower": "against the paper", "alike": "alike"},
              "lower": {"lower": "as the paper", "higher": "against the paper", "alike": "alike"},
              "differs": {"higher": "as the paper", "lower": "as the paper", "alike": "alike"},
              "not-lower": {"higher": "as the paper", "alike": "as the paper", "lower": "against the paper"},
              }[direction].get(stat, "undecided")
    if direction == "not-lower":   # one side of the same 90 % interval: above −margin (no worse), or below it (worse)
        answer = "as the paper" if lo > -margin else ("against the paper" if hi < -margin else "undecided")
    return {"answer": answer, "stat": stat, "mean": mean, "sd": sd, "n": n, "lo90": lo, "hi90": hi,
            "lo95": mean - h95, "hi95": mean + h95, "above": int((d > 0).sum()),
            "nonzero": bool(mean - h95 > 0 or mean + h95 < 0),
            "alike_above": max(abs(lo), abs(hi)),
            "beyond_below": lo if lo > 0 else (-hi if hi < 0 else None),
            "no_worse_above": max(0.0, -lo),
            "seeds_to_decide": seeds_to_decide(mean, sd, margin, direction) if answer == "undecided" and n > 1 else None}


def seeds_to_decide(mean: float, sd: float, margin: float, direction: str = "higher") -> int | None:
    """The smallest n at which RULE would decide a part with this observed mean and sd (alike, or beyond the margin;
    for "not-lower": the interval wholly above or wholly below −margin); None beyond 10,000 seeds (a mean on the
    margin itself is never decided)."""
    def decides(n: int) -> bool:
        h = claims.t_quantile(0.95, n - 1) * sd / math.sqrt(n)
        if direction == "not-lower":
            return mean - h > -margin or mean + h < -margin
        return abs(mean) + h < margin or abs(mean) - h > margin
    if not decides(10_000):
        return None
    lo, hi = 2, 10_000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decides(mid) else (mid + 1, hi)
    return lo


def part_text(p: dict) -> str:
    """One part as docs/findings.md prints it: the mean and 90 % interval, the seeds above 0, the answer, the margins
    for which it holds, and what would decide an undecided part."""
    part = p["part"]
    if p["answer"] == "not run":
        return claims.part_text(p)
    text = (f"{part.what}: {claims._fmt(p['mean'])} [90 %: {claims._fmt(p['lo90'])}, {claims._fmt(p['hi90'])}], "
            f"{p['above']}/{p['n']} seeds > 0 → {claims.label(p['answer'])}")
    if part.direction == "not-lower" and p["answer"] != "undecided":
        if p["answer"] == "as the paper":
            text += f" (no worse for any margin above {p['no_worse_above']:.3g})"
        else:
            text += f" (worse for any margin below {-p['hi90']:.3g})"
    elif p["stat"] == "alike":
        text += f" (no difference that matters for any margin above {p['alike_above']:.3g})"
    elif p["stat"] in ("higher", "lower"):
        text += f" ({p['stat']} for any margin below {p['beyond_below']:.3g})"
    else:
        if p["nonzero"]:
            text += " (different from 0, size undecided)"
        need = p["seeds_to_decide"]
        text += f" (~{need} seeds would decide it)" if need else " (no number of seeds would decide it at this mean)"
    return text


# =====================================================================================================================
# The metrics: v1's (claims.py: final_*, hgold_*, the training windows, the base's), and these.
#   pretrain_ppl   the final policy's perplexity on pre-training text no stage trained on / SFT's (summary.json's
#                  pretrain_text): the alignment tax that Eq. 17's ptx is there to limit. Compared as a ratio.
#   mid10:KEY      the 10 training steps around the middle of the run (35-44 of 80): a window to compare the end
#                  with where a quantity that starts at 0 by construction (the KL to the reference) has already moved
#   q3:KEY, q4:KEY the third and the last quarter of the run: a plateau is the late part of a run staying put
#   skew_first10   the skewness of the RM scores of the training batches of steps 1-10, mean over the steps
# =====================================================================================================================
def _window2(run: dict, key: str, which: str) -> float:
    y = np.array([np.nan if m.get(key) is None else m[key] for m in run["metrics"]], float)
    n = len(y)
    sl = {"mid10": slice(max(n // 2 - 5, 0), n // 2 + 5), "q3": slice(n // 2, 3 * n // 4),
          "q4": slice(3 * n // 4, None)}[which]
    window = y[sl]
    return float(np.nanmean(window)) if (~np.isnan(window)).any() else float("nan")  # a key the run never logged


RUN_METRICS = {**claims.RUN_METRICS,
               # None for best-of-n and DPO, whose summaries have no pre-training-text evaluation (not recorded)
               "pretrain_ppl": lambda r: (r["summary"]["pretrain_text"]["policy_ppl"]
                                          / r["summary"]["pretrain_text"]["sft_ppl"]
                                          if "pretrain_text" in r["summary"] else None),
               "skew_first10": lambda r: float(np.mean([claims._skew(s["scores"]) for s in r["samples"][1:11]])),
               **{f"{w}:{k}": (lambda r, k=k, w=w: _window2(r, k, w)) for k in claims.TRAIN_KEYS
                  for w in ("mid10", "q3", "q4")}}


def _rm_after(base: dict, frac: float) -> float:
    steps = np.array([r["step"] for r in base["rm_log"]], float)
    acc = np.array([r["heldout_accuracy"] for r in base["rm_log"]], float)
    return float(acc[-1] - np.interp(frac * steps[-1], steps, acc))


BASE_METRICS = dict(claims.BASE_METRICS)
FINAL_METRICS = claims.FINAL_METRICS + ("pretrain_ppl",)

# =====================================================================================================================
# The variants: train.py flags on top of its default (the operating point above). Fig. 15's three η are named by
# their value, so that one of them is the default itself (one run serves both names: claims.twin).
# =====================================================================================================================
KL = V + ("--kl-coef", "0.05")   # "a PPO configuration that would converge normally" (Fig. 16): vanilla + the KL penalty
CRITIC_PRETRAIN = "30"           # PPO-max's critic pre-training (train.py's --critic-pretrain-steps default)
VARIANTS: dict[str, tuple] = {
    **{k: v for k, v in claims.VARIANTS.items()
       if k not in ("ppo-max-kl0.1", "ppo-max-kl0.2", "clip-0.1", "clip-0.4")
       and not (k.startswith("ent-") and k != "ent-0.01-clip")},
    "ppo-max-kl0.05": ("--kl-coef", "0.05"), "ppo-max-kl0.1": ("--kl-coef", "0.1"),
    "ppo-max-kl0.2": ("--kl-coef", "0.2"),
    # Fig. 7: importance sampling with the KL penalty, against the KL penalty alone
    "kl-0.05-is": KL + ("--importance-sampling",),
    # Fig. 16: the entropy bonus on a base that converges without it (vanilla + η 0.05), clipped at δ or not
    **{f"kl-ent-{w}-{c}": KL + ("--entropy-coef", w) + (("--entropy-clip", d) if d else ())
       for w in ("0.01", "0.1")
       for c, d in (("clip", str(ENT_CLIP)), ("clip-0.9", "0.9"), ("clip-1.1", "1.1"), ("noclip", None))},
    # Fig. 8: critic pre-training on vanilla PPO (the paper's setting), and the critic's initialisation without it
    "vanilla-critic-pretrain": V + ("--critic-pretrain-steps", CRITIC_PRETRAIN),
    "critic-sft-no-critic-pretrain": ("--ptx-data", "pretrain", "--critic-init", "sft", "--critic-pretrain-steps",
                                      "0"),
    # Fig. 17: no clip and ε 0.5 (the paper's two), on vanilla PPO
    "clip-none": V + ("--clip-eps", "0"), "clip-0.5": V + ("--clip-eps", "0.5"),
    # what PPO gained since the paper (docs/methods.md), each on the run its source changes
    "vanilla-cliphigher": V + ("--clip-eps-high", "0.28"),
    "topp": ("--rollout-mismatch", "top-p"),
    "topp-tis": ("--rollout-mismatch", "top-p", "--rollout-correction", "tis"),
    "k3-loss": ("--kl-in", "loss"),
    "vreturns": ("--critic-pretrain-target", "returns"),
    "lam-critic-1": ("--lam-critic", "1.0"),
    "grpo": ("--advantage", "grpo", "--group-size", "4"),
    "gspo": ("--advantage", "grpo", "--group-size", "4", "--ratio", "sequence", "--clip-eps", "3e-4",
             "--clip-eps-high", "4e-4"),
    "cispo": ("--policy-loss", "cispo"),
    "dapo": ("--preset", "dapo"),
    "vapo": ("--preset", "vapo"),
}
LONG = dict(claims.LONG)
SUMMARY = ("ppo-max", "vanilla", "bon-4", "dapo", "vapo")   # the README's table: SFT, these, paired by seed


# =====================================================================================================================
# The claims. The paper's own: each claim is the paper's sentence, quoted with its place in the paper (the
# technical report, arXiv 2307.04964v2), read with metrics that can pass or fail: no part is a within-run change of
# a quantity that starts at 0 by construction (the KL to the reference at step 0), or a loss that a stage before it
# minimised. Where the paper's figure and its sentence differ, the sentence is the claim and `why` says what the
# figure shows. The project's own claims are labelled; one claim per newer trick is its source's own. Seeds:
# SEED_PLAN (below).
# =====================================================================================================================
VANILLA_TUNED = claims.VANILLA_TUNED
OWN = " (the project's own claim, not the paper's)"
PAPER_CLAIMS: list[Claim] = [
    # ----------------------------------------------------------------------------------------- the reward model (§4)
    Claim("fig3", "3", "\"the rate of improvement significantly slows down after 200 steps [a fifth of the run] ..., "
          "the accuracy of which is comparable to that obtained after training for a complete epoch\" (§4.4)", (
        P("share of the accuracy gain reached by 20 % of the steps − ½ (most of it early)", "rm_share20", BASE, None,
          "higher", "share", 0.5),
        P("accuracy at the end − at 20 % of the steps (comparable)", "rm_after20", BASE, None, "alike", "acc"),
    ), notebook="rm", why="the sentence, as the paper states it; its own English curve still gains ~0.10 after "
                          "step 200 while its caption says the accuracy 'steadily improves'"),
    Claim("fig2", "2", "\"Both models exhibit a degree of alignment with human preferences\" (§4.3): r(chosen) − "
          "r(rejected) on held-out pairs", (
        P("share of held-out margins > 0 − ½", "margin_pos", BASE, None, "higher", "share", 0.5),
        P("share of helpful held-out pairs the RM orders like gold − ½ (gold: the world's human; the project's "
          "analogue)", "rm_gold_agree", BASE, None, "higher", "share", 0.5),
    ), notebook="rm", why="'a degree of' read as better than chance"),
    Claim("sec4.3", "§4.3", "\"the response that RM gave a higher reward was notably longer compared to the other "
          "which is preferred by human\" (§4.3, on the pairs it got most wrong)", (
        P("RM − gold score change per filler token added to a correct answer", "length_bias", BASE, None, "higher",
          "slope"),
    ), notebook="rm", construction=VANILLA_TUNED,
        why="the paper's observation on its worst pairs, read as a controlled length bias (the project's "
            "generalisation)"),
    # ---------------------------------------------------------------------------------- vanilla PPO's collapse (§5.2)
    Claim("fig4-reward", "4", "\"We observed stable convergence processes in training loss, but higher rewards do "
          "not reflect better policy behaviors\" (§5.2, vanilla PPO)", (
        W("RM score, last 10 − first 5 steps (the reward rises)", "reward/score", "vanilla", "higher", "score"),
        P("PG loss over the last 10 steps (converged: near 0)", "last10:loss/pg", "vanilla", None, "alike", "pg"),
        P("VF loss over the last 10 steps (converged: near 0)", "last10:loss/vf", "vanilla", None, "alike", "vf"),
    ), notebook="vanilla_collapse", construction=VANILLA_TUNED,
        why="v1 asked the VF loss to fall, which an unfitted critic's must: the paper's 'converged' is its level"),
    Claim("fig4-winrate", "4", "\"higher rewards do not reflect better policy behaviors from the perspective of human "
          "and GPT-4 evaluation\" (§5.2): the win rate against SFT rises, then falls below it (Fig. 4)", (
        P("held-out gold over steps 8–32 − SFT's (it rises first)", "hgold_early", "vanilla", None, "higher", "gold"),
        P("held-out gold over steps 8–32 − over the last 3 points (then falls)", "hgold_early", "vanilla", None,
          "higher", "gold", minus="hgold_end"),
        P("win − lose of the final policy against SFT (held out, under gold)", "win_lose", "vanilla", None, "lower",
          "win-lose"),
    ), notebook="vanilla_collapse", construction=VANILLA_TUNED),
    Claim("fig4-drift", "4", "\"the collapsed model uniformly delivers longer responses and exhibits lower perplexity\" "
          "(§5.2), with the KL to the SFT model rising (Fig. 4)", (
        W("KL, last 10 − steps 35–44 (still rising in the second half)", "kl/ref", "vanilla", "higher", "kl",
          first="mid10"),
        W("perplexity, last 10 / first 5 steps − 1", "policy/perplexity", "vanilla", "lower", "ppl"),
        W("length, last 10 − first 5 steps", "response/length", "vanilla", "higher", "length"),
    ), notebook="vanilla_collapse", construction=VANILLA_TUNED,
        why="the KL starts at 0: v1's 'last 10 − first 5' passed for any run that moves; the second half's rise "
            "does not"),
    Claim("fig13", "13", "\"The reward model exhibits identical reward distribution over the stable training period "
          "and subsequently exhibits long-tail characteristics after pattern collapse\" (Fig. 13, vanilla PPO)", (
        P("vanilla: skewness of the RM scores over steps 1–10 − at step 0 (stable period: the same)",
          "skew_first10", "vanilla", None, "alike", "skew", minus="skew_first"),
        P("vanilla: skewness over the last 10 steps − at step 0 (after the collapse: a tail)", "skew_last10",
          "vanilla", None, "differs", "skew", minus="skew_first"),
    ), notebook="vanilla_collapse",
        why="within the vanilla run, as the paper's figure; v1 compared PPO-max, which the figure does not show. "
            "The RM scores are the training batches' (the paper: a sub-validation set of the training data's kind)"),
    # --------------------------------------------------------------------------------------------- PPO-max (§5.4)
    Claim("fig9", "9", "\"PPO-max ensures long-term stable policy optimization for the model\" (Fig. 9, 10K steps)", (
        W("RM score, last − first eighth of 400 steps", "reward/score", "ppo-max-long", "higher", "score",
          "first8th", "last8th"),
        W("KL, last − third quarter (a plateau, no late drift)", "kl/ref", "ppo-max-long", "alike", "kl", "q3",
          "q4"),
        W("length, last − third quarter", "response/length", "ppo-max-long", "alike", "length", "q3", "q4"),
        W("perplexity, last / third quarter − 1", "policy/perplexity", "ppo-max-long", "alike", "ppl", "q3", "q4"),
    ), notebook="ppo_max", why="in the paper's figure length and perplexity move over the first quarter and then "
                                "stay: stability is the late run staying put (v1 compared the first and last "
                                "eighths, which the figure itself fails)"),
    Claim("ptx", "§5.4, Eq. 17", "\"To reduce alignment tax, we add pre-train language model loss in policy "
          "optimization\" (§5.4); \"PPO-ptx effectively alleviates the decline in NLU capabilities\" (§6.4)", (
        P("pre-training-text perplexity of the final policy against SFT's, with ptx / without − 1",
          "pretrain_ppl", "ppo-max", "no-ptx", "lower", "ppl"),
    ), notebook="win_rates", why="v1 judged ptx by the win rate; the paper adds it for language ability and measures "
                                  "it on a knowledge benchmark: here the likelihood of pre-training text no stage "
                                  "trained on"),
    # ---------------------------------------------------------------------------- score reparameterisation (§5.3.1)
    Claim("fig6-scale", "6", "\"PPO exhibits consistent patterns in training trajectories with and without reward "
          "scaling\" (§5.3.1)", (
        P("KL onset step, scaling − vanilla", "kl_onset", "rscale", "vanilla", "alike", "steps"),
        P("win − lose against SFT, scaling − vanilla", "win_lose", "rscale", "vanilla", "alike", "win-lose"),
    ), notebook="score_reparam"),
    Claim("fig6-rnorm", "6", "\"Temporarily stable settings, such as reward normalize with δ = 0.3, also exhibit "
          "consistent upward trends across metrics, which implies that pattern collapse problems likewise occur when "
          "training longer\" (Fig. 6)", tuple(p for d in ("0.3", "0.8") for p in (
              P(f"KL onset, δ {d} − vanilla (delayed)", "kl_onset", f"rnorm-{d}", "vanilla", "higher", "steps"),
              W(f"KL, last 10 − steps 35–44 at δ {d} (still rising)", "kl/ref", f"rnorm-{d}", "higher", "kl",
                first="mid10"))),
          notebook="score_reparam", why="'upward trends' read on the second half, where the KL no longer starts "
                                         "at 0 by construction"),
    Claim("fig6-advnorm", "6", "\"a severe constraint on advantage can provide similar effects to reward clip\" "
          "(§5.3.1): advantage normalisation and clipping delay the drift, which still rises (Fig. 6)",
          tuple(p for d in ("0.12", "0.5") for p in (
              P(f"KL onset, δ {d} − vanilla (delayed)", "kl_onset", f"advnorm-{d}", "vanilla", "higher", "steps"),
              W(f"KL, last 10 − steps 35–44 at δ {d} (still rising)", "kl/ref", f"advnorm-{d}", "higher", "kl",
                first="mid10"))), notebook="score_reparam"),
    Claim("fig14", "14", "\"the operation on the advantage and value function shows conflicts in the policy "
          "optimization process\" (Fig. 14)", (
        P("interaction of advantage norm × value clip on vanilla + reward norm: (A+C − A) − (C − neither), "
          "win − lose", "interaction_vanilla", "rnorm-advnorm-vclip", None, "lower", "win-lose"),
        P("the same on PPO-max", "interaction_ppomax", "advnorm", None, "lower", "win-lose"),
    ), notebook="score_reparam", why="a conflict read as a negative interaction of the 2 × 2 (the project's "
                                      "formalisation; the paper shows five runs' drift)"),
    # ------------------------------------------------------------------------------------ policy constraints (§5.3.2)
    Claim("fig7-kl", "7", "\"we find this constraint critical to the stability of PPO\" (§5.3.2, the KL penalty, "
          "η 0.05)", (
        P("KL over the last 10 steps, η 0.05 − vanilla", "last10:kl/ref", "kl-0.05", "vanilla", "lower", "kl"),
        P("win − lose against SFT, η 0.05 − vanilla", "win_lose", "kl-0.05", "vanilla", "higher", "win-lose"),
    ), notebook="policy_constraints"),
    Claim("fig7-is", "7", "\"this implementation [importance sampling, with the KL penalty] further stabilizes PPO "
          "training, but compromises the final performance of the policy model\" (§5.3.2)", (
        P("KL over the first 10 steps, KL + IS − KL alone (the early moves steadied)", "first10:kl/ref",
          "kl-0.05-is", "kl-0.05", "lower", "kl"),
        P("RM score over the last 10 steps, KL + IS − KL alone", "last10:reward/score", "kl-0.05-is", "kl-0.05",
          "lower", "score"),
    ), notebook="policy_constraints", why="the sentence compares IS with the KL penalty to the KL penalty alone (v1 "
                                           "compared IS alone with vanilla); 'stabilizes': Fig. 15's early "
                                           "fluctuations, which 'disappear only when we use importance sampling'"),
    Claim("fig7-entropy", "7", "\"only a penalty of the policy entropy or KL divergence can provide a long-lasting "
          "stable optimization\" (Fig. 7); \"we did not find an obvious advantage of this trick relative to "
          "KL-penalty\" (§5.3.2)", (
        P("KL over the last 10 steps, entropy bonus (0.01, clip δ 1.0) − vanilla", "last10:kl/ref", "ent-0.01-clip",
          "vanilla", "lower", "kl"),
        P("win − lose against SFT, entropy bonus − vanilla", "win_lose", "ent-0.01-clip", "vanilla", "higher",
          "win-lose"),
        P("win − lose against SFT, the KL penalty − the entropy bonus (no advantage of the bonus)", "win_lose",
          "kl-0.05", "ent-0.01-clip", "not-lower", "win-lose"),
    ), notebook="policy_constraints", why="δ 1.0 (SFT's mean token entropy) is the project's; the paper's δ 30 is "
                                           "in units it does not state"),
    Claim("fig15-vanilla", "15", "\"A looser constraint not only induces higher reward responses but also results in "
          "a more pronounced deviation from the original policy distribution\" (Fig. 15: η 0.05 / 0.1 / 0.2)",
          tuple(P(f"{k} over the last 10 steps, η {b} − {a}", f"last10:{key}", f"kl-{b}", f"kl-{a}", "lower", m)
                for a, b in (("0.05", "0.1"), ("0.1", "0.2"))
                for k, key, m in (("RM score", "reward/score", "score"), ("KL", "kl/ref", "kl"))),
          notebook="policy_constraints", why="the paper does not say which base Fig. 15 runs on; its rewards are raw "
                                              "RM scores, as vanilla PPO's (an inference)"),
    Claim("fig15-ppomax", "15", "the same hierarchy on PPO-max" + OWN,
          tuple(P(f"{k} over the last 10 steps, η {b} − {a}", f"last10:{key}", f"ppo-max-kl{b}", f"ppo-max-kl{a}",
                  "lower", m) for a, b in (("0.05", "0.1"), ("0.1", "0.2"))
                for k, key, m in (("RM score", "reward/score", "score"), ("KL", "kl/ref", "kl"))),
          notebook="policy_constraints", why="v1's id: a paper claim read on the project's base"),
    *[Claim(f"fig16-diverges-{w}", "16", "\"In code implementation, the entropy bonus is equivalent to a negative term "
            "on the loss function, so the model tends to optimize it to as large a value as possible\" (Fig. 16, "
            f"without the clip, on a configuration that would converge normally; weight {w}"
            f"{'' if w == '0.01' else ': the project’s, the paper uses 0.01'})", (
        P("mean token entropy over the last 10 steps, no clip − clip δ 1.0", "last10:policy/entropy",
          f"kl-ent-{w}-noclip", f"kl-ent-{w}-clip", "higher", "entropy"),
        P("KL over the last 10 steps, no clip − clip δ 1.0 (the collapse the figure shows)", "last10:kl/ref",
          f"kl-ent-{w}-noclip", f"kl-ent-{w}-clip", "higher", "kl"),
    ), notebook="policy_constraints", why="on vanilla + η 0.05, which converges without the bonus (v1's vanilla "
                                           "base collapses anyway); the figure plots KL, perplexity and length, "
                                           "not the entropy") for w in ("0.01", "0.1")],
    *[Claim(f"fig16-sensitive-{w}", "16", "\"Delta is a hyperparameter that must be carefully tuned to prevent "
            "training collapse (our experiments fail with only a 10% change at this threshold)\" (Fig. 16; weight "
            f"{w}{'' if w == '0.01' else ': the project’s'})", (
        P("KL over the last 10 steps, δ 0.9 − δ 1.0 (fails)", "last10:kl/ref", f"kl-ent-{w}-clip-0.9",
          f"kl-ent-{w}-clip", "higher", "kl"),
        P("KL over the last 10 steps, δ 1.1 − δ 1.0 (fails)", "last10:kl/ref", f"kl-ent-{w}-clip-1.1",
          f"kl-ent-{w}-clip", "higher", "kl"),
    ), notebook="policy_constraints", why="'fail' read as the collapse of Fig. 16, in the KL; the project's δ (SFT's "
                                           "mean entropy) was not tuned to an edge as the paper's was") for w in
      ("0.01", "0.1")],
    # ------------------------------------------------------------------------------------- initialisation (§5.3.3)
    Claim("fig8-policy", "8", "\"a policy model initialized without SFT training is clearly incapable in PPO training\" "
          "(§5.3.3); \"the train model response obtains lower rewards relative to the policy model after SFT\"", (
        P("RM score over the last 10 steps, pretrained − SFT-initialised", "last10:reward/score",
          "policy-pretrained", "ptx-pretrain", "lower", "score"),
        P("win − lose against SFT, pretrained − SFT-initialised", "win_lose", "policy-pretrained", "ptx-pretrain",
          "lower", "win-lose"),
    ), notebook="initialization", why="every run of Fig. 8 has ptx on pretraining text (--ptx-data pretrain). The "
                                       "KL to SFT of a policy that starts elsewhere is high or falling by "
                                       "construction (the reference is SFT): no part reads it"),
    Claim("fig8-critic", "8", "\"The initialization of the critic model did not significantly affect the convergence "
          "or fluctuation of the PPO and only varied the numerical stability at the early stage of optimization\" "
          "(§5.3.3)", (
        P("VF loss over the first 5 steps, critic from SFT − from the RM (differs early)", "first5:loss/vf",
          "critic-sft-no-critic-pretrain", "ptx-pretrain-no-critic-pretrain", "differs", "vf"),
        P("VF loss over the last 10 steps, from SFT − from the RM", "last10:loss/vf", "critic-sft-no-critic-pretrain",
          "ptx-pretrain-no-critic-pretrain", "alike", "vf"),
        P("win − lose against SFT, from SFT − from the RM", "win_lose", "critic-sft-no-critic-pretrain",
          "ptx-pretrain-no-critic-pretrain", "alike", "win-lose"),
    ), notebook="initialization", why="no direction for the early difference (the paper's SFT critic starts lower); "
                                       "neither critic pre-trained, as in the figure, where PPO-max's VF loss "
                                       "starts at ~18"),
    Claim("fig8-pretrain", "8 / §5.4", "\"we believe the critic model pre-training helps to improve the training "
          "stability by providing better advantage estimation\" (§5.3.3, on vanilla PPO)", (
        P("advantage spread over the first 5 steps, vanilla − vanilla with critic pre-training",
          "first5:adv/std", "vanilla", "vanilla-critic-pretrain", "higher", "adv"),
        P("KL over the first 10 steps, vanilla − with critic pre-training (the policy's early moves)",
          "first10:kl/ref", "vanilla", "vanilla-critic-pretrain", "higher", "kl"),
    ), notebook="initialization", why="on the policy side, as the paper's evidence: the early VF loss v1 compared is "
                                       "the loss pre-training minimised"),
    # ------------------------------------------------------------------------------------ secondary tricks (App. C)
    Claim("fig17", "17", "\"we find different clipping value has little effect on the results and does not provide "
          "stable optimization as KL constraint\" (Fig. 17: no clip, ε 0.5, the KL penalty)", (
        P("win − lose against SFT, no clip − ε 0.5 (little effect)", "win_lose", "clip-none", "clip-0.5", "alike",
          "win-lose"),
        P("KL over the last 10 steps, ε 0.5 − the KL penalty", "last10:kl/ref", "clip-0.5", "kl-0.05", "higher",
          "kl"),
        P("KL over the last 10 steps, no clip − the KL penalty", "last10:kl/ref", "clip-none", "kl-0.05", "higher",
          "kl"),
    ), notebook="secondary_tricks", why="the paper's runs (no clip, ε 0.5) against its KL-penalty run; v1 compared "
                                         "ε 0.1 / 0.4 with 0.2 and asked each to end below SFT"),
    Claim("fig18", "18", "\"it's difficult to distinguish the difference between different constraints\" (Fig. 18: "
          "global gradient clipping at 0 / 0.5 / 1.0)", (
        P("held-out gold, clip 0 − 1.0", "final_gold", "gclip-0", "ppo-max", "alike", "gold"),
        P("held-out gold, clip 0.5 − 1.0", "final_gold", "gclip-0.5", "ppo-max", "alike", "gold"),
        P("win − lose, clip 0 − 1.0", "win_lose", "gclip-0", "ppo-max", "alike", "win-lose"),
        P("win − lose, clip 0.5 − 1.0", "win_lose", "gclip-0.5", "ppo-max", "alike", "win-lose"),
    ), notebook="secondary_tricks", why="on PPO-max, the project's base: the paper's three runs all collapse (δ 0 "
                                         "first), ours do not"),
    Claim("fig19", "19", "\"TD estimation (with λ = 0) provides smaller variance but is numerically more unstable in "
          "training, while Monte Carlo estimation exhibits larger variance\" (Fig. 19)", (
        P("advantage spread (adv/std, mean over steps), λ 0 − 0.9", "mean:adv/std", "lam-0", "ppo-max", "lower", "adv"),
        P("KL over the last 10 steps, λ 0 − 0.9 (unstable: it drifts)", "last10:kl/ref", "lam-0", "ppo-max", "higher",
          "kl"),
        P("advantage spread, λ 1 − 0.9", "mean:adv/std", "lam-1", "ppo-max", "higher", "adv"),
    ), notebook="secondary_tricks", why="'unstable' read as the drift the figure shows (λ 0 collapses), not as a "
                                         "quality verdict"),
]

OWN_CLAIMS: list[Claim] = [
    Claim("leave-one-out", "leave-one-out (new)", "each of PPO-max's parts that acts on the policy is needed" + OWN,
          tuple(P(f"win − lose, PPO-max − without {what}", "win_lose", "ppo-max", v, "higher", "win-lose")
                for what, v in [("the KL penalty", "no-kl"), ("reward norm + clip", "no-rnorm"),
                                ("value clipping", "no-vclip"), ("critic pre-training", "no-critic-pretrain")]),
          notebook="win_rates", why="v1 also asked it of ptx (judged by its own purpose in 'ptx') and of gradient "
                                    "clipping (which Fig. 18 says is hard to tell apart): both left out"),
    Claim("release", "release (new)", "PPO-max beats the settings of the paper's released scripts" + OWN, (
        P("win − lose, PPO-max − the release's settings", "win_lose", "ppo-max", "moss-release", "higher",
          "win-lose"),
    ), notebook="win_rates"),
]

TRICK_CLAIMS: list[Claim] = [
    Claim("clip-higher", "DAPO (Yu et al. 2025, arXiv 2503.14476)", "\"Clip-Higher, which promotes the diversity of "
          "the system and avoids entropy collapse\" (DAPO, section 1; ε 0.2, ε_high 0.28, no KL term)", (
        P("mean token entropy over the last 10 steps, vanilla + ε_high 0.28 − vanilla", "last10:policy/entropy",
          "vanilla-cliphigher", "vanilla", "higher", "entropy"),
    ), notebook="methods", why="DAPO's setting has no KL penalty: on vanilla PPO, whose entropy falls"),
    Claim("tis", "TIS (Yao, Liu et al. 2025)", "\"performing PPO in setting 2 [a mismatched sampler] leads to "
          "significant performance degradation ... applying truncated importance sampling manages to mitigate the "
          "gap greatly\" (Yao et al., 'Your Efficient RL Framework Secretly Brings You Off-Policy RL Training')", (
        P("win − lose against SFT, a top-p sampler without a correction − the policy sampling itself", "win_lose",
          "topp", "ppo-max", "lower", "win-lose"),
        P("win − lose against SFT, the top-p sampler with TIS − the policy sampling itself", "win_lose", "topp-tis",
          "ppo-max", "alike", "win-lose"),
    ), notebook="methods", why="top-p 0.9: the largest of the three mismatches here (mean |Δ log π| ≈ 0.1); a "
                                "support mismatch (the tail is never sampled), which no reweighting restores fully"),
    Claim("k1-reward", "arXiv 2512.21852", "\"using estimator configurations resulting in unbiased gradients leads to "
          "better performance\" (Shah et al. 2025): k1 in the reward (unbiased) at least as good as k3 in the loss "
          "(biased) at the same η", (
        P("win − lose against SFT, k1 in the reward − k3 in the loss", "win_lose", "ppo-max", "k3-loss", "not-lower",
          "win-lose"),
    ), notebook="methods", why="'at least as good': the η in the reward also enters the returns, the η in the "
                                "loss does not, so the same η is not the same strength"),
    Claim("value-returns", "VC-PPO (Yuan et al. 2025, arXiv 2503.01491)", "\"the value model is pretrained to tackle "
          "initialization bias\" (VC-PPO), on Monte-Carlo returns of a fixed SFT policy (VAPO, section 4.1): it lowers the "
          "early value loss below PPO-max's critic pre-training", (
        P("VF loss over the first 5 PPO steps, critic pre-trained on returns (λ = 1) − on PPO-max's GAE targets",
          "first5:loss/vf", "vreturns", "ppo-max", "lower", "vf"),
    ), notebook="methods", why="PPO's value targets are λ 0.9 returns, which PPO-max's pre-training fits and the "
                                "returns' pre-training does not: the part can fail"),
    Claim("decoupled-lam", "VC-PPO (Yuan et al. 2025)", "\"the Generalized Advantage Estimation (GAE) computation is "
          "decoupled between the actor and critic to mitigate reward signal decay\" (VC-PPO): λ_critic = 1, a smaller "
          "λ for the advantages, trains better than one λ for both", (
        P("win − lose against SFT, λ_critic 1 − λ 0.9 for both", "win_lose", "lam-critic-1", "ppo-max", "higher",
          "win-lose"),
    ), notebook="methods", why="the decay it mends is λ^T: 0.9^9 ≈ 0.39 here, against ~0 over long chains of "
                                "thought"),
    Claim("gspo", "GSPO (Zheng et al. 2025, arXiv 2507.18071)", "\"GSPO achieves superior training efficiency and "
          "performance compared to the GRPO algorithm\" (GSPO, abstract)", (
        P("win − lose against SFT, GSPO (ε 3e-4 / 4e-4) − GRPO (ε 0.2), G 4", "win_lose", "gspo", "grpo", "higher",
          "win-lose"),
    ), notebook="methods", why="GSPO's own clip range, on its sequence ratio's scale"),
    Claim("cispo", "CISPO (MiniMax 2025, arXiv 2506.13585)", "\"CISPO clips importance sampling weights rather than "
          "token updates, outperforming other competitive RL variants\" (MiniMax-M1, abstract): faster than "
          "PPO-clip", (
        P("held-out gold over steps 8–32 − SFT's, CISPO − PPO-clip", "hgold_early", "cispo", "ppo-max", "higher",
          "gold"),
    ), notebook="methods", why="its 2× speedup read on the early held-out curve"),
]


# =====================================================================================================================
# The seeds, planned by code from v1's records (its 10-20 seeds per comparison are v2's pilot), under a budget:
#   1. each part: the smallest n at which RULE decides it with 80 % power at v1's mean and sd (its distance from the
#      margin against (t(0.95) + t(0.80))·sd/√n, power_n); a part with no pilot (a new metric or variant) N_DEFAULT;
#   2. a claim: the largest n of its parts (at least N_MIN); more than N_CAP, or a part no n decides: N_HOPELESS
#      (printed, expected undecided, with the seeds that would decide it);
#   3. the cost: every variant on the largest n of the claims that read it (the README's summary variants on every
#      seed), a 400-step run counting 5, a seed's base 1.1; within BUDGET, as many claims as possible get the n they
#      need, the cheapest to add first; the others stay at N_HOPELESS;
#   4. the claims on the reward model alone read the bases, built for every seed anyway: all of them.
# Seeds 1000, 1001, …: a claim with n seeds reads the first n. SEED_PLAN is the plan as committed (a test checks that
# plan_seeds() still gives it).
# =====================================================================================================================
SEEDS = tuple(range(1000, 1040))
N_MIN, N_CAP, N_DEFAULT, N_HOPELESS = 5, 25, 6, 3
BUDGET = 260.0   # run units: one 80-step run on one core takes ~2 min here, two cores ~55 an hour: ~4.7 hours
PILOT = {"ppo-max-kl0.05": "ppo-max"}   # v2 variants whose v1 records go by another name (v1's default η was 0.05)


def power_n(mean: float, sd: float, margin: float, direction: str = "higher") -> int | None:
    """The smallest n (≥ 3) at which RULE decides a part whose differences have this mean and sd, with 80 % power;
    None when none up to 1,000 does (a mean on the margin; for "not-lower", on −margin)."""
    distance = abs(mean + margin) if direction == "not-lower" else abs(abs(mean) - margin)
    for n in range(3, 1001):
        if distance >= (claims.t_quantile(0.95, n - 1) + claims.t_quantile(0.80, n - 1)) * sd / math.sqrt(n):
            return n
    return None


def pilot_differences(part, recs: dict) -> list[float]:
    """The part's d on every v1 seed whose records have it (v1's variant names; PILOT maps the renamed ones)."""
    from dataclasses import replace
    part = replace(part, a=PILOT.get(part.a, part.a), b=PILOT.get(part.b, part.b) if part.b else None)
    out = []
    for s in range(20):
        try:
            d = claims.difference(part, recs, s)
        except (KeyError, TypeError, ZeroDivisionError):
            d = None
        if d is not None and np.isfinite(d):
            out.append(float(d))
    return out


UNITS = {"bon-4": 0.2}   # a run's cost in units of one 80-step PPO run: best-of-n trains nothing, only evaluates


def _cost(n: dict[str, int], claim_list: list[Claim]) -> float:
    """Run units: every variant on the most seeds a claim reading it has (the README's summary variants on every
    seed of the plan), a 400-step run counting 5, a seed's base 1.1."""
    var_n: dict[str, int] = {}
    for c in claim_list:
        for part in c.parts:
            for v in claims.part_variants(part) - {BASE}:
                var_n[v] = max(var_n.get(v, 0), n[c.id])
    seeds = max(var_n.values())
    for v in SUMMARY:
        var_n[v] = seeds
    return sum(k * UNITS.get(v, LONG.get(v, 80) / 80) for v, k in var_n.items()) + 1.1 * seeds


def plan_seeds(claim_list: list[Claim] | None = None) -> dict[str, dict]:
    """{claim id: {"n", "parts": [each part's n for 80 % power, None without a pilot or never], "hopeless"}}."""
    claim_list = claim_list or CLAIMS_UNPLANNED
    recs = claims.records(claims.V1)   # v1's committed records (claims.py's own)
    plan, need = {}, {}
    for c in claim_list:
        ds = [pilot_differences(part, recs) for part in c.parts]
        ns = [power_n(np.mean(d), np.std(d, ddof=1), MARGINS[part.margin], part.direction) if len(d) >= 3 else None
              for d, part in zip(ds, c.parts)]
        never = any(len(d) >= 3 and n is None for d, n in zip(ds, ns))
        known = [n for n in ns if n is not None]
        k = max(known + [N_DEFAULT] * (len(known) < len(ns)) + [N_MIN])
        need[c.id] = None if never or k > N_CAP else k
        plan[c.id] = {"parts": ns, "n": need[c.id] or N_HOPELESS, "hopeless": need[c.id] is None}
    # within BUDGET, as many claims as possible at the n they need: the cheapest to add first (each one's extra
    # cost given those added before it), until none fits
    n = {i: N_HOPELESS for i in plan}
    todo = {i for i in plan if need[i] is not None}
    while todo:
        extra = {i: _cost({**n, i: need[i]}, claim_list) - _cost(n, claim_list) for i in todo}
        i = min(extra, key=lambda k: (extra[k], k))
        todo.discard(i)
        if _cost(n, claim_list) + extra[i] <= BUDGET:
            n[i] = need[i]
        else:
            plan[i]["hopeless"], plan[i]["budget"] = True, True
    most = max(n.values())
    for c in claim_list:
        if all(claims.part_variants(part) == {BASE} for part in c.parts):
            n[c.id] = most
    for i in plan:
        plan[i]["n"] = n[i]
    plan["_cost"] = _cost(n, claim_list)
    return plan


CLAIMS_UNPLANNED = PAPER_CLAIMS + OWN_CLAIMS + TRICK_CLAIMS
SEED_PLAN = {  # plan_seeds() as committed: claim id → its seeds, the first n of SEEDS (259.8 run units)
    "fig3": 6, "fig2": 6, "sec4.3": 6, "fig4-reward": 3, "fig4-winrate": 3, "fig4-drift": 3, "fig13": 3, "fig9": 3,
    "ptx": 6, "fig6-scale": 3, "fig6-rnorm": 3, "fig6-advnorm": 3, "fig14": 3, "fig7-kl": 3, "fig7-is": 6,
    "fig7-entropy": 3, "fig15-vanilla": 3, "fig15-ppomax": 3, "fig16-diverges-0.01": 6, "fig16-diverges-0.1": 6,
    "fig16-sensitive-0.01": 6, "fig16-sensitive-0.1": 6, "fig8-policy": 3, "fig8-critic": 3, "fig8-pretrain": 6,
    "fig17": 6, "fig18": 3, "fig19": 3, "leave-one-out": 3, "release": 3, "clip-higher": 6, "tis": 3, "k1-reward": 6,
    "value-returns": 6, "decoupled-lam": 6, "gspo": 3, "cispo": 6,
}
EXPECTED_UNDECIDED = (  # no plan within BUDGET decides them (plan_seeds): N_HOPELESS seeds, or the bases' seeds
    "fig3", "fig4-reward", "fig4-winrate", "fig4-drift", "fig13", "fig9", "fig6-scale", "fig6-rnorm", "fig6-advnorm",
    "fig14", "fig7-kl", "fig7-entropy", "fig15-vanilla", "fig15-ppomax", "fig8-policy", "fig8-critic", "fig18",
    "fig19", "leave-one-out", "release", "tis", "gspo",
)
CLAIMS: list[Claim] = [claims.replace(c, seeds=SEEDS[:SEED_PLAN[c.id]]) for c in CLAIMS_UNPLANNED]
PLOT_SEEDS = SEEDS[:3]   # the figures draw these seeds' runs, which every variant has (N_HOPELESS = 3)


def rule_text() -> str:
    """The rule, the way parts combine, the margins and the seeds, as docs/findings.md prints them for v2."""
    margins = ", ".join(f"{k} ±{v:g}" for k, v in MARGINS.items())
    return (f"**The rule, for every part of every claim:** {RULE}.\n\n**A claim from its parts:** {COMBINE}.\n\n"
            f"**The margins** (`MARGINS`, one per kind of number, the same in every claim): {margins}.\n\n"
            f"**Seeds:** from {SEEDS[0]}, planned per claim by `plan_seeds()` from v1's effects and spreads for 80 % "
            f"power under the rule, at least {N_MIN}, a budget of {BUDGET:g} run units "
            f"({len(EXPECTED_UNDECIDED)} claims expected undecided: no plan within the budget decides them at "
            f"v1's effects and spreads; they run on {N_HOPELESS} seeds, or on every base's: "
            f"{', '.join(EXPECTED_UNDECIDED)}).")


# =====================================================================================================================
# Qualifiers: descriptions printed beside v2's verdicts (claims.qualifiers), written after its campaign and no part of
# its plan: they change no claim, margin, seed or verdict. What each kind means, and the engagement thresholds with
# their reasons, are in claims.py ("Qualifiers"). policy/entropy is the rollout batch's mean token entropy, which the
# entropy bonus's clip compares with δ per minibatch; grad/norm is the policy's gradient norm before the clip, the mean
# over a step's minibatches (a minibatch above the clip inside a step whose mean is below it is not counted; the
# critic's norm is not logged).
# =====================================================================================================================
def _entropy_between(lo: float, hi: float):
    return claims.step_share("policy/entropy", lo, hi)


TOK, STEPS = claims.TOKEN_SHARE, claims.STEP_SHARE
QUALIFIERS = {
    "ptx": [claims.Setting(
        "what it tests now is ptx on the demonstrations (--ptx-data sft at 0.25, v2's default, in both runs' ppo-max "
        "− no-ptx) against none, not Eq. 17's ptx on pre-training text: its seeds were planned from v1, whose default "
        "had ptx on the pre-training text. Eq. 17's pre-training-text ptx is not tested by v2")],
    "fig7-is": [claims.Engaged("the clip against π_ref (importance sampling's ratio) binds", ("kl-0.05-is",),
                               "ppo/clipfrac", claims.token_share(), TOK, "tokens")],
    "fig7-entropy": [
        claims.Setting(f"δ {ENT_CLIP} (SFT's mean token entropy) is the project's; the paper's δ 30 is in units it "
                       "does not state"),
        claims.Engaged(f"the entropy bonus acts (mean token entropy below δ {ENT_CLIP})", ("ent-0.01-clip",),
                       "policy/entropy", claims.step_share("policy/entropy", hi=ENT_CLIP), STEPS, "steps")],
    **{f"fig16-diverges-{w}": [
        *([claims.Setting("the entropy weight 0.1 is the project's; at the paper's 0.01 this is fig16-diverges-0.01")]
          if w == "0.1" else []),
        claims.Engaged(f"the clip switches the bonus off (entropy at or above δ {ENT_CLIP} in the clipped run; "
                       "below it the two runs are the same computation)", (f"kl-ent-{w}-clip",), "policy/entropy",
                       claims.step_share("policy/entropy", lo=ENT_CLIP), STEPS, "steps")] for w in ("0.01", "0.1")},
    **{f"fig16-sensitive-{w}": [
        *([claims.Setting("the entropy weight 0.1 is the project's; at the paper's 0.01 this is fig16-sensitive-0.01")]
          if w == "0.1" else []),
        claims.Engaged("δ 0.9 and 1.0 act differently (entropy in [0.9, 1.0))", (f"kl-ent-{w}-clip-0.9",
                                                                                   f"kl-ent-{w}-clip"),
                       "policy/entropy", _entropy_between(0.9, 1.0), STEPS, "steps"),
        claims.Engaged("δ 1.1 and 1.0 act differently (entropy in [1.0, 1.1))", (f"kl-ent-{w}-clip-1.1",
                                                                                   f"kl-ent-{w}-clip"),
                       "policy/entropy", _entropy_between(1.0, 1.1), STEPS, "steps")] for w in ("0.01", "0.1")},
    "fig6-rnorm": [claims.NoCurve("no curve shows how many rewards the clip δ 0.3 / 0.8 cuts")],
    "fig6-advnorm": [claims.NoCurve("no curve shows how many advantages the clip δ 0.12 / 0.5 cuts")],
    "fig14": [claims.NoCurve("no curve shows how often the advantage clip or the value clip binds")],
    "leave-one-out": [claims.NoCurve("no curve shows how often the reward clip (δ 5) or the value clip (0.2) binds")],
    "fig17": [claims.Engaged("the PPO clip ε 0.5 binds", ("clip-0.5",), "ppo/clipfrac", claims.token_share(), TOK,
                             "tokens")],
    "fig18": [
        claims.Setting("on PPO-max, the project's base: the paper's three runs all collapse"),
        claims.Engaged("the global gradient clip at 1.0 engages (the policy's grad/norm above 1.0)", ("ppo-max",),
                       "grad/norm", claims.step_share("grad/norm", lo=1.0), STEPS, "steps"),
        claims.Engaged("the global gradient clip at 0.5 engages (grad/norm above 0.5)", ("gclip-0.5",), "grad/norm",
                       claims.step_share("grad/norm", lo=0.5), STEPS, "steps")],
    "clip-higher": [claims.Engaged("the ε 0.2 clip binds on either side in vanilla PPO (an upper bound on the tokens "
                                   "ε_high 0.28 frees)", ("vanilla",), "ppo/clipfrac", claims.token_share(), TOK,
                                   "tokens")],
    "tis": [claims.Engaged("the rollout mismatch (k3 KL of the top-p sampler to the policy)", ("topp", "topp-tis"),
                           "mismatch/kl", claims.token_share("mismatch/kl"), MARGINS["kl"], "nats per token"),
            claims.Engaged("TIS truncates the weight", ("topp-tis",), "correction/capped_frac",
                           claims.token_share("correction/capped_frac"), TOK, "tokens"),
            claims.Contrast("win − lose against SFT, the top-p sampler with TIS − without a correction", "win_lose",
                            "topp-tis", "topp")],
    "k1-reward": [claims.Stronger("higher", "registered 'not lower' (at least as good), weaker than the source's "
                                            "'better'"),
                  claims.Always("the KL term is in every step's rewards or loss")],
    "value-returns": [claims.Always("the critic's pre-training targets are Monte-Carlo returns instead of GAE "
                                    "targets: it acts before PPO's first step"), claims.Scale(0, "ppo-max")],
    "decoupled-lam": [claims.Always("λ_critic 1 sets every value target; the decay it mends, 0.9^9 ≈ 0.39 over a "
                                    "9-token answer, is far milder than over long chains of thought")],
    "gspo": [claims.Engaged("GSPO's sequence clip binds (tokens of clipped sequences)", ("gspo",), "ppo/clipfrac",
                            claims.token_share(), TOK, "tokens"),
             claims.Engaged("GRPO's token clip binds", ("grpo",), "ppo/clipfrac", claims.token_share(), TOK,
                            "tokens")],
    "cispo": [claims.Engaged("PPO-clip binds in PPO-max (where CISPO's gradient differs)", ("ppo-max",),
                             "ppo/clipfrac", claims.token_share(), TOK, "tokens"),
              claims.Engaged("CISPO's cap binds", ("cispo",), "ppo/clipfrac", claims.token_share(), TOK, "tokens"),
              claims.Scale(0, "ppo-max")],
}

REGISTRY = claims.Registry("v2", CLAIMS, MARGINS, VARIANTS, LONG, claims.RESULTS / "v2", judge, part_text,
                           rule_text, {c.id: c.seeds for c in CLAIMS}, RUN_METRICS, BASE_METRICS, FINAL_METRICS,
                           SUMMARY, SEEDS[:max(SEED_PLAN.values())], PLOT_SEEDS, QUALIFIERS)


def successor_plan(caps: tuple[int, ...] = (10, 25, 50, 100), recs: dict | None = None) -> list[dict]:
    """Written after v2's campaign and no part of its plan: what v2's own records say a successor registry would
    need, as plan_seeds reads v1's. Each claim's n: the largest of its parts' power_n at v2's mean and sd (None when
    a part has fewer than 3 seeds or no n up to 1,000 decides it). Per cap: how many claims some n ≤ cap powers
    (80 % each), and the run units of giving each of them its n (the others keep their seeds), as _cost counts."""
    recs = claims.records(REGISTRY) if recs is None else recs
    need = {}
    for c in CLAIMS:
        ns = []
        for part in c.parts:
            ds = [d for s in SEEDS for d in [_difference(part, recs, s)] if d is not None and np.isfinite(d)]
            ns.append(power_n(float(np.mean(ds)), float(np.std(ds, ddof=1)), MARGINS[part.margin], part.direction)
                      if len(ds) >= 3 else None)
        need[c.id] = None if None in ns else max(ns + [N_MIN])
    rows = []
    for cap in caps:
        n = {c.id: max(len(c.seeds), need[c.id] if need[c.id] is not None and need[c.id] <= cap else 0)
             for c in CLAIMS}
        powered = sorted(i for i in need if need[i] is not None and need[i] <= cap)
        rows.append({"cap": cap, "powered": len(powered), "claims": len(CLAIMS),
                     "run_units": round(_cost(n, CLAIMS), 1), "unpowered": sorted(set(need) - set(powered))})
    return rows


def _difference(part, recs: dict, seed: int) -> float | None:
    try:
        return claims.difference(part, recs, seed)
    except (KeyError, TypeError, ZeroDivisionError):
        return None
