"""The figure notebooks' runner: train (or reuse) one run per (name, flags, seed) with `train.main`, read it back, and
judge it by one stated rule.

Implements: no equation; the cache, the two budgets and the verdict rule behind every figure notebook.
  run(name, *flags, seed)        train.main([*flags, --seed s, --out runs/<name>-seed<s>, --threads 1]) unless
                                 that directory already holds a summary.json whose saved config matches the flags,
                                 trained by the same code (code_version; then the notebook only re-plots); returns
                                 the run's summary.json (+ "dir")
  run_seeds(name, *flags, n=)    run() for every seed of the budget (n seeds in FULL, default 3; 1 in the small one)
  series(runs_, key)             one metrics.jsonl key of several runs as an array (S, steps)
  samples(run_)                  samples.jsonl of a run: per step the RM scores, gold rewards and 4 examples
  base_dir(seed)                 the default SFT + reward-model directory of a seed (rm_log.json, ... for Fig. 2-3)
  current_alarm(dir)             the collapse alarm under monitor.py's current thresholds (replayed, not retrained)
  run_many(specs)                every run of [(name, flags, seed, steps)] that is not cached yet, trained side by
                                 side in a pool of PPO_MAX_JOBS worker processes (default: one per core), each on
                                 one thread and kept alive from one run to the next (imports and warm-up paid once)
  run_each(specs)                the same as a stream: (i, run) as each run is ready (claims.py writes a seed's
                                 records as soon as its last run is done, while the pool goes on with the others)
  report()                       the runs this process trained, their wall time and runs per hour
  slot()                         file locks (runs/.slot-<i>.lock): at most PPO_MAX_JOBS trainings and evaluations
                                 of all processes at once, each on one core; a run directory and a new base are
                                 built by one process only (runs/.locks/)
  verdict(a, b, margin)          the interval rule of methods.ipynb and overoptimization.ipynb (RULE): the per-seed
                                 difference a − b, its mean with a 95 % t-interval, and "higher" / "lower" / "alike" /
                                 "inconclusive"; the figure claims are judged by notebooks/claims.py's rule instead
  configure(), MODE, FULL        the mode (records / small / full, PPO_MAX_MODE) and the budget of what is trained
  figures_dir(here), savefig(fig, path)   where a notebook's PNGs go; a PNG without machine- or day-dependent metadata
  retrained_note(), note(fig, text)       "retrained on <machine>", and that text under a figure's panels
  dynamics_figure(variants)      the panels shared by Fig. 6-8 and 14-19 (reward, gold, KL, perplexity, length), each
                                 variant's mean over seeds with its spread, each seed faint (mean_band)
  table(variants)                the last-10-step means of those metrics and the held-out win − lose, per variant
  interval(values), verdict_words(…)  the 95 % t-interval over seeds; the rule in own words: above / below 0 / inconclusive
  frontier(run_), budget(run_)   a run's gold-vs-√KL point at temperature 1, and the samples / pairs it consumed
  frontier_checkpoints(run_)     every checkpoint as a point of the over-optimisation curve (Gao et al. 2022)
  bon_curve(run_, ns)            best-of-n from the run's SFT model under its reward model, for every n, from one pool
  fit_gao(d, gain, form)         α, β of d(α − βd) (best-of-n) or d(α − β log d) (RL)
Modes (env PPO_MAX_MODE; one switch for every figure notebook, printed by its first cell):
  records (the default)          every panel of per-step or final metrics of a registry's runs is drawn from the
                                 committed records (notebooks/results/<registry>/, claims.runs_for) of every seed
                                 the notebook's claims judge: nothing is trained for them, and the PNGs are the same,
                                 byte for byte, on any machine. What a record cannot give (samples, a model: a score
                                 histogram, sample texts, best-of-n, the notebooks' own comparisons) is retrained at
                                 train.py's budget (cached under runs/) and its panel says "retrained on <machine>"
                                 (claims.retrained). The committed outputs and notebooks/figures/ come from this mode.
                                 PPO_MAX_RETRAIN=small retrains those panels in the tiny world instead (the tests).
  full (PPO_MAX_FULL=1 too)      every panel retrained: train.py's default budget (80 PPO steps unless a notebook asks
                                 for more), the registry's plot seeds (claims.R.plot_seeds), seeds 0 … n−1 for the
                                 notebooks' own comparisons, under runs/<name>-seed<s>/; figures under runs/figures/.
  small                          a tiny world (SMALL_FLAGS, as tests/test_pipeline.py), SMALL_STEPS PPO steps, seed
                                 0, under runs/small/<name>-seed0/ (its SFT + RM under runs/_base/ with their own
                                 hash), so that `pytest -m notebook` runs every notebook in minutes. Its numbers mean
                                 nothing; it checks that the notebooks run. Figures under runs/small/figures/.
  FULL                           the budget of whatever is trained: True in full and records (unless
                                 PPO_MAX_RETRAIN=small), False in small.
Run: in a notebook, `import runs; MODE = runs.configure(); s = runs.run("vanilla", "--preset", "vanilla")`;
     `runs.run_seeds(...)` trains its seeds side by side. Several single-thread processes, one per core, train
     more runs per hour than one process with several threads (the tiny models gain nothing from a second thread);
     two notebooks side by side share the PPO_MAX_JOBS slots (set it to the number of cores in both).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("records", "small", "full")


def mode_from(env=os.environ) -> str:
    """PPO_MAX_MODE (records, small or full); unset: full when PPO_MAX_FULL=1, else records (a reader's default)."""
    mode = env.get("PPO_MAX_MODE") or ("full" if env.get("PPO_MAX_FULL", "0") == "1" else "records")
    if mode not in MODES:
        print(f"error: PPO_MAX_MODE={mode!r}: choose one of {', '.join(MODES)}", file=sys.stderr)
        raise SystemExit(2)
    return mode


def full_from(mode: str, env=os.environ) -> bool:
    """The training budget of a mode: train.py's (full; records, for the panels a record cannot draw, unless
    PPO_MAX_RETRAIN=small) or the tiny world's (small)."""
    return mode == "full" or (mode == "records" and env.get("PPO_MAX_RETRAIN", "full") != "small")


MODE = mode_from()
FULL = full_from(MODE)
FULL_SEEDS = (0, 1, 2)
SMALL_SEEDS = (0,)
# trainings / evaluations at once over all processes (the slots), and the worker processes of this one's pool
JOBS = max(1, int(os.environ.get("PPO_MAX_JOBS", str(os.cpu_count() or 1))))
# The small budget: a tiny world (as tests/test_pipeline.py), few PPO steps, one evaluation sample per prompt.
SMALL_FLAGS = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100",
               "--world-n-pretrain", "400", "--sft-epochs", "1", "--rm-epochs", "1", "--rollout-batch", "16",
               "--minibatch", "8", "--critic-pretrain-steps", "4", "--eval-samples", "1"]
SMALL_STEPS = 4


WORLD = "a"  # the synthetic world of every later run (train.py's --world): configure(..., world="b")


def configure(full: bool | None = None, mode: str | None = None, world: str = "a") -> str:
    """Choose the mode (and with it the budget) for every later call; a notebook's first cell calls it with no
    argument (the environment's PPO_MAX_MODE, see Modes). `full` alone, as before: full (True) or small (False).
    world: the synthetic world of every later run (world B's runs: "b", under runs/world-b/). Returns the mode."""
    global FULL, MODE, WORLD
    if world not in ("a", "b"):
        raise ValueError(f"runs.configure: unknown world {world!r}: a or b")
    WORLD = world
    MODE = mode or ({True: "full", False: "small"}[bool(full)] if full is not None else mode_from())
    if MODE not in MODES:
        raise ValueError(f"mode {MODE!r}: choose one of {', '.join(MODES)}")
    FULL = full_from(MODE)
    return MODE


@contextlib.contextmanager
def in_world(world: str):
    """configure()'s world for the duration of a `with` block (a registry whose seeds live in two worlds reads each
    seed's config key in its own), the mode and budget unchanged."""
    global WORLD
    if world not in ("a", "b"):
        raise ValueError(f"runs.in_world: unknown world {world!r}: a or b")
    old, WORLD = WORLD, world
    try:
        yield
    finally:
        WORLD = old


def figures_dir(here: Path) -> Path:
    """Where a notebook writes its PNGs: notebooks/figures/ (the committed ones) in records mode, runs/figures/ in
    full, runs/small/figures/ in small, so that a retrain never replaces a committed figure; PPO_MAX_FIGURES
    overrides it (the tests). Created if missing."""
    where = {"records": Path(here) / "figures", "full": ROOT / "runs" / "figures",
             "small": ROOT / "runs" / "small" / "figures"}
    out = Path(os.environ.get("PPO_MAX_FIGURES") or where[MODE])
    out.mkdir(parents=True, exist_ok=True)
    return out


# PNG metadata: matplotlib writes its version as "Software"; without it the same figure is the same bytes anywhere
# the same matplotlib draws it
PNG_METADATA = {"Software": None}


def savefig(fig, path: Path) -> None:
    """fig as a PNG at `path`: tight, 110 dpi, no metadata that changes from one machine or day to the next."""
    fig.savefig(path, bbox_inches="tight", dpi=110, metadata=PNG_METADATA)


def retrained_note() -> str:
    """What a panel drawn from runs trained here says on itself: "retrained on <machine>", with the budget."""
    import claims
    return (f"retrained on {claims.machine()}" + ("" if FULL else f", small world ({SMALL_STEPS} PPO steps)")
            + ("; not the records the verdicts read" if MODE == "records" else ""))


def note(fig, text: str) -> None:
    """`text` under a figure's panels, small and grey (retrained_note's words on a retrained panel)."""
    fig.text(0.5, 0.0, text, ha="center", va="top", fontsize=8, color="dimgrey")


def mode_line() -> str:
    """What a notebook's first cell prints: the mode, what it draws from and what it trains."""
    if MODE == "records":
        return ("mode: records (PPO_MAX_MODE=records, the default): the registry's runs are drawn from the committed "
                "records, nothing is trained for them; panels a record cannot draw are retrained "
                + ("at train.py's budget" if FULL else f"in the small world ({SMALL_STEPS} PPO steps)")
                + " and say so")
    if MODE == "full":
        return "mode: full (PPO_MAX_MODE=full or PPO_MAX_FULL=1): every run retrained at train.py's budget here"
    return f"mode: small (PPO_MAX_MODE=small): the small world, {SMALL_STEPS} PPO steps, seed 0; numbers mean nothing"


def seeds(n: int | None = None) -> tuple[int, ...]:
    """The budget's seeds: 0 … n−1 in FULL (default FULL_SEEDS), seed 0 alone in the small budget."""
    return (tuple(range(n)) if n else FULL_SEEDS) if FULL else SMALL_SEEDS


def out_dir(name: str, seed: int) -> Path:
    runs = ROOT / "runs" / ("world-b" if WORLD == "b" else "")
    return runs / (f"{name}-seed{seed}" if FULL else f"small/{name}-seed{seed}")


def small_flags(flags: list[str]) -> list[str]:
    """SMALL_FLAGS for a variant: without --critic-pretrain-steps where the variant has no critic (a critic-free
    --advantage, given or by its preset), which train.py refuses as it refuses every critic flag there."""
    from plumbing import flags as train_flags
    if train_flags.parse_configs(list(flags))[3].advantage == "gae":
        return list(SMALL_FLAGS)
    i = SMALL_FLAGS.index("--critic-pretrain-steps")
    return SMALL_FLAGS[:i] + SMALL_FLAGS[i + 2:]


def argv_for(name: str, flags: tuple[str, ...], seed: int, steps: int | None) -> list[str]:
    flags = [str(f) for f in flags]
    if FULL:
        argv = flags + (["--steps", str(steps)] if steps else [])
    else:
        argv = small_flags(flags) + flags + ["--steps", str(SMALL_STEPS)]
    world = ["--world", WORLD] if WORLD != "a" else []
    return argv + world + ["--seed", str(seed), "--out", str(out_dir(name, seed)), "--threads", "1"]


def expected(argv: list[str]) -> dict:
    """What summary.json must say for a cached run to stand for `argv`: preset, steps, the method's config (PPO's,
    DPO's, best-of-n's n), base directory."""
    from plumbing import flags, pipeline
    run_cfg, sft_cfg, rm_cfg, ppo_cfg, world_cfg, dpo_cfg = flags.parse_configs(argv)
    config = {"ppo": dataclasses.asdict(ppo_cfg), "dpo": dataclasses.asdict(dpo_cfg),
              "best-of-n": {"bon_n": run_cfg.bon_n}}[run_cfg.method]
    if run_cfg.method != "ppo":  # the evaluation's length cap, which every method's result depends on
        config["max_new_tokens"] = ppo_cfg.max_new_tokens
    return {"preset": run_cfg.preset if run_cfg.method == "ppo" else run_cfg.method,
            "steps": run_cfg.steps if run_cfg.method == "ppo" else 0, "config": config,
            "base": pipeline.base_dir(run_cfg, sft_cfg, rm_cfg, world_cfg).name}


def mismatch(summary: dict, want: dict) -> list[str]:
    """The entries of `want` that summary.json contradicts. A PPOConfig field added to the code after the run was
    saved is not held against it (a new field's default is meant to keep the old behaviour)."""
    saved = summary.get("config") or {}
    got = {"preset": summary.get("preset"), "steps": summary.get("steps"), "config": saved,
           "base": Path(summary.get("base", "")).name}
    want = {**want, "config": {k: v for k, v in want["config"].items() if k in saved}}
    return [k for k in want if json.dumps(got[k], sort_keys=True) != json.dumps(want[k], sort_keys=True)]


def run(name: str, *flags: str, seed: int = 0, steps: int | None = None) -> dict:
    """Train runs/<name>-seed<seed> with train.py's `flags`, or reuse it when its summary.json matches them.

    steps: PPO steps in FULL (default: train.py's 80); the small budget always runs SMALL_STEPS.
    Training output goes to <dir>/train.log, not to the notebook. Returns summary.json plus "dir" (a Path).
    """
    return run_many([(name, flags, seed, steps)])[0]


def code_version(files: dict[str, str] | None = None) -> str:
    """A hash of the project's code, the .py files every run imports (the concept files and the package plumbing/),
    each as its syntax tree without docstrings: an edit of a comment or a docstring keeps it, any change of code
    changes it. `files` ({relative path: text}) hashes those instead of this tree's (another commit's, read from
    git)."""
    import ast
    import hashlib
    files = files if files is not None else {str(path.relative_to(ROOT)): path.read_text()
                                             for path in [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py")]}
    h = hashlib.sha256()
    for name in sorted(files):
        tree = ast.parse(files[name])
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        h.update(name.encode() + ast.dump(tree).encode())
    return h.hexdigest()[:12]


def cached(name: str, flags, seed: int, steps: int | None) -> dict | None:
    """The saved run that stands for these flags (summary.json plus "dir"), or None when there is none yet or it was
    trained by other code (runner.json's code_version); a RuntimeError when its directory holds a run of other
    flags."""
    out = out_dir(name, seed)
    argv = argv_for(name, tuple(flags), seed, steps)
    summary_path = out / "summary.json"
    if not summary_path.exists():
        return None
    runner = out / "runner.json"
    if not runner.exists() or json.loads(runner.read_text()).get("code") != code_version():
        return None
    summary = json.loads(summary_path.read_text())
    bad = mismatch(summary, expected(argv))
    if bad:
        raise RuntimeError(f"{out} holds a run with another {', '.join(bad)} than `train.py {' '.join(argv)}`; "
                           f"delete that directory or give this run another name")
    return saved(out)


def saved(out: Path) -> dict:
    """A trained run directory as cached() returns it: summary.json, the collapse alarm, "dir"."""
    summary = json.loads((out / "summary.json").read_text())
    alarm = current_alarm(out) if (out / "metrics.jsonl").exists() else None  # DPO, best-of-n: no PPO steps
    return {**summary, "collapse_alarm": alarm, "dir": out}


def run_many(specs: list[tuple]) -> list[dict]:
    """run() for every (name, flags, seed, steps) of `specs`, in their order: the cached ones read back, the others
    trained side by side by the worker pool (JOBS processes, one thread each). A failed run raises its own error."""
    found: list[dict | None] = [None] * len(specs)
    for i, run_ in run_each(specs):
        found[i] = run_
    return found


def run_each(specs: list[tuple], keep_going: bool = False):
    """run_many() as a stream: yields (i, run) for the i-th spec as soon as it is ready, the cached ones first, then
    each trained one when its worker finishes it, whatever its place in `specs`; the pool takes the specs in their
    order. With keep_going a failed run yields (i, its exception) and the others still run; otherwise it raises."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool
    todo = []
    for i, spec in enumerate(specs):
        found = cached(*spec)
        if found is None:
            todo.append(i)
        else:
            yield i, found
    if not todo:
        return
    t0 = time.time()
    futures = {_pool().submit(_build, FULL, *specs[i], world=WORLD): i for i in todo}
    try:
        for future in as_completed(futures):
            i = futures[future]
            try:
                out, seconds = future.result()   # a run that failed raises here, with its own error
            except Exception as e:  # noqa: BLE001 — handed to the caller, or raised, as keep_going says
                if not keep_going:
                    raise
                yield i, e
                continue
            print(f"trained {Path(out).relative_to(ROOT)} in {seconds:.0f} s", flush=True)
            TRAINED["runs"] += 1
            TRAINED["names"].append((specs[i][0], specs[i][2]))
            yield i, saved(Path(out))   # what the worker just trained (the tree's code may have moved on since)
    except (KeyboardInterrupt, BrokenProcessPool):  # a cell interrupted, or a worker killed: the next call starts a
        _drop_pool()                                 # fresh pool (a broken one would refuse every later run)
        raise
    finally:
        TRAINED["seconds"] += time.time() - t0


TRAINED = {"runs": 0, "seconds": 0.0, "names": []}   # what this process trained so far: runs, wall seconds
#                                                       (report()), and each run's (name, seed)
_POOL = None


def _pool():
    """The worker processes, started on first use: spawned (not forked from a process whose torch already holds
    threads), one thread each, and kept for the next runs."""
    global _POOL
    if _POOL is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        _POOL = ProcessPoolExecutor(max_workers=JOBS, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_worker_start)
    return _POOL


def _drop_pool() -> None:
    """Stop the workers (a run they were training is cleared by the next attempt at it) and forget the pool."""
    global _POOL
    if _POOL is not None:
        # the executor's own worker table: before Python 3.14 (terminate_workers) it has no public way to stop a
        # worker in the middle of a run, and shutdown() alone would wait for that run to end
        for process in list((getattr(_POOL, "_processes", None) or {}).values()):
            process.terminate()
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None


WORKER_CODE: list[str | None] = [None]   # in a worker process: code_version() when it imported the project


def _worker_start() -> None:
    """A worker's start: one thread, and the project imported once for all of its runs. Ctrl-C or a notebook's
    interrupt (SIGINT to the kernel's process group) ends a worker quietly; the process that waits on it sees the
    pool broken and starts a fresh one next time."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    import torch
    torch.set_num_threads(1)
    import train  # noqa: F401
    WORKER_CODE[0] = code_version()   # the code this worker imported, whatever the tree holds later


def _build(full: bool, name: str, flags, seed: int, steps: int | None, world: str = "a") -> tuple[str, float]:
    """In a worker: train one run, unless another process did it meanwhile. A run directory and a new base are
    built by one process only (file locks under runs/.locks/), and a run that waits for a base another process is
    building holds no slot. Returns (its directory, seconds)."""
    configure(full, world=world)
    out = out_dir(name, seed)
    argv = argv_for(name, tuple(flags), seed, steps)
    t0 = time.time()
    with _lock(ROOT / "runs" / ".locks" / (str(out.relative_to(ROOT / "runs")).replace("/", "+") + ".lock")):
        if cached(name, flags, seed, steps) is not None:   # trained by another process while this one waited
            return str(out), 0.0
        base = ROOT / "runs" / "_base" / expected(argv)["base"]
        new_base = contextlib.nullcontext() if (base / "DONE").exists() else \
            _lock(ROOT / "runs" / ".locks" / f"_base+{base.name}.lock")
        with new_base, slot():
            _train(out, argv)
    return str(out), time.time() - t0


def report() -> str:
    """One line: the runs this process trained, their wall time, and the runs per hour that makes."""
    n, s = TRAINED["runs"], TRAINED["seconds"]
    line = (f"trained {n} run(s) in {s / 60:.1f} min wall with {JOBS} single-thread worker process(es): "
            f"{3600 * n / s:.0f} runs per hour" if n else "trained no run: every one was cached")
    print(line)
    return line


def current_alarm(out: Path) -> dict | None:
    """The collapse alarm of a saved run under monitor.py's current default thresholds (monitor.replay over its
    metrics.jsonl and samples.jsonl): summary.json records the alarm under the thresholds in force when the run
    trained, and the alarm never changes training, so a cached run reports what a fresh run would."""
    from plumbing import monitor
    r = monitor.replay(out)
    return {"step": r["alarm"], "reasons": r["reasons"]} if r["alarm"] is not None else None


def _train(out: Path, argv: list[str]) -> None:
    import train
    out.mkdir(parents=True, exist_ok=True)
    # a killed earlier attempt (checkpoints, no summary.json): rerun from the start, which train.py refuses to do
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "runner.json").write_text(json.dumps({"argv": argv, "code": WORKER_CODE[0] or code_version()}, indent=2))
    with open(out / "train.log", "w") as log, contextlib.chdir(ROOT), \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train.main(argv + ["--overwrite"])  # builds (or reuses) runs/_base/<seed>-<hash>, then critic + PPO;
        # --overwrite: a run of other code, or one killed half-way, is replaced (cached() found none to reuse)


def _lock(path: Path):
    """An exclusive file lock (blocking), released when the block ends or the process dies: checkpoint.exclusive,
    the lock build_once takes too."""
    from plumbing.checkpoint import exclusive
    return exclusive(path)


@contextlib.contextmanager
def slot():
    """One of JOBS slots (runs/.slot-<i>.lock) for a training or an evaluation: each uses one core, and notebooks run
    side by side (PPO_MAX_JOBS=2 in each one's environment) must not slow down everything else on the machine."""
    import fcntl
    (ROOT / "runs").mkdir(exist_ok=True)
    while True:
        for i in range(JOBS):
            f = open(ROOT / "runs" / f".slot-{i}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(2.0)


def run_seeds(name: str, *flags: str, steps: int | None = None, n: int | None = None,
              seeds_: tuple[int, ...] | None = None) -> list[dict]:
    """run() for seeds 0 … n − 1 (FULL; default 3) or the small budget's seed, or for `seeds_`, side by side."""
    return run_many([(name, flags, s, steps) for s in (seeds_ or seeds(n))])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def metrics(run_: dict) -> list[dict]:
    """A run's per-step metrics: metrics.jsonl of a trained run, the curve of a record (claims.runs_for, records)."""
    if run_.get("rows") is not None:
        return run_["rows"]
    return read_jsonl(run_["dir"] / "metrics.jsonl")


def samples(run_: dict) -> list[dict]:
    if run_.get("dir") is None:
        raise ValueError(f"{run_.get('variant')} seed {run_.get('seed')} is a record: it keeps no samples; draw this "
                         f"panel from claims.retrained(...)'s runs")
    return read_jsonl(run_["dir"] / "samples.jsonl")


def series(runs_: list[dict], key: str) -> np.ndarray:
    """metrics.jsonl[key] of each run, stacked (S, steps); runs cut to the shortest (NaN where a value is None)."""
    rows = [[np.nan if m.get(key) is None else float(m[key]) for m in metrics(r)] for r in runs_]
    n = min(len(r) for r in rows)
    return np.array([r[:n] for r in rows])


def smooth(x: np.ndarray, k: int = 5) -> np.ndarray:
    """Trailing moving average over the last k steps (axis -1), the same length as x."""
    c = np.cumsum(np.insert(np.asarray(x, float), 0, 0.0, axis=-1), axis=-1)
    n = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(n - k, 0)
    return (c[..., n] - c[..., lo]) / (n - lo)


def base_dir(seed: int) -> Path:
    """runs/_base/seed<s>-<hash> of train.py's default world/SFT/RM flags (the small world in the small budget).

    Built, if missing, by the default (PPO-max) run of that seed, which every notebook shares."""
    want = expected(argv_for("ppo-max", (), seed, None))
    base = ROOT / "runs" / "_base" / want["base"]
    if not (base / "DONE").exists():
        run("ppo-max", seed=seed)
    return base


def interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided 95 % t-interval of the mean over seeds (RULE's, below); (mean, nan, nan)
    with one seed."""
    v = verdict(values)
    return (v["effect"], float("nan"), float("nan")) if v["n"] < 2 else (v["effect"], v["lo"], v["hi"])


def verdict_words(values, above: str, below: str) -> str:
    """RULE (below) in words of one's own: `above` when the 95 % interval of the mean over seeds lies above 0,
    `below` when it lies below, "inconclusive" otherwise (and always with one seed)."""
    return {"higher": above, "lower": below}.get(verdict(values)["verdict"], "inconclusive")


def base_of(run_: dict) -> Path:
    """The cached SFT + reward-model directory a run used."""
    return ROOT / run_["base"]


def _plain_models(base: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from reward_model import ScalarHeadModel
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    sft = AutoModelForCausalLM.from_pretrained(base / "sft").eval()
    rm = ScalarHeadModel.from_pretrained(base / "reward_model").eval()
    prompts = [r["prompt"] for r in read_jsonl(base / "data" / "prompts_heldout.jsonl")]
    return tokenizer, sft, rm, prompts


def frontier(run_: dict) -> dict:
    """The run's point on the gold-vs-√KL frontier (eval.frontier_point: sampled at temperature 1, KL per response):
    summary.json's "frontier", or computed once from its final policy for a run saved before summaries had one."""
    if run_.get("frontier"):
        return run_["frontier"]
    cache = run_["dir"] / "frontier.json"
    if not cache.exists():
        import eval as evaluation
        from transformers import AutoModelForCausalLM
        with slot():
            tokenizer, sft, rm, prompts = _plain_models(base_of(run_))
            policy = AutoModelForCausalLM.from_pretrained(run_["dir"] / "policy").eval()
            point = evaluation.frontier_point(policy, sft, rm, tokenizer, prompts, 4 if FULL else 1, run_["seed"] + 1,
                                              run_["config"]["max_new_tokens"])
            cache.write_text(json.dumps(point, indent=1))
    return json.loads(cache.read_text())


def budget(run_: dict) -> dict:
    """What a run consumed: policy samples drawn in training (critic pre-training rounds + PPO steps, × the rollout
    batch), preference pairs; summary.json's "budget", or counted from the run's files for an older run."""
    if run_.get("budget"):
        return run_["budget"]
    pretrain = run_["dir"] / "critic_pretrain.json"
    rounds = len(json.loads(pretrain.read_text())) if pretrain.exists() else 0
    return {"policy_samples": (rounds + len(metrics(run_))) * run_["config"]["rollout_batch"], "preference_pairs": 0}


def frontier_checkpoints(run_: dict, samples_per_prompt: int | None = None) -> list[dict]:
    """Every saved checkpoint of a run as a point of the over-optimisation curve: gold and proxy (the run's own
    reward model) against d = √KL(π ‖ π_SFT) per response, sampled at temperature 1 (eval.frontier_point); step 0 is
    the SFT model (d = 0). Cached in <dir>/frontier_checkpoints.json."""
    cache = run_["dir"] / "frontier_checkpoints.json"
    ckpts = sorted(p for p in (run_["dir"] / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    n = samples_per_prompt or (4 if FULL else 1)
    steps = [0] + [int(p.name[5:]) for p in ckpts]
    if cache.exists() and [r["step"] for r in json.loads(cache.read_text())] == steps:
        return json.loads(cache.read_text())
    import eval as evaluation
    from transformers import AutoModelForCausalLM
    with slot():
        tokenizer, sft, rm, prompts = _plain_models(base_of(run_))
        rows = []
        for step, model_dir in [(0, None)] + [(int(p.name[5:]), p / "policy") for p in ckpts]:
            policy = sft if model_dir is None else AutoModelForCausalLM.from_pretrained(model_dir).eval()
            rows.append({"step": step, **evaluation.frontier_point(policy, sft, rm, tokenizer, prompts, n,
                                                                   run_["seed"] + 1, run_["config"]["max_new_tokens"])})
        cache.write_text(json.dumps(rows, indent=1))
    return rows


def bon_curve(run_: dict, ns=(1, 2, 4, 8, 16, 32, 64), samples_per_prompt: int | None = None) -> list[dict]:
    """Best-of-n from the SFT model of a run's base, scored by that base's reward model, judged by gold, for every n
    of `ns` from one pool of max(ns) candidates per (prompt, sample) at temperature 1: the pool is cut into
    max(ns)/n disjoint groups of n, and each group's best is averaged (Gao et al. 2022's unbiased estimator uses
    every subset; disjoint groups are a subset of those). d = √(log n − (n − 1)/n). Cached in <dir>/bon_curve.json."""
    import best_of_n
    import eval as evaluation
    import toy_world
    cache = run_["dir"] / "bon_curve.json"
    n_max, per = max(ns), samples_per_prompt or (4 if FULL else 1)
    if cache.exists() and [r["n"] for r in json.loads(cache.read_text())] == list(ns):
        return json.loads(cache.read_text())
    import torch
    with slot():
        tokenizer, sft, rm, prompts = _plain_models(base_of(run_))
        pool = evaluation.sample(sft, tokenizer, prompts, per * n_max, run_["seed"] + 2,
                                 run_["config"]["max_new_tokens"], sampling=evaluation.PLAIN_SAMPLING)
        with torch.no_grad():
            proxy = torch.cat([rm.score(torch.cat([q, r], 1), torch.cat([qm, m], 1)).float() for q, qm, r, m in
                               zip(pool["query"], pool["query_mask"], pool["response"], pool["mask"])])
        gold_reward = toy_world.world(run_.get("world", "a")).gold_reward   # the run's world's gold
        gold = torch.tensor([gold_reward(p, t, f) for p, t, f in
                             zip(pool["prompts"], pool["texts"], pool["finished"])])
        proxy, gold = proxy.view(-1, n_max), gold.view(-1, n_max)          # (prompts · per, n_max)
        rows = []
        for n in ns:
            groups_p, groups_g = proxy.reshape(-1, n), gold.reshape(-1, n)  # disjoint groups of n
            best = best_of_n.select_best(groups_p)
            kl = best_of_n.bon_kl(n)
            rows.append({"n": n, "kl_seq": kl, "d": kl ** 0.5,
                         "reward": groups_p.gather(1, best[:, None]).mean().item(),
                         "gold_reward": groups_g.gather(1, best[:, None]).mean().item()})
        cache.write_text(json.dumps(rows, indent=1))
    return rows


def fit_gao(d, gain, form: str) -> tuple[float, float]:
    """Least squares of Gao et al. 2022's functional forms through the origin, gain = R(d) − R(0):
    best-of-n "bon": gain = d(α − βd); RL "rl": gain = d(α − β log d). Returns (α, β)."""
    d, gain = np.asarray(d, float), np.asarray(gain, float)
    keep = d > 0
    d, gain = d[keep], gain[keep]
    X = np.stack([d, -d * d if form == "bon" else -d * np.log(d)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(X, gain, rcond=None)
    return float(alpha), float(beta)


def mean_std(values) -> str:
    v = np.asarray(values, float)
    return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v.mean():.2f}"


# ---------------------------------------------------------------------------------------------------------
# The verdict rule: every notebook's verdict is computed here, the same way
# ---------------------------------------------------------------------------------------------------------
RULE = ("verdict rule: per seed s (each seed its own world, SFT model and reward model), d_s = variant − reference "
        "(or the value itself when there is no reference); effect = mean of d_s with its 95 % t-interval "
        "mean ± t(0.975, n−1)·sd/√n; 'higher' / 'lower' when the interval excludes 0, 'alike' when it lies inside "
        "±margin (the smallest difference that would matter), otherwise 'inconclusive'; the seeds with d_s > 0 are "
        "counted beside it")
# t(0.975, df), the two-sided 95 % quantile of Student's t (tests/test_runs.py checks it by integrating the density)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}
# the margins of "alike", per quantity: differences smaller than these would not change what a reader does
MARGINS = {"gold": 0.25, "win-lose": 0.10, "kl": 0.05, "length": 1.0, "onset": 5.0}


def verdict(a, b=None, margin: float = 0.0, what: str = "") -> dict:
    """RULE applied to per-seed values a (and a reference b, paired by seed: a[i] and b[i] share seed i).

    Returns {"effect", "lo", "hi", "n", "above" (seeds with d > 0), "verdict", "text"}; verdict is "higher",
    "lower", "alike" (only when margin > 0) or "inconclusive" (always, with one seed)."""
    d = np.asarray(a, float) - (0.0 if b is None else np.asarray(b, float))
    n = len(d)
    mean = float(d.mean())
    half = T975.get(n - 1, 1.96) * float(d.std(ddof=1)) / np.sqrt(n) if n > 1 else float("inf")
    lo, hi = mean - half, mean + half
    if lo > 0:
        v = "higher"
    elif hi < 0:
        v = "lower"
    elif margin > 0 and -margin < lo and hi < margin:
        v = "alike"
    else:
        v = "inconclusive"
    text = (f"{what + ': ' if what else ''}{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] (n = {n}, {int((d > 0).sum())}/{n} "
            f"seeds > 0{f', margin ±{margin:g}' if margin else ''}) → {v}")
    return {"effect": mean, "lo": lo, "hi": hi, "n": n, "above": int((d > 0).sum()), "verdict": v, "text": text}


def held_out(rs: list[dict], key: str = "win-lose") -> np.ndarray:
    """Per seed, the final held-out evaluation against SFT: "win-lose", "gold" (the policy's gold) or "sft_gold"."""
    if key == "win-lose":
        return np.array([r["win_rate_vs_sft"]["win"] - r["win_rate_vs_sft"]["lose"] for r in rs])
    return np.array([r["final" if key == "gold" else "sft"]["gold_reward"] for r in rs])


# ---------------------------------------------------------------------------------------------------------
# Shared plots and tables of the training-dynamics notebooks (Fig. 6, 7, 8, 14-19 have the same panels)
# ---------------------------------------------------------------------------------------------------------
DYNAMICS = [("reward/score", "Reward score"), ("reward/gold", "Gold reward (synthetic human)"),
            ("kl/ref", "KL-divergence"), ("policy/perplexity", "Perplexity"), ("response/length", "Response length")]


def mean_band(ax, y: np.ndarray, color, label: str, k: int = 5, thin: bool = True, **line) -> None:
    """y (seeds, steps) on one axis: each seed faint, the mean over seeds (k-step moving average) bold, and its
    spread, mean ± one sd over seeds (the same average), shaded."""
    x = np.arange(y.shape[1])
    if thin:
        for row in y:
            ax.plot(x, row, color=color, alpha=0.15, lw=0.7)
    import warnings
    with warnings.catch_warnings():   # a metric some runs lack (no critic: no VF loss) is NaN, without numpy's warning
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, sd = smooth(np.nanmean(y, 0), k), smooth(np.nanstd(y, 0), k)
    if len(y) > 1:
        ax.fill_between(x, mean - sd, mean + sd, color=color, alpha=0.12, lw=0)
    ax.plot(x, mean, color=color, lw=2, label=f"{label} ({len(y)} seeds)" if len(y) > 1 else label, **line)


def dynamics_figure(variants: dict[str, list[dict]], panels=DYNAMICS, title: str = "", k: int = 5, colors=None):
    """One panel per metric, one colour per variant: mean over seeds (k-step moving average) with its spread, each
    seed thin (mean_band)."""
    import matplotlib.pyplot as plt
    colors = colors or dict(zip(variants, plt.cm.tab10.colors))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for label, rs in variants.items():
            mean_band(ax, series(rs, key), colors[label], label, k)
        ax.set(title=name, xlabel="step")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def table(variants: dict[str, list[dict]], last: int = 10) -> dict[str, dict]:
    """Per variant: the mean of the last `last` steps of each metric and the held-out evaluation, as arrays over seeds;
    printed as mean ± std. `win−lose` > 0 means better than SFT under the gold judge."""
    out = {}
    keys = [k for k, _ in DYNAMICS]
    w = max(24, 2 + max(len(label) for label in variants))
    short = {"reward/score": "RM score", "reward/gold": "gold", "kl/ref": "KL", "policy/perplexity": "perplexity",
             "response/length": "length"}
    print(f"{'':<{w}}{'(means of the last ' + str(last) + ' training steps)':^90}{'(final held-out evaluation)':^34}")
    print(f"{'variant':<{w}}" + "".join(f"{short[k]:>18}" for k in keys) + f"{'win − lose':>19}{'gold':>15}")
    for label, rs in variants.items():
        row = {k: series(rs, k)[:, -last:].mean(1) for k in keys}
        row["win-lose"] = np.array([r["win_rate_vs_sft"]["win"] - r["win_rate_vs_sft"]["lose"] for r in rs])
        row["gold"] = np.array([r["final"]["gold_reward"] for r in rs])
        row["sft_gold"] = np.array([r["sft"]["gold_reward"] for r in rs])
        out[label] = row
        print(f"{label:<{w}}" + "".join(f"{mean_std(row[k]):>18}" for k in keys)
              + f"{mean_std(row['win-lose']):>19}{mean_std(row['gold']):>15}")
    return out
