"""Evaluate a policy the way section 5.2 says to watch one: win rate against SFT, KL, perplexity, length, reward.

Implements: no equation; the monitoring metrics of §5.2 and the win rate of Fig. 10.
  sample()        responses with the paper's evaluation sampling (top-p 0.9, temperature 0.8, repetition penalty 1.1)
  measure()       reward-model score, gold reward, per-token KL to the reference, perplexity, length
  compare()       the above for a policy and the SFT model, plus win / tie / lose judged by gold (synthetic world)
                  or by a reward model (real data, where no gold judge exists: rm_judge(), on the sampled ids)
  heldout_point() the held-out curve's point of a PPO step (--heldout-every): judge, proxy, KL, length
  text_perplexity() the likelihood of pre-training text no stage trained on (the alignment tax Eq. 17's ptx limits)
  frontier_point() gold and proxy reward against d = √KL(π ‖ π_SFT) per response, sampled at temperature 1: one
                  point of the over-optimisation curve (Gao et al. 2022)
  score()         r(x, y) of every pair or response of a data file with a saved reward model: pairwise accuracy
                  (Eq. 1; Fig. 3) and the histogram of r(x, y_w) − r(x, y_l) (Fig. 2)
  plot()          §5.2's panels of any runs, one line per run: reward-model score, gold or judge reward, KL to the
                  reference, perplexity, response length, and the win rate where checkpoints were evaluated
Run:
  python eval.py --policy runs/ppo-max-seed0/policy --sft runs/_base/<...>/sft --reward-model runs/_base/<...>/reward_model
  python eval.py --run runs/ppo-max-seed0          # the same, with every path read from that run's summary.json
  python eval.py score --reward-model runs/_base/real-<...>/reward_model --data pairs.jsonl.gz --out scores.jsonl
  python eval.py plot runs/ppo-max-seed0 runs/vanilla-seed0 --out curves.png
Definitions of every metric: docs/metrics.md.
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import torch

from plumbing import cli
from plumbing import data
from plumbing import models
import ppo_max
import toy_world
from plumbing.monitor import cannot_judge, judge_of, progress, rm_check
from ppo_loss import kl_full, logprobs_from_logits, ptx_loss

# The paper's evaluation sampling (§ hyperparameters): top-p 0.9, temperature 0.8, repetition penalty 1.1.
EVAL_SAMPLING = dict(top_p=0.9, temperature=0.8, repetition_penalty=1.1)
# The policy itself (temperature 1, nothing cut): the distribution whose KL to π_SFT the gold-vs-√KL frontier plots
# (Gao et al. 2022 sample at temperature 1; best_of_n.bon_kl holds for draws from π_SFT itself).
PLAIN_SAMPLING = dict(top_p=1.0, temperature=1.0, repetition_penalty=1.0)


# A judge scores one batch of samples: judge(prompts, texts, finished, ids (B, L), mask (B, L)) → [reward, …], where
# ids = query + response exactly as sampled and mask = query mask + response mask, the tensors PPO's step (2) scores.
def rm_judge(reward_model):
    """A judge when no gold exists (real data): r(x, y) of a reward model on the very ids that were sampled, with
    the masks of training (never the text decoded and encoded again: byte-level BPE re-encodes most sampled
    responses to other ids)."""
    @torch.no_grad()
    def judge(prompts, texts, finished, ids, mask) -> list[float]:
        device = next(reward_model.parameters()).device
        return reward_model.score(ids.to(device), mask.to(device)).float().tolist()
    return judge


def judge_samples(judge, samples: dict) -> list[float]:
    """`judge` over every batch of sample()'s output, in order: one reward per sampled response."""
    out, i = [], 0
    for q, qm, r, m in zip(samples["query"], samples["query_mask"], samples["response"], samples["mask"]):
        j = i + len(q)
        out += judge(samples["prompts"][i:j], samples["texts"][i:j], samples["finished"][i:j], torch.cat([q, r], 1),
                     torch.cat([qm, m], 1))
        i = j
    return out


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int, batch: int = 256,
           sampling: dict | None = None) -> dict:
    """n responses per prompt, sampled with EVAL_SAMPLING (or `sampling`) from `seed` (the same seed for every model
    compared)."""
    rows = [p for p in prompts for _ in range(n)]
    out = {"prompts": rows, "query": [], "query_mask": [], "response": [], "mask": [], "finished": []}
    device = next(model.parameters()).device
    gen = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with gen:
        torch.manual_seed(seed)
        for i in progress(range(0, len(rows), batch), "evaluation: sampling", leave=False):
            q, qm = data.pad([data.query_ids(p, tokenizer) for p in rows[i:i + batch]], tokenizer.pad_token_id, "left")
            q, qm = q.to(device), qm.to(device)                                        # (B, P), on the model's device
            r, m, f = ppo_max.rollout(model, q, qm, max_new_tokens, data.stop_id(tokenizer), tokenizer.pad_token_id,
                                      **(sampling or EVAL_SAMPLING))
            out["query"].append(q); out["query_mask"].append(qm)
            out["response"].append(r); out["mask"].append(m); out["finished"].append(f)
    out["texts"] = [tokenizer.decode(r[m.bool()], skip_special_tokens=True)
                    for R, M in zip(out["response"], out["mask"]) for r, m in zip(R, M)]
    out["finished"] = torch.cat(out["finished"]).tolist()
    return out


@torch.no_grad()
def measure(model, ref, reward_model, samples: dict, judge=toy_world.gold_judge) -> dict:
    """Mean metrics over the sampled responses. KL and perplexity use the models' own (temperature 1)
    distributions at the visited positions: kl = mean over response tokens of Σ_v π log(π/π_ref), kl_seq = the same
    summed over each response and averaged over responses (nats per response: with samples of the policy itself, a
    Monte Carlo estimate of the sequence-level KL(π ‖ π_ref)); perplexity = exp(mean NLL of the sampled tokens under
    the model). The reward model and the judge score the sampled ids with the masks of training
    (judge_samples)."""
    kl_sum = nll_sum = tokens = 0.0
    lengths = []
    for q, qm, r, m in zip(samples["query"], samples["query_mask"], samples["response"], samples["mask"]):
        logits = ppo_max.policy_logits(model, q, qm, r, m)                              # (B, T, V)
        ref_logits = ppo_max.policy_logits(ref, q, qm, r, m)                            # (B, T, V)
        kl_sum += (kl_full(logits, ref_logits) * m).sum().item()
        nll_sum += -(logprobs_from_logits(logits, r) * m).sum().item()
        tokens += m.sum().item()
        lengths += m.sum(1).tolist()
    scores = judge_samples(rm_judge(reward_model), samples)                             # r(x, y) of the proxy
    gold = judge_samples(judge, samples)
    return {"reward": sum(scores) / len(scores), "gold_reward": sum(gold) / len(gold), "kl": kl_sum / tokens,
            "perplexity": math.exp(nll_sum / tokens), "response_length": sum(lengths) / len(lengths),
            "finished": sum(samples["finished"]) / len(samples["finished"]), "kl_seq": kl_sum / len(lengths)}, gold


def win_rate(a: list[float], b: list[float]) -> dict:
    """Win / tie / lose of a against b, paired by prompt and sample index."""
    n = len(a)
    win = sum(x > y for x, y in zip(a, b)) / n
    lose = sum(x < y for x, y in zip(a, b)) / n
    tie = sum(x == y for x, y in zip(a, b)) / n  # counted, not 1 − win − lose (which can print as −0.00)
    return {"win": win, "tie": tie, "lose": lose}


def compare(policy, sft, ref, reward_model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int,
            judge=toy_world.gold_judge, extra_judges: dict | None = None) -> dict:
    """The policy against the SFT model on the same prompts and sampling seed: metrics of each, and the win rate
    by `judge` (and by every one of `extra_judges`, {name: judge}, on the same samples: "win_rates"). Every judge
    scores the sampled ids (see toy_world.gold_judge for the signature)."""
    s_pol = sample(policy, tokenizer, prompts, n, seed, max_new_tokens)
    s_sft = sample(sft, tokenizer, prompts, n, seed, max_new_tokens)
    m_pol, g_pol = measure(policy, ref, reward_model, s_pol, judge)
    m_sft, g_sft = measure(sft, ref, reward_model, s_sft, judge)
    examples = [{"prompt": p, "policy": a, "sft": b} for p, a, b in
                list(zip(s_pol["prompts"], s_pol["texts"], s_sft["texts"]))[::max(n, 1)][:8]]
    out = {"policy": m_pol, "sft": m_sft, "win_rate": win_rate(g_pol, g_sft), "examples": examples}
    if extra_judges:
        out["win_rates"] = {name: win_rate(judge_samples(j, s_pol), judge_samples(j, s_sft))
                            for name, j in extra_judges.items()}
    return out


def frontier_point(policy, sft, reward_model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int,
                   judge=toy_world.gold_judge) -> dict:
    """One point of the gold-vs-√KL frontier: the policy sampled as itself (PLAIN_SAMPLING), its judge and proxy
    rewards, and its sequence-level KL to the SFT model, KL = E_{y~π} Σ_t KL(π(·|s_t) ‖ π_SFT(·|s_t)) (the per-token
    exact KL summed along the policy's own samples), with d = √KL as Gao et al. 2022 plot it."""
    s = sample(policy, tokenizer, prompts, n, seed, max_new_tokens, sampling=PLAIN_SAMPLING)
    m, _ = measure(policy, sft, reward_model, s, judge)
    return {"gold_reward": m["gold_reward"], "reward": m["reward"], "kl_seq": m["kl_seq"],
            "d": math.sqrt(max(m["kl_seq"], 0.0)), "response_length": m["response_length"], "samples": len(s["texts"])}


def heldout_point(policy, ref, reward_model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int,
                  judge, key: str | None, step: int) -> dict:
    """One point of the held-out curve at PPO step `step` (--heldout-every): the policy sampled on the held-out
    prompts as the final evaluation samples (EVAL_SAMPLING; n each, from seed + step), judged like it: the judge's
    mean under `key` (heldout/gold or heldout/judge), the proxy's (heldout/score), KL to the reference per token
    (heldout/kl) and the response length (heldout/length). The policy's train/eval mode is left as it was."""
    was_training = policy.training
    policy.eval()
    samples = sample(policy, tokenizer, prompts, n, seed + step, max_new_tokens)
    r, _ = measure(policy, ref, reward_model, samples, judge)
    policy.train(was_training)
    return {**({key: r["gold_reward"]} if key else {}), "heldout/score": r["reward"], "heldout/kl": r["kl"],
            "heldout/length": r["response_length"]}


@torch.no_grad()
def text_perplexity(model, tokenizer, texts: list[str], batch: int = 256) -> float:
    """exp of the mean NLL per token of `texts`, each read after an empty prompt as ptx reads D_pretrain (Eq. 17):
    the policy's likelihood of pre-training text, whose loss against SFT's is the alignment tax."""
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0.0
    for i in range(0, len(texts), batch):
        ids, attn, resp = (t.to(device) for t in data.lm_batch([("", x) for x in texts[i:i + batch]], tokenizer))
        logits = model(input_ids=ids, attention_mask=attn, position_ids=data.position_ids_from_mask(attn),
                       use_cache=False).logits                                   # (B, L, V)
        loss, stats = ptx_loss(logits.float(), ids, resp)                        # mean NLL of the text's tokens
        nll, tokens = nll + loss.item() * stats["ptx_tokens"], tokens + stats["ptx_tokens"]
    return math.exp(nll / tokens)


@torch.no_grad()
def length_bias(rm, tokenizer, prompt_rows: list[dict], seed: int, world: str = "a") -> dict:
    """RM score vs gold as the world's exploit is added to a correct answer, 0 … 6 units: the RM's bias beyond
    gold's (synthetic world). World A adds filler words (same content, longer: slopes per added token, over held-out
    helpful prompts), world B praise phrases (same answer, more flattery: slopes per phrase, every held-out prompt)."""
    import random

    import numpy as np
    rng = random.Random(seed)
    w = toy_world.world(world)
    prompts = w.probe_prompts([w.parse_prompt(r["prompt"]) for r in prompt_rows])
    out = {"extra_tokens": [], "rm": [], "gold": []}
    for extra in range(0, 7):
        rows, golds = [], []
        for p in prompts:
            base, padded = w.probe_responses(p, rng, extra)
            rows.append((p.text, padded))
            golds.append(w.gold_reward(p.text, padded))
        ids, attn, _ = data.lm_batch(rows, tokenizer)
        out["extra_tokens"].append(extra)
        out["rm"].append(rm.score(ids, attn).mean().item())
        out["gold"].append(float(np.mean(golds)))
    out["rm_slope"] = float(np.polyfit(out["extra_tokens"], out["rm"], 1)[0])
    out["gold_slope"] = float(np.polyfit(out["extra_tokens"], out["gold"], 1)[0])
    return out


def format_table(summary: dict) -> str:
    """The final table: the held-out comparison with SFT as it was sampled (summary["eval_sampling"]), the win rate
    (or, when its reward-model judge cannot judge, judge_check's words in its place), the held-out curve's peak."""
    keys = ["reward", "gold_reward", "kl", "perplexity", "response_length"]
    judge = summary.get("judge", "gold")
    names = {"gold_reward": {"gold": "gold_reward", "held-out reward model": "judge(held-out)"}.get(judge, "judge(RM)")}
    lines = []
    ev = summary.get("eval_sampling")
    if ev:
        lines.append(f"held-out prompts, {ev['samples']} sample(s) each at top-p {ev['top_p']:g}, temperature "
                     f"{ev['temperature']:g}, repetition penalty {ev['repetition_penalty']:g} "
                     f"(the paper's evaluation):")
    lines.append(f"{'held-out':<10}" + "".join(f"{names.get(k, k):>16}" for k in keys))
    for name in ["sft", "final"]:  # a value that does not exist for a method (best-of-n's per-token KL) prints as —
        lines.append(f"{name:<10}" + "".join(f"{summary[name][k]:>16.3f}" if summary[name][k] is not None
                                             else f"{'—':>16}" for k in keys))

    def win_line(name: str, w: dict, note: str = "") -> str:  # or judge_check's words, where it cannot judge
        check = judge_of(summary, name)
        if check and not check["can_judge"]:
            return f"win rate vs SFT (judge: {name}): {cannot_judge(check)}"
        return f"win rate vs SFT (judge: {name}): win {w['win']:.2f}  tie {w['tie']:.2f}  lose {w['lose']:.2f}{note}"

    lines.append(win_line("gold" if judge == "gold" else judge, summary["win_rate_vs_sft"]))
    for name, w in (summary.get("win_rate_vs_sft_by_judge") or {}).items():
        if name != judge:
            lines.append(win_line(name, w, "   (the reward PPO optimised)" if "proxy" in name else ""))
    peak = summary.get("peak")
    if peak and peak.get("curve") == "held-out":  # the held-out curve: sampled as above, fewer samples per prompt
        sft = f"SFT (step 0) {peak['sft']:.2f}, " if peak.get("sft") is not None else ""
        lines.append(f"held-out gold curve ({peak['samples']} sample(s) per prompt, every {peak['every']} steps, "
                     f"another sampling seed): {sft}peak {peak['gold_reward']:.2f} at step {peak['step']}")
    elif peak:
        lines.append(f"training gold (temperature 1, {peak['smoothing']}): peak {peak['gold_reward']:.2f} at step "
                     f"{peak['step']}")
    on = lambda c: f" on {c['pairs']} pairs (95 % interval [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}])"  # noqa
    if "rm" in summary:
        check = summary["rm"].get("check")
        lines.append(f"reward model held-out accuracy {summary['rm']['accuracy']:.3f}" + (on(check) if check else ""))
    if check := summary.get("judge_check"):
        lines.append(f"judge held-out accuracy {check['accuracy']:.3f}{on(check)}")
    return "\n".join(lines)


# =========================================================================================================
# What every command checks before any work: a mistake is one line `error: …`, exit 2 (cli.fail, cli.UserError)
# =========================================================================================================
def read_json(path, expect: type = dict):
    """The JSON of a file this project wrote (a run's summary.json or checkpoint_eval.json, a model's
    data_limits.json), which must be a JSON object (expect=dict) or array (expect=list); one that is not UTF-8, not
    JSON or not of that kind is a UserError naming the file."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        first = (str(e).strip().splitlines() or [""])[0]
        raise cli.UserError(f"{path}: cannot be read as UTF-8 JSON ({type(e).__name__}: {first})") from None
    if not isinstance(value, expect):
        kind = {dict: "object {...}", list: "array [...]"}[expect]
        raise cli.UserError(f"{path}: expected a JSON {kind}, got {type(value).__name__} (a damaged file?)")
    return value


def read_log(path) -> list[dict]:
    """Every object of a run's JSONL log (metrics.jsonl); [] for an empty file. A damaged line (not UTF-8, not
    JSON) is a data.DataError naming the file and line."""
    try:
        return [obj for _, obj in data.read_jsonl(path)]
    except data.DataError as e:
        if e.reason == "empty_file":
            return []
        raise


def check_out(flag: str, path: str, image: bool = False) -> None:
    """An output path a command can write: not a directory, under no file posing as a directory and, for an image,
    ending in an extension matplotlib writes (it picks the format by it); else one line naming the flag."""
    p = Path(path)
    if p.is_dir():
        cli.fail(f"{flag} {path}: is a directory; name the file to write")
    above = next((d for d in p.parents if d.exists()), None)  # the nearest folder that already exists
    if above is not None and not above.is_dir():
        cli.fail(f"{flag} {path}: {above} is a file, not a directory")
    if image:
        from matplotlib.figure import Figure
        formats = Figure().canvas.get_supported_filetypes()  # {"png": ..., "pdf": ...}: what savefig can write
        if p.suffix[1:].lower() not in formats:
            what = f"{p.suffix} is not an image type matplotlib writes" if p.suffix else "no extension to name its type"
            cli.fail(f"{flag} {path}: {what}; end it in one of {', '.join('.' + f for f in sorted(formats))}")


# =========================================================================================================
# `python eval.py score`: a saved reward model on its own, over a data file (pairs or prompt/response)
# =========================================================================================================
def load_scorer(model_dir: str):
    """(reward model, tokenizer, limits) of a reward-model directory written by train.py.

    A missing directory, a missing tokenizer or a directory that is not a trained reward model is a
    data.DataError (one line, exit 2 under cli_guard). limits = data_limits.json written by
    `train.py --data`; without it (a synthetic-world RM) the model's context is split 2:1 prompt:response.
    """
    from reward_model import ScalarHeadModel
    tokenizer = data.load_tokenizer(model_dir)
    try:  # ours (value_head.safetensors) or an AutoModelForSequenceClassification; never a random head
        rm = ScalarHeadModel.from_pretrained(model_dir, require_head=True).eval().requires_grad_(False)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise data.DataError(model_dir, None, None, "no_model", f"cannot load the reward model ({first})") from None
    return rm, tokenizer, model_limits(model_dir, rm.config)


def model_limits(model_dir, config) -> dict:
    """The limits a reward model was trained with (data_limits.json, written by train.py --data); without it (a
    synthetic-world RM) the model's context split 2:1 between the query and the response."""
    limits_file = Path(model_dir) / "data_limits.json"
    if limits_file.is_file():
        return read_json(limits_file)
    context = config.max_position_embeddings  # a query (BOS included) and a response share it
    return {"max_prompt_tokens": 2 * context // 3, "max_response_tokens": context - 2 * context // 3}


@torch.no_grad()
def score_texts(rm, tokenizer, rows: list[tuple[str, str]], batch: int = 64) -> list[float]:
    """r(x, y) of (prompt, response) rows, encoded as in training ([BOS] + x + y + [EOS], data.lm_batch),
    batched by length so that little is padding; returned in the order of `rows`."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    scores = [0.0] * len(rows)
    for i in progress(range(0, len(order), batch), "scoring", leave=False):
        idx = order[i:i + batch]
        ids, attn, _ = data.lm_batch([rows[j] for j in idx], tokenizer)                 # (B, L), (B, L)
        for j, r in zip(idx, rm.score(ids, attn).tolist()):                          # (B,)
            scores[j] = r
    return scores


def margin_histogram(margins: list[float], path: str, title: str) -> None:
    """Fig. 2: the distribution of r(x, y_w) − r(x, y_l) over pairs, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(margins, bins=40, color="tab:blue", alpha=0.8)
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("r(x, y_chosen) − r(x, y_rejected)")
    ax.set_ylabel("pairs")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def score(argv=None) -> dict:
    """Score every pair (or every prompt/response) of a data file with a saved reward model."""
    from reward_model import accuracy
    p = cli.OneLineParser(prog="eval.py score", description=score.__doc__)
    p.add_argument("--reward-model", required=True, help="reward-model directory (with its tokenizer), from train.py")
    p.add_argument("--data", required=True, help="preference pairs in any format train.py --data reads (HH "
                                                 "transcripts, prompt/chosen/rejected, conversational), or "
                                                 "prompt-completion / text records; .jsonl, .jsonl.gz or a hub id")
    p.add_argument("--data-split", default="train", help="with --data as a hub id or a folder of several splits")
    p.add_argument("--data-config", default=None, help="with --data as a hub id: its configuration")
    p.add_argument("--out", default="scores.jsonl", help="per-example scores (JSONL)")
    p.add_argument("--hist", default=None, help="PNG of the margin histogram (Fig. 2); default: --out with .png")
    p.add_argument("--skip-bad", action="store_true", help="skip bad lines, count them by reason (else exit 2)")
    p.add_argument("--batch", type=int, default=64, help="sequences per forward pass")
    a = p.parse_args(argv)
    cli.check_flags(a, {"batch": ">=1"})
    check_out("--out", a.out)
    a.hist = a.hist or str(Path(a.out).with_suffix(".png"))
    check_out("--hist", a.hist, image=True)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    rm, tokenizer, limits = load_scorer(a.reward_model)
    P, T = limits["max_prompt_tokens"], limits["max_response_tokens"]
    report = data.DataReport()
    a.data = data.source(a.data, a.data_split, a.data_config)
    first = next((obj for _, obj in data.records(a.data, skip_bad=True)), {})
    out_rows, result = [], {"file": str(a.data), "reward_model": a.reward_model, "limits": {"P": P, "T": T}}
    if "chosen" in first or "rejected" in first or not first:
        pairs = data.load_pairs(a.data, a.skip_bad, report)
        rows = data.pair_records(pairs, tokenizer, P, T, a.skip_bad, report, cut=True)  # every pair, cut to fit
        if not rows:
            raise data.DataError(a.data, None, None, "all_skipped", f"no pair fits the limits P={P}, T={T} ({report.summary()})")
        s = score_texts(rm, tokenizer, [(r["prompt"], r["chosen"]) for r in rows]
                        + [(r["prompt"], r["rejected"]) for r in rows], a.batch)
        r_chosen, r_rejected = torch.tensor(s[:len(rows)]), torch.tensor(s[len(rows):])  # (N,), (N,)
        margins = r_chosen - r_rejected                                                   # (N,)  r(x,y_w) − r(x,y_l)
        out_rows = [{"source": r["source"], "chosen": c, "rejected": j, "margin": c - j}
                    for r, c, j in zip(rows, r_chosen.tolist(), r_rejected.tolist())]
        result.update(pairs=len(rows), accuracy=accuracy(r_chosen, r_rejected), mean_margin=margins.mean().item())
        result["hist"] = a.hist
        margin_histogram(margins.tolist(), result["hist"], f"{Path(str(a.data)).name}: {len(rows)} pairs, accuracy "
                         f"{result['accuracy']:.3f}, mean margin {result['mean_margin']:+.3f}")
        print(f"{len(rows)} pairs: pairwise accuracy {result['accuracy']:.3f}, mean margin r(chosen) − r(rejected) "
              f"{result['mean_margin']:+.3f}; histogram {result['hist']}")
    else:
        rows = data.text_records(data.load_texts(a.data, a.skip_bad, report, with_source=True), tokenizer, P, T,
                                 a.skip_bad, report, cut=True)  # every record, cut to fit
        rows = [(r["prompt"], r["response"], r["source"]) for r in rows]
        if not rows:
            raise data.DataError(a.data, None, None, "all_skipped", f"no record fits the limits P={P}, T={T} ({report.summary()})")
        s = score_texts(rm, tokenizer, [(x, y) for x, y, _ in rows], a.batch)
        out_rows = [{"source": src, "score": r} for (_, _, src), r in zip(rows, s)]
        result.update(responses=len(rows), mean_score=sum(s) / len(s))
        print(f"{len(rows)} responses: mean r(x, y) {result['mean_score']:+.3f} (no pairs, so no accuracy or histogram)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in out_rows))
    result.update(out=a.out, data_report=report.to_dict())
    print(f"scores: {a.out}; data: {report.summary()}")
    return result


# the panels of `eval.py plot`, in §5.2's order: (metrics.jsonl key or keys, the panel's title). The gold panel draws
# the training samples' gold (temperature 1, every step), the held-out curve (heldout/*, sampled as the final
# evaluation, every --heldout-every steps), SFT's held-out level and the final evaluation's point.
PANELS = [(("reward/score",), "reward-model score (raw)"),
          (("reward/gold", "reward/judge"), "gold reward / judge: training samples and held-out"),
          (("kl/ref",), "KL to the reference (nats/token)"), (("policy/perplexity",), "perplexity on own samples"),
          (("response/length",), "response length (tokens)"), (None, "win rate vs SFT (win + ½ tie, held out)")]
# drawn when a run has it (--rollout-mismatch / --rollout-correction): how far the sampler's log-probs are from the
# trainer's on the sampled tokens
MISMATCH_PANEL = (("mismatch/mean_abs_logp_diff",), "rollout/training mismatch: mean |log π_rollout − log π_old|")


def plot_run(run: str) -> tuple[list[dict], list[dict], dict]:
    """One run's curves for plot(): its metrics.jsonl rows, its win rates against SFT by step (checkpoint_eval.json,
    then summary.json's) and its summary.json ({} before the run ends). A missing or damaged log is one line."""
    f = Path(run) / "metrics.jsonl"
    if not f.is_file():
        cli.fail(f"{run}: no metrics.jsonl (not a train.py run directory)")
    rows = read_log(f)
    if not rows:
        cli.fail(f"{f}: no steps yet")
    wins = Path(run) / "checkpoint_eval.json"  # the figure notebooks' per-checkpoint evaluation, if any
    wins = read_json(wins, list) if wins.is_file() else []
    summary = Path(run) / "summary.json"       # and the final held-out evaluation of a finished run
    s = read_json(summary) if summary.is_file() else {}
    if s.get("win_rate_vs_sft"):
        wins = [w for w in wins if w["step"] != s["steps"]] + [{"step": s["steps"], **s["win_rate_vs_sft"]}]
    return rows, wins, s


def plot_gold(ax, rows: list[dict], summary: dict, key: str, label: str, at_chance: bool) -> None:
    """The gold (or judge) panel of one run: the training samples' mean (a thin line), the held-out curve (markers),
    SFT's held-out level (a dotted horizontal line: the final evaluation's SFT, else the curve's step 0) and the
    final evaluation's point (a star), all in the run's colour."""
    name = "judge at chance" if at_chance else key.split("/")[1]
    temperature = (summary.get("config") or {}).get("temperature", 1.0)
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    line, = ax.plot(*zip(*pts), linewidth=0.8, alpha=0.6, label=f"{label}: training samples, T {temperature:g} "
                                                                 f"({name})")
    colour = line.get_color()
    held = [(r["step"], r[f"heldout/{key.split('/')[1]}"]) for r in rows
            if r.get(f"heldout/{key.split('/')[1]}") is not None]
    if held:
        ax.plot(*zip(*held), marker="o", markersize=4, color=colour, label=f"{label}: held-out, eval sampling")
    sft, where = (summary.get("sft") or {}).get("gold_reward"), "final table"
    if sft is None and held and held[0][0] == 0:
        sft, where = held[0][1], "step 0"
    if sft is not None:
        ax.axhline(sft, color=colour, linestyle=":", linewidth=1.2, label=f"{label}: SFT, held-out ({where})")
    final = (summary.get("final") or {}).get("gold_reward")
    if final is not None:
        ax.plot([summary["steps"]], [final], marker="*", markersize=11, color=colour, linestyle="none",
                label=f"{label}: final evaluation")


def plot(argv=None) -> dict:
    """§5.2's panels of one or more train.py runs, one line per run, as one PNG."""
    p = cli.OneLineParser(prog="eval.py plot", description=plot.__doc__)
    p.add_argument("runs", nargs="+", help="run directories (each with its metrics.jsonl)")
    p.add_argument("--out", default="curves.png", help="the PNG to write")
    p.add_argument("--labels", default="", help="comma-separated labels (default: the directories' names)")
    a = p.parse_args(argv)
    check_out("--out", a.out, image=True)
    labels = [x.strip() for x in a.labels.split(",")] if a.labels else [Path(r).name for r in a.runs]
    if len(labels) != len(a.runs):
        cli.fail(f"--labels: {len(labels)} labels for {len(a.runs)} runs")
    runs = [plot_run(run) for run in a.runs]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mismatch = any(r.get(MISMATCH_PANEL[0][0]) is not None for rows, _, _ in runs for r in rows)
    panels = PANELS + [MISMATCH_PANEL] if mismatch else PANELS
    fig, axes = plt.subplots(2, 4 if mismatch else 3, figsize=(17 if mismatch else 13, 7), sharex=True)
    if mismatch:
        axes[1, 3].set_visible(False)
    drawn = []
    for ax, (keys, title) in zip([a for a in axes.flat if a.get_visible()], panels):
        notes = []  # runs whose judge cannot tell the policies apart: words in place of their win rate
        for (rows, wins, summary), label in zip(runs, labels):
            check = judge_of(summary, summary.get("judge", "gold"))
            at_chance = bool(check) and not check["can_judge"]
            if keys is None:  # the win rate (win + ½ tie) of each evaluated checkpoint against SFT
                if at_chance:
                    notes.append(f"{label}: {cannot_judge(check)}")
                elif wins:
                    ax.plot([w["step"] for w in wins], [w["win"] + 0.5 * w["tie"] for w in wins], marker="o",
                            label=label)
                continue
            key = next((k for k in keys if any(r.get(k) is not None for r in rows)), None)
            if key and len(keys) > 1:
                plot_gold(ax, rows, summary, key, label, at_chance)
            elif key:
                pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                ax.plot(*zip(*pts), label=label)
        has_lines = bool(ax.lines)
        if keys is None and has_lines:
            ax.axhline(0.5, color="gray", linestyle="--", linewidth=0.8)  # as good as SFT
        if notes:
            ax.text(0.02, 0.5, "\n".join(textwrap.fill(n, 48) for n in notes), transform=ax.transAxes, fontsize=7,
                    va="center", color="firebrick")
        drawn.append(title + ("".join(f": {n}" for n in notes)) if has_lines or notes else f"{title}: none")
        ax.set_title(title if has_lines or notes else f"{title}\n(not in these runs)", fontsize=9)
        if has_lines and len(keys or ()) > 1:  # the gold panel's four entries per run: room above its lines
            lo, hi = ax.get_ylim()
            ax.set_ylim(lo, hi + 0.45 * (hi - lo))
            ax.legend(fontsize=6, loc="upper right")
        elif has_lines:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("PPO step")
    fig.suptitle("§5.2 monitoring: " + ", ".join(labels), fontsize=10)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    plt.close(fig)
    print(f"{a.out}: {len(runs)} run(s); panels: " + "; ".join(drawn))
    return {"out": a.out, "panels": drawn}


def eval_args(argv):
    """The flags of the policy-vs-SFT comparison, each numeric one checked against its range."""
    p = cli.OneLineParser(prog="eval.py", description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a run directory written by train.py (reads paths from its summary.json)")
    p.add_argument("--policy", help="policy directory (Hugging Face)")
    p.add_argument("--sft", help="SFT directory (the baseline and the KL reference)")
    p.add_argument("--reward-model", help="reward-model directory")
    p.add_argument("--prompts", help="JSONL of {'prompt'} lines or pairs; default the run's held-out prompts")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", choices=["a", "b"], help="the synthetic world whose gold judges (toy_world.py, "
                   "toy_world_b.py); default: the --run's, else a")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--random-head", action="store_true",
                   help="score with a fresh (seeded) random head where --reward-model or the run's judge has no "
                        "trained one: a chance-level baseline; without it such a directory is an error")
    a = p.parse_args(argv)
    cli.check_flags(a, {"samples": ">=1", "max_new_tokens": ">=1"})
    return a


def paths_from_run(a) -> tuple[str, str | None]:
    """With --run: every path not given, from the run's summary.json (a damaged one is one line naming it). Returns
    the judge's name ("gold" in the synthetic world) and the held-out judge model's directory, if any."""
    if not a.run:
        return "gold", None
    if not (Path(a.run) / "summary.json").is_file():
        cli.fail(f"--run {a.run}: no summary.json (not a finished train.py run directory)")
    summ = read_json(Path(a.run) / "summary.json")
    if a.world and summ.get("world", "a") != a.world:
        cli.fail(f"--world {a.world}: the run {a.run} was trained in world {summ.get('world', 'a')}; drop --world")
    a.world = a.world or summ.get("world", "a")
    base, models = (Path(summ["base"]) if summ.get("base") else None), summ.get("models") or {}
    a.policy = a.policy or str(Path(a.run) / "policy")
    a.sft = a.sft or (str(base / "sft") if base else models.get("sft"))
    a.reward_model = a.reward_model or (str(base / "reward_model") if base else models.get("reward"))
    held = (base if base else Path(a.run)) / "data" / "prompts_heldout.jsonl"  # a real --model: in its run
    a.prompts = a.prompts or (str(held) if held.is_file() else None)
    if not a.prompts:
        cli.fail(f"--run {a.run}: no held-out prompts in {held}; pass --prompts")
    # real data has no gold: a held-out reward model (or the RM) judges
    return summ.get("judge", "gold"), summ.get("judge_model")


def world_prompts(prompts: list[str], world: str = "a") -> bool:
    """Whether every prompt is one of the synthetic world's (its parse_prompt reads it), so gold can judge."""
    try:
        for p in prompts:
            toy_world.world(world).parse_prompt(p)
    except (ValueError, StopIteration):  # no topic word, or a helpful request without its number
        return False
    return True


def evaluate(argv) -> None:
    """The policy against the SFT model (compare()), printed as a table and a few examples. Flags, paths, the
    prompts file and the scorers' heads (a --reward-model or judge without a trained one is an error unless
    --random-head) are checked before any model loads; the tokenizer is the policy's, loaded as train.py does."""
    a = eval_args(argv)
    judge_name, judge_dir = paths_from_run(a)
    for flag, path in (("--policy", a.policy), ("--sft", a.sft), ("--reward-model", a.reward_model)):
        if not path:
            cli.fail(f"{flag} is missing: pass --run RUN_DIR, or --policy, --sft and --reward-model directories")
        if not Path(path, "config.json").is_file():  # a local directory: nothing is downloaded
            cli.fail(f"{flag} {path}: not a model directory (no config.json); pass --run RUN_DIR or the directories")
    from plumbing.models import not_a_reward_model, reward_model_kind
    from reward_model import ScalarHeadModel
    # a scorer without a trained head would score with a random one: refused as train.py refuses it (plumbing/pipeline.py)
    for flag, path in (("--reward-model", a.reward_model), (f"--run {a.run}: judge_model", judge_dir)):
        if path and not Path(path, "config.json").is_file():  # only the judge is still unchecked here
            cli.fail(f"{flag} {path}: not a model directory (no config.json)")
        if path and reward_model_kind(path) is None and not a.random_head:
            cli.fail(f"{flag} {not_a_reward_model(path)} (--random-head scores with one anyway)")
    prompt_items = data.load_prompts(a.prompts, with_source=True)  # a bad line: DataError naming file and line
    tok = data.load_tokenizer(a.policy)  # as train.py: no pad token (LLaMA, GPT-2) → pad = EOS; the masks know padding
    policy = models.causal_lm_class(a.policy).from_pretrained(a.policy).eval()
    sft = models.causal_lm_class(a.sft).from_pretrained(a.sft).eval()
    rm = ScalarHeadModel.from_pretrained(a.reward_model, require_head=not a.random_head).eval()
    # {"prompt"} lines, or the prompts of pairs, cut as in training (data.fit_example) to fit every model
    limits = model_limits(a.reward_model, rm.config)
    P, _, a.max_new_tokens = data.context_limits(limits["max_prompt_tokens"], limits["max_response_tokens"],
                                                 a.max_new_tokens, policy.config.max_position_embeddings)
    prompts = [r["prompt"] for r in data.prompt_records(prompt_items, tok, P, False, data.DataReport())]
    a.world = a.world or "a"
    if not a.run and not world_prompts(prompts, a.world):  # real data has no gold: the reward model judges
        judge_name = "reward model"
    judge = toy_world.world(a.world).gold_judge if judge_name == "gold" else rm_judge(
        ScalarHeadModel.from_pretrained(judge_dir, require_head=not a.random_head).eval() if judge_dir else rm)
    extra = {"reward model (proxy)": rm_judge(rm)} if judge_dir else None
    rep = compare(policy, sft, sft, rm, tok, prompts, a.samples, a.seed, a.max_new_tokens, judge=judge,
                  extra_judges=extra)
    rm_check_ = rm_check(Path(a.reward_model))
    judge_check_ = rm_check(Path(judge_dir)) if judge_dir else None
    print(format_table({"sft": rep["sft"], "final": rep["policy"], "win_rate_vs_sft": rep["win_rate"],
                        "peak": None, "judge": judge_name,
                        "eval_sampling": {"samples": a.samples, **EVAL_SAMPLING},
                        **({"rm": {"accuracy": rm_check_["accuracy"], "check": rm_check_}} if rm_check_ else {}),
                        **({"judge_check": judge_check_} if judge_check_ else {}),
                        "win_rate_vs_sft_by_judge": {judge_name: rep["win_rate"], **rep.get("win_rates", {})}}))
    for e in rep["examples"]:
        print(f"{e['prompt']!r:28} policy: {e['policy']!r}\n{'':28} sft:    {e['sft']!r}")


def main(argv=None):
    """`python eval.py score ...` (score()), `python eval.py plot ...` (plot()), else the policy-vs-SFT comparison
    (evaluate()); a user's mistake in any of them is one line `error: …` on stderr and exit status 2."""
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["score"], ["plot"]):
        return cli.cli_guard(score if argv[0] == "score" else plot)(argv[1:])
    return cli.cli_guard(evaluate)(argv)


if __name__ == "__main__":
    main()
