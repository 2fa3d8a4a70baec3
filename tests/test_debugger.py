"""Stepping through one PPO iteration in pdb, as the README's "Step through one iteration" says: `python -m pdb
train.py --break-at 0 --critic-pretrain-steps 0 ...` stops at the top of iteration 0, `n` walks steps (0)-(7) with one
stop per statement (each numbered call on one line, its result printable right after it), and Ctrl-C inside a step
breaks into pdb instead of checkpointing and exiting (monitor.GracefulExit leaves SIGINT to a debugger); `s` on a
numbered call enters the recipe's function at once (no decorator between), and the steps spent under the debugger
are not counted as the PPO stage's time. pdb is driven through its stdin, as a person would type, in a folder of the
test's own (the README's commands never touch a user's runs/)."""
import ast
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plumbing import monitor

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
         "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--eval-samples", "1", "--threads", "1"]


class Session:
    """A child process whose stdout is read on a thread, so the test can wait for a prompt and then type."""

    def __init__(self, cmd: list[str], cwd: Path):
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=0)
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while c := self.proc.stdout.read(1):
            self.out.append(c)

    @property
    def text(self) -> str:
        return "".join(self.out)

    def wait_for(self, what: str, count: int = 1, timeout: float = 180) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.text.count(what) >= count:
                return time.time() - t0
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {what!r} (x{count}) from {self.proc.args}; output ends:\n{self.text[-3000:]}")

    def type(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")

    def stop_after(self, command: str) -> str:
        """Type `command` and wait for pdb's next prompt; returns what pdb wrote in between."""
        count = self.text.count("(Pdb)")
        self.type(command)
        self.wait_for("(Pdb)", count + 1)
        return self.text.rsplit("(Pdb)", 2)[-2]


def where(stop: str) -> tuple[int, str]:
    """(line, source) of a pdb stop in train.ppo: `> …/train.py(LINE)ppo()` then `-> SOURCE`."""
    found = re.search(r"train\.py\((\d+)\)ppo\(\)\n-> (.*)\n", stop)
    assert found, stop
    return int(found[1]), found[2]


def statement_starts(function: str) -> set[int]:
    """The first line of every statement of train.py's `function`: the lines where `n` may stop."""
    tree = ast.parse((ROOT / "train.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {n.lineno for n in ast.walk(fn) if isinstance(n, ast.stmt)}


# the README's table ("Step through one iteration"): the line of train.ppo that carries each numbered step, and what
# to print once `n` has run it
STEPS = {"(0)": ("lr_scale = ", ("p lr_scale", "1.0")), "(1)": ("= sampler(", ("p response.shape", "torch.Size([16, ")),
         "(2)-(5)": ("ppo_max.make_experience(", ('p exp["advantages"].shape', "torch.Size([16, ")),
         "(6)": ("ppo_max.ppo_update(", ('p "loss/pg" in upd', "True")), "(7)": ("loop.end_step(", None)}


def step_starts() -> dict[str, int]:
    """The first statement after each `# (k)` comment of train.ppo: {"(0)": line, "(1)": line, ...}."""
    lines = (ROOT / "train.py").read_text().splitlines()
    starts, label = {}, None
    for i, line in enumerate(lines, 1):
        found = re.match(r"\s*# (\(\d\)(?:-\(\d\))?) ", line)
        if found:
            label = found[1].replace("-", "–")
        elif label and line.strip() and not line.strip().startswith("#"):
            starts.setdefault(label, i)
    return starts


def stops_per_step(lines: list[int]) -> dict[str, int]:
    """How many of pdb's stops (`n`) fall in each numbered step, from its first line to the next step's."""
    starts = sorted(step_starts().items(), key=lambda kv: kv[1])
    bounds = [(name, first, nxt) for (name, first), (_, nxt) in zip(starts, starts[1:] + [("", 10 ** 9)])]
    return {name: sum(first <= line < nxt for line in lines) for name, first, nxt in bounds}


def readme_n_column() -> dict[str, int]:
    """The README's "Step through one iteration" table: {step: its `n` column}."""
    rows = re.findall(r"^\| (\(\d\)(?:–\(\d\))?) \| (\d+) \|", (ROOT / "README.md").read_text(), re.M)
    return {name: int(n) for name, n in rows}


def test_the_readme_names_every_numbered_step():
    assert set(readme_n_column()) == set(step_starts()) == {"(0)", "(1)", "(2)–(5)", "(6)", "(7)"}


@pytest.mark.slow
def test_pdb_stops_at_iteration_zero_and_ctrl_c_breaks_into_it(tmp_path):
    train = str(ROOT / "train.py")
    base = subprocess.run([sys.executable, train, *SMALL, "--stages", "sft,rm"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # the cached base, so the timed part is what a second run costs
    assert base.returncode == 0, base.stderr[-2000:]
    out = tmp_path / "run"
    s = Session([sys.executable, "-m", "pdb", train, *SMALL, "--steps", "50", "--critic-pretrain-steps", "0",
                 "--break-at", "0", "--save-every", "0", "--out", str(out)], tmp_path)
    try:
        s.wait_for("(Pdb)")                                   # pdb's first stop: train.py's first line
        t0 = time.time()
        s.type("c")
        s.wait_for("(Pdb)", 2)                                # --break-at 0: the top of iteration 0
        seconds = time.time() - t0
        stop = s.text.rsplit("(Pdb)", 2)[-2]
        assert "train.py" in stop and "ppo()" in stop and "lr_scale" in stop, stop
        s.type("p step")
        s.wait_for("(Pdb) 0\n")
        print(f"pdb reached PPO iteration 0 in {seconds:.1f} s (the base cached)")
        # `n` from (0) to the next iteration's loop head: one stop per statement, none on a continuation line, and
        # one stop at each line of the README's table, after which its values print
        stops = [where(stop)]
        while "loop.end_step(" not in stops[-1][1] and len(stops) < 40:
            stops.append(where(s.stop_after("n")))
            for name, (line, printed) in STEPS.items():
                if printed and line in stops[-2][1]:
                    assert printed[1] in s.stop_after(printed[0]), (name, s.text[-2000:])
        stops.append(where(s.stop_after("n")))
        assert "for step in loop.steps()" in stops[-1][1], stops
        assert {line for line, _ in stops} <= statement_starts("ppo"), stops
        assert len({line for line, _ in stops}) == len(stops), stops
        named = [name for _, code in stops for name, (line, _) in STEPS.items() if line in code]
        assert named == list(STEPS), stops
        assert readme_n_column() == stops_per_step([line for line, _ in stops[:-1]]), stops
        # `s` on the (2)-(5) line of the next iteration enters ppo_max.make_experience in one press
        while "ppo_max.make_experience(" not in stops[-1][1] and len(stops) < 60:
            stops.append(where(s.stop_after("n")))
        entered = s.stop_after("s")
        assert re.search(r"ppo_max\.py\(\d+\)make_experience\(\)", entered), entered
    finally:
        s.proc.kill()
        s.proc.wait(30)
    # Ctrl-C with no breakpoint set: pdb's own SIGINT handler, installed by `c`, must still be the one that runs
    s = Session([sys.executable, "-m", "pdb", train, *SMALL, "--steps", "200", "--critic-pretrain-steps", "0",
                 "--save-every", "0", "--out", str(out)], tmp_path)
    try:
        s.wait_for("(Pdb)")
        s.type("c")
        s.wait_for("4. PPO")                                  # the loop is running
        time.sleep(2)                                         # inside some step by now
        s.proc.send_signal(signal.SIGINT)                     # Ctrl-C
        s.wait_for("Program interrupted", timeout=60)         # pdb's own message: we are in the debugger
        s.wait_for("(Pdb)", 2, timeout=60)
        assert "received: finishing this step" not in s.text  # GracefulExit did not take Ctrl-C
        assert s.proc.poll() is None                          # still running, waiting at the prompt
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    finally:
        s.proc.kill()
        s.proc.wait(30)


def test_graceful_exit_leaves_ctrl_c_to_a_debugger():
    """With a tracing function set (what pdb does while stepping), GracefulExit takes SIGTERM but not SIGINT."""
    before = signal.getsignal(signal.SIGINT)
    old_trace = sys.gettrace()
    sys.settrace(lambda *a: None)
    try:
        assert monitor.debugger_active()
        with monitor.GracefulExit() as stop:
            assert signal.getsignal(signal.SIGINT) is before
            assert signal.getsignal(signal.SIGTERM) == stop._handler
    finally:
        sys.settrace(old_trace)
    if old_trace is None and not isinstance(getattr(before, "__self__", None), __import__("bdb").Bdb):
        assert not monitor.debugger_active()
        with monitor.GracefulExit() as stop:               # no debugger: Ctrl-C is ours
            assert signal.getsignal(signal.SIGINT) == stop._handler


def test_steps_under_a_debugger_are_not_counted_as_the_stage_time():
    """A step during which a debugger traces the process (pdb stepping) is left out of the PPO stage's seconds."""
    import types

    class Log:  # what LoopPlumbing reads of a RunLog
        def steps(self, start, total, bar=True):
            return range(start, total)

        def close(self):
            pass

    run = types.SimpleNamespace(steps=3, break_at=-1, heldout_every=0)
    loop = monitor.LoopPlumbing(run, Log(), None, None, None, None, None, "cpu", start=0)
    old = sys.gettrace()
    with loop:
        for step in loop.steps():
            if step == 1:                      # pdb steps through iteration 1 for a while
                sys.settrace(lambda *a: None)
                time.sleep(0.5)
            elif step == 2:
                sys.settrace(old)
    assert loop.debugged >= 0.5 and loop.seconds < 0.4, (loop.debugged, loop.seconds)
