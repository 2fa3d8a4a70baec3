"""What trains never sees what evaluates, checked on what `train.py` itself fed its stages: each run writes
<out>/records.json (pipeline.write_stage_records) before its first stage, the prompts each consumer reads as written,
and here `train.py` runs end to end on --sft-data and --prompts files that hold copies of every prompt of --data:
re-spaced, re-cased, cut off at the end, cut to the limits (the long ones), and conversations that open with the same
human turn. No copy of a held-out or judge prompt may reach SFT, the reward model, the critic, the rollouts or the ptx
rows, and the final evaluation samples the held-out prompts only.

The rules are written out again here, apart from data.py (one key: whitespace collapsed, case folded; a training
prompt may not equal an evaluation prompt, be the start of one, or open with its first human turn).
"""
import json
from pathlib import Path

import pytest

from plumbing import data
import tiny_model
import train
from test_real_data import write_jsonl
import plumbing.flags

H, A = "\n\nHuman:", "\n\nAssistant:"
TOPICS = ["bake bread", "fix a bike", "learn chess", "grow tomatoes", "write a poem", "save money", "sleep better",
          "paint a wall", "train a puppy", "cook rice", "run a mile", "clean a window"]
TRAINING = ("sft", "rm", "critic", "ppo", "ptx")

# a budget that keeps each run within seconds on one core; no held-out curve (it samples the held-out prompts too)
BUDGET = ["--steps", "2", "--sft-epochs", "1", "--sft-batch", "8", "--sft-hidden", "16", "--rm-epochs", "1",
          "--rm-batch", "8", "--rm-eval-every", "4", "--max-prompt-tokens", "32", "--max-response-tokens", "40",
          "--rollout-batch", "8", "--minibatch", "8", "--ppo-epochs", "1", "--ptx-batch", "4", "--max-new-tokens", "6",
          "--critic-pretrain-steps", "1", "--eval-samples", "1", "--heldout-every", "0", "--heldout-frac", "0.2",
          "--vocab-size", "300", "--threads", "1"]


def key(text: str) -> str:
    return " ".join(text.split()).casefold()


def first_turn(text: str) -> str:
    """The key of what follows the first "Human:" up to the next "Assistant:"; all of the key without one."""
    k = key(text)
    at = (" " + k).find(" human:")
    if at < 0:
        return k
    turn = k[at + len("human:"):]
    end = turn.find(" assistant:")
    turn = (turn if end < 0 else turn[:end]).strip()
    return turn or k


def meets(trained: str, evaluated: str) -> bool:
    """A training prompt that is an evaluation prompt: the same key, its start, or the same first human turn."""
    return key(evaluated).startswith(key(trained)) or first_turn(trained) == first_turn(evaluated)


def conversations() -> list[str]:
    """32 prompts: one short question per topic; one long conversation per topic (longer than --max-prompt-tokens,
    so it is cut to its latest turns) that opens with a turn of its own; and for four topics that opening turn alone
    and a second conversation that opens with it (the split keeps each such family on one side)."""
    short = [f"{H} How do I {t}?{A}" for t in TOPICS]
    long = [f"{H} Hi there, {t}.{A} Hello! How can I help?{H} I want to {t} this week, what should I get ready "
            f"first?{A} Start with the basics and go slowly.{H} And how do I {t} well?{A}" for t in TOPICS]
    family = [x for t in TOPICS[:4] for x in (f"{H} Hi there, {t}.{A}", f"{H} Hi there, {t}.{A} Hello!{H} Is it hard "
                                                                        f"to {t}?{A}")]
    return short + long + family


def copies(prompt: str) -> list[str]:
    """The ways a file repeats an evaluation prompt: re-spaced, re-cased, both (long ones are then cut at other
    points than the prompt itself), cut off at the end, its opening turn alone, and its first turn continued
    another way."""
    turn = prompt[len(H):prompt.index(A)].strip()
    return [prompt.replace(" ", "  ").replace("\n\n", "\n\n\n"), prompt.upper(), "\t" + prompt.swapcase() + " ",
            prompt[:len(prompt) * 2 // 3], prompt[:prompt.index(A) + len(A)],
            f"{H} {turn}{A} Fine.{H} Anything else to add?{A}"]


def leak_files(d: Path) -> dict[str, Path]:
    answers = ((" Sure, start slowly.", " No, go away."), (" Practise a little daily.", " Ask someone else."))
    pairs = [{"chosen": p + c, "rejected": p + r} for p in conversations() for c, r in answers]
    others = [f"{H} What is a good name for a cat?{A}", f"{H} Where is the moon?{A}"]
    prompts = [c for p in conversations() for c in copies(p)] + others
    sft = [{"prompt": c, "response": " A copy's answer."} for c in prompts]
    sft += [{"text": p.replace("\n\n", "\n\n\n") + " Sure."} for p in conversations()]  # a transcript: prompt, answer
    return {"pairs": write_jsonl(d / "pairs.jsonl", pairs), "sft": write_jsonl(d / "sft.jsonl", sft),
            "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": p} for p in prompts])}


def assert_no_leak(records: dict[str, list[str]]) -> None:
    """records.json: every consumer listed; no training prompt meets a held-out or judge prompt; the evaluation
    samples held-out prompts, never a judge's."""
    assert list(records) == ["heldout", "judge", "sft", "rm", "critic", "ppo", "ptx", "eval"]
    evaluated = records["heldout"] + records["judge"]
    assert records["heldout"] and records["judge"] and records["eval"]
    assert not any(meets(h, j) or meets(j, h) for h in records["heldout"] for j in records["judge"])
    for consumer in TRAINING:
        for trained in records[consumer]:
            bad = [e for e in evaluated if meets(trained, e)]
            assert not bad, (consumer, trained, bad[0])
    assert {key(e) for e in records["eval"]} <= {key(h) for h in records["heldout"]}  # held-out only, not the judge's


@pytest.mark.slow
def test_train_py_keeps_every_copy_of_an_evaluation_prompt_out_of_training(tmp_path, monkeypatch):
    """A real --model (a tiny GPT-2 of tools/tiny_model.py) through every stage, and the tiny --data path under
    --stages sft (stages 1-2 in runs/_base): records.json before the first stage, nothing of the evaluation in it."""
    monkeypatch.chdir(tmp_path)
    files = leak_files(tmp_path)
    given = ["--data", str(files["pairs"]), "--sft-data", str(files["sft"]), "--prompts", str(files["prompts"])]
    model = tiny_model.build_model("gpt2", [p + r for p, r in data.load_texts(files["pairs"])], tmp_path / "gpt2",
                                   hidden=16, layers=1, heads=2, vocab_size=300)
    summary = train.main(["--model", str(model), *given, *BUDGET, "--out", "run"])
    records = json.loads((tmp_path / "run" / "records.json").read_text())
    assert_no_leak(records)
    assert records["critic"] == records["ppo"] and records["ptx"] == records["sft"]
    # the files were read: copies of the proxy's prompts train, re-spaced as written (the key finds them)
    written = [c for p in conversations() for c in copies(p)]
    assert set(records["ppo"]) & set(written) and set(records["sft"]) & set(written)
    written_at = lambda path: path.stat().st_mtime_ns  # noqa: E731
    assert written_at(tmp_path / "run" / "records.json") <= written_at(tmp_path / "run" / "sft" / "DONE")
    assert summary["win_rate_vs_sft"]  # it ran to the end
    # the tiny --data path: records.json under --stages too, from the base it built; each kind counted in the report
    base = Path(train.main([*given, *BUDGET, "--stages", "sft", "--out", "tiny"])["sft"]).parent
    records = json.loads((tmp_path / "tiny" / "records.json").read_text())
    assert_no_leak(records)
    assert written_at(tmp_path / "tiny" / "records.json") <= written_at(base / "sft" / "config.json")
    dropped = json.loads((base / "data_report.json").read_text())["dropped"]
    for kind in ("same_prompt_as", "prefix_of", "first_turn_of"):
        for part in ("heldout", "judge"):
            assert dropped.get(f"{kind}_{part}", 0) > 0, (kind, part, dropped)


def test_the_split_keeps_conversations_that_open_alike_on_one_side(tmp_path):
    """--data's split (held out, judge, proxy) and --prompts' own split (without --data) group prompts by their first
    human turn: no part holds a prompt that opens like a prompt of another part, whatever the seed."""
    from plumbing import pipeline
    files = leak_files(tmp_path)
    tok = tiny_model.build_tokenizer("llama", conversations(), tmp_path / "tok", vocab_size=300)
    for seed in range(4):
        run = plumbing.flags.parse_configs(["--data", str(files["pairs"]), "--heldout-frac", "0.2", "--seed", str(seed)])[0]
        parts = pipeline.split_pairs(run, data.DataReport())
        turns = [{first_turn(p.prompt) for p in parts[k]} for k in ("pairs_train", "pairs_judge", "pairs_heldout")]
        assert all(turns) and not (turns[0] & turns[1] or turns[0] & turns[2] or turns[1] & turns[2]), seed
        run = plumbing.flags.parse_configs(["--prompts", str(files["pairs"]), "--heldout-frac", "0.3",
                                   "--seed", str(seed)])[0]
        rec = pipeline.run_records(run, tok)
        rollout, held = ({first_turn(r["uncut"]) for r in rec[k]} for k in ("prompts_train", "prompts_heldout"))
        assert rollout and held and not rollout & held, seed
        assert len(rec["prompts_train"]) + len(rec["prompts_heldout"]) == len(conversations())  # grouped, none lost
