"""The command-line tools beside the run: ``python -m trainer.tools.NAME``.

``plan`` (will an experiment fit its GPUs), ``preflight`` (what a cluster lacks for a release), ``submit``
(experiments through the Ray Jobs API), ``eval`` (pass@k of a model), ``convert`` (a checkpoint as a Hugging
Face directory) and ``passk`` (the unbiased pass@k estimator ``eval`` reports). Each imports the run core
it needs; the run core never imports a tool (the import-linter layers in pyproject.toml check both).
"""
