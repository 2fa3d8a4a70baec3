"""`deepspeed --num_gpus 2 train.py` on the CPU against one process with the same global batch and seed; an exact
resume under DeepSpeed; `train.py --plan`; a real --model that is not on this machine fails at once, clearly.

The launch that works here (DeepSpeed 0.19.8, torch CPU, 2 cores, no GPU), run from the run's directory:
    DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= deepspeed --num_gpus 2 --master_port <port> train.py <flags>
DeepSpeed finds no GPU, takes its CPU accelerator and the gloo backend, and `--num_gpus 2` starts 2 processes
(its launcher accepts it on the CPU; no torchrun, no --bind_cores_to_rank needed). DS_ACCELERATOR=cpu and the empty
CUDA_VISIBLE_DEVICES only make a GPU machine run this test the same way; a free --master_port keeps it off the
default 29500 that another job may hold. `python train.py --deepspeed` (no launcher) runs the engines in one
process: that run equals the plain one up to float32 rounding (a test below). The very first launch on a machine
compiles DeepSpeed's shared-memory communication op (about 2.5 minutes on 2 cores, once; cached in
~/.cache/torch_extensions); afterwards each launch costs ~10 s of start-up and the whole file ~2.5 minutes.

What is compared, and why not bit for bit. Both runs draw the same global batch of prompts (one prompt stream,
replayed on every rank; rank r keeps prompts r, r+2, …), start from the same SFT and reward model (the same
cached runs/_base directory) and use the same global minibatch. But a rank samples its 32 responses in its own
`generate` call from its own torch stream (seed + rank), and a batched sampler's draws for a row depend on the
whole batch (its size, its padding, how many steps it runs), so rank r's responses cannot equal the single
process's responses to the same prompts without changing the single-process sampler. The ranks' minibatches
are also drawn per rank. So we check:
  exactly: the prompts of every step (first 4 of the global batch, in order), 64 scores per step, the running
    moments of Eq. 18 counting every rank's scores (count = (2 critic-pretraining rounds + 4 steps) × 64 = 384:
    per-rank moments would count 192), the KL coefficient and learning rate;
  statistically, paired by prompt: per-sequence reward-model scores and gold rewards, pooled over the 4 steps
    (n = 256 pairs): the mean difference must be within 4 standard errors (|z| ≤ 4; a false alarm about 1 in 15,000
    per check if the two runs sample one distribution). At step 0 the policies are identical (critic
    pre-training does not touch the policy), later they differ by a few optimizer steps of drift;
    Measured on seeds 0, 1, 2: |z| ≤ 1.40 (scores), ≤ 0.41 (gold).
  tolerances on the training curves, measured on seeds 0, 1, 2 (worst difference in brackets) and set ~4× wider:
    loss/ptx (same SFT rows in both runs, only the weights differ) |Δ| ≤ 0.05 [0.010]: a broken update moves
    it by ~0.3 over these 4 steps (3.47 → 3.18); policy/entropy |Δ| ≤ 0.02 [0.005]; kl/ref after step 0 within a
    factor 1.5 [1.19]; grad/norm within 20% [4%]. Not compared: values and returns, which follow the critic
    pre-training's own samples and the moments of Eq. 18 (|Δ values/mean| up to 0.5 between the runs).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plumbing import data
from plumbing.engine import free_port
import sft
import ppo_max
import train
import plumbing.flags
import plumbing.run

ROOT = Path(__file__).resolve().parents[1]
WORLD = ["--world-n-sft", "400", "--world-n-pairs", "300", "--world-n-pairs-heldout", "100", "--sft-epochs", "1",
         "--rm-epochs", "1", "--eval-samples", "1", "--threads", "1"]
# one global batch for both runs: 64 prompts per step, minibatch 16 (8 per rank under 2 processes)
# policy lr 2e-4, the rate the tolerances below were measured at: at the world's default 7e-5 the policy moves so
# little in 4 steps that kl/ref (~0.002) is mostly sampling noise between the runs
PPO = ["--rollout-batch", "64", "--minibatch", "16", "--critic-pretrain-steps", "2", "--steps", "4",
       "--save-every", "2", "--policy-lr", "2e-4"]


def deepspeed_cmd(*args: str, port: int | None = None) -> list[str]:
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the `deepspeed` launcher is not on PATH")
    return [launcher, "--num_gpus", "2", "--master_port", str(port or free_port()), str(ROOT / "train.py"), *args]


def run_deepspeed(cwd: Path, *args: str, timeout: int = 170) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus 2 train.py ARGS` on the CPU; it must succeed and leave no shared-memory buffer behind
    (/dev/shm is RAM: DeepSpeed's own 66 MiB per rank and run, never removed, had grown to 19 GB on one machine)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    proc = subprocess.run(deepspeed_cmd(*args, port=port), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), "shared memory left behind"
    return proc


def metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("time/")}
            for l in (path / "metrics.jsonl").read_text().splitlines()]


def samples(path: Path) -> list[dict]:
    return [json.loads(l) for l in (path / "samples.jsonl").read_text().splitlines()]


def moments(path: Path, step: int) -> dict:
    state = json.loads((path / "checkpoints" / f"step-{step:06d}" / "state.json").read_text())
    return state["extra_state"]["moments"]


def paired_z(a: list[float], b: list[float]) -> float:
    """Mean of the paired differences b − a over its standard error (a brute-force loop, no library)."""
    d = [y - x for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean / (var / n) ** 0.5


# ------------------------------------------------------------------------------------------------ DeepSpeed
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One process in-process (it also builds the cached SFT and reward model), then 2 DeepSpeed processes."""
    work = tmp_path_factory.mktemp("deepspeed")
    old = os.getcwd()
    os.chdir(work)
    try:
        train.main(WORLD + PPO + ["--out", "single"])
    finally:
        os.chdir(old)
    t0 = time.time()
    proc = run_deepspeed(work, *WORLD, *PPO, "--out", "ds")
    return work, proc, time.time() - t0


@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_two_processes_match_one_process(two_runs):
    work, proc, _ = two_runs
    one, two = work / "single", work / "ds"
    assert "[deepspeed] 2 process(es) on cpu" in proc.stdout and '"stage": 2' in proc.stdout
    assert proc.stdout.count("preset 'ppo-max'") == 1, "only rank 0 prints"
    m1, m2 = metrics(one), metrics(two)
    s1, s2 = samples(one), samples(two)
    assert [m["step"] for m in m2] == [0, 1, 2, 3]
    json.loads((two / "summary.json").read_text())  # rank 0 evaluated and wrote the summary
    # exactly: the same global batch of prompts, every rank's scores in the moments of Eq. 18
    for a, b in zip(s1, s2):
        assert [p for p, _ in a["examples"]] == [p for p, _ in b["examples"]]
        assert len(a["scores"]) == len(b["scores"]) == 64
    assert moments(one, 4)["count"] == moments(two, 4)["count"] == (2 + 4) * 64
    for a, b in zip(m1, m2):
        assert a["kl/coef"] == b["kl/coef"] and a["lr/policy"] == b["lr/policy"]
    # statistically, paired by prompt: scores and gold rewards of the same prompts
    for key in ("scores", "gold"):
        z = paired_z([x for s in s1 for x in s[key]], [x for s in s2 for x in s[key]])
        assert abs(z) <= 4, f"{key}: paired z = {z:.2f}"
    # the training curves
    for a, b in zip(m1, m2):
        assert abs(a["loss/ptx"] - b["loss/ptx"]) <= 0.05, (a["step"], a["loss/ptx"], b["loss/ptx"])
        assert abs(a["policy/entropy"] - b["policy/entropy"]) <= 0.02
        assert 1 / 1.5 <= b["grad/norm"] / a["grad/norm"] <= 1.5, (a["step"], a["grad/norm"], b["grad/norm"])  # other samples
        if a["step"] > 0:  # at step 0 the policy is the reference: KL = 0 in both
            assert 1 / 1.5 <= b["kl/ref"] / a["kl/ref"] <= 1.5, (a["step"], a["kl/ref"], b["kl/ref"])
        else:
            assert a["kl/ref"] == pytest.approx(0, abs=1e-6) and b["kl/ref"] == pytest.approx(0, abs=1e-6)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_engines_in_one_process_match_the_plain_run(two_runs):
    """`train.py --deepspeed` in one process (W = 1: the same prompts, samples and minibatches as the plain run; its
    rendezvous on a free port, with 29500 taken) puts
    policy and critic in ZeRO-2 engines; its metrics equal the plain run's up to float32 rounding (measured: ≤ 3e-7
    absolute, perplexity 5e-7 relative), so engine.backward / engine.step / the engine's clipping do what
    backward_step does without DeepSpeed."""
    work, _, _ = two_runs
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # a world of one picks a free port itself
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    with socket.socket() as held:  # DeepSpeed's default 29500 held by "another job": the run must not need it
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass  # something else holds it already, which tests the same
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *WORLD, *PPO, "--steps", "2", "--deepspeed",
                               "--out", "ds1"], cwd=work, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[deepspeed] 1 process(es) on cpu" in proc.stdout
    plain, engines = metrics(work / "single")[:2], metrics(work / "ds1")
    assert len(engines) == 2
    for a, b in zip(plain, engines):
        assert a.keys() == b.keys()
        floats = [k for k in a if isinstance(a[k], float)]
        assert {k: a[k] for k in a if k not in floats} == {k: b[k] for k in b if k not in floats}
        torch.testing.assert_close(torch.tensor([b[k] for k in floats], dtype=torch.float64),
                                   torch.tensor([a[k] for k in floats], dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_resume_matches_uninterrupted(two_runs):
    """The DeepSpeed run checkpointed at step 2 (engines: ZeRO shards per rank; every rank's RNG streams) and
    resumed under DeepSpeed writes steps 2-3 exactly as the uninterrupted run (gloo sums in a fixed order)."""
    work, _, _ = two_runs
    shutil.copytree(work / "ds", work / "ds-resumed")
    ckpt = work / "ds-resumed" / "checkpoints"
    assert (ckpt / "deepspeed" / "policy" / "step-000002").is_dir()
    assert (ckpt / "deepspeed" / "rng" / "step-000002-rank1.pt").is_file()
    run_deepspeed(work, *WORLD, *PPO, "--out", "ds-resumed", "--resume", str(ckpt / "step-000002"))
    assert metrics(work / "ds-resumed") == metrics(work / "ds")
    assert samples(work / "ds-resumed") == samples(work / "ds")  # steps 2-3 replaced, not repeated


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("frozen", [["--frozen-zero-stage", "3"], ["--frozen-offload"]])
def test_frozen_models_as_zero3_engines_score_as_the_replicated_ones(two_runs, frozen):
    """The reference and the reward model as ZeRO-3 inference engines (each rank holds half of their parameters and
    gathers a layer's for its forward; with --frozen-offload on the CPU) under 2 ranks, against the replicated run
    (the `two_runs` DeepSpeed run, the same flags): the gathered parameters are the same numbers, so every metric
    of steps 0 and 1 (scores, log-probs, KL, values, losses: the critic's pre-training and the update read them too)
    and every score are equal to the last bit; then rank 0 evaluates with whole copies loaded again."""
    work, _, _ = two_runs
    out = "ds-" + frozen[0].strip("-")
    proc = run_deepspeed(work, *WORLD, *PPO, "--steps", "2", *frozen, "--out", out)
    assert "ZeRO-3 engines, their parameters partitioned over the 2 rank(s)" in proc.stdout
    assert ("kept on the CPU" in proc.stdout) == ("--frozen-offload" in frozen)
    assert metrics(work / out) == metrics(work / "ds")[:2]
    assert [s["scores"] for s in samples(work / out)] == [s["scores"] for s in samples(work / "ds")][:2]
    assert json.loads((work / out / "summary.json").read_text())["final"]


def test_a_rank_reading_the_logs_while_rank_0_rewrites_them_never_sees_them_torn(tmp_path):
    """On --resume every rank reads metrics.jsonl while rank 0 rewrites it to the steps before the checkpoint. A
    plain write_text truncates first, so a slower rank now and then read an empty file and exited 2 ("file is
    empty"), which broke the DeepSpeed resume under load; rank 0 now writes beside the file and renames over it."""
    import threading
    from plumbing import monitor
    history = [{"step": i, "kl/ref": 0.0} for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history + history))
    errors, done = [], threading.Event()

    def read():
        while not done.is_set():
            try:
                if len(data.read_records(tmp_path / "metrics.jsonl")) < len(history):
                    errors.append("short")
            except Exception as e:  # noqa: BLE001 - any failure to read is the defect
                errors.append(repr(e))
    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(300):
        monitor.RunLog(tmp_path, monitor.CollapseMonitor(), history, [], main_rank=True).close()
    done.set()
    reader.join()
    assert errors == [] and len(data.read_records(tmp_path / "metrics.jsonl")) == len(history)


def test_ranks_probing_one_out_dir_at_once_never_fail(tmp_path):
    """Every rank checks that --out is writable before the process group exists. With one shared probe name, one
    rank's unlink removed the other's probe now and then (measured: 80 failures in 2 × 2,000 tries), which train.py
    read as "cannot write there": the occasional exit 2 of `deepspeed --num_gpus 2` under load."""
    import threading
    from types import SimpleNamespace
    errors = []

    def probe():
        for _ in range(500):
            try:
                plumbing.run.make_out_dir(SimpleNamespace(out=str(tmp_path / "out")))
            except SystemExit as e:
                errors.append(e.code)
    threads = [threading.Thread(target=probe) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and not list((tmp_path / "out").iterdir())


@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_critic_free_groups_stay_whole_and_resume(tmp_path):
    """--advantage grpo --group-size 2 under 2 ranks: each rank takes whole groups and the global batch comes back in
    the one process's prompt order (the first 4 rows: two prompts, each twice); no critic engine is built or
    checkpointed, and a resume under DeepSpeed writes the uninterrupted run's metrics. (That the two ranks' group
    baselines and the REINFORCE++ whitening equal the one-process ones: tests/test_critic_free.py, on gloo.)
    The DeepSpeed run starts in a folder without a cached base: rank 0 builds stages 1-2 alone while rank 1 waits,
    and builds what one process builds (the same SFT weights, the same reward model's held-out curve)."""
    args = [*WORLD, "--rollout-batch", "32", "--minibatch", "16", "--steps", "2", "--save-every", "1",
            "--advantage", "grpo", "--group-size", "2"]
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        train.main(args + ["--out", "single"])
    finally:
        os.chdir(old)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    run_deepspeed(fresh, *args, "--out", "ds")
    [base1], [base2] = (list((d / "runs" / "_base").glob("seed0-*")) for d in (tmp_path, fresh))
    assert base1.name == base2.name
    assert (base1 / "rm_log.json").read_text() == (base2 / "rm_log.json").read_text()
    assert (base1 / "sft" / "model.safetensors").read_bytes() == (base2 / "sft" / "model.safetensors").read_bytes()
    for a, b in zip(samples(tmp_path / "single"), samples(fresh / "ds")):
        prompts = [p for p, _ in b["examples"]]
        assert prompts == [p for p, _ in a["examples"]] and prompts[0] == prompts[1] and prompts[2] == prompts[3]
        assert len(b["scores"]) == 32
    ckpt = fresh / "ds" / "checkpoints"
    assert sorted(p.name for p in (ckpt / "deepspeed").iterdir()) == ["policy", "rng"]
    part = fresh / "part"
    shutil.copytree(fresh / "ds", part)
    for p in [part / "checkpoints" / "step-000002", *part.glob("checkpoints/deepspeed/*/step-000002*")]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (part / "metrics.jsonl").write_text((part / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    run_deepspeed(fresh, "--resume", "part")
    assert metrics(part) == metrics(fresh / "ds")


# ------------------------------------------------------------------------------------------------ --plan
HH = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"


def test_plan_llama7b_prints_the_paper_plan():
    """`train.py --model llama-7b --plan` bills the alias's run on 8 × 80 GiB: the released script's lengths, the
    paper's batches, 4 prompts generated at a time, the frozen models as ZeRO-3 engines; it fits, and with --data's
    judge (one more frozen model) still with at least 5 GiB to spare."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", "llama-7b", "--plan", "--num-gpus", "8",
                           "--gpu-mem", "80"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Memory plan per GPU: llama-7b" in proc.stdout and "L = 1536 + 512" in proc.stdout
    assert "B=16 prompts/GPU per iteration, g=4 generated and scored at a time" in proc.stdout
    assert "frozen models ZeRO-3, sharded" in proc.stdout and "→ fits" in proc.stdout
    assert "Loading weights" not in proc.stdout + proc.stderr
    plan = plumbing.flags.print_plan(["--model", "llama-7b", "--plan", "--data", str(HH), "--skip-bad"])
    assert "judge" in plan.n_params and plan.fits
    assert plan.capacity_bytes - plan.total_bytes >= 5 * 2 ** 30, plan.total_bytes / 2 ** 30


def test_plan_bills_the_runs_parsed_configuration(monkeypatch):
    """The plan's inputs are the run's: what `deepspeed --num_gpus 8 train.py ARGV` parses (WORLD_SIZE 8) gives the
    lengths, the batches per GPU, the micro-batches, the ZeRO stages, the frozen models' sharding and the judge that
    `train.py ARGV --plan` bills."""
    argv = ["--model", "llama-7b", "--data", str(HH), "--skip-bad"]
    settings, models, stages = plumbing.flags.plan_inputs(argv + ["--plan", "--num-gpus", "8"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    run, sft_cfg, rm_cfg, cfg, *_ = plumbing.flags.parse_configs(argv)
    W = 8
    assert (settings["prompt_len"], settings["response_len"]) == (run.max_prompt_tokens, cfg.max_new_tokens) \
        == (1536, 512)
    assert settings["rollout_batch_per_gpu"] == cfg.rollout_batch // W == 16
    assert settings["micro_batch"] == cfg.minibatch // W == 4
    assert settings["ptx_batch_per_gpu"] == cfg.ptx_batch // W and cfg.ptx_coef > 0
    assert settings["generate_batch"] == cfg.generate_batch == 4
    assert settings["frozen_zero_stage"] == run.frozen_zero_stage == 3 and not run.frozen_offload
    assert settings["zero_stage"] == run.zero_stage == 2 and settings["grad_ckpt"] == run.grad_ckpt is True
    assert settings["judge"] is True and run.judge_frac > 0 and settings["critic"] == (cfg.advantage == "gae")
    assert stages == {"sft_batch": sft_cfg.sft_batch // W, "rm_batch": rm_cfg.rm_batch // W}
    assert models["model"] == run.model == "llama-7b"


def test_plan_never_reads_a_prefix_of_a_flag(capsys):
    """--rollout-batch 64 over 8 GPUs is 8 prompts per GPU: the plan's own --rollout-batch-per-gpu is not read for
    it (allow_abbrev=False on every parser), nor --ptx-batch for --ptx-batch-per-gpu."""
    plan = plumbing.flags.print_plan(["--model", "llama-7b", "--plan", "--rollout-batch", "64", "--num-gpus", "8",
                                      "--ptx-batch", "8"])
    assert plan.settings["rollout_batch_per_gpu"] == 8 and plan.settings["ptx_batch_per_gpu"] == 1
    assert "B=8 prompts/GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a prefix of a flag is an unknown flag, not the flag
        plumbing.flags.parse_configs(["--rollout-b", "64"])


def test_every_argument_parser_refuses_abbreviations():
    """allow_abbrev=False on every argparse parser of the project (tools/ and notebooks/ included): OneLineParser
    forces it, and every plain argparse.ArgumentParser( call passes it."""
    import ast
    from plumbing.cli import OneLineParser
    assert OneLineParser(prog="x").allow_abbrev is False
    calls = []
    for path in ROOT.rglob("*.py"):
        if {".git", "runs"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                    "ArgumentParser":
                calls.append((path.name, any(k.arg == "allow_abbrev" and getattr(k.value, "value", True) is False
                                             for k in node.keywords)))
    assert calls and all(ok for _, ok in calls), [name for name, ok in calls if not ok]


@pytest.mark.parametrize("argv, words", [
    (["--frozen-zero-stage", "3"], "--frozen-zero-stage 3: ZeRO-3 inference engines"),
    (["--frozen-offload"], "--frozen-offload: ZeRO-3 inference engines"),
    (["--rollout-batch", "16", "--minibatch", "8", "--generate-batch", "5"], "--generate-batch 5: must divide"),
])
def test_bad_launch_combinations_are_one_line_before_any_work(argv, words, tmp_path):
    """Outside the launcher (one process, no --deepspeed) the frozen models cannot be ZeRO-3 engines; micro-batches
    must divide the rollout batch per process. One line, exit 2, nothing written."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and "Traceback" not in proc.stderr


def test_llama_alias_takes_the_released_scripts_lengths(monkeypatch):
    """--model llama-7b: prompts of up to 1536 tokens, responses of up to 512 (MOSS-RLHF's --maxlen_prompt 2048
    --maxlen_res 512), the paper's batches, the frozen models sharded and 4 prompts generated at a time under the
    launcher; a one-process run keeps a copy of the frozen models; the start-up line prints them all."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = plumbing.flags.parse_configs(["--model", "llama-7b"])
    assert (one[0].max_prompt_tokens, one[3].max_new_tokens, one[0].max_response_tokens) == (1536, 512, 512)
    assert (one[3].rollout_batch, one[3].minibatch, one[3].generate_batch) == (128, 32, 4)
    assert one[0].frozen_zero_stage == 0  # one process: no engines to shard them
    line = plumbing.flags.startup_line(one[0], one)
    assert '"max-new-tokens": 512' in line and '"max-prompt-tokens": 1536' in line and '"generate-batch": 4' in line
    launched = plumbing.flags.parse_configs(["--model", "llama-7b"], world=8)
    assert launched[0].frozen_zero_stage == 3 and launched[3].generate_batch == 4
    small = ["--model", "llama-7b", "--rollout-batch", "16", "--minibatch", "8"]  # 2 prompts per GPU: 2 at a time
    assert plumbing.flags.parse_configs(small, world=8)[3].generate_batch == 2


def test_plan_tiny_counts_the_tiny_model(capsys):
    plan = plumbing.flags.print_plan(["--plan", "--num-gpus", "1", "--gpu-mem", "4", "--zero-stage", "0", "--fp32",
                             "--sft-hidden", "32"])
    import toy_world
    model = sft.tiny_llama(len(toy_world.VOCAB), sft.SFTConfig(sft_hidden=32))
    assert plan.n_params["policy"] == sum(p.numel() for p in model.parameters())
    assert plan.settings["zero_stage"] == 0 and plan.settings["dtype_bytes"] == 4
    assert plan.fits
    assert "Memory plan per GPU: tiny" in capsys.readouterr().out


def test_plan_of_a_missing_model_fails_clearly(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(tmp_path / "nope"), "--plan"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model") and "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------ --model
def test_llama_preset_applies_to_flags_not_given():
    argv = ["--model", "llama-7b", "--critic-lr", "1e-6"]
    configs = plumbing.flags.parse_configs(argv)
    run, sft_cfg, rm_cfg, cfg = configs[:4]
    assert (cfg.policy_lr, cfg.warmup_frac, cfg.rollout_batch, cfg.minibatch) == (5e-7, 0.1, 128, 32)
    assert (cfg.lam, cfg.clip_eps, cfg.kl_coef, run.grad_ckpt) == (0.9, 0.2, 0.05, True)
    assert cfg.critic_lr == 1e-6, "a flag on the command line wins over the preset"
    line = plumbing.flags.startup_line(run, configs)
    assert line.startswith("preset 'ppo-max' + 'llama-7b' + 'real model'"), line   # the layers, named
    assert '"policy-lr": 5e-07' in line and '"critic-lr": 1e-06' in line          # what differs from the preset


@pytest.mark.parametrize("name", ["llama-7b", "someone/missing-model"])
def test_model_not_on_this_machine_fails_at_once(tmp_path, name):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", name, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --model {name}"), proc.stderr
    assert "download it" in lines[0] and "or pass a local directory" in lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists(), "nothing trained, no fallback"
    assert time.time() - t0 < 60


def test_real_model_without_reward_model_fails_clearly(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model") and "--reward-model" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_real_model_directories_run_ppo(tmp_path, monkeypatch):
    """--model / --reward-model as local Hugging Face directories (here the synthetic world's own SFT and reward
    model) and --prompts: PPO only, judged by the reward model; --warmup-frac 1 over 2 steps: lr ½α then α."""
    monkeypatch.chdir(tmp_path)
    base = Path(train.main(WORLD + ["--steps", "1", "--rollout-batch", "8", "--minibatch", "8",
                                    "--critic-pretrain-steps", "0", "--out", "tiny"])["base"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n"
                               for r in data.read_records(base / "data" / "prompts_train.jsonl")[:40]))
    summary = train.main(["--model", str(base / "sft"), "--reward-model", str(base / "reward_model"), "--prompts",
                          str(prompts), "--steps", "2", "--rollout-batch", "8", "--minibatch", "4",
                          "--critic-pretrain-steps", "1", "--warmup-frac", "1.0", "--grad-ckpt", "--eval-samples", "1",
                          "--threads", "1", "--out", "real"])
    assert summary["judge"] == "reward model" and summary["models"]["reward"] == str((base / "reward_model").resolve())
    m = metrics(tmp_path / "real")
    lr = ppo_max.PPOConfig().policy_lr                                      # α, the PPO-max default
    assert [x["lr/policy"] for x in m] == pytest.approx([lr / 2, lr])
    assert summary["config"]["ptx_coef"] == 0.0, "no SFT text with --prompts: ptx off"
    assert (tmp_path / "real" / "policy" / "config.json").is_file()


# ------------------------------------------------------------------------------------------------ real models
REAL_BUDGET = ["--steps", "2", "--sft-epochs", "1", "--sft-batch", "8", "--rm-epochs", "1", "--rm-batch", "8",
               "--rm-eval-every", "4", "--max-prompt-tokens", "48", "--max-response-tokens", "40", "--rollout-batch",
               "8", "--minibatch", "8", "--ppo-epochs", "1", "--ptx-batch", "4", "--max-new-tokens", "8",
               "--critic-pretrain-steps", "1", "--eval-samples", "1", "--threads", "1"]


def real_model_args(arch: str, tmp_path: Path) -> list[str]:
    import tiny_model
    from test_real_data import hh_pairs, write_jsonl
    pairs = write_jsonl(tmp_path / "pairs.jsonl", hh_pairs(96))
    model = tiny_model.build_model(arch, [p + r for p, r in data.load_texts(pairs)], tmp_path / "model", hidden=32,
                                   vocab_size=300)
    return ["--model", str(model), "--data", str(pairs), *REAL_BUDGET]


def assert_two_ranks_follow_one_process(one: Path, two: Path, stdout: str) -> None:
    """SFT and the reward model were DeepSpeed engines on 2 ranks, each taking half of every batch; their losses follow
    the one-process run's; PPO ran its steps and rank 0 wrote the policy."""
    assert "2 process(es)" in stdout
    for stage, log, key in (("sft", "sft_log.json", None), ("reward_model", "rm_log.json", "bt")):
        a, b = (json.loads((run / stage / log).read_text()) for run in (one, two))
        if key is None:
            a, b = a["loss"], b["loss"]
        else:
            a, b = ([t[key] for row in x for t in row.get("train", [])] for x in (a, b))
        # the first SFT step sees the same weights and the same batch split over two ranks; its loss differs only
        # because each rank takes its own token mean and the ranks average those (measured: 1e-3 of 5.7). Later
        # steps drift apart a little more (Adam turns small gradient differences into steps of size lr), and the
        # reward model starts from the two runs' slightly different SFT models
        assert len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) < 0.05, (stage, a, b)
        if stage == "sft":
            assert abs(a[0] - b[0]) < 1e-2, (a[0], b[0])
    assert len(metrics(two)) == 2 and (two / "policy" / "config.json").exists()


@pytest.mark.deepspeed
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_real_model_every_stage_under_deepspeed_matches_one_process(arch, tmp_path):
    """All four stages of a tiny real-architecture model under `deepspeed --num_gpus 2`: SFT and the reward model
    are DeepSpeed engines too, each rank takes half of every batch, and their losses follow the one-process run's."""
    args = real_model_args(arch, tmp_path)
    train.main(args + ["--out", str(tmp_path / "single")])
    proc = run_deepspeed(tmp_path, *args, "--out", "two")
    assert_two_ranks_follow_one_process(tmp_path / "single", tmp_path / "two", proc.stdout)
    assert "Warning" not in proc.stderr, proc.stderr  # no rank passes on a deprecation notice of DeepSpeed's own calls


@pytest.mark.deepspeed
def test_real_model_on_two_nodes_matches_one_process(tmp_path):
    """Two "nodes" on this machine, one process each, as on two hosts (docs/real-scale.md): `torchrun --nnodes 2
    --nproc_per_node 1 --node_rank R --master_addr 127.0.0.1 --master_port P train.py ... --deepspeed`, both started
    here, rendezvous over TCP. All four stages of a tiny LLaMA, checked as the 2-process test checks them. The two
    nodes share --out (a shared file system, as multi-node runs need: rank 0 writes every stage's directory)."""
    args = real_model_args("llama", tmp_path)
    train.main(args + ["--out", str(tmp_path / "single")])
    port = str(free_port())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(r), "--master_addr", "127.0.0.1", "--master_port", port,
                               str(ROOT / "train.py"), *args, "--out", "two", "--deepspeed"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=400) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert outs[1][0].count("preset 'ppo-max'") == 0, "only rank 0 prints"
    assert_two_ranks_follow_one_process(tmp_path / "single", tmp_path / "two", outs[0][0])


@pytest.mark.deepspeed
@pytest.mark.slow
def test_lora_under_deepspeed_resumes_exactly(tmp_path):
    """--lora-r under `deepspeed --num_gpus 2`: every stage trains adapters through engines, a checkpoint's engine
    state holds no frozen weights, and a resumed run writes the uninterrupted run's metrics."""
    import tiny_model
    from test_real_data import hh_pairs, write_jsonl
    pairs = write_jsonl(tmp_path / "pairs.jsonl", hh_pairs(96))
    model = tiny_model.build_model("llama", [p + r for p, r in data.load_texts(pairs)], tmp_path / "model", hidden=32,
                                   vocab_size=300)
    args = ["--model", str(model), "--data", str(pairs), *REAL_BUDGET, "--lora-r", "4", "--save-every", "1"]
    proc = run_deepspeed(tmp_path, *args, "--out", "full")
    assert "2 process(es)" in proc.stdout and "reference = the policy with adapters off" in proc.stdout
    full = tmp_path / "full"
    assert (full / "sft" / "adapter" / "adapter_config.json").is_file() and (full / "policy" / "adapter").is_dir()
    states = torch.load(full / "checkpoints" / "deepspeed" / "policy" / "step-000001" / "mp_rank_00_model_states.pt",
                        weights_only=False)["module"]
    assert states and all("lora_" in k for k in states), sorted(states)[:5]   # adapters only, no frozen weights
    part = tmp_path / "part"
    shutil.copytree(full, part)       # as if killed after step 1: its checkpoint 2 and its metrics line 2 gone
    for p in [part / "checkpoints" / "step-000002", *part.glob("checkpoints/deepspeed/*/step-000002*")]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    lines = (part / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text(lines[0] + "\n")
    run_deepspeed(tmp_path, "--resume", "part")
    assert metrics(part) == metrics(full) and len(metrics(full)) == 2
