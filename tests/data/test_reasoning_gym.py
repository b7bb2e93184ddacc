"""``data=reasoning_gym``: reasoning-gym's generators as a dataset; splits that never share a problem, the
prompt built as every dataset builds it, a ground truth that survives Ray and the jsonl, and bad options
refused in one line before anything starts."""

from __future__ import annotations

import json

import pytest

from trainer import data
from trainer.config import ConfigError, DataConfig, RewardSpec, load

load_rg = data.get("reasoning_gym")
# one-digit sums of two terms: a problem space of 100 questions, where two seeds collide at once
SMALL = {"chain_sum": {"weight": 1.0, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}


def _cfg(**options) -> DataConfig:
    return DataConfig(
        name="reasoning_gym", options={"tasks": SMALL, **options}, system_prompt="Be brief.", seed=7
    )


def _questions(examples) -> set[str]:
    return {ex["messages"][-1]["content"] for ex in examples}


def test_should_never_share_a_problem_between_train_and_evaluation_when_the_problem_space_is_small():
    train, test = load_rg(_cfg(size=400), "train"), load_rg(_cfg(size=400), "test")
    assert len(train) == len(test) == 400
    assert len(_questions(train)) > 50  # most of the space is drawn, so a shared problem would show
    assert not _questions(train) & _questions(test)
    assert not _questions(train) & _questions(load_rg(_cfg(size=400), "validation"))


def test_should_give_the_same_problems_for_a_seed_and_other_ones_for_another():
    first, again = load_rg(_cfg(size=50), "train"), load_rg(_cfg(size=50), "train")
    assert first == again
    other = load_rg(DataConfig(name="reasoning_gym", options={"tasks": SMALL, "size": 50}, seed=8), "train")
    assert [ex["messages"] for ex in other] != [ex["messages"] for ex in first]


def test_should_mix_the_named_tasks_with_their_configs_and_build_the_prompt_from_the_question():
    tasks = {**SMALL, "gcd": {"weight": 3.0, "config": {"max_value": 20}}, "spell_backward": None}
    examples = load_rg(
        DataConfig(
            name="reasoning_gym",
            options={"tasks": tasks, "size": 120},
            system_prompt="Be brief.",
            prompt_template="Q: {question}",
        ),
        "train",
    )
    seen = {ex["ground_truth"]["task"] for ex in examples}
    assert seen == {"chain_sum", "gcd", "spell_backward"}
    for ex in examples:
        assert ex["dataset"] == "reasoning_gym" and ex["id"].startswith(ex["ground_truth"]["task"])
        assert ex["messages"][0] == {"role": "system", "content": "Be brief."}
        assert ex["messages"][1]["role"] == "user" and ex["messages"][1]["content"].startswith("Q: ")
        if ex["ground_truth"]["task"] == "gcd":
            assert all(n <= 20 for n in ex["ground_truth"]["metadata"]["numbers"])


def test_should_size_an_evaluation_split_by_max_examples_and_training_by_size():
    cfg = _cfg(size=30)
    assert len(load_rg(cfg, "train")) == 30
    cfg.max_examples = 12
    assert len(load_rg(cfg, "train")) == 12 and len(load_rg(cfg, "validation")) == 12


def test_should_keep_in_the_ground_truth_what_the_scorer_reads_as_json_gives_it_back():
    import reasoning_gym

    for ex in load_rg(
        DataConfig(
            name="reasoning_gym",
            options={"tasks": ["chain_sum", "gcd", "word_sorting", "puzzle24", "time_intervals"], "size": 40},
        ),
        "train",
    ):
        gt = ex["ground_truth"]
        assert set(gt) == {"task", "answer", "metadata"}
        assert json.loads(json.dumps(gt)) == gt  # tuples were made lists once, at generation
        entry = {"answer": gt["answer"], "metadata": gt["metadata"]}
        assert reasoning_gym.get_score_answer_fn(gt["task"])(gt["answer"], entry) == 1.0, gt


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tasks": {"nope": None}},
            "data.options.tasks: unknown reasoning-gym task 'nope'; valid: ab, acre,",
        ),
        ({"tasks": {"chain_sum": {"config": {"bogus": 1}}}}, "data.options.tasks.chain_sum.config: "),
        (
            {"tasks": {"chain_sum": {"config": {"min_terms": 0}}}},
            "data.options.tasks.chain_sum.config: min_terms",
        ),
        (
            {"tasks": {"chain_sum": {"config": {"seed": 1}}}},
            "data.options.tasks.chain_sum.config.seed: set by kuberl",
        ),
        (
            {"tasks": {"chain_sum": {"weight": 0}}},
            "data.options.tasks.chain_sum.weight=0 must be a positive number",
        ),
        ({"tasks": {"chain_sum": {"wieght": 2}}}, "data.options.tasks.chain_sum: unknown keys ['wieght']"),
        ({"tasks": {}}, "data.options.tasks must name at least one reasoning-gym task"),
        ({"tasks": ["chain_sum"], "sise": 3}, "reasoning_gym: unknown data.options ['sise']"),
    ],
)
def test_should_refuse_bad_options_in_one_line_naming_the_key(options, message):
    with pytest.raises(ConfigError) as err:
        data.check("reasoning_gym", "data.name", options)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    if "unknown reasoning-gym task" in message:
        assert "chain_sum" in str(err.value) and "composite" not in str(err.value)


def test_should_refuse_an_unknown_task_before_ray_or_any_model_when_a_run_starts(monkeypatch):
    from trainer import cluster, models, run

    def started(*args, **kwargs):
        raise AssertionError("the run got past its checks")

    monkeypatch.setattr(cluster, "init_ray", started)
    monkeypatch.setattr(models, "resolve_model", started)
    monkeypatch.setattr(run, "check_backend", started)
    cfg = load(["experiment=cpu-reasoning-gym", "data.options.tasks={nope: null}"])
    with pytest.raises(
        ConfigError, match=r"^data.options.tasks: unknown reasoning-gym task 'nope'; valid: ab, "
    ):
        run.train(cfg)


def test_should_score_the_ground_truth_the_same_after_the_rollouts_jsonl(tmp_path):
    """The jsonl is written by the run's own logger from the rollout rows, and read back as a person would."""
    from types import SimpleNamespace

    from trainer.logger import RunLogger
    from trainer.rewards.runner import RewardResult, score_one
    from trainer.step_report import rollout_rows

    examples = load_rg(_cfg(size=4), "train")
    specs = [RewardSpec("reasoning_gym")]
    responses = [f"<answer>{ex['ground_truth']['answer']}</answer>" for ex in examples]
    rollouts = [
        SimpleNamespace(
            example=ex,
            completion=SimpleNamespace(text=resp, finish_reason="stop"),
            tokens=[],
            turns=1,
            reward=RewardResult(1.0, True, {"reasoning_gym": 1.0}),
            model_tokens=3,
        )
        for ex, resp in zip(examples, responses)
    ]
    cfg = load(["experiment=cpu-reasoning-gym", f"logger.log_dir={tmp_path}", "logger.backends=[]"])
    logger = RunLogger(cfg)
    try:
        logger.rollouts(1, rollout_rows(1, rollouts, [0.0] * 4, [0] * 4, None, None))
    finally:
        logger.close()
    (path,) = tmp_path.rglob("train_data_step1.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["ground_truth"] for row in rows] == [ex["ground_truth"] for ex in examples]
    for row in rows:
        assert score_one(specs, row["ground_truth"], row["response"]).total == 1.0
        wrong = score_one(specs, row["ground_truth"], "<answer>1000</answer>")
        assert wrong.total == 0.0 and wrong.answer == "1000"


def test_should_score_the_ground_truth_in_a_ray_task_as_in_the_driver(ray_local):
    from trainer.config import EnvConfig
    from trainer.rewards.runner import RewardRunner

    examples = load_rg(
        DataConfig(name="reasoning_gym", options={"tasks": ["chain_sum", "gcd", "puzzle24"], "size": 6}),
        "train",
    )
    runner = RewardRunner(EnvConfig(reward_functions=[RewardSpec("reasoning_gym")]))
    right = [
        (ex["ground_truth"], f"The final answer is \\boxed{{{ex['ground_truth']['answer']}}}.")
        for ex in examples
    ]
    wrong = [(ex["ground_truth"], "<answer>100000</answer>") for ex in examples]
    results = runner.results(runner.submit(right + wrong))
    assert [r.total for r in results] == [1.0] * 6 + [0.0] * 6, [r.answer_note for r in results]
    assert [r.answer for r in results[:6]] == [str(ex["ground_truth"]["answer"]) for ex in examples]
