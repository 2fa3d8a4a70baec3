"""Long runs: an interrupted run (by --steps or by SIGTERM) resumed with --resume writes the same metrics.jsonl as an
uninterrupted one; a NaN reward skips the update and K consecutive ones stop the run with the last good checkpoint;
Ctrl-C in any stage keeps what finished; a finished run is never replaced without --overwrite."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plumbing import checkpoint
import ppo_max
import train
import plumbing.config
import plumbing.flags
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
        "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "4",
        "--eval-samples", "1", "--threads", "1", "--save-every", "3"]


@pytest.fixture(scope="module")
def uninterrupted(work, metrics):
    train.main(TINY + ["--steps", "9", "--out", "full"])
    return metrics(work / "full")


@pytest.mark.slow
def test_resume_after_stop_matches_uninterrupted(work, uninterrupted, metrics):
    train.main(TINY + ["--steps", "5", "--out", "part"])          # stops after step 5 (checkpoints at 3 and 5)
    train.main(["--resume", "part", "--steps", "9"])               # the run's own flags, extended to 9 steps
    assert metrics(work / "part") == uninterrupted


@pytest.mark.slow
def test_resume_refuses_a_flag_that_contradicts_the_run(work, uninterrupted, capsys):
    """--resume continues the run as it was configured: --seed 4 on a seed-0 run is one line, exit 2, nothing done."""
    before = (work / "full" / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", "full", "--seed", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --seed 4 contradicts the run's --seed 0")
    assert (work / "full" / "metrics.jsonl").read_text() == before
    record = json.loads((work / "full" / "run_config.json").read_text())
    assert record["configs"]["run"]["steps"] == 9 and record["configs"]["ppo"]["rollout_batch"] == 16


@pytest.mark.slow
def test_resume_after_sigterm_matches_uninterrupted(work, uninterrupted, metrics):
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "--steps", "9", "--out", "term"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until PPO has written its first step, then interrupt
        f = work / "term" / "metrics.jsonl"
        if f.exists() and f.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    done = len(metrics(work / "term"))
    if done < 9:  # the signal arrived during training: a checkpoint at the step it stopped and a resume hint
        assert "--resume" in out
        assert checkpoint.find_latest(work / "term").name == f"step-{done:06d}"
        train.main(["--resume", "term"])  # the directory alone: the run remembers its flags
    assert metrics(work / "term") == uninterrupted


def _nan_scores_from(call: int, until: int, monkeypatch):
    """Make the reward model return NaN on the make_experience calls numbered [call, until)."""
    real, count = ppo_max.make_experience, {"n": 0}

    class NanRM:
        def __init__(self, rm):
            self.rm = rm

        def score(self, ids, mask):
            return torch.full((ids.shape[0],), float("nan"))

    def fake(policy, ref, reward_model, *args, **kw):
        count["n"] += 1
        rm = NanRM(reward_model) if call <= count["n"] < until else reward_model
        return real(policy, ref, rm, *args, **kw)

    monkeypatch.setattr(ppo_max, "make_experience", fake)


@pytest.mark.slow
def test_nan_reward_skips_the_update(work, monkeypatch, capsys, metrics):
    _nan_scores_from(3, 4, monkeypatch)  # critic pre-training off: call 3 is PPO step 2
    summary = train.main(TINY + ["--steps", "5", "--critic-pretrain-steps", "0", "--out", "nan1"])
    steps = [m["step"] for m in metrics(work / "nan1")]
    assert steps == [0, 1, 3, 4]
    assert "non-finite reward/score" in capsys.readouterr().out
    assert summary["stopped"] is None
    from transformers import AutoModelForCausalLM
    for p in AutoModelForCausalLM.from_pretrained(work / "nan1" / "policy").parameters():
        assert torch.isfinite(p).all()


@pytest.mark.slow
def test_consecutive_nans_stop_with_last_good_checkpoint(work, monkeypatch, metrics):
    _nan_scores_from(5, 10**9, monkeypatch)  # from PPO step 4 on, every score is NaN
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "9", "--critic-pretrain-steps", "0", "--max-bad-steps", "3", "--out", "nan2"])
    assert e.value.code == 1
    latest = checkpoint.find_latest(work / "nan2")
    assert latest.name == "step-000003" and (latest / "COMPLETE").exists()
    assert [m["step"] for m in metrics(work / "nan2")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_collapse_alarm_stop_checkpoints_and_replays_the_same(work, metrics):
    # KL to the reference is exactly 0 at step 0 (policy = reference) and > 0 after the first update, so with
    # --alarm-kl-max 0 every step from 1 on is bad: patience 2 fires at step 2, and 'stop' ends the run there.
    summary = train.main(TINY + ["--steps", "9", "--alarm-kl-max", "0", "--alarm-patience", "2",
                                 "--on-collapse", "stop", "--out", "alarm"])
    rows = metrics(work / "alarm")
    assert rows[0]["kl/ref"] == 0.0 and all(r["kl/ref"] > 0 for r in rows[1:])
    assert [r["alarm/collapse"] for r in rows] == [False, False, True]
    assert summary["collapse_alarm"]["step"] == 2 and summary["stopped"] == "collapse alarm at step 2"
    latest = checkpoint.find_latest(work / "alarm")  # the steps done, alarm step included; resumable
    assert latest.name == "step-000003" and (latest / "COMPLETE").exists()
    from plumbing import monitor
    assert monitor.replay(work / "alarm", kl_max=0.0, patience=2)["alarm"] == 2  # replay = the live alarm


@pytest.mark.slow
def test_damaged_newest_checkpoint_resumes_from_the_one_before(work, uninterrupted, capsys, metrics):
    """Truncate the newest checkpoint's weights (steps 3, 6, 9 saved): --resume says so in one line, continues from
    step 6, and the run ends with the same metrics.jsonl and samples.jsonl as the uninterrupted one (the rows the
    damaged run had written for steps 6-8 are replaced, not repeated)."""
    import shutil
    shutil.copytree(work / "full", work / "damaged")
    weights = work / "damaged" / "checkpoints" / "step-000009" / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    train.main(["--resume", "damaged"])
    out = capsys.readouterr().out
    assert "step-000009" in out and "truncated" in out and "continuing at step 6" in out
    assert metrics(work / "damaged") == uninterrupted
    assert (work / "damaged" / "samples.jsonl").read_text() == (work / "full" / "samples.jsonl").read_text()


@pytest.mark.parametrize("content", [b"{\"argv\": [\"--steps\"", b"\xff\xfe garbage", b"{}", b"{\"argv\": 5}"])
def test_a_damaged_run_record_is_one_line_naming_it(tmp_path, content, capsys):
    (tmp_path / "run_config.json").write_bytes(content)
    with pytest.raises(SystemExit) as e:
        plumbing.flags.resumed_argv([], plumbing.config.RunConfig(out=str(tmp_path), resume=str(tmp_path)))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "run_config.json: damaged run record" in err[0], err


def test_a_new_run_refuses_a_folder_that_holds_a_run_unless_told_to_overwrite(tmp_path, capsys):
    """Without --resume, an earlier run's checkpoints in --out would be continued by a later --resume as if they
    were this run's: a folder that holds an unfinished or a finished run stops the new one with one line naming the
    folder and the ways on; --overwrite removes that run's checkpoints and summary."""
    (tmp_path / "checkpoints" / "step-000003").mkdir(parents=True)
    run = plumbing.config.RunConfig(out=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        plumbing.run.replace_earlier_run(run, tmp_path, rank=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0] == (
        f"error: --out {tmp_path} holds an unfinished run (newest checkpoint step-000003): --resume {tmp_path} "
        f"continues it, --out NEW starts this run in another folder, --overwrite replaces it"), err
    assert (tmp_path / "checkpoints" / "step-000003").is_dir()  # nothing lost
    plumbing.run.replace_earlier_run(plumbing.config.RunConfig(out=str(tmp_path), resume=str(tmp_path)), tmp_path, rank=0)  # resume
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        plumbing.run.replace_earlier_run(run, tmp_path, rank=0)
    assert e.value.code == 2 and "holds a finished run (summary.json)" in capsys.readouterr().err
    plumbing.run.replace_earlier_run(plumbing.config.RunConfig(out=str(tmp_path), overwrite=True), tmp_path, rank=0)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "summary.json").exists()
    assert "replaces it" in capsys.readouterr().out


# ---- faults during a run: a disk that fills, a second run on the folder; --resume finishes either --------------------
FILLS_AT_STEP_6 = r"""
import shutil, sys, torch
sys.path.insert(0, {root!r})
real_save, real_usage = torch.save, shutil.disk_usage
full = []  # the disk fills at the second checkpoint: before it there is room (the check before the first step)

def save(obj, f, *a, **k):  # the second checkpoint's first torch.save meets a full disk, as torch reports it
    if "step-000006" in str(f):
        full.append(True)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 666432 vs 666320")
    return real_save(obj, f, *a, **k)

torch.save = save
shutil.disk_usage = lambda path: real_usage(path)._replace(free=0) if full else real_usage(path)
import train
from plumbing import cli
sys.argv = ["train.py", *sys.argv[1:]]
cli.cli_guard(train.main)()
"""

ON_A_SMALL_DISK = """
set -e
mount -t tmpfs -o size={size} tmpfs {disk}
set +e
{python} {train} "$@" --out {disk}/run
status=$?
cp -a {disk}/run {copy}
exit $status
"""


def small_disk(work: Path, size: int, copy: Path) -> list[str] | None:
    """A shell command that runs train.py with --out on a tmpfs of `size` bytes (in a mount namespace of its own:
    a user namespace, or as root its own), then copies what the run left there to `copy`; None where no tmpfs can
    be mounted."""
    import shutil
    disk = work / "small-disk"
    disk.mkdir(exist_ok=True)
    if shutil.which("unshare") is None:
        return None
    for way in (["unshare", "-rm"], ["unshare", "-m"]):
        probe = subprocess.run(way + ["sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk}"], capture_output=True)
        if probe.returncode == 0:
            script = ON_A_SMALL_DISK.format(size=size, disk=disk, python=sys.executable, train=ROOT / "train.py",
                                            copy=copy)
            return way + ["sh", "-c", script, "sh"]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["tmpfs", "patched"])
def test_a_disk_that_fills_during_a_checkpoint_ends_in_one_line_and_resume_finishes(work, uninterrupted, metrics,
                                                                                   disk):
    """The disk fills during the second checkpoint (step 6; steps 3, 6, 9 saved): a tmpfs with room for one
    checkpoint and the run's other files but not two (where a tmpfs can be mounted), or torch.save's own error on a
    full disk (everywhere). The run ends with one line naming the file and the bytes free, exit 3 (cli.WRITE_FAILED),
    no traceback; step 3's checkpoint is intact, both logs hold whole lines only, and --resume on a disk with room
    finishes with the uninterrupted run's metrics.jsonl and samples.jsonl."""
    from plumbing import data
    copy = work / f"filled-{disk}"
    if disk == "tmpfs":
        full = work / "full"
        ckpt = sum(json.loads((full / "checkpoints" / "step-000009" / "COMPLETE").read_text())["files"].values())
        rest = sum(p.stat().st_size for p in full.iterdir() if p.is_file() and p.name != "summary.json")
        cmd = small_disk(work, rest + ckpt * 3 // 2 + (256 << 10), copy)
        if cmd is None:
            pytest.skip("cannot mount a tmpfs here (no user namespaces, not root)")
        proc = subprocess.run(cmd + [*TINY, "--steps", "9"], cwd=work, capture_output=True, text=True, timeout=900)
    else:
        proc = subprocess.run([sys.executable, "-c", FILLS_AT_STEP_6.format(root=str(ROOT)), *TINY, "--steps", "9",
                               "--out", str(copy)], cwd=work, capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error") or "Traceback" in l]
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write "), lines
    assert "/checkpoints/step-000006/" in lines[0] and "no space left on device" in lines[0], lines[0]
    assert "bytes free on" in lines[0] and "step-000003, is intact" in lines[0], lines[0]
    assert checkpoint.find_intact(copy).name == "step-000003"
    assert not [p for p in (copy / "checkpoints").iterdir() if ".tmp-" in p.name]
    for log in ("metrics.jsonl", "samples.jsonl"):
        assert (copy / log).read_bytes().endswith(b"\n")
        assert [r["step"] for r in data.read_records(copy / log)] == list(range(6))
    train.main(["--resume", str(copy)])
    assert metrics(copy) == uninterrupted
    assert (copy / "samples.jsonl").read_text() == (work / "full" / "samples.jsonl").read_text()


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_folder_is_turned_away_and_a_killed_run_resumes(work, uninterrupted, metrics):
    """Two real processes on one --out: while the first trains (held stopped here, with its step-3 checkpoint
    written), `train.py --resume` of that folder exits 2 in one line naming the first one's pid, and writes nothing;
    the first is then killed with SIGKILL (no handler runs), and --resume, the kernel having let go of its lock,
    finishes with the uninterrupted run's metrics."""
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "--steps", "9", "--out", "locked"]
    first = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while checkpoint.find_latest(work / "locked") is None and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # a live run, between two of its writes
        assert first.poll() is None, "the first run ended before the second one started"
        before = {p: p.read_bytes() for p in sorted((work / "locked").rglob("*")) if p.is_file()}
        second = subprocess.run([sys.executable, str(ROOT / "train.py"), "--resume", "locked"], cwd=work,
                                capture_output=True, text=True, timeout=300)
        lines = [l for l in second.stderr.splitlines() if l.strip() and not l.startswith("[")]
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("error: --out locked is in use by another run "
                                                       f"(pid {first.pid}: "), lines
        assert "train.py" in lines[0]
        assert {p: p.read_bytes() for p in sorted((work / "locked").rglob("*")) if p.is_file()} == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    train.main(["--resume", "locked"])
    assert metrics(work / "locked") == uninterrupted


# ---- an interrupted run keeps what it finished; a finished run is never replaced silently --------------------------
# Ctrl-C (SIGINT) during SFT, then during the reward model, then during PPO each ends the run in one line (what was
# stopped, what is kept, the command that continues) without a traceback; SFT is kept as soon as it ends, so the rerun
# after the reward model's interruption starts from it and says so; --resume of a run with no PPO checkpoint yet says
# that a plain rerun continues.
# a world of its own (not the other tests' cached base), each stage a few seconds on one thread
INTERRUPTED = ["--world-n-sft", "3000", "--world-n-pairs", "900", "--world-n-pairs-heldout", "100", "--sft-epochs",
               "1", "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "2",
               "--eval-samples", "1", "--threads", "1", "--seed", "3"]


def _as_in_a_terminal() -> None:
    """The child's SIGINT and SIGTERM as a terminal's foreground command has them: default and unblocked, whatever
    the test session inherited (a background job starts with SIGINT ignored, and an ignored or blocked signal is
    passed on to every child, which would then never see the Ctrl-C this test sends)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def interrupt_when(cmd: list[str], work: Path, ready, sig=signal.SIGINT) -> tuple[int, str, str]:
    """Run `cmd` in `work`, send `sig` once ready() holds; (exit status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_as_in_a_terminal)
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
    cmd = [sys.executable, str(ROOT / "train.py"), *INTERRUPTED, "--steps", "40", "--out", "r"]
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
