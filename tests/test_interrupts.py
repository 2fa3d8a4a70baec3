"""An interrupted run keeps what it finished: Ctrl-C (SIGINT) during SFT, then during the reward model, then during PPO
each ends the run in one line (what was stopped, what is kept, the command that continues) without a traceback; SFT
is kept as soon as it ends, so the rerun after the reward model's interruption starts from it and says so; --resume of
a run with no PPO checkpoint yet says that a plain rerun continues; a finished run is never replaced silently."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import plumbing.flags
import plumbing.run
import train

ROOT = Path(__file__).resolve().parents[1]
# a world of its own (not the other tests' cached base), each stage a few seconds on one thread
TINY = ["--world-n-sft", "3000", "--world-n-pairs", "900", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
        "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "2",
        "--eval-samples", "1", "--threads", "1", "--seed", "3"]


def interrupt_when(cmd: list[str], work: Path, ready, sig=signal.SIGINT) -> tuple[int, str, str]:
    """Run `cmd` in `work`, send `sig` once ready() holds; (exit status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while not ready() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def last_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip() and not l.lstrip().startswith(("1. SFT", "2. reward", "4. PPO",
                                                                                        "3. critic"))]
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_sigint_in_sft_then_reward_model_then_ppo_keeps_what_each_finished(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "--steps", "40", "--out", "r"]
    base = tmp_path / "runs" / "_base"

    # 1. during SFT: nothing of SFT kept, one line with the command that continues
    rc, out, err = interrupt_when(cmd, tmp_path, lambda: any(base.glob("*.tmp/data")) and time.sleep(1.0) is None)
    assert rc == 0 and "Traceback" not in err, err
    assert last_line(err).startswith("[SIGINT] stopped during stage 1 (SFT)"), err
    assert "continue with: python train.py" in last_line(err) and "--out r" in last_line(err)
    assert not list(base.glob("*.tmp")) and not list(base.glob("*.sft"))  # nothing half-built is kept
    # --resume of a run with no PPO checkpoint: a plain rerun continues it
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--resume", "r"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "before its first PPO checkpoint" in r.stderr and "a plain rerun continues" in r.stderr, r.stderr

    # 2. during the reward model: SFT is kept, and the rerun starts from it
    rc, out, err = interrupt_when(cmd, tmp_path, lambda: any(base.glob("*.sft/DONE")))
    assert rc == 0 and "Traceback" not in err, err
    assert last_line(err).startswith("[SIGINT] stopped during stage 2 (reward model); kept: SFT in runs/_base/"), err
    (kept,) = base.glob("*.sft")

    # 3. during PPO: the rerun reuses SFT; the loop finishes its step, checkpoints and says how to go on
    metrics = tmp_path / "r" / "metrics.jsonl"
    rc, out, err = interrupt_when(cmd, tmp_path, lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1)
    assert rc == 0 and "Traceback" not in err, err
    assert f"[1. SFT] reusing runs/_base/{kept.name}" in out, out
    assert "continue with: python train.py --resume r" in out + err
    assert not kept.exists()  # the finished base holds SFT now

    # 4. the interrupted run is resumable, not replaceable by accident
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "holds an unfinished run" in r.stderr and "--resume r" in r.stderr, r.stderr


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.slow
def test_a_finished_run_is_never_replaced_without_overwrite(work, capsys):
    """`train.py --steps 2 --out X` twice: the second stops in one line, exit 2, naming the folder and the ways on, the
    first run's files untouched; --overwrite replaces it; the default --out goes to the next free folder instead."""
    flags = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
             "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "2",
             "--eval-samples", "1", "--threads", "1", "--steps", "2"]
    train.main(flags + ["--out", "X"])
    before = tree(work / "X")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(flags + ["--out", "X"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == ("error: --out X holds a finished run (summary.json): --out NEW starts this run in another "
                      "folder, --overwrite replaces it"), err
    assert tree(work / "X") == before
    train.main(flags[:-1] + ["3", "--out", "X", "--overwrite"])
    assert "replaces it" in capsys.readouterr().out
    assert json.loads((work / "X" / "summary.json").read_text())["steps"] == 3
    assert "--overwrite" not in (work / "X" / "run_config.json").read_text()  # a --resume never replaces


def test_the_default_out_goes_to_the_next_free_folder(tmp_path, monkeypatch, capsys):
    """A command without --out run twice never needs --overwrite: the default folder that holds a run is left as it
    is and the run writes the next free one, said in one line."""
    monkeypatch.chdir(tmp_path)
    for d in ("runs/ppo-max-seed0", "runs/ppo-max-seed0-2"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "summary.json").write_text("{}")
    run = plumbing.flags.parse_configs([])[0]
    moved = plumbing.run.free_default_out(run, [])
    assert moved.out == "runs/ppo-max-seed0-3"
    assert capsys.readouterr().out.startswith("[out] runs/ppo-max-seed0 holds a finished run (summary.json): this "
                                              "run writes runs/ppo-max-seed0-3")
    assert plumbing.run.free_default_out(run, ["--out", "runs/ppo-max-seed0"]) == run  # given: refused later
