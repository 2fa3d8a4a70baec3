"""Where each stage's inputs come from and where its outputs go, for the synthetic world, --data and a real model.

Implements (no equation: the order and the files around the stage functions of sft.py, reward_model.py and
ppo_max.py):
    build_base(run, sft_cfg, rm_cfg, world_cfg)  → stages 1-2 of the tiny world or --data, cached once under
                                                   runs/_base/<name>-<hash>/ (checkpoint.build_once)
    split_pairs / encode_splits                  → --data's pairs: held out, the proxy reward model's, the judge's,
                                                   split by a conversation's first human turn: the one split of the run
    run_records / keep_out                       → every stage's records from that split, each taking its part by
                                                   name; --sft-data / --prompts rows that meet an evaluation prompt
                                                   (data.Evaluation: one key, the text as written) left out, counted
    stage_records / write_stage_records          → what each consumer reads (SFT, RM, critic, PPO, ptx, evaluation),
                                                   and <out>/records.json, written before the first stage
    resolve_real_models / fit_context            → a real --model: the directories given, and the limits lowered to
                                                   fit the models' positions
    real_model_records / real_model_stages       → its records, and stages 1-2 trained into --out/sft/,
                                                   --out/reward_model/, --out/judge_model/
    ppo_inputs → Inputs                          → what the PPO stage loads: four model directories, the tokenizer,
                                                   the prompts and SFT text
    stop_after_stages                            → --stages sft or sft,rm: the trained directories, and stop

Run: python train.py --stages sft,rm [--model DIR --data PAIRS]      (stages 1-2 only)

`run` is train.RunConfig (the flags); this file reads it and never imports train.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from plumbing import checkpoint
from plumbing import data
from plumbing import engine
import eval as evaluation
from plumbing import models
from plumbing import lora

from plumbing import scale
import toy_world
from plumbing import cli
from plumbing.cli import fail
from plumbing.config import PPOConfig, RMConfig, SFTConfig
from plumbing.models import not_a_reward_model, reward_model_kind
from reward_model import ScalarHeadModel, score_pairs, train_reward_model
from sft import pretrained_model, tiny_llama, train_sft


STAGES = ("sft", "rm", "critic", "ppo")
RM_SIZE_FLAGS = ("rm_hidden", "rm_layers", "rm_pairs")  # the proxy's own size and data (the over-optimisation curve)


def last_stage(run) -> str:
    return [s.strip() for s in run.stages.split(",") if s.strip()][-1]


def base_key(run, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig):
    """(directory name under runs/_base, what it depends on): everything stages 1-2 read, and nothing else."""
    rm = {k: v for k, v in dataclasses.asdict(rm_cfg).items() if k not in RM_SIZE_FLAGS or v}  # the defaults (0)
    if not run.data:  # leave the key, and the cached bases of runs from before these flags existed, unchanged
        key = [toy_world.config_key(world_cfg), dataclasses.asdict(sft_cfg), rm]
        return f"seed{run.seed}-{checkpoint.config_hash(key)}", key
    limits = {"max_prompt_tokens": run.max_prompt_tokens, "max_response_tokens": run.max_response_tokens,
              "note": "ids = query_ids(prompt) ([BOS] + prompt, latest turns kept) ≤ P + response + [EOS] ≤ T"}
    key = {"data": data.fingerprint(data_source(run, run.data)), "split": "by first human turn",
           "read": "TRL's formats; a conversation as messages until rendered; a special token's spelling as text",
           "keep_out": "text as written, one key (whitespace, case): same prompt, prefix, first turn",
           "limits": limits, "vocab_size": run.vocab_size, "heldout_frac": run.heldout_frac, "skip_bad": run.skip_bad,
           "judge_frac": run.judge_frac,
           "seed": run.seed, "sft": dataclasses.asdict(sft_cfg), "rm": rm}
    for flag in ("sft_data", "prompts"):  # the SFT/ptx rows and PPO prompts are written into the base too
        if getattr(run, flag):
            key[flag] = data.fingerprint(data_source(run, getattr(run, flag)))
    return f"real-seed{run.seed}-{checkpoint.config_hash(key)}", key


def base_dir(run, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig) -> Path:
    return Path("runs/_base") / base_key(run, sft_cfg, rm_cfg, world_cfg)[0]


def build_base(run, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig,
               rebuild: bool = False, cfg: PPOConfig | None = None) -> tuple[Path, bool]:
    """(the base, whether this process built it): stages 1-2 into runs/_base/<name>-<hash>/: data/*.jsonl and the
    tokenizer, sft/ and reward_model/ (Hugging Face directories), sft_log.json, rm_log.json (Fig. 3),
    rm_heldout_scores.json (Fig. 2), timings.json, config.json; in the synthetic world also rm_length_bias.json, with
    --data data_report.json and data_limits.json (also in reward_model/, for `eval.py score`). Reused when built
    before, unless `rebuild`. With `cfg` (the run's PPO config), --out/records.json too (write_stage_records): before
    stage 1 when built here, else from the base's records."""
    name, key = base_key(run, sft_cfg, rm_cfg, world_cfg)

    def build(tmp: Path) -> None:
        timings = {}
        t0 = time.time()
        tokenizer, records, max_positions = real_data(tmp, run, key["limits"]) if run.data else world_data(tmp, world_cfg)
        if rm_cfg.rm_pairs:  # the proxy's data size: what the reward model (and DPO) see, on disk as pairs_train
            records["pairs_train"] = records["pairs_train"][:rm_cfg.rm_pairs]
            toy_world.write_dataset({"pairs_train": records["pairs_train"]}, tmp / "data")
        timings["data" if run.data else "world"] = time.time() - t0
        if cfg is not None:
            write_stage_records(Path(run.out), stage_records(records, run, cfg))
        rm = sft_and_reward_model(tmp, tokenizer, records, sft_cfg, rm_cfg, run.seed, timings, max_positions,
                                  sft_cache=sft_cache)
        if run.data and records["pairs_judge"]:  # the judge: the same recipe on pairs the proxy never saw
            t0 = time.time()
            train_judge(tmp / "sft", tokenizer, records, rm_cfg, run.seed, tmp / "judge_model")
            timings["judge_model"] = time.time() - t0
            print(f"[2b. judge] {timings['judge_model']:.1f} s")
        if run.data:
            write_json(tmp / "reward_model" / "data_limits.json", key["limits"])
            print(f"[base] reward model held-out accuracy "
                  f"{json.loads((tmp / 'rm_log.json').read_text())[-1]['heldout_accuracy']:.3f} "
                  f"on {len(records['pairs_heldout'])} pairs")
        else:
            write_json(tmp / "rm_length_bias.json",
                       evaluation.length_bias(rm, tokenizer, records["prompts_heldout"], run.seed, world_cfg.name))
        write_json(tmp / "timings.json", timings)
        write_json(tmp / "config.json", key if run.data else {"world": key[0], "sft": key[1], "rm": key[2],
                                                              "seed": run.seed})

    what = ("tokenizer, SFT and reward model for this data file and config" if run.data
            else "world, SFT and reward model for this seed and config")
    sft_cache = Path("runs/_base") / f"{name}.sft"  # stage 1 alone, kept as soon as it ends (keep_sft)
    if rebuild:
        shutil.rmtree(sft_cache, ignore_errors=True)
    cli.interrupt_note(during="stages 1-2 (SFT, reward model)", kept="nothing of this run yet")
    path, built = checkpoint.build_once(Path("runs/_base") / name, build, what, rebuild=rebuild)
    shutil.rmtree(sft_cache, ignore_errors=True)  # the base holds its sft/ now
    cli.interrupt_note(during="stage 3 (critic pre-training) or the start of PPO",
                       kept=f"SFT and the reward model in {path} (a rerun reuses them)")
    if not built and (problem := checkpoint.unreadable(path)):  # a cached base damaged since it was built
        fail(f"{problem}; --rebuild-base trains stages 1-2 again")
    if not built and cfg is not None:
        write_stage_records(Path(run.out), stage_records(base_records(path), run, cfg))
    return path, built


def base_records(base: Path) -> dict[str, list[dict]]:
    """Every record a base holds (its data/*.jsonl, by file name: prompts_train, sft, pairs_heldout, ...)."""
    return {f.name.removesuffix(".jsonl"): data.read_records(f) for f in sorted((base / "data").glob("*.jsonl"))}


def world_data(tmp: Path, world_cfg: toy_world.WorldConfig):
    """The synthetic world's records (written to tmp/data) and its word-level tokenizer (tmp/tokenizer)."""
    from transformers import AutoTokenizer
    world = toy_world.world(world_cfg.name)  # toy_world.py or toy_world_b.py (--world)
    records = world.make_dataset(world_cfg)
    toy_world.write_dataset(records, tmp / "data")
    toy_world.build_tokenizer(tmp / "tokenizer", world.VOCAB)
    return AutoTokenizer.from_pretrained(tmp / "tokenizer"), records, None


def data_source(run, path: str):
    """--data / --sft-data / --prompts as data.py reads them (a .jsonl file, or a Source with --data-split/-config)."""
    return data.source(path, run.data_split, run.data_config or None) if path else path


def split_pairs(run, report: data.DataReport) -> dict[str, list]:
    """--data's pairs in three disjoint parts, the ONE split of the run: held out (RM accuracy, evaluation prompts),
    the proxy reward model's training pairs (and with them SFT, PPO's prompts and the ptx text), and (--judge-frac
    > 0) the judge's: a second reward model PPO never optimises (Gao et al. 2022). The groups are conversations that
    open with the same human turn (data.first_turn_key, on the text as written): all pairs of one prompt, and of
    prompts that continue one conversation, go to one part together, so no prompt is both trained on and evaluated
    and no evaluation prompt begins with a training one. A part the split leaves empty is a DataError that names
    why (split_cause), before any work."""
    pairs = data.load_pairs(data_source(run, run.data), skip_bad=run.skip_bad, report=report)  # DataError: exit 2
    key = lambda p: data.first_turn_key(p.prompt)  # noqa: E731
    train_pairs, heldout = data.train_heldout_split(pairs, run.heldout_frac, run.seed, key)
    proxy, judge = data.train_heldout_split(train_pairs, run.judge_frac, run.seed + 1, key) if run.judge_frac else (
        train_pairs, [])
    splits = {"pairs_train": proxy, "pairs_judge": judge, "pairs_heldout": heldout}
    empty = [PART_NAMES[name] for name in splits if not splits[name] and (name != "pairs_judge" or run.judge_frac)]
    if empty:
        raise data.DataError(run.data, None, None, "too_few_prompts", split_cause(
            [(p.prompt, p.source) for p in pairs], "pairs", " and ".join(empty), run, splits))
    return splits


PART_NAMES = {"pairs_train": "training", "pairs_heldout": "held-out", "pairs_judge": "judge"}


def split_cause(prompts: list[tuple[str, str]], what: str, empty: str, run, splits: dict | None = None) -> str:
    """Why a split of these (prompt, source) rows left the `empty` part(s) with nothing, in the words of the cause:
    one row; prompts that hold no question (nothing but role markers: a prompt lost before the file was read);
    one prompt for every row; one conversation (first human turn) for every row; else the fractions that took
    every conversation. The split keeps a conversation on one side, so it needs one per part."""
    parts = 3 if splits is not None and run.judge_frac else 2
    names = "held out, trained on and judged" if parts == 3 else "held out and trained on"
    turns = Counter(data.first_turn_key(p) for p, _ in prompts)
    need = f"give {what} of at least {parts} different conversations (one for each part: {names})"
    if len(prompts) == 1:
        return f"one row ({prompts[0][1]}): the split holds nothing out of one; {need}"
    if not any(data.question_words(p) for p, _ in prompts):
        return (f"every prompt holds no question, nothing but role markers (e.g. {prompts[0][1]}: "
                f"{data.show(prompts[0][0])}): the prompts were lost before the file was read, so no {empty} "
                f"{what} are left; write each question in the prompt")
    if len({data.text_key(p) for p, _ in prompts}) == 1:
        return (f"all {len(prompts)} {'rows' if what == 'prompts' else what} have the same prompt "
                f"{data.show(prompts[0][0])}: the split keeps a prompt on one side, so none is left for the "
                f"{empty} part; {need}")
    if len(turns) < parts:
        return (f"{len(prompts)} {what} in only {len(turns)} conversation(s) (prompts that open with the same human "
                f"turn, e.g. {data.show(turns.most_common(1)[0][0])}): the split keeps a conversation on one side, "
                f"so none are left for the {empty} part; {need}")
    took = ", ".join(f"{PART_NAMES[k]} {len({data.first_turn_key(p.prompt) for p in v})}"
                     for k, v in (splits or {}).items())
    return (f"{len(turns)} conversations (first human turns), split by --heldout-frac {run.heldout_frac}"
            + (f" and --judge-frac {run.judge_frac}" if parts == 3 else "") + f" into {took}: none are left for "
            f"the {empty} part; change the fractions or give more {what}")


def encode_splits(run, splits: dict[str, list], tokenizer, report: data.DataReport) -> dict[str, list]:
    """The limits applied once to every split (data.pair_records), and a clear error when one is left empty. A pair
    that meets a prompt of a later part (held out, then the judge's) as written or once cut (evaluation_parts,
    keep_out) leaves its part too, counted by kind (same_prompt_as_heldout, prefix_of_judge, ...): cut prompts keep
    only their latest turns, so two different prompts can become one. A part left empty names its cause: every
    pair beyond the limits, or every pair within them left out."""
    lim = (run.max_prompt_tokens, run.max_response_tokens)
    fitted = {name: data.pair_records(pairs, tokenizer, *lim, run.skip_bad, report) for name, pairs in splits.items()}
    out, left = dict(fitted), {}
    held = evaluation_parts(splits, out, ("pairs_heldout",))
    out["pairs_judge"], left["pairs_judge"] = keep_out(out["pairs_judge"], held, report)
    out["pairs_train"], left["pairs_train"] = keep_out(out["pairs_train"], evaluation_parts(splits, out), report)
    report.pairs_summary = report.summary()  # the run's closing [data] line repeats it
    print(f"[data] {run.data}: {len(out['pairs_train'])} train / {len(out['pairs_judge'])} judge / "
          f"{len(out['pairs_heldout'])} held-out pairs; {report.pairs_summary}")
    for name, what in PART_NAMES.items():
        if out[name] or (name == "pairs_judge" and not run.judge_frac):
            continue
        if not fitted[name]:
            hint = ("raise --max-response-tokens (a response is never cut for training)"
                    if report.dropped.get("response_too_long") else "see the reasons counted")
            cause = (f"none of its {len(splits[name])} pairs fits --max-prompt-tokens {lim[0]} and "
                     f"--max-response-tokens {lim[1]} ({report.summary()}); {hint}, or give more pairs")
        else:
            cause = (f"its {len(fitted[name])} pairs within the limits all meet a held-out or judge prompt once cut "
                     f"to --max-prompt-tokens {lim[0]} ({left_out(left[name])}: a cut prompt keeps only its latest "
                     f"turns, so two prompts can become one); raise --max-prompt-tokens")
        raise data.DataError(run.data, None, None, "all_skipped", f"no {what} pairs left: {cause}")
    return out


EVALUATION_PARTS = {"pairs_heldout": "heldout", "pairs_judge": "judge"}
KINDS = {"same_prompt": "same_prompt_as", "prefix": "prefix_of", "first_turn": "first_turn_of"}  # a DataReport reason


def evaluation_parts(splits: dict[str, list], records: dict[str, list[dict]],
                     parts=("pairs_heldout", "pairs_judge")) -> dict[str, data.Evaluation]:
    """"heldout" and "judge": the prompts of those parts of --data's split as written (`splits`) and as cut
    (`records`), for keep_out."""
    return {EVALUATION_PARTS[p]: data.Evaluation.of([x.prompt for x in splits[p]] + [r["prompt"] for r in records[p]])
            for p in parts}


def keep_out(records: list[dict], evaluation: dict[str, data.Evaluation], report: data.DataReport
             ) -> tuple[list[dict], Counter]:
    """(the records that meet no evaluation prompt, what was left out by reason). A record meets one when a text it
    trains on (data.trained_texts: its prompt as written and as cut, a {"text"} row's transcripts) has the key of one,
    is the start of one, or opens with its first human turn (data.Evaluation.overlap); each one left out is counted
    in report.dropped as <kind>_<part> (same_prompt_as_heldout, prefix_of_judge, first_turn_of_heldout, ...) with its
    file and line."""
    kept, dropped = [], Counter()
    for r in records:
        texts = data.trained_texts(r)
        kinds = ((part, ev.overlap(texts)) for part, ev in evaluation.items())
        reason = next((f"{KINDS[kind]}_{part}" for part, kind in kinds if kind), None)  # held-out first, then judge
        if reason:
            report.drop(reason, r.get("source", "?"))
            dropped[reason] += 1
        else:
            kept.append(r)
    return kept, dropped


def left_out(dropped: Counter) -> str:
    """keep_out's counts as a phrase of a [data] line: "3 left out (same_prompt_as_heldout 2, prefix_of_judge 1)"."""
    return f"{sum(dropped.values())} left out" + (
        f" ({', '.join(f'{k} {n}' for k, n in sorted(dropped.items()))})" if dropped else "")


def closing_data_line(path: str, report: dict) -> str:
    """The run's last [data] line, from the base's data_report.json: --data's pairs as the first [data] line counted
    them (kept, skipped, truncated, dropped), and, when --sft-data or --prompts added to the counts, all of it."""
    pairs = report.get("pairs_summary") or report["summary"]
    return f"[data] {path}: {pairs}" + ("" if pairs == report["summary"] else
                                       f" (with --sft-data / --prompts: {report['summary']})")


def run_records(run, tokenizer, report: data.DataReport | None = None, splits: dict | None = None) -> dict:
    """Every record the run's stages read, from ONE split of --data (split_pairs), each stage taking its part by name
    and every text cut by the one rule (data.fit_example):

        pairs_train     the proxy reward model (Eq. 2)          pairs_judge     the judge
        pairs_heldout   RM accuracy (Fig. 3)                    prompts_heldout the final evaluation (its prompts)
        sft             SFT and the ptx term (Eq. 17)           prompts_train   PPO's rollouts

    sft: --sft-data when given, else the chosen responses of pairs_train. prompts_train: --prompts when given, else
    the prompts of pairs_train. Rows of --sft-data or --prompts that meet a held-out or judge prompt (keep_out: on
    the text as written, and as cut) are left out and counted by kind (printed, and in the report). The evaluation
    prompts are --data's held-out prompts; with --prompts and no --data, --prompts itself is split (--heldout-frac,
    grouped by first human turn) into rollout and evaluation prompts. Every record keeps its prompt as written in
    "uncut" (records.json lists those)."""
    report = report if report is not None else data.DataReport()
    P, T = run.max_prompt_tokens, run.max_response_tokens
    out = {"pairs_train": [], "pairs_judge": [], "pairs_heldout": [], "prompts_heldout": []}
    evaluation = {}  # "heldout", "judge" → their prompts as written and as cut (data.Evaluation)
    if run.data:
        splits = splits or split_pairs(run, report)
        out.update(encode_splits(run, splits, tokenizer, report))
        out["prompts_heldout"] = data.distinct_prompts(out["pairs_heldout"])
        evaluation = evaluation_parts(splits, out)
    if run.prompts:
        rows = data.load_prompts(data_source(run, run.prompts), skip_bad=run.skip_bad, with_source=True)
        rows = every = data.prompt_records(rows, tokenizer, P, run.skip_bad, report)
        if not run.data:  # --prompts is its own evaluation: its held-out part, whole conversations on one side
            rows, held = data.train_heldout_split(data.distinct_prompts(rows), run.heldout_frac, run.seed,
                                                  lambda r: data.first_turn_key(r["uncut"]))
            out["prompts_heldout"] = held
            evaluation = {"heldout": data.Evaluation.of([r["uncut"] for r in held] + [r["prompt"] for r in held])}
        prompts, dropped = keep_out(rows, evaluation, report)
        out["prompts_train"] = data.distinct_prompts(prompts)
        if not out["prompts_train"] or not out["prompts_heldout"]:
            raise data.DataError(run.prompts, None, None, "all_skipped" if run.data else "too_few_prompts", (
                "every prompt is a held-out or judge prompt of --data" if run.data else split_cause(
                    [(r["uncut"], r["source"]) for r in every], "prompts", "rollout" if not out["prompts_train"]
                    else "evaluation", run)) + f" ({report.summary()})")
        print(f"[data] --prompts {run.prompts}: {len(out['prompts_train'])} rollout prompts, {left_out(dropped)} (they "
              f"meet a held-out or judge prompt)" + ("" if run.data else
                                                     f", {len(out['prompts_heldout'])} held out for the evaluation"))
    else:
        out["prompts_train"] = data.distinct_prompts(out["pairs_train"])
    if run.sft_data:
        rows = data.load_texts(data_source(run, run.sft_data), skip_bad=run.skip_bad, with_source=True)
        fitted = data.text_records(rows, tokenizer, P, T, run.skip_bad, report)
        out["sft"], dropped = keep_out(fitted, evaluation, report)
        print(f"[data] --sft-data {run.sft_data}: {len(out['sft'])} SFT / ptx rows; {left_out(dropped)} (they train "
              f"on a held-out or judge prompt); {len(rows) - len(fitted)} beyond the limits")
        if not out["sft"]:
            raise data.DataError(run.sft_data, None, None, "all_skipped", f"no SFT row left within the limits, apart "
                                                                          f"from the evaluation ({report.summary()})")
    else:
        out["sft"] = [{"prompt": r["prompt"], "response": r["chosen"], "source": r["source"], "uncut": r["uncut"]}
                      for r in out["pairs_train"]]  # SFT on y_w
    return out


CONSUMERS = ("heldout", "judge", "sft", "rm", "critic", "ppo", "ptx", "eval")  # the keys of records.json


def stage_records(records: dict[str, list[dict]], run, cfg: PPOConfig) -> dict[str, list[dict]]:
    """What each consumer of the run reads, by name: the one place where each stage takes its part of the run's
    records (run_records, or the synthetic world's), so that records.json (write_stage_records) says what trained.

        heldout  the held-out part of the split: --data's held-out pairs (RM accuracy, Fig. 3), else the held-out
                 prompts (the world's, or --prompts' own)
        judge    the judge's pairs (--data; none in the synthetic world, whose judge is gold)
        sft      stage 1's rows                  rm      stage 2's pairs (and DPO's, --method dpo)
        ppo      the rollouts' prompts           critic  the same rollouts, when --advantage has a critic (stage 3 and
                                                         the value loss)
        ptx      the rows of the ptx term (Eq. 17): the SFT rows, or the world's pretraining text (--ptx-data pretrain),
                 {"prompt": "", "response": text}; none when λ_ptx = 0
        eval     what the final evaluation and the held-out curve sample: the held-out prompts

    ppo, critic and ptx are empty for --method dpo and best-of-n (no rollouts)."""
    part = lambda name: records.get(name, [])  # noqa: E731  (a real --model given all its stages reads none)
    ppo = run.method == "ppo"
    pretrain = [{"prompt": "", "response": r["text"]} for r in part("pretrain")]  # the world's text, no prompt
    ptx = pretrain if cfg.ptx_data == "pretrain" else part("sft")
    return {"heldout": part("pairs_heldout") if run.data else part("prompts_heldout"),
            "judge": part("pairs_judge"),
            "sft": part("sft"),
            "rm": part("pairs_train"),
            "critic": part("prompts_train") if ppo and cfg.advantage == "gae" else [],
            "ppo": part("prompts_train") if ppo else [],
            "ptx": ptx if ppo and cfg.ptx_coef else [],
            "eval": part("prompts_heldout")}


def write_stage_records(out: Path, rows: dict[str, list[dict]]) -> None:
    """<out>/records.json, written atomically before the first stage: for each consumer (CONSUMERS) the distinct
    prompts it reads, as written (data.uncut_prompt: before any cut; a {"text"} row as its whole text)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "records.json", {k: list(dict.fromkeys(data.uncut_prompt(r) for r in rows[k])) for k in CONSUMERS})


def real_data(tmp: Path, run, limits: dict):
    """--data's pairs: split, a byte-level BPE trained on the training splits only, every record of the run
    (run_records) written to tmp/data. Returns (tokenizer, records, the model's context P + T)."""
    report = data.DataReport()
    splits = split_pairs(run, report)
    train_pairs = splits["pairs_train"] + splits["pairs_judge"]
    tokenizer = data.train_bpe_tokenizer([p.prompt + p.chosen for p in train_pairs] + [p.rejected for p in train_pairs],
                                         tmp / "tokenizer", run.vocab_size)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)  # tiny_llama's ids
    records = run_records(run, tokenizer, report, splits)
    toy_world.write_dataset(records, tmp / "data")
    write_json(tmp / "data_report.json", {**report.to_dict(), "summary": report.summary(),
                                          "pairs_summary": report.pairs_summary, "file": run.data,
                                          **{k: len(records[k]) for k in ("pairs_train", "pairs_judge",
                                                                          "pairs_heldout")}})
    write_json(tmp / "data_limits.json", limits)
    return tokenizer, records, run.max_prompt_tokens + run.max_response_tokens


def sft_and_reward_model(tmp: Path, tokenizer, records: dict, sft_cfg: SFTConfig, rm_cfg: RMConfig, seed: int,
                         timings: dict, max_positions: int | None = None,
                         sft_cache: Path | None = None) -> ScalarHeadModel:
    """Stage 1 (tmp/sft) on records["sft"], then stage 2 (tmp/reward_model) from it with a fresh scalar head on
    records["pairs_train"], held-out accuracy on records["pairs_heldout"]; the logs of Fig. 2 and Fig. 3. With
    `sft_cache`, stage 1 is kept there as soon as it ends (keep_sft), and taken from there when an earlier build
    stopped after it (Ctrl-C in the reward model): stage 2 reseeds, so it trains the same either way."""
    # 1. SFT: a from-scratch tiny LLaMA on the demonstrations
    t0 = time.time()
    if sft_cache is not None and (sft_cache / checkpoint.DONE).is_file():
        shutil.copytree(sft_cache / "sft", tmp / "sft")
        kept = json.loads((sft_cache / "sft_log.json").read_text())
        sft_losses, timings["sft"] = kept["loss"], kept["seconds"]
        print(f"[1. SFT] reusing {sft_cache} (finished by an earlier run that stopped before its reward model)")
    else:
        cli.interrupt_note(during="stage 1 (SFT)")
        checkpoint.seed_everything(seed)
        model = tiny_llama(len(tokenizer), sft_cfg)
        if max_positions:
            model.config.max_position_embeddings = max_positions  # RoPE: no table to resize
        sft_losses = train_sft(model, tokenizer, [(r["prompt"], r["response"]) for r in records["sft"]], sft_cfg,
                               seed, out_dir=tmp / "sft")
        timings["sft"] = time.time() - t0
        print(f"[1. SFT] {timings['sft']:.1f} s")
        if sft_cache is not None:
            keep_sft(sft_cache, tmp / "sft", sft_losses, timings["sft"])
    if sft_cache is not None:
        cli.interrupt_note(during="stage 2 (reward model)", kept=f"SFT in {sft_cache} (a rerun starts from it)")
    # 2. reward model, initialised from SFT with a fresh scalar head (Eq. 2), held-out accuracy along the way (Fig. 3)
    t0 = time.time()
    backbone = tmp / "sft"
    if rm_cfg.rm_hidden or rm_cfg.rm_layers:  # a proxy of its own size: its LM trained as stage 1, then Eq. 2 on it
        backbone = tmp / "rm_backbone"
        size = dataclasses.replace(sft_cfg, sft_hidden=rm_cfg.rm_hidden or sft_cfg.sft_hidden,
                                   sft_layers=rm_cfg.rm_layers or sft_cfg.sft_layers)
        checkpoint.seed_everything(seed + 2)
        lm_ = tiny_llama(len(tokenizer), size)
        if max_positions:
            lm_.config.max_position_embeddings = max_positions
        train_sft(lm_, tokenizer, [(r["prompt"], r["response"]) for r in records["sft"]], size, seed + 2,
                  "2a. reward model's backbone", out_dir=backbone)
    checkpoint.seed_everything(seed)
    rm = ScalarHeadModel.from_pretrained(backbone)
    rm_log = train_reward_model(rm, tokenizer, records["pairs_train"], records["pairs_heldout"], rm_cfg, seed,
                                out_dir=tmp / "reward_model")
    rc, rr = score_pairs(rm, tokenizer, records["pairs_heldout"])
    timings["reward_model"] = time.time() - t0
    print(f"[2. reward model] {timings['reward_model']:.1f} s")
    write_json(tmp / "sft_log.json", {"loss": sft_losses})
    write_json(tmp / "rm_log.json", rm_log)                                                      # Fig. 3
    write_json(tmp / "rm_heldout_scores.json", {"chosen": rc.tolist(), "rejected": rr.tolist()})  # Fig. 2
    return rm


def keep_sft(cache: Path, sft_dir: Path, losses: list[float], seconds: float) -> None:
    """Stage 1's model and log at `cache` (written beside it, then renamed into place with its DONE), so that a run
    stopped in stage 2 keeps its SFT; build_base removes it once the whole base is built."""
    part = Path(str(cache) + ".tmp")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(sft_dir, part / "sft")
    write_json(part / "sft_log.json", {"loss": losses, "seconds": seconds})
    (part / checkpoint.DONE).write_text("ok\n")
    shutil.rmtree(cache, ignore_errors=True)
    part.rename(cache)


def reward_model_dir(sft_dir, tokenizer, pairs: list[dict], heldout: list[dict], rm_cfg: RMConfig, seed: int,
                     head_seed: int, out_dir: Path, name: str, ds: dict | None = None, bf16: bool = False,
                     device: torch.device = torch.device("cpu"), grad_ckpt: bool = False, run=None) -> list[dict]:
    """Stage 2 into its own directory: from the SFT model with a fresh head (drawn with head_seed), Eq. 2 on `pairs`,
    held-out accuracy on `heldout`; rm_log.json (Fig. 3) and rm_heldout_scores.json (Fig. 2) beside the weights.
    Serves a real model's reward model and every judge. With `run` and its --lora-r: adapters and the head train."""
    checkpoint.seed_everything(seed)
    adapters = run is not None and lora.enabled(run)
    rm = ScalarHeadModel.from_pretrained(sft_dir, seed=head_seed, **({"torch_dtype": torch.bfloat16} if bf16 else {}),
                                         quantization=lora.quantization(run) if adapters else None)
    rm = rm if adapters and run.lora_bits != 16 else rm.to(device)
    if grad_ckpt:
        models.gradient_checkpointing(rm)
    if adapters:
        rm = lora.add_adapters(rm, run, seed=seed)
    log = train_reward_model(rm, tokenizer, pairs, heldout, rm_cfg, seed, ds=ds, out_dir=out_dir)
    rc, rr = score_pairs(rm, tokenizer, heldout)
    if engine.rank() == 0:
        write_json(out_dir / "rm_log.json", log)                                                          # Fig. 3
        write_json(out_dir / "rm_heldout_scores.json", {"chosen": rc.tolist(), "rejected": rr.tolist()})  # Fig. 2
    print(f"[{name}] held-out accuracy {log[-1]['heldout_accuracy']:.3f} on {len(heldout)} pairs (trained on "
          f"{len(pairs)} pairs)")
    return log


def train_judge(sft_dir, tokenizer, records: dict, rm_cfg: RMConfig, seed: int, out_dir: Path, **kw) -> list[dict]:
    """The judge: stage 2's recipe on records["pairs_judge"], disjoint from the proxy's pairs, so the win rate it
    gives was never the target of PPO (Gao et al. 2022's gold RM)."""
    return reward_model_dir(sft_dir, tokenizer, records["pairs_judge"], records["pairs_heldout"], rm_cfg, seed + 1,
                            seed + 1, out_dir, "judge", **kw)


def write_json(path: Path, obj) -> None:
    """`obj` as JSON in `path`, whole or not at all (written beside it, then renamed over it). A write that fails (a
    full disk) leaves the old file, no temporary one, and raises cli.WriteFailed naming `path` and the bytes."""
    text = json.dumps(obj, indent=2)
    tmp = Path(str(path) + ".tmp")
    try:
        with checkpoint.writing(path, len(text.encode())):
            tmp.write_text(text)
            tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def resolve_real_models(run, cfg: PPOConfig) -> dict[str, str | None]:
    """Local directories of a real --model and of the models given for the stages it skips (--sft-model,
    --reward-model, --critic-model; None where a stage trains it here). A name not on this machine ends the run with
    scale.py's message (download it, or pass a local directory); so does a stage that has no data to train on."""
    def resolve(flag: str, name: str) -> str:
        try:
            return scale.resolve_model(name)
        except scale.ModelNotFound as e:
            fail(str(e).replace("--model", flag, 1))

    stages = run.stages.split(",")
    dirs = {"model": resolve("--model", run.model),
            "sft": resolve("--sft-model", run.sft_model) if run.sft_model else None,
            "reward": resolve("--reward-model", run.reward_model) if run.reward_model else None,
            "critic": resolve("--critic-model", run.critic_model) if run.critic_model else None}
    if dirs["reward"] and reward_model_kind(dirs["reward"]) is None:
        fail(f"--reward-model {not_a_reward_model(dirs['reward'])}")
    if not (run.data or run.sft_data or dirs["reward"]):
        fail(f"--model {run.model}: nothing to train on: pass --data PAIRS (then SFT, the reward model and PPO all "
             f"run), or --reward-model DIR with --prompts FILE for PPO alone")
    if last_stage(run) == "sft" and not (run.data or run.sft_data):
        fail(f"--model {run.model}: stage sft needs data: pass --data PAIRS or --sft-data FILE")
    if dirs["reward"] is None and ("rm" not in stages or not run.data) and last_stage(run) in ("rm", "critic", "ppo"):
        fail(f"--model {run.model}: no reward model: pass --data PAIRS to train one with Eq. 2 (stage rm), or "
             f"--reward-model DIR")
    if last_stage(run) in ("critic", "ppo") and not (run.prompts or run.data):
        fail(f"--model {run.model}: no prompts; pass --prompts FILE.jsonl ({{\"prompt\": ...}} lines) or --data PAIRS")
    for path in (run.data, run.sft_data, run.prompts):
        if path and not Path(path).exists() and data.looks_like_a_path(path):
            raise data.DataError(path, None, None, "not_found", "no such file")
    return dirs


def config_json(model_dir) -> dict:
    """A model directory's config.json, a multimodal model's text_config merged in; {} when it cannot be read
    (resolve_model found a directory; transformers will say what is wrong with it)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {**config.get("text_config", {}), **config} if isinstance(config, dict) else {}


def model_context(model_dir) -> tuple[int | None, bool]:
    """(positions, learned) of a model directory's config.json: n_positions / max_position_embeddings / …, and
    whether they are a learned table (GPT-2, OPT: an index beyond it is an IndexError) rather than rotary (the model
    was never trained beyond them). (None, False) when the config names none."""
    config = config_json(model_dir)
    if not config:
        return None, False
    context = next((config[k] for k in ("n_positions", "max_position_embeddings", "max_sequence_length",
                                        "seq_length", "n_ctx") if isinstance(config.get(k), int)), None)
    return context, "n_positions" in config or config.get("model_type") == "opt"


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_weights(model_dir) -> None:
    """The directory holds weights, every safetensors file's header reads (a truncated or overwritten file fails
    here in one line, not half-way into a stage), and without a model.safetensors (which from_pretrained would read
    instead) every pickled pytorch_model*.bin loads as data alone: one whose pickle names anything but tensors and
    plain containers (it would run code) is refused here in one line, before any work, rather than by
    torch.load(weights_only=True) half-way into a stage. The tensors themselves are read when the stage loads them
    (weights_only=True still)."""
    from safetensors import safe_open
    if not any((Path(model_dir) / f).exists() for f in WEIGHTS):
        fail(f"{model_dir}: no model weights in it (expected one of {', '.join(WEIGHTS)})")
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # safetensors' own SafetensorError, or an OSError
            fail(f"{f}: damaged safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    safetensors = any((Path(model_dir) / f).exists() for f in WEIGHTS[:2])  # from_pretrained reads those then
    for f in [] if safetensors else sorted(Path(model_dir).glob("pytorch_model*.bin")):
        if problem := checkpoint.unsafe_pickle(f):
            fail(f"{f}: {problem}; only weights load here (torch.load weights_only=True): use the model's "
                 f"model.safetensors, or convert this file to safetensors where you trust its source")



def check_models(dirs: dict) -> None:
    """Every model directory of the run has readable weights (check_weights), and every model that reads the run's
    token ids an embedding row for each id of the tokenizer. A tokenizer with more ids than a model's vocab_size (a
    pad or chat token added without resizing the embeddings) would stop a stage with an IndexError; here it is one
    line, before any work. A larger embedding than the tokenizer is common (rows padded to a multiple of 64)."""
    policy_dir = dirs.get("sft") or dirs["model"]
    for d in dict.fromkeys(x for x in (policy_dir, dirs.get("reward"), dirs.get("critic")) if x):
        check_weights(d)
        vocab = config_json(d).get("vocab_size")
        # each model against the tokenizer beside it (a different one is load_models' "share one tokenizer" error)
        tokenizer_dir = d if any((Path(d) / f).exists() for f in data.TOKENIZER_FILES) else policy_dir
        ids = max(data.load_tokenizer(tokenizer_dir).get_vocab().values()) + 1
        if isinstance(vocab, int) and ids > vocab:
            fail(f"{d}/config.json: vocab_size {vocab} has no embedding for ids {vocab}-{ids - 1} of the tokenizer "
                 f"({tokenizer_dir}); resize the model's embeddings to len(tokenizer) "
                 f"(model.resize_token_embeddings) and save it, or use the tokenizer it was trained with")


def fit_context(run, cfg: PPOConfig, dirs: dict) -> tuple:
    """(run, cfg) with --max-prompt-tokens, --max-response-tokens and --max-new-tokens lowered, where they must be, to
    fit the shortest context among the models that read the run's sequences (data.context_limits): every text a
    stage builds then fits every model, learned position tables and rotary ones alike. Printed when it changes them;
    a context too short for any prompt and answer ends the run with one line."""
    given = [d for d in (dirs.get("sft") or dirs["model"], dirs.get("reward"), dirs.get("critic")) if d]
    contexts = [(model_context(d), d) for d in given]
    contexts = [(c, learned, d) for (c, learned), d in contexts if c is not None]
    if not contexts:
        return run, cfg
    context, learned, where = min(contexts, key=lambda x: x[0])
    if context < 8:
        fail(f"{where}/config.json: a context of {context} positions leaves no room for a prompt and an answer")
    old = (run.max_prompt_tokens, run.max_response_tokens, cfg.max_new_tokens)
    p, t, n = data.context_limits(*old, context)
    if (p, t, n) == old:
        return run, cfg
    kind = "a learned position table" if learned else "the positions it was trained on"
    print(f"[context] {where}: {context} positions ({kind}); --max-prompt-tokens {old[0]} → {p}, "
          f"--max-response-tokens {old[1]} → {t}, --max-new-tokens {old[2]} → {n}, so that every sequence fits "
          f"(P + max(T, N) ≤ {context}); pass smaller values to choose the split yourself")
    return (dataclasses.replace(run, max_prompt_tokens=p, max_response_tokens=t),
            dataclasses.replace(cfg, max_new_tokens=n))


def stage_dir(path: Path, build, what: str, rebuild: bool, rank: int, timings: dict, key: str, label: str) -> Path:
    """A real model's stage directory under --out (sft/, reward_model/): every rank trains (under DeepSpeed each
    holds an engine), rank 0 writes; a directory with DONE is a finished stage, not redone on a second start. A
    stage that ran puts its seconds in timings[key] and prints them as [label]; a reused one does neither."""
    t0 = time.time()
    path, ran = checkpoint.build_once(path, build, what, rebuild=rebuild, rank=rank, barrier=engine.barrier,
                                      label="stage")
    if ran:
        timings[key] = time.time() - t0
        print(f"[{label}] {timings[key]:.1f} s")
    return path


def real_model_records(run, dirs: dict) -> dict[str, list[dict]]:
    """A real --model's records (run_records, with the model's tokenizer): the one split every stage reads."""
    if not (run.data or run.sft_data or run.prompts):
        return {}
    return run_records(run, data.load_tokenizer(dirs["sft"] or dirs["model"]))


def real_model_stages(run, cfg: PPOConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig, dirs: dict,
                      rank: int, world: int, device: torch.device, timings: dict, records: dict) -> dict:
    """Stages 1-2 on a real Hugging Face model (the same sft.train_sft and reward_model.train_reward_model as the
    tiny world), each into --out/<stage>/ unless a directory for it was given, on their parts of `records`
    (real_model_records). Returns every model's directory; the stages' seconds go into `timings`."""
    out, stages = Path(run.out), run.stages.split(",")
    tokenizer = data.load_tokenizer(dirs["sft"] or dirs["model"])
    bf16 = use_bf16(run, device)
    for name, n in (("sft_batch", sft_cfg.sft_batch), ("rm_batch", rm_cfg.rm_batch)):
        if n % world:  # each rank takes an equal slice of every batch
            fail(f"--{name.replace('_', '-')} {n} must be divisible by the number of processes ({world})")
    if dirs["sft"] is None and "sft" in stages and records.get("sft"):  # without SFT data: --model is the SFT model

        def build_sft(tmp: Path) -> None:
            checkpoint.seed_everything(run.seed)
            model = load_lm(dirs["model"], bf16, device, run.grad_ckpt, run)
            losses = train_sft(model, tokenizer, [(r["prompt"], r["response"]) for r in records["sft"]], sft_cfg,
                               run.seed, ds=stage_ds(run, sft_cfg.sft_batch // world, device), out_dir=tmp)
            if rank == 0:
                write_json(tmp / "sft_log.json", {"loss": losses})
        dirs["sft"] = stage_dir(out / "sft", build_sft, f"stage 1, SFT of {run.model}", run.rebuild_base, rank,
                                timings, "sft", "1. SFT")
    dirs["sft"] = dirs["sft"] or dirs["model"]
    if dirs["reward"] is None and "rm" in stages:
        def build_rm(tmp: Path) -> None:
            reward_model_dir(dirs["sft"], tokenizer, records["pairs_train"], records["pairs_heldout"], rm_cfg,
                             run.seed, 0, tmp, "rm", stage_ds(run, rm_cfg.rm_batch // world, device), bf16, device,
                             run.grad_ckpt, run)
            if rank == 0:
                write_json(tmp / "data_limits.json", {"max_prompt_tokens": run.max_prompt_tokens,
                                                      "max_response_tokens": run.max_response_tokens})
        dirs["reward"] = stage_dir(out / "reward_model", build_rm, f"stage 2, the reward model from {dirs['sft']}",
                                   run.rebuild_base, rank, timings, "reward_model", "2. reward model")
    dirs["judge"] = None
    if "rm" in stages and records.get("pairs_judge"):
        dirs["judge"] = stage_dir(out / "judge_model", lambda tmp: train_judge(
            dirs["sft"], tokenizer, records, rm_cfg, run.seed, tmp, ds=stage_ds(run, rm_cfg.rm_batch // world, device),
            bf16=bf16, device=device, grad_ckpt=run.grad_ckpt, run=run),
            "the judge, a second reward model on pairs the proxy never saw", run.rebuild_base, rank, timings,
            "judge_model", "2b. judge")
    if dirs["reward"]:
        same_tokenizer(dirs["sft"], dirs["reward"])
    dirs["critic"] = dirs["critic"] or (dirs["reward"] if cfg.critic_init == "rm" else dirs["sft"])
    return dirs


def load_lm(path, bf16: bool, device: torch.device, grad_ckpt: bool, run=None):
    """A causal LM from a local directory (never remote code), in bf16 if asked, on `device`; with --lora-r, its
    weights frozen (quantized with --lora-bits) under fresh adapters (lora.add_adapters)."""
    adapters = run is not None and lora.enabled(run)
    kw = lora.load_kwargs(run, bf16)
    try:
        model = models.causal_lm_class(path).from_pretrained(path, trust_remote_code=False, **kw)
    except (OSError, ValueError, RuntimeError) as e:  # no weights, a damaged file, a config no causal LM takes
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        fail(f"{path}: cannot load a causal LM from it ({first})")
    model = model if "quantization_config" in kw else model.to(device)
    models.check_causal(model, path)
    if grad_ckpt:
        models.gradient_checkpointing(model)
    return lora.add_adapters(model, run, seed=run.seed) if adapters else model


def same_tokenizer(policy_dir, reward_dir) -> None:
    """The policy's token ids go straight into the reward model: both must read them alike."""
    a, b = data.load_tokenizer(policy_dir), data.load_tokenizer(reward_dir)
    if a.get_vocab() != b.get_vocab() or data.stop_id(a) != data.stop_id(b):
        fail(f"--reward-model {reward_dir}: its tokenizer differs from the policy's ({policy_dir}); the reward model "
             f"reads the policy's token ids, so both must share one tokenizer")


def use_bf16(run, device: torch.device) -> bool:
    """bf16 with --bf16 (even on the CPU), or under DeepSpeed on an accelerator that has it (unless --fp32)."""
    engines = run.deepspeed or engine.world_size() > 1
    return run.bf16 or (engines and not run.fp32 and device.type != "cpu" and engine.accelerator_bf16())


def stage_ds(run, micro_batch: int, device: torch.device) -> dict | None:
    """The DeepSpeed config of a trained model of stages 1-2 (None in one process without --deepspeed)."""
    if not (run.deepspeed or engine.world_size() > 1):
        return None
    try:
        ds = engine.engine_config(run.deepspeed_config, run.zero_stage, use_bf16(run, device), micro_batch, 1.0)
    except engine.ConfigError as e:
        fail(str(e))
    print(f"[deepspeed] {engine.world_size()} process(es) on {device.type}, stage engine: ZeRO-"
          f"{ds.get('zero_optimization', {}).get('stage', 0)}, bf16 {ds.get('bf16', {}).get('enabled', False)}, "
          f"micro batch {micro_batch} per rank")
    return ds


@dataclass
class Inputs:
    """The directories the four models load from, their tokenizer, and the PPO stage's records."""
    policy: Path | str
    ref: Path | str
    reward: Path | str
    critic: Path | str
    tokenizer: object
    data: dict
    base: Path | None = None     # runs/_base/<...> when stages 1-2 ran here (None for a real --model)
    timings: dict = dataclasses.field(default_factory=dict)
    judge: Path | str | None = None  # real data: the second reward model that judges the win rate
    rows: dict = dataclasses.field(default_factory=dict)  # stage_records(data): what PPO, ptx and the evaluation read


def ppo_inputs(run, cfg: PPOConfig, sft_cfg: SFTConfig, rm_cfg: RMConfig,
               world_cfg: toy_world.WorldConfig, dirs: dict | None, main_rank: bool,
               records: dict | None = None) -> Inputs:
    """A real --model: its directories and its parts of the run's records (real_model_records: PPO's prompts, the
    ptx text, the evaluation's prompts), the held-out prompts also written to --out/data/ for `eval.py --run`.
    Otherwise stages 1-2 first (cached): rank 0 builds them while the other ranks wait at the barrier, then they
    read the cache."""
    from transformers import AutoTokenizer
    if dirs:
        tokenizer = data.load_tokenizer(dirs["sft"])  # no pad token (LLaMA, GPT-2): pad = EOS; the mask knows padding
        records = {k: records.get(k, []) for k in ("prompts_train", "prompts_heldout", "sft", "pairs_train",
                                                   "pairs_heldout", "pairs_judge")}  # the pairs: --method dpo
        if main_rank:  # read by nobody during the run: no other rank waits for it
            toy_world.write_dataset({"prompts_heldout": [data.as_row(r) for r in records["prompts_heldout"]]},
                                    Path(run.out) / "data")  # a conversation as its messages, for its template
        return Inputs(dirs["sft"], dirs["sft"], dirs["reward"], dirs["critic"], tokenizer, records,
                      judge=dirs.get("judge"), rows=stage_records(records, run, cfg))
    if not main_rank:
        engine.barrier()
    with engine.alone() if main_rank else contextlib.nullcontext():  # rank 0 builds; the others wait at the barrier
        base, built = build_base(run, sft_cfg, rm_cfg, world_cfg, rebuild=run.rebuild_base and main_rank,
                                 cfg=cfg if main_rank else None)  # rank 0 writes records.json
        policy = base / "sft" if cfg.policy_init == "sft" else pretrained_model(base, sft_cfg, run.seed)
    if main_rank:
        engine.barrier()
    if not run.data:
        bias = json.loads((base / "rm_length_bias.json").read_text())
        unit = "token" if world_cfg.name == "a" else "phrase"
        print(f"[base] reward model {'length' if unit == 'token' else 'flattery'} bias: RM {bias['rm_slope']:+.3f}/"
              f"{unit} vs gold {bias['gold_slope']:+.3f}/{unit} ({toy_world.world(world_cfg.name).EXPLOIT} added to "
              f"a correct answer)")
    records = base_records(base)  # ptx on the world's pretraining text (prompt-less responses): stage_records
    critic = base / ("reward_model" if cfg.critic_init == "rm" else "sft")
    return Inputs(policy, base / "sft", base / "reward_model", critic, AutoTokenizer.from_pretrained(base / "tokenizer"),
                  records, base, json.loads((base / "timings.json").read_text()) if built else {},  # stages that ran
                  judge=base / "judge_model" if (base / "judge_model" / "value_head.safetensors").exists() else None,
                  rows=stage_records(records, run, cfg))


def preference_pairs(run, inp: Inputs, dirs: dict | None) -> tuple[list[dict], list[dict]]:
    """The pairs stage 2 trained the reward model on (stage_records' "rm") and the held-out ones, as {"prompt",
    "chosen", "rejected"} rows: the cached base's data/pairs_train.jsonl and pairs_heldout.jsonl (the synthetic world,
    --data), or a real --model's --data split as real_model_stages made it. DPO trains on exactly these."""
    if dirs is not None and not run.data:
        fail(f"--method dpo with --model {run.model}: DPO trains on preference pairs; pass --data PAIRS")
    return inp.rows["rm"], inp.data["pairs_heldout"]  # run_records' split, as stage 2 trained on it


def stop_after_stages(run, sft_cfg: SFTConfig, rm_cfg: RMConfig, world_cfg: toy_world.WorldConfig,
                      dirs: dict | None, rank: int, cfg: PPOConfig | None) -> dict:
    """--stages sft or sft,rm: the trained directories (for the tiny world and --data, the cached base, and
    --out/records.json from it unless cfg is None: an earlier run in --out keeps its own)."""
    if dirs is None:
        if rank == 0:
            with engine.alone():   # the other ranks wait at the barrier
                build_base(run, sft_cfg, rm_cfg, world_cfg, rebuild=run.rebuild_base, cfg=cfg)
        engine.barrier()
        base = base_dir(run, sft_cfg, rm_cfg, world_cfg)
        dirs = {"sft": str(base / "sft"), "reward": str(base / "reward_model")}
    result = {"stages": run.stages, "sft": str(dirs["sft"])}
    if "rm" in run.stages.split(","):
        result["reward_model"] = str(dirs["reward"])
        log = Path(dirs["reward"]) / "rm_log.json"
        log = log if log.is_file() else Path(dirs["reward"]).parent / "rm_log.json"  # the tiny world's base
        result["rm_heldout_accuracy"] = json.loads(log.read_text())[-1]["heldout_accuracy"]
    print(f"[stages] {run.stages}: " + json.dumps(result))
    return result
