"""No user mistake ends in a traceback: every entry point, given a wrong path, a bad flag, a bad file or a damaged
checkpoint, prints one line `error: …` naming what is wrong and exits with status 2, before doing any work."""
import json
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
    "monitor_not_a_run": (["plumbing/monitor.py", "replay", "empty"], "empty"),
    "data_bad_file": (["plumbing/data.py", "bad.jsonl"], "bad.jsonl:1"),
    "data_missing_file": (["plumbing/data.py", "nowhere.jsonl"], "nowhere.jsonl"),
    "bench_bad_flag": (["tools/bench.py", "--iters", "0"], "--iters"),
    "bench_bad_config": (["tools/bench.py", "--configs", "huge"], "huge"),
    "scale_missing_model": (["plumbing/scale.py", "--model", "nowhere"], "nowhere"),
    "tiny_model_bad_arch": (["tools/tiny_model.py", "--arch", "bert", "--out", "m"], "bert"),
    "gpu_check_bad_flag": (["tools/gpu_check.py", "--steps", "0"], "--steps"),
    "train_lora_bad_rank": (["train.py", "--lora-r", "-1"], "--lora-r"),
    "train_lora_no_such_layer": (["train.py", "--lora-r", "4", "--lora-targets", "q_proj,qkv"], "qkv"),
    "train_lora_4bit_on_cpu": (["train.py", "--lora-r", "4", "--lora-bits", "4"], "--lora-bits 4"),
    "train_lora_bits_without_lora": (["train.py", "--lora-bits", "8"], "--lora-r"),
    "lora_merge_not_an_adapter": (["plumbing/lora.py", "merge", "empty", "--out", "merged"], "empty"),
    "lora_merge_bad_config": (["plumbing/lora.py", "merge", "bad_adapter", "--out", "merged"], "bad_adapter"),
    # flags a run would ignore, or combinations the loop cannot run (plumbing/config.py: "Flags a run ignores")
    "train_method_ignores_preset": (["train.py", "--method", "dpo", "--preset", "vanilla", "--steps", "1"],
                                    "--preset vanilla with --method dpo"),
    "train_uneven_minibatches": (["train.py", "--rollout-batch", "3", "--minibatch", "2"],
                                 "--minibatch 2: must divide"),
    "train_uneven_minibatches_64_48": (["train.py", "--rollout-batch", "64", "--minibatch", "48"],
                                       "--minibatch 48: must divide --rollout-batch 64"),
    "train_critic_flag_without_critic": (["train.py", "--advantage", "grpo", "--group-size", "4", "--value-clip",
                                          "0.1"], "--value-clip with --advantage grpo"),
    "train_break_at_after_the_run": (["train.py", "--break-at", "5", "--steps", "2"], "--break-at 5"),
    "train_negative_number_value": (["train.py", "--policy-lr", "-1e-5"], "--policy-lr -1e-05: must be ≥ 0"),
    "train_dpo_flag_without_dpo": (["train.py", "--dpo-beta", "0.2"], "--dpo-beta with --method ppo"),
    "train_resume_rebuild_base": (["train.py", "--resume", "empty", "--rebuild-base"], "--rebuild-base with --resume"),
    # the newer tricks' combinations that make no sense (docs/methods.md, "What PPO gained since the paper")
    "train_dynamic_sampling_without_groups": (["train.py", "--dynamic-sampling"], "--dynamic-sampling with --advantage gae"),
    "train_overlong_buffer_beyond_cap": (["train.py", "--overlong-buffer", "30", "--max-new-tokens", "24"],
                                         "--overlong-buffer 30"),
    "train_clip_high_without_clip": (["train.py", "--clip-eps", "0", "--clip-eps-high", "0.28"],
                                     "--clip-eps-high 0.28 with --clip-eps 0"),
    "train_cispo_sequence_ratio": (["train.py", "--policy-loss", "cispo", "--ratio", "sequence"],
                                   "--policy-loss cispo with --ratio sequence"),
    "train_returns_target_without_pretraining": (["train.py", "--critic-pretrain-target", "returns",
                                                  "--critic-pretrain-steps", "0"], "--critic-pretrain-target returns"),
    "train_lam_critic_without_critic": (["train.py", "--advantage", "grpo", "--group-size", "4", "--lam-critic", "1"],
                                        "--lam-critic with --advantage grpo"),
    "train_correction_cap_without_correction": (["train.py", "--rollout-correction-cap", "3"],
                                                "--rollout-correction-cap"),
    "train_cispo_eps_without_cispo": (["train.py", "--cispo-eps-high", "3"], "--cispo-eps-high"),
    "train_cispo_under_a_clip_higher_preset": (["train.py", "--preset", "vapo", "--policy-loss", "cispo"],
                                               "--clip-eps-high 0.28 (--preset vapo sets it)"),
    # a model directory whose pytorch_model.bin would run code when unpickled: refused before it is loaded
    "train_model_pickle_runs_code": (["train.py", "--model", "evil_model", "--data", "bad.jsonl"],
                                     "pytorch_model.bin: its pickle would run code"),
}


def mistake_dir(root: Path) -> Path:
    """A folder of its own for one mistake: the bad files the argv names, and nothing else (so that "no work left
    behind" is that mistake's alone)."""
    root.mkdir(parents=True)
    (root / "bad.jsonl").write_text("{not json\n")
    (root / "empty").mkdir()
    (root / "bad_adapter").mkdir()
    (root / "bad_adapter" / "adapter_config.json").write_text("{not json")
    evil_model(root / "evil_model", root / "PWNED")
    return root


class Evil:
    """An object whose unpickling runs a shell command (what a malicious pytorch_model.bin holds)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def evil_model(path: Path, marker: Path) -> Path:
    """A GPT-2 model folder whose only weights are a pytorch_model.bin that would create `marker` if unpickled."""
    import torch
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                  "vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 1,
                                                  "n_head": 2}))
    torch.save({"transformer.wte.weight": torch.zeros(300, 32), "x": Evil(marker)}, path / "pytorch_model.bin")
    return path


# one mistake of every command runs as a fresh `python` (what a user runs, import-time output included); the others
# as forks of tests/preloaded.py, a Python that has imported torch, transformers, peft and DeepSpeed once
FRESH = {min(n for n in MISTAKES if MISTAKES[n][0][0] == cmd) for cmd in {argv[0] for argv, _ in MISTAKES.values()}}


def command(name: str) -> list[str]:
    """The mistake's argv after `python`: a plumbing/ command runs as a module of the package (python -m
    plumbing.data ...), the others as the script."""
    argv = MISTAKES[name][0]
    script = ["-m", argv[0][:-3].replace("/", ".")] if argv[0].startswith("plumbing/") else [str(ROOT / argv[0])]
    return [*script, *argv[1:]]


def environment(home: Path) -> dict:
    return {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(home),
            "HF_HOME": str(home / "hf")}


def run_mistake(name: str, cwd: Path) -> subprocess.CompletedProcess:
    """The mistake in a fresh interpreter, in its folder."""
    return subprocess.run([sys.executable, *command(name)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=environment(cwd))


def run_forked(names: list[str], dirs: dict, root: Path) -> dict:
    """The mistakes as forks of tests/preloaded.py (two at a time), each in its folder: name → CompletedProcess."""
    if not names:
        return {}
    jobs = [{"argv": command(n), "cwd": str(dirs[n]), "out": str(root / f"{n}.out"), "err": str(root / f"{n}.err")}
            for n in names]
    server = subprocess.run([sys.executable, str(ROOT / "tests" / "preloaded.py")], cwd=root, capture_output=True,
                            text=True, timeout=600, env=environment(root),
                            input="".join(json.dumps(j) + "\n" for j in jobs))
    assert server.returncode == 0, server.stderr[-3000:]
    answers = [json.loads(l) for l in server.stdout.splitlines() if l.startswith('{"job"')]   # DeepSpeed logs too
    codes = {a["job"]: a["returncode"] for a in answers}
    assert sorted(codes) == list(range(len(jobs))), server.stdout
    return {n: subprocess.CompletedProcess(j["argv"], codes[i], Path(j["out"]).read_text(), Path(j["err"]).read_text())
            for i, (n, j) in enumerate(zip(names, jobs))}


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> dict:
    """Every selected mistake in a folder of its own: one of each command as a fresh `python` process (two at a time),
    the rest forked from a Python that imported torch and transformers once (most of a fresh one's time is those
    imports: a mistake stops before any work)."""
    root = tmp_path_factory.mktemp("mistakes")
    names = sorted(selected(request, "test_a_mistake_is_one_line_and_exit_2", "name"))
    dirs = {name: mistake_dir(root / name) for name in names}
    fresh = [n for n in names if n in FRESH]
    procs = dict(zip(fresh, two_at_a_time(lambda name: run_mistake(name, dirs[name]), fresh)))
    procs.update(run_forked([n for n in names if n not in FRESH], dirs, root))
    return {name: (procs[name], dirs[name]) for name in names}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2(name, ran):
    needle = MISTAKES[name][1]
    proc, cwd = ran[name]
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("[")]  # '[' : DeepSpeed's log
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (cwd / "runs").exists() or name.startswith("train_resume"), "a mistake must not leave work behind"
    assert not (cwd / "PWNED").exists(), "no code of a model's pickle ran"


# ---- the same, in-process: eval.py's flags, output paths and damaged files, each caught before any work ----------

def one_line_error(main, argv: list[str], capsys, *needles: str) -> str:
    """main(argv) exits 2 with one line `error: …` on stderr that names every needle; returns that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert e.value.code == 2 and "Traceback" not in err, (e.value.code, err[-1500:])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def fake_run(path: Path, summary: bytes | None = None) -> Path:
    """A run directory by hand: three steps of metrics.jsonl, models that are folders with a config.json and, for
    the reward model, the name of a trained head (enough for every check; nothing here loads), held-out prompts, and
    a summary.json naming them."""
    (path / "data").mkdir(parents=True)
    for name in ("policy", "sft", "reward_model"):
        (path / name).mkdir()
        (path / name / "config.json").write_text("{}")
    (path / "reward_model" / "value_head.safetensors").write_bytes(b"")
    (path / "data" / "prompts_heldout.jsonl").write_text('{"prompt": "name 2 fruits ."}\n')
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "kl/ref": 0.01}}\n' for s in range(3)))
    default = {"base": str(path), "steps": 3, "win_rate_vs_sft": {"win": 0.5, "tie": 0.0, "lose": 0.5}}
    (path / "summary.json").write_bytes(summary if summary is not None else json.dumps(default).encode())
    return path


@pytest.fixture
def evaluation():
    import eval as evaluation
    return evaluation


@pytest.mark.parametrize("flag,value", [("--samples", "0"), ("--samples", "-1"), ("--max-new-tokens", "0")])
def test_eval_flag_out_of_range_before_any_model(flag, value, tmp_path, capsys, evaluation):
    line = one_line_error(evaluation.main, ["--run", str(fake_run(tmp_path / "run")), flag, value], capsys, flag)
    assert "must be ≥ 1" in line


def test_eval_bad_prompts_file_before_any_model(tmp_path, capsys, evaluation):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "name 2 fruits ."}\n{not json\n')
    run = fake_run(tmp_path / "run")  # its models are empty folders: the prompts must fail before they load
    one_line_error(evaluation.main, ["--run", str(run), "--prompts", str(tmp_path / "prompts.jsonl")], capsys,
                   "prompts.jsonl:2", "not JSON")


def test_eval_scorer_without_a_trained_head_before_any_model(tmp_path, capsys, evaluation):
    """A --reward-model or the run's judge without a trained head (value_head.safetensors, or a sequence classifier)
    would score with a random one: one line naming it, before the prompts are read or any model loads."""
    run = fake_run(tmp_path / "run")
    (run / "data" / "prompts_heldout.jsonl").write_text("{not json\n")  # an error that must come later
    one_line_error(evaluation.main, ["--run", str(run), "--reward-model", str(run / "sft")], capsys,
                   f"--reward-model {run / 'sft'}: not a reward model", "--random-head")
    (run / "judge_model").mkdir()
    (run / "judge_model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "judge": "held-out reward model",
                                                  "judge_model": str(run / "judge_model")}))
    one_line_error(evaluation.main, ["--run", str(run)], capsys,
                   f"--run {run}: judge_model {run / 'judge_model'}: not a reward model")
    (run / "judge_model" / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    one_line_error(evaluation.main, ["--run", str(run)], capsys, "prompts_heldout.jsonl:1", "not JSON")


@pytest.mark.parametrize("summary,needle", [(b"\xff\xfe{}", "UnicodeDecodeError"), (b"{not json", "JSONDecodeError"),
                                            (b"[1, 2]", "expected a JSON object")])
def test_eval_damaged_summary_names_it(summary, needle, tmp_path, capsys, evaluation):
    run = fake_run(tmp_path / "run", summary)
    one_line_error(evaluation.main, ["--run", str(run)], capsys, "summary.json", needle)
    one_line_error(evaluation.main, ["plot", str(run), "--out", str(tmp_path / "c.png")], capsys, "summary.json")


def test_eval_score_checks_its_outputs_before_scoring(tmp_path, capsys, evaluation):
    # --reward-model names nothing: each output mistake must be found before the model is even looked for
    score = ["score", "--reward-model", str(tmp_path / "nowhere"), "--data", str(tmp_path / "p.jsonl")]
    (tmp_path / "outdir").mkdir()
    one_line_error(evaluation.main, score + ["--out", str(tmp_path / "outdir")], capsys, "--out", "is a directory")
    one_line_error(evaluation.main, score + ["--out", str(tmp_path / "s.jsonl"), "--hist", "h.xyz"], capsys,
                   "--hist h.xyz", ".xyz", ".png")
    one_line_error(evaluation.main, score + ["--batch", "0"], capsys, "--batch 0")


def test_eval_plot_checks_out_and_names_a_damaged_log(tmp_path, capsys, evaluation):
    run = fake_run(tmp_path / "run")
    one_line_error(evaluation.main, ["plot", str(run), "--out", str(tmp_path / "c.xyz")], capsys, "--out", ".xyz",
                   ".png", ".pdf")
    one_line_error(evaluation.main, ["plot", str(run), "--out", str(tmp_path)], capsys, "--out", "is a directory")
    assert not list(tmp_path.glob("c.*"))
    raw = bytearray((run / "metrics.jsonl").read_bytes())
    raw[40:42] = b"\xff\xff"  # inside the second line
    (run / "metrics.jsonl").write_bytes(bytes(raw))
    one_line_error(evaluation.main, ["plot", str(run), "--out", str(tmp_path / "c.png")], capsys,
                   f"{run / 'metrics.jsonl'}:2", "not UTF-8")
