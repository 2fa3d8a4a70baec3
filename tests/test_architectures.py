"""Token bookkeeping as invariants, on tiny random-init models of the families tools/tiny_model.py builds (LLaMA,
Qwen2, Mistral, GPT-2, GPT-NeoX/Pythia) and of a fixed sample of five more from the sweep of every causal LM
(tools/architectures.py, docs/architectures.md): OPT (a learned position table offset by 2, LayerDrop), BLOOM (ALiBi:
no positions, a bias built from the mask), Phi (rotary on half of each head, attention and MLP in parallel), Gemma 2
(√H-scaled embeddings, soft-capped logits, a sliding window of 4 on every other layer) and Mixtral (4 experts, 2 per
token, router jitter). Each is built here with dropout (and LayerDrop, router jitter) on where its config has it:

    dropout off          the log-probs the update computes (train mode) equal the rollout's: ρ = 1 on the first minibatch
    temperature          the stored log-probs are log-softmax(logits / T): those of π^(1/T), the sampled distribution
    position ids         a left-padded batch gives each sequence the log-probs it has alone (learned positions too)
    padding by the mask  the pad id is the EOS id (as GPT-2 / Pythia tokenizers do) and the EOS still ends and scores
    reward               r(x, y) is the head's value at the last real token, found by a loop over the mask

and one PPO step of each of the five through train.main, from the same small config the sweep builds.
"""
import copy
import json

import pytest
import torch
import transformers
from torch.testing import assert_close

from plumbing import data
from plumbing import models as lm
import ppo_max
from ppo_loss import logprobs_from_logits
from reward_model import ScalarHeadModel
import plumbing.config
import plumbing.run

V, EOS, BOS = 64, 2, 1


def config(arch: str):
    """A 2-layer, 32-wide model of `arch` whose dropout probabilities (where it has any) are 0.1."""
    common = dict(vocab_size=V, bos_token_id=BOS, eos_token_id=EOS)
    if arch == "gpt2":   # learned absolute positions; resid/embd/attn dropout 0.1 by default
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.1,
                                          attention_dropout=0.1, **common)
    if arch == "opt":    # positions looked up at cumsum(mask) + 2; LayerDrop skips whole layers in train mode
        return transformers.OPTConfig(hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, dropout=0.1,
                                      attention_dropout=0.1, layerdrop=0.5, **common)
    if arch == "bloom":  # ALiBi: no position ids at all, a per-head linear bias in key distance
        return transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1,
                                        **common)
    if arch == "phi":
        return transformers.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      partial_rotary_factor=0.5, max_position_embeddings=64, resid_pdrop=0.1,
                                      embd_pdrop=0.1, attention_dropout=0.1, **common)
    if arch == "gemma2":  # layer 0 attends to the last 4 tokens only, layer 1 to all
        return transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         query_pre_attn_scalar=8, sliding_window=4, max_position_embeddings=64,
                                         attention_dropout=0.1, **common)
    if arch == "mixtral":  # the router multiplies its input by U(1 − 0.1, 1 + 0.1) noise in train mode
        return transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2, max_position_embeddings=64, attention_dropout=0.1,
                                          router_jitter_noise=0.1, **common)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, attention_dropout=0.1, **common)


SAMPLE = ["opt", "bloom", "phi", "gemma2", "mixtral"]  # five of docs/architectures.md beyond tiny_model.py's families
ARCHS = ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", *SAMPLE]
PAD = {"llama": 0, "qwen2": 0, "mistral": 0, "gpt2": EOS, "gpt_neox": EOS,  # GPT-2 / Pythia: no pad token, EOS pads
       "opt": 0, "bloom": EOS, "phi": EOS, "gemma2": 0, "mixtral": 0}


def models(arch: str):
    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_config(config(arch))
    critic = ScalarHeadModel(transformers.AutoModelForCausalLM.from_config(config(arch)))
    return policy, copy.deepcopy(policy).eval(), copy.deepcopy(critic).eval(), critic


def prompts(arch: str):
    """Three prompts of different lengths, left-padded with the architecture's pad id: (B, P) ids and mask."""
    g = torch.Generator().manual_seed(1)
    seqs = [[BOS] + torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 2, 8)]
    return data.pad(seqs, PAD[arch], "left")


def experience(arch: str, temperature: float, drop: bool = True):
    policy, ref, reward_model, critic = models(arch)
    if drop:
        for m in (policy, ref, reward_model, critic):
            lm.disable_dropout(m)
    query, query_mask = prompts(arch)
    cfg = ppo_max.PPOConfig(temperature=temperature)
    torch.manual_seed(2)
    policy.eval()
    response, response_mask, _ = ppo_max.rollout(policy, query, query_mask, 10, EOS, PAD[arch], temperature)
    exp = ppo_max.make_experience(policy, ref, reward_model, critic, query, query_mask, response, response_mask,
                                  ppo_max.RunningMoments(), cfg, 0.05)
    return policy, exp, cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_off_ratio_is_one_on_the_first_minibatch(arch):
    policy, exp, cfg = experience(arch, temperature=0.7)
    policy.train()  # the update's mode (gradient checkpointing needs it)
    logprobs = logprobs_from_logits(ppo_max.policy_logits(policy, exp["query"], exp["query_mask"], exp["response"],
                                                          exp["mask"], cfg.temperature), exp["response"])  # (B, T)
    ratio = torch.exp(logprobs - exp["logprobs"]) * exp["mask"]                                           # ρ_t
    assert_close(ratio, exp["mask"], atol=1e-5, rtol=0)


def test_without_disable_dropout_gpt2_ratio_is_not_one():
    """The check above can fail: GPT-2's default dropout 0.1 left on moves ρ away from 1 in train mode."""
    policy, exp, cfg = experience("gpt2", temperature=1.0, drop=False)
    policy.train()
    torch.manual_seed(3)
    logprobs = logprobs_from_logits(ppo_max.policy_logits(policy, exp["query"], exp["query_mask"], exp["response"],
                                                          exp["mask"]), exp["response"])
    assert ((logprobs - exp["logprobs"]).abs() * exp["mask"]).max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_are_those_of_the_tempered_distribution(arch):
    T = 0.7
    policy, exp, _ = experience(arch, temperature=T)
    q, qm, r, m = exp["query"], exp["query_mask"], exp["response"], exp["mask"]
    ids, mask = torch.cat([q, r], 1), torch.cat([qm, m], 1)
    with torch.no_grad():  # independent: one sequence at a time, unpadded, log-softmax of logits / T by hand
        for b in range(len(ids)):
            real = mask[b].bool()
            seq = ids[b][real][None]                                                          # (1, L_b)
            logits = policy(input_ids=seq).logits[0].double() / T                             # (L_b, V)
            logp = logits - torch.logsumexp(logits, -1, keepdim=True)
            P_b, T_b = int(qm[b].sum()), int(m[b].sum())
            want = torch.stack([logp[P_b - 1 + t, seq[0, P_b + t]] for t in range(T_b)])
            assert_close(exp["logprobs"][b, :T_b].double(), want, atol=2e-5, rtol=0)
            untempered = torch.log_softmax(logits * T, -1)[torch.arange(P_b - 1, P_b - 1 + T_b), seq[0, P_b:P_b + T_b]]
            assert (want - untempered).abs().max() > 1e-3  # T ≠ 1 does change them: the check can fail


@pytest.mark.parametrize("arch", ARCHS)
def test_position_ids_follow_the_mask_under_left_padding(arch):
    policy, *_ = models(arch)
    lm.disable_dropout(policy).eval()
    query, query_mask = prompts(arch)
    response = torch.randint(3, V, (3, 4))
    response_mask = torch.ones(3, 4)
    with torch.no_grad():
        batch = ppo_max.policy_logits(policy, query, query_mask, response, response_mask)             # (B, T, V)
        for b in range(3):
            real = query_mask[b].bool()
            alone = ppo_max.policy_logits(policy, query[b][real][None], query_mask[b][real][None], response[b:b + 1],
                                          response_mask[b:b + 1])
            assert_close(batch[b:b + 1], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_ends_and_scores_a_response_even_when_it_is_the_pad_id(arch):
    """The rollout's mask covers each response up to and including its first EOS, whatever the pad id; the reward is
    the head's value at the last real token of prompt + response (found here by a plain loop over the mask)."""
    _, exp, _ = experience(arch, temperature=1.0)
    response, mask = exp["response"], exp["mask"]
    for b in range(len(response)):
        n = int(mask[b].sum())
        eos_at = (response[b] == EOS).nonzero().flatten().tolist()
        assert n == (eos_at[0] + 1 if eos_at else response.shape[1])
        assert mask[b, :n].all() and not mask[b, n:].any()
    _, _, reward_model, _ = models(arch)
    lm.disable_dropout(reward_model)
    ids, attn = torch.cat([exp["query"], response], 1), torch.cat([exp["query_mask"], mask], 1)
    with torch.no_grad():
        scores, values = reward_model.score(ids, attn), reward_model(ids, attn)                     # (B,), (B, L)
    for b in range(len(ids)):
        last = max(i for i in range(ids.shape[1]) if attn[b, i] == 1)
        assert_close(scores[b], values[b, last])


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_and_logprobs_use_one_distribution(arch):
    """What generate() sampled from at T (its processed scores: logits / T, positions from the left-padded mask)
    is, token for token, the distribution whose log-probs make_experience stores."""
    T = 0.7
    policy, exp, _ = experience(arch, temperature=T)
    query, query_mask = prompts(arch)
    torch.manual_seed(2)  # the rollout's seed: the same samples again, now with their scores
    out = policy.generate(input_ids=query, attention_mask=query_mask, do_sample=True, top_k=0, top_p=1.0,
                          temperature=T, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD[arch], use_cache=True,
                          output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores, 1).float()                                                  # (B, T, V)
    mask = exp["mask"].bool()
    assert torch.equal(out.sequences[:, query.shape[1]:][mask], exp["response"][mask])
    sampled = torch.log_softmax(scores, -1).gather(-1, exp["response"][..., None]).squeeze(-1)  # (B, T)
    assert_close(sampled[mask], exp["logprobs"][mask], atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_the_models_generation_config_does_not_change_what_rollout_samples(arch):
    """A checkpoint's generation_config.json (settings rollout passes no argument for: no n-gram repeats, a minimum
    length, typical-p, a forced EOS) would sample from a distribution other than π^(1/T), whose log-probs PPO
    stores; rollout sets them aside, draws what it draws without them, and leaves the model's own as they were."""
    policy, *_ = models(arch)
    lm.disable_dropout(policy).eval()
    query, query_mask = prompts(arch)

    def draw():
        torch.manual_seed(2)
        return ppo_max.rollout(policy, query, query_mask, 24, EOS, PAD[arch], 0.7)[0]

    plain = draw()
    settings = dict(no_repeat_ngram_size=1, min_new_tokens=20, typical_p=0.2, forced_eos_token_id=EOS)
    for name, value in settings.items():
        setattr(policy.generation_config, name, value)
    assert torch.equal(draw(), plain)
    assert {k: getattr(policy.generation_config, k) for k in settings} == settings
    torch.manual_seed(2)  # the check can fail: generate() itself does read them
    kept = policy.generate(input_ids=query, attention_mask=query_mask, do_sample=True, top_k=0, temperature=0.7,
                           max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD[arch])[:, query.shape[1]:]
    assert kept.shape != plain.shape or not torch.equal(kept, plain)


def test_a_model_that_reads_later_tokens_is_not_a_causal_lm():
    """BERT saved without is_decoder=True loads as BertLMHeadModel with bidirectional attention: every stage would
    train it on tokens it has not seen yet. lm.check_causal refuses it; as a decoder, and every family here, pass."""
    from plumbing.cli import UserError
    bert = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    with pytest.raises(UserError, match="bert-dir: not a causal LM: BertLMHeadModel's logits at earlier positions"):
        lm.check_causal(transformers.BertLMHeadModel(transformers.BertConfig(**bert)), "bert-dir")
    lm.check_causal(transformers.BertLMHeadModel(transformers.BertConfig(**bert, is_decoder=True)), "bert-dir")
    for arch in ARCHS:
        lm.check_causal(models(arch)[0], arch)


def test_train_load_models_turns_dropout_off_in_all_four(tmp_path):
    import train
    policy, _, reward_model, _ = models("gpt2")
    policy.save_pretrained(tmp_path / "sft")
    reward_model.save_pretrained(tmp_path / "rm")
    inp = plumbing.run.Inputs(tmp_path / "sft", tmp_path / "sft", tmp_path / "rm", tmp_path / "rm", tokenizer=None, data={})
    m = plumbing.run.load_models(inp, plumbing.config.RunConfig(), ppo_max.PPOConfig(), torch.device("cpu"), ds=None)
    for model in (m.policy, m.ref, m.reward_model, m.critic):
        drops = [x.p for x in model.modules() if isinstance(x, torch.nn.Dropout)]
        assert drops and set(drops) == {0.0}
        lm = model.lm if isinstance(model, ScalarHeadModel) else model
        assert (lm.config.resid_pdrop, lm.config.embd_pdrop, lm.config.attn_pdrop) == (0.0, 0.0, 0.0)


def test_disable_dropout_turns_off_layerdrop_and_router_jitter_but_not_what_eval_mode_reads():
    """LayerDrop (OPT) and router jitter (Mixtral) draw fresh noise in every train-mode forward, so two passes over one
    batch differ until disable_dropout; PhiMoE's router_jitter_noise is read in eval mode too and stays as it is."""
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(0))
    for arch, field in (("opt", "layerdrop"), ("mixtral", "router_jitter_noise")):
        cfg = config(arch)
        for name in ("dropout", "attention_dropout"):
            setattr(cfg, name, 0.0)  # only the noise under test is left on
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).train()
        with torch.no_grad():
            assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits), arch  # the noise is real
            lm.disable_dropout(model)
            assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits), arch
        assert getattr(model.config, field) == (0.0 if field == "layerdrop" else 0.1)
    phimoe = transformers.PhimoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, num_local_experts=4, vocab_size=V, input_jitter_noise=0.1)
    with torch.device("meta"):
        model = lm.disable_dropout(transformers.AutoModelForCausalLM.from_config(phimoe))
    routers = [m for m in model.modules() if hasattr(m, "router_jitter_noise")]
    assert routers and all(m.router_jitter_noise == 0.01 for m in routers)
    inputs = [m.input_jitter_noise for m in model.modules() if hasattr(m, "input_jitter_noise")]
    assert inputs and set(inputs) == {0.0}  # was 0.1


@pytest.mark.parametrize("arch", SAMPLE)
def test_one_ppo_step_of_a_sampled_architecture_through_train_main(arch, tmp_path, monkeypatch):
    """The sweep's path for the five: the small config tools/architectures.py builds, a tokenizer of the family's
    conventions, one rollout minibatch, one PPO epoch: the first update's ρ is 1 and approx_kl 0."""
    import architectures
    import tiny_model
    import train
    from test_real_data import hh_pairs, write_jsonl
    monkeypatch.chdir(tmp_path)
    pairs = hh_pairs(24)
    tokenizer = tiny_model.build_tokenizer(architectures.style(arch), [p["chosen"] + p["rejected"] for p in pairs],
                                           tmp_path / "model", vocab_size=300)
    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_config(architectures.small_config(arch, tokenizer))
    policy.save_pretrained(tmp_path / "model")
    ScalarHeadModel(policy).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p["chosen"][:p["chosen"].rindex("Assistant:") + 10]}
                                                       for p in pairs])
    train.main(["--model", str(tmp_path / "model"), "--reward-model", str(tmp_path / "rm"), "--prompts", str(prompts),
                "--out", "run", "--steps", "1", "--rollout-batch", "4", "--minibatch", "4", "--ppo-epochs", "1",
                "--max-new-tokens", "6", "--max-prompt-tokens", "32", "--critic-pretrain-steps", "1",
                "--eval-samples", "1", "--heldout-frac", "0.1", "--threads", "1"])
    (m,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["ppo/ratio"] == pytest.approx(1.0, abs=1e-6) and m["ppo/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["ppo/clipfrac"] == 0.0


def head_input_configs():
    """Models whose LM head does not read hidden_states[-1], or not at config.hidden_size, or not at the width of its
    output embeddings: OPT projecting 32 → 16 before its head, Gemma 3n whose last recorded hidden state is its 4
    AltUp streams (4, B, L, H), Gemma 3 with its vision tower, whose config keeps hidden_size in text_config; and two
    whose head transforms the backbone's state before its output embeddings: RemBERT (32 → 48) and Electra
    (32 → 48)."""
    common = dict(vocab_size=V, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8, **common)
    encoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, is_decoder=True,
                   **common)
    return {
        "opt-projected": transformers.OPTConfig(hidden_size=32, word_embed_proj_dim=16, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, **common),
        "gemma3n-altup": transformers.Gemma3nTextConfig(**text, vocab_size_per_layer_input=V,
                                                        hidden_size_per_layer_input=8, num_kv_shared_layers=0,
                                                        laurel_rank=4, activation_sparsity_pattern=[0.0, 0.0]),
        "gemma3-composite": transformers.Gemma3Config(
            text_config=dict(text, query_pre_attn_scalar=8), vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                patch_size=14), mm_tokens_per_image=4),
        "rembert-transformed": transformers.RemBertConfig(**encoder, input_embedding_size=16, output_embedding_size=48),
        "electra-transformed": transformers.ElectraConfig(**encoder, embedding_size=48),
    }


@pytest.mark.parametrize("name", ["opt-projected", "gemma3n-altup", "gemma3-composite", "rembert-transformed",
                                  "electra-transformed"])
def test_value_head_reads_what_the_backbone_hands_the_lm_head(name):
    """V(s_t) = w·h_t + b with h_t what the backbone hands the LM head: where the head is one Linear, its very input
    (caught by a hook on it); where the head transforms first, the backbone's own output (called directly). So the
    value head has that width and reads the final, normed, merged state, whatever hidden_states[-1] holds."""
    torch.manual_seed(0)
    model = ScalarHeadModel(transformers.AutoModelForCausalLM.from_config(head_input_configs()[name])).eval()
    query, query_mask = prompts("llama")
    read, out = [], model.lm.get_output_embeddings()
    hook = out.register_forward_pre_hook(lambda m, args: read.append(args[0]))
    with torch.no_grad():
        values, _ = model(query, query_mask, return_logits=True)                             # (B, L), (B, L, V)
        if name.endswith("transformed"):  # the head's input is its transform's output: not what the value head reads
            assert read[0].shape[-1] == 48 and model.head.in_features == 32
            read = [model.lm.base_model(input_ids=query, attention_mask=query_mask,
                                        position_ids=data.position_ids_from_mask(query_mask)).last_hidden_state]
    hook.remove()
    h = read[-1]                                                                             # (B, L, H)
    assert h.shape == (*query.shape, model.head.in_features)
    assert_close(values, model.head(h).squeeze(-1), atol=1e-6, rtol=0)


def test_causal_lm_class_loads_what_automodel_cannot_load_back(tmp_path):
    """AutoModelForCausalLM builds MllamaForCausalLM from an `mllama` config, saves an `mllama_text_model` config, and
    cannot load that back; lm.causal_lm_class names the class that can (config.json's architectures)."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1], bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)
    cfg = transformers.MllamaConfig(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64,
                                                                          num_hidden_layers=1, num_global_layers=1,
                                                                          attention_heads=4, image_size=28,
                                                                          patch_size=14))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mllama")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mllama")
    assert lm.causal_lm_class(tmp_path / "mllama") is transformers.MllamaForCausalLM
    lm.causal_lm_class(tmp_path / "mllama").from_pretrained(tmp_path / "mllama")
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(tmp_path / "llama")
    assert lm.causal_lm_class(tmp_path / "llama") is transformers.AutoModelForCausalLM
