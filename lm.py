"""The causal LM as every stage sets it up: dropout off for good, and gradient checkpointing by either of
transformers' names. SFT, the reward model, the critic and PPO all call these; none of them needs the PPO recipe
to do so. (Position ids from the attention mask are data.py's, with the padding they undo.)

Implements (no equation: what the equations' token bookkeeping relies on):
    disable_dropout(model, keep)            → every dropout probability 0, so ρ = 1 on the first minibatch
    gradient_checkpointing(model)           → activations recomputed in backward (the paper trains with it)

Run: python -m pytest tests/test_architectures.py -q     (the invariants on five architectures)
"""
from __future__ import annotations

import torch


def disable_dropout(model: torch.nn.Module, keep: str | None = None) -> torch.nn.Module:
    """Dropout off for good, in train() mode too (which gradient checkpointing needs): every nn.Dropout gets p = 0,
    and so does every float attribute or config field named like a dropout probability. The ratio ρ compares the
    same network at the same weights, so with dropout on it is not 1 on the first minibatch (GPT-2's default 0.1:
    about 1.02), and the log-probs of rollout, experience and update would each see another random network.
    `keep`: modules whose name contains it keep their dropout (SFT and the reward model keep --lora-dropout)."""
    for path, module in model.named_modules():
        if keep and keep in path:
            continue
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
                setattr(module, name, 0.0)      # e.g. LlamaAttention.attention_dropout, read inside forward()
    config = getattr(model, "config", None)
    for name, value in (list(vars(config).items()) if config is not None else []):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)          # what the saved config.json says, too
    return model


def gradient_checkpointing(model) -> None:
    """Recompute the model's activations in backward. transformers ≥ 5.x renamed `gradient_checkpointing_enable`
    `activation_checkpointing_enable`; use that name where it exists."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
