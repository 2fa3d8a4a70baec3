"""The memory of a PPO-max run measured on the CPU, beside plumbing/scale.py's plan: the tensors each model holds after an
optimizer step (the plan's static part, to the byte), each phase's peak allocations under the torch profiler (its
dynamic part), and LLaMA-7B's widths through every stage of train.py.

Implements (no equation: the check of scale.plan_memory, whose formulas are in its docstring):
    held_bytes(models, optimizers)  Σ numel·element_size of the parameters, gradients and optimizer states each
                                    model holds; a tensor two models share counts once, for the first of policy,
                                    critic, reference, reward, judge (the reference under LoRA holds nothing of its
                                    own); buffers apart (rotary tables: not planned)
    one_step(m, batch)              one optimizer step of the policy and one of the critic, through the functions
                                    ppo_max.ppo_update calls (policy_logits, critic_values) and the losses it takes
    peak_allocated(fn)              the peak of the bytes allocated and not yet freed while fn runs, from the
                                    profiler's allocation events (torch.profiler, profile_memory=True)
    phase_peaks(m, judge, ...)      generate, make_experience, policy train + step, critic train + step, judge score,
                                    each measured, beside the plan's bytes for the same phase (planned_phases) and
                                    what the CPU adds in bf16 (cpu_head_copies)
    wide_config / build_wide        LLaMA-7B's exact widths (hidden 4096, 32 heads, MLP 11008, vocabulary 32,000,
                                    2,048 positions) with 2 layers instead of 32: 0.67 B parameters
    wide_run(out, lora)             every stage of train.py on it, in bf16, in one process: peak RSS, stage times

Run: python tools/memory_check.py static --model DIR [--bf16] [--lora-r 16]
     python tools/memory_check.py phases --model DIR [--bf16] [--lora-r 16] --batch 8 --prompt-len 32 --response-len 32
     python tools/memory_check.py wide --out runs/wide7b [--full]       (slow: minutes on one CPU thread, ~6 GiB)

The vocabulary of the wide model: a byte-level BPE trained on the HH-RLHF sample stops at 18,543 tokens (1,794
dialogues have no more merges to make), and a config vocabulary larger than its tokenizer would let a random-init
policy sample ids the tokenizer decodes to nothing (42 % of them here; real checkpoints such as Pythia and Qwen2
pad their vocabularies too, but their policies rarely sample the padding). So the tokenizer itself is padded with
plain added tokens <extra_0> ... to exactly 32,000: the embedding, the lm_head and every (B, T, V) logits tensor have
LLaMA-7B's width, and every sampled id decodes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)

import torch
import plumbing.flags
import plumbing.run

HH = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"
MODELS = ("policy", "critic", "reference", "reward", "judge")
GiB = 2 ** 30


# ---------------------------------------------------------------------------------------------------------
# The static part: what each model holds
# ---------------------------------------------------------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def held_bytes(models: dict, optimizers: dict) -> dict[str, dict[str, int]]:
    """{model: {"weights", "gradients", "optimizer", "buffers"}} in bytes, read off the tensors themselves. `models`
    maps names (MODELS) to what plumbing.run.load_models / make_judge return (torch modules, or lora.AdaptersOff, whose
    parameters() are the shared model's); `optimizers` maps the trained ones to their optimizers."""
    seen_params, seen_buffers, out = set(), set(), {}
    for name in MODELS:
        if name not in models or models[name] is None:
            continue
        model = models[name]
        mine = [p for p in model.parameters() if id(p) not in seen_params]
        seen_params.update(id(p) for p in mine)
        module = getattr(model, "model", model)  # an AdaptersOff wraps the module it runs
        buffers = [b for b in module.buffers() if id(b) not in seen_buffers] if hasattr(module, "buffers") else []
        seen_buffers.update(id(b) for b in buffers)
        opt = optimizers.get(name)
        state = [t for p in mine for t in (opt.state.get(p, {}).values() if opt is not None else ())
                 if torch.is_tensor(t)]
        out[name] = {"weights": sum(_nbytes(p) for p in mine),
                     "gradients": sum(_nbytes(p.grad) for p in mine if p.grad is not None),
                     "optimizer": sum(_nbytes(t) for t in state),
                     "buffers": sum(_nbytes(b) for b in buffers)}
    return out


def random_batch(vocab_size: int, n: int, prompt_len: int, response_len: int, seed: int = 0) -> dict:
    """Prompts (n, P) left-padded by one token in the first row, responses (n, T) right-padded by one token in the
    last row: ids 3 … V − 1 (never a special token)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, vocab_size, (n, prompt_len), generator=g)
    r = torch.randint(3, vocab_size, (n, response_len), generator=g)
    qm, rm = torch.ones(n, prompt_len), torch.ones(n, response_len)
    qm[0, 0] = 0.0
    rm[-1, -1] = 0.0
    return {"query": q, "query_mask": qm, "response": r, "mask": rm}


def _steps(opt, model, loss) -> None:
    """What engine.backward_step does in one process: zero the gradients, backward, clip, step."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def policy_loss(policy, batch: dict, ptx: tuple | None = None):
    """The policy's PPO-clip loss on the batch (ratio 1, advantages 1) plus, with ptx = (ids, attn, mask), the ptx
    term of Eq. 17: the losses ppo_max.ppo_update builds, so that the same parameters get gradients."""
    import ppo_loss
    import ppo_max
    b = batch
    logits = ppo_max.policy_logits(policy, b["query"], b["query_mask"], b["response"], b["mask"])   # (n, T, V)
    logprobs = ppo_loss.logprobs_from_logits(logits, b["response"])                                # (n, T)
    loss, _ = ppo_loss.policy_loss(logprobs, logprobs.detach(), torch.ones_like(logprobs), b["mask"], 0.2)
    if ptx is not None:
        ids, attn, resp = ptx
        ptx_logits = policy(input_ids=ids, attention_mask=attn).logits                              # (x, L, V)
        loss = loss + 0.5 * ppo_loss.ptx_loss(ptx_logits, ids, resp)[0]
    return loss


def critic_loss(critic, batch: dict):
    """The critic's clipped value loss (Eq. 16) on the batch, returns 0, as ppo_max.ppo_update builds it."""
    import ppo_loss
    import ppo_max
    b = batch
    values = ppo_max.critic_values(critic, b["query"], b["query_mask"], b["response"], b["mask"])  # (n, T)
    zeros = torch.zeros_like(values)
    return ppo_loss.value_loss(values, zeros, zeros, b["mask"], 0.2)[0]


def one_step(m, batch: dict) -> None:
    """One optimizer step of the policy and one of the critic (plumbing.run.Models m), in train mode as ppo_update runs."""
    m.policy.train()
    m.critic.train()
    _steps(m.policy_opt, m.policy, policy_loss(m.policy, batch))
    _steps(m.critic_opt, m.critic, critic_loss(m.critic, batch))


def measured_models(m, judge) -> dict:
    return {"policy": m.policy, "critic": m.critic, "reference": m.ref, "reward": m.reward_model,
            "judge": judge.model if judge is not None else None}


# ---------------------------------------------------------------------------------------------------------
# A run's models, built as train.py builds them, and its plan
# ---------------------------------------------------------------------------------------------------------
def reward_dir(sft_dir: Path, out: Path, seed: int = 0) -> Path:
    """A reward model directory from an SFT directory: its LM, a fresh seeded head, its tokenizer (no training)."""
    from plumbing import data
    from reward_model import ScalarHeadModel
    if not (out / "value_head.safetensors").is_file():
        ScalarHeadModel.from_pretrained(sft_dir, seed=seed).save_pretrained(out)
        data.load_tokenizer(sft_dir).save_pretrained(out)
    return out


def run_argv(model: Path, reward: Path, *, bf16: bool, lora_r: int, critic_init: str = "rm",
             lora_targets: str = "all-linear") -> list[str]:
    """train.py's flags of the run whose models these are (a judge: --data with its default --judge-frac)."""
    argv = ["--model", str(model), "--reward-model", str(reward), "--data", str(HH), "--skip-bad", "--grad-ckpt",
            "--critic-init", critic_init, "--threads", "0"]
    argv += ["--bf16"] if bf16 else []
    argv += ["--lora-r", str(lora_r), "--lora-targets", lora_targets] if lora_r else []
    return argv


def load_run(model: Path, reward: Path, argv: list[str]):
    """(plumbing.run.Models, plumbing.run.Judge, run, cfg) exactly as train.main builds them for these flags, in one process."""
    from plumbing import data
    from plumbing import lora
    import train
    from plumbing.pipeline import Inputs
    run, _, _, cfg, *_ = plumbing.flags.parse_configs(argv)
    device = torch.device("cpu")
    critic = reward if cfg.critic_init == "rm" else model
    inp = Inputs(policy=model, ref=model, reward=reward, critic=critic, tokenizer=data.load_tokenizer(model), data={},
                 judge=reward)
    m = plumbing.run.load_models(inp, run, cfg, device, None)
    judge = plumbing.run.make_judge(inp, False, m.bf16, device, lora.quantization(run))
    return m, judge, run, cfg


def plan_of(argv: list[str], **shapes):
    """The plan `train.py ARGV --plan --num-gpus 1` prints, at the given shapes (scale.plan_memory's keywords)."""
    import contextlib
    import io
    import train
    extra = [x for k, v in shapes.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    with contextlib.redirect_stdout(io.StringIO()):
        return plumbing.flags.print_plan(argv + ["--plan", "--num-gpus", "1", *extra])


# ---------------------------------------------------------------------------------------------------------
# The dynamic part: peak allocations of each phase
# ---------------------------------------------------------------------------------------------------------
def peak_allocated(fn) -> tuple[int, int, object]:
    """(peak, end, fn's result): the largest number of bytes allocated and not yet freed at any moment while fn runs
    (relative to its start), and at its end, from the allocation and free events torch.profiler records with
    profile_memory=True. The CPU has no caching allocator: every tensor is an allocation of its own."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live, result


def phase_peaks(m, judge, cfg, batch_size: int, prompt_len: int, response_len: int, ptx_batch: int,
                micro_batch: int, vocab_size: int, seed: int = 0) -> dict[str, dict]:
    """Each phase of a PPO iteration, run the way train.ppo runs it, measured with peak_allocated:
        generate        ppo_max.rollout of B prompts, max_new_tokens = T (every sequence runs to T: no EOS id is
                        ever sampled, see below)
        experience      ppo_max.make_experience on the B rollouts (reward score, log-probs and KL, values)
        policy train    from zeroed (None) gradients: the PPO loss on b sequences + the ptx term on x rows,
                        backward, clip, AdamW step (the gradients it allocates count)
        critic train    the same for the critic's value loss
        judge score     the judge's score() of the B sequences
    Returns {phase: {"peak", "end"}} in bytes. Prompts are random ids, unpadded; the EOS id passed to the rollout is
    one no model samples (vocab_size: outside the vocabulary), so the responses are T tokens long."""
    import ppo_max
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, vocab_size, (batch_size, prompt_len), generator=g)
    qm = torch.ones(batch_size, prompt_len)
    out = {}
    m.policy.eval()
    pk, end, (resp, rmask, _) = peak_allocated(lambda: ppo_max.rollout(m.policy, q, qm, response_len, vocab_size,
                                                                       0, cfg.temperature))
    out["generate"] = {"peak": pk, "end": end, "response_len": resp.shape[1]}
    moments = ppo_max.RunningMoments()
    pk, end, exp = peak_allocated(lambda: ppo_max.make_experience(m.policy, m.ref, m.reward_model, m.critic, q, qm,
                                                                  resp, rmask, moments, cfg, cfg.kl_coef))
    out["experience"] = {"peak": pk, "end": end}
    b = {"query": q[:micro_batch], "query_mask": qm[:micro_batch], "response": resp[:micro_batch],
         "mask": rmask[:micro_batch]}
    ptx = None
    if ptx_batch:
        ids = torch.randint(3, vocab_size, (ptx_batch, prompt_len + resp.shape[1]), generator=g)
        ptx = (ids, torch.ones_like(ids), torch.ones_like(ids).float())
    m.policy.train()
    m.critic.train()
    for name, model, opt, loss in (("policy train", m.policy, m.policy_opt, lambda: policy_loss(m.policy, b, ptx)),
                                   ("critic train", m.critic, m.critic_opt, lambda: critic_loss(m.critic, b))):
        _steps(opt, model, loss())   # a first step: the optimizer states exist, as from the second step of a run
        opt.zero_grad()              # where backward_step begins: the gradients freed
        pk, end, _ = peak_allocated(lambda: _steps(opt, model, loss()))
        out[name] = {"peak": pk, "end": end}
    if judge is not None:
        ids, mask = torch.cat([q, resp], 1), torch.cat([qm, rmask], 1)
        pk, end, _ = peak_allocated(lambda: torch.no_grad()(judge.model.score)(ids, mask))
        out["judge score"] = {"peak": pk, "end": end}
    return out


def cpu_head_copies(plan) -> dict[str, int]:
    """What the CPU adds to the plan in bf16, by phase: reward_model.ScalarHeadModel asks its LM for the last
    position's logits only (logits_to_keep=1), so the lm_head reads a strided (n, 1, h) view; for a bf16 weight that
    needs no gradient, the CPU's oneDNN matmul then copies the whole V·h weight once per sequence (measured: fp32 and
    fp16 do not, nor a weight that requires grad; CUDA takes no oneDNN path). The frozen heads: the reward model's
    and the judge's, and under LoRA the critic's and the policy's (its prefill in generate)."""
    s = plan.settings
    if s["dtype_bytes"] != 2:
        return {}
    B, b, lora = s["rollout_batch_per_gpu"], s["micro_batch"], s["lora_r"] > 0
    heads = [("reward", "reward score", B), ("judge", "judge score", B)]
    if lora:
        heads += [("critic", "critic values", B), ("critic", "critic train", b), ("policy", "generate", B)]
    copies = {}
    for role, phase, n in heads:
        if role in plan.n_params:
            a = plan.cfg if role == "policy" else plan.reward_cfg  # one architecture throughout in these runs
            copies[phase] = copies.get(phase, 0) + n * a["vocab_size"] * a["hidden_size"] * 2
    return copies


def planned_phases(plan, cpu: bool = True) -> dict[str, tuple[int, int]]:
    """{phase: (the plan's bytes, what the CPU adds: cpu_head_copies)} for each measured phase: make_experience = the
    largest of its three phases; a training phase = its gradients (allocated inside the measured window) + its train
    phase. The plan's step phase (foreach AdamW's √v of every tensor at once, a GPU's default) is left out: on the CPU
    torch steps one tensor at a time."""
    p, extra = plan.phase_bytes, cpu_head_copies(plan) if cpu else {}
    sub = ("reward score", "log-probs", "critic values")
    gpu = max(p[k] for k in sub if k in p)
    out = {"generate": (p["generate"], extra.get("generate", 0)),
           "experience": (gpu, max(p[k] + extra.get(k, 0) for k in sub if k in p) - gpu)}
    for role in ("policy", "critic"):
        out[f"{role} train"] = (plan.static(role)["gradients"] + p[f"{role} train"], extra.get(f"{role} train", 0))
    if "judge score" in p:
        out["judge score"] = (p["judge score"], extra.get("judge score", 0))
    return out


# ---------------------------------------------------------------------------------------------------------
# LLaMA-7B's widths, 2 layers
# ---------------------------------------------------------------------------------------------------------
WIDE_VOCAB = 32000


def wide_config(tokenizer, layers: int = 2):
    """LlamaConfig with llama-7b's numbers (scale.LLAMA_CONFIGS) and `layers` layers, the tokenizer's special ids."""
    from plumbing import scale
    from transformers import LlamaConfig
    numbers = dict(scale.LLAMA_CONFIGS["llama-7b"], num_hidden_layers=layers)
    assert len(tokenizer) == numbers["vocab_size"] == WIDE_VOCAB
    return LlamaConfig(**numbers, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


def build_wide(out: str | Path, layers: int = 2, seed: int = 0) -> Path:
    """The 7B-wide shallow model, random init, saved in bf16 with its 32,000-token tokenizer (module docstring)."""
    from plumbing import data
    import tiny_model
    from transformers import AutoModelForCausalLM
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    texts = [p + r for p, r in data.load_texts(HH, skip_bad=True)]
    tok = tiny_model.build_tokenizer("llama", texts, out, WIDE_VOCAB)
    tok.add_tokens([f"<extra_{i}>" for i in range(WIDE_VOCAB - len(tok))])  # plain tokens: they decode as text
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = wide_config(tok, layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


# The wide run's flags: every stage twice (2 SFT steps, 2 reward-model and 2 judge steps, 2 critic pre-training
# rounds, 2 PPO iterations), batches of 2-4 and short sequences, held-out sets of ~9 pairs, so that one CPU thread
# finishes in minutes. bf16, gradient checkpointing, the ptx term and the judge as a real run has them.
WIDE_FLAGS = ["--data", str(HH), "--skip-bad", "--bf16", "--grad-ckpt", "--heldout-frac", "0.01",
              "--max-prompt-tokens", "48", "--max-response-tokens", "24", "--max-new-tokens", "16",
              "--sft-epochs", "0.025", "--sft-batch", "2", "--rm-epochs", "0.025", "--rm-batch", "2",
              "--rm-eval-every", "1000", "--steps", "2", "--rollout-batch", "4", "--minibatch", "2", "--ptx-batch",
              "2", "--critic-pretrain-steps", "2", "--eval-samples", "1", "--save-every", "0"]


def wide_run(out: str | Path, lora: bool = True, threads: int = 1, timeout: int = 7200) -> dict:
    """train.py on the wide model, every stage, one process; its peak RSS (the kernel's ru_maxrss of that process,
    from os.wait4) and the stage times summary.json records. Returns what it also writes to out/wide-<variant>.json."""
    out = Path(out)
    model = build_wide(out / "model")
    variant = "lora" if lora else "full"
    run_dir = out / f"run-{variant}"
    argv = [sys.executable, str(ROOT / "train.py"), "--model", str(model), *WIDE_FLAGS, "--threads", str(threads),
            "--out", str(run_dir), *(["--lora-r", "16"] if lora else [])]
    t0 = time.time()
    with open(out / f"wide-{variant}.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
    seconds = time.time() - t0
    code = os.waitstatus_to_exitcode(status)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    result = {"variant": variant, "returncode": code, "seconds": round(seconds, 1),
              "peak_rss_gib": round(usage.ru_maxrss * 1024 / GiB, 2),  # ru_maxrss: KiB on Linux
              "timings": {k: round(v, 1) for k, v in summary.get("timings", {}).items()},
              "stages_done": sorted(k for k in ("sft", "reward_model", "judge_model", "critic_pretrain", "ppo")
                                    if k in summary.get("timings", {})),
              "params": sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"])
                            .load_file(str(model / "model.safetensors")).values()),
              "command": " ".join(argv[1:]).replace(str(ROOT) + "/", "")}
    (out / f"wide-{variant}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def _table(rows: list[tuple]) -> str:
    return "\n".join("  " + "".join(f"{c:>16s}" if i else f"{c:<24s}" for i, c in enumerate(r)) for r in rows)


def main(argv=None) -> None:
    from plumbing import cli
    p = cli.OneLineParser(prog="tools/memory_check.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("static", "phases"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="a causal LM directory (e.g. from tools/tiny_model.py)")
        s.add_argument("--bf16", action="store_true", help="every model in bf16, as --bf16 loads them")
        s.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0 = full weights)")
        s.add_argument("--critic-init", default="rm", choices=("rm", "sft"))
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--json", default="", help="also write the numbers to this JSON file")
        if name == "phases":
            s.add_argument("--batch", type=int, default=8, help="prompts per rollout (B)")
            s.add_argument("--micro-batch", type=int, default=2, help="sequences per training step (b)")
            s.add_argument("--ptx-batch", type=int, default=2, help="SFT rows in the ptx term (x)")
            s.add_argument("--prompt-len", type=int, default=32)
            s.add_argument("--response-len", type=int, default=32)
    w = sub.add_parser("wide")
    w.add_argument("--out", default="runs/wide7b")
    w.add_argument("--full", action="store_true", help="full weights instead of LoRA r = 16")
    w.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if a.cmd == "wide":
        print(json.dumps(wide_run(a.out, lora=not a.full, threads=a.threads), indent=2))
        return
    torch.set_num_threads(a.threads)
    model = Path(a.model)
    if not (model / "config.json").is_file():
        cli.fail(f"--model {model}: no config.json there")
    reward = reward_dir(model, Path(str(model).rstrip("/") + "-rm"))
    flags = run_argv(model, reward, bf16=a.bf16, lora_r=a.lora_r, critic_init=a.critic_init)
    m, judge, run, cfg = load_run(model, reward, flags)
    if a.cmd == "static":
        from plumbing import data
        V = data.load_tokenizer(model).vocab_size
        one_step(m, random_batch(min(V, m.policy.config.vocab_size), 2, 8, 8))
        got = held_bytes(measured_models(m, judge), {"policy": m.policy_opt, "critic": m.critic_opt})
        plan = plan_of(flags)
        rows = [("model", "weights", "gradients", "optimizer", "plan = measured")]
        for name, h in got.items():
            want = plan.static(name)
            rows.append((name, *(f"{h[k]:,}" for k in ("weights", "gradients", "optimizer")),
                         "yes" if all(want[k] == h[k] for k in want) else f"no: plan {want}"))
        print(_table(rows))
        if a.json:
            Path(a.json).write_text(json.dumps({"measured": got, "plan": {n: plan.static(n) for n in got}}, indent=2))
        return
    if cfg.ptx_coef == 0:
        a.ptx_batch = 0
    V = m.policy.config.vocab_size
    got = phase_peaks(m, judge, cfg, a.batch, a.prompt_len, a.response_len, a.ptx_batch, a.micro_batch, V)
    T = got["generate"]["response_len"]
    plan = plan_of(flags, micro_batch=a.micro_batch, rollout_batch_per_gpu=a.batch, ptx_batch_per_gpu=a.ptx_batch,
                   prompt_len=a.prompt_len, response_len=T)
    want = planned_phases(plan)
    rows = [("phase", "plan MiB", "+ CPU bf16 MiB", "measured MiB", "measured/both")]
    for name, x in got.items():
        gpu, cpu = want[name]
        rows.append((name, f"{gpu / 2**20:.2f}", f"{cpu / 2**20:.2f}", f"{x['peak'] / 2**20:.2f}",
                     f"{x['peak'] / (gpu + cpu):.2f}"))
    print(f"B={a.batch} b={a.micro_batch} x={a.ptx_batch} P={a.prompt_len} T={T} {'bf16' if a.bf16 else 'fp32'}"
          f"{f' LoRA r={a.lora_r}' if a.lora_r else ''}, {model}")
    print(_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"measured": got, "plan": {k: {"gpu": g, "cpu_bf16": c}
                                                                        for k, (g, c) in want.items()}}, indent=2))


if __name__ == "__main__":
    from plumbing.cli import cli_guard
    cli_guard(main)()
