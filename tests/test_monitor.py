"""The collapse alarm (section 5.2, Fig. 4, Fig. 13): quiet on stable streams, fires on drift with its numbers."""
import json

import numpy as np
import pytest

from plumbing import monitor
from plumbing.monitor import Alarm, CollapseMonitor, gold_halfway


def stable_stream(n: int, seed: int = 0, batch: int = 64):
    """PPO-max-like (Fig. 9): KL small, length and perplexity flat, scores from one fixed distribution."""
    rng = np.random.default_rng(seed)
    for step in range(n):
        metrics = {"kl/ref": float(abs(rng.normal(0.03, 0.01))), "response/length": float(rng.normal(10.0, 0.8)),
                   "policy/perplexity": float(rng.normal(2.0, 0.1))}
        yield step, metrics, rng.normal(0.0, 1.0, batch).tolist()


def drifting_stream(n: int = 15):
    """The worked example of monitor.py: 5 calm steps, then KL +0.1/step, length +2/step (Fig. 4)."""
    for step in range(n):
        drift = max(step - 4, 0)
        metrics = {"kl/ref": 0.02 + 0.1 * drift, "response/length": 10.0 + 2.0 * drift,
                   "policy/perplexity": 2.0 - 0.05 * drift}
        yield step, metrics, ([-1.0, 0.0, 1.0, 2.0] if drift == 0 else [1.0 + 0.5 * drift] * 4)


def run(monitor, stream):
    return [a for step, m, s in stream if (a := monitor.update(step, m, s)) is not None]


def test_monitor_stable_stream_never_fires():
    monitor = CollapseMonitor()
    assert run(monitor, stable_stream(300)) == []
    assert monitor.first_alarm is None and monitor.ready


def test_monitor_drift_fires_after_patience_with_reasons():
    # the former defaults (KL 0.3, patience 3): a quiet alarm that confirms a collapse
    alarms = run(CollapseMonitor(kl_max=0.3, patience=3), drifting_stream())
    assert len(alarms) == 1, "one run of bad steps fires once"
    assert alarms[0].step == 9
    assert alarms[0].reasons == ["kl/ref 0.520 > 0.300", "response/length 20.0 > 1.5 × baseline 10.0 = 15.0"]
    assert str(alarms[0]).startswith("collapse alarm at step 9: kl/ref 0.520 > 0.300")
    # by hand: KL first exceeds 0.3 at step 7 (0.02 + 0.3 = 0.32), length first exceeds 15 at step 7 (16);
    # patience 3 → steps 7, 8, 9 → fires at 9. With patience 1 it fires at 7.
    assert run(CollapseMonitor(kl_max=0.3, patience=1), drifting_stream())[0].step == 7


def test_monitor_defaults_fire_on_the_first_bad_step():
    # numbers printed by `python -m plumbing.monitor`: drift starts at step 5 (KL 0.02 + 0.1 = 0.12 > 0.08), patience 1
    alarms = run(CollapseMonitor(), drifting_stream())
    assert [(a.step, a.reasons) for a in alarms] == [(5, ["kl/ref 0.120 > 0.080"])]


def test_monitor_patience_resets_on_a_good_step():
    monitor = CollapseMonitor(warmup=1, patience=3)
    good, bad = {"kl/ref": 0.01}, {"kl/ref": 0.9}
    pattern = [good, bad, bad, good, bad, bad, good, bad, bad, bad, bad, good, bad, bad, bad]
    fired = [step for step, m in enumerate(pattern) if monitor.update(step, m)]
    assert fired == [9, 14]  # the 3rd bad step of each run of ≥ 3; runs of 2 never fire


def test_monitor_perplexity_drop_fires():
    monitor = CollapseMonitor(patience=2, ppl_drop=0.3)
    stream = [{"kl/ref": 0.01, "response/length": 10.0, "policy/perplexity": p}
              for p in [2.0, 2.2, 1.8, 2.0, 2.0, 1.5, 1.41, 1.39, 1.2]]
    fired = [(s, a) for s, m in enumerate(stream) if (a := monitor.update(s, m))]
    # baseline perplexity = mean(2.0, 2.2, 1.8, 2.0, 2.0) = 2.0 → limit 0.7 × 2.0 = 1.4; 1.39 and 1.2 are below
    assert [s for s, _ in fired] == [8]
    assert fired[0][1].reasons == ["policy/perplexity 1.200 < 0.7 × baseline 2.000 = 1.400"]


def test_monitor_reward_tail_fires():
    rng = np.random.default_rng(1)
    base_scores = [rng.normal(0.0, 1.0, 64).tolist() for _ in range(5)]
    flat = {"kl/ref": 0.01, "response/length": 10.0, "policy/perplexity": 2.0}
    pooled = np.concatenate(base_scores)
    cut = pooled.mean() + 3 * pooled.std()  # population std (ddof 0), independently of the monitor

    def tail_batch(frac):
        k = int(round(frac * 64))
        return [float(cut + 2.0)] * k + rng.normal(0.0, 1.0, 64 - k).tolist()

    monitor = CollapseMonitor(patience=3)
    for step, s in enumerate(base_scores):
        assert monitor.update(step, flat, s) is None
    base = monitor.baseline()
    np.testing.assert_allclose([base["score_mean"], base["score_std"]], [pooled.mean(), pooled.std()], rtol=1e-12)
    # a 10 % tail is within what Cantelli allows for a stable distribution: no alarm
    assert [monitor.update(5 + i, flat, tail_batch(0.10)) for i in range(5)] == [None] * 5
    # a 30 % tail (Fig. 13's long tail after collapse): fires after patience, with the tail as the only reason
    batches = [tail_batch(0.30) for _ in range(3)]
    alarms = [monitor.update(10 + i, flat, b) for i, b in enumerate(batches)]
    assert alarms[:2] == [None, None] and isinstance(alarms[2], Alarm) and alarms[2].step == 12
    frac = sum(x > cut for x in batches[2]) / 64  # the 19 planted values, plus any natural ones beyond 3σ
    assert alarms[2].reasons == [f"reward tail {frac:.0%} of scores > baseline mean {pooled.mean():.2f} + 3σ "
                                 f"({pooled.std():.2f}) = {cut:.2f}, limit 20%"]


def test_monitor_relative_checks_wait_for_warmup_and_skip_missing_metrics():
    monitor = CollapseMonitor(kl_max=0.3, patience=1)
    # during warmup only the absolute KL check runs, so a long response there is not a reason
    assert monitor.check({"response/length": 1000.0}) == []
    assert monitor.check({"kl/ref": 0.5}) == ["kl/ref 0.500 > 0.300"]
    for step in range(5):
        assert monitor.update(step, {"response/length": 10.0}) is None  # no perplexity, no scores: not checked
    assert monitor.check({"policy/perplexity": 0.1, "response/length": 14.9}) == []
    assert monitor.check({"response/length": 15.1}) == ["response/length 15.1 > 1.5 × baseline 10.0 = 15.0"]


def test_monitor_state_dict_round_trip_continues_exactly():
    stream = list(stable_stream(6, seed=3)) + list(drifting_stream(20))[6:]
    whole = CollapseMonitor()
    expected = [whole.update(s, m, x) for s, m, x in stream]

    first = CollapseMonitor()
    got = [first.update(s, m, x) for s, m, x in stream[:7]]
    saved = json.loads(json.dumps(first.state_dict()))  # through JSON, as the checkpoint stores it
    resumed = CollapseMonitor()
    resumed.load_state_dict(saved)
    got += [resumed.update(s, m, x) for s, m, x in stream[7:]]
    assert got == expected and any(a is not None for a in expected)
    assert resumed.state_dict() == whole.state_dict()


def test_monitor_ignores_non_finite_values():
    monitor = CollapseMonitor(warmup=2)
    nan = float("nan")
    monitor.update(0, {"kl/ref": nan, "response/length": nan, "policy/perplexity": 2.0}, [nan, 1.0, float("inf")])
    monitor.update(1, {"kl/ref": 0.0, "response/length": 10.0, "policy/perplexity": 2.0}, [3.0])
    assert monitor.baseline() == {"response/length": 10.0, "policy/perplexity": 2.0, "score_mean": 2.0,
                                  "score_std": 1.0}
    json.dumps(monitor.state_dict(), allow_nan=False)  # still valid JSON for the checkpoint


def test_monitor_rejects_bad_thresholds():
    with pytest.raises(ValueError):
        CollapseMonitor(patience=0)
    with pytest.raises(ValueError):
        CollapseMonitor(ppl_drop=1.0)


def test_monitor_accepts_tensor_scores():
    torch = pytest.importorskip("torch")
    a, b = CollapseMonitor(), CollapseMonitor()
    for step, m, s in stable_stream(7, seed=5, batch=8):
        a.update(step, m, torch.tensor(s, dtype=torch.float64))
        b.update(step, m, s)
    assert a.state_dict() == b.state_dict()


# ---- the yardstick and the replay of finished runs ----------------------------------------------------------

def halfway_by_brute_force(gold, hold=10):
    """Independent of gold_halfway's walk back: try every step t after the peak, in order, and test the whole tail."""
    g = np.array([np.mean(gold[max(0, i - 1):i + 2]) for i in range(len(gold))])  # centred 3-step mean
    p = int(np.argmax(g))
    half = (g[p] + gold[0]) / 2
    if g[p] <= gold[0]:
        return None
    for t in range(p + 1, len(g)):
        if np.all(g[t:] <= half):
            return t if len(g) - t >= hold else None
    return None


def test_gold_halfway_by_hand():
    # SFT level 1, a peak of 3, then down to -1: half = (3 + 1) / 2 = 2.
    gold = [1.0, 2.0, 3.0, 3.0, 3.0, 2.0, 1.0, 0.0] + [-1.0] * 12
    # centred means: step 4 = (3+3+2)/3 = 2.67, step 5 = (3+2+1)/3 = 2.0 ≤ 2 and everything after is lower
    assert gold_halfway(gold) == 5 == halfway_by_brute_force(gold)
    assert gold_halfway([1.0] * 20) is None                       # never rose
    assert gold_halfway([1.0, 3.0, 3.0] + [2.5] * 20) is None      # kept most of its gain
    dip = [1.0, 3.0, 3.0, 3.0, 0.0, 0.0, 3.0, 3.0, 3.0] + [3.0] * 15
    assert gold_halfway(dip) is None                               # a dip that recovers is not a collapse
    late = [1.0] + [3.0] * 20 + [-1.0] * 5
    # step 20's centred mean (3 + 3 − 1) / 3 = 1.67 is the first ≤ 2: 6 steps before the end, < hold = 10
    assert gold_halfway(late) is None and gold_halfway(late, hold=6) == 20 and gold_halfway(late, hold=7) is None


def test_gold_halfway_matches_brute_force_on_random_curves():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(5, 60))
        peak_at = int(rng.integers(1, n))
        curve = np.concatenate([np.linspace(1, 2, peak_at), np.linspace(2, rng.uniform(-1, 2.5), n - peak_at)])
        gold = (curve + rng.normal(0, 0.2, n)).tolist()
        hold = int(rng.integers(1, 12))
        assert gold_halfway(gold, hold=hold) == halfway_by_brute_force(gold, hold=hold)


def write_run(path, stream, gold):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as fm, open(path / "samples.jsonl", "w") as fs:
        for (step, m, s), g in zip(stream, gold):
            fm.write(json.dumps({"step": step, **m}) + "\n")
            fs.write(json.dumps({"step": step, "scores": s, "gold": [g, g]}) + "\n")


def test_replay_and_sweep_of_saved_runs(tmp_path):
    import subprocess, sys
    from pathlib import Path
    from plumbing.monitor import replay, sweep, load_run
    drift = list(drifting_stream(30))
    gold = [1.0] * 5 + [3.0] * 4 + [-1.0] * 21  # halfway (2) at step 8: centred mean (3 + 3 − 1) / 3 = 1.67
    write_run(tmp_path / "drift", drift, gold)
    write_run(tmp_path / "calm", list(stable_stream(30)), [1.0, 2.0] + [2.0] * 28)
    live = run(CollapseMonitor(kl_max=0.3, patience=3), drifting_stream(30))
    r = replay(tmp_path / "drift", kl_max=0.3, patience=3)
    assert r["alarm"] == live[0].step == 9 and r["reasons"] == live[0].reasons
    assert r["gold_halfway"] == halfway_by_brute_force(gold) == 8
    assert replay(tmp_path / "drift", kl_max=0.3, patience=1)["alarm"] == 7
    assert replay(tmp_path / "drift")["alarm"] == 5  # the defaults: 3 steps before the halfway step
    assert replay(tmp_path / "calm")["alarm"] is None and replay(tmp_path / "calm")["gold_halfway"] is None
    rows = sweep([load_run(tmp_path / "drift"), load_run(tmp_path / "calm")], {"patience": [1, 3]}, kl_max=0.3)
    # patience 1 fires at 7 (< 8: in time, lead 1), patience 3 at 9 (late, lead −1); the calm run stays quiet
    assert [(x["patience"], x["in_time"], x["late"], x["false"], x["quiet"], x["median_lead"]) for x in rows] == \
        [(1, 1, 0, 0, 1, 1), (3, 0, 1, 0, 1, -1)]
    out = subprocess.run([sys.executable, "-m", "plumbing.monitor", "replay",
                          str(tmp_path / "drift"), str(tmp_path / "calm"), "--kl-max", "0.3", "--patience", "3"],
                         capture_output=True, text=True, check=True)
    assert "late, 1 step(s) after" in out.stdout and "quiet: the run kept its gold" in out.stdout


def test_replay_names_a_wrong_directory_or_a_damaged_line(tmp_path):
    import subprocess, sys
    from pathlib import Path
    script = ["-m", "plumbing.monitor"]
    out = subprocess.run([sys.executable, *script, "replay", str(tmp_path / "nope")], capture_output=True, text=True)
    assert out.returncode == 2 and "nope: no metrics.jsonl" in out.stderr and "Traceback" not in out.stderr
    write_run(tmp_path / "bad", list(drifting_stream(3)), [1.0, 1.0, 1.0])
    with open(tmp_path / "bad" / "samples.jsonl", "a") as f:
        f.write("{not json\n")
    out = subprocess.run([sys.executable, *script, "replay", str(tmp_path / "bad")], capture_output=True, text=True)
    assert out.returncode == 2 and "samples.jsonl:4: not a JSON object" in out.stderr


def test_progress_into_a_file_writes_each_state_once(capsys):
    """No TTY: whole lines, and no line that repeats the one before but for its clock (the bar's close redraws its
    last state; so does tqdm.write)."""
    import re
    import time
    from tqdm import tqdm
    bar = monitor.progress(range(3), "x", total=3, every=0.2)
    for i in bar:
        time.sleep(0.3)  # slower than `every`: every update draws, the last one included
        bar.set_postfix(kl=f"{i:.3f}", refresh=False)
        tqdm.write(f"step {i}")
    bar.close()
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("x:")]
    states = [re.sub(r"\[[^\]]*?(?:\?it/s|s/it|it/s)", "[", l) for l in lines]
    assert lines and "3/3" in lines[-1], lines
    assert all(a != b for a, b in zip(states, states[1:])), lines


def one_line_error(argv: list[str], capsys, *needles: str) -> str:
    """monitor.main(argv) exits 2 with one line `error: …` on stderr that names every needle; returns that line."""
    with pytest.raises(SystemExit) as e:
        monitor.main(argv)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (e.value.code, err)
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


@pytest.mark.parametrize("argv,needle", [
    (["replay", "--patience", "0"], "--patience 0"), (["replay", "--patience", "-2"], "--patience -2"),
    (["replay", "--warmup", "-1"], "--warmup -1"), (["replay", "--kl-max", "nan"], "--kl-max nan"),
    (["replay", "--kl-max", "inf"], "--kl-max inf"), (["replay", "--kl-max", "-0.1"], "--kl-max -0.1"),
    (["replay", "--ppl-drop", "1"], "--ppl-drop 1.0"), (["replay", "--tail-frac", "nan"], "--tail-frac nan"),
    (["sweep", "--grid-kl", "abc"], "--grid-kl 'abc'"), (["sweep", "--grid-kl", ""], "--grid-kl ''"),
    (["sweep", "--grid-kl", "0.1,nan"], "--grid-kl '0.1,nan'"), (["sweep", "--grid-patience", "1,0"], "value 0"),
    (["sweep", "--grid-patience", "1.5"], "--grid-patience '1.5'"), (["foo"], "'foo'")])
def test_cli_bad_flag_is_one_line_naming_it(argv, needle, tmp_path, capsys):
    """A threshold out of range or not finite, a grid that is not numbers, an unknown command: one line naming it,
    before any run is read (this one does not exist, and is never looked for)."""
    one_line_error([argv[0], str(tmp_path / "nowhere"), *argv[1:]], capsys, needle)


@pytest.mark.parametrize("log", ["metrics.jsonl", "samples.jsonl"])
def test_cli_names_a_log_that_is_not_utf8(log, tmp_path, capsys):
    """A log with bytes that are not UTF-8 (a disk error, a binary file in its place): one line naming file and line."""
    write_run(tmp_path / "run", list(drifting_stream(3)), [1.0, 1.0, 1.0])
    raw = bytearray((tmp_path / "run" / log).read_bytes())
    raw[100:102] = b"\xff\xff"
    (tmp_path / "run" / log).write_bytes(bytes(raw))
    one_line_error(["replay", str(tmp_path / "run")], capsys, f"{tmp_path / 'run' / log}:", "not UTF-8")
