"""Data no one here wrote, for the built-in rewards: reasoning-gym's numeric tasks with their own scorers,
and a harness that runs any reward calls under a per-call time limit (CONTRIBUTING.md: Rewards are an attack surface; issue 47).

:func:`crosscheck_cases` generates, for every task in :data:`NUMERIC_TASKS`, problems with seeds of our
choosing and three kinds of response to each: the task's own answer in the three styles of
:data:`STYLES` (honest), another problem's answer (wrong) and the answer with one digit changed (a near
miss). The task's scorer (``reasoning_gym.get_score_answer_fn``) judges the bare answer string beside
ours: an honest answer it does not pay, or a wrong answer or near miss it does pay (``power_function``
compares 3 significant figures), is no test of ours and is left out. :data:`EXCLUDED` names the tasks
whose answers are numbers or expressions that ``math`` cannot judge honestly, and why.

:func:`timed_calls` runs reward calls in a child process, one after another, and reports each one's CPU
time; a call that has not returned after :data:`HANG_S` of wall time is a hang: the child is killed and
a fresh one goes on with the next call. CPU time, not wall time, is what the limit is checked against,
so that a busy machine does not fail a call that costs little.
"""

from __future__ import annotations

import collections
import multiprocessing
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# How the answer is given: the three styles of issue 47 (the Minerva ending is lm-eval's).
STYLES = {
    "boxed": lambda a: f"Working through it, the answer is $\\boxed{{{a}}}$.",
    "final answer is": lambda a: f"The final answer is {a}.",
    "Minerva": lambda a: f"Final Answer: The final answer is ${a}$. I hope it is correct.",
}

# Tasks whose answers are numbers or expressions -> the rewards that apply besides math (gsm8k and
# arithmetic judge a single number; arithmetic one written plainly, integers and decimals only).
NUMERIC_TASKS: dict[str, tuple[str, ...]] = {
    "aiw": ("gsm8k", "arithmetic"),
    "basic_arithmetic": ("gsm8k", "arithmetic"),
    "binary_alternation": ("gsm8k", "arithmetic"),
    "bitwise_arithmetic": (),
    "chain_sum": ("gsm8k", "arithmetic"),
    "coin_flip": ("gsm8k",),
    "complex_arithmetic": (),
    "count_bits": ("gsm8k", "arithmetic"),
    "count_primes": ("gsm8k", "arithmetic"),
    "decimal_arithmetic": ("gsm8k", "arithmetic"),
    "decimal_chain_sum": ("gsm8k", "arithmetic"),
    "dice": ("gsm8k",),
    "fraction_simplification": ("gsm8k",),
    "gcd": ("gsm8k", "arithmetic"),
    "gsm_symbolic": ("gsm8k", "arithmetic"),
    "intermediate_integration": (),
    "largest_island": ("gsm8k", "arithmetic"),
    "lcm": ("gsm8k", "arithmetic"),
    "leg_counting": ("gsm8k", "arithmetic"),
    "letter_counting": ("gsm8k", "arithmetic"),
    "maze": ("gsm8k", "arithmetic"),
    "number_format": ("gsm8k", "arithmetic"),
    "number_sequence": ("gsm8k", "arithmetic"),
    "polynomial_equations": (),
    "polynomial_multiplication": (),
    "power_function": (),
    "products": ("gsm8k", "arithmetic"),
    "rectangle_count": ("gsm8k", "arithmetic"),
    "rotten_oranges": ("gsm8k", "arithmetic"),
    "self_reference": ("gsm8k", "arithmetic"),
    "simple_equations": ("gsm8k", "arithmetic"),
    "simple_geometry": ("gsm8k", "arithmetic"),
    "simple_integration": (),
}

# Tasks whose answers look numeric but that ``math`` cannot judge by value, and why.
EXCLUDED: dict[str, str] = {
    "countdown": "the answer is any expression reaching the target; the task's answer is one of many",
    "puzzle24": "the answer is any expression reaching 24 from the given numbers; one of many",
    "prime_factorization": "the answer is a form (2 × 2 × 5), not a value: 20 has the same value and is wrong",
    "base_conversion": "the answer is digits in another base (1111010010, 3a7), not a decimal value",
    "time_intervals": "a duration written hh:mm:ss is not a math object",
    "advanced_geometry": "mixes coordinates, angles and ratios that its scorer rounds to 2-3 places",
    "number_filtering": "a Python list of strings, not a math object",
    "number_sorting": "a Python list of strings, not a math object",
    "list_functions": "a Python list, compared as text",
    "circuit_logic": "a 0/1 truth value: another problem's answer is the same half the time",
    "codeio": "any JSON value a program prints",
    "string_splitting": "counts of several things as a row of digits, compared as text",
    "string_synthesis": "counts of several things as a row of digits, compared as text",
    "game_of_life": "a grid, compared as text",
}


@dataclass(frozen=True)
class Case:
    task: str
    kind: str  # "honest", "wrong", "near miss"
    style: str
    reward: str
    ground_truth: Any
    response: str


def _bare(answer: str) -> str:
    return answer.strip().strip("$").strip()


def near_misses(answer: str) -> list[str]:
    """``answer`` with one digit changed, the last digit first (``0x1f`` -> ``0x1e``, ``-3.625`` ->
    ``-3.626``), then each earlier one: the first its scorer rejects is the nearest miss it can tell."""
    out = []
    for m in reversed(list(re.finditer(r"[0-9]", answer))):
        i = m.start()
        out.append(answer[:i] + ("8" if answer[i] == "9" else str(int(answer[i]) + 1)) + answer[i + 1 :])
    return out


def problems(task: str, n: int, seed: int) -> list[dict]:
    import reasoning_gym

    data = reasoning_gym.create_dataset(task, size=n, seed=seed)
    return [data[i] for i in range(n)]


def crosscheck_cases(tasks: Iterable[str], n: int, seed: int) -> tuple[list[Case], dict[str, dict[str, int]]]:
    """The cases for ``tasks`` (``n`` problems each, from ``seed``), and per task how many candidates the
    task's own scorer ruled out: ``honest unpaid`` (its own answer scored below 1), ``wrong paid`` and
    ``near miss paid`` (another answer it pays in full)."""
    import reasoning_gym

    cases: list[Case] = []
    dropped: dict[str, dict[str, int]] = {}
    for task in tasks:
        score = reasoning_gym.get_score_answer_fn(task)
        entries = problems(task, n, seed)
        drop = dropped.setdefault(task, {"honest unpaid": 0, "wrong paid": 0, "near miss paid": 0})
        for i, entry in enumerate(entries):
            gold = str(entry["answer"])
            rewards = ("math", *NUMERIC_TASKS[task])
            if score(gold, entry) < 1.0:
                drop["honest unpaid"] += 1
                continue
            for style, make in STYLES.items():
                for reward in rewards:
                    cases.append(Case(task, "honest", style, reward, gold, make(_bare(gold))))
            others = [str(e["answer"]) for e in entries[i + 1 :] + entries[:i]]
            wrong = next((o for o in others if _bare(o) != _bare(gold)), None)
            near = next((m for m in near_misses(gold) if score(m, entry) < 1.0), None)
            if near_misses(gold) and near is None:
                drop["near miss paid"] += 1
            if wrong is not None and score(wrong, entry) >= 1.0:
                drop["wrong paid"] += 1
                wrong = None
            for kind, answer in (("wrong", wrong), ("near miss", near)):
                if answer is None:
                    continue
                for style, make in STYLES.items():
                    for reward in rewards:
                        cases.append(Case(task, kind, style, reward, gold, make(_bare(answer))))
    return cases, dropped


# -- calls under a time limit -------------------------------------------------------------------------

HANG_S = 20.0  # wall seconds after which a call that has not returned is a hang (the child is killed)


@dataclass(frozen=True)
class Timed:
    index: int
    cpu_s: float | None  # None: it hung (killed after HANG_S) or its process died
    value: float | None
    note: str


def _child(calls: list[tuple[str, Any, str, str | None]], start: int, conn) -> None:
    from trainer import rewards

    for name in {
        c[0] for c in calls
    }:  # imports (math-verify, sympy) and first-call caches are not a call's cost
        rewards.call(rewards.get(name), "x+1", "\\boxed{1+x}", {}, None)
        rewards.call(rewards.get(name), "2", "\\boxed{2}", {}, None)
    for i in range(start, len(calls)):
        name, gt, response, question = calls[i]
        conn.send(("start", i))
        t = time.process_time()
        try:
            s = rewards.call(rewards.get(name), gt, response, {}, question)
            value, note = s.value, s.note
        except Exception as e:  # a reward that raises is not a hang; the tables that score it say so
            value, note = None, f"raised {type(e).__name__}"
        conn.send(("done", i, time.process_time() - t, value, note))
    conn.send(("end",))


def timed_calls(calls: list[tuple[str, Any, str, str | None]]) -> list[Timed]:
    """Run ``(reward name, ground truth, response, question)`` calls in a child process and return each
    one's CPU seconds, value and note; a hang (no return after :data:`HANG_S`) is killed and reported
    with ``cpu_s`` None, and a fresh child goes on after it."""
    # spawn, not fork: a fork of a process with threads (a test session's Ray client, torch's pools) can
    # copy a lock another thread held, and the child then waits forever on its first import
    ctx = multiprocessing.get_context("spawn")
    out: list[Timed] = []
    start = 0
    while start < len(calls):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(calls, start, child), daemon=True)
        proc.start()
        child.close()
        current, started = None, False
        try:
            while True:
                # imports take seconds before the first call; then each call gets HANG_S
                if not parent.poll(HANG_S if current is not None else 120.0):
                    if current is None and not started:
                        raise RuntimeError("the timing child sent nothing within 120 s of its start")
                    break
                msg = parent.recv()
                if msg[0] == "start":
                    current, started = msg[1], True
                elif msg[0] == "done":
                    out.append(Timed(msg[1], msg[2], msg[3], msg[4]))
                    current = None
                else:
                    break
        except EOFError:  # the child died (killed by memory, a crash): the call it was in is reported
            pass
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            parent.close()
        if current is None:
            if len(out) == len(calls) or not out:
                break
            start = out[-1].index + 1
            continue
        out.append(Timed(current, None, None, f"no return within {HANG_S:g} s, or its process died"))
        start = current + 1
    return out


def table(cases: list[Case], results: list[Timed], limit_s: float) -> tuple[list[dict], list[str]]:
    """The cross-check by (task, reward): ``n`` problems, ``honest <style>``, ``wrong`` and ``near miss`` as
    (paid, of), the slowest call's CPU ms; and a line for each thing that breaks the acceptance (honest
    paid under 99 %, a wrong answer or near miss paid, a call over ``limit_s`` or that never returned)."""
    by = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0])
    )  # (task, reward) -> key -> [paid, n]
    slowest: dict[tuple[str, str], float] = collections.defaultdict(float)
    problems: dict[tuple[str, str], int] = collections.Counter()
    failures = []
    for case, r in zip(cases, results):
        k = (case.task, case.reward)
        key = f"honest {case.style}" if case.kind == "honest" else case.kind
        paid = r.value is not None and r.value >= 1.0
        by[k][key][0] += paid
        by[k][key][1] += 1
        if case.kind == "honest" and case.style == next(iter(STYLES)):
            problems[k] += 1
        if r.cpu_s is None or r.cpu_s > limit_s:
            failures.append(
                f"{case.task} {case.reward} {case.kind}: {r.note} ({r.cpu_s}) {case.response[:80]!r}"
            )
        else:
            slowest[k] = max(slowest[k], r.cpu_s)
        if case.kind != "honest" and paid:
            failures.append(
                f"{case.task} {case.reward} {case.kind} paid: gt {case.ground_truth!r}, {case.response[:80]!r}"
            )
    rows = []
    for (task, reward), counts in sorted(by.items()):
        rows.append(
            {
                "task": task,
                "reward": reward,
                "n": problems[(task, reward)],
                **{key: tuple(v) for key, v in counts.items()},
                "max_call_ms": round(slowest[(task, reward)] * 1000, 1),
            }
        )
    honest = [v for row in rows for key, v in row.items() if key.startswith("honest ")]
    paid, total = sum(v[0] for v in honest), sum(v[1] for v in honest)
    if total and paid / total < 0.99:
        failures.append(f"honest paid {paid}/{total} = {paid / total:.1%} < 99 %")
    return rows, failures
