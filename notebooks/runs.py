"""The figure notebooks' runner: train (or reuse) one run per (name, flags, seed) with `train.main`, then read it back.

Implements: no equation; the cache and the two budgets behind every figure notebook.
  run(name, *flags, seed)        train.main([*flags, --seed s, --out runs/<name>-seed<s>, --threads 1]) unless
                                 that directory already holds a summary.json whose saved config matches the flags
                                 (then the notebook only re-plots); returns the run's summary.json (+ "dir")
  run_seeds(name, *flags)        run() for every seed of the budget (3 in FULL, 1 in the small budget)
  series(runs_, key)             one metrics.jsonl key of several runs as an array (S, steps)
  samples(run_)                  samples.jsonl of a run: per step the RM scores, gold rewards and 4 examples
  base_dir(seed)                 the default SFT + reward-model directory of a seed (rm_log.json, ... for Fig. 2-3)
  evaluate_checkpoints(run_)     win / tie / lose vs SFT under the gold judge of every saved checkpoint (Fig. 4)
  current_alarm(dir)             the collapse alarm under monitor.py's current thresholds (replayed, not retrained)
  one_at_a_time()                a file lock (runs/.runner.lock): trainings and evaluations of all processes take turns
  dynamics_figure(variants)      the panels shared by Fig. 6-8 and 14-19 (reward, gold, KL, perplexity, length)
  table(variants)                the last-10-step means of those metrics and the held-out win − lose, per variant
Budgets:
  FULL (env PPO_MAX_FULL=1)      train.py's default budget (80 PPO steps unless a notebook asks for more),
                                 seeds 0, 1, 2, under runs/<name>-seed<s>/. The committed notebook outputs and the
                                 PNGs in notebooks/figures/ come from this budget.
  small (PPO_MAX_FULL unset/0)   a tiny world (SMALL_FLAGS, as tests/test_pipeline.py), SMALL_STEPS PPO steps,
                                 seed 0, under runs/small/<name>-seed0/ (its SFT + RM under runs/_base/ with their own
                                 hash), so that `pytest -m notebook` runs every notebook in minutes. Its numbers mean nothing; it checks that the notebooks run.
Run: in a notebook, `import runs; runs.configure(full=FULL); s = runs.run("vanilla", "--preset", "vanilla")`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL = os.environ.get("PPO_MAX_FULL", "0") == "1"
FULL_SEEDS = (0, 1, 2)
SMALL_SEEDS = (0,)
# The small budget: a tiny world (as tests/test_pipeline.py), few PPO steps, one evaluation sample per prompt.
SMALL_FLAGS = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100",
               "--sft-epochs", "1", "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8",
               "--critic-pretrain-steps", "4", "--eval-samples", "1"]
SMALL_STEPS = 4


def configure(full: bool) -> None:
    """Choose the budget for every later call (a notebook's first cell: `runs.configure(full=FULL)`)."""
    global FULL
    FULL = bool(full)


def seeds() -> tuple[int, ...]:
    return FULL_SEEDS if FULL else SMALL_SEEDS


def out_dir(name: str, seed: int) -> Path:
    return ROOT / "runs" / (f"{name}-seed{seed}" if FULL else f"small/{name}-seed{seed}")


def argv_for(name: str, flags: tuple[str, ...], seed: int, steps: int | None) -> list[str]:
    flags = [str(f) for f in flags]
    if FULL:
        argv = flags + (["--steps", str(steps)] if steps else [])
    else:
        argv = SMALL_FLAGS + flags + ["--steps", str(SMALL_STEPS)]
    return argv + ["--seed", str(seed), "--out", str(out_dir(name, seed)), "--threads", "1"]


def expected(argv: list[str]) -> dict:
    """What summary.json must say for a cached run to stand for `argv`: preset, steps, the method's config (PPO's,
    DPO's, best-of-n's n), base directory."""
    import pipeline
    import train
    run_cfg, sft_cfg, rm_cfg, ppo_cfg, world_cfg, dpo_cfg = train.parse_configs(argv)
    config = {"ppo": dataclasses.asdict(ppo_cfg), "dpo": dataclasses.asdict(dpo_cfg),
              "best-of-n": {"bon_n": run_cfg.bon_n}}[run_cfg.method]
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
    out = out_dir(name, seed)
    argv = argv_for(name, flags, seed, steps)
    want = expected(argv)
    summary_path = out / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        bad = mismatch(summary, want)
        if bad:
            raise RuntimeError(f"{out} holds a run with another {', '.join(bad)} than `train.py {' '.join(argv)}`; "
                               f"delete that directory or give this run another name")
        return {**summary, "collapse_alarm": current_alarm(out), "dir": out}
    with one_at_a_time():
        if summary_path.exists():          # another process trained it while this one waited
            return run(name, *flags, seed=seed, steps=steps)
        return _train(out, argv)


def current_alarm(out: Path) -> dict | None:
    """The collapse alarm of a saved run under monitor.py's current default thresholds (monitor.replay over its
    metrics.jsonl and samples.jsonl): summary.json records the alarm under the thresholds in force when the run
    trained, and the alarm never changes training, so a cached run reports what a fresh run would."""
    import monitor
    r = monitor.replay(out)
    return {"step": r["alarm"], "reasons": r["reasons"]} if r["alarm"] is not None else None


def _train(out: Path, argv: list[str]) -> dict:
    import train
    out.mkdir(parents=True, exist_ok=True)
    (out / "runner.json").write_text(json.dumps({"argv": argv}, indent=2))
    t0 = time.time()
    with open(out / "train.log", "w") as log, contextlib.chdir(ROOT), \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        summary = train.main(argv)     # builds (or reuses) runs/_base/<seed>-<hash>, then critic pre-training + PPO
    print(f"trained {out.relative_to(ROOT)} in {time.time() - t0:.0f} s")
    return {**summary, "dir": out}


@contextlib.contextmanager
def one_at_a_time():
    """Trainings and checkpoint evaluations of every process using this runner take turns (runs/.runner.lock):
    each uses one core, and two notebooks run side by side must not slow down everything else on the machine."""
    import fcntl
    (ROOT / "runs").mkdir(exist_ok=True)
    with open(ROOT / "runs" / ".runner.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_seeds(name: str, *flags: str, steps: int | None = None, seeds_: tuple[int, ...] | None = None) -> list[dict]:
    return [run(name, *flags, seed=s, steps=steps) for s in (seeds_ or seeds())]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def metrics(run_: dict) -> list[dict]:
    return read_jsonl(run_["dir"] / "metrics.jsonl")


def samples(run_: dict) -> list[dict]:
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


def evaluate_checkpoints(run_: dict, samples_per_prompt: int | None = None) -> list[dict]:
    """Each saved checkpoint's policy against the SFT model on the held-out prompts, judged by gold (eval.compare,
    sampled as the paper evaluates: top-p 0.9, temperature 0.8). Cached in <dir>/checkpoint_eval.json.

    Returns [{"step", "win", "tie", "lose", "gold_reward", "sft_gold_reward", "kl", "perplexity", "length"}], with
    step 0 = the SFT model itself (its win rate against itself is all ties)."""
    cache = run_["dir"] / "checkpoint_eval.json"
    ckpts = sorted(p for p in (run_["dir"] / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    n = samples_per_prompt or (4 if FULL else 1)
    fresh = lambda: (cache.exists() and (rows := json.loads(cache.read_text())) and rows[0].get("n") == n
                     and [r["step"] for r in rows[1:]] == [int(p.name[5:]) for p in ckpts])
    if fresh():
        return json.loads(cache.read_text())
    with one_at_a_time():
        return json.loads(cache.read_text()) if fresh() else _evaluate_checkpoints(run_, ckpts, n, cache)


def _evaluate_checkpoints(run_: dict, ckpts: list[Path], n: int, cache: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    import eval as evaluation
    from reward_model import ScalarHeadModel
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    base = ROOT / run_["base"]
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    sft = AutoModelForCausalLM.from_pretrained(base / "sft").eval()
    rm = ScalarHeadModel.from_pretrained(base / "reward_model").eval()
    prompts = [r["prompt"] for r in read_jsonl(base / "data" / "prompts_heldout.jsonl")]
    max_new = run_["config"]["max_new_tokens"]
    rows = []
    for step, model_dir in [(0, base / "sft")] + [(int(p.name[5:]), p / "policy") for p in ckpts]:
        policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        rep = evaluation.compare(policy, sft, sft, rm, tokenizer, prompts, n, seed=run_["seed"], max_new_tokens=max_new)
        rows.append({"step": step, "n": n, **rep["win_rate"], "gold_reward": rep["policy"]["gold_reward"],
                     "sft_gold_reward": rep["sft"]["gold_reward"], "kl": rep["policy"]["kl"],
                     "perplexity": rep["policy"]["perplexity"], "length": rep["policy"]["response_length"],
                     "reward": rep["policy"]["reward"]})
    cache.write_text(json.dumps(rows, indent=1))
    return rows


def mean_std(values) -> str:
    v = np.asarray(values, float)
    return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v.mean():.2f}"


# ---------------------------------------------------------------------------------------------------------
# Shared plots and tables of the training-dynamics notebooks (Fig. 6, 7, 8, 14-19 have the same panels)
# ---------------------------------------------------------------------------------------------------------
DYNAMICS = [("reward/score", "Reward score"), ("reward/gold", "Gold reward (synthetic human)"),
            ("kl/ref", "KL-divergence"), ("policy/perplexity", "Perplexity"), ("response/length", "Response length")]


def dynamics_figure(variants: dict[str, list[dict]], panels=DYNAMICS, title: str = "", k: int = 5, colors=None):
    """One panel per metric, one colour per variant: mean over seeds (k-step moving average), each seed thin."""
    import matplotlib.pyplot as plt
    colors = colors or dict(zip(variants, plt.cm.tab10.colors))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for label, rs in variants.items():
            y = series(rs, key)
            for row in y:
                ax.plot(row, color=colors[label], alpha=0.15, lw=0.7)
            ax.plot(smooth(y.mean(0), k), color=colors[label], lw=2, label=label)
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
