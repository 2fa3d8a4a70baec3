"""A real Hugging Face model through every stage: `train.py --model DIR --data PAIRS` runs SFT, the reward model
(Eq. 2), critic pre-training and PPO-max on tiny random-init LLaMA, Qwen2, Mistral, GPT-2 and GPT-NeoX models, each
with its own tokenizer (tools/tiny_model.py: no pad token, EOS as BOS, no BOS, a chat template whose end of turn is not
the EOS). Plus: --stages, restarts that reuse finished stages, --bf16 on the CPU, the HH sample's ptx rows on a
128-position learned table, the evaluation scoring the sampled ids, and the clear errors for a wrong directory or a
mismatched tokenizer. (Sequence-classification reward models against transformers: tests/test_reward_model.py.)"""
import json
from pathlib import Path

import pytest
import torch

from plumbing import data
import tiny_model
import train
from reward_model import ScalarHeadModel
from test_real_data import hh_pairs, write_jsonl
import plumbing.flags

BUDGET = ["--steps", "1", "--sft-epochs", "1", "--sft-batch", "8", "--rm-epochs", "1", "--rm-batch", "8",
          "--rm-eval-every", "4", "--max-prompt-tokens", "48", "--max-response-tokens", "40", "--rollout-batch", "8",
          "--minibatch", "8", "--ppo-epochs", "1", "--ptx-batch", "4", "--max-new-tokens", "8",
          "--critic-pretrain-steps", "1", "--eval-samples", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", hh_pairs(96))


def tiny(arch: str, root: Path, pairs: Path) -> Path:
    texts = [p + r for p, r in data.load_texts(pairs)]
    return tiny_model.build_model(arch, texts, root / f"model-{arch}", hidden=32, layers=2, heads=4, vocab_size=300)


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_model.ARCHS)
def test_all_four_stages_on_a_real_architecture(arch, tmp_path, pairs, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tiny(arch, tmp_path, pairs)
    out = tmp_path / "run"
    summary = train.main(["--model", str(model), "--data", str(pairs), "--out", str(out), *BUDGET])
    for stage in ("sft", "reward_model"):
        assert (out / stage / "DONE").exists() and (out / stage / "config.json").exists()
    assert (out / "reward_model" / "value_head.safetensors").exists()
    assert 0.0 <= summary["rm"]["accuracy"] <= 1.0 and summary["models"]["sft"] == str(out / "sft")
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # one epoch over one minibatch: the update's first (and only) ratio is exactly 1, so nothing is clipped
    assert m["ppo/ratio"] == pytest.approx(1.0, abs=1e-5) and m["ppo/clipfrac"] == 0.0
    assert set(summary["timings"]) >= {"sft", "reward_model", "critic_pretrain", "ppo", "eval"}
    # a second start (told to replace the finished run) reuses the finished stages instead of training them again
    stamp = (out / "sft" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    train.main(["--model", str(model), "--data", str(pairs), "--out", str(out), "--overwrite", *BUDGET])
    printed = capsys.readouterr().out
    assert f"[stage] reusing {out / 'sft'}" in printed and f"[stage] reusing {out / 'reward_model'}" in printed
    assert (out / "sft" / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_stages_sft_rm_trains_only_a_reward_model(tmp_path, pairs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tiny("qwen2", tmp_path, pairs)
    result = train.main(["--model", str(model), "--data", str(pairs), "--out", "run", "--stages", "sft,rm", *BUDGET])
    assert result["reward_model"] == str(Path("run") / "reward_model") and 0 <= result["rm_heldout_accuracy"] <= 1
    assert not (tmp_path / "run" / "policy").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    rm = ScalarHeadModel.from_pretrained(tmp_path / "run" / "reward_model", require_head=True)
    assert rm.config.model_type == "qwen2"


@pytest.mark.slow
def test_bf16_on_the_cpu_runs_every_stage(tmp_path, pairs, monkeypatch):
    """--bf16 loads every model in bf16 on the CPU, so a dtype mismatch between them shows up here, not on a GPU."""
    monkeypatch.chdir(tmp_path)
    model = tiny("llama", tmp_path, pairs)
    summary = train.main(["--model", str(model), "--data", str(pairs), "--out", "run", "--bf16", *BUDGET])
    assert summary["final"]["kl"] == summary["final"]["kl"]  # finite, not NaN
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").dtype == torch.bfloat16


def test_wrong_kind_of_reward_model_directory_fails_clearly(tmp_path, pairs, capsys):
    model = tiny("gpt2", tmp_path, pairs)  # a causal LM: no value head, not a sequence classifier
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(model), "--reward-model", str(model), "--prompts", str(pairs), "--out",
                    str(tmp_path / "run"), "--stages", "ppo", *BUDGET])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a reward model" in err[0] and "value_head.safetensors" in err[0]


def test_policy_and_reward_model_must_share_a_tokenizer(tmp_path, pairs, capsys):
    policy = tiny("gpt2", tmp_path, pairs)
    other = tiny_model.build_model("llama", ["completely different text"] * 20, tmp_path / "other", hidden=32,
                                   vocab_size=300)
    ScalarHeadModel.from_pretrained(other).save_pretrained(tmp_path / "other-rm")
    data.load_tokenizer(other).save_pretrained(tmp_path / "other-rm")
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(policy), "--reward-model", str(tmp_path / "other-rm"), "--prompts", str(pairs),
                    "--out", str(tmp_path / "run"), "--stages", "ppo", *BUDGET])
    assert e.value.code == 2
    assert "share one tokenizer" in capsys.readouterr().err


def test_eval_refuses_a_reward_model_without_a_trained_head(tmp_path, pairs):
    """`python eval.py --policy M --sft M --reward-model M --prompts P` with a plain causal LM M (GPT-2: its tokenizer
    has no pad token) is one line and exit 2 before any model loads: M's head would be random."""
    import subprocess
    import sys
    from transformers import AutoTokenizer
    model = tiny("gpt2", tmp_path, pairs)
    assert AutoTokenizer.from_pretrained(model).pad_token is None
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.prompt} for p in data.load_pairs(pairs)[:4]])
    proc = subprocess.run([sys.executable, str(Path(tiny_model.ROOT) / "eval.py"), "--policy", str(model), "--sft",
                           str(model), "--reward-model", str(model), "--prompts", str(prompts)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-1500:])
    assert len(lines) == 1 and lines[0].startswith("error: --reward-model ") and "not a reward model" in lines[0], lines
    assert "--random-head" in lines[0] and proc.stdout == ""


def test_eval_runs_with_a_trained_reward_model_and_a_tokenizer_without_pad(tmp_path, pairs, capsys):
    """The same plain GPT-2 as policy and SFT, with a reward-model directory that has a trained head
    (value_head.safetensors): eval.py samples (pad = EOS, as train.py loads the tokenizer) and prints its table,
    judged by the reward model (real prompts have no gold); a random head only with --random-head, and then the
    reward column differs."""
    import eval as evaluation
    model = tiny("gpt2", tmp_path, pairs)
    ScalarHeadModel.from_pretrained(model, seed=3).save_pretrained(tmp_path / "rm")
    data.load_tokenizer(model).save_pretrained(tmp_path / "rm")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.prompt} for p in data.load_pairs(pairs)[:4]])
    argv = ["--policy", str(model), "--sft", str(model), "--prompts", str(prompts), "--samples", "1",
            "--max-new-tokens", "4"]
    capsys.readouterr()
    evaluation.main(argv + ["--reward-model", str(tmp_path / "rm")])
    trained = capsys.readouterr().out
    # real prompts have no gold: the reward model judges; the policy is the SFT model, so every sample ties
    assert "win rate vs SFT (judge: reward model): win 0.00  tie 1.00  lose 0.00" in trained, trained
    assert trained.splitlines()[0].startswith("held-out prompts, 1 sample(s) each at top-p 0.9, temperature 0.8")
    sft_row = lambda out: next(line for line in out.splitlines() if line.startswith("sft"))  # noqa: E731
    evaluation.main(argv + ["--reward-model", str(model), "--random-head"])
    random_head = capsys.readouterr().out
    assert "win rate vs SFT" in random_head and sft_row(random_head) != sft_row(trained)


def test_chat_messages_pairs_read_like_transcripts(tmp_path):
    """Today's preference sets: {"chosen": [messages], "rejected": [messages]}, the same pair as the transcript."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How do I cook rice?"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"chosen": conv + [{"role": "assistant", "content": "Rinse, boil."}],
                                              "rejected": conv + [{"role": "assistant", "content": "No."}]}])
    (pair,) = data.load_pairs(path)
    assert pair.prompt == "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: How do I cook rice?\n\nAssistant:"
    assert (pair.chosen, pair.rejected) == (" Rinse, boil.", " No.")
    assert data.hh_to_messages(pair.prompt) == conv
    bad = write_jsonl(tmp_path / "b.jsonl", [{"chosen": conv + [{"role": "assistant", "content": "A"}],
                                              "rejected": conv[:1] + [{"role": "assistant", "content": "B"}]}])
    with pytest.raises(data.DataError) as info:
        data.load_pairs(bad)
    assert info.value.reason == "prompt_mismatch" and info.value.line == 1


def test_chat_template_ends_a_response_with_its_end_of_turn_token(tmp_path):
    tok = tiny_model.build_tokenizer("qwen2", ["hello there, how are you"] * 10, tmp_path / "q", 300)
    stop = data.stop_id(tok)
    assert stop == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    assert data.response_ids(" Fine.", tok)[-1] == stop
    q = tok.decode(data.query_ids("\n\nHuman: hi\n\nAssistant:", tok))
    assert q == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_with_more_ids_than_the_embedding_is_one_line_before_any_work(tmp_path, pairs, capsys):
    from transformers import AutoModelForCausalLM
    model = tiny("llama", tmp_path, pairs)
    ids = len(data.load_tokenizer(model))
    lm_ = AutoModelForCausalLM.from_pretrained(model)
    lm_.resize_token_embeddings(ids - 40)  # 40 ids of the tokenizer without a row
    lm_.save_pretrained(model)
    capsys.readouterr()  # the building's own progress bars
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(model), "--data", str(pairs), "--out", str(tmp_path / "run"), *BUDGET])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert f"vocab_size {ids - 40} has no embedding for ids {ids - 40}-{ids - 1}" in err and "config.json" in err
    assert not (tmp_path / "run").exists()  # nothing was written, nothing trained


def test_a_model_directory_without_readable_weights_is_one_line_before_any_work(tmp_path, pairs, capsys):
    import shutil
    model = tiny("llama", tmp_path, pairs)
    weights = model / "model.safetensors"
    shutil.copy(weights, tmp_path / "weights")
    for damage, named in ((lambda: weights.write_bytes(weights.read_bytes()[:3000]), "model.safetensors: damaged"),
                          (lambda: weights.unlink(), "no model weights in it")):
        shutil.copy(tmp_path / "weights", weights)
        damage()
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main(["--model", str(model), "--data", str(pairs), "--out", str(tmp_path / "run"), *BUDGET])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and named in err[0], err
        assert not (tmp_path / "run").exists()


LLAMA2_CHAT = ("{% for m in messages %}{% if m['role'] == 'user' %}"
               "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
               "{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")  # Llama 2's turn ends


def test_end_of_turn_is_the_first_special_token_after_the_answer_never_a_space_or_a_piece(tmp_path):
    """Llama 2's template ends an answer with " </s>": the EOS ends responses, not the space before it. A ChatML
    template on a tokenizer that lacks <|im_end|> (it splits into "<", "|", ...) ends them with the EOS too, not "<"."""
    texts = ["hello there, how are you <|im_end|> [INST] fine [/INST]"] * 10
    for style, template in (("mistral", LLAMA2_CHAT), ("llama", tiny_model.CHATML)):
        tok = tiny_model.build_tokenizer(style, texts, tmp_path / style, 300)
        tok.chat_template = template
        assert data.stop_id(tok) == tok.eos_token_id, style
        assert data.response_ids(" Fine.", tok)[-1] == tok.eos_token_id


STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # Mistral's and Llama 2's check


def test_a_chat_template_that_refuses_a_conversation_is_one_examples_data_error(tmp_path):
    """Templates that insist on alternating roles: an HH turn left empty or doubled is merged into one turn; a
    conversation the template still refuses (a system turn first) is a DataError naming file and line, skipped and
    counted under --skip-bad; a template that refuses even one user turn and one answer names the tokenizer."""
    tok = tiny_model.build_tokenizer("qwen2", ["hello there, how are you"] * 10, tmp_path / "q", 300)
    tok.chat_template = STRICT
    doubled = "\n\nHuman: hi\n\nAssistant: hello\n\nAssistant: again?\n\nHuman: so\n\nAssistant:"
    empty = "\n\nHuman: hi\n\nAssistant:\n\nHuman: hello?\n\nAssistant:"
    assert [m["role"] for m in data.hh_to_messages(doubled)] == ["user", "assistant", "user"]
    assert data.hh_to_messages(doubled)[1]["content"] == "hello\n\nagain?"
    assert data.hh_to_messages(empty) == [{"role": "user", "content": "hi\n\nhello?"}]
    for prompt in (doubled, empty):
        assert data.fit_prompt(prompt, tok, 100, source="p.jsonl:1") == prompt
    system = "System: be brief" + doubled  # messages_to_hh's system message: this template takes none
    with pytest.raises(data.DataError) as info:
        data.fit_prompt(system, tok, 100, source="p.jsonl:7")
    assert (info.value.path, info.value.line, info.value.reason) == ("p.jsonl", 7, "chat_template")
    assert "roles must alternate" in str(info.value) and "\n" not in str(info.value)
    report = data.DataReport()
    kept = data.prompt_records([(doubled, "p.jsonl:1"), (system, "p.jsonl:2")], tok, 100, True, report)
    assert [r["source"] for r in kept] == ["p.jsonl:1"] and report.skipped == {"chat_template": 1}
    tok.chat_template = "{{ raise_exception('this template takes no assistant turn') }}"
    tok.save_pretrained(tmp_path / "refuses")
    with pytest.raises(data.TemplateRefused, match="refuses: .*takes no assistant turn.*a user turn, then an"):
        data.stop_id(data.load_tokenizer(tmp_path / "refuses"))


HH_SAMPLE = Path(__file__).resolve().parents[1] / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"


def test_the_ptx_batch_of_the_hh_sample_fits_a_128_position_table(tmp_path, capsys):
    """GPT-2's learned position table is a hard limit (an id past it is `IndexError: index out of range`). With the
    README's limits (P 128, T 64) on a 128-position model the limits are lowered to fit, and every ptx row of the HH
    sample (the longest 2,772 tokens as written with this 300-token tokenizer) runs through the policy as ppo_update
    runs it."""
    from plumbing import models
    from plumbing import pipeline
    import ppo_loss
    from transformers import AutoModelForCausalLM
    texts = [p + r for p, r in data.load_texts(HH_SAMPLE, skip_bad=True)]
    tok = tiny_model.build_tokenizer("gpt2", texts, tmp_path / "gpt2", 300)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_model.model_config("gpt2", tok, hidden=16, layers=1, heads=2,
                                                             max_positions=128)).save_pretrained(tmp_path / "gpt2")
    run, _, _, cfg, *_ = plumbing.flags.parse_configs(["--model", str(tmp_path / "gpt2"), "--data", str(HH_SAMPLE), "--skip-bad",
                                             "--max-new-tokens", "32"])
    dirs = pipeline.resolve_real_models(run, cfg)
    run, cfg = pipeline.fit_context(run, cfg, dirs)
    assert "[context]" in capsys.readouterr().out
    assert run.max_prompt_tokens + max(run.max_response_tokens, cfg.max_new_tokens) <= 128
    records = pipeline.real_model_records(run, dirs)
    assert max(len(data.token_ids(p + r, tok)) for p, r in data.load_texts(HH_SAMPLE, skip_bad=True)) > 1000
    rows = [(r["prompt"], r["response"]) for r in records["sft"]]
    batches = data.RolloutBatches([r["prompt"] for r in records["prompts_train"]], rows, tok, seed=0)
    batches.rng.shuffle(rows)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    with torch.no_grad():
        for i in range(0, len(rows), 128):  # every ptx row, as ppo_update feeds them (Eq. 17)
            ids, attn, resp = data.lm_batch(rows[i:i + 128], tok)
            assert ids.shape[1] <= 128
            loss, _ = ppo_loss.ptx_loss(policy(input_ids=ids, attention_mask=attn).logits, ids, resp)
            assert torch.isfinite(loss)
        _, query, query_mask = batches.prompts(len(records["prompts_train"]))  # and every rollout prompt
        assert query.shape[1] + cfg.max_new_tokens <= 128
        policy(input_ids=query, attention_mask=query_mask, position_ids=data.position_ids_from_mask(query_mask))


def test_the_evaluation_scores_the_sampled_ids(tmp_path, pairs):
    """Every judge of the final evaluation (proxy, held-out judge, a sequence-classification RM: all rm_judge) scores
    the ids that were sampled, with the masks of training: equal to each sequence scored alone from its real
    tokens. Decoding and encoding again would not give those ids back for a random byte-level BPE model."""
    import eval as evaluation
    from transformers import AutoModelForCausalLM
    model = tiny("gpt2", tmp_path, pairs)
    tok = data.load_tokenizer(model)
    policy = AutoModelForCausalLM.from_pretrained(model).eval()
    reward = ScalarHeadModel.from_pretrained(model, seed=3).eval()
    prompts = [p.prompt for p in data.load_pairs(pairs)[:12]]
    samples = evaluation.sample(policy, tok, prompts, 2, seed=0, max_new_tokens=12)
    metrics, judged = evaluation.measure(policy, policy, reward, samples, judge=evaluation.rm_judge(reward))
    alone, sampled = [], []
    with torch.no_grad():
        for q, qm, r, m in zip(samples["query"], samples["query_mask"], samples["response"], samples["mask"]):
            for i in range(len(q)):
                ids = torch.cat([q[i][qm[i].bool()], r[i][m[i].bool()]])
                sampled.append(ids.tolist())
                alone.append(reward.score(ids[None], torch.ones(1, len(ids))).item())
    torch.testing.assert_close(torch.tensor(judged), torch.tensor(alone), atol=1e-5, rtol=1e-5)
    assert metrics["reward"] == pytest.approx(sum(alone) / len(alone), abs=1e-5)  # the proxy's column too
    again = [data.query_ids(p, tok) + data.token_ids(t, tok) + ([data.stop_id(tok)] if f else [])
             for p, t, f in zip(samples["prompts"], samples["texts"], samples["finished"])]
    assert sum(a != b for a, b in zip(again, sampled)) >= len(sampled) // 4  # what scoring text would have read


@pytest.mark.parametrize("style", ["qwen2", "gpt2"])
def test_records_counted_in_one_batch_are_the_records_of_fit_example_one_at_a_time(tmp_path, style):
    """pair_records, text_records and prompt_records count every text's tokens in one call of the tokenizer
    (data.Lengths) before fitting: their records and the report's counts are fit_example's, called per example
    without those counts, on the HH sample (a chat template, and a plain BPE), at limits that cut and drop some."""
    pairs = data.load_pairs(HH_SAMPLE, skip_bad=True)[:400]
    tok = tiny_model.build_tokenizer(style, [p.prompt + p.chosen for p in pairs[:50]], tmp_path / style, 400)
    P, T = 64, 48

    def one_at_a_time(items, responses_of):
        report, out = data.DataReport(), []
        for prompt, responses, source in items:
            got = data.fit_example(prompt, responses_of(responses), tok, P, T, False, source, report)
            if got is not None:
                out.append((got[0], list(got[1])))
        return out, report

    report = data.DataReport()
    got = data.pair_records(pairs, tok, P, T, True, report)
    want, want_report = one_at_a_time([(p.prompt, (p.chosen, p.rejected), p.source) for p in pairs], list)
    assert [(r["prompt"], [r["chosen"], r["rejected"]]) for r in got] == want and 0 < len(want) < len(pairs)
    assert (report.dropped, report.truncated) == (want_report.dropped, want_report.truncated)
    assert want_report.truncated > 0 and want_report.dropped
    rows = [(p.prompt, p.chosen, p.source) for p in pairs]
    texts = data.text_records(rows, tok, P, T, True, data.DataReport())
    assert [(r["prompt"], [r["response"]]) for r in texts] == one_at_a_time(rows, lambda y: [y])[0]
    prompts = data.prompt_records([(p.prompt, p.source) for p in pairs], tok, P, True, data.DataReport())
    assert [r["prompt"] for r in prompts] == [data.fit_prompt(p.prompt, tok, P) for p in pairs]
    known = data.Lengths.count([p.prompt for p in pairs], [p.chosen for p in pairs], tok, chunk=7)  # many chunks
    assert known.query == {p.prompt: len(data.query_ids(p.prompt, tok)) for p in pairs}
    assert known.response == {p.chosen: len(data.response_ids(p.chosen, tok)) for p in pairs}
    uncounted = [p.rejected for p in pairs if p.rejected not in known.response][:20]   # counted on the spot
    assert uncounted and [known.response_len(y, tok) for y in uncounted] == \
        [len(data.response_ids(y, tok)) for y in uncounted]
    assert data.Lengths({}, {}).query_len(pairs[0].prompt, tok) == known.query[pairs[0].prompt]
