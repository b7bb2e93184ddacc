"""The disaggregated placement's start-up order and its bounds, with real Ray actors standing in for the
engines and the policy ranks (the session's Ray instance).

vLLM's trainer-side rendezvous gives the engines' workers 300 s to join, which we cannot change, so
nothing may open the weight-transfer group before every engine is built; a refit that fails or stalls
ends in one line. The stand-ins write every call into a recorder actor, in the order they happen.
"""

from __future__ import annotations

import os
import time

import pytest

from trainer.config import load


class _Recorder:
    def __init__(self):
        self.events: list[str] = []

    def note(self, what: str) -> None:
        self.events.append(what)

    def read(self) -> list[str]:
        return list(self.events)


def _engine_class(recorder: str, build_s: float, receive: str = "ok", join: dict[int, str] | None = None):
    """A stand-in for GenerationWorker: building its engine takes ``build_s``; a refit does ``receive``;
    joining the transfer group does ``join[rank]`` (default "ok")."""

    class Engine:
        def __init__(self, cfg, model_path, rank):
            import ray

            self.rank, self.log = rank, ray.get_actor(recorder)
            time.sleep(build_s)  # reading, compiling, capturing graphs
            ray.get(self.log.note.remote(f"engine {rank} built"))

        def ready(self) -> bool:
            return True

        def init_weight_sync(self, info: dict) -> None:
            import ray

            how = (join or {}).get(self.rank, "ok")
            if how == "raise":
                raise RuntimeError("ncclInternalError: ibv_modify_qp failed with 110 Connection timed out")
            if how == "hang":  # a rendezvous nobody completes (NCCL's init has no time limit)
                time.sleep(90)
            ray.get(self.log.note.remote(f"engine {self.rank} joins the transfer group"))

        def receive_weights(self, update_info: dict) -> None:
            if receive == "raise":
                raise ValueError("cannot load model.layers.0.mlp.up_proj.weight: shape mismatch")
            if receive == "hang":
                time.sleep(3600)

        def close_weight_sync(self) -> None:
            pass

        def generate(self, prompts, n, params):
            return [[(prompt, seed)] for prompt, seed in zip(prompts, params.prompt_seeds(len(prompts)))]

        def shutdown(self) -> None:
            pass

    return Engine


class _PolicyRank:
    def __init__(self, recorder: str, rank: int):
        import ray

        self.rank, self.log = rank, ray.get_actor(recorder)

    def address(self):
        return "127.0.0.1", 1

    def weight_metadata(self) -> dict:
        return {"names": [], "dtype_names": [], "shapes": []}

    def init_weight_sync(self, info: dict) -> None:
        import ray

        ray.get(self.log.note.remote(f"policy rank {self.rank} opens the transfer group"))

    def broadcast_weights(self, update_info: dict) -> dict:
        return {}

    def close_weight_sync(self) -> None:
        pass


class _Policy:
    def __init__(self, workers):
        self.workers = workers


@pytest.fixture
def placed(ray_local, monkeypatch, tiny_model_path):
    """``make(build_s, receive, *overrides)``: a DisaggregatedGenerator over two stand-in engines and two
    stand-in policy ranks; the recorder's events afterwards with ``events()``. Everything is ended after."""
    import ray

    from trainer.generation import placement, worker

    name = f"kuberl-test-recorder-{os.getpid()}-{time.monotonic_ns()}"
    recorder = ray.remote(num_cpus=0)(_Recorder).options(name=name).remote()
    ranks = [ray.remote(num_cpus=0)(_PolicyRank).remote(name, r) for r in range(2)]
    made = []

    def make(build_s: float, receive: str = "ok", *overrides: str, join: dict[int, str] | None = None):
        monkeypatch.setattr(worker, "GenerationWorker", _engine_class(name, build_s, receive, join))
        cfg = load(
            [
                "experiment=tiny",
                f"model.name={tiny_model_path}",
                "generation.placement=disaggregated",
                "generation.resources.num_cpu_workers=2",
                *overrides,
            ]
        )
        gen = placement.DisaggregatedGenerator(cfg, tiny_model_path, _Policy(ranks))
        made.append(gen)
        return gen

    make.events = lambda: ray.get(recorder.read.remote())  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for gen in made:
            gen.shutdown(graceful=False)
        for actor in (*ranks, recorder):
            ray.kill(actor)


def test_should_open_the_weight_group_only_after_every_engine_is_built_when_generation_is_disaggregated(
    placed,
):
    placed(1.5)
    events = placed.events()
    built = [i for i, e in enumerate(events) if e.endswith("built")]
    opened = [i for i, e in enumerate(events) if "transfer group" in e]
    assert len(built) == 2 and len(opened) == 4, events
    assert max(built) < min(opened), f"the transfer group was opened before every engine was built: {events}"


def test_should_stop_in_one_line_naming_the_engine_when_an_engine_is_not_ready_in_time(placed):
    from trainer.generation.placement import GenerationError

    with pytest.raises(GenerationError) as e:
        placed(60, "ok", "generation.engine_start_timeout_s=2")
    assert str(e.value) == (
        "generation engine 0, generation engine 1: not ready within generation.engine_start_timeout_s=2s"
    )
    assert not any("transfer group" in ev for ev in placed.events())


def test_should_stop_in_one_line_naming_the_receiver_when_a_receiver_fails_in_a_refit(placed):
    from trainer.generation.placement import GenerationError

    gen = placed(0, "raise")
    with pytest.raises(GenerationError) as e:
        gen.update_weights()
    assert str(e.value).startswith("generation engine ") and str(e.value).endswith(
        " failed in the weight refit: ValueError: cannot load model.layers.0.mlp.up_proj.weight: shape mismatch"
    ), str(e.value)


def test_should_stop_in_one_line_within_the_bound_when_a_refit_hangs(placed):
    from trainer.generation.placement import GenerationError

    gen = placed(0, "hang", "generation.refit_timeout_s=2")
    t0 = time.monotonic()
    with pytest.raises(GenerationError) as e:
        gen.update_weights()
    assert time.monotonic() - t0 < 30
    assert str(e.value) == (
        "generation engine 0, generation engine 1: the weight refit did not finish within generation.refit_timeout_s=2s"
    )


@pytest.mark.parametrize(
    ("how", "says"),
    [
        (
            "hang",
            "generation engine 1: did not join the weight-transfer group within generation.weight_group_timeout_s=2s",
        ),
        (
            "raise",
            "generation engine 1 failed to join the weight-transfer group: "
            "ncclInternalError: ibv_modify_qp failed with 110 Connection timed out",
        ),
    ],
    ids=["never-joins", "fails-to-join"],
)
def test_should_stop_in_one_line_naming_the_engine_when_an_engine_does_not_join_the_weight_group(
    placed, how, says
):
    """The rendezvous is bounded like every other wait; the engines' actors are ended with it. (Run in a
    thread only so that a rendezvous that never returns fails this test instead of hanging it.)"""
    import threading

    import ray

    from trainer.generation.placement import GenerationError

    raised: list[BaseException] = []

    def start():
        try:
            placed(0, "ok", "generation.weight_group_timeout_s=2", join={1: how})
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            raised.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the driver was still waiting for the weight-transfer group after 60 s"
    assert time.monotonic() - t0 < 30
    assert len(raised) == 1 and isinstance(raised[0], GenerationError), raised
    assert str(raised[0]) == says
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    deadline = time.monotonic() + 30
    while live := [
        a
        for a in state.actors(job_id=job).values()
        if a["ActorClassName"] == "Engine" and a["State"] != "DEAD"
    ]:
        assert time.monotonic() < deadline, f"generation actors left after a failed start: {live}"
        time.sleep(0.5)


def test_should_send_each_prompts_seed_with_it_when_prompts_are_split_over_the_engines(placed):
    import ray

    from trainer.generation.base import SamplingParams

    gen = placed(0.0)
    prompts = [[i, i + 1] for i in range(5)]
    calls = gen.submit(prompts, 1, SamplingParams(seeds=[100 + i for i in range(5)]))
    assert len(calls) == 2  # both engines got prompts
    got = {}
    for ref, idx in calls:
        for i, ((prompt, seed),) in zip(idx, ray.get(ref)):
            got[i] = (prompt, seed)
    assert got == {i: ([i, i + 1], 100 + i) for i in range(5)}
