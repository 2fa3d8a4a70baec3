"""Real preference data through the command lines: `train.py --data` (bad input → one line, exit 2; a tiny
end-to-end run judged by the reward model) and `eval.py score` (per-example scores, accuracy, Fig. 2 PNG).

The end-to-end data are made here (templated English HH transcripts), not taken from the real file.
"""
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing import data
import eval as evaluation
import train
from plumbing.cli import cli_guard
import plumbing.flags

ROOT = Path(__file__).resolve().parents[1]

# a budget small enough for CI: the whole train.py --data run stays well under a minute on 2 cores
TINY = ["--steps", "2", "--sft-epochs", "1", "--sft-hidden", "32", "--sft-batch", "16", "--rm-epochs", "1",
        "--rm-batch", "16", "--rm-eval-every", "4", "--vocab-size", "400", "--max-prompt-tokens", "48",
        "--max-response-tokens", "40", "--rollout-batch", "8", "--minibatch", "4", "--ptx-batch", "4",
        "--max-new-tokens", "8", "--critic-pretrain-steps", "1", "--eval-samples", "1", "--threads", "1"]

TOPICS = ["bake bread", "fix a bike", "learn chess", "grow tomatoes", "write a poem", "save money", "sleep better",
          "paint a wall", "train a puppy", "cook rice", "run a mile", "clean a window"]


def hh_pairs(n: int, seed: int = 0) -> list[dict]:
    """n HH-RLHF-format pairs: the chosen answer helps, the rejected one brushes the user off (longer)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        prompt = f"\n\nHuman: How do I {topic}?\n\nAssistant:"
        if i % 3 == 0:  # some multi-turn prompts, opening with a turn of their own (the split groups by it)
            prompt = f"\n\nHuman: Hi there, {topic}.\n\nAssistant: Hello! How can I help?{prompt}"
        chosen = f" Sure, to {topic} start slowly and practise {rng.choice(['daily', 'often', 'a little each day'])}."
        rejected = f" I do not want to talk about how to {topic}, {rng.choice(['go away', 'ask someone else', 'no'])}."
        rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return rows


def write_jsonl(path: Path, rows, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def assert_one_line_error(returncode: int, stderr: str, *needles: str) -> None:
    assert returncode == 2, (returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ----------------------------------------------------------------------------------------------
# Bad input: one line naming file and line, exit 2, no traceback (exits before any training)
# ----------------------------------------------------------------------------------------------
GOOD = json.dumps(hh_pairs(1)[0])
BAD_FILES = {  # file name: (lines, where, what the message says)
    "not_json.jsonl": ([GOOD, "{not json"], ":2:", "not JSON"),
    "no_marker.jsonl": ([GOOD, GOOD, json.dumps({"chosen": "Human: hi", "rejected": "Human: yo"})], ":3:", "Assistant:"),
    "identical.jsonl.gz": ([json.dumps({"prompt": "Q?", "chosen": " A.", "rejected": " A."})], ":1:", "identical"),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The real command lines, started together (each is mostly the torch/transformers import): name -> (rc, stderr)."""
    d = tmp_path_factory.mktemp("cli")
    cmds = {name: [str(ROOT / "train.py"), "--data", str(write_jsonl(d / name, rows, gz=name.endswith(".gz"))),
                   "--threads", "1"] for name, (rows, _, _) in BAD_FILES.items()}
    cmds["score"] = [str(ROOT / "eval.py"), "score", "--reward-model", "/nonexistent/rm",
                     "--data", str(write_jsonl(d / "pairs.jsonl", hh_pairs(3)))]
    procs = {k: subprocess.Popen([sys.executable, *c], cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in cmds.items()}
    return {k: (p.wait(timeout=180), p.communicate()[1]) for k, p in procs.items()}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_train_data_bad_line_exit_2_one_line(cli_runs, name):
    _, where, what = BAD_FILES[name]
    assert_one_line_error(*cli_runs[name], name + where, what)


def test_eval_score_wrong_reward_model_exit_2(cli_runs):
    assert_one_line_error(*cli_runs["score"], "/nonexistent/rm", "no such model/tokenizer directory")


def test_train_data_missing_file_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli_guard(train.main)(["--data", "nope.jsonl", "--threads", "1"])
    assert_one_line_error(e.value.code, capsys.readouterr().err, "nope.jsonl", "no such file")


@pytest.mark.parametrize("rows, where, what", [
    ([GOOD, json.dumps({"prompt": "Q?", "completion": " A.", "label": True})], ":2: field 'label'",
     "unpaired preference data"),
    ([GOOD], ": one row", "the split holds nothing out of one"),
    ([json.dumps({"prompt": [{"role": "user", "content": "tell me about bread"}], "chosen": [
        {"role": "assistant", "content": f"Bread {i}."}], "rejected": [{"role": "assistant", "content": "No."}]})
      for i in range(20)], ": all 20 pairs have the same prompt", "tell me about bread")])
def test_train_data_that_cannot_be_read_or_split_exit_2_before_any_work(rows, where, what, tmp_path, monkeypatch,
                                                                        capsys):
    """A format read as written but not usable (unpaired preference), and a file the split can hold nothing out of:
    one line naming the file (and line and field), exit 2, before the tokenizer or any stage is built."""
    monkeypatch.chdir(tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        cli_guard(train.main)(["--data", str(path), "--threads", "1", "--out", str(tmp_path / "run")])
    assert_one_line_error(e.value.code, capsys.readouterr().err, f"{path}{where}", what)
    assert not list(tmp_path.glob("runs/_base/real-*")) and not (tmp_path / "run" / "records.json").exists()


def test_eval_score_model_without_tokenizer_exit_2(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        evaluation.main(["score", "--reward-model", str(tmp_path / "model"),
                         "--data", str(write_jsonl(tmp_path / "p.jsonl", hh_pairs(2)))])
    assert_one_line_error(e.value.code, capsys.readouterr().err, "model", "no tokenizer files")


# ----------------------------------------------------------------------------------------------
# A tiny end-to-end run on real-format text, then `eval.py score` on its reward model
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """train.py --data on 120 generated HH pairs (one bad line, skipped), inside a temporary working directory."""
    d = tmp_path_factory.mktemp("real")
    rows = [json.dumps(r) for r in hh_pairs(120)]
    rows.insert(7, json.dumps({"chosen": "\n\nHuman: hi\n\nAssistant: ", "rejected": "\n\nHuman: hi\n\nAssistant: no"}))
    data_file = write_jsonl(d / "pairs.jsonl.gz", rows, gz=True)
    old = os.getcwd()
    os.chdir(d)
    try:
        summary = train.main(TINY + ["--data", str(data_file), "--skip-bad", "--out", str(d / "run")])
    finally:
        os.chdir(old)
    return d, data_file, summary


@pytest.mark.slow
def test_train_data_end_to_end_rm_judge(real_run):
    d, _, summary = real_run
    base = Path(summary["base"])
    if not base.is_absolute():
        base = d / base
    for f in ["DONE", "timings.json", "rm_log.json", "rm_heldout_scores.json", "data_report.json", "data_limits.json",
              "data/prompts_train.jsonl", "data/prompts_heldout.jsonl", "data/sft.jsonl",
              "tokenizer/tokenizer.json", "sft/config.json", "reward_model/value_head.safetensors",
              "reward_model/tokenizer.json", "reward_model/data_limits.json", "judge_model/value_head.safetensors",
              "judge_model/rm_log.json"]:
        assert (base / f).exists(), f
    report = json.loads((base / "data_report.json").read_text())
    assert report["kept"] == 120 and report["skipped"] == {"empty_response": 1}
    n = report["pairs_train"] + report["pairs_judge"] + report["pairs_heldout"]
    assert n + sum(report["dropped"].values()) == 120
    # split by prompt (24 distinct prompts here): half of the training prompts each, none on two sides
    by_part = {k: {r["prompt"] for r in data.read_records(base / "data" / f"{k}.jsonl")}
               for k in ("pairs_train", "pairs_judge", "pairs_heldout")}
    assert abs(len(by_part["pairs_train"]) - len(by_part["pairs_judge"])) <= 1
    assert not (by_part["pairs_train"] & by_part["pairs_judge"] or by_part["pairs_heldout"] & (
        by_part["pairs_train"] | by_part["pairs_judge"]))
    assert 0.0 <= summary["rm"]["accuracy"] <= 1.0
    # the win rate is judged by a second reward model on pairs the proxy never saw, and by the proxy beside it
    assert summary["judge"] == "held-out reward model" and summary["peak"] is None
    assert set(summary["win_rate_vs_sft_by_judge"]) == {"held-out reward model", "reward model (proxy)"}
    for w in summary["win_rate_vs_sft_by_judge"].values():
        assert abs(w["win"] + w["tie"] + w["lose"] - 1) < 1e-9
    assert summary["win_rate_vs_sft"] == summary["win_rate_vs_sft_by_judge"]["held-out reward model"]
    metrics = [json.loads(l) for l in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/gold"] is None for m in metrics)
    assert all(isinstance(m["reward/judge"], float) for m in metrics)  # the proxy-vs-judge gap, step by step
    table = evaluation.format_table(summary)
    assert "judge: held-out reward model" in table and "judge: reward model (proxy)" in table
    # every prompt written for PPO fits the limit as the model reads it ([BOS] added by data.query_ids)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base / "tokenizer")
    for line in (base / "data" / "prompts_train.jsonl").read_text().splitlines():
        assert len(data.query_ids(json.loads(line)["prompt"], tok)) <= 48


@pytest.mark.slow
def test_eval_score_writes_scores_and_histogram(real_run, tmp_path):
    d, data_file, summary = real_run
    base = Path(summary["base"])
    base = base if base.is_absolute() else d / base
    out = tmp_path / "scores.jsonl"
    res = evaluation.score(["--reward-model", str(base / "reward_model"), "--data", str(data_file), "--skip-bad",
                            "--out", str(out), "--hist", str(tmp_path / "fig2.png")])
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == res["pairs"] > 0
    assert all(abs(r["margin"] - (r["chosen"] - r["rejected"])) < 1e-9 for r in rows)
    acc = sum((r["margin"] > 0) + 0.5 * (r["margin"] == 0) for r in rows) / len(rows)
    assert abs(acc - res["accuracy"]) < 1e-9
    assert (tmp_path / "fig2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the held-out pairs scored through the CLI agree with the scores train.py saved for them
    saved = json.loads((base / "rm_heldout_scores.json").read_text())
    held = [json.loads(l)["source"] for l in (base / "data" / "pairs_heldout.jsonl").read_text().splitlines()]
    by_source = {r["source"]: r for r in rows}
    for src, c, j in zip(held, saved["chosen"], saved["rejected"]):
        assert abs(by_source[src]["chosen"] - c) < 1e-4 and abs(by_source[src]["rejected"] - j) < 1e-4
    # {"prompt","response"} records: one score each, no histogram
    recs = write_jsonl(tmp_path / "responses.jsonl", [{"prompt": "\n\nHuman: How do I cook rice?\n\nAssistant:",
                                                       "response": " Rinse it first."}, {"text": "Hello there."}])
    res = evaluation.score(["--reward-model", str(base / "reward_model"), "--data", str(recs),
                            "--out", str(tmp_path / "r.jsonl")])
    assert res["responses"] == 2 and len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    # the same pair in TRL's conversational formats scores as its transcript (a tokenizer without a template reads
    # the conversation text), and prompt-completion rows score as {"prompt", "response"} records
    q, yes, no = "How do I cook rice?", "Rinse it first.", "No."
    user, answer = {"role": "user", "content": q}, lambda c: [{"role": "assistant", "content": c}]  # noqa: E731
    hh = lambda y: f"\n\nHuman: {q}\n\nAssistant: {y}"  # noqa: E731
    forms = {"hh": {"chosen": hh(yes), "rejected": hh(no)},
             "explicit": {"prompt": [user], "chosen": answer(yes), "rejected": answer(no)},
             "implicit": {"chosen": [user] + answer(yes), "rejected": [user] + answer(no)},
             "completion": {"prompt": [user], "completion": answer(yes)}}

    def scored(name: str) -> tuple[dict, dict]:
        out = tmp_path / f"{name}.out"
        res = evaluation.score(["--reward-model", str(base / "reward_model"), "--out", str(out),
                                "--data", str(write_jsonl(tmp_path / f"{name}.jsonl", [forms[name]]))])
        return res, json.loads(out.read_text().splitlines()[0])
    margins = {name: scored(name)[1]["margin"] for name in ("hh", "explicit", "implicit")}
    assert margins["explicit"] == margins["implicit"] == pytest.approx(margins["hh"])
    res, row = scored("completion")  # prompt-completion: a {"prompt", "response"} record by another name
    assert res["responses"] == 1 and res["data_report"]["formats"] == {
        str(tmp_path / "completion.jsonl"): {"conversational prompt-completion": 1}}
    assert row["score"] == pytest.approx(evaluation.score_texts(*evaluation.load_scorer(str(base / "reward_model"))[:2],
                                                                [(hh("").rstrip(), " " + yes)])[0], abs=1e-5)


@pytest.mark.slow
def test_eval_score_scores_every_pair_cutting_long_ones(real_run, tmp_path):
    """Pairs whose responses (or prompts) exceed the reward model's limits are cut as they would be fed to it, and
    counted; none is dropped. A cut pair scores as its kept tokens do."""
    d, _, summary = real_run
    base = Path(summary["base"])
    base = base if base.is_absolute() else d / base
    long = " and then keep going" * 30   # far beyond the 40-token response limit
    rows = hh_pairs(6, seed=1)
    rows[1]["chosen"] += long
    rows[2]["rejected"] += long
    rows[3] = {k: "\n\nHuman: hi" * 60 + v for k, v in rows[3].items()}  # a prompt far beyond 48 tokens
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    res = evaluation.score(["--reward-model", str(base / "reward_model"), "--data", str(path),
                            "--out", str(tmp_path / "s.jsonl")])
    assert res["pairs"] == 6 and not res["data_report"]["dropped"]
    assert res["data_report"]["truncated_responses"] == 2 and res["data_report"]["truncated"] == 1
    # the cut pair's score equals the score of the text that was kept, encoded as in training
    rm, tok, limits = evaluation.load_scorer(str(base / "reward_model"))
    (rec,) = data.pair_records(data.load_pairs(path)[1:2], tok, 48, 40, False, data.DataReport(), cut=True)
    assert len(data.response_ids(rec["chosen"], tok)) <= 40 and rec["chosen"] != rows[1]["chosen"]
    kept = evaluation.score_texts(rm, tok, [(rec["prompt"], rec["chosen"])])[0]
    scored = [json.loads(l) for l in (tmp_path / "s.jsonl").read_text().splitlines()][1]["chosen"]
    assert abs(kept - scored) < 1e-4


@pytest.mark.slow
def test_eval_plot_draws_the_panels_of_a_run(real_run, tmp_path):
    d, _, _ = real_run
    res = evaluation.plot([str(d / "run"), "--out", str(tmp_path / "curves.png"), "--labels", "hh"])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = [p for p in res["panels"] if not p.endswith(": none")]
    # real data: the judge's reward instead of gold, and the final win rate of summary.json as its one point
    assert len(res["panels"]) == 6 and len(drawn) == 6, res["panels"]


@pytest.mark.slow
def test_train_data_as_a_parquet_file_and_a_saved_dataset(tmp_path, monkeypatch):
    """--data through `datasets`: the same pairs as a .parquet file and as a save_to_disk folder give the same
    stages 1-2 (the same held-out accuracy), with the split and the row in every message."""
    import datasets
    monkeypatch.chdir(tmp_path)
    ds = datasets.Dataset.from_list(hh_pairs(120))
    ds.to_parquet(str(tmp_path / "pairs.parquet"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    a = train.main(TINY + ["--data", "pairs.parquet", "--stages", "sft,rm", "--out", "a"])
    b = train.main(TINY + ["--data", "saved", "--data-split", "test", "--stages", "sft,rm", "--out", "b"])
    assert a["rm_heldout_accuracy"] == b["rm_heldout_accuracy"]
    with pytest.raises(data.DataError, match=r"saved\[dev\]: no split 'dev' \(it has test\)"):  # exit 2 on the CLI
        train.main(TINY + ["--data", "saved", "--data-split", "dev", "--out", "c"])


# ----------------------------------------------------------------------------------------------
# What trains never sees what evaluates: the run's records, built as train.py builds them
# ----------------------------------------------------------------------------------------------
def leak_files(d: Path) -> dict[str, Path]:
    """Pairs whose prompts repeat (the generator has 24 distinct prompts for 200 pairs, so a split by pair would put
    one prompt on both sides), and --sft-data / --prompts files that deliberately hold some of those prompts."""
    rows = hh_pairs(200)
    pairs = write_jsonl(d / "pairs.jsonl", rows)
    topics = ["bake bread", "fix a bike", "learn chess", "grow tomatoes", "write a poem", "save money"]
    sft = [{"prompt": f"\n\nHuman: How do I {t}?\n\nAssistant:", "response": f" Carefully, {t}."} for t in topics]
    sft += [{"text": r["chosen"]} for r in rows[:30]]              # whole transcripts: prompt and answer in the text
    sft += [{"prompt": "\n\nHuman: What is a good name for a cat?\n\nAssistant:", "response": " Tom."}]  # on no prompt
    prompts = [{"prompt": f"\n\nHuman: How do I {t}?\n\nAssistant:"} for t in topics]
    prompts += [{"prompt": "\n\nHuman: Where is the moon?\n\nAssistant:"}]
    return {"pairs": pairs, "sft": write_jsonl(d / "sft.jsonl", sft), "prompts": write_jsonl(d / "prompts.jsonl", prompts)}


def assert_no_leak(records: dict, pairs_file: Path) -> None:
    """No training set (SFT, proxy RM, ptx, PPO prompts) holds a held-out or judge prompt, as written or as cut, nor
    the text of a held-out or judge pair; checked by substring search against the raw lines of the file."""
    from plumbing.pipeline import data as pdata  # the same module
    raw = {p.source: p for p in pdata.load_pairs(pairs_file, skip_bad=True)}
    key = data.text_key
    banned = set()
    for part in ("pairs_heldout", "pairs_judge"):
        for r in records[part]:
            banned |= {key(r["prompt"]), key(raw[r["source"]].prompt)}
    assert records["pairs_heldout"] and banned
    eval_pairs = [raw[r["source"]] for part in ("pairs_heldout", "pairs_judge") for r in records[part]]
    assert {key(r["prompt"]) for r in records["prompts_heldout"]} <= banned  # the evaluation samples held-out only
    training = {"rm": [(r["prompt"], r["chosen"]) for r in records["pairs_train"]]
                      + [(raw[r["source"]].prompt, r["rejected"]) for r in records["pairs_train"]],
                "sft / ptx": [(r["prompt"], r["response"]) for r in records["sft"]],
                "ppo prompts": [(r["prompt"], "") for r in records["prompts_train"]]}
    for name, rows in training.items():
        assert rows, name
        for prompt, response in rows:
            text = key(prompt + response)
            assert key(prompt) not in banned or not prompt, (name, prompt)
            for p in eval_pairs:  # a held-out or judge prompt (or pair) anywhere inside a trained text
                assert key(p.prompt) not in text or (not prompt and key(p.prompt) not in key(response)), (name, prompt)
                assert key(p.prompt + p.chosen) not in text and key(p.prompt + p.rejected) not in text, (name, prompt)


@pytest.mark.parametrize("extra", [[], ["sft"], ["prompts"], ["sft", "prompts"]])
def test_the_runs_records_keep_evaluation_out_of_training(extra, tmp_path, capsys):
    """train.py's records on the tiny --data path (runs/_base, its own BPE) and on the real --model path (a GPT-2-style
    tokenizer), with and without --sft-data and --prompts: no held-out prompt and no held-out or judge pair in any
    training set. The files hold such prompts on purpose, and the rows left out are counted and printed."""
    import tiny_model
    from plumbing import pipeline
    files = leak_files(tmp_path)
    flags = ["--data", str(files["pairs"]), "--max-prompt-tokens", "24", "--max-response-tokens", "40",
             "--vocab-size", "400", "--out", str(tmp_path / "run")]
    for name in extra:
        flags += ["--sft-data" if name == "sft" else "--prompts", str(files[name])]
    run = plumbing.flags.parse_configs(flags)[0]
    records = pipeline.real_data(tmp_path / "base", run, {})[1]    # the tiny path (build_base's data step)
    assert_no_leak(records, files["pairs"])
    model = tiny_model.build_model("gpt2", [json.dumps(r) for r in hh_pairs(50)], tmp_path / "gpt2", hidden=16,
                                   layers=1, vocab_size=300)
    run = plumbing.flags.parse_configs(flags + ["--model", str(model)])[0]
    records = pipeline.real_model_records(run, {"model": str(model), "sft": None})  # the real --model path
    assert_no_leak(records, files["pairs"])
    out = capsys.readouterr().out
    if "sft" in extra:  # the topics' prompts and transcripts are held out or judged in part: some rows left out
        left = [int(l.split("SFT / ptx rows; ")[1].split(" left out")[0]) for l in out.splitlines() if "--sft-data" in l]
        assert left and all(n > 0 for n in left) and len({r["prompt"] for r in records["sft"]}) > 1
    if "prompts" in extra:
        assert "moon?" in " ".join(r["prompt"] for r in records["prompts_train"])  # (cut to 24 tokens)
        assert all("left out" in l for l in out.splitlines() if l.startswith("[data] --prompts"))


def test_prompts_without_data_are_split_for_the_evaluation(tmp_path):
    """--prompts alone (PPO from a given reward model): its own held-out part is the evaluation's, and --sft-data
    rows on those prompts are left out."""
    from plumbing import pipeline
    import tiny_model
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"\n\nHuman: Question {i}?\n\nAssistant:"} for i in range(40)]
                          + [{"prompt": "\n\nHuman: Question 3?\n\nAssistant:"}])
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"\n\nHuman: Question {i}?\n\nAssistant:", "response": " Yes."}
                                             for i in range(40)])
    model = tiny_model.build_model("llama", ["Question 1 2 3? Yes."] * 20, tmp_path / "m", hidden=16, layers=1,
                                   vocab_size=300)
    run = plumbing.flags.parse_configs(["--model", str(model), "--prompts", str(prompts), "--sft-data", str(sft)])[0]
    rec = pipeline.real_model_records(run, {"model": str(model), "sft": None})
    held = {r["prompt"] for r in rec["prompts_heldout"]}
    assert len(held) == 4 and not held & {r["prompt"] for r in rec["prompts_train"]}
    assert len(rec["prompts_train"]) == 36 and not held & {r["prompt"] for r in rec["sft"]} and len(rec["sft"]) == 36


def test_prompts_that_leave_nothing_to_train_or_evaluate_fail_clearly(tmp_path):
    from plumbing import pipeline
    import tiny_model
    model = tiny_model.build_model("llama", ["Question 1 2 3? Yes."] * 20, tmp_path / "m", hidden=16, layers=1,
                                   vocab_size=300)
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "\n\nHuman: Only one?\n\nAssistant:"}] * 3)
    run = plumbing.flags.parse_configs(["--model", str(model), "--prompts", str(one)])[0]
    with pytest.raises(data.DataError, match="all 3 rows have the same prompt") as info:
        pipeline.real_model_records(run, {"model": str(model), "sft": None})
    assert str(info.value).startswith(str(one))
