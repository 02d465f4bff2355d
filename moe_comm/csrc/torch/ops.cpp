// The host path of the CUDA backend's calls, as a Python extension built against the installed torch
// (moe_comm.jit.load_extension): one crossing from Python per call (a fresh dispatch with a CPU sync waits inside it
// for the counts its layout kernel left for the host) allocates the outputs with torch's caching allocator, sets the
// per-call pointers in the launch structs that moe_comm.backends.cuda built once per shape, and launches through the
// kernel library. ctypes crossings and torch.empty from Python cost more host time than the kernels run at small
// sizes (benchmarks/host-path_*.md).
//
// The kernel library stays free of torch headers (the CPU CI machine compiles it; one build serves every torch):
// this module reaches its launchers through the addresses given to `Launcher`, and shares only the generated
// moe_comm/abi.h (from moe_comm/layout.py: structs, constants, the summary's entries, the functions'
// declarations). (Over 400 lines: one class, every launch's host path, whose calls share the output allocation and
// the pointer-setting helpers.)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe_comm/abi.h"

namespace py = pybind11;
using namespace moe_comm;

namespace {

// The launchers' types, from their declarations in abi.h (moe_comm.layout.FUNCTIONS): only their addresses come
// here, from Python; this module does not link the library.
using Stream = cudaStream_t;
using LayoutFn = decltype(&moe_comm_layout);
using DispatchFn = decltype(&moe_comm_dispatch);
using CombineFn = decltype(&moe_comm_combine);
using WaitNotifyFn = decltype(&moe_comm_wait_notify);
using LastErrorFn = decltype(&moe_comm_last_error);
using OptionalTensor = std::optional<at::Tensor>;

template <typename T>
T* at_address(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

uint8_t* bytes_of(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
uint8_t* bytes_of(const OptionalTensor& t) { return t ? bytes_of(*t) : nullptr; }
py::object or_none(const OptionalTensor& t) { return t ? py::cast(*t) : py::none(); }

class Launcher {
public:
    // Addresses of the kernel library's moe_comm_layout, moe_comm_dispatch, moe_comm_combine, moe_comm_wait_notify
    // and moe_comm_last_error (kernels/*.cu; moe_comm.backends.cuda_kernels.SIGNATURES).
    Launcher(uintptr_t layout, uintptr_t dispatch, uintptr_t combine, uintptr_t wait_notify, uintptr_t last_error)
        : layout_(reinterpret_cast<LayoutFn>(layout)),
          dispatch_(reinterpret_cast<DispatchFn>(dispatch)),
          combine_(reinterpret_cast<CombineFn>(combine)),
          wait_notify_(reinterpret_cast<WaitNotifyFn>(wait_notify)),
          last_error_(reinterpret_cast<LastErrorFn>(last_error)) {}

    // A fresh dispatch in one crossing: the routing workspace (`offsets`: the address of its
    // moe_comm.layout.workspace_offsets), the layout kernel (its last block runs the notify: the counts into every
    // peer's control slot, published by the barrier with the call's signature), then the dispatch kernel, which sends
    // and receives. The outputs are sized one of two ways:
    // - without a CPU sync (`mapped` 0): for the worst case, `num_rows` received rows M and `num_expand_rows` output
    //   rows P, all allocated before the layout kernel, which is collective, launches; the routing outputs at the end
    //   of the workspace's allocation. Outputs that cannot be allocated: both launches still run, without outputs
    //   (the receivers skip every row), then the error is raised; only a failure of the bare workspace too (a few
    //   words per token) leaves the peers to their timeout.
    // - with a CPU sync (`mapped`: the buffer's host-mapped words, the ErrorRecord at 0, the notify's done word at
    //   kNotifyDoneOffset and summary at kSummaryOffset, moe_comm.layout.summary_len): after the layout launch the
    //   host waits without the GIL for the notify to mark its summary done and reads it: M, the per-expert counts
    //   aligned up to `alignment`, P (their sum with `do_expand`, else M). Returns None, launching nothing more, when
    //   the kernel stopped before its summary, a kernel recorded an error or any rank's flags (or pending flags) are
    //   set: the host raises them (moe_comm.backends.cuda). A workspace that cannot be allocated
    //   launches nothing (the peers wait for this rank's notify until their timeout); outputs that cannot be
    //   allocated after the notify: the dispatch runs without them (whole), then the error is raised.
    // `quantize`: 0, or the FP8 format (1 fp8_block128, 2 mxfp8) the senders cast bf16 `data` to; `dequantize`: 0,
    // or the FP8 format of the wire rows, cast back to bf16 on arrival; arguments that do not fit launch nothing.
    // `part`: kPartWhole, or kPartSend (the receivers later: `receive_dispatch`). Returns ((x [P, H] in data's
    // dtype, FP8 or bf16, scales [P, H / 128] or None, topk_idx [M, K], src_idx [M], psum per rank [R], psum per
    // local expert [L], weights or None), the clean topk_idx [N, K] (a view at the workspace's start: the workspace
    // is its storage), P, the aligned per-expert counts as a list or None without a CPU sync), the routing outputs
    // views of one int64 allocation.
    py::object layout_dispatch(uintptr_t params, uintptr_t args, uintptr_t notify, uintptr_t inputs,
                               uintptr_t outputs, const at::Tensor& topk_idx, const at::Tensor& data,
                               const OptionalTensor& scales, const OptionalTensor& weights, uintptr_t offsets,
                               uintptr_t mapped, int64_t alignment, int64_t num_rows, int64_t num_expand_rows,
                               bool do_expand, int quantize, int dequantize, int num_blocks, int part,
                               uintptr_t stream) {
        const int64_t* o = checked_offsets(offsets);
        require(alignment >= 1, "alignment=" + std::to_string(alignment) + " (at least 1)");
        const EpParams* p = at_address<const EpParams>(params);
        require(topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous() &&
                    topk_idx.numel() == p->num_tokens * p->num_topk,
                "topk_idx must be contiguous int64 of num_tokens x num_topk = " +
                    std::to_string(p->num_tokens * p->num_topk) + " values");
        require(data.dim() == 2 && num_rows >= 0 && num_expand_rows >= 0,
                "data must be 2-D rows and num_rows, num_expand_rows >= 0; got " + std::to_string(data.dim()) +
                    "-D data, num_rows=" + std::to_string(num_rows) + ", num_expand_rows=" +
                    std::to_string(num_expand_rows));
        check_casts(data, scales, quantize, dequantize);
        const Launch launch{params, args, notify, inputs, outputs, o, quantize, dequantize, num_blocks, stream};
        if (mapped) return synchronized_dispatch(launch, topk_idx, data, scales, weights, mapped, alignment, do_expand,
                                                 part);
        const Sizes sizes{num_rows, num_expand_rows, do_expand};
        const int64_t extra = routing_words(params, num_rows);
        RowOutputs rows;
        at::Tensor workspace;
        try {
            rows = row_outputs(params, data, scales, weights, quantize, dequantize, sizes);
            workspace = at::empty({o[kWorkspaceLength] + extra}, topk_idx.options());
        } catch (const c10::Error&) {  // an allocation failed
            rows = {};  // the outputs that were allocated go back first
            const at::Tensor bare = at::empty({o[kWorkspaceLength]}, topk_idx.options());
            launch_layout(launch, topk_idx, bare);
            launch_dispatch(launch, data, scales, weights, {}, Sizes{0, 0, do_expand}, bare, kPartWhole);
            throw;
        }
        launch_layout(launch, topk_idx, workspace);
        launch_dispatch(launch, data, scales, weights, pointers(rows, workspace, o[kWorkspaceLength]), sizes,
                        workspace, part);
        return py::make_tuple(results_of(params, rows, workspace, o[kWorkspaceLength], num_rows),
                              clean_view(workspace, params), num_expand_rows, py::none());
    }

    // A cached dispatch (the kernel runs the barrier itself) into `num_rows` new rows, `quantize` and `dequantize`
    // and `part` as in `layout_dispatch`. Returns (x, scales or None).
    py::tuple cached_dispatch(uintptr_t params, uintptr_t inputs, uintptr_t outputs, const at::Tensor& data,
                              const OptionalTensor& scales, int quantize, int dequantize, int64_t num_rows,
                              int num_blocks, int part, uintptr_t stream) const {
        const EpParams* p = at_address<const EpParams>(params);
        check_casts(data, scales, quantize, dequantize);
        auto [x, out_scales] = outputs_of(data, scales, quantize, dequantize, num_rows);
        auto* in = at_address<DispatchInputs>(inputs);
        in->x = bytes_of(data);
        in->scales = bytes_of(scales);
        in->quantize = quantize;
        auto* out = at_address<RecvOutputs>(outputs);
        out->x = bytes_of(x);
        out->scales = bytes_of(out_scales);
        out->dequantize = dequantize;
        check(released(dispatch_, p, in, out, num_blocks, 1, part, reinterpret_cast<Stream>(stream)), p, "dispatch");
        return py::make_tuple(x, or_none(out_scales));
    }

    // The receivers of a dispatch launched with kPartSend (fresh or cached), along the structs as that call set
    // them (nothing may run on the buffer in between: moe_comm.Buffer refuses it).
    void receive_dispatch(uintptr_t params, uintptr_t inputs, uintptr_t outputs, int num_blocks,
                          uintptr_t stream) const {
        const EpParams* p = at_address<const EpParams>(params);
        check(released(dispatch_, p, at_address<const DispatchInputs>(inputs), at_address<const RecvOutputs>(outputs),
                       num_blocks, 0, kPartReceive, reinterpret_cast<Stream>(stream)),
              p, "dispatch receive");
    }

    // A combine of `x` into [num_tokens, H], in `num_rounds` launches of `num_slots` slots each (an expand combine
    // whose rows do not fit the region at once; the rounds accumulate in fp32/fp64). `dtype`: the kernel's code
    // for x's dtype (moe_comm.backends.common.DTYPE_CODES). `unreduced`: each token's rows unsummed instead,
    // [num_tokens, T, H] with T = K (expand: a term per slot) or R (a term per rank), absent terms unwritten.
    // `part`: kPartWhole, or kPartSend (one round; the reducers run later, `receive_combine`). Returns (combined or
    // the terms, combined weights or None).
    py::tuple combine(uintptr_t params, uintptr_t args, const at::Tensor& x, const OptionalTensor& weights,
                      const OptionalTensor& bias0, const OptionalTensor& bias1, int64_t num_tokens, int dtype,
                      int num_slots, int num_rounds, bool unreduced, int num_blocks, int part,
                      uintptr_t stream) const {
        require(part == kPartWhole || (part == kPartSend && num_rounds == 1),
                "part must be 0 (whole), or 1 (send) for a combine of one round; got part=" + std::to_string(part) +
                    ", num_rounds=" + std::to_string(num_rounds));
        const EpParams* p = at_address<const EpParams>(params);
        const int K = p->num_topk;
        auto* a = at_address<CombineArgs>(args);
        const int64_t num_terms = a->do_expand ? K : p->num_ranks;
        at::Tensor combined = unreduced ? at::empty({num_tokens, num_terms, x.size(1)}, x.options())
                                        : at::empty({num_tokens, x.size(1)}, x.options());
        OptionalTensor combined_weights, acc;
        if (weights) combined_weights = at::empty({num_tokens, K}, weights->options());
        if (num_rounds > 1 && !unreduced) {
            const auto acc_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
            acc = at::empty({num_tokens, x.size(1)}, x.options().dtype(acc_dtype));
        }
        a->x = bytes_of(x);
        a->weights = bytes_of(weights);
        a->acc = bytes_of(acc);
        a->bias0 = bytes_of(bias0);
        a->bias1 = bytes_of(bias1);
        a->out = unreduced ? nullptr : bytes_of(combined);
        a->terms = unreduced ? bytes_of(combined) : nullptr;
        a->out_weights = bytes_of(combined_weights);
        for (int r = 0; r < num_rounds; ++r) {
            if (num_rounds > 1) {  // one round: the plan set the slots once
                a->slot_begin = r * num_slots;
                a->slot_end = std::min(K, (r + 1) * num_slots);
                a->first_round = r == 0;
                a->last_round = r == num_rounds - 1;
            }
            check(released(combine_, p, a, dtype, num_blocks, part, reinterpret_cast<Stream>(stream)), p, "combine");
        }
        return py::make_tuple(combined, or_none(combined_weights));
    }

    // The reducers of a combine launched with kPartSend, along the struct as that call set it.
    void receive_combine(uintptr_t params, uintptr_t args, int dtype, int num_blocks, uintptr_t stream) const {
        const EpParams* p = at_address<const EpParams>(params);
        check(released(combine_, p, at_address<const CombineArgs>(args), dtype, num_blocks, kPartReceive,
                       reinterpret_cast<Stream>(stream)),
              p, "combine receive");
    }

private:
    // What every launch of a fresh dispatch shares (`layout_dispatch`'s arguments).
    struct Launch {
        uintptr_t params, args, notify, inputs, outputs;
        const int64_t* offsets;
        int quantize, dequantize, num_blocks;
        uintptr_t stream;
    };

    // `layout_dispatch` with a CPU sync.
    py::object synchronized_dispatch(const Launch& launch, const at::Tensor& topk_idx, const at::Tensor& data,
                                     const OptionalTensor& scales, const OptionalTensor& weights, uintptr_t mapped,
                                     int64_t alignment, bool do_expand, int part) {
        const EpParams* p = at_address<const EpParams>(launch.params);
        const at::Tensor workspace = at::empty({launch.offsets[kWorkspaceLength]}, topk_idx.options());
        // Mapped memory the device writes, read through volatile. The notify writes this call's number into `done`
        // once the summary is final (a kernel of an earlier call, still running after its wait failed, cannot pass
        // for it); a kernel that stopped before (the stream ran dry) left the reason in the ErrorRecord at `mapped`.
        const int64_t value = ++notify_calls_;
        at_address<NotifyArgs>(launch.notify)->done_value = value;
        const volatile int64_t* done = at_address<const volatile int64_t>(mapped + kNotifyDoneOffset);
        launch_layout(launch, topk_idx, workspace);
        check(released(wait_notify_, done, value, reinterpret_cast<Stream>(launch.stream)), p,
              "wait for the dispatch notify");
        const volatile int64_t* error_code = at_address<const volatile int64_t>(mapped);
        const volatile int64_t* summary = at_address<const volatile int64_t>(mapped + kSummaryOffset);
        const int R = p->num_ranks, L = p->num_local_experts;
        const bool finished = *done == value, recorded = *error_code != 0;
        if (!finished && !recorded) {
            throw std::runtime_error("moe_comm: the dispatch notify on rank " + std::to_string(p->rank) +
                                     " ended before its summary and recorded no error: a bug in moe_comm");
        }
        bool problem = !finished || recorded;
        for (int i = 0; i < R; ++i)
            problem = problem || summary[summary_flags_from(R, L, i)] != 0 ||
                      summary[summary_pending_from(R, L, i)] != 0;
        if (problem) return py::none();
        const int64_t M = summary[summary_total(R, L, 0)];
        std::vector<int64_t> aligned(L);
        int64_t aligned_sum = 0;
        for (int e = 0; e < L; ++e) {
            aligned[e] = (summary[summary_per_expert(R, L, e)] + alignment - 1) / alignment * alignment;
            aligned_sum += aligned[e];
        }
        const Sizes sizes{M, do_expand ? aligned_sum : M, do_expand};
        RowOutputs rows;
        at::Tensor routing;
        try {
            rows = row_outputs(launch.params, data, scales, weights, launch.quantize, launch.dequantize, sizes);
            routing = at::empty({routing_words(launch.params, M)}, topk_idx.options());
        } catch (const c10::Error&) {  // an allocation failed
            rows = {};  // the outputs that were allocated go back first
            // Every peer now waits for this rank's rows (the notify ran): the dispatch runs with no outputs (the
            // senders send, the receivers skip every row: num_rows 0), so the peers finish theirs, then this rank
            // raises (e.g. torch.OutOfMemoryError naming the bytes; moe_comm.backends.cuda counted the epoch). Whole,
            // with or without a receive hook: no rows to receive later.
            launch_dispatch(launch, data, scales, weights, {}, Sizes{0, 0, do_expand}, workspace, kPartWhole);
            throw;
        }
        launch_dispatch(launch, data, scales, weights, pointers(rows, routing, 0), sizes, workspace, part);
        // The list after the launch (a failure here leaves no peer waiting), through the C API: pybind11's item
        // assignment costs ~25 ns per expert (6 us at 256 experts).
        py::list counts = py::reinterpret_steal<py::list>(PyList_New(L));
        if (!counts) throw py::error_already_set();
        for (int e = 0; e < L; ++e) {
            PyObject* item = PyLong_FromLongLong(aligned[e]);
            if (!item) throw py::error_already_set();
            PyList_SET_ITEM(counts.ptr(), e, item);
        }
        return py::make_tuple(results_of(launch.params, rows, routing, 0, M), clean_view(workspace, launch.params),
                              sizes.num_expand_rows, counts);
    }

    // The routing outputs of M received rows, in int64 words: topk_idx [M, K], src_idx [M], psum per rank [R], psum
    // per local expert [L].
    static int64_t routing_words(uintptr_t params, int64_t num_rows) {
        const EpParams* p = at_address<const EpParams>(params);
        return num_rows * p->num_topk + num_rows + p->num_ranks + p->num_local_experts;
    }

    // The clean topk_idx [N, K] at the start of a workspace. Views are made with one as_strided each (narrow then
    // view makes two tensors: ~0.3 us of host time each).
    static at::Tensor clean_view(const at::Tensor& workspace, uintptr_t params) {
        const EpParams* p = at_address<const EpParams>(params);
        return workspace.as_strided({p->num_tokens, p->num_topk}, {p->num_topk, 1}, 0);
    }

    // Set the layout's and the notify's pointers into `workspace` (int64, at least offsets[kWorkspaceLength] words)
    // and launch the layout kernel.
    void launch_layout(const Launch& launch, const at::Tensor& topk_idx, const at::Tensor& workspace) const {
        const EpParams* p = at_address<const EpParams>(launch.params);
        const int64_t* offsets = launch.offsets;
        int64_t* base = static_cast<int64_t*>(workspace.storage().mutable_data());
        int64_t* counts = base + offsets[kWorkspaceCounts];  // rows per rank [R], rows per expert [E], error flags [1]
        auto* a = at_address<LayoutArgs>(launch.args);
        a->topk_idx = topk_idx.data_ptr<int64_t>();
        a->clean_idx = base;
        a->send_pos = base + offsets[kWorkspaceSendPos];
        a->expert_rank = reinterpret_cast<int32_t*>(base + offsets[kWorkspaceExpertRank]);
        a->num_tokens_per_rank = counts;
        a->num_tokens_per_expert = counts + p->num_ranks;
        a->flags = counts + p->num_ranks + p->num_experts;
        a->scratch = reinterpret_cast<int32_t*>(base + offsets[kWorkspaceLayoutScratch]);
        auto* n = at_address<NotifyArgs>(launch.notify);
        n->num_tokens_per_rank = a->num_tokens_per_rank;
        n->num_tokens_per_expert = a->num_tokens_per_expert;
        n->flags = a->flags;
        n->recv_slots = base + offsets[kWorkspaceRecvSlots];
        check(released(layout_, p, a, n, reinterpret_cast<Stream>(launch.stream)), p, "dispatch layout and notify");
    }

    // A fresh dispatch's received rows M, output rows P (M without expand), and whether rows are expanded.
    struct Sizes {
        int64_t num_rows, num_expand_rows;
        bool do_expand;
    };

    // A fresh dispatch's row outputs: rows and scales (`outputs_of`), weights [M, K] (expand: [P]) if given.
    struct RowOutputs {
        at::Tensor x;
        OptionalTensor scales, weights;
    };

    static RowOutputs row_outputs(uintptr_t params, const at::Tensor& data, const OptionalTensor& scales,
                                  const OptionalTensor& weights, int quantize, int dequantize, const Sizes& sizes) {
        const EpParams* p = at_address<const EpParams>(params);
        auto [x, out_scales] = outputs_of(data, scales, quantize, dequantize, sizes.num_expand_rows);
        OptionalTensor out_weights;
        if (weights) {
            out_weights = sizes.do_expand ? at::empty({sizes.num_expand_rows}, weights->options())
                                          : at::empty({sizes.num_rows, p->num_topk}, weights->options());
        }
        return {x, out_scales, out_weights};
    }

    // The workspace offsets at `offsets` (moe_comm.layout.workspace_offsets: kWorkspaceLength + 1 values, the
    // pieces' starts then the length), refused unless present and in order.
    static const int64_t* checked_offsets(uintptr_t offsets) {
        const int64_t* o = at_address<const int64_t>(offsets);
        require(o != nullptr, "workspace offsets: the address is 0");
        bool ordered = o[0] >= 0;
        for (int i = 0; i < kWorkspaceLength; ++i) ordered = ordered && o[i] <= o[i + 1];
        require(ordered, "workspace offsets must be non-negative and non-decreasing (workspace_offsets)");
        return o;
    }

    // Where a fresh dispatch's launch writes: row outputs, and the routing outputs (`routing_words` long: topk_idx
    // [M, K], src_idx [M], psum per rank [R], psum per local expert [L]); null: not written.
    struct OutputPointers {
        uint8_t *x = nullptr, *scales = nullptr, *weights = nullptr;
        int64_t* routing = nullptr;
    };

    // The routing outputs at word `routing_offset` of `words`' storage. The storage's address: a view of no elements
    // (a dispatch of 0 tokens) has a null data_ptr().
    static OutputPointers pointers(const RowOutputs& rows, const at::Tensor& words, int64_t routing_offset) {
        return {bytes_of(rows.x), bytes_of(rows.scales), bytes_of(rows.weights),
                static_cast<int64_t*>(words.storage().mutable_data()) + routing_offset};
    }

    // Set a fresh dispatch's pointers (into the workspace at `launch.offsets`, and `to`) and its sizes in the
    // RecvOutputs struct, and launch the dispatch kernel.
    void launch_dispatch(const Launch& launch, const at::Tensor& data, const OptionalTensor& scales,
                         const OptionalTensor& weights, const OutputPointers& to, const Sizes& sizes,
                         const at::Tensor& workspace, int part) const {
        const EpParams* p = at_address<const EpParams>(launch.params);
        const int64_t* offsets = launch.offsets;
        const int64_t M = sizes.num_rows, K = p->num_topk, R = p->num_ranks;
        int64_t* base = static_cast<int64_t*>(workspace.storage().mutable_data());
        int64_t* recv = to.routing;
        auto* in = at_address<DispatchInputs>(launch.inputs);
        in->x = bytes_of(data);
        in->scales = bytes_of(scales);
        in->quantize = launch.quantize;
        in->clean_idx = base;
        in->weights = bytes_of(weights);
        in->send_pos = base + offsets[kWorkspaceSendPos];
        in->expert_rank = reinterpret_cast<const int32_t*>(base + offsets[kWorkspaceExpertRank]);
        auto* out = at_address<RecvOutputs>(launch.outputs);
        out->counts = base + offsets[kWorkspaceRecvSlots];
        out->x = to.x;
        out->scales = to.scales;
        out->dequantize = launch.dequantize;
        out->topk_idx = recv;
        out->weights = to.weights;
        out->src_idx = recv ? recv + M * K : nullptr;
        out->expand_row =
            sizes.do_expand ? reinterpret_cast<int32_t*>(base + offsets[kWorkspaceExpandRow]) : nullptr;
        out->psum_rank = recv ? recv + M * K + M : nullptr;
        out->psum_expert = recv ? recv + M * K + M + R : nullptr;
        out->num_rows = M;
        out->num_expand_rows = sizes.num_expand_rows;
        out->do_expand = sizes.do_expand ? 1 : 0;
        check(released(dispatch_, p, in, out, launch.num_blocks, 0, part, reinterpret_cast<Stream>(launch.stream)), p,
              "dispatch");
    }

    // A fresh dispatch's outputs as `layout_dispatch` returns them, the routing outputs views of `words` at word
    // `at`.
    static py::tuple results_of(uintptr_t params, const RowOutputs& rows, const at::Tensor& words, int64_t at,
                                int64_t M) {
        const EpParams* p = at_address<const EpParams>(params);
        const int64_t K = p->num_topk, R = p->num_ranks, L = p->num_local_experts;
        return py::make_tuple(rows.x, or_none(rows.scales), words.as_strided({M, K}, {K, 1}, at),
                              words.as_strided({M}, {1}, at + M * K), words.as_strided({R}, {1}, at + M * K + M),
                              words.as_strided({L}, {1}, at + M * K + M + R), or_none(rows.weights));
    }

    // The scales' dtype of an FP8 format (fp8_block128: float32, mxfp8: int32 words of UE8M0 bytes).
    static at::ScalarType scale_type(int format) { return format == kFp8Block128 ? at::kFloat : at::kInt; }

    // `quantize` and `dequantize` (0, 1 fp8_block128, 2 mxfp8) with rows `data` and `scales`, checked before
    // anything is allocated or launched (outputs_of trusts them).
    static void check_casts(const at::Tensor& data, const OptionalTensor& scales, int quantize, int dequantize) {
        static_assert(kFp8Block128 == 1 && kFp8Mx == 2, "the FP8 codes are 1 and 2 (0: none)");
        require(quantize >= 0 && quantize <= kFp8Mx && dequantize >= 0 && dequantize <= kFp8Mx,
                "quantize and dequantize must be 0, 1 (fp8_block128) or 2 (mxfp8), got " + std::to_string(quantize) +
                    " and " + std::to_string(dequantize));
        if (quantize)
            require(data.scalar_type() == at::kBFloat16 && data.size(1) % kFp8ChannelsPerScale == 0 && !scales,
                    "quantize casts bf16 rows of a multiple of " + std::to_string(kFp8ChannelsPerScale) +
                        " channels and takes no scales; got " +
                        std::string(c10::toString(data.scalar_type())) + " rows of " + std::to_string(data.size(1)));
        if (dequantize)
            require(quantize ? dequantize == quantize
                             : scales && data.scalar_type() == at::kFloat8_e4m3fn &&
                                   scales->scalar_type() == scale_type(dequantize) &&
                                   data.size(1) % kFp8ChannelsPerScale == 0,
                    "dequantize must be 0 or the format of FP8 rows on the wire (quantize, or a pre-quantized tuple "
                    "whose scales' dtype names it), got dequantize=" + std::to_string(dequantize) + ", quantize=" +
                        std::to_string(quantize));
    }

    // A dispatch's row outputs: [rows, H] in data's dtype with scales like the given ones, or, with `quantize`, FP8
    // rows of bf16 `data` and their scales (float32 for fp8_block128, int32 words of UE8M0 bytes for mxfp8), or,
    // with `dequantize`, bf16 rows and no scales (the casts as check_casts passed them).
    static std::pair<at::Tensor, OptionalTensor> outputs_of(const at::Tensor& data, const OptionalTensor& scales,
                                                            int quantize, int dequantize, int64_t rows) {
        if (dequantize) return {at::empty({rows, data.size(1)}, data.options().dtype(at::kBFloat16)), {}};
        if (!quantize) {
            OptionalTensor out_scales;
            if (scales) out_scales = at::empty({rows, scales->size(1)}, scales->options());
            return {at::empty({rows, data.size(1)}, data.options()), out_scales};
        }
        return {at::empty({rows, data.size(1)}, data.options().dtype(at::kFloat8_e4m3fn)),
                at::empty({rows, data.size(1) / kFp8ChannelsPerScale}, data.options().dtype(scale_type(quantize)))};
    }

    // A launcher call without the GIL: a launch may block (a full launch queue), other Python threads go on.
    template <typename Fn, typename... Args>
    static int released(Fn fn, Args... args) {
        py::gil_scoped_release no_gil;
        return fn(args...);
    }

    static void require(bool condition, const std::string& what) {
        if (!condition) throw std::invalid_argument(what);
    }

    // A launcher's failure as a RuntimeError with its own message (the condition and values, or the CUDA error).
    void check(int result, const EpParams* p, const char* what) const {
        if (result) {
            throw std::runtime_error(std::string("moe_comm: ") + what + " failed on rank " + std::to_string(p->rank) +
                                     ": " + last_error_());
        }
    }

    LayoutFn layout_;
    DispatchFn dispatch_;
    CombineFn combine_;
    WaitNotifyFn wait_notify_;
    LastErrorFn last_error_;
    int64_t notify_calls_ = 0;  // synchronized dispatches so far: each one's number for its notify's done word
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "moe_comm's host path: allocate, set the per-call pointers, launch (moe_comm/csrc/torch/ops.cpp)";
    py::class_<Launcher>(m, "Launcher", py::module_local())
        .def(py::init([](uintptr_t layout, uintptr_t dispatch, uintptr_t combine, uintptr_t wait_notify,
                         uintptr_t last_error) {
            if (!layout || !dispatch || !combine || !wait_notify || !last_error)
                throw std::invalid_argument("a launcher address is 0");
            return Launcher(layout, dispatch, combine, wait_notify, last_error);
        }))
        .def("layout_dispatch", &Launcher::layout_dispatch)
        .def("cached_dispatch", &Launcher::cached_dispatch)
        .def("receive_dispatch", &Launcher::receive_dispatch)
        .def("combine", &Launcher::combine)
        .def("receive_combine", &Launcher::receive_combine);
}
