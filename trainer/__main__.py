"""``python -m trainer experiment=NAME key=value ...``: compose the config with Hydra, validate it
once, and train. Bad input ends in one line naming the problem and the fix, never a traceback.

``--cfg`` prints the composed config instead of training; ``--help`` lists the experiments and the sections,
``--help SECTION`` (``grpo.loss``) every key of a section with its type, default and doc.
"""

from __future__ import annotations

import logging
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


def _fail(message: str, code: int = 2) -> int:
    print(f"kuberl: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    from trainer.cluster import quiet

    quiet()
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
    from trainer.prestart import check_names

    try:
        cfg = load([a for a in argv if a != "--cfg"])
        check_names(cfg)  # the registries' names, before --cfg prints the config or a run builds anything
    except ConfigError as e:
        return _fail(str(e))
    if show:
        import yaml

        from trainer.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer.checkpoint import CheckpointError
    from trainer.cluster import ClusterError
    from trainer.generation.placement import GenerationError
    from trainer.models import ModelNotFoundError
    from trainer.preemption import Preempted
    from trainer.prestart import SetupError
    from trainer.rewards.reward_model import RewardModelError
    from trainer.rewards.runner import RewardFailureError
    from trainer.run import train
    from trainer.watchdog import LOST_EXIT, Lost

    heap.settle(*DRIVER_IMPORTS)

    try:
        train(cfg)
    except ConfigError as e:  # a name a component checks when it is built (check_names ran them above)
        return _fail(str(e))
    except (
        ClusterError,
        ModelNotFoundError,
        CheckpointError,
        SetupError,
        GenerationError,
        RewardModelError,
        RewardFailureError,
    ) as e:
        return _fail(str(e), 3)
    except Lost as e:  # a worker or the cluster is gone: the line says which, and where to resume
        return _fail(str(e), LOST_EXIT)
    except Preempted as e:
        return _fail(f"{e}; rerun with checkpointing.resume=auto to continue", 143)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return 0


if __name__ == "__main__":
    heap.pause()  # until the driver's imports are done (trainer.heap)
    sys.exit(main())
