"""The collapse alarm of section 5.2: watch KL, length, perplexity and the reward tail, not the reward itself.

Implements (section and figure numbers of Zheng et al. 2023, arXiv 2307.04964; no equation of its own):
    CollapseMonitor(kl_max, length_growth, ppl_drop, tail_sigmas, tail_frac, warmup, patience)
        .check(metrics, scores)        → the reasons this one step looks collapsed (pure; § 5.2, Fig. 4, Fig. 13)
        .update(step, metrics, scores) → an Alarm once `patience` steps in a row had a reason, else None
        .state_dict() / .load_state_dict(d)  → plain JSON, so a resumed run continues the monitor exactly
    Alarm(step, reasons)               → the step it fired and the numbers behind it

Run: python monitor.py        (a synthetic drifting run; prints the alarm the tests expect)

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
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

KL_KEY, LENGTH_KEY, PPL_KEY = "kl/ref", "response/length", "policy/perplexity"


@dataclass
class Alarm:
    """Where the alarm fired and why: each reason carries its numbers, e.g. "kl/ref 0.41 > 0.30"."""
    step: int
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"collapse alarm at step {self.step}: " + "; ".join(self.reasons)


def _as_floats(scores: Any) -> list[float]:
    if scores is None:
        return []
    if hasattr(scores, "tolist"):  # a torch tensor or numpy array, any shape
        scores = scores.tolist()
    out: list[float] = []
    stack = [scores]
    while stack:  # flatten nested lists
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif math.isfinite(float(x)):  # NaN / inf are the NaN guard's business, and would poison the baseline
            out.append(float(x))
    return out


def _get(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    return None if v is None or not math.isfinite(float(v)) else float(v)


class CollapseMonitor:
    """Fires when, for `patience` consecutive steps, ANY of these holds (thresholds are arguments):

    kl_max = 0.3 (nats/token)     KL to the reference > kl_max. Absolute, because the reference is fixed: Fig. 4
        shows vanilla PPO's KL climbing without bound, Fig. 9 PPO-max's staying small under the Eq. 19 penalty.
        0.3 per token is ≈ 3–5 nats over a short response, far beyond what PPO-max reaches in the synthetic world.
    length_growth = 0.5           mean response length > (1 + 0.5) × baseline. Fig. 4's collapse multiplies
        length by 3–4; Fig. 9 keeps it flat; +50 % is a fraction of the collapse and well outside batch noise.
    ppl_drop = 0.3                policy perplexity < (1 − 0.3) × baseline. Fig. 4's perplexity falls toward 1
        (the policy becomes certain of one pattern); Fig. 9's stays flat. Perplexity is ≥ 1, so with a baseline
        below 1/(1 − ppl_drop) this check can never fire; the other three still do.
    tail_sigmas = 3, tail_frac = 0.2   more than 20 % of the step's raw scores lie above baseline mean + 3 σ
        (baseline: all scores of the warmup steps, population σ). Fig. 13: the distribution is unchanged while
        training is stable and grows a long tail after collapse. For the baseline distribution itself, whatever
        its shape, Cantelli's inequality bounds that fraction by 1/(1 + 3²) = 10 %, so 20 % cannot be the
        stable distribution plus noise.
    patience = 3                  consecutive steps with at least one reason; one noisy batch does not fire.
    warmup = 5                    steps averaged into the baseline (length, perplexity: per-step means averaged;
        scores: pooled).

    update() returns an Alarm on the step a run of bad steps reaches `patience`, then None until a good step
    ends that run (a later run of bad steps fires again). Every alarm is kept in `.alarms`.
    """

    def __init__(self, kl_max: float = 0.3, length_growth: float = 0.5, ppl_drop: float = 0.3,
                 tail_sigmas: float = 3.0, tail_frac: float = 0.2, warmup: int = 5, patience: int = 3):
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
        if not self.ready:
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
        xs = _as_floats(scores)
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
        if not self.ready:
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


if __name__ == "__main__":
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
    # collapse alarm at step 9: kl/ref 0.520 > 0.300; response/length 20.0 > 1.5 × baseline 10.0 = 15.0
    # baseline: {'response/length': 10.0, 'policy/perplexity': 2.0, 'score_mean': 0.5, 'score_std': 1.118}
