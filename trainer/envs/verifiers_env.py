"""``env.verifiers``: a verifiers environment (Prime Intellect's format, PyPI ``verifiers``) as the run's data, its
rollouts and its reward.

``env.verifiers.id`` names the module ``verifiers.load_environment`` imports (an installed environment package,
or any importable module with a ``load_environment``), ``env.verifiers.args`` its keyword arguments. The
environment is loaded once, on the driver:

- its dataset's rows (``prompt`` messages, ``answer``, ``info``, ``task``) are the run's prompts
  (``data.name=verifiers``): each example keeps its row, and its ``answer`` is the example's ground truth;
- for each batch, its own ``generate`` runs ``n`` rollouts per example against the generation endpoint
  (:mod:`trainer.generation.endpoint`, an OpenAI client with the run's token), its groups spread over the
  engines' endpoints; it sends each turn as a chat request, runs its tools and parsers, and scores the
  rollouts with its ``Rubric``;
- each rollout comes back as the endpoint's turns: the prompt ids it rendered, the ids the engine sampled and
  their logprobs (verifiers keeps them in the state's ``trajectory``), which :func:`trainer.envs.base.chain`
  joins into one token-exact sample. verifiers sends a later turn as the whole conversation, the assistant
  messages the endpoint returned among it; the endpoint prompts it with the ids it sampled for them, not the
  chat template's rewriting of them, so each turn's prompt extends the sample before it;
- the rubric's reward is what ``{name: environment, weight: w}`` in ``env.reward_functions`` pays, beside the
  other rewards; its metrics (and the sample's ``turns``, ``turns_dropped``, ``errors``) become
  ``train/verifiers/<name>``.

Pinned at ``verifiers==0.1.9.post3`` (the ``envs`` extra): the last generation whose dependencies resolve beside
vLLM 0.32's and whose API is this one (``load_environment(env_id, **args)``, ``Environment.generate``, the
``trajectory`` of token ids); 0.3 needs ``mcp<2``, 0.4 replaced the API.

Loading an environment installs verifiers' own SIGINT and SIGTERM handlers; they are put back at once, so a
preempted run still saves (:mod:`trainer.preemption`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
from collections.abc import Mapping
from typing import Any

from trainer.config import ConfigError
from trainer.envs.base import Trajectory, Turn

INSTALL = "pip install 'kuberl-trainer[envs]'"


def check(env_id: str) -> None:
    """ConfigError (one line) unless verifiers is installed and ``env_id``'s module can be found: before Ray
    starts or anything loads."""
    key = f"env.verifiers.id={env_id}"
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(f"{key} needs the verifiers package: {INSTALL}")
    module = _module(env_id)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        found = False
    if not found:
        raise ConfigError(
            f"{key}: no module {module!r} to load it from; install the environment's package or put its module "
            "on PYTHONPATH"
        )


def _module(env_id: str) -> str:
    return env_id.replace("-", "_").split("/")[-1]  # as verifiers.load_environment reads it


def _text(content: Any) -> str:
    """A prompt message's content as text: a string, or OpenAI's text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, Mapping))
    return ""


class VerifiersEnvironment:
    """One verifiers environment, loaded on the driver; :meth:`connect` points it at the endpoints."""

    name = "verifiers"

    def __init__(self, env_id: str, args: Mapping[str, Any] | None = None) -> None:
        check(env_id)
        import verifiers

        self.id, key = env_id, f"env.verifiers.id={env_id}"
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.env = verifiers.load_environment(env_id, **dict(args or {}))
        except TypeError as e:  # an argument its load_environment does not take, or one it needs
            raise ConfigError(f"env.verifiers.args for {key}: {e}") from None
        finally:
            for sig, handler in handlers.items():  # verifiers installs its own (module docstring)
                if handler is not None:
                    signal.signal(sig, handler)
        if self.env.message_type != "chat":
            raise ConfigError(f"{key} is a completion (not chat) environment; the endpoint serves chat only")
        if getattr(self.env, "interleaved_rollouts", False):
            raise ConfigError(
                f"{key} asks for interleaved rollouts (a token endpoint of PRIME-RL's); load it without them"
            )
        self.endpoints: list[str] = []
        self.token = self.model = ""
        self.max_concurrent = 1

    def tools(self) -> list[dict[str, Any]] | None:
        return list(self.env.oai_tools) if self.env.oai_tools else None

    def examples(self, max_examples: int | None = None) -> list[dict[str, Any]]:
        """The environment's dataset as the run's examples (``data.name=verifiers``)."""
        dataset = self.env.dataset if self.env.dataset is not None else self.env.eval_dataset
        rows = dataset.to_list()
        if max_examples is not None:
            rows = rows[:max_examples]
        out = []
        for i, row in enumerate(rows):
            prompt = row.get("prompt")
            if not isinstance(prompt, list) or not prompt:
                raise ConfigError(
                    f"env.verifiers.id={self.id}: row {i} of its dataset has no prompt messages"
                )
            # Arrow fills the keys one message lacks and another has with None: the template sees neither
            messages = [
                {**{k: v for k, v in m.items() if v is not None}, "content": _text(m.get("content"))}
                for m in prompt
            ]
            out.append(
                {
                    "id": f"verifiers-{self.id}-{row.get('example_id', i)}",
                    "messages": messages,
                    "ground_truth": row.get("answer", ""),
                    "dataset": "verifiers",
                    # the rollout input verifiers reads: its own row, as its dataset holds it
                    "verifiers": {k: row[k] for k in ("prompt", "answer", "info", "task") if k in row},
                }
            )
        return out

    def connect(self, endpoints: list[str], token: str, model: str, max_concurrent: int) -> None:
        """Where the rollouts go: the endpoints' base URLs (``http://host:port/v1``), the bearer token, the model
        name they serve, and how many rollouts may be in flight on each (their requests wait for the engine)."""
        if not endpoints:
            raise ConfigError(
                f"env.verifiers.id={self.id} needs the generation endpoint: set generation.endpoint.enabled=true"
            )
        self.endpoints, self.token, self.model = list(endpoints), token, model
        self.max_concurrent = max(1, max_concurrent)

    def run(self, examples: list[dict[str, Any]], n: int, sampling: dict[str, Any]) -> list[Trajectory]:
        """``n`` rollouts per example by the environment's own ``generate``, group-contiguous; each example's
        group on one endpoint, the groups spread over all of them."""
        # example_id: the position in the batch, by which verifiers groups and sorts
        inputs = [{**ex["verifiers"], "example_id": i} for i, ex in enumerate(examples) for _ in range(n)]
        shares = [
            [x for x in inputs if x["example_id"] % len(self.endpoints) == k]
            for k in range(len(self.endpoints))
        ]
        states = asyncio.run(self._generate(shares, {**sampling, "logprobs": True}))
        states.sort(key=lambda s: s["example_id"])  # stable: a group keeps its order
        if len(states) != len(inputs):
            raise RuntimeError(
                f"verifiers environment {self.id!r} returned {len(states)} of the {len(inputs)} rollouts asked for"
            )
        return [self._trajectory(s) for s in states]

    async def _generate(self, shares: list[list[dict]], sampling: dict[str, Any]) -> list[Any]:
        from openai import AsyncOpenAI

        async def on(url: str, share: list[dict]) -> list[Any]:
            if not share:
                return []
            # Retries: a request the engine turned away (503 after endpoint.wait_timeout_s) may go again.
            async with AsyncOpenAI(base_url=url, api_key=self.token, max_retries=2) as client:
                out = await self.env.generate(
                    share,
                    client,
                    self.model,
                    sampling,
                    max_concurrent=self.max_concurrent,
                    use_tqdm=False,
                )
            return list(out["state"])

        parts = await asyncio.gather(*(on(url, share) for url, share in zip(self.endpoints, shares)))
        return [s for part in parts for s in part]

    def _trajectory(self, state: Any) -> Trajectory:
        turns = []
        for step in state.get("trajectory") or []:
            tokens, response = step.get("tokens"), step.get("response")
            if tokens is None:
                raise RuntimeError(
                    f"verifiers environment {self.id!r}: a turn came back without token ids; its requests must "
                    "reach the trainer's generation endpoint, which returns them"
                )
            finish = response.choices[0].finish_reason if response is not None else "stop"
            turns.append(
                Turn(
                    list(tokens["prompt_ids"]),
                    list(tokens["completion_ids"]),
                    [float(x) for x in tokens["completion_logprobs"]],
                    "length" if finish == "length" else "stop",
                )
            )
        error = state.get("error")
        if not turns:
            raise RuntimeError(
                f"verifiers environment {self.id!r}: a rollout got no answer from the endpoint ({error!r})"
            )
        last = state["trajectory"][-1]["response"]
        text = (last.choices[0].message.content or "") if last is not None else ""
        info = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        info["errors"] = float(error is not None)
        reward = state.get("reward")
        return Trajectory(turns, text, None if reward is None else float(reward), info)


class VerifiersComponent:
    """``env.verifiers`` as a run component (:mod:`trainer.components`): checked before anything starts, loaded
    once Ray is up, the run's prompts and tools, and pointed at the endpoints once they serve."""

    name = "verifiers environment"

    def __init__(self, env_id: str, args: Mapping[str, Any], max_examples: int | None) -> None:
        self.id, self.args, self.max_examples = env_id, dict(args), max_examples
        self.env: VerifiersEnvironment | None = None

    def check(self) -> None:
        check(self.id)

    def start(self) -> None:
        self.env = VerifiersEnvironment(self.id, self.args)

    def _loaded(self) -> VerifiersEnvironment:
        if self.env is None:  # a caller's mistake, not the config's
            raise RuntimeError("the verifiers environment is read before start()")
        return self.env

    def examples(self, max_examples: int | None = None) -> list[dict[str, Any]]:
        return self._loaded().examples(self.max_examples if max_examples is None else max_examples)

    def tools(self) -> list[dict[str, Any]] | None:
        return self._loaded().tools()

    def attach(self, served: Any) -> None:
        """The endpoints it drives its rollouts through (:class:`trainer.components.Served`); one in the engine
        and the rest waiting on each, so none is turned away."""
        self._loaded().connect(served.urls, served.token, served.model, served.max_concurrent)

    @property
    def rollouts(self) -> VerifiersEnvironment:
        """What runs the rollouts (:class:`trainer.envs.base.RolloutEnvironment`)."""
        return self._loaded()

    def wait_ready(self) -> None:
        return None

    def describe(self) -> str | None:
        return f"verifiers environment {self.id}: the run's prompts, rollouts and `environment` reward"

    def shutdown(self, graceful: bool = True) -> None:
        return None


def component(cfg: Any) -> VerifiersComponent | None:
    """The run's verifiers environment when ``env.verifiers.id`` names one."""
    v = cfg.env.verifiers
    return VerifiersComponent(v.id, v.args, cfg.data.max_examples) if v.id else None
