"""The claims registries (notebooks/claims.py, notebooks/registry_v2.py): the t quantiles; v1's rule (equivalence
first, then a direction at 95 %), its second stage, operating point and summary, exactly as committed; v2's rule (one
standard both ways: a 90 % interval inside ±margin, or wholly beyond it), its seed plan, claims, seeds, operating point
and per-step curves; the selection of a registry; and docs/findings.md and the README as the records give them."""
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import claims  # noqa: E402
import registry_v2  # noqa: E402

V1_RULE_TALLY = {"as the paper": 10, "against the paper": 10, "alike": 4, "undecided": 6}   # v1, as committed
V1_TALLY = {"supported": 10, "no effect": 4, "contradicted": 10, "undecided": 6}   # the same answers, labelled
V2_TALLY = {"supported": 5, "no effect": 9, "contradicted": 1, "undecided": 22}    # v2's {5, 1, 9, 22}, labelled
DIRECTIONS = ("higher", "lower", "alike", "differs", "not-lower")


@pytest.fixture(autouse=True)
def v2_selected(monkeypatch):
    """Every test starts with v2 selected (the default) and leaves the selection as it found it."""
    monkeypatch.setattr(claims._Selected, "registry", claims.registry("v2"))


def use(monkeypatch, reg: claims.Registry) -> claims.Registry:
    """Select `reg` for this test only (the autouse fixture puts the selection back)."""
    monkeypatch.setattr(claims._Selected, "registry", reg)
    return reg


@pytest.fixture(scope="module")
def v1_records():
    """v1's committed records, read once for the tests that need all of them."""
    return claims.records(claims.V1)


def t_cdf_by_integration(t: float, df: int, steps: int = 400_000) -> float:
    """P(T ≤ t) for t ≥ 0: ½ + the midpoint rule on Student's density over [0, t]."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    x = (np.arange(steps) + 0.5) * (t / steps)
    return 0.5 + float(np.sum(c * (1 + x * x / df) ** (-(df + 1) / 2)) * (t / steps))


@pytest.mark.parametrize("df", [1, 2, 3, 5, 9, 19, 30, 100])
@pytest.mark.parametrize("p", [0.95, 0.975])
def test_t_quantile_against_the_integrated_density(df, p):
    assert t_cdf_by_integration(claims.t_quantile(p, df), df) == pytest.approx(p, abs=2e-5)


def test_t_quantiles_agree_with_the_printed_tables():
    # two-sided 95 % and 90 % quantiles every statistics table prints
    assert claims.t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert claims.t_quantile(0.975, 9) == pytest.approx(2.262, abs=1e-3)
    assert claims.t_quantile(0.95, 9) == pytest.approx(1.833, abs=1e-3)
    assert claims.t_quantile(0.95, 19) == pytest.approx(1.729, abs=1e-3)


def intervals(d):
    """(mean, lo95, hi95, lo90, hi90) of the paired differences d, computed here from claims.t_quantile."""
    d = np.asarray(d, float)
    n, m, se = len(d), d.mean(), d.std(ddof=1) / math.sqrt(len(d))
    return m, m - claims.t_quantile(0.975, n - 1) * se, m + claims.t_quantile(0.975, n - 1) * se, \
        m - claims.t_quantile(0.95, n - 1) * se, m + claims.t_quantile(0.95, n - 1) * se


# =====================================================================================================================
# Selecting a registry
# =====================================================================================================================
def test_v2_is_the_default_and_select_switches_what_every_function_reads(monkeypatch):
    monkeypatch.setattr(claims._Selected, "registry", None)     # as a fresh import has it
    assert claims.R.name == "v2" and claims.R.claims is registry_v2.CLAIMS
    assert claims.record_path("ppo-max", 1000) == claims.RESULTS / "v2" / "ppo-max-seed1000.json"
    assert claims.select("v1") is claims.V1 and claims.R.name == "v1" and claims.R.claims is claims.CLAIMS
    assert claims.record_path("ppo-max", 3) == claims.RESULTS / "ppo-max-seed3.json"
    assert claims.registry("v2") is registry_v2.REGISTRY and claims.select("v2").name == "v2"


def test_an_unknown_registry_is_a_one_line_exit(capsys):
    with pytest.raises(SystemExit) as e:
        claims.main(["--registry", "v4", "--tally"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--registry v4" in err


def test_v1_tally_is_as_committed(capsys):
    """`python notebooks/claims.py --registry v1 --tally`: v1's verdicts from its committed records, unchanged by
    v2's arrival."""
    claims.main(["--registry", "v1", "--tally"])
    assert capsys.readouterr().out == json.dumps(V1_TALLY) + "\n"
    claims.main(["--tally"])
    assert capsys.readouterr().out == json.dumps(V2_TALLY) + "\n"


def test_records_reads_the_selected_registry_or_the_given_one(monkeypatch, v1_records):
    """records() reads the selected registry's folder (v2: notebooks/results/v2/, none of v1's records);
    records(reg) reads reg's whatever is selected."""
    v2 = claims.records()
    assert v2 == claims.records(registry_v2.REGISTRY) and all(s in registry_v2.SEEDS for _, s in v2)
    assert v1_records and all(s < 1000 for _, s in v1_records)
    assert all(rec["variant"] == v and rec["seed"] == s for (v, s), rec in v1_records.items())
    use(monkeypatch, claims.V1)
    assert claims.records().keys() == v1_records.keys() and claims.records(registry_v2.REGISTRY) == v2


# =====================================================================================================================
# v1's rule (claims.judge), as committed
# =====================================================================================================================
def test_equivalence_is_tested_before_the_direction():
    # a small difference that is significant (its 95 % interval excludes 0) but lies inside the margin is "alike"
    d = [0.010, 0.012, 0.011, 0.009, 0.010, 0.011, 0.012, 0.009, 0.010, 0.011]
    m, lo95, hi95, lo90, hi90 = intervals(d)
    assert lo95 > 0 and -0.05 < lo90 and hi90 < 0.05
    assert claims.judge(d, 0.05, "higher")["answer"] == "alike"      # the paper claims a difference: none found
    assert claims.judge(d, 0.05, "alike")["answer"] == "as the paper"
    assert claims.judge(d, 0.005, "higher")["answer"] == "as the paper"   # a margin smaller than the effect


def test_directions_and_the_paper_claim():
    up = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7, 1.0, 1.0]
    assert claims.judge(up, 0.1, "higher")["answer"] == "as the paper"
    assert claims.judge(up, 0.1, "lower")["answer"] == "against the paper"
    assert claims.judge(up, 0.1, "alike")["answer"] == "against the paper"
    assert claims.judge(up, 0.1, "differs")["answer"] == "as the paper"
    assert claims.judge([-x for x in up], 0.1, "differs")["answer"] == "as the paper"
    v = claims.judge(up, 0.1, "higher")
    m, lo95, hi95, _, _ = intervals(up)
    assert (v["mean"], v["lo95"], v["hi95"], v["n"], v["above"]) == pytest.approx((m, lo95, hi95, 10, 10))


def test_undecided_prints_the_seeds_that_would_decide_it():
    d = [1.0, -0.6, 0.5, 0.2, -0.3, 1.0, -0.6, 0.5, 0.2, -0.3]
    v = claims.judge(d, 0.1, "higher")
    assert v["answer"] == "undecided" and v["stat"] == "undecided"
    mean, sd = float(np.mean(d)), float(np.std(d, ddof=1))
    # the same number by brute force: the first n whose 95 % half-width at this mean and sd falls below |mean|
    # (or whose 90 % interval fits the margin)
    brute = next(n for n in range(2, 100_000)
                 if claims.t_quantile(0.975, n - 1) * sd / math.sqrt(n) < abs(mean)
                 or abs(mean) + claims.t_quantile(0.95, n - 1) * sd / math.sqrt(n) < 0.1)
    assert v["seeds_to_decide"] == brute
    assert claims.judge([5.0], 1.0, "higher")["answer"] == "undecided"           # one seed tells nothing


def test_combine_every_part_holds_or_the_claim_does_not():
    assert claims.combine(["as the paper", "as the paper"]) == "as the paper"
    assert claims.combine(["as the paper", "alike"]) == "alike"
    assert claims.combine(["as the paper", "undecided", "alike"]) == "undecided"
    assert claims.combine(["undecided", "against the paper"]) == "against the paper"
    assert registry_v2.COMBINE == claims.COMBINE     # v2 combines parts as v1 did


def test_every_v1_claim_names_variants_metrics_and_margins_that_exist():
    ids = [c.id for c in claims.CLAIMS]
    assert len(ids) == len(set(ids)) >= 26
    for c in claims.CLAIMS:
        assert len(c.seeds) >= 10, c.id
        for part in c.parts:
            assert part.margin in claims.MARGINS, (c.id, part.margin)
            assert part.direction in ("higher", "lower", "alike", "differs"), (c.id, part.direction)
            for v in claims.part_variants(part):
                assert v == claims.BASE or v in claims.VARIANTS, (c.id, v)
            special = part.metric in claims.INTERACTIONS or part.metric == "skew_delta"
            assert special or part.metric in claims.METRICS, (c.id, part.metric)
            assert part.minus is None or part.minus in claims.METRICS, (c.id, part.minus)
            base_metric = part.metric in claims.BASE_METRICS
            assert base_metric == (part.a == claims.BASE), (c.id, part.metric)


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_a_claim_reads_its_parts_from_records_paired_by_seed(name, monkeypatch):
    """verdict() on hand-made records, under either registry's rule: the d of each seed is the difference of that
    seed's two records; a missing record makes the claim "not run", its parts printed as interim."""
    use(monkeypatch, claims.registry(name))
    claim = claims.Claim("t", "t", "a beats b", (claims.P("x", "win_lose", "a", "b", "higher", "win-lose"),),
                         seeds=(0, 1, 2))
    recs = {(v, s): {"metrics": {"win_lose": x}} for v, xs in {"a": [0.5, 0.4, 0.6], "b": [0.1, 0.0, 0.3]}.items()
            for s, x in enumerate(xs)}
    v = claims.verdict(claim, recs)
    assert v["parts"][0]["mean"] == pytest.approx(np.mean([0.4, 0.4, 0.3]))
    del recs[("b", 2)]
    v = claims.verdict(claim, recs)
    assert v["answer"] == "not run" and v["parts"][0]["missing"] == [2]
    # the seeds run so far are judged and printed as interim, never as the claim's answer
    assert v["parts"][0]["interim"]["mean"] == pytest.approx(0.4) and v["parts"][0]["interim"]["n"] == 2
    assert "not run (seeds 2 missing)" in claims.R.part_text(v["parts"][0])
    assert "interim, not a verdict" in claims.R.part_text(v["parts"][0])


def test_seed_ranges_and_parse_seeds_agree():
    for seeds in ([6, 7, 8, 9], [0, 2, 3, 10], [5], [1000, 1001, 1002, 1007]):
        text = claims._seed_ranges(seeds)
        assert claims.parse_seeds(text.replace("–", "-").replace(" ", "")) == set(seeds)
    assert claims._seed_ranges([6, 7, 8, 9, 12]) == "6–9, 12"
    with pytest.raises(SystemExit) as e:
        claims.parse_seeds("6-x")
    assert e.value.code == 2


# =====================================================================================================================
# v2's rule (registry_v2.judge): one standard both ways
# =====================================================================================================================
SMALL = [0.010, 0.012, 0.011, 0.009, 0.010, 0.011, 0.012, 0.009, 0.010, 0.011]   # 90 %: [+0.0099, +0.0111]
UP = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7, 1.0, 1.0]                           # 90 %: [+0.905, +1.095]
# 95 % interval [+0.074, +0.206] excludes 0, 90 % interval [+0.087, +0.193] reaches inside the margin 0.1
STRADDLE = [0.30, 0.02, 0.20, 0.08, 0.14, 0.25, 0.03, 0.10, 0.18, 0.10]


def test_v2_judge_numbers_are_the_intervals_computed_here():
    for d in (SMALL, UP, STRADDLE, [-x for x in STRADDLE]):
        m, lo95, hi95, lo90, hi90 = intervals(d)
        v = registry_v2.judge(d, 0.1, "higher")
        assert (v["mean"], v["lo95"], v["hi95"], v["lo90"], v["hi90"]) == pytest.approx((m, lo95, hi95, lo90, hi90))
        assert v["n"] == len(d) and v["sd"] == pytest.approx(np.std(d, ddof=1))
        assert v["above"] == sum(x > 0 for x in d)
        assert v["nonzero"] == (lo95 > 0 or hi95 < 0)
        assert v["alike_above"] == pytest.approx(max(abs(lo90), abs(hi90)))


def test_v2_a_difference_inside_the_margin_is_alike():
    m, lo95, hi95, lo90, hi90 = intervals(SMALL)
    assert lo95 > 0 and -0.05 < lo90 and hi90 < 0.05     # significant, and inside the margin
    v = registry_v2.judge(SMALL, 0.05, "higher")
    assert v["stat"] == "alike" and v["answer"] == "alike" and v["nonzero"]
    assert v["seeds_to_decide"] is None and v["beyond_below"] == pytest.approx(lo90)
    assert registry_v2.judge(SMALL, 0.05, "alike")["answer"] == "as the paper"
    assert registry_v2.judge(SMALL, 0.05, "lower")["answer"] == "alike"
    assert registry_v2.judge(SMALL, 0.05, "differs")["answer"] == "alike"
    assert registry_v2.judge(SMALL, 0.05, "not-lower")["answer"] == "as the paper"
    # a margin smaller than the whole 90 % interval: then the difference is beyond it
    assert registry_v2.judge(SMALL, 0.005, "higher")["answer"] == "as the paper"


def test_v2_a_90_interval_wholly_beyond_the_margin_is_a_direction():
    m, lo95, hi95, lo90, hi90 = intervals(UP)
    assert lo90 > 0.1
    v = registry_v2.judge(UP, 0.1, "higher")
    assert v["stat"] == "higher" and v["answer"] == "as the paper" and v["nonzero"]
    assert v["beyond_below"] == pytest.approx(lo90) and v["seeds_to_decide"] is None
    expect = {"higher": "as the paper", "lower": "against the paper", "alike": "against the paper",
              "differs": "as the paper", "not-lower": "as the paper"}
    assert {k: registry_v2.judge(UP, 0.1, k)["answer"] for k in DIRECTIONS} == expect
    down = [-x for x in UP]
    v = registry_v2.judge(down, 0.1, "lower")
    assert v["stat"] == "lower" and v["answer"] == "as the paper" and v["beyond_below"] == pytest.approx(lo90)
    expect = {"higher": "against the paper", "lower": "as the paper", "alike": "against the paper",
              "differs": "as the paper", "not-lower": "against the paper"}
    assert {k: registry_v2.judge(down, 0.1, k)["answer"] for k in DIRECTIONS} == expect


def test_v2_an_interval_that_excludes_0_but_reaches_inside_the_margin_is_undecided():
    """The case v1 called a difference: 95 % interval above 0, 90 % interval across +margin. v2: undecided,
    "different from 0, size undecided", with the seeds that would decide it."""
    m, lo95, hi95, lo90, hi90 = intervals(STRADDLE)
    assert 0 < lo95 and 0 < lo90 < 0.1 < hi90
    assert claims.judge(STRADDLE, 0.1, "higher")["answer"] == "as the paper"      # v1: a difference
    v = registry_v2.judge(STRADDLE, 0.1, "higher")
    assert v["stat"] == "undecided" and v["answer"] == "undecided" and v["nonzero"]
    assert v["beyond_below"] == pytest.approx(lo90)      # higher for any margin below lo90 ...
    assert registry_v2.judge(STRADDLE, lo90 * 0.999, "higher")["stat"] == "higher"
    assert registry_v2.judge(STRADDLE, lo90 * 1.001, "higher")["stat"] == "undecided"
    assert {k: registry_v2.judge(STRADDLE, 0.1, k)["answer"] for k in DIRECTIONS if k != "not-lower"} == \
        {k: "undecided" for k in ("higher", "lower", "alike", "differs")}
    text = registry_v2.part_text({"part": claims.P("d", "x", "a", "b", "higher", "win-lose"), **v})
    assert "different from 0, size undecided" in text and f"~{v['seeds_to_decide']} seeds would decide it" in text
    assert "[90 %: " in text and "→ undecided" in text


def test_v2_alike_and_beyond_hold_exactly_for_the_margins_it_prints():
    """alike_above: alike for every margin above it and none below; beyond_below: a direction for every margin below
    it and none above."""
    for d in (SMALL, UP, STRADDLE, [-x for x in UP], [0.3, -0.2, 0.1, 0.0, -0.1]):
        v = registry_v2.judge(d, 0.1, "alike")
        a = v["alike_above"]
        assert registry_v2.judge(d, a * 1.001, "alike")["stat"] == "alike"
        assert registry_v2.judge(d, a * 0.999, "alike")["stat"] != "alike"
        b = v["beyond_below"]
        if b is None:      # the 90 % interval holds 0: no margin makes it a direction
            assert v["lo90"] <= 0 <= v["hi90"]
            continue
        assert registry_v2.judge(d, b * 0.999, "alike")["stat"] in ("higher", "lower")
        assert registry_v2.judge(d, b * 1.001, "alike")["stat"] not in ("higher", "lower")


def test_v2_part_text_says_the_margins_for_which_it_holds():
    part = claims.P("d", "x", "a", "b", "higher", "win-lose")
    alike = registry_v2.judge(SMALL, 0.05, "higher")
    assert f"(no difference that matters for any margin above {alike['alike_above']:.3g})" in registry_v2.part_text({"part": part, **alike})
    up = registry_v2.judge(UP, 0.1, "higher")
    assert f"(higher for any margin below {up['beyond_below']:.3g})" in registry_v2.part_text({"part": part, **up})
    on_margin = registry_v2.judge([0.1 + x for x in (0.05, -0.05, 0.1, -0.1, 0.0)], 0.1, "higher")
    assert on_margin["stat"] == "undecided" and on_margin["seeds_to_decide"] is None
    assert "no number of seeds would decide it" in registry_v2.part_text({"part": part, **on_margin})


def test_v2_not_lower_and_differs():
    around0 = [0.3, -0.2, 0.1, 0.0, -0.1, 0.2, -0.3, 0.05, -0.05, 0.0]   # 90 % across 0 and both margins at 0.1
    below = [x - 0.1 for x in around0]                                # across −margin: not shown to be no worse
    for d in (around0, below):
        assert registry_v2.judge(d, 0.1, "not-lower")["answer"] == "undecided"
        assert registry_v2.judge(d, 0.1, "differs")["answer"] == "undecided"
    assert registry_v2.judge(SMALL, 0.05, "not-lower")["answer"] == "as the paper"        # alike: no worse
    assert registry_v2.judge(UP, 0.1, "not-lower")["answer"] == "as the paper"            # better
    assert registry_v2.judge([-x for x in UP], 0.1, "not-lower")["answer"] == "against the paper"   # worse
    assert registry_v2.judge(UP, 0.1, "differs")["answer"] == "as the paper"
    assert registry_v2.judge([-x for x in UP], 0.1, "differs")["answer"] == "as the paper"
    assert registry_v2.judge(SMALL, 0.05, "differs")["answer"] == "alike"


def test_v2_not_lower_holds_once_the_90_interval_lies_above_minus_the_margin():
    m, lo95, hi95, lo90, hi90 = intervals(STRADDLE)
    assert -0.1 < lo90 and hi90 > 0.1
    assert registry_v2.judge(STRADDLE, 0.1, "not-lower")["answer"] == "as the paper"


def first_deciding_n(mean: float, sd: float, margin: float, most: int = 2000) -> int | None:
    """The first n whose 90 % interval at this mean and sd lies inside ±margin or wholly beyond it (brute force)."""
    for n in range(2, most + 1):
        h = claims.t_quantile(0.95, n - 1) * sd / math.sqrt(n)
        if -margin < mean - h and mean + h < margin or mean - h > margin or mean + h < -margin:
            return n
    return None


@pytest.mark.parametrize("mean, sd, margin", [(0.14, 0.092, 0.1), (-0.14, 0.092, 0.1), (0.05, 0.1, 0.1),
                                              (0.3, 0.5, 0.25), (0.0, 0.2, 0.1)])
def test_v2_seeds_to_decide_against_brute_force(mean, sd, margin):
    assert registry_v2.seeds_to_decide(mean, sd, margin) == first_deciding_n(mean, sd, margin)


def test_v2_judge_prints_the_seeds_that_would_decide_an_undecided_part():
    v = registry_v2.judge(STRADDLE, 0.1, "higher")
    assert v["seeds_to_decide"] == first_deciding_n(v["mean"], v["sd"], 0.1) > len(STRADDLE)
    assert registry_v2.seeds_to_decide(0.1, 0.05, 0.1) is None       # a mean on the margin: never decided
    one = registry_v2.judge([5.0], 1.0, "higher")                     # one seed tells nothing
    assert one["answer"] == "undecided" and one["seeds_to_decide"] is None and not one["nonzero"]


# =====================================================================================================================
# v2's plan, claims and seeds
# =====================================================================================================================
def test_v2_plan_seeds_reproduces_the_committed_plan():
    """plan_seeds() from v1's committed records gives SEED_PLAN and EXPECTED_UNDECIDED exactly, within BUDGET;
    every claim planned to be decided gets at least the seeds each of its parts needs for 80 % power."""
    plan = registry_v2.plan_seeds()
    cost = plan.pop("_cost")
    assert {i: p["n"] for i, p in plan.items()} == registry_v2.SEED_PLAN
    assert tuple(i for i, p in plan.items() if p["hopeless"]) == registry_v2.EXPECTED_UNDECIDED
    on_bases = {c.id for c in registry_v2.CLAIMS if all(claims.part_variants(p) == {claims.BASE} for p in c.parts)}
    assert all(plan[i]["n"] == registry_v2.N_HOPELESS for i in registry_v2.EXPECTED_UNDECIDED if i not in on_bases)
    assert cost <= registry_v2.BUDGET and cost == pytest.approx(259.8, abs=0.05)   # SEED_PLAN's comment says 259.8
    for i, p in plan.items():
        if not p["hopeless"]:
            assert p["n"] >= max([n for n in p["parts"] if n is not None] + [registry_v2.N_MIN]), i


def test_v2_plan_costs_what_its_runs_cost():
    """The committed claims' runs, counted here from what --run plans (every variant on its claims' seeds, the
    README's summary variants on every seed of the registry, each seed's base), cost plan_seeds' cost."""
    reg = registry_v2.REGISTRY
    runs = {(v, s) for v, s in claims.planned(reg.claims) if v != claims.BASE} | \
           {(v, s) for v in reg.summary for s in reg.seeds}
    bases = {s for v, s in claims.planned(reg.claims) if v == claims.BASE}
    assert bases == set(reg.seeds)
    cost = sum(registry_v2.UNITS.get(v, reg.long.get(v, claims.STEPS) / claims.STEPS) for v, _ in runs) \
        + 1.1 * len(bases)
    assert cost == pytest.approx(registry_v2._cost(registry_v2.SEED_PLAN, registry_v2.CLAIMS_UNPLANNED))
    assert cost <= registry_v2.BUDGET


def test_v2_judges_every_paper_claim_v1_judged_and_the_newer_tricks():
    v1_paper = {c.id for c in claims.CLAIMS} - {"fig10-style", "leave-one-out", "release"}
    v2_ids = [c.id for c in registry_v2.CLAIMS]
    assert len(v1_paper) == 27 and v1_paper <= set(v2_ids)
    assert len(v2_ids) == len(set(v2_ids)) and set(v2_ids) == set(registry_v2.SEED_PLAN)
    # the newer tricks: claims that read a run v1 never had
    new = [c.id for c in registry_v2.CLAIMS
           if any(v not in claims.VARIANTS and v != claims.BASE for p in c.parts for v in claims.part_variants(p))]
    assert len(new) >= 6 and {c.id for c in registry_v2.TRICK_CLAIMS} <= set(new)
    for c in registry_v2.OWN_CLAIMS:     # the project's own claims say so
        assert "the project's own claim" in c.sentence and "(new)" in c.figure, c.id


@pytest.mark.parametrize("claim", registry_v2.CLAIMS, ids=lambda c: c.id)
def test_every_v2_claim_names_variants_metrics_and_margins_that_exist(claim):
    assert claim.seeds == registry_v2.SEEDS[:registry_v2.SEED_PLAN[claim.id]]
    assert len(claim.seeds) >= registry_v2.N_HOPELESS and set(registry_v2.PLOT_SEEDS) <= set(claim.seeds)
    metrics = {**registry_v2.RUN_METRICS, **registry_v2.BASE_METRICS}
    for part in claim.parts:
        assert part.margin in registry_v2.MARGINS, part
        assert part.direction in DIRECTIONS, part
        for v in claims.part_variants(part):
            assert v == claims.BASE or v in registry_v2.VARIANTS, (part, v)
        special = part.metric in claims.INTERACTIONS or part.metric == "skew_delta"
        assert special or part.metric in metrics, part
        assert part.minus is None or part.minus in metrics, part
        assert (part.metric in registry_v2.BASE_METRICS) == (part.a == claims.BASE), part


def test_every_v2_variant_is_a_command_line_train_py_accepts(monkeypatch):
    """Each variant's flags (the newer tricks' included) parse and pass train.py's checks at the registry's budget;
    a variant v1 had keeps v1's flags, so v1's records of it are its pilot."""
    import runs
    monkeypatch.setattr(runs, "FULL", True)
    for v, flags in registry_v2.VARIANTS.items():
        want = runs.expected(runs.argv_for(v, flags, registry_v2.SEEDS[0], registry_v2.LONG.get(v)))
        assert want["steps"] == (registry_v2.LONG.get(v, claims.STEPS) if want["preset"] != "best-of-n" else 0), v
        assert v not in claims.VARIANTS or claims.VARIANTS[v] == flags, v
    for v2_name, v1_name in registry_v2.PILOT.items():
        assert v2_name in registry_v2.VARIANTS and v1_name in claims.VARIANTS


def test_v2_seeds_are_new_and_its_records_are_on_them():
    """No v2 seed is one v1 used (its seeds, its records' seeds, its operating point's pilot) or v2's own
    operating-point pilot; every record under notebooks/results/v2/ is on a seed of registry_v2.SEEDS."""
    v2 = set(registry_v2.SEEDS)
    assert len(v2) == len(registry_v2.SEEDS) and min(v2) >= 1000
    v1_record_seeds = {int(re.search(r"-seed(\d+)\.json$", p.name).group(1))
                       for p in claims.RESULTS.glob("*-seed*.json")}
    for used in (set(range(20)), set(claims.SEEDS20), {100, 101, 102}, set(claims.OPERATING_POINT["pilot_seeds"]),
                 set(registry_v2.OPERATING_POINT["pilot_seeds"]), v1_record_seeds):
        assert not v2 & used
    reg = registry_v2.REGISTRY
    assert set(reg.seeds) <= v2 and set(reg.plot_seeds) <= v2
    assert reg.results == claims.RESULTS / "v2"
    for p in sorted(reg.results.glob("*.json")):
        if p.name == "operating-point.json":
            continue
        rec = json.loads(p.read_text())
        assert rec["seed"] in v2 and p.name == f"{rec['variant']}-seed{rec['seed']}.json", p.name
        assert rec["variant"] == claims.BASE or rec["variant"] in registry_v2.VARIANTS, p.name


def test_v2_operating_point_takes_the_best_win_rate_and_breaks_ties_by_kl():
    op = registry_v2.OPERATING_POINT
    assert op["tie"] == pytest.approx(0.02) and not set(op["pilot_seeds"]) & set(registry_v2.SEEDS)
    rows = {"a": {"win_lose": [0.40, 0.20, 0.30], "kl_tok": [0.30, 0.30, 0.30]},     # mean 0.30: the best
            "b": {"win_lose": [0.35, 0.25, 0.255], "kl_tok": [0.20, 0.10, 0.15]},    # mean 0.285: within the tie
            "c": {"win_lose": [0.27, 0.27, 0.26], "kl_tok": [0.01, 0.01, 0.01]},     # mean 0.267: beyond it
            "d": {"win_lose": [0.50, 0.00, 0.10], "kl_tok": [0.0, 0.0, 0.0]}}        # the best single seed only
    assert registry_v2.choose_operating_point(rows) == "b"            # tied with a, the smaller KL
    assert registry_v2.choose_operating_point({k: rows[k] for k in "acd"}) == "a"   # c's KL does not count
    assert registry_v2.choose_operating_point({k: rows[k] for k in "cd"}) == "c"
    rows["e"] = {"win_lose": [0.6, 0.6, 0.6], "kl_tok": [0.9, 0.9, 0.9]}
    assert registry_v2.choose_operating_point(rows) == "e"            # the highest mean, whatever its KL
    names = [n for n, _ in op["candidates"]]
    assert len(names) == len(set(names)) and all(flags for _, flags in op["candidates"])


# =====================================================================================================================
# Records: the per-step curve
# =====================================================================================================================
def test_compress_decompress_round_trip():
    rows = [{"step": i, "reward/score": 0.1 * i + 1e-12, "kl/ref": None, "text": "naïve – ✓", "nested": {"a": [1, 2]}}
            for i in range(200)]
    text = claims.compress(rows)
    assert isinstance(text, str) and text.isascii() and claims.decompress(text) == rows
    assert claims.compress(rows) == text          # no timestamp inside: a record rewritten is the same bytes
    assert len(text) < len(json.dumps(rows)) / 3
    assert claims.decompress(claims.compress([])) == []


def test_a_record_names_the_machine_and_v2_keeps_the_curve(monkeypatch, tmp_path):
    """make_record stamps machine() (the CPU, the kernel level torch runs at, torch's version); under v2 it keeps the
    per-step curve (the run's metrics.jsonl, a base's rm_log), compressed; v1's records have none."""
    import runs
    import torch
    m = claims.machine()
    assert torch.__version__ in m and torch.backends.cpu.get_cpu_capability() in m
    monkeypatch.setattr(runs, "code_version", lambda files=None: "this-code")   # hashing the tree: not tested here
    monkeypatch.setattr(claims, "git_commit", lambda: "this-commit")
    rm_log = [{"step": s, "heldout_accuracy": 0.5 + s / 100} for s in (0, 10, 20)]
    steps = [{"step": s, "reward/score": s / 10, "kl/ref": None} for s in range(5)]
    monkeypatch.setattr(claims, "load_base", lambda base: {"rm_log": rm_log})
    monkeypatch.setattr(claims, "load_run", lambda d: {"metrics": steps, "summary": {}})
    monkeypatch.setattr(claims, "config_key", lambda v, s: f"{v}/{s}")
    for reg in (claims.V1, registry_v2.REGISTRY):
        use(monkeypatch, dataclasses.replace(reg, base_metrics={"x": lambda got: 1.0},
                                             run_metrics={"y": lambda got: len(got["metrics"])},
                                             variants={"a": ("--a",)}))
        base = claims.make_record(claims.BASE, 0, None, tmp_path / "seed0-base")
        run = claims.make_record("a", 0, tmp_path / "a-seed0")
        assert base["machine"] == m and base["metrics"] == {"x": 1.0} and run["metrics"] == {"y": 5.0}
        assert run["config"] == "a/0" and run["flags"] == ["--a"] and run["steps"] == claims.STEPS
        assert (run["code"], run["commit"], base["config"], base["steps"]) == ("this-code", "this-commit",
                                                                               "seed0-base", 0)
        if reg.name == "v1":
            assert "curve" not in base and "curve" not in run
        else:
            assert claims.decompress(base["curve"]) == rm_log and claims.decompress(run["curve"]) == steps


# =====================================================================================================================
# Running a registry
# =====================================================================================================================
@pytest.mark.parametrize("name", ["v1", "v2"])
def test_run_registry_sends_every_seed_to_the_pool_and_writes_each_record_when_its_run_is_done(name, tmp_path,
                                                                                              monkeypatch):
    """--run hands all seeds' runs to the pool at once, long runs first, then each seed's first run before any seed's
    second; each record is written as soon as its run is done (runs finish out of order), a seed's base record with
    its first run (at once where the seed has no run), and a failed run gets no record while the others do; the
    records go to the selected registry's folder."""
    import runs
    todo = [("a", 10), ("b", 10), ("a", 11), ("b", 11), ("long", 12), ("a", 12), ("base", 10), ("base", 13)]
    monkeypatch.setattr(runs, "configure", lambda full, world="a": None)
    monkeypatch.setattr(runs, "report", lambda: "")
    monkeypatch.setattr(runs, "base_dir", lambda s: Path(f"runs/_base/seed{s}"))
    use(monkeypatch, dataclasses.replace(claims.registry(name), results=tmp_path / name,
                                         variants={"a": ("--a",), "b": ("--b",), "long": ("--long",)},
                                         long={"long": 400}))
    monkeypatch.setattr(claims, "planned", lambda cs=None: todo)
    monkeypatch.setattr(claims, "recorded", lambda v, s: False)
    monkeypatch.setattr(claims, "BASE", "base")
    monkeypatch.setattr(claims, "config_key", lambda v, s: f"{v}/{s}")
    monkeypatch.setattr(claims, "make_record", lambda v, s, d, base=None: {"variant": v, "seed": s, "dir": str(d)})
    order, writes = [], []
    real_write = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, text: writes.append(self.name) or real_write(self, text))

    def stream(specs, keep_going=False):
        order.extend((v, s) for v, _, s, _ in specs)
        assert writes == ["base-seed13.json"], "a seed without runs has its base record before any run"
        for i in [4, 0, 2, 1, 5, 3]:       # the order the workers finish the specs in
            v, _, s, _ = specs[i]
            yield i, (RuntimeError("boom") if (v, s) == ("b", 11) else {"dir": Path(f"runs/{v}-seed{s}")})

    monkeypatch.setattr(runs, "run_each", stream)
    claims.run_registry()
    assert order == [("long", 12), ("a", 10), ("a", 11), ("b", 10), ("b", 11), ("a", 12)]
    # finish order: b/11 (fails), long/12, a/11, a/10 (and seed 10's base), a/12, b/10
    assert writes == ["base-seed13.json", "long-seed12.json", "a-seed11.json", "a-seed10.json", "base-seed10.json",
                      "a-seed12.json", "b-seed10.json"]
    assert json.loads((tmp_path / name / "a-seed11.json").read_text())["dir"] == "runs/a-seed11"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


# =====================================================================================================================
# v1's second stage, operating point and summary, as committed
# =====================================================================================================================
def test_the_second_stage_is_its_rule_applied_to_the_first_ten_seeds(monkeypatch, v1_records):
    """SECOND_STAGE is what second_stage_rule gives on v1's committed records of seeds 0-9, and exactly those claims
    are planned on 20 seeds beyond the ones first planned on 20; each reports its first ten seeds' answer."""
    use(monkeypatch, claims.V1)
    assert claims.second_stage_rule(v1_records) == claims.SECOND_STAGE
    twenty = {c.id for c in claims.CLAIMS if c.seeds == claims.SEEDS20}
    first_twenty = {i for i, seeds in claims.FIRST_PLAN.items() if seeds == claims.SEEDS20}
    assert twenty - first_twenty == set(claims.SECOND_STAGE)
    for c in claims.CLAIMS:
        first = claims.first_stage(c, v1_records)
        if c.id in claims.SECOND_STAGE:
            assert first["answer"] == "undecided" and first["claim"].seeds == claims.SEEDS
        else:
            assert first is None


def test_second_stage_rule_takes_undecided_claims_that_twenty_seeds_would_decide(monkeypatch):
    """The rule on canned verdicts: undecided with every undecided part at ≤ 20 seeds → in; a part beyond 20 or never
    decidable, a decided claim, or a claim first planned on 20 seeds → out."""
    use(monkeypatch, claims.V1)

    def part(answer, need=None):
        return {"answer": answer, "seeds_to_decide": need}
    canned = {
        "in": ("undecided", [part("as the paper"), part("undecided", 12), part("undecided", 20)]),
        "too-many": ("undecided", [part("undecided", 12), part("undecided", 21)]),
        "never": ("undecided", [part("undecided", None)]),
        "decided": ("against the paper", [part("against the paper"), part("undecided", 11)]),
        "twenty": ("undecided", [part("undecided", 12)]),
    }
    fake = [claims.Claim(i, "x", "x", ()) for i in canned]
    monkeypatch.setattr(claims, "CLAIMS", fake)
    monkeypatch.setattr(claims, "FIRST_PLAN", {i: claims.SEEDS20 if i == "twenty" else claims.SEEDS for i in canned})
    seen = []

    def verdict(c, recs=None):
        seen.append(c.seeds)
        answer, parts = canned[c.id]
        return {"claim": c, "answer": answer, "parts": parts}
    monkeypatch.setattr(claims, "verdict", verdict)
    assert claims.second_stage_rule(recs={}) == ("in",)
    assert seen and all(s == claims.SEEDS for s in seen)   # judged on the first ten seeds only


def test_v1_operating_point_rule_takes_the_first_candidate_that_reaches_the_target(monkeypatch):
    use(monkeypatch, claims.V1)
    names = [n for n, _ in claims.OPERATING_POINT["candidates"]]
    target = claims.OPERATING_POINT["target_kl_seq"]
    assert target == pytest.approx(math.log(4) - 0.75)
    kl = {n: 0.1 for n in names}
    kl[names[3]] = kl[names[5]] = target + 0.01
    assert claims.choose_operating_point(kl) == (names[3], True)
    kl = {n: 0.05 * i for i, n in enumerate(names)}     # none reaches it: the largest
    assert claims.choose_operating_point(kl) == (names[-1], False)


def canned_summary_records(variants, seeds):
    rng = np.random.default_rng(0)
    recs = {}
    for v in variants:
        for s in seeds:
            w, t = rng.uniform(0, 0.5, 2)
            recs[(v, s)] = {"metrics": {"final_gold": rng.normal(2), "final_gold_vs_sft": rng.normal(),
                                        "win": w, "tie": t, "lose": 1 - w - t, "win_lose": w - (1 - w - t),
                                        "final_kl_seq": rng.uniform(), "final_kl": rng.uniform(),
                                        "final_length": rng.uniform(5, 15)}}
    return recs


def summary_rows(text: str) -> dict[str, list[str]]:
    """{row label: its cells} of the summary's markdown table."""
    rows = {}
    for r in text.splitlines():
        if r.startswith("| "):
            cells = [c.strip() for c in r.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_v1_summary_rows_are_means_over_seeds_of_the_records(monkeypatch):
    """The README's summary from canned records under v1: each cell is the mean (± sd) over the seeds, computed here
    by a loop, and the win / tie / lose row prints the three mean shares."""
    use(monkeypatch, claims.V1)
    seeds = (3, 4, 5)
    recs = canned_summary_records(claims.SUMMARY, seeds)
    rows = summary_rows(claims.summary(recs, seeds))   # row label -> its cells: SFT, then claims.SUMMARY's columns
    for i, v in enumerate(claims.SUMMARY):
        shares = [sum(recs[(v, s)]["metrics"][k] for s in seeds) / len(seeds) for k in ("win", "tie", "lose")]
        assert rows["win / tie / lose vs SFT (mean shares)"][1 + i] == " / ".join(f"{x:.2f}" for x in shares)
        gold = [recs[(v, s)]["metrics"]["final_gold"] for s in seeds]
        mean = sum(gold) / len(gold)
        sd = (sum((g - mean) ** 2 for g in gold) / (len(gold) - 1)) ** 0.5
        assert rows["gold reward"][1 + i] == f"{mean:.2f} ± {sd:.2f}"


def test_v2_summary_has_a_column_for_every_summary_variant():
    seeds = registry_v2.SEEDS[:3]
    text = claims.summary(canned_summary_records(registry_v2.SUMMARY, seeds), seeds)
    table = [r for r in text.splitlines() if r.startswith("|")]
    widths = {r.count("|") for r in table}
    assert widths == {len(registry_v2.SUMMARY) + 3}, widths   # label, SFT, one per variant: n + 2 cells, n + 3 bars


# =====================================================================================================================
# The pages: docs/findings.md and the README as the committed records give them
# =====================================================================================================================
@pytest.mark.parametrize("name", ["v1", "v2"])
def test_write_findings_fills_every_block_and_keeps_the_prose(name, tmp_path, monkeypatch):
    use(monkeypatch, claims.registry(name))
    text = "intro\n"
    for start, end in claims.marks(name):
        text += f"PROSE-A\n{start}\nSTALE-X\n{end}\nPROSE-B\n"
    page = tmp_path / "findings.md"
    page.write_text(text)
    claims.write_findings({}, path=page)
    out = page.read_text()
    assert "STALE-X" not in out and out.count("PROSE-A") == 3 and out.count("PROSE-B") == 3
    assert claims.table({}).strip() in out and claims.R.rule_text() in out
    page.write_text("no marks")
    with pytest.raises(SystemExit):
        claims.write_findings({}, path=page)


def test_the_two_registries_have_their_own_marks():
    v1, v2 = claims.marks("v1"), claims.marks("v2")
    every = [m for pair in (*v1, *v2) for m in pair]
    assert len(set(every)) == 12
    for a in every:     # no mark is found inside another: each block is read between its own marks only
        assert not any(a in b for b in every if b != a), a
    assert all("--registry v1" in m for pair in v1 for m in pair)
    assert all("--registry" not in m for pair in v2 for m in pair)


def between(text: str, start: str, end: str) -> str:
    assert start in text and end in text, f"the page has lost the marks {start} … {end}"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_docs_findings_blocks_are_what_the_committed_records_give(monkeypatch, v1_records):
    """docs/findings.md's rule, verdict table and tally of BOTH registries are claims.py's output from their records,
    character for character (python notebooks/claims.py --write-docs): a verdict is computed, never typed."""
    text = claims.FINDINGS.read_text()
    for name, recs in (("v1", v1_records), ("v2", claims.records(registry_v2.REGISTRY))):
        use(monkeypatch, claims.registry(name))
        for (start, end), body in claims.findings_blocks(recs).items():
            assert between(text, start, end) == body.strip(), (name, start)
        tally = claims.tally(recs)
        assert sum(tally.values()) == len(claims.R.claims)
        assert tally == (V1_TALLY if name == "v1" else V2_TALLY)


def test_readme_summary_is_what_the_committed_records_give():
    """The README's table of SFT, PPO-max, vanilla PPO, best-of-4 and the newer presets is claims.py --summary's
    output under v2 (v1's until v2 has records of two seeds), character for character."""
    assert between(claims.README.read_text(), *claims.SUMMARY_MARKS) == claims.readme_summary().strip()


@pytest.fixture(scope="module")
def written_docs(tmp_path_factory):
    """`python notebooks/claims.py --write-docs` into copies of docs/findings.md and README.md: (findings, README)."""
    tmp = tmp_path_factory.mktemp("docs")
    copies = {claims.FINDINGS: tmp / "findings.md", claims.README: tmp / "README.md"}
    for real, copy in copies.items():
        copy.write_text(real.read_text())
    write = claims.write_findings

    def redirected(recs=None, path=claims.FINDINGS, blocks=None):
        return write(recs, copies[path], blocks)      # a KeyError rather than a write to any other page
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(claims._Selected, "registry", claims.registry("v2"))
        mp.setattr(claims, "write_findings", redirected)
        claims.main(["--write-docs"])
        assert claims.R.name == "v2"      # --write-docs puts the selection back
    return copies[claims.FINDINGS].read_text(), copies[claims.README].read_text()


def test_write_docs_leaves_the_committed_findings_as_they_are(written_docs):
    assert written_docs[0] == claims.FINDINGS.read_text()


def test_write_docs_writes_the_readme_summary_the_check_expects(written_docs):
    assert between(written_docs[1], *claims.SUMMARY_MARKS) == claims.readme_summary().strip()


def test_against_records_compares_each_run_with_the_record_of_its_config_and_seed(monkeypatch, request):
    """runs_for's line (full budget): a run is matched to the committed record of its config and seed (a twin, the
    same config under two names, counted once), its final held-out gold compared; equal numbers count as equal, and
    the largest gap is named with the record's machine."""
    import runs
    monkeypatch.setattr(runs, "FULL", True)
    claims._config_key.cache_clear()   # the keys of the full budget's flags, and none of them left for later tests
    request.addfinalizer(claims._config_key.cache_clear)
    recs = claims.records()
    (variant, seed), rec = next((k, r) for k, r in sorted(recs.items()) if k[0] == "vanilla")
    recorded = rec["metrics"]["final_gold"]
    same = claims.against_records({variant: [{"final": {"gold_reward": recorded}}]}, (seed,))
    assert "of these 1 runs" in same and "1 equal, median |Δ| 0, 0 beyond" in same and "largest" not in same
    off = claims.against_records({variant: [{"final": {"gold_reward": recorded - 1.0}}]}, (seed,))
    assert "0 equal, median |Δ| 1, 1 beyond the gold margin" in off
    assert f"{variant} seed {seed}: {recorded:+.3f} recorded on {rec['machine']}, {recorded - 1:+.3f} here" in off
    twins = [v for v in claims.R.variants if claims.config_key(v, seed) == claims.config_key("ppo-max", seed)]
    assert len(twins) >= 2   # PPO-max under another name (its η spelled out)
    both = claims.against_records({v: [{"final": {"gold_reward": 0.0}}] for v in twins}, (seed,))
    assert "of these 1 runs" in both
    none = claims.against_records({variant: [{"final": {"gold_reward": 0.0}}]}, (7,))
    assert none.startswith("[records] none of these runs has a record")


def test_successor_plan_reads_v2_records_as_a_pilot(monkeypatch):
    """--successor (after the campaign, not v2's plan): a claim is powered at a cap when every part's power_n at
    v2's mean and sd is within it; a larger cap powers a superset at a cost no lower; with differences far beyond
    every margin each claim needs N_MIN seeds and nothing more than it has, except those planned below N_MIN."""
    rows = registry_v2.successor_plan((10, 25, 100))
    for small, large in zip(rows, rows[1:]):
        assert set(large["unpowered"]) <= set(small["unpowered"]) and large["run_units"] >= small["run_units"]
        assert large["powered"] + len(large["unpowered"]) == large["claims"] == len(registry_v2.CLAIMS)
    recs = claims.records()
    claim = next(c for c in registry_v2.CLAIMS if c.id == "fig3")
    part = claim.parts[1]
    ds = [claims.difference(part, recs, s) for s in claim.seeds]
    n = registry_v2.power_n(np.mean(ds), np.std(ds, ddof=1), registry_v2.MARGINS[part.margin], part.direction)
    assert ("fig3" in rows[-1]["unpowered"]) == (n > 100)
    far = iter(np.tile([100.0, 101.0, 102.0], 10_000))
    monkeypatch.setattr(registry_v2, "_difference", lambda part, recs, seed: next(far))
    (row,) = registry_v2.successor_plan((10,), recs={})
    assert row["powered"] == len(registry_v2.CLAIMS) and row["unpowered"] == []
    n = {c.id: max(len(c.seeds), registry_v2.N_MIN) for c in registry_v2.CLAIMS}
    assert row["run_units"] == round(registry_v2._cost(n, registry_v2.CLAIMS), 1)


def test_readme_states_v2s_tally_as_the_records_give_it():
    """The README's sentence on registry v2's tally is what --tally prints from the committed records."""
    text = " ".join((claims.ROOT / "README.md").read_text().split())
    t = claims.tally()
    assert claims.readme_sentence() in text
    assert claims.readme_sentence() in " ".join(claims.FINDINGS.read_text().split())   # findings says it too
    assert (f"{t['supported']} of its {sum(t.values())} claims are supported" in claims.readme_sentence()
            and f"{t['no effect'] + t['contradicted']} failed" in claims.readme_sentence())


def test_readme_and_methods_state_the_presets_as_the_records_give_them():
    """The README's line on DAPO and VAPO (paired with vanilla PPO by seed; medians and ranges of their skewed KL) and
    docs/methods.md's fuller sentence are presets_brief() and presets_sentence() from the committed records."""
    squash = lambda path: " ".join(path.read_text().split())  # noqa: E731
    assert " ".join(claims.presets_brief().split()) in squash(claims.README)
    assert " ".join(claims.presets_sentence().split()) in squash(claims.ROOT / "docs" / "methods.md")
    recs = claims.records()
    kl = [recs[("dapo", s)]["metrics"]["final_kl_seq"] for s in claims.R.seeds]
    assert f"medians {np.median(kl):.1f}" in claims.presets_brief() and f"{max(kl):.1f}" in claims.presets_brief()


# =====================================================================================================================
# Labels and qualifiers: the rule's answers renamed by what they mean, and the descriptions beside them
# =====================================================================================================================
@pytest.mark.parametrize("name", ["v1", "v2"])
def test_labels_rename_the_rules_answers_and_keep_their_counts(name, monkeypatch, v1_records):
    """Every claim's label is LABELS of its answer by COMBINE; the label tally adds up to the claims and each count is
    the count of the answer it renames (counted here from the verdicts, not from rule_tally)."""
    reg = use(monkeypatch, claims.registry(name))
    recs = v1_records if name == "v1" else claims.records(reg)
    answers = [v["answer"] for v in claims.verdicts(recs)]
    tally = claims.tally(recs)
    assert sum(tally.values()) == len(reg.claims) == len(answers)
    renamed = {"as the paper": "supported", "alike": "no effect", "against the paper": "contradicted",
               "undecided": "undecided"}
    assert set(claims.LABELS.items()) >= set(renamed.items())
    for answer, lab in renamed.items():
        assert tally[lab] == answers.count(answer), (answer, lab)
    assert claims.rule_tally(recs) == {a: answers.count(a) for a in claims.ANSWERS}
    assert tally == (V1_TALLY if name == "v1" else V2_TALLY)
    assert claims.rule_tally(recs) == (V1_RULE_TALLY if name == "v1" else
                                       {"as the paper": 5, "against the paper": 1, "alike": 9, "undecided": 22})


def test_a_claimed_difference_inside_the_margin_is_no_effect_and_beyond_it_the_other_way_contradicted():
    small, up = [0.01, 0.012, 0.009, 0.011, 0.01], [1.0, 1.1, 0.9, 1.05, 0.95]
    down = [-x for x in up]
    lab = lambda d, m, direction: claims.label(registry_v2.judge(d, m, direction)["answer"])  # noqa: E731
    for direction in ("higher", "lower", "differs"):          # a claim of a difference
        assert lab(small, 0.1, direction) == "no effect"
    assert lab(up, 0.1, "higher") == lab(down, 0.1, "lower") == lab(up, 0.1, "differs") == "supported"
    assert lab(up, 0.1, "lower") == lab(down, 0.1, "higher") == "contradicted"
    assert lab(small, 0.1, "alike") == lab(small, 0.1, "not-lower") == "supported"   # a claim of no difference
    assert lab(up, 0.1, "alike") == lab(down, 0.1, "not-lower") == "contradicted"
    assert lab([-1.0, 1.0, 0.5], 0.1, "higher") == "undecided"
    part = lambda direction, answer: {"part": claims.P("x", "win_lose", "a", "b", direction, "win-lose"),  # noqa: E731
                                      "answer": answer}
    assert claims.how_contradicted({"parts": [part("alike", "against the paper")]}) == \
        "a difference where none was claimed"
    assert claims.how_contradicted({"parts": [part("higher", "against the paper"), part("lower", "as the paper")]}) \
        == "the other way"


def curve_record(variant: str, seed: int, rows: list[dict]) -> dict:
    return {"variant": variant, "seed": seed, "metrics": {}, "curve": claims.compress(rows)}


def test_engagement_is_read_from_the_curves_and_below_its_threshold_the_row_says_so(monkeypatch):
    """Engaged: the measure on each judged run's curve, the mean over the runs against the threshold; a run whose
    curve lacks the key is named; every engagement below → "not really tested here", some → "partly"."""
    claim = claims.Claim("c", "x", "s", (claims.P("w", "win_lose", "a", "b", "higher", "win-lose"),), seeds=(1, 2))
    clip = claims.Engaged("the clip binds", ("a",), "ppo/clipfrac", claims.token_share(), 0.01, "tokens")
    grad = claims.Engaged("the grad clip engages", ("b",), "grad/norm", claims.step_share("grad/norm", lo=1.0), 0.1,
                          "steps")
    recs = {("a", 1): curve_record("a", 1, [{"ppo/clipfrac": 0.001}, {"ppo/clipfrac": 0.003}]),
            ("a", 2): curve_record("a", 2, [{"ppo/clipfrac": 0.004}]),
            ("b", 1): curve_record("b", 1, [{"grad/norm": x} for x in (0.5, 1.5, 2.0, 0.9)]),
            ("b", 2): curve_record("b", 2, [{"step": 0}])}
    e = claims.engagement(clip, claim, recs)
    assert e["values"] == pytest.approx([0.002, 0.004]) and e["mean"] == pytest.approx(0.003) and e["below"]
    g = claims.engagement(grad, claim, recs)
    assert g["values"] == [0.5] and g["missing"] == ["b seed 2"] and not g["below"]
    reg = use(monkeypatch, dataclasses.replace(claims.registry("v2"), qualifiers={"c": [clip, grad]}))
    v = {"claim": claim, "parts": []}
    q = claims.qualifiers(v, recs)
    assert q[0] == "**partly tested here**"
    assert any("0.3 % of tokens" in x and "threshold 1 %" in x and x.endswith("not really tested here") for x in q)
    assert any("50 % of steps" in x and "no curve of grad/norm in b seed 2" in x for x in q)
    reg.qualifiers["c"] = [clip]
    assert claims.qualifiers(v, recs)[0] == "**not really tested here**"
    assert claims.step_share("x", 0.9, 1.0)([{"x": 0.9}, {"x": 1.0}, {"x": 0.95}, {"y": 3}]) == pytest.approx(2 / 3)


def test_every_v2_qualifier_prints_on_its_row_of_the_table():
    """--table: each claim with an engagement shows it with its threshold; each qualified claim shows its qualifiers."""
    recs = claims.records()
    rows = {r.split(" | ")[1]: r for r in claims.table(recs).splitlines()[2:]}
    by_sentence = {c.id: c.sentence for c in registry_v2.CLAIMS}
    for cid, qs in registry_v2.QUALIFIERS.items():
        row = rows[by_sentence[cid]]
        for q in qs:
            if isinstance(q, claims.Engaged):
                assert f"engagement: {q.what}: " in row and "threshold " in row, cid
            if isinstance(q, claims.Setting):
                assert q.text in row, cid
    assert claims.not_tested(recs) == ["fig17", "fig18", "clip-higher", "tis", "cispo"]
