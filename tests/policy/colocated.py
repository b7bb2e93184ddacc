"""A real PolicyWorker (one gloo rank, in this process) with a colocated engine that records every call the
worker makes, shared by the tests of the colocated refit (tests/policy/test_colocated_refit.py) and of its
stream rule (tests/policy/test_refit_streams.py); import the ``worker`` fixture from here."""

from __future__ import annotations

import pytest
import torch

from tests.policy.helpers import one_rank_worker
from trainer.generation.base import Completion
from trainer.policy.batch import Sample


class RecordingEngine:
    """Answers like an engine and writes each call the worker makes into ``calls``."""

    reloads_every_weight = False

    def __init__(self, calls: list):
        self.calls = calls
        self.loaded: dict[str, torch.Tensor] = {}

    def generate(self, prompts, n, params):
        self.calls.append("generate")
        return [[Completion([5, 6], [-1.0, -1.0], "ab", "length") for _ in range(n)] for _ in prompts]

    def update_weights(self, named_tensors):
        self.calls.append("update_weights")
        for name, tensor in named_tensors:  # consumed as an engine does: the gathers happen here
            self.loaded[name] = tensor.detach().clone()

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def shutdown(self):
        pass


@pytest.fixture
def worker(request, tiny_model_path, monkeypatch):
    """A real PolicyWorker (world of 1, gloo) with a recording engine; ``worker.calls`` is the record.
    Indirect parameter: a dict of ``kl`` (the KL penalty; default 0: no reference model), ``freeze``
    (policy.freeze patterns) and ``reloads`` (the engine's ``reloads_every_weight``)."""
    from trainer.generation import factory

    calls: list[str] = []
    options = getattr(request, "param", {})
    engine = RecordingEngine(calls)
    engine.reloads_every_weight = options.get("reloads", False)
    monkeypatch.setattr(factory, "build_engine", lambda gen, spec: engine)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    overrides = [
        "cluster.keep_freed_memory=false",
        f"grpo.loss.reference_policy_kl_penalty={options.get('kl', 0.0)}",
        f"policy.freeze=[{','.join(options.get('freeze', []))}]",
    ]
    with one_rank_worker(tiny_model_path, overrides, colocated_engine=True) as w:
        w.calls = calls

        def note(label: str):
            def hook(*_):
                # a pass of several forwards (prompt, then responses) is one
                if not calls or calls[-1] != label:
                    calls.append(label)

            return hook

        # The policy's own device work goes into the record beside the engine's calls.
        # On the embeddings: the logprob forward runs the model through an FSDP forward method of its own
        # (trainer/policy/forward.py), which the top module's hooks do not see.
        w.model.get_input_embeddings().register_forward_pre_hook(note("policy forward"))
        if w.ref_model is not None:
            w.ref_model.get_input_embeddings().register_forward_pre_hook(note("reference forward"))
        w.optimizer.register_step_post_hook(note("optimizer step"))
        yield w


def train_step(w, samples: list[Sample]) -> None:
    tokens = float(sum(len(s.response_ids) for s in samples))
    w.train([samples], [{"tokens": tokens, "seqs": float(len(samples))}])
