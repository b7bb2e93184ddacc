"""``python -m trainer experiment=NAME key=value ...``: compose the config with Hydra, validate it
once, and train. Bad input ends in one line naming the problem and the fix, never a traceback.

``--cfg`` prints the composed config instead of training; ``--help`` lists the experiments and the sections,
``--help SECTION`` (``grpo.loss``) every key of a section with its type, default and doc.

The exit status says whether running the same command again can help (:func:`exit_code`; docs/cluster.md,
"When a run fails", has the same table):

====  ======================================================================================================
code  meaning
====  ======================================================================================================
0     done, or nothing to do (the checkpoint is already at ``grpo.max_num_steps``)
1     a bug: an error nobody anticipated, with its traceback
2     permanent: the config, or what it names, cannot work, and the same command fails the same way: a bad
      key or value, a model that is missing, has no weights or is of the wrong architecture (an actor whose
      constructor raised), a chat template or BOS the run cannot use, a checkpoint of another config. Under a
      RayJob the next attempts stop at start (:mod:`trainer.failures`)
3     failed, and a later retry may pass: the cluster did not offer the run's GPUs or CPUs in time, an engine
      or a reward model's replicas did not start in time, a refit failed, a step's rewards failed beyond
      ``env.reward_failure_budget``, another run holds the checkpoint directory, a server (the hub, a
      tracker) did not answer
4     lost a worker or the cluster (:data:`trainer.watchdog.LOST_EXIT`): resubmit, it resumes from the last
      complete checkpoint
130   interrupted (Ctrl-C)
143   preempted (SIGTERM): it saved if there was time; ``checkpointing.resume=auto`` continues
====  ======================================================================================================

No error line says "resubmit" for a permanent error, and none carries ANSI colour (Ray colours an actor's
error; :func:`trainer.failures.plain`); Ray's own prefixes on forwarded worker logs are plain when stderr is
not a terminal (``RAY_COLOR_PREFIX=0``, unless set).
"""

from __future__ import annotations

import logging
import os
import sys

from trainer import heap

# What a run's driver imports anyway (the loop, the tokenizer, Ray), imported before trainer.heap
# freezes the heap so that their objects are frozen too.
DRIVER_IMPORTS = ("torch", "ray", "transformers.models.auto.tokenization_auto", "trainer.loop.grpo")

USAGE = """usage: python -m trainer [--cfg] experiment=NAME [key=value ...]
       python -m trainer --help SECTION

Hydra overrides, e.g. grpo.max_num_steps=50 generation.placement=disaggregated logger.log_dir=/data/logs
  --cfg           print the composed config and exit
  --help SECTION  print every key of a section (e.g. grpo.loss, policy.moe) with its type, default and doc
experiments: {experiments}
sections: {sections}"""


def _help_topic(argv: list[str]) -> str | None:
    """The SECTION of ``--help SECTION`` (or ``--help=SECTION``); None for a plain ``--help``."""
    for i, arg in enumerate(argv):
        if arg.startswith("--help="):
            return arg.removeprefix("--help=")
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in ("-h", "--help") and following and not following.startswith("-") and "=" not in following:
            return following
    return None


PERMANENT_EXIT = 2  # the same command fails the same way: fix the config or what it names
RETRY_EXIT = 3  # a later retry may pass
PREEMPTED_EXIT = 143
INTERRUPTED_EXIT = 130


def _fail(message: str, code: int = PERMANENT_EXIT) -> int:
    from trainer.failures import plain

    print(f"kuberl: error: {plain(message)}", file=sys.stderr, flush=True)
    return code


def exit_code(error: BaseException) -> int | None:
    """The exit status for ``error`` (the table above); None for an error nobody anticipated (a bug: its
    traceback is the report)."""
    from trainer.config import ConfigError
    from trainer.failures import unreachable

    # Checked from their words too: a check that reads the hub or a tracker fails the same way when it does
    # not answer, and that a retry may fix (trainer.failures.unreachable).
    if isinstance(error, ConfigError):  # first: a bad name at start need not import the run's modules
        return RETRY_EXIT if unreachable(str(error)) else PERMANENT_EXIT
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_EXIT
    from ray.exceptions import RayActorError

    from trainer.checkpoint import CheckpointError
    from trainer.cluster import ClusterError
    from trainer.generation.placement import GenerationError
    from trainer.lease import LeaseError
    from trainer.models import ModelNotFoundError
    from trainer.preemption import Preempted
    from trainer.prestart import SetupError
    from trainer.rewards.actors import RewardModelError
    from trainer.rewards.runner import RewardFailureError
    from trainer.run import CheckpointSaveError
    from trainer.watchdog import LOST_EXIT, Lost

    if isinstance(error, LeaseError):  # another run holds the directory: it may end, or go stale
        return RETRY_EXIT
    if isinstance(error, (SetupError, ModelNotFoundError, CheckpointError)):
        return RETRY_EXIT if unreachable(str(error)) else PERMANENT_EXIT
    if isinstance(error, RayActorError) and error.actor_init_failed:  # its constructor raised
        return RETRY_EXIT if unreachable(str(error)) else PERMANENT_EXIT
    # An engine that did not start and a refit that failed are both a GenerationError: it is retried.
    # A save that failed leaves the last complete checkpoint: a retry resumes from it once space is freed.
    if isinstance(
        error, (ClusterError, GenerationError, RewardModelError, RewardFailureError, CheckpointSaveError)
    ):
        return RETRY_EXIT
    if isinstance(error, Lost):  # the line says what was lost, and where a resubmission resumes from
        return LOST_EXIT
    if isinstance(error, Preempted):
        return PREEMPTED_EXIT
    return None


def _end(cfg, error: BaseException) -> int:
    """Print ``error``'s line and return its exit status; a permanent one is remembered for a RayJob's
    retries (trainer.failures). Re-raises an error nobody anticipated."""
    from trainer.failures import actor_init_failure, plain, remember

    code = exit_code(error)
    if code is None:
        raise error
    if code == INTERRUPTED_EXIT:
        line = "interrupted"
    elif code == PREEMPTED_EXIT:
        line = f"{error}; rerun with checkpointing.resume=auto to continue"
    else:
        line = plain(actor_init_failure(error) or str(error))
    return _fail(remember(cfg, line) if code == PERMANENT_EXIT else line, code)


def main(argv: list[str] | None = None) -> int:
    from trainer.cluster import quiet

    quiet()
    if not sys.stderr.isatty():  # Ray colours the prefix of every worker line it forwards, in a file too
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    argv = list(sys.argv[1:] if argv is None else argv)
    from trainer.config import ConfigError, describe, experiments, load, sections

    if {"-h", "--help"} & set(argv) or any(a.startswith("--help=") for a in argv):
        topic = _help_topic(argv)
        if topic is None:
            print(USAGE.format(experiments=", ".join(experiments()), sections=", ".join(sections())))
            return 0
        try:
            print(describe(topic))
        except ConfigError as e:
            return _fail(str(e))
        return 0
    show = "--cfg" in argv
    flags = [a for a in argv if a.startswith("-") and a != "--cfg"]
    if flags:
        return _fail(
            f"unknown option {flags[0]}; options are --cfg and --help, the rest are key=value overrides"
        )
    from trainer.failures import recall
    from trainer.prestart import check_names

    try:
        cfg = load([a for a in argv if a != "--cfg"])
    except ConfigError as e:
        return _fail(str(e))
    # An earlier attempt of this RayJob found a permanent error under this config: end now, before a name is
    # checked, Ray starts or anything loads (trainer.failures).
    refusal = None if show else recall(cfg)
    if refusal:
        return _fail(refusal, PERMANENT_EXIT)
    try:
        check_names(cfg)  # the registries' names, before --cfg prints the config or a run builds anything
    except ConfigError as e:
        return _end(cfg, e)
    if show:
        import yaml

        from trainer.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer.run import train

    heap.settle(*DRIVER_IMPORTS)

    try:
        train(cfg)
    except BaseException as e:  # exit_code sorts it; what nobody anticipated is re-raised
        return _end(cfg, e)
    return 0


if __name__ == "__main__":
    heap.pause()  # until the driver's imports are done (trainer.heap)
    sys.exit(main())
