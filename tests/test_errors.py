"""No user mistake ends in a traceback: every entry point, given a wrong path, a bad flag, a bad file or a damaged
checkpoint, prints one line `error: …` naming what is wrong and exits with status 2, before doing any work."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import selected, two_at_a_time

ROOT = Path(__file__).resolve().parents[1]
MISTAKES = {  # name: (argv after `python`, what the one line must mention)
    "train_bad_int": (["train.py", "--steps", "x"], "--steps"),
    "train_unknown_flag": (["train.py", "--stepz", "3"], "--stepz"),
    "train_out_of_range": (["train.py", "--clip-eps", "-1"], "--clip-eps"),
    "train_missing_data": (["train.py", "--data", "nowhere.jsonl"], "nowhere.jsonl"),
    "train_bad_data": (["train.py", "--data", "bad.jsonl"], "bad.jsonl:1"),
    "train_resume_nothing": (["train.py", "--resume", "empty"], "no intact checkpoint"),
    "train_missing_model": (["train.py", "--model", "nowhere"], "--model nowhere"),
    "train_wandb_missing": (["train.py", "--log-with", "wandb"], "--log-with wandb"),
    "train_wrong_deepspeed_json": (["train.py", "--deepspeed", "--deepspeed_config", "bad.jsonl"], "bad.jsonl"),
    "eval_no_run": (["eval.py", "--run", "nowhere"], "--run nowhere"),
    "eval_nothing_to_evaluate": (["eval.py"], "--policy is missing"),
    "eval_no_model": (["eval.py", "--policy", "nowhere", "--sft", "nowhere", "--reward-model", "nowhere",
                       "--prompts", "bad.jsonl"], "--policy nowhere"),
    "eval_score_no_model": (["eval.py", "score", "--reward-model", "nowhere", "--data", "bad.jsonl"], "nowhere"),
    "eval_unknown_command": (["eval.py", "plots"], "plots"),
    "eval_plot_not_a_run": (["eval.py", "plot", "empty"], "empty"),
    "monitor_not_a_run": (["monitor.py", "replay", "empty"], "empty"),
    "data_bad_file": (["data.py", "bad.jsonl"], "bad.jsonl:1"),
    "data_missing_file": (["data.py", "nowhere.jsonl"], "nowhere.jsonl"),
    "bench_bad_flag": (["tools/bench.py", "--iters", "0"], "--iters"),
    "bench_bad_config": (["tools/bench.py", "--configs", "huge"], "huge"),
    "scale_missing_model": (["scale.py", "--model", "nowhere"], "nowhere"),
    "tiny_model_bad_arch": (["tools/tiny_model.py", "--arch", "bert", "--out", "m"], "bert"),
    "gpu_check_bad_flag": (["tools/gpu_check.py", "--steps", "0"], "--steps"),
    "train_lora_bad_rank": (["train.py", "--lora-r", "-1"], "--lora-r"),
    "train_lora_no_such_layer": (["train.py", "--lora-r", "4", "--lora-targets", "q_proj,qkv"], "qkv"),
    "train_lora_4bit_on_cpu": (["train.py", "--lora-r", "4", "--lora-bits", "4"], "--lora-bits 4"),
    "train_lora_bits_without_lora": (["train.py", "--lora-bits", "8"], "--lora-r"),
    "lora_merge_not_an_adapter": (["lora.py", "merge", "empty", "--out", "merged"], "empty"),
    "lora_merge_bad_config": (["lora.py", "merge", "bad_adapter", "--out", "merged"], "bad_adapter"),
}


def mistake_dir(root: Path) -> Path:
    """A folder of its own for one mistake: the bad files the argv names, and nothing else (so that "no work left
    behind" is that mistake's alone)."""
    root.mkdir(parents=True)
    (root / "bad.jsonl").write_text("{not json\n")
    (root / "empty").mkdir()
    (root / "bad_adapter").mkdir()
    (root / "bad_adapter" / "adapter_config.json").write_text("{not json")
    return root


def run_mistake(name: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = MISTAKES[name][0]
    return subprocess.run([sys.executable, str(ROOT / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                            "HOME": str(cwd), "HF_HOME": str(cwd / "hf")})


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> dict:
    """Every selected mistake, each a fresh `python` process in its own folder, two at a time: most of each one's
    time is the interpreter importing torch and transformers on one core, and the machine has two."""
    root = tmp_path_factory.mktemp("mistakes")
    names = sorted(selected(request, "test_a_mistake_is_one_line_and_exit_2", "name"))
    dirs = {name: mistake_dir(root / name) for name in names}
    procs = two_at_a_time(lambda name: run_mistake(name, dirs[name]), names)
    return {name: (proc, dirs[name]) for name, proc in zip(names, procs)}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2(name, ran):
    needle = MISTAKES[name][1]
    proc, cwd = ran[name]
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("[")]  # '[' : DeepSpeed's log
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (cwd / "runs").exists() or name.startswith("train_resume"), "a mistake must not leave work behind"
