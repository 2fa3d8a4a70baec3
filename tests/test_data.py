"""Tests for data.py: every bad input is one clear error (file, line, field), --skip-bad counts by reason,
HH transcripts split by hand, truncation keeps the latest turns, responses are never cut, BPE round-trip.

Test files are written here into tmp_path with neutral made-up text; the real HH sample is only counted.
"""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plumbing import cli
from plumbing import data
from plumbing.data import DataError, DataReport, PreferencePair

ROOT = Path(__file__).resolve().parents[1]
HH_SAMPLE = ROOT / "data" / "hh-rlhf" / "harmless-base-test.dev.jsonl.gz"
H, A = "\n\nHuman:", "\n\nAssistant:"


def write(path: Path, lines) -> Path:
    """Write lines (dicts → JSON, str → as is, bytes → raw) one per line."""
    with open(path, "wb") as f:
        for x in lines:
            raw = x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode("utf-8")
            f.write(raw + b"\n")
    return path


def hh(prompt_turns: str, chosen: str, rejected: str) -> dict:
    return {"chosen": prompt_turns + chosen, "rejected": prompt_turns + rejected}


GOOD = hh(f"{H} What is two plus two?{A}", " Four.", " Five.")


def expect_error(path, reason, line, field=None, fn=data.load_pairs) -> DataError:
    with pytest.raises(DataError) as info:
        fn(path)
    err = info.value
    msg = str(err)
    assert err.reason == reason and err.line == line and err.field == field, msg
    where = f"{path}:{line}:" if line is not None else f"{path}:"
    assert msg.startswith(where), msg  # names the file and the line
    if field is not None:
        assert f"field '{field}'" in msg, msg  # names the field
    assert "\n" not in msg
    return err


# ------------------------------------------------------------------------- one test per bad input
def test_read_jsonl_file_not_found(tmp_path):
    err = expect_error(tmp_path / "nope.jsonl", "not_found", None)
    assert "no such file" in str(err)


def test_read_jsonl_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n  \n\n")
    assert "empty" in str(expect_error(p, "empty_file", None))


def test_read_jsonl_not_json_names_line(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, "", '{"chosen": "x", '])  # line 2 blank: numbers are physical lines
    assert "not JSON" in str(expect_error(p, "not_json", 3))


def test_read_jsonl_not_object(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, ["a", "b"]])
    assert "got a list" in str(expect_error(p, "not_object", 2))


def test_load_pairs_missing_field(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, {"chosen": GOOD["chosen"]}])
    assert "missing" in str(expect_error(p, "missing_field", 2, "rejected"))


def test_load_pairs_non_string_field(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"prompt": "Q?", "chosen": 3, "rejected": "b"}])
    assert "expected a string, got a number 3" in str(expect_error(p, "not_string", 1, "chosen"))


def test_load_pairs_empty_chosen(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, {"prompt": "Q?", "chosen": "", "rejected": "b"}])
    err = expect_error(p, "empty_response", 2, "chosen")
    assert str(err) == f"{p}:2: field 'chosen': expected a non-empty response, got \"\""


def test_load_pairs_empty_rejected_hh(tmp_path):
    p = write(tmp_path / "d.jsonl", [hh(f"{H} Hi?{A}", " Hello.", "  ")])
    assert 'got "  "' in str(expect_error(p, "empty_response", 1, "rejected"))


def test_load_pairs_identical(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, GOOD, hh(f"{H} Hi?{A}", " Same.", " Same. ")])
    assert "identical" in str(expect_error(p, "identical", 3, "rejected"))


def test_load_pairs_no_assistant_marker(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"chosen": f"{H} Hi? Hello.", "rejected": f"{H} Hi?{A} Hey."}])
    assert '"\\n\\nAssistant:"' in str(expect_error(p, "no_assistant_marker", 1, "chosen"))


def test_load_pairs_prompt_mismatch(tmp_path):
    bad = {"chosen": f"{H} Hi?{A} Hello.", "rejected": f"{H} Bye?{A} Ciao."}
    p = write(tmp_path / "d.jsonl", [GOOD, bad])
    err = expect_error(p, "prompt_mismatch", 2)
    assert "different prompts" in str(err) and "character 10" in str(err)  # 1-based: "\n\nHuman: " is 9 characters


def test_read_jsonl_not_utf8(tmp_path):
    p = write(tmp_path / "d.jsonl", [GOOD, b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}'])
    assert "not UTF-8 at byte 16" in str(expect_error(p, "not_utf8", 2))


def test_read_jsonl_lone_surrogate_escape_names_its_field(tmp_path):
    """JSON may write "\\ud800" alone: Python reads it as a string that no tokenizer or file can encode. An emoji
    written as its escaped pair ("\\ud83d\\ude00") is one character and loads."""
    pair = b'{"prompt": "\\n\\nHuman: hi \\ud83d\\ude00\\n\\nAssistant:", "chosen": " a", "rejected": " b"}'
    lone = b'{"prompt": "\\n\\nHuman: hi\\n\\nAssistant:", "chosen": " a \\uD800", "rejected": " b"}'
    p = write(tmp_path / "d.jsonl", [GOOD, pair, lone])
    assert "lone" in str(expect_error(p, "not_utf8", 3, "chosen"))
    report = DataReport()
    pairs = data.load_pairs(p, skip_bad=True, report=report)
    assert len(pairs) == 2 and "\U0001F600" in pairs[1].prompt and report.skipped == {"not_utf8": 1}


def test_read_jsonl_bad_gzip(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(b"not gzip at all\n")
    expect_error(p, "bad_gzip", None)


# ------------------------------------------------------------------------- skip_bad
def test_load_pairs_skip_bad_counts_by_reason(tmp_path):
    lines = [
        GOOD,                                                   # 1 kept
        "not json",                                             # 2 not_json
        [1],                                                    # 3 not_object
        {"chosen": "x"},                                        # 4 missing_field
        {"prompt": "Q", "chosen": "", "rejected": "b"},         # 5 empty_response
        {"prompt": "Q", "chosen": "b", "rejected": "b"},        # 6 identical
        {"prompt": "Q", "chosen": "a", "rejected": "b"},        # 7 kept
        b'{"prompt": "\xff"}',                                  # 8 not_utf8
        {"chosen": f"{H} a{A} b", "rejected": f"{H} c{A} d"},   # 9 prompt_mismatch
        "",                                                     # 10 blank, not counted
        {"prompt": "Q", "chosen": "a", "rejected": "c"},        # 11 kept
    ]
    p = write(tmp_path / "d.jsonl", lines)
    report = DataReport()
    pairs = data.load_pairs(p, skip_bad=True, report=report)
    assert [x.source for x in pairs] == [f"{p}:1", f"{p}:7", f"{p}:11"]
    assert report.kept == 3
    assert report.skipped == {"not_json": 1, "not_object": 1, "missing_field": 1, "empty_response": 1,
                              "identical": 1, "not_utf8": 1, "prompt_mismatch": 1}
    assert report.first["not_utf8"] == f"{p}:8"
    s = report.summary()
    assert "kept 3" in s and "skipped 7" in s and "identical 1" in s
    assert json.loads(json.dumps(report.to_dict()))["skipped"]["not_json"] == 1  # saveable


def test_load_pairs_skip_bad_all_bad_is_an_error(tmp_path):
    p = write(tmp_path / "d.jsonl", ["nope", "nope"])
    with pytest.raises(DataError) as info:
        data.load_pairs(p, skip_bad=True)
    assert info.value.reason == "all_skipped" and "no usable lines" in str(info.value)


# ------------------------------------------------------------------------- HH split
def test_split_hh_transcript_single_turn():
    prompt, c, r = data.split_hh_transcript(f"{H} Hi?{A} Hello there.", f"{H} Hi?{A} Go away.")
    assert prompt == "\n\nHuman: Hi?\n\nAssistant:"
    assert (c, r) == (" Hello there.", " Go away.")  # leading space kept: prompt + response == transcript


def test_split_hh_transcript_multi_turn_keeps_role_markers():
    turns = f"{H} Name a color.{A} Blue.{H} Another?{A}"
    prompt, c, r = data.split_hh_transcript(turns + " Red.", turns + " Green, or red.")
    assert prompt == "\n\nHuman: Name a color.\n\nAssistant: Blue.\n\nHuman: Another?\n\nAssistant:"
    assert (c, r) == (" Red.", " Green, or red.")
    assert data.hh_to_messages(prompt) == [{"role": "user", "content": "Name a color."},
                                           {"role": "assistant", "content": "Blue."},
                                           {"role": "user", "content": "Another?"}]


def test_load_pairs_both_formats_and_gz(tmp_path):
    lines = [GOOD, {"prompt": "Q?", "chosen": " yes", "rejected": " no", "extra": 1}]
    p = tmp_path / "d.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    pairs = data.load_pairs(p)
    assert pairs == [PreferencePair(f"{H} What is two plus two?{A}", " Four.", " Five.", f"{p}:1"),
                     PreferencePair("Q?", " yes", " no", f"{p}:2")]


def test_load_prompts_and_texts_formats(tmp_path):
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "Tell me a joke."}, GOOD])
    assert data.load_prompts(prompts) == ["Tell me a joke.", f"{H} What is two plus two?{A}"]
    assert data.load_prompts(prompts, with_source=True)[0] == ("Tell me a joke.", f"{prompts}:1")
    expect_error(write(tmp_path / "e.jsonl", [{"prompt": " "}]), "empty_prompt", 1, "prompt", data.load_prompts)
    texts = write(tmp_path / "t.jsonl", [{"text": "Plain text."}, {"prompt": "Q?", "response": " A."}, GOOD])
    assert data.load_texts(texts) == [("", "Plain text."), ("Q?", " A."), (f"{H} What is two plus two?{A}", " Four.")]
    expect_error(write(tmp_path / "m.jsonl", [{"prompt": "Q?"}]), "missing_field", 1, "completion", data.load_texts)
    expect_error(write(tmp_path / "n.jsonl", [{"body": "x"}]), "missing_field", 1, "text", data.load_texts)
    demo = write(tmp_path / "d.jsonl", [{"prompt": "Q?", "chosen": " A."}])  # a demonstration, no 'rejected'
    assert data.load_texts(demo) == [("Q?", " A.")]
    expect_error(write(tmp_path / "d0.jsonl", [{"prompt": "Q?", "chosen": " "}]), "empty_response", 1, "chosen",
                 data.load_texts)
    expect_error(write(tmp_path / "r.jsonl", [{"prompt": "Q?", "rejected": " A."}]), "missing_field", 1, "chosen",
                 data.load_texts)  # only the worse half of a pair is no demonstration


def test_load_pairs_real_hh_sample():
    with pytest.raises(DataError) as info:  # strict: stops at the first bad line
        data.load_pairs(HH_SAMPLE)
    assert (info.value.reason, info.value.line) == ("empty_response", 87)
    report = DataReport()
    pairs = data.load_pairs(HH_SAMPLE, skip_bad=True, report=report)
    # 1800 lines: 4 chosen responses are a single space, 2 chosen responses carry a second "\n\nAssistant:" turn
    assert len(pairs) == report.kept == 1794
    assert report.skipped == {"empty_response": 4, "prompt_mismatch": 2}
    with gzip.open(HH_SAMPLE, "rt", encoding="utf-8") as f:  # independent check: prompt + response == transcript
        raw = [json.loads(x) for x in f]
    for pair in pairs[:200]:
        line = int(pair.source.rsplit(":", 1)[1])
        assert pair.prompt + pair.chosen == raw[line - 1]["chosen"]
        assert pair.prompt + pair.rejected == raw[line - 1]["rejected"]
        assert pair.prompt.startswith(H) and pair.prompt.endswith(A)


# ------------------------------------------------------------------------- truncation (one token per character)
class CharTok:
    """One token per character (id = code point + 10), BOS id 1 when given, EOS id 2: token counts are len(text),
    and a query is [BOS] + x: one more."""

    eos_token_id = 2

    def __init__(self, bos: bool = False):
        self.bos_token_id = 1 if bos else None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) + 10 for ch in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(i - 10) for i in ids if i >= 10)


def test_fit_prompt_fits_untouched():
    report = DataReport()
    prompt = f"{H} a{A} b{H} c{A}"
    assert data.fit_prompt(prompt, CharTok(), len(prompt), report=report) == prompt
    assert report.truncated == 0


def test_fit_prompt_keeps_latest_turns_then_the_end_of_the_last_and_counts():
    t1, t2, t3 = f"{H} first{A} one.", f"{H} second{A} two.", f"{H} a third question{A}"
    prompt = t1 + t2 + t3
    report = DataReport()
    assert data.fit_prompt(prompt, CharTok(), len(t2 + t3), report=report) == t2 + t3  # earliest whole turn dropped
    assert data.fit_prompt(prompt, CharTok(), len(t2 + t3) - 1, report=report) == t3   # only the last turn fits
    # the last turn alone is too long: its markers stay, the latest characters between them fill what is left
    assert data.fit_prompt(prompt, CharTok(), len(H + A) + 6, report=report) == f"{H}estion{A}"
    # not even the markers fit: the latest characters of the text
    assert data.fit_prompt(prompt, CharTok(), 10, report=report) == prompt[-10:]
    assert report.truncated == 4


def test_fit_prompt_counts_the_bos_the_model_reads():
    """The limit is on the query as the model reads it: [BOS] + x has one more token than x."""
    prompt = f"{H} hello{A}"
    assert data.fit_prompt(prompt, CharTok(bos=True), len(prompt) + 1) == prompt
    cut = data.fit_prompt(prompt, CharTok(bos=True), len(prompt))
    assert len(data.query_ids(cut, CharTok(bos=True))) == len(prompt) and cut == f"{H}hello{A}"
    with pytest.raises(DataError) as info:  # a limit that holds nothing but the BOS
        data.fit_prompt(prompt, CharTok(bos=True), 1, source="f.jsonl:3")
    assert (info.value.reason, info.value.line, info.value.field) == ("prompt_too_long", 3, "prompt")


def test_fit_example_truncated_prompt_and_responses_intact():
    prompt = f"{H} long old turn{A} ok.{H} new?{A}"
    report = DataReport()
    got = data.fit_example(prompt, (" yes", " no"), CharTok(), len(f"{H} new?{A}"), 5, source="f.jsonl:4",
                           report=report)
    assert got == (f"{H} new?{A}", [" yes", " no"]) and report.truncated == 1
    (rec,) = data.pair_records([PreferencePair(prompt, " yes", " no", "f.jsonl:4")], CharTok(), len(f"{H} new?{A}"), 5,
                               False, DataReport())
    assert rec == {"prompt": f"{H} new?{A}", "chosen": " yes", "rejected": " no", "source": "f.jsonl:4",
                   "uncut": prompt}  # the prompt as written: what keeps evaluation prompts out of training
    assert data.response_ids(rec["chosen"], CharTok()) == CharTok().encode(" yes") + [2]  # EOS ends every response


def test_fit_example_response_never_cut_for_training_dropped_and_counted():
    pairs = [PreferencePair("Q?", " short", " tiny", "f:1"),
             PreferencePair("Q?", " this one is far too long", " no", "f:2"),
             PreferencePair("Q?", " ok", " this rejected one too, far too long", "f:3")]
    report = DataReport()
    out = data.pair_records(pairs, CharTok(), 8, 7, False, report)
    assert [r["source"] for r in out] == ["f:1"] and out[0]["chosen"] == " short"  # 6 + EOS = 7: fits exactly
    assert report.dropped == {"response_too_long": 2} and report.first["response_too_long"] == "f:2"
    assert data.text_records([("", " far too long", "f:4")], CharTok(), 8, 7, False, report) == []
    assert report.dropped["response_too_long"] == 3
    # scoring cuts instead: the first tokens and the EOS, counted
    (rec,) = data.pair_records(pairs[1:2], CharTok(), 8, 7, False, report, cut=True)
    assert rec["chosen"] == " this " and len(data.response_ids(rec["chosen"], CharTok())) == 7
    assert report.truncated_responses == 1


def test_context_limits_fit_the_positions_prompt_first():
    assert data.context_limits(128, 64, 32, 512) == (128, 64, 32)   # fits: unchanged
    assert data.context_limits(128, 64, 32, None) == (128, 64, 32)
    assert data.context_limits(128, 64, 32, 128) == (64, 64, 32)     # the prompt gives way first
    assert data.context_limits(128, 64, 96, 128) == (64, 64, 64)     # down to half the context, then the responses
    assert data.context_limits(128, 64, 32, 48) == (24, 24, 24)
    for ctx in range(8, 300, 7):  # brute force: every result fits and never exceeds what was asked
        p, t, n = data.context_limits(128, 64, 32, ctx)
        assert p + max(t, n) <= ctx and p <= 128 and t <= 64 and n <= 32


def test_split_by_prompt_keeps_a_prompt_on_one_side():
    items = [("p" + str(i % 7), i) for i in range(40)]  # 7 prompts, several pairs each
    for seed in range(5):
        train, held = data.train_heldout_split(items, 0.3, seed, key=lambda x: x[0])
        assert {k for k, _ in train}.isdisjoint({k for k, _ in held}) and len(train) + len(held) == 40
        assert len({k for k, _ in held}) == 2  # round(0.3 · 7) prompts held out, with all their pairs
    distinct = [(str(i), i) for i in range(30)]  # every key distinct: the same cut as without a key
    assert data.train_heldout_split(distinct, 0.2, 3, key=lambda x: x[0]) == data.train_heldout_split(distinct, 0.2, 3)


def test_prompt_keys_find_a_transcript_inside_a_text_row():
    text = f"{H} a{A} b.{H} c{A} d."
    assert data.prompt_keys("", text) == {data.text_key(f"{H} a{A}"), data.text_key(f"{H} a{A} b.{H} c{A}")}
    assert data.prompt_keys(f"{H}  a {A}") == {data.text_key(f"{H} a{A}")}  # whitespace does not make it new
    respaced = text.replace("\n\n", "\n \n\t").upper()  # markers re-spaced and re-cased are still markers
    assert data.prompt_keys("", respaced) == data.prompt_keys("", text)


def test_text_key_one_key_for_spacing_and_case():
    prompt = f"{H} How do I bake Bread?{A}"
    for copy in (prompt.lower(), prompt.upper(), prompt.replace(" ", "   "), "  " + prompt.replace("\n\n", "\n") + " ",
                 prompt.replace("Bread", "BREAD").replace(" ", "\t")):
        assert data.text_key(copy) == data.text_key(prompt), copy
    assert data.text_key(prompt.replace("Bread", "Bead")) != data.text_key(prompt)


def test_first_turn_key_is_the_human_turn_a_conversation_opens_with():
    two = f"{H} Hi there.{A} Hello!{H} How do I bake bread?{A}"
    assert data.first_turn_key(two) == "hi there."
    assert data.first_turn_key(f"{H} Hi there.{A}") == data.first_turn_key(two.upper().replace("\n\n", " "))
    assert data.first_turn_key(f"System: be brief{H} Hi there.{A} Yes?") == "hi there."  # the system head aside
    assert data.first_turn_key("How do I bake bread?") == "how do i bake bread?"  # a plain prompt: one turn
    assert data.first_turn_key(f"{H}{A} Hello!") == data.text_key(f"{H}{A} Hello!")  # an empty turn: all of it
    # the split's groups: every prompt of one opening on one side
    items = [f"{H} Hi there.{A} Hello!{H} Q{i}?{A}" for i in range(6)] + [f"{H} Q{i}?{A}" for i in range(6)]
    train, held = data.train_heldout_split(items, 0.3, 0, key=data.first_turn_key)
    assert {data.first_turn_key(x) for x in train}.isdisjoint({data.first_turn_key(x) for x in held})


@pytest.mark.parametrize("row, kind, as_text", [  # as_text: the row + " An answer." as a {"text"} row
    (f"{H} How do I bake bread?{A}", "same_prompt", "same_prompt"),
    (f"\n\nhuman:   how do i BAKE bread?\n\nASSISTANT:", "same_prompt", "same_prompt"),   # re-spaced and re-cased
    (f"{H} How do I bake", "prefix", None),                                            # cut off at its end
    (f"{H} Hi there.{A} Hello!", "prefix", "prefix"),                                  # the opening of a longer one
    (f"{H} How do I bake bread?{A} Knead it.{H} And then?{A}", "first_turn", "same_prompt"),  # continued
    (f"{H} hi there.{A} Sure.{H} Something else?{A}", "first_turn", "prefix"),         # ... or taken elsewhere
    ("How do I bake bread?", "first_turn", None),                                      # its first turn, no markers
    (f"{H} How do I bake a cake?{A}", None, None),
    (f"{H} Bake bread?{A}", None, None)])
def test_evaluation_overlap_same_prompt_prefix_first_turn(row, kind, as_text):
    ev = data.Evaluation.of([f"{H} How do I bake bread?{A}", f"{H} Hi there.{A} Hello!{H} Where is the moon?{A}"])
    assert ev.overlap(data.trained_texts({"prompt": row, "uncut": row})) == kind
    assert ev.overlap(data.trained_texts({"prompt": "", "response": row + " An answer."})) == as_text


def test_trained_texts_compare_the_prompt_as_written_and_as_cut():
    rec = {"prompt": f"{H} Where is the moon?{A}", "uncut": f"{H} Hi.{A} Hello!{H} Where is the moon?{A}"}
    assert data.trained_texts(rec) == [rec["uncut"], rec["prompt"]]
    assert data.Evaluation.of([rec["prompt"]]).overlap(data.trained_texts(rec)) == "same_prompt"  # as cut
    assert data.Evaluation.of([f"{H} Hi.{A}"]).overlap(data.trained_texts(rec)) == "first_turn"     # as written
    assert data.uncut_prompt(rec) == rec["uncut"] and data.uncut_prompt({"prompt": "", "response": "T."}) == "T."


# ------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    words = "the cat sat on a mat while dog ran far away from home and back again".split()
    texts = [" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(6)) for i in range(300)]
    out = tmp_path_factory.mktemp("bpe")
    data.train_bpe_tokenizer(texts, out / "a", vocab_size=300)
    data.train_bpe_tokenizer(texts, out / "b", vocab_size=300)
    return out


def test_train_bpe_tokenizer_roundtrip_and_special_ids(bpe_dir):
    tok = data.load_tokenizer(bpe_dir / "a")  # goes through AutoTokenizer.from_pretrained
    assert len(tok) == 300
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    text = "the cat sat on a mat\n\nHuman: unseen wörds, 42!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: even unseen characters round-trip
    assert len(tok.encode("the cat sat on a mat", add_special_tokens=False)) < len("the cat sat on a mat")  # merges learned
    (rec,) = data.pair_records([PreferencePair("the cat", " sat", " ran", "x:1")], tok, 16, 16, False, DataReport())
    ids = data.response_ids(rec["chosen"], tok)
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == " sat"


def test_encode_many_gives_the_ids_of_encode_one_text_at_a_time(bpe_dir):
    tok = data.load_tokenizer(bpe_dir / "a")
    texts = ["the cat sat", "", " sat", "the cat sat", "wörds\n\nHuman: 42!", " ran far away"]
    assert tok.is_fast
    assert data.encode_many(texts, tok) == [tok.encode(t, add_special_tokens=False) for t in texts]
    rows = [("the cat", " sat"), ("the cat", " ran"), ("a dog", "")]
    encoded = data.encode_rows(rows, tok)
    assert encoded == [([tok.bos_token_id] + tok.encode(p, add_special_tokens=False),
                        tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]) for p, r in rows]
    pairs = [{"prompt": "the cat", "chosen": " sat", "rejected": " ran"}]
    for got, want in zip(data.pair_batch(pairs, tok), data.lm_batch([("the cat", " sat"), ("the cat", " ran")], tok)):
        assert torch.equal(got, want)


def test_shuffled_batches_are_epochs_of_one_seeded_shuffle():
    import random
    batches = list(data.shuffled_batches(10, 4, 7, seed=3))   # 28 indices: two epochs of 10, and 8 of a third
    rng = random.Random(3)
    stream = [i for _ in range(3) for i in rng.sample(range(10), 10)]
    assert [i for b in batches for i in b] == stream[:28]
    assert all(len(b) == 4 for b in batches) and sorted(stream[:10]) == list(range(10))


def test_minibatches_split_each_shuffled_batch_across_ranks_and_collate_it():
    """data.minibatches, the loop of SFT, the reward model and DPO: one process takes every shuffled_batches minibatch
    whole; W ranks take positions r, r + W, … of it, together the whole; each share is collated from its own rows."""
    encoded = [([1, 2 + i], [10 + i] * (1 + i % 3), [20 + i]) for i in range(10)]   # (query, chosen, rejected) ids
    want = list(data.shuffled_batches(10, 4, 5, seed=7))
    one = list(data.minibatches(encoded, 4, 5, 7, data.pair_batch_of_ids, 0, "cpu"))
    assert [idx for idx, *_ in one] == want
    for idx, *tensors in one:
        for got, expected in zip(tensors, data.pair_batch_of_ids([encoded[i] for i in idx], 0)):
            assert torch.equal(got, expected)
    ranks = [list(data.minibatches(encoded, 4, 5, 7, data.pair_batch_of_ids, 0, "cpu", rank=r, world=2))
             for r in range(2)]
    for k, idx in enumerate(want):
        assert ranks[0][k][0] == idx[0::2] and ranks[1][k][0] == idx[1::2]


def test_train_bpe_tokenizer_deterministic(bpe_dir):
    assert (bpe_dir / "a" / "tokenizer.json").read_bytes() == (bpe_dir / "b" / "tokenizer.json").read_bytes()


def test_load_tokenizer_missing_dir_or_files(tmp_path):
    with pytest.raises(DataError) as info:
        data.load_tokenizer(tmp_path / "no_model")
    assert info.value.reason == "no_tokenizer" and str(info.value).startswith(str(tmp_path / "no_model"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(DataError) as info:
        data.load_tokenizer(tmp_path / "model")
    assert info.value.reason == "no_tokenizer" and "no tokenizer files" in str(info.value)


# ------------------------------------------------------------------------- command line
def test_cli_guard_one_line_exit_2(capsys):
    def bad():
        raise DataError("d.jsonl", 7, "chosen", "empty_response", 'expected a non-empty string, got ""')

    with pytest.raises(SystemExit) as info:
        cli.cli_guard(bad)()
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: d.jsonl:7: field 'chosen': expected a non-empty string, got \"\"\n"

    def missing_model():
        open("/nonexistent/model/config.json")

    with pytest.raises(SystemExit) as info:
        cli.cli_guard(missing_model)()
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "/nonexistent/model/config.json" in err


def test_cli_bad_file_exits_2_one_line_no_traceback(tmp_path):
    p = write(tmp_path / "bad.jsonl", [GOOD, '{"prompt": "Q", "chosen": "a", "rejected": "a"}'])
    run = subprocess.run([sys.executable, "-m", "plumbing.data", str(p)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [f"error: {p}:2: field 'rejected': chosen and rejected responses are "
                                       "identical, so the pair carries no preference"]
    ok = subprocess.run([sys.executable, "-m", "plumbing.data", str(p), "--skip-bad"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "1 pairs" in ok.stdout and "identical 1" in ok.stdout


# ----------------------------------------------------------------------------------------------
# Sources through the `datasets` library: .json, .parquet, save_to_disk folders, hub ids in the local cache
# ----------------------------------------------------------------------------------------------
def test_every_source_gives_the_same_pairs_and_names_bad_rows(tmp_path):
    import datasets
    rows = [{"prompt": f"Q{i}?", "chosen": f" yes {i}.", "rejected": f" no {i}."} for i in range(5)]
    bad = rows[:2] + [{"prompt": "Q?", "chosen": " same.", "rejected": " same."}] + rows[2:]
    ds = datasets.Dataset.from_list(rows)
    write(tmp_path / "p.jsonl", rows)
    (tmp_path / "p.json").write_text(json.dumps(rows))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(str(tmp_path / "splits"))
    want = [(p.prompt, p.chosen, p.rejected) for p in data.load_pairs(tmp_path / "p.jsonl")]
    for src in [tmp_path / "p.json", tmp_path / "p.parquet", tmp_path / "folder", tmp_path / "splits"]:
        got = data.load_pairs(data.source(str(src)))
        assert [(p.prompt, p.chosen, p.rejected) for p in got] == want, src
    test = data.load_pairs(data.source(str(tmp_path / "splits"), split="test"))
    assert len(test) == 2 and test[0].source == f"{tmp_path / 'splits'}[test]:1"
    with pytest.raises(DataError, match="no split 'dev'"):
        data.load_pairs(data.source(str(tmp_path / "splits"), split="dev"))
    datasets.Dataset.from_list(bad).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError) as info:  # the file and the row, as for a .jsonl line
        data.load_pairs(data.source(str(tmp_path / "bad.parquet")))
    assert (info.value.reason, info.value.line) == ("identical", 3)
    assert str(info.value).startswith(f"{tmp_path / 'bad.parquet'}[train]:3: ")
    report = DataReport()
    assert len(data.load_pairs(data.source(str(tmp_path / "bad.parquet")), skip_bad=True, report=report)) == 5
    assert report.skipped == {"identical": 1}


def test_a_hub_dataset_not_on_this_machine_is_one_line_without_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError) as info:
        data.load_pairs(data.source("someone/not-cached", split="test"))
    msg = str(info.value)
    assert info.value.reason == "not_found" and "\n" not in msg and msg.startswith("someone/not-cached[test]: ")
    assert "load_dataset('someone/not-cached', split='test')" in msg
    with pytest.raises(DataError, match="no such file"):  # a path-like name is never taken for a hub id
        data.load_pairs(data.source("./missing.parquet"))


def test_a_broken_json_or_parquet_file_is_one_line_with_where_it_breaks(tmp_path, capsys):
    """datasets says only "An error occurred while generating the dataset" (and logs an ArrowInvalid line before it):
    the line and column of a broken .json, the innermost reason for anything else, and nothing else on stderr."""
    broken = tmp_path / "d.json"
    broken.write_text('[{"prompt": "x", "chosen": "a", "rejected": "b"},\n {"prompt": 3')
    with pytest.raises(DataError) as info:
        data.load_pairs(str(broken))
    assert (info.value.line, info.value.reason) == (2, "not_json") and "column 14" in str(info.value)
    fake = tmp_path / "d.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match="magic bytes"):
        data.load_pairs(str(fake))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("pad_id", [None, 0, 7])
def test_pad_puts_every_row_at_its_side_and_the_mask_says_which_tokens_are_real(side, pad_id):
    import torch
    rows = [[5, 6, 7], [9], [], [1, 2, 3, 4, 8]]
    ids, mask = data.pad(rows, pad_id, side)
    assert ids.dtype == torch.long and mask.dtype == torch.get_default_dtype() and ids.shape == mask.shape == (4, 5)
    fill = 0 if pad_id is None else pad_id
    for i, row in enumerate(rows):  # element by element, against the row as written
        start = 5 - len(row) if side == "left" else 0
        for j in range(5):
            real = start <= j < start + len(row)
            assert mask[i, j].item() == (1.0 if real else 0.0)
            assert ids[i, j].item() == (row[j - start] if real else fill)
    one, one_mask = data.pad([[3, 4]], None, side)  # nothing to pad
    assert one.tolist() == [[3, 4]] and one_mask.tolist() == [[1.0, 1.0]]


def test_json_lines_in_a_json_file_name_the_bad_line_and_its_column(tmp_path):
    """A .json file holding JSON Lines with a broken line: that line and the column of the error on it (not "line 2
    column 1", where the whole file stops parsing as one JSON value)."""
    good = {"chosen": f"{H} hi{A} yo", "rejected": f"{H} hi{A} no"}
    path = write(tmp_path / "pairs.json", [good, '{"chosen": "ab" "rejected": "x"}'])
    with pytest.raises(DataError, match=r"pairs.json:2: line is not JSON \(Expecting ',' delimiter at column 17\)"):
        data.load_pairs(str(path))
    path = write(tmp_path / "tab.jsonl", [good, '{"chosen": "a\tb", "rejected": "x"}'])
    with pytest.raises(DataError, match=r"tab.jsonl:2: line is not JSON \(Invalid control character at column 14\)"):
        data.load_pairs(str(path))


@pytest.mark.parametrize("row, flag", [({"prompt": "hello there"}, "--prompts"),
                                       ({"prompt": "hello", "completion": "hi"}, "--sft-data"),
                                       ({"prompt": "hello", "response": "hi"}, "--sft-data")])
def test_a_prompt_or_sft_file_given_as_pairs_says_which_flag_takes_it(tmp_path, row, flag):
    path = write(tmp_path / "rows.jsonl", [row])
    with pytest.raises(DataError, match=f"goes to {flag} \\(beside --data PAIRS\\)$"):
        data.load_pairs(str(path))


def test_a_cut_prompt_names_the_first_and_the_longest_where_they_are(tmp_path):
    report = DataReport()
    long, longer = f"{H} {'word ' * 20}{A}", f"{H} {'word ' * 2000}{A}"
    for text, where in ((f"{H} short{A}", "a.jsonl:1"), (long, "a.jsonl:2"), (longer, "a.jsonl:7")):
        data.fit_prompt(text, CharTok(), 40, source=where, report=report)
    assert report.truncated == 2
    assert "truncated 2 prompts (first at a.jsonl:2; the longest, " in report.summary()
    assert f"the longest, {len(longer)} tokens, at a.jsonl:7)" in report.summary(), report.summary()


def test_the_closing_data_line_counts_the_pairs_as_the_first_line_did():
    """The run's last [data] line repeats the pairs' counts of its first one; what --sft-data or --prompts dropped
    later is said beside them, not folded into --data's own count."""
    from plumbing.pipeline import closing_data_line
    first = "kept 10; skipped 0; truncated 0 prompts; dropped 0"
    later = "kept 10; skipped 0; truncated 0 prompts; dropped 88: response_too_long 88 (first at sft.jsonl:3)"
    assert closing_data_line("pairs.jsonl", {"summary": first, "pairs_summary": first}) == f"[data] pairs.jsonl: {first}"
    line = closing_data_line("pairs.jsonl", {"summary": later, "pairs_summary": first})
    assert line == f"[data] pairs.jsonl: {first} (with --sft-data / --prompts: {later})"
