"""Config composition for every experiment, each default written once, and one-line errors for bad values."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.cli import refuse_ray, run_main
from trainer.__main__ import main as trainer_main
from trainer.config import ConfigError, experiments, load

from .conftest import REPO


@pytest.mark.parametrize("name", experiments())
def test_should_compose_and_validate_when_experiment_is_shipped(name):
    from trainer.prestart import check_names

    cfg = load([f"experiment={name}"])
    check_names(cfg)  # every loss, dataset and reward it names is registered
    assert cfg.experiment_name == name
    assert cfg.train_world_size >= 1
    assert cfg.grpo.batch_size % (cfg.train_world_size * cfg.grpo.num_minibatches) == 0


def test_should_match_runbook_shapes_when_gpu_experiments_compose():
    g27 = load(["experiment=gemma3-27b-gsm8k"])
    assert (g27.cluster.num_nodes, g27.cluster.gpus_per_node) == (3, 8)
    assert g27.disaggregated and g27.generation.tensor_parallel_size == 8
    assert g27.train_world_size == 16 and g27.num_generation_workers == 1
    assert (g27.grpo.num_prompts_per_step, g27.grpo.num_generations_per_prompt) == (16, 64)
    g1 = load(["experiment=gemma3-1b-math"])
    assert g1.generation.vllm_kwargs == {"block_size": 32} and not g1.disaggregated
    assert g1.train_world_size == 8 and g1.model.name == "google/gemma-3-1b-it"
    q = load(["experiment=qwen2.5-coder-7b-code"])
    assert (q.grpo.num_prompts_per_step, q.grpo.num_generations_per_prompt, q.grpo.max_num_steps) == (
        32,
        16,
        1000,
    )
    qt = load(["experiment=qwen2.5-coder-1.5b-code-test"])
    assert qt.train_world_size == 2 and qt.grpo.max_num_steps == 100


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt"),
        (
            ["experiment=gemma3-27b-gsm8k", "generation.tensor_parallel_size=3"],
            "generation.tensor_parallel_size",
        ),
        (
            ["experiment=gemma3-27b-gsm8k", "generation.resources.num_nodes=3"],
            "generation.resources.num_nodes",
        ),
        (["generation.placement=sideways"], "generation.placement"),
        (["grpo.loss.ratio_clip_c=0.5"], "grpo.loss.ratio_clip_c"),
        (["grpo.max_num_steps=abc"], "grpo.max_num_steps"),
        (["grpo.bogus=1"], "grpo.bogus"),
        (["experiment=nope"], "experiment"),
        (["grpo.loss.mis_low=2.0", "grpo.loss.mis_high=1.5"], "grpo.loss.mis_low"),
        (["grpo.loss.tis_cap=0.5"], "grpo.loss.tis_cap"),
        (["generation.backend=vllm", "generation.tensor_parallel_size=2"], "generation.tensor_parallel_size"),
        (["generation.refit_bucket_mb=0"], "generation.refit_bucket_mb"),
        (["grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=3"], "grpo.num_prompts_per_step"),
        (["generation.placement=disaggregated", "grpo.async.max_staleness=-1"], "grpo.async.max_staleness"),
        (["grpo.async.max_staleness=1"], "grpo.async.max_staleness"),  # colocated: nothing to overlap
        (
            ["grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_rounds=0"],
            "grpo.dynamic_sampling.max_rounds",
        ),
        (["grpo.loss.kl_clamp=0"], "grpo.loss.kl_clamp"),
        (["grpo.loss.kl_clamp=-1.5"], "grpo.loss.kl_clamp"),
        (["grpo.loss.ratio_level=seq"], "grpo.loss.ratio_level"),
        (["grpo.advantage.std=batch"], "grpo.advantage.std"),
        (["grpo.advantage.std=leave_one_out", "grpo.normalize_rewards=false"], "grpo.advantage.std"),
        (["grpo.advantage.std=leave_one_out", "grpo.num_generations_per_prompt=2"], "grpo.advantage.std"),
        (["grpo.advantage.bogus=1"], "grpo.advantage.bogus"),
        (["grpo.reward_shaping.overlong_buffer=-1"], "grpo.reward_shaping.overlong_buffer"),
        (
            ["generation.max_new_tokens=64", "grpo.reward_shaping.overlong_buffer=64"],
            "grpo.reward_shaping.overlong_buffer",
        ),
        (["grpo.reward_shaping.overlong_penalty=-0.5"], "grpo.reward_shaping.overlong_penalty"),
        (["policy.max_tokens_per_microbatch=0"], "policy.max_tokens_per_microbatch"),
        (["policy.logprob_max_tokens_per_microbatch=-1"], "policy.logprob_max_tokens_per_microbatch"),
        (["policy.sequence_parallel_size=3"], "policy.sequence_parallel_size"),
        (["policy.sequence_parallel_size=4"], "policy.sequence_parallel_size"),  # 2 policy ranks
        (["policy.sequence_parallel_size=2", "policy.sequence_packing=false"], "policy.sequence_packing"),
    ],
)
def test_should_name_the_key_when_a_value_is_bad(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize("key", ["max_tokens_per_microbatch", "logprob_max_tokens_per_microbatch"])
def test_should_name_both_keys_in_one_line_when_a_sequence_could_exceed_the_token_budget(key):
    with pytest.raises(ConfigError) as err:
        load(["policy.max_total_sequence_length=1024", f"policy.{key}=1000"])
    assert str(err.value) == (
        f"policy.max_total_sequence_length=1024 exceeds policy.{key}=1000: one sequence must fit a "
        f"micro-batch; raise policy.{key} (or policy.sequence_parallel_size) or lower policy.max_total_sequence_length"
    )
    assert load(["policy.max_total_sequence_length=1024", f"policy.{key}=1024"]).policy.sequence_packing


def test_should_count_the_token_budget_per_rank_when_rows_are_split_over_sequence_parallel_ranks():
    cfg = load(
        [
            "policy.sequence_parallel_size=2",
            "policy.max_total_sequence_length=1024",
            "policy.max_tokens_per_microbatch=512",
        ]
    )  # a 1024-token row spans both ranks
    assert cfg.policy.sequence_parallel_size == 2
    with pytest.raises(ConfigError) as err:
        load(
            [
                "policy.sequence_parallel_size=2",
                "policy.max_total_sequence_length=1025",
                "policy.max_tokens_per_microbatch=512",
            ]
        )
    assert "exceeds policy.max_tokens_per_microbatch=512 x policy.sequence_parallel_size=2" in str(err.value)


def test_should_refuse_in_one_line_a_model_or_attention_that_sequence_parallelism_cannot_split():
    from types import SimpleNamespace

    from trainer.policy.ulysses import check_model

    assert check_model(SimpleNamespace(num_attention_heads=8), 4, None) is None
    assert (
        check_model(SimpleNamespace(text_config=SimpleNamespace(num_attention_heads=32)), 8, "sdpa") is None
    )
    heads = check_model(SimpleNamespace(num_attention_heads=6), 4, None)
    assert "policy.sequence_parallel_size=4 must divide the model's 6 attention heads" in heads
    eager = check_model(SimpleNamespace(num_attention_heads=8), 2, "eager")
    assert "model.attn_implementation=eager" in eager and "\n" not in eager


@pytest.mark.parametrize(
    "overrides",
    [
        ["cluster.gpus_per_node=8", "generation.backend=vllm", "generation.tensor_parallel_size=2"],  # 8 GPUs
        [
            "generation.backend=vllm",
            "generation.tensor_parallel_size=2",
        ],  # CPU: the same line, before the CPU rule
        ["experiment=gemma3-1b-math", "generation.tensor_parallel_size=2"],
    ],
)
def test_should_refuse_tensor_parallel_in_one_line_when_the_engine_is_colocated(overrides):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert str(err.value) == (
        "generation.tensor_parallel_size=2 needs generation.placement=disaggregated: a colocated engine "
        "shares its policy rank's one GPU"
    )


def test_should_default_to_truncated_importance_sampling_when_batches_may_be_stale():
    assert load(["experiment=tiny"]).grpo.loss.importance_sampling == "none"
    cfg = load(["experiment=tiny", "generation.placement=disaggregated", "grpo.async.max_staleness=1"])
    assert cfg.grpo.loss.importance_sampling == "tis"
    explicit = [
        "generation.placement=disaggregated",
        "grpo.async.max_staleness=2",
        "grpo.loss.importance_sampling=none",
    ]
    assert load(["experiment=tiny", *explicit]).grpo.loss.importance_sampling == "none"


def test_should_write_the_async_section_under_its_key_when_the_config_is_saved():
    from trainer.config import to_dict

    cfg = load(["experiment=tiny", "generation.placement=disaggregated", "grpo.async.max_staleness=1"])
    assert to_dict(cfg)["grpo"]["async"] == {"max_staleness": 1}


def test_should_default_the_algorithm_options_to_plain_grpo_and_accept_their_other_values():
    cfg = load()
    loss, g = cfg.grpo.loss, cfg.grpo
    assert (loss.kl_clamp, loss.ratio_level, g.advantage.std) == (10.0, "token", "group")
    assert (g.reward_shaping.overlong_buffer, g.reward_shaping.overlong_penalty) == (0, 1.0)
    cfg = load(
        [
            "grpo.loss.kl_clamp=null",
            "grpo.loss.ratio_level=sequence",
            "grpo.advantage.std=leave_one_out",
            "generation.max_new_tokens=64",
            "grpo.reward_shaping.overlong_buffer=16",
            "grpo.reward_shaping.overlong_penalty=0",
        ]
    )
    assert (cfg.grpo.loss.kl_clamp, cfg.grpo.loss.ratio_level, cfg.grpo.advantage.std) == (
        None,
        "sequence",
        "leave_one_out",
    )
    assert (cfg.grpo.reward_shaping.overlong_buffer, cfg.grpo.reward_shaping.overlong_penalty) == (16, 0.0)


def test_should_accept_user_reward_when_given_as_module_function():
    cfg = load(
        ["env.reward_functions=[{name: 'trainer.rewards.math_rewards:exact_alnum_reward', weight: 0.5}]"]
    )
    assert cfg.env.reward_functions[0].weight == 0.5


# ----- each default written once: in its dataclass, never again in a YAML file ----------------------


def _field_defaults(cls) -> dict:
    """A dataclass's defaults under the keys a user writes (fields without one left out)."""
    import dataclasses

    from trainer.config import config_key, to_dict

    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[config_key(f)] = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[config_key(f)] = to_dict(f.default_factory())
    return out


def _restated(written, cls, path: str = ""):
    """The keys of ``written`` (a YAML mapping for dataclass ``cls``) that repeat the dataclass default."""
    import dataclasses
    import typing

    from trainer.config import _type_hints, config_key

    defaults = _field_defaults(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls)}
    for key, value in (written or {}).items():
        if key not in fields:
            continue  # an unknown key: composing refuses it
        hint, where = _type_hints(cls)[fields[key].name], f"{path}{key}"
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        filled = value
        if dataclasses.is_dataclass(item) and isinstance(value, list):  # items: their own defaults filled in
            filled = [{**_field_defaults(item), **v} if isinstance(v, dict) else v for v in value]
        if key in defaults and filled == defaults[key]:
            yield where
        elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
            yield from _restated(value, hint, f"{where}.")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            for i, item in enumerate(value or []):
                yield from _restated(item, typing.get_args(hint)[0], f"{where}[{i}].")


def _restated_in(path) -> list[str]:
    """What a config group's YAML file (or the root config.yaml) repeats of the dataclasses' defaults."""
    import re

    import yaml

    from trainer.config import CONF_DIR, GROUP_SECTIONS, Config, _type_hints

    text = path.read_text()
    written = yaml.safe_load(text) or {}
    group = path.parent.name
    if path.parent == CONF_DIR:
        return list(_restated({k: v for k, v in written.items() if k not in ("defaults", "hydra")}, Config))
    section = GROUP_SECTIONS[group]
    package = re.search(r"^# @package (\S+)", text, re.M)
    assert (package.group(1) if package else group) == section, f"{path}: write it under {section}"
    return list(_restated(written, _type_hints(Config)[section], f"{section}."))


def _config_files():
    from trainer.config import CONF_DIR

    return sorted(p for p in CONF_DIR.rglob("*.yaml") if p.parent.name != "experiment")


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_should_write_each_default_once_when_a_config_file_sets_values(path):
    """Defaults live in trainer/config.py's dataclasses; a group option writes only what makes it an
    alternative (experiments are diffs, free to pin a value with its reason)."""
    from trainer.config import CONF_DIR, GROUP_SECTIONS

    assert path.name != "default.yaml", f"{path}: the dataclass holds the defaults"
    assert path.parent == CONF_DIR or path.parent.name in GROUP_SECTIONS, f"{path}: not a group of a section"
    assert _restated_in(path) == [], f"{path} repeats the dataclass default of these keys"


def test_should_find_a_restated_default_when_a_group_option_repeats_one(tmp_path):
    from trainer.config import CONF_DIR

    (tmp_path / "data").mkdir()
    restating = tmp_path / "data" / "mine.yaml"
    restating.write_text(
        (CONF_DIR / "data" / "math500.yaml").read_text() + "shuffle: true\nmax_val_examples: 32\n"
    )
    assert _restated_in(restating) == ["data.shuffle"]
    (tmp_path / "rewards").mkdir()
    rewards = tmp_path / "rewards" / "mine.yaml"
    rewards.write_text(
        "# @package env\nreward_functions: [{name: math, weight: 1.0}]\nreward_timeout_s: 30\n"
    )
    assert _restated_in(rewards) == ["env.reward_functions", "env.reward_timeout_s"]
    rewards.write_text("# @package env\nreward_functions: [{name: gsm8k, weight: 1.0, kwargs: {a: 1}}]\n")
    assert _restated_in(rewards) == ["env.reward_functions[0].weight"]


@pytest.mark.parametrize("name", experiments())
def test_should_compose_the_same_config_again_when_an_experiment_is_printed_and_read_back(name):
    """``--cfg`` prints every key under the name a user writes (grpo.async): it composes to the same config."""
    import copy

    from trainer.config import from_dictconfig, to_dict

    cfg = load([f"experiment={name}"])
    again = copy.deepcopy(cfg)
    again.validate()  # validation changes nothing
    assert again == cfg
    assert from_dictconfig(to_dict(cfg)) == cfg


def test_should_take_the_async_section_under_its_key_when_a_config_file_writes_it():
    from trainer.config import from_dictconfig

    cfg = from_dictconfig(
        {"grpo": {"async": {"max_staleness": 2}}, "generation": {"placement": "disaggregated"}}
    )
    assert cfg.grpo.async_.max_staleness == 2 and cfg.grpo.loss.importance_sampling == "tis"


@pytest.mark.parametrize(
    ("written", "message"),
    [
        (
            {"grpo": {"loss": {"bogus": 1}}},
            "unknown key grpo.loss.bogus; valid keys under grpo.loss: aggregation,",
        ),
        ({"grpo": {"bogus": 1}}, "unknown key grpo.bogus; valid keys under grpo: advantage, async,"),
        ({"grpo": {"async": {"max_staleness": "x"}}}, "grpo.async.max_staleness='x' must be an integer"),
        (
            {"env": {"reward_functions": [{"name": "math"}, {"name": "m", "weight": "x"}]}},
            "env.reward_functions[1].weight='x' must be a number",
        ),
        (
            {"env": {"reward_functions": [{"name": "math", "bogus": 1}]}},
            "unknown key env.reward_functions[0].bogus; valid keys under env.reward_functions[0]: kwargs, name, normalize, weight, window",
        ),
        ({"env": {"reward_functions": [{"weight": 2.0}]}}, "env.reward_functions[0].name is required"),
        (
            {"env": {"reward_functions": [{"name": "math", "weight": float("nan")}]}},
            "env.reward_functions[0].weight=nan must be a finite number",
        ),
        ({"policy": {"adam_betas": [0.9]}}, "policy.adam_betas=[0.9] must be a pair of numbers"),
    ],
)
def test_should_name_the_whole_key_in_one_line_when_a_written_config_is_bad(written, message):
    from trainer.config import from_dictconfig

    with pytest.raises(ConfigError) as err:
        from_dictconfig(written)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "env.reward_functions=[{name: math}, {name: gsm8k, weight: abc}]",
            "env.reward_functions[1].weight='abc' must be a number",
        ),
        ("env.reward_functions=[{name: math, bogus: 1}]", "unknown key env.reward_functions[0].bogus"),
        ("grpo.async.bogus=1", "unknown key grpo.async.bogus; check the spelling"),
        ("policy.adam_betas=notalist", "policy.adam_betas='notalist' must be a pair of numbers"),
    ],
)
def test_should_name_the_whole_key_in_one_line_when_an_override_inside_a_list_is_bad(override, message):
    with pytest.raises(ConfigError) as err:
        load([override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_should_read_a_group_option_over_its_section_defaults_when_a_tool_asks_for_one():
    from trainer.config import EnvConfig, RewardSpec, preset

    assert preset("rewards", "math") == EnvConfig()
    code = preset("rewards", "code_unit_tests")
    assert code.reward_functions == [
        RewardSpec("code_unit_tests", 1.0, {"max_tests": 16, "time_limit_s": 2.0})
    ]
    assert (code.reward_timeout_s, code.max_concurrent_rewards) == (120.0, 16)
    assert preset("data", "math500").split == "test"


# ----- mapping keys (dict-typed fields): Hydra's struct mode would close them -----------------------


def _value_at(cfg, key: str):
    """The value under a written key (``env.reward_functions.0.kwargs``) of a typed config."""
    from trainer.config import to_dict

    value = to_dict(cfg)
    for part in key.split("."):
        value = value[int(part)] if part.isdigit() else value[part]
    return value


MAPPING_KEYS = [
    "data.options",
    "generation.chat_template_kwargs",
    "generation.vllm_kwargs",
    "env.reward_functions.0.kwargs",
    "env.feedback_kwargs",
    "judge.verdicts",
    "judge.chat_template_kwargs",
    "env.environment_kwargs",
    "env.verifiers.args",
]


def test_should_find_every_mapping_key_when_reading_the_dataclass_types():
    from trainer.config import mapping_keys

    found = [".".join(k).replace("*", "0") for k in mapping_keys()]
    assert sorted(found) == sorted(MAPPING_KEYS)


@pytest.mark.parametrize("key", MAPPING_KEYS)
def test_should_take_a_mapping_when_the_key_is_dict_valued_and_its_default_empty(key):
    assert _value_at(load(), key) == {}
    assert _value_at(load([f"{key}={{a: 1}}"]), key) == {"a": 1}


@pytest.mark.parametrize("key", MAPPING_KEYS)
def test_should_merge_a_mapping_into_a_non_empty_value_when_the_key_is_dict_valued(key):
    cfg = load([f"+{key}.b=2", f"{key}={{a: 1}}"])  # + adds to a closed mapping, as in Hydra
    assert _value_at(cfg, key) == {"b": 2, "a": 1}


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        (["experiment=gemma3-1b-math"], "generation.vllm_kwargs", {"block_size": 32, "a": 1}),
        (
            ["experiment=tiny"],
            "data.options",
            {"num_examples": 512, "min_operand": 0, "max_operand": 2, "ops": "+", "a": 1},
        ),
        (
            ["rewards=code_unit_tests"],
            "env.reward_functions.0.kwargs",
            {"max_tests": 16, "time_limit_s": 2.0, "a": 1},
        ),
    ],
)
def test_should_merge_a_mapping_into_the_default_when_a_config_file_sets_one(overrides, key, expected):
    assert _value_at(load([*overrides, f"{key}={{a: 1}}"]), key) == expected


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("generation.vllm_kwargs.block_size=16", {"block_size": 16}),  # an entry the default has
        ("generation.vllm_kwargs.swap_space=1", {"block_size": 32, "swap_space": 1}),  # one it lacks
        ("+generation.vllm_kwargs.swap_space=1", {"block_size": 32, "swap_space": 1}),
        ("~generation.vllm_kwargs.block_size", {}),
    ],
)
def test_should_set_one_entry_when_the_override_names_a_key_inside_a_mapping(override, expected):
    assert load(["experiment=gemma3-1b-math", override]).generation.vllm_kwargs == expected


@pytest.mark.parametrize(
    "override",
    [
        "generation.vllm_kwarg={a: 1}",
        "data.option.a=1",
        "generation.bogus={a: 1}",
        "env.reward_functions.0.kwarg={a: 1}",
    ],
)
def test_should_say_unknown_key_in_one_line_when_a_key_beside_a_mapping_is_misspelt(override):
    key = override.split("=")[0]
    with pytest.raises(
        ConfigError,
        match=rf"^unknown key {key}; check the spelling \(python -m trainer --cfg lists every key\)$",
    ):
        load([override])


def test_should_print_vllm_kwargs_when_the_cli_sets_them_over_an_empty_default(capsys):
    import yaml

    from trainer.__main__ import main

    rc = main(
        ["experiment=tiny", "generation=vllm", "generation.vllm_kwargs={gpu_memory_utilization:0.9}", "--cfg"]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert yaml.safe_load(out.out)["generation"]["vllm_kwargs"] == {"gpu_memory_utilization": 0.9}


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("grpo.num_generations_per_prompt=1", "grpo.num_generations_per_prompt"),  # config.py's own check
        # Names the registries check (trainer.prestart.check_names), still before anything is built:
        ("data.name=nope", "data.name='nope' is not allowed; choose one of: arithmetic,"),
        ("env.reward_functions=[{name: nope}]", "env.reward_functions[0].name: unknown reward 'nope'"),
        (
            "grpo.loss.policy_loss=x",
            "grpo.loss.policy_loss='x' is not allowed; choose one of: clipped, module:function",
        ),
        ("grpo.loss.aggregation=median", "grpo.loss.aggregation='median' is not allowed"),
        ("grpo.max_rollout_turns=2", "grpo.max_rollout_turns=2 needs execution feedback: env.feedback=None"),
        (
            "env.environment=nope",
            "env.environment='nope' is not an environment; valid: code_feedback, skyrl_gym, tools",
        ),
        ("env.environment=tools", "env.environment=tools answers the model between its turns"),
    ],
)
def test_should_fail_with_one_line_before_anything_starts_when_cli_value_is_bad(
    override, key, capsys, monkeypatch
):
    from trainer import run
    from trainer.__main__ import main

    monkeypatch.setattr(run, "train", lambda cfg: pytest.fail("the run started"))
    rc = main(["experiment=tiny", override])
    out = capsys.readouterr()
    assert rc == 2, out.err
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0], out.err
    assert "Traceback" not in out.err and not out.out.strip(), out.out  # nothing started, nothing printed


def test_should_check_registry_names_when_cfg_only_prints_the_config(capsys):
    from trainer.__main__ import main

    rc = main(["--cfg", "experiment=tiny", "grpo.loss.importance_sampling=sis"])
    err = capsys.readouterr().err
    assert rc == 2 and "grpo.loss.importance_sampling='sis'" in err, err


# ----- the ground floor: config.py imports no registry ---------------------------------------------


def _trainer_imports(path) -> set[str]:
    """Every trainer module ``path`` imports, at the top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if node.module == "trainer" else node.module for a in node.names
            }
    return {m for m in found if m == "trainer" or m.startswith("trainer.")}


@pytest.mark.integration  # a Python interpreter of its own
def test_should_import_no_registry_when_config_converts_and_validates():
    # hardware is a leaf probe (torch only), not a registry.
    assert _trainer_imports(REPO / "trainer" / "config.py") <= {"trainer.hardware"}
    assert _trainer_imports(REPO / "trainer" / "hardware.py") == set()
    code = (
        "import sys; from trainer.config import load; load(['experiment=cpu-demo', 'grpo.max_rollout_turns=2']); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('trainer'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["trainer", "trainer.config", "trainer.hardware"]


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    """Take the path of an AVX2-only CPU (no AVX512-BF16, no AMX, no oneDNN bf16) on any machine."""
    from trainer import hardware

    monkeypatch.setattr(hardware, "native_bf16", lambda: False)
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: False)


@pytest.fixture
def cpu_with_bf16(monkeypatch):
    from trainer import hardware

    monkeypatch.setattr(hardware, "native_bf16", lambda: True)


def test_should_pick_float32_when_auto_runs_on_a_cpu_without_native_bf16(cpu_without_bf16):
    demo = load(["experiment=cpu-demo"])
    assert (demo.model.dtype, demo.policy.param_dtype, demo.engine_dtype) == ("float32", None, "float32")
    line = demo.precision_summary()
    assert "compute float32, engine float32" in line and "emulate" in line and "\n" not in line


def test_should_pick_bf16_compute_over_fp32_masters_when_auto_runs_on_a_bf16_cpu(cpu_with_bf16):
    demo = load(["experiment=cpu-demo"])
    assert (demo.model.dtype, demo.policy.param_dtype, demo.engine_dtype) == (
        "float32",
        "bfloat16",
        "bfloat16",
    )
    assert "natively" in demo.precision_summary()


def test_should_pick_bf16_when_auto_runs_on_gpus(cpu_without_bf16):
    cfg = load(
        ["experiment=gemma3-1b-math", "policy.param_dtype=auto", "generation.dtype=auto", "model.dtype=auto"]
    )
    assert (cfg.model.dtype, cfg.policy.param_dtype, cfg.engine_dtype) == ("float32", "bfloat16", "bfloat16")


def test_should_keep_explicit_dtypes_and_say_nothing_of_auto_when_none_is_auto(cpu_without_bf16):
    cfg = load(["experiment=tiny"])
    assert cfg.precision_summary() == "weights float32, compute float32, engine float32"


def test_should_warn_with_the_fix_when_bf16_is_asked_for_on_a_cpu_without_it(cpu_without_bf16):
    from trainer.prestart import precision_warning

    demo = load(["experiment=cpu-demo", "policy.param_dtype=bfloat16", "generation.dtype=bfloat16"])
    line = precision_warning(demo)
    assert line and "policy.param_dtype=auto generation.dtype=auto" in line and "\n" not in line
    assert (
        precision_warning(load(["experiment=cpu-demo"])) is None
    )  # auto chose float32: nothing to warn about
    assert precision_warning(load(["experiment=tiny"])) is None  # float32 throughout
    assert precision_warning(load(["experiment=gemma3-1b-math"])) is None  # GPUs


def test_should_not_warn_when_the_cpu_runs_bf16_natively(cpu_with_bf16):
    from trainer.prestart import precision_warning

    assert precision_warning(load(["experiment=cpu-demo", "policy.param_dtype=bfloat16"])) is None


# ----- every key, with a value of the wrong type -----------------------------------------------------


def _leaves(cls, prefix=""):
    import dataclasses

    from trainer.config import _type_hints, config_key

    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{prefix}{config_key(f)}.")
        else:
            yield f"{prefix}{config_key(f)}", hint


def _wrong_value(hint) -> str | None:
    """An override of the wrong type for a key of type ``hint`` (None: any value is accepted)."""
    import types
    import typing

    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is typing.Any:
        return None
    if hint in (int, float, bool):
        return "notanumber"
    if hint is str:
        return "[1,2]"
    return "notalist"  # lists, mappings, pairs


@pytest.mark.integration  # composes the config for every key: half a minute of CPU
def test_should_name_the_key_in_one_line_when_any_key_gets_a_wrong_type():
    from trainer.config import Config

    checked, problems = 0, []
    for key, hint in _leaves(Config):
        value = _wrong_value(hint)
        if value is None:
            continue
        checked += 1
        try:
            load(["experiment=tiny", f"{key}={value}"])
            problems.append(f"{key}={value}: accepted")
        except ConfigError as e:
            if key not in str(e) or "\n" in str(e):
                problems.append(f"{key}={value}: {e}")
        except Exception as e:  # anything but a ConfigError would reach the user as a traceback
            problems.append(f"{key}={value}: {type(e).__name__}: {e}")
    assert checked > 60 and not problems, problems


# ----- bad input found at start-up, before any worker --------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.name=/nonexistent/path", "model.name"),
        ("model.name=./no_such_model_dir", "model.name"),
        ("model.tokenizer=/nonexistent/tokenizer", "model.tokenizer"),
        ("env.reward_functions=[{name:math,weight:abc}]", "env.reward_functions[0].weight"),
        ("logger.log_dir=/proc/forbidden", "logger.log_dir"),
        ("checkpointing.checkpoint_dir=/proc/forbidden", "checkpointing.checkpoint_dir"),
        ("seed=notanint", "seed="),
    ],
)
def test_should_exit_with_one_line_naming_the_key_when_input_is_bad(override, key, tmp_path, capsys):
    from trainer.__main__ import main

    logs = [] if override.startswith("logger.") else [f"logger.log_dir={tmp_path / 'logs'}"]
    ckpts = (
        [] if override.startswith("checkpointing.") else [f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"]
    )
    rc = main(["experiment=tiny", *logs, *ckpts, override])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0 and len(lines) == 1 and key in lines[0] and "Traceback" not in err, err


def test_should_end_the_ranks_it_started_when_the_data_fails_while_they_set_up(
    ray_local, tmp_path, monkeypatch
):
    """The policy ranks start before the driver reads its data (their set-up overlaps it): a dataset
    that cannot be read is still one line, and the ranks, their placement group and the run's SIGTERM
    handler are gone with it. (The session's instance serves other runs meanwhile: only this job's
    placement groups and actors count.)"""
    import contextlib
    import signal

    import psutil
    from ray._private import state

    from trainer import run
    from trainer.policy import group

    reserved = []

    def reserve(*args, **kwargs):
        reserved.append(real(*args, **kwargs))
        return reserved[-1]

    real = group.reserve
    monkeypatch.setattr(group, "reserve", reserve)
    job = ray_local.JobID.from_hex(ray_local.get_runtime_context().get_job_id())

    def policy_actors() -> dict[str, dict]:
        return {i: a for i, a in state.actors(job_id=job).items() if a["ActorClassName"] == "PolicyWorker"}

    earlier = set(policy_actors())  # this process's earlier tests' ranks
    before = signal.getsignal(signal.SIGTERM)
    cfg = load(
        [
            "experiment=tiny",
            "data.name=local",
            f"data.path={tmp_path / 'missing.jsonl'}",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ck'}",
        ]
    )
    with pytest.raises(run.SetupError) as err:
        run.train(cfg)
    assert str(err.value).startswith("data.name=local split=train: data.path") and "\n" not in str(err.value)
    assert signal.getsignal(signal.SIGTERM) is before
    assert reserved and all(ray_local.util.placement_group_table(pg)["state"] == "REMOVED" for pg in reserved)
    ranks = {i: a for i, a in policy_actors().items() if i not in earlier}
    assert ranks

    def alive() -> list[int]:
        out = []
        for pid in (a["Pid"] for a in ranks.values() if a["Pid"]):  # 0: it never got a process
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
        return out

    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.val_name=nope", "data.val_name"),
        ("env.reward_functions=[{name: 'no.such.module:fn'}]", "env.reward_functions[0].name"),
        ("grpo.loss.kl_estimator=k9", "grpo.loss.kl_estimator"),
    ],
)
def test_should_check_the_registries_names_before_ray_or_any_model_when_a_run_starts(
    override, key, monkeypatch
):
    from trainer import cluster, models, run

    def started(*args, **kwargs):
        raise AssertionError("the run got past its checks")

    monkeypatch.setattr(cluster, "init_ray", started)
    monkeypatch.setattr(models, "resolve_model", started)
    monkeypatch.setattr(run, "check_backend", started)
    cfg = load(["experiment=tiny", override])  # the config itself is fine: the registry knows the name
    with pytest.raises(ConfigError) as err:
        run.train(cfg)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_should_refuse_a_bad_loss_name_before_policy_ranks_start(monkeypatch):
    from trainer.policy import group

    monkeypatch.setattr(group, "reserve", lambda *a, **k: pytest.fail("a placement group was reserved"))
    with pytest.raises(
        ConfigError,
        match=r"^grpo.loss.policy_loss='x' is not allowed; choose one of: clipped, module:function$",
    ):
        group.PolicyGroup(
            load(["experiment=tiny", "grpo.loss.policy_loss=x"]), "unused", colocated_engine=True
        )


def test_should_say_not_a_model_directory_when_it_has_no_config(tmp_path):
    from trainer.models import ModelNotFoundError, resolve_model

    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model("org/some-model") == "org/some-model"  # a hub id passes through


def test_should_accept_vllm_on_cpu_and_say_in_one_line_when_it_is_not_installed(monkeypatch):
    from trainer import prestart
    from trainer.generation import vllm_engine

    cfg = load(["experiment=tiny", "generation.backend=vllm"])
    assert not cfg.cluster.use_gpus
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(prestart.SetupError) as err:
        prestart.check_backend(cfg)
    message = str(err.value)
    assert message.startswith("generation.backend=vllm") and "\n" not in message


@pytest.mark.integration  # writes a model
def test_should_name_the_model_in_one_line_when_its_head_dim_is_too_small_for_vllm_on_cpu(monkeypatch):
    refuse_ray(monkeypatch)
    proc = run_main(
        trainer_main, ["experiment=tiny", "generation.backend=vllm", "model.name='builtin:tiny?num_heads=4'"]
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("kuberl: warning")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr  # permanent: a retry fails the same way
    assert "Traceback" not in proc.stderr
    from trainer.generation.vllm_engine import vllm_available

    # head_dim 64/4 = 16; without vLLM installed the line names the backend instead.
    assert (
        ("model.name=builtin:tiny?num_heads=4" in lines[0] and "16" in lines[0])
        if vllm_available()
        else ("generation.backend" in lines[0])
    )


@pytest.mark.integration  # writes a model
def test_should_name_the_key_in_one_line_when_the_models_heads_cannot_take_the_tensor_parallel_size(
    monkeypatch,
):
    """builtin:tiny has 2 heads: vLLM cannot split them over 3 workers (it failed inside the generation
    actor, a validation traceback after the policy had loaded)."""
    from trainer.generation.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed: the run stops earlier, naming generation.backend")
    refuse_ray(monkeypatch)
    argv = ["experiment=tiny", "generation.backend=vllm", "generation.placement=disaggregated",
            "generation.tensor_parallel_size=3"]  # fmt: skip
    proc = run_main(trainer_main, argv)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("kuberl: warning")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(
        "kuberl: error: generation.tensor_parallel_size=3: model.name=builtin:tiny has 2 attention heads"
    )
    assert lines[0].endswith("use one of 1, 2")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "limit", "sizes"),
    [
        (32, 16, 8, [1, 2, 4, 8]),  # gemma-3-27b on a node of 8
        (4, 1, 8, [1, 2, 4]),  # gemma-3-1b: one KV head, replicated
        (12, 2, 8, [1, 2, 4, 6]),  # Qwen2.5-1.5B: 3 divides the heads but not the 2 KV heads' replication
        (2, 2, 3, [1, 2]),  # builtin:tiny
    ],
)
def test_should_list_the_sizes_vllm_can_split_the_heads_over_when_tensor_parallel(
    heads, kv_heads, limit, sizes
):
    from trainer.generation.vllm_engine import tensor_parallel_sizes

    assert tensor_parallel_sizes(heads, kv_heads, limit) == sizes


def test_should_group_consecutive_numbers_by_node_when_a_run_says_where_its_actors_run():
    from trainer.run import by_host

    hosts = ["10.0.0.5"] * 8 + ["10.0.0.6"] * 8
    assert by_host("rank", hosts) == "ranks 0-7 on 10.0.0.5, ranks 8-15 on 10.0.0.6"
    assert by_host("worker", ["a", "b", "a"]) == "worker 0 on a, worker 1 on b, worker 2 on a"


def test_should_pay_cpu_gemma3_for_its_prompts_line_completed_and_not_for_a_worked_line_copied():
    """cpu-gemma3 asks first (``3+4 = ?``) and works sums below it, for a base model that copies the first
    line: its reward must pay that line completed. It paid nothing for it (the reward took the last worked sum
    for the question) and paid ``2 + 6 = 8`` whenever the answer was 8, with no error: the run learns nothing."""
    from trainer.prestart import load_dataset
    from trainer.rewards.answer import same_expression
    from trainer.rewards.runner import question_of, score_one

    cfg = load(["experiment=cpu-gemma3"])
    specs = cfg.env.reward_functions
    for example in load_dataset(cfg.data, "train")[:50]:
        prompt, gold = question_of(example), example["ground_truth"]
        asked, open_, worked = prompt.partition(" = ?")
        assert open_ and worked.strip(), f"cpu-gemma3's prompt no longer opens with the question: {prompt!r}"
        assert score_one(specs, gold, f"{asked} = {gold}", prompt).total == 1.0, prompt
        for line in worked.strip().splitlines():  # '5 + 1 = 6' pays only where it answers the question (1+5)
            left = line.partition("=")[0]
            itself = same_expression(left, asked) and line.endswith(f"= {gold}")
            assert score_one(specs, gold, line, prompt).total == float(itself), (prompt, line)
            paid = score_one(specs, gold, f"{left.strip()} = {gold}", prompt).total
            assert paid == float(same_expression(left, asked)), line
