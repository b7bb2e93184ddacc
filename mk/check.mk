# The checks the anchors run (CONTRIBUTING.md: make check): lint, format, types, layers, and the chart's scripts.
# `.ci/run` runs `make check` before `make test`; .pre-commit-config.yaml runs the same tools on commit.
.PHONY: check format typecheck

# The Python the checks read: the trainer, its tests and the benchmarks.
CHECK_PATHS := trainer tests bench

# mypy's module list: the core whose types are a contract (pyproject.toml [tool.mypy] files).
# check-chart (shellcheck on the chart's scripts) runs when mk/chart.mk defines it: `make -q` exits 2
# only for a target no rule makes.
check: setup ## ruff check, ruff format --check, mypy on the core modules, import-linter, shellcheck on the chart's scripts
	$(VENV)/bin/ruff check $(CHECK_PATHS)
	$(VENV)/bin/ruff format --check $(CHECK_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@$(MAKE) --no-print-directory -q check-chart >/dev/null 2>&1; \
	  if [ $$? -ne 2 ]; then $(MAKE) --no-print-directory check-chart; \
	  else echo "no check-chart target: the chart's scripts are not checked"; fi

format: setup ## Apply ruff's formatter and its import sorting to trainer, tests and bench
	$(VENV)/bin/ruff check --select I --fix $(CHECK_PATHS)
	$(VENV)/bin/ruff format $(CHECK_PATHS)

typecheck: setup ## mypy on the core modules listed in pyproject.toml
	$(VENV)/bin/mypy
