"""Code-reward throughput: test executions per second, sandboxed on 2 workers vs a serial baseline.

A fixed workload (12 stdin/stdout problems, 3 responses each: correct, sometimes wrong, sometimes
crashing; 10 tests per problem) is scored several ways in one run, in interleaved rounds (the best
round of each counts, so that load from other users hits every path alike):

- ``baseline``: serial, one plain ``python3 -I solution.py`` subprocess per test, no sandbox, output
  compared in the parent (what a first reward implementation does);
- ``sandbox``: ``code_unit_tests`` as the trainer runs it, one Ray task per sample on a local Ray
  instance with 2 CPUs, in the default ``fork`` mode and in ``exec`` mode (an interpreter start per
  test, like the baseline, so the sandbox's own cost is visible);
- the same on a 2-thread pool without Ray, for reference.

Every path must agree on how many tests pass (the speed-up may not come from skipping work).
Columns: wall seconds, executions per second and the ratio to the baseline; CPU milliseconds per
execution (every process involved, from a cgroup of our own when we may make one); and the speed-up
two idle cores would give, 2 x baseline CPU / path CPU, which is what to read on a shared machine
where the wall-clock ratio only says how busy the neighbours were. Per-execution overhead is the CPU
per test on one worker for a trivial program, sandboxed minus plain, plus the sandbox's fixed
start-up per sample. ``--cpp`` adds a small C++ workload (compile once, then tests) scored by
``cpp_contest`` against a serial g++-then-subprocess baseline.

Then the reward model's scoring throughput (:func:`bench_reward_model`): a SmolLM2-135M-shaped sequence
classifier (the embedded model's weights, a random one-label head) scores the same arithmetic-style
conversations as a reward model replica does (its chat template, its tokenizer, forward passes under a
token budget), in float32 and bfloat16, in one process; samples/s and tokens/s, best of the rounds.

And the LLM judge's (:func:`bench_judge`): the embedded SmolLM2-135M-Instruct as ``judge.model`` on the hf
engine, judging the same conversations with the default ``judge.template`` (greedy, up to 32 tokens of
verdict), as a judge replica does; samples/s, and the judge's output tokens/s.

    make bench-rewards         # BENCH_REWARDS_ARGS="--cpp --json out.json --repeat 5"
                               # --rm-only: the reward model and the judge alone; --no-rm: without them
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import rewards  # noqa: E402
from trainer.rewards.code import CPP_TAGS, PYTHON_TAGS, extract_code, outputs_match  # noqa: E402
from trainer.sandbox import backends, pch, run_tests  # noqa: E402
from trainer.sandbox.executor import CPP_STD  # noqa: E402
from trainer.sandbox.parallel import map_bounded  # noqa: E402

TESTS_PER_PROBLEM = 10
WORKERS = 2
TIME_LIMIT_S = 5.0  # generous: the workload has no timeouts, and a shared machine is noisy

# name -> (input generator, correct solution)
PROBLEMS = {
    "sum": (
        lambda r: (
            n := r.randint(1000, 30000),
            f"{n}\n" + " ".join(str(r.randint(-(10**9), 10**9)) for _ in range(n)),
        )[1],
        "input()\nprint(sum(map(int, input().split())))",
    ),
    "sort": (
        lambda r: (
            n := r.randint(1000, 20000),
            f"{n}\n" + " ".join(str(r.randint(0, 10**6)) for _ in range(n)),
        )[1],
        "input()\nprint(*sorted(map(int, input().split())))",
    ),
    "sieve": (
        lambda r: str(r.randint(10**4, 3 * 10**5)),
        "n = int(input())\ns = bytearray([1]) * (n + 1)\ns[0:2] = b'\\x00\\x00'\n"
        "for i in range(2, int(n ** 0.5) + 1):\n    if s[i]:\n        s[i*i::i] = bytearray(len(s[i*i::i]))\n"
        "print(sum(s))",
    ),
    "lis": (
        lambda r: (
            n := r.randint(500, 8000),
            f"{n}\n" + " ".join(str(r.randint(0, 10**5)) for _ in range(n)),
        )[1],
        "import bisect\ninput()\nt = []\nfor x in map(int, input().split()):\n    i = bisect.bisect_left(t, x)\n"
        "    t[i:i+1] = [x]\nprint(len(t))",
    ),
    "palindrome": (
        lambda r: "".join(r.choice("ab") for _ in range(r.randint(10, 2000))),
        "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO', s.count('a'))",
    ),
    "gcd": (
        lambda r: (
            m := r.randint(100, 3000),
            f"{m}\n" + "\n".join(f"{r.randint(1, 10**12)} {r.randint(1, 10**12)}" for _ in range(m)),
        )[1],
        "import sys, math\nd = sys.stdin.read().split()\nm = int(d[0])\n"
        "print('\\n'.join(str(math.gcd(int(d[1+2*i]), int(d[2+2*i]))) for i in range(m)))",
    ),
    "prefix": (
        lambda r: (
            n := r.randint(100, 5000),
            q := r.randint(100, 5000),
            f"{n} {q}\n"
            + " ".join(str(r.randint(0, 1000)) for _ in range(n))
            + "\n"
            + "\n".join(f"{(a := r.randint(1, n))} {r.randint(a, n)}" for _ in range(q)),
        )[2],
        "import sys\nd = sys.stdin.buffer.read().split()\nn, q = int(d[0]), int(d[1])\np = [0]\n"
        "for x in d[2:2+n]:\n    p.append(p[-1] + int(x))\nout = []\nfor i in range(q):\n"
        "    l, r = int(d[2+n+2*i]), int(d[3+n+2*i])\n    out.append(p[r] - p[l-1])\nprint('\\n'.join(map(str, out)))",
    ),
    "grid_bfs": (
        lambda r: (
            h := r.randint(5, 60),
            w := r.randint(5, 60),
            f"{h} {w}\n"
            + "\n".join(
                "".join("#" if r.random() < 0.25 and (i, j) != (0, 0) else "." for j in range(w))
                for i in range(h)
            ),
        )[2],
        "from collections import deque\nh, w = map(int, input().split())\ng = [input() for _ in range(h)]\n"
        "d = [[-1] * w for _ in range(h)]\nd[0][0] = 0\nq = deque([(0, 0)])\nwhile q:\n    i, j = q.popleft()\n"
        "    for a, b in ((i+1, j), (i-1, j), (i, j+1), (i, j-1)):\n"
        "        if 0 <= a < h and 0 <= b < w and g[a][b] == '.' and d[a][b] < 0:\n"
        "            d[a][b] = d[i][j] + 1\n            q.append((a, b))\nprint(d[h-1][w-1])",
    ),
    "fib": (
        lambda r: str(r.randint(10**3, 2 * 10**5)),
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % 1000000007\nprint(a)",
    ),
    "two_sum": (
        lambda r: (
            n := r.randint(100, 20000),
            f"{n} {r.randint(0, 2000)}\n" + " ".join(str(r.randint(0, 1000)) for _ in range(n)),
        )[1],
        "from collections import Counter\nn, k = map(int, input().split())\nc = Counter(map(int, input().split()))\n"
        "print(sum(v * c.get(k - x, 0) for x, v in c.items() if x < k - x) + "
        "(c.get(k // 2, 0) * (c.get(k // 2, 0) - 1) // 2 if k % 2 == 0 else 0))",
    ),
    "knapsack": (
        lambda r: (
            n := r.randint(5, 40),
            f"{n} {r.randint(50, 800)}\n"
            + "\n".join(f"{r.randint(1, 100)} {r.randint(1, 1000)}" for _ in range(n)),
        )[1],
        "n, W = map(int, input().split())\nbest = [0] * (W + 1)\nfor _ in range(n):\n    w, v = map(int, input().split())\n"
        "    for c in range(W, w - 1, -1):\n        if best[c - w] + v > best[c]:\n            best[c] = best[c - w] + v\nprint(best[W])",
    ),
    "words": (
        lambda r: " ".join(
            r.choice(["ray", "grpo", "kube", "rl", "token", "vllm", "fsdp"]) + str(r.randint(0, 50))
            for _ in range(r.randint(10, 20000))
        ),
        "import sys\nw = sys.stdin.read().split()\nprint(len(set(w)), max(w, key=lambda x: (w.count(x) if len(w) < 200 else 0, x)))",
    ),
}

# Wrong in about a third of the tests, crashing in about half: what a policy mid-training writes.
SOMETIMES_WRONG = "import sys, io, zlib\n_d = sys.stdin.read()\nsys.stdin = io.StringIO(_d)\n{code}\nif zlib.crc32(_d.encode()) % 3 == 0:\n    print('extra')"
SOMETIMES_CRASHING = "import sys, io, zlib\n_d = sys.stdin.read()\nsys.stdin = io.StringIO(_d)\nif zlib.crc32(_d.encode()) % 2:\n    raise ValueError('bad')\n{code}"

CPP_PROBLEMS = {
    "sum": (
        "sum",
        '#include <bits/stdc++.h>\nint main(){int n;scanf("%d",&n);long long s=0,x;while(n--){scanf("%lld",&x);s+=x;}printf("%lld\\n",s);}',
    ),
    "sort": (
        "sort",
        '#include <bits/stdc++.h>\nint main(){int n;scanf("%d",&n);std::vector<int>v(n);for(auto&x:v)scanf("%d",&x);std::sort(v.begin(),v.end());for(int i=0;i<n;i++)printf(i?" %d":"%d",v[i]);puts("");}',
    ),
    "fib": (
        "fib",
        '#include <bits/stdc++.h>\nint main(){long long n,a=0,b=1;std::cin>>n;while(n--){long long t=(a+b)%1000000007;a=b;b=t;}std::cout<<a<<"\\n";}',
    ),
}


def fence(lang: str, code: str) -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\n"


def build_workload() -> list[tuple[dict, str]]:
    """[(ground truth, response)]: expected outputs come from the correct solutions, run once untimed."""
    python = backends.resolve().python
    samples = []
    for k, (_name, (gen, code)) in enumerate(sorted(PROBLEMS.items())):
        rng = random.Random(1000 + k)
        inputs = [gen(rng) + "\n" for _ in range(TESTS_PER_PROBLEM)]
        outputs = [_plain_run(python, code, x)[1] for x in inputs]
        gt = {"inputs": inputs, "outputs": outputs}
        for variant in ("{code}", SOMETIMES_WRONG, SOMETIMES_CRASHING):
            samples.append((gt, fence("python", variant.format(code=code))))
    return samples


def _plain_run(python: str, code: str, stdin: str, path: str | None = None) -> tuple[bool, str]:
    own = path is None
    if own:
        fd, path = tempfile.mkstemp(suffix=".py")
        os.write(fd, code.encode())
        os.close(fd)
    try:
        p = subprocess.run(
            [python, "-I", path], input=stdin.encode(), capture_output=True, timeout=TIME_LIMIT_S
        )
        return p.returncode == 0, p.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        return False, ""
    finally:
        if own:
            os.unlink(path)


def baseline_python(samples, python: str) -> list[int]:
    """Serial: write the code once per sample, then one subprocess per test."""
    passed = []
    with tempfile.TemporaryDirectory() as d:
        for j, (gt, response) in enumerate(samples):
            code = extract_code(response, PYTHON_TAGS)
            path = os.path.join(d, f"s{j}.py")
            Path(path).write_text(code)
            n = 0
            for x, want in zip(gt["inputs"], gt["outputs"], strict=True):
                ok, out = _plain_run(python, code, x, path)
                n += ok and outputs_match(out, want)
            passed.append(n)
    return passed


class CpuMeter:
    """CPU seconds used by this process and everything it starts, sandboxes and Ray workers included.

    A cgroup of our own counts every descendant exactly, even those bwrap's PID namespace reaps out
    of our sight; without one (no root, no cgroup fs) it falls back to rusage, which misses them.
    """

    def __init__(self) -> None:
        self.dir, self.kind = None, "rusage (misses sandboxed processes)"
        for root, stat, kind in (
            ("/sys/fs/cgroup/cpuacct", "cpuacct.usage", "cgroup v1 cpuacct"),
            ("/sys/fs/cgroup/unified", "cpu.stat", "cgroup v2"),
            ("/sys/fs/cgroup", "cpu.stat", "cgroup v2"),
        ):
            d = os.path.join(root, f"kuberl-bench-{os.getpid()}")
            try:
                os.mkdir(d)
                Path(d, "cgroup.procs").write_text(str(os.getpid()))
                if os.path.exists(os.path.join(d, stat)):
                    self.dir, self.stat, self.root, self.kind = d, stat, root, kind
                    return
                self._leave(root, d)
            except OSError:
                continue

    def _leave(self, root: str, d: str) -> None:
        try:
            Path(root, "cgroup.procs").write_text(str(os.getpid()))
            os.rmdir(d)
        except OSError:
            pass

    def seconds(self) -> float:
        if self.dir is None:
            me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        text = Path(self.dir, self.stat).read_text()
        if self.stat == "cpuacct.usage":
            return int(text) / 1e9
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6

    def close(self) -> None:
        if self.dir is not None:
            self._leave(self.root, self.dir)


def _score_python(item):
    """One sample, as the trainer scores it: the number of tests it passed."""
    gt, response, mode = item
    value, _ = rewards.get("code_unit_tests")(gt, response, time_limit_s=TIME_LIMIT_S, python_mode=mode)
    return round(value * len(gt["inputs"]))


def _score_cpp(item):
    gt, response = item
    value, _ = rewards.get("cpp_contest")(gt, response, time_limit_s=TIME_LIMIT_S)
    return round(value * len(gt["inputs"]))


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def overhead(python: str, repeat: int, meter: CpuMeter) -> dict:
    """CPU per test on one worker, sandboxed vs plain, for a program that does almost nothing.

    CPU rather than wall time: on a shared machine it is what stays put. The sandbox's fixed cost
    (bwrap, the runner's interpreter) is paid once per sample and reported apart.
    """
    code, n = "print(input())", 30
    inputs = [f"{i}\n" for i in range(n)]

    def cpu(fn) -> float:
        fn()  # warm
        best = float("inf")
        for _ in range(repeat):
            c0 = meter.seconds()
            fn()
            best = min(best, meter.seconds() - c0)
        return best

    plain = cpu(lambda: [_plain_run(python, code, x) for x in inputs]) / n
    out = {"plain_cpu_s_per_exec": plain}
    for mode in ("fork", "exec"):
        c1 = cpu(lambda m=mode: run_tests("python", code, inputs[:1], python_mode=m))
        cn = cpu(lambda m=mode: run_tests("python", code, inputs, python_mode=m))
        per_test = (cn - c1) / (n - 1)
        out[f"{mode}_cpu_s_per_exec"] = per_test
        out[f"{mode}_overhead_cpu_s_per_exec"] = per_test - plain
        out["sandbox_startup_cpu_s"] = c1 - per_test
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--repeat", type=int, default=3, help="rounds over every path; the best round counts")
    ap.add_argument("--cpp", action="store_true", help="add the C++ workload (slower: one g++ per sample)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray runs (threads only)")
    ap.add_argument("--no-rm", action="store_true", help="skip the reward model's and the judge's throughput")
    ap.add_argument(
        "--rm-only", action="store_true", help="only the reward model's and the judge's throughput"
    )
    args = ap.parse_args()
    if args.rm_only:
        results = {"reward_model": bench_reward_model(args.repeat), "judge": bench_judge(args.repeat)}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return

    b = backends.resolve()
    print(
        f"backend: {b.kind} ({b.bwrap or b.reason}); interpreter {b.python}; {os.cpu_count()} CPUs; {WORKERS} workers"
    )
    samples = build_workload()
    n_exec = sum(len(gt["inputs"]) for gt, _ in samples)
    print(
        f"workload: {len(samples)} samples, {n_exec} test executions; best of {args.repeat} interleaved rounds\n"
    )
    results: dict = {"backend": b.kind, "samples": len(samples), "executions": n_exec, "workers": WORKERS}
    meter = CpuMeter()
    atexit.register(meter.close)
    print(f"CPU time measured with {meter.kind}")

    def sandboxed(mode: str, use_ray: bool):
        items = [(gt, r, mode) for gt, r in samples]
        return lambda: map_bounded(_score_python, items, max_concurrency=WORKERS, use_ray=use_ray)

    paths = {"baseline: serial, subprocess per test, no sandbox": lambda: baseline_python(samples, b.python)}
    for mode in ("fork", "exec"):
        paths[f"sandbox {mode}: {WORKERS} threads"] = sandboxed(mode, False)
    ray = None
    if not args.no_ray:
        import ray

        ray.init(
            address="local",
            num_cpus=WORKERS,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
        )
        map_bounded(
            _score_python, [(gt, r, "fork") for gt, r in samples[: 4 * WORKERS]], max_concurrency=WORKERS
        )
        for mode in ("fork", "exec"):
            paths[f"sandbox {mode}: {WORKERS} Ray workers, a task per sample"] = sandboxed(mode, True)
    try:
        best: dict[str, tuple[float, float]] = {}
        passed_by: dict[str, list[int]] = {}
        for _ in range(args.repeat):
            for name, fn in paths.items():
                c0 = meter.seconds()
                t, passed_by[name] = timed(fn)
                best[name] = min((t, meter.seconds() - c0), best.get(name, (float("inf"), 0.0)))
    finally:
        if ray is not None:
            ray.shutdown()

    base_name = next(iter(paths))
    (t_base, cpu_base), base_passed = best[base_name], passed_by[base_name]
    print(
        f"{'path':56s} {'seconds':>7s} {'exec/s':>7s} {'vs base':>7s} {'CPU ms/exec':>11s} {'2x CPU ratio':>12s}"
    )
    for name in paths:
        (t, cpu), passed = best[name], passed_by[name]
        if passed != base_passed:
            raise SystemExit(
                f"{name}: passed {sum(passed)} tests, the baseline {sum(base_passed)}: results disagree"
            )
        # What two idle cores would give: the work's CPU cost relative to the baseline's, spread over two.
        ideal = (1 if name == base_name else WORKERS) * cpu_base / cpu
        print(
            f"{name:56s} {t:7.2f} {n_exec / t:7.1f} {t_base / t:6.2f}x {cpu / n_exec * 1e3:11.1f} {ideal:11.2f}x"
        )
        results[name] = {
            "seconds": t, "exec_per_s": n_exec / t, "speedup": t_base / t,
            "cpu_ms_per_exec": cpu / n_exec * 1e3, "speedup_on_idle_cores": ideal,
        }  # fmt: skip
    print(
        f"(tests passed: {sum(base_passed)}/{n_exec} on every path; load average now {os.getloadavg()[0]:.1f})"
    )

    ov = overhead(b.python, args.repeat, meter)
    results["overhead"] = ov
    print(
        "\nCPU per execution of a trivial program, one worker: "
        f"plain subprocess {ov['plain_cpu_s_per_exec'] * 1e3:.1f} ms; "
        f"sandbox fork {ov['fork_cpu_s_per_exec'] * 1e3:.1f} ms ({ov['fork_overhead_cpu_s_per_exec'] * 1e3:+.1f} ms), "
        f"sandbox exec {ov['exec_cpu_s_per_exec'] * 1e3:.1f} ms ({ov['exec_overhead_cpu_s_per_exec'] * 1e3:+.1f} ms); "
        f"plus {ov['sandbox_startup_cpu_s'] * 1e3:.0f} ms to start a sandbox, once per sample"
    )

    if args.cpp:
        results["cpp"] = bench_cpp(b, meter)
    if not args.no_rm:
        results["reward_model"] = bench_reward_model(args.repeat)
        results["judge"] = bench_judge(args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def bench_cpp(b, meter: CpuMeter) -> dict:
    samples = []
    for k, (_name, (pyname, code)) in enumerate(sorted(CPP_PROBLEMS.items())):
        gen, ref = PROBLEMS[pyname]
        rng = random.Random(2000 + k)
        inputs = [gen(rng) + "\n" for _ in range(TESTS_PER_PROBLEM)]
        gt = {"inputs": inputs, "outputs": [_plain_run(b.python, ref, x)[1] for x in inputs]}
        samples += [(gt, fence("cpp", code))] * 2
    n_exec = sum(len(gt["inputs"]) for gt, _ in samples)

    def baseline():
        passed = []
        with tempfile.TemporaryDirectory() as d:
            for j, (gt, response) in enumerate(samples):
                src, exe = os.path.join(d, f"s{j}.cpp"), os.path.join(d, f"s{j}")
                Path(src).write_text(extract_code(response, CPP_TAGS))
                subprocess.run(["g++", "-O2", "-std=c++17", "-o", exe, src], check=True, capture_output=True)
                n = 0
                for x, want in zip(gt["inputs"], gt["outputs"], strict=True):
                    p = subprocess.run([exe], input=x.encode(), capture_output=True, timeout=TIME_LIMIT_S)
                    n += p.returncode == 0 and outputs_match(p.stdout.decode(), want)
                passed.append(n)
        return passed

    pch.include_dir(shutil.which("g++"), CPP_STD)  # start building the precompiled header, if not there
    map_bounded(_score_cpp, samples[:1], use_ray=False)
    c0 = meter.seconds()
    t_base, base_passed = timed(baseline)
    c1 = meter.seconds()
    t, passed = timed(lambda: map_bounded(_score_cpp, samples, max_concurrency=WORKERS, use_ray=False))
    c2 = meter.seconds()
    assert passed == base_passed, (passed, base_passed)
    with_pch = pch.include_dir(shutil.which("g++"), CPP_STD) is not None
    print(
        f"\nC++ ({len(samples)} samples, {n_exec} executions, one g++ each): baseline {t_base:.2f}s "
        f"({c1 - c0:.1f} CPU-s), sandbox on {WORKERS} threads {t:.2f}s ({c2 - c1:.1f} CPU-s): {t_base / t:.2f}x"
        f"{' (precompiled <bits/stdc++.h>)' if with_pch else ''}"
    )
    return {"baseline_s": t_base, "sandbox_s": t, "speedup": t_base / t, "executions": n_exec,
            "baseline_cpu_s": c1 - c0, "sandbox_cpu_s": c2 - c1, "precompiled_header": with_pch}  # fmt: skip


def conversations(samples: int, seed: int) -> list[tuple[list[dict], str]]:
    """``(messages, response)``: a math question and a worked answer of 40-160 words, as a policy writes them."""
    rng = random.Random(seed)
    items = []
    for _ in range(samples):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        steps = " ".join(
            f"step {k}: {rng.randint(1, 99)} + {rng.randint(1, 99)} carries over;"
            for k in range(rng.randint(8, 32))
        )
        items.append(
            (
                [{"role": "user", "content": f"What is {a} + {b}? Show your work."}],
                f"{steps} so the answer is \\boxed{{{a + b}}}.",
            )
        )
    return items


def score_rounds(worker, items: list, repeat: int) -> tuple[float, list, list[str]]:
    """A replica's ``score`` over ``items``, ``repeat`` times, as the runner drives it: the best seconds, then
    the last round's scores and notes."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        gen = worker.score(items)
        next(gen)  # started
        scores, notes, _ = next(gen)
        best = min(best, time.perf_counter() - t0)
    return best, scores, notes


def bench_reward_model(repeat: int, samples: int = 64, seed: int = 0) -> dict:
    """Samples/s of a SmolLM2-135M-shaped reward model on this CPU, per dtype and token budget."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from trainer import hardware
    from trainer.config import RewardModelConfig
    from trainer.models import load_tokenizer, resolve_model
    from trainer.rewards.reward_model import RewardModelWorker, render

    base = resolve_model("embedded:smollm2-135m-instruct")
    out = Path(tempfile.mkdtemp(prefix="kuberl-bench-rm-"))
    atexit.register(shutil.rmtree, out, True)
    torch.manual_seed(seed)  # the random head: the scores are not the point, the forward passes are
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(out)
    load_tokenizer(base).save_pretrained(out)
    items = conversations(samples, seed)
    print(
        f"\nreward model: SmolLM2-135M-shaped sequence classifier (embedded weights, random head), {samples} "
        f"samples; {hardware.describe()}, {torch.get_num_threads()} threads; best of {repeat} rounds"
    )
    print(f"{'dtype':9s} {'tokens/batch':>12s} {'seconds':>8s} {'samples/s':>9s} {'tokens/s':>9s}")
    results: dict = {"samples": samples}
    for dtype in ("float32", "bfloat16"):
        for budget in (2048, 8192):
            worker = RewardModelWorker(
                RewardModelConfig(name=str(out), dtype=dtype, max_tokens_per_batch=budget)
            )
            tokens = 0
            for m, r in items:  # what the replica reads: its template's text, in its tokens
                text, special = render(worker.tokenizer, m, r)
                tokens += len(worker.tokenizer(text, add_special_tokens=not special)["input_ids"])
            best, scores, notes = score_rounds(worker, items, repeat)
            assert len(scores) == samples and not any(notes)
            print(f"{dtype:9s} {budget:12d} {best:8.2f} {samples / best:9.1f} {tokens / best:9.0f}")
            results[f"{dtype}/{budget}"] = {
                "seconds": best,
                "samples_per_s": samples / best,
                "tokens_per_s": tokens / best,
                "tokens": tokens,
            }
    print(f"(load average now {os.getloadavg()[0]:.1f})")
    return results


def bench_judge(repeat: int, samples: int = 32, max_new_tokens: int = 32, seed: int = 0) -> dict:
    """Samples/s of the embedded SmolLM2-135M-Instruct as a judge on the hf engine, on this CPU, per dtype."""
    import torch

    from trainer import hardware
    from trainer.config import JudgeConfig
    from trainer.generation.judge import JudgeWorker
    from trainer.models import resolve_model
    from trainer.rewards import judge

    model = resolve_model("embedded:smollm2-135m-instruct")
    items = [judge.item(None, response, messages) for messages, response in conversations(samples, seed)]
    print(
        f"\njudge: SmolLM2-135M-Instruct (embedded weights) on the hf engine, default judge.template, greedy, up "
        f"to {max_new_tokens} tokens, {samples} samples; {hardware.describe()}, {torch.get_num_threads()} threads; "
        f"best of {repeat} rounds"
    )
    print(f"{'dtype':9s} {'seconds':>8s} {'samples/s':>9s} {'out tok/s':>9s} {'parsed':>7s}")
    results: dict = {"samples": samples, "max_new_tokens": max_new_tokens}
    for dtype in ("float32", "bfloat16"):
        worker = JudgeWorker(
            JudgeConfig(model=model, dtype=dtype, max_new_tokens=max_new_tokens, batch_size=samples)
        )
        prompts, _ = worker.prompts(items)
        best, scores, notes = score_rounds(worker, items, repeat)
        parsed = sum(n.startswith(judge.PARSED) for n in notes)
        outs = worker.engine.generate(prompts, 1, worker.params)  # type: ignore[arg-type]
        out_tokens = sum(len(c[0].token_ids) for c in outs)
        print(f"{dtype:9s} {best:8.2f} {samples / best:9.2f} {out_tokens / best:9.0f} {parsed:4d}/{samples}")
        results[dtype] = {
            "seconds": best,
            "samples_per_s": samples / best,
            "output_tokens_per_s": out_tokens / best,
            "parsed": parsed,
            "example_note": notes[0][:300],
        }
        worker.shutdown()
    print(f"(load average now {os.getloadavg()[0]:.1f})")
    return results


if __name__ == "__main__":
    main()
