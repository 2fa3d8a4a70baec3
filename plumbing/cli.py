"""Command-line plumbing: dataclass fields that become flags, the range every flag must lie in, and one-line errors.

Implements (no equation; nothing here is part of the algorithm, and no equation file imports it):
    arg(default, help, allowed)   → a dataclass field whose help becomes `--help` and whose `allowed` range or choices
                                    every run checks before any work (">=1", "(0,1)", "k1|k2|k3", ...)
    allowed(cls)                  → {field name: allowed spec} of a config dataclass
    check_value(value, spec)      → what is wrong with a value under a spec (None if nothing)
    check_flags(args, ranges)     → an argparse result's flags each within its spec, else one line naming the flag
    UserError, fail(message)      → a user's mistake: one line `error: …` on stderr, exit status 2, no traceback
    OneLineParser                 → argparse whose own errors are such lines
    cli_guard(main)               → an entry point whose UserError / FileNotFoundError become such lines

Run: python train.py --clip-eps -1        (error: --clip-eps -1.0: must be ≥ 0; exit 2)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable


def arg(default, help: str, allowed: str | None = None):
    """A dataclass field whose help text becomes a `--flag` help in train.py; `allowed` is its valid range or choices
    in check_value's language, checked for every run before any stage."""
    return dataclasses.field(default=default, metadata={"help": help, "allowed": allowed})


def allowed(cls) -> dict[str, str]:
    """{field name: allowed spec} for the fields of a config dataclass that declare one."""
    return {f.name: f.metadata["allowed"] for f in dataclasses.fields(cls) if f.metadata.get("allowed")}


def check_value(value, spec: str) -> str | None:
    """What is wrong with a flag's value under `spec` (None if nothing): ">0", ">=0", ">=1", "[0,1]", "(0,1)",
    "[0,1)", or "a|b|c" (choices). Numbers must also be finite."""
    if "|" in spec:
        choices = spec.split("|")
        return None if str(value) in choices else f"choose one of {', '.join(choices)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number {spec}"
    if not math.isfinite(value):
        return "must be a finite number"
    if spec.startswith(">="):
        return None if value >= float(spec[2:]) else f"must be ≥ {spec[2:]}"
    if spec.startswith(">"):
        return None if value > float(spec[1:]) else f"must be > {spec[1:]}"
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    ok = (value >= lo if spec[0] == "[" else value > lo) and (value <= hi if spec[-1] == "]" else value < hi)
    return None if ok else f"must be in {spec}"


def check_flags(args, ranges: dict[str, str]) -> None:
    """Each flag of `ranges` ({attribute of the parsed args: check_value spec}) within its range, else one line
    naming it (fail)."""
    for name, spec in ranges.items():
        value = getattr(args, name)
        problem = check_value(value, spec)
        if problem:
            fail(f"--{name.replace('_', '-')} {value!r}: {problem}")


class UserError(Exception):
    """A mistake of the user's (bad data, a bad path, a bad configuration): cli_guard prints str() as one line."""


def fail(message: str) -> None:
    """A user's mistake: one line on stderr, exit 2 (as cli_guard)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose own errors (a value that is not a number, an unknown flag, a missing one) are one line and
    exit 2, like every other user mistake here."""

    def error(self, message: str) -> None:
        fail(f"{message} ({self.prog} --help lists every flag)")


def cli_guard(fn: Callable) -> Callable:
    """Wrap a CLI entry point: UserError (data.DataError among them) / FileNotFoundError → one line `error: …` on
    stderr, exit 2."""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
        except FileNotFoundError as e:
            print(f"error: {e.filename or ''}: {e.strerror or e}".replace("\n", " "), file=sys.stderr)
        raise SystemExit(2)
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped

