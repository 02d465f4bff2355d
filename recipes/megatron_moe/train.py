"""Train a GPT-MoE with megatron-core APIs and moe_comm as the token dispatcher; log to wandb.

    torchrun --nproc-per-node 2 recipes/megatron_moe/train.py --preset tiny                    # CPU, gloo
    torchrun --nproc-per-node 2 recipes/megatron_moe/train.py --preset small --dispatcher alltoall  # 2 GPUs

Every rank holds `num_experts / world_size` experts (expert parallelism over all ranks, no tensor or pipeline
parallelism); dense weights are data-parallel (gradients averaged with all-reduce). Mock data: random tokens
from a seeded generator, so two runs with the same seed see the same batches and their loss curves compare
directly. `--dispatcher` picks moe_comm (route A, the layer spec), moe_comm_flex (route B, Megatron's flex
dispatcher backed by moe_comm) or Megatron's alltoall.

Logged every step (wandb, offline unless WANDB_MODE says otherwise; the run directory is printed at the end):
loss, tokens/s, forward dispatch and combine time per step (summed over layers, from the call to the moment
the result is usable) and their bandwidth (logical bytes: all received rows, DeepEP's metric), SMs the
moe_comm kernels ran with, and the dispatcher (in the run config). `--metrics-json` keeps the same numbers
for `compare.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root, for `recipes.megatron_moe`

from recipes.megatron_moe.model import DISPATCHERS, ModelDims, build_gpt, initialize_megatron, mock_batch  # noqa: E402
from recipes.megatron_moe.model import transformer_config  # noqa: E402
from moe_comm.testing.bench import run_metadata  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model and run size."""

    dims: ModelDims
    micro_batch_size: int
    dtype: torch.dtype
    lr: float
    steps: int
    grouped_experts: bool = False  # MoECommGroupedMLP for every dispatcher (else Megatron's SequentialMLP)
    swiglu: bool = False


PRESETS = {
    # CPU smoke run over gloo: seconds per step on 2 cores.
    "tiny": Preset(ModelDims(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                             moe_ffn_hidden_size=64, seq_length=64, vocab_size=256),
                   micro_batch_size=2, dtype=torch.float32, lr=3e-3, steps=30),
    # 2x H200: 8192 tokens per rank per step, bf16 with fp32 master weights.
    "small": Preset(ModelDims(num_layers=4, hidden_size=1024, num_attention_heads=16, num_experts=16,
                              moe_router_topk=4, moe_ffn_hidden_size=2048, seq_length=2048, vocab_size=32768),
                    micro_batch_size=4, dtype=torch.bfloat16, lr=3e-4, steps=50),
    # 2x H200: one MoE layer of DeepSeek-V3's shapes (hidden 7168, 256 experts, top-8, moe ffn 2048, SwiGLU),
    # 4096 tokens per rank, grouped experts (the experts' time is what communication must hide behind).
    "dsv3": Preset(ModelDims(num_layers=1, hidden_size=7168, num_attention_heads=56, num_experts=256,
                             moe_router_topk=8, moe_ffn_hidden_size=2048, seq_length=4096, vocab_size=32768),
                   micro_batch_size=1, dtype=torch.bfloat16, lr=3e-4, steps=20, grouped_experts=True, swiglu=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="moe_comm")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=("auto", "torch", "cuda"), default="auto", help="moe_comm Buffer backend")
    p.add_argument("--do-expand", action="store_true", help="moe_comm route A: expand layout (no local permute)")
    p.add_argument("--quantize", choices=("fp8_block128", "mxfp8"), default=None, help="FP8 on the wire (bf16 only)")
    p.add_argument("--no-cpu-sync", action="store_true",
                   help="moe_comm route A: the sync-free layer (expand layout, device counts, grouped experts)")
    p.add_argument("--grouped-experts", action="store_true",
                   help="MoECommGroupedMLP as experts for any dispatcher (the preset may already use it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="override the preset's dtype")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--out", default="runs/megatron_moe", help="output folder (wandb runs, metrics)")
    p.add_argument("--metrics-json", default=None, help="write per-step metrics here (rank 0)")
    p.add_argument("--wandb-project", default="moe_comm-megatron")
    p.add_argument("--wandb-run-name", default=None)
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="collective timeout (seconds): the default group, Megatron's groups and moe_comm's host waits; "
                        "it also bounds rank 0's start of wandb")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms (and cuBLAS's workspace setting it needs), for loss-curve "
                        "comparisons on GPUs: Megatron's unpermute then adds with index_add_ instead of scatter_add_'s "
                        "atomics; torch raises on an op that has no deterministic CUDA implementation")
    p.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0, gloo between them, moe_comm's buffers over CUDA IPC: results of expert "
                        "parallelism > 1 (loss curves) on a one-GPU machine; its times mean nothing")
    args = p.parse_args(argv)
    if not 0 <= args.seed < 2**32:  # Megatron's and torch's generators take it (the batches' seed * 1000 + rank)
        p.error(f"--seed={args.seed} must be in [0, 2**32)")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps={args.steps} must be >= 1")
    if args.metrics_json is not None:
        # Checked now, not after the whole run: the file is written at the end.
        folder = os.path.dirname(os.path.abspath(args.metrics_json))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            p.error(f"--metrics-json {args.metrics_json}: cannot create its folder: {exc}")
        if not os.access(folder, os.W_OK) or os.path.isdir(args.metrics_json):
            p.error(f"--metrics-json {args.metrics_json}: not a writable file path")
    if not 0 < args.timeout_s <= 7 * 24 * 3600:  # nan too; timedelta and moe_comm refuse more than a week
        p.error(f"--timeout-s={args.timeout_s} must be a number of seconds in (0, 604800]")
    if args.log_interval < 1:
        p.error(f"--log-interval={args.log_interval} must be >= 1")
    if args.no_cpu_sync and args.dispatcher != "moe_comm":
        p.error(f"--no-cpu-sync is route A's (--dispatcher moe_comm), got --dispatcher {args.dispatcher}")
    if args.do_expand and args.dispatcher == "moe_comm_flex":
        p.error("--do-expand is route A's layout (--dispatcher moe_comm); route B (moe_comm_flex) keeps Megatron's "
                "non-expand permutation")
    dtype = getattr(torch, args.dtype) if args.dtype is not None else PRESETS[args.preset].dtype
    if args.quantize is not None and args.dispatcher == "alltoall":
        p.error(f"--quantize {args.quantize} is moe_comm's FP8 on the wire (--dispatcher moe_comm or moe_comm_flex), "
                f"got --dispatcher alltoall")
    if args.quantize is not None and dtype != torch.bfloat16:
        p.error(f"--quantize {args.quantize} casts bf16 rows; --preset {args.preset} runs in {dtype} (add --dtype "
                f"bfloat16)")
    if args.preset == "dsv3" and not torch.cuda.is_available():
        p.error("--preset dsv3 is one DeepSeek-V3 layer for GPUs (~114 GB per rank at EP2 for its weights and Adam "
                "state); on a machine without CUDA use --preset tiny")
    if args.share_gpu and not torch.cuda.is_available():
        p.error("--share-gpu puts every rank on GPU 0 and needs CUDA; this torch sees no GPU")
    if args.share_gpu and args.backend == "torch" and args.dispatcher != "alltoall":
        p.error("--share-gpu runs moe_comm's CUDA backend over CUDA IPC; --backend torch keeps its buffers on the CPU "
                "(use --backend auto or cuda)")
    if "WORLD_SIZE" not in os.environ:
        p.error("start the recipe with torchrun (WORLD_SIZE is not set), e.g. torchrun --standalone --nproc-per-node 2 "
                "recipes/megatron_moe/train.py --preset tiny")
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size == 1 and not (PRESETS[args.preset].grouped_experts or args.grouped_experts or args.no_cpu_sync):
        # Megatron's expert MLP adds its bias in place to the output of a tensor-parallel reduce, which at expert
        # parallelism 1 returns its input as-is (a view to autograd): "Output 0 of _ReduceFromModelParallelRegion
        # is a view and is being modified inplace", in megatron-core 0.16.1 and 0.19.2 alike, any dispatcher.
        p.error(f"one rank (WORLD_SIZE={world_size}): Megatron-core's SequentialMLP experts fail at expert "
                f"parallelism 1 (mlp.py adds the bias in place to a view); run 2 or more ranks, or pass "
                f"--grouped-experts (moe_comm's grouped MLP)")
    return args


class CommTimer:
    """Forward dispatch/combine time and logical bytes per step, for any of the three dispatchers.

    moe_comm (route A) times from `token_dispatch` to `wait_dispatch` (where the result becomes usable; the
    communication may overlap other work in between), Megatron's dispatchers time `token_dispatch` /
    `token_combine` (synchronous). CUDA events on GPUs, the host clock on CPU.
    """

    def __init__(self, use_cuda: bool) -> None:
        self.use_cuda = use_cuda
        self._open: dict[str, object] = {}
        self._spans: dict[str, list] = {"dispatch": [], "combine": []}
        self.bytes = {"dispatch": 0, "combine": 0}

    def _mark(self):
        if self.use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, phase: str) -> None:
        self._open[phase] = self._mark()

    def stop(self, phase: str) -> None:
        if phase in self._open:
            self._spans[phase].append((self._open.pop(phase), self._mark()))

    def step_metrics(self) -> dict[str, float]:
        """Milliseconds and GB/s per phase for the step that just ended; resets the counters."""
        if self.use_cuda:
            torch.cuda.synchronize()
        out = {}
        for phase, spans in self._spans.items():
            secs = sum(a.elapsed_time(b) / 1e3 if self.use_cuda else b - a for a, b in spans)
            out[f"{phase}_ms"] = secs * 1e3
            out[f"{phase}_gbps"] = float(self.bytes[phase]) / secs / 1e9 if secs > 0 else 0.0
            spans.clear()
            self.bytes[phase] = 0
        return out

    @staticmethod
    def received_bytes(dispatcher, rows: torch.Tensor):
        """Bytes of the valid rows of a dispatch's output (or a combine's input, the same rows). Without a CPU sync
        (route A's sync-free layer) the rows are sized for the worst case and only the first
        `psum_num_recv_tokens_per_*[-1]` are received: that count stays a device tensor (no host sync here) and is
        read at the step's end."""
        from moe_comm.integrations.megatron import MoECommConfig

        nbytes = rows.numel() * rows.element_size()
        options = getattr(dispatcher, "options", None)
        if not isinstance(options, MoECommConfig) or options.do_cpu_sync or rows.shape[0] == 0:
            return nbytes
        handle = dispatcher.handle
        psum = handle.psum_num_recv_tokens_per_expert if options.do_expand else handle.psum_num_recv_tokens_per_rank
        return psum[-1] * (nbytes // rows.shape[0])

    def instrument(self, dispatcher) -> None:
        """Wrap one layer's token dispatcher (instance attributes; the class is untouched)."""
        token_dispatch, token_combine = dispatcher.token_dispatch, dispatcher.token_combine
        is_async = hasattr(dispatcher, "wait_dispatch")

        received = []  # route A's dispatched rows until wait_dispatch: their count is on the device till then

        def timed_dispatch(hidden, probs):
            self.start("dispatch")
            out = token_dispatch(hidden, probs)
            if is_async:
                received.append(out[0])
            else:
                self.stop("dispatch")
                self.bytes["dispatch"] += self.received_bytes(dispatcher, out[0])
            return out

        def timed_combine(hidden):
            self.bytes["combine"] += self.received_bytes(dispatcher, hidden)  # outside the span: the count's kernels
            self.start("combine")
            out = token_combine(hidden)
            if not is_async:
                self.stop("combine")
            return out

        dispatcher.token_dispatch, dispatcher.token_combine = timed_dispatch, timed_combine
        if is_async:
            wait_dispatch, wait_combine = dispatcher.wait_dispatch, dispatcher.wait_combine

            def timed_wait_dispatch():
                wait_dispatch()
                self.stop("dispatch")
                # After the wait: the handle's counts are written (read before it, the current stream raced the
                # comm stream's layout kernel and counted stale memory).
                if received:  # a second wait of one dispatch is a no-op
                    self.bytes["dispatch"] += self.received_bytes(dispatcher, received.pop(0))

            def timed_wait_combine():
                wait_combine()
                self.stop("combine")

            dispatcher.wait_dispatch, dispatcher.wait_combine = timed_wait_dispatch, timed_wait_combine


def reduce_gradients(model: torch.nn.Module) -> None:
    """Average gradients over data parallelism: dense weights over the data-parallel group, expert weights
    (Megatron marks them `allreduce=False`) over the expert-data-parallel group, both scaled by 1/DP."""
    from megatron.core import parallel_state as ps

    dp_size = ps.get_data_parallel_world_size()
    groups = {True: ps.get_data_parallel_group(), False: ps.get_expert_data_parallel_group()}
    for param in model.parameters():
        if param.grad is None:
            continue
        group = groups[getattr(param, "allreduce", True)]
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(dp_size)


class MasterAdam:
    """Adam on fp32 master copies of (possibly bf16) model weights. Memory at the step, per parameter: the model's
    copy and fp32 master, gradient, m and v (the dsv3 preset's 6.3e9 parameters per rank at EP2: ~114 GB); each
    model gradient is freed once its fp32 copy exists, and on CUDA the fused Adam needs no temporaries of the
    parameters' size (torch's default foreach Adam took another 25 GB there: over an H200's memory)."""

    def __init__(self, params, lr: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        fused = bool(self.master) and self.master[0].is_cuda
        self.opt = torch.optim.Adam(self.master, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                m.grad = None


def sms_in_use(dispatcher: str, model) -> int:
    """SMs moe_comm's last dispatch ran with (0 for Megatron's alltoall, which runs on NCCL's channels)."""
    if dispatcher == "moe_comm":
        return max(layer.mlp.token_dispatcher.last_num_sms for layer in model.decoder.layers)
    if dispatcher == "moe_comm_flex":
        from moe_comm.integrations.megatron import flex_last_num_sms

        return flex_last_num_sms()
    return 0


def domains_in_use(dispatcher: str) -> str:
    """moe_comm's `(scale-out ranks x scale-up ranks)`: `1xR` on the direct path, `hosts x ranks per host` on the
    hybrid one; "-" for Megatron's alltoall."""
    if dispatcher == "alltoall":
        return "-"
    from moe_comm.integrations.megatron import buffer_domain_sizes

    return ",".join(f"{s}x{u}" for s, u in buffer_domain_sizes())


def recipe_metadata() -> dict:
    """The run's metadata (`run_metadata`: commit, versions, command, ...) with megatron-core's version (from its
    package record; "unknown" for a source checkout on PYTHONPATH)."""
    from moe_comm.integrations.megatron.compat import megatron_core_version

    return {**run_metadata(sys.argv), "megatron_core": str(megatron_core_version() or "unknown")}


def init_wandb(args, preset: Preset, world_size: int, out_dir: str, metadata: dict):
    """wandb on rank 0, offline unless WANDB_MODE is set; None with --no-wandb. The run config holds the options,
    the model's shapes and `metadata` (the commit and versions, as in the metrics JSON)."""
    if args.no_wandb:
        return None
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    config = {**vars(args), **dataclasses.asdict(preset.dims), "dtype": str(preset.dtype).replace("torch.", ""),
              "micro_batch_size": preset.micro_batch_size, "world_size": world_size, "lr": preset.lr,
              "metadata": metadata}
    name = args.wandb_run_name or f"{args.preset}-{args.dispatcher}-seed{args.seed}"
    return wandb.init(project=args.wandb_project, name=name, dir=out_dir, config=config,
                      settings=wandb.Settings(console="off"))


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    if args.dtype is not None:
        preset = dataclasses.replace(preset, dtype=getattr(torch, args.dtype))
    grouped = preset.grouped_experts or args.grouped_experts or args.no_cpu_sync
    steps = args.steps or preset.steps
    use_cuda = torch.cuda.is_available()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: torch requires it
        torch.use_deterministic_algorithms(True)
    if use_cuda:
        torch.cuda.set_device(0 if args.share_gpu else int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)  # one core per rank
        from recipes.megatron_moe.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if preset.dtype == torch.bfloat16 and not use_cuda:
        print("warning: the bf16 preset on CPU is slow; use --preset tiny", file=sys.stderr)
    # NCCL refuses two ranks on one GPU; gloo stages the CUDA tensors of Megatron's collectives through the host.
    dist.init_process_group("nccl" if use_cuda and not args.share_gpu else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    with contextlib.ExitStack() as stack:
        if args.share_gpu:
            from moe_comm.testing.shared_gpu import every_buffer_over_ipc

            stack.enter_context(every_buffer_over_ipc())
        train(args, preset, grouped, steps, use_cuda, stack)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train(args, preset: Preset, grouped: bool, steps: int, use_cuda: bool, stack: contextlib.ExitStack) -> None:
    """Build the model and run `steps` training steps; rank 0 logs, writes the metrics and prints the summary.
    What must be undone after the run (route B's installed dispatcher) goes on `stack`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    initialize_megatron(world_size, args.seed, timeout_s=args.timeout_s)

    moe_comm_config = None
    if args.dispatcher.startswith("moe_comm"):
        from moe_comm.integrations.megatron import MoECommConfig, install_flex_dispatcher

        if args.dispatcher == "moe_comm_flex":
            stack.callback(install_flex_dispatcher(backend=args.backend, quantize=args.quantize,
                                                   num_cpu_timeout_secs=args.timeout_s))
        else:
            moe_comm_config = MoECommConfig(backend=args.backend, do_expand=args.do_expand or args.no_cpu_sync,
                                            do_cpu_sync=not args.no_cpu_sync, quantize=args.quantize,
                                            num_cpu_timeout_secs=args.timeout_s)
    swiglu = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu) if preset.swiglu else {}
    config = transformer_config(preset.dims, args.dispatcher, world_size, preset.dtype, **swiglu)
    model = build_gpt(config, preset.dims, args.dispatcher, moe_comm_config, grouped_experts=grouped).to(device)
    timer = CommTimer(use_cuda)
    for layer in model.decoder.layers:
        timer.instrument(layer.mlp.token_dispatcher)
    optimizer = MasterAdam(model.parameters(), preset.lr)

    out_dir = os.path.abspath(args.out)
    run = metadata = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        metadata = recipe_metadata()
        run = init_wandb(args, preset, world_size, out_dir, metadata)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    tokens_per_step = preset.micro_batch_size * preset.dims.seq_length * world_size
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=f"{args.preset}/{args.dispatcher}", unit="step", dynamic_ncols=True,
                   disable=None)  # None: shown on a terminal, off in logs (the log lines stay)
    history = []
    for step in range(1, steps + 1):
        batch = mock_batch(preset.dims, preset.micro_batch_size, generator, device)
        if use_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                     labels=batch["labels"]).float().mean()
        loss.backward()
        reduce_gradients(model)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = global_loss.item() / world_size
        elapsed = time.perf_counter() - start  # .item() above waited for the device
        comm = timer.step_metrics()
        num_sms = sms_in_use(args.dispatcher, model)
        metrics = dict(step=step, loss=global_loss, tokens_per_s=tokens_per_step / elapsed, step_s=elapsed,
                       num_sms=num_sms, **comm)
        history.append(metrics)
        if rank == 0:
            if run is not None:
                run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{global_loss:.4f}")
            if step % args.log_interval == 0 or step == steps:
                bar.write(f"step {step:4d}/{steps} | loss {global_loss:.4f} | {metrics['tokens_per_s']:9.0f} tok/s | "
                          f"dispatch {comm['dispatch_ms']:7.2f} ms {comm['dispatch_gbps']:6.2f} GB/s | "
                          f"combine {comm['combine_ms']:7.2f} ms {comm['combine_gbps']:6.2f} GB/s | "
                          f"SMs {num_sms or '-'} | {args.dispatcher}")
    if rank == 0:
        bar.close()
        skip = min(3, steps - 1)  # first steps include warm-up (allocations, NCCL/buffer set-up)
        steady = history[skip:]
        mean = {k: sum(h[k] for h in steady) / len(steady) for k in ("tokens_per_s", "dispatch_ms", "combine_ms")}
        run_dir = os.path.dirname(run.dir) if run is not None else "none (--no-wandb)"
        summary = dict(preset=args.preset, dispatcher=args.dispatcher, steps=steps, seed=args.seed,
                       world_size=world_size, first_loss=history[0]["loss"], final_loss=history[-1]["loss"],
                       domains=domains_in_use(args.dispatcher), dtype=str(preset.dtype).replace("torch.", ""),
                       do_expand=args.dispatcher == "moe_comm" and (args.do_expand or args.no_cpu_sync),
                       deterministic=args.deterministic,
                       share_gpu=args.share_gpu, wandb_run_dir=run_dir,
                       **{f"mean_{k}": v for k, v in mean.items()})
        if run is not None:
            run.summary.update({k: v for k, v in summary.items() if k != "wandb_run_dir"})
            run.finish()
        if args.metrics_json:
            with open(args.metrics_json, "w") as f:
                json.dump(dict(metadata=metadata, summary=summary, history=history), f, indent=1)
        print(f"SUMMARY preset={args.preset} dispatcher={args.dispatcher} steps={steps} "
              f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | "
              f"{mean['tokens_per_s']:.0f} tokens/s | dispatch {mean['dispatch_ms']:.2f} ms, "
              f"combine {mean['combine_ms']:.2f} ms per step | domains {summary['domains']}"
              + (" | SHARING GPU 0 (times mean nothing)" if args.share_gpu else ""))
        print(f"wandb run directory: {run_dir}")


if __name__ == "__main__":
    sys.exit(main())
