"""code_unit_tests and cpp_contest: extraction, comparison, test sampling, and the reward values.

These run real programs in the default sandbox backend (bubblewrap here when available, else the
fallback); tests/sandbox/ covers both backends and hostile programs.
"""

from __future__ import annotations

import json

import pytest

from trainer import rewards
from trainer.rewards.code import extract_code, final_answer, outputs_match, select_tests

pytestmark = pytest.mark.timeout(120)

ADD = {"inputs": ["1 2\n", "3 4\n", "10 20\n", "-1 1\n"], "outputs": ["3\n", "7\n", "30\n", "0\n"]}
PY_ADD = "a, b = map(int, input().split())\nprint(a + b)"
CPP_ADD = "#include <bits/stdc++.h>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"


def fence(lang: str, code: str) -> str:
    return f"```{lang}\n{code}\n```"


# --- extraction and comparison -------------------------------------------------------------------


def test_should_take_the_last_python_block_when_there_are_several():
    r = (
        "First try:\n"
        + fence("python", "print(1)")
        + "\nBetter:\n"
        + fence("python", "print(2)")
        + "\n"
        + fence("text", "2")
    )
    assert extract_code(r, ("python", "py")) == "print(2)\n"


def test_should_fall_back_to_an_untagged_block_when_none_is_tagged():
    assert extract_code("```\nprint(3)\n```", ("python",)) == "print(3)\n"
    assert extract_code(fence("cpp", "int main(){}"), ("python",)) is None
    assert extract_code("no code here", ("python",)) is None
    assert extract_code("```python\nprint(1)\n", ("python",)) is None  # cut off before the closing fence


def test_should_ignore_drafts_in_the_reasoning_when_the_model_thinks_first():
    draft = fence("cpp", "int main(){ draft; }")
    assert (
        extract_code(f"<think>{draft}</think>\nFinal:\n" + fence("cpp", "int main(){}"), ("cpp",))
        == "int main(){}\n"
    )
    assert extract_code(f"<think>still thinking {draft}", ("cpp",)) is None
    assert final_answer("no reasoning") == "no reasoning"


@pytest.mark.parametrize(
    "got,expected,match",
    [
        ("3\n", "3", True),
        ("1 2 3", "1\n2\n3\n", True),
        ("  YES  \r\n", "YES\n", True),
        ("yes", "YES", False),
        ("1.5000001", "1.500000000", True),
        ("1.6", "1.500000000", False),
        ("3.0000000001", "3", False),  # integers are compared exactly
        ("nan", "1.0", False),
        ("3 4", "3", False),
    ],
)
def test_should_compare_outputs_token_by_token(got, expected, match):
    assert outputs_match(got, expected) is match


def test_should_sample_the_same_tests_for_every_response_when_max_tests_is_set():
    inputs = [f"{i}\n" for i in range(50)]
    a, b = select_tests(inputs, 8), select_tests(list(inputs), 8)
    assert a == b and len(a) == 8 and a == sorted(set(a))
    assert select_tests(inputs, 8, seed=1) != a
    assert select_tests(inputs, None) == list(range(50))
    assert select_tests(inputs[:5], 8) == list(range(5))


# --- code_unit_tests -----------------------------------------------------------------------------


@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_one_when_the_python_program_is_correct():
    assert rewards.get("code_unit_tests")(ADD, "Solution:\n" + fence("python", PY_ADD)) == (1.0, True)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_the_fraction_passed_when_some_tests_fail():
    code = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)"
    assert rewards.get("code_unit_tests")(ADD, fence("python", code)) == (0.75, False)
    assert rewards.get("code_unit_tests")(ADD, fence("python", code), all_or_nothing=True) == (0.0, False)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_zero_when_there_is_no_code_or_it_crashes():
    assert rewards.get("code_unit_tests")(ADD, "I don't know.") == (0.0, False)
    assert rewards.get("code_unit_tests")(ADD, fence("python", "raise SystemExit(1)")) == (0.0, False)
    assert rewards.get("code_unit_tests")(ADD, fence("python", "def broken(:")) == (0.0, False)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_run_only_max_tests_when_the_problem_has_many():
    gt = {"inputs": [f"{i}\n" for i in range(40)], "outputs": [f"{i}\n" for i in range(40)]}
    # Passes exactly the tests with even inputs; with all tests that is 1/2.
    code = "n = int(input())\nprint(n if n % 2 == 0 else -1)"
    value, _ = rewards.get("code_unit_tests")(gt, fence("python", code), max_tests=6)
    picked = select_tests(gt["inputs"], 6)
    assert value == sum(i % 2 == 0 for i in picked) / 6


@pytest.mark.integration  # runs the program in the sandbox
def test_should_apply_the_problems_time_limit_when_the_ground_truth_has_one():
    slow = "import time\ntime.sleep(1.2)\nprint(int(input().split()[0]) + 2)"
    gt = {"inputs": ["1 1\n"], "outputs": ["3\n"]}
    assert rewards.get("code_unit_tests")(gt, fence("python", slow), time_limit_s=2.0) == (1.0, True)
    # Sleeping uses no CPU: the wall-clock backstop (1.5 * 0.2 + 0.5 = 0.8 s) is what stops it.
    assert rewards.get("code_unit_tests")({**gt, "time_limit_s": 0.2}, fence("python", slow)) == (0.0, False)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_accept_tests_given_as_a_json_string():
    assert rewards.get("code_unit_tests")(json.dumps(ADD), fence("python", PY_ADD)) == (1.0, True)


def test_should_raise_a_clear_error_when_the_ground_truth_is_malformed():
    with pytest.raises(ValueError, match="inputs"):
        rewards.get("code_unit_tests")({"tests": []}, fence("python", PY_ADD))
    with pytest.raises(ValueError, match="2 test inputs for 1 outputs"):
        rewards.get("code_unit_tests")({"inputs": ["1", "2"], "outputs": ["1"]}, fence("python", PY_ADD))


# --- cpp_contest ---------------------------------------------------------------------------------


@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_one_when_the_cpp_program_is_correct():
    assert rewards.get("cpp_contest")(ADD, fence("cpp", CPP_ADD)) == (1.0, True)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_score_the_documented_values_when_cpp_fails_in_each_way():
    cpp = rewards.get("cpp_contest")
    assert cpp(ADD, "Sorry, no idea.") == (-1.0, False)
    assert cpp(ADD, fence("python", PY_ADD)) == (-1.0, False)  # no C++ block
    assert cpp(ADD, fence("cpp", "int main() { return missing; }")) == (-0.5, False)
    partial = CPP_ADD.replace("std::cout<<a+b", "std::cout<<(a>0?a+b:99)")
    assert cpp(ADD, fence("cpp", partial)) == (0.75, False)
    spin = CPP_ADD.replace("std::cout<<a+b", "if(a==10)for(volatile long i=0;;i++);std::cout<<a+b")
    assert cpp({**ADD, "time_limit_s": 0.3}, fence("cpp", spin)) == (0.0, False)
    assert cpp(ADD, fence("cpp", "int main(){ int* p = 0; return *p; }")) == (0.0, False)


@pytest.mark.integration  # runs the program in the sandbox
def test_should_respect_the_problems_memory_limit_when_cpp_allocates():
    grab = (
        "#include <bits/stdc++.h>\nint main(){ std::vector<char> v(200<<20, 1); std::cout << 3 + v[5] - 1; }"
    )
    gt = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert rewards.get("cpp_contest")({**gt, "memory_limit_mb": 256}, fence("cpp", grab)) == (1.0, True)
    assert rewards.get("cpp_contest")({**gt, "memory_limit_mb": 64}, fence("cpp", grab)) == (0.0, False)


def test_should_be_registered_under_their_names():
    assert {"code_unit_tests", "cpp_contest"} <= set(rewards.names())
