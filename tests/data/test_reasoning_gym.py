# ruff: noqa: F811  (the `tiny` fixture is imported from run_helpers and requested by name)
"""reasoning-gym tasks as data and reward: the rewards of a training step are reasoning-gym's own scores
(recomputed here with its scorer on the same responses), the per-task metrics, the train/eval split, and the
start-up errors (unknown task, bad task config, missing library)."""

import dataclasses
import json
import sys

import pytest
import torch
from run_helpers import tiny  # noqa: F401  (the shared tiny-model fixture)

from rlkit.config.schema import ConfigError
from rlkit.data import reasoning_gym as rg_data
from rlkit.metrics import per_task, without_absent_tasks
from rlkit.train import compose, load_config

pytestmark = pytest.mark.slow  # a trainer run: `make test-fast` leaves it out

rg = pytest.importorskip("reasoning_gym")

TASKS = "data.tasks=[{chain_sum: {min_terms: 2, max_terms: 2, max_digits: 1}},{leg_counting: {min_animals: 1, max_animals: 2}}]"


def overrides(tiny, run_dir, *extra):
    return [
        "+recipe=reasoning_gym",
        f"model.path={tiny}",
        f"trainer.run_dir={run_dir}",
        TASKS,
        "trainer.steps=1",
        "trainer.train_batch_size=16",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "rollout.engine=hf",
        "model.dtype=float32",
        "model.compute_dtype=float32",
        "algo.rollout_is.enabled=false",
        "algo.dynamic_sampling=off",
        "data.num_train=40",
        "data.num_eval=8",
        "data.eval_size=8",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.progress_bar=false",
        "reward.num_workers=1",
        "reward.fn=reasoning_gym",  # reasoning-gym's own contract (the recipe's is reasoning_gym_lenient)
        "+reward.extra.answer_tags=0.2",
        "logger=none",
        *extra,
    ]


def test_step_rewards_are_reasoning_gyms_scores_and_per_task_metrics(tiny, tmp_path):
    """Responses chosen per sample (right answer in tags, a longer answer, no tags, a wrong one): each
    sample's reward in the step's batch equals reasoning-gym's score_answer(extract_answer(response), entry),
    called here; reward/<task> and accuracy/<task> are those scores' means over each task's samples."""
    from reasoning_gym.utils import extract_answer

    from rlkit.trainer import Trainer

    cfg = load_config(compose(overrides(tiny, tmp_path / "r")))
    trainer = Trainer(cfg)
    try:
        prompts = trainer.rollouts.train_prompts
        real_generate = trainer.rollouts.producer.generate
        seen = []

        def chosen(token_ids, n, sampling, seed, **kw):
            rb = real_generate(token_ids, n, sampling, seed, **kw)
            texts = []
            for ids in token_ids:
                row = prompts.rows[prompts.token_ids.index(ids)]
                a = row["answer"]
                for text in (
                    f"<answer>{a}</answer>",
                    f"x <answer>{a}.50</answer>",
                    a,
                    "<answer>-999</answer>",
                ):
                    texts.append(text)
                    seen.append((row, text))
            return dataclasses.replace(rb, response_texts=tuple(texts[: len(token_ids) * n]))

        trainer.rollouts.producer.generate = chosen
        real_produce = trainer.rollouts.produce
        batches = []
        trainer.rollouts.produce = lambda step, timers: (
            batches.append(real_produce(step, timers)) or batches[-1]
        )
        metrics = trainer.train_step()
    finally:
        trainer.close()
    (batch,) = batches
    expected, tasks, totals = [], [], []
    for row, text in seen:
        entry = json.loads(row["entry"])
        assert entry["question"] == row["question"] and entry["metadata"]["source_dataset"] == row["task"]
        score_answer = rg.create_dataset(row["task"], **json.loads(row["task_config"])).score_answer
        expected.append(score_answer(extract_answer(text), entry))
        tasks.append(row["task"])
        # the format term set above: reward.extra={answer_tags: 0.2}
        totals.append(expected[-1] + 0.2 * (extract_answer(text) is not None))
    assert batch.per_fn["reasoning_gym"].tolist() == pytest.approx(expected)
    assert batch.rewards.tolist() == pytest.approx(totals)
    assert set(expected) > {0.0, 1.0}  # partial credit too (leg_counting: "12" in "12.50" scores 2/5)
    for task in set(tasks):
        mine = [e for e, t in zip(expected, tasks) if t == task]
        total = [e for e, t in zip(totals, tasks) if t == task]
        assert metrics[f"reward/{task}"] == pytest.approx(sum(total) / len(total))
        assert metrics[f"accuracy/{task}"] == pytest.approx(sum(e == 1.0 for e in mine) / len(mine))
        assert metrics[f"task_samples/{task}"] == len(mine)
    assert metrics["accuracy"] == pytest.approx(sum(e == 1.0 for e in expected) / len(expected))


def test_per_task_metrics_by_hand():
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.2, 0.0])
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    tasks = {
        "a": torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
        "b": torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
        "c": torch.zeros(6),
    }
    out = {k: float(v) for k, v in per_task(rewards, correct, tasks).items()}
    # a: rewards 1, 0.5 -> 0.75, one correct of 2; b: 0, 1, 0.2, 0 -> 0.3, one of 4; c: no sample
    assert out["reward/a"] == pytest.approx(0.75) and out["accuracy/a"] == pytest.approx(0.5)
    assert out["reward/b"] == pytest.approx(0.3) and out["accuracy/b"] == pytest.approx(0.25)
    assert out["task_samples/a"] == 2 and out["task_samples/b"] == 4 and out["task_samples/c"] == 0
    kept = without_absent_tasks({**out, "reward/mean": 0.5})
    assert "reward/c" not in kept and "accuracy/c" not in kept and kept["task_samples/c"] == 0
    assert kept["reward/a"] == out["reward/a"] and kept["reward/mean"] == 0.5


def test_eval_split_holds_no_training_question(tmp_path):
    """A task with few distinct questions (one animal kind, 1-2 of it) repeats questions across seeds: every
    eval question is dropped from train, and the rows are reasoning-gym's entries."""
    tasks = {"leg_counting": {"min_animals": 1, "max_animals": 1, "max_instances": 2}, "chain_sum": {}}
    d = rg_data.generate(tmp_path / "rg", tasks, num_train=300, num_eval=40)
    train = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (d / "test.jsonl").read_text().splitlines()]
    assert len(test) == 40 and 0 < len(train) < 300  # some training rows repeated an eval question
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert {r["task"] for r in train} == {r["task"] for r in test} == set(tasks)
    for r in train[:20] + test[:20]:
        entry = json.loads(r["entry"])
        assert (entry["question"], entry["answer"]) == (r["question"], r["answer"])
        # the reference answer scores 1 under the task's own scorer
        assert rg.get_score_answer_fn(r["task"])(r["answer"], entry) == 1.0


def test_unknown_task_and_bad_task_config_are_config_errors():
    with pytest.raises(
        ConfigError, match=r"data\.tasks: 'chain_summ' is not a reasoning-gym task.*chain_sum"
    ):
        load_config(compose(["+recipe=reasoning_gym", "data.tasks=[chain_summ,leg_counting]"]))
    with pytest.raises(ConfigError, match=r"data\.tasks\.chain_sum: bad reasoning-gym config .*max_termz"):
        load_config(compose(["+recipe=reasoning_gym", "data.tasks=[{chain_sum: {max_termz: 3}}]"]))
    with pytest.raises(ConfigError, match=r"data\.tasks\.leg_counting\.weight=0"):
        load_config(compose(["+recipe=reasoning_gym", "data.tasks=[chain_sum,{leg_counting: {weight: 0}}]"]))
    with pytest.raises(ConfigError, match=r"not one of reasoning-gym's system prompts"):
        load_config(compose(["+recipe=reasoning_gym", "data.system_prompt=reasoning_gym:nope"]))


def test_tasks_as_a_list_or_a_mapping():
    cfg = load_config(compose(["+recipe=reasoning_gym", "data.tasks=[chain_sum,leg_counting]"]))
    assert rg_data.task_specs(rg_data.plain(cfg.data.tasks)) == [
        ("chain_sum", 1.0, {}),
        ("leg_counting", 1.0, {}),
    ]
    assert cfg.reward.fn == "reasoning_gym_lenient" and cfg.data.path == "reasoning_gym"
    cfg = load_config(
        compose(["+recipe=reasoning_gym", "data.tasks=[{chain_sum: {max_terms: 3, weight: 2}},lcm]"])
    )
    assert rg_data.task_specs(rg_data.plain(cfg.data.tasks)) == [
        ("chain_sum", 2, {"max_terms": 3}),
        ("lcm", 1.0, {}),
    ]
    mapping = {"chain_sum": {"max_terms": 3, "weight": 2}, "lcm": None}
    assert rg_data.task_specs(mapping) == [("chain_sum", 2, {"max_terms": 3}), ("lcm", 1.0, {})]
    rg_data.check_tasks(mapping)


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "rlkit\[reasoning-gym\]"'):
        load_config(compose(["+recipe=reasoning_gym", "data.tasks=[chain_sum]"]))
    with pytest.raises(ImportError, match=r'pip install "rlkit\[reasoning-gym\]"'):
        rg_data.score("<answer>1</answer>", "chain_sum", '{"answer": "1"}', "{}")


def test_answer_tags_format_reward():
    from rlkit.rewards.functions import call_reward

    row = {"question": "q", "answer": "7"}
    texts = ["so <answer>7</answer>", "<answer></answer>", "7", "<answer>7"]
    # reasoning-gym's extract_answer: the tags found (even empty) -> 1; no closing tag or none -> 0
    assert [call_reward("answer_tags", [("p", t, "7", row)])[0][0] for t in texts] == [1.0, 1.0, 0.0, 0.0]


def test_refill_counts_kept_groups_per_task(tiny, tmp_path):
    """Dynamic sampling's per-task share of kept groups: every chain_sum group gets one right answer among
    wrong ones (spread: kept), every leg_counting group the same wrong answer (no spread: dropped)."""
    from rlkit.trainer import Trainer

    cfg = load_config(
        compose(overrides(tiny, tmp_path / "k", "algo.dynamic_sampling=refill", "algo.max_gen_batches=1"))
    )
    trainer = Trainer(cfg)
    try:
        prompts = trainer.rollouts.train_prompts
        real_generate = trainer.rollouts.producer.generate
        drawn = []

        def chosen(token_ids, n, sampling, seed, **kw):
            rb = real_generate(token_ids, n, sampling, seed, **kw)
            rows = [prompts.rows[prompts.token_ids.index(ids)] for ids in token_ids]
            drawn.extend(r["task"] for r in rows)
            texts = [
                f"<answer>{r['answer']}</answer>"
                if r["task"] == "chain_sum" and j == 0
                else "<answer>-999</answer>"
                for r in rows
                for j in range(n)
            ]
            return dataclasses.replace(rb, response_texts=tuple(texts))

        trainer.rollouts.producer.generate = chosen
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert {"chain_sum", "leg_counting"} <= set(drawn)  # 4 prompts of 2 tasks (seed 0 draws both)
    assert metrics["dynamic/kept_frac/chain_sum"] == 1.0
    assert metrics["dynamic/kept_frac/leg_counting"] == 0.0
    assert metrics["dynamic/kept_frac"] == pytest.approx(drawn.count("chain_sum") / len(drawn))


def test_lenient_reward_scores_the_tagged_answer_else_the_last_number():
    from rlkit.rewards.functions import call_reward, extract_answer

    ds = rg.create_dataset("chain_sum", min_terms=2, max_terms=2, max_digits=1, size=4, seed=3)
    entry = ds[0]
    gold = entry["answer"]
    row = {
        "question": entry["question"],
        "answer": gold,
        "task": "chain_sum",
        "entry": json.dumps(entry),
        "task_config": json.dumps({"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    }
    wrong = str(int(gold) + 1)
    texts = [
        f"The sum is {gold}.",  # prose, right last number
        f"{wrong} is not it; the answer is {gold}",  # the last number counts
        f"The answer is {gold}, not {wrong}.",  # ...even when wrong
        f"<answer>{wrong}</answer> then {gold}",  # tags win over the last number
        "no number here",
    ]
    lenient = [call_reward("reasoning_gym_lenient", [("p", t, gold, row)])[0][0] for t in texts]
    strict = [call_reward("reasoning_gym", [("p", t, gold, row)])[0][0] for t in texts]
    # by hand: reasoning-gym's own score_answer on the answer each rule picks
    picked = [gold, gold, wrong, wrong, None]
    assert lenient == [ds.score_answer(a, entry) for a in picked] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert strict == [0.0, 0.0, 0.0, 0.0, 0.0]  # no tags, no answer for reasoning-gym; tagged: wrong
    assert [extract_answer("reasoning_gym_lenient", t) for t in texts] == picked
    assert extract_answer("reasoning_gym", texts[3]) == wrong  # maj@k votes on the tagged answer


def test_gsm_symbolic_rows_with_fractions_in_their_metadata_are_written_and_scored(tmp_path):
    # gsm_symbolic's entries carry fractions.Fraction values in their metadata, which plain JSON refuses.
    path = rg_data.generate(tmp_path / "gs", {"gsm_symbolic": {}}, num_train=4, num_eval=2)
    rows = [json.loads(line) for line in open(path / "test.jsonl")]
    assert rows and all(r["task"] == "gsm_symbolic" for r in rows)
    row = rows[0]
    entry = json.loads(row["entry"])
    assert entry["answer"] == row["answer"]
    right = f"<answer>{row['answer']}</answer>"
    assert rg_data.score(right, "gsm_symbolic", row["entry"], row["task_config"]) == 1.0
    wrong = rg_data.score("<answer>-12345</answer>", "gsm_symbolic", row["entry"], row["task_config"])
    # reasoning-gym's own scorer on the entry it generated (gives a small credit for a well-formed number)
    assert wrong == rg.create_dataset("gsm_symbolic", size=1).score_answer("-12345", entry) < 1.0
