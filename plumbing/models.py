"""The causal LM as every stage sets it up: dropout off for good, and gradient checkpointing by either of
transformers' names. SFT, the reward model, the critic and PPO all call these; none of them needs the PPO recipe
to do so. (Position ids from the attention mask are plumbing/data.py's, with the padding they undo.)

Implements (no equation: what the equations' token bookkeeping relies on):
    disable_dropout(model, keep)            → every dropout, LayerDrop and MoE-router jitter probability 0, so
                                              ρ = 1 on the first minibatch
    gradient_checkpointing(model)           → activations recomputed in backward (the paper trains with it)
    causal_lm_class(path)                   → what loads a causal-LM directory: AutoModelForCausalLM, or the class
                                              its config.json names where the Auto mapping lacks the saved config

Run: python -m pytest tests/test_architectures.py -q     (the invariants on five architectures)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch


# The other randomness transformers' causal LMs draw in train() mode only: LayerDrop skips whole layers (OPT, BART,
# Whisper, ...: `layerdrop`, `decoder_layerdrop`), and MoE routers multiply their input by uniform noise (Mixtral,
# MiniMax: `jitter_noise`; PhiMoE: `input_jitter_noise`; DBRX: `moe_jitter_eps`). PhiMoE's `router_jitter_noise` is
# not among them: its SparseMixer router reads it in eval mode too, as part of the function.
TRAINING_NOISE = ("layerdrop", "jitter_noise", "input_jitter_noise", "moe_jitter_eps")


def is_noise(name: str, value) -> bool:
    """A float attribute that is a probability or amplitude of train-mode randomness."""
    return isinstance(value, float) and not isinstance(value, bool) and (
        "dropout" in name or name.endswith(("pdrop", "_layerdrop")) or name in TRAINING_NOISE)


def disable_dropout(model: torch.nn.Module, keep: str | None = None) -> torch.nn.Module:
    """Dropout off for good, in train() mode too (which gradient checkpointing needs): every nn.Dropout gets p = 0,
    and so does every float attribute or config field named like a dropout probability, a LayerDrop probability or
    an MoE router's jitter (TRAINING_NOISE). The ratio ρ compares the same network at the same weights, so with
    dropout on it is not 1 on the first minibatch (GPT-2's default 0.1: about 1.02), and the log-probs of rollout,
    experience and update would each see another random network.
    `keep`: modules whose name contains it keep their dropout (SFT and the reward model keep --lora-dropout)."""
    for path, module in model.named_modules():
        if keep and keep in path:
            continue
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if is_noise(name, value):
                setattr(module, name, 0.0)      # e.g. LlamaAttention.attention_dropout, read inside forward()
    config = getattr(model, "config", None)
    for name, value in (list(vars(config).items()) if config is not None else []):
        if is_noise(name, value):
            setattr(config, name, 0.0)          # what the saved config.json says, too
    return model


def gradient_checkpointing(model) -> None:
    """Recompute the model's activations in backward. transformers ≥ 5.x renamed `gradient_checkpointing_enable`
    `activation_checkpointing_enable`; use that name where it exists."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def causal_lm_class(path):
    """The class whose from_pretrained loads the causal LM saved in `path`: AutoModelForCausalLM, or, where the Auto
    mapping does not know the saved config's type, the transformers class its config.json's `architectures` names.
    Mllama and Emu3 need it: AutoModelForCausalLM builds MllamaForCausalLM from an `mllama` config, and what that
    saves (an `mllama_text_model` config) AutoModelForCausalLM cannot load back. Only transformers' own classes:
    never remote code."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    named = [getattr(transformers, name, None) for name in (config.architectures or [])]
    return next((cls for cls in named if isinstance(cls, type)), transformers.AutoModelForCausalLM)


def check_causal(model, path) -> None:
    """UserError unless `model` is causal: its logits at positions 0 … L−2 must not move when the last token
    changes. A BERT-style model saved without is_decoder=True loads as a *ForCausalLM with bidirectional attention, and would
    train and score on tokens it has not yet seen; an encoder-decoder has no such forward at all."""
    from plumbing.cli import UserError
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(1, 9, device=model.device)[None] % vocab                          # (1, 8)
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % vocab
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a, b = (model(input_ids=x).logits[0, :-1].float() for x in (ids, other))  # (7, V)
    except Exception as e:  # not a decoder's forward (T5 wants decoder inputs, ...): not a model the stages can train
        raise UserError(f"{path}: not a causal LM ({type(model).__name__}: {str(e).splitlines()[0]})") from None
    finally:
        model.train(was_training)
    # a causal model's earlier logits agree to rounding (MoE layers, batching tokens per expert, differ by ~3e-7 of
    # the largest logit in float32); a bidirectional one moves them by 6e-4 (random init) to 0.7 (CPM-Ant) of it.
    # In bf16/fp16 (8 and 11 bits of mantissa) rounding alone can reach ~1e-2 (an estimate, not measured here), so
    # only a move past 5 % counts there.
    tol = 1e-5 if next(model.parameters()).dtype == torch.float32 else 0.05
    if not torch.allclose(a, b, atol=tol * float(a.abs().max()) + 1e-6, rtol=0):
        raise UserError(f"{path}: not a causal LM: {type(model).__name__}'s logits at earlier positions depend on "
                        f"later tokens (bidirectional attention; for a BERT-style model set is_decoder=True in "
                        f"its config.json)")


# ---------------------------------------------------------------------------------------------------------------
# The scalar-head model's plumbing (reward_model.ScalarHeadModel): where an architecture's LM head reads its state,
# where a transformers sequence-classification reward model reads its score, and loading either kind of directory
# ---------------------------------------------------------------------------------------------------------------
VALUE_HEAD_WEIGHTS = "value_head.safetensors"
VALUE_HEAD_CONFIG = "value_head.json"


def head_width(lm) -> int:
    """H of the hidden state the backbone hands the LM head, which the value head reads too: the text config's hidden
    size (composite configs such as Gemma 3's keep it in text_config) where the output embeddings read that width or
    are not a Linear; else measured (measured_width), since a head can read another width for either of two
    reasons: OPT-350m's backbone projects its 1024-wide states to 512 before the head, Electra's head transforms its
    64-wide states to 128 itself."""
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # peft.PeftModel → the Hugging Face model
    hidden = hf.config.get_text_config().hidden_size
    width = getattr(hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None, "in_features", None)
    return hidden if not isinstance(width, int) or width == hidden else measured_width(lm) or hidden


def measured_width(lm) -> int | None:
    """The width of the backbone's output on one token (no gradient, eval mode, torch's RNG left where it was);
    None if no backbone runs."""
    caught: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, i=i: caught.__setitem__(
        i, out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])) for i, m in enumerate(backbones(lm))]
    training = lm.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ids = torch.zeros(1, 1, dtype=torch.long, device=lm.device)
            lm.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception:  # noqa: BLE001 - an architecture that cannot run one token alone: the config's width then
        return None
    finally:
        for hook in hooks:
            hook.remove()
        lm.train(training)
    return caught[min(caught)].shape[-1] if caught else None


def backbones(lm) -> list[torch.nn.Module]:
    """The modules whose output the causal LM may hand its LM head, outermost first: its base model
    (LlamaForCausalLM.model, GPT2LMHeadModel.transformer, Gemma3ForConditionalGeneration.model) and its decoder (what
    OPTForCausalLM calls instead, OPTModel.decoder), through a peft wrapper too; none where transformers names none."""
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # peft.PeftModel → the Hugging Face model
    found = [getattr(hf, "base_model", None), hf.get_decoder() if hasattr(hf, "get_decoder") else None]
    return [m for i, m in enumerate(found) if isinstance(m, torch.nn.Module) and m is not hf and m not in found[:i]]


def reward_model_kind(path: str | os.PathLike) -> str | None:
    """"scalar-head" (ours: value_head.safetensors), "sequence-classification" (transformers' format), or None (no
    reward head: a plain causal LM, whose head would be random). Reads file names and config.json only."""
    path = Path(path)
    if (path / VALUE_HEAD_WEIGHTS).is_file():
        return "scalar-head"
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return "sequence-classification" if any(a.endswith("ForSequenceClassification") for a in architectures) else None


def not_a_reward_model(path) -> str:
    return (f"{path}: not a reward model: no {VALUE_HEAD_WEIGHTS} (ScalarHeadModel.save_pretrained) and not an "
            f"AutoModelForSequenceClassification (config.json's architectures); it would get a random head")


class TransformedScoreHead(torch.nn.Sequential):
    """dense → activation → norm → score, per token: (…, H) → (…, 1). The head of a sequence classifier that
    transforms the hidden state before its Linear: ModernBERT-decoder's ModernBertDecoderPredictionHead (dense,
    activation, LayerNorm), then its dropout (0 here, as every dropout) and its `classifier`. The same modules in the
    same order, so the same numbers; `spec` is what value_head.json records to build it again (build_head)."""
    KIND = "dense-activation-norm-linear"

    def __init__(self, hidden: int, activation: str, dense_bias: bool, norm_eps: float, norm_bias: bool):
        from collections import OrderedDict

        from transformers.activations import ACT2FN
        super().__init__(OrderedDict(dense=torch.nn.Linear(hidden, hidden, bias=dense_bias), act=ACT2FN[activation],
                                     norm=torch.nn.LayerNorm(hidden, eps=norm_eps, bias=norm_bias),
                                     score=torch.nn.Linear(hidden, 1)))
        self.in_features = hidden  # the width it reads, as nn.Linear names it
        self.spec = {"kind": self.KIND, "activation": activation, "dense_bias": dense_bias, "norm_eps": norm_eps,
                     "norm_bias": norm_bias}


def build_head(spec: dict, hidden: int, where) -> torch.nn.Module:
    """The head value_head.json's "head" describes (a head that is more than nn.Linear(H, 1)), freshly initialised."""
    if spec.get("kind") == TransformedScoreHead.KIND:
        return TransformedScoreHead(hidden, spec["activation"], spec["dense_bias"], spec["norm_eps"], spec["norm_bias"])
    raise ValueError(f"ScalarHeadModel.from_pretrained: {str(where)!r} names a head of kind {spec.get('kind')!r}; "
                     f"known: nn.Linear (no \"head\" entry) and {TransformedScoreHead.KIND!r}")


def load_scalar_head_model(cls, path: str | os.PathLike, torch_dtype: torch.dtype | None = None,
                    seed: int | None = 0, require_head: bool = False,
                    quantization: dict | None = None) -> torch.nn.Module:
    """Load from a local Hugging Face directory: the LM, and the head from value_head.safetensors.

    A reward model saved by other libraries as AutoModelForSequenceClassification (num_labels = 1) loads with its
    own score head on the same backbone (from_sequence_classification), and score() reads it where transformers does
    (score_index: the last real token that is not config.pad_token_id, so before a final EOS that is also the pad
    id): its scores equal transformers' own forward on each sequence, whatever the padding (tested to 1e-5); a head
    this cannot reproduce is refused. Without either head (a reward model or critic initialised from an
    SFT directory) the head is fresh: N(0, 1/(H+1)) weights, zero bias, drawn with `seed` (None: torch's global
    RNG); with require_head=True (a --reward-model) that is a ValueError instead, never a random head.
    value_head.safetensors holds weight (1, H) and bias (1,) of an nn.Linear(H, 1); a head that is more than that
    (a sequence classifier's, kept by its critic) is named by value_head.json's "head" and built again (build_head).
    `torch_dtype` is passed to transformers as `dtype`, `quantization` (lora.quantization: 8-/4-bit frozen
    weights) as it is; the head takes the LM's dtype and device.
    Only local directories are accepted (no Hub download, no remote code).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"ScalarHeadModel.from_pretrained: {str(path)!r} is not a directory; expected a "
                                f"local Hugging Face model directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"ScalarHeadModel.from_pretrained: no config.json in {str(path)!r}; expected a "
                                f"directory written by save_pretrained()")
    kwargs = {**({} if torch_dtype is None else {"dtype": torch_dtype}), **(quantization or {})}
    head_file = path / VALUE_HEAD_WEIGHTS
    kind = reward_model_kind(path)
    if kind == "sequence-classification":
        return from_sequence_classification(cls, path, kwargs)
    if kind is None and require_head:
        raise ValueError(not_a_reward_model(path))
    lm = causal_lm_class(path).from_pretrained(path, trust_remote_code=False, **kwargs)
    hidden = head_width(lm)
    if not head_file.is_file():
        return cls(lm, head=None, seed=seed)
    state = safetensors.torch.load_file(str(head_file))
    meta_file = path / VALUE_HEAD_CONFIG  # where a sequence-classification RM saved here reads its score; its head
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    head = build_head(meta["head"], hidden, meta_file) if "head" in meta else torch.nn.Linear(hidden, 1)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    if {k: tuple(v.shape) for k, v in state.items()} != expected:
        what = "; ".join(f"{k} {s}" for k, s in expected.items()) if "head" in meta else \
            f"weight (1, {hidden}) and bias (1,)"
        raise ValueError(f"ScalarHeadModel.from_pretrained: {str(head_file)!r} holds "
                         f"{ {k: tuple(v.shape) for k, v in state.items()} }; expected {what} for the model's hidden "
                         f"size {hidden}")
    head.load_state_dict(state)
    return cls(lm, head=head, score_pad_id=meta.get("score_pad_id"))


def from_sequence_classification(cls, path: Path, kwargs: dict) -> torch.nn.Module:
    """An AutoModelForSequenceClassification reward model as a ScalarHeadModel (`cls`): its backbone inside a causal
    LM of the same architecture (the LM head is unused by score() and forward(); Eq. 2 would need one), its score head
    (sequence_classification_head), read where transformers reads it (config.pad_token_id). Checked before it is
    returned: its score of a probe row must be the classifier's own (check_scores_as_transformers)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    seq = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=False, **kwargs)
    if seq.config.num_labels != 1:
        raise ValueError(f"{path}: a sequence-classification model with num_labels = {seq.config.num_labels}; a "
                         f"reward model has one output (num_labels = 1)")
    head = sequence_classification_head(seq, path)
    lm = AutoModelForCausalLM.from_config(seq.config, **kwargs)
    lm.base_model.load_state_dict(seq.base_model.state_dict())
    model = cls(lm.to(seq.dtype), head=head, score_pad_id=seq.config.get_text_config().pad_token_id)
    check_scores_as_transformers(model, seq, path)
    return model


def unsupported_head(path, seq, why: str) -> str:
    return f"{path}: {type(seq).__name__}'s head is not supported as a reward model's: {why}"


def sequence_classification_head(seq, path) -> torch.nn.Module:
    """The score head of a transformers sequence classifier as a module (…, H) → (…, 1) applied per token, in
    float32 (ScalarHeadModel casts it to the LM's dtype): nn.Linear(H, 1) from its Linear `score` / `classifier` /
    `v_head` (bias 0 where it has none), or, where a `head` of dense, activation and norm comes first
    (ModernBERT-decoder), a TransformedScoreHead with those weights too. Anything else: a ValueError naming the
    directory and the class. What it gives is checked against transformers' forward (check_scores_as_transformers)."""
    children = dict(seq.named_children())
    score = next((children[n] for n in ("score", "classifier", "v_head")
                  if isinstance(children.get(n), torch.nn.Linear)), None)
    if score is None:
        raise ValueError(unsupported_head(path, seq, f"no Linear score head (score, classifier or v_head) among its "
                                                     f"modules {', '.join(children)}"))
    hidden = score.in_features
    pre = children.get("head")
    if pre is None:
        head = torch.nn.Linear(hidden, 1)
        final = head
    elif (isinstance(getattr(pre, "dense", None), torch.nn.Linear)
          and isinstance(getattr(pre, "norm", None), torch.nn.LayerNorm)
          and isinstance(getattr(seq.config, "classifier_activation", None), str)):
        head = TransformedScoreHead(hidden, seq.config.classifier_activation, pre.dense.bias is not None, pre.norm.eps,
                                    pre.norm.bias is not None)
        with torch.no_grad():
            head.dense.load_state_dict({k: v.float() for k, v in pre.dense.state_dict().items()})
            head.norm.load_state_dict({k: v.float() for k, v in pre.norm.state_dict().items()})
        final = head.score
    else:
        raise ValueError(unsupported_head(path, seq, f"its score reads `head` ({type(pre).__name__}), which is not a "
                                                     f"dense layer, an activation and a norm"))
    with torch.no_grad():
        final.weight.copy_(score.weight.float())
        final.bias.copy_(score.bias.float() if getattr(score, "bias", None) is not None else torch.zeros(1))
    return head


@torch.no_grad()
def check_scores_as_transformers(model, seq, path) -> None:
    """ValueError (one line: the directory, the class, the two scores) unless model.score of a probe row, one unpadded
    row of 8 ids, equals the sequence classifier's own forward on it: a head or pooling that ScalarHeadModel does not
    reproduce is refused, never scored silently wrong. Tolerance: 1e-3·max(1, |r|) in float32 and float64 (the two
    agree to ~1e-6), 5e-2·max(1, |r|) in half precision. Every module is left in the mode it was in; torch's RNG is
    not touched."""
    vocab = seq.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    modes = [(m, m.training) for m in (*model.modules(), *seq.modules())]
    model.eval()
    seq.eval()
    try:
        theirs = seq(input_ids=ids.to(seq.device)).logits[0, 0].float().item()
        ours = model.score(ids.to(model.lm.device), torch.ones_like(ids, device=model.lm.device))[0].float().item()
    finally:
        for m, training in modes:
            m.training = training
    tol = (1e-3 if seq.dtype in (torch.float32, torch.float64) else 5e-2) * max(1.0, abs(theirs))
    if not abs(ours - theirs) <= tol:
        raise ValueError(unsupported_head(path, seq, f"on a probe row transformers scores {theirs:.6g} and "
                                                     f"ScalarHeadModel {ours:.6g} (a head or pooling it does not "
                                                     f"reproduce)"))
