"""The packed weight transport between two real processes, under vLLM's NCCL contract: this test is the
sender (rank 0, the policy's side); a subprocess is the receiver, which is told only the update info
(names, dtype_names, shapes) and the init info, as vLLM's engines are. Both ends leave the group with
:meth:`WeightSyncGroup.close`, as the policy and the generation actors do.

The chunking rule is checked against vLLM's own ``pack_tensors`` (the GPU path packs with it). The vLLM
case sends perturbed weights of the tiny model into a vLLM engine in the other process through the
``kuberl_gloo`` twin that vLLM's plugin entry point registered, and checks that engine's logprobs against
transformers with the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from trainer.generation.refit.group import WeightSyncGroup
from trainer.generation.refit.transport import WeightMeta, chunks, init_info, send_packed
from trainer.ports import free_port


def _meta(named) -> WeightMeta:
    return WeightMeta.of((name, t.shape, t.dtype) for name, t in named)


def _free_port() -> int:
    return free_port("127.0.0.1")  # outside the ephemeral range (trainer.ports)


def _start_receiver(code: str, port: int, out: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(port), out, *extra])


def _join(proc: subprocess.Popen, timeout: float) -> None:
    try:
        assert proc.wait(timeout=timeout) == 0, "the receiver failed (its output is above)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


RAW_RECEIVER = """
    import json, sys, torch
    from trainer.generation.refit.transport import WeightMeta, receive_packed, receive_tensors
    from trainer.generation.refit.group import WeightSyncGroup

    first, second = (WeightMeta.from_update_info(json.loads(a)) for a in sys.argv[3:5])
    group = WeightSyncGroup("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, device=torch.device("cpu"))
    got = {"chunks": [], "first": {}}
    for chunk in receive_packed(group, first, 32 * 1024):
        got["chunks"].append([name for name, _ in chunk])
        got["first"].update((name, t.clone()) for name, t in chunk)  # clones: torch.save keeps views as views
    got["second"] = {name: t.clone() for name, t in receive_tensors(group, second, 32 * 1024)}  # same group
    assert group.close(), "the sender did not meet this receiver at close"
    torch.save(got, sys.argv[2])
"""


@pytest.mark.integration  # a Python interpreter of its own
def test_should_deliver_names_dtypes_and_shapes_in_chunks_when_sent_between_processes(tmp_path):
    torch.manual_seed(0)
    first = [
        ("a.weight", torch.randn(64, 64)),  # 16 KiB
        ("a.bias", torch.randn(64).to(torch.bfloat16)),
        ("b.weight", torch.randn(300, 64)),  # 75 KiB: larger than a chunk, closes it
        ("b.index", torch.arange(7, dtype=torch.int64)),
        ("c.scalar", torch.tensor(3.5)),
        ("c.transposed", torch.randn(32, 16).t()),  # not contiguous
    ]
    second = [("z.weight", torch.randn(5, 3, 2).to(torch.float16)), ("z.empty", torch.zeros(0, 4))]
    port, out = _free_port(), str(tmp_path / "got.pt")
    infos = [json.dumps(_meta(t).update_info()) for t in (first, second)]
    proc = _start_receiver(RAW_RECEIVER, port, out, *infos)
    try:
        group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
        stats = send_packed(group, iter(first), _meta(first), 32 * 1024)  # 32 KiB chunks
        send_packed(group, iter(second), _meta(second), 32 * 1024)
        assert group.close() and group.closed
    finally:
        _join(proc, timeout=120)
    got = torch.load(out)
    assert stats.tensors == len(first) and stats.buckets == 2
    assert got["chunks"] == [["a.weight", "a.bias", "b.weight"], ["b.index", "c.scalar", "c.transposed"]]
    assert list(got["second"]) == ["z.weight", "z.empty"]
    for key, sent in (("first", first), ("second", second)):
        for name, tensor in sent:
            received = got[key][name]
            assert received.dtype == tensor.dtype and received.shape == tensor.shape
            assert torch.equal(received, tensor)


def test_should_refuse_to_send_what_the_update_info_did_not_announce():
    class Nobody:
        def broadcast(self, tensor):
            return tensor

    named = [("a", torch.zeros(2, 2)), ("b", torch.zeros(3))]
    with pytest.raises(ValueError, match=r"tensor 1 is \('b', 'float32', \[3\]\), the update info announced"):
        send_packed(Nobody(), iter(named), _meta([named[0], ("b", torch.zeros(4))]), 1024)
    with pytest.raises(ValueError, match="1 tensors sent, 2 announced"):
        send_packed(Nobody(), iter(named[:1]), _meta(named), 1024)


@pytest.mark.vllm
def test_should_chunk_as_vllms_packed_producer_does_when_given_the_same_tensors():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    torch.manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 3000, (60,))] + [9000, 1, 4096, 4097]
    named = [
        (f"t{i}", torch.zeros(n, dtype=torch.bfloat16 if i % 3 else torch.float32))
        for i, n in enumerate(sizes)
    ]
    for buffer in (1, 4096, 8192, 10**6):
        theirs, it = [], iter(named)
        with warnings.catch_warnings():  # "exceeds buffer_size_bytes": the case under test
            warnings.simplefilter("ignore")
            while (chunk := pack_tensors(it, lambda item: item[1], buffer)) is not None:
                theirs.append(chunk.names)
        ours = [[named[i][0] for i in part] for part in chunks(_meta(named), buffer)]
        assert ours == theirs, buffer


def test_should_give_each_tensor_parallel_worker_the_rank_vllms_nccl_engine_gives_it():
    from trainer.generation.refit.transport import worker_rank

    # Two engines of TP 2 after the sender: engine 1's workers are ranks 3 and 4 of a world of 5.
    info = init_info("10.0.0.1", 29500, rank_offset=1 + 1 * 2, world_size=5)
    assert [worker_rank(info["rank_offset"], 0, 2, r) for r in range(2)] == [3, 4]
    assert info["packed"] and info["master_address"] == "10.0.0.1"


EXITING_RECEIVER = """
    import sys, torch
    from trainer.generation.refit.transport import WeightMeta, receive_tensors
    from trainer.generation.refit.group import WeightSyncGroup

    group = WeightSyncGroup("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, device=torch.device("cpu"))
    meta = WeightMeta(["a", "b", "c"], ["float32"] * 3, [[8], [3, 3], [1]])
    assert sum(1 for _ in receive_tensors(group, meta, 40)) == 3
    # No close(): the interpreter exits right after the last broadcast, the moment the gloo worker
    # thread may still be dropping that broadcast's tensors (SIGABRT at exit before the atexit hook).
"""


@pytest.mark.integration  # a Python interpreter of its own
def test_should_exit_cleanly_when_a_receiver_ends_right_after_its_last_broadcast(tmp_path):
    ports = [_free_port() for _ in range(6)]  # 6 receivers at once: before the fix 4 in 10 aborted
    procs = [_start_receiver(EXITING_RECEIVER, port, "-") for port in ports]
    try:
        for port in ports:
            group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
            named = [("a", torch.randn(8)), ("b", torch.randn(3, 3)), ("c", torch.ones(1))]
            send_packed(group, named, _meta(named), 40)  # 40 bytes: every tensor a broadcast of its own
            group.abandon()
    finally:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=120))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert codes == [0] * len(procs), f"receiver exit codes {codes} (-6: aborted at exit)"


@pytest.mark.integration  # a Python interpreter of its own
def test_should_close_without_waiting_forever_when_the_receiver_is_gone():
    port = _free_port()
    proc = _start_receiver(
        """
        import sys, os, torch
        from trainer.generation.refit.group import WeightSyncGroup
        WeightSyncGroup("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, device=torch.device("cpu"))
        os._exit(0)  # gone without a word, as a killed actor is
        """,
        port,
        "-",
    )
    group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
    proc.wait(timeout=60)
    assert group.close(timeout_s=2) is False and group.closed
    assert group.close() is True  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        group.broadcast(torch.zeros(1))


VLLM_RECEIVER = """
    import json, sys
    from trainer.config import GenerationConfig
    from trainer.generation.base import SamplingParams
    from trainer.generation.vllm_engine import VLLMGenerationEngine
    from trainer.models import resolve_model

    engine = VLLMGenerationEngine(
        resolve_model("builtin:tiny"), GenerationConfig(), "float32", seed=0, max_model_len=256, threads=1,
        weight_transfer=True,
    )
    try:
        engine.init_weight_receiver(json.loads(sys.argv[3]))
        engine.receive_weights(json.loads(sys.argv[4]))
        engine.close_weight_receiver()  # in step with the sender's close(); the engine keeps generating
        out = engine.generate([[2, 8, 9, 10]], 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
        with open(sys.argv[2], "w") as f:
            json.dump([[c.token_ids, c.logprobs] for c in out[0]], f)
    finally:
        engine.shutdown()
"""


@pytest.mark.vllm
def test_should_generate_with_sent_weights_when_a_vllm_engine_receives_them_over_gloo(
    tiny_model_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # the tied embedding included: lm_head must follow it
            p.add_(0.05 * torch.randn_like(p))
    port, out = _free_port(), str(tmp_path / "completions.json")
    meta = _meta(model.named_parameters())
    info = init_info("127.0.0.1", port, rank_offset=1, world_size=2, buffer_bytes=16 * 1024)  # 16 KiB chunks
    proc = _start_receiver(VLLM_RECEIVER, port, out, json.dumps(info), json.dumps(meta.update_info()))
    try:
        group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
        stats = send_packed(group, model.named_parameters(), meta, 16 * 1024)
        assert group.close(), "the engine's receiver did not meet the sender at close"
    finally:
        _join(proc, timeout=300)
    assert stats.buckets > 3  # several chunks, each cut where the update info says
    prompt = [2, 8, 9, 10]
    with open(out) as f:
        samples = json.load(f)
    with torch.no_grad():
        for ids, logprobs in samples:
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]  # (L, V)
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            # float32 on both sides; vLLM's fused qkv/gate_up kernels add only rounding.
            assert (expected - torch.tensor(logprobs)).abs().max().item() < 1e-3


FAILING_VLLM_RECEIVER = """
    import json, sys
    from trainer.config import GenerationConfig
    from trainer.generation.vllm_engine import VLLMGenerationEngine
    from trainer.models import resolve_model

    engine = VLLMGenerationEngine(
        resolve_model("builtin:tiny"), GenerationConfig(), "float32", seed=0, max_model_len=256, threads=1,
        weight_transfer=True,
    )
    try:
        engine.init_weight_receiver(json.loads(sys.argv[3]))
        try:
            engine.receive_weights(json.loads(sys.argv[4]))
            said = "no error"
        except Exception as e:
            said = f"{type(e).__name__}: {e}".splitlines()[0]
        engine.close_weight_receiver()  # vLLM lets the trainer go only when no update is left open
        with open(sys.argv[2], "w") as f:
            f.write(said)
    finally:
        engine.shutdown()
"""


@pytest.mark.vllm
def test_should_report_the_loads_own_error_when_a_vllm_engine_receives_a_weight_it_does_not_have(
    tiny_model_path, tmp_path
):
    """A refit whose update info names a weight the engine does not have: the engine's error is vLLM's own
    (the name it could not place), not a complaint about the update's bookkeeping."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    named = [*model.named_parameters(), ("model.layers.0.mlp.bogus_proj.weight", torch.zeros(4, 4))]
    port, out = _free_port(), tmp_path / "said.txt"
    meta = _meta(named)
    # One chunk: the whole stream is sent before the receiver meets the unknown name, so the sender is not
    # left in a broadcast nobody receives.
    info = init_info("127.0.0.1", port, rank_offset=1, world_size=2, buffer_bytes=2**30)
    proc = _start_receiver(
        FAILING_VLLM_RECEIVER, port, str(out), json.dumps(info), json.dumps(meta.update_info())
    )
    try:
        group = WeightSyncGroup("127.0.0.1", port, rank=0, world_size=2, device=torch.device("cpu"))
        send_packed(group, iter(named), meta, 2**30)
        assert group.close(), "the engine's receiver did not meet the sender at close"
    finally:
        _join(proc, timeout=300)
    said = out.read_text()
    assert "finish_weight_update" not in said, said
    assert said.startswith("ValueError: ") and "bogus_proj" in said, said
