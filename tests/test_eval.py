"""trainer.tools.eval: pass@k over n samples, the printed block, the jsonl, and one-line errors.

The engine is an interface, so most tests script it: given the rendered prompt it returns known
texts, which makes the scores hand-computable. One run goes through the real tiny model and hf engine
in-process, and one (slow) through ``make eval`` in a fresh process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from trainer.generation.base import Completion, SamplingParams

from .conftest import REPO

QA = REPO / "tests" / "fixtures" / "eval" / "qa.jsonl"
RIGHT, WRONG = "so the answer is \\boxed{{{}}}", "\\boxed{{-{}}}"
# Correct samples out of 4 for each question of qa.jsonl, in file order.
CORRECT = {"what is 7*6?": 2, "what is 9-4?": 0, "what is 3+3?": 4, "what is 2*8?": 1}
ANSWERS = {"what is 7*6?": "42", "what is 9-4?": "5", "what is 3+3?": "6", "what is 2*8?": "16"}


class ScriptedEngine:
    """A GenerationEngine whose samples are fixed by the question in the rendered prompt."""

    def __init__(self, tokenizer, script=None):
        self.tokenizer, self.calls = tokenizer, []
        self.script = script or self.qa_script

    @staticmethod
    def qa_script(prompt: str, n: int) -> list[str]:
        question = next(q for q in CORRECT if q in prompt)
        c = CORRECT[question]
        # the right answers first at odd positions, so the scorer cannot rely on their order
        order = [RIGHT if i < c else WRONG for i in range(n)]
        order = order[1::2] + order[0::2]
        return [t.format(ANSWERS[question]) for t in order]

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append({"prompts": texts, "n": n, "seed": params.seed})
        out = []
        for text in texts:
            assert text.endswith("<|im_start|>assistant\n"), text  # rendered with the chat template
            out.append([Completion([5, 6], [-0.1, -0.2], s, "stop") for s in self.script(text, n)])
        return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from trainer.models import load_tokenizer

    return load_tokenizer(tiny_model_path)


def qa_examples() -> list[dict]:
    from trainer.data.common import make_example

    rows = [json.loads(line) for line in QA.read_text().splitlines()]

    class Cfg:
        prompt_template, system_prompt = "{question}", None

    return [make_example(Cfg, "local", f"qa-{i}", r["question"], r["answer"]) for i, r in enumerate(rows)]


# ----- evaluate(): hand-computed pass@k --------------------------------------------------------------


@pytest.mark.parametrize(
    "k, numerator",
    [
        (1, 2 / 4 + 0 + 1 + 1 / 4),  # pass@1 = c / n
        (2, (1 - 1 / 6) + 0 + 1 + (1 - 3 / 6)),  # 1 - C(n-c, 2) / C(4, 2), C(4, 2) = 6
        (3, 1 + 0 + 1 + (1 - 1 / 4)),  # n - c < k: certain; C(3, 3) / C(4, 3) = 1/4
        (4, 1 + 0 + 1 + 1),
    ],
)
def test_pass_at_k_over_four_samples_matches_hand_computed(k, numerator, tokenizer):
    from trainer.config import RewardSpec
    from trainer.tools.eval import evaluate

    engine = ScriptedEngine(tokenizer)
    result = evaluate(
        engine, tokenizer, qa_examples(), [RewardSpec("math")], 4, SamplingParams(temperature=1.0), k=k
    )
    assert result["numerator"] == pytest.approx(numerator)
    assert result["denominator"] == 4
    assert result["score"] == pytest.approx(numerator / 4)
    rows = result["rows"]
    assert len(rows) == 16 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 3]
    assert sum(r["correct"] for r in rows) == sum(CORRECT.values())
    assert all(r["reward"] == float(r["correct"]) for r in rows)
    assert rows[0]["id"] == "qa-0" and rows[0]["ground_truth"] == "42" and rows[0]["prompt"] == "what is 7*6?"
    # each row says what the reward judged: the boxed number, right or wrong
    assert {(r["extracted_answer"], r["answer_note"]) for r in rows if r["id"] == "qa-0"} == {
        ("42", "\\boxed{}"),
        ("-42", "\\boxed{}: -42, not 42"),
    }


def test_evaluate_groups_prompts_offsets_seeds_and_reuses_encoded_prompts(tokenizer):
    from trainer.config import RewardSpec
    from trainer.data.prompts import encode_examples
    from trainer.tools.eval import evaluate

    # Validation passes examples already encoded by encode_examples: their prompt_ids are used as is.
    examples = encode_examples(tokenizer, qa_examples(), {}, 1000)
    engine, lines = ScriptedEngine(tokenizer), []
    params = SamplingParams(temperature=1.0, seed=7)
    result = evaluate(
        engine, tokenizer, examples, [RewardSpec("math")], 4, params, log_every=3, log=lines.append
    )
    assert [len(c["prompts"]) for c in engine.calls] == [3, 1]
    assert [c["seed"] for c in engine.calls] == [7, 10]  # the seed plus the group's first prompt index
    assert lines[0].startswith("eval: 3/4 prompts, pass@1=0.5000") and lines[1].startswith(
        "eval: 4/4 prompts"
    )
    assert result["score"] == pytest.approx(1.75 / 4)


def test_evaluate_scores_each_group_with_a_given_scorer(tokenizer):
    """Validation scores on Ray through its RewardRunner: evaluate takes any batch scorer."""
    from trainer.rewards.runner import RewardResult
    from trainer.tools.eval import evaluate

    batches = []

    def scorer(items):
        batches.append(len(items))
        assert all(question.startswith("what is") for _, _, question in items)  # the prompt, for the rewards
        return [RewardResult(1.0, response.startswith("so the answer"), {}) for _, response, _ in items]

    result = evaluate(
        ScriptedEngine(tokenizer),
        tokenizer,
        qa_examples(),
        [],
        4,
        SamplingParams(),
        log_every=2,
        log=lambda s: None,
        scorer=scorer,
    )
    assert batches == [8, 8] and result["numerator"] == pytest.approx(1.75)


def test_evaluate_rejects_k_above_n(tokenizer):
    from trainer.config import RewardSpec
    from trainer.tools.eval import evaluate

    with pytest.raises(ValueError, match="pass@3 needs 1 <= k <= num_tests_per_prompt"):
        evaluate(
            ScriptedEngine(tokenizer),
            tokenizer,
            qa_examples(),
            [RewardSpec("math")],
            2,
            SamplingParams(),
            k=3,
        )


# ----- the CLI with a scripted engine ----------------------------------------------------------------


def test_block_jsonl_and_result_for_a_local_file(tokenizer, tmp_path, capsys):
    from trainer.tools.eval import parse_args, run

    args = parse_args(
        [
            f"model={tmp_path}/models/scripted-model/",
            "data=local",
            f"data_path={QA}",
            "num_tests_per_prompt=4",
            "k=2",
            "temperature=1.0",
            "seed=7",
            "max_new_tokens=16",
            f"output={tmp_path / 'out'}",
        ]
    )
    run(args, engine=ScriptedEngine(tokenizer), tokenizer=tokenizer)
    out = capsys.readouterr().out
    block = "\n".join(
        [
            "=" * 60,
            "model_name='scripted-model' dataset_name='local'",
            "max_new_tokens=16 temperature=1.0 top_p=1.0 top_k=-1 seed=7",
            "metric=pass@2 num_tests_per_prompt=4",
            "score=0.5833 (2.3/4)",
            "=" * 60,
        ]
    )
    assert block in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "eval_local.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and sum(r["correct"] for r in rows) == 7
    assert {r["response"] for r in rows if r["correct"]} == {
        RIGHT.format(a) for q, a in ANSWERS.items() if CORRECT[q]
    }
    result = json.loads((tmp_path / "out" / "eval_local_result.json").read_text())
    assert result["metric"] == "pass@2" and result["score"] == pytest.approx((2 + 1 / 3) / 4)
    assert result["numerator"] == pytest.approx(2 + 1 / 3) and result["denominator"] == 4
    assert result["rewards"] == [
        {"name": "math", "weight": 1.0, "kwargs": {}, "normalize": "none", "window": 20}
    ]


@pytest.mark.parametrize(
    "data, reward, tail",
    [
        ("math500", "math", "\nPlease reason step by step, and put your final answer within \\boxed{}."),
        ("gsm8k", "gsm8k", "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ],
)
def test_dataset_prompt_template_and_default_reward(data, reward, tail, tokenizer, tmp_path):
    """Eval prompts are the training prompts (conf/data/<name>.yaml); each dataset has its reward."""
    from trainer.tools.eval import parse_args, run

    path = REPO / "tests" / "fixtures" / "data" / data
    args = parse_args(
        [f"model={data}-model", f"data={data}", f"data_path={path}", "max_examples=2", f"output={tmp_path}"]
    )
    result = run(
        args, engine=ScriptedEngine(tokenizer, lambda prompt, n: ["no idea"] * n), tokenizer=tokenizer
    )
    assert result["denominator"] == 2 and result["score"] == 0.0
    assert [r["name"] for r in result["rewards"]] == [reward]
    assert all(r["prompt"].endswith(tail) for r in result["rows"])
    assert result["split"] == "test"


def test_should_score_arithmetic_with_its_own_reward_when_no_reward_is_given():
    from trainer.config import RewardSpec
    from trainer.tools.eval import parse_args, reward_specs

    assert reward_specs(parse_args(["model=m", "data=arithmetic"])) == [
        RewardSpec("arithmetic", 1.0, {"unboxed_score": 1.0})
    ]


# ----- one-line errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["model=m", "data=mmlu"], "data='mmlu' is not allowed; choose one of: arithmetic, "),
        (
            ["model=/no/such/model", "data=arithmetic"],
            "model=/no/such/model: no such local directory, and not a hub id either",
        ),
        (
            ["model=m", "data=arithmetic", "temperature=hot"],
            "temperature='hot' must be a number, e.g. temperature=0.6",
        ),
        (["model=m", "data=arithmetic", "max_examples=2.5"], "max_examples='2.5' must be an integer"),
        (["model=m", "data=arithmetic", "top_p=0"], "top_p=0.0 must be in (0, 1]"),
        (["model=m", "data=arithmetic", "k=4"], "k=4 exceeds num_tests_per_prompt=1; pass@k needs"),
        (
            ["model=m", "data=arithmetic", "temprature=0.5"],
            "unknown key 'temprature'; valid keys: model, data",
        ),
        (["model=m", "data=local"], "data=local needs data_path=FILE"),
        (["model=m", "data=gsm8k", "data_path=/no/such.jsonl"], "data_path='/no/such.jsonl' does not exist"),
        (["model=m", "data=arithmetic", "reward=nope"], "reward: unknown reward 'nope'; registered:"),
        (["data=arithmetic"], "model= is required"),
        (["model=m", "data=arithmetic", "oops"], "'oops' is not key=value"),
        (["model=m", "data=arithmetic", "stop_strings=\\n"], "stop_strings='\\\\n' must be a YAML list"),
        (
            ["model=m", "data=arithmetic", "few_shot=[{question: 1+1}]"],
            "data.few_shot[0]={'question': '1+1'} must",
        ),
    ],
)
def test_bad_input_is_one_line(argv, expected, capsys):
    from trainer.tools.eval import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kuberl: error: ") and expected in err and err.count("\n") == 1, err


def test_training_checkpoint_as_model_says_convert_first(tmp_path, capsys):
    from trainer.tools.eval import main

    (tmp_path / "step_4" / "policy" / "weights").mkdir(parents=True)
    assert main([f"model={tmp_path / 'step_4'}", "data=arithmetic"]) == 2
    assert "is a training checkpoint; convert it first: make convert CKPT=" in capsys.readouterr().err


def test_vllm_backend_without_vllm_is_one_line(tiny_model_path, tmp_path, capsys):
    import importlib.util

    from trainer.tools.eval import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    argv = [
        f"model={tiny_model_path}",
        "data=arithmetic",
        "backend=vllm",
        "max_examples=1",
        f"output={tmp_path}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "kuberl: error: backend=vllm needs vllm: make setup installs its CPU build (or pip install '.[vllm]' "
        "on a GPU machine); or use backend=hf\n"
    )


# ----- real model --------------------------------------------------------------------------------------

BLOCK = re.compile(
    r"={60}\n"
    r"model_name='(?P<model>[^']+)' dataset_name='arithmetic'\n"
    r"max_new_tokens=3 temperature=0\.0 top_p=1\.0 top_k=-1 seed=42\n"
    r"metric=pass@1 num_tests_per_prompt=1\n"
    r"score=(?P<score>\d\.\d{4}) \((?P<num>\d+\.\d)/3\)\n"
    r"={60}\n"
)


def check_run(out: str, output: Path, model: str) -> None:
    m = BLOCK.search(out)
    assert m, out
    assert m["model"] == model and float(m["score"]) == pytest.approx(float(m["num"]) / 3, abs=1e-4)
    rows = [json.loads(line) for line in (output / "eval_arithmetic.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0 < r["num_tokens"] <= 3 for r in rows)
    assert sum(r["correct"] for r in rows) == float(m["num"])
    result = json.loads((output / "eval_arithmetic_result.json").read_text())
    assert result["score"] == pytest.approx(float(m["score"]), abs=1e-4) and result["split"] == "test"


def test_tiny_model_end_to_end_in_process(tiny_model_path, tmp_path, capsys):
    from trainer.tools.eval import main

    argv = [
        f"model={tiny_model_path}",
        "data=arithmetic",
        "max_examples=3",
        "max_new_tokens=3",
        f"output={tmp_path}",
    ]
    assert main(argv) == 0
    check_run(capsys.readouterr().out, tmp_path, Path(tiny_model_path).name)


@pytest.mark.slow
def test_make_eval_with_the_tiny_model(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "eval",
            "MODEL=builtin:tiny",
            "DATA=arithmetic",
            f"ARGS=max_examples=3 max_new_tokens=3 output={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    check_run(proc.stdout, tmp_path, "builtin:tiny")


def test_should_read_stop_strings_and_few_shot_turns_as_yaml_into_the_prompt_and_sampling():
    from trainer.data.common import build_messages
    from trainer.tools.eval import data_config, parse_args

    args = parse_args(
        ["model=m", "data=arithmetic", 'stop_strings=["\\n", "Q:"]', "few_shot=[{question: 2+3, answer: 5}]"]
    )
    assert args.stop_strings == ["\n", "Q:"]
    cfg, _ = data_config(args)
    assert build_messages(cfg, "1+1")[-3:] == [
        {"role": "user", "content": "2+3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "1+1"},
    ]
