"""Registry v3: does a verdict travel to another world, did the mechanism act where it was judged, and the claims v2
nearly decided, on fresh seeds. v1 and v2 stay as committed.

Committed (2f16ae5) before any v3 record; its campaign trained from the tag registry-v3 and is complete
(docs/findings.md, "Does a verdict travel?"). notebooks/claims.py reads it (`--registry v3`). World B's margins come
from world B's pilot (tools/world_b_pilot.py margins, docs/worlds.md) by the principle stated here, and its variants'
defaults from the pilot's rule (`--world b`), so nothing about them was chosen after seeing a v3 result.

Implements: no equation of the paper.
  TRANSFER                v2's 15 decided claims, each judged in world B by v2's rule (registry_v2.judge)
  MARGIN_PRINCIPLE, margins_for(pilot)   world B's margins from its pilot by one principle; world A's beside them
  ENGAGEMENT              per claim: the measure that says whether its mechanism acted, and the threshold below which
                          the claim is "not tested" in that world (declared now, before the runs)
  NEARLY_DECIDED          the undecided v2 claims that v2's records say 10 seeds or fewer would decide (every
                          undecided part's seeds_to_decide ≤ 10), in world A on seeds from 2000
  plan()                  each claim's seeds (80 % power from v2's spreads, registry_v2.power_n) and the run units,
                          within BUDGET (300); PLAN is it as committed (a test checks plan() still gives it)
  acts(claim, recs)       ENGAGEMENT's measure on the judged runs' records (MEASURES); below its threshold,
                          claims.verdict answers "not tested"
  REGISTRY                what claims.py reads: v2's claims re-seeded by PLAN, world B's with world B's margins ("b:…")
  travel_rows/_table      v2's verdict (world A) beside v3's (world B) with each world's engagement; readme_sentence
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
# rule, parts and directions. A world B seed's runs are v2's variants with `--world b` (notebooks/runs.py's world,
# from the seed: claims.world_of), whose defaults are its pilot's (plumbing/config.py WORLD_B_PRESET, held to the
# pilot's records by tests/test_toy_world_b.py). "sec4.3" reads world B's probe of its own exploit (praise phrases
# added to a correct answer, eval.length_bias), not length: the paper's claim generalised to "the reward model
# over-pays for what the annotators favoured", the only reading world B can test.
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


def world_b_margins() -> dict[str, float]:
    """World B's margins under MARGIN_PRINCIPLE, as its pilot's record holds them (tools/world_b_pilot.py margins:
    notebooks/results/world-b/margins.json, committed before any v3 record). An error until that step has run."""
    path = PILOT_B / "margins.json"
    if not path.is_file():
        raise FileNotFoundError(f"world B's margins are not computed (missing {path}): python tools/world_b_pilot.py "
                                "margins")
    return json.loads(path.read_text())["margins"]


# =====================================================================================================================
# Engagement, declared before the runs: a claim whose mechanism does not act in a world is "not tested" there, not
# "no effect". Each entry: (the measure in words, how it is read from the judged runs' records, the threshold).
# Measures read the variants the claim judges, mean over its seeds. A claim without an entry compares whole
# configurations whose difference always acts (the treatment is the comparison itself).
# =====================================================================================================================
ENGAGEMENT = {
    "cispo": ("share of tokens PPO-clip clips in PPO-max (ppo/clipfrac, mean over steps)", "ppo-max mean:ppo/clipfrac",
              0.01),   # CISPO differs from PPO-clip only on clipped tokens; v2's runs clipped 0.07-0.09 %
    "tis": ("what the uncorrected top-p sampler costs: |win − lose(topp) − win − lose(ppo-max)|", "topp-cost",
            "win-lose"),
    "fig18": ("share of PPO-max's optimizer steps whose gradient norm exceeds the clip (1.0)",
              "ppo-max share:grad/norm>1", 0.10),
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


# =====================================================================================================================
# Engagement in code: ENGAGEMENT's measures, read from the judged runs' records (mean over the claim's seeds; a run
# without a record, or whose curve lacks the key, is left out and named). acts(claim, recs) is claims.verdict's
# Registry.acts: below the threshold the claim is "not tested" in that world.
# =====================================================================================================================
MEASURES = {   # the measure's name in ENGAGEMENT → f(rows of one run's per-step curve) → a number
    "mean:ppo/clipfrac": claims.token_share("ppo/clipfrac"),
    "share:grad/norm>1": lambda rows: sum(r["grad/norm"] > 1.0 for r in rows) / len(rows),
    "share:policy/entropy>1.0": lambda rows: sum(r["policy/entropy"] > 1.0 for r in rows) / len(rows),
    "mean:|ppo/ratio-1|": lambda rows: sum(abs(r["ppo/ratio"] - 1) for r in rows) / len(rows),
    "last10:kl/ref": lambda rows: claims._window({"metrics": rows}, "kl/ref", "last10"),
    # η · KL per response over |the total reward per response| (kl/coef · kl/ref_seq, reward/total), last 10 steps
    "share:eta*kl": lambda rows: sum(r["kl/coef"] * r["kl/ref_seq"] for r in rows[-10:]) / max(
        sum(abs(r["reward/total"]) for r in rows[-10:]), 1e-12),
    # 1 − λ^T (λ = 0.9, train.py's) at the run's mean response length T over its steps
    "decay:response/length": lambda rows: 1 - 0.9 ** (sum(r["response/length"] for r in rows) / len(rows)),
}


def acts(claim, recs: dict, margins: dict | None = None) -> dict | None:
    """How much the claim's mechanism acted in the runs it judges (ENGAGEMENT), or None for a claim without an entry.
    {"what", "value" (mean over the seeds with records), "threshold", "below", "runs" (how many), "missing"}.
    margins: the world's margins a threshold named by a margin kind reads (default: the registry's, by the claim's
    world)."""
    if claim.id not in ENGAGEMENT:
        return None
    what, measure, threshold = ENGAGEMENT[claim.id]
    world = "b" if claim.seeds and claims.world_of(claim.seeds[0]) == "b" else "a"
    if margins is None:
        margins = {k.removeprefix("b:"): v for k, v in MARGINS.items() if k.startswith("b:") == (world == "b")}
    if isinstance(threshold, str):
        threshold = margins[threshold]
    values, missing = [], []
    for s in claim.seeds:
        if measure == "topp-cost":   # a final metric: win − lose of the top-p sampler's run against PPO-max's
            a, b = (recs.get((v, s)) for v in ("topp", "ppo-max"))
            if a is None or b is None:
                missing.append(f"seed {s}")
                continue
            values.append(abs(a["metrics"]["win_lose"] - b["metrics"]["win_lose"]))
            continue
        variant, key = measure.split(" ", 1)
        r = recs.get((variant, s))
        rows = claims.decompress(r["curve"]) if r is not None and r.get("curve") else []
        if not rows:
            missing.append(f"{variant} seed {s}")
            continue
        try:
            values.append(float(MEASURES[key](rows)))
        except (KeyError, ZeroDivisionError, TypeError):
            missing.append(f"{variant} seed {s}")
    value = sum(values) / len(values) if values else None
    return {"what": what, "value": value, "threshold": threshold, "runs": len(values), "missing": missing,
            "below": value is not None and not missing and round(value, 12) < threshold}


# =====================================================================================================================
# The registry claims.py reads: v2's claims re-seeded by PLAN (world B's seeds for the transfer claims, their margins
# world B's: "b:gold" and so on), v2's variants, metrics and rule, v2's qualifiers as descriptions, and acts().
# =====================================================================================================================
WORLD_B_CONSTRUCTION = ("world B was built with an exploit (annotators who favour praise, 2.0 log-odds per phrase, "
                        "set before any run); its learning rates came from its pilot rule, not from a vanilla run; one "
                        "edit ('repeat frame') was added after its first vanilla run repeated the frame "
                        "(docs/worlds.md)")


def _in_world_b(claim):
    """A v2 claim as world B judges it: world B's margins ("b:…"); the exploit probe's words are world B's (praise
    phrases, not filler words); world A's "by construction" replaced by what world B was built to have. The metrics,
    variants and directions are v2's."""
    def part(p):
        what = p.what.replace("per filler token", "per praise phrase") if p.metric == "length_bias" else p.what
        return claims.replace(p, margin="b:" + p.margin, what=what)
    return claims.replace(claim, parts=tuple(part(p) for p in claim.parts),
                          construction=WORLD_B_CONSTRUCTION if claim.construction else "")


def _registry():
    """claims.Registry for v3 (world B's margins must exist: world_b_margins())."""
    global MARGINS
    MARGINS = {**v2.MARGINS, **{"b:" + k: v for k, v in world_b_margins().items()}}
    cs = [(_in_world_b(c) if PLAN["world"][c.id] == "b" else c) for c in claims_v3()]
    return claims.Registry("v3", cs, MARGINS, v2.VARIANTS, v2.LONG, RESULTS, v2.judge, v2.part_text, rule_text,
                           {c.id: c.seeds for c in cs}, v2.RUN_METRICS, v2.BASE_METRICS, v2.FINAL_METRICS, v2.SUMMARY,
                           SEEDS_A[:max(PLAN["n"].values())], v2.PLOT_SEEDS, v2.QUALIFIERS,
                           world_b_seeds=SEEDS_B, acts=acts)


def rule_text() -> str:
    """What docs/findings.md prints above v3's table."""
    b = ", ".join(f"{k[2:]} ±{v:.3g}" for k, v in MARGINS.items() if k.startswith("b:") and k[2:] not in SCALE_FREE)
    return (f"**The rule** is v2's, unchanged, for every part ({v2.RULE}); parts combine as in v2 ({v2.COMBINE}). "
            f"**Engagement:** a claim whose mechanism acted less than its declared threshold in the runs judging it "
            f"(`ENGAGEMENT`) is **not tested** there, whatever its parts say. **Margins:** world A's claims keep v2's; "
            f"world B's come from its pilot by `MARGIN_PRINCIPLE` (half the pilot's gain of PPO-max over SFT, and so "
            f"on): {b}; the scale-free ones are v2's. **Seeds:** world A from {SEEDS_A[0]}, world B from "
            f"{SEEDS_B[0]}, per claim by `PLAN` ({PLAN['run_units']:g} run units of a budget of {BUDGET:g}).")


MARGINS: dict = {}
REGISTRY = _registry()


# =====================================================================================================================
# Does a verdict travel? v2's verdict in world A beside v3's in world B, with the engagement (ENGAGEMENT's measure) in
# each: world A's read from v2's records of the claim's v2 seeds, thresholds named by a margin kind at v2's margins.
# =====================================================================================================================
TRAVEL = ("travels", "does not travel", "undecided in B", "not tested", "not run yet")


def travel_rows() -> list[dict]:
    """One row per transfer claim: the claim, v2's verdict (world A) and v3's (world B), each world's engagement
    (acts(), None where ENGAGEMENT has no entry) and the outcome, one of TRAVEL:
      not run yet      a seed v3 plans in world B has no record (the seeds run so far are printed, interim);
      not tested       the mechanism acted below its threshold in either world (v2's verdict read by v3's measure);
      undecided in B   world B's rule answers undecided;
      travels          the same label in both worlds; does not travel: two decided labels that differ."""
    before = claims.R.name
    try:
        claims.select("v2")
        recs_a = claims.records()
        a = {v["claim"].id: v for v in claims.verdicts(recs_a)}
        acts_a = {i: acts(a[i]["claim"], recs_a, v2.MARGINS) for i in TRANSFER}
        claims.select("v3")
        recs_b = claims.records()
        b = {v["claim"].id: v for v in claims.verdicts(recs_b)}
    finally:
        claims.select(before)
    rows = []
    for i in TRANSFER:
        va, vb, ea, eb = a[i], b[i], acts_a[i], b[i]["acts"]
        la, lb = claims.label(va["answer"]), claims.label(vb["answer"])
        if vb["answer"] == "not run":
            out = "not run yet"
        elif (ea is not None and ea["below"]) or lb == "not tested":
            out = "not tested"
        elif lb == "undecided":
            out = "undecided in B"
        else:
            out = "travels" if la == lb else "does not travel"
        rows.append({"claim": vb["claim"], "a": va, "b": vb, "label_a": la, "label_b": lb, "acts_a": ea, "acts_b": eb,
                     "outcome": out})
    return rows


def _acts_text(e: dict | None) -> str:
    if e is None:
        return "always acts (the comparison itself)"
    if e["value"] is None:
        return "no record yet"
    return f"{e['value']:.3g} (threshold {e['threshold']:.3g}){' → below' if e['below'] else ''}"


def travel_tally(rows: list[dict] | None = None) -> dict:
    rows = travel_rows() if rows is None else rows
    return {k: sum(r["outcome"] == k for r in rows) for k in TRAVEL}


def travel_table(rows: list[dict] | None = None) -> str:
    """docs/findings.md's "Does a verdict travel?" table, markdown."""
    rows = travel_rows() if rows is None else rows
    lines = ["| fig (claim) | the claim (the source's words) | world A (v2, seeds from 1000) | engagement in A | "
             "world B (v3, seeds from 3000) | engagement in B | does it travel? |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, vb = r["claim"], r["b"]
        if vb["answer"] == "not run":
            done = len(c.seeds) - max(len(p.get("missing", [])) for p in vb["parts"])
            b = f"not run ({done} of {len(c.seeds)} seeds recorded)"
        else:
            b = f"**{r['label_b']}** ({len(c.seeds)} seeds)"
        seeds_a = len(r["a"]["claim"].seeds)
        lines.append(f"| {c.figure} (`{c.id}`) | {c.sentence} | **{r['label_a']}** ({seeds_a} seeds) | "
                     f"{_acts_text(r['acts_a'])} | {b} | {_acts_text(r['acts_b'])} | {r['outcome']} |")
    lines.append("")
    lines.append("What each engagement measures (`ENGAGEMENT`, declared before the runs): " + "; ".join(
        f"{i}: {ENGAGEMENT[i][0]}" for i in TRANSFER if i in ENGAGEMENT) + ".")
    return "\n".join(lines)


def readme_sentence(rows: list[dict] | None = None) -> str:
    """The README's sentence on registry v3 (a test holds the README to it)."""
    t = travel_tally(rows)
    return (f"Registry v3 (`--registry v3 --travel`) judges v2's {sum(t.values())} decided claims again in world B: "
            f"travels {t['travels']}, does not travel {t['does not travel']}, undecided there {t['undecided in B']}, "
            f"not tested in one world {t['not tested']}, not run yet {t['not run yet']}")


if __name__ == "__main__":
    print(json.dumps(plan(), indent=1))
    print("world A's margins under MARGIN_PRINCIPLE:", json.dumps(margins_for(
        json.loads((claims.RESULTS / "v2" / "operating-point.json").read_text()), [{"gold_slope": -0.3}], 8.8, 1.02)))
