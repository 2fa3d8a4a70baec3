"""The reward model of RLHF: the Bradley–Terry ranking loss, its LM (imitation) term, and a causal LM with a scalar head.

Implements (equation numbers as in Zheng et al. 2023, see docs/paper.md):
    bradley_terry_loss(r_chosen, r_rejected)      −E[log σ(r(x,y_w) − r(x,y_l))]                (Eq. 1)
    accuracy(r_chosen, r_rejected)                pairwise accuracy P(r_w > r_l), ties = ½       (Eq. 1; Fig. 3)
    response_lm_loss(logits, input_ids, mask)     −E[log r'(x, y_w)], per chosen-response token  (Eq. 2, LM term)
    reward_model_loss(...)                        λ·BT + β_rm·NLL(y_w | x)                        (Eq. 2)
    ScalarHeadModel.score(input_ids, mask)        r(x, y): head on the last real token            (Eq. 1–2, 18–19)
                                                  (a sequence-classification RM: where transformers reads it)
    ScalarHeadModel.forward(input_ids, mask)      V(s_t): head on every token (the critic)        (Eq. 8–11, 16)
    last_token_index(attention_mask)              index of the last position where mask == 1
    score_index(input_ids, mask, pad_token_id)    transformers' *ForSequenceClassification pooling, on real tokens
    head_width(lm), backbones(lm)                 the width and the source of the state the backbone hands the LM
                                                  head, which the value head reads too (OPT-350m, Electra, Gemma 3,
                                                  Gemma 3n differ from hidden_states[-1] or config.hidden_size)
    train_reward_model(rm, tokenizer, pairs, ..)  stage 2: Eq. 2 on the training pairs, held-out accuracy along
                                                  the way (Fig. 3); one process or a DeepSpeed engine

The file has two halves. The loss half imports only torch (it is what students implement and what the tests
grade). The model half, below its banner, wraps a Hugging Face causal LM and imports transformers and
safetensors.

Run:  python reward_model.py      (prints the worked example at the bottom of this file; CPU, a few seconds)
      python train.py --rebuild-base   (stage 2 trains again, even when the base is cached)

References:
    Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", arXiv 2307.04964, sec. 3.1.
    Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs: I. The Method of Paired Comparisons".
    Ouyang et al. 2022, "Training language models to follow instructions with human feedback" (InstructGPT RM).
    Askell et al. 2021, "A General Language Assistant as a Laboratory for Alignment" (LM loss on preferred text).
"""
import torch
import torch.nn.functional as F

# Shapes: B batch (of preference pairs, or of sequences), L = P + T full sequence (prompt + response),
# V vocabulary, H hidden size.


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley–Terry ranking loss −mean log σ(r_w − r_l) (Eq. 1), as a loss to minimise.

    r_chosen   r(x, y_w), the score of the preferred response,    shape (B,)
    r_rejected r(x, y_l), the score of the dispreferred response, shape (B,)

    `F.logsigmoid` is used instead of `log(sigmoid(·))`: the latter rounds σ(−1000) to 0 and returns −inf;
    logsigmoid(m) = −softplus(−m) is finite for every margin. At equal rewards the loss is log 2.
    stats: `accuracy` (see `accuracy`), `margin` = mean (r_w − r_l).
    """
    if r_chosen.shape != r_rejected.shape or r_chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss: expected r_chosen and r_rejected of the same shape (B,), "
                         f"got {tuple(r_chosen.shape)} and {tuple(r_rejected.shape)}")
    margin = r_chosen - r_rejected                                # (B,)  r(x,y_w) − r(x,y_l)
    loss = -F.logsigmoid(margin).mean()                           # −E[log σ(r_w − r_l)]   (Eq. 1)
    stats = {"accuracy": accuracy(r_chosen, r_rejected), "margin": margin.mean().item()}
    return loss, stats


def accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> float:
    """Fraction of pairs the model ranks correctly, r_w > r_l (the RM accuracy of Fig. 3).

    A tie r_w == r_l counts ½: the model's Bradley–Terry probability for it is σ(0) = ½, and a freshly
    initialised head that scores everything equally then sits at chance (0.5), not at 0 or 1.
    """
    margin = (r_chosen - r_rejected).detach()                     # (B,)
    correct = (margin > 0).double() + 0.5 * (margin == 0).double()  # (B,)  1, ½ or 0
    return correct.mean().item()


def response_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over the chosen-response tokens: −E[log r'(x, y_w)] per token (Eq. 2, LM term).

    logits        (B, L, V) the LM head's output on the full chosen sequence x ⊕ y_w
    input_ids     (B, L)    that sequence
    response_mask (B, L)    1 on the tokens of y_w, 0 on the prompt x and on padding

    logits[:, t] predicts input_ids[:, t+1], and the mask is read on the *predicted* token, so the last
    prompt position (which predicts the first response token) counts and the prompt tokens themselves do
    not. Position 0 is never predicted, so a response starting at t = 0 loses its first token.
    The mean is over all selected tokens of the batch (token-level, as `ptx_loss` in ppo_loss.py), so long
    responses weigh more than short ones. Positions the mask leaves out never reach the mean, even if their
    logits hold inf or NaN. bf16/fp16 logits are upcast to float32 first; float64 stays float64. A mask that
    selects no predicted token is a ValueError (there would be nothing to average).
    """
    B, L, V = logits.shape
    if input_ids.shape != (B, L) or response_mask.shape != (B, L):
        raise ValueError(f"response_lm_loss: expected input_ids and response_mask of shape {(B, L)} to match "
                         f"logits {tuple(logits.shape)}, got {tuple(input_ids.shape)} and {tuple(response_mask.shape)}")
    targets = input_ids[:, 1:]                                    # (B, L−1) the token each position predicts
    mask = response_mask[:, 1:].bool()                            # (B, L−1) mask on the predicted token
    if not mask.any():
        raise ValueError("response_lm_loss: response_mask selects no predicted token (is the response empty, "
                         "or only at position 0?)")
    # bf16/fp16 logits are upcast to float32 (a log-softmax over V loses digits in half precision); float64 stays.
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))  # (B, L−1, V)
    nll = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
                          reduction="none").view(B, L - 1)        # (B, L−1)  −log r'(y_{t+1} | x, y_≤t)
    # torch.where (not nll * mask) so that a non-finite logit at a padding position cannot leak in as 0·inf.
    return torch.where(mask, nll, 0.0).sum() / mask.sum()


def reward_model_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, chosen_logits: torch.Tensor,
                      chosen_input_ids: torch.Tensor, chosen_response_mask: torch.Tensor,
                      lam: float = 1.0, beta_rm: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Reward-model loss of Eq. 2: λ·BT(r_w, r_l) + β_rm·NLL(y_w | x).

    The paper writes L(ψ) = −λ E[log σ(r_w − r_l)] + β_rm E[log r'(x, y_w)], with r' the same network with
    its LM head and β_rm = 1 (λ = 1 implicitly). Read literally, minimising "+β_rm·log-likelihood" would push
    the likelihood of the chosen response *down*; the intent (imitation on y_w, as in Askell et al. 2021) is to
    push it up, so as a minimised loss the LM term enters as +β_rm·NLL = −β_rm·log r'(x, y_w).

    r_chosen, r_rejected      (B,)       scores r(x, y_w), r(x, y_l)                 (λ, Eq. 1)
    chosen_logits             (B, L, V)  LM logits of the same forward pass on x ⊕ y_w
    chosen_input_ids          (B, L)
    chosen_response_mask      (B, L)     1 on the y_w tokens only
    stats: `bt`, `lm`, `accuracy`, `margin`.
    """
    bt, bt_stats = bradley_terry_loss(r_chosen, r_rejected)
    lm = response_lm_loss(chosen_logits, chosen_input_ids, chosen_response_mask)
    loss = lam * bt + beta_rm * lm                                # λ·(−E log σ(r_w − r_l)) + β_rm·(−E log r')  (Eq. 2)
    stats = {"bt": bt.item(), "lm": lm.item(), **bt_stats}
    return loss, stats


# ======================================================================================================
# Model half: a Hugging Face causal LM with a scalar head (reward model and critic). Imports transformers.
# ======================================================================================================
import inspect
import json
import math
import os
from pathlib import Path

import safetensors.torch

from plumbing import data, engine, lora
from plumbing.config import RMConfig
from plumbing.data import position_ids_from_mask
from plumbing.models import (VALUE_HEAD_CONFIG, VALUE_HEAD_WEIGHTS, backbones, gradient_checkpointing, head_width,
                             load_scalar_head_model)
from plumbing.engine import supervised_stage
from plumbing.monitor import progress

def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where attention_mask == 1, per row: (B, L) -> (B,).

    Correct for right padding (1 1 1 0 0 -> 2), left padding (0 0 1 1 1 -> 4) and both (0 1 1 0 -> 2).
    """
    L = attention_mask.shape[-1]
    real = attention_mask.bool()                                  # (B, L)
    if not real.any(dim=-1).all():
        rows = (~real.any(dim=-1)).nonzero().flatten().tolist()
        raise ValueError(f"last_token_index: rows {rows} of attention_mask have no real token (all zeros)")
    return (L - 1) - real.flip(-1).int().argmax(dim=-1)           # (B,)  first 1 seen from the right


def score_index(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Where a reward model trained as a transformers *ForSequenceClassification reads its score, per row: (B,).

    transformers pools at the last token whose id is not config.pad_token_id (its only way to know padding). When the
    pad id is also the EOS (GPT-2 or LLaMA tokenizers without a pad token, as TRL's RewardTrainer then sets), a
    sequence that ends with EOS is read BEFORE that EOS, so such a model was trained there. Here padding is known by
    the mask: the same rule on the real tokens only, so a padded row is read where transformers reads the row alone.
    pad_token_id None: the last real token (transformers' rule for one unpadded row). No real token but pad ids: the
    first real token (transformers' argmax of all zeros, 0, on the row alone)."""
    last_real = last_token_index(attention_mask)                  # (B,)  (a row without any real token: ValueError)
    if pad_token_id is None:
        return last_real
    real = attention_mask.bool()                                  # (B, L)
    read = real & (input_ids != pad_token_id)                     # (B, L) real tokens transformers does not skip
    L = read.shape[-1]
    last = (L - 1) - read.flip(-1).int().argmax(dim=-1)           # (B,)  the last of them
    first_real = real.int().argmax(dim=-1)                        # (B,)
    return torch.where(read.any(dim=-1), last, first_real)




class ScalarHeadModel(torch.nn.Module):
    """A causal LM backbone with a scalar head H -> 1: r(x, y) for the reward model, V(s_t) for the critic.

    self.lm    the Hugging Face causal LM, *with* its LM head, so Eq. 2's r'(x, y_w) is the same network
    self.head  nn.Linear(H, 1), applied to the last hidden layer at every position. A reward model loaded from
               transformers' sequence-classification format keeps its own head, which may be more than a Linear
               (ModernBERT-decoder: dense, activation, norm, then the Linear; built in plumbing/models.py): any
               module (…, H) -> (…, 1) with `in_features` H, and a `spec` that value_head.json records

    forward() gives one value per token (the critic's V(s_t)); score() reads the value at the last real token
    of each sequence (the reward model's r(x, y)). Both accept left, right or two-sided padding (a left-padded
    prompt followed by a right-padded response), as long as the 1s of each mask row are contiguous.
    """

    def __init__(self, lm: torch.nn.Module, head: torch.nn.Module | None = None, seed: int | None = 0,
                 score_pad_id: int | None = None):
        super().__init__()
        self.lm = lm
        # None: score() reads the last real token (our reward models). A sequence-classification reward model's
        # config.pad_token_id: score() reads where transformers does (score_index), the token it was trained on.
        self.score_pad_id = score_pad_id
        hidden = head_width(lm)
        if head is None:
            head = torch.nn.Linear(hidden, 1)
            # A fresh head: N(0, 1/(H+1)) weights and zero bias, so initial scores are O(1) whatever H is
            # (as in the InstructGPT / OpenAI lm-human-preferences reward head). Seeded for determinism:
            # the same SFT directory and seed give the same head; seed=None draws from torch's global RNG.
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / math.sqrt(hidden + 1))
                head.bias.zero_()
        self.head = head.to(device=lm.device, dtype=lm.dtype)
        # Most HF causal LMs take `logits_to_keep`: with it we skip the (B, L, V) logits when nobody asked for them.
        self._has_logits_to_keep = "logits_to_keep" in inspect.signature(lm.forward).parameters
        # The modules whose output the LM head reads (the outermost first; plumbing/models.py finds them for each
        # architecture), in a tuple so that they are not registered a second time as this module's children
        self._backbones = tuple(backbones(lm))

    @property
    def config(self):
        return self.lm.config

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Recompute the backbone's activations in backward (the paper trains with it). transformers ≥ 5.x
        renamed this `activation_checkpointing_enable`; use that name where it exists."""
        gradient_checkpointing(self.lm)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, return_logits: bool = False,
                score: bool = False):
        """Values (B, L): the head on the last hidden layer at every position, V(s_t); with score=True the value read
        at the last real token of each sequence, r(x, y) (B,) (score()); and the LM logits (B, L, V) if asked.

        One backbone pass serves both. Position ids are derived from the mask (HF Llama does not do this by
        itself): the first real token gets position 0 wherever the padding is, so a padded sequence sees the
        same positions as the unpadded one. Values at padding positions are meaningless; mask them.
        """
        position_ids = position_ids_from_mask(attention_mask)  # (B, L)  0, 1, … from the first real token
        extra = {} if return_logits or not self._has_logits_to_keep else {"logits_to_keep": 1}
        # The hidden state the LM head reads: the backbone's last_hidden_state (after the final norm), caught on its
        # way out; where no backbone is named or called, hidden_states[-1] after all.
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        caught: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(lambda m, args, out, i=i: caught.__setitem__(
            i, out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
            for i, m in enumerate(self._backbones)]
        try:
            out = self.lm(**kw, output_hidden_states=not hooks, **extra)
        finally:
            for hook in hooks:
                hook.remove()
        if hooks and not caught:  # a backbone is named but the LM calls something else
            out = self.lm(**kw, output_hidden_states=True, **extra)
        hidden = caught[min(caught)] if caught else out.hidden_states[-1]  # (B, L, H)  the outermost backbone's
        if hidden.shape != (*input_ids.shape, self.head.in_features):
            raise ValueError(f"ScalarHeadModel: {type(self.lm).__name__}'s last hidden state is "
                             f"{tuple(hidden.shape)}, not (B, L, H) = {(*input_ids.shape, self.head.in_features)}")
        values = self.head(hidden).squeeze(-1)                    # (B, L)     V(s_t)
        if score:  # r(x, y): the last real token; a sequence-classification reward model's: where transformers reads
            idx = last_token_index(attention_mask) if self.score_pad_id is None else \
                score_index(input_ids, attention_mask, self.score_pad_id)    # (B,)
            values = values.gather(1, idx[:, None]).squeeze(1)             # (B,)
        return (values, out.logits) if return_logits else values  # logits (B, L, V)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, return_logits: bool = False):
        """r(x, y) (B,): the value at the last real token of each sequence (and the LM logits if asked); for a
        sequence-classification reward model, at the token transformers reads (score_index)."""
        return self(input_ids, attention_mask, return_logits=return_logits, score=True)

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files are the caller's)
        plus value_head.safetensors (the head's weight and bias) and value_head.json."""
        out_dir = Path(out_dir)
        self.lm.save_pretrained(out_dir, safe_serialization=True)
        self.save_head(out_dir)

    def save_head(self, out_dir: str | os.PathLike) -> None:
        """The head alone: value_head.safetensors (the head's weights: a Linear's weight and bias) and value_head.json
        (also beside LoRA adapters). A head that is more than a Linear is named in value_head.json's "head", so that
        from_pretrained builds it again."""
        out_dir = Path(out_dir)
        state = {k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()}
        safetensors.torch.save_file(state, str(out_dir / VALUE_HEAD_WEIGHTS))
        reads = ("score(): the last position where attention_mask == 1" if self.score_pad_id is None else
                 f"score(): the last position where attention_mask == 1 and the id is not {self.score_pad_id} "
                 f"(transformers' sequence-classification pooling)")
        dtype = next(self.head.parameters()).dtype
        meta = {"hidden_size": head_width(self.lm), "dtype": str(dtype).removeprefix("torch."),
                "reads": reads + "; forward(): every position", "score_pad_id": self.score_pad_id,
                "weights": VALUE_HEAD_WEIGHTS}
        if not isinstance(self.head, torch.nn.Linear):
            meta["head"] = self.head.spec  # e.g. {"kind": "dense-activation-norm-linear", "activation": "gelu", ...}
        (out_dir / VALUE_HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, torch_dtype: torch.dtype | None = None, seed: int | None = 0,
                        require_head: bool = False, quantization: dict | None = None) -> "ScalarHeadModel":
        """Load a local Hugging Face directory: ours (value_head.safetensors beside the LM), transformers'
        AutoModelForSequenceClassification (its score head on the same backbone; refused in one line where this class
        does not score as transformers does), or a plain causal LM (a fresh head drawn with `seed`; with
        require_head=True a ValueError instead). plumbing/models.load_scalar_head_model."""
        return load_scalar_head_model(cls, path, torch_dtype, seed, require_head, quantization)

# ------------------------------------------------------------------------------------------------------
# Stage 2: train the reward model with Eq. 2, from the SFT model with a fresh scalar head
# ------------------------------------------------------------------------------------------------------
def score_pairs(rm: ScalarHeadModel, tokenizer, rows: list[dict], batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """r(x, y_w) (N,) and r(x, y_l) (N,) of {"prompt", "chosen", "rejected"} rows."""
    return score_encoded_pairs(rm, data.encode_pairs(rows, tokenizer), tokenizer.pad_token_id, batch)


@torch.no_grad()
def score_encoded_pairs(rm: ScalarHeadModel, pairs: list[tuple], pad_id: int | None, batch: int = 256
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """score_pairs of pairs already encoded (data.encode_pairs): (N,), (N,). The 2N sequences are scored in batches
    of 2·batch sequences of similar length (sorted by length: far less padding than batches in pair order); a score
    depends on its own sequence only, up to float rounding (~1e-6)."""
    device = next(rm.parameters()).device
    seqs = [(q, w) for q, w, _ in pairs] + [(q, l) for q, _, l in pairs]   # chosen 0..N-1, then rejected
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    scores = torch.empty(len(seqs), device=device)
    for k in range(0, len(order), 2 * batch):
        chunk = order[k:k + 2 * batch]
        ids, attn, _ = (t.to(device) for t in data.lm_batch_of_ids([seqs[i] for i in chunk], pad_id))  # (b, L)
        scores[chunk] = rm.score(ids, attn).float()                                                   # (b,)
    return scores[:len(pairs)], scores[len(pairs):]


# Pairs per batch of the held-out accuracy during training: 64 pairs, 128 sequences, a batch that stays in a CPU's
# cache (score_pairs' default batch of 512 sequences does not). The scores differ from score_pairs' in float rounding
# only (~1e-6): the accuracy, a comparison of a pair's two scores, changes only where they lie that close.
EVAL_PAIRS = 64


def train_reward_model(rm: ScalarHeadModel, tokenizer, train_rows: list[dict], heldout_rows: list[dict],
                       cfg: RMConfig, seed: int, ds: dict | None = None, out_dir: str | Path | None = None) -> list[dict]:
    """Stage 2: AdamW with cosine decay on Eq. 2 (λ = 1, β_rm = cfg.rm_lm_coef), chosen and rejected in one batch,
    global gradient clip 1.0; held-out pairwise accuracy every cfg.rm_eval_every steps and at the end (Fig. 3).
    Returns the log [{"step", "heldout_accuracy", "train": [stats per step]}]; `rm` is trained in place and saved
    with its tokenizer at `out_dir` when one is given."""
    train_ids, heldout_ids = data.encode_pairs(train_rows, tokenizer), data.encode_pairs(heldout_rows, tokenizer)
    # dropout off (chosen and rejected scored by one deterministic network, as in PPO), AdamW on what trains (under
    # LoRA: adapters and head), the engine, seeded epochs of pair batches: ids, attn, resp (2B, L), chosen first
    stage = supervised_stage(rm, train_ids, cfg.rm_epochs, cfg.rm_batch, cfg.rm_lr, seed, data.pair_batch_of_ids,
                             tokenizer.pad_token_id, ds)
    log = []
    for step in (bar := progress(range(stage.steps + 1), "2. reward model", leave=False, disable=stage.rank != 0)):
        if step % cfg.rm_eval_every == 0 or step == stage.steps:   # Fig. 3: held-out accuracy vs step
            rm.eval()
            rc, rr = score_encoded_pairs(rm, heldout_ids, tokenizer.pad_token_id, batch=EVAL_PAIRS)
            log.append({"step": step, "heldout_accuracy": accuracy(rc, rr)})
            bar.set_postfix(acc=f"{log[-1]['heldout_accuracy']:.3f}", refresh=False)
        if step == stage.steps:
            break
        stage.trained.train()
        idx, ids, attn, resp = next(stage.batches)                                  # chosen rows, then rejected
        B = len(idx)
        scores, logits = stage.trained(ids, attn, return_logits=True, score=True)   # (2B,) r(x, y), (2B, L, V)
        loss, stats = reward_model_loss(scores[:B], scores[B:], logits[:B], ids[:B], resp[:B],
                                        lam=1.0, beta_rm=cfg.rm_lm_coef)             # Eq. 2
        engine.set_lr(stage.opt, engine.cosine_lr(step, stage.steps, cfg.rm_lr))
        engine.backward_step(stage.trained, stage.opt, loss, 1.0, "rm", [])
        log[-1].setdefault("train", []).append(engine.all_mean({k: float(v) for k, v in stats.items()}, stage.device))
    engine.release(stage.trained)  # under DeepSpeed: the engine's memory back before the next stage
    rm.eval()
    if out_dir is not None and stage.rank == 0:  # LoRA: out_dir/adapter/ (adapters and head) and the merged model
        lora.save(rm, out_dir, tokenizer)
    return log


if __name__ == "__main__":
    torch.set_printoptions(precision=6)
    # 1. Bradley–Terry (Eq. 1): the textbook exercise r_w = 3.2, r_l = 1.5.
    r_w, r_l = torch.tensor([3.2]), torch.tensor([1.5])
    loss, stats = bradley_terry_loss(r_w, r_l)
    print(f"P(y_w ≻ y_l) = σ(3.2 − 1.5) = {torch.sigmoid(r_w - r_l).item():.6f}   loss = {loss.item():.6f}")
    # P(y_w ≻ y_l) = σ(3.2 − 1.5) = 0.845535   loss = 0.167786
    loss, stats = bradley_terry_loss(torch.zeros(4), torch.zeros(4))
    print(f"equal rewards: loss = {loss.item():.6f} = log 2 = {math.log(2):.6f}, accuracy = {stats['accuracy']}")
    # equal rewards: loss = 0.693147 = log 2 = 0.693147, accuracy = 0.5
    loss, stats = bradley_terry_loss(torch.tensor([1.0, 0.0, 2.0, 1000.0]), torch.tensor([0.0, 0.0, 3.0, -1000.0]))
    print(f"batch: loss = {loss.item():.6f}, accuracy = {stats['accuracy']}, margin = {stats['margin']:.2f}")
    # batch: loss = 0.579918, accuracy = 0.625, margin = 500.00   (ties count ½; margin 2000 is no trouble)

    # 2. A tiny random Llama with a scalar head scores a left- and a right-padded batch identically.
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = ScalarHeadModel(LlamaForCausalLM(config)).double().eval()
    seqs = [[5, 9, 11, 3, 7], [8, 2, 4]]
    L, pad = max(map(len, seqs)), 0
    right = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])
    left = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    right_mask, left_mask = (right != pad).long(), (left != pad).long()
    with torch.no_grad():
        print("last real token:", last_token_index(right_mask).tolist(), last_token_index(left_mask).tolist())
        print("right-padded scores:", model.score(right, right_mask))
        print("left-padded scores: ", model.score(left, left_mask))
        print("one at a time:      ", torch.cat([model.score(torch.tensor([s]), torch.ones(1, len(s))) for s in seqs]))
    # last real token: [4, 2] [4, 4]
    # right-padded scores: tensor([0.316286, 1.117633], dtype=torch.float64)
    # left-padded scores:  tensor([0.316286, 1.117633], dtype=torch.float64)
    # one at a time:       tensor([0.316286, 1.117633], dtype=torch.float64)
