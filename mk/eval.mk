# Checkpoints to Hugging Face models, and pass@k evaluation.
.PHONY: convert eval

CKPT        ?=
OUT         ?=
MODEL       ?=
DATA        ?=
ARGS        ?=

convert: setup ## Checkpoint -> HF model dir: make convert CKPT=checkpoints/RUN/step_N OUT=DIR [ARGS="--max-shard-size 2GB --dtype bfloat16"]
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "usage: make convert CKPT=checkpoints/RUN/step_N OUT=DIR [ARGS=\"--max-shard-size 2GB --dtype bfloat16 --overwrite\"]"; exit 2; }
	$(PY) -m trainer.tools.convert --checkpoint "$(CKPT)" --output "$(OUT)" $(ARGS)

eval: setup ## pass@k of a model on a dataset: make eval MODEL=PATH_OR_HF_ID DATA=math500 [ARGS="num_tests_per_prompt=4 ..."]
	@test -n "$(MODEL)" -a -n "$(DATA)" || { echo "usage: make eval MODEL=PATH_OR_HF_ID DATA=math500|gsm8k|arithmetic|local [ARGS=\"data_path=... num_tests_per_prompt=4 temperature=0.6 ...\"]"; exit 2; }
	$(PY) -m trainer.tools.eval model="$(MODEL)" data="$(DATA)" $(ARGS)
