"""The figure notebooks' verdict rule (notebooks/runs.py): the t quantiles, the interval, and the answers it gives."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import runs  # noqa: E402


def t_cdf_central(t: float, df: int, steps: int = 200_000) -> float:
    """P(|T| ≤ t) for Student's t with df degrees of freedom, by the midpoint rule on its density."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    x = (np.arange(steps) + 0.5) * (t / steps)
    return float(2 * np.sum(c * (1 + x * x / df) ** (-(df + 1) / 2)) * (t / steps))


@pytest.mark.parametrize("df", sorted(runs.T975))
def test_t975_table_is_the_two_sided_95_percent_quantile(df):
    assert t_cdf_central(runs.T975[df], df) == pytest.approx(0.95, abs=2e-4)


def test_verdict_interval_by_hand():
    v = runs.verdict([3.0, 4.0, 5.0], [1.0, 2.0, 3.0])          # d = 2, 2, 2: sd 0, interval [2, 2]
    assert (v["effect"], v["lo"], v["hi"], v["verdict"], v["above"]) == (2.0, 2.0, 2.0, "higher", 3)
    v = runs.verdict([1.0, 2.0, 3.0])                            # mean 2, sd 1, half-width 4.303 / √3
    assert v["lo"] == pytest.approx(2 - 4.303 / math.sqrt(3)) and v["hi"] == pytest.approx(2 + 4.303 / math.sqrt(3))
    assert v["verdict"] == "inconclusive"
    assert runs.verdict([-1.0, -1.2, -0.8, -1.1, -0.9])["verdict"] == "lower"
    assert runs.verdict([0.01, -0.02, 0.0, 0.02], margin=0.1)["verdict"] == "alike"
    assert runs.verdict([0.01, -0.02, 0.0, 0.02])["verdict"] == "inconclusive"   # no margin: never "alike"
    assert runs.verdict([5.0])["verdict"] == "inconclusive"                      # one seed tells nothing


def test_interval_and_verdict_words_follow_the_one_rule():
    """The methods notebooks' interval and worded verdict are RULE's: t(0.975, n − 1), not another table's."""
    m, lo, hi = runs.interval([1.0, 2.0, 3.0, 4.0, 5.0])         # mean 3, sd √2.5, t(0.975, 4) = 2.776
    assert m == 3.0 and abs((hi - lo) / 2 - 2.776 * 2.5 ** 0.5 / 5 ** 0.5) < 1e-9
    assert runs.verdict_words([-1.0, -1.2, -0.8, -1.1, -0.9], "better", "worse") == "worse"
    assert runs.verdict_words([1.0, 1.1, 0.9], "better", "worse") == "better"
    assert runs.verdict_words([0.5, -0.5, 0.1], "better", "worse") == "inconclusive"
    assert runs.verdict_words([5.0], "better", "worse") == "inconclusive"
    assert runs.interval([2.0])[0] == 2.0


@pytest.mark.parametrize("form", ["bon", "rl"])
def test_fit_gao_recovers_known_alpha_beta_and_solves_the_normal_equations(form):
    """Gao et al.'s forms, fitted through the origin: exact on noise-free curves, and on noisy ones the solution of
    the 2 × 2 normal equations written out by hand (Cramer's rule); d = 0 points are left out (log 0)."""
    d = np.array([0.0, 0.3, 0.6, 1.0, 1.4, 2.0, 2.7])
    shape = (lambda x: x * x) if form == "bon" else (lambda x: x * np.log(x))
    with np.errstate(divide="ignore", invalid="ignore"):
        clean = np.where(d > 0, d * 1.7 - 0.45 * shape(d), 0.0)     # d(α − βd) or d(α − β log d), α 1.7, β 0.45
    assert runs.fit_gao(d, clean, form) == pytest.approx((1.7, 0.45), abs=1e-9)
    noisy = clean + np.random.default_rng(0).normal(0, 0.2, len(d))
    x1, x2, y = d[1:], -shape(d[1:]), noisy[1:]
    s11, s12, s22, s1y, s2y = x1 @ x1, x1 @ x2, x2 @ x2, x1 @ y, x2 @ y
    det = s11 * s22 - s12 * s12
    assert runs.fit_gao(d, noisy, form) == pytest.approx(((s1y * s22 - s12 * s2y) / det,
                                                          (s11 * s2y - s12 * s1y) / det), rel=1e-9)


@pytest.mark.slow
def test_the_worker_pool_trains_what_train_py_alone_trains(tmp_path, monkeypatch):
    """Two runs trained one after the other by one kept-alive worker (the notebooks' runner) give the second one's
    metrics.jsonl and samples.jsonl exactly as `python train.py` with the same flags in a fresh process."""
    import json
    import shutil
    import subprocess
    monkeypatch.setattr(runs, "JOBS", 1)
    monkeypatch.setattr(runs, "_POOL", None)
    runs.configure(full=False)
    specs = [("test-pool-a", ("--preset", "vanilla"), 0, None), ("test-pool-b", (), 0, None)]
    for name, *_ in specs:
        shutil.rmtree(runs.out_dir(name, 0), ignore_errors=True)
    try:
        _, second = runs.run_many(specs)
        argv = runs.argv_for("test-pool-b", (), 0, None)
        argv[argv.index("--out") + 1] = str(tmp_path / "alone")
        subprocess.run([sys.executable, str(runs.ROOT / "train.py"), *argv], check=True, capture_output=True,
                       cwd=runs.ROOT)
        untimed = lambda path: [{k: v for k, v in json.loads(line).items() if k != "time/step"}
                                for line in path.read_text().splitlines()]
        assert untimed(second["dir"] / "metrics.jsonl") == untimed(tmp_path / "alone" / "metrics.jsonl")
        assert (second["dir"] / "samples.jsonl").read_text() == (tmp_path / "alone" / "samples.jsonl").read_text()
    finally:
        if runs._POOL is not None:
            runs._POOL.shutdown()
        for name, *_ in specs:
            shutil.rmtree(runs.out_dir(name, 0), ignore_errors=True)


def never_ends(full, name, flags, seed, steps, world="a"):
    """A worker's run that only a signal ends."""
    import time
    time.sleep(120)


def test_a_worker_interrupted_mid_run_leaves_a_fresh_pool_for_the_next_call(monkeypatch):
    """SIGINT to a worker (Ctrl-C in a terminal, a notebook's interrupt: both reach the whole process group) ends it
    without a traceback; run_many raises, and the next call gets new workers instead of a broken pool."""
    import os
    import signal
    import threading
    from concurrent.futures.process import BrokenProcessPool
    monkeypatch.setattr(runs, "JOBS", 1)
    monkeypatch.setattr(runs, "_POOL", None)
    monkeypatch.setattr(runs, "_build", never_ends)
    monkeypatch.setattr(runs, "cached", lambda name, flags, seed, steps: None)
    pid = runs._pool().submit(os.getpid).result()
    threading.Timer(1.0, os.kill, (pid, signal.SIGINT)).start()
    with pytest.raises((BrokenProcessPool, KeyboardInterrupt)):
        runs.run_many([("x", (), 0, None)])
    assert runs._POOL is None
    try:
        assert runs._pool().submit(os.getpid).result() != pid
    finally:
        runs._drop_pool()


def test_run_each_yields_cached_runs_first_then_each_run_as_its_worker_finishes(monkeypatch):
    """run_each streams: the cached run at once, then the trained ones in the order they finish (not the specs'
    order); keep_going hands a failed run back as its exception while the others still arrive, and run_many,
    which does not keep going, raises it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    gates = {name: threading.Event() for name in ("slow", "fast", "bad")}
    built: set[str] = set()

    def build(full, name, flags, seed, steps, world="a"):
        gates[name].wait(timeout=10)
        if name == "bad":
            raise ValueError("bad run")
        built.add(name)
        return str(runs.ROOT / "runs" / name), 0.0

    pool = ThreadPoolExecutor(max_workers=3)
    monkeypatch.setattr(runs, "_pool", lambda: pool)
    monkeypatch.setattr(runs, "_build", build)
    monkeypatch.setattr(runs, "cached", lambda name, flags, seed, steps:
                        {"name": name} if name == "old" or name in built else None)
    monkeypatch.setattr(runs, "saved", lambda out: {"name": Path(out).name})  # what a worker trained, read back
    specs = [("slow", (), 0, None), ("old", (), 0, None), ("bad", (), 0, None), ("fast", (), 0, None)]
    stream = runs.run_each(specs, keep_going=True)
    assert next(stream) == (1, {"name": "old"})
    gates["fast"].set()
    assert next(stream) == (3, {"name": "fast"})
    gates["bad"].set()
    i, error = next(stream)
    assert i == 2 and isinstance(error, ValueError)
    gates["slow"].set()
    assert next(stream) == (0, {"name": "slow"})
    assert next(stream, None) is None
    built.clear()
    with pytest.raises(ValueError, match="bad run"):
        runs.run_many(specs)
    pool.shutdown()
