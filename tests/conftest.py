"""Test set-up: put the repo root on sys.path, and let a teacher point the equation tests at a student's code.

Assignment mode (see TEACHING.md): `PPO_MAX_IMPL=handout/ pytest tests/test_gae.py` makes `import gae`,
`import ppo_loss`, `import reward_model` and `import ppo_max` load the student's files from that folder (where there
is one); every other module (data, engine, ...) still comes from the repository. A relative PPO_MAX_IMPL is taken
from the repository root, so it names the same folder whatever the current directory (tools/assignment.py's
impl_folder; the exercises notebook reads it the same way).
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tools"))  # the tools (tiny_model, bench, gpu_check, assignment) import as modules too

if os.environ.get("PPO_MAX_IMPL"):
    import assignment

    try:
        assignment.import_from(assignment.impl_folder(os.environ["PPO_MAX_IMPL"]))
    except assignment.ImplFolderError as e:
        raise SystemExit(f"error: {e}") from None
