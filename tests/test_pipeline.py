"""End-to-end checks of `python train.py` on a tiny budget: files and keys, determinism, and that flags do what they say."""
import json
from pathlib import Path

import pytest
import torch

from plumbing import cli
import dpo
import ppo_max
import toy_world
import train
import plumbing.config
import plumbing.flags

# a world and budget small enough for CI (each run well under a minute on 2 cores)
TINY = ["--steps", "3", "--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100",
        "--sft-epochs", "1", "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8",
        "--critic-pretrain-steps", "8", "--eval-samples", "1", "--threads", "1"]

METRIC_KEYS = ["reward/score", "reward/gold", "kl/ref", "policy/perplexity", "response/length", "loss/pg", "loss/vf",
               "loss/ptx", "adv/mean", "adv/std", "returns/mean", "values/mean", "ppo/clipfrac", "ppo/approx_kl",
               "grad/norm", "time/step"]


def run(work, name, *extra):
    return train.main(TINY + ["--out", str(work / name), *extra])


@pytest.mark.slow
def test_pipeline_writes_metrics_and_summary(work, monkeypatch):
    import gc
    import plumbing.run

    def optimizers() -> int:
        gc.collect()
        return sum(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_objects())
    live, before = [], optimizers()   # the optimizers alive while the final evaluation samples: none of the run's

    def evaluate(*args, **kwargs):
        live.append(optimizers())
        return evaluate_(*args, **kwargs)
    evaluate_ = plumbing.run.evaluate
    monkeypatch.setattr(plumbing.run, "evaluate", evaluate)
    summary = run(work, "a")
    assert live == [before], (live, before)
    out = work / "a"
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for key in METRIC_KEYS:
        assert all(key in l for l in lines), key
        assert all(l[key] == l[key] for l in lines), f"{key} is NaN"
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary))
    for key in ["preset", "seed", "steps", "seconds", "rm", "sft", "final", "peak", "win_rate_vs_sft"]:
        assert key in s
    for part in ["sft", "final"]:
        assert set(s[part]) >= {"reward", "gold_reward", "kl", "perplexity", "response_length"}
    w = s["win_rate_vs_sft"]
    assert abs(w["win"] + w["tie"] + w["lose"] - 1) < 1e-9
    assert s["rm"]["accuracy"] > 0.55, "the reward model's held-out accuracy should beat chance"
    for d in ["policy", "critic"]:
        assert (out / d / "config.json").exists() and list((out / d).glob("*.safetensors"))
    base = Path(s["base"])
    for d in ["sft", "reward_model", "tokenizer"]:
        assert (base / d).is_dir()


@pytest.mark.slow
def test_stages_sft_rm_leave_a_finished_run_in_out_as_it_is(work):
    """The README's step-through begins with `python train.py --stages sft,rm` after `python train.py`: the same
    --out. Stages 1-2 go to the cached base; the finished run keeps its summary, checkpoints, record and records."""
    run(work, "kept", "--steps", "2", "--save-every", "1")
    out = work / "kept"
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"}
    assert (out / "summary.json").exists() and list((out / "checkpoints").glob("step-*"))
    result = run(work, "kept", "--stages", "sft,rm")
    assert result["stages"] == "sft,rm" and Path(result["sft"]).is_dir()
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"}
    assert after == before


@pytest.mark.slow
def test_pipeline_same_seed_same_metrics(work, metrics):
    run(work, "b1")
    run(work, "b2")
    assert metrics(work / "b1") == metrics(work / "b2")


@pytest.mark.slow
def test_heldout_curve_changes_no_training_number(work):
    """--heldout-every logs the held-out points (step 0 = the SFT policy: KL 0) and leaves every training number,
    sample and the final evaluation exactly as without it."""
    run(work, "h0", "--heldout-every", "0")
    run(work, "h2", "--heldout-every", "2")
    rows = lambda p: [json.loads(l) for l in (work / p / "metrics.jsonl").read_text().splitlines()]
    untimed = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "heldout/"))}
    assert [untimed(r) for r in rows("h0")] == [untimed(r) for r in rows("h2")]
    assert (work / "h0" / "samples.jsonl").read_text() == (work / "h2" / "samples.jsonl").read_text()
    final = lambda p: json.loads((work / p / "summary.json").read_text())["final"]
    assert final("h0") == final("h2")
    points = [r for r in rows("h2") if "heldout/gold" in r]
    assert [r["step"] for r in points] == [0, 2] and not any("heldout/gold" in r for r in rows("h0"))
    assert points[0]["heldout/kl"] == pytest.approx(0.0, abs=1e-6)   # before any update the policy is π_SFT
    assert all(set(r) >= {"heldout/score", "heldout/kl", "heldout/length"} for r in points)


@pytest.mark.slow
def test_critic_pretraining_lowers_value_loss(work):
    run(work, "c")
    log = json.loads((work / "c" / "critic_pretrain.json").read_text())
    assert len(log) >= 2
    assert log[-1]["loss/vf"] < log[0]["loss/vf_first"]


def test_kl_coef_zero_leaves_only_the_score():
    scores = torch.tensor([1.5, -0.5])
    logprobs, ref = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    rewards = ppo_max.shape_rewards(scores, logprobs, ref, mask, kl_coef=0.0)
    expected = torch.zeros(2, 4)
    expected[0, 2], expected[1, 3] = 1.5, -0.5
    torch.testing.assert_close(rewards, expected)


def test_presets_and_flags_parse():
    _, _, _, cfg, *_ = plumbing.flags.parse_configs(["--preset", "vanilla"])
    assert cfg.kl_coef == 0 and not cfg.reward_norm and cfg.critic_pretrain_steps == 0 and cfg.ptx_coef == 0
    _, _, _, cfg, *_ = plumbing.flags.parse_configs(["--preset", "vanilla", "--kl-coef", "0.1"])
    assert cfg.kl_coef == 0.1, "an explicit flag overrides the preset"
    _, _, _, cfg, *_ = plumbing.flags.parse_configs([])
    assert cfg == plumbing.config.apply_preset("ppo-max")
    with pytest.raises(ValueError):
        plumbing.config.apply_preset("nope")
    run, *_ = plumbing.flags.parse_configs(["--alarm-kl-max", "0.3", "--alarm-patience", "3", "--on-collapse", "stop"])
    assert (run.alarm_kl_max, run.alarm_patience, run.on_collapse) == (0.3, 3, "stop")


def bad_value(spec: str):
    """A value outside `spec` (cli.check_value's language)."""
    if "|" in spec:
        return "7" if all(c.isdigit() for c in spec.split("|")) else "nope"
    if spec.startswith(">="):
        return float(spec[2:]) - 1
    if spec.startswith(">"):
        return float(spec[1:]) - 1 if float(spec[1:]) > -1e300 else float("nan")
    return float(spec[1:-1].split(",")[1]) + 1


ALL_CHECKS = [("", n, s) for c in (plumbing.config.RunConfig, plumbing.config.SFTConfig, plumbing.config.RMConfig, ppo_max.PPOConfig, dpo.DPOConfig)
              for n, s in cli.allowed(c).items()] + [("world-", n, s) for n, s in cli.allowed(toy_world.WorldConfig).items()]


@pytest.mark.parametrize("prefix, name, spec", ALL_CHECKS, ids=[f"{p}{n}" for p, n, _ in ALL_CHECKS])
def test_every_flag_out_of_range_fails_with_one_line(prefix, name, spec, capsys):
    flag = f"--{prefix}{name.replace('_', '-')}"
    value = bad_value(spec)
    if isinstance(value, float) and value.is_integer() and "|" not in spec:
        value = int(value)
    with pytest.raises(SystemExit) as e:
        plumbing.flags.parse_configs([flag, str(value)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag} "), err


def fails_with_one_line(parse, flags, message, capsys) -> None:
    """parse(flags) exits 2 with one line on stderr that contains `message`."""
    with pytest.raises(SystemExit) as e:
        parse(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("flags, message", [
    (["--kl-coef", "nan"], "--kl-coef nan: must be a finite number"),
    (["--lam", "2"], "--lam 2.0: must be in [0,1]"),
    (["--preset", "foo"], "unknown preset 'foo'"),
    (["--minibatch", "128"], "--minibatch 128: must be ≤ --rollout-batch 64"),
    (["--sft-heads", "3"], "divisible by --sft-heads 3"),
    (["--data", "nope.jsonl"], "--data nope.jsonl: no such file"),
    (["--resume", "nowhere"], "--resume nowhere: no such run"),
    (["--bf16", "--fp32"], "--bf16 and --fp32"),
    (["--out", "pytest.ini"], "--out pytest.ini: exists and is not a directory"),
    (["--resume", "pytest.ini"], "--resume pytest.ini: not a run or checkpoint directory")])
def test_bad_combinations_and_paths_fail_with_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(train.__file__).parent)
    fails_with_one_line(plumbing.flags.parse_configs, flags, message, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--stages", "ppo,ppo"], "--stages ppo,ppo: expected stages from sft,rm,critic,ppo, each once"),
    (["--stages", "sft,rm,rm,critic"], "each once, in that order"),
    (["--reward-model", "rm"], "--reward-model rm: needs a real --model DIR"),
    (["--sft-model", "sft"], "--sft-model sft: needs a real --model DIR"),
    (["--critic-model", "critic"], "--critic-model critic: needs a real --model DIR"),
    (["--prompts", "pytest.ini"], "--prompts pytest.ini: needs --data or a real --model"),
    (["--sft-data", "pytest.ini"], "--sft-data pytest.ini: needs --data or a real --model")])
def test_flags_the_run_would_ignore_fail_with_one_line(flags, message, capsys, monkeypatch):
    """A stage named twice, or a model or file the synthetic world would never read, is a mistake, not a no-op."""
    monkeypatch.chdir(Path(train.__file__).parent)
    fails_with_one_line(plumbing.flags.resolve, flags, message, capsys)


def test_every_numeric_or_choice_flag_has_a_check():
    """A new flag cannot slip in without its range: every int/float/str field is checked, or is a path/name."""
    import dataclasses
    checked = {n for _, n, _ in ALL_CHECKS}
    free = {"out", "model", "resume", "data", "sft_data", "prompts", "deepspeed_config", "sft_model", "reward_model",
            "critic_model", "preset", "stages", "seed", "data_split", "data_config",
            "lora_targets"}  # names: checked where used (--lora-targets against the model's layers)
    for cls in (plumbing.config.RunConfig, plumbing.config.SFTConfig, plumbing.config.RMConfig, ppo_max.PPOConfig, toy_world.WorldConfig,
                dpo.DPOConfig):
        for f in dataclasses.fields(cls):
            if f.type in ("bool", bool) or (cls is toy_world.WorldConfig and f.name in ("seed", "name")):  # --seed, --world
                continue
            assert f.name in checked or f.name in free, f"{cls.__name__}.{f.name} has no check"


def test_bad_flag_exits_before_any_work(tmp_path):
    """From the command line: one line, exit 2, no traceback, within seconds, and nothing written."""
    import subprocess
    import sys
    import time
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(train.__file__)), "--rollout-batch", "0", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --rollout-batch 0: must be ≥ 1"
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    assert time.time() - t0 < 60


@pytest.mark.slow
def test_rebuild_base_trains_stages_1_2_again_with_the_same_result(work, capsys):
    """A second run of a seed reuses the cached base; --rebuild-base trains SFT and the reward model again (so a
    student can step into them), and, the seed being fixed, writes the same weights and logs."""
    first = Path(run(work, "rb1", "--steps", "1")["base"])
    rm_log = (first / "rm_log.json").read_text()
    stamp = (first / "sft" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    run(work, "rb2", "--steps", "1")
    assert "[base] reusing" in capsys.readouterr().out
    assert (first / "sft" / "model.safetensors").stat().st_mtime_ns == stamp
    again = Path(run(work, "rb3", "--steps", "1", "--rebuild-base")["base"])
    assert "[base] reusing" not in capsys.readouterr().out
    assert again == first and (again / "DONE").exists()
    assert (again / "sft" / "model.safetensors").stat().st_mtime_ns != stamp
    assert (again / "rm_log.json").read_text() == rm_log


@pytest.mark.slow
def test_tensorboard_holds_every_metric_of_metrics_jsonl(work):
    """--log-with tensorboard: every numeric key of metrics.jsonl is a scalar under the same name with the same value
    at each step (read back with TensorBoard's own reader), plus the SFT and reward-model stages' curves."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run(work, "tb", "--log-with", "tensorboard")
    rows = [json.loads(l) for l in (work / "tb" / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(work / "tb" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for row in rows:
        for key, value in row.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            (event,) = [e for e in acc.Scalars(key) if e.step == row["step"]]
            assert event.value == pytest.approx(float(value), rel=1e-6, abs=1e-6), key
    assert {"sft/loss", "rm/heldout_accuracy", "rm/bt"} <= tags
    sft_losses = json.loads((run_base(work, "tb") / "sft_log.json").read_text())["loss"]
    assert [e.value for e in acc.Scalars("sft/loss")] == pytest.approx(sft_losses)


def run_base(work, name) -> Path:
    base = Path(json.loads((work / name / "summary.json").read_text())["base"])
    return base if base.is_absolute() else work / base


@pytest.mark.slow
def test_redirected_output_is_a_few_true_lines(work):
    """Into a file or a pipe (no TTY): whole lines, no progress-bar redraws, no library loading bars or DeepSpeed
    warning, no line for a stage that is off (vanilla has no critic pre-training), and stage times only for stages
    that ran here (the base is cached by the first run)."""
    import subprocess
    import sys
    cmd = [sys.executable, str(Path(train.__file__)), *TINY, "--preset", "vanilla", "--critic-pretrain-steps", "0"]
    for name in ("first", "second"):
        proc = subprocess.run(cmd + ["--out", str(work / f"quiet-{name}")], cwd=work, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "\r" not in text and len(text) < 6000, (len(text), text[-1500:])
    assert "Loading weights" not in text and "Writing model shards" not in text and "accelerator" not in text
    assert "critic pre-training" not in text
    timings = next(l for l in proc.stdout.splitlines() if l.startswith("stage seconds:"))
    assert "sft" not in timings and "reward_model" not in timings and "ppo" in timings, timings


@pytest.mark.parametrize("content, flags, message", [
    ("[1, 2]", ["--deepspeed"], "expected a JSON object with a zero_optimization object, if any, got list"),
    ('{"zero_optimization": 3}', ["--deepspeed"], "got int"),
    ('{"zero_optimization": {"stage": 7}}', ["--deepspeed"], "zero_optimization.stage 7: the loop runs ZeRO stages"),
    ('{"zero_optimization": {"stage": 2}}', [], "DeepSpeed engines run under the `deepspeed` launcher")])
def test_a_deepspeed_config_the_engines_cannot_use_is_one_line_before_any_work(tmp_path, content, flags, message,
                                                                               capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "ds.json").write_text(content)
    fails_with_one_line(plumbing.flags.parse_configs, ["--deepspeed_config", str(tmp_path / "ds.json"), *flags], message, capsys)
