"""The methods beyond PPO through `train.py` on a tiny budget: critic-free estimators (no critic anywhere, exact
resume, G responses per prompt in whole groups), --kl-in loss, and the one-line refusals of combinations that cannot
work."""
import json
from pathlib import Path

import pytest

import train
import plumbing.flags

TINY = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
        "--rm-epochs", "1", "--rollout-batch", "16", "--minibatch", "8", "--eval-samples", "1", "--threads", "1"]


@pytest.mark.slow
def test_grpo_runs_without_a_critic_and_resumes_exactly(work, metrics):
    args = TINY + ["--advantage", "grpo", "--group-size", "4", "--save-every", "2"]
    summary = train.main(args + ["--steps", "4", "--out", "grpo"])
    out = work / "grpo"
    assert summary["config"]["advantage"] == "grpo" and not (out / "critic").exists()
    assert not (out / "critic_pretrain.json").exists(), "no critic pre-training without a critic"
    ckpt = out / "checkpoints" / "step-000004"
    assert sorted(p.name for p in ckpt.iterdir()) == ["COMPLETE", "optimizer-policy.pt", "policy", "rng.pt",
                                                       "state.json"]
    m = metrics(out)
    assert all("loss/vf" not in x and "values/mean" not in x and "loss/kl" not in x for x in m)
    samples = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # the first 4 rows of the batch are one prompt's 4 responses
        assert len({p for p, _ in s["examples"]}) == 1 and len(s["scores"]) == 16
    train.main(args + ["--steps", "2", "--out", "part"])
    train.main(["--resume", "part", "--steps", "4"])
    assert metrics(work / "part") == m


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--advantage", "reinforce++"],
                                   ["--advantage", "dr-grpo", "--group-size", "2", "--kl-in", "loss"],
                                   ["--advantage", "rloo", "--group-size", "2", "--lora-r", "4"]])
def test_other_estimators_run(work, flags, metrics):
    name = "-".join(flags).replace("--", "")
    summary = train.main(TINY + flags + ["--steps", "2", "--out", name])
    cfg = summary["config"]
    if "dr-grpo" in flags:  # both halves of Dr. GRPO; the KL in the loss is GRPO's k3 unless given
        assert cfg["loss_agg"] == "seq-mean-token-sum-norm" and cfg["kl_estimator"] == "k3"
    m = metrics(work / name)
    assert all(("loss/kl" in x) == ("loss" in flags) for x in m)
    if "--lora-r" in flags:  # LoRA without a critic: the policy's adapters alone, the reward model loaded on its own
        assert (work / name / "policy" / "adapter" / "adapter_config.json").is_file()
        assert not (work / name / "critic").exists()


def test_default_out_names_the_estimator():
    run, *_ = plumbing.flags.parse_configs(["--advantage", "grpo", "--group-size", "4"])
    assert run.out == "runs/ppo-max-grpo-g4-seed0"
    run, *_ = plumbing.flags.parse_configs([])
    assert run.out == "runs/ppo-max-seed0"


def test_dr_grpo_implies_its_loss_aggregation():
    """`python train.py --advantage dr-grpo --group-size 4` (docs/methods.md) is both halves of Dr. GRPO: its advantage
    and its constant divisor (--loss-agg seq-mean-token-sum-norm), with the KL in the reward (k1) or, with --kl-in
    loss, GRPO's k3; the other estimators keep the token-mean."""
    _, _, _, cfg, *_ = plumbing.flags.parse_configs(["--advantage", "dr-grpo", "--group-size", "4"])
    assert (cfg.advantage, cfg.loss_agg, cfg.kl_in, cfg.kl_estimator) == ("dr-grpo", "seq-mean-token-sum-norm",
                                                                          "reward", "k1")
    _, _, _, cfg, *_ = plumbing.flags.parse_configs(["--advantage", "dr-grpo", "--group-size", "4", "--kl-in", "loss"])
    assert (cfg.loss_agg, cfg.kl_estimator) == ("seq-mean-token-sum-norm", "k3")
    _, _, _, cfg, *_ = plumbing.flags.parse_configs(["--advantage", "grpo", "--group-size", "4"])
    assert cfg.loss_agg == "token-mean"


@pytest.mark.parametrize("flags,message", [
    (["--advantage", "grpo"], "--advantage grpo: needs --group-size G ≥ 2"),
    (["--advantage", "rloo", "--group-size", "4", "--rollout-batch", "18"], "--rollout-batch 18: must be a multiple"),
    (["--advantage", "dr-grpo", "--group-size", "4", "--loss-agg", "token-mean"], "Dr. GRPO is its advantage"),
    (["--kl-in", "loss", "--kl-estimator", "k1"], "k1 = log π/π_SFT has zero expected gradient"),
    (["--kl-in", "loss", "--kl-estimator", "full"], "the exact KL in the loss"),
    (["--dual-clip", "0.5"], "--dual-clip 0.5: must be > 1"),
    (["--advantage", "grpo", "--group-size", "2", "--critic-model", "x"], "--advantage grpo trains no critic"),
    (["--advantage", "grpo", "--group-size", "2", "--stages", "sft,rm,critic"], "has no critic to pre-train"),
    (["--advantage", "ppo"], "--advantage 'ppo': choose one of gae, grpo"),
    (["--loss-agg", "seq-sum"], "--loss-agg 'seq-sum': choose one of token-mean"),
])
def test_combinations_that_cannot_work_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        plumbing.flags.parse_configs(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_plan_prints_what_a_critic_free_run_saves(capsys):
    """LLaMA-7B on 8 × 80 GiB, ZeRO-2: without the critic (plan_memory(critic=False)) the peak drops by exactly the
    critic's resident rows (weights, gradients, optimizer states, fp32 gradients, buckets: its training activations never set the peak, the
    policy's phase does), and --plan prints that difference."""
    from plumbing import scale
    plan = plumbing.flags.print_plan(["--model", "llama-7b", "--plan", "--num-gpus", "8", "--gpu-mem", "80"])
    out = capsys.readouterr().out
    free = plumbing.flags.print_plan(["--model", "llama-7b", "--plan", "--num-gpus", "8", "--gpu-mem", "80",
                             "--advantage", "grpo", "--group-size", "4"])
    resident = sum(plan.get("critic", c) for c in ("weights", "gradients", "optimizer", "grad_fp32", "buckets"))
    assert "critic" not in free.n_params and free.total_bytes == plan.total_bytes - resident > 0
    saved = f"{resident / scale.GiB:.2f} GiB"
    assert f"holds no critic: {free.total_bytes / scale.GiB:.2f} GiB per GPU, {saved} less" in out
    assert f"--advantage grpo holds no critic: {saved} per GPU less" in capsys.readouterr().out
    lora = ["--model", "llama-7b", "--plan", "--num-gpus", "1", "--gpu-mem", "24", "--lora-r", "16"]
    with_critic, free = plumbing.flags.print_plan(lora), plumbing.flags.print_plan(lora + ["--advantage", "rloo", "--group-size", "4"])
    assert 0 < with_critic.total_bytes - free.total_bytes < 0.01 * with_critic.total_bytes  # LoRA: the critic's
    # frozen backbone is the reward model's, which stays


def test_reward_model_size_flags_leave_the_default_base_unchanged():
    """--rm-hidden / --rm-layers / --rm-pairs at their defaults are not part of the cached base's key, so the bases
    built before these flags existed are found again; set, they are."""
    from plumbing import pipeline
    run, sft_cfg, rm_cfg, _, world_cfg, _ = plumbing.flags.parse_configs([])
    assert set(pipeline.base_key(run, sft_cfg, rm_cfg, world_cfg)[1][2]) == {
        "rm_epochs", "rm_lr", "rm_batch", "rm_lm_coef", "rm_eval_every"}
    run2, sft2, rm2, _, world2, _ = plumbing.flags.parse_configs(["--rm-hidden", "16"])
    assert pipeline.base_dir(run2, sft2, rm2, world2) != pipeline.base_dir(run, sft_cfg, rm_cfg, world_cfg)


@pytest.mark.slow
def test_a_reward_model_of_its_own_size_and_data(work):
    from plumbing import data
    result = train.main(TINY + ["--rm-hidden", "16", "--rm-layers", "1", "--rm-pairs", "120", "--stages", "sft,rm",
                                "--out", "rm16"])
    rm_dir, sft_dir = Path(result["reward_model"]), Path(result["sft"])
    rm_config = json.loads((rm_dir / "config.json").read_text())
    assert (rm_config["hidden_size"], rm_config["num_hidden_layers"]) == (16, 1)
    assert json.loads((sft_dir / "config.json").read_text())["hidden_size"] == 64  # the policy keeps its size
    assert len(data.read_records(rm_dir.parent / "data" / "pairs_train.jsonl")) == 120
