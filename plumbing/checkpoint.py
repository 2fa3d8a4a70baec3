"""Checkpoints that survive crashes and resume exactly, a clean exit on SIGINT/SIGTERM, and a non-finite guard.

Implements (no equation: the engineering a 10,000-step run such as the paper's Fig. 9 needs on a shared cluster):
    save_checkpoint(run_dir, step, models=, optimizers=, ...)  → run_dir/checkpoints/step-000123/, written into a
                                                                  temporary directory, fsynced, renamed into place
    find_latest(path)                                          → the newest *complete* checkpoint, or None
    find_intact(path) / damage(ckpt)                           → the newest complete one whose files all have the
                                                                  sizes COMPLETE recorded (resume falls back to it)
    load_checkpoint(ckpt_dir, models=, optimizers=, rngs=)     → weights, optimizer/scheduler states and every RNG
                                                                  stream restored in place; returns state.json
    writing(path, needed, hint)                                → a block whose failed write (a full disk, a read-only
                                                                  folder, a quota) leaves as cli.WriteFailed: one line
                                                                  naming the path, on a full disk the bytes needed
                                                                  and free (cli.write_failure tells it from a bug)
    RunCheckpoints(out, models, optimizers, rngs, ...)         → the PPO loop's save(step, state) and resume(path),
                                                                  one process or DeepSpeed engines alike
    build_once(dir, build)                                     → (a cached stage directory, built here?): the base,
                                                                  built in a temporary directory, renamed when DONE,
                                                                  one process at a time (exclusive(.dir.lock))
    seed_everything(seed), config_hash(obj)                    → python / numpy / torch seeded; a stable short hash

(SIGINT/SIGTERM and the non-finite guard, which decide when the loop checkpoints: monitor.py's GracefulExit and
NonFiniteGuard.)

Run: python -m plumbing.checkpoint      (saves a tiny model, perturbs everything, resumes; prints the layout and proof)

Layout of one run directory (only one process, rank 0, writes it):
    checkpoints/latest                  "step-000123\n", replaced atomically (write a temp file, os.replace)
    checkpoints/step-000123/
        policy/  critic/                 save_pretrained() directories (safetensors; the critic adds value_head.*),
                                         with the tokenizer's files when one is given, so each is from_pretrained-ready
        optimizer-policy.pt  ...         torch.save(optimizer.state_dict()): tensors, numbers, lists only
        scheduler-policy.pt  ...         the same for LR schedulers
        rng.pt                           python `random`, numpy, torch CPU (+ CUDA) states, and named generators
        state.json                       {"step", "extra_state", and what the files hold}
        COMPLETE                         written last: the file names and sizes. No COMPLETE → not a checkpoint
    checkpoints/step-000124.tmp-4242/   a save in progress (or killed mid-way): ignored, removed by the next save

Why each step of a save:
    * Write into `step-N.tmp-<pid>` and `os.replace` it to `step-N` only once every file is fsynced and COMPLETE
      exists: a rename within one file system is atomic, so a reader sees the old set of checkpoints or the new
      one, never a half-written directory that looks complete (a crash in save_pretrained leaves only a .tmp-*).
    * fsync the files, then the directory: without it a power loss after the rename can leave the new name
      pointing at empty files (ext4 / xfs delayed allocation).
    * A write that fails (ENOSPC: the disk is full) removes the `.tmp-*` directory and ends the run with one line
      (cli.WriteFailed) naming the file, the bytes the checkpoint needs and those free: the newest complete
      checkpoint is untouched (older ones are deleted only after a new one is complete), so `--resume` continues
      from it once there is room.
    * `latest` is written after the rename; if it is missing or names a deleted directory, find_latest falls back
      to the highest complete step-N.
    * Loading never unpickles code: weights through safetensors, the rest through torch.load(weights_only=True)
      (whose unpickler admits only tensors and plain containers) and JSON.

Under DeepSpeed, save the engines with `engine.save_checkpoint` (ZeRO shards the optimizer state across ranks);
this file handles the single-process case, the RNG streams and the run state around it.

References:
    Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", section 5.2 and Fig. 9 (long runs).
    POSIX rename(2) atomicity; "Files are hard" (Dan Luu, 2015) on fsync of the file and its directory.
"""
import contextlib
import errno
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import safetensors.torch
import torch

from plumbing.cli import WRITE_ERRNOS, WriteFailed, write_failure

CKPT_SUBDIR = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STATE = "state.json"
RNG = "rng.pt"
VALUE_HEAD_WEIGHTS = "value_head.safetensors"  # as written by reward_model.ScalarHeadModel.save_pretrained
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


# ======================================================================================================
# Small file-system helpers: durable writes
# ======================================================================================================
def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories: so that the names created in them are durable too)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # some platforms cannot open a directory; the data files were synced already
        return
    try:
        os.fsync(fd)
    except OSError as e:  # a directory may not sync (some platforms); a file that does not holds lost data
        if e.errno in WRITE_ERRNOS | {errno.EIO} and not path.is_dir():
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


@contextlib.contextmanager
def writing(path: str | os.PathLike, needed: int | None = None, hint: str = ""):
    """The block writes `path`: an error that is a failure to write leaves it as cli.WriteFailed (cli.write_failure,
    writing=True), naming `path`; any other error leaves as it is."""
    try:
        yield
    except Exception as e:
        failed = write_failure(e, path, needed, hint, writing=True)
        if failed is None:
            raise
        raise failed from None


def atomic_write_text(path: Path, text: str, hint: str = "") -> None:
    """Write `text` to `path` so that a reader sees the old content or the new, never a torn file. A failed write
    leaves the old content and no temporary file, and raises cli.WriteFailed naming `path`."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path, len(text.encode()), hint):
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_path(path.parent)


def _checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_SUBDIR


def _step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the step-N directories under `ckpt_root` that hold a COMPLETE marker, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _check_names(kind: str, d: Mapping | None) -> dict:
    d = dict(d or {})
    for name in d:
        if not _NAME_RE.match(name):
            raise ValueError(f"checkpoint.py: {kind} name {name!r} must be letters, digits, '_', '-' or '.' "
                             f"(it becomes a file name)")
    return d


# ======================================================================================================
# RNG streams: python `random`, numpy, torch (CPU and CUDA), and named generators the loop owns
# ======================================================================================================
def _python_state(state: tuple) -> dict:
    version, internal, gauss_next = state  # Mersenne Twister: (3, 625 ints, None or a float)
    return {"kind": "random.Random", "version": version, "internal": list(internal), "gauss_next": gauss_next}


def _rng_to_plain(rng: Any) -> dict:
    """One generator's state as tensors / ints / lists, so torch.load(weights_only=True) can read it back."""
    if isinstance(rng, random.Random):
        return _python_state(rng.getstate())
    if isinstance(rng, torch.Generator):
        return {"kind": "torch.Generator", "state": rng.get_state()}
    if isinstance(rng, np.random.Generator):
        return {"kind": "numpy.Generator", "state": rng.bit_generator.state}
    raise TypeError(f"checkpoint.py: cannot save an RNG of type {type(rng).__name__}; "
                    f"expected random.Random, torch.Generator or numpy.random.Generator")


def _rng_from_plain(rng: Any, saved: dict, name: str) -> None:
    kind = _rng_to_plain(rng)["kind"]
    if saved["kind"] != kind:
        raise TypeError(f"checkpoint.py: rng {name!r} was saved as {saved['kind']} but a {kind} was passed to load")
    if kind == "random.Random":
        rng.setstate((saved["version"], tuple(saved["internal"]), saved["gauss_next"]))
    elif kind == "torch.Generator":
        rng.set_state(saved["state"])
    else:
        rng.bit_generator.state = saved["state"]


def rng_state(rngs: Mapping[str, Any] | None = None) -> dict:
    """All global RNG states (python, numpy, torch CPU, CUDA when present) plus the named generators."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": _python_state(random.getstate()),  # the module-level generator behind random.random()
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),  # ByteTensor
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "named": {name: _rng_to_plain(r) for name, r in (rngs or {}).items()},
    }
    return state


def set_rng_state(state: dict, rngs: Mapping[str, Any] | None = None) -> None:
    """Inverse of rng_state(): every global stream and each named generator continues where it was saved."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("torch_cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            print(f"checkpoint.py: warning: {len(cuda)} CUDA RNG states saved, {torch.cuda.device_count()} devices "
                  f"now; restoring the first {min(len(cuda), torch.cuda.device_count())}", file=sys.stderr)
        for i, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    for name, r in (rngs or {}).items():
        if name not in state["named"]:
            raise KeyError(f"checkpoint.py: rng {name!r} is not in the checkpoint (it has {sorted(state['named'])})")
        _rng_from_plain(r, state["named"][name], name)


# ======================================================================================================
# Save
# ======================================================================================================
def _write_checkpoint(tmp: Path, step: int, models: dict, optimizers: dict, schedulers: dict, rngs: dict,
                      extra_json: str, tokenizer, shown: Path, needed: int, hint: str) -> None:
    """Every file of one checkpoint into `tmp`, fsynced, COMPLETE last. A write that fails raises cli.WriteFailed
    naming the file under `shown` (the checkpoint's own name), `needed` bytes for the whole checkpoint."""
    def file(name: str):
        return writing(shown / name, needed, hint)

    for mname, model in models.items():
        with file(mname):
            model.save_pretrained(tmp / mname)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / mname)
    for oname, opt in optimizers.items():
        with file(f"optimizer-{oname}.pt"):
            torch.save(opt.state_dict(), tmp / f"optimizer-{oname}.pt")
    for sname, sch in schedulers.items():
        with file(f"scheduler-{sname}.pt"):
            torch.save(sch.state_dict(), tmp / f"scheduler-{sname}.pt")
    with file(RNG):
        torch.save(rng_state(rngs), tmp / RNG)
    state = json.loads(extra_json)
    state.update(format=FORMAT_VERSION, models=sorted(models), optimizers=sorted(optimizers),
                 schedulers=sorted(schedulers), rngs=sorted(rngs))
    with file(STATE):
        (tmp / STATE).write_text(json.dumps(state, indent=1) + "\n")
    with writing(shown, needed, hint):
        fsync_tree(tmp)
    # COMPLETE last: the names and sizes of every file, so a loader can also notice a truncated one
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    with file(COMPLETE):
        with open(tmp / COMPLETE, "w") as f:
            json.dump({"step": int(step), "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    _fsync_path(tmp)


def checkpoint_bytes(ckpt: Path | None, models: Mapping[str, Any] = (), optimizers: Mapping[str, Any] = ()) -> int:
    """About what one checkpoint takes on disk: the newest complete one's files (its COMPLETE list), or before the
    first, the tensors of the models' weights and of the optimizers' states."""
    if ckpt is not None:
        try:
            return sum(json.loads((ckpt / COMPLETE).read_text())["files"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass

    def tensors(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, Mapping):
            return sum(tensors(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(tensors(v) for v in x)
        return 0
    total = 0
    for m in dict(models).values():
        if isinstance(m, torch.nn.Module):  # LoRA: a checkpoint holds what trains (its adapters) only
            total += tensors({n: p for n, p in m.named_parameters() if p.requires_grad} if _frozen(m)
                             else m.state_dict())
    for o in dict(optimizers).values():
        sd = getattr(o, "state_dict", None)
        total += tensors(sd()) if callable(sd) else 0
    return total


def check_room(run_dir: str | os.PathLike, models: Mapping[str, Any], optimizers: Mapping[str, Any],
               hint: str = "") -> int:
    """Before the first PPO step: the bytes one checkpoint will take (checkpoint_bytes, with an optimizer that has
    no state yet counted as AdamW's two moments per trained weight), or cli.WriteFailed when the file system of
    `run_dir` has less free, so that a run with no room stops before its steps instead of after them."""
    needed = checkpoint_bytes(find_latest(run_dir), models, optimizers)
    for o in dict(optimizers).values():
        if getattr(o, "state", None) == {} or (isinstance(getattr(o, "state", None), Mapping) and not o.state):
            needed += sum(2 * p.numel() * p.element_size() for g in getattr(o, "param_groups", [])
                          for p in g["params"] if getattr(p, "requires_grad", False))
    free = shutil.disk_usage(_checkpoints_dir(run_dir) if _checkpoints_dir(run_dir).is_dir() else run_dir).free
    if free < needed:
        raise WriteFailed(_checkpoints_dir(run_dir), "no room for a checkpoint before the first PPO step",
                          needed=needed, full=True, hint=hint)
    return needed


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, models: Mapping[str, Any],
                    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
                    schedulers: Mapping[str, Any] | None = None, rngs: Mapping[str, Any] | None = None,
                    extra_state: dict | None = None, tokenizer=None, keep_last: int = 3) -> Path:
    """Write run_dir/checkpoints/step-{step:06d}/ atomically, point `latest` at it, keep the newest `keep_last`.

    models: name → object with save_pretrained(dir) (HF models, reward_model.ScalarHeadModel).
    optimizers / schedulers: name → object with state_dict(); stored with torch.save (tensors and plain data).
    rngs: name → random.Random / torch.Generator / numpy Generator owned by the loop (e.g. the prompt stream's);
        the global python, numpy and torch streams are always saved.
    extra_state: plain JSON (RunningMoments.state_dict(), the KL coefficient, the monitor's state, …).
    keep_last: complete checkpoints to keep; the one just written is never deleted (≤ 0 keeps all).
    Returns the checkpoint directory. A write that fails (a full disk) raises cli.WriteFailed naming the file, the
    bytes a checkpoint needs (checkpoint_bytes) and, with the partial directory removed, those free; any other error
    of a writer is raised as it is. The previous checkpoints are untouched either way.
    """
    models, optimizers, schedulers, rngs = (_check_names(k, d) for k, d in
                                            [("model", models), ("optimizer", optimizers),
                                             ("scheduler", schedulers), ("rng", rngs)])
    extra_state = dict(extra_state or {})
    try:
        extra_json = json.dumps({"step": int(step), "extra_state": extra_state}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint.py: extra_state must be plain JSON (dicts, lists, str, finite numbers); {e}")
    root = _checkpoints_dir(run_dir)
    name = f"step-{int(step):06d}"
    final = root / name
    previous = find_latest(root) if root.is_dir() else None
    needed = checkpoint_bytes(previous, models, optimizers)
    hint = (f"the newest complete checkpoint, {previous}, is intact: with more room, `train.py --resume {run_dir}` "
            f"continues from it" if previous else "no checkpoint of this run was written yet")
    with writing(root, needed, hint):
        root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp-*"):  # earlier saves killed mid-way; one writer per run dir, so none is live
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    for stale in root.glob("*.old-*"):
        shutil.rmtree(stale, ignore_errors=True)

    tmp = root / f"{name}.tmp-{os.getpid()}"
    with writing(final, needed, hint):
        tmp.mkdir()
    hf_logging = sys.modules.get("transformers.utils.logging")  # silence its "Writing model shards" bar
    bar_was_on = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    if bar_was_on:
        hf_logging.disable_progress_bar()
    try:
        _write_checkpoint(tmp, step, models, optimizers, schedulers, rngs, extra_json, tokenizer, final, needed, hint)
    except BaseException:  # an exception (not a kill): remove the partial directory now, re-raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()

    with writing(final, needed, hint):
        if final.exists():  # the same step saved again (e.g. after a resume): move the old one aside first
            old = root / f"{name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)  # the atomic step: from here on step-N is a complete checkpoint
        _fsync_path(root)
    atomic_write_text(root / LATEST, name + "\n", hint=f"{final} is complete; `train.py --resume {run_dir}` continues "
                                                       f"from it")

    if keep_last > 0:
        others = [p for _, p in _step_dirs(root) if p != final]
        for p in others[:max(len(others) - (keep_last - 1), 0)]:  # drop the oldest; the new one always stays
            shutil.rmtree(p, ignore_errors=True)
    return final


# ======================================================================================================
# Find and load
# ======================================================================================================
def held_run(out: str | os.PathLike) -> str | None:
    """What run the folder `out` holds, in words, or None: "a finished run (summary.json)" when its summary is
    written, "an unfinished run (newest checkpoint step-000003)" when it has PPO checkpoints but no summary. A run
    stopped before its first PPO checkpoint holds nothing of its own (stages 1-2 are in the cached base): None."""
    out = Path(out)
    if (out / "summary.json").is_file():
        return "a finished run (summary.json)"
    steps = sorted(p.name for p in (out / CKPT_SUBDIR).glob("step-*")) if (out / CKPT_SUBDIR).is_dir() else []
    return f"an unfinished run (newest checkpoint {steps[-1]})" if steps else None


def _is_complete(d: Path) -> bool:
    return d.is_dir() and (d / COMPLETE).is_file() and ".tmp-" not in d.name and ".old-" not in d.name


def find_latest(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `path`, or None.

    path: a checkpoint directory itself (returned if complete), a run directory (uses run/checkpoints), or the
    checkpoints directory. Uses `latest` when it names a complete checkpoint, else the highest complete step-N.
    Directories without COMPLETE (a save killed mid-way: *.tmp-*) are never returned.
    """
    path = Path(path)
    if _is_complete(path):
        return path
    root = path / CKPT_SUBDIR if (path / CKPT_SUBDIR).is_dir() else path
    latest = root / LATEST
    if latest.is_file():
        cand = root / latest.read_text().strip()
        if _STEP_RE.match(cand.name) and _is_complete(cand):
            return cand
    found = _step_dirs(root)
    return found[-1][1] if found else None


def damage(d: Path) -> str | None:
    """What is wrong with checkpoint `d`, or None when it is intact: COMPLETE must list every file with its size
    (a truncated or missing file is damage), state.json must parse, every safetensors header must read, and every
    .pt file (optimizers, RNG streams) must unpickle; memory-mapped, so its tensors are not read. Bytes overwritten
    inside a tensor's data, with the file's size and headers intact, are not caught here."""
    try:
        listed = json.loads((d / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{COMPLETE} is missing or unreadable"
    for name, size in listed.items():
        p = d / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, {size} when it was written (truncated or overwritten)"
    p = d / STATE
    try:
        json.loads(p.read_text())
        for p in sorted(d.rglob("*.safetensors")):
            with safetensors.safe_open(str(p), framework="pt") as f:
                f.keys()
        for p in sorted(d.rglob("*.pt")):
            torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file is damage, whatever the library raises)
        return f"{p.relative_to(d)}: {refusal(p, e)}"
    return None


def refusal(path: Path, e: Exception) -> str:
    """Why a checkpoint file was not loaded, in a few words of our own: "not a weights-only file (…)" for a pickle
    that names globals beyond tensors and plain containers (never torch's advice to load it with weights_only off,
    which would run that pickle's code), else "unreadable (the error's first line)"."""
    import pickle
    if isinstance(e, pickle.UnpicklingError):
        lines = [l.strip() for l in str(e).splitlines() if "GLOBAL" in l]
        return f"not a weights-only file ({lines[0] if lines else 'its pickle names code to run'}; never loaded)"
    first = next((l.strip() for l in str(e).splitlines() if l.strip()), "")
    if "weights_only" in first:
        first = "not a file torch.load reads as data alone"
    return f"unreadable ({type(e).__name__}: {first})"


def unreadable(d: Path) -> str | None:
    """The first file under `d` that does not read, as `path: unreadable (why)`: a safetensors file whose header
    does not parse, a .json file that is not JSON; None when every one reads. Headers only: tensors are not read."""
    for p in sorted(Path(d).rglob("*")):
        try:
            if p.suffix == ".safetensors":
                with safetensors.safe_open(str(p), framework="pt") as f:
                    f.keys()
            elif p.suffix == ".json":
                json.loads(p.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001  (any unreadable file is damage, whatever the library raises)
            return f"{p}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def unsafe_pickle(path: str | os.PathLike) -> str | None:
    """What keeps a pickled torch checkpoint from loading as data alone (None when nothing does): the globals its
    pickle names beyond the tensors and plain containers of torch.load(weights_only=True), read without running it;
    a file in the legacy format, which cannot be read that way, is loaded with weights_only=True on the CPU. Used to
    refuse a model directory's pytorch_model*.bin in one line before any work (pipeline.check_weights)."""
    import pickle
    import zipfile
    from torch.serialization import get_unsafe_globals_in_checkpoint
    try:
        if zipfile.is_zipfile(path):
            found = get_unsafe_globals_in_checkpoint(path)
            return (f"its pickle would run code on loading ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
                    if found else None)
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [l for l in str(e).splitlines() if "GLOBAL" in l]
        return f"its pickle would run code on loading ({lines[0].strip() if lines else 'a global torch refuses'})"
    except Exception as e:  # noqa: BLE001  (whatever torch raises for a file it cannot read)
        return f"not a readable torch checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def find_intact(path: str | os.PathLike, log: Callable[[str], Any] = print) -> Path | None:
    """The newest checkpoint under `path` that is complete *and* intact (see damage), saying in one line about each
    newer one that is not; None if there is none. A checkpoint directory given itself must be intact: ValueError."""
    path = Path(path)
    if _STEP_RE.match(path.name) and path.is_dir():
        problem = damage(path) if _is_complete(path) else f"not a complete checkpoint (no {COMPLETE})"
        if problem:
            raise ValueError(f"--resume {path}: {problem}")
        return path
    root = path / CKPT_SUBDIR if (path / CKPT_SUBDIR).is_dir() else path
    for _, d in reversed(_step_dirs(root)):
        problem = damage(d)
        if problem is None:
            return d
        log(f"[resume] {d}: {problem}; trying the checkpoint before it")
    return None


def _read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory (one model.safetensors or the shards of its index)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors") if p.name != VALUE_HEAD_WEIGHTS)
    if not files:
        raise FileNotFoundError(f"checkpoint.py: no *.safetensors weights in {str(d)!r}")
    state = {}
    for f in files:
        state.update(safetensors.torch.load_file(str(d / f)))
    return state


def _load_module_in_place(module: torch.nn.Module, d: Path) -> None:
    """Copy the weights saved in `d` into `module`'s existing tensors (so optimizers keep pointing at them). A LoRA
    model's checkpoint holds its adapters only (peft's format); its frozen weights are the stage directory's."""
    if (d / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict
        result = set_peft_model_state_dict(module, safetensors.torch.load_file(str(d / "adapter_model.safetensors")))
        if result.unexpected_keys:
            raise KeyError(f"checkpoint.py: {str(d)!r} holds adapters this model does not have: "
                           f"{result.unexpected_keys[:5]}")
        return
    state = _read_safetensors_dir(d)
    own = module.state_dict()
    unexpected = sorted(set(state) - set(own))
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    # save_pretrained drops one name of each tied pair (lm_head.weight ≡ embed_tokens.weight): fine if tied
    missing = sorted(k for k in set(own) - set(state) if own[k].data_ptr() not in loaded_ptrs)
    if unexpected or missing:
        if hasattr(type(module), "from_pretrained"):  # the HF writer renamed keys (weight conversions): let HF read it
            fresh = type(module).from_pretrained(d, dtype=next(module.parameters()).dtype, trust_remote_code=False)
            module.load_state_dict(fresh.state_dict())
            return
        raise KeyError(f"checkpoint.py: {str(d)!r} does not match the model: unexpected {unexpected[:5]}, "
                       f"missing {missing[:5]}")
    module.load_state_dict(state, strict=False)


def load_model_weights(model: torch.nn.Module, d: str | os.PathLike) -> None:
    """Load a save_pretrained directory into an existing model in place (HF model or ScalarHeadModel)."""
    d = Path(d)
    head_file = d / VALUE_HEAD_WEIGHTS
    if head_file.is_file() and hasattr(model, "lm") and hasattr(model, "head"):  # reward_model.ScalarHeadModel
        _load_module_in_place(model.lm, d)
        model.head.load_state_dict(safetensors.torch.load_file(str(head_file)))
    else:
        _load_module_in_place(model, d)


def load_checkpoint(ckpt_dir: str | os.PathLike, *, models: Mapping[str, torch.nn.Module] | None = None,
                    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
                    schedulers: Mapping[str, Any] | None = None, rngs: Mapping[str, Any] | None = None,
                    restore_rng: bool = True) -> dict:
    """Restore a checkpoint into existing objects, in place; return its state.json ({"step", "extra_state", …}).

    ckpt_dir: a checkpoint directory, or a run / checkpoints directory (its latest complete checkpoint is used).
    Models are loaded before optimizers (the optimizer state is cast to each parameter's device and dtype).
    restore_rng: also restore the global python / numpy / torch streams (and any `rngs` given); needed for an
    exact resume.
    """
    found = find_latest(ckpt_dir)
    if found is None:
        raise FileNotFoundError(f"checkpoint.py: no complete checkpoint in {str(ckpt_dir)!r} (looked for a "
                                f"step-N directory with a {COMPLETE} file, under {CKPT_SUBDIR}/ too)")
    d = found
    marker = json.loads((d / COMPLETE).read_text())
    for rel, size in marker["files"].items():
        if not (d / rel).is_file() or (d / rel).stat().st_size != size:
            raise OSError(f"checkpoint.py: {str(d / rel)!r} is missing or truncated (expected {size} bytes); "
                          f"resume from an older checkpoint in {str(d.parent)!r}")
    state = json.loads((d / STATE).read_text())

    def need(kind: str, names, available):
        absent = sorted(set(names) - set(available))
        if absent:
            raise KeyError(f"checkpoint.py: {kind} {absent} not in {str(d)!r} (it has {sorted(available)})")

    models, optimizers, schedulers = dict(models or {}), dict(optimizers or {}), dict(schedulers or {})
    need("models", models, state["models"])
    need("optimizers", optimizers, state["optimizers"])
    need("schedulers", schedulers, state["schedulers"])
    for name, model in models.items():
        load_model_weights(model, d / name)
    for name, opt in optimizers.items():
        opt.load_state_dict(torch.load(d / f"optimizer-{name}.pt", map_location="cpu", weights_only=True))
    for name, sch in schedulers.items():
        sch.load_state_dict(torch.load(d / f"scheduler-{name}.pt", map_location="cpu", weights_only=True))
    if restore_rng:
        set_rng_state(torch.load(d / RNG, map_location="cpu", weights_only=True), rngs)
    state["path"] = str(d)
    return state


# ======================================================================================================
# The run's wiring: seeds, the cached base, and the PPO loop's checkpoints (one process or DeepSpeed)
# ======================================================================================================
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def config_hash(obj) -> str:
    """12 hex digits of sha256 over `obj` as sorted JSON: the same configuration gives the same name."""
    import hashlib
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


DONE = "DONE"


def build_once(path: str | os.PathLike, build: Callable[[Path], Any], what: str, rebuild: bool = False,
               rank: int = 0, barrier: Callable[[], None] = lambda: None, label: str = "base") -> tuple[Path, bool]:
    """(`path`, whether this process built it): built by build(tmp) into `path`.tmp and renamed into place once
    `tmp/DONE` is written, so a build killed half-way is never mistaken for a finished one. Reused as it is when
    DONE exists, unless `rebuild`.
    A write that fails while it builds (a full disk: safetensors, torch.save or any file; no half-built directory is
    kept) raises cli.WriteFailed naming the file, or the directory when the writer names none.
    Two processes that need the same missing directory (two runs started together in one folder) build it once:
    the second waits on the lock .<name>.lock beside it and then reuses what the first built.
    With several ranks that all build (each holds a DeepSpeed engine), rank 0 alone touches the file system and
    `barrier` keeps the others in step."""
    path = Path(path)
    if (path / DONE).exists() and not rebuild:
        print(f"[{label}] reusing {path} ({what}; --rebuild-base trains it again)")
        return path, False
    waiting = f"[{label}] waiting for another process that is building {path}"
    with exclusive(path.parent / f".{path.name}.lock", waiting) if rank == 0 else contextlib.nullcontext():
        barrier()  # the other ranks wait here while rank 0 waits for the lock
        if (path / DONE).exists() and not rebuild:  # built by the process this one waited for
            print(f"[{label}] reusing {path} ({what}, built by another process meanwhile)")
            barrier()
            return path, False
        tmp = Path(str(path) + ".tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        hint = f"nothing half-built is kept: with more room, the next run builds {path.name} again"
        try:
            build(tmp)
        except BaseException as e:  # a failed build (bad data, a signal) leaves no half-built directory behind
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = write_failure(e, hint=hint) if isinstance(e, Exception) else None
            if failed is None:
                raise
            if failed.path == "a file":  # safetensors and torch name no file: the directory being built
                failed.path = str(path)
            elif str(failed.path).startswith(str(tmp)):  # a file of the build: named where it was to end up
                failed.path = str(path) + str(failed.path)[len(str(tmp)):]
            failed.hint = failed.hint or hint
            raise failed from None
        barrier()
        if rank == 0:
            with writing(path, hint=hint):
                try:
                    (tmp / DONE).write_text("ok\n")
                    shutil.rmtree(path, ignore_errors=True)
                    tmp.rename(path)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        barrier()
    return path, True


@contextlib.contextmanager
def exclusive(path: Path, waiting: str = ""):
    """An exclusive lock on the file `path` (created if missing) for the length of the block: another process that
    asks for it waits, after printing `waiting`. The kernel releases it when the block ends or the process dies, so
    a killed build leaves no stale lock behind. Without fcntl (Windows) it locks nothing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _frozen(model) -> bool:
    """Whether a model has frozen parameters (LoRA's base weights): a checkpoint then saves only what trains."""
    return any(not p.requires_grad for p in model.parameters())


class RunCheckpoints:
    """save(n_done, extra_state) and resume(path) for the PPO loop, whether the models are plain modules or
    DeepSpeed engines.

    Under DeepSpeed the engines save themselves (ZeRO shards the optimizer state across ranks) into
    checkpoints/deepspeed/<name>/step-N/, every rank its RNG streams into checkpoints/deepspeed/rng/; rank 0
    writes the rest with save_checkpoint: from_pretrained-ready weights, the run state, and COMPLETE last.
    """

    def __init__(self, out: Path, models: dict, optimizers: dict, rngs: dict, tokenizer, keep_last: int,
                 rank: int = 0, barrier: Callable[[], None] = lambda: None):
        self.out, self.models, self.optimizers, self.rngs = Path(out), models, optimizers, rngs
        self.tokenizer, self.keep_last, self.rank, self.barrier = tokenizer, keep_last, rank, barrier
        self.engines = any(hasattr(m, "backward") for m in models.values())  # DeepSpeed engines
        self.ds_dir = self.out / CKPT_SUBDIR / "deepspeed"

    def _modules(self) -> dict:
        return {k: m.module if self.engines else m for k, m in self.models.items()}

    def save(self, n_done: int, extra_state: dict) -> Path | None:
        tag = f"step-{n_done:06d}"
        if self.engines:  # every rank: its ZeRO shards and its RNG streams
            hint = (f"`train.py --resume {self.out}` continues from the newest complete checkpoint under "
                    f"{self.ds_dir.parent}")
            for name, engine in self.models.items():  # frozen weights (LoRA's base) come from the stage dirs
                with writing(self.ds_dir / name / tag, hint=hint):
                    engine.save_checkpoint(str(self.ds_dir / name), tag=tag, exclude_frozen_parameters=_frozen(engine))
            with writing(self.ds_dir / "rng" / f"{tag}-rank{self.rank}.pt", hint=hint):
                (self.ds_dir / "rng").mkdir(parents=True, exist_ok=True)
                torch.save(rng_state(self.rngs), self.ds_dir / "rng" / f"{tag}-rank{self.rank}.pt")
            self.barrier()
        path = None
        if self.rank == 0:
            path = save_checkpoint(self.out, n_done, models=self._modules(),
                                   optimizers={} if self.engines else self.optimizers, rngs=self.rngs,
                                   extra_state=extra_state, tokenizer=self.tokenizer, keep_last=self.keep_last)
            if self.engines:  # the engines' states (and RNG files) of the checkpoints save_checkpoint just deleted
                kept = {p.name for p in path.parent.glob("step-*")}
                for old in self.ds_dir.glob("*/step-*"):   # <name>/step-N/, rng/step-N-rank<r>.pt
                    if old.name.split("-rank")[0] not in kept:
                        shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.barrier()
        return path

    def resume(self, path: str | os.PathLike) -> tuple[Path, dict]:
        """Restore the newest complete checkpoint under `path` into the models, optimizers and RNG streams.
        Returns (its directory, its state.json). ValueError when there is none or it was written the other way
        (with engines / without); the caller reports it as one line."""
        ckpt = find_intact(path)
        if ckpt is None:
            raise ValueError(f"--resume {path}: no intact checkpoint there")
        ds_src = ckpt.parent / "deepspeed"  # where save() put the engines' states of this checkpoint
        first = next(iter(self.models))
        if (ds_src / first / ckpt.name).is_dir() != self.engines:
            raise ValueError(f"--resume {ckpt}: written {'without' if self.engines else 'by'} DeepSpeed engines; "
                             f"resume it as it ran")
        state = load_checkpoint(ckpt, models={} if self.engines else self.models,
                                optimizers={} if self.engines else self.optimizers, rngs=self.rngs)
        if self.engines:
            for name, engine in self.models.items():
                engine.load_checkpoint(str(ds_src / name), tag=ckpt.name, load_lr_scheduler_states=False,
                                       load_module_strict=not _frozen(engine))
            set_rng_state(torch.load(ds_src / "rng" / f"{ckpt.name}-rank{self.rank}.pt", weights_only=True), self.rngs)
        return ckpt, state


if __name__ == "__main__":
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    policy = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 8))
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    prompt_rng = random.Random(0)
    with tempfile.TemporaryDirectory() as run:
        path = save_checkpoint(run, 7, models={"policy": policy}, optimizers={"policy": opt},
                               rngs={"prompt": prompt_rng}, extra_state={"kl_coef": 0.05})
        print("saved:", path.relative_to(run), sorted(p.name for p in path.iterdir()))
        before = (prompt_rng.random(), random.random(), np.random.rand(), torch.rand(()).item())
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(1.0)  # perturb the weights; the RNG streams already moved on above
        state = load_checkpoint(run, models={"policy": policy}, optimizers={"policy": opt}, rngs={"prompt": prompt_rng})
        after = (prompt_rng.random(), random.random(), np.random.rand(), torch.rand(()).item())
        print("state:", {k: state[k] for k in ("step", "extra_state")})
        print("next draws identical after resume:", before == after)
    # saved: checkpoints/step-000007 ['COMPLETE', 'optimizer-policy.pt', 'policy', 'rng.pt', 'state.json']
    # state: {'step': 7, 'extra_state': {'kl_coef': 0.05}}
    # next draws identical after resume: True
