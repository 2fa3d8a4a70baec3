"""The causal LM as every stage sets it up: dropout off for good, and gradient checkpointing by either of
transformers' names. SFT, the reward model, the critic and PPO all call these; none of them needs the PPO recipe
to do so. (Position ids from the attention mask are data.py's, with the padding they undo.)

Implements (no equation: what the equations' token bookkeeping relies on):
    disable_dropout(model, keep)            → every dropout, LayerDrop and MoE-router jitter probability 0, so
                                              ρ = 1 on the first minibatch
    gradient_checkpointing(model)           → activations recomputed in backward (the paper trains with it)
    causal_lm_class(path)                   → what loads a causal-LM directory: AutoModelForCausalLM, or the class
                                              its config.json names where the Auto mapping lacks the saved config

Run: python -m pytest tests/test_architectures.py -q     (the invariants on five architectures)
"""
from __future__ import annotations

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
    from cli import UserError
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
