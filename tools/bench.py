"""Benchmark one PPO-max iteration of this project's own loop (rollout, make_experience, ppo_update) at 3 sizes.

Implements (no equation of Zheng et al. 2023 here: this file times the functions that implement them):
    CONFIGS                          tiny (the synthetic world's model), 25m (~27M), 1b (~0.94B, GPU only)
    build_models(numbers, ...)       random-init policy, reference, reward model and critic (ScalarHeadModel)
    bench_config(name, ...)          warm-up + N timed iterations of ppo_max.rollout / make_experience / ppo_update
    measure_bandwidth(device)        memory bandwidth of a large tensor copy (STREAM "copy": 2 bytes moved / byte)
    decode_roofline(...)             max decoding tokens/s when every step must read the weights and the KV cache
    main(argv) -> dict               the two tables; also what `--json OUT` writes and tests/test_bench.py checks
    world_main(argv) -> dict         `world`: the synthetic world's own runs as whole processes (a new seed's base,
                                     one variant run, eight variants through the notebooks' runner: runs per hour),
                                     this tree beside an older commit (--against REF, a git worktree of it), and one
                                     PPO iteration's matmul FLOPs counted from the shapes (MatmulLog) against the
                                     single-thread GEMM rate at those shapes (gemm_rate)

Run: python tools/bench.py [--configs tiny,25m,1b] [--iters N] [--device auto|cpu|cuda] [--dtype auto|fp32|bf16]
                     [--batch B] [--prompt-len P] [--response-len T] [--threads N] [--json OUT]
     (default: tiny and 25m on the CPU in fp32, sized for < 3 minutes on 2 free cores; 1b: GPU only, bf16)
     python tools/bench.py world [--against REF] [--steps N] [--variants N] [--small] [--json OUT]
     (the default budget: about 5 minutes per tree on 2 free cores; --small: the notebooks' small world, a check)
     On a shared, loaded CPU, OpenMP threads that outnumber the free cores wait on each other at every op:
     compare with --threads 1 before reading the numbers as the machine's.

What is timed, per iteration (as train.py's loop, steps 1–6):
    rollout          ppo_max.rollout: HF generate with the KV cache, B prompts × T new tokens (prefill included).
                     Every response has exactly T tokens: the policy's generation_config gets min_new_tokens = T,
                     so generate's own MinNewTokensLengthLogitsProcessor sets the EOS logit to −∞ for T steps
                     (rollout itself is called unchanged; random weights would otherwise stop at random lengths).
    make_experience  reward score, reference + policy log-probs, critic values, GAE: 4 forward passes, no grad.
    ppo_update       cfg.ppo_epochs passes of policy (PPO-clip + ptx on a random "SFT" batch) and critic
                     (clipped value loss) forward + backward + AdamW step, with PPOConfig's PPO-max defaults.
Throughputs: rollout tokens/s = B·T / rollout seconds. update tokens/s = tokens through a forward + backward
pass / ppo_update seconds, counting policy, ptx and critic passes separately:
ppo_epochs · (B·L + B·L + minibatches·ptx_batch·L), L = P + T.

Decoding roofline (Williams et al. 2009; Pope et al. 2022, section 2): at batch b, one decoding step reads every weight
matrix once (shared by the b sequences) plus each sequence's KV cache, so
    tokens/s ≤ b·BW / (W + b·KV_read),   W = (N − V·h)·β,   KV_read = 2·ℓ·k·d·β · (P + (T − 1)/2)
(β bytes per number; the embedding table is a lookup of b rows, so it is left out of W; KV_read is the mean
cache read over the T steps). BW is measured here, not taken from a data sheet. Achieved = rollout tokens/s
over the batch bound; a small model on the CPU sits in the caches and far below the bound (Python and
generate's per-step overhead dominate), a 1B model on a GPU is where the bound is meant to be read.

References:
    Williams, Waterman, Patterson 2009, "Roofline: An Insightful Visual Performance Model for Multicore Architectures".
    Pope et al. 2022, "Efficiently Scaling Transformer Inference" (decoding is memory-bound; KV cache bytes).
    McCalpin 1995, STREAM benchmark (the copy kernel and its 2-bytes-per-byte accounting).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import resource
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)

import torch

import ppo_max
from reward_model import ScalarHeadModel
from plumbing.scale import llama_param_count
from plumbing.cli import OneLineParser, fail
from plumbing.data import pad

MiB, GiB = 2**20, 2**30
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # as sft.tiny_llama; random prompt tokens are drawn from [3, V)

# LlamaConfig numbers + default (batch, prompt length, response length, timed iterations) of each named config;
# the defaults size `python tools/bench.py` for under 3 minutes on 2 free CPU cores.
CONFIGS: dict[str, dict] = {
    # the synthetic world's model (sft.tiny_llama with SFTConfig defaults; the world's tokenizer has 91 ids);
    # B, T = PPOConfig.rollout_batch, max_new_tokens
    "tiny": dict(llama=dict(vocab_size=91, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=256), batch=64, prompt_len=16, response_len=24,
             iters=2),
    "25m": dict(llama=dict(vocab_size=8000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                           num_key_value_heads=8, intermediate_size=1376), batch=16, prompt_len=16, response_len=32,
            iters=1),
    "1b": dict(llama=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=16, intermediate_size=5504), batch=32, prompt_len=128, response_len=128,
               iters=3, gpu_only=True),
}
# The columns every result row has; each is a positive number (tests/test_bench.py checks this).
COLUMNS = ("params", "rollout_tok_s", "experience_s", "update_tok_s", "iter_s", "peak_mem_bytes",
           "weight_bytes_per_step", "kv_bytes_per_token", "kv_cache_bytes", "bandwidth_bytes_s",
           "roofline_tok_s_seq", "roofline_tok_s_batch", "achieved_frac")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_models(numbers: dict, max_len: int, device: torch.device, dtype: torch.dtype):
    """Random-init policy, reference (a copy of the policy, as π_SFT is at step 0), reward model and critic
    (a copy of the reward model, PPO-max's critic_init='rm'). Built directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**numbers, max_position_embeddings=max(128, max_len), bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    with torch.device(device):  # initialised in place: a 1B model never passes through host memory
        policy = LlamaForCausalLM(config).to(dtype)
        reward_lm = LlamaForCausalLM(config).to(dtype)
    reward_model = ScalarHeadModel(reward_lm)  # outside: its seeded head draws from a CPU generator, then moves
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    critic = copy.deepcopy(reward_model)
    reward_model.eval().requires_grad_(False)
    return policy, ref, reward_model, critic


def random_batch(n: int, length: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """n random prompts: BOS + length−1 ids from [3, V), left-padded by data.pad (here all the same length)."""
    seqs = [[BOS_ID] + torch.randint(3, vocab, (length - 1,)).tolist() for _ in range(n)]
    ids, mask = pad(seqs, PAD_ID, "left")  # (n, length), (n, length)
    return ids.to(device), mask.to(device)


def bench_config(name: str, iters: int | None, device: torch.device, dtype: torch.dtype, batch: int | None = None,
                 prompt_len: int | None = None, response_len: int | None = None, seed: int = 0) -> dict:
    """Warm-up + `iters` timed PPO iterations of config `name`. Returns one row (the roofline is added later)."""
    spec = CONFIGS[name]
    numbers = spec["llama"]
    iters = iters or spec["iters"]
    B = batch or spec["batch"]
    P = prompt_len or spec["prompt_len"]
    T = response_len or spec["response_len"]
    L = P + T
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    policy, ref, reward_model, critic = build_models(numbers, L, device, dtype)
    policy.generation_config.min_new_tokens = T  # EOS masked for T steps: full-length responses (see docstring)
    # PPO-max defaults; the minibatch and ptx batch shrink with a small rollout batch
    default = ppo_max.PPOConfig()
    cfg = dataclasses.replace(default, rollout_batch=B, max_new_tokens=T, minibatch=min(default.minibatch, B),
                              ptx_batch=min(default.ptx_batch, B))
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.policy_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    moments = ppo_max.RunningMoments()

    def ptx_batch():
        """A random stand-in for the SFT text of Eq. 17: L tokens, the last T are targets."""
        ids, attn = random_batch(cfg.ptx_batch, L, numbers["vocab_size"], device)  # (b, L), (b, L)
        resp = torch.zeros_like(attn)
        resp[:, P:] = 1.0                                                          # (b, L)
        return ids, attn, resp

    timings = {"rollout": 0.0, "experience": 0.0, "update": 0.0, "iter": 0.0}
    for it in range(iters + 1):  # iteration 0 is the warm-up (allocator, kernels, lazy inits), not timed
        query, query_mask = random_batch(B, P, numbers["vocab_size"], device)  # (B, P)
        sync(device)
        t0 = time.perf_counter()
        policy.eval()
        response, response_mask, _ = ppo_max.rollout(policy, query, query_mask, T, EOS_ID, PAD_ID, cfg.temperature)
        sync(device)
        t1 = time.perf_counter()
        exp = ppo_max.make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                                      moments, cfg, cfg.kl_coef)
        sync(device)
        t2 = time.perf_counter()
        policy.train(); critic.train()
        ppo_max.ppo_update(policy, critic, policy_opt, critic_opt, exp, cfg, ptx_batch)
        sync(device)
        t3 = time.perf_counter()
        if response.shape != (B, T) or not bool(response_mask.all()):
            raise RuntimeError(f"bench.py: expected full-length responses (B, T) = ({B}, {T}); got "
                               f"{tuple(response.shape)} with {int(response_mask.sum())} real tokens")
        if it > 0:
            for k, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                timings[k] += dt / iters

    minibatches = math.ceil(B / cfg.minibatch)
    update_tokens = cfg.ppo_epochs * (2 * B * L + (minibatches * cfg.ptx_batch * L if cfg.ptx_coef else 0))
    if device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:  # Linux reports KiB; the process's high-water mark since start, so it never falls from one config to the next
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (process peak RSS)"
    row = {
        "config": name, "params": llama_param_count(numbers),
        "params_counted": sum(p.numel() for p in policy.parameters()),
        "device": device.type, "dtype": str(dtype).replace("torch.", ""), "batch": B, "prompt_len": P,
        "response_len": T, "iters": iters, "ppo_epochs": cfg.ppo_epochs, "minibatch": cfg.minibatch,
        "rollout_s": timings["rollout"], "rollout_tok_s": B * T / timings["rollout"],
        "experience_s": timings["experience"],
        "update_s": timings["update"], "update_tokens": update_tokens,
        "update_tok_s": update_tokens / timings["update"],
        "iter_s": timings["iter"], "peak_mem_bytes": peak, "peak_mem_kind": peak_kind,
    }
    del policy, ref, reward_model, critic, policy_opt, critic_opt, exp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure_bandwidth(device: torch.device, nbytes: int = 256 * MiB, reps: int = 5) -> float:
    """Bytes/s of `dst.copy_(src)` on `nbytes` arrays (far larger than any CPU cache), best of `reps`, counting
    2·nbytes per copy (read + write, STREAM's convention; a CPU's write-allocate traffic is not counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()  # touched: pages are real
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def decode_roofline(numbers: dict, dtype_bytes: int, batch: int, prompt_len: int, response_len: int,
                    bandwidth: float) -> dict:
    """Bytes one decoding step must read and the tokens/s that `bandwidth` allows (see the module docstring)."""
    h, n_layers, V = numbers["hidden_size"], numbers["num_hidden_layers"], numbers["vocab_size"]
    k, d = numbers["num_key_value_heads"], h // numbers["num_attention_heads"]
    weight_bytes = (llama_param_count(numbers) - V * h) * dtype_bytes  # W: all matrices but the embedding table
    kv_per_token = 2 * n_layers * k * d * dtype_bytes                   # K and V of one position, all layers
    kv_read = kv_per_token * (prompt_len + (response_len - 1) / 2)      # mean cache read per sequence per step
    return {
        "weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_per_token,
        "kv_cache_bytes": kv_per_token * batch * (prompt_len + response_len),  # the cache at the last step
        "bandwidth_bytes_s": bandwidth,
        "roofline_tok_s_seq": bandwidth / (weight_bytes + kv_read),                   # b = 1
        "roofline_tok_s_batch": batch * bandwidth / (weight_bytes + batch * kv_read),  # b = B, W read once per step
    }


def machine_info(device: torch.device, threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "threads": threads, "python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_num(x: float) -> str:
    for suffix, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.{2 if suffix == 'B' else 1}f}{suffix}"
    return f"{x:.3g}"


def format_tables(result: dict) -> str:
    rows = result["rows"]
    t1 = [("config", "params", "device/dtype", "B×(P+T)", "iters", "rollout tok/s", "experience s", "update tok/s",
           "s / PPO iter", "peak mem")]
    t2 = [("config", "weights read/step", "KV bytes/token", "KV cache", "bandwidth", "max tok/s (1 seq)",
           "max tok/s (batch)", "achieved")]
    for r in rows:
        t1.append((r["config"], fmt_num(r["params"]), f"{r['device']}/{r['dtype']}",
                   f"{r['batch']}×({r['prompt_len']}+{r['response_len']})", r["iters"], f"{r['rollout_tok_s']:.0f}",
                   f"{r['experience_s']:.2f}", f"{r['update_tok_s']:.0f}", f"{r['iter_s']:.2f}",
                   fmt_bytes(r["peak_mem_bytes"])))
        t2.append((r["config"], fmt_bytes(r["weight_bytes_per_step"]), fmt_bytes(r["kv_bytes_per_token"]),
                   fmt_bytes(r["kv_cache_bytes"]), f"{r['bandwidth_bytes_s'] / 1e9:.1f} GB/s",
                   f"{r['roofline_tok_s_seq']:.0f}", f"{r['roofline_tok_s_batch']:.0f}",
                   f"{100 * r['achieved_frac']:.2f}%"))

    def table(t):
        w = [max(len(str(row[i])) for row in t) for i in range(len(t[0]))]
        return "\n".join("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(row))
                         for row in t)

    m = result["machine"]
    lines = [f"machine: {m['cpu']}, {m['threads']} torch threads" + (f", GPU {m['gpu']}" if "gpu" in m else "")
             + f"; torch {m['torch']}, python {m['python']}", "",
             "PPO loop (mean of the timed iterations, after one warm-up)",
             table(t1), "", "decoding roofline (bandwidth measured here by a large tensor copy)", table(t2), ""]
    if rows:
        lines += [f"peak mem: {rows[0]['peak_mem_kind']}.",
                  "update tok/s counts policy, ptx and critic forward+backward tokens; s / PPO iter = rollout + "
                  "experience + update.",
                  "achieved = rollout tok/s / max tok/s (batch); the rollout includes the prefill."]
    lines += [f"skipped {s['config']}: {s['why']}" for s in result["skipped"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="tools/bench.py", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,25m,1b", help=f"comma-separated, from {list(CONFIGS)}; 1b needs a GPU")
    p.add_argument("--iters", type=int, default=None, help="timed PPO iterations per config, after one warm-up "
                   "(default: per config, tiny 2, 25m 1, 1b 3)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 on a GPU that has it, else fp32 (bf16: pure bf16 weights and AdamW states)")
    p.add_argument("--batch", type=int, default=None, help="B, prompts per rollout (default: per config)")
    p.add_argument("--prompt-len", type=int, default=None, help="P (default: per config)")
    p.add_argument("--response-len", type=int, default=None, help="T (default: per config)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = every core this process may use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=0,
                   help="size of each array of the bandwidth copy (0: 256 on the CPU, 1024 on a GPU)")
    p.add_argument("--json", default="", help="also write the results to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for flag, v, lo in (("--iters", args.iters, 1), ("--batch", args.batch, 1), ("--prompt-len", args.prompt_len, 1),
                        ("--response-len", args.response_len, 1), ("--threads", args.threads, 0),
                        ("--bandwidth-mib", args.bandwidth_mib, 0)):
        if v is not None and v < lo:
            fail(f"{flag} {v}: must be ≥ {lo}")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    # ppo_update logs float(ptx) of a tensor that still requires grad; harmless, and not this file's to change
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            fail("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dtype_name = str(dtype).replace("torch.", "")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        fail(f"--configs: unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    result = {"machine": machine_info(device, threads), "rows": [], "skipped": []}
    for name in names:
        if CONFIGS[name].get("gpu_only") and device.type != "cuda":
            n = fmt_num(llama_param_count(CONFIGS[name]["llama"]))
            why = f"GPU only ({n} parameters × 4 models); device is the CPU"
            result["skipped"].append({"config": name, "why": why})
            print(f"[bench] skipping {name}: GPU only", file=sys.stderr)
            continue
        print(f"[bench] {name}: {llama_param_count(CONFIGS[name]['llama']):,} parameters per model, "
              f"warm-up + {args.iters or CONFIGS[name]['iters']} PPO iterations on {device.type}/{dtype_name}",
              file=sys.stderr)
        result["rows"].append(bench_config(name, args.iters, device, dtype, args.batch, args.prompt_len,
                                           args.response_len, args.seed))
    # after the configs, so the copy's buffers do not raise the CPU peak RSS reported above
    bandwidth = measure_bandwidth(device, (args.bandwidth_mib or (1024 if device.type == "cuda" else 256)) * MiB)
    for row in result["rows"]:
        row.update(decode_roofline(CONFIGS[row["config"]]["llama"], torch.finfo(dtype).bits // 8, row["batch"],
                                   row["prompt_len"], row["response_len"], bandwidth))
        row["achieved_frac"] = row["rollout_tok_s"] / row["roofline_tok_s_batch"]
    print(format_tables(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


# ---------------------------------------------------------------------------------------------------------
# `python tools/bench.py world`: the synthetic world's own runs, whole processes, this tree beside an older commit
# ---------------------------------------------------------------------------------------------------------
# Eight variants of one seed, as the figure notebooks run them (four on vanilla PPO, four on PPO-max).
WORLD_VARIANTS = [("vanilla", ("--preset", "vanilla")), ("kl-only", ("--preset", "vanilla", "--kl-coef", "0.05")),
                  ("rscale", ("--preset", "vanilla", "--reward-scale")),
                  ("rnorm-0.8", ("--preset", "vanilla", "--reward-norm", "--reward-clip", "0.8")),
                  ("ppo-max", ()), ("ppo-max-no-ptx", ("--ptx-coef", "0")), ("lam-0", ("--lam", "0")),
                  ("gclip-0", ("--grad-clip", "0"))]
# The runner of the figure notebooks, driven from outside: every variant through notebooks/runs.py's run_many (a pool
# of single-thread workers, one per core) where the tree has it, else one run() after the other (one process).
RUNNER = """
import json, sys, time
sys.path.insert(0, "notebooks")
import runs
if __name__ == "__main__":
    runs.configure(full=True)
    specs = [(name, tuple(flags), 0, steps) for name, flags, steps in json.loads(sys.argv[1])]
    t0 = time.time()
    if hasattr(runs, "run_many"):
        runs.run_many(specs)
    else:
        for name, flags, seed, steps in specs:
            runs.run(name, *flags, seed=seed, steps=steps)
    print(json.dumps({"seconds": time.time() - t0, "jobs": getattr(runs, "JOBS", 1)}))
"""


NEW_SEED = 987654  # the seed whose base the bench builds (with --rebuild-base) and removes again


def timed(cmd: list[str], cwd: Path) -> float:
    """Wall seconds of one whole process run in `cwd` (interpreter start and imports included)."""
    import subprocess
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        fail(f"`{' '.join(cmd)}` in {cwd} exited with {done.returncode}: "
             f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    return time.perf_counter() - t0


def bench_tree(tree: Path, scratch: Path, steps: int, variants: list, small: list[str]) -> dict:
    """One tree's numbers, each a whole process of that tree's own code run in the tree (its runs/_base): a new
    seed's base (--stages sft,rm, seed NEW_SEED rebuilt, then removed), one vanilla run with seed 0's base cached,
    and every variant through the notebooks' runner (base cached)."""
    import shutil
    import subprocess
    py, train_py = sys.executable, str(tree / "train.py")
    budget = small + ["--steps", str(steps), "--threads", "1"]
    timed([py, train_py, *budget, "--stages", "sft,rm", "--seed", "0", "--out", str(scratch / "warm")], tree)
    out: dict = {"tree": str(tree)}
    out["base_s"] = timed([py, train_py, *budget, "--stages", "sft,rm", "--seed", str(NEW_SEED), "--rebuild-base",
                           "--out", str(scratch / "base")], tree)
    (base,) = (tree / "runs" / "_base").glob(f"seed{NEW_SEED}-*")
    out["base_stages"] = json.loads((base / "timings.json").read_text())
    shutil.rmtree(base)
    out["variant_s"] = timed([py, train_py, *budget, "--preset", "vanilla", "--seed", "0",
                              "--out", str(scratch / "vanilla")], tree)
    summary = json.loads((scratch / "vanilla" / "summary.json").read_text())
    out["variant_stages"] = summary["timings"]
    out["ppo_s_per_iter"] = summary["timings"]["ppo"] / steps
    names = [(f"bench-{name}", list(small) + list(flags), steps) for name, flags in variants]
    for name, *_ in names:
        shutil.rmtree(tree / "runs" / f"{name}-seed0", ignore_errors=True)
    done = subprocess.run([py, "-c", RUNNER, json.dumps(names)], cwd=tree, capture_output=True, text=True)
    for name, *_ in names:
        shutil.rmtree(tree / "runs" / f"{name}-seed0", ignore_errors=True)
    if done.returncode:
        fail(f"the notebooks' runner of {tree} failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    runner = json.loads(done.stdout.strip().splitlines()[-1])
    out["runner_s"], out["runner_jobs"], out["variants"] = runner["seconds"], runner["jobs"], len(names)
    out["runs_per_hour"] = 3600 * len(names) / runner["seconds"]
    return out


class MatmulLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every matrix multiply (mm, addmm, bmm, baddbmm) and attention call (scaled_dot_product_*) dispatched while it
    is on, by shape: the FLOPs of an iteration counted from the shapes (2·M·K·N a multiply; attention 4·B·H·Lq·Lk·d
    forward, twice that backward, the causal half not subtracted)."""

    MM = {"mm": lambda a, b: (a.shape[0], a.shape[1], b.shape[1], 1),
          "addmm": lambda c, a, b: (a.shape[0], a.shape[1], b.shape[1], 1),
          "bmm": lambda a, b: (a.shape[1], a.shape[2], b.shape[2], a.shape[0]),
          "baddbmm": lambda c, a, b: (a.shape[1], a.shape[2], b.shape[2], a.shape[0])}

    def __init__(self):
        super().__init__()
        self.mm: dict[tuple, int] = {}   # (M, K, N, batch) -> calls
        self.attention_flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.MM:
            shape = self.MM[name](*args[:3 if name in ("addmm", "baddbmm") else 2])
            self.mm[shape] = self.mm.get(shape, 0) + 1
        elif name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            q, k = args[0], args[1]                                     # (B, H, Lq, d), (B, H, Lk, d)
            self.attention_flops += 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        elif name.startswith("_scaled_dot_product") and name.endswith("backward"):
            q, k = args[1], args[2]
            self.attention_flops += 8 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        return func(*args, **(kwargs or {}))

    @property
    def mm_flops(self) -> float:
        return float(sum(2 * m * k * n * b * c for (m, k, n, b), c in self.mm.items()))


def gemm_rate(shapes: dict[tuple, int], reps: int = 20) -> float:
    """FLOP/s of torch.mm / torch.bmm at the logged shapes, each timed `reps` times and weighted by its calls."""
    flops = seconds = 0.0
    for (m, k, n, b), calls in shapes.items():
        x, y = (torch.randn(m, k), torch.randn(k, n)) if b == 1 else (torch.randn(b, m, k), torch.randn(b, k, n))
        f = torch.mm if b == 1 else torch.bmm
        f(x, y)
        t0 = time.perf_counter()
        for _ in range(reps):
            f(x, y)
        seconds += (time.perf_counter() - t0) / reps * calls
        flops += 2.0 * m * k * n * b * calls
    return flops / seconds


def count_iteration(scratch: Path, small: list[str], iters: int = 4) -> dict:
    """In this process, a vanilla run of `iters` + 1 PPO steps on seed 0's cached base: the matmul and attention
    FLOPs of each iteration after the first, counted from the shapes (MatmulLog), its seconds without the log, and
    the single-thread GEMM rate at those very shapes."""
    import contextlib
    import train
    import ppo_max
    torch.set_num_threads(1)
    log, seconds, step = MatmulLog(), [], {"n": 0}
    originals = {f: getattr(ppo_max, f) for f in ("rollout", "make_experience", "ppo_update")}

    def wrap(name):
        def call(*a, **k):
            t0 = time.perf_counter()
            with log if step["n"] == 1 else contextlib.nullcontext():  # iteration 1 counted, 0 warms up, 2+ timed
                r = originals[name](*a, **k)
            if step["n"] >= 2:
                seconds.append(time.perf_counter() - t0)
            step["n"] += name == "ppo_update"
            return r
        return call

    try:
        for f in originals:
            setattr(ppo_max, f, wrap(f))
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(open(os.devnull, "w")), \
                contextlib.redirect_stderr(open(os.devnull, "w")):
            train.main([*small, "--preset", "vanilla", "--seed", "0", "--steps", str(iters + 1), "--threads", "1",
                        "--out", str(scratch / "count"), "--save-every", "0", "--eval-samples", "1"])
    finally:
        for f, g in originals.items():
            setattr(ppo_max, f, g)
    per_iter = sum(seconds) / (iters - 1)
    flops = log.mm_flops + log.attention_flops
    return {"mm_gflop": log.mm_flops / 1e9, "attention_gflop": log.attention_flops / 1e9, "iter_s": per_iter,
            "achieved_gflop_s": flops / per_iter / 1e9, "gemm_gflop_s": gemm_rate(log.mm) / 1e9,
            "matmul_floor_s": log.mm_flops / gemm_rate(log.mm)}


def format_world(rows: list[dict], counted: dict) -> str:
    def stages(d: dict) -> str:
        return " ".join(f"{k} {v:.1f}" for k, v in d.items())
    lines = ["synthetic world, whole processes on one thread each (seconds)", ""]
    for r in rows:
        lines += [f"{r['label']}: {r['tree']}",
                  f"  new seed's base (--stages sft,rm): {r['base_s']:.1f} s   stages: {stages(r['base_stages'])}",
                  f"  one variant run (--preset vanilla, base cached): {r['variant_s']:.1f} s   stages: "
                  f"{stages(r['variant_stages'])}   PPO {r['ppo_s_per_iter']:.3f} s/iteration",
                  f"  {r['variants']} variants through the notebooks' runner: {r['runner_s']:.0f} s with "
                  f"{r['runner_jobs']} process(es): {r['runs_per_hour']:.0f} variant runs per hour", ""]
    if len(rows) == 2:
        new, old = rows
        lines.append(f"this tree / {old['label']}: base {new['base_s'] / old['base_s']:.2f}x the time, variant run "
                     f"{new['variant_s'] / old['variant_s']:.2f}x, runs per hour "
                     f"{new['runs_per_hour'] / old['runs_per_hour']:.2f}x")
    lines += ["", f"one PPO iteration of this tree (vanilla, seed 0): matmul {counted['mm_gflop']:.2f} GFLOP + attention "
              f"{counted['attention_gflop']:.2f} GFLOP in {counted['iter_s']:.3f} s: {counted['achieved_gflop_s']:.1f}"
              f" GFLOP/s achieved, against {counted['gemm_gflop_s']:.1f} GFLOP/s of torch.mm at the same shapes on "
              f"one thread (the matmuls alone at that rate: {counted['matmul_floor_s']:.3f} s)"]
    return "\n".join(lines)


def world_main(argv: list[str]) -> dict:
    """`python tools/bench.py world [--against REF] [--steps N] [--small]`: the table of format_world."""
    import shutil
    import subprocess
    import tempfile
    p = OneLineParser(prog="tools/bench.py world", description="the synthetic world's runs, whole processes")
    p.add_argument("--against", default="", help="also time this commit (a git worktree of it), side by side")
    p.add_argument("--steps", type=int, default=80, help="PPO steps of every run (train.py's default 80)")
    p.add_argument("--small", action="store_true", help="the notebooks' small world (a quick check, not a measure)")
    p.add_argument("--variants", type=int, default=len(WORLD_VARIANTS), help="how many of the eight variants")
    p.add_argument("--json", default="", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.steps < 1 or not 1 <= args.variants <= len(WORLD_VARIANTS):
        fail(f"--steps must be ≥ 1 and --variants in [1, {len(WORLD_VARIANTS)}]")
    sys.path.insert(0, str(ROOT / "notebooks"))
    import runs
    small = list(runs.SMALL_FLAGS) if args.small else []
    variants = WORLD_VARIANTS[:args.variants]
    work = Path(tempfile.mkdtemp(prefix="ppo-max-bench-"))
    trees = [("this tree", ROOT)]
    if args.against:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", args.against + "^{commit}"],
                             capture_output=True, text=True)
        if sha.returncode:
            fail(f"--against {args.against}: not a commit of {ROOT}")
        old = work / f"tree-{sha.stdout.strip()[:10]}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), sha.stdout.strip()],
                       check=True, capture_output=True)
        trees.append((f"commit {sha.stdout.strip()[:10]}", old))
    rows = []
    try:
        for label, tree in trees:
            print(f"[bench world] {label}: {tree}", file=sys.stderr)
            rows.append({"label": label, **bench_tree(tree, work / label.replace(" ", "-"), args.steps, variants,
                                                      small)})
        counted = count_iteration(work / "this-tree", small)
    finally:
        if args.against:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[1][1])],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    result = {"machine": machine_info(torch.device("cpu"), 1), "rows": rows, "iteration": counted}
    print(format_world(rows, counted), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    world_main(sys.argv[2:]) if sys.argv[1:2] == ["world"] else main()
