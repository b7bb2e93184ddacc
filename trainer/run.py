"""Setting up a training run and tearing it down: Ray, model, data, workers, logger; saving it.

The GRPO loop itself lives in :mod:`trainer.loop.grpo`; this module builds what it needs
(:class:`TrainState`), prints where things go, saves checkpoints, and always releases the workers,
also on errors and interrupts.

A run that loses a worker or its cluster ends within a bounded time with one line naming what it
lost and which checkpoint a resubmission resumes from (:mod:`trainer.watchdog`): Ray's errors are
diagnosed in :func:`train`, a cluster gone while the driver is blocked inside Ray is caught by the
watch thread, and every wait of the teardown after a failure or SIGTERM has a deadline.

The checks before anything starts are :mod:`trainer.prestart`'s; preemption (SIGTERM) and the save
budget it decides by are :mod:`trainer.preemption`'s: the run installs the handler and offers a safe
point after each step (:meth:`TrainState.preemption_point`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import Checkpointer, config_changes, read_info, refuse_changes, rng_info
from trainer.config import Config, to_dict
from trainer.lease import Lease
from trainer.preemption import Preempted, Preemption
from trainer.prestart import (
    SetupError,
    check_backend,
    check_compiler,
    check_cpu_pinning,
    check_names,
    check_trackers,
    check_writable,
    load_dataset,
    precision_warning,
)
from trainer.watchdog import Lost, Watch, gcs_address

if TYPE_CHECKING:  # the heavy modules load inside TrainState, after the checks that need none of them
    from trainer.components import Component
    from trainer.data.loader import PromptLoader
    from trainer.data.prompts import TurnEncoder
    from trainer.envs.base import Environment, RolloutEnvironment
    from trainer.generation.placement import Generator
    from trainer.logger import RunLogger
    from trainer.policy.group import PolicyGroup
    from trainer.rewards.runner import RewardRunner

log = logging.getLogger(__name__)


def by_host(what: str, hosts: list[str]) -> str:
    """``hosts[i]`` is where number i runs -> "ranks 0-7 on 10.0.0.5, ranks 8-15 on 10.0.0.6"."""
    runs: list[tuple[str, int, int]] = []
    for i, host in enumerate(hosts):
        if runs and runs[-1][0] == host and runs[-1][2] == i - 1:
            runs[-1] = (host, runs[-1][1], i)
        else:
            runs.append((host, i, i))
    return ", ".join(f"{what}s {a}-{b} on {h}" if a != b else f"{what} {a} on {h}" for h, a, b in runs)


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
    reward_state: dict[str, Any] | None = None  # the reward runner's after ``step`` (running normalisation)


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
    components: list[Component]  # the run's optional parts (trainer.components), started with the ranks
    environment: Environment | None
    rollout_env: RolloutEnvironment | None  # a component that runs its own rollouts through the endpoint
    turns: TurnEncoder
    logger: RunLogger
    lease: Lease | None  # the run's hold on its checkpoint directory; None without checkpointing
    config_changes: list[str] = []  # checkpointing.allow_changed_config: what this resume changed

    def __init__(self, cfg: Config):
        from trainer.models import hub_id_or_directory

        self.cfg = cfg
        t0 = time.monotonic()
        check_names(cfg)  # first: a bad name is a ConfigError (exit 2), before anything loads or starts
        check_backend(cfg)
        check_cpu_pinning(cfg)
        check_compiler(cfg)
        # Before anything loads or any actor starts: paths that cannot work fail now, in one line.
        check_writable("logger.log_dir", cfg.logger.log_dir)
        check_trackers(cfg)
        if cfg.checkpointing.enabled:
            check_writable("checkpointing.checkpoint_dir", cfg.checkpointing.checkpoint_dir)
        if cfg.model.tokenizer:
            hub_id_or_directory(cfg.model.tokenizer, "model.tokenizer", need_config=False)
        # The run's checkpoint directory is its own while it lives (trainer/lease.py): a second run on it
        # refuses here, before it reads, cleans or prunes anything there.
        self.lease = None
        if cfg.checkpointing.enabled:
            ck = cfg.checkpointing
            self.lease = Lease(
                Path(ck.checkpoint_dir) / cfg.experiment_name,
                cfg.experiment_name,
                ck.lease_stale_after_s,
                ck.take_over,
            )
            took = (
                self.lease.acquire()
            )  # a LeaseError (a CheckpointError: one line) when another run holds it
            if took:
                print(took, flush=True)
        try:
            self._start(cfg, t0)
        except BaseException:
            if self.lease is not None:
                self.lease.release()
            raise

    def _start(self, cfg: Config, t0: float) -> None:
        import ray

        from trainer.cluster import init_ray
        from trainer.models import resolve_model
        from trainer.policy.group import PolicyGroup

        # Which checkpoint to continue, first: a finished run need not start Ray or load anything.
        self.checkpointer = Checkpointer(
            cfg.checkpointing, cfg.experiment_name, self.lease.check if self.lease is not None else None
        )
        resume, skipped = self.checkpointer.resume_path()  # first: resume=PATH of a cut-off save is an error
        if resume:
            self._check_resume_config(cfg, resume)
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
        from trainer import components

        self.components = []  # self.generator: set once made (close() reads it with getattr)
        try:
            # The run's optional parts (trainer.components) start beside the ranks and load while the data
            # is read; each is shut down by close(), also when a later one fails to start.
            for part in components.build(cfg):
                self.components.append(part)
                part.start()
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

    def _check_resume_config(self, cfg: Config, resume: Path) -> None:
        """Refuse to resume ``resume`` under another config or image than it was saved with, naming the
        changes (checkpoint.config_changes); with checkpointing.allow_changed_config, say each one."""
        changes = config_changes(resume, to_dict(cfg))
        if not changes:
            return
        if not cfg.checkpointing.allow_changed_config:
            raise SetupError(str(refuse_changes(resume, changes)))
        self.config_changes = changes
        for change in changes:
            print(f"kuberl: warning: resuming {resume} with a changed {change} (checkpointing.allow_changed_config=true)",
                  flush=True)  # fmt: skip

    def _check_bos(self, cfg: Config, tokenizer, prompt_ids: list[int]) -> None:
        """The prompts' first token against what the model needs (trainer.data.prompts.check_bos): its
        ``self-check:`` line, or one line naming the failure."""
        from trainer.data.prompts import BosError, check_bos

        config = Path(self.model_path) / "config.json"
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
        try:
            print(f"kuberl: {check_bos(tokenizer, prompt_ids, model_type)}", flush=True)
        except BosError as e:
            raise SetupError(f"model={cfg.model.name}: {e}") from None

    def _check_template(self, cfg: Config, messages: list[dict[str, Any]]) -> None:
        """A multi-turn run's glue, checked on its own template before anything starts (TurnEncoder.self_check):
        its ``self-check:`` line, or one line naming the failure and the key that overrides it."""
        from trainer.data.prompts import TemplateGlueError

        try:
            print(f"kuberl: {self.turns.self_check(messages)}", flush=True)
        except TemplateGlueError as e:
            if not cfg.env.unchecked_chat_template:
                raise SetupError(
                    f"model={cfg.model.name}: multi-turn episodes cannot be glued exactly: {e}; give a tokenizer "
                    "whose chat template glues exactly (model.tokenizer), or set env.unchecked_chat_template=true "
                    "to train on it at your own risk"
                ) from None
            print(f"kuberl: self-check: chat template glue FAILED ({e}); env.unchecked_chat_template=true: "
                  "training on it anyway", flush=True)  # fmt: skip

    def _build(self, cfg: Config, resume: Path | None, info: dict[str, Any], t0: float) -> None:
        """The rest of the set-up, while the policy ranks start: data, then the ranks, generation,
        rewards, a checkpoint to resume, the logger."""
        from trainer import components, envs
        from trainer.data.loader import PromptLoader
        from trainer.data.prompts import TurnEncoder, encode_examples
        from trainer.envs.tool_calls import offer_tools, takes_tools
        from trainer.generation import tool_parsers
        from trainer.generation.placement import make_generator
        from trainer.logger import RunLogger
        from trainer.models import load_tokenizer
        from trainer.rewards.runner import RewardRunner

        try:
            tokenizer = load_tokenizer(cfg.model.tokenizer or self.model_path, cfg.model.trust_remote_code)
        except (OSError, ValueError) as e:  # no such directory, hub unreachable, not a tokenizer
            key = "model.tokenizer" if cfg.model.tokenizer else "model.name"
            raise SetupError(
                f"{key}={cfg.model.tokenizer or cfg.model.name}: cannot load its tokenizer: "
                f"{str(e).strip().splitlines()[0]}"
            ) from None
        max_prompt = cfg.policy.max_total_sequence_length - cfg.generation.max_new_tokens
        kwargs = cfg.generation.chat_template_kwargs
        # A named environment is built first: the tools it offers are part of every prompt.
        self.environment = (
            envs.build(
                cfg.env.environment,
                cfg.env.environment_kwargs,
                cfg.env.tool_parser,
                lambda tools: tool_parsers.build(cfg.env.tool_parser, tokenizer, tools),
            )
            if cfg.env.environment
            else None
        )
        # A component may bring the run's prompts and tools (and run its own rollouts through the endpoint).
        source = components.source(self.components)
        self.rollout_env = getattr(source, "rollouts", None)
        offering = self.environment or source
        schemas = offering.tools() if offering is not None else None
        tools = schemas if schemas and takes_tools(tokenizer) else None  # through the template's own tools=
        in_prompt = schemas if schemas and tools is None else None  # else written into the system prompt
        if in_prompt:
            print(
                f"kuberl: {cfg.model.name}'s chat template has no tools support: the tools are offered in the "
                "system prompt",
                flush=True,
            )

        def offered(ex: dict) -> dict:
            return {**ex, "messages": offer_tools(ex["messages"], in_prompt)} if in_prompt else ex

        train = [
            offered(ex)
            for ex in (source.examples() if source is not None else load_dataset(cfg.data, cfg.data.split))
        ]
        self.train_examples = encode_examples(tokenizer, train, kwargs, max_prompt, tools)
        if not self.train_examples:
            raise SetupError(
                f"data={cfg.data.name}: none of its {len(train)} training prompts fits in {max_prompt} tokens "
                f"(policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} - "
                f"generation.max_new_tokens={cfg.generation.max_new_tokens}); raise "
                f"policy.max_total_sequence_length or shorten data.system_prompt / data.prompt_template"
                if train
                else f"data={cfg.data.name}: the {cfg.data.split!r} split has no examples"
            )
        self._check_bos(cfg, tokenizer, self.train_examples[0]["prompt_ids"])
        self.turns = TurnEncoder(tokenizer, kwargs, tools)
        if self.rollout_env is None and (self.environment is not None or cfg.grpo.max_rollout_turns > 1):
            self._check_template(cfg, train[0]["messages"])
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
            val = [offered(ex) for ex in load_dataset(val_cfg, cfg.data.val_split)]
            self.val_examples = encode_examples(tokenizer, val, kwargs, max_prompt, tools)
        self.loader = PromptLoader(
            self.train_examples, cfg.grpo.num_prompts_per_step, cfg.seed, cfg.data.shuffle
        )
        self.progress = Progress(step=0, loader_state=self.loader.state_dict())

        from trainer.policy.forward import HeadCheckError

        try:
            self.policy.wait_ready()
        except HeadCheckError as e:  # Ray's error is also the rank's own: its line, not a traceback
            raise SetupError(f"model={cfg.model.name}: {getattr(e, 'cause', e)}") from None
        self.generator = make_generator(cfg, self.model_path, self.policy)
        attaching = components.offering(self.components, "attach")
        if attaching:
            served = self._served()
            for part in attaching:
                part.attach(served)
        for part in self.components:
            part.wait_ready()
            line = part.describe()
            if line:
                print(f"kuberl: {line}", flush=True)
        self.rewards = RewardRunner(
            cfg.env, scorers=[p.scorer for p in components.offering(self.components, "scorer")]
        )
        if self.environment is None:  # a multi-turn run without env.environment: env.feedback's loop
            self.environment = envs.default(cfg.env, cfg.grpo.max_rollout_turns)
        if resume:
            self.policy.run("load_checkpoint", str(resume))
            self.generator.update_weights()
            warning = self.loader.load_state_dict(json.loads((resume / "dataloader.json").read_text()))
            if warning:
                print(warning, flush=True)
            self.progress = Progress(
                step=int(info["step"]),
                loader_state=self.loader.state_dict(),
                metrics=info.get("metrics", {}),
                saved=resume,
                saved_step=int(info["step"]),
                save_s=info.get("save_s"),
                reward_state=info.get("rewards"),
            )
            warning = self.rewards.load_state_dict(info.get("rewards") or {})
            if warning:
                print(warning, flush=True)
        # A resumed run appends to its own TensorBoard run and continues its W&B and MLflow runs; a fresh
        # one never touches old ones.
        from trainer.tracking import TrackerError

        try:
            self.logger = RunLogger(
                cfg,
                run_name=info.get("run_name"),
                resume_step=self.progress.step,
                run_ids=info.get("tracker_runs"),
            )
        except TrackerError as e:
            raise SetupError(str(e)) from None
        saved_at = None
        if resume:
            saved_at = (
                (resume / "COMMITTED").stat().st_mtime if (resume / "COMMITTED").is_file() else time.time()
            )
        elif cfg.checkpointing.enabled:
            saved_at = time.time()  # none yet: the checkpoint-age alert counts from the start
        self.logger.gauges.started(self.progress.step, saved_at)
        if self.config_changes:  # allow_changed_config: in the trackers too, at the step it resumed from
            self.logger.scalars(
                self.progress.step, {"resume/changed_config_keys": float(len(self.config_changes))}
            )
            with open(self.logger.run_dir / "config_changes.txt", "a") as f:
                f.write(f"resumed from {resume} at step {self.progress.step}:\n")
                f.writelines(f"  {change}\n" for change in self.config_changes)
        if resume:
            print(
                f"kuberl: resumed from {resume} (step {self.progress.step}, checkpointing.resume={cfg.checkpointing.resume})"
            )
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

    def _served(self) -> Any:
        """The run's OpenAI-compatible endpoints (:class:`trainer.components.Served`), for the components that
        drive rollouts through them: the engines' addresses and the token they check."""
        from trainer.components import Served
        from trainer.generation.endpoint import EndpointError, read_token

        ep = self.cfg.generation.endpoint
        try:
            token = read_token(ep.token_env)
        except EndpointError as e:
            raise SetupError(str(e)) from None
        return Served(
            urls=[endpoint_url(host, port) for host, port in getattr(self.generator, "endpoints", [])],
            token=token,
            model=self.cfg.model.name,
            max_concurrent=ep.max_waiting + 1,  # one in the engine, the rest waiting: none turned away
        )

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

    def after_step(
        self,
        step: int,
        metrics: dict[str, float],
        loader_state: dict[str, Any],
        reward_state: dict[str, Any] | None = None,
    ) -> None:
        """Record the finished step (``loader_state``: the prompt loader's position after its batch, not
        after batches generated ahead; ``reward_state`` likewise the reward runner's); checkpoint every
        ``save_period`` steps and at the end; stop here if preemption was signalled."""
        self.progress.step, self.progress.metrics = step, metrics
        self.progress.loader_state = loader_state
        if reward_state is not None:
            self.progress.reward_state = reward_state
        ck = self.cfg.checkpointing
        if ck.enabled and (step % ck.save_period == 0 or step == self.cfg.grpo.max_num_steps):
            self.save()
        self.preemption_point()

    def preemption_point(self) -> None:
        """A safe point: the weights are those of ``progress.step``. After SIGTERM, save that step if it
        is not saved yet and the save fits in what is left of the grace budget, then stop."""
        self.preemption.at_safe_point(self.progress, self.cfg.checkpointing, self.save, self._resumes_from)

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
        from ray.exceptions import RayError

        try:
            self.policy.run("save_checkpoint", str(path))
        except RayError as e:
            raise lost(e, f"while saving {path}", self._resumes_from()) or save_failed(
                e, path, self._resumes_from()
            ) from None
        info = {
            "step": p.step,
            "consumed_samples": p.step * self.cfg.grpo.batch_size,
            "run_name": self.logger.run_name,
            "tracker_runs": self.logger.run_ids(),  # W&B and MLflow run ids: a resumed run continues them
            "metrics": p.metrics,
            "rng": rng_info(self.cfg.seed, p.step),
            "save_s": round(time.monotonic() - t0, 3),  # the next run's estimate for a save at preemption
        }
        if p.reward_state is not None:  # the reward runner's run state (running normalisation windows)
            info["rewards"] = p.reward_state
        try:
            self.checkpointer.commit(path, p.step, info, p.loader_state, to_dict(self.cfg))
        except OSError as e:
            raise save_failed(e, path, self._resumes_from()) from None
        p.saved, p.saved_step, p.save_s = path, p.step, time.monotonic() - t0
        self.logger.gauges.checkpointed(time.time())
        print(f"kuberl: saved checkpoint {path} ({p.save_s:.1f}s)", flush=True)

    def close(self, failed: bool = False) -> None:
        """Release the workers. After a failure (``failed``) nothing waits on them: they are killed, and
        the whole teardown has a deadline, so a driver whose workers are stuck or gone still ends."""
        self.preemption.uninstall()
        with self.watch.deadline(30 if failed else 300, "the run's workers did not shut down in time"):
            close_environment = getattr(getattr(self, "environment", None), "close", None)
            if close_environment is not None:  # an environment's own processes (the tools' fork server)
                close_environment()
            for part in (getattr(self, "generator", None), self.policy, *self.components):
                if part is None:  # a set-up that failed before the generator was made
                    continue
                try:
                    part.shutdown(graceful=not failed)
                except Exception as e:  # teardown must not hide the run's own error
                    log.warning("shutdown: %s", e)
            if getattr(self, "logger", None) is not None:
                self.logger.close(failed)
        lease = getattr(self, "lease", None)
        if lease is not None:  # last: the directory is free once nothing writes to it
            lease.release()
        if (
            not failed
        ):  # after a failure it keeps watching: the way out (ray.shutdown) may hang on a lost cluster
            self.watch.stop()


def endpoint_url(host: str, port: int) -> str:
    """The OpenAI base URL of a generation endpoint at (host, port)."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def summarize(history: list[dict[str, float]]) -> str:
    rewards = [h["train/reward_mean"] for h in history]
    k = min(3, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"kuberl: done, {len(rewards)} steps | reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
        f"({last - first:+.3f})"
    )


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (a full or failing volume): the run ends in one line, and the
    last complete checkpoint stays the one a resubmission resumes from (a step_N without its commit marker is
    never read)."""


# Free space under which a failed save is put down to a full volume, whatever the error says (torch's zip
# writer reports a short write as "unexpected pos 704 vs 598", not as ENOSPC).
LOW_SPACE_BYTES = 1 << 30


def save_failed(
    error: BaseException, path: Path, resumes_from: str, free_bytes: int | None = None
) -> CheckpointSaveError:
    """The one line a run whose checkpoint ``path`` could not be written ends with: the cause's own last line
    (a rank's error out of Ray's wrapper), the free space on the volume (``free_bytes``, else measured), what
    to do, and where a resubmission resumes from."""
    import errno
    import shutil

    cause = getattr(error, "cause", None) or error  # a RayTaskError carries the rank's own error
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    reason = f"{type(cause).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
    if free_bytes is None:
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            free_bytes = shutil.disk_usage(where).free
        except OSError:
            free_bytes = None
    full = (
        getattr(cause, "errno", None) == errno.ENOSPC
        or "no space left" in str(error).lower()
        or (free_bytes is not None and free_bytes < LOW_SPACE_BYTES)
    )
    space = f"; {free_bytes / 2**20:.1f} MiB free on its volume" if free_bytes is not None else ""
    fix = (
        "the volume is full: free space there or set checkpointing.checkpoint_dir to a larger one"
        if full
        else "check that volume (permissions, mount) or set checkpointing.checkpoint_dir elsewhere"
    )
    return CheckpointSaveError(f"saving checkpoint {path} failed ({reason}){space}: {fix}; {resumes_from}")


# Ray's memory monitor: "... Memory on the node (IP: ..., ID: ...) was 23.05GB used / 23.54GB limit (0.979) ..."
_NODE_MEMORY = re.compile(r"was ([\d.]+)\s*GB used / ([\d.]+)\s*GB limit")
_MEMORY_FIX = (
    "lower what the run holds (make plan EXP counts it; policy.activation_checkpointing=true, a smaller "
    "policy.micro_batch_size or grpo.num_prompts_per_step) or run it where the node has more memory"
)


def lost(error: BaseException, doing: str, resumes_from: str) -> Lost | None:
    """A :class:`Lost` naming what the run lost behind a Ray error, or None if nothing was (a worker raised).
    Workers Ray's memory monitor killed are named as that, with the node's use and the keys that lower it."""
    from ray.exceptions import OutOfMemoryError

    from trainer.watchdog import diagnose

    if isinstance(error, OutOfMemoryError):
        used = _NODE_MEMORY.search(str(error))
        usage = f" ({used[1]} of {used[2]} GB in use)" if used else ""
        return Lost(
            f"lost workers {doing}: the node ran out of memory{usage} and Ray's memory monitor killed them; "
            f"{_MEMORY_FIX}; {resumes_from}"
        )
    what = diagnose(error)
    return Lost(f"lost {what} {doing}; {resumes_from}") if what else None


def failed_step(error: Exception, step: int, resumes_from: str) -> Exception:
    """What a step that raised ``error`` (a Ray error, or a :class:`GenerationError`) ends the run with.

    A :class:`Lost` where the run lost a worker behind it. The loss is not always the error that came
    first: when a generation actor dies mid-refit, the policy rank sending to it can fail on its broken
    collective ("Connection reset by peer") before Ray reports the receiver dead, and that error is not the
    run's failure but the loss's echo: it is read against every actor's liveness, over long enough for a
    death under way to land (:data:`trainer.watchdog.SETTLE_S`), before it is reported as its own. Else
    an engine's or a refit's own failure, saying where a resubmission resumes from; else the Ray error
    itself."""
    from trainer.generation.placement import GenerationError

    loss = lost(error, f"in step {step}", resumes_from)
    if loss is not None:
        return loss
    if isinstance(error, GenerationError):
        return GenerationError(f"{error} (step {step}); {resumes_from}")
    return error


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
    except (RayError, GenerationError) as e:
        raise failed_step(e, state.progress.step + 1, state._resumes_from()) from None
    finally:
        state.close(failed)
    if history:
        print(summarize(history), flush=True)
    return history
