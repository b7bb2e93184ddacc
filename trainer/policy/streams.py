"""The stream rule of a refit: gathered weights are produced on one stream and handed to whichever
stream reads them, fenced by an event.

A refit's consumer does not read on the stream the policy worked on. vLLM 0.32's packed NCCL producer
(``packed_nccl_broadcast_producer``, what policy rank 0 sends with on GPUs) calls ``next()`` on our
iterator inside ``torch.cuda.stream(streams[i])`` and moves to the next of its streams after every
packed chunk, synchronising only the stream it is about to reuse. FSDP2's ``unshard(async_op=True)``
issues its all-gather on the stream current at the call and ``wait()`` copies the result out on the
stream current at the wait; ``reshard()`` frees that memory. Left to run under the consumer's streams,
a unit gathered and copied out on stream 0 is read by stream 1 with nothing ordering the two, and its
storage can be freed and reused while the other stream still reads it: the engine would receive stale
or garbage weights and nothing would fail.

The rule, as :meth:`~trainer.policy.worker.PolicyWorker.iter_full_weights` applies it:

1. **Produce on the home stream.** Every FSDP call of the gather (``unshard``, ``wait``, ``reshard``)
   and every copy or cast of a yielded tensor runs on one stream, the one current when the iterator
   was created (after the optimizer step, so the gather also sees the step's writes).
2. **Hand over with an event.** Before a tensor is yielded, an event recorded on the home stream after
   its production is waited on by the stream current at that ``next()`` (the reader's).
3. **Keep memory alive for its reader.** The tensor is marked used by the reader's stream
   (``record_stream``), so the caching allocator does not give its memory to the home stream's next
   allocation before the reader is done with it.

Without CUDA there are no streams: :class:`NoStreams` makes every step a no-op, and the CPU twin runs
the same code in the same order. Which one a rank gets is decided in one place, :func:`for_device`.
"""

from __future__ import annotations

import contextlib

import torch


class NoStreams:
    """A device without streams (CPU): production and reading are ordered by the program itself."""

    def producing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def hand_over(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class CudaStreams:
    """The rule on a CUDA device (module docstring). Created where the iterator is: that stream is home."""

    def __init__(self, device: torch.device):
        self.device = device
        self.home = torch.cuda.current_stream(device)

    def producing(self) -> contextlib.AbstractContextManager:
        """Run the enclosed FSDP calls and copies on the home stream (rule 1). Entered and left around each
        production, never held across a ``yield``: the reader's code runs between two ``next()`` calls."""
        return torch.cuda.stream(self.home)

    def hand_over(self, tensor: torch.Tensor) -> torch.Tensor:
        """Order the reader's stream after ``tensor``'s production and keep its memory for that stream
        (rules 2 and 3). Called in the reader's context, just before the ``yield``."""
        reader = torch.cuda.current_stream(self.device)
        if reader != self.home:
            done = torch.cuda.Event()
            done.record(self.home)
            reader.wait_event(done)
            tensor.record_stream(reader)
        return tensor


def for_device(device: torch.device) -> NoStreams | CudaStreams:
    """The stream rule for a rank whose parameters live on ``device``."""
    return CudaStreams(device) if device.type == "cuda" else NoStreams()
