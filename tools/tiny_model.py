"""A small random-init Hugging Face model of a real architecture, with its own tokenizer: a stand-in for a real
checkpoint, so every stage of `train.py --model DIR` can run on a CPU with nothing downloaded.

Implements (no equation: the real-model path's test bed):
    STYLES                                   → how each family's tokenizer marks text: BOS or none, which EOS, a pad
                                               token or none (then EOS pads), a chat template or none
    build_tokenizer(style, texts, out_dir)   → a byte-level BPE trained on `texts` with that family's special tokens
    build_model(arch, tokenizer, out_dir, ..)→ LLaMA, Qwen2, Mistral, GPT-2 or GPT-NeoX (Pythia) config and weights,
                                               saved with the tokenizer as one from_pretrained-ready directory

Run: python tools/tiny_model.py --arch qwen2 --out models/tiny-qwen2      (trains its tokenizer on the HH-RLHF sample)
     python train.py --model models/tiny-qwen2 --data data/hh-rlhf/harmless-base-test.dev.jsonl.gz --skip-bad

The tokenizers differ where real ones do, since that is what breaks real-model code: GPT-2 and Pythia have no pad
token and their EOS doubles as BOS; Qwen2 has no BOS and ends a chat turn with <|im_end|>, which is not its EOS;
Mistral wraps turns in [INST] … [/INST]. GPT-2 keeps its default dropout of 0.1, which PPO must turn off.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
INST = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% else %}{{ m['content'] + '\n' }}"
        "{% endif %}{% endfor %}")

# special tokens of each family: bos / eos / pad / unk (None: the family has none), and its chat template
STYLES = {
    "llama": dict(bos="<s>", eos="</s>", pad=None, unk="<unk>", template=None),
    "mistral": dict(bos="<s>", eos="</s>", pad=None, unk="<unk>", template=INST),
    "qwen2": dict(bos=None, eos="<|endoftext|>", pad="<|endoftext|>", unk=None, template=CHATML,
                  extra=["<|im_start|>", "<|im_end|>"]),
    "gpt2": dict(bos="<|endoftext|>", eos="<|endoftext|>", pad=None, unk="<|endoftext|>", template=None),
    "gpt_neox": dict(bos="<|endoftext|>", eos="<|endoftext|>", pad=None, unk="<|endoftext|>", template=None),
}
ARCHS = list(STYLES)


def build_tokenizer(style: str, texts: list[str], out_dir: str | Path, vocab_size: int = 512):
    """A byte-level BPE with `style`'s special tokens (STYLES), trained on `texts`, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    s = STYLES[style]
    specials = list(dict.fromkeys(t for t in (s["pad"], s["bos"], s["eos"], s["unk"], *s.get("extra", [])) if t))
    tok = Tokenizer(models.BPE(unk_token=s["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=s["bos"], eos_token=s["eos"], pad_token=s["pad"],
                                   unk_token=s["unk"], additional_special_tokens=s.get("extra", []))
    if s["template"]:
        fast.chat_template = s["template"]
    fast.save_pretrained(str(out_dir))
    return fast


def model_config(arch: str, tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, max_positions: int = 512):
    import transformers
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if arch == "gpt2":  # learned absolute positions; dropout 0.1 (resid, embd, attn) by default
        return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **ids)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                          intermediate_size=4 * hidden, max_position_embeddings=max_positions, **ids)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_positions, tie_word_embeddings=False,
               **ids)


def build_model(arch: str, texts: list[str], out_dir: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4,
                vocab_size: int = 512, seed: int = 0, max_positions: int = 512) -> Path:
    """`arch`'s tokenizer trained on `texts` and a random-init model of it, saved together in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(arch, texts, out_dir, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(arch, tokenizer, hidden, layers, heads, max_positions))
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    from plumbing import cli
    from plumbing import data
    p = cli.OneLineParser(prog="tools/tiny_model.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--arch", choices=ARCHS, default="llama", help="the architecture and its tokenizer's conventions")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--data", default="data/hh-rlhf/harmless-base-test.dev.jsonl.gz",
                   help="text to train the tokenizer on: pairs or SFT records (.jsonl[.gz])")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary")
    a = p.parse_args(argv)
    for flag, v in (("--hidden", a.hidden), ("--layers", a.layers), ("--heads", a.heads), ("--vocab-size", a.vocab_size)):
        if v < 1:
            cli.fail(f"{flag} {v}: must be ≥ 1")
    if a.hidden % a.heads:
        cli.fail(f"--hidden {a.hidden}: must be divisible by --heads {a.heads}")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        cli.fail(f"--out {a.out}: exists and is not a directory")
    report = data.DataReport()
    texts = [p + r for p, r in data.load_texts(a.data, skip_bad=True, report=report)]
    if report.skipped:  # the HH sample has a few unusable lines; the tokenizer only needs text
        print(f"[data] {a.data}: {report.summary()}")
    out = build_model(a.arch, texts, a.out, a.hidden, a.layers, a.heads, a.vocab_size)
    from transformers import AutoModelForCausalLM
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"{out}: a random-init {a.arch} of {n / 1e6:.2f} M parameters with its own tokenizer (trained on {a.data})")


if __name__ == "__main__":
    from plumbing import cli
    cli.cli_guard(main)()
