"""A Python that has already imported torch, transformers, peft and DeepSpeed, and runs commands as forks of itself:
each one as `python script.py args` or `python -m package.module args` would, without paying those imports again.

Most of a mistake's second in tests/test_errors.py is a fresh interpreter importing torch and transformers; the
mistakes themselves stop before any work. This process imports those libraries once (no module of this project:
each fork imports the project's own as the command would), then reads one JSON job per line on stdin
({"argv", "cwd", "out", "err"}), runs at most two forks at a time (the machine has two cores), and answers
{"job": i, "returncode": rc} for each as it ends. A fork ends the way the interpreter would: SystemExit's code
(its message on stderr and status 1 when it is not a number), a traceback and status 1 on any other exception.

What a fork cannot show is what a fresh interpreter prints while importing those libraries: test_errors.py runs
one mistake of every command as a fresh `python` for that.
"""
import json
import os
import runpy
import sys
import traceback

import deepspeed  # noqa: F401 (imported for the forks)
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

PROJECT = ("train", "eval", "ppo_max", "ppo_loss", "gae", "reward_model", "toy_world", "plumbing", "bench")
assert not [m for m in sys.modules if m.split(".")[0] in PROJECT], "the forks must import the project themselves"


def run_command(argv: list[str]) -> int:
    """argv as `python argv…` would run it, in this (forked) process: its exit status."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()   # what `python -m` puts first (in place of this file's folder)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))   # what `python script.py` puts first
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 — what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1


def fork(job: dict) -> int:
    """Start the job in a child process: its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.chdir(job["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        code = run_command(job["argv"])
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    os._exit(code)


def main() -> None:
    jobs = [json.loads(line) for line in sys.stdin if line.strip()]
    answer = sys.stdout
    running: dict[int, int] = {}   # pid → job index
    todo = list(range(len(jobs)))
    while todo or running:
        while todo and len(running) < 2:
            i = todo.pop(0)
            running[fork(jobs[i])] = i
        pid, status = os.wait()
        i = running.pop(pid)
        answer.write(json.dumps({"job": i, "returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
