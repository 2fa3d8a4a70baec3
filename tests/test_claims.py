"""The claims registry (notebooks/claims.py): the t quantiles, the one rule (equivalence first, then a direction, else
undecided with the seeds that would decide it), the rule that combines parts, and the registry's own consistency."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import claims  # noqa: E402


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
    d = np.asarray(d, float)
    n, m, se = len(d), d.mean(), d.std(ddof=1) / math.sqrt(len(d))
    return m, m - claims.t_quantile(0.975, n - 1) * se, m + claims.t_quantile(0.975, n - 1) * se, \
        m - claims.t_quantile(0.95, n - 1) * se, m + claims.t_quantile(0.95, n - 1) * se


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
    d = [1.0, -1.0, 0.5, 0.2, -0.3, 1.0, -1.0, 0.5, 0.2, -0.3]
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


def test_every_claim_names_variants_metrics_and_margins_that_exist():
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


def test_a_claim_reads_its_parts_from_records_paired_by_seed():
    """verdict() on hand-made records: the d of each seed is the difference of that seed's two records."""
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
    assert "not run (seeds 2 missing)" in claims.part_text(v["parts"][0])
    assert "interim, not a verdict" in claims.part_text(v["parts"][0])


def test_seed_ranges_and_parse_seeds_agree():
    for seeds in ([6, 7, 8, 9], [0, 2, 3, 10], [5]):
        text = claims._seed_ranges(seeds)
        assert claims.parse_seeds(text.replace("–", "-").replace(" ", "")) == set(seeds)
    assert claims._seed_ranges([6, 7, 8, 9, 12]) == "6–9, 12"
    with pytest.raises(SystemExit) as e:
        claims.parse_seeds("6-x")
    assert e.value.code == 2


def test_code_equivalence_links_versions_that_reproduced_the_records(tmp_path, monkeypatch):
    """Records of one code version stand for another only through code-equivalence.json's links, in either
    direction and along a chain, never for an unlinked version."""
    import json
    path = tmp_path / "code-equivalence.json"
    monkeypatch.setattr(claims, "EQUIVALENCE", path)
    assert claims.same_code("a", "a") and not claims.same_code("a", "b")
    path.write_text(json.dumps([{"code": "b", "same_as": "a"}, {"code": "c", "same_as": "b"}]))
    assert claims.same_code("a", "c") and claims.same_code("c", "a") and claims.same_code("b", "a")
    assert not claims.same_code("a", "d") and not claims.same_code(None, "c")


def test_write_findings_fills_every_block_and_keeps_the_prose(tmp_path):
    text = "intro\n"
    for start, end in (claims.RULE_MARKS, claims.TABLE_MARKS, claims.TALLY_MARKS):
        text += f"PROSE-A\n{start}\nSTALE-X\n{end}\nPROSE-B\n"
    page = tmp_path / "findings.md"
    page.write_text(text)
    claims.write_findings(path=page)
    out = page.read_text()
    assert "STALE-X" not in out and out.count("PROSE-A") == 3 and out.count("PROSE-B") == 3
    assert claims.table().strip() in out and claims.rule_text() in out
    page.write_text("no marks")
    with pytest.raises(SystemExit):
        claims.write_findings(path=page)


def test_operating_point_rule_takes_the_first_candidate_that_reaches_the_target():
    names = [n for n, _ in claims.OPERATING_POINT["candidates"]]
    target = claims.OPERATING_POINT["target_kl_seq"]
    assert target == pytest.approx(math.log(4) - 0.75)
    kl = {n: 0.1 for n in names}
    kl[names[3]] = kl[names[5]] = target + 0.01
    assert claims.choose_operating_point(kl) == (names[3], True)
    kl = {n: 0.05 * i for i, n in enumerate(names)}     # none reaches it: the largest
    assert claims.choose_operating_point(kl) == (names[-1], False)


def test_docs_findings_table_and_tally_are_what_the_committed_records_give():
    """docs/findings.md's verdict table and tally are claims.py's output from notebooks/results/, character for
    character (python notebooks/claims.py --table / --tally): a verdict is computed, never typed."""
    import json
    text = (claims.ROOT / "docs" / "findings.md").read_text()
    start, end = "<!-- claims.py --table -->", "<!-- end of claims.py --table -->"
    assert start in text and end in text, "docs/findings.md has lost the markers of its generated table"
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == claims.table().strip()
    tally = json.dumps(claims.tally())
    assert f"`{tally}`" in text, f"docs/findings.md does not quote the tally {tally}"
    assert sum(claims.tally().values()) == len(claims.CLAIMS) >= 26


def test_readme_summary_is_what_the_committed_records_give():
    """The README's table of SFT, PPO-max, vanilla PPO and best-of-4 is claims.py --summary's output, character for
    character (python notebooks/claims.py --write-docs writes it)."""
    text = claims.README.read_text()
    start, end = claims.SUMMARY_MARKS
    assert start in text and end in text, "README.md has lost the marks of its generated summary"
    assert text.split(start, 1)[1].split(end, 1)[0].strip() == claims.summary().strip()


def test_check_code_of_a_seed_without_records_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        claims.check_code(77)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--check-code 77" in err


def test_check_code_against_a_bad_commit_fails_in_one_line_before_any_training(capsys, monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("trained before the argument was checked")
    monkeypatch.setattr(claims, "check_metrics", no_training)
    for argv, needle in ((["--check-code", "0", "--against", "no-such-commit"], "--against no-such-commit"),
                         (["--against", "HEAD"], "--against")):
        with pytest.raises(SystemExit) as e:
            claims.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err


@pytest.fixture
def fake_check(tmp_path, monkeypatch):
    """check_code on made-up records (every CHECK variant of seed 0 at code "old", metric m = 1.0), this code at
    version "now", the commits' code at "old", and the training replaced: trained["here"] is what CHECK's runs give
    in this repository, trained["commit"] in any other tree (a worktree of --against's commit); trained["trees"]
    lists the trees trained in."""
    import json
    import runs
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(claims, "RESULTS", results)
    monkeypatch.setattr(claims, "EQUIVALENCE", results / "code-equivalence.json")
    monkeypatch.setattr(claims, "record_path", lambda v, s: results / f"{v}-seed{s}.json")
    for v in claims.CHECK:
        (results / f"{v}-seed0.json").write_text(json.dumps({"code": "old", "metrics": {"m": 1.0}}))
    monkeypatch.setattr(runs, "code_version", lambda files=None: "now")
    monkeypatch.setattr(claims, "code_version_at", lambda sha: "old")
    trained = {"trees": []}

    def check_metrics(tree, seed):
        trained["trees"].append(tree)
        return {"code": "?", "metrics": trained["here" if tree == claims.ROOT else "commit"]}
    monkeypatch.setattr(claims, "check_metrics", check_metrics)
    return trained


def test_check_code_links_this_code_only_where_it_reproduces_the_records(fake_check, capsys):
    import json
    fake_check["here"] = {v: {"m": 1.0} for v in claims.CHECK}
    assert claims.check_code(0)
    (link,) = json.loads(claims.EQUIVALENCE.read_text())
    assert link["code"] == "now" and link["same_as"] == "old" and "against" not in link and link["machine"]
    claims.EQUIVALENCE.unlink()
    fake_check["here"] = {v: {"m": 1.0 + (v == claims.CHECK[-1]) * 1e-9} for v in claims.CHECK}
    assert not claims.check_code(0)
    assert not claims.EQUIVALENCE.exists()
    assert "does not reproduce the records of code old" in capsys.readouterr().out


def test_check_code_tells_a_machine_that_rounds_differently_from_changed_code(fake_check, capsys, monkeypatch):
    """The records' own code reproducing them except in the last bits: the machine, not the code, and no link."""
    import runs
    monkeypatch.setattr(runs, "code_version", lambda files=None: "old")
    fake_check["here"] = {v: {"m": 1.0 + 1e-9} for v in claims.CHECK}
    assert not claims.check_code(0)
    out = capsys.readouterr().out
    assert "rounds differently" in out and "--against COMMIT" in out and not claims.EQUIVALENCE.exists()


def test_check_code_against_a_commit_compares_the_two_codes_on_this_machine(fake_check):
    """--against: neither code reproduces the records here, but this code reproduces the commit's code to the last
    bit (NaN included): linked to the commit's version, the worktree gone again; one bit apart: no link."""
    import json
    import subprocess
    fake_check["commit"] = {v: {"m": 1.5, "nan": math.nan} for v in claims.CHECK}
    fake_check["here"] = {v: {"m": 1.5, "nan": math.nan} for v in claims.CHECK}
    assert claims.check_code(0, "HEAD")
    (link,) = json.loads(claims.EQUIVALENCE.read_text())
    head = subprocess.run(["git", "-C", str(claims.ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert link["code"] == "now" and link["same_as"] == "old" and link["against"] == head[:12]
    commit_tree, here = fake_check["trees"]
    assert here == claims.ROOT and commit_tree != claims.ROOT and not commit_tree.exists()
    claims.EQUIVALENCE.unlink()
    fake_check["here"] = {v: {"m": 1.5 + 1e-9, "nan": math.nan} for v in claims.CHECK}
    assert not claims.check_code(0, "HEAD")
    assert not claims.EQUIVALENCE.exists()


def test_a_record_names_the_machine_that_trained_its_run(monkeypatch, tmp_path):
    """make_record stamps machine(): the CPU, the kernel level torch runs at and torch's version."""
    import torch
    m = claims.machine()
    assert torch.__version__ in m and torch.backends.cpu.get_cpu_capability() in m
    monkeypatch.setattr(claims, "load_base", lambda base: {})
    monkeypatch.setattr(claims, "BASE_METRICS", {"x": lambda got: 1.0})
    rec = claims.make_record(claims.BASE, 0, None, tmp_path / "seed0-base")
    assert rec["machine"] == m and rec["metrics"] == {"x": 1.0}


def test_code_version_of_a_commit_is_that_of_its_checkout(tmp_path, monkeypatch):
    """code_version_at reads a commit's top-level .py files from git; it equals code_version of a tree holding
    them, keeps through a docstring edit, and tells a code change."""
    import subprocess
    import runs
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "a.py").write_text('def f():\n    """doc"""\n    return 1\n')
    (tmp_path / "b.py").write_text("x = 2\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    monkeypatch.setattr(claims, "ROOT", tmp_path)
    monkeypatch.setattr(runs, "ROOT", tmp_path)
    at_head = claims.code_version_at("HEAD")
    assert at_head == runs.code_version()
    (tmp_path / "a.py").write_text('def f():\n    """another doc"""\n    return 1\n')
    assert runs.code_version() == at_head
    (tmp_path / "a.py").write_text('def f():\n    return 2\n')
    assert runs.code_version() != at_head


def test_run_registry_sends_every_seed_to_the_pool_and_writes_each_record_when_its_run_is_done(tmp_path, monkeypatch):
    """--run hands all seeds' runs to the pool at once, long runs first, then each seed's first run before any seed's
    second; each record is written as soon as its run is done (runs finish out of order), a seed's base record with
    its first run (at once where the seed has no run), and a failed run gets no record while the others do."""
    import runs
    todo = [("a", 10), ("b", 10), ("a", 11), ("b", 11), ("long", 12), ("a", 12), ("base", 10), ("base", 13)]
    monkeypatch.setattr(runs, "configure", lambda full: None)
    monkeypatch.setattr(runs, "report", lambda: "")
    monkeypatch.setattr(runs, "base_dir", lambda s: Path(f"runs/_base/seed{s}"))
    monkeypatch.setattr(claims, "RESULTS", tmp_path)
    monkeypatch.setattr(claims, "planned", lambda cs=None: todo)
    monkeypatch.setattr(claims, "recorded", lambda v, s: False)
    monkeypatch.setattr(claims, "BASE", "base")
    monkeypatch.setattr(claims, "VARIANTS", {"a": ("--a",), "b": ("--b",), "long": ("--long",)})
    monkeypatch.setattr(claims, "LONG", {"long": 400})
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
    import json
    assert json.loads((tmp_path / "a-seed11.json").read_text())["dir"] == "runs/a-seed11"


def test_the_second_stage_is_its_rule_applied_to_the_first_ten_seeds():
    """SECOND_STAGE is what second_stage_rule gives on the committed records of seeds 0-9, and exactly those claims
    are planned on 20 seeds beyond the ones first planned on 20; each reports its first ten seeds' answer."""
    assert claims.second_stage_rule() == claims.SECOND_STAGE
    twenty = {c.id for c in claims.CLAIMS if c.seeds == claims.SEEDS20}
    first_twenty = {i for i, seeds in claims.FIRST_PLAN.items() if seeds == claims.SEEDS20}
    assert twenty - first_twenty == set(claims.SECOND_STAGE)
    for c in claims.CLAIMS:
        first = claims.first_stage(c)
        if c.id in claims.SECOND_STAGE:
            assert first["answer"] == "undecided" and first["claim"].seeds == claims.SEEDS
        else:
            assert first is None


def test_second_stage_rule_takes_undecided_claims_that_twenty_seeds_would_decide(monkeypatch):
    """The rule on canned verdicts: undecided with every undecided part at ≤ 20 seeds → in; a part beyond 20 or never
    decidable, a decided claim, or a claim first planned on 20 seeds → out."""
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


def test_summary_rows_are_means_over_seeds_of_the_records():
    """The README's summary from canned records: each cell is the mean (± sd) over the seeds, computed here by a loop,
    and the win / tie / lose row prints the three mean shares."""
    rng = np.random.default_rng(0)
    recs, seeds = {}, (3, 4, 5)
    for v in claims.SUMMARY:
        for s in seeds:
            w, t = rng.uniform(0, 0.5, 2)
            recs[(v, s)] = {"metrics": {"final_gold": rng.normal(2), "final_gold_vs_sft": rng.normal(),
                                        "win": w, "tie": t, "lose": 1 - w - t, "win_lose": w - (1 - w - t),
                                        "final_kl_seq": rng.uniform(), "final_kl": rng.uniform(),
                                        "final_length": rng.uniform(5, 15)}}
    rows = {}   # row label -> its cells: SFT, then claims.SUMMARY's columns
    for r in claims.summary(recs, seeds).splitlines():
        if r.startswith("| "):
            cells = [c.strip() for c in r.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    for i, v in enumerate(claims.SUMMARY):
        shares = [sum(recs[(v, s)]["metrics"][k] for s in seeds) / len(seeds) for k in ("win", "tie", "lose")]
        assert rows["win / tie / lose vs SFT (mean shares)"][1 + i] == " / ".join(f"{x:.2f}" for x in shares)
        gold = [recs[(v, s)]["metrics"]["final_gold"] for s in seeds]
        mean = sum(gold) / len(gold)
        sd = (sum((g - mean) ** 2 for g in gold) / (len(gold) - 1)) ** 0.5
        assert rows["gold reward"][1 + i] == f"{mean:.2f} ± {sd:.2f}"
