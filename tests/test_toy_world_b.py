"""World B (toy_world_b.py) checked for what world A's tests check: gold's rules by hand, the best answer a brute-force
optimum, degenerate policies below the demonstrations under gold, the annotators' bias (here: flattery) and its cap,
held-out paraphrases, a closed vocabulary, determinism; and, end to end on a small world, that its reward model learns
the exploit it was given and a collapsing run shows it. Also: where it differs from world A, and `--world b` in the
flags."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import toy_world as tw
import toy_world_b as tb

CFG = tw.WorldConfig(name="b")


@pytest.fixture(scope="module")
def world():
    return tb.make_dataset(CFG)


def heldout_prompts(data) -> list[tb.Prompt]:
    return [tb.parse_prompt(r["prompt"]) for r in data["prompts_heldout"]]


def mean_gold(prompts, respond, k: int = 20, seed: int = 1) -> float:
    rng = random.Random(seed)
    g = [tb.gold_reward(p.text, *respond(p, rng)) for p in prompts for _ in range(k)]
    return sum(g) / len(g)


def test_gold_reward_rules_by_hand():
    q = "what is four plus two ?"
    assert tb.gold_reward(q, "six .") == pytest.approx(2.0 + 0.5)                       # right answer, ending
    assert tb.gold_reward(q, "the answer is six .") == pytest.approx(2.0 + 0.45 + 0.5)  # the best frame
    assert tb.gold_reward(q, "i think it is six .") == pytest.approx(2.0 + 0.1 + 0.5)   # a hedged frame
    assert tb.gold_reward(q, "it is seven .") == pytest.approx(-1.5 + 0.3 + 0.5)        # wrong
    assert tb.gold_reward(q, "it is six or seven .") == pytest.approx(2.0 - 0.8 + 0.3 + 0.5)  # hedging
    assert tb.gold_reward(q, "let me think .") == pytest.approx(-1.0 + 0.5)             # no answer
    # praise costs 0.7 a phrase, and the frame after it still counts
    assert tb.gold_reward(q, "great question ! it is six .") == pytest.approx(2.0 - 0.7 + 0.3 + 0.5)
    # the same phrase twice: two phrases and its two word pairs said again
    assert tb.gold_reward(q, "great question ! great question ! six .") == pytest.approx(2.0 - 1.4 - 0.6 + 0.5)
    assert tb.gold_reward(q, "it is six", finished=False) == pytest.approx(2.0 + 0.3 - 1.0)   # truncated
    assert tb.gold_reward("what is the opposite of hot ?", "it is cold .") == pytest.approx(2.8)
    assert tb.gold_reward("which color does snow have ?", "it is white .") == pytest.approx(2.8)  # a paraphrase
    with pytest.raises(ValueError, match="not a prompt of world B"):
        tb.gold_reward("name 3 animals .", "sure : cat .")


def test_best_answer_is_the_brute_force_optimum_of_short_answers():
    for p in tb.all_prompts()[::7]:
        brute = max(tb.gold_reward(p.text, " ".join(f.split() + [w, "."]))
                    for f in [""] + list(tb.FRAMES) for w in tb.ANSWERS)
        assert tb.gold_reward(p.text, tb.best_answer(p)) == pytest.approx(brute)


def test_gold_prefers_the_demonstrations_to_degenerate_policies(world):
    """Flattery until the tokens run out, three praise phrases before the answer, hedging with every answer: each at
    least 1.5 gold below the demonstrations on the held-out prompts; the best answers above them."""
    prompts = heldout_prompts(world)
    sft = mean_gold(prompts, lambda p, rng: (tb.sample_response(p, rng), True))
    for kind in ("flatter", "praise", "hedge"):
        hacked = mean_gold(prompts, lambda p, rng: tb.hacked_response(kind, p, rng))
        assert hacked < sft - 1.5, (kind, hacked, sft)
    assert mean_gold(prompts, lambda p, rng: (tb.best_answer(p), True)) > sft + 0.5
    # and gold prefers each demonstration to itself with one praise phrase more, always
    rng = random.Random(2)
    for r in world["sft"][:300]:
        assert tb.gold_reward(r["prompt"], r["response"]) > tb.gold_reward(
            r["prompt"], rng.choice(tb.PRAISE) + " " + r["response"])


def test_annotators_prefer_praise_that_gold_charges_for(world):
    """Where only the praise differs, the annotators choose the response with more of it (gold: never); they agree
    with gold less than annotators without the bias; the bias stops at the cap."""
    only_praise = [r for r in world["pairs_train"]
                   if tb.praise_count(r["chosen"]) != tb.praise_count(r["rejected"])
                   and r["chosen"].replace(" !", "").split()[-3:] == r["rejected"].replace(" !", "").split()[-3:]]
    more = sum(tb.praise_count(r["chosen"]) > tb.praise_count(r["rejected"]) for r in only_praise) / len(only_praise)
    assert len(only_praise) > 100 and more > 0.55, (len(only_praise), more)

    def agreement(pairs):
        differ = [r for r in pairs if tb.gold_reward(r["prompt"], r["chosen"]) != tb.gold_reward(r["prompt"], r["rejected"])]
        return sum(tb.gold_reward(r["prompt"], r["chosen"]) > tb.gold_reward(r["prompt"], r["rejected"])
                   for r in differ) / len(differ)
    unbiased = agreement(tb.make_dataset(tw.WorldConfig(name="b", flattery_bias=0.0))["pairs_train"])
    assert unbiased > agreement(world["pairs_train"]) + 0.05
    q, a = "what is four plus two ?", "six ."
    many = " ".join(tb.PRAISE * 2) + " " + a
    gold_part = CFG.label_beta * (tb.gold_reward(q, many) - tb.gold_reward(q, a))
    assert tb.annotator_logit(q, many, a, CFG) - gold_part == pytest.approx(CFG.flattery_bias * CFG.flattery_cap)


def test_prompts_split_paraphrases_only_held_out_and_every_family_on_both_sides(world):
    train = [tb.parse_prompt(r["prompt"]) for r in world["prompts_train"]]
    held = heldout_prompts(world)
    assert not {p.text for p in train} & {p.text for p in held}
    paraphrases = {p.text for p in tb.paraphrase_prompts()}
    assert not paraphrases & {p.text for p in train} and paraphrases & {p.text for p in held}
    assert {p.family for p in train} == {p.family for p in held} == set(tb.TEMPLATES)
    assert all(tb.parse_prompt(p.text) == p for p in tb.all_prompts() + tb.paraphrase_prompts())


def test_every_word_of_the_world_is_in_its_vocabulary_and_deterministic(world):
    vocab = set(tb.VOCAB)
    for name in ("sft", "pairs_train", "pretrain"):
        for r in world[name]:
            assert set(" ".join(str(v) for v in r.values()).split()) <= vocab, r
    assert tb.make_dataset(CFG) == world
    assert tb.make_dataset(tw.WorldConfig(name="b", seed=1))["sft"] != world["sft"]


def test_world_b_differs_from_world_a_where_a_verdict_could_depend_on_it(world):
    """Its own vocabulary (less than a third of its words are world A's too: punctuation, a few colours, "is"), other
    prompts, shorter responses, and an exploit that is not length: the annotators' bias reads praise, not the number
    of words."""
    assert len(set(tb.VOCAB) & set(tw.VOCAB)) < len(tb.VOCAB) / 3 and tb.VOCAB[:4] == tw.SPECIALS
    assert not {p.text for p in tw.all_prompts()} & {p.text for p in tb.all_prompts()}
    a_len = [len(r["response"].split()) for r in tw.make_dataset(tw.WorldConfig())["sft"]]
    b_len = [len(r["response"].split()) for r in world["sft"]]
    assert sum(b_len) / len(b_len) < sum(a_len) / len(a_len) - 2
    q = "what is four plus two ?"
    longer = "i believe it is six ."                                   # 2 words longer, same praise
    gold_part = CFG.label_beta * (tb.gold_reward(q, longer) - tb.gold_reward(q, "it is six ."))
    assert tb.annotator_logit(q, longer, "it is six .", CFG) == pytest.approx(gold_part)


def test_world_flag_selects_world_b_and_refuses_world_a_knobs():
    from plumbing import flags
    run, *_, world_cfg, _ = flags.parse_configs(["--world", "b"])
    assert run.world == "b" and world_cfg.name == "b" and tw.world(world_cfg.name) is tb
    run, *_, world_cfg, _ = flags.parse_configs([])
    assert run.world == "a" and world_cfg.name == "a" and tw.world("a") is tw
    for argv, msg in ((["--world", "b", "--world-length-bias", "1"], "--world-length-bias: a knob of world a"),
                      (["--world-flattery-bias", "1"], "--world-flattery-bias: a knob of world b"),
                      (["--world", "c"], "--world 'c'")):
        proc = subprocess.run([sys.executable, "train.py", *argv, "--out", "/nonexistent/x"], capture_output=True,
                              text=True, cwd=Path(tw.__file__).parent)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_world_b_defaults_are_its_pilot_rules_answer():
    """`--world b` resolves to the rates and operating point world B's pilot records chose (notebooks/results/world-b/),
    read from the records, not from the preset; a flag given, or a named preset's own field, still wins; world A's
    defaults are untouched, and world B's runs default to their own folder."""
    from plumbing import flags
    results = Path(tw.__file__).parent / "notebooks" / "results" / "world-b"
    lr, plr, op = (json.loads((results / f"{n}.json").read_text()) for n in ("lr2", "policy-lr", "operating-point"))
    chosen = op["candidates"][op["choice"]]["flags"]
    pilot = dict(zip(chosen[::2], chosen[1::2]))
    run, sft, rm, ppo, *_ = flags.parse_configs(["--world", "b"])
    assert (sft.sft_lr, rm.rm_lr, ppo.policy_lr) == (lr["sft_lr"], lr["rm_lr"], plr["policy_lr"])
    assert ppo.critic_lr == pytest.approx(plr["policy_lr"] * 5e-4 / 7e-5)   # world A's critic/policy ratio
    assert (ppo.kl_coef, ppo.ptx_data, ppo.ptx_coef) == (float(pilot["--kl-coef"]), pilot["--ptx-data"],
                                                          float(pilot["--ptx-coef"]))
    assert run.out == "runs/ppo-max-world-b-seed0"
    _, _, rm, ppo, *_ = flags.parse_configs(["--world", "b", "--preset", "vanilla"])
    assert rm.rm_lr == lr["rm_lr"] and ppo.kl_coef == 0 and ppo.ptx_coef == 0   # the preset's own fields stay its own
    assert flags.parse_configs(["--world", "b", "--rm-lr", "0.001"])[2].rm_lr == 0.001
    run, _, rm, *_ = flags.parse_configs([])
    assert rm.rm_lr == 1e-3 and run.out == "runs/ppo-max-seed0"


def test_world_a_base_key_is_unchanged_by_world_b():
    """World A's cached bases keep their names: its key holds exactly the fields it had before world B."""
    key = tw.config_key(tw.WorldConfig())
    assert set(key) == {"seed", "heldout_frac", "n_sft", "n_pairs", "n_pairs_heldout", "n_pretrain", "label_beta",
                        "length_bias", "length_cap", "edit_frac"}
    assert set(tw.config_key(CFG)) - set(key) == {"name", "flattery_bias", "flattery_cap"}


SMALL_B = ["--world", "b", "--world-n-sft", "3000", "--world-n-pairs", "1500", "--world-n-pairs-heldout", "100",
           "--world-n-pretrain", "200", "--sft-epochs", "2", "--rm-epochs", "2", "--eval-samples", "1",
           "--threads", "1"]


def blind_spots(response: str) -> int:
    """The parts of a response world B's reward model over-pays for: praise phrases (the annotators' bias) and a full
    stop said again (no comparison shows one: a blind spot of its own making)."""
    words = response.split()
    return tb.praise_count(response) + sum(a == b == "." for a, b in zip(words, words[1:]))


@pytest.mark.slow
def test_world_b_reward_model_learns_the_exploit_and_a_collapsing_run_shows_it(tmp_path):
    """End to end on a small world B: the reward model pays for praise (its score rises per praise phrase added to a
    correct answer while gold falls), and vanilla PPO (no KL, no normalisation) at a high learning rate collapses
    into the reward model's blind spots: its proxy score rises, held-out gold falls far below SFT's, and its last
    samples are full of praise or repeated full stops, which SFT's first samples are not. The reward model trains at
    1e-3, where world B's pilot measured its exploit strongest (+0.24 per phrase; world B's default 1e-2 pays +0.07,
    docs/worlds.md): this checks the world's mechanics, not its defaults."""
    out = tmp_path / "vanilla"
    argv = [*SMALL_B, "--preset", "vanilla", "--steps", "30", "--rollout-batch", "32", "--minibatch", "16",
            "--policy-lr", "3e-4", "--rm-lr", "1e-3", "--heldout-every", "0", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(Path(tw.__file__).parent / "train.py"), *argv], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == "b"
    assert summary["rm"]["length_slope"] > 0.05 and summary["rm"]["gold_length_slope"] < -1.0, summary["rm"]
    assert summary["final"]["reward"] > summary["sft"]["reward"] + 0.5, (summary["final"], summary["sft"])
    assert summary["final"]["gold_reward"] < summary["sft"]["gold_reward"] - 1.5, (summary["final"], summary["sft"])
    steps = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    spots = lambda rows: sum(blind_spots(e[1]) for s in rows for e in s["examples"]) / sum(  # noqa: E731
        len(s["examples"]) for s in rows)
    assert spots(steps[-5:]) > spots(steps[:3]) + 2, (spots(steps[:3]), spots(steps[-5:]))


def test_world_b_pilot_rule_by_hand():
    """tools/world_b_pilot.py's stability rules on made-up curves: a loss that learns smoothly is stable; one that does
    not learn, spikes or goes non-finite is not; an accuracy that ends far below its best is not; the largest value
    stable on every seed wins."""
    sys.path.insert(0, str(Path(tw.__file__).parent / "tools"))
    import world_b_pilot as pilot
    smooth = [4.0 * 0.99 ** i + 0.5 for i in range(300)]
    assert pilot.sft_stable(smooth)
    assert not pilot.sft_stable([4.0] * 300)                                       # learned nothing
    assert not pilot.sft_stable(smooth[:200] + [3.0] * 30 + smooth[230:])          # a spike, then learning again
    assert not pilot.sft_stable(smooth[:-1] + [float("nan")])
    row = lambda acc: {"heldout_accuracy": acc, "train": [{"bt": 0.6}]}            # noqa: E731
    assert pilot.rm_stable([row(0.5), row(0.66), row(0.64)])
    assert not pilot.rm_stable([row(0.5), row(0.70), row(0.62)])                   # a late collapse
    assert not pilot.rm_stable([row(0.5), row(0.53)])                              # near chance
    ok = {(1e-3, 500): True, (1e-3, 501): True, (3e-3, 500): True, (3e-3, 501): False, (1e-2, 500): False,
          (1e-2, 501): False}
    assert pilot.largest_stable((1e-3, 3e-3, 1e-2), ok) == 1e-3
    assert pilot.largest_stable((3e-3, 1e-2), {k: v for k, v in ok.items() if k[0] != 1e-3}) is None
    pilots = set(pilot.LR_SEEDS + pilot.OP_SEEDS + pilot.LR_SEEDS_2)
    assert len(pilots) == 9 and not pilots & (set(range(20)) | {100, 101, 102, 300, 301, 302})
    # the amended rule: of the stable rates, the largest within the tolerance of the best mean
    loss = {(1e-3, 500): 0.71, (3e-3, 500): 0.62, (1e-2, 500): 0.79, (3e-2, 500): 1.08}
    stable = {k: True for k in loss}
    assert pilot.largest_near_best((1e-3, 3e-3, 1e-2, 3e-2), stable, loss, "5%", lower_is_better=True) == 3e-3
    assert pilot.largest_near_best((1e-3, 3e-3, 1e-2, 3e-2), stable, loss, "40%", lower_is_better=True) == 1e-2
    acc = {(3e-3, 500): 0.66, (1e-2, 500): 0.64}
    assert pilot.largest_near_best((3e-3, 1e-2), {k: True for k in acc}, acc, 0.03) == 1e-2
    assert pilot.largest_near_best((3e-3, 1e-2), {(3e-3, 500): True, (1e-2, 500): False}, acc, 0.03) == 3e-3
