"""The CUDA backend's host path timed on a CPU: the real Buffer, CudaBackend (its Python) and host extension
(csrc/torch/ops.cpp, built against the installed torch) around launchers that return at once, on CPU tensors, so that
a change to the Python or the extension can be timed without a GPU (device time is scarce and the lent hosts drift).

Left out: the CUDA launches (~5 us each on the H200 machines' hosts), CUDA allocations (torch's caching allocator
instead of the CPU's), the raw stream lookup, and the device itself. The calls are sized small (hidden 512, 256
tokens per rank at most) so that CPU allocations stay cheap as cached CUDA ones are. One rank over gloo; the backend
is assembled without its constructor (which needs a GPU), so the script breaks loudly when CudaBackend gains state
it does not set. benchmarks/NOTES.md (eleventh session) compares its numbers with the device's.

    python scripts/host_path_cpu.py [--tokens 128] [--iters 3000] [--profile "fresh no-sync"]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_comm  # noqa: E402
from moe_comm import layout as lay  # noqa: E402
from moe_comm.backends import cuda, cuda_kernels  # noqa: E402
from moe_comm.backends.common import Backend  # noqa: E402
from moe_comm.testing.bench import least_host_us  # noqa: E402
from moe_comm.testing.routing import Case, rank_inputs  # noqa: E402

NO_OP_LAUNCHERS = """
int layout(void* p, void* a, void* n, void* s) { return 0; }
int dispatch(void* p, void* i, void* o, int b, int w, int part, void* s) { return 0; }
int combine(void* p, void* a, int d, int b, int part, void* s) { return 0; }
int wait_notify(long long* done, long long value, void* s) { *done = value; return 0; }  /* the summary is final */
const char* last_error(void) { return "no error"; }
"""
HIDDEN, TOPK, EXPERTS, CAP = 512, 8, 256, 256


def no_op_library(folder: str) -> ctypes.CDLL:
    """The five launcher entry points the host extension calls, each returning at once (built with the C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("host_path_cpu.py needs a C compiler (cc or gcc) for its no-op launchers")
    source, library = Path(folder) / "no_op.c", Path(folder) / "libno_op.so"
    source.write_text(NO_OP_LAUNCHERS)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def cpu_backend(buf: moe_comm.Buffer, library: ctypes.CDLL) -> cuda.CudaBackend:
    """A CudaBackend on `buf`'s CPU group whose launches go to `library`: the state its constructor would set on a
    GPU, with host memory for the host-mapped words and no peers."""
    address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value  # noqa: E731
    impl = cuda.CudaBackend.__new__(cuda.CudaBackend)
    Backend.__init__(impl, buf.group, buf.device, buf.num_cpu_timeout_secs)
    impl.comm_stream = object()  # not None: Backend.run takes its CUDA path (nothing is waited for)
    impl.tuning, impl.kernels, impl.timeout_ns = cuda.CudaTuning(), None, 10 ** 10
    impl.region_bytes, impl.num_device_sms, impl._raw_stream = 1 << 34, 132, lambda: 0  # no CUDA streams here
    impl.launcher = cuda_kernels.host_extension().Launcher(*(address(n) for n in ("layout", "dispatch", "combine",
                                                                                    "wait_notify", "last_error")))
    impl._shapes, impl._stale_epoch, impl._plans, impl._ipc = {}, 0, weakref.WeakKeyDictionary(), None
    impl.buffer, impl.symm, impl._peer_bases = torch.zeros(64, dtype=torch.uint8), None, 0
    impl._mapped_words = ctypes.create_string_buffer(lay.SUMMARY_OFFSET + 8 * lay.summary_len(lay.MAX_RANKS,
                                                                                             lay.SLOT_STRIDE))
    impl._mapped_host, impl._mapped_dev = ctypes.addressof(impl._mapped_words), 0
    impl._error = lay.ErrorRecord.from_address(impl._mapped_host)
    return impl


def cpu_cuda_buffer(folder: str) -> moe_comm.Buffer:
    """A Buffer of this rank's gloo group (one rank) whose backend is the CUDA backend around no-op launchers built
    in `folder` (`cpu_backend`): its outputs are never written; the host-mapped words are host memory."""
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=CAP, hidden=HIDDEN, num_topk=TOPK, backend="torch")
    buf._impl = cpu_backend(buf, no_op_library(folder))
    return buf


OPS = ("fresh no-sync", "fresh sync", "cached", "combine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help=f"tokens per call (at most {CAP})")
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--profile", default=None, choices=OPS, help="an op to show a cProfile of")
    args = parser.parse_args()
    if not 1 <= args.tokens <= CAP or args.iters < 1:
        parser.error(f"--tokens={args.tokens} must be in [1, {CAP}] and --iters={args.iters} >= 1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as folder:
        buf = cpu_cuda_buffer(folder)
        case = Case(seed=3, num_ranks=1, num_experts=EXPERTS, num_topk=TOPK, hidden=HIDDEN, num_tokens=(args.tokens,),
                    num_max_tokens_per_rank=CAP, drop_prob=0.0)
        x, idx, w = rank_inputs(case, 0, buf.device)
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=EXPERTS, do_cpu_sync=False)
        # What a notify of this call would leave in the summary (one rank): every token received, its slots spread
        # over the experts; the no-op layout never changes it.
        summary = [args.tokens, 0, 0, args.tokens] + [args.tokens * TOPK // EXPERTS] * EXPERTS
        (ctypes.c_int64 * len(summary)).from_address(buf._impl._mapped_host + lay.SUMMARY_OFFSET)[:] = summary
        ops = dict(zip(OPS, (lambda: buf.dispatch(x, idx, w, num_experts=EXPERTS, do_cpu_sync=False),
                             lambda: buf.dispatch(x, idx, w, num_experts=EXPERTS, do_cpu_sync=True),
                             lambda: buf.dispatch(x, handle=handle),
                             lambda: buf.combine(recv_x, handle, topk_weights=recv_w))))
        print(f"host us per call on this CPU, {args.tokens} tokens, no-op launchers (least of five loops):")
        for name, fn in ops.items():
            for _ in range(50):
                fn()
            print(f"    {least_host_us(fn, args.iters):7.1f}  {name}")
            if args.profile == name:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iters):
                    fn()
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
                print(text.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
