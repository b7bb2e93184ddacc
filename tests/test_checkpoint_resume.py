"""Preemption, for real: a run killed (SIGKILL) between writing a checkpoint and committing it, and
runs stopped by SIGTERM with and without time to save; then ``resume=auto``.

The resumed run must end with the same weights, log the same rewards and see the same prompts at
every step as an uninterrupted run of the same seed. Every random draw of a step is seeded from
(seed, step) and the data order from (seed, epoch), CPU kernels and gloo reductions are
deterministic, so we expect equality to float32 rounding; the tolerance (1e-6) only absorbs
summation-order noise, it is far below one Adam step (lr 1e-2) and so would catch a resume that lost
or repeated a step. The prompts come from the per-step ``train_data_step{N}.jsonl`` files and must
be identical, row for row: no prompt replayed or skipped.

Faults are injected from the test side (``tests/faults.py``): the trainer is started through a
launcher that patches its driver process, so production code reads no test switch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REPO
from .faults import launch
from .tiny_run import run_in_process

pytestmark = pytest.mark.slow

STEPS = 6


# One policy rank unless a test says otherwise: what two add (sharded DCP files, resharding) is what the
# LoRA run (two ranks throughout) and the reshard test (two, then one) check.
TWO_RANKS = "cluster.cpu_workers_per_node=2"


def _overrides(tmp: Path, *extra: str) -> list[str]:
    ranks = (
        []
        if any(e.startswith("cluster.cpu_workers_per_node=") for e in extra)
        else ["cluster.cpu_workers_per_node=1"]
    )
    return [
        "experiment=tiny",
        f"grpo.max_num_steps={STEPS}",
        "checkpointing.save_period=2",
        *ranks,
        f"logger.log_dir={tmp / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        *extra,
    ]


def _cmd(tmp: Path, *extra: str, faults: str = "") -> list[str]:
    overrides = _overrides(tmp, *extra)
    return launch(faults, overrides) if faults else [sys.executable, "-m", "trainer", *overrides]


# Every run attaches to the session's Ray instance (``trainer_env``): a SIGKILLed driver's actors are then
# ended by Ray, which notices the driver gone, as on a cluster. A run that is neither stopped nor faulted is
# ``python -m trainer``'s main in this process (tests.tiny_run.run_in_process): what these tests check of it
# is its checkpoints, logs and output, not its process.
def _run(env: dict[str, str], tmp: Path, *extra: str, faults: str = "") -> subprocess.CompletedProcess:
    if faults:
        proc = subprocess.run(
            _cmd(tmp, *extra, faults=faults), cwd=REPO, env=env, capture_output=True, text=True, timeout=900
        )
    else:
        proc = run_in_process(_overrides(tmp, *extra), env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _start(env: dict[str, str], tmp: Path, *extra: str, faults: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        _cmd(tmp, *extra, faults=faults),
        cwd=REPO,
        env=env,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the run ended before printing {prefix!r}:\n" + "".join(lines[-30:]))


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(step_dir / "policy" / "weights"))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader)
    return state


def _run_dir(tmp: Path) -> Path:
    (run_dir,) = list((tmp / "logs" / "tiny").iterdir())  # a resumed run appends to its own run
    return run_dir


def _rewards(tmp: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(_run_dir(tmp)))
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("train/reward_mean"), key=lambda e: e.step)]


def _prompts(tmp: Path) -> dict[int, list[str]]:
    """Step -> the prompt of every rollout of that step, in order (from train_data_step{N}.jsonl)."""
    out = {}
    for f in _run_dir(tmp).glob("train_data_step*.jsonl"):
        step = int(re.fullmatch(r"train_data_step(\d+)\.jsonl", f.name).group(1))
        out[step] = [json.loads(line)["prompt"] for line in f.read_text().splitlines()]
    return out


def _steps(ckpt: Path) -> list[str]:
    return sorted((p.name for p in ckpt.iterdir() if p.name.startswith("step_")), key=lambda n: int(n[5:]))


def _assert_same_run(tmp: Path, reference) -> None:
    ref_weights, ref_rewards, ref_prompts = reference[:3]
    final = _weights(tmp / "ckpt" / "tiny" / f"step_{STEPS}")
    assert final.keys() == ref_weights.keys()
    for k in final:
        assert torch.allclose(final[k], ref_weights[k], atol=1e-6, rtol=0), k
    assert _rewards(tmp) == pytest.approx(ref_rewards, abs=1e-6)
    prompts = _prompts(tmp)
    assert sorted(prompts) == list(range(1, STEPS + 1))
    for step in prompts:
        assert prompts[step] == ref_prompts[step], f"step {step}: other prompts than the uninterrupted run"


@pytest.fixture(scope="module")
def reference(trainer_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _run(trainer_env, tmp)
    prompts = _prompts(tmp)
    # The check is not vacuous: the steps see different prompts (16 of 512, shuffled).
    assert len({tuple(p) for p in prompts.values()}) == STEPS and len(prompts[1]) == 16 * 16
    return _weights(tmp / "ckpt" / "tiny" / f"step_{STEPS}"), _rewards(tmp), prompts, tmp


def test_should_see_the_same_prompts_and_drop_batches_made_ahead_when_an_async_run_resumes(
    trainer_env, tmp_path, reference
):
    # Async rollouts are timing-dependent (which weights made a batch), so weights and rewards may
    # differ from the synchronous reference; the prompt stream may not.
    ahead = ("generation.placement=disaggregated", "grpo.async.max_staleness=1")
    proc = _start(trainer_env, tmp_path, *ahead)
    lines = _read_until(proc, "step    2/")  # the producer holds the batch of step 3 by now
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=300)
    assert proc.returncode == 143, out[-2000:]
    step = int(re.search(r"preempted after step (\d+)", out).group(1))
    assert step < STEPS
    _run(trainer_env, tmp_path, *ahead)
    prompts = _prompts(tmp_path)
    assert sorted(prompts) == list(range(1, STEPS + 1))
    for s in prompts:
        assert prompts[s] == reference[2][s], f"step {s}: other prompts than the uninterrupted run"
    versions = {
        s: {json.loads(line)["policy_version"] for line in f.read_text().splitlines()}
        for s, f in ((int(f.stem[15:]), f) for f in _run_dir(tmp_path).glob("train_data_step*.jsonl"))
    }
    assert versions[step + 1] == {step}  # the resumed run's first batch: new, from the resumed weights


def _sigterm_after(env: dict[str, str], tmp: Path, step: int, *extra: str) -> str:
    """Start a run, SIGTERM its driver once it prints step ``step`` (the driver only, as `ray job stop` or
    the kubelet would); its output, after it exited 143."""
    proc = _start(env, tmp, *extra)
    lines = _read_until(proc, f"step {step:4d}/")
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=300)
    assert proc.returncode == 143, out[-2000:]
    assert "kuberl: SIGTERM received" in out
    return out


def test_should_save_only_when_sigterm_leaves_time_and_name_the_checkpoint_it_resumes_from(
    trainer_env, tmp_path, reference
):
    """One run stopped twice: first with no time to save (preemption_grace_s=0) after step 3, then, resumed,
    with time; resumed again it must end as the uninterrupted run."""
    ckpt = tmp_path / "ckpt" / "tiny"
    out = _sigterm_after(
        trainer_env, tmp_path, 3, "checkpointing.preemption_grace_s=0"
    )  # step 2 is saved, 3 not
    assert re.search(
        r"kuberl: SIGTERM: not saving step 3: a save takes about [\d.]+s and 0.0s of "
        r"checkpointing.preemption_grace_s=0 are left; the next run resumes from "
        + re.escape(str(ckpt / "step_2"))
        + ", redoing steps 3-3",
        out,
    ), out[-2000:]
    assert "preempted after step 3 (last complete checkpoint: step_2)" in out
    assert _steps(ckpt) == ["step_2"]
    out = _sigterm_after(trainer_env, tmp_path, 3)  # resumed from step 2; step 3 (or 4) is now saved
    assert f"kuberl: resumed from {ckpt / 'step_2'} (step 2," in out
    step = int(re.search(r"preempted after step (\d+)", out).group(1))
    assert 3 <= step < STEPS and (ckpt / f"step_{step}" / "COMMITTED").is_file()
    saved = re.search(rf"kuberl: saved checkpoint \S+step_{step} \(([\d.]+)s\)", out)
    print(f"SIGTERM after step {step}: checkpoint saved in {saved.group(1)}s")  # for the record (-s)
    resumed = _run(trainer_env, tmp_path)
    assert f"resumed from {ckpt / f'step_{step}'}" in resumed.stdout
    _assert_same_run(tmp_path, reference)


def test_should_reshard_when_resumed_on_fewer_ranks(trainer_env, tmp_path, tiny_model_path):
    import shutil

    from transformers import AutoModelForCausalLM

    two, one = tmp_path / "two", tmp_path / "one"
    _run(trainer_env, two, "grpo.max_num_steps=2", TWO_RANKS)
    shutil.copytree(two, one)  # the same 2-rank checkpoint of step 2, resumed on two ranks and on one
    _run(trainer_env, two, TWO_RANKS)
    resumed = _run(trainer_env, one, "cluster.cpu_workers_per_node=1")
    assert f"kuberl: resumed from {one / 'ckpt' / 'tiny' / 'step_2'} (step 2," in resumed.stdout
    assert "| 1 policy ranks," in resumed.stdout
    again = _run(
        trainer_env, one, "cluster.cpu_workers_per_node=1"
    )  # already at max_num_steps: says so, exits 0
    assert f"nothing to do: the checkpoint is at step {STEPS}" in again.stdout
    ref_weights = _weights(two / "ckpt" / "tiny" / f"step_{STEPS}")
    final = _weights(one / "ckpt" / "tiny" / f"step_{STEPS}")
    # One rank samples its completions from other random streams than two, so the runs part ways after
    # step 2; but they start from the same trained weights, far from the base model.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()

    def dist(a, b):
        return sum(float((a[k] - b[k]).norm()) for k in ref_weights)

    assert dist(final, ref_weights) < 0.7 * dist(base, ref_weights)


def test_should_start_fresh_in_a_new_run_dir_without_deleting_when_resume_is_never(trainer_env, reference):
    tmp = reference[3]  # the uninterrupted run's directories (the fixture holds what the tests compare with)
    ckpt = tmp / "ckpt" / "tiny"
    before = _steps(ckpt)
    again = _run(trainer_env, tmp, "grpo.max_num_steps=2", "checkpointing.resume=never")
    assert "starting a fresh run (resume=never" in again.stdout
    assert len(list((tmp / "logs" / "tiny").iterdir())) == 2
    assert f"step_{STEPS}" in before and _steps(ckpt) == before  # step_2 written again, nothing deleted
    assert (ckpt / "step_2" / "COMMITTED").is_file()


# ----- LoRA: the checkpoint holds the adapters and their optimizer state, the base is the model's files

LORA = (
    "policy.lora.rank=8",
    "model.name='builtin:tiny?embed_scale=3'",
    "grpo.loss.reference_policy_kl_penalty=0.01",
    TWO_RANKS,
)


def test_should_match_an_uninterrupted_run_when_a_lora_run_is_killed_before_a_commit_on_a_flat_bucket(
    trainer_env, tmp_path_factory
):
    """Directory renames refused, as on a flat GCS bucket; SIGKILL with every file of step 4 written but its
    marker; keep_top_k=1 so pruning runs too. Resumed from step 2, the adapters (and the reference computed
    with them off) must train on as in a run never stopped."""
    whole = tmp_path_factory.mktemp("lora-uninterrupted")
    _run(
        trainer_env, whole, *LORA
    )  # two ranks, each saving its shard of the adapters and their optimizer state
    reference = _weights(whole / "ckpt" / "tiny" / f"step_{STEPS}"), _rewards(whole), _prompts(whole)
    assert reference[0] and all(".lora_A." in k or ".lora_B." in k for k in reference[0])  # adapters only
    tmp = tmp_path_factory.mktemp("lora-killed")
    ckpt = tmp / "ckpt" / "tiny"
    flat = "refuse_dir_renames"
    proc = _start(
        trainer_env, tmp, *LORA, "checkpointing.keep_top_k=1", faults=f"{flat};hold_before_marker=4"
    )
    try:
        _read_until(proc, "fault: holding step 4 before its commit marker")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver; Ray then ends its actors (the job is gone)
        proc.wait()
    assert _steps(ckpt) == ["step_2", "step_4"]
    assert (ckpt / "step_4" / "policy" / "weights" / ".metadata").is_file()
    assert (ckpt / "step_4" / "training_info.json").is_file() and not (ckpt / "step_4" / "COMMITTED").exists()
    resumed = _run(trainer_env, tmp, *LORA, "checkpointing.keep_top_k=1", faults=flat)
    assert f"kuberl: removed {ckpt / 'step_4'}: incomplete (no COMMITTED marker)" in resumed.stdout
    assert f"kuberl: resumed from {ckpt / 'step_2'} (step 2," in resumed.stdout
    assert _steps(ckpt) == [f"step_{STEPS}"] and (ckpt / f"step_{STEPS}" / "COMMITTED").is_file()
    _assert_same_run(tmp, reference)
