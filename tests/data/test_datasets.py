"""Dataset loaders on the tiny samples in tests/fixtures/data, through the real ``datasets.load_dataset``."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainer.data as data
from trainer.data.arithmetic import evaluate, render
from trainer.data.common import build_messages
from trainer.data.math_datasets import gsm8k_answer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def cfg(**overrides):
    base = dict(
        name="arithmetic",
        path=None,
        hf_name=None,
        hf_config=None,
        split="train",
        prompt_key="question",
        answer_key="answer",
        system_prompt=None,
        prompt_template="{question}",
        max_examples=None,
        shuffle=False,
        seed=42,
        options={},
    )
    return SimpleNamespace(**{**base, **overrides})


def user(example) -> str:
    return example["messages"][-1]["content"]


def test_all_datasets_registered():
    assert {"gsm8k", "openmathinstruct2", "math500", "local", "arithmetic"} <= set(data.names())
    with pytest.raises(KeyError, match="registered: .*gsm8k"):
        data.get("gsm9k")


@pytest.mark.parametrize(
    "key", ["data.name", "data.val_name", "data"]
)  # data: python -m trainer.tools.eval's key
def test_should_name_the_key_in_one_line_when_a_dataset_is_not_registered(key):
    from trainer.config import ConfigError

    data.check("gsm8k", key)
    data.check(None, "data.val_name")  # optional: null is no dataset, not an unknown one
    with pytest.raises(ConfigError) as e:
        data.check("gsm9k", key)
    assert str(e.value) == f"{key}='gsm9k' is not allowed; choose one of: {', '.join(data.names())}"


# -- prompt building -------------------------------------------------------------------------------


def test_messages_with_system_prompt_and_template():
    c = cfg(
        system_prompt="Think step by step.", prompt_template="Q: {question}\nPut the answer in \\boxed{{}}."
    )
    assert build_messages(c, "1+1?") == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Q: 1+1?\nPut the answer in \\boxed{}."},
    ]
    assert build_messages(cfg(), "1+1?") == [{"role": "user", "content": "1+1?"}]


def test_should_put_few_shot_examples_as_earlier_turns_templated_as_the_question():
    c = cfg(
        system_prompt="Be brief.",
        prompt_template="Q: {question}",
        few_shot=[{"question": "1+1", "answer": "2"}],
    )
    assert build_messages(c, "2+2") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Q: 2+2"},
    ]


def test_should_refuse_a_few_shot_example_without_its_answer_in_one_line():
    from trainer.config import ConfigError, DataConfig

    with pytest.raises(
        ConfigError, match=r"^data\.few_shot\[1\]=\{'question': '2\+2'\} must be \{question: \.\.\., answer"
    ):
        DataConfig(few_shot=[{"question": "1+1", "answer": "2"}, {"question": "2+2"}]).validate()


def test_question_with_braces_is_not_formatted_again():
    assert (
        user({"messages": build_messages(cfg(), "Simplify $\\frac{2}{4}$ {x}")})
        == "Simplify $\\frac{2}{4}$ {x}"
    )


@pytest.mark.parametrize(
    ("template", "match"),
    [("Answer in \\boxed{} : {question}", "literal braces"), ("no placeholder", "must contain")],
)
def test_bad_template_says_how_to_fix(template, match):
    with pytest.raises(ValueError, match=match):
        build_messages(cfg(prompt_template=template), "q")


# -- gsm8k -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "expected"),
    [("so 72\n#### 72", "72"), ("#### 5,000", "5000"), ("#### -7", "-7"), ("a #### b #### 1 234 ", "1234")],
)
def test_gsm8k_answer(solution, expected):
    assert gsm8k_answer(solution) == expected


def test_gsm8k_answer_without_marker_is_an_error():
    with pytest.raises(ValueError, match="####"):
        gsm8k_answer("just 72")


def test_gsm8k_from_a_local_snapshot_directory():
    train = data.get("gsm8k")(cfg(path=str(FIXTURES / "gsm8k")), "train")
    assert [e["ground_truth"] for e in train] == ["72", "10", "5000", "-7"]
    assert train[0]["id"] == "gsm8k-train-0" and train[0]["dataset"] == "gsm8k"
    assert user(train[0]).startswith("Natalia sold clips")
    test = data.get("gsm8k")(cfg(path=str(FIXTURES / "gsm8k")), "test")
    assert [e["ground_truth"] for e in test] == ["18", "3"]
    assert data.get("gsm8k")(cfg(path=str(FIXTURES / "gsm8k")), "validation") == [
        {**e, "id": e["id"].replace("test", "validation")} for e in test
    ]  # validation reads GSM8K's test split


def test_gsm8k_from_a_single_file_ignores_the_split():
    path = str(FIXTURES / "gsm8k" / "main" / "test.jsonl")
    assert len(data.get("gsm8k")(cfg(path=path), "train")) == 2


def test_unknown_split_of_a_directory_is_named():
    with pytest.raises(ValueError, match="no split 'dev'"):
        data.get("gsm8k")(cfg(path=str(FIXTURES / "gsm8k")), "dev")


# -- math500, openmathinstruct2 ----------------------------------------------------------------------


def test_math500_reads_its_test_split_for_any_phase():
    c = cfg(path=str(FIXTURES / "math500"), system_prompt="sys")
    examples = data.get("math500")(c, "train")
    assert [e["ground_truth"] for e in examples] == [
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "26000",
        "\\frac{1}{2}",
    ]
    assert examples[1]["messages"][0] == {"role": "system", "content": "sys"}
    assert user(examples[1]) == "What is the value of $513^2 - 487^2$?"
    assert data.get("math500")(c, "validation")[0]["ground_truth"] == examples[0]["ground_truth"]


def test_openmathinstruct2_from_parquet_keeps_each_problem_once():
    c = cfg(path=str(FIXTURES / "openmathinstruct2"))
    examples = data.get("openmathinstruct2")(c, "train")
    assert [e["ground_truth"] for e in examples] == ["5", "5", "\\frac{3}{4}", "6"]
    assert len({user(e) for e in examples}) == 4
    assert [e["id"] for e in examples] == [f"openmathinstruct2-train-{i}" for i in (0, 2, 3, 5)]
    assert len(data.get("openmathinstruct2")(cfg(path=c.path, max_examples=2), "train")) == 2


def test_streaming_gives_the_same_rows_as_loading():
    path = str(FIXTURES / "openmathinstruct2" / "train.parquet")
    loaded = data.get("openmathinstruct2")(cfg(path=path, max_examples=3), "train")
    streamed = data.get("openmathinstruct2")(
        cfg(path=path, max_examples=3, options={"streaming": True}), "train"
    )
    assert streamed == loaded


# -- local -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["local.jsonl", "local.parquet"])
def test_local_file_with_configured_keys(name):
    c = cfg(
        path=str(FIXTURES / name),
        prompt_key="prompt",
        answer_key="target",
        prompt_template="Task: {question}",
    )
    examples = data.get("local")(c, "train")
    assert {user(e) for e in examples} >= {"Task: What is 7*6?"}
    assert {e["ground_truth"] for e in examples} >= {"42"}
    assert all(e["dataset"] == "local" for e in examples)


def test_local_missing_column_lists_the_columns():
    c = cfg(path=str(FIXTURES / "local.jsonl"), prompt_key="question", answer_key="target")
    with pytest.raises(KeyError, match="no column 'question'; columns: prompt, target"):
        data.get("local")(c, "train")


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [(None, ValueError, "needs data.path"), ("/nonexistent/x.jsonl", FileNotFoundError, "does not exist")],
)
def test_local_bad_paths(path, error, match):
    with pytest.raises(error, match=match):
        data.get("local")(cfg(path=path), "train")


def test_local_unsupported_suffix(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected one of .jsonl"):
        data.get("local")(cfg(path=str(tmp_path / "x.csv")), "train")


# -- selection -------------------------------------------------------------------------------------


def test_shuffle_is_seeded_and_ids_keep_the_row():
    path = str(FIXTURES / "gsm8k")
    a = data.get("gsm8k")(cfg(path=path, shuffle=True, seed=1, max_examples=3), "train")
    b = data.get("gsm8k")(cfg(path=path, shuffle=True, seed=1, max_examples=3), "train")
    assert a == b and len(a) == 3
    others = [data.get("gsm8k")(cfg(path=path, shuffle=True, seed=s), "train") for s in range(2, 8)]
    assert any([e["id"] for e in o] != [e["id"] for e in a] for o in others)
    by_id = {e["id"]: e["ground_truth"] for e in data.get("gsm8k")(cfg(path=path), "train")}
    assert all(by_id[e["id"]] == e["ground_truth"] for e in a)


def test_max_examples_takes_the_first_rows():
    path = str(FIXTURES / "gsm8k")
    assert [e["id"] for e in data.get("gsm8k")(cfg(path=path, max_examples=2), "train")] == [
        "gsm8k-train-0",
        "gsm8k-train-1",
    ]


# -- arithmetic --------------------------------------------------------------------------------------


def test_arithmetic_defaults():
    examples = data.get("arithmetic")(cfg(), "train")
    assert len(examples) == 1000
    for e in examples:
        q = user(e)
        assert e["ground_truth"] == str(eval(q))  # the oracle: Python's own precedence
        a, op, b = q.partition("+") if "+" in q else q.partition("-")
        assert op and 0 <= int(a) <= 20 and 0 <= int(b) <= 20
    assert {"+", "-"} <= {c for e in examples for c in user(e)}


def test_arithmetic_is_deterministic_and_seeded():
    one = data.get("arithmetic")(cfg(seed=5), "train")
    assert one == data.get("arithmetic")(cfg(seed=5), "train")
    assert [user(e) for e in one] != [user(e) for e in data.get("arithmetic")(cfg(seed=6), "train")]


@pytest.mark.parametrize("held_out", ["validation", "test"])
def test_arithmetic_train_and_eval_are_disjoint(held_out):
    train = {user(e) for e in data.get("arithmetic")(cfg(), "train")}
    evals = data.get("arithmetic")(cfg(options={"num_examples": 200}), held_out)
    assert len(evals) == 200 and not train & {user(e) for e in evals}


@pytest.mark.parametrize("max_operand", [15, 4])  # cpu-demo's sums, cpu-gemma3's
def test_should_hold_out_sums_scattered_over_the_operands_not_whole_columns_of_them(max_operand):
    # Each operand value's line of sums (a+b for every a, or for every b) should hold out about
    # holdout_fraction of its sums, as a binomial draw would: crc32 held out every teen + 8 (and 0-7 + 3,
    # 0-7 + 7) of cpu-demo's grid, and all five x + 3 of cpu-gemma3's, so training never saw those columns.
    options = {"num_examples": 4000, "max_operand": max_operand, "ops": "+"}
    split = {
        side: {user(e) for e in data.get("arithmetic")(cfg(options=options), side)}
        for side in ("train", "test")
    }
    grid = (max_operand + 1) ** 2
    assert len(split["train"]) + len(split["test"]) == grid and not split["train"] & split["test"]
    held = [tuple(map(int, q.split("+"))) for q in split["test"]]
    n, p = max_operand + 1, 0.1
    for side in (0, 1):
        for value in range(n):
            k = sum(1 for pair in held if pair[side] == value)
            tail = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))
            assert tail > 1e-3, f"{k} of the {n} sums with operand {side + 1} = {value} are held out"


def test_arithmetic_options_and_prompt():
    c = cfg(
        options={"num_examples": 50, "ops": "*+-", "num_operands": 3, "min_operand": -5, "max_operand": 5},
        prompt_template="What is {question}?",
        system_prompt="Answer with a number.",
        max_examples=30,
    )
    examples = data.get("arithmetic")(c, "train")
    assert len(examples) == 30
    for e in examples:
        q = user(e).removeprefix("What is ").removesuffix("?")
        assert e["ground_truth"] == str(eval(q)) and "--" not in q and "+-" not in q
        assert e["messages"][0]["role"] == "system"


@pytest.mark.parametrize(
    ("operands", "ops", "value", "text"),
    [
        ([2, 3, 4], "+*", 14, "2+3*4"),
        ([2, 3, 4], "*-", 2, "2*3-4"),
        ([5, -2], "-", 7, "5-(-2)"),
        ([9], "", 9, "9"),
    ],
)
def test_evaluate_and_render(operands, ops, value, text):
    assert evaluate(operands, ops) == value and render(operands, ops) == text


@pytest.mark.parametrize(
    ("options", "split", "match"),
    [
        ({"opz": "+"}, "train", "unknown data.options"),
        ({"ops": "/"}, "train", "use characters from"),
        ({"min_operand": 3, "max_operand": 1}, "train", "min_operand=3 > max_operand=1"),
        ({}, "dev", "unknown split 'dev'"),
        ({"min_operand": 1, "max_operand": 1, "num_operands": 1}, "validation", "almost no problems"),
    ],
)
def test_arithmetic_bad_options(options, split, match):
    with pytest.raises(ValueError, match=match):
        data.get("arithmetic")(cfg(options={"num_examples": 5, **options}), split)
