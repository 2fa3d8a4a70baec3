"""Real data in, clear errors out: HH-RLHF and JSONL loaders, prompt truncation, tokenizers.

Every bad input becomes a `DataError` that names the file, the line and the field and says what was
expected; `cli_guard` turns it into one line `error: …` on stderr and exit status 2 (no traceback).
With `skip_bad=True` bad lines are skipped and counted by reason in a `DataReport` instead.

Implements (the data behind the paper's equations; data.py itself computes none):
    load_pairs          the preference pairs (x, y_w, y_l) of the reward-model loss        (Eq. 1–2)
    split_hh_transcript x = shared prefix up to and including the last "\\n\\nAssistant:"  (HH-RLHF)
    load_prompts        the prompts x that PPO samples responses for                         (Eq. 3, 15)
    load_texts          SFT text and D_pretrain of PPO-ptx                                    (Eq. 17)
    Chat / read_messages / row_format
                        a conversation kept as its messages until a template renders it; the
                        messages as written, checked; the format of a row, for the report
    train_heldout_split the seeded split; with a key, every pair of one group (a conversation's first
                        human turn, first_turn_key) on one side
    fit_example         THE truncation rule for every text a model sees (SFT, reward model, judge,
                        ptx, PPO and evaluation prompts): the query ([BOS] or chat template + x)
                        keeps ≤ P tokens, latest turns first (fit_prompt); a response with its stop
                        token ≤ T tokens, else dropped and counted, or cut when scoring (fit_response)
    context_limits      P, T and the sampled length N lowered to fit a model's positions
    pair_records / text_records / prompt_records
                        fit_example applied once, kept as text records for the stages
    text_key / first_turn_key / prompt_keys / Evaluation / distinct_prompts
                        what "the same prompt" means when training and evaluation are kept apart: one
                        key (whitespace and case), read on the text as written, before any cut
    token_ids / query_ids / response_ids / chat_ids / pad / lm_batch(_of_ids) / pair_batch(_of_ids)
                        the model's inputs: [BOS] + x (left-padded for sampling), x + y + [EOS]
                        (right-padded for SFT, Eq. 2 and ptx), or the chat template's rendering of the
                        messages; padding is known by the mask only
    encode_rows / encode_pairs / shuffled_batches / minibatches
                        a data set encoded once (one batch call of the tokenizer), the seeded
                        minibatches of row indices, and the loop SFT, the reward model and DPO
                        read them with (this rank's share of each, collated, on the device)
    train_bpe_tokenizer byte-level BPE trained with `tokenizers` on the training split, saved as a
                        Hugging Face tokenizer directory
    load_tokenizer      AutoTokenizer.from_pretrained with a clear error

Formats (every type of TRL's "Dataset formats and types" page, standard and conversational, detected per row and
named once per file in the DataReport; docs/real-data.md has one example line of each):
    preference      {"prompt", "chosen", "rejected"} strings or messages (explicit prompt); {"chosen", "rejected"}
                    (implicit prompt): HH-RLHF transcripts (the prompt through the last "\\n\\nAssistant:"), messages
                    (every message but the last answer), or plain strings (the words they share before they differ)
    prompt-only     {"prompt"}: a string or messages (PPO prompts; every type with a prompt gives its prompts)
    prompt-completion {"prompt", "completion"} (also {"prompt", "response"} and the demonstration {"prompt",
                    "chosen"}): SFT / ptx text
    language modelling {"text"} (all of it the response) or {"messages"} (the last assistant turn the response)
    Refused in one line: unpaired preference ({"prompt", "completion", "label"}) and stepwise supervision as pairs or
    SFT text, tool calls and tool results, roles other than system / user / assistant, content in parts (images).
    Lines of a .jsonl or .jsonl.gz file are read here; .json, .parquet, save_to_disk folders and cached hub datasets
    through `datasets`.

A conversation stays messages until a tokenizer renders it: a Chat is the str of the conversation in this project's
format ("System: …\\n\\nHuman: …\\n\\nAssistant:", what a tokenizer without a chat template reads, and what keys and
logs compare) that keeps its messages, which a chat template renders (query_ids, response_ids).

Conventions (one choice, used everywhere):
    - A response is kept exactly as written, leading space included: for an HH transcript
      prompt + response == transcript, character for character (byte-level BPE then tokenizes
      " Sure" as it would inside the transcript). "Empty" and "identical" compare after .strip().
    - Text is text: a special token's spelling inside the data ("</s>", "<pad>", "<|im_end|>") is encoded as
      ordinary text (encode_many: split_special_tokens; a chat template's rendering: sanitize_control_tokens). The
      control tokens are only those the project or the template writes: the BOS, the template's markers, the stop
      token that ends every response.
    - Token ids come from tokenizer.encode(text, add_special_tokens=False) (encode_many: for a fast tokenizer the
      same ids from one call of its batch encoder); query_ids adds the BOS (or renders the chat template with the
      assistant's turn opened), response_ids the stop token (EOS; with a template, the answer as the template writes
      it, through its end-of-turn token).
    - Limits count what the model reads: len(query_ids(x)) ≤ max_prompt_tokens (BOS / template
      included) and len(response_ids(y)) ≤ max_response_tokens, so a sequence has at most P + T
      tokens. A too-long prompt drops whole earliest "\\n\\nHuman:" turns (a conversation's system message stays),
      then keeps the latest tokens of its last turn between that turn's markers (report.truncated). A too-long
      response is never cut for training: the example is dropped and counted (report.dropped["response_too_long"]);
      scoring (cut=True) keeps its first tokens instead (report.truncated_responses).

Run: python -m plumbing.data data/hh-rlhf/harmless-base-test.dev.jsonl.gz --skip-bad
References: Bai et al. 2022, "Training a Helpful and Harmless Assistant with RLHF" (HH-RLHF,
github.com/anthropics/hh-rlhf); Zheng et al. 2023, "Secrets of RLHF in LLMs Part I: PPO" (arXiv 2307.04964).
"""
from __future__ import annotations

import bisect
import gzip
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from plumbing.cli import OneLineParser, UserError, cli_guard

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


# ----------------------------------------------------------------------------------------------
# Errors and counts
# ----------------------------------------------------------------------------------------------
class DataError(UserError):
    """A user's data problem: str() is one line `path:line: field 'f': message`.

    reason is a short machine key (not_found, empty_file, bad_gzip, not_utf8, not_json, not_object,
    missing_field, not_string, empty_response, empty_prompt, identical, no_assistant_marker, no_shared_prompt,
    prompt_mismatch, bad_messages, bad_role, bad_content, tool_calls, images, unpaired, stepwise, prompt_too_long,
    chat_template, special_token, all_skipped, too_few_prompts, no_tokenizer).
    """

    def __init__(self, path, line: int | None, field: str | None, reason: str, message: str):
        self.path, self.line, self.field, self.reason = str(path), line, field, reason
        self.message = message.replace("\n", " ")
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        what = self.message if self.field is None else f"field '{self.field}': {self.message}"
        return f"{where}: {what}"

    @property
    def source(self) -> str:
        return self.path if self.line is None else f"{self.path}:{self.line}"


@dataclass
class DataReport:
    """What happened to the examples of one file; print `summary()`, save `to_dict()`."""

    kept: int = 0                                           # lines loaded
    skipped: Counter = field(default_factory=Counter)       # reason → lines skipped (skip_bad)
    truncated: int = 0                                      # prompts shortened to fit (latest turns kept)
    truncated_responses: int = 0                            # responses cut to fit (scoring only; training drops)
    dropped: Counter = field(default_factory=Counter)       # reason → examples dropped when encoding
    first: dict = field(default_factory=dict)               # reason → "file:line" where it first happened
    formats: dict = field(default_factory=dict)             # file → Counter(format (row_format) → rows kept)
    pairs_summary: str = ""                                 # summary() once --data's pairs are encoded
    longest_cut: tuple = (0, "")                            # (query tokens, "file:line") of the longest cut prompt

    def saw(self, path, fmt: str) -> None:
        self.formats.setdefault(str(path), Counter())[fmt] += 1

    def format_summary(self) -> str:
        """The format detected in each file, once per file: "format conversational preference (explicit prompt)";
        with several files "formats a.jsonl = …, b.jsonl = …"; a file of mixed rows "… 100 + … 20"."""
        def kinds(c: Counter) -> str:
            return next(iter(c)) if len(c) == 1 else " + ".join(f"{k} {n}" for k, n in c.most_common())
        if len(self.formats) == 1:
            return f"format {kinds(next(iter(self.formats.values())))}"
        return "formats " + ", ".join(f"{path} = {kinds(c)}" for path, c in self.formats.items())

    def skip(self, err: DataError) -> None:
        self.skipped[err.reason] += 1
        self.first.setdefault(err.reason, err.source)

    def drop(self, reason: str, source: str) -> None:
        self.dropped[reason] += 1
        self.first.setdefault(reason, source)

    def summary(self) -> str:
        def by_reason(c: Counter) -> str:
            return ", ".join(f"{r} {n} (first at {self.first.get(r, '?')})" for r, n in sorted(c.items()))
        parts = ([self.format_summary()] if self.formats else []) + [f"kept {self.kept}"]
        parts.append(f"skipped {sum(self.skipped.values())}" + (f": {by_reason(self.skipped)}" if self.skipped else ""))
        where = [f"first at {self.first['truncated']}"] if self.first.get("truncated") else []
        if self.longest_cut[1] and self.longest_cut[1] != self.first.get("truncated"):
            where.append(f"the longest, {self.longest_cut[0]} tokens, at {self.longest_cut[1]}")
        elif self.longest_cut[1]:
            where[-1] += f", the longest, {self.longest_cut[0]} tokens"
        parts.append(f"truncated {self.truncated} prompts" + (f" ({'; '.join(where)})" if where and self.truncated
                                                              else "")
                     + (f" and {self.truncated_responses} responses" if self.truncated_responses else ""))
        parts.append(f"dropped {sum(self.dropped.values())}" + (f": {by_reason(self.dropped)}" if self.dropped else ""))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(self.skipped), "truncated": self.truncated,
                "truncated_responses": self.truncated_responses, "dropped": dict(self.dropped),
                "first": dict(self.first), "formats": {path: dict(c) for path, c in self.formats.items()}}


def _show(value, limit: int = 40) -> str:
    """A short one-line JSON rendering of a bad value for an error message."""
    s = json.dumps(value, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 4] + "…" + s[-3:]


show = _show  # the same, for the messages of other modules (pipeline's split)


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null", str: "a string"}.get(type(value), type(value).__name__)


def _split_source(source: str) -> tuple[str, int | None]:
    path, _, line = source.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else (source, None)


# ----------------------------------------------------------------------------------------------
# Reading JSONL
# ----------------------------------------------------------------------------------------------
def read_jsonl(path, skip_bad: bool = False, report: DataReport | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line of a .jsonl or .jsonl.gz file (1-based)."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, None, None, "not_found", "no such file")
    if path.is_dir():
        raise DataError(path, None, None, "not_found", "is a directory, expected a .jsonl or .jsonl.gz file")
    return _read_jsonl(path, skip_bad, report if report is not None else DataReport())


def _read_jsonl(path: Path, skip_bad: bool, report: DataReport) -> Iterator[tuple[int, dict]]:
    gz = path.suffix == ".gz"
    n_lines = 0
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        line_no = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
                raise DataError(path, None, None, "bad_gzip", f"not a readable gzip file ({e})") from None
            if not raw:
                break
            line_no += 1
            if not raw.strip():
                continue
            n_lines += 1
            try:
                obj = _parse_line(path, line_no, raw)
            except DataError as err:
                if not skip_bad:
                    raise
                report.skip(err)
                continue
            yield line_no, obj
    if n_lines == 0:
        raise DataError(path, None, None, "empty_file", "file is empty (no JSON lines)")


def json_error(e: json.JSONDecodeError) -> str:
    """json's error as `what at column N` (the column of its line)."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def _parse_line(path: Path, line_no: int, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, line_no, None, "not_utf8",
                        f"bytes that are not UTF-8 at byte {e.start + 1} of the line (save the file as UTF-8)") from None
    if line_no == 1:
        text = text.lstrip("\ufeff")  # a UTF-8 byte-order mark is harmless
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(path, line_no, None, "not_json", f"line is not JSON ({json_error(e)})") from None
    if not isinstance(obj, dict):
        raise DataError(path, line_no, None, "not_object", f"expected a JSON object {{...}}, got {_type_name(obj)}")
    if "\\ud" in text.lower():  # a \ud800-\udfff escape is half of a UTF-16 pair: json.loads joins whole pairs only
        for key, value in obj.items():
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(path, line_no, key, "not_utf8", "a lone \\ud800-\\udfff escape, half of a UTF-16 "
                                                                "surrogate pair and not a character") from None
    return obj


def _get_str(obj: dict, key: str, path, line_no: int, nonempty: bool = False, reason: str = "empty_response") -> str:
    if key not in obj:
        have = ", ".join(repr(k) for k in obj) or "none"
        raise DataError(path, line_no, key, "missing_field", f"missing (fields present: {have})")
    value = obj[key]
    if not isinstance(value, str):
        got = "null" if value is None else f"{_type_name(value)} {_show(value)}"
        raise DataError(path, line_no, key, "not_string", f"expected a string, got {got}")
    if nonempty and not value.strip():
        raise DataError(path, line_no, key, reason, f"expected a non-empty string, got {_show(value)}")
    return value


FILE_SUFFIXES = (".jsonl", ".gz", ".json", ".parquet")


@dataclass(frozen=True)
class Source:
    """Records through the `datasets` library: a .json or .parquet file, a `Dataset.save_to_disk` folder, or a hub
    dataset id already in the local Hugging Face cache (never downloaded), with its split and config. str() names it
    in error messages as `<id or path>[<split>]`, and the row number follows it as a line number does a file."""
    path: str
    split: str = "train"
    config: str | None = None

    def __str__(self) -> str:
        return f"{self.path}[{self.split}]"


def source(path: str, split: str = "train", config: str | None = None):
    """What --data names: a .jsonl[.gz] file as itself (read line by line here, with line numbers), anything else
    (.json, .parquet, a save_to_disk folder, a hub id) as a Source read through `datasets`."""
    p = Path(path)
    if p.suffix in (".jsonl", ".gz") or (p.is_file() and p.suffix not in (".json", ".parquet")):
        return path
    return Source(str(path), split, config)


def fingerprint(src) -> dict:
    """What identifies the data a cached stage was built from: a file's path, size and mtime; a folder's files; a
    hub id with its split and config (its cached revision does not change under us: nothing is downloaded)."""
    path = Path(src.path if isinstance(src, Source) else src)
    if path.is_file():
        stat = path.stat()
        info = {"path": str(path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime}
    elif path.is_dir():
        info = {"path": str(path.resolve()), "files": {str(p.relative_to(path)): [p.stat().st_size, p.stat().st_mtime]
                                                      for p in sorted(path.rglob("*")) if p.is_file()}}
    else:
        info = {"hub_id": str(path)}
    if isinstance(src, Source):
        info.update(split=src.split, config=src.config)
    return info


def looks_like_a_path(path: str) -> bool:
    """A name that can only be a local file or folder (so it must exist), not a hub dataset id like org/name."""
    return Path(path).suffix in FILE_SUFFIXES or str(path).startswith((".", "/", "~"))


def _dataset_rows(src: Source) -> Iterator[tuple[int, dict]]:
    """(row number from 1, row) of a Source; a missing or unreadable one is a DataError in one line."""
    import datasets
    import huggingface_hub.constants
    datasets.config.HF_DATASETS_OFFLINE = True  # a hub id must already be on this machine: never a download
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # what fails is said once, below, as one line
    datasets.disable_progress_bars()
    p = Path(src.path)
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(src, None, None, "no_split", f"no split {src.split!r} (it has {', '.join(ds)}); "
                                                                 f"pass --data-split")
                ds = ds[src.split]
        elif p.is_file():
            ds = datasets.load_dataset("parquet" if p.suffix == ".parquet" else "json", data_files=str(p),
                                       split="train")
        elif looks_like_a_path(src.path):
            raise DataError(src.path, None, None, "not_found", "no such file or folder")
        else:
            ds = datasets.load_dataset(src.path, name=src.config, split=src.split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001  (datasets raises many kinds; each is the user's file or id)
        if p.is_file() and p.suffix == ".json":  # where a JSON file breaks, which datasets does not say
            try:
                json.loads(p.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as bad:
                where = getattr(bad, "lineno", None)
                if getattr(bad, "msg", "") == "Extra data":  # JSON Lines in a .json file: its first bad line
                    for line_no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                        if line.strip():
                            _parse_line(p, line_no, line.encode())
                else:
                    raise DataError(src.path, where, None, "not_json", "not JSON (" + (
                        json_error(bad) if where else str(bad)) + ")") from None
        while e.__cause__ is not None or e.__context__ is not None:  # the innermost error says what went wrong
            e = e.__cause__ or e.__context__
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        hint = "" if p.exists() else (f"; it is not a local file or folder, nor a dataset in the local Hugging Face "
                                      f"cache: on a machine with network, run `python -c \"import datasets; "
                                      f"datasets.load_dataset('{src.path}', split='{src.split}')\"` once, or pass a "
                                      f"file")
        raise DataError(src, None, None, "not_found" if not p.exists() else "unreadable",
                        f"cannot read it ({first}){hint}") from None
    if len(ds) == 0:
        raise DataError(src, None, None, "empty_file", "no rows")
    for i, row in enumerate(ds):
        yield i + 1, dict(row)


def records(path, skip_bad: bool = False, report: DataReport | None = None) -> Iterator[tuple[int, dict]]:
    """(line or row number, object) of a .jsonl[.gz] file (read_jsonl) or of a Source (datasets)."""
    src = source(path) if isinstance(path, (str, Path)) else path
    return _dataset_rows(src) if isinstance(src, Source) else read_jsonl(src, skip_bad, report)


def _load(path, parse: Callable, skip_bad: bool, report: DataReport | None) -> list:
    report = report if report is not None else DataReport()
    out = []
    for line_no, obj in records(path, skip_bad, report):
        try:
            out.append(parse(obj, path, line_no))
        except DataError as err:
            if not skip_bad:
                raise
            report.skip(err)
            continue
        report.kept += 1
        report.saw(path, row_format(obj))
    if not out:
        raise DataError(path, None, None, "all_skipped",
                        f"no usable lines ({sum(report.skipped.values())} skipped: {report.summary()})")
    return out


# ----------------------------------------------------------------------------------------------
# Chat messages: a conversation kept as its messages until a tokenizer renders it
# ----------------------------------------------------------------------------------------------
SYSTEM = "System:"
ROLES = ("system", "user", "assistant")
MESSAGE_FIELDS = ("role", "content")


def conversation_text(messages) -> str:
    """Messages in this project's conversation format, what a tokenizer without a chat template reads: a first system
    message as "System: …", then "\\n\\nHuman: …" and "\\n\\nAssistant: …" turns, the contents as written; a
    conversation that ends with the user's turn opens the assistant's ("\\n\\nAssistant:"); one assistant message
    alone (an answer) is " " + its content, as an HH response is written after its prompt."""
    if len(messages) == 1 and messages[0]["role"] == "assistant":
        return " " + messages[0]["content"]
    text = "".join(f"{SYSTEM} {m['content']}" if m["role"] == "system" else
                   f"{HUMAN if m['role'] == 'user' else ASSISTANT} {m['content']}" for m in messages)
    return text + ASSISTANT if messages[-1]["role"] == "user" else text


class Chat(str):
    """Text read from chat messages that keeps them: the str is the conversation in this project's format
    (conversation_text), which a tokenizer without a chat template reads and every key, log and record compares and
    shows; `messages` (role and content each) are what a chat template renders (query_ids: a prompt, the assistant's
    turn opened; response_ids: one assistant message, an answer). Equal to its text and hashed as it; where two
    conversations of one text must stay apart (counts, query ids), chat_key tells them apart. Written to JSON it is
    its text (as_row writes a prompt's messages)."""

    messages: tuple

    def __new__(cls, messages):
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
        self = super().__new__(cls, conversation_text(messages))
        self.messages = messages
        return self

    def __reduce__(self):  # pickle and copy rebuild it from its messages
        return Chat, (list(self.messages),)


def chat_key(text: str):
    """A key that tells apart two Chats of one text whose messages differ (the text itself for any other str)."""
    return (str(text), json.dumps(text.messages)) if isinstance(text, Chat) else text


def messages_of(prompt: str) -> list[dict]:
    """The messages a chat template renders for a prompt: a Chat's own, or an HH prompt's (hh_to_messages)."""
    return [dict(m) for m in prompt.messages] if isinstance(prompt, Chat) else hh_to_messages(prompt)


def answer_content(response: str) -> str:
    """The assistant message's content a chat template renders for a response: a Chat's own, as written; a response
    read as text, stripped (as hh_to_messages strips every turn)."""
    return response.messages[-1]["content"] if isinstance(response, Chat) else response.strip()


def as_row(record: dict) -> dict:
    """A record as a JSON row that the loaders read back the same: a Chat prompt as its messages (a conversational
    prompt-only row), every other field as it is (a Chat as its text)."""
    return {k: list(v.messages) if k == "prompt" and isinstance(v, Chat) else v for k, v in record.items()}


def _given(value) -> bool:
    """A field that holds something: datasets fills a column a row lacks with None (or an empty list)."""
    return value is not None and value != [] and value != ""


def read_messages(value, path, line_no: int | None, field: str, last: str) -> list[dict]:
    """Chat messages as written, checked: a non-empty list of {"role": "system"|"user"|"assistant", "content": text},
    a system message only first, the last message `last`'s ("user" for a prompt, "assistant" for an answer or a
    whole conversation). What cannot be read exactly is a DataError naming the message and its field: a tool call
    or a tool's result, another role, content in parts (text and images), any other field of a message (it would be
    lost). Fields that hold None (datasets' filler for a column a row lacks) are absent."""
    if not isinstance(value, list) or not value:
        raise DataError(path, line_no, field, "bad_messages", f'expected a non-empty list of messages [{{"role": '
                        f'..., "content": ...}}], got {_type_name(value)} {_show(value)}')
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(path, line_no, where, "bad_messages", f'expected a message {{"role": ..., "content": '
                            f'...}}, got {_type_name(m)} {_show(m)}')
        extra = [k for k, v in m.items() if k not in MESSAGE_FIELDS and _given(v)]
        if "tool_calls" in extra or m.get("role") == "tool":
            raise DataError(path, line_no, f"{where}.{'tool_calls' if 'tool_calls' in extra else 'role'}",
                            "tool_calls", "a tool call or a tool's result: only text turns (system, user, assistant) "
                                          "are read here, so this conversation cannot be rendered as written")
        if extra:
            raise DataError(path, line_no, f"{where}.{extra[0]}", "bad_messages",
                            f"a message field other than 'role' and 'content' ({_show(m[extra[0]])}): it would be lost")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise DataError(path, line_no, f"{where}.role", "missing_field", "missing: expected 'system', 'user' or "
                                                                             "'assistant'")
        if role not in ROLES:
            raise DataError(path, line_no, f"{where}.role", "bad_role", f"role {_show(role)} is not 'system', 'user' "
                            "or 'assistant': a conversation here has no place for it, nor need a chat template")
        if role == "system" and i > 0:
            raise DataError(path, line_no, f"{where}.role", "bad_role", "a system message after the first: a "
                                                                       "conversation here has one, first")
        if isinstance(content, list):
            raise DataError(path, line_no, f"{where}.content", "bad_content", "content in parts (text, images): only "
                                                                             "text content is read")
        if not isinstance(content, str):
            raise DataError(path, line_no, f"{where}.content", "not_string" if content is not None else
                            "missing_field", f"expected a string, got {_type_name(content)} {_show(content)}")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != last:
        what = "the user's question" if last == "user" else "the assistant's answer"
        raise DataError(path, line_no, f"{field}[{len(out) - 1}].role", "bad_messages",
                        f"expected the last message to be {what}, got a {out[-1]['role']} message")
    return out


def _prompt_messages(messages: list[dict], path, line_no: int | None, field: str) -> Chat:
    """A prompt's messages (ending with the user's turn, whose question is not empty) as a Chat."""
    if not messages or messages[-1]["role"] != "user":
        got = f"a {messages[-1]['role']} message" if messages else "nothing"
        raise DataError(path, line_no, field, "bad_messages", f"expected the conversation before the answer to end "
                                                              f"with the user's question, got {got}")
    if not messages[-1]["content"].strip():
        raise DataError(path, line_no, f"{field}[{len(messages) - 1}].content", "empty_prompt",
                        f"expected the user's question, got {_show(messages[-1]['content'])}")
    return Chat(messages)


def _answer(obj: dict, name: str, path, line_no: int) -> Chat:
    """An answer written as messages ([{"role": "assistant", "content": ...}]) as a Chat of that one message."""
    if name not in obj:
        raise DataError(path, line_no, name, "missing_field", f"missing (fields present: "
                                                              f"{', '.join(repr(k) for k in obj) or 'none'})")
    msgs = read_messages(obj[name], path, line_no, name, last="assistant")
    if len(msgs) != 1:
        raise DataError(path, line_no, name, "bad_messages", f"expected the answer as one assistant message, got "
                                                             f"{len(msgs)} messages")
    return Chat(msgs)


def _conversation(obj: dict, name: str, path, line_no: int) -> tuple[Chat, Chat]:
    """(prompt, answer) of a whole conversation written as messages ({"messages"}, an implicit-prompt side): the last
    message is the assistant's answer, every message before it the prompt."""
    msgs = read_messages(obj.get(name), path, line_no, name, last="assistant")
    return _prompt_messages(msgs[:-1], path, line_no, name), Chat(msgs[-1:])


def row_format(obj: dict) -> str:
    """The format of one row in the words of TRL's "Dataset formats and types" page ("standard" or
    "conversational", then its type), or this project's own: "HH-RLHF transcripts", "prompt-response", the
    "demonstration {prompt, chosen}". A prompt of the other format than the answers is set aside, as TRL does."""
    conv = any(isinstance(obj.get(k), list) for k in ("prompt", "chosen", "rejected", "completion", "messages"))
    style = "conversational" if conv else "standard"
    if "completions" in obj:
        return f"{style} stepwise supervision"
    if "label" in obj and "completion" in obj:
        return f"{style} unpaired preference"
    if "chosen" in obj or "rejected" in obj:
        if "rejected" not in obj and "prompt" in obj:
            return "demonstration {prompt, chosen}"
        explicit = "prompt" in obj and isinstance(obj["prompt"], list) == conv
        if not explicit and not conv and any(_hh_like(obj.get(k)) for k in ("chosen", "rejected")):
            return "HH-RLHF transcripts (standard preference, implicit prompt)"
        return f"{style} preference ({'explicit' if explicit else 'implicit'} prompt)"
    if "completion" in obj:
        return f"{style} prompt-completion"
    if "response" in obj:
        return "prompt-response"
    if "messages" in obj or "text" in obj:
        return f"{style} language modeling"
    return f"{style} prompt-only" if "prompt" in obj else "unknown"


def _refuse_unreadable(obj: dict, path, line_no: int, pairs_or_texts: bool) -> None:
    """Row fields that change what a model reads but are not rendered here (tool definitions, images), and, for
    pairs and SFT text, the types that are neither: one completion marked good or bad, or labelled steps."""
    for name, reason, what in (("tools", "tool_calls", "tool definitions: only text turns are read here, so the "
                                                        "conversation cannot be rendered as written"),
                               ("images", "images", "images: only text is read here")):
        if _given(obj.get(name)):
            raise DataError(path, line_no, name, reason, what)
    if not pairs_or_texts:
        return
    if "completions" in obj:
        raise DataError(path, line_no, "completions", "stepwise", "stepwise supervision (labelled steps): not pairs "
                                                                  "of answers, nor one answer to train on")
    if "label" in obj and "completion" in obj:
        raise DataError(path, line_no, "label", "unpaired", "unpaired preference data (one completion marked good or "
                        "bad): the reward model learns from pairs of answers to one prompt (Eq. 2), and SFT would "
                        "learn the bad ones too; pair them, or keep the rows labelled true without 'label' as SFT text")


# ----------------------------------------------------------------------------------------------
# Preference pairs, prompts, texts
# ----------------------------------------------------------------------------------------------
@dataclass
class PreferencePair:
    """One comparison: prompt x, chosen response y_w, rejected response y_l (Eq. 1). Read from messages, each is a
    Chat (its messages kept for a chat template)."""

    prompt: str
    chosen: str
    rejected: str
    source: str = "file:line"


def split_hh_transcript(chosen: str, rejected: str, path="<transcript>",
                        line: int | None = None) -> tuple[str, str, str]:
    """(prompt, chosen_response, rejected_response) of two HH-RLHF transcripts.

    prompt = everything up to and including the last "\\n\\nAssistant:" (earlier turns keep their role
    markers); a response is what follows, leading space kept, so prompt + response == transcript.
    """
    cut = {}
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        i = text.rfind(ASSISTANT)
        if i < 0:
            raise DataError(path, line, name, "no_assistant_marker",
                            f'expected an HH transcript containing "\\n\\nAssistant:", got {_show(text)}')
        cut[name] = i + len(ASSISTANT)
    prompt, prompt_r = chosen[: cut["chosen"]], rejected[: cut["rejected"]]
    if prompt != prompt_r:
        at = next((k for k, (a, b) in enumerate(zip(prompt, prompt_r)) if a != b), min(len(prompt), len(prompt_r)))
        hint = ""
        n_c, n_r = chosen.count(ASSISTANT), rejected.count(ASSISTANT)
        if n_c != n_r:
            hint = f'; chosen has {n_c} "\\n\\nAssistant:" markers, rejected {n_r}'
        raise DataError(path, line, None, "prompt_mismatch",
                        "chosen and rejected have different prompts (the text up to their last "
                        f'"\\n\\nAssistant:"), first difference at character {at + 1}{hint}')
    return prompt, chosen[cut["chosen"]:], rejected[cut["rejected"]:]


def _hh_like(text) -> bool:
    """A text that uses HH's role markers ("Human:", "Assistant:"), so it is read as a transcript (or refused as a
    broken one), never split where two plain texts first differ."""
    return isinstance(text, str) and (HUMAN.strip() in text or ASSISTANT.strip() in text)


def split_shared_words(chosen: str, rejected: str, path="<texts>", line: int | None = None) -> tuple[str, str, str]:
    """(prompt, chosen_response, rejected_response) of the standard implicit-prompt preference format, {"chosen":
    "The sky is blue.", "rejected": "The sky is green."}: the prompt is the text both share up to the last
    whitespace before they first differ, and each response starts with that whitespace (" blue.", " green."), so
    prompt + response == text and no word is cut in two (TRL's extract_prompt moves one space the same way, but can
    end a prompt inside a word)."""
    at = next((k for k, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    cut = max((k for k in range(at) if chosen[k].isspace()), default=0)
    while cut > 0 and chosen[cut - 1].isspace():  # a run of whitespace goes with the responses
        cut -= 1
    if not chosen[:cut].strip():
        raise DataError(path, line, None, "no_shared_prompt",
                        "chosen and rejected share no words before they differ, so no prompt can be read from them; "
                        "write it in a 'prompt' field")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _messages_pair(obj: dict, path, line_no: int) -> tuple[Chat, Chat, Chat]:
    """(prompt, chosen, rejected) of the implicit-prompt conversational format, {"chosen": [messages], "rejected":
    [messages]}: each side ends with the assistant's answer, and the messages before it, the prompt, agree."""
    prompt, chosen = _conversation(obj, "chosen", path, line_no)
    prompt_r, rejected = _conversation(obj, "rejected", path, line_no)
    if prompt.messages != prompt_r.messages:
        raise DataError(path, line_no, None, "prompt_mismatch",
                        "chosen and rejected have different conversations before their last (assistant) message")
    return prompt, chosen, rejected


def _parse_pair(obj: dict, path, line_no: int) -> PreferencePair:
    _refuse_unreadable(obj, path, line_no, pairs_or_texts=True)
    for name in ("chosen", "rejected"):
        if name not in obj:
            kind = row_format(obj)
            elsewhere = ("; a file of PPO prompts goes to --prompts (beside --data PAIRS)"
                         if kind.endswith("prompt-only")
                         else "; a file of demonstrations goes to --sft-data (beside --data PAIRS)"
                         if kind.endswith(("prompt-completion", "prompt-response", "language modeling", "chosen}"))
                         else "")
            raise DataError(path, line_no, name, "missing_field", f"missing: a preference row has 'chosen' and "
                            f"'rejected' (this row reads as {kind}; fields present: "
                            f"{', '.join(repr(k) for k in obj) or 'none'}){elsewhere}")
    conversational = isinstance(obj.get("chosen"), list) or isinstance(obj.get("rejected"), list)
    if conversational and isinstance(obj.get("prompt"), list):  # explicit prompt: prompt, then one answer each
        prompt = _prompt_messages(read_messages(obj["prompt"], path, line_no, "prompt", last="user"), path, line_no,
                                  "prompt")
        chosen, rejected = (_answer(obj, name, path, line_no) for name in ("chosen", "rejected"))
    elif conversational:  # implicit prompt (a string 'prompt' beside whole conversations is set aside, as by TRL)
        prompt, chosen, rejected = _messages_pair(obj, path, line_no)
    elif isinstance(obj.get("prompt"), list):
        name = "chosen" if "chosen" in obj else "rejected"
        raise DataError(path, line_no, name, "bad_messages", 'the prompt is messages, so the answers must be too: '
                        f'[{{"role": "assistant", "content": ...}}], got {_type_name(obj.get(name))}')
    elif "prompt" in obj:  # {"prompt", "chosen", "rejected"}
        prompt = _get_str(obj, "prompt", path, line_no, nonempty=True, reason="empty_prompt")
        chosen = _get_str(obj, "chosen", path, line_no)
        rejected = _get_str(obj, "rejected", path, line_no)
    else:  # implicit prompt: HH-RLHF transcripts {"chosen", "rejected"}, or two plain texts
        chosen_t = _get_str(obj, "chosen", path, line_no)
        rejected_t = _get_str(obj, "rejected", path, line_no)
        split = split_hh_transcript if _hh_like(chosen_t) or _hh_like(rejected_t) else split_shared_words
        prompt, chosen, rejected = split(chosen_t, rejected_t, path, line_no)
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise DataError(path, line_no, name, "empty_response", f"expected a non-empty response, got {_show(text)}")
    if chosen.strip() == rejected.strip():
        raise DataError(path, line_no, "rejected", "identical",
                        "chosen and rejected responses are identical, so the pair carries no preference")
    return PreferencePair(prompt, chosen, rejected, f"{path}:{line_no}")


def load_pairs(path, skip_bad: bool = False, report: DataReport | None = None) -> list[PreferencePair]:
    """Preference pairs (Eq. 1–2 data) of every preference format: explicit or implicit prompt, strings (HH-RLHF
    transcripts among them) or messages."""
    return _load(path, _parse_pair, skip_bad, report)


def _parse_prompt(obj: dict, path, line_no: int) -> tuple[str, str]:
    _refuse_unreadable(obj, path, line_no, pairs_or_texts=False)
    if "chosen" in obj or "rejected" in obj:  # a pair file also gives prompts
        prompt = _parse_pair(obj, path, line_no).prompt
    elif isinstance(obj.get("prompt"), list):  # conversational prompt-only (or prompt-completion, unpaired, ...)
        prompt = _prompt_messages(read_messages(obj["prompt"], path, line_no, "prompt", last="user"), path, line_no,
                                  "prompt")
    elif "prompt" not in obj and "messages" in obj:  # a conversation: the prompt of its last answer
        prompt = _conversation(obj, "messages", path, line_no)[0]
    else:
        if "prompt" not in obj and "text" in obj:
            raise DataError(path, line_no, "prompt", "missing_field", "missing: a language-modelling row {\"text\"} "
                                                                      "has no prompt to sample an answer for")
        prompt = _get_str(obj, "prompt", path, line_no, nonempty=True, reason="empty_prompt")
    return prompt, f"{path}:{line_no}"


def load_prompts(path, skip_bad: bool = False, report: DataReport | None = None,
                 with_source: bool = False) -> list[str] | list[tuple[str, str]]:
    """PPO prompts from prompt-only rows, a string or messages, or the prompts of any other type that has them
    (pairs, prompt-completion, unpaired preference, a conversation's turns before its last answer); (prompt,
    source) if with_source."""
    items = _load(path, _parse_prompt, skip_bad, report)
    return items if with_source else [p for p, _ in items]


def _parse_text(obj: dict, path, line_no: int) -> tuple[str, str, str]:
    src = f"{path}:{line_no}"
    _refuse_unreadable(obj, path, line_no, pairs_or_texts=True)
    if "text" in obj:
        return "", _get_str(obj, "text", path, line_no, nonempty=True, reason="empty_response"), src
    if "completion" in obj and "prompt" in obj:  # prompt-completion, standard or conversational
        if isinstance(obj["prompt"], list) or isinstance(obj["completion"], list):
            if not isinstance(obj["prompt"], list):
                raise DataError(path, line_no, "prompt", "bad_messages", "the completion is messages, so the prompt "
                                f"must be too, got {_type_name(obj['prompt'])}")
            prompt = _prompt_messages(read_messages(obj["prompt"], path, line_no, "prompt", last="user"), path,
                                      line_no, "prompt")
            response = _answer(obj, "completion", path, line_no)
            if not response.strip():
                raise DataError(path, line_no, "completion[0].content", "empty_response", "expected a non-empty "
                                                                                          "response, got \"\"")
            return prompt, response, src
        prompt = _get_str(obj, "prompt", path, line_no)
        return prompt, _get_str(obj, "completion", path, line_no, nonempty=True, reason="empty_response"), src
    if "prompt" in obj and "chosen" in obj and not {"rejected", "response"} & obj.keys():  # a demonstration
        if isinstance(obj["prompt"], list):  # {"prompt", "chosen"}: named as a pair's better half
            prompt = _prompt_messages(read_messages(obj["prompt"], path, line_no, "prompt", last="user"), path,
                                      line_no, "prompt")
            response = _answer(obj, "chosen", path, line_no)
            if not response.strip():
                raise DataError(path, line_no, "chosen[0].content", "empty_response", "expected a non-empty "
                                                                                      "response, got \"\"")
            return prompt, response, src
        prompt = _get_str(obj, "prompt", path, line_no)
        return prompt, _get_str(obj, "chosen", path, line_no, nonempty=True, reason="empty_response"), src
    if "chosen" in obj or "rejected" in obj:  # SFT on the chosen responses of a pair file
        pair = _parse_pair(obj, path, line_no)
        return pair.prompt, pair.chosen, src
    if "messages" in obj:  # a conversation: SFT on its last (assistant) message, the turns before it the prompt
        prompt, response = _conversation(obj, "messages", path, line_no)
        if not response.strip():
            raise DataError(path, line_no, f"messages[{len(prompt.messages)}].content", "empty_response",
                            "expected a non-empty answer, got \"\"")
        return prompt, response, src
    if "prompt" not in obj and "response" not in obj:
        have = ", ".join(repr(k) for k in obj) or "none"
        raise DataError(path, line_no, "text", "missing_field",
                        f'missing: expected {{"text"}}, {{"messages"}}, {{"prompt", "completion"}} or {{"prompt", '
                        f'"response"}} (fields present: {have})')
    if "response" not in obj:
        raise DataError(path, line_no, "completion", "missing_field", "missing: a prompt-only row has no answer to "
                        f"train on (fields present: {', '.join(repr(k) for k in obj)})")
    prompt = _get_str(obj, "prompt", path, line_no)
    return prompt, _get_str(obj, "response", path, line_no, nonempty=True, reason="empty_response"), src


def load_texts(path, skip_bad: bool = False, report: DataReport | None = None,
               with_source: bool = False) -> list[tuple[str, str]] | list[tuple[str, str, str]]:
    """(prompt, response) for SFT / ptx: {"text"} gives prompt "", {"messages"} (the turns before the last answer,
    that answer), {"prompt", "completion"} strings or messages and {"prompt", "response"} as they are, pair rows and
    {"prompt", "chosen"} demonstrations give (prompt, chosen); (prompt, response, source) if with_source."""
    items = _load(path, _parse_text, skip_bad, report)
    return items if with_source else [(p, r) for p, r, _ in items]


def train_heldout_split(items: list, heldout_frac: float = 0.1, seed: int = 0,
                        key: Callable | None = None) -> tuple[list, list]:
    """A seeded shuffle cut into (train, held-out), in the items' order; at least one held-out item when there are ≥ 2.
    With `key`, items of one key (pairs of one prompt, or of prompts that open with one turn: first_turn_key) form a
    group that goes to one side whole, so no group is on both; the fraction then counts groups (items when every key
    is distinct, and the same cut as without it)."""
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item) if key else i, []).append(i)
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    n_held = max(1, round(heldout_frac * len(order))) if len(order) >= 2 else 0
    held = sorted(i for g in order[:n_held] for i in g)
    train = sorted(i for g in order[n_held:] for i in g)
    return [items[i] for i in train], [items[i] for i in held]


def hh_to_messages(prompt: str) -> list[dict]:
    """An HH prompt as chat messages [{"role": "user"|"assistant", "content"}] for a real model's
    chat template; the final empty "Assistant:" turn is left for add_generation_prompt."""
    messages = []
    head = prompt.split(HUMAN)[0].strip()
    if head.startswith(SYSTEM):  # conversation_text's system message
        messages.append({"role": "system", "content": head[len(SYSTEM):].strip()})
    elif head:  # a plain prompt, not a transcript: one user turn
        return [{"role": "user", "content": prompt.strip()}]
    for chunk in prompt.split(HUMAN)[1:]:
        parts = chunk.split(ASSISTANT)
        turns = [("user", parts[0].strip())] + [("assistant", p.strip()) for p in parts[1:] if p.strip()]
        for role, content in turns:  # two turns of one role in a row (an empty or a doubled turn) are one turn:
            if messages and messages[-1]["role"] == role:  # templates that check alternation would refuse them
                messages[-1]["content"] = (messages[-1]["content"] + "\n\n" + content).strip()
            else:
                messages.append({"role": role, "content": content})
    return messages or [{"role": "user", "content": ""}]  # an empty prompt is an empty user turn


# ----------------------------------------------------------------------------------------------
# The one truncation rule: every text a model sees (SFT, reward model, judge, ptx, PPO and evaluation prompts)
# ----------------------------------------------------------------------------------------------
def token_ids(text: str, tokenizer) -> list[int]:
    """The ids of `text` with no special tokens added (encode_many of one text)."""
    return encode_many([text], tokenizer)[0]


def _decode(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def context_limits(max_prompt_tokens: int, max_response_tokens: int, max_new_tokens: int,
                   context: int | None) -> tuple[int, int, int]:
    """(P, T, N) within a model's context of `context` positions: every sequence a stage builds is a query of at most
    P tokens and a response of at most T (training) or N (sampling) tokens, so P + max(T, N) ≤ context. Limits that fit
    stay; otherwise the prompt gives way first (prompts keep their latest turns, while a too-long response is dropped),
    down to half the context, then the responses take what is left."""
    if context is None or max_prompt_tokens + max(max_response_tokens, max_new_tokens) <= context:
        return max_prompt_tokens, max_response_tokens, max_new_tokens
    p = min(max_prompt_tokens, max(context - max(max_response_tokens, max_new_tokens), context // 2))
    return p, min(max_response_tokens, context - p), min(max_new_tokens, context - p)


def fit_prompt(prompt: str, tokenizer, max_prompt_tokens: int, source: str = "",
               report: DataReport | None = None, known: Lengths | None = None) -> str:
    """The prompt x, cut so that the query the model reads (data.query_ids: [BOS] + x, or the chat template's
    rendering of it) has at most max_prompt_tokens tokens, BOS and template included.

    1. fits → as is;  2. drop whole earliest turns (at "\\n\\nHuman:") until it fits;  3. its last turn alone too
    long → keep that turn's "\\n\\nHuman:" and closing "\\n\\nAssistant:" markers and the latest tokens between them;
    4. not even the markers fit → the latest tokens of the text. Steps 2-4 count report.truncated. A Chat is cut the
    same way on its messages (fit_chat: its system message stays while it fits, a cut keeps it a Chat), and with a
    chat template step 4 does not exist. A limit that cannot hold even the BOS or the template's own tokens is a
    DataError (prompt_too_long); so is a conversation the chat template refuses (chat_template, special_token).
    """
    try:
        return _fit_prompt(prompt, tokenizer, max_prompt_tokens, source, report, known or Lengths({}, {}))
    except TemplateRefused as e:  # a conversation the chat template will not render: this example, not the run
        raise DataError(*_split_source(source), "prompt", e.reason, str(e)) from None


def _fit_prompt(prompt: str, tokenizer, max_prompt_tokens: int, source: str, report: DataReport | None,
                known: Lengths) -> str:
    def fits(text: str) -> bool:
        return len(query_ids(text, tokenizer)) <= max_prompt_tokens

    if known.query_len(prompt, tokenizer) <= max_prompt_tokens:
        return prompt
    if report is not None:
        report.truncated += 1
        report.first.setdefault("truncated", source)
        n = known.query_len(prompt, tokenizer)
        if source and n > report.longest_cut[0]:
            report.longest_cut = (n, source)
    if isinstance(prompt, Chat):
        cut = fit_chat(prompt, tokenizer, max_prompt_tokens)
        if cut is not None:
            return cut
        if has_chat_template(tokenizer):
            return _prompt_too_long(source, max_prompt_tokens, tokenizer)
        prompt = str(prompt)  # without a template the model reads the text itself: the text's own last resort
    starts = []  # character offsets of the "\n\nHuman:" turns that can start a shorter prompt
    i = prompt.find(HUMAN, 1)
    while i > 0:
        starts.append(i)
        i = prompt.find(HUMAN, i + 1)
    for s in starts:  # earliest cut first: keep as many of the latest turns as fit
        if fits(prompt[s:]):
            return prompt[s:]
    last = prompt[starts[-1]:] if starts else prompt
    head = HUMAN if last.startswith(HUMAN) else ""
    tail = ASSISTANT if last.endswith(ASSISTANT) and len(last) >= len(head) + len(ASSISTANT) else ""
    for head, body, tail in ((head, last[len(head):len(last) - len(tail)], tail), ("", prompt, "")):
        ids = token_ids(body, tokenizer)
        room = max_prompt_tokens - len(query_ids(head + tail, tokenizer))  # what BOS / template and markers leave
        # a token-level cut can start inside a word or a UTF-8 character and re-encode longer: keep one token fewer
        for k in range(min(len(ids), room + 2), 0, -1):
            text = head + _decode(ids[len(ids) - k:], tokenizer) + tail
            if fits(text):
                return text
    return _prompt_too_long(source, max_prompt_tokens, tokenizer)


def _prompt_too_long(source: str, max_prompt_tokens: int, tokenizer):
    path, line = _split_source(source)
    raise DataError(path, line, "prompt", "prompt_too_long",
                    f"--max-prompt-tokens {max_prompt_tokens} leaves no room for any prompt text: the query's own "
                    f"tokens (BOS, chat template) take {len(query_ids('', tokenizer))} or more")


def fit_chat(prompt: Chat, tokenizer, max_prompt_tokens: int) -> Chat | None:
    """fit_prompt's steps 2-3 on a conversation's messages: drop whole earliest turns (a user message and what
    follows it up to the next one) while a first system message stays; then the last user message alone, with the
    system message if it still fits, keeping the latest tokens of its content. None when not even that fits."""
    def fits(messages: list[dict]) -> bool:
        return len(query_ids(Chat(messages), tokenizer)) <= max_prompt_tokens

    messages = [dict(m) for m in prompt.messages]
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    for s in (i for i, m in enumerate(body) if m["role"] == "user" and i > 0):
        if fits(head + body[s:]):
            return Chat(head + body[s:])
    ids = token_ids(body[-1]["content"], tokenizer)  # the prompt's last message: the user's question
    for keep in ([head, []] if head else [[]]):
        room = max_prompt_tokens - len(query_ids(Chat(keep + [{"role": "user", "content": ""}]), tokenizer))
        for k in range(min(len(ids), room + 2), 0, -1):  # one token fewer, as in fit_prompt
            cut = keep + [{"role": "user", "content": _decode(ids[len(ids) - k:], tokenizer)}]
            if fits(cut):
                return Chat(cut)
    return None


def fit_response(response: str, tokenizer, max_response_tokens: int, cut: bool = False,
                 known: Lengths | None = None) -> str | None:
    """The response y, whose ids with their stop token (data.response_ids) must be at most max_response_tokens: as
    written if it fits; else None (training drops it: a cut answer would teach stopping mid-sentence) or, with cut
    (scoring), the text of its first tokens (with a chat template, of its content; a Chat stays a Chat)."""
    if (known or Lengths({}, {})).response_len(response, tokenizer) <= max_response_tokens:
        return response
    if not cut:
        return None
    template = has_chat_template(tokenizer)
    ids = token_ids(answer_content(response) if template else str(response), tokenizer)[:max_response_tokens - 1]
    while True:  # a cut inside a UTF-8 character can re-encode longer: drop one more token
        text = _decode(ids, tokenizer)
        if template and isinstance(response, Chat):
            text = Chat([{"role": "assistant", "content": text}])
        if len(response_ids(text, tokenizer)) <= max_response_tokens or not ids:
            return text
        ids = ids[:-1]


def fit_example(prompt: str, responses: tuple[str, ...], tokenizer, max_prompt_tokens: int, max_response_tokens: int,
                cut: bool = False, source: str = "", report: DataReport | None = None, known: Lengths | None = None
                ) -> tuple[str, list[str]] | None:
    """THE truncation rule, for every text a model sees: (x, [y, …]) → (fitted x, [fitted y, …]) such that each
    sequence [query_ids(x) + response_ids(y)] has at most max_prompt_tokens + max_response_tokens tokens (fit_prompt,
    fit_response). None when a response is too long for training (dropped, counted as response_too_long); with cut
    (scoring) such a response is cut instead and counted in report.truncated_responses. A prompt of "" (a {"text"}
    row: all of it is the response) stays "". Records keep TEXT (a Chat keeps its messages); every stage re-encodes
    exactly these tokens. `known`: the token counts of these texts, counted beforehand for a whole data set
    (Lengths.count), or None."""
    try:
        kept = [fit_response(r, tokenizer, max_response_tokens, cut, known) for r in responses]
    except TemplateRefused as e:  # an answer the template cannot render as written: this example, not the run
        raise DataError(*_split_source(source), "response", e.reason, str(e)) from None
    if any(k is None for k in kept):
        if report is not None:
            report.drop("response_too_long", source)
        return None
    if cut and report is not None:
        report.truncated_responses += sum(k != r for k, r in zip(kept, responses))
    return (fit_prompt(prompt, tokenizer, max_prompt_tokens, source, report, known) if prompt else prompt), kept


@dataclass
class Lengths:
    """len(query_ids(x)) and len(response_ids(y)) of a data set's texts, counted in batch calls of the tokenizer
    (`chunk` texts each, only the counts kept), so that fit_example's first question (does it fit as written?) costs
    no call of its own per example. A text missing from them is counted by fit_example itself. Keyed by chat_key."""
    query: dict
    response: dict

    @staticmethod
    def count(prompts: list[str], responses: list[str], tokenizer, chunk: int = 4096) -> Lengths:
        def lengths(texts: list[str], encode: Callable) -> dict:  # chunked: only the counts are kept
            try:
                return {chat_key(t): n for i in range(0, len(texts), chunk)
                        for t, n in zip(texts[i:i + chunk], map(len, encode(texts[i:i + chunk], tokenizer)))}
            except TemplateRefused:  # a text the chat template will not render: fit_example meets it on its own
                return {}
        distinct = lambda texts: list({chat_key(t): t for t in texts}.values())  # noqa: E731
        return Lengths(lengths(distinct(p for p in prompts if p), queries_ids), lengths(distinct(responses),
                                                                                          responses_ids))

    def query_len(self, prompt: str, tokenizer) -> int:
        """len(query_ids(prompt)): the count made beforehand, else one tokenizer call."""
        key = chat_key(prompt)
        return self.query[key] if key in self.query else len(query_ids(prompt, tokenizer))

    def response_len(self, response: str, tokenizer) -> int:
        """len(response_ids(response)): the count made beforehand, else one tokenizer call."""
        key = chat_key(response)
        return self.response[key] if key in self.response else len(response_ids(response, tokenizer))


def _fit_all(items: list, fit: Callable, skip_bad: bool, report: DataReport | None) -> list[dict]:
    out = []
    for item in items:
        try:
            rec = fit(item)
        except DataError as err:
            if not skip_bad:
                raise
            if report is not None:
                report.skip(err)
            continue
        if rec is not None:
            out.append(rec)
    return out


def pair_records(pairs: list[PreferencePair], tokenizer, max_prompt_tokens: int, max_response_tokens: int,
                 skip_bad: bool, report: DataReport, cut: bool = False) -> list[dict]:
    """Preference pairs through fit_example, as the text records {"prompt", "chosen", "rejected", "source"} the
    reward model and the judge read (Eq. 1-2), with "uncut": the prompt as written; over-long responses dropped and
    counted (cut, with cut)."""
    known = Lengths.count([p.prompt for p in pairs], [y for p in pairs for y in (p.chosen, p.rejected)], tokenizer)

    def fit(p: PreferencePair) -> dict | None:
        got = fit_example(p.prompt, (p.chosen, p.rejected), tokenizer, max_prompt_tokens, max_response_tokens, cut,
                          p.source, report, known)
        return None if got is None else {"prompt": got[0], "chosen": got[1][0], "rejected": got[1][1],
                                         "source": p.source, "uncut": p.prompt}
    return _fit_all(pairs, fit, skip_bad, report)


def text_records(rows: list[tuple[str, str, str]], tokenizer, max_prompt_tokens: int, max_response_tokens: int,
                 skip_bad: bool, report: DataReport, cut: bool = False) -> list[dict]:
    """(prompt, response, source) rows (load_texts(..., with_source=True)) through fit_example, as the records
    {"prompt", "response", "source", "uncut"} of SFT and of the ptx term (Eq. 17); "uncut" is the prompt as
    written."""
    known = Lengths.count([r[0] for r in rows], [r[1] for r in rows], tokenizer)

    def fit(row) -> dict | None:
        got = fit_example(row[0], (row[1],), tokenizer, max_prompt_tokens, max_response_tokens, cut, row[2], report,
                          known)
        return None if got is None else {"prompt": got[0], "response": got[1][0], "source": row[2], "uncut": row[0]}
    return _fit_all(rows, fit, skip_bad, report)


def prompt_records(prompts: list[tuple[str, str]], tokenizer, max_prompt_tokens: int, skip_bad: bool,
                   report: DataReport) -> list[dict]:
    """(prompt, source) rows (load_prompts(..., with_source=True)) through fit_example, as the records
    {"prompt", "source", "uncut"} of PPO's rollouts and of the evaluation; "uncut" is the prompt as written."""
    known = Lengths.count([r[0] for r in prompts], [], tokenizer)

    def fit(row) -> dict:
        return {"prompt": fit_example(row[0], (), tokenizer, max_prompt_tokens, 1, source=row[1], report=report,
                                      known=known)[0], "source": row[1], "uncut": row[0]}
    return _fit_all(prompts, fit, skip_bad, report)


def text_key(text: str) -> str:
    """What "the same text" means wherever training and evaluation are kept apart (the split's groups, distinct PPO
    prompts, the rows of --sft-data and --prompts left out): the text with its whitespace collapsed and its case
    folded, so that a copy re-spaced or re-cased is the same prompt."""
    return " ".join(text.split()).casefold()


HUMAN_KEY, ASSISTANT_KEY = text_key(HUMAN), text_key(ASSISTANT)  # "human:", "assistant:": the markers in a key
FIRST_TURN = re.compile(rf"(?:^| ){HUMAN_KEY}(.*?)(?= {ASSISTANT_KEY}|$)")


def question_words(prompt: str) -> str:
    """text_key of a prompt without its role markers: "" for a prompt that holds no question ("\\n\\nHuman:
    \\n\\nAssistant:"), what the split names when every prompt is one."""
    return " ".join(w for w in text_key(prompt).split() if w not in (HUMAN_KEY, ASSISTANT_KEY, text_key(SYSTEM)))


def first_turn_key(text: str) -> str:
    """text_key of the turn a conversation opens with: what follows its first "Human:" up to the next "Assistant:"
    (a "System: …" head before it set aside). Read on the key, so re-spaced or re-cased markers are still markers; a
    text with no "Human:" turn (a plain prompt) or an empty first turn is one turn, all of it."""
    key = text_key(text)
    found = FIRST_TURN.search(key)
    return found.group(1).strip() if found and found.group(1).strip() else key


def prompt_keys(prompt: str, response: str = "") -> set[str]:
    """The prompts an example trains a response for, as text_key()s: its prompt; for a {"text"} row (prompt "", all of
    it trained) every prefix of the text that ends with "Assistant:" (an HH transcript inside it, found on the key)."""
    if prompt:
        return {text_key(prompt)}
    key, keys = text_key(response), set()
    i = key.find(ASSISTANT_KEY)
    while i >= 0:
        keys.add(key[:i + len(ASSISTANT_KEY)])
        i = key.find(ASSISTANT_KEY, i + 1)
    return keys


def uncut_prompt(record: dict) -> str:
    """The prompt a record was made from, as written in its file (its "uncut" field; the synthetic world's prompts are
    never cut); a {"text"} row (prompt "") stands as its whole text, every token of which it trains."""
    return record.get("uncut", record["prompt"]) or record.get("response", "")


def trained_texts(record: dict) -> list[str]:
    """What the keep-out rule (Evaluation.overlap) compares of a record: its prompt as written and as cut (a cut can
    make two prompts one); for a {"text"} row, its text and every transcript prefix inside it (prompt_keys)."""
    if not record["prompt"]:
        return [record["response"], *prompt_keys("", record["response"])]
    return list(dict.fromkeys((record.get("uncut", record["prompt"]), record["prompt"])))


@dataclass
class Evaluation:
    """Prompts that no training set may hold (the held-out or the judge's part, as written and as cut), read the way
    the keep-out rule reads them: their text_keys (sorted, for the prefix test) and their first turns."""
    keys: list[str]
    turns: set[str]

    @classmethod
    def of(cls, prompts) -> "Evaluation":
        return cls(sorted({text_key(p) for p in prompts}), {first_turn_key(p) for p in prompts})

    def overlap(self, texts: list[str]) -> str | None:
        """How a row whose trained texts (trained_texts) are `texts` meets these prompts, checked in this order:
        "same_prompt" (one key), "prefix" (a text is the start of one of these prompts, a cut-off copy), "first_turn"
        (it opens with the first human turn of one: the same conversation, continued or shortened); else None."""
        keys = [k for k in (text_key(t) for t in texts) if k]
        at = [bisect.bisect_left(self.keys, k) for k in keys]  # the first key ≥ k: equal to k, or starting with it
        if any(i < len(self.keys) and self.keys[i] == k for k, i in zip(keys, at)):
            return "same_prompt"
        if any(i < len(self.keys) and self.keys[i].startswith(k) for k, i in zip(keys, at)):
            return "prefix"
        if any(first_turn_key(k) in self.turns for k in keys):
            return "first_turn"
        return None


def distinct_prompts(records: list[dict]) -> list[dict]:
    """{"prompt", "source"} (and "uncut") of each distinct prompt of `records` (text_key), in order of first
    appearance."""
    seen, out = set(), []
    for r in records:
        if text_key(r["prompt"]) not in seen:
            seen.add(text_key(r["prompt"]))
            out.append({"prompt": r["prompt"], "source": r.get("source", ""),
                        **({"uncut": r["uncut"]} if "uncut" in r else {})})
    return out


# ----------------------------------------------------------------------------------------------
# The model's inputs: [BOS] + prompt (+ response + [EOS]); padding is known by the mask, never by an id
# ----------------------------------------------------------------------------------------------
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


PROBE = {"role": "user", "content": "q"}  # the one-turn conversation that shows how a template writes an answer


def stop_id(tokenizer) -> int:
    """The token that ends a response, ends sampling and is scored: with a chat template its end-of-turn token (the
    first special token the template writes after an assistant message: Qwen's <|im_end|>, Llama 3's <|eot_id|>,
    which need not be the EOS; Llama 2's " </s>" is the EOS, not the space before it), else the tokenizer's EOS. A
    template that ends a turn with no special token (plain text such as "\n", or a marker this tokenizer splits
    into pieces) ends responses with the EOS: a whitespace token or a piece of a word would stop sampling wherever
    it occurs."""
    if not has_chat_template(tokenizer):
        return tokenizer.eos_token_id
    cached = getattr(tokenizer, "_ppo_max_stop_id", None)
    if cached is not None:
        return cached
    marker = "ppo-max-end-of-answer"
    try:
        text = render_chat(tokenizer, [PROBE, {"role": "assistant", "content": marker}])
    except TemplateRefused as e:  # not one example's fault: the template cannot render a user and an assistant turn
        raise TemplateRefused(f"{tokenizer.name_or_path or 'tokenizer'}: {e}: a user turn, then an assistant "
                              "turn") from None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    after = encode_many([text[text.rindex(marker) + len(marker):]], tokenizer, markup=True)[0]
    tokenizer._ppo_max_stop_id = next((i for i in after if i in special), tokenizer.eos_token_id)
    return tokenizer._ppo_max_stop_id


class TemplateRefused(UserError):
    """The tokenizer's chat template raised on a conversation (roles that do not alternate, a system turn it does
    not take; reason "chat_template"), or could not keep a special token's spelling inside a message as text
    (reason "special_token"): str() is one line."""

    def __init__(self, message: str, reason: str = "chat_template"):
        super().__init__(message)
        self.reason = reason


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text of `messages`; TemplateRefused when the template (code of the model's authors)
    raises on them."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as e:  # jinja2's TemplateError from raise_exception(...), or whatever the template's code hits
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TemplateRefused(f"the tokenizer's chat template refuses this conversation ({first})") from None


def _spellings(tokenizer):
    """A regex of the spellings of the tokenizer's added tokens (special or not), or None when it has none: a
    message that holds one is encoded through apply_chat_template's sanitize_control_tokens (chat_ids)."""
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    key = tuple(sorted(added))
    cached = getattr(tokenizer, "_ppo_max_spellings", None)
    if cached is None or cached[0] != key:
        pattern = re.compile("|".join(map(re.escape, sorted(key, key=len, reverse=True)))) if key else None
        cached = (key, pattern)
        try:
            tokenizer._ppo_max_spellings = cached
        except AttributeError:  # a tokenizer object that takes no attributes: counted again next time
            pass
    return cached[1]


def chat_ids(conversations: list[list[dict]], tokenizer, add_generation_prompt: bool = False) -> list[list[int]]:
    """The chat template's rendering of each conversation, as ids: what the template writes (its markers, its BOS,
    its end of turn) are control tokens; a special token's spelling inside a message is text
    (apply_chat_template(..., sanitize_control_tokens=True)). Conversations whose messages spell no added token give
    the same ids through one batch call of the tokenizer on their rendered texts, which is how most are encoded.
    TemplateRefused when the template raises, or cannot keep such a spelling as text."""
    texts = [render_chat(tokenizer, c, add_generation_prompt) for c in conversations]
    spelled = _spellings(tokenizer)
    marked = {i for i, c in enumerate(conversations) if spelled and any(spelled.search(m["content"]) for m in c)}
    plain = iter(encode_many([t for i, t in enumerate(texts) if i not in marked], tokenizer, markup=True))
    out = []
    for i, c in enumerate(conversations):
        if i not in marked:
            out.append(next(plain))
            continue
        try:
            out.append(list(tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                          tokenize=True, sanitize_control_tokens=True,
                                                          return_dict=False)))
        except Exception as e:  # transformers' "Can't sanitize ...", or the template's own error
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TemplateRefused(f"the chat template's rendering cannot keep a special token's spelling in this "
                                  f"conversation as text ({first})", "special_token") from None
    return out


def query_ids(prompt: str, tokenizer) -> list[int]:
    """What the model reads before it answers: the chat template's rendering of the conversation (a Chat's
    messages, or an HH prompt's) with the assistant's turn opened, when the tokenizer has a template; else [BOS] + x
    (no BOS where the tokenizer has none)."""
    return queries_ids([prompt], tokenizer)[0]


def response_ids(response: str, tokenizer) -> list[int]:
    """y + [stop]: every response ends with stop_id (the EOS, or the template's end-of-turn token), which ends and
    scores it. With a chat template, the answer (answer_content) as the template writes an assistant turn after a
    user turn, through its end-of-turn token: the ids that follow the query in the template's rendering of the whole
    conversation (Mistral's " " + answer, ChatML's answer alone); the text a template writes after that token
    ("\\n") is not part of the response."""
    return responses_ids([response], tokenizer)[0]


def queries_ids(prompts: list[str], tokenizer) -> list[list[int]]:
    """query_ids of many prompts, encoded in one call of the tokenizer (encode_many, chat_ids)."""
    if has_chat_template(tokenizer):
        return chat_ids([messages_of(p) for p in prompts], tokenizer, add_generation_prompt=True)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids for ids in encode_many([str(p) for p in prompts], tokenizer)]


def responses_ids(responses: list[str], tokenizer) -> list[list[int]]:
    """response_ids of many responses, encoded in one call of the tokenizer (encode_many, chat_ids). With a chat
    template: the rendering of [PROBE, the answer] after the rendering of [PROBE] with the assistant's turn opened,
    cut after its first stop token; where the template's rendering does not go on from that query, or writes no
    stop token after the answer, the answer's own ids and the stop token."""
    if not responses:
        return []
    if not has_chat_template(tokenizer):
        return [ids + [tokenizer.eos_token_id] for ids in encode_many([str(r) for r in responses], tokenizer)]
    stop, contents = stop_id(tokenizer), [answer_content(r) for r in responses]
    opened = chat_ids([[PROBE]], tokenizer, add_generation_prompt=True)[0]
    whole = chat_ids([[PROBE, {"role": "assistant", "content": c}] for c in contents], tokenizer)
    out = [ids[len(opened):] if ids[:len(opened)] == opened else [] for ids in whole]
    out = [ids[:ids.index(stop) + 1] if stop in ids else None for ids in out]
    alone = iter(encode_many([c for c, ids in zip(contents, out) if ids is None], tokenizer))
    return [ids if ids is not None else next(alone) + [stop] for ids in out]


def encode_many(texts: list[str], tokenizer, markup: bool = False) -> list[list[int]]:
    """tokenizer.encode(text, add_special_tokens=False) of every text, each distinct text encoded once; a fast
    (Rust) tokenizer encodes them all in one call of its batch encoder, `tokenizer(texts)`, the function its encode
    calls with one text (tests/test_data.py checks that the ids agree). Text is text: a special token's spelling
    ("</s>", "<pad>") is encoded as the characters it is (split_special_tokens=True), never as the control token;
    `markup` (a chat template's rendering, whose special tokens are the template's own) keeps them special."""
    distinct = list(dict.fromkeys(str(t) for t in texts))
    split = {} if markup or not getattr(tokenizer, "added_tokens_encoder", None) else {"split_special_tokens": True}
    if getattr(tokenizer, "is_fast", False) and distinct:
        encoded = tokenizer(distinct, add_special_tokens=False, **split)["input_ids"]
    else:
        encoded = [tokenizer.encode(t, add_special_tokens=False, **split) for t in distinct]
    ids = dict(zip(distinct, encoded))
    return [list(ids[str(t)]) for t in texts]


def encode_rows(rows: list[tuple[str, str]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) rows → (query_ids(x), response_ids(y)) each: a stage encodes its data set once, then draws
    minibatches of ids (lm_batch_of_ids, pair_batch_of_ids) instead of re-encoding every batch."""
    return list(zip(queries_ids([p for p, _ in rows], tokenizer), responses_ids([r for _, r in rows], tokenizer)))


def encode_pairs(rows: list[dict], tokenizer) -> list[tuple[list[int], list[int], list[int]]]:
    """{"prompt", "chosen", "rejected"} rows → (query ids, chosen response ids, rejected response ids) each."""
    queries = queries_ids([r["prompt"] for r in rows], tokenizer)
    chosen, rejected = (responses_ids([r[k] for r in rows], tokenizer) for k in ("chosen", "rejected"))
    return list(zip(queries, chosen, rejected))


def shuffled_batches(n_rows: int, batch: int, steps: int, seed: int) -> Iterator[list[int]]:
    """`steps` minibatches of `batch` row indices: epochs of a seeded shuffle (each epoch random.Random(seed)'s next
    permutation of the n rows), a minibatch taking the end of one epoch and the start of the next where it must.
    The order SFT, the reward model and DPO read their rows in."""
    rng, order = random.Random(seed), []
    for _ in range(steps):
        if len(order) < batch:
            order += rng.sample(range(n_rows), n_rows)
        idx, order = order[:batch], order[batch:]
        yield idx


def minibatches(encoded: list, batch: int, steps: int, seed: int, collate: Callable, pad_id: int | None, device,
                rank: int = 0, world: int = 1) -> Iterator[tuple]:
    """The minibatch loop of SFT, the reward model and DPO: `steps` minibatches of `batch` encoded rows in
    shuffled_batches' order, each as (the row indices this rank takes, *collate(their rows, pad_id) on `device`),
    e.g. (idx, ids, attention mask, response mask) with lm_batch_of_ids or pair_batch_of_ids. Under DeepSpeed rank r
    of W takes positions r, r + W, … of every minibatch; one process takes all of it."""
    for idx in shuffled_batches(len(encoded), batch, steps, seed):
        mine = idx[rank::world]
        yield mine, *(t.to(device) for t in collate([encoded[i] for i in mine], pad_id))


def pad(seqs: list[list[int]], pad_id: int, side: str):
    """Pad id lists to one length. Returns ids (B, L) and the 0/1 mask (B, L) as float. The mask alone says what is
    padding, so any id will do where the tokenizer has no pad token (pad_id None: 0)."""
    import torch
    L = max(len(s) for s in seqs)
    fill = 0 if pad_id is None else pad_id
    gaps = [L - len(s) for s in seqs]
    # one torch.tensor call per output (not one per row: the rows are short, and each call costs more than its copy)
    if side == "left":
        ids = [[fill] * g + list(s) for g, s in zip(gaps, seqs)]
        mask = [[0.0] * g + [1.0] * len(s) for g, s in zip(gaps, seqs)]
    else:
        ids = [list(s) + [fill] * g for g, s in zip(gaps, seqs)]
        mask = [[1.0] * len(s) + [0.0] * g for g, s in zip(gaps, seqs)]
    return torch.tensor(ids, dtype=torch.long).reshape(len(seqs), L), torch.tensor(mask).reshape(len(seqs), L)


def position_ids_from_mask(attention_mask):
    """(B, L) → (B, L): the first real token gets position 0 wherever the padding is, so a padded sequence sees the
    positions of the unpadded one (HF LLaMA does not derive them from the mask by itself)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def lm_batch(rows: list[tuple[str, str]], tokenizer):
    """(prompt, response) rows -> right-padded ids (B, L), attention mask (B, L), response-token mask (B, L)."""
    return lm_batch_of_ids(encode_rows(rows, tokenizer), tokenizer.pad_token_id)


def lm_batch_of_ids(rows: list[tuple[list[int], list[int]]], pad_id: int | None):
    """lm_batch of rows already tokenized: (query ids, response ids) each."""
    seqs = [q + r for q, r in rows]
    resp = [[0] * len(q) + [1] * len(r) for q, r in rows]
    ids, attn = pad(seqs, pad_id, "right")
    response_mask, _ = pad(resp, 0, "right")
    return ids, attn, response_mask.float()


def pair_batch(rows: list[dict], tokenizer):
    """Chosen and rejected stacked in one batch of 2B sequences: [chosen_0..B-1, rejected_0..B-1]."""
    return pair_batch_of_ids(encode_pairs(rows, tokenizer), tokenizer.pad_token_id)


def pair_batch_of_ids(rows: list[tuple[list[int], list[int], list[int]]], pad_id: int | None):
    """pair_batch of pairs already encoded (encode_pairs): ids (2B, L), attention mask, response mask."""
    return lm_batch_of_ids([(q, w) for q, w, _ in rows] + [(q, l) for q, _, l in rows], pad_id)


class RolloutBatches:
    """The PPO stage's batches, drawn from one seeded stream (checkpointed as "prompt", so a resumed run draws the
    same batches): prompts for the rollouts, left-padded (B, P), and SFT rows for the ptx term (Eq. 17),
    right-padded. Every rank draws the global batch and keeps its rows r, r + W, … (W ranks), or its groups.
    Every text is tokenized once, here (query_ids, response_ids), not at every PPO step."""

    def __init__(self, prompts: list[str], sft_rows: list[tuple[str, str]], tokenizer, seed: int, rank: int = 0,
                 world: int = 1, device="cpu"):
        self.prompt_rows, self.sft_rows, self.tokenizer = prompts, sft_rows, tokenizer
        self.rng, self.rank, self.world, self.device = random.Random(seed), rank, world, device
        self.query = {chat_key(p): q for p, q in zip(prompts, queries_ids(prompts, tokenizer))}  # prompt → query ids
        self.sft_ids = encode_rows(sft_rows, tokenizer)                                # (query ids, response ids)
        self.stop_id = stop_id(tokenizer)                                              # ends and scores a response

    def prompts(self, n: int, group: int = 1):
        """n rows of the global batch → (this rank's prompts, query ids (b, P), query mask (b, P)). With `group` = G:
        n/G prompts, each repeated G times in a row (G responses per prompt), and each rank keeps whole groups
        (r, r + W, …), so no group is split across ranks; G = 1 draws exactly what it always did."""
        prompts = [self.rng.choice(self.prompt_rows) for _ in range(n // group)][self.rank::self.world]
        rows = [p for p in prompts for _ in range(group)]
        query, query_mask = pad([self.query[chat_key(p)] for p in rows], self.tokenizer.pad_token_id, "left")
        return rows, query.to(self.device), query_mask.to(self.device)

    def ptx(self, n: int):
        """n SFT rows of the global batch → this rank's ids (b, L), attention mask (b, L), response mask (b, L)."""
        rows = [self.sft_ids[self.rng.randrange(len(self.sft_ids))] for _ in range(n)][self.rank::self.world]
        return tuple(t.to(self.device) for t in lm_batch_of_ids(rows, self.tokenizer.pad_token_id))


def read_records(path) -> list[dict]:
    """Every object of a JSONL file this project wrote itself (a cache, a run's logs); for user data use the
    loaders above, which check each line. An empty file is an empty list."""
    return [obj for _, obj in read_jsonl(path)] if Path(path).read_text().strip() else []


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------
def train_bpe_tokenizer(texts, out_dir, vocab_size: int = 2000, min_frequency: int = 2):
    """Train a byte-level BPE on the training split's texts and save it as a Hugging Face tokenizer
    directory (AutoTokenizer.from_pretrained(out_dir)). Specials: <pad>=0, <s>=1, </s>=2, <unk>=3.
    Deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # every byte has a token: no <unk> in practice
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path):
    """AutoTokenizer.from_pretrained(path); DataError (no_tokenizer) if missing, without EOS, or unreadable.
    A tokenizer without a pad token gets pad = EOS."""
    p = Path(path)
    if not p.is_dir():
        raise DataError(path, None, None, "no_tokenizer", "no such model/tokenizer directory")
    if not any((p / name).exists() for name in TOKENIZER_FILES):
        raise DataError(path, None, None, "no_tokenizer",
                        f"directory has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(path, None, None, "no_tokenizer", f"cannot load the tokenizer ({first})") from None
    if tok.eos_token_id is None:
        raise DataError(path, None, None, "no_tokenizer", "tokenizer has no EOS token (responses must end with one)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _kind(path) -> str:
    """What the first row of a file is read as: pairs (preference rows, and the unpaired and stepwise types, which
    load_pairs then refuses), texts (language modelling, prompt-completion), else prompts."""
    for _, obj in records(path, skip_bad=True):
        if {"chosen", "rejected", "completions"} & obj.keys() or {"completion", "label"} <= obj.keys():
            return "pairs"
        return "texts" if {"text", "response", "completion", "messages"} & obj.keys() else "prompts"
    return "pairs"


def main(argv: list[str] | None = None) -> None:
    """Validate a data file: the format detected, counts, mean lengths in characters, and lines skipped by reason."""
    ap = OneLineParser(prog="python -m plumbing.data", description=main.__doc__)
    ap.add_argument("file", help=".jsonl[.gz], .json, .parquet, a save_to_disk folder or a cached hub dataset id")
    ap.add_argument("--kind", choices=["auto", "pairs", "prompts", "texts"], default="auto")
    ap.add_argument("--skip-bad", action="store_true", help="skip bad lines and count them by reason")
    ap.add_argument("--split", default="train", help="the split of a hub dataset or a folder of several")
    ap.add_argument("--config", default=None, help="a hub dataset's configuration")
    args = ap.parse_args(argv)
    args.file = source(args.file, args.split, args.config)
    kind = _kind(args.file) if args.kind == "auto" else args.kind
    report = DataReport()
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    if kind == "pairs":
        pairs = load_pairs(args.file, args.skip_bad, report)
        print(f"{len(pairs)} pairs; mean chars: prompt {mean([len(p.prompt) for p in pairs]):.1f}, "
              f"chosen {mean([len(p.chosen) for p in pairs]):.1f}, rejected {mean([len(p.rejected) for p in pairs]):.1f}; "
              f"mean turns {mean([p.prompt.count(HUMAN) for p in pairs]):.2f}")
    elif kind == "prompts":
        prompts = load_prompts(args.file, args.skip_bad, report)
        print(f"{len(prompts)} prompts; mean chars {mean([len(p) for p in prompts]):.1f}")
    else:
        texts = load_texts(args.file, args.skip_bad, report)
        print(f"{len(texts)} texts; mean chars: prompt {mean([len(p) for p, _ in texts]):.1f}, "
              f"response {mean([len(r) for _, r in texts]):.1f}")
    print(report.summary())


if __name__ == "__main__":
    cli_guard(main)()
    # $ python -m plumbing.data data/hh-rlhf/harmless-base-test.dev.jsonl.gz --skip-bad
    # 1794 pairs; mean chars: prompt 480.5, chosen 170.0, rejected 211.2; mean turns 2.48
    # format HH-RLHF transcripts (standard preference, implicit prompt); kept 1794; skipped 6: empty_response 4
    #   (first at data/hh-rlhf/harmless-base-test.dev.jsonl.gz:87), prompt_mismatch 2 (first at
    #   data/hh-rlhf/harmless-base-test.dev.jsonl.gz:1255); truncated 0 prompts; dropped 0
    # (the 4 empty ones: a chosen response of a single space; the 2 mismatches: a chosen response holding a
    #  second "\n\nAssistant:" turn, so its last marker is not the rejected one's.) Without --skip-bad: exit 2,
    # error: data/hh-rlhf/harmless-base-test.dev.jsonl.gz:87: field 'chosen': expected a non-empty response, got " "
