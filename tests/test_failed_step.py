"""How a failed step ends the run (:func:`trainer.run.failed_step`): the loss behind an error when a worker
is gone, even when the first error was not the dead actor's own, else the error saying where to resume."""

from __future__ import annotations

import os
import threading

import pytest

from trainer import watchdog
from trainer.generation.placement import GenerationError
from trainer.run import failed_step
from trainer.watchdog import Lost

RESUMES = "the next run resumes from /ckpt/tiny/step_2"
ECHO = GenerationError(
    "policy rank 0 failed in the weight refit: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:27038: Connection reset by peer"
)


@pytest.fixture
def actors(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Worker:
        def ping(self) -> int:
            return 1

        def exit_in(self, seconds: float) -> None:
            """End this process ``seconds`` from now, as the kernel's OOM killer would: no goodbye."""
            threading.Timer(seconds, os._exit, args=(1,)).start()

    handles = {"policy rank 0": Worker.remote(), "generation engine 0": Worker.remote()}
    ray.get([h.ping.remote() for h in handles.values()])
    for role, handle in handles.items():
        watchdog.register(handle, role)
    yield handles
    for handle in handles.values():
        watchdog.forget(handle)
        ray.kill(handle)


def test_should_name_the_dead_receiver_when_the_sender_of_a_refit_fails_first_on_its_broken_collective(
    actors, ray_local
):
    ray_local.kill(actors["generation engine 0"], no_restart=True)
    got = failed_step(ECHO, 3, RESUMES)
    assert isinstance(got, Lost), got
    line = str(got)
    assert line.startswith("lost generation engine 0 (its process is gone") and "in step 3" in line
    assert line.endswith(RESUMES) and "policy rank 0" not in line


def test_should_name_the_dead_receiver_when_its_process_ends_after_it_answered_the_first_ping(
    actors, ray_local
):
    # The death lands after the first question (a kill in flight answers it) and well before SETTLE_S,
    # when the engine is asked once more: an answer before then is not proof of life.
    ray_local.get(actors["generation engine 0"].exit_in.remote(1.0))
    got = failed_step(ECHO, 3, RESUMES)
    assert isinstance(got, Lost), got
    line = str(got)
    assert line.startswith("lost generation engine 0 (its process is gone") and "policy rank 0" not in line


def test_should_report_the_refits_own_failure_with_where_to_resume_when_every_worker_is_alive(actors):
    got = failed_step(ECHO, 3, RESUMES)
    assert type(got) is GenerationError
    assert str(got) == f"{ECHO} (step 3); {RESUMES}"


def test_should_say_in_one_line_that_the_node_ran_out_of_memory_and_what_lowers_it():
    from ray.exceptions import OutOfMemoryError

    # Ray's own message, as its memory monitor ended a cpu-gemma3 run in float32 (its pids and ids shortened)
    ray_says = OutOfMemoryError(
        "Task was killed due to the node running low on memory.\n2 worker(s) were killed due to the node running "
        "low on memory. Memory on the node (IP: 192.0.2.2, ID: 93e0b4d3) was 23.05GB used / 23.54GB limit "
        "(0.979344), which exceeds the memory usage threshold 0.95.\nTop 10 memory users: PID\tMEM(GB)\tCOMMAND\n"
        "14041\t11.11\tray::PolicyWorker.train"
    )
    got = failed_step(ray_says, 2, RESUMES)
    assert isinstance(got, Lost), got
    line = str(got)
    assert "\n" not in line and line.endswith(RESUMES)
    assert line.startswith("lost workers in step 2: the node ran out of memory (23.05 of 23.54 GB in use)")
    assert "policy.activation_checkpointing=true" in line and "make plan" in line
