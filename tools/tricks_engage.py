"""Does each newer trick act in this world as the README shows it? Each example of the README's "What PPO gained
since the paper" run as written for 12 PPO steps of the default world, and its own engagement number read back from
metrics.jsonl: how many steps it was non-zero, its mean and its largest value.

    EXAMPLES   {trick: (the README's flags, the metrics key of its engagement)}: the README holds each flag string
               verbatim and the step line shows each key (tests/test_gold_and_judge.py checks both, cheaply)
    main()     the runs (runs/tricks/<trick>, one cached base for all), then the table

A trick that never engages (a clip that never binds, a filter that never drops) would be a flag that changes nothing:
this script says so, and exits 1. Not a test: six runs of 12 steps on the default world take 2-4 minutes on 2 cores.
Measured numbers: docs/methods.md ("What PPO gained since the paper").

Run: python tools/tricks_engage.py [--steps 12] [--only clip-higher,GSPO] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EXAMPLES = {
    "clip-higher": ("--clip-eps-high 0.28 --ppo-epochs 4", "ppo/clip_higher_frac"),
    "GSPO": ("--ratio sequence --clip-eps 3e-4 --clip-eps-high 4e-4", "ppo/clipfrac"),
    "CISPO": ("--policy-loss cispo --cispo-eps-high 0.28", "ppo/clipfrac"),
    "dynamic sampling": ("--preset dapo --temperature 0.5", "dynamic/dropped"),
    "overlong penalty": ("--overlong-buffer 16", "overlong/share"),
    "rollout mismatch": ("--rollout-mismatch bf16", "mismatch/mean_abs_logp_diff"),
}


def engagement(out: Path, key: str) -> dict:
    """The run's engagement number over its steps: steps non-zero, mean, max."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    values = [r.get(key) or 0.0 for r in rows]
    return {"steps": len(values), "nonzero": sum(v != 0 for v in values), "mean": sum(values) / len(values),
            "max": max(values)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated tricks (default: every example)")
    p.add_argument("--threads", type=int, default=0, help="train.py --threads (0: torch's default)")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",")] if a.only else list(EXAMPLES)
    results = {}
    for name in names:
        flags, key = EXAMPLES[name]
        out = ROOT / "runs" / "tricks" / name.replace(" ", "-")
        cmd = [sys.executable, str(ROOT / "train.py"), *flags.split(), "--steps", str(a.steps), "--out", str(out),
               *(["--threads", str(a.threads)] if a.threads else [])]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name}: train.py failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            results[name] = None
            continue
        results[name] = {"flags": flags, "key": key, **engagement(out, key)}
    print(f"{'trick':<18} {'README flags':<58} {'metric':<30} non-zero      mean       max")
    for name, r in results.items():
        if r:
            print(f"{name:<18} {r['flags']:<58} {r['key']:<30} {r['nonzero']:>3}/{r['steps']:<3} {r['mean']:>9.4f} "
                  f"{r['max']:>9.4f}")
    idle = [n for n, r in results.items() if not r or not r["nonzero"]]
    if idle:
        print(f"never engaged (or failed) in {a.steps} steps: {', '.join(idle)}")
    return results


if __name__ == "__main__":
    sys.exit(1 if any(not r or not r["nonzero"] for r in main().values()) else 0)
