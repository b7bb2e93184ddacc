"""The refit: how a weight goes from the optimizer step to the engines that sample with it.

1. **The step.** Each policy rank holds a shard of every parameter (FSDP2) and its optimizer state;
   ``PolicyWorker.train`` ends with the optimizer step.
2. **The gather.** Every rank iterates :meth:`~trainer.policy.worker.PolicyWorker.iter_full_weights`
   (a collective): FSDP2 gathers one unit (a transformer block, or the root) at a time, the next one in
   flight, in the mixed-precision dtype, so a refit holds two layers, never the model. On GPUs every
   gather, copy and reshard runs on the stream current when the refit starts, and each tensor reaches its
   reader's stream behind an event (:mod:`trainer.policy.streams`). With LoRA only the adapters move
   (``iter_adapter_weights``).
3. **Colocated** (an engine in each policy rank's process, on its device): the rank loads the tensors
   into its own engine in place as they come (``refresh_engine``; on a GPU between waking the engine's
   weights and its KV cache, vLLM's sleep mode). Nothing crosses a process.
4. **Disaggregated** (engines in generation actors, on their own GPUs or cores): at start the driver waits
   for every engine to be built, then policy rank 0 and every engine's tensor-parallel workers open one
   group (:mod:`~trainer.generation.placement`). Each refit, rank 0 sends what the others gathered with
   it, in packed chunks, under vLLM's weight-transfer contract (:mod:`.transport`: the update info, names,
   dtypes and shapes, is known to every receiver before a byte moves):

   - on GPUs with a vLLM engine, vLLM's own code on both ends: rank 0's
     :class:`~.vllm_nccl.NcclSender` (``trainer_init`` and ``packed_nccl_broadcast_producer``, a CUDA
     stream per chunk) and the engine's ``NCCLWeightTransferEngine``;
   - on CPU with a vLLM engine, the same protocol over gloo: :class:`~.transport.GroupSender` and the
     engine's ``kuberl_gloo`` backend (:class:`~.vllm_nccl.GlooWeightTransferEngine`), registered in
     every vLLM process through the ``vllm.general_plugins`` entry point;
   - with the hf engine, on either device, :class:`~.transport.GroupSender` and the actor's receiver over
     a :class:`~.group.WeightSyncGroup` (NCCL on GPUs, gloo on CPU).

   Which sender rank 0 opens is decided in one place (:func:`.senders.open_sender`), and which backend a
   vLLM engine receives with in another (:func:`.transport.vllm_transfer_backend`).
5. **The engine.** vLLM loads the tensors through its ``load_weights`` (a quantized engine, FP8, through
   its layerwise reload, which quantizes them again); on CPU it then rebuilds its packed kernels
   (:mod:`trainer.generation.vllm_cpu`). The hf engine copies them into its model. Either way the prefix
   cache, computed with the old weights, is dropped.

A receiver that raises ends the run in one line naming it; a refit that stalls ends it after
``generation.refit_timeout_s`` (NCCL never times out), and a committed checkpoint is never touched.
"""
