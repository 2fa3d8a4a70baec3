"""The GPU check: all four stages of a ~1B random-init LLaMA in bf16 under DeepSpeed (ZeRO-2, gradient
checkpointing), a few steps each, with tokens/s and peak GPU memory per stage, once with full weights and once with
LoRA adapters (--lora-r 16 on every linear layer). Never needed by the tests.

Run (one GPU, under 10 minutes on an H100/H200-class card):
    python tools/gpu_check.py                        # ~1.1 B parameters: h 2048, 16 layers, V = the BPE's size
    python tools/gpu_check.py --tiny                 # the same stages on a 0.1 M model: a dry run that works on a CPU
    python tools/gpu_check.py --variants lora        # only the LoRA run

Each stage is one `train.main` call in this process (`--deepspeed`: a DeepSpeed world of one), `--stages` growing by
one stage each time, so finished stages are reused and each call's peak memory and wall time are its new stage's
(the last call, `ppo`, also pre-trains the critic again: its line is critic + PPO). Tokens/s count the tokens the
stage trained on or generated: SFT steps × batch × mean SFT length; RM steps × 2 × batch × mean pair length; PPO
steps × rollout batch × (prompt + response), forward and update together.

Beside each stage's torch.cuda.max_memory_allocated it prints what `train.py --plan` predicts for the same flags
(plumbing/scale.py: plan_stage_memory for SFT and the reward model, plan_memory for PPO), without the plan's flat overhead
(the CUDA context and NCCL buffers are not the caching allocator's): the first GPU run checks the plan. Each stage's
line also counts the DeepSpeed engines still alive after it (engines_left, 0 when every stage released its own).
The plan assumes the longest sequences the flags allow (P = --max-prompt-tokens, T = --max-new-tokens); the data's are
shorter, so measured < planned is expected by about that ratio.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)

import torch

from plumbing import cli
from plumbing import data
from plumbing import pipeline
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


def main(argv=None) -> list[dict]:
    p = cli.OneLineParser(prog="tools/gpu_check.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", default="runs/gpu_check", help="working directory of the check")
    p.add_argument("--tiny", action="store_true", help="a 0.1 M model: checks the script itself, on a CPU too")
    p.add_argument("--steps", type=int, default=4, help="PPO iterations")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads of every stage (0 = torch's default); "
                                                           "the CPU dry run of the tests uses 1")
    p.add_argument("--variants", default="full,lora", help="full (every weight trains), lora (--lora-r 16 adapters "
                                                           "on every linear layer), or both")
    a = p.parse_args(argv)
    if a.steps < 1:
        cli.fail(f"--steps {a.steps}: must be ≥ 1")
    if a.threads < 0:
        cli.fail(f"--threads {a.threads}: must be ≥ 0")
    if not a.variants or any(v not in ("full", "lora") for v in a.variants.split(",")):
        cli.fail(f"--variants {a.variants}: expected full, lora or full,lora")
    out = Path(a.out)
    texts = [x + y for x, y in data.load_texts(HH, skip_bad=True)]
    size = dict(hidden=32, layers=2, heads=4, vocab_size=500) if a.tiny else dict(hidden=2048, layers=16, heads=16,
                                                                                  vocab_size=32000)
    model = out / "model"
    if not (model / "config.json").exists():
        tiny_model.build_model("llama", texts, model, **size)
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
    n = sum(x.numel() for x in pipeline.load_lm(model, False, torch.device("cpu"), False).parameters())
    print(json.dumps({"params": n, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "stages": results}, indent=2))
    return results


if __name__ == "__main__":
    cli.cli_guard(main)()
