"""Best-of-n: sample n responses from the SFT policy, keep the one the proxy reward model scores highest.

Implements:
    bon_kl(n)                          → KL(π_bon ‖ π_SFT) = log n − (n − 1)/n, in nats per response (Stiennon et al.
                                         2020, App. G.3; Gao et al. 2022, section 2): exact when the scores have a
                                         continuous distribution (no ties), an upper bound otherwise (Beirami et al.
                                         2024); it grows like log n, so d = √KL grows like √(log n)
    select_best(scores)                → (N, n) proxy scores → (N,) the index of the best of each row (first on a tie;
                                         a NaN/inf score is never the best, as PPO's guard never learns from one)
    sample(model, rm, tokenizer, prompts, n, per_prompt, seed, ...)
                                       → per_prompt best-of-n responses per prompt, in eval.sample's layout, with the
                                         proxy score of each chosen response
    evaluate(sft, rm, tokenizer, prompts, n, per_prompt, seed, ...)
                                       → the held-out comparison with SFT that train.py's evaluation makes for a policy:
                                         metrics of each (eval.measure), win / tie / lose by the judge

Run: python train.py --method best-of-n --bon-n 16      (SFT and the reward model as always, then no training:
                                                         the policy is "the SFT model, best of 16 by the proxy")
     python best_of_n.py                                (the worked example: the KL of a few n, and one selection)

Why it belongs beside PPO: it is the baseline every RL method should beat at the same KL (Gao et al. 2022), and it
optimises the proxy with no gradient at all, so its gold-vs-√KL curve isolates the reward model's error from the
optimiser's. The judge (gold) never chooses; the proxy does.

References: Stiennon et al. 2020, "Learning to summarize from human feedback" (App. G.3, the BoN KL); Gao, Schulman,
Hilton 2022, "Scaling Laws for Reward Model Overoptimization" (sections 2-3); Beirami et al. 2024, "Theoretical
guarantees on the best-of-n alignment policy" (the formula is an upper bound).
"""
from __future__ import annotations

import math
import sys

import torch
from torch import Tensor


def bon_kl(n: int) -> float:
    """KL(π_bon ‖ π) = log n − (n − 1)/n nats per response: the density ratio of the best of n i.i.d. draws is
    n·F(r)^(n−1) with F the scores' CDF, and E[log F] = −1/n under the best of n (F ~ Beta(n, 1))."""
    if n < 1:
        raise ValueError(f"best_of_n.bon_kl: n must be ≥ 1, got {n}")
    return math.log(n) - (n - 1) / n


def select_best(scores: Tensor) -> Tensor:
    """(N, n) proxy scores of n candidates per row → (N,) the index of the highest (the first of equal ones).

    A NaN or ±inf score (a reward model that overflowed) is skipped, never chosen: argmax alone would take a NaN as
    the largest. PPO treats such a score the same way (ppo_max.check_finite: the batch is not learned from). A row
    whose n scores are all non-finite has nothing to choose from: a ValueError naming it."""
    if scores.dim() != 2:
        raise ValueError(f"best_of_n.select_best: scores must be (N, n), got {tuple(scores.shape)}")
    finite = torch.isfinite(scores)                                      # (N, n)
    if not finite.any(dim=1).all():
        row = int((~finite.any(dim=1)).nonzero()[0])
        raise ValueError(f"best_of_n.select_best: row {row} has no finite proxy score among its {scores.shape[1]} "
                         f"candidates ({scores[row].tolist()}): the reward model returned NaN/inf for every one")
    return scores.masked_fill(~finite, -math.inf).argmax(dim=1)         # (N,)


@torch.no_grad()
def sample(model, reward_model, tokenizer, prompts: list[str], n: int, per_prompt: int, seed: int,
           max_new_tokens: int, sampling: dict | None = None) -> dict:
    """per_prompt responses for each prompt, each the best of n candidates sampled from `model` and scored by
    `reward_model` (the proxy): eval.sample's dict (prompts, query, query_mask, response, mask, texts, finished),
    one batch, plus "scores" (the proxy score of each chosen response) and "nonfinite" (how many candidates had a
    NaN/inf proxy score and were skipped by select_best; a line on stderr says so when there are any)."""
    from plumbing import data
    import eval as evaluation
    cand = evaluation.sample(model, tokenizer, prompts, per_prompt * n, seed, max_new_tokens, sampling=sampling)
    scores, rows = [], []
    for q, qm, r, m in zip(cand["query"], cand["query_mask"], cand["response"], cand["mask"]):
        scores.append(reward_model.score(torch.cat([q, r], 1), torch.cat([qm, m], 1)).float())  # (b,)
        rows += [(qi[qmi != 0].tolist(), ri[mi != 0].tolist()) for qi, qmi, ri, mi in zip(q, qm, r, m)]
    scores = torch.cat(scores).view(-1, n).cpu()                         # (len(prompts)·per_prompt, n)
    choice = select_best(scores)                                         # (N,) index within each group of n
    best = choice + torch.arange(scores.shape[0]) * n                    # (N,) the chosen candidate's row
    nonfinite = int((~torch.isfinite(scores)).sum())
    if nonfinite:
        print(f"[best-of-n] {nonfinite} of {scores.numel()} candidates had a NaN/inf proxy score; none was chosen",
              file=sys.stderr)
    device = cand["query"][0].device
    query, query_mask = data.pad([rows[i][0] for i in best.tolist()], tokenizer.pad_token_id, "left")
    response, mask = data.pad([rows[i][1] for i in best.tolist()], tokenizer.pad_token_id, "right")
    return {"prompts": [cand["prompts"][i] for i in best.tolist()], "query": [query.to(device)],
            "query_mask": [query_mask.to(device)], "response": [response.to(device)], "mask": [mask.to(device)],
            "texts": [cand["texts"][i] for i in best.tolist()],
            "finished": [cand["finished"][i] for i in best.tolist()],
            "scores": scores.gather(1, choice[:, None]).squeeze(1).tolist(), "nonfinite": nonfinite}


def evaluate(sft, reward_model, tokenizer, prompts: list[str], n: int, per_prompt: int, seed: int,
             max_new_tokens: int, judge, sampling: dict | None = None) -> dict:
    """Best-of-n against the SFT model on the same prompts, as eval.compare does for a policy: {"policy", "sft",
    "win_rate"}. The best-of-n row's kl is None (it is no model with per-token probabilities) and kl_seq its exact
    KL per response, bon_kl(n); its perplexity is the SFT model's on the chosen responses."""
    import eval as evaluation
    s_sft = evaluation.sample(sft, tokenizer, prompts, per_prompt, seed, max_new_tokens, sampling=sampling)
    s_bon = sample(sft, reward_model, tokenizer, prompts, n, per_prompt, seed + 1, max_new_tokens, sampling)
    m_sft, g_sft = evaluation.measure(sft, sft, reward_model, s_sft, judge)
    m_bon, g_bon = evaluation.measure(sft, sft, reward_model, s_bon, judge)
    m_bon.update(kl=None, kl_seq=bon_kl(n))
    return {"policy": m_bon, "sft": m_sft, "win_rate": evaluation.win_rate(g_bon, g_sft)}


if __name__ == "__main__":
    for n in (1, 2, 4, 16, 64):
        print(f"n={n:3d}  KL={bon_kl(n):.6f}  d=√KL={math.sqrt(bon_kl(n)):.6f}")
    scores = torch.tensor([[0.3, 1.2, -0.5, 1.2], [2.0, 0.1, 0.0, -1.0]])
    print("best of each row:", select_best(scores).tolist())
    # Printed (tests/test_best_of_n.py checks these numbers):
    # n=  1  KL=0.000000  d=√KL=0.000000
    # n=  2  KL=0.193147  d=√KL=0.439485
    # n=  4  KL=0.636294  d=√KL=0.797681
    # n= 16  KL=1.835089  d=√KL=1.354654
    # n= 64  KL=3.174508  d=√KL=1.781715
    # best of each row: [1, 0]
