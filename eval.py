"""Evaluate a policy the way section 5.2 says to watch one: win rate against SFT, KL, perplexity, length, reward.

Implements: no equation; the monitoring metrics of §5.2 and the win rate of Fig. 10.
  sample()        responses with the paper's evaluation sampling (top-p 0.9, temperature 0.8, repetition penalty 1.1)
  measure()       reward-model score, gold reward, per-token KL to the reference, perplexity, length
  compare()       the above for a policy and the SFT model, plus win / tie / lose judged by gold (synthetic world)
                  or by the reward model (real data, where no gold judge exists)
Run:
  python eval.py --policy runs/ppo-max-seed0/policy --sft runs/_base/<...>/sft --reward-model runs/_base/<...>/reward_model
  python eval.py --run runs/ppo-max-seed0          # the same, with every path read from that run's summary.json
Definitions of every metric: README, "Metrics".
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import ppo_max
import toy_world
from ppo_loss import kl_full, logprobs_from_logits, masked_mean

# The paper's evaluation sampling (§ hyperparameters): top-p 0.9, temperature 0.8, repetition penalty 1.1.
EVAL_SAMPLING = dict(top_p=0.9, temperature=0.8, repetition_penalty=1.1)


def gold_judge(prompt: str, text: str, finished: bool) -> float:
    return toy_world.gold_reward(prompt, text, finished)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int, batch: int = 256) -> dict:
    """n responses per prompt, sampled with EVAL_SAMPLING from `seed` (the same seed for every model compared)."""
    from train import encode_prompt, pad
    rows = [p for p in prompts for _ in range(n)]
    out = {"prompts": rows, "query": [], "query_mask": [], "response": [], "mask": [], "finished": []}
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        for i in range(0, len(rows), batch):
            q, qm = pad([encode_prompt(tokenizer, p) for p in rows[i:i + batch]], tokenizer.pad_token_id, "left")
            r, m, f = ppo_max.rollout(model, q, qm, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                      **EVAL_SAMPLING)
            out["query"].append(q); out["query_mask"].append(qm)
            out["response"].append(r); out["mask"].append(m); out["finished"].append(f)
    out["texts"] = [tokenizer.decode(r[m.bool()], skip_special_tokens=True)
                    for R, M in zip(out["response"], out["mask"]) for r, m in zip(R, M)]
    out["finished"] = torch.cat(out["finished"]).tolist()
    return out


@torch.no_grad()
def measure(model, ref, reward_model, samples: dict, judge=gold_judge) -> dict:
    """Mean metrics over the sampled responses. KL and perplexity use the models' own (temperature 1)
    distributions at the visited positions: kl = mean over response tokens of Σ_v π log(π/π_ref);
    perplexity = exp(mean NLL of the sampled tokens under the model)."""
    kl_sum = nll_sum = tokens = 0.0
    scores, lengths = [], []
    for q, qm, r, m in zip(samples["query"], samples["query_mask"], samples["response"], samples["mask"]):
        logits = ppo_max.policy_logits(model, q, qm, r, m)                              # (B, T, V)
        ref_logits = ppo_max.policy_logits(ref, q, qm, r, m)                            # (B, T, V)
        kl_sum += (kl_full(logits, ref_logits) * m).sum().item()
        nll_sum += -(logprobs_from_logits(logits, r) * m).sum().item()
        tokens += m.sum().item()
        scores += reward_model.score(torch.cat([q, r], 1), torch.cat([qm, m], 1)).tolist()
        lengths += m.sum(1).tolist()
    gold = [judge(p, t, f) for p, t, f in zip(samples["prompts"], samples["texts"], samples["finished"])]
    return {"reward": sum(scores) / len(scores), "gold_reward": sum(gold) / len(gold), "kl": kl_sum / tokens,
            "perplexity": math.exp(nll_sum / tokens), "response_length": sum(lengths) / len(lengths),
            "finished": sum(samples["finished"]) / len(samples["finished"])}, gold


def win_rate(a: list[float], b: list[float]) -> dict:
    """Win / tie / lose of a against b, paired by prompt and sample index."""
    n = len(a)
    win = sum(x > y for x, y in zip(a, b)) / n
    lose = sum(x < y for x, y in zip(a, b)) / n
    return {"win": win, "tie": 1 - win - lose, "lose": lose}


def compare(policy, sft, ref, reward_model, tokenizer, prompts: list[str], n: int, seed: int, max_new_tokens: int,
            judge=gold_judge) -> dict:
    s_pol = sample(policy, tokenizer, prompts, n, seed, max_new_tokens)
    s_sft = sample(sft, tokenizer, prompts, n, seed, max_new_tokens)
    m_pol, g_pol = measure(policy, ref, reward_model, s_pol, judge)
    m_sft, g_sft = measure(sft, ref, reward_model, s_sft, judge)
    examples = [{"prompt": p, "policy": a, "sft": b} for p, a, b in
                list(zip(s_pol["prompts"], s_pol["texts"], s_sft["texts"]))[::max(n, 1)][:8]]
    return {"policy": m_pol, "sft": m_sft, "win_rate": win_rate(g_pol, g_sft), "examples": examples}


def format_table(summary: dict) -> str:
    keys = ["reward", "gold_reward", "kl", "perplexity", "response_length"]
    lines = [f"{'held-out':<10}" + "".join(f"{k:>16}" for k in keys)]
    for name in ["sft", "final"]:
        lines.append(f"{name:<10}" + "".join(f"{summary[name][k]:>16.3f}" for k in keys))
    w = summary["win_rate_vs_sft"]
    lines.append(f"win rate vs SFT (gold judge): win {w['win']:.2f}  tie {w['tie']:.2f}  lose {w['lose']:.2f}   "
                 f"peak training gold {summary['peak']['gold_reward']:.2f} at step {summary['peak']['step']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from reward_model import ScalarHeadModel
    from train import read_jsonl
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a run directory written by train.py (reads paths from its summary.json)")
    p.add_argument("--policy", help="policy directory (Hugging Face)")
    p.add_argument("--sft", help="SFT directory (the baseline and the KL reference)")
    p.add_argument("--reward-model", help="reward-model directory")
    p.add_argument("--prompts", help="JSONL of {'prompt'}; default the run's held-out prompts")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=24)
    a = p.parse_args(argv)
    if a.run:
        summ = json.loads((Path(a.run) / "summary.json").read_text())
        base = Path(summ["base"])
        a.policy = a.policy or str(Path(a.run) / "policy")
        a.sft = a.sft or str(base / "sft")
        a.reward_model = a.reward_model or str(base / "reward_model")
        a.prompts = a.prompts or str(base / "data" / "prompts_heldout.jsonl")
    tok = AutoTokenizer.from_pretrained(a.policy)
    policy = AutoModelForCausalLM.from_pretrained(a.policy).eval()
    sft = AutoModelForCausalLM.from_pretrained(a.sft).eval()
    rm = ScalarHeadModel.from_pretrained(a.reward_model).eval()
    prompts = [r["prompt"] for r in read_jsonl(Path(a.prompts))]
    rep = compare(policy, sft, sft, rm, tok, prompts, a.samples, a.seed, a.max_new_tokens)
    print(format_table({"sft": rep["sft"], "final": rep["policy"], "win_rate_vs_sft": rep["win_rate"],
                        "peak": {"gold_reward": float("nan"), "step": -1}}))
    for e in rep["examples"]:
        print(f"{e['prompt']!r:28} policy: {e['policy']!r}\n{'':28} sft:    {e['sft']!r}")


if __name__ == "__main__":
    main()
