"""Mixture-of-experts policies: the routers of a transformers MoE model, read and (with router replay) steered.

Every MoE family kuberl trains routes a token by a linear router: softmax over the experts, the top k, their
probabilities (renormalised over the k where the family does) as the gate weights of the k experts' outputs.
An engine that samples and a trainer that scores the same tokens compute the router's logits in different
kernels, batch shapes and often precisions, so near-ties fall the other way in a share of the decisions: that
token then goes through other experts in training than when it was sampled, and its importance ratio measures
the routing noise, not the policy's change (NVIDIA/Megatron-LM#4168 on GitHub: three of three GRPO runs on Qwen3-30B-A3B
collapsed without replay). **Router replay** (R3, as NeMo-RL's router-replay guide, verl, slime's
``--use-rollout-routing-replay`` and prime-rl do it) routes every token in the trainer's forwards to the
experts the engine chose. The rule followed here is theirs: the **expert ids are the engine's**, the **gate
weights are the trainer's own router's** softmax over all experts gathered at those ids (renormalised over the
k when the family renormalises), so the router still gets a gradient through the weights of the experts it is
made to use.

Only the routers are touched: a forward hook on each router module (:data:`RULES` names the classes and how each
turns logits into gate weights, read from the installed transformers' sources) replaces its (logits, weights,
ids) output when the call carries routes, and records what it routed when asked (:class:`Routing`). The
expert kernels, FSDP2's units and the attention are the model's own. :func:`check_replay` proves at start-up on
the run's own model that replaying the model's own routes gives its own logprobs bit for bit, so a family whose
router does something else is refused in one line rather than trained on a wrong rule.

Routes travel as the engines return them (vLLM's ``routed_experts``: an array (positions, layers, k) of expert
ids over every position the engine computed, the prompt's and every sampled token's but the last, which is
never fed back; the hf engine's are the same shape). A layout (:mod:`trainer.policy.batch`) lays them out like
its input ids, -1 where a position has none (padding, a multi-turn sample's later turns): those route freely.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.models.shape import EXPERT_COUNT_FIELDS

FREE = -1  # a position with no route to replay: the trainer's router picks its experts


@dataclass(frozen=True)
class Rule:
    """How a router class turns its logits into gate weights: softmax in float32, top k, then ``norm``
    ("config": renormalise over the k when ``config.norm_topk_prob``; "always"), and the weights cast back to
    the logits' dtype when ``cast``."""

    norm: str
    cast: bool


# transformers router classes -> their rule, read off each class's forward in the pinned transformers (5.19):
# Qwen3-MoE, Qwen2-MoE and OLMoE renormalise by config and cast; Mixtral always renormalises and keeps float32.
RULES: dict[str, Rule] = {
    "Qwen3MoeTopKRouter": Rule("config", True),
    "Qwen2MoeTopKRouter": Rule("config", True),
    "OlmoeTopKRouter": Rule("config", True),
    "MixtralTopKRouter": Rule("always", False),
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTING = "_kuberl_routing"


class MoEError(RuntimeError):
    """An MoE model kuberl cannot route as its engine did (the message names the model and the way out)."""


def is_moe(config: Any) -> bool:
    """Whether a transformers config (or a model's) describes a mixture of experts."""
    config = getattr(config, "config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any((getattr(text, f, 0) or 0) > 0 for f in EXPERT_COUNT_FIELDS)


@dataclass
class Router:
    layer: int  # the decoder layer it routes for (the engine's routes are indexed by it)
    module: torch.nn.Module
    rule: Rule | None  # None: a router class RULES does not know
    top_k: int
    num_experts: int


def routers(model: torch.nn.Module) -> list[Router]:
    """The model's routers, one per MoE layer in layer order: modules of a class in :data:`RULES`, or any other
    ``*TopKRouter`` / ``*Router`` module with a ``top_k`` (rule unknown: replay refuses it)."""
    found = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls not in RULES and not (cls.endswith("Router") and hasattr(module, "top_k")):
            continue
        match = _LAYER.search(name + ".")
        if match is None:
            continue
        experts = getattr(module, "num_experts", None) or int(module.weight.shape[0])
        found.append(Router(int(match.group(1)), module, RULES.get(cls), int(module.top_k), int(experts)))
    return sorted(found, key=lambda r: r.layer)


@dataclass
class Call:
    """What one model call routes by, and what it records. ``routes`` (N, layers, k) int64: the engine's expert
    ids over the call's N flattened positions (row-major over its input ids), :data:`FREE` where a position has
    none; replayed when ``replay``, else only compared (the mismatch statistic). ``real`` (N,) bool: the
    positions that are tokens, not padding (None: all), which the statistics and losses count."""

    routes: torch.Tensor | None = None
    replay: bool = False
    real: torch.Tensor | None = None
    record: bool = False
    keep_grad: bool = False  # the auxiliary losses need the router logits with their graph


@dataclass(frozen=True)
class Mode:
    """What a batch's calls do with an MoE model's routers (the worker sets it; the default: nothing)."""

    replay: bool = False
    record: bool = False
    keep_grad: bool = False

    def call(self, routes: torch.Tensor | None, mask: torch.Tensor | None) -> Call:
        """The :class:`Call` of one model call whose input ids are laid out as ``routes`` (..., layers, k) and
        ``mask`` (...) (1 on tokens; None: every position is one)."""
        if routes is not None:
            routes = routes.reshape(-1, *routes.shape[-2:])
        real = mask.reshape(-1).bool() if mask is not None else None
        return Call(routes, self.replay, real, self.record, self.keep_grad)


@dataclass
class Record:
    layer: int
    logits: torch.Tensor  # (N, E) the router's logits
    ids: torch.Tensor  # (N, k) the experts the call routed to
    own: torch.Tensor  # (N, k) the router's own top k (before any replay)
    real: torch.Tensor | None  # (N,) bool, or None: every position
    engine: torch.Tensor | None  # (N, k) the engine's ids, FREE where none
    replayed: bool  # whether the call replays the engine's ids where it has them (else only compares)


@dataclass
class Routing:
    """The model's routing state: the current call (set by the layouts before each model call, kept until the
    next, so a checkpointed layer recomputed in backward routes as in its forward) and its records."""

    routers: list[Router]
    call: Call = field(default_factory=Call)
    records: list[Record] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)


def install(model: torch.nn.Module) -> Routing | None:
    """Hook the model's routers (once; None for a dense model). The hooks do nothing until a call asks."""
    state = model.__dict__.get(_ROUTING)
    if state is not None:
        return state
    found = routers(model)
    if not found:
        return None
    state = Routing(found)
    for router in found:
        state.handles.append(router.module.register_forward_hook(_hook(state, router, model.config)))
    model.__dict__[_ROUTING] = state
    return state


def state_of(model: torch.nn.Module) -> Routing | None:
    return model.__dict__.get(_ROUTING)


@contextmanager
def calling(model: torch.nn.Module, call: Call) -> Iterator[Routing | None]:
    """Route the next model call by ``call`` (a dense model: nothing). The call stays current after the block, for
    a checkpointed layer's recompute in backward, until the next one replaces it; its records add to those
    since :func:`begin`."""
    state = state_of(model)
    if state is not None:
        state.call = call
    yield state


def begin(model: torch.nn.Module) -> Routing | None:
    """Forget the records so far (before a micro-batch's forward); the model's routing state, or None."""
    state = state_of(model)
    if state is not None:
        state.records = []
    return state


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _hook(state: Routing, router: Router, config: Any):
    norm_by_config = bool(getattr(_text_config(config), "norm_topk_prob", False))

    def hook(module, args, output):
        call = state.call
        if call.routes is None and not call.record:
            return None
        logits, weights, ids = output
        own = ids
        engine = None
        if call.routes is not None:
            engine = call.routes[:, router.layer].to(ids.device)
            if engine.shape != ids.shape:
                raise MoEError(
                    f"router replay: layer {router.layer} routes {tuple(ids.shape)} positions x experts, the "
                    f"call carries {tuple(engine.shape)}: the routes are not laid out as the input ids"
                )
        if call.replay and engine is not None:
            if router.rule is None:
                raise MoEError(f"router replay: {type(module).__name__} is a router kuberl has no rule for")
            free = engine[:, :1] < 0
            ids = torch.where(free, ids, engine)
            probs = torch.softmax(logits.float(), dim=-1)
            weights = probs.gather(1, ids)
            if router.rule.norm == "always" or norm_by_config:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if router.rule.cast:
                weights = weights.to(logits.dtype)
        if call.record:
            real = call.real.to(ids.device) if call.real is not None else None
            kept = logits if call.keep_grad else logits.detach()
            state.records.append(
                Record(router.layer, kept, ids.detach(), own.detach(), real, engine, call.replay)
            )
        return logits, weights, ids

    return hook


# ----- statistics and losses ------------------------------------------------------------------------------
STAT_KEYS = (
    "moe/routing_mismatch",  # share of the engine's routing decisions the trainer's router would not make
    "moe/routing_replayed",  # share of the call's real (token, layer) decisions that were replayed
    "moe/load_imbalance",  # the busiest expert's load over the mean load, averaged over MoE layers (1: even)
    "moe/router_entropy",  # nats, the router's distribution per token, averaged over tokens and layers
)


def stat_sums(state: Routing) -> dict[str, torch.Tensor]:
    """Numerators and denominators (``key``, ``key/den``) of :data:`STAT_KEYS` over the call's records, 0-dim
    float64 tensors on the records' device: summed over micro-batches and ranks, then divided."""
    out: dict[str, torch.Tensor] = {}

    def add(key: str, num: torch.Tensor, den: torch.Tensor) -> None:
        for k, v in ((key, num), (f"{key}/den", den)):
            v = v.detach().to(torch.float64)
            out[k] = out[k] + v if k in out else v

    for rec in state.records:
        real = rec.real if rec.real is not None else torch.ones_like(rec.ids[:, 0], dtype=torch.bool)
        known = torch.zeros_like(real)
        if rec.engine is not None:
            known = real & (rec.engine[:, 0] >= 0)
            differs = (rec.own.sort(dim=-1).values != rec.engine.sort(dim=-1).values).any(dim=-1)
            add("moe/routing_mismatch", (differs & known).sum(), known.sum())
        if rec.replayed:  # a call without routes replays nothing: 0, not absent
            add("moe/routing_replayed", known.sum(), real.sum())
        experts = rec.logits.shape[-1]
        chosen = rec.ids[real]
        load = torch.bincount(chosen.flatten(), minlength=experts).to(torch.float64)
        if chosen.numel():
            add("moe/load_imbalance", load.max() / load.mean(), torch.ones((), device=load.device))
        probs = torch.softmax(rec.logits.detach()[real].float(), dim=-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        add("moe/router_entropy", entropy.sum(), real.sum())
    return out


def finish_stats(totals: dict[str, float]) -> dict[str, float]:
    """The step's :data:`STAT_KEYS` from summed numerators and denominators (popped from ``totals``); a key none
    of whose calls measured anything is absent, not 0."""
    out = {}
    for key in STAT_KEYS:
        num, den = totals.pop(key, 0.0), totals.pop(f"{key}/den", 0.0)
        if den > 0:
            out[key] = num / den
    return out


def aux_loss(state: Routing, load_balance_coef: float, z_loss_coef: float) -> torch.Tensor | None:
    """The router's auxiliary losses over the call's real tokens, summed over MoE layers (None when both are off):
    Switch-style load balancing, num_experts x sum_e (share of routed slots to e) x (mean router probability of
    e), 1 when even; and the z-loss, the mean squared logsumexp of the router logits."""
    if not (load_balance_coef or z_loss_coef) or not state.records:
        return None
    total = None
    for rec in state.records:
        real = rec.real if rec.real is not None else slice(None)
        logits = rec.logits[real].float()
        if not logits.shape[0]:
            continue
        term = logits.new_zeros(())
        if load_balance_coef:
            experts = logits.shape[-1]
            probs = torch.softmax(logits, dim=-1).mean(0)
            ids = rec.ids[real]
            share = torch.bincount(ids.flatten(), minlength=experts).to(probs.dtype) / ids.numel()
            term = term + load_balance_coef * experts * (share * probs).sum()
        if z_loss_coef:
            term = term + z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        total = term if total is None else total + term
    return total


# ----- routes as samples carry them ---------------------------------------------------------------------
def route_dtype(num_experts: int) -> np.dtype:
    """The narrowest dtype of an expert id, as vLLM returns them: uint8 up to 256 experts, else uint16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def take_routes(state: Routing) -> np.ndarray:
    """The routes the last recorded call took, (N, layers, k) over its N positions (a layer that is not MoE: 0),
    as an engine returns them; the records are then forgotten."""
    recs = state.records[-len(state.routers) :]
    layers = max(r.layer for r in state.routers) + 1
    n, k = recs[0].ids.shape
    out = np.zeros((n, layers, k), dtype=route_dtype(state.routers[0].num_experts))
    for rec in recs:
        out[:, rec.layer] = rec.ids.cpu().numpy()
    state.records = []
    return out


def sample_routes(routes: Any, prompt_len: int, response_len: int) -> np.ndarray | None:
    """An engine's routes for one sample as kuberl carries them: (prompt + response - 1, layers, k) uint8/uint16
    (the last sampled token is never fed back); None when there are none or too few (said by the caller)."""
    if routes is None:
        return None
    arr = np.asarray(routes)
    need = prompt_len + response_len - 1
    if arr.ndim != 3 or arr.shape[0] < need:
        return None
    return arr[:need]


def positions(
    routes: Sequence[np.ndarray | None], lengths: Sequence[int], layers: int, k: int
) -> list[torch.Tensor]:
    """Each sample's routes over its ``lengths[i]`` positions as (length, layers, k) int64, :data:`FREE` where
    it has none (a sample without routes, or its last position)."""
    out = []
    for arr, length in zip(routes, lengths):
        t = torch.full((length, layers, k), FREE, dtype=torch.int64)
        if arr is not None:
            n = min(length, arr.shape[0])
            t[:n] = torch.from_numpy(np.ascontiguousarray(arr[:n, :layers, :k]).astype(np.int64))
        out.append(t)
    return out


# ----- the start-up self-check ------------------------------------------------------------------------------
def refuse_unknown(model: torch.nn.Module) -> None:
    """:class:`MoEError` naming the model's router classes that :data:`RULES` has no rule for."""
    state = install(model)
    unknown = sorted({type(r.module).__name__ for r in state.routers if r.rule is None}) if state else []
    if unknown:
        raise MoEError(
            f"{type(model).__name__}: router replay has no rule for {', '.join(unknown)} (known: "
            f"{', '.join(sorted(RULES))}); set policy.moe.router_replay=false to train it without replay"
        )


@torch.no_grad()
def check_replay(model: torch.nn.Module, run: Callable[[Mode, np.ndarray | None], torch.Tensor]) -> str:
    """Replaying the model's own routes must give its own logprobs exactly. ``run(mode, routes)``: the logprobs of
    one sample of ``n`` tokens, laid out in one row of ``n`` positions, its routes (n - 1, layers, k) or None;
    called twice (with FSDP2, on every rank alike): recording, then replaying what it recorded. The one
    ``self-check:`` line, or :class:`MoEError` naming the router classes without a rule or the gap."""
    refuse_unknown(model)
    state = install(model)
    name = type(model).__name__.removeprefix("FSDP")  # FSDP2's class of the sharded root: its own name
    if state is None:
        return "self-check: router replay: a dense model, nothing to replay"
    training = model.training
    model.eval()
    try:
        begin(model)
        want = run(Mode(record=True), None)
        routes = take_routes(state)
        n = routes.shape[0]
        got = run(Mode(replay=True, record=True), routes[: n - 1])
        replayed = sum(
            int(((r.engine[:, 0] >= 0) if r.engine is not None else r.ids[:, 0] < 0).sum())
            for r in state.records
        )
    finally:
        begin(model)
        with calling(model, Call()):
            pass
        model.train(training)
    gap = float((got.float() - want.float()).abs().max())
    if gap != 0.0 or replayed != (n - 1) * len(state.routers):
        raise MoEError(
            f"{name}: replaying its own routes moves its logprobs by up to {gap:.3g} ({replayed} of "
            f"{(n - 1) * len(state.routers)} decisions replayed): its router computes gate weights otherwise than "
            "kuberl's rule; set policy.moe.router_replay=false"
        )
    return f"self-check: router replay reproduces {name}'s own logprobs exactly ({len(state.routers)} MoE layers)"
