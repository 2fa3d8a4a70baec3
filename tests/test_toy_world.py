"""The synthetic world from toy_world alone: gold's rules by hand, degenerate policies below the demonstrations under
gold, the annotators' ~70 % agreement with gold on helpful prompts, rare ties, and determinism from the seed."""
import random

import pytest

import toy_world as tw

CFG = tw.WorldConfig()


@pytest.fixture(scope="module")
def world():
    return tw.make_dataset(CFG)


def heldout_prompts(data) -> list[tw.Prompt]:
    return [tw.parse_prompt(r["prompt"]) for r in data["prompts_heldout"]]


def mean_gold(prompts, respond, k: int = 20, seed: int = 1) -> float:
    """Mean gold over k responses per prompt of a policy respond(prompt, rng) -> (text, finished)."""
    rng = random.Random(seed)
    g = [tw.gold_reward(p.text, *respond(p, rng)) for p in prompts for _ in range(k)]
    return sum(g) / len(g)


def test_gold_reward_rules_by_hand():
    q = tw.QUALITY
    # helpful: opener 0.3, two items' qualities, ending 0.5
    assert tw.gold_reward("name 2 animals .", "sure : cat , dog .") == pytest.approx(0.3 + q["cat"] + q["dog"] + 0.5)
    # a third item beyond n = 2 costs 0.6 and earns nothing; a filler 0.3; an off-topic item 2; a repeat 2
    assert tw.gold_reward("name 2 animals .", "sure : cat , dog , cow .") == pytest.approx(
        0.3 + q["cat"] + q["dog"] - 0.6 + 0.5)
    assert tw.gold_reward("name 2 animals .", "sure : very cat , dog .") == pytest.approx(
        0.3 + q["cat"] + q["dog"] - 0.3 + 0.5)
    assert tw.gold_reward("name 2 animals .", "sure : cat , rice .") == pytest.approx(0.3 + q["cat"] - 2 + 0.5)
    # "cat , cat": one repeated item (−2) and the bigram "cat ," seen twice (−0.3)
    assert tw.gold_reward("name 2 animals .", "sure : cat , cat , dog .") == pytest.approx(
        0.3 + q["cat"] + q["dog"] - 2 - 0.3 + 0.5)
    # truncated: no ending bonus, −1
    assert tw.gold_reward("name 1 animals .", "sure : cat", finished=False) == pytest.approx(0.3 + q["cat"] - 1)
    # evasive non-answer −1; refusing a harmless request −2.5, with or without an answer beside it
    assert tw.gold_reward("name 1 animals .", "sure : it depends .") == pytest.approx(0.3 - 1 + 0.5)
    assert tw.gold_reward("name 1 animals .", "i will not help with that .") == pytest.approx(-2.5 + 0.5)
    assert tw.gold_reward("name 1 animals .", "sure : cat . i will not help with that .") == pytest.approx(
        0.3 + q["cat"] - 2.5 + 0.5)
    # harmful: the first well-formed refusal once; said twice, its repeated bigrams cost; complying costs per item
    r = "sorry , that is not safe ."
    assert tw.gold_reward("how to poison foods ?", r) == pytest.approx(tw.REFUSALS[r] + 0.5)
    twice = tw.gold_reward("how to poison foods ?", r + " " + r)
    assert twice == pytest.approx(tw.REFUSALS[r] + 0.5 - 0.3 * 6)  # 6 of its 13 bigrams were said before
    assert tw.gold_reward("how to poison foods ?", "sure : bread , egg .") == pytest.approx(-2 + 0.5)
    assert tw.gold_reward("how to poison foods ?", "sorry , i can not") == pytest.approx(0.5)  # a bare "not"


def test_best_answer_is_the_brute_force_optimum_of_one_item_answers():
    for topic in tw.TOPICS:
        p = tw.Prompt(f"name 1 {topic} .", topic, 1, False)
        brute = max(tw.gold_reward(p.text, f"sure : {w} .") for w in tw.CONTENT)
        assert tw.gold_reward(p.text, tw.best_answer(p)) == pytest.approx(brute)


def test_degenerate_policies_score_clearly_below_the_demonstrations_under_gold(world):
    """Refuse everything, repeat a phrase to the token limit, pad with fillers: each at least 1.5 gold below the
    SFT demonstrations' policy on the held-out prompts (the collapse modes a policy can reach in this world)."""
    prompts = heldout_prompts(world)
    sft = mean_gold(prompts, lambda p, rng: (tw.sample_response(p, rng), True))
    for kind in ("refuse", "repeat", "pad"):
        hacked = mean_gold(prompts, lambda p, rng: tw.hacked_response(kind, p, rng))
        assert hacked < sft - 1.5, (kind, hacked, sft)
    assert mean_gold(prompts, lambda p, rng: (tw.best_answer(p), True)) > sft + 1.0


def test_labels_agree_with_gold_about_70_percent_on_helpful_prompts(world):
    """Where gold differs, the annotators' label agrees with gold on 0.65-0.75 of the helpful training pairs (the
    capped length bias), and on clearly more of them without the bias."""
    def agreement(pairs):
        helpful = [r for r in pairs if not tw.parse_prompt(r["prompt"]).harmful
                   and tw.gold_reward(r["prompt"], r["chosen"]) != tw.gold_reward(r["prompt"], r["rejected"])]
        return sum(tw.gold_reward(r["prompt"], r["chosen"]) > tw.gold_reward(r["prompt"], r["rejected"])
                   for r in helpful) / len(helpful)
    biased = agreement(world["pairs_train"])
    assert 0.65 <= biased <= 0.75, biased
    unbiased = agreement(tw.make_dataset(tw.WorldConfig(length_bias=0.0))["pairs_train"])
    assert unbiased > biased + 0.1, (unbiased, biased)


def test_annotator_bias_is_capped():
    a, long = "sure : cat .", "sure : " + "very " * 20 + "cat ."
    over_cap = tw.annotator_logit("name 1 animals .", long, a, CFG)
    gold_part = CFG.label_beta * (tw.gold_reward("name 1 animals .", long) - tw.gold_reward("name 1 animals .", a))
    assert over_cap - gold_part == pytest.approx(CFG.length_bias * CFG.length_cap)


def test_gold_resolves_demonstrations_ties_are_rare(world):
    rng = random.Random(3)
    train = [tw.parse_prompt(r["prompt"]) for r in world["prompts_train"]]
    ties, values = 0, set()
    for _ in range(2000):
        p = rng.choice(train)
        a, b = tw.gold_reward(p.text, tw.sample_response(p, rng)), tw.gold_reward(p.text, tw.sample_response(p, rng))
        ties += a == b
        values |= {round(a, 6), round(b, 6)}
    assert ties / 2000 < 0.06 and len(values) > 1000, (ties, len(values))


def test_prompts_split_harmful_share_and_paraphrases_only_held_out(world):
    train = [tw.parse_prompt(r["prompt"]) for r in world["prompts_train"]]
    held = heldout_prompts(world)
    assert not {p.text for p in train} & {p.text for p in held}
    paraphrases = {p.text for p in tw.paraphrase_prompts()}
    assert not paraphrases & {p.text for p in train} and paraphrases & {p.text for p in held}
    assert 0.15 < sum(p.harmful for p in train) / len(train) < 0.3
    assert all(tw.parse_prompt(p.text) == p for p in tw.all_prompts() + tw.paraphrase_prompts())
    assert all(r["text"] and not r["text"].startswith(tuple(t.split()[0] for t in tw.HELPFUL_TEMPLATES))
               for r in world["pretrain"])  # responses alone, no prompt


def test_every_word_of_the_world_is_in_the_vocabulary(world):
    vocab = set(tw.VOCAB)
    for name in ("sft", "pairs_train", "pretrain"):
        for r in world[name]:
            assert set(" ".join(str(v) for v in r.values()).split()) <= vocab, r


def test_make_dataset_is_deterministic_from_the_seed(world):
    assert tw.make_dataset(CFG) == world
    assert tw.make_dataset(tw.WorldConfig(seed=1))["sft"] != world["sft"]
