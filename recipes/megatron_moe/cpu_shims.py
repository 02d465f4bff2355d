"""CPU shims of Megatron-core's CUDA assumptions, for running MoE layers and GPTModels over gloo on a machine
without a GPU (CI, the `tiny` recipe preset). Harness code only: the library has no CPU shims. The names
megatron-core 0.16.1 leaves undefined without Transformer Engine are not shimmed here: they break its router on
GPUs too, so the integration defines them (`moe_comm/integrations/megatron/compat.py`, called by
`model.initialize_megatron` for every dispatcher).

`apply_cpu_shims()` is idempotent and does nothing when CUDA is available. Each shim names the Megatron-core
0.16.1 line it works around (file paths under megatron/core/). Call it before building any Megatron module,
in every process.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


class _FakeEvent:
    """Stands in for torch.cuda.Event: on CPU every operation is already complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _FakeStream:
    """Stands in for torch.cuda.Stream: CPU work runs in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _FakeEvent:
        return event or _FakeEvent()

    def synchronize(self) -> None:
        pass


_CURRENT_STREAM = _FakeStream()


def apply_cpu_shims() -> None:
    """Patch Megatron-core (and torch.cuda) so the MoE stack and GPTModel run on CPU tensors."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True

    # 1. transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.__init__:
    #    `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()` and `_maybe_dtoh_and_synchronize`
    #    (`torch.cuda.current_stream()`, `torch.cuda.stream(...)`, `record_event()`), also
    #    transformer/moe/shared_experts.py (`self.stream = torch.cuda.Stream()`): no-op streams and events.
    torch.cuda.Stream = _FakeStream
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None

    # 2. transformer/moe/router.py (`.to(device=torch.cuda.current_device())` of the expert bias / aux loss
    #    tensors) and tensor_parallel/mappings.py `_AllToAll` (`device=torch.cuda.current_device()`):
    #    the "current device" is the CPU.
    torch.cuda.current_device = lambda: "cpu"

    # 3. transformer/moe/moe_utils.py `maybe_move_tensor_to_cpu`: `if torch.is_tensor(tensor) and
    #    tensor.is_cuda:` converts only CUDA tensors, so the alltoall dispatcher's split sizes stay CPU tensors
    #    and torch 2.13 `all_to_all_single` rejects them (TypeError). Convert CPU tensors too.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 4. transformer/utils.py `get_default_causal_mask`: `torch.ones(sq, sq, device="cuda")` (imported by
    #    fusions/fused_softmax.py): build the mask on the CPU.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask

    # 5. tensor_parallel/random.py `CudaRNGStatesTracker.add` / `.fork` (`torch.cuda.get_rng_state()`,
    #    `_set_cuda_rng_state`), used by attention/dropout and `model_parallel_cuda_manual_seed`: without a
    #    CUDA generator the tracker only records names and forks are no-ops (dropout uses the CPU generator).
    from megatron.core.tensor_parallel import random as mcore_random

    def add(self, name, seed):
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = None

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    mcore_random.CudaRNGStatesTracker.add = add
    mcore_random.CudaRNGStatesTracker.fork = fork

    # 6. pipeline_parallel/utils.py `ScheduleNode._forward` / `_backward` (the EP-overlap schedule,
    #    `overlap_moe_expert_parallel_comm`): `input.record_stream(self.stream)` and `g.record_stream(...)` with
    #    the fake streams above (torch raises "unknown parameter type"): nothing to record on CPU.
    torch.Tensor.record_stream = lambda self, stream=None: None

    # 7. pipeline_parallel/utils.py `ScheduleNode._forward` / `_backward`: `torch.cuda.nvtx.range_push` /
    #    `range_pop` raise "NVTX functions not installed" in a CPU build of torch (0.19.2 no longer calls them).
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None

    # 8. jit.py `jit_fuser = torch.compile` (e.g. `@jit_fuser def dispatch_preprocess` of the flex dispatcher):
    #    on CPU every new shape compiles C++ with gcc (about 10 s each). Eager runs the same ops, so run eager.
    torch._dynamo.config.disable = True
