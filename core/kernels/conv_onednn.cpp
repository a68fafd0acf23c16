// 2-D convolutions on oneDNN: forward, backward data and backward weights. Activations stay in
// Linum's NHWC layout (oneDNN's nhwc kernels read it in place); kernels are reordered into the
// blocked layout oneDNN prefers for the machine (and gradients back), which costs little next to
// the convolution. Primitives are cached per shape, dtype and thread count, so recomputation under
// remat runs the very primitive of the forward pass and gives bitwise the same result.
#include <linum/core/kernels/conv.hpp>
#include <linum/core/profiler.hpp>
#include <linum/core/kernels/engine.hpp>
#include <linum/core/kernels/gemm.hpp>

#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>
#include <exception>
#include <linum/core/threading.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels {
namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;

dnnl::engine& cpu_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

memory::data_type to_dnnl(DType t) { return t == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32; }

// The descriptors of one convolution geometry in Linum's layouts.
struct Descs {
  memory::desc x, w_user, y;
  memory::dims strides, dilates, pad_l, pad_r;
};

// Our kernel layout, [KH, KW, Cg, O] with O = G * Og, row-major, with elements of type `dt`.
memory::desc kernel_desc(const ConvShape& s, memory::data_type dt) {
  const memory::dim og = s.o / s.groups;
  if (s.groups == 1) return memory::desc({s.o, s.cg, s.kh, s.kw}, dt, memory::dims{1, s.o, s.kw * s.cg * s.o, s.cg * s.o});
  return memory::desc({s.groups, og, s.cg, s.kh, s.kw}, dt, memory::dims{og, 1, s.o, s.kw * s.cg * s.o, s.cg * s.o});
}

Descs descs_of(const ConvShape& s) {
  const auto dt = to_dnnl(s.dtype);
  Descs d;
  d.x = memory::desc({s.n, s.c, s.h, s.w}, dt, tag::nhwc);
  d.y = memory::desc({s.n, s.o, s.oh, s.ow}, dt, tag::nhwc);
  d.w_user = kernel_desc(s, dt);
  d.strides = {s.sh, s.sw};
  d.dilates = {s.dh - 1, s.dw - 1};
  d.pad_l = {s.pad_top, s.pad_left};
  d.pad_r = {s.pad_bottom, s.pad_right};
  return d;
}

memory::desc any_weights(const Descs& d) { return memory::desc(d.w_user.dims(), d.w_user.data_type(), tag::any); }

template <class Prim>
using Built = std::optional<std::pair<typename Prim::primitive_desc, Prim>>;

struct Primitives {
  Descs d;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Built<dnnl::convolution_backward_data> bwd_data;        // created on first use (training only)
  Built<dnnl::convolution_backward_weights> bwd_weights;
};

std::mutex g_mutex;
std::map<std::pair<ConvShape, int>, Primitives>& cache() {
  static std::map<std::pair<ConvShape, int>, Primitives> c;
  return c;
}

// oneDNN refuses some legal geometries (e.g. a stride beyond its dimension limits): a Linum error
// naming the geometry, instead of oneDNN's own exception.
[[noreturn]] void refused(const ConvShape& s, const dnnl::error& e) {
  throw ShapeError(linum::detail::cat("conv2d: oneDNN cannot build a convolution of input [", s.n, ", ", s.h, ", ", s.w, ", ",
                                      s.c, "] with kernel [", s.kh, ", ", s.kw, ", ", s.cg, ", ", s.o, "], strides (", s.sh,
                                      ", ", s.sw, "), dilation (", s.dh, ", ", s.dw, ") and padding (", s.pad_top, ", ",
                                      s.pad_bottom, ", ", s.pad_left, ", ", s.pad_right, "): ", e.what(),
                                      "; the Eigen engine (set_engine(Engine::eigen)) has no such limit"));
}

Primitives& primitives_for(const ConvShape& s, int threads) {
  auto key = std::make_pair(s, threads);
  auto it = cache().find(key);
  if (it != cache().end()) return it->second;
  try {
    Descs d = descs_of(s);
    dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, d.x,
                                       any_weights(d), d.y, d.strides, d.dilates, d.pad_l, d.pad_r);
    dnnl::convolution_forward::primitive_desc fpd(fd, cpu_engine());
    Primitives p{d, fpd, dnnl::convolution_forward(fpd), {}, {}};
    return cache().emplace(key, std::move(p)).first->second;
  } catch (const dnnl::error& e) {
    refused(s, e);
  }
}

// A backward primitive (data or weights; their descriptors take the same arguments), built once.
template <class Prim>
const std::pair<typename Prim::primitive_desc, Prim>& backward(Built<Prim>& slot, const Primitives& p) {
  if (!slot) {
    typename Prim::desc desc(dnnl::algorithm::convolution_direct, p.d.x, any_weights(p.d), p.d.y, p.d.strides,
                             p.d.dilates, p.d.pad_l, p.d.pad_r);
    typename Prim::primitive_desc pd(desc, cpu_engine(), p.fwd_pd);
    slot.emplace(pd, Prim(pd));
  }
  return *slot;
}

// Runs `body` with OpenMP limited to the thread count chosen for this convolution (one thread for
// small ones, as matrix products), restoring the caller's setting.
template <class F>
auto with_threads([[maybe_unused]] int threads, F&& body) {
#ifdef _OPENMP
  const int previous = omp_get_max_threads();
  if (threads != previous) omp_set_num_threads(threads);
  struct Restore {
    int previous, now;
    ~Restore() { if (now != previous) omp_set_num_threads(previous); }
  } restore{previous, threads};
#endif
  return body();
}

// The team a large reorder may use: OpenMP's current maximum, which inside a convolution is the
// team that convolution chose (one thread for a small one).
int threads_for_elements() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int threads_for([[maybe_unused]] const ConvShape& s) {
#ifdef _OPENMP
  const double macs = static_cast<double>(s.n) * s.oh * s.ow * s.o * s.kh * s.kw * s.cg;
  if (!omp_in_parallel() && macs >= kParallelGemmWork) return omp_get_max_threads();
#endif
  return 1;
}

memory wrap(const memory::desc& md, const Array& a) { return memory(md, cpu_engine(), const_cast<void*>(a.raw())); }

// A reorder of a kernel (or its gradient) from `from` into `to`. Kernels are small next to the
// convolution (3x3x24x24 in the main example: 5184 elements), and a reorder on the whole team costs
// a parallel region whose threads must all get a core: on a busy machine that wait was ~6 ms per
// reorder, most of a bf16 training step. So one thread unless the kernel is large.
void reorder_kernel(memory& from, memory& to, dnnl::stream& stream) {
  const memory::dims dims = from.get_desc().dims();
  std::int64_t elements = 1;
  for (const memory::dim d : dims) elements *= d;
  with_threads(elements >= (std::int64_t{1} << 18) ? threads_for_elements() : 1,
               [&] { dnnl::reorder(from, to).execute(stream, from, to); });
}

// `m` in layout `want`: itself when it already is, else a reordered copy.
memory in_layout(memory m, const memory::desc& want, dnnl::stream& stream) {
  if (m.get_desc() == want) return m;
  memory out(want, cpu_engine());
  reorder_kernel(m, out, stream);
  return out;
}

}  // namespace

bool onednn_bf16_conv_available() {
  static const bool available = [] {
    try {
      const ConvShape s{1, 4, 4, 2, 3, 3, 2, 2, 1, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1, DType::bf16};
      const Descs d = descs_of(s);
      dnnl::convolution_forward::desc fd(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, d.x,
                                         any_weights(d), d.y, d.strides, d.dilates, d.pad_l, d.pad_r);
      const dnnl::convolution_forward::primitive_desc fpd(fd, cpu_engine());
      const dnnl::convolution_backward_data::desc dd(dnnl::algorithm::convolution_direct, d.x, any_weights(d), d.y,
                                                     d.strides, d.dilates, d.pad_l, d.pad_r);
      const dnnl::convolution_backward_data::primitive_desc dpd(dd, cpu_engine(), fpd);
      const dnnl::convolution_backward_weights::desc wd(dnnl::algorithm::convolution_direct, d.x, any_weights(d), d.y,
                                                        d.strides, d.dilates, d.pad_l, d.pad_r);
      const dnnl::convolution_backward_weights::primitive_desc wpd(wd, cpu_engine(), fpd);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

namespace {
// bf16 where this CPU has no oneDNN bf16 convolutions (oneDNN 2.7 builds them for AVX-512 and AMX,
// not for AVX2 CPUs such as AMD's Zen 3) or bf16_products() is widened: the float32 kernels on the operands widened (exactly:
// every bf16 value is a float32) and the result rounded once, as bf16 kernels sum in float32.
// Nullopt where the bf16 kernels run.
template <class F>
std::optional<Array> widened(const ConvShape& s, const Array& p, const Array& q, F&& f32_kernel) {
  if (s.dtype != DType::bf16 || (onednn_bf16_conv_available() && bf16_products() != Bf16Products::widened)) return std::nullopt;
  ConvShape s32 = s;
  s32.dtype = DType::f32;
  // (the widened operands freed before the rounding: the peak is theirs and the float32 result's,
  // not also the bf16 result's)
  const Array r32 = f32_kernel(linum::detail::convert_float(p, DType::f32), linum::detail::convert_float(q, DType::f32), s32);
  return linum::detail::convert_float(r32, DType::bf16);
}
}  // namespace

Array conv_forward_onednn(const Array& x, const Array& w, const ConvShape& s) {
  if (auto y = widened(s, x, w, conv_forward_onednn)) return std::move(*y);
  profiler::detail::add_flops(conv_flops(s));
  const int threads = threads_for(s);
  return with_threads(threads, [&] {
    std::unique_lock<std::mutex> lock(g_mutex);
    Primitives& p = primitives_for(s, threads);
    lock.unlock();
    Array y = Array::empty(Shape{s.n, s.oh, s.ow, s.o}, s.dtype);
    dnnl::stream stream(cpu_engine());
    memory mw = in_layout(wrap(p.d.w_user, w), p.fwd_pd.weights_desc(), stream);
    memory mx = wrap(p.d.x, x), my(p.d.y, cpu_engine(), y.mutable_raw());
    p.fwd.execute(stream, {{DNNL_ARG_SRC, mx}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DST, my}});
    stream.wait();
    return y;
  });
}

Array conv_backward_data_onednn(const Array& gy, const Array& w, const ConvShape& s) {
  if (auto dx = widened(s, gy, w, conv_backward_data_onednn)) return std::move(*dx);
  profiler::detail::add_flops(conv_flops(s));
  const int threads = threads_for(s);
  return with_threads(threads, [&] {
    std::unique_lock<std::mutex> lock(g_mutex);
    Primitives& p = primitives_for(s, threads);
    const auto& [pd, prim] = backward(p.bwd_data, p);
    lock.unlock();
    Array dx = Array::empty(Shape{s.n, s.h, s.w, s.c}, s.dtype);
    dnnl::stream stream(cpu_engine());
    memory mw = in_layout(wrap(p.d.w_user, w), pd.weights_desc(), stream);
    memory mgy = wrap(p.d.y, gy), mdx(p.d.x, cpu_engine(), dx.mutable_raw());
    prim.execute(stream, {{DNNL_ARG_DIFF_DST, mgy}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DIFF_SRC, mdx}});
    stream.wait();
    return dx;
  });
}

namespace {

// One single-threaded weight gradient of images [n0, n0 + count), in Linum's kernel layout but
// always in float32 (bf16 pieces are summed in float32 and rounded once): a primitive with a user
// scratchpad, so pieces of the same shape can run on several threads at once.
struct WeightPiece {
  ConvShape shape;
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights prim;
  memory::desc x, y, w_user;
};

WeightPiece& weight_piece_for(const ConvShape& s) {
  static std::map<ConvShape, WeightPiece> pieces;  // under g_mutex
  auto it = pieces.find(s);
  if (it != pieces.end()) return it->second;
  return *with_threads(1, [&]() -> WeightPiece* {
    try {
      Primitives& p = primitives_for(s, 1);
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      // The user kernel layout with float32 elements (the same strides: Linum's [KH, KW, Cg, O]).
      const memory::desc w_f32 = kernel_desc(s, memory::data_type::f32);
      const memory::desc any_f32(p.d.w_user.dims(), memory::data_type::f32, tag::any);
      dnnl::convolution_backward_weights::desc desc(dnnl::algorithm::convolution_direct, p.d.x, any_f32, p.d.y,
                                                    p.d.strides, p.d.dilates, p.d.pad_l, p.d.pad_r);
      dnnl::convolution_backward_weights::primitive_desc pd(desc, attr, cpu_engine(), p.fwd_pd);
      WeightPiece piece{s, pd, dnnl::convolution_backward_weights(pd), p.d.x, p.d.y, w_f32};
      return &pieces.emplace(s, std::move(piece)).first->second;
    } catch (const dnnl::error& e) {
      refused(s, e);
    }
  });
}

// Runs a piece (on the calling thread: oneDNN runs single-threaded inside a parallel region) into
// `dw` (Linum's layout).
void run_piece(const WeightPiece& piece, const void* x, const void* gy, void* dw) {
  dnnl::stream stream(cpu_engine());
  memory mx(piece.x, cpu_engine(), const_cast<void*>(x)), mgy(piece.y, cpu_engine(), const_cast<void*>(gy));
  memory user_dw(piece.w_user, cpu_engine(), dw);
  const bool direct = piece.pd.diff_weights_desc() == piece.w_user;
  memory mdw = direct ? user_dw : memory(piece.pd.diff_weights_desc(), cpu_engine());
  memory scratch(piece.pd.scratchpad_desc(), cpu_engine());
  piece.prim.execute(stream, {{DNNL_ARG_SRC, mx}, {DNNL_ARG_DIFF_DST, mgy}, {DNNL_ARG_DIFF_WEIGHTS, mdw},
                              {DNNL_ARG_SCRATCHPAD, scratch}});
  if (!direct) reorder_kernel(mdw, user_dw, stream);
  stream.wait();
}

}  // namespace

// The weight gradient sums over the batch. oneDNN's kernels sum per thread (float32 everywhere,
// bfloat16 on CPUs with AMX), so their bits would depend on the thread count (the team adapts to a
// busy machine; ranks of a data-parallel job run different counts). Large convolutions are
// therefore cut into pieces of the batch fixed by the shape, each computed on one thread in
// float32, and the pieces summed in index order (bf16 rounded once at the end): the same bits on
// any team.
Array conv_backward_weights_onednn(const Array& x, const Array& gy, const ConvShape& s) {
  if (auto dw = widened(s, x, gy, conv_backward_weights_onednn)) return std::move(*dw);
  profiler::detail::add_flops(conv_flops(s));
  constexpr std::int64_t kPieces = 8;
  const std::int64_t pieces = std::min<std::int64_t>(s.n, kPieces);
#ifdef _OPENMP
  const double macs = static_cast<double>(s.n) * s.oh * s.ow * s.o * s.kh * s.kw * s.cg;
  const bool split = pieces > 1 && macs >= kParallelGemmWork && !omp_in_parallel();
#else
  const bool split = false;
#endif
  if (split) {
    // Piece i holds images [i * n / pieces, (i + 1) * n / pieces): at most two distinct shapes.
    std::vector<std::int64_t> first(pieces + 1);
    for (std::int64_t i = 0; i <= pieces; ++i) first[i] = i * s.n / pieces;
    std::vector<const WeightPiece*> plan(pieces);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      for (std::int64_t i = 0; i < pieces; ++i) {
        ConvShape ps = s;
        ps.n = first[i + 1] - first[i];
        plan[i] = &weight_piece_for(ps);
      }
    }
    const std::int64_t w_elems = s.kh * s.kw * s.cg * s.o;
    const std::size_t item = dtype_size(s.dtype);  // of x and gy; the pieces' outputs are float32
    const std::int64_t x_image = s.h * s.w * s.c, y_image = s.oh * s.ow * s.o;
    Array piece_out = Array::empty(Shape{pieces, w_elems});
    const auto* xb = static_cast<const char*>(x.raw());
    const auto* gb = static_cast<const char*>(gy.raw());
    auto* ob = static_cast<char*>(piece_out.mutable_raw());
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 1) num_threads(linum::team_size())
    for (std::int64_t i = 0; i < pieces; ++i) {
      try {
        run_piece(*plan[i], xb + first[i] * x_image * item, gb + first[i] * y_image * item,
                  ob + i * w_elems * sizeof(float));
      } catch (...) {
#pragma omp critical(linum_conv_piece_failure)
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    // The sum over pieces, in index order.
    const float* in = piece_out.data();
    Array total = Array::empty(Shape{s.kh, s.kw, s.cg, s.o});
    float* out = total.mutable_data();
    for (std::int64_t e = 0; e < w_elems; ++e) out[e] = in[e];
    for (std::int64_t i = 1; i < pieces; ++i)
      for (std::int64_t e = 0; e < w_elems; ++e) out[e] += in[i * w_elems + e];
    if (s.dtype == DType::f32) return total;
    Array rounded = Array::empty(total.shape(), s.dtype);
    f32_to_bf16(out, static_cast<bfloat16*>(rounded.mutable_raw()), w_elems);
    return rounded;
  }
  const int threads = threads_for(s);
  return with_threads(threads, [&] {
    std::unique_lock<std::mutex> lock(g_mutex);
    Primitives& p = primitives_for(s, threads);
    const auto& [pd, prim] = backward(p.bwd_weights, p);
    lock.unlock();
    Array dw = Array::empty(Shape{s.kh, s.kw, s.cg, s.o}, s.dtype);
    dnnl::stream stream(cpu_engine());
    memory user_dw(p.d.w_user, cpu_engine(), dw.mutable_raw());
    const bool direct = pd.diff_weights_desc() == p.d.w_user;
    memory mdw = direct ? user_dw : memory(pd.diff_weights_desc(), cpu_engine());
    memory mx = wrap(p.d.x, x), mgy = wrap(p.d.y, gy);
    prim.execute(stream, {{DNNL_ARG_SRC, mx}, {DNNL_ARG_DIFF_DST, mgy}, {DNNL_ARG_DIFF_WEIGHTS, mdw}});
    if (!direct) reorder_kernel(mdw, user_dw, stream);
    stream.wait();
    return dw;
  });
}

}  // namespace linum::kernels
