"""Stage 1, supervised fine-tuning: next-token NLL on the demonstrations' responses, the prompt as context.

Implements (the SFT model is π_SFT of the paper: the policy's initialisation and the frozen reference of Eq. 19):
    SFTConfig                           → the stage's flags (`--sft-*`); the tiny LLaMA's size
    train_sft(model, tokenizer, rows, cfg, seed, ds=)
                                        → −Σ_t log π(y_t | x, y_<t) over response tokens (the ptx loss of Eq. 17 on
                                          demonstrations), AdamW with cosine decay, global gradient clip 1.0,
                                          dropout off (as in every stage)
    tiny_llama(vocab_size, cfg)         → the synthetic world's LLaMA-architecture model (transformers.LlamaConfig)
    pretrained_model(base, cfg, seed)   → Fig. 8's "pretrained, not SFT" policy: the same LM on prompt-less responses

Run: python train.py --rebuild-base      (stage 1 runs again, even when the base is cached)

The same function trains the tiny world's model on the CPU and a real Hugging Face model under DeepSpeed: `ds` is
the engine config (engine.engine_config), or None for a plain AdamW in one process.

References: Ouyang et al. 2022 (InstructGPT), section 3.5 "Supervised fine-tuning"; Zheng et al. 2023, §3 and §5.3.3.
"""
from __future__ import annotations

import shutil
from pathlib import Path


from plumbing import data, engine, lora
from plumbing.checkpoint import seed_everything
from plumbing.config import SFTConfig
from plumbing.engine import supervised_stage
from plumbing.monitor import progress
from ppo_loss import ptx_loss


def tiny_llama_config(vocab_size: int, cfg: SFTConfig):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.sft_hidden, intermediate_size=4 * cfg.sft_hidden,
                       num_hidden_layers=cfg.sft_layers, num_attention_heads=cfg.sft_heads,
                       num_key_value_heads=cfg.sft_heads, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def tiny_llama(vocab_size: int, cfg: SFTConfig):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(tiny_llama_config(vocab_size, cfg))


def train_sft(model, tokenizer, rows: list[tuple[str, str]], cfg: SFTConfig, seed: int, desc: str = "1. SFT",
              ds: dict | None = None, out_dir: str | Path | None = None) -> list[float]:
    """Stage 1 on (prompt, response) rows: cfg.sft_epochs epochs of batches of cfg.sft_batch, the NLL of the
    response tokens only (prompt tokens are context, not targets). Returns the per-step losses; the model is
    trained in place (under DeepSpeed: through an engine whose module is `model`), left in eval mode, and saved
    with its tokenizer as a Hugging Face directory at `out_dir` when one is given. A model with LoRA adapters
    (lora.add_adapters) trains only them, and out_dir gets them in adapter/ and the merged model beside."""
    encoded = data.encode_rows(rows, tokenizer)  # every row encoded once: (query ids, response ids)
    stage = supervised_stage(model, encoded, cfg.sft_epochs, cfg.sft_batch, cfg.sft_lr, seed, data.lm_batch_of_ids,
                             tokenizer.pad_token_id, ds)  # dropout off, AdamW, the engine, seeded epochs of batches
    losses = []
    stage.trained.train()
    bar = progress(range(stage.steps), desc, leave=False, disable=stage.rank != 0)
    for step, (_, ids, attn, resp_mask) in zip(bar, stage.batches):                  # (B, L) each
        # no KV cache to build while training (xLSTM's updates its states in place, which backward cannot use)
        logits = stage.trained(input_ids=ids, attention_mask=attn, use_cache=False).logits   # (B, L, V)
        loss, _ = ptx_loss(logits, ids, resp_mask)                                       # NLL of the response tokens
        engine.set_lr(stage.opt, engine.cosine_lr(step, stage.steps, cfg.sft_lr))
        engine.backward_step(stage.trained, stage.opt, loss, 1.0, "sft", [])
        losses.append(engine.all_mean({"loss": loss.item()}, stage.device)["loss"])
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # drawn with the bar (monitor.progress)
    engine.release(stage.trained)  # under DeepSpeed: the engine's memory back before the next stage
    model.eval()
    if out_dir is not None and stage.rank == 0:  # LoRA: out_dir/adapter/ and the merged model in out_dir
        lora.save(model, out_dir, tokenizer)
    return losses


def pretrained_model(base: Path, cfg: SFTConfig, seed: int) -> Path:
    """The "pretrained, not SFT" policy of Fig. 8: the same LM trained, as long as SFT, on the synthetic world's
    pretraining text (base/data/pretrain.jsonl: responses with their prompts dropped), so it speaks the responses'
    language but has never seen the instruction format. Built on first use and cached in the base directory."""
    from transformers import AutoTokenizer

    out = base / "pretrained"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(base / "tokenizer")
    seed_everything(seed + 1)
    pre = tiny_llama(len(tokenizer), cfg)
    rows = [("", r["text"]) for r in data.read_records(base / "data" / "pretrain.jsonl")]
    tmp = Path(str(out) + ".tmp")
    train_sft(pre, tokenizer, rows, cfg, seed + 1, "1b. pretrained (no SFT)", out_dir=tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
