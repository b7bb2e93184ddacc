"""`make bench-gpu`'s path, on CPU: the GPU check that a lent H100/H200 runs in one call must be right before a
GPU is lent, so its parts run here. The profile split is held to time lines split by hand (streams that
overlap, a thread's nested ops, the profiler's GPU-side annotation ranges that span idle gaps); the kernel
names are real ones from CUDA profiles; and the bench itself runs end to end at the smallest size, with the
packages a GPU machine lacks (Hydra, omegaconf, vLLM, peft, datasets, tensorboard) made unimportable, and
writes its JSON: every row run or saying why, every profile split adding up to its step's wall time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from .conftest import REPO


def bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "bench" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_should_share_overlapping_kernel_time_and_count_the_gaps_as_idle_when_two_streams_run() -> None:
    bt = bench_train()
    gemm, add = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "vectorized_elementwise_kernel<CUDAFunctor_add>"
    events = [
        ("s1", 1.0, 4.0, bt.bucket_of(gemm)),
        ("s1", 5.0, 6.0, bt.bucket_of("Memcpy DtoD (Device -> Device)")),
        ("s2", 3.0, 5.0, bt.bucket_of(add)),
        ("s2", 8.0, 9.0, bt.bucket_of("ncclDevKernel_AllGather_RING_LL")),
        ("s2", 9.5, 12.0, bt.bucket_of(add)),  # runs past the window's end: only its first 0.5 counts
    ]
    spent = bt.split_time(events, (0.0, 10.0))
    # By hand: gemm alone 1-3 (2), gemm and add together 3-4 (0.5 each), add alone 4-5 (1), the copy 5-6,
    # the gather 8-9, add 9.5-10 (0.5); nothing runs 0-1, 6-8, 9-9.5: idle 3.5.
    assert spent == pytest.approx(
        {"matmul": 2.5, "other elementwise": 2.0, "copies, casts": 1.0, "collectives": 1.0, "idle": 3.5}
    )
    split = bt.coarse_split(spent)
    assert list(split) == list(bt.SPLIT)
    assert split == pytest.approx(
        {
            "matmul": 2.5,
            "attention": 0.0,
            "copies, casts": 1.0,
            "elementwise": 2.0,
            "collectives": 1.0,
            "idle": 3.5,
        }
    )
    assert sum(split.values()) == pytest.approx(10.0)


def test_should_give_each_instant_to_the_innermost_op_when_a_thread_nests_them() -> None:
    bt = bench_train()
    events = [
        ("t1", 0.0, 10.0, bt.bucket_of("aten::linear")),
        ("t1", 1.0, 8.0, bt.bucket_of("aten::addmm")),
        ("t1", 2.0, 3.0, bt.bucket_of("aten::copy_")),
        ("t1", 11.0, 12.0, bt.bucket_of("aten::add")),
    ]
    spent = bt.split_time(events, (0.0, 15.0))
    # linear's own time 0-1 and 8-10 (3), addmm's 1-2 and 3-8 (6), the copy 2-3, add 11-12; idle 10-11, 12-15.
    assert spent == pytest.approx(
        {"matmul": 9.0, "copies, casts": 1.0, "other elementwise": 1.0, "idle": 4.0}
    )


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
        ("cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_32x6_tn_align1", "matmul"),
        ("triton_tem_fused_mm_0", "matmul"),
        ("aten::mm", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>>", "attention"),
        ("fmha_cutlassB_bf16_aligned_128x64_k128_sm80", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("Memcpy HtoD (Pinned -> Device)", "copies, casts"),
        ("Memset (Device)", "copies, casts"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copies, casts"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 2, 64, 64>", "copies, casts"),
        ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<c10::BFloat16, c10::BFloat16>", "copies, casts"),
        ("aten::_to_copy", "copies, casts"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
        ("triton_poi_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
        ("triton_red_fused__to_copy_mul_sum_1", "elementwise"),
        ("## Call CompiledFxGraph fcxli7wdzzzd5aretukh6xxv6cr66stm5345mb267wlxhc5lkzqq ##", "elementwise"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>", "elementwise"),
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "elementwise"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ],
)  # fmt: skip
def test_should_put_a_kernel_or_op_in_its_part_of_the_split_when_named_as_profiles_name_it(
    name, split
) -> None:
    bt = bench_train()
    assert bt.coarse_split({bt.bucket_of(name): 1.0})[split] == 1.0


def test_should_leave_annotation_ranges_and_host_ops_out_when_it_reads_a_gpu_profile() -> None:
    """A ``record_function`` range shows on the GPU's timeline too (a CUDA event marked ``is_user_annotation``):
    counted, it would fill the step's idle gaps with its own name. A CPU op's device time is its kernels'."""
    from torch.autograd import DeviceType

    bt = bench_train()

    def event(name, start_us, end_us, device=DeviceType.CUDA, annotation=False, stream=7, thread=1):
        return SimpleNamespace(
            name=name, device_type=device, is_user_annotation=annotation, is_async=False, thread=thread,
            device_index=0, device_resource_id=stream, time_range=SimpleNamespace(start=start_us, end=end_us),
        )  # fmt: skip

    events = [
        event(bt.STEP_MARK, 0, 10e6, device=DeviceType.CPU, annotation=True),
        event(bt.STEP_MARK, 0, 10e6, annotation=True),  # its projection on the GPU's timeline
        event("FSDP::post_backward", 1e6, 9e6, annotation=True),
        event("aten::mm", 1e6, 2e6, device=DeviceType.CPU),
        event("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 2e6, 4e6),
        event("Memcpy DtoD (Device -> Device)", 5e6, 6e6, stream=9),
    ]
    gpu = bt.split_time(bt.timed_events(events, gpu=True), (0.0, 10.0))
    assert gpu == pytest.approx({"matmul": 2.0, "copies, casts": 1.0, "idle": 7.0})
    # The same events read as a CPU profile: the CPU op alone owns time (FSDP's range and the step's are host).
    cpu = bt.split_time(bt.timed_events(events, gpu=False), (0.0, 10.0))
    assert cpu == pytest.approx({"matmul": 1.0, "idle": 9.0})


def test_should_read_a_real_profile_and_add_up_to_its_wall_when_the_step_runs_matmuls() -> None:
    """torch's own profiler, read both ways: as a CPU profile (the matmuls are most of the step) and as a GPU
    one, whose Python runs here as on a GPU (the step's range, device events by stream): with no CUDA kernel
    here the whole step is idle."""
    import torch

    bt = bench_train()
    a = torch.randn(256, 256)

    def step() -> None:
        for _ in range(20):
            torch.mm(a, a)

    cpu = bt.profile_step(step, gpu=False)
    assert sum(cpu["split"].values()) == pytest.approx(cpu["wall_s"], rel=1e-9)
    assert sum(cpu["detail"].values()) == pytest.approx(cpu["wall_s"], rel=1e-9)
    # What the ops' spans hold, not how the wall divides: on a loaded machine the gaps between ops (idle)
    # can be most of the step, while the matmuls' spans stay most of the time spent in ops.
    others = sum(v for k, v in cpu["split"].items() if k not in ("matmul", "idle"))
    assert cpu["split"]["matmul"] > 0 and cpu["split"]["matmul"] > others, cpu
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available, disabling CUDA profiling", here
        gpu = bt.profile_step(step, gpu=True)  # CPU tensors: no kernel on a GPU machine either
    assert gpu["split"]["idle"] == pytest.approx(gpu["wall_s"]) and gpu["wall_s"] > 0, gpu


# Made unimportable in the bench's processes, as on the GPU machine (torch, transformers and their own
# dependencies only). Ray stays: a CPU rank sets its threads through trainer.cluster, which imports it; a GPU
# rank never does (PolicyWorker.__init__).
ABSENT_ON_THE_GPU_MACHINE = ("hydra", "omegaconf", "vllm", "peft", "datasets", "tensorboard", "math_verify")


@pytest.mark.slow
def test_should_write_every_row_and_splits_that_add_up_when_bench_gpu_runs_at_the_smallest_size(
    tmp_path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {ABSENT_ON_THE_GPU_MACHINE!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError; importlib.util.find_spec says absent\n"
    )
    out = tmp_path / "results" / "bench-gpu.json"
    # make bench-gpu's rows (mk/bench.mk), on the tiny Llama, a CPU rank, one step each.
    proc = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--model", "builtin:tiny", "--layouts", "packed",
         "--heads", "tiled,fused", "--compile", "off,on", "--prompts", "1", "--group", "2",
         "--max-response", "32", "--repeats", "1", "--no-memory", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["packed/tiled", "packed/fused", "packed/tiled+compile", "packed/fused+compile"]
    assert rows["packed/tiled"]["status"] == "ok", rows["packed/tiled"]  # the baseline always runs
    for name, row in rows.items():
        if row["status"] != "ok":
            assert row["reason"], name  # a row that did not run says why, in the table too
            assert any(line.startswith(name) and row["reason"] in line for line in proc.stdout.splitlines())
            continue
        assert row["median_s"] > 0 and 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0, row
        profile = row["profile"]
        assert list(profile["split"]) == list(result["split_categories"])
        assert sum(profile["split"].values()) == pytest.approx(profile["wall_s"], rel=1e-6)
        assert profile["split"]["matmul"] > 0, profile
    assert result["checks_passed"] is True
    assert result["batch"]["tokens"] > 0 and result["peak_flops"] > 0
