"""The GPU check: three measurements for one lent GPU, one command, under 10 minutes on an H100/H200-class card.

  1. stages   all four stages of a ~1.08 B random-init LLaMA in bf16 under DeepSpeed (ZeRO-2, gradient
              checkpointing), a few steps each, each stage's peak GPU memory (torch.cuda.max_memory_allocated) beside
              what `train.py --plan` bills for the same flags (less its flat overhead: the CUDA context and NCCL
              buffers are not the caching allocator's), and the DeepSpeed engines still alive after it (0: every
              stage releases its own, so each starts near zero); --variants lora adds the same with LoRA adapters.
  2. steady   the same 1.08 B model at the llama aliases' lengths, prompts of 1536 tokens and responses of up to
              512 (--generate-batch 8 of 8 prompts), a few PPO iterations: the seconds of an iteration after a
              warm-up iteration (steady state, without loading or DeepSpeed's start), split into the rollout, the
              experience and the update; the rollout's tokens/s against the decoding bound of the GPU's measured
              memory bandwidth (tools/bench.py decode_roofline: the weights and the KV cache read once per step),
              and the update's FLOP/s (its matmuls and attention counted from the shapes on the warm-up iteration,
              tools/bench.py MatmulLog) against the GPU's own bf16 matmul rate (a large torch.mm, timed here).
  3. lora-7b  a 6.74 B LLaMA at LLaMA-7B's widths (random weights, tools/memory_check.build_wide with 32 layers) with
              --lora-r 16, its SFT and reward model given (no stages 1-2), 2 PPO iterations on the one GPU: the peak
              beside `train.py --plan`'s bill of that run.

Run:
    python tools/gpu_check.py                        # all three on the GPU (writes ~30 GB under --out)
    python tools/gpu_check.py --tiny                 # the same three on tiny models: a dry run that works on a CPU
    python tools/gpu_check.py --checks stages --variants full,lora

Each stage is one `train.main` call in this process (`--deepspeed`: a DeepSpeed world of one), `--stages` growing by
one stage each time, so finished stages are reused and each call's peak memory and wall time are its new stage's
(the last call, `ppo`, also pre-trains the critic again: its line is critic + PPO). Tokens/s count the tokens the
stage trained on or generated: SFT steps × batch × mean SFT length; RM steps × 2 × batch × mean pair length; PPO
steps × rollout batch × (prompt + response), forward and update together. The plan assumes the longest sequences
the flags allow (P = --max-prompt-tokens, T = --max-new-tokens); the data's are shorter in check 1, so measured <
planned is expected by about that ratio there; check 2's prompts are cut to the full 1536 tokens and a random model
seldom stops before 512.

Nothing here has run on a GPU since plumbing/engine.release (docs/real-scale.md says so); the tests run --tiny.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))  # bench, memory_check

import torch

from plumbing import cli
from plumbing import data
import tiny_model
import train
import plumbing.flags

HH = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")


def engines_alive() -> int:
    """DeepSpeed engines still alive after a stage: each one holds its optimizer states (and on a GPU adds them to
    the next stage's peak); every stage releases its own (engine.release), so this is 0."""
    import gc
    gc.collect()
    return sum(type(o).__name__ == "DeepSpeedEngine" for o in gc.get_objects())


def planned_gib(argv: list[str]) -> dict[str, float]:
    """What `train.py ARGV --plan` predicts per stage, in GiB, less its flat overhead: {"sft", "rm", "critic+ppo"}."""
    import contextlib
    import io
    mem = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if torch.cuda.is_available() else 80
    with contextlib.redirect_stdout(io.StringIO()):
        plan = plumbing.flags.print_plan(argv + ["--plan", "--num-gpus", "1", "--gpu-mem", f"{mem:.1f}"])
    sft, rm = (p["total_bytes"] - p["rows"]["overhead"] for p in plan.stages)
    return {"sft": sft / 2 ** 30, "rm": rm / 2 ** 30, "critic+ppo": (plan.total_bytes - plan.overhead_bytes) / 2 ** 30}


def stages(argv: list[str], run: Path, variant: str, P: int, sft_len: float, pair_len: float) -> list[dict]:
    """SFT, then the reward model, then critic + PPO: one train.main call each (finished stages reused), with
    each call's wall time, tokens/s and peak GPU memory beside the plan's."""
    plan = planned_gib(argv)
    results = []
    for stages in ("sft", "sft,rm", "sft,rm,critic,ppo"):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        train.main(argv + ["--stages", stages])
        seconds = time.time() - t0
        stage = stages.split(",")[-1]
        if stage == "sft":
            steps = len(json.loads((run / "sft" / "sft_log.json").read_text())["loss"])
            tokens = steps * 16 * sft_len
        elif stage == "rm":
            log = json.loads((run / "reward_model" / "rm_log.json").read_text())
            tokens = sum(len(x.get("train", [])) for x in log) * 2 * 8 * pair_len
        else:
            summary = json.loads((run / "summary.json").read_text())
            lengths = [json.loads(l)["response/length"] for l in (run / "metrics.jsonl").read_text().splitlines()]
            tokens = 32 * sum(P + n for n in lengths)
            seconds = summary["timings"]["ppo"] + summary["timings"].get("critic_pretrain", 0.0)
        name = "critic+ppo" if stage == "ppo" else stage
        results.append({"variant": variant, "stage": name, "seconds": round(seconds, 1),
                        "tokens_per_s": round(tokens / seconds, 1), "peak_gib": round(peak_gib(), 2),
                        "plan_gib": round(plan[name], 4), "engines_left": engines_alive()})
        print(f"[gpu check] {results[-1]}", file=sys.stderr)
    return results


def long_prompts(path: Path, tok, n: int, tokens: int) -> Path:
    """n {"prompt"} lines of at least `tokens` tokens each: HH's dialogues one after another (the run cuts each to
    --max-prompt-tokens, keeping its latest turns)."""
    texts = [p for p, _ in data.load_texts(HH, skip_bad=True)]
    rows, cur, i = [], "", 0
    while len(rows) < n:
        cur, i = cur + texts[i % len(texts)], i + 1
        if len(tok(cur)["input_ids"]) >= tokens:
            rows.append(json.dumps({"prompt": cur}))
            cur = ""
    path.write_text("\n".join(rows) + "\n")
    return path


def given_models(model: Path, out: Path) -> list[str]:
    """--sft-model and --reward-model for a run that skips stages 1-2: the random model itself, and a reward model
    made of it with a fresh seeded head (bf16, no training)."""
    from reward_model import ScalarHeadModel
    if not (out / "value_head.safetensors").is_file():
        dtype = torch.bfloat16 if torch.cuda.is_available() else None
        ScalarHeadModel.from_pretrained(model, seed=0, torch_dtype=dtype).save_pretrained(out)
        data.load_tokenizer(model).save_pretrained(out)
    return ["--model", str(model), "--sft-model", str(model), "--reward-model", str(out), "--judge-frac", "0"]


def bf16_matmul_rate(n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of one n × n × n torch.mm in bf16 on the GPU (2·n³ per product), best of `reps`: the card's own
    matmul rate, the ceiling of the update's achieved FLOP/s. NaN without a GPU."""
    if not torch.cuda.is_available():
        return float("nan")
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(x, x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def timed_iterations(argv: list[str]) -> list[dict]:
    """train.main(argv) with the loop's three calls timed per iteration (rollout: Sampler.__call__; experience:
    make_experience; update: ppo_update; the GPU synchronised around each), the rollout's decoded tokens (batch ×
    steps) and, on iteration 0 only, the update's FLOPs counted from the shapes (bench.MatmulLog)."""
    import contextlib
    import bench
    import ppo_max
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    iters: list[dict] = [{}]
    originals = {"rollout": ppo_max.Sampler.__call__, "experience": ppo_max.make_experience,
                 "update": ppo_max.ppo_update}

    def timed(name, fn):
        def call(*a, **k):
            log = bench.MatmulLog() if name == "update" and len(iters) == 1 else contextlib.nullcontext()
            sync()
            t0 = time.perf_counter()
            with log:
                r = fn(*a, **k)
            sync()
            it = iters[-1]
            it[f"{name}_s"] = time.perf_counter() - t0
            if name == "rollout":
                it["decoded_tokens"] = r[0].shape[0] * r[0].shape[1]
                it["prompt_len"] = a[2].shape[1]
            if isinstance(log, bench.MatmulLog):
                it["update_flop"] = log.mm_flops + log.attention_flops
            if name == "update":
                iters.append({})
            return r
        return call

    try:
        ppo_max.Sampler.__call__ = timed("rollout", originals["rollout"])
        ppo_max.make_experience = timed("experience", originals["experience"])
        ppo_max.ppo_update = timed("update", originals["update"])
        train.main(argv)
    finally:
        ppo_max.Sampler.__call__ = originals["rollout"]
        ppo_max.make_experience, ppo_max.ppo_update = originals["experience"], originals["update"]
    return [it for it in iters if "update_s" in it]


def steady_state(model: Path, out: Path, tiny: bool, steps: int, threads: int) -> dict:
    """Check 2: PPO at the aliases' lengths on `model`, the seconds of an iteration after one warm-up iteration, the
    rollout's tokens/s against the bandwidth bound of decoding and the update's FLOP/s against the bf16 matmul rate."""
    import bench
    from plumbing import scale
    P, T, B, g = (48, 16, 4, 2) if tiny else (1536, 512, 8, 8)
    tok = data.load_tokenizer(model)
    prompts = long_prompts(out / "long_prompts.jsonl", tok, 4 * B, P)
    argv = [*given_models(model, out / "steady-rm"), "--data", str(HH), "--skip-bad", "--prompts", str(prompts),
            "--deepspeed", "--grad-ckpt", "--max-prompt-tokens", str(P), "--max-new-tokens", str(T),
            "--rollout-batch", str(B), "--minibatch", str(B // 2), "--generate-batch", str(g), "--ptx-batch", "2",
            "--critic-pretrain-steps", "0", "--steps", str(max(steps, 3)), "--heldout-every", "0", "--eval-samples",
            "1", "--threads", str(threads), "--out", str(out / "run-steady"), *([] if tiny else ["--bf16"])]
    iters = timed_iterations(argv)
    warm, timed = iters[0], iters[1:]
    mean = lambda key: sum(it[key] for it in timed) / len(timed)  # noqa: E731
    numbers = scale.llama_config_numbers(str(model))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = bench.measure_bandwidth(device, (1024 if device.type == "cuda" else 64) * bench.MiB)
    bound = bench.decode_roofline(numbers, 2 if not tiny else 4, g, warm["prompt_len"], T, bandwidth)
    rollout_tok_s = mean("decoded_tokens") / mean("rollout_s")
    update_flop_s = warm["update_flop"] / mean("update_s")
    peak = bf16_matmul_rate()
    result = {"prompt_len": warm["prompt_len"], "max_new_tokens": T, "rollout_batch": B, "generate_batch": g,
              "iterations_timed": len(timed), "warmup_iteration_s": round(sum(warm[k] for k in
                                                                              ("rollout_s", "experience_s", "update_s")), 2),
              "iteration_s": round(mean("rollout_s") + mean("experience_s") + mean("update_s"), 3),
              "rollout_s": round(mean("rollout_s"), 3), "experience_s": round(mean("experience_s"), 3),
              "update_s": round(mean("update_s"), 3), "rollout_tok_s": round(rollout_tok_s, 1),
              "decode_bound_tok_s": round(bound["roofline_tok_s_batch"], 1),
              "rollout_of_bound": round(rollout_tok_s / bound["roofline_tok_s_batch"], 3),
              "bandwidth_GB_s": round(bandwidth / 1e9, 1), "update_tflop": round(warm["update_flop"] / 1e12, 3),
              "update_tflop_s": round(update_flop_s / 1e12, 3), "bf16_matmul_tflop_s": round(peak / 1e12, 1),
              "update_of_matmul_rate": round(update_flop_s / peak, 3) if peak == peak else None}
    print(f"[gpu check] steady {result}", file=sys.stderr)
    return result


def lora_7b(out: Path, tiny_model_dir: Path, tiny: bool, threads: int) -> dict:
    """Check 3: a 6.74 B LLaMA at LLaMA-7B's widths (random weights; --tiny: the tiny model) with --lora-r 16, two
    PPO iterations on the one GPU (DeepSpeed engines in one process), its peak beside the plan of the same flags."""
    import memory_check
    model = tiny_model_dir if tiny else memory_check.build_wide(out / "wide7b", layers=32)
    argv = [*given_models(model, out / ("lora-rm" if tiny else "wide7b-rm")), "--data", str(HH), "--skip-bad",
            "--deepspeed", "--grad-ckpt", "--lora-r", "16", "--max-prompt-tokens", "256" if not tiny else "48",
            "--max-new-tokens", "128" if not tiny else "16", "--rollout-batch", "4", "--minibatch", "2",
            "--ptx-batch", "2", "--critic-pretrain-steps", "0", "--steps", "2", "--heldout-every", "0",
            "--eval-samples", "1", "--threads", str(threads), "--out", str(out / "run-lora-7b"),
            *([] if tiny else ["--bf16"])]
    plan = planned_gib(argv)["critic+ppo"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    train.main(argv)
    n = scale_params(model)
    result = {"params": n, "seconds": round(time.time() - t0, 1), "peak_gib": round(peak_gib(), 2),
              "plan_gib": round(plan, 3), "steps": len((out / "run-lora-7b" / "metrics.jsonl").read_text().splitlines())}
    print(f"[gpu check] lora-7b {result}", file=sys.stderr)
    return result


def drop_checkpoints(out: Path) -> None:
    """The finished runs' checkpoints (a 1 B model's engines with their fp32 Adam states: ~13 GB each) deleted, so
    the three checks fit a 64 GiB disk."""
    import shutil
    for d in out.glob("run-*/checkpoints"):
        shutil.rmtree(d, ignore_errors=True)


def scale_params(model: Path) -> int:
    from plumbing import scale
    return scale.arch_numbers(str(model))["n_params"]


CHECKS = ("stages", "steady", "lora-7b")


def main(argv=None) -> dict:
    p = cli.OneLineParser(prog="tools/gpu_check.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", default="runs/gpu_check", help="working directory of the check")
    p.add_argument("--tiny", action="store_true", help="tiny models: checks the script itself, on a CPU too")
    p.add_argument("--steps", type=int, default=4, help="PPO iterations of checks 1 and 2 (2: at least 3)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads of every stage (0 = torch's default); "
                                                           "the CPU dry run of the tests uses 1")
    p.add_argument("--variants", default="full", help="check 1: full (every weight trains), lora (--lora-r 16 "
                                                      "adapters on every linear layer), or full,lora")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)} to run")
    a = p.parse_args(argv)
    if a.steps < 1:
        cli.fail(f"--steps {a.steps}: must be ≥ 1")
    if a.threads < 0:
        cli.fail(f"--threads {a.threads}: must be ≥ 0")
    if not a.variants or any(v not in ("full", "lora") for v in a.variants.split(",")):
        cli.fail(f"--variants {a.variants}: expected full, lora or full,lora")
    checks = a.checks.split(",")
    if not checks or any(c not in CHECKS for c in checks):
        cli.fail(f"--checks {a.checks}: expected some of {','.join(CHECKS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [x + y for x, y in data.load_texts(HH, skip_bad=True)]
    size = dict(hidden=32, layers=2, heads=4, vocab_size=500) if a.tiny else dict(hidden=2048, layers=16, heads=16,
                                                                                  vocab_size=32000, max_positions=2048)
    model = out / "model"
    if not (model / "config.json").exists():
        tiny_model.build_model("llama", texts, model, **size)
    report = {"params": scale_params(model),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if "stages" in checks:
        report["stages"] = check_stages(model, out, a)
        drop_checkpoints(out)
    if "steady" in checks:
        report["steady"] = steady_state(model, out, a.tiny, a.steps, a.threads)
        drop_checkpoints(out)
    if "lora-7b" in checks:
        report["lora_7b"] = lora_7b(out, model, a.tiny, a.threads)
        drop_checkpoints(out)
    print(json.dumps(report, indent=2))
    return report


def check_stages(model: Path, out: Path, a) -> list[dict]:
    """Check 1: every stage of the 1.08 B model, its peak beside the plan (stages)."""
    P, T = (48, 32) if a.tiny else (256, 128)
    common = ["--model", str(model), "--data", str(HH), "--skip-bad", "--deepspeed",
              "--grad-ckpt", "--max-prompt-tokens", str(P), "--max-response-tokens", str(T),
              "--threads", str(a.threads),
              "--sft-epochs", "0.05", "--sft-batch", "16", "--rm-epochs", "0.05", "--rm-batch", "8",
              "--rm-eval-every", "1000", "--steps", str(a.steps), "--rollout-batch", "32", "--minibatch", "8",
              "--ptx-batch", "8", "--max-new-tokens", str(T), "--critic-pretrain-steps", "2", "--eval-samples", "1",
              *([] if a.tiny else ["--bf16"])]
    tok = data.load_tokenizer(model)
    pairs = data.pair_records(data.load_pairs(HH, skip_bad=True), tok, P, T, True, data.DataReport())
    pair_len = sum(len(data.query_ids(r["prompt"], tok)) * 2 + len(data.response_ids(r["chosen"], tok))
                   + len(data.response_ids(r["rejected"], tok)) for r in pairs) / len(pairs) / 2
    sft_len = sum(len(data.query_ids(r["prompt"], tok)) + len(data.response_ids(r["chosen"], tok))
                  for r in pairs) / len(pairs)
    results = []
    for variant in a.variants.split(","):  # full weights, then LoRA adapters (r 16) on the same model and data
        extra = ["--lora-r", "16", "--lora-targets", "all-linear"] if variant == "lora" else []
        results += stages(common + extra + ["--out", str(out / f"run-{variant}")], out / f"run-{variant}", variant,
                          P, sft_len, pair_len)
    for r in results:  # the plan beside the measurement, one line per stage
        print(f"[gpu check] {r['variant']:4s} {r['stage']:10s} plan {r['plan_gib']:8.3f} GiB   "
              f"torch.cuda.max_memory_allocated {r['peak_gib']:8.2f} GiB", file=sys.stderr)
    return results


if __name__ == "__main__":
    cli.cli_guard(main)()
