"""Registry v3's draft, checked before any v3 record: its transfer claims are exactly v2's decided ones, its nearly
decided ones exactly v2's undecided claims that 10 seeds or fewer would decide, its plan is what plan() computes and
fits its budget, its seeds are fresh, and world B's variants cannot be built before world B's pilot has run."""
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


def test_world_b_variants_need_world_bs_pilot_first():
    if all((registry_v3.PILOT_B / f"{s}.json").is_file() for s in ("lr2", "policy-lr", "operating-point")):
        assert registry_v3.world_b_flags()[:2] == ("--world", "b")
    else:
        with pytest.raises(FileNotFoundError, match="world B's pilot has not run"):
            registry_v3.world_b_flags()
