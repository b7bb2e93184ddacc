"""Shared fixtures: a real local Ray instance and the tiny model, built once per session, and a second Ray
instance that the tests' ``python -m trainer`` runs attach to; and the check that no process the session
started outlives it (:mod:`tests.leftovers`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiers
from tests.ray_process import ray_process
from tests.shared_instance import shared

# A local instance turns on Ray's token auth (token in ~/.ray/auth_token); a client must ask for it, and Ray
# reads this once per process, on import: before trainer.cluster below imports it (ray_local connects this
# process; without xdist, this process is the one that runs the tests).
os.environ.setdefault("RAY_AUTH_MODE", "token")

try:
    from trainer.cluster import QUIET_ENV
except ImportError:  # a GPU node's Python without Ray runs tests/gpu (tests/gpu/conftest.py)
    QUIET_ENV = {}

REPO = Path(__file__).resolve().parents[1]
SESSION = pytest.StashKey[str]()  # this session's id in tests.leftovers.MARK

# Set before any test module is imported (collection imports them all, in every xdist worker): huggingface_hub
# and transformers read these once, on import.
# - No test reaches a model hub (there is none to reach: models are built locally or embedded). Without
#   HF_HUB_OFFLINE, each lookup of a hub name (a preset's reward model, a judge, a model whose config a check
#   reads) waits through huggingface_hub's five retries, 23 s, before the path for an unreachable hub runs;
#   with it, the same path runs at once. The runs the tests start inherit it (trainer.cluster passes it on).
# - The quiet environment a run sets for itself (trainer.cluster.QUIET_ENV), so that an entry point called in
#   process (tests.cli.run_main) prints what it prints as a process: no progress bar from a model built on
#   the way, whichever module imported transformers first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _key, _value in QUIET_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=("all", "fast"),
        default="all",
        help="fast: only the tests not marked integration, each failing if it starts Ray, loads or writes a "
        "model, starts vLLM, runs the loop or starts a program, or takes more CPU time than the tier allows "
        "(tests/tiers.py; make test-fast). all: the whole suite",
    )


def pytest_configure(config):
    from tests.leftovers import mark_session

    config.stash[SESSION] = mark_session()  # before any test starts a process
    # Two xdist workers, each running multi-process runs, share two cores: more threads want them than there
    # are. libgomp (torch's OpenMP) keeps a thread that finished its share of an op spinning for the next
    # one, on a core another process could use; passive threads sleep instead. Set here, before any process
    # loads libgomp: the xdist workers, Ray instances and trainer runs inherit it. Two concurrent 20-step tiny
    # runs on a 2-core AVX512-BF16 EPYC: 26-27 core-s and 14.2-14.7 s with it, 30-31 and 16.0-16.5 s without,
    # the same rewards to the digit.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """No collections while the test modules import torch, transformers and Ray; then those imports
    and the collected items, which live to the end of the session, are frozen (trainer.heap)."""
    from trainer import heap

    heap.pause()
    yield
    heap.settle()


def pytest_collection_modifyitems(config, items):
    """Each test in its tier (tests/tiers.py): ``integration`` on those with a fixture that starts something
    (``tiers.starts``: Ray, a model, a program) and on those marked slow or gpu; under ``--tier=fast`` only
    the others run.

    Then the modules with slow tests first, the longest first (as measured, ``SLOWEST``), each kept whole.
    Under ``make test``'s two xdist workers (``--dist loadfile``: one module per worker at a time;
    ``--no-loadscope-reorder``: in this order) the long modules then start at once and the short ones fill
    in around them, instead of one long module finishing alone at the end while the other worker idles."""
    for item in items:
        markers = {mark.name for mark in item.iter_markers()}
        defs = item._fixtureinfo.name2fixturedefs  # each name's definitions; the last is the one used
        fixtures = {name: defs[name][-1].func for name in item.fixturenames if defs.get(name)}
        if tiers.MARKER not in markers and tiers.integration_reason(fixtures, markers):
            item.add_marker(tiers.MARKER)
    if config.getoption("tier") == "fast":
        integration = [item for item in items if item.get_closest_marker(tiers.MARKER)]
        if integration:
            config.hook.pytest_deselected(items=integration)
            items[:] = [item for item in items if not item.get_closest_marker(tiers.MARKER)]

    first = {name: i for i, name in enumerate(SLOWEST)}

    def rank(item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        if module in first:
            return 0, first[module]
        return (1 if item.get_closest_marker("slow") is None else 0), len(first)

    modules: dict[str, tuple[int, int]] = {}
    for item in items:  # a module's rank is its first test's: a module never splits
        modules.setdefault(item.nodeid.split("::", 1)[0], rank(item))
    items.sort(key=lambda item: modules[item.nodeid.split("::", 1)[0]])


CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("tier") == "fast":
        item.stash[CPU_AT_SETUP] = tiers.cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``--tier=fast``, a test that passed but took more CPU time than the fast tier allows, its
    set-up included, fails in one line (tests/tiers.py)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed and CPU_AT_SETUP in item.stash:
        failure = tiers.over_budget(tiers.cpu_seconds() - item.stash[CPU_AT_SETUP])
        if failure:
            report.outcome, report.longrepr = "failed", failure


# The longest modules of a whole run on a 2-core AVX2 EPYC (`--durations`, summed per module), longest first.
SLOWEST = [
    "tests/test_train_tiny.py",
    "tests/test_checkpoint_resume.py",
    "tests/test_lost_workers.py",
    "tests/policy/test_policy_group.py",
    "tests/test_config.py",
    "tests/test_precision.py",
    "tests/test_plan.py",
    "tests/test_submit.py",
    "tests/generation/test_vllm_compiled.py",
    "tests/test_rayjob_resume.py",
    "tests/generation/test_engine_contract.py",
    "tests/models/test_models.py",
    "tests/generation/test_weight_transport.py",
    "tests/generation/test_vllm_colocated.py",
    "tests/loop/test_multi_turn.py",
    "tests/rewards/test_runner.py",
    "tests/test_convert.py",
    "tests/sandbox/test_hostile.py",
]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the suite, naming them, if processes the session started are still running. Under xdist the
    controller checks, once its workers have ended: a worker's own check would wait out its grace for what
    only ends with the worker, and its failure would not reach the report."""
    from tests.leftovers import kill, leftovers

    if hasattr(session.config, "workerinput"):  # an xdist worker
        return
    left = leftovers(session.config.stash[SESSION])
    if not left:
        return
    kill(left)
    lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
    session.config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"\nFAILED leftovers: {len(left)} process(es) started by this test session outlived it "
        f"(killed now); the test that started each must end it:\n{lines}",
        red=True,
        bold=True,
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# What an idle Ray instance does in the background, and a session holds one for most of its run (session_ray)
# besides those some tests start: 5.6 core-s a minute on a 2-core AVX2 EPYC, 2.9 with the first two below.
# No workers prestarted for an instance's first driver (session_ray's holder, whose job never runs a task:
# each trainer run is a job of its own, with workers of its own), and the dashboard agent's system report
# once a minute instead of every 5 s. And the log monitor, which forwards workers' output to their drivers,
# globs the log folder for new files 10 times a second, a folder that grows with every run: after 3 tiny
# runs (69 files) it took 1.2 core-s a minute, 0.5 when it looks for new files every 2 s. It still reads
# every known file 10 times a second, from where it stopped, so no line is lost; a new worker's first lines
# reach its driver up to 2 s later.
# And one lease request in flight per kind of task: a run's reward tasks then start workers one at a time, as
# they are needed. With Ray's ten, and its workers started for a backlog of tasks, a 20-step tiny run started
# four reward workers and used two (each started worker about a second of CPU).
RAY_IDLE_ENV = {
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
    "RAY_max_pending_lease_requests_per_scheduling_category": "1",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
}


@pytest.fixture(scope="session", autouse=True)
def _tier_guards(request):
    """Under ``--tier=fast``, a test that starts Ray, loads or writes a model, starts vLLM, runs the loop or
    starts a program fails there in one line (tests/tiers.py). Session-wide and first, so a fixture of any
    scope is held to it."""
    if request.config.getoption("tier") != "fast":
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        tiers.install(monkeypatch)
        yield


@pytest.fixture(scope="session", autouse=True)
def _quiet_env(tmp_path_factory):
    from trainer.cluster import QUIET_ENV

    for key, value in {**QUIET_ENV, **RAY_IDLE_ENV}.items():
        os.environ.setdefault(key, value)
    # One model cache for the whole session, its xdist workers and the subprocesses its tests start: each model
    # is built once, and vLLM's model info inspected once (trainer.models.resolve builds under a lock and
    # renames into place; vLLM writes its model-info files atomically).
    cache = _session_dir(tmp_path_factory) / "kuberl-cache"
    cache.mkdir(exist_ok=True)
    os.environ.setdefault("KUBERL_CACHE", str(cache))


def _session_dir(tmp_path_factory) -> Path:
    """The session's temporary folder: under xdist, the one its workers share (each has its own inside)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
@tiers.starts("writes the tiny model")
def tiny_model_path(_quiet_env) -> str:
    from trainer.models import resolve_model

    return resolve_model("builtin:tiny")


# The session's Ray instance, shared by its xdist workers (tests.shared_instance), sized for each worker's
# in-process tests (``ray_local``: a module may hold several policy groups of 1-2 bundles and reward actors
# at once; tests/policy/test_policy_group.py holds up to 14 bundles) and its
# ``python -m trainer`` runs (``trainer_env``: 2 policy ranks, a generation actor and 2 spare CPUs for reward
# and sandbox tasks, as many as a run's own local instance would count). CPUs are bookkeeping here: a run's
# rewards send one task first and size the rest to what that one measured (trainer.rewards.runner), so the
# tasks, not the spare CPUs, set how many workers they take.
RAY_LOCAL_CPUS, TRAINER_RAY_CPUS = 16, 6


@contextlib.contextmanager
def _ray_instance(env: dict[str, str], num_cpus: int) -> Iterator[str]:
    """A Ray instance in a process of its own (its owner's tests connect and disconnect as they please): its
    address; ended, with all it started, on exit."""
    start = (
        "import ray\n"
        f"ray.init(address='local', num_cpus={num_cpus}, num_gpus=0, include_dashboard=False, log_to_driver=False)\n"
        "address = ray.get_runtime_context().gcs_address"
    )
    with ray_process(start, "ray.shutdown()", env, "the session's Ray instance") as address:
        yield address


@pytest.fixture(scope="session")
@tiers.starts("starts Ray")
def session_ray(_quiet_env, tmp_path_factory) -> Iterator[str]:
    """The address of the session's Ray instance. Under xdist the workers share it (tests.shared_instance):
    the first to need it starts it, sized for all of them, and ends it when the last has finished. An idle
    instance costs its start-up and a few core-seconds a minute; one for the session instead of one per
    worker and per use. A test that watches the processes of its run, or stops the run's cluster, starts
    its own."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    start = lambda: _ray_instance(env, (RAY_LOCAL_CPUS + TRAINER_RAY_CPUS) * workers)  # noqa: E731
    with shared(_session_dir(tmp_path_factory) / "ray", start) as address:
        yield address


@pytest.fixture(scope="session")
def ray_local(session_ray):
    """This process connected to the session's Ray instance, as a driver of its own job."""
    import ray

    if not ray.is_initialized():
        ray.init(address=session_ray, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def trainer_env(session_ray):
    """The environment for ``python -m trainer`` runs that attach to the session's Ray instance
    (``RAY_ADDRESS``, the code path of a run on a cluster) instead of starting and stopping their own: a
    local instance costs a run 5-8 s here, most of a tiny run."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    yield {**env, "RAY_ADDRESS": session_ray}
