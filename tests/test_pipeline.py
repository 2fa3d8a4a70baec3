"""End-to-end checks of `python train.py` on a tiny budget: files and keys, determinism, and that flags do what they say."""
import json
import os
from pathlib import Path

import pytest
import torch

import ppo_max
import train

# a world and budget small enough for CI (each run well under a minute on 2 cores)
TINY = ["--steps", "3", "--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100",
        "--sft-epochs", "1", "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8",
        "--critic-pretrain-steps", "8", "--eval-samples", "1", "--threads", "1"]

METRIC_KEYS = ["reward/score", "reward/gold", "kl/ref", "policy/perplexity", "response/length", "loss/pg", "loss/vf",
               "loss/ptx", "adv/mean", "adv/std", "returns/mean", "values/mean", "ppo/clipfrac", "ppo/approx_kl",
               "grad/norm", "time/step"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """Run everything inside a temporary working directory so runs/_base is not shared with the user's."""
    d = tmp_path_factory.mktemp("work")
    old = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(old)


def run(base_dir, name, *extra):
    return train.main(TINY + ["--out", str(base_dir / name), *extra])


@pytest.mark.slow
def test_pipeline_writes_metrics_and_summary(base_dir):
    summary = run(base_dir, "a")
    out = base_dir / "a"
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
def test_pipeline_same_seed_same_metrics(base_dir):
    run(base_dir, "b1")
    run(base_dir, "b2")
    strip = lambda p: [{k: v for k, v in json.loads(l).items() if not k.startswith("time/")}
                       for l in (base_dir / p / "metrics.jsonl").read_text().splitlines()]
    assert strip("b1") == strip("b2")


@pytest.mark.slow
def test_critic_pretraining_lowers_value_loss(base_dir):
    run(base_dir, "c")
    log = json.loads((base_dir / "c" / "critic_pretrain.json").read_text())
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
    _, _, _, cfg, _ = train.parse_configs(["--preset", "vanilla"])
    assert cfg.kl_coef == 0 and not cfg.reward_norm and cfg.critic_pretrain_steps == 0 and cfg.ptx_coef == 0
    _, _, _, cfg, _ = train.parse_configs(["--preset", "vanilla", "--kl-coef", "0.1"])
    assert cfg.kl_coef == 0.1, "an explicit flag overrides the preset"
    _, _, _, cfg, _ = train.parse_configs([])
    assert cfg == ppo_max.apply_preset("ppo-max")
    with pytest.raises(ValueError):
        ppo_max.apply_preset("nope")
    run, *_ = train.parse_configs(["--alarm-kl-max", "0.3", "--alarm-patience", "3", "--on-collapse", "stop"])
    assert (run.alarm_kl_max, run.alarm_patience, run.on_collapse) == (0.3, 3, "stop")


@pytest.mark.parametrize("flags, message", [(["--on-collapse", "halt"], "--on-collapse 'halt'"),
                                            (["--alarm-patience", "0"], "--alarm-patience must be ≥ 1")])
def test_bad_alarm_flags_fail_with_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_configs(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_rebuild_base_trains_stages_1_2_again_with_the_same_result(base_dir, capsys):
    """A second run of a seed reuses the cached base; --rebuild-base trains SFT and the reward model again (so a
    student can step into them), and, the seed being fixed, writes the same weights and logs."""
    first = Path(run(base_dir, "rb1", "--steps", "1")["base"])
    rm_log = (first / "rm_log.json").read_text()
    stamp = (first / "sft" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    run(base_dir, "rb2", "--steps", "1")
    assert "[base] reusing" in capsys.readouterr().out
    assert (first / "sft" / "model.safetensors").stat().st_mtime_ns == stamp
    again = Path(run(base_dir, "rb3", "--steps", "1", "--rebuild-base")["base"])
    assert "[base] reusing" not in capsys.readouterr().out
    assert again == first and (again / "DONE").exists()
    assert (again / "sft" / "model.safetensors").stat().st_mtime_ns != stamp
    assert (again / "rm_log.json").read_text() == rm_log
