"""The run's optional parts as components (trainer/components.py): the run, its checks and the memory plan name
none of them, and a new one is a package plus a config section."""

from __future__ import annotations

import ast
import dataclasses
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from trainer import components, config
from trainer.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
# What the optional features are called in code: their config sections, reward entries, modules and classes.
FEATURES = (
    "reward_model",
    "judge",
    "llm_judge",
    "verifiers",
    "sandbox",
    "code_feedback",
    "codefeedback",
    "reward_server",
    "rewardmodel",
)


def _names(path: Path) -> list[str]:
    """Every identifier, attribute, keyword argument, imported module and string constant of ``path``'s code
    (docstrings and comments are prose, not wiring: left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            out.append(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            out.append(node.arg)
        elif isinstance(node, ast.alias):
            out.append(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append(node.value)
    return out


@pytest.mark.parametrize("path", ["trainer/run.py", "trainer/prestart.py", "trainer/tools/plan.py"])
def test_should_name_no_optional_feature_in_the_run_its_checks_or_the_plan(path):
    named = [n for n in _names(REPO / path) if any(f in n.lower() for f in FEATURES)]
    assert not named, f"{path} names optional features {sorted(set(named))}: they belong to their components"


def test_should_build_only_the_components_a_config_uses_in_the_order_of_its_sections():
    assert components.build(config.load([])) == []  # the default: the math reward, nothing else to start
    cfg = config.load(
        [
            "env.reward_functions=[{name: code_unit_tests}, {name: reward_model}, {name: llm_judge}]",
            "reward_model.name=tiny-rm",
            "judge.model=tiny-judge",
        ]
    )
    assert [c.name for c in components.build(cfg)] == ["sandbox", "reward model", "judge"]
    assert all(isinstance(c, components.Component) for c in components.build(cfg))
    planned = [target for _, target in components.factories(cfg, components.PLANNERS)]
    assert planned == ["trainer.tools.plan_rewards:reward_model", "trainer.tools.plan_rewards:judge"]


class _Counter(components.Base):
    """A component of a test's own: what a new service would be."""

    name = "counter"
    calls: ClassVar[list[str]] = []

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self):
        if self.cfg.counter.every < 1:
            raise ConfigError(f"counter.every={self.cfg.counter.every} must be >= 1")
        self.calls.append("check")

    def start(self):
        self.calls.append("start")

    def describe(self):
        return f"counter every {self.cfg.counter.every}"


def test_should_take_a_new_component_from_its_own_section_alone(monkeypatch):
    """A package with a factory and a config section that names it: nothing else changes."""
    module = types.ModuleType("kuberl_test_counter")
    module.component = lambda cfg: _Counter(cfg) if cfg.counter.enabled else None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)

    @dataclasses.dataclass
    class CounterConfig:
        components: ClassVar[tuple[str, ...]] = ("kuberl_test_counter:component",)
        enabled: bool = True
        every: int = 1

    @dataclasses.dataclass
    class WithCounter:
        counter: CounterConfig = dataclasses.field(default_factory=CounterConfig)

    _Counter.calls.clear()
    (part,) = components.build(WithCounter())
    part.check()
    part.start()
    assert _Counter.calls == ["check", "start"] and part.describe() == "counter every 1"
    assert components.build(WithCounter(CounterConfig(enabled=False))) == []
    with pytest.raises(ConfigError, match="counter.every=0"):
        components.build(WithCounter(CounterConfig(every=0)))[0].check()


def test_should_refuse_two_components_that_each_bring_the_run_s_prompts():
    class Source(components.Base):
        def __init__(self, name):
            self.name = name

        def examples(self, max_examples=None):
            return []

    one, two = Source("one"), Source("two")
    assert components.source([components.Base(), one]) is one
    assert components.source([components.Base()]) is None
    with pytest.raises(ConfigError, match="one and two each bring the run's prompts"):
        components.source([one, two])
