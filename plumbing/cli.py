"""Command-line plumbing: dataclass fields that become flags, the range every flag must lie in, and one-line errors.

Implements (no equation; nothing here is part of the algorithm, and no equation file imports it):
    arg(default, help, allowed)   → a dataclass field whose help becomes `--help` and whose `allowed` range or choices
                                    every run checks before any work (">=1", "(0,1)", "k1|k2|k3", ...)
    allowed(cls)                  → {field name: allowed spec} of a config dataclass
    check_value(value, spec)      → what is wrong with a value under a spec (None if nothing)
    check_flags(args, ranges)     → an argparse result's flags each within its spec, else one line naming the flag
    UserError, fail(message)      → a user's mistake: one line `error: …` on stderr, exit status 2, no traceback
    WriteFailed, WRITE_FAILED     → a file the run could not write (a full disk, a read-only folder): one line naming
                                    the path, exit status 3 (work up to the last complete checkpoint is kept)
    write_failure(exc, path)      → an error as WriteFailed when it is a failure to write (errno, safetensors' and
                                    torch.save's own errors), else None
    OneLineParser                 → argparse whose own errors are such lines, and whose values may be negative numbers
                                    in any notation (--policy-lr -1e-5)
    cli_guard(main)               → an entry point whose UserError / FileNotFoundError / WriteFailed become such lines,
                                    and whose Ctrl-C or SIGTERM ends in one: what it stopped, what is kept, the command
                                    that continues (interrupt_note)

Exit statuses of train.py and the other entry points: 0 done (or stopped by a signal, resumable); 1 stopped on
non-finite values (monitor.NonFiniteGuard); 2 a mistake, found before any work; 3 a write failed during the run.

Run: python train.py --clip-eps -1        (error: --clip-eps -1.0: must be ≥ 0; exit 2)
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import os
import re
import shutil
import sys
from pathlib import Path
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
    "[0,1)", or "a|b|c" (choices). Numbers must also be finite. None (an optional flag left unset, whose help says
    what that means, e.g. --clip-eps-high) is always allowed."""
    if value is None:
        return None
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


WRITE_FAILED = 3  # the exit status of a run that could not write a file (cli_guard)


class WriteFailed(Exception):
    """A file the run could not write (write_failure makes one): `path`, the `reason`, whether the disk is
    `full` and the bytes the write `needed` when known, and a `hint` of what to do next. Its line says, for a full
    disk, the bytes free on that file system when it is printed (after the partial files are gone). cli_guard prints
    it as one line `error: …` and exits WRITE_FAILED. Not an OSError, so that no `except OSError` on the way up takes
    it for a file that could not be read."""

    def __init__(self, path, reason: str, needed: int | None = None, full: bool = False, hint: str = ""):
        super().__init__(str(path), reason)
        self.path, self.reason, self.needed, self.full, self.hint = str(path), reason, needed, full, hint

    def __str__(self) -> str:
        line = f"cannot write {self.path}: {self.reason}"
        if self.full:
            where = _existing(self.path)
            try:
                shown = os.path.relpath(where)
                free = f"{shutil.disk_usage(where).free:,} bytes free on {where if shown.startswith('..') else shown}"
            except (OSError, ValueError):
                free = "free space unknown"
            line += f" ({'' if self.needed is None else f'about {self.needed:,} bytes needed, '}{free})"
        return line + (f"; {self.hint}" if self.hint else "")


# errors that only a write raises: with any of these an error is a failure to write wherever it comes from
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# what torch.save's zip writer says when a write fails (it names neither the file nor the cause: a full disk reads
# "unexpected pos 666432 vs 666320"); its reader's errors say PytorchStreamReader
TORCH_WRITER = ("PytorchStreamWriter", "unexpected pos", "file write failed")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # safetensors' (Rust's) spelling of an errno


def write_failure(exc: BaseException, path: str | os.PathLike | None = None, needed: int | None = None,
                  hint: str = "", writing: bool = False) -> WriteFailed | None:
    """`exc` as a cli.WriteFailed when it is a failure to write, else None (a bug, or a file that could not be
    read, stays what it is). writing=True: `exc` came out of a write (of `path`), so any OSError, safetensors I/O
    error or torch writer error is one; otherwise only the errors no read raises (ENOSPC, EDQUOT, EFBIG, EROFS, and
    torch's writer). `path` is what the line names (else the file the OSError names); `needed` the bytes the write
    needed, when known; `hint` what the reader can do next (e.g. the checkpoint --resume continues from). A full
    disk is ENOSPC / EDQUOT, or an error without an errno (torch's) with less than `needed` (or 1 MiB) left free."""
    if isinstance(exc, WriteFailed):
        return exc
    causes, e = [], exc  # exc and what it was raised from (not what it was raised while handling: that may be any)
    while e is not None and len(causes) < 10:
        causes.append(e)
        e = e.__cause__
    os_error = next((e for e in causes if isinstance(e, OSError) and e.errno), None)
    code = os_error.errno if os_error is not None else None
    io_error = any(type(e).__name__ == "SafetensorError" and "I/O error" in str(e) for e in causes)
    if code is None and io_error:
        found = next((m for e in causes for m in [_OS_ERROR.search(str(e))] if m), None)
        code = int(found.group(1)) if found else None
    chain, e = [], exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    torch_writer = any(isinstance(e, RuntimeError) and any(t in str(e) for t in TORCH_WRITER) for e in chain)
    if not (code in WRITE_ERRNOS or torch_writer or (writing and (code is not None or io_error))):
        return None
    where = path if path is not None else (os_error.filename if os_error is not None and os_error.filename else None)
    full = code in FULL_ERRNOS or (code is None and _free_bytes(where) < max(needed or 0, 1 << 20))
    if full:
        reason = "no space left on device"
    elif code is not None:
        reason = os.strerror(code).lower()
    else:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return WriteFailed(where if where is not None else "a file", reason, needed=needed if full else None, full=full,
                       hint=hint)


def _free_bytes(path) -> int:
    """Bytes free to this user on the file system of `path` (its nearest existing folder); a large number when it
    cannot be told."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 1 << 62


def _existing(path) -> Path:
    p = Path(path if path is not None else ".").absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


# a value that is a negative number, in the notations float() reads: -1, -.5, -1e-5, -2.5E+3, -inf
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose own errors (a value that is not a number, an unknown flag, a missing one) are one line and
    exit 2, like every other user mistake here. A negative number after a flag is its value in any notation
    (argparse alone takes `-1e-5` for a flag and says the value is missing); the range check then says what is
    wrong with it. Never a prefix of a flag for the flag (allow_abbrev=False): `--rollout-batch` must not be read as
    `--rollout-batch-per-gpu` when only the longer one is a flag of the parser."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str) -> None:
        fail(f"{message} ({self.prog} --help lists every flag)")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, where it has one to show: not `(default: )` or `(default: None)` (a flag
    whose help says what leaving it unset means, or whose default comes from a preset)."""

    def _get_help_string(self, action):
        if action.default in ("", None):
            return action.help
        return super()._get_help_string(action)


# what a Ctrl-C or SIGTERM now stops: the stage, what of the run is kept, the command that continues (interrupt_note)
INTERRUPT = {"during": "", "kept": "", "again": ""}
_SIGNAL = {"name": ""}


def interrupt_note(during: str | None = None, kept: str | None = None, again: str | None = None) -> None:
    """Say what a Ctrl-C or SIGTERM from now on interrupts (`during`: the stage), what of the run is kept by then,
    and the command that continues it; cli_guard prints them as one line. Arguments left None stay as they were."""
    for key, value in (("during", during), ("kept", kept), ("again", again)):
        if value is not None:
            INTERRUPT[key] = value


def interrupted_line() -> str:
    """The one line a run stopped by a signal outside the PPO loop ends with (the loop has its own, monitor.py)."""
    name, note = _SIGNAL["name"] or "SIGINT", INTERRUPT
    line = f"[{name}] stopped" + (f" during {note['during']}" if note["during"] else "")
    line += f"; kept: {note['kept']}" if note["kept"] else ""
    return line + (f"; continue with: {note['again']}" if note["again"] else "")


def _sigterm(signum, frame):
    _SIGNAL["name"] = "SIGTERM"
    raise KeyboardInterrupt


def cli_guard(fn: Callable) -> Callable:
    """Wrap a CLI entry point: UserError (data.DataError among them) / FileNotFoundError → one line `error: …` on
    stderr, exit 2; WriteFailed, or any other error of a write that failed on the way (a full disk, a read-only
    folder, a quota: write_failure tells them from other errors) → one line naming the file, exit 3."""
    def wrapped(*args, **kwargs):
        import signal
        try:  # SIGTERM as Ctrl-C: the stage stops, and the run ends in one line (interrupted_line)
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _sigterm)
        except ValueError:  # not the main thread: signals stay as they are
            pass
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            print(interrupted_line(), file=sys.stderr)
            raise SystemExit(0 if INTERRUPT["again"] else 130) from None
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
        except FileNotFoundError as e:
            print(f"error: {e.filename or ''}: {e.strerror or e}".replace("\n", " "), file=sys.stderr)
        except WriteFailed as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(WRITE_FAILED) from None
        except Exception as e:
            failed = write_failure(e)
            if failed is None:
                raise
            print(f"error: {failed}", file=sys.stderr)
            raise SystemExit(WRITE_FAILED) from None
        raise SystemExit(2)
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped

