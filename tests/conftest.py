"""Test set-up: put the repo root on sys.path, and let a teacher point the equation tests at a student's code.

Assignment mode (see README, "Teaching"): `PPO_MAX_IMPL=/path/to/student pytest tests/test_gae.py` makes
`import gae`, `import ppo_loss`, `import reward_model` pick the student's files from that folder first, so the
same tests that prove our implementation grade theirs.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tools"))  # the tools (tiny_model, bench, gpu_check, assignment) import as modules too

_impl = os.environ.get("PPO_MAX_IMPL")
if _impl:
    if not Path(_impl).is_dir():
        raise SystemExit(f"PPO_MAX_IMPL={_impl!r} is not a directory")
    sys.path.insert(0, str(Path(_impl).resolve()))
