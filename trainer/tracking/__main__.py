"""``python -m trainer.tracking [key=value ...]``: would a run started here reach its trackers?

The same checks a run makes before it starts (:func:`trainer.tracking.check`: the library installed,
W&B's API key, the tracking server answering), on the config a run would compose here (the default one,
``KUBERL_LOGGER_BACKENDS`` and the trackers' environment, then the overrides). The chart's ``helm test``
runs it in a pod beside the head, where the driver runs: exit 0 and one line saying what was checked,
or 1 and the line naming the problem.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from trainer import tracking
    from trainer.config import ConfigError, load

    try:
        cfg = load(list(sys.argv[1:] if argv is None else argv))
        tracking.check(cfg.logger)
    except (ConfigError, tracking.TrackerError) as e:
        print(f"kuberl: error: {e}", file=sys.stderr, flush=True)
        return 1
    described = []
    for name in cfg.logger.backends:
        if name == "wandb":
            name += f" ({tracking.wandb_mode(cfg.logger)})"
        elif name == "mlflow":
            name += f" ({tracking.mlflow_uri(cfg.logger)})"
        described.append(name)
    print(f"kuberl: trackers ok: {', '.join(described)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
