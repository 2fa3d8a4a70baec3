"""Checkpoints: exact resume (weights, optimizer, every RNG stream), atomic saves, keep-last, signals, NaN guard."""
import json
import os
import random
import signal
import time

import numpy as np
import pytest
import safetensors.torch
import torch

from plumbing.checkpoint import find_latest, load_checkpoint, save_checkpoint
from plumbing.monitor import GracefulExit, NonFiniteGuard
import plumbing.config


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is fastest, and avoids 100× slow-downs on a shared, busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------------
# A tiny policy (Llama) and critic (ScalarHeadModel) with AdamW, as train.py has them
# ------------------------------------------------------------------------------------------------------
def tiny_setup(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    from reward_model import ScalarHeadModel

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    policy, critic = LlamaForCausalLM(config), ScalarHeadModel(LlamaForCausalLM(config))
    popt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    copt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    return policy, critic, popt, copt


def train_step(policy, critic, popt, copt) -> None:
    """One update whose data comes from the global torch RNG, so it depends on the restored stream too."""
    ids = torch.randint(0, 50, (2, 6))  # (B, L)
    loss = policy(input_ids=ids, labels=ids).loss + critic(ids, torch.ones_like(ids)).pow(2).mean()
    popt.zero_grad()
    copt.zero_grad()
    loss.backward()
    popt.step()
    copt.step()


def draws(prompt_rng: random.Random) -> tuple:
    return (prompt_rng.random(), random.random(), float(np.random.rand()), torch.rand(3).tolist())


def weights(*models) -> list[torch.Tensor]:
    return [t.detach().clone() for m in models for t in m.state_dict().values()]


class Fake:
    """Stands in for a model where only the file layout matters (keeps those tests fast)."""

    def save_pretrained(self, d):
        os.makedirs(d)
        safetensors.torch.save_file({"w": torch.zeros(2)}, os.path.join(d, "model.safetensors"))


def save_fake(run, step, **kw):
    return save_checkpoint(run, step, models={"m": Fake()}, **kw)


# ------------------------------------------------------------------------------------------------------
# Exact resume
# ------------------------------------------------------------------------------------------------------
def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    policy, critic, popt, copt = tiny_setup()
    for _ in range(2):
        train_step(policy, critic, popt, copt)  # AdamW now has exp_avg, exp_avg_sq, step
    prompt_rng = random.Random(123)
    prompt_rng.random()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 2, models={"policy": policy, "critic": critic},
                           optimizers={"policy": popt, "critic": copt}, rngs={"prompt": prompt_rng},
                           extra_state={"moments": {"count": 8, "mean": 0.5, "var": 2.0}, "kl_coef": 0.05})
    saved_opt = {k: v.clone() for k, v in popt.state_dict()["state"][0].items()}

    # the uninterrupted run: the next draws of every stream, and the weights after one more update
    expected_draws = draws(prompt_rng)
    train_step(policy, critic, popt, copt)
    expected_weights = weights(policy, critic)

    # perturb everything the checkpoint should restore
    with torch.no_grad():
        for p in list(policy.parameters()) + list(critic.parameters()):
            p.add_(torch.randn_like(p))
    train_step(policy, critic, popt, copt)
    draws(prompt_rng)
    params_before = [id(p) for p in policy.parameters()]

    state = load_checkpoint(tmp_path, models={"policy": policy, "critic": critic},
                            optimizers={"policy": popt, "critic": copt}, rngs={"prompt": prompt_rng})
    assert state["step"] == 2 and state["path"] == str(path)
    assert state["extra_state"] == {"moments": {"count": 8, "mean": 0.5, "var": 2.0}, "kl_coef": 0.05}
    # loaded in place: the optimizer still holds the very same parameter objects
    assert [id(p) for p in policy.parameters()] == params_before == [id(p) for p in popt.param_groups[0]["params"]]
    for k, v in saved_opt.items():
        torch.testing.assert_close(popt.state_dict()["state"][0][k], v, rtol=0, atol=0)

    assert draws(prompt_rng) == expected_draws
    train_step(policy, critic, popt, copt)
    for got, want in zip(weights(policy, critic), expected_weights):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_checkpoint_files_are_safetensors_and_weights_only(tmp_path):
    policy, critic, popt, copt = tiny_setup()
    train_step(policy, critic, popt, copt)
    path = save_checkpoint(tmp_path, 1, models={"policy": policy, "critic": critic},
                           optimizers={"policy": popt, "critic": copt}, rngs={"prompt": random.Random(0)})
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert {"policy/model.safetensors", "critic/model.safetensors", "critic/value_head.safetensors",
            "optimizer-policy.pt", "optimizer-critic.pt", "rng.pt", "state.json", "COMPLETE"} <= files
    assert not any(f.endswith((".bin", ".pkl", ".pickle")) for f in files)
    for pt in path.glob("*.pt"):
        torch.load(pt, weights_only=True)  # raises if anything but tensors and plain containers were pickled
    marker = json.loads((path / "COMPLETE").read_text())
    assert set(marker["files"]) == files - {"COMPLETE"}
    # each model directory is an ordinary Hugging Face directory
    from reward_model import ScalarHeadModel
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(ScalarHeadModel.from_pretrained(path / "critic").score(ids, torch.ones_like(ids)),
                                   critic.score(ids, torch.ones_like(ids)), rtol=0, atol=0)


def test_checkpoint_tied_embeddings_load_in_place(tmp_path):
    policy, critic, popt, copt = tiny_setup(tie=True)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    want = weights(policy)
    save_checkpoint(tmp_path, 0, models={"policy": policy})
    with torch.no_grad():
        policy.model.embed_tokens.weight.zero_()
    load_checkpoint(tmp_path, models={"policy": policy}, restore_rng=False)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    for got, w in zip(weights(policy), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def test_checkpoint_named_torch_and_numpy_generators(tmp_path):
    gens = {"torch": torch.Generator().manual_seed(7), "numpy": np.random.default_rng(7), "py": random.Random(7)}
    save_fake(tmp_path, 0, rngs=gens)
    want = (torch.rand(2, generator=gens["torch"]).tolist(), gens["numpy"].random(2).tolist(), gens["py"].random())
    load_checkpoint(tmp_path, rngs=gens)
    got = (torch.rand(2, generator=gens["torch"]).tolist(), gens["numpy"].random(2).tolist(), gens["py"].random())
    assert got == want


# ------------------------------------------------------------------------------------------------------
# Atomicity, latest, keep-last
# ------------------------------------------------------------------------------------------------------
def test_checkpoint_crash_midway_keeps_previous(tmp_path, monkeypatch):
    policy, critic, popt, copt = tiny_setup()
    models, opts = {"policy": policy, "critic": critic}, {"policy": popt, "critic": copt}
    first = save_checkpoint(tmp_path, 1, models=models, optimizers=opts)

    def boom(d):
        os.makedirs(d)
        (open(os.path.join(d, "model.safetensors"), "wb")).write(b"half a file")
        raise RuntimeError("disk full")

    monkeypatch.setattr(critic, "save_pretrained", boom)  # the policy is written, then the critic fails
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, models=models, optimizers=opts)
    root = tmp_path / "checkpoints"
    assert find_latest(tmp_path) == first and (root / "latest").read_text() == "step-000001\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]

    # a save killed by the OS leaves its .tmp-* directory behind, even one that got as far as COMPLETE
    leftover = root / "step-000003.tmp-99999"
    leftover.mkdir()
    (leftover / "COMPLETE").write_text("{}")
    assert find_latest(tmp_path) == first and find_latest(root) == first
    assert load_checkpoint(tmp_path, models={"policy": policy}, restore_rng=False)["step"] == 1
    monkeypatch.undo()
    save_checkpoint(tmp_path, 4, models=models)
    assert not leftover.exists(), "the next save removes stale temporary directories"


def test_checkpoint_find_latest_falls_back_without_latest_file(tmp_path):
    assert find_latest(tmp_path) is None
    for step in (3, 10, 7):
        save_fake(tmp_path, step, keep_last=0)
    root = tmp_path / "checkpoints"
    assert find_latest(tmp_path).name == "step-000007"  # `latest` = the last one written
    (root / "latest").write_text("step-000999\n")  # names a directory that does not exist
    assert find_latest(tmp_path).name == "step-000010"
    (root / "latest").unlink()
    assert find_latest(root).name == "step-000010"
    assert find_latest(root / "step-000003").name == "step-000003"  # a checkpoint directory itself
    (root / "step-000010" / "COMPLETE").unlink()
    assert find_latest(tmp_path).name == "step-000007"


def test_checkpoint_keep_last(tmp_path):
    for step in range(1, 6):
        save_fake(tmp_path, step, keep_last=3)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000003", "step-000004", "step-000005"]
    # resuming from an earlier step and saving: the new checkpoint is never the one deleted
    save_fake(tmp_path, 2, keep_last=3)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002", "step-000004", "step-000005"]
    assert find_latest(tmp_path).name == "step-000002"
    save_fake(tmp_path, 2, keep_last=1)  # the same step again replaces it
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]


def test_checkpoint_detects_truncated_file_and_bad_state(tmp_path):
    path = save_fake(tmp_path, 5)
    with open(path / "m" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(OSError, match="truncated"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="plain JSON"):
        save_fake(tmp_path, 6, extra_state={"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="plain JSON"):
        save_fake(tmp_path, 6, extra_state={"x": float("nan")})
    assert not (tmp_path / "checkpoints" / "step-000006").exists()
    with pytest.raises(KeyError, match="policy"):
        load_checkpoint(save_fake(tmp_path, 7), models={"policy": torch.nn.Linear(2, 2)})


# ------------------------------------------------------------------------------------------------------
# Signals and the NaN guard
# ------------------------------------------------------------------------------------------------------
def _wait_for(cond, seconds=2.0):
    end = time.time() + seconds
    while not cond() and time.time() < end:
        time.sleep(0.01)


def test_graceful_exit_sigterm_sets_flag_and_restores():
    calls = []
    old = signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    try:
        outer = signal.getsignal(signal.SIGTERM)
        with GracefulExit() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(lambda: stop.requested)
            assert stop.requested and stop.signal_name == "SIGTERM" and calls == []  # alive, flag set
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal goes to the handler that was there before
            _wait_for(lambda: calls)
            assert calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, old)


def test_graceful_exit_sigint_does_not_raise():
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN when started in the background
    with GracefulExit() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: stop.requested)
        assert stop.signal_name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("previous", [signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler])
def test_graceful_exit_restores_whatever_handler_was_there(previous):
    """A shell starts a background job with SIGINT ignored; GracefulExit hands back exactly the handler it found,
    after one signal and after two (the second goes to that handler; with SIG_IGN, nothing happens)."""
    old = signal.signal(signal.SIGINT, previous)
    try:
        with GracefulExit() as stop:
            assert signal.getsignal(signal.SIGINT) is not previous
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: stop.requested)
        assert signal.getsignal(signal.SIGINT) is previous
        if previous is signal.SIG_IGN:
            with GracefulExit() as stop:
                os.kill(os.getpid(), signal.SIGINT)
                _wait_for(lambda: stop.requested)
                os.kill(os.getpid(), signal.SIGINT)  # the second one goes to SIG_IGN
                _wait_for(lambda: signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_nonfinite_guard_nan_and_consecutive():
    log = []
    guard = NonFiniteGuard(max_consecutive=3, log=log.append)
    good = {"scores": torch.tensor([1.0, 2.0]), "loss": 0.5, "grad_norm": torch.tensor(3.0), "n": torch.tensor([1])}
    assert guard.check(0, good) is None
    guard.ok()
    bad = {"scores": torch.tensor([1.0, 2.0]), "loss": torch.tensor(float("nan")), "grad_norm": float("inf")}
    assert guard.check(1, bad) == "loss"  # the first non-finite one, in the order given
    assert log == ["step 1: non-finite loss; update skipped (1/3 consecutive)"]
    assert guard.check(1, {"advantages": torch.tensor([float("-inf")])}) == "advantages"
    assert guard.consecutive == 1, "a step counts once however many checks fail in it"
    assert guard.check(2, {"grad_norm": float("inf")}) == "grad_norm" and not guard.should_stop
    guard.ok()  # a good step in between resets the count
    for step in range(3, 6):
        assert not guard.should_stop
        assert guard.check(step, {"scores": np.array([np.nan, 1.0])}) == "scores"
    assert guard.should_stop and guard.skipped == 5 and log[-1].endswith("(3/3 consecutive)")
    restored = NonFiniteGuard(3)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.should_stop and restored.skipped == 5


# ------------------------------------------------------------------------------------------------------
# Damage never costs more than one checkpoint
# ------------------------------------------------------------------------------------------------------
def test_truncated_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    from plumbing.checkpoint import damage, find_intact
    policy, critic, popt, copt = tiny_setup()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, models={"policy": policy, "critic": critic})
    newest = tmp_path / "checkpoints" / "step-000002"
    weights_file = newest / "policy" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:100])           # a disk that filled up mid-copy
    said = []
    assert "truncated" in damage(newest) and find_intact(tmp_path, log=said.append).name == "step-000001"
    assert len(said) == 1 and "step-000002" in said[0] and "\n" not in said[0]
    with pytest.raises(ValueError, match="truncated"):                 # asked for by name: refused, not replaced
        find_intact(newest)
    (tmp_path / "checkpoints" / "step-000001" / "state.json").write_text("{not json")
    assert find_intact(tmp_path, log=said.append) is None               # none intact: the caller stops (exit 2)


@pytest.mark.parametrize("name, offset", [("optimizer-policy.pt", 0), ("rng.pt", 0), ("rng.pt", 100)])
def test_overwritten_pt_file_of_the_same_size_is_damage(tmp_path, name, offset):
    """Bytes overwritten in an optimizer or RNG file keep its size: it still unpickles or it is damage, so the run
    resumes from the checkpoint before it instead of ending in an UnpicklingError traceback."""
    from plumbing.checkpoint import damage, find_intact
    policy, critic, popt, copt = tiny_setup()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, models={"policy": policy}, optimizers={"policy": popt},
                        rngs={"prompt": random.Random(0)})
    newest = tmp_path / "checkpoints" / "step-000002"
    raw = bytearray((newest / name).read_bytes())
    raw[offset:offset + 50] = b"\xff" * 50
    (newest / name).write_bytes(bytes(raw))
    assert "unreadable" in damage(newest)
    assert find_intact(tmp_path, log=lambda line: None).name == "step-000001"


KILLER = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from transformers import LlamaConfig, LlamaForCausalLM
from plumbing.checkpoint import save_checkpoint
cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=4)
model = LlamaForCausalLM(cfg)
for step in range(1, 1000):
    save_checkpoint(sys.argv[1], step, models={"policy": model}, keep_last=2)
    print(step, flush=True)
"""


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_save_leaves_an_intact_checkpoint(tmp_path):
    """Really kill a process (SIGKILL: no handler runs) while it writes checkpoints back to back: what is left is
    the newest intact checkpoint plus a half-written temporary directory that nothing mistakes for one."""
    import subprocess
    import sys
    from pathlib import Path

    from plumbing.checkpoint import damage, find_intact
    root = Path(__file__).resolve().parents[1]
    half_written = 0
    for delay in (0.05, 0.15, 0.3):  # three moments within the saves (100 MB each: ~0.1-0.5 s here)
        run = tmp_path / f"run{delay}"
        proc = subprocess.Popen([sys.executable, "-c", KILLER, str(run), str(root)], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        while line.startswith("["):  # DeepSpeed's log line, when transformers' saving imports it (via accelerate)
            line = proc.stdout.readline()
        assert line.strip() == "1"                                       # one checkpoint written, the next under way
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        ckpt = find_intact(run)
        assert ckpt is not None and damage(ckpt) is None
        from transformers import LlamaForCausalLM
        LlamaForCausalLM.from_pretrained(ckpt / "policy")               # and it loads
        assert all(".tmp-" in p.name or damage(p) is None for p in (run / "checkpoints").glob("step-*"))
        half_written += any(".tmp-" in p.name for p in (run / "checkpoints").glob("step-*"))
    assert half_written >= 1, "no kill landed inside a save: the test did not test what it says"


BUILD_TWICE = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from plumbing.checkpoint import build_once
base, me = Path(sys.argv[2]), sys.argv[3]
(base.parent / f"ready-{me}").touch()
while not (base.parent / "go").exists():  # both processes reach build_once together
    time.sleep(0.01)

def build(tmp):
    with open(base.parent / "builds.txt", "a") as f:
        f.write(me + "\n")
    time.sleep(2.0)  # long enough for the other process to find the base missing
    (tmp / "weights").write_text(me)

path, built = build_once(base, build, "a test base")
print("got", (path / "weights").read_text(), "built" if built else "reused")
"""


def test_two_processes_needing_one_missing_base_build_it_once(tmp_path):
    """Two runs started together in one folder need the same base: one builds it, the other waits on its lock and
    reuses it (and says it did not build it), and both end with the one built directory (without the lock both build
    into one .tmp directory)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = tmp_path / "_base" / "seed0-test"
    base.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_TWICE, root, str(base), me], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for me in ("a", "b")]
    deadline = time.time() + 120
    while not all((base.parent / f"ready-{me}").exists() for me in ("a", "b")) and time.time() < deadline:
        time.sleep(0.05)
    (base.parent / "go").touch()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    builders = (base.parent / "builds.txt").read_text().split()
    assert len(builders) == 1, outs
    assert all(f"got {builders[0]}" in out for out in outs), outs
    builder, waiter = sorted(outs, key=lambda out: f"got {builders[0]} built" not in out)
    assert f"got {builders[0]} built" in builder and f"got {builders[0]} reused" in waiter, outs
    assert "waiting for another process" in waiter and "built by another process meanwhile" in waiter, waiter
    assert (base / "DONE").exists() and not (base.parent / "seed0-test.tmp").exists()


def test_a_cached_base_damaged_since_it_was_built_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """runs/_base is reused as it is: a safetensors header or JSON file overwritten since is named (with the flag that
    rebuilds it) before anything loads it, not a SafetensorError or UnicodeDecodeError traceback later."""
    from plumbing import pipeline
    import toy_world
    import train
    from plumbing.checkpoint import unreadable
    base = tmp_path / "base"
    (base / "sft").mkdir(parents=True)
    safetensors.torch.save_file({"w": torch.zeros(3)}, str(base / "sft" / "model.safetensors"))
    (base / "tokenizer.json").write_text('{"version": "1.0"}')
    assert unreadable(base) is None
    monkeypatch.setattr(pipeline.checkpoint, "build_once", lambda *a, **k: (base, False))
    for name, garble in (("tokenizer.json", lambda b: b"\xff" * len(b)), ("sft/model.safetensors", lambda b: b[:20])):
        good = (base / name).read_bytes()
        (base / name).write_bytes(garble(good))
        assert unreadable(base).startswith(f"{base / name}: unreadable")
        with pytest.raises(SystemExit) as e:
            pipeline.build_base(plumbing.config.RunConfig(), plumbing.config.SFTConfig(), plumbing.config.RMConfig(), toy_world.WorldConfig())
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and name in err[0] and "--rebuild-base" in err[0], err
        (base / name).write_bytes(good)


def test_a_build_that_fails_leaves_no_half_built_directory(tmp_path):
    from plumbing.checkpoint import build_once

    def build(tmp):
        (tmp / "half").write_text("x")
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        build_once(tmp_path / "base", build, "a test base")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".base.lock"]  # no base, no base.tmp
