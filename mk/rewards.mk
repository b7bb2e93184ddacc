# Code rewards: the sandbox's system packages, and the reward-throughput benchmark; the math rewards
# against reasoning-gym's own scorers (bench/bench_reward_crosscheck.py).
.PHONY: sandbox-deps bench-rewards bench-reward-crosscheck

TEST_DEPS += sandbox-deps
BENCH_REWARDS_ARGS ?=
BENCH_REWARDS_CROSSCHECK_ARGS ?= --n 36 --seed 47

# bubblewrap is the sandbox (the job image installs it too); where it cannot be installed the code
# rewards refuse to run model code unless KUBERL_SANDBOX=rlimit-without-isolation says to run it without
# bubblewrap (trainer/sandbox/backends.py), and the tests of bubblewrap skip, so a failed install is not an error.
sandbox-deps: ## Install bubblewrap and g++ for the code sandbox when missing (apt; tolerated if it fails)
	@missing=""; command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing$$missing"; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null 2>&1 \
	      || echo "sandbox-deps: could not install$$missing; code rewards need KUBERL_SANDBOX=rlimit-without-isolation"; \
	  else echo "sandbox-deps: not root or no apt-get; install$$missing yourself for the bubblewrap sandbox"; fi; \
	fi

bench-rewards: setup sandbox-deps ## Code-reward throughput (sandbox vs a serial baseline), then the math rewards' cross-check
	$(PY) bench/bench_rewards.py $(BENCH_REWARDS_ARGS)
	$(PY) bench/bench_reward_crosscheck.py $(BENCH_REWARDS_CROSSCHECK_ARGS)

# For every reasoning-gym task whose answers are numbers or expressions: math (gsm8k, arithmetic where they
# apply) against the task's own scorer, honest answers in three styles, wrong answers and near misses, each
# call under a 1 s CPU limit; prints the table by task and exits 1 unless honest >= 99 %, wrong paid 0.
bench-reward-crosscheck: setup ## Math rewards vs reasoning-gym's own scorers: the table by task (BENCH_REWARDS_CROSSCHECK_ARGS)
	$(PY) bench/bench_reward_crosscheck.py $(BENCH_REWARDS_CROSSCHECK_ARGS)
