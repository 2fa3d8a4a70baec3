"""Registry v3, a DRAFT committed before any v3 record: does a verdict travel to another world, did the mechanism act
where it was judged, and the claims v2 nearly decided, on fresh seeds. v1 and v2 stay as committed.

Status: written and planned, not yet run and not yet read by notebooks/claims.py (`--registry v3` does not exist
yet: claims.py is being changed for engagement labels, and v3 plugs in after that). World B's margins and its
variants' flags come from world B's pilot (tools/world_b_pilot.py, docs/worlds.md), which has not run either: the
functions below compute them from its records by the principle stated here, so nothing about them is chosen after
seeing a v3 result.

Implements: no equation of the paper.
  TRANSFER                v2's 15 decided claims, each judged in world B by v2's rule (registry_v2.judge)
  MARGIN_PRINCIPLE, margins_for(pilot)   world B's margins from its pilot by one principle; world A's beside them
  ENGAGEMENT              per claim: the measure that says whether its mechanism acted, and the threshold below which
                          the claim is "not tested" in that world (declared now, before the runs)
  NEARLY_DECIDED          the undecided v2 claims that v2's records say 10 seeds or fewer would decide (every
                          undecided part's seeds_to_decide ≤ 10), in world A on seeds from 2000
  plan()                  each claim's seeds (80 % power from v2's spreads, registry_v2.power_n) and the run units,
                          within BUDGET (300); PLAN is it as committed (a test checks plan() still gives it)
Seeds: world A from 2000, world B from 3000: none of v1's (0-19, pilot 100-102), v2's (300-302, 1000-1039) or world
B's pilot's (500-502, 510-512, 520-522). The campaign trains from one tagged commit, as v2's did; its records go under
notebooks/results/v3/, each naming its world, code, commit and machine.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import claims
import registry_v2 as v2

RESULTS = claims.RESULTS / "v3"
PILOT_B = claims.RESULTS / "world-b"
SEEDS_A = tuple(range(2000, 2030))
SEEDS_B = tuple(range(3000, 3030))
BUDGET = 300.0          # run units (one 80-step run): about 5.5 hours on 2 cores at v2's ~55 runs an hour
N_MIN, N_CAP = 5, 15

# =====================================================================================================================
# Transfer: v2's decided claims (its records: 5 as the paper, 1 against, 9 alike), judged again in world B by the same
# rule, parts and directions. Every variant gets `--world b` and world B's defaults (its pilot's learning rates and
# operating point: world_b_flags()). "sec4.3" reads world B's probe of its own exploit (praise phrases added to a
# correct answer, eval.length_bias), not length: the paper's claim generalised to "the reward model over-pays for
# what the annotators favoured", the only reading world B can test.
# =====================================================================================================================
TRANSFER = ("sec4.3", "fig4-reward", "fig7-is", "fig15-ppomax", "fig16-diverges-0.1", "fig8-policy", "fig8-pretrain",
            "fig18", "fig19", "leave-one-out", "tis", "k1-reward", "value-returns", "decoupled-lam", "cispo")

# =====================================================================================================================
# Margins by one principle, for both worlds (world A's numbers printed beside world B's, never replacing v2's):
#   * an outcome margin is HALF of the world's pilot gain of its default over SFT: gold (held-out gold − SFT's) and
#     win − lose (against SFT), mean over the operating point's pilot seeds, for the chosen candidate; the RM score
#     the same on the proxy's scale (final reward − SFT's). World A under it: gold 0.196, win − lose 0.097 (v2: 0.25,
#     0.10).
#   * the KL per token: a sixth of best-of-4's KL per response (log 4 − 3/4 = 0.636 nats) spread over the world's
#     mean SFT response length (tokens, the pilot's held-out SFT length): world A 0.106 / 8.8 ≈ 0.012 (v2: 0.01).
#   * the exploit slope ("slope"): a sixth of |gold's slope| per unit of the world's exploit (its pilot bases'
#     rm_length_bias.json): world A 0.3 / 6 = 0.05 (v2's), world B per praise phrase.
#   * the entropy: 5 % of the SFT policy's per-token entropy (step 0 of the pilot's runs), as v2's.
#   * scale-free margins stay v2's: length (one token = one word), ppl (10 %), vf, pg, adv (normalised units), steps
#     (one held-out interval), skew, share, acc.
# =====================================================================================================================
MARGIN_PRINCIPLE = {"outcome_fraction": 0.5, "kl_fraction_of_bon4": 1 / 6, "slope_fraction_of_gold": 1 / 6,
                    "entropy_fraction": 0.05}
SCALE_FREE = ("length", "ppl", "vf", "pg", "adv", "steps", "skew", "share", "acc")


def margins_for(op: dict, bases: list[dict], sft_length: float, sft_entropy: float) -> dict[str, float]:
    """MARGIN_PRINCIPLE on a world's pilot: `op` its operating-point record (tools/world_b_pilot.py's, or v2's
    operating-point.json), `bases` its pilot bases' rm_length_bias.json, sft_length its SFT's mean held-out response
    length, sft_entropy its SFT policy's per-token entropy. Returns a MARGINS table (v2's keys)."""
    chosen = op["candidates"][op["choice"]]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    f = MARGIN_PRINCIPLE["outcome_fraction"]
    out = {k: v2.MARGINS[k] for k in SCALE_FREE}
    out["gold"] = f * mean(chosen["gold_vs_sft"])
    out["win-lose"] = f * mean(chosen["win_lose"])
    out["score"] = f * mean(chosen["score_vs_sft"]) if "score_vs_sft" in chosen else v2.MARGINS["score"]
    out["kl"] = MARGIN_PRINCIPLE["kl_fraction_of_bon4"] * (math.log(4) - 0.75) / sft_length
    out["slope"] = MARGIN_PRINCIPLE["slope_fraction_of_gold"] * abs(mean([b["gold_slope"] for b in bases]))
    out["entropy"] = MARGIN_PRINCIPLE["entropy_fraction"] * sft_entropy
    return out


def world_b_flags() -> tuple[str, ...]:
    """World B's defaults from its pilot's records (docs/worlds.md's rule, steps 1-5): every world B variant's flags
    start with these. An error until the pilot has run: no world B record may exist before them."""
    need = [PILOT_B / f"{s}.json" for s in ("lr2", "policy-lr", "operating-point")]   # lr2: the amended rule
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"world B's pilot has not run (missing {', '.join(missing)}): python "
                                f"tools/world_b_pilot.py lr | policy-lr | operating-point")
    lr, plr, op = (json.loads(p.read_text()) for p in need)
    chosen = dict(zip(op["candidates"][op["choice"]]["flags"][::2], op["candidates"][op["choice"]]["flags"][1::2])) \
        if "flags" in op["candidates"][op["choice"]] else {}
    flags = ["--world", "b", "--sft-lr", str(lr["sft_lr"]), "--rm-lr", str(lr["rm_lr"]),
             "--policy-lr", str(plr["policy_lr"]), "--critic-lr", f"{plr['policy_lr'] * 5e-4 / 7e-5:.3g}"]
    return tuple(flags + [x for k, v in chosen.items() for x in (k, v)])


# =====================================================================================================================
# Engagement, declared before the runs: a claim whose mechanism does not act in a world is "not tested" there, not
# "no effect". Each entry: (the measure in words, how it is read from the judged runs' records, the threshold).
# Measures read the variants the claim judges, mean over its seeds. A claim without an entry compares whole
# configurations whose difference always acts (the treatment is the comparison itself).
# =====================================================================================================================
ENGAGEMENT = {
    "cispo": ("share of tokens PPO-clip clips in PPO-max (ppo/clipfrac, mean over steps)", "ppo-max mean:ppo/clipfrac",
              0.01),   # CISPO differs from PPO-clip only on clipped tokens; v2's runs clipped 0.07-0.09 %
    "tis": ("what the uncorrected top-p sampler costs: |win − lose(topp) − win − lose(ppo-max)|", "topp-cost", "win-lose"),
    "fig18": ("share of PPO-max's optimizer steps whose gradient norm exceeds the clip (1.0)", "ppo-max share:grad/norm>1",
              0.10),
    "fig16-diverges-0.1": ("share of steps whose mean token entropy is above the clip δ in the unclipped run",
                           "kl-ent-0.1-noclip share:policy/entropy>1.0", 0.10),
    "fig7-is": ("mean |ratio − 1| of the importance weights (ppo/ratio)", "kl-0.05-is mean:|ppo/ratio-1|", 0.01),
    "k1-reward": ("KL to the reference per token over the last 10 steps (a KL term that acts)", "ppo-max last10:kl/ref",
                  "kl"),
    "fig15-ppomax": ("the KL penalty's share of the reward: η · KL / |total reward| over the last 10 steps",
                     "ppo-max-kl0.2 share:eta*kl", 0.05),
    "leave-one-out": ("the KL penalty's share of the reward in PPO-max (its 'without the KL penalty' part)",
                      "ppo-max share:eta*kl", 0.05),
    "value-returns": ("the decay λ^T that λ_critic = 1 mends: 1 − 0.9^T at the mean response length T",
                      "ppo-max decay:response/length", 0.5),
    "decoupled-lam": ("the same decay: 1 − 0.9^T", "ppo-max decay:response/length", 0.5),
}
# a threshold named by a margin kind ("win-lose", "kl") is that world's margin: the mechanism acted when its measure
# is at least one margin (a degradation, a KL, that a reader would notice)

# =====================================================================================================================
# The nearly decided (world A, fresh seeds): undecided in v2 with every undecided part's seeds_to_decide ≤ 10 at
# v2's observed mean and sd. Planned at 80 % power (registry_v2.power_n, v2's spreads), N_MIN to N_CAP seeds; a part
# no n ≤ N_CAP powers gets N_CAP and is expected to stay undecided (said beside it, never chased).
# =====================================================================================================================
NEARLY_DECIDED = ("fig2", "fig4-winrate", "fig4-drift", "fig13", "fig9", "fig6-rnorm", "fig6-advnorm",
                  "fig16-sensitive-0.01", "fig8-critic", "gspo")


def _power(claim, recs) -> int | None:
    """The claim's n for 80 % power at v2's mean and sd (largest over its parts; None when a part has none)."""
    import numpy as np
    ns = []
    for part in claim.parts:
        ds = [d for s in v2.SEEDS for d in [v2._difference(part, recs, s)] if d is not None and np.isfinite(d)]
        ns.append(v2.power_n(float(np.mean(ds)), float(np.std(ds, ddof=1)), v2.MARGINS[part.margin], part.direction)
                  if len(ds) >= 3 else None)
    return None if None in ns else max(ns)


def _cost(n: dict[str, int], world_of: dict[str, str]) -> float:
    """Run units: each world's variants on the most seeds a claim reading them has (a 400-step run 5, best-of-4
    0.2), plus a base (1.1) per seed of each world."""
    by_claim = {c.id: c for c in v2.CLAIMS}
    var_n: dict[tuple[str, str], int] = {}
    for cid, k in n.items():
        for part in by_claim[cid].parts:
            for v in claims.part_variants(part):
                key = (world_of[cid], v)
                var_n[key] = max(var_n.get(key, 0), k)
    units = sum(k * (0 if v == claims.BASE else v2.UNITS.get(v, v2.LONG.get(v, 80) / 80)) for (_, v), k in
                var_n.items())
    seeds = {w: max([k for (ww, _), k in var_n.items() if ww == w] or [0]) for w in ("a", "b")}
    return units + 1.1 * sum(seeds.values())


def plan(recs: dict | None = None) -> dict:
    """Every v3 claim's seeds, within BUDGET: the transfer claims first (max(N_MIN, v2's 80 %-power n in world A),
    at most N_CAP: world B has no spreads of its own yet), then the nearly decided ones, the cheapest to add first,
    each at its 80 %-power n (N_CAP where none ≤ N_CAP); a claim that does not fit stays out and is listed."""
    claims.select("v2")
    recs = claims.records(v2.REGISTRY) if recs is None else recs
    by_claim = {c.id: c for c in v2.CLAIMS}
    world_of = {**{i: "b" for i in TRANSFER}, **{i: "a" for i in NEARLY_DECIDED}}
    n = {}
    for i in TRANSFER:
        p = _power(by_claim[i], recs)
        n[i] = min(N_CAP, max(N_MIN, p or N_CAP))
    want = {}
    for i in NEARLY_DECIDED:
        p = _power(by_claim[i], recs)
        want[i] = min(N_CAP, max(N_MIN, p)) if p is not None else N_CAP
    left_out = []
    todo = set(NEARLY_DECIDED)
    while todo:
        extra = {i: _cost({**n, i: want[i]}, world_of) - _cost(n, world_of) for i in todo}
        i = min(extra, key=lambda k: (extra[k], k))
        todo.discard(i)
        if _cost({**n, i: want[i]}, world_of) <= BUDGET:
            n[i] = want[i]
        else:
            left_out.append(i)
    return {"n": n, "world": {i: world_of[i] for i in n}, "left_out": sorted(left_out),
            "run_units": round(_cost(n, world_of), 1)}


PLAN = {  # plan() as committed (a test checks that plan() still gives it): claim id → seeds, its world, the cost
  "n": {
    "sec4.3": 5, "fig4-reward": 5, "fig7-is": 8, "fig15-ppomax": 5, "fig16-diverges-0.1": 5, "fig8-policy": 5,
    "fig8-pretrain": 6, "fig18": 5, "fig19": 5, "leave-one-out": 5, "tis": 5, "k1-reward": 5, "value-returns":
    5, "decoupled-lam": 5, "cispo": 5, "fig8-critic": 5, "gspo": 5, "fig2": 15, "fig4-drift": 8, "fig13": 10,
    "fig4-winrate": 15, "fig6-advnorm": 12, "fig6-rnorm": 13, "fig16-sensitive-0.01": 15},
  "world": {i: ("b" if i in TRANSFER else "a") for i in TRANSFER + NEARLY_DECIDED if i != "fig9"},
  "left_out": ["fig9"], "run_units": 293.3,
}   # fig9 left out: its 400-step runs (5 units each) do not fit the budget after the cheaper claims


def claims_v3() -> list:
    """The v3 claims: v2's, re-seeded (world A from 2000, world B from 3000) by PLAN."""
    by_claim = {c.id: c for c in v2.CLAIMS}
    return [claims.replace(by_claim[i], seeds=(SEEDS_B if PLAN["world"][i] == "b" else SEEDS_A)[:k])
            for i, k in PLAN["n"].items()]


if __name__ == "__main__":
    print(json.dumps(plan(), indent=1))
    print("world A's margins under MARGIN_PRINCIPLE:", json.dumps(margins_for(
        json.loads((claims.RESULTS / "v2" / "operating-point.json").read_text()), [{"gold_slope": -0.3}], 8.8, 1.02)))
