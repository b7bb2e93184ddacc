"""Our ``math`` (and ``gsm8k``, ``arithmetic`` where they apply) against reasoning-gym's own scorers, on
every reasoning-gym task whose answers are numbers or expressions (CONTRIBUTING.md: Rewards are an attack surface; issue 47).

For each task, ``--n`` problems from ``--seed``; each problem's answer is given honestly in three
response styles ("... $\\boxed{X}$", "The final answer is X.", the Minerva ending), and another
problem's answer (wrong) and the answer with one digit changed (near miss) in the same styles, each
kept only where the task's own scorer agrees it is wrong (``tests/rewards/rg_corpus.py``). Every call
runs in a child process under a time limit; the table shows, by task and reward: n (problems), honest
paid per style, wrong paid, near-miss paid, and the slowest call in CPU milliseconds. Acceptance:
honest paid >= 99 %, wrong and near misses paid 0, no call over ``--limit-s``. The tasks left out, and
why, are printed after the table. Exit status 1 when the acceptance fails.

    make bench-rewards BENCH_REWARDS_CROSSCHECK_ARGS="--n 36 --seed 47"   # the default
    python bench/bench_reward_crosscheck.py --tasks dice,bitwise_arithmetic --n 10
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.rewards.rg_corpus import EXCLUDED, NUMERIC_TASKS, STYLES, crosscheck_cases, table, timed_calls  # noqa: E402


def show(rows: list[dict]) -> None:
    cols = ["task", "reward", "n", *(f"honest {s}" for s in STYLES), "wrong", "near miss", "max_call_ms"]
    heads = [
        "task",
        "reward",
        "n",
        *(f"honest: {s}" for s in STYLES),
        "wrong paid",
        "near miss paid",
        "max call ms",
    ]

    def cell(row, c):
        v = row.get(c)
        if isinstance(v, tuple):
            return f"{v[0]}/{v[1]}"
        return "-" if v is None else str(v)

    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for row in rows:
        print("| " + " | ".join(cell(row, c) for c in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=36, help="problems per task")
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument(
        "--tasks", default=",".join(NUMERIC_TASKS), help="comma-separated reasoning-gym task names"
    )
    ap.add_argument("--limit-s", type=float, default=1.0, help="CPU seconds one reward call may take")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    # killed (make's timeout, ^C): exit through timed_calls' finally, which kills the child a call may hang in
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(NUMERIC_TASKS))
    if unknown:
        sys.exit(f"--tasks: {', '.join(unknown)} not among the numeric tasks ({', '.join(NUMERIC_TASKS)})")
    t0 = time.monotonic()
    cases, dropped = crosscheck_cases(tasks, args.n, args.seed)
    results = timed_calls([(c.reward, c.ground_truth, c.response, None) for c in cases])
    results = sorted(results, key=lambda r: r.index)
    if len(results) != len(cases):
        sys.exit(f"{len(cases) - len(results)} calls never ran: the child process failed to start")
    rows, failures = table(cases, results, args.limit_s)
    show(rows)
    print(
        f"\n{len(cases)} calls over {len(tasks)} tasks x {args.n} problems (seed {args.seed}) in {time.monotonic() - t0:.0f} s"
    )
    for task, d in dropped.items():
        if any(d.values()):
            print(
                f"  {task}: left out where its own scorer disagrees: "
                + ", ".join(f"{k} {v}" for k, v in d.items() if v)
            )
    print("\nLeft out (not judged by value):")
    for task, why in EXCLUDED.items():
        print(f"  {task}: {why}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "dropped": dropped, "failures": failures}, indent=1)
        )
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for f in failures[:50]:
            print("  " + f)
        sys.exit(1)
    print("\nOK: honest paid >= 99 %, wrong and near misses paid 0, every call within the limit")


if __name__ == "__main__":
    main()
