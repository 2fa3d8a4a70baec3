"""Registry v3's draft, checked before any v3 record: its transfer claims are exactly v2's decided ones, its nearly
decided ones exactly v2's undecided claims that 10 seeds or fewer would decide, its plan is what plan() computes and
fits its budget, its seeds are fresh, world B's seeds run in world B at its pilot's defaults and margins, and its
engagement measures compute what they declare."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import claims  # noqa: E402
import registry_v2  # noqa: E402
import registry_v3  # noqa: E402


@pytest.fixture(scope="module")
def v2_verdicts():
    claims.select("v2")
    recs = claims.records(registry_v2.REGISTRY)
    return recs, {v["claim"].id: v for v in claims.verdicts(recs)}


def test_transfer_is_v2s_decided_claims_and_nearly_decided_its_close_undecided_ones(v2_verdicts):
    _, verdicts = v2_verdicts
    decided = {i for i, v in verdicts.items() if v["answer"] != "undecided"}
    assert set(registry_v3.TRANSFER) == decided and len(decided) == 15
    close = {i for i, v in verdicts.items() if v["answer"] == "undecided"
             and all(p["seeds_to_decide"] is not None and p["seeds_to_decide"] <= 10
                     for p in v["parts"] if p["answer"] == "undecided")}
    assert set(registry_v3.NEARLY_DECIDED) == close


def test_the_plan_is_plan_and_fits_the_budget(v2_verdicts):
    recs, _ = v2_verdicts
    got = registry_v3.plan(recs)
    assert got == registry_v3.PLAN
    assert got["run_units"] <= registry_v3.BUDGET
    assert all(registry_v3.N_MIN <= k <= registry_v3.N_CAP for k in got["n"].values())


def test_v3_seeds_are_none_of_v1_v2_or_any_pilot():
    used = set(range(20)) | {100, 101, 102, 300, 301, 302} | set(registry_v2.SEEDS) | {500, 501, 502, 510, 511, 512, 520, 521, 522}
    assert not used & (set(registry_v3.SEEDS_A) | set(registry_v3.SEEDS_B))
    assert not set(registry_v3.SEEDS_A) & set(registry_v3.SEEDS_B)
    assert max(registry_v3.PLAN["n"].values()) <= len(registry_v3.SEEDS_A)


def test_margin_principle_gives_world_a_numbers_near_v2s():
    op = json.loads((claims.RESULTS / "v2" / "operating-point.json").read_text())
    m = registry_v3.margins_for(op, [{"gold_slope": -0.3}], 8.8, 1.02)
    assert m["gold"] == pytest.approx(0.5 * 0.391, abs=0.005) and m["win-lose"] == pytest.approx(0.0964, abs=0.001)
    assert m["kl"] == pytest.approx(0.012, abs=0.001) and m["slope"] == pytest.approx(0.05)
    assert {k: m[k] for k in registry_v3.SCALE_FREE} == {k: registry_v2.MARGINS[k] for k in registry_v3.SCALE_FREE}


def test_world_b_seeds_run_in_world_b_at_its_defaults_and_world_a_keys_are_v2s():
    """A v3 world B seed's run is v2's variant with --world b (runs.argv_for from the seed's world), whose defaults
    are the pilot's (WORLD_B_PRESET); a world A seed's config key is computed exactly as v2's records' keys are."""
    import runs
    claims.select("v3")
    try:
        assert claims.world_of(registry_v3.SEEDS_B[0]) == "b" and claims.world_of(registry_v3.SEEDS_A[0]) == "a"
        with runs.in_world("b"):
            argv = runs.argv_for("vanilla", registry_v2.VARIANTS["vanilla"], registry_v3.SEEDS_B[0], None)
        assert argv[argv.index("--world") + 1] == "b"
        from plumbing import flags
        _, _, rm, ppo, world, _ = flags.parse_configs(argv)
        assert world.name == "b" and rm.rm_lr == 1e-2 and ppo.kl_coef == 0   # world B's RM rate; vanilla stays vanilla
        key_b = claims.config_key("vanilla", registry_v3.SEEDS_B[0])
        assert key_b != claims._config_key(tuple(registry_v2.VARIANTS["vanilla"]), 80, registry_v3.SEEDS_B[0])
        claims.select("v2")
        rec = json.loads(claims.record_path("vanilla", 1000).read_text())
        assert claims.config_key("vanilla", 1000) == rec["config"]   # v2's keys unchanged by the world
    finally:
        claims.select("v2")


def test_world_b_margins_follow_the_principle_from_the_pilots_record():
    rec = json.loads((registry_v3.PILOT_B / "margins.json").read_text())
    op = json.loads((registry_v3.PILOT_B / "operating-point.json").read_text())
    runs_ = list(rec["runs"].values())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    got = registry_v3.margins_for(op, runs_, mean([r["sft_length"] for r in runs_]),
                                  mean([r["sft_entropy"] for r in runs_]))
    assert got == rec["margins"] == registry_v3.world_b_margins()
    chosen = op["candidates"][op["choice"]]
    assert got["gold"] == pytest.approx(0.5 * mean(chosen["gold_vs_sft"]))
    assert got["win-lose"] == pytest.approx(0.5 * mean(chosen["win_lose"]))
    assert got["kl"] == pytest.approx((1.3862943611198906 - 0.75) / 6 / mean([r["sft_length"] for r in runs_]))
    assert {k: v for k, v in registry_v3.MARGINS.items() if k.startswith("b:")} == {"b:" + k: v for k, v in got.items()}


def test_engagement_measures_by_hand():
    """Each ENGAGEMENT measure against a loop written here on made-up curves, and acts()'s threshold and 'below'."""
    rows = [{"ppo/clipfrac": 0.02 * (i % 3), "grad/norm": 0.5 + 0.2 * i, "policy/entropy": 0.9 + 0.05 * i,
             "ppo/ratio": 1 + (-1) ** i * 0.01 * i, "kl/ref": 0.01 * i, "kl/coef": 0.2, "kl/ref_seq": 0.1 * i,
             "reward/total": (-1) ** i * (1.0 + i), "response/length": 4 + i} for i in range(12)]
    m = registry_v3.MEASURES
    assert m["mean:ppo/clipfrac"](rows) == pytest.approx(sum(0.02 * (i % 3) for i in range(12)) / 12)
    assert m["share:grad/norm>1"](rows) == pytest.approx(len([i for i in range(12) if 0.5 + 0.2 * i > 1]) / 12)
    assert m["share:policy/entropy>1.0"](rows) == pytest.approx(len([i for i in range(12) if 0.9 + 0.05 * i > 1]) / 12)
    assert m["mean:|ppo/ratio-1|"](rows) == pytest.approx(sum(0.01 * i for i in range(12)) / 12)
    assert m["last10:kl/ref"](rows) == pytest.approx(sum(0.01 * i for i in range(2, 12)) / 10)
    num = sum(0.2 * 0.1 * i for i in range(2, 12))
    den = sum(1.0 + i for i in range(2, 12))
    assert m["share:eta*kl"](rows) == pytest.approx(num / den)
    t = sum(4 + i for i in range(12)) / 12
    assert m["decay:response/length"](rows) == pytest.approx(1 - 0.9 ** t)
    claims.select("v3")
    try:
        c = next(c for c in registry_v3.REGISTRY.claims if c.id == "cispo")
        recs = {("ppo-max", s): {"curve": claims.compress(rows), "metrics": {}} for s in c.seeds}
        a = registry_v3.acts(c, recs)
        assert a["value"] == pytest.approx(m["mean:ppo/clipfrac"](rows)) and a["threshold"] == 0.01
        assert a["below"] is False and a["runs"] == len(c.seeds)
        low = [{**r, "ppo/clipfrac": 0.001} for r in rows]
        recs = {("ppo-max", s): {"curve": claims.compress(low), "metrics": {}} for s in c.seeds}
        assert registry_v3.acts(c, recs)["below"] is True
        tis = next(c for c in registry_v3.REGISTRY.claims if c.id == "tis")
        recs = {(v, s): {"metrics": {"win_lose": w}} for s in tis.seeds for v, w in (("topp", 0.1), ("ppo-max", 0.2))}
        a = registry_v3.acts(tis, recs)
        assert a["value"] == pytest.approx(0.1) and a["threshold"] == registry_v3.MARGINS["b:win-lose"]
        assert registry_v3.acts(tis, {})["below"] is False   # nothing recorded yet: not below, "not run"
    finally:
        claims.select("v2")


def between(text: str, start: str, end: str) -> str:
    assert start in text and end in text, f"the page has lost the marks {start} … {end}"
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_findings_v3_blocks_and_the_readme_sentence_are_what_the_committed_records_give():
    """docs/findings.md's v3 rule, table, tally and "Does a verdict travel?" blocks, and the README's v3 sentence, are
    claims.py's and registry_v3's output from the committed records (python notebooks/claims.py --write-docs)."""
    claims.select("v3")
    try:
        text = claims.FINDINGS.read_text()
        blocks = claims.findings_blocks()
        assert claims.TRAVEL_MARKS in blocks and len(blocks) == 5
        for (start, end), body in blocks.items():
            assert between(text, start, end) == body.strip(), start
    finally:
        claims.select("v2")
    assert between(claims.README.read_text(), *claims.V3_SENTENCE_MARKS) == registry_v3.readme_sentence()


def test_travel_outcome_by_hand():
    """travel_rows' outcome for made-up verdicts: the same label travels, two decided labels differ, undecided in B,
    an engagement below its threshold in either world is not tested, and B not run is not run yet."""
    claim = registry_v3.REGISTRY.claims[0]
    base = {"claim": claim, "parts": [], "acts": None}

    def outcome(a, b, ea=None, eb=None):
        import unittest.mock as m
        va, vb = {**base, "answer": a}, {**base, "answer": b, "acts": eb}
        with m.patch.object(claims, "verdicts", side_effect=lambda recs=None: [
                {**(va if claims.R.name == "v2" else vb), "claim": c} for c in claims.R.claims]), \
                m.patch.object(claims, "records", return_value={}), \
                m.patch.object(registry_v3, "acts", return_value=ea):
            return registry_v3.travel_rows()[0]["outcome"]
    below, above = {"below": True}, {"below": False}
    assert outcome("as the paper", "as the paper") == "travels"
    assert outcome("alike", "alike", above, above) == "travels"
    assert outcome("as the paper", "alike") == "does not travel"
    assert outcome("alike", "against the paper") == "does not travel"
    assert outcome("as the paper", "undecided") == "undecided in B"
    assert outcome("alike", "alike", below, above) == "not tested"      # world A's mechanism did not act
    assert outcome("alike", "not tested", above, below) == "not tested"
    assert outcome("as the paper", "not run") == "not run yet"


def test_a_mechanism_below_its_threshold_is_not_tested_whatever_its_parts_say():
    """claims.verdict under v3: the same decided parts give the rule's answer when the declared engagement is met, and
    "not tested" when it is not (cispo: PPO-clip's clipped share in PPO-max against 1 %)."""
    claims.select("v3")
    try:
        c = next(c for c in registry_v3.REGISTRY.claims if c.id == "cispo")
        (part,) = c.parts

        def recs(clipfrac):
            rows = [{"ppo/clipfrac": clipfrac}] * 10
            out = {}
            for i, s in enumerate(c.seeds):
                out[("ppo-max", s)] = {"metrics": {part.metric: 0.1}, "curve": claims.compress(rows)}
                out[("cispo", s)] = {"metrics": {part.metric: 1.0 + 0.01 * i}}   # far above any margin: decided
            return out
        acted, idle = claims.verdict(c, recs(0.05)), claims.verdict(c, recs(0.001))
        assert acted["answer"] == "as the paper" and acted["acts"]["below"] is False
        assert idle["answer"] == "not tested" and idle["parts"][0]["answer"] == "as the paper"
        assert claims.label(idle["answer"]) == "not tested"
        assert claims.qualifiers(idle, recs(0.001))[0].endswith("→ not tested")
    finally:
        claims.select("v2")


def test_travel_needs_registry_v3(capsys):
    with pytest.raises(SystemExit) as e:
        claims.main(["--travel"])
    assert e.value.code == 2 and "--registry v3" in capsys.readouterr().err
    claims.select("v2")
