"""The faults a user hits, each one line: a full disk (or any failed write) during a checkpoint, a log, a record or the
cached base ends the run with one line naming the path and, for a full disk, the bytes needed and free, the last
complete checkpoint intact and no log cut mid-line; a second run on an --out that a live run holds is turned away in
one line naming it; a model whose pickle would run code is refused in one line; the flag combinations a run would
ignore or cannot run are refused in one line (and negative numbers are values). The end-to-end runs (a disk that
fills during train.py, then --resume; a second run on a live run's folder, then SIGKILL and --resume) are in
tests/test_resume.py."""
import ast
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import plumbing.cli
import plumbing.flags
import plumbing.run
from plumbing import checkpoint, monitor, pipeline
from plumbing.checkpoint import damage, find_latest, save_checkpoint
from plumbing.cli import WriteFailed

ROOT = Path(__file__).resolve().parents[1]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def tiny_models():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    policy = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 6))
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {"policy": policy}, {"policy": opt}


def torch_writer_error(*args, **kwargs):
    """What torch.save raises when the disk fills mid-write (its zip writer names neither file nor cause)."""
    try:
        raise RuntimeError("basic_ios::clear: iostream error")
    except RuntimeError as e:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 666432 vs 666320") from e


def full_disk(monkeypatch, free: int = 0) -> None:
    """shutil.disk_usage says `free` bytes are left (what a full disk says), wherever it is asked."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - free, free))


# ------------------------------------------------------------------------------------------------ checkpoints
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path, monkeypatch):
    """torch.save's own error on a full disk ("unexpected pos …") becomes one WriteFailed naming the file of the
    checkpoint, the bytes a checkpoint needs (the last one's size) and those free; the partial directory is gone and
    the newest complete checkpoint, `latest` included, is untouched."""
    models, opts = tiny_models()
    first = save_checkpoint(tmp_path, 3, models=models, optimizers=opts)
    size = sum(json.loads((first / "COMPLETE").read_text())["files"].values())
    before = {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    monkeypatch.setattr(torch, "save", torch_writer_error)
    full_disk(monkeypatch, free=1234)
    with pytest.raises(WriteFailed) as e:
        save_checkpoint(tmp_path, 6, models=models, optimizers=opts)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"cannot write {tmp_path / 'checkpoints' / 'step-000006'}/optimizer")
    assert "no space left on device" in line and f"about {size:,} bytes needed" in line and "1,234 bytes free" in line
    assert f"{first}, is intact" in line and f"--resume {tmp_path}" in line
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003"]
    assert find_latest(tmp_path) == first and damage(first) is None
    assert {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()} == before


def test_the_first_checkpoint_estimates_what_it_needs(tmp_path, monkeypatch):
    """Before any checkpoint, the bytes needed are the tensors of the weights and of the optimizer's state; a
    safetensors error on a full disk (errno 28 in its text) is a full disk too."""
    models, opts = tiny_models()

    def no_space(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    import transformers.modeling_utils
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_space)  # save_pretrained's writer
    with pytest.raises(WriteFailed) as e:
        save_checkpoint(tmp_path, 1, models=models, optimizers=opts)
    weights = sum(t.numel() * t.element_size() for t in models["policy"].state_dict().values())
    assert e.value.full and weights * 3 <= e.value.needed <= weights * 3.1, (e.value.needed, weights)
    assert str(e.value).startswith(f"cannot write {tmp_path / 'checkpoints' / 'step-000001' / 'policy'}: no space")
    assert "no checkpoint of this run was written yet" in str(e.value)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_other_errors_of_a_save_stay_what_they_are(tmp_path, monkeypatch):
    """Only failures to write become WriteFailed: a bug (a TypeError) keeps its traceback."""
    models, opts = tiny_models()

    def bug(*args, **kwargs):
        raise TypeError("cannot pickle 'generator' object")
    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, models=models, optimizers=opts)
    assert checkpoint.write_failure(ValueError("bad data")) is None
    assert checkpoint.write_failure(PermissionError(errno.EACCES, "Permission denied", "x.jsonl")) is None  # a read?
    assert checkpoint.write_failure(PermissionError(errno.EACCES, "Permission denied", "x"), writing=True) is not None


MOUNT = r"""
set -e
mount -t tmpfs -o size={size} tmpfs {disk}
cd {disk}
{python} - <<'EOF'
import json, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_faults import tiny_models
from plumbing.checkpoint import damage, find_latest, save_checkpoint
from plumbing.cli import WriteFailed
models, opts = tiny_models()
first = save_checkpoint(".", 1, models=models, optimizers=opts, keep_last=1)
try:
    save_checkpoint(".", 2, models=models, optimizers=opts, keep_last=1)
    print(json.dumps({{"failed": None}}))
except WriteFailed as e:
    import os
    print(json.dumps({{"failed": str(e), "full": e.full, "latest": str(find_latest(".")), "damage": damage(first),
                      "left": sorted(os.listdir("checkpoints"))}}))
EOF
"""


def test_a_real_full_disk_during_a_checkpoint(tmp_path):
    """A tmpfs with room for one checkpoint and not two (a user and mount namespace of its own, as an unprivileged
    user can make one; skipped where neither root nor namespaces allow a mount): the second save ends in one
    WriteFailed that says the disk is full, and the first checkpoint stays complete and intact (keep_last=1 deletes
    it only after the second is complete)."""
    models, opts = tiny_models()
    probe = save_checkpoint(tmp_path / "probe", 1, models=models, optimizers=opts)
    size = sum(json.loads((probe / "COMPLETE").read_text())["files"].values())
    disk = tmp_path / "disk"
    disk.mkdir()
    script = MOUNT.format(size=int(size * 1.5) + (64 << 10), disk=disk, python=sys.executable, root=str(ROOT),
                          tests=str(ROOT / "tests"))
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    # a user namespace (root there, unprivileged here), or as root a mount namespace of its own: gone when it ends
    ways = [w for w in (["unshare", "-rm"], ["unshare", "-m"]) if subprocess.run(
        w + ["sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk}"], capture_output=True).returncode == 0]
    if not ways:
        pytest.skip("cannot mount a tmpfs here (no user namespaces, not root)")
    proc = subprocess.run(ways[0] + ["sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failed"] and result["full"], result
    assert result["failed"].startswith("cannot write checkpoints/step-000002/") and "bytes free" in result["failed"]
    assert result["latest"] == "checkpoints/step-000001" and result["damage"] is None
    assert result["left"] == ["latest", "step-000001"], result


# ------------------------------------------------------------------------------------------------ logs and records
class FillsUp:
    """A log file on a disk that fills after `room` more bytes: a write takes what fits, then ENOSPC (as write(2))."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def seek(self, *a):
        return self.f.seek(*a)

    def truncate(self, n):
        return self.f.truncate(n)

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.f.write(bytes(data[:self.room]))
        self.room -= n
        return n

    def close(self):
        self.f.close()


@pytest.mark.parametrize("which, room", [("samples_f", 10), ("metrics_f", 10), ("samples_f", 0)])
def test_a_full_disk_never_leaves_a_log_cut_mid_line(tmp_path, which, room, monkeypatch):
    """The step whose rows do not fit leaves metrics.jsonl and samples.jsonl as they were after the step before:
    whole lines only, the same number in each, and one WriteFailed naming the file that filled."""
    history = [{"step": 0, "kl/ref": 0.0}]
    log = monitor.RunLog(tmp_path, monitor.CollapseMonitor(), history, [{"step": 0, "scores": [1.0]}])
    log.steps(1, 3, bar=False)
    row = {"step": 1, "kl/ref": 0.01, "reward/score": 0.5, "response/length": 3.0, "policy/perplexity": 2.0}
    log.record(1, dict(row), [0.5], None, ["p"], ["t"])
    before = [(tmp_path / n).read_bytes() for n in ("metrics.jsonl", "samples.jsonl")]
    setattr(log, which, FillsUp(getattr(log, which), room))
    full_disk(monkeypatch)
    with pytest.raises(WriteFailed) as e:
        log.record(2, dict(row, step=2), [0.7], None, ["p"] * 4, ["a much longer response"] * 4)
    log.close()
    name = "samples.jsonl" if which == "samples_f" else "metrics.jsonl"
    assert str(e.value).startswith(f"cannot write {tmp_path / name}: no space left on device (about ")
    assert [(tmp_path / n).read_bytes() for n in ("metrics.jsonl", "samples.jsonl")] == before
    for n in ("metrics.jsonl", "samples.jsonl"):
        assert [json.loads(l)["step"] for l in (tmp_path / n).read_text().splitlines()] == [0, 1]


def test_a_record_that_cannot_be_written_keeps_the_old_one(tmp_path, monkeypatch):
    """write_json (summary.json, run_config.json, records): the old file stays whole, no temporary file is left."""
    path = tmp_path / "summary.json"
    pipeline.write_json(path, {"old": 1})

    def no_room(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    monkeypatch.setattr(Path, "write_text", no_room)
    full_disk(monkeypatch, free=0)
    with pytest.raises(WriteFailed) as e:
        pipeline.write_json(path, {"new": list(range(100))})
    assert str(e.value).startswith(f"cannot write {path}: no space left on device (about ")
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_base_whose_build_cannot_write_leaves_nothing_half_built(tmp_path):
    """A write that fails inside the cached base's build (here safetensors' error, which names no file) is one
    WriteFailed naming the base's directory; neither it nor its .tmp is left."""
    def build(tmp):
        (tmp / "sft").mkdir()
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(WriteFailed) as e:
        checkpoint.build_once(tmp_path / "base", build, "a test base")
    assert str(e.value).startswith(f"cannot write {tmp_path / 'base'}: no space left on device")
    assert "the next run builds base again" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".base.lock"]


GUARDED = r"""
import errno, os, sys
sys.path.insert(0, {root!r})
from plumbing import cli
def main():
    kind = sys.argv[1]
    if kind == "oserror":
        raise OSError(errno.ENOSPC, "No space left on device", "runs/x/tensorboard/events")
    if kind == "writefailed":
        raise cli.WriteFailed("runs/x/summary.json", "read-only file system")
    raise RuntimeError("a bug")
cli.cli_guard(main)()
"""


@pytest.mark.parametrize("kind, needle", [
    ("oserror", "cannot write runs/x/tensorboard/events: no space left on device"),
    ("writefailed", "cannot write runs/x/summary.json: read-only file system")])
def test_an_entry_point_ends_a_failed_write_in_one_line_exit_3(kind, needle):
    """cli_guard: WriteFailed, or an error any writer raises on a full disk on the way up, is one line and exit 3
    (WRITE_FAILED); any other error keeps its traceback."""
    proc = subprocess.run([sys.executable, "-c", GUARDED.format(root=str(ROOT)), kind], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == plumbing.cli.WRITE_FAILED == 3 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {needle}") and "Traceback" not in proc.stderr
    bug = subprocess.run([sys.executable, "-c", GUARDED.format(root=str(ROOT)), "bug"], capture_output=True, text=True,
                         timeout=120)
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "RuntimeError: a bug" in bug.stderr


# ------------------------------------------------------------------------------------------------ one run per folder
HOLDER = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import plumbing.run
lock = plumbing.run.hold_out_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_held_out_dir_is_one_line_and_touches_nothing(tmp_path):
    """Two real processes: while one holds --out, `train.py --out` there exits 2 in one line naming its pid and
    command, and every file in the folder keeps its bytes and times; once the holder is killed (SIGKILL: no handler
    runs) the folder is free at once."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "run_config.json").write_text('{"argv": []}')
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT)), str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--steps", "2", "--out", str(out)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("[")]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert lines[0].startswith(f"error: --out {out} is in use by another run (pid {holder.pid}: ")
        assert "time.sleep(600)" in lines[0] or "-c" in lines[0], lines[0]
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
        assert not (tmp_path / "runs").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    lock = plumbing.run.hold_out_dir(out)  # a killed holder's lock is gone with it
    assert lock is not None
    assert json.loads((out / ".run.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_process_that_runs_again_lets_go_of_its_earlier_run(tmp_path):
    """The tests and the notebooks' workers run train.main many times in one process: each start() lets go of the
    folder the run before held, and a run's lock goes when its Setup does."""
    a = plumbing.run.hold_out_dir(tmp_path)
    b = plumbing.run.hold_out_dir(tmp_path)  # the same process again: the earlier hold is let go first
    assert a.file is None and b.file is not None
    del b
    import fcntl
    with open(tmp_path / ".run.lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nobody holds it


def test_only_rank_0_holds_the_out_dir(tmp_path, monkeypatch):
    """Under the deepspeed launcher every rank of one run shares --out: rank 0 holds it, the others hold nothing."""
    monkeypatch.setenv("RANK", "1")
    assert plumbing.run.hold_out_dir(tmp_path) is None and not (tmp_path / ".run.lock").exists()


# ------------------------------------------------------------------------------------------------ unsafe weights
class Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_model_whose_pickle_would_run_code_is_one_line(tmp_path, capsys):
    """pytorch_model.bin that runs code when unpickled: refused before any load, in one line naming the file and the
    global, and the code never runs; a plain state dict in the same format passes, and a directory with
    model.safetensors (which from_pretrained reads instead) is not held up by a .bin beside it."""
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.zeros(2), "x": Evil(tmp_path / "PWNED")}, model / "pytorch_model.bin")
    with pytest.raises(SystemExit) as e:
        pipeline.check_weights(model)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {model / 'pytorch_model.bin'}: its pickle would run code on loading (")
    assert "system" in lines[0] and "weights_only=True" in lines[0]
    assert not (tmp_path / "PWNED").exists()
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model.bin")
    pipeline.check_weights(model)
    torch.save({"x": Evil(tmp_path / "PWNED")}, model / "pytorch_model.bin")
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    pipeline.check_weights(model)
    assert not (tmp_path / "PWNED").exists()


# ------------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("argv, needle", [
    (["--method", "dpo", "--preset", "vanilla", "--steps", "1"], "--preset vanilla with --method dpo"),
    (["--method", "dpo", "--kl-coef", "0.1"], "--kl-coef with --method dpo: only PPO reads it"),
    (["--method", "best-of-n", "--policy-init", "pretrained"], "--policy-init with --method best-of-n"),
    (["--method", "best-of-n", "--save-every", "2", "--heldout-every", "4"],
     "--save-every, --heldout-every with --method best-of-n"),
    (["--dpo-beta", "0.2"], "--dpo-beta with --method ppo: --method dpo reads it"),
    (["--method", "dpo", "--bon-n", "4"], "--bon-n with --method dpo: --method best-of-n reads it"),
    (["--rollout-batch", "3", "--minibatch", "2"], "--minibatch 2: must divide --rollout-batch 3"),
    (["--rollout-batch", "64", "--minibatch", "48"], "--minibatch 48: must divide --rollout-batch 64"),
    (["--advantage", "grpo", "--group-size", "4", "--critic-lr", "1e-5", "--lam", "0.5"],
     "--critic-lr, --lam with --advantage grpo"),
    (["--break-at", "5", "--steps", "2"], "--break-at 5: the run's steps are 0 … 1"),
    (["--break-at", "2", "--steps", "2"], "--break-at 2"),
    (["--policy-lr", "-1e-5"], "--policy-lr -1e-05: must be ≥ 0"),
    (["--clip-eps", "-2.5E-1"], "--clip-eps -0.25: must be ≥ 0"),
    (["--kl-coef", "-inf"], "--kl-coef -inf: must be a finite number"),
    (["--preset", "vanilla", "--kl-target", "0.1"], "--kl-target 0.1: acts only with --kl-coef > 0"),
    (["--kl-horizon", "100"], "--kl-horizon 100: acts only with --kl-target > 0"),
    (["--entropy-clip", "1"], "--entropy-clip 1.0: acts only with --entropy-coef > 0"),
    (["--adv-clip", "0.5"], "--adv-clip 0.5: acts only with --adv-norm"),
    (["--preset", "vanilla", "--reward-clip", "3"], "--reward-clip 3.0: acts only with --reward-norm"),
    (["--ptx-coef", "0", "--ptx-data", "sft"], "--ptx-data 'sft': acts only with --ptx-coef > 0"),
    (["--heldout-every", "0", "--heldout-samples", "2"], "--heldout-samples 2"),
    (["--overlong-penalty", "0.5"], "--overlong-penalty 0.5: acts only with --overlong-buffer > 0"),
    (["--rollout-correction-cap", "3"], "--rollout-correction-cap 3.0: acts only with --rollout-correction"),
    (["--advantage", "rloo", "--group-size", "2", "--critic-pretrain-target", "returns"],
     "--critic-pretrain-target with --advantage rloo"),
    (["--advantage", "grpo", "--group-size", "4", "--critic-pretrain-steps", "5"],
     "--critic-pretrain-steps with --advantage grpo: it sets the critic, and --advantage grpo has none; drop it"),
    (["--preset", "dapo", "--critic-pretrain-steps", "5"], "--critic-pretrain-steps with --advantage grpo"),
    (["--lora-dropout", "0.1"], "--lora-dropout: sets LoRA's adapters"),
    (["--skip-bad"], "--skip-bad: reads --data"),
    (["--vocab-size", "500"], "--vocab-size: reads --data"),
    (["--data", "tests/conftest.py", "--world-n-sft", "10"], "--world-n-sft: the synthetic world's flag"),
])
def test_a_flag_the_run_would_ignore_or_cannot_run_is_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        plumbing.flags.parse_configs(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_resume_with_rebuild_base_is_one_line(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit) as e:
        plumbing.flags.parse_configs(["--resume", str(tmp_path), "--rebuild-base"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --rebuild-base with --resume"), err


@pytest.mark.parametrize("argv, note", [
    (["--method", "dpo", "--steps", "4", "--rollout-batch", "16", "--minibatch", "8", "--critic-pretrain-steps", "4"],
     "[flags] --method dpo trains no PPO: --steps 4, --rollout-batch 16, --minibatch 8, --critic-pretrain-steps 4 "
     "not used"),
    (["--method", "best-of-n", "--preset", "ppo-max"], "[flags] --method best-of-n trains no PPO: --preset ppo-max "
                                                       "not used"),
    (["--advantage", "grpo", "--group-size", "4", "--critic-pretrain-steps", "0"], None),  # 0 = off: accepted
    (["--method", "best-of-n", "--bon-n", "4", "--dpo-epochs", "1"],
     "[flags] --method best-of-n trains no DPO: --dpo-epochs 1.0 not used"),
    (["--no-reward-norm", "--reward-clip", "0", "--method", "ppo"], None),
    (["--method", "dpo", "--max-new-tokens", "8", "--policy-init", "pretrained"], None),
])
def test_a_budget_is_accepted_and_said_once_where_unused(argv, note):
    """One budget for every method (notebooks/runs.py's small budget, the tests' TINY lists): where a method without
    PPO does not use it, it is accepted and said in one line; 0 = off is always accepted."""
    run, _, _, cfg, _, dpo_cfg = plumbing.flags.parse_configs(argv)
    assert plumbing.flags.ignored_budget(run, cfg, plumbing.flags.given_flags(argv), dpo_cfg) == note


def test_keep_last_0_says_it_keeps_every_checkpoint():
    import dataclasses
    import plumbing.config
    help_ = {f.name: f.metadata["help"] for f in dataclasses.fields(plumbing.config.RunConfig)}["keep_last"]
    assert "0 = keep every checkpoint" in help_


# ------------------------------------------------------------------------------------------------ a stage's result
class _Tokenizer:
    """What lora.save asks of a tokenizer: save_pretrained(dir), here one small file (or the error `fails`)."""

    def __init__(self, fails: Exception | None = None):
        self.fails = fails

    def save_pretrained(self, out_dir):
        if self.fails is not None:
            raise self.fails
        (Path(out_dir) / "tokenizer.json").write_text("{}")


def test_a_stage_result_that_cannot_be_written_keeps_the_earlier_one(tmp_path):
    """lora.save (every stage's final model: SFT, the reward model, DPO, the policy and critic) writes beside its
    directory and renames it into place: a full disk half-way is one WriteFailed naming the directory, the earlier
    result is left whole and no temporary directory stays; a save that succeeds replaces the earlier one."""
    from plumbing import lora
    models, _ = tiny_models()
    out = tmp_path / "policy"
    lora.save(models["policy"], out, _Tokenizer())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "model.safetensors" in before and "tokenizer.json" in before
    with torch.no_grad():
        models["policy"].lm_head.weight.add_(1.0)
    with pytest.raises(WriteFailed) as e:
        lora.save(models["policy"], out, _Tokenizer(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert str(e.value).startswith(f"cannot write {out}: no space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    (tmp_path / "policy.tmp-1").mkdir()  # a save killed mid-way earlier: cleared by the next one
    lora.save(models["policy"], out, _Tokenizer())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    after = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert torch.equal(after["lm_head.weight"], models["policy"].lm_head.weight)


def test_no_room_for_a_checkpoint_is_said_before_the_first_ppo_step(tmp_path, monkeypatch):
    """A disk without room for one checkpoint (the weights, and AdamW's two moments that the first step creates) is
    one line before any PPO step, naming the folder, the bytes needed and those free."""
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert checkpoint.check_room(tmp_path, {"policy": model}, {"policy": opt}) == 3 * weights  # no state yet
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2 * weights))
    with pytest.raises(WriteFailed) as e:
        checkpoint.check_room(tmp_path, {"policy": model}, {"policy": opt}, hint="free some space")
    line = str(e.value)
    assert line.startswith(f"cannot write {tmp_path / 'checkpoints'}: no room for a checkpoint before the first PPO "
                           f"step (about {3 * weights:,} bytes needed, ") and line.endswith("; free some space"), line


def test_a_tampered_checkpoint_is_refused_naming_its_file_and_never_the_advice_to_unpickle_it(tmp_path, capsys):
    """An optimizer file replaced by a pickle that runs code, then a truncated one: --resume of the checkpoint, and of
    the run, stops in one line naming the file and why ("not a weights-only file", "truncated"); the code never runs,
    and no line passes on torch's advice to load it with weights_only set to False."""
    models, optimizers = tiny_models()
    save_checkpoint(tmp_path, 1, models=models, optimizers=optimizers)
    step = tmp_path / "checkpoints" / "step-000001"
    marker = tmp_path / "PWNED"
    torch.save({"state": {}, "x": Evil(marker)}, step / "optimizer-policy.pt")
    complete = json.loads((step / checkpoint.COMPLETE).read_text())
    complete["files"]["optimizer-policy.pt"] = (step / "optimizer-policy.pt").stat().st_size  # a careful tamperer
    (step / checkpoint.COMPLETE).write_text(json.dumps(complete))
    lines = []
    for target in (step, tmp_path):
        with pytest.raises(SystemExit) as e:
            plumbing.flags.configure(["--resume", str(target)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert "optimizer-policy.pt: not a weights-only file (" in err[0] and "never loaded" in err[0], err
        lines += err
    assert lines[1].startswith(f"error: --resume {tmp_path}: no intact checkpoint there; the newest is refused: ")
    with open(step / "optimizer-policy.pt", "r+b") as fh:  # now cut short
        fh.truncate(100)
    with pytest.raises(SystemExit):
        plumbing.flags.configure(["--resume", str(step)])
    lines += capsys.readouterr().err.strip().splitlines()
    assert "optimizer-policy.pt has 100 bytes" in lines[-1] and "truncated" in lines[-1], lines[-1]
    assert not marker.exists()
    assert not any(re.search(r"weights_only.{0,20}False", l) for l in lines), lines


def test_no_message_of_the_project_advises_weights_only_false():
    """No string the project's code prints holds torch's advice to load a file with weights_only=False."""
    said = []
    for path in [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py"), *ROOT.glob("tools/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.search(r"weights_only\W{0,4}(=|set to)\W{0,4}False", node.value):
                said.append(f"{path.name}:{node.lineno}")
    assert not said, said


def test_help_shows_no_empty_default_and_a_tools_help_is_whole_sentences(capsys):
    """`train.py --help` never shows `(default: )` or `(default: None)` (--out's default is said in its help), and
    `tools/tiny_model.py --help` describes itself in whole sentences, not a first line cut mid-sentence."""
    with pytest.raises(SystemExit):
        plumbing.flags.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: )" not in text and "(default: None)" not in text and "--overwrite" in text
    import tiny_model
    with pytest.raises(SystemExit):
        tiny_model.main(["--help"])
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description.endswith("can run on a CPU with nothing downloaded."), description
