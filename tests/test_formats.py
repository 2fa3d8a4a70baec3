"""Data as the Hub ships it: every format of TRL's "Dataset formats and types" page, read exactly wherever data enters
(--data pairs, --prompts, --sft-data, eval.py score). With a tokenizer that has a chat template, what the model reads
is that template's rendering of the messages, system turns included; without one, the project's conversation text.
Every row's question reaches the run's records; a special token's spelling in the data reaches the model as text;
what cannot be read exactly is refused in one line naming the file, the line and the field; and a split that can hold
nothing out says why.

The files are written here into tmp_path; the tokenizers are tiny BPEs trained here: tools/tiny_model.py's Qwen2 style
(ChatML: <|im_start|>, <|im_end|>, EOS <|endoftext|>) and Mistral style ([INST] … [/INST], EOS </s>), and the
project's from-scratch BPE without a template (data.train_bpe_tokenizer: <pad>, <s>, </s>, <unk>).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing import data
from plumbing.data import DataError
import plumbing.flags
import tiny_model

H, A = "\n\nHuman:", "\n\nAssistant:"
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
WORDS = ("how do i bake bread fix a bike learn chess what color is the sky it is blue green yes no number you answer "
         "in one short sentence hi hello there see and here").split()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """name → tokenizer: "chatml" and "inst" have a chat template, "plain" (the project's own BPE) has none."""
    d = tmp_path_factory.mktemp("toks")
    texts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(12)) for i in range(60)]
    return {"chatml": tiny_model.build_tokenizer("qwen2", texts, d / "chatml", 300),
            "inst": tiny_model.build_tokenizer("mistral", texts, d / "inst", 300),
            "plain": data.train_bpe_tokenizer(texts, d / "plain", vocab_size=300)}


# ----------------------------------------------------------------------------------------------
# The formats: each row's prompt (as the messages a template renders), and its answer
# ----------------------------------------------------------------------------------------------
def question(i: int) -> str:
    return f"how do i bake bread number {i}?"


def conversation(i: int) -> list[dict]:
    """A system turn, or a multi-turn prompt (the turns before the answer), in turn."""
    return [SYSTEM, user(question(i))] if i % 2 == 0 else [user("hi there"), assistant("hello"), user(question(i))]


def yes(i: int) -> str:
    return f"Yes, bake it {i} times."


def no(i: int) -> str:
    return f"No, never {i}."


# name → (row i, the prompt's messages (None: a string prompt, read as text), answer i); loaders that read it
FORMATS = {
    "standard preference (explicit prompt)": (
        lambda i: {"prompt": question(i), "chosen": " " + yes(i), "rejected": " " + no(i)},
        ("pairs", "prompts", "texts")),
    "standard preference (implicit prompt)": (
        lambda i: {"chosen": f"{question(i)} {yes(i)}", "rejected": f"{question(i)} {no(i)}"},
        ("pairs", "prompts", "texts")),
    "HH-RLHF transcripts (standard preference, implicit prompt)": (
        lambda i: {"chosen": f"{H} {question(i)}{A} {yes(i)}", "rejected": f"{H} {question(i)}{A} {no(i)}"},
        ("pairs", "prompts", "texts")),
    "conversational preference (explicit prompt)": (
        lambda i: {"prompt": conversation(i), "chosen": [assistant(yes(i))], "rejected": [assistant(no(i))]},
        ("pairs", "prompts", "texts")),
    "conversational preference (implicit prompt)": (
        lambda i: {"chosen": conversation(i) + [assistant(yes(i))], "rejected": conversation(i) + [assistant(no(i))]},
        ("pairs", "prompts", "texts")),
    "standard prompt-only": (lambda i: {"prompt": question(i)}, ("prompts",)),
    "conversational prompt-only": (lambda i: {"prompt": conversation(i)}, ("prompts",)),
    "standard prompt-completion": (lambda i: {"prompt": question(i), "completion": " " + yes(i)}, ("prompts", "texts")),
    "conversational prompt-completion": (
        lambda i: {"prompt": conversation(i), "completion": [assistant(yes(i))]}, ("prompts", "texts")),
    "standard language modeling": (lambda i: {"text": f"{question(i)} {yes(i)}"}, ("texts",)),
    "conversational language modeling": (
        lambda i: {"messages": conversation(i) + [assistant(yes(i))]}, ("prompts", "texts")),
}
LOADERS = {"pairs": data.load_pairs, "prompts": data.load_prompts, "texts": data.load_texts}
CASES = [(name, kind) for name, (_, kinds) in FORMATS.items() for kind in kinds]


def read(kind: str, path: Path, report: data.DataReport) -> list[tuple[str, str | None]]:
    """(prompt, answer) of every row, as the loader of `kind` gives them (prompts: no answer)."""
    got = LOADERS[kind](path, report=report)
    if kind == "pairs":
        return [(p.prompt, p.chosen) for p in got]
    return [(p, None) for p in got] if kind == "prompts" else list(got)


def want_messages(name: str, i: int) -> list[dict] | None:
    """The messages a chat template must render for row i's prompt (None: a standard row, whose prompt is text)."""
    return conversation(i) if name.startswith("conversational") else None


def token_ids(tok, text: str) -> list[int]:
    """The ids of a template's rendering, its special tokens read as such (no spelling in these rows' data)."""
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name, kind", CASES)
def test_every_format_is_read_with_its_question_and_rendered_by_the_template(name, kind, tmp_path, toks):
    """Each format, through each loader that takes it: the report names the format once for the file; every row's
    question is in its prompt (a {"text"} row: in its text); with a chat template the query is the template's
    rendering of the row's messages (system turns and earlier turns included) with the assistant's turn opened, and
    query + answer is its rendering of the whole conversation through the end-of-turn token; without a template the
    model reads [BOS] + the conversation text."""
    row, _ = FORMATS[name]
    path = write(tmp_path / "d.jsonl", [row(i) for i in range(4)])
    report = data.DataReport()
    items = read(kind, path, report)
    assert report.formats == {str(path): {name: 4}} and report.format_summary() == f"format {name}"
    assert len(items) == 4
    for i, (prompt, answer) in enumerate(items):
        if name == "standard language modeling":
            assert prompt == "" and question(i) in answer
            continue
        assert question(i) in prompt, prompt
        msgs = want_messages(name, i)
        if msgs is not None:
            assert isinstance(prompt, data.Chat) and list(prompt.messages) == msgs
            assert str(prompt) == data.conversation_text(msgs)  # what a tokenizer without a template reads
            assert (SYSTEM["content"] in prompt) == (i % 2 == 0)
        if answer is not None:
            assert answer.strip() == yes(i)
        for tname, tok in toks.items():
            q = data.query_ids(prompt, tok)
            if not data.has_chat_template(tok):
                assert q == [tok.bos_token_id] + token_ids(tok, str(prompt)), tname
                if answer is not None:
                    assert data.response_ids(answer, tok) == token_ids(tok, str(answer)) + [tok.eos_token_id]
                continue
            rendered = msgs if msgs is not None else data.hh_to_messages(prompt)
            assert q == token_ids(tok, data.render_chat(tok, rendered, add_generation_prompt=True)), tname
            if answer is None:
                continue
            r = data.response_ids(answer, tok)
            whole = data.render_chat(tok, rendered + [assistant(yes(i))])
            read_back = tok.decode(q + r, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            stop = tok.convert_ids_to_tokens(data.stop_id(tok))
            assert r[-1] == data.stop_id(tok) and read_back.endswith(stop), tname
            assert whole.startswith(read_back) and not whole[len(read_back):].strip(), (tname, whole, read_back)


def test_a_template_writes_the_answer_as_it_writes_an_assistant_turn(toks):
    """The answer's ids are the ones that follow the query in the template's rendering: Mistral's " " before the
    answer is part of it, ChatML's answer starts at once; both end with the template's end of turn."""
    inst, chatml = toks["inst"], toks["chatml"]
    assert inst.decode(data.response_ids(" Yes.", inst)) == " Yes.</s>"
    assert chatml.decode(data.response_ids(" Yes.", chatml)) == "Yes.<|im_end|>"
    chat = data.Chat([assistant("  spaced as written ")])  # an answer from messages: its content as written
    assert chatml.decode(data.response_ids(chat, chatml)) == "  spaced as written <|im_end|>"


def test_the_formats_of_several_files_are_named_once_per_file(tmp_path):
    pairs = write(tmp_path / "pairs.jsonl", [FORMATS["conversational preference (explicit prompt)"][0](i)
                                             for i in range(3)])
    texts = write(tmp_path / "sft.jsonl", [{"text": "plain words"}, {"messages": [user("q?"), assistant("a.")]}])
    report = data.DataReport()
    data.load_pairs(pairs, report=report)
    data.load_texts(texts, report=report)
    assert report.format_summary() == (f"formats {pairs} = conversational preference (explicit prompt), {texts} = "
                                       f"standard language modeling 1 + conversational language modeling 1")
    assert report.summary().startswith("formats ") and report.to_dict()["formats"][str(pairs)] == {
        "conversational preference (explicit prompt)": 3}


def test_the_implicit_prompt_of_two_plain_texts_ends_at_a_word():
    """TRL's {"chosen": "The sky is blue.", "rejected": "The sky is green."}: the prompt is the words both share, the
    answers start with the space before their first difference, and no word is cut in two."""
    assert data.split_shared_words("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert data.split_shared_words("The sky is blue.", "The sky is black.") == ("The sky is", " blue.", " black.")
    assert data.split_shared_words("It is blue", "It is blue!") == ("It is", " blue", " blue!")
    with pytest.raises(DataError) as info:
        data.split_shared_words("Blue.", "Green.", "d.jsonl", 4)
    assert (info.value.reason, info.value.line) == ("no_shared_prompt", 4)


# ----------------------------------------------------------------------------------------------
# The run's records: every row's question, system turns included, in records.json
# ----------------------------------------------------------------------------------------------
def run_files(d: Path) -> dict[str, Path]:
    """--data as conversational pairs with explicit prompts (the format that lost its question), --sft-data as
    conversations, --prompts as conversational prompt-only rows: 12 different questions each."""
    conv = lambda i: [SYSTEM, user(question(i))] if i % 2 == 0 else [user(f"hi {i}"), assistant("hello"),  # noqa: E731
                                                                      user(question(i))]
    return {"data": write(d / "pairs.jsonl", [{"prompt": conv(i), "chosen": [assistant(yes(i))],
                                               "rejected": [assistant(no(i))]} for i in range(12)]),
            "sft": write(d / "sft.jsonl", [{"messages": conv(i) + [assistant(yes(i))]} for i in range(20, 32)]),
            "prompts": write(d / "prompts.jsonl", [{"prompt": conv(i)} for i in range(40, 52)])}


def test_every_question_of_every_file_reaches_records_json_and_the_template(tmp_path, toks):
    """A real --model whose tokenizer has a chat template: the run's records (pipeline.run_records) and records.json
    hold every row's question, the system turn with it; each stage's prompt is still the conversation's messages, so
    the template renders the system turn."""
    from plumbing import pipeline
    model = tmp_path / "model"
    toks["chatml"].save_pretrained(model)  # run_records reads only the tokenizer
    files = run_files(tmp_path)
    run, *_, cfg, _, _ = plumbing.flags.parse_configs([
        "--model", str(model), "--data", str(files["data"]), "--sft-data", str(files["sft"]),
        "--prompts", str(files["prompts"]), "--out", str(tmp_path / "run"), "--judge-frac", "0.3"])
    records = pipeline.real_model_records(run, {"model": str(model), "sft": None})
    rows = pipeline.stage_records(records, run, cfg)
    pipeline.write_stage_records(tmp_path / "run", rows)
    written = json.loads((tmp_path / "run" / "records.json").read_text())
    split = written["rm"] + written["judge"] + written["heldout"]
    for i in range(12):  # each pair of --data in exactly one part of the split, its question and system turn intact
        assert sum(question(i) in p for p in split) == 1, i
    assert all(SYSTEM["content"] in p for p in split if "hi " not in p)
    assert len(written["sft"]) == 12 and all(any(question(i) in p for p in written["sft"]) for i in range(20, 32))
    assert len(written["ppo"]) == 12 and all(any(question(i) in p for p in written["ppo"]) for i in range(40, 52))
    tok = toks["chatml"]
    for consumer in ("rm", "sft", "ppo", "eval"):
        for r in rows[consumer]:
            assert isinstance(r["prompt"], data.Chat)
            text = tok.decode(data.query_ids(r["prompt"], tok))
            assert text == data.render_chat(tok, list(r["prompt"].messages), add_generation_prompt=True)
            assert text.startswith(f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>") == (
                r["prompt"].messages[0]["role"] == "system")


def test_prompts_held_out_for_eval_are_written_as_messages(tmp_path):
    """A real --model's held-out prompts go to --out/data/ for `eval.py --run`: a conversation as its messages (TRL's
    conversational prompt-only row), read back as the same Chat."""
    import toy_world
    prompt = data.Chat([SYSTEM, user(question(1))])
    toy_world.write_dataset({"prompts_heldout": [data.as_row({"prompt": prompt, "source": "f:1", "uncut": prompt})]},
                            tmp_path)
    (back,) = data.load_prompts(tmp_path / "prompts_heldout.jsonl")
    assert isinstance(back, data.Chat) and back.messages == prompt.messages
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(prompt)).messages == copy.deepcopy(prompt).messages == prompt.messages


def test_the_tiny_data_run_trains_on_conversations_with_every_question(tmp_path, monkeypatch):
    """train.py --data on conversational pairs with explicit prompts (the project's own BPE, no template), stage 1
    only: the split holds questions out, and records.json lists each one, system turn included."""
    import train
    monkeypatch.chdir(tmp_path)
    files = run_files(tmp_path)
    rows = [json.loads(line) for line in files["data"].read_text().splitlines()]
    write(files["data"], rows + [{"prompt": [user(question(i))], "chosen": [assistant(yes(i))],
                                  "rejected": [assistant(no(i))]} for i in range(60, 72)])
    train.main(["--data", str(files["data"]), "--stages", "sft", "--sft-epochs", "1", "--sft-hidden", "16",
                "--sft-batch", "8", "--vocab-size", "300", "--max-prompt-tokens", "64", "--threads", "1",
                "--out", str(tmp_path / "run")])
    written = json.loads((tmp_path / "run" / "records.json").read_text())
    split = written["rm"] + written["judge"] + written["heldout"]
    for i in list(range(12)) + list(range(60, 72)):
        assert sum(question(i) in p for p in split) == 1, i
    assert written["heldout"] and all(A in p for p in split)
    assert sum(p.startswith("System: " + SYSTEM["content"]) for p in split) == 6


# ----------------------------------------------------------------------------------------------
# Text is text: a special token's spelling in the data is never the control token
# ----------------------------------------------------------------------------------------------
SPELLED = "see </s> and <pad> or <s> <|endoftext|> <|im_end|> <|im_start|> here"


def test_special_spellings_in_a_response_reach_the_model_as_text(tmp_path, toks):
    """`</s>`, `<pad>` (and every other special token's spelling) written in a prompt or a response: the model reads
    their characters; the only control tokens are the BOS, the template's markers and the stop token that ends the
    response; decoding gives the text back."""
    pairs = write(tmp_path / "p.jsonl", [{"prompt": f"Say it: {SPELLED}", "chosen": f" {SPELLED}", "rejected": " no"},
                                         {"prompt": [SYSTEM, user(f"Say it: {SPELLED}")],
                                          "chosen": [assistant(SPELLED)], "rejected": [assistant("no")]}])
    for name, tok in toks.items():
        special = set(tok.all_special_ids)
        for row in data.pair_records(data.load_pairs(pairs), tok, 256, 128, False, data.DataReport()):
            q, r = data.query_ids(row["prompt"], tok), data.response_ids(row["chosen"], tok)
            clean = {"prompt": data.Chat([SYSTEM, user("Say it: x")]) if isinstance(row["prompt"], data.Chat)
                     else "Say it: x", "chosen": " x"}
            want_q = [i for i in data.query_ids(clean["prompt"], tok) if i in special]
            assert [i for i in q if i in special] == want_q, name  # the template's (or the BOS) alone
            assert [i for i in r if i in special] == [data.stop_id(tok)] and r[-1] == data.stop_id(tok), name
            assert tok.decode(r[:-1]).strip() == SPELLED and SPELLED in tok.decode(q), name
            ids, _, _ = data.pair_batch([row], tok)  # (2, L): what SFT, the reward model and DPO read
            assert SPELLED in tok.decode(ids[0].tolist())
        sft = data.encode_rows([(f"Say {SPELLED}", f" {SPELLED}")], tok)[0]
        assert [i for i in sft[1] if i in special] == [data.stop_id(tok)], name
        batches = data.RolloutBatches([f"Say {SPELLED}"], [], tok, seed=0)
        _, query, mask = batches.prompts(2)
        assert sum(i in special for i in query[0][mask[0].bool()].tolist()) == len(
            [i for i in data.query_ids("Say x", tok) if i in special])


def test_the_project_bpe_and_a_python_tokenizer_read_spellings_as_text(toks):
    """encode_many (split_special_tokens) on the from-scratch BPE: "</s>" is not EOS id 2 nor "<pad>" id 0, and the
    ids of text without a spelling are the tokenizer's own. The same for a tokenizer of transformers' Python backend
    (ByT5's, which needs no files)."""
    from transformers import ByT5Tokenizer
    tok = toks["plain"]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    ids = data.token_ids(SPELLED, tok)
    assert not {0, 1, 2, 3} & set(ids) and tok.decode(ids) == SPELLED
    assert data.token_ids("plain words here", tok) == tok.encode("plain words here", add_special_tokens=False)
    assert data.encode_many(["</s>"], tok, markup=True) == [[2]]  # a template's own markup keeps its tokens
    slow = ByT5Tokenizer()
    assert not slow.is_fast and slow.encode("</s>", add_special_tokens=False) == [slow.eos_token_id]
    ids = data.response_ids(f" {SPELLED}", slow)
    assert [i for i in ids if i in slow.all_special_ids] == [slow.eos_token_id] == ids[-1:]
    assert slow.decode(ids[:-1]) == f" {SPELLED}"


# ----------------------------------------------------------------------------------------------
# What cannot be read exactly: one line naming file, line and field, before any work
# ----------------------------------------------------------------------------------------------
Q = [user("What color is the sky?")]
REFUSED = [  # (row, the loaders that refuse it, reason, field, words of the message)
    ({"prompt": "The sky is", "completion": " blue.", "label": True}, ("pairs", "texts"), "unpaired", "label",
     "unpaired preference"),
    ({"prompt": Q, "completion": [assistant("It is blue.")], "label": False}, ("pairs", "texts"), "unpaired", "label",
     "unpaired preference"),
    ({"prompt": "Which is larger?", "completions": ["9.8", "9.11"], "labels": [True, False]}, ("pairs", "texts"),
     "stepwise", "completions", "stepwise"),
    ({"messages": Q + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
                       {"role": "tool", "name": "f", "content": "on"}, assistant("Done!")]}, ("texts", "prompts"),
     "tool_calls", "messages[1].tool_calls", "tool call"),
    ({"messages": Q + [{"role": "tool", "content": "on"}, assistant("Done!")]}, ("texts",), "tool_calls",
     "messages[1].role", "tool"),
    ({"messages": Q + [assistant("Done!")], "tools": [{"type": "function"}]}, ("texts", "prompts"), "tool_calls",
     "tools", "tool definitions"),
    ({"prompt": [{"role": "developer", "content": "Be kind."}] + Q}, ("prompts",), "bad_role", "prompt[0].role",
     'role "developer" is not'),
    ({"prompt": Q + [assistant("It is"), SYSTEM, user("And?")]}, ("prompts",), "bad_role", "prompt[2].role",
     "system message after the first"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]},
     ("prompts",), "bad_content", "prompt[0].content", "only text"),
    ({"prompt": Q, "images": ["sky.png"]}, ("prompts",), "images", "images", "only text"),
    ({"prompt": Q + [{"role": "user", "content": "x", "name": "bob"}]}, ("prompts",), "bad_messages",
     "prompt[1].name", "would be lost"),
    ({"prompt": Q + [assistant("It is")]}, ("prompts",), "bad_messages", "prompt[1].role", "the user's question"),
    ({"prompt": Q, "chosen": " blue.", "rejected": " green."}, ("pairs",), "bad_messages", "chosen",
     "the answers must be too"),
    ({"prompt": Q, "chosen": [assistant("Blue."), assistant("Really.")], "rejected": [assistant("Green.")]},
     ("pairs",), "bad_messages", "chosen", "one assistant message"),
    ({"prompt": "The sky is", "completion": [assistant("blue")]}, ("texts",), "bad_messages", "prompt",
     "the prompt must be too"),
    ({"chosen": "Blue sky.", "rejected": "Green sea."}, ("pairs",), "no_shared_prompt", None, "share no words"),
    ({"prompt": [user("   ")]}, ("prompts",), "empty_prompt", "prompt[0].content", "the user's question"),
    ({"text": "a plain text"}, ("prompts",), "missing_field", "prompt", "has no prompt"),
]


@pytest.mark.parametrize("row, kinds, reason, field, words", REFUSED)
def test_what_cannot_be_read_exactly_is_one_line_naming_file_line_and_field(row, kinds, reason, field, words,
                                                                            tmp_path):
    ok = {"prompt": "Fine?", "chosen": " Yes.", "rejected": " No.", "completion": " Yes."}
    path = write(tmp_path / "d.jsonl", [ok, row])
    for kind in kinds:
        with pytest.raises(DataError) as info:
            LOADERS[kind](path)
        err, msg = info.value, str(info.value)
        assert (err.reason, err.line, err.field) == (reason, 2, field), (kind, msg)
        assert msg.startswith(f"{path}:2: " + (f"field '{field}': " if field else "")) and "\n" not in msg, msg
        assert words in msg, (kind, msg)
        report = data.DataReport()  # --skip-bad: skipped and counted by reason, the first line named
        assert len(LOADERS[kind](path, skip_bad=True, report=report)) == 1
        assert report.skipped == {reason: 1} and report.first[reason] == f"{path}:2"


def test_a_template_that_does_not_know_a_turn_refuses_that_row_in_one_line(tmp_path, toks):
    """A system turn the chat template raises on (Mistral's and Llama 2's older templates take none) is that row's
    DataError naming file, line and field before any work, skipped and counted under --skip-bad."""
    tok = tiny_model.build_tokenizer("qwen2", WORDS, tmp_path / "strict", 300)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'"
                         " }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    path = write(tmp_path / "p.jsonl", [{"prompt": Q}, {"prompt": [SYSTEM] + Q}])
    rows = data.load_prompts(path, with_source=True)
    with pytest.raises(DataError) as info:
        data.prompt_records(rows, tok, 64, False, data.DataReport())
    assert (info.value.line, info.value.field, info.value.reason) == (2, "prompt", "chat_template")
    assert "System role not supported" in str(info.value) and "\n" not in str(info.value)
    report = data.DataReport()
    assert len(data.prompt_records(rows, tok, 64, True, report)) == 1 and report.skipped == {"chat_template": 1}


def test_the_command_line_names_the_format_or_refuses_in_one_line(tmp_path):
    good = write(tmp_path / "good.jsonl", [FORMATS["conversational preference (explicit prompt)"][0](i)
                                           for i in range(3)])
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "The sky is", "completion": " blue.", "label": True}])
    runs = [subprocess.run([sys.executable, "-m", "plumbing.data", str(f)], capture_output=True, text=True,
                           timeout=120) for f in (good, bad)]
    assert runs[0].returncode == 0 and "3 pairs" in runs[0].stdout, runs[0].stderr
    assert "format conversational preference (explicit prompt); kept 3" in runs[0].stdout
    assert runs[1].returncode == 2 and "Traceback" not in runs[1].stderr
    assert runs[1].stderr.splitlines() == [f"error: {bad}:1: field 'label': unpaired preference data (one completion "
                                           "marked good or bad): the reward model learns from pairs of answers to one "
                                           "prompt (Eq. 2), and SFT would learn the bad ones too; pair them, or keep "
                                           "the rows labelled true without 'label' as SFT text"]


# ----------------------------------------------------------------------------------------------
# Cutting a conversation to the limit: whole earliest turns first, the system turn kept while it fits
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["chatml", "plain"])
def test_a_long_conversation_keeps_its_system_turn_and_latest_turns(name, toks):
    tok = toks[name]
    turns = [SYSTEM] + [m for i in range(6) for m in (user(f"question number {i} here"), assistant(f"answer {i}"))]
    prompt = data.Chat(turns + [user(question(9))])
    full = len(data.query_ids(prompt, tok))
    report = data.DataReport()
    cut = data.fit_prompt(prompt, tok, full - 5, report=report)
    assert isinstance(cut, data.Chat) and report.truncated == 1
    assert cut.messages[0] == SYSTEM and cut.messages[-1] == user(question(9)) and len(cut.messages) < len(turns)
    assert cut.messages[1]["role"] == "user" and len(data.query_ids(cut, tok)) <= full - 5
    alone = len(data.query_ids(data.Chat([SYSTEM, user(question(9))]), tok))
    tight = data.fit_prompt(prompt, tok, alone - 2)  # the question's latest tokens, the system turn while it fits
    assert isinstance(tight, data.Chat) and len(data.query_ids(tight, tok)) <= alone - 2
    assert tight.messages[-1]["role"] == "user" and question(9).endswith(tight.messages[-1]["content"].strip()[-6:])


# ----------------------------------------------------------------------------------------------
# The split's messages name the cause
# ----------------------------------------------------------------------------------------------
def split_error(tmp_path, rows, *flags) -> DataError:
    from plumbing import pipeline
    path = write(tmp_path / "d.jsonl", rows)
    run = plumbing.flags.parse_configs(["--data", str(path), "--out", str(tmp_path / "run"), *flags])[0]
    with pytest.raises(DataError) as info:
        pipeline.split_pairs(run, data.DataReport())
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    assert "--max-response-tokens" not in str(info.value)  # not the limits: they were never the cause here
    return info.value


def test_the_split_names_identical_prompts_one_row_and_vanished_questions(tmp_path):
    same = [{"prompt": [user("tell me about bread")], "chosen": [assistant(f"Bread {i}.")],
             "rejected": [assistant(f"No {i}.")]} for i in range(120)]
    err = split_error(tmp_path, same)
    assert err.reason == "too_few_prompts" and "all 120 pairs have the same prompt" in str(err)
    assert "tell me about bread" in str(err) and "at least 3 different conversations" in str(err)
    assert "one row" in str(split_error(tmp_path, same[:1]))
    empty = [{"chosen": f"{H}{A} Bread {i}.", "rejected": f"{H}{A} No {i}."} for i in range(10)]
    assert "holds no question" in str(split_error(tmp_path, empty))
    opening = [{"chosen": f"{H} Hi.{A} Hello.{H} Q{i}?{A} A{i}.", "rejected": f"{H} Hi.{A} Hello.{H} Q{i}?{A} B."}
               for i in range(10)]  # ten prompts, one conversation: they all open with "Hi."
    assert "in only 1 conversation(s)" in str(split_error(tmp_path, opening))
    two = opening[:5] + [{"chosen": f"{H} Q{i}?{A} A.", "rejected": f"{H} Q{i}?{A} B."} for i in range(1)]
    assert "in only 2 conversation(s)" in str(split_error(tmp_path, two))  # the judge's part has none left
    many = [{"chosen": f"{H} Q{i}?{A} A.", "rejected": f"{H} Q{i}?{A} B."} for i in range(6)]
    err = split_error(tmp_path, many, "--heldout-frac", "0.95", "--judge-frac", "0")
    assert "6 conversations" in str(err) and "--heldout-frac 0.95" in str(err) and "training" in str(err)


def test_a_part_emptied_by_the_limits_says_so(tmp_path):
    from plumbing import pipeline
    rows = [{"prompt": f"Q{i}?", "chosen": " yes " * 40, "rejected": " no"} for i in range(12)]
    path = write(tmp_path / "d.jsonl", rows)
    run = plumbing.flags.parse_configs(["--data", str(path), "--max-response-tokens", "8", "--out",
                                        str(tmp_path / "run")])[0]
    tok = data.train_bpe_tokenizer(["Q1? yes no"] * 20, tmp_path / "tok", 300)
    report = data.DataReport()
    with pytest.raises(DataError) as info:
        pipeline.encode_splits(run, pipeline.split_pairs(run, report), tok, report)
    msg = str(info.value)
    assert "pairs fits --max-prompt-tokens" in msg and "raise --max-response-tokens" in msg and "\n" not in msg


def test_prompts_alone_that_are_one_prompt_say_so(tmp_path):
    from plumbing import pipeline
    model = tmp_path / "model"
    data.train_bpe_tokenizer(["Only one?"] * 20, model, 300)
    one = write(tmp_path / "one.jsonl", [{"prompt": [user("Only one?")]}] * 3)
    run = plumbing.flags.parse_configs(["--model", str(model), "--prompts", str(one)])[0]
    with pytest.raises(DataError) as info:
        pipeline.real_model_records(run, {"model": str(model), "sft": None})
    assert info.value.reason == "too_few_prompts" and str(info.value).startswith(f"{one}: all 3 rows have the same "
                                                                                 "prompt")
