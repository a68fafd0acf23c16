// 2-D convolutions on oneDNN: forward, backward data and backward weights. Activations stay in
// Linum's NHWC layout (oneDNN's nhwc kernels read it in place); kernels are reordered into the
// blocked layout oneDNN prefers for the machine (and gradients back), which costs little next to
// the convolution. Primitives are cached per shape, dtype and thread count, so recomputation under
// remat runs the very primitive of the forward pass and gives bitwise the same result.
#include <linum/core/kernels/conv.hpp>
#include <linum/core/kernels/gemm.hpp>

#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <mutex>
#include <optional>
#include <utility>

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

Descs descs_of(const ConvShape& s) {
  const auto dt = to_dnnl(s.dtype);
  Descs d;
  d.x = memory::desc({s.n, s.c, s.h, s.w}, dt, tag::nhwc);
  d.y = memory::desc({s.n, s.o, s.oh, s.ow}, dt, tag::nhwc);
  const memory::dim og = s.o / s.groups;
  // Our kernel is [KH, KW, Cg, O] with O = G * Og, row-major.
  if (s.groups == 1)
    d.w_user = memory::desc({s.o, s.cg, s.kh, s.kw}, dt, memory::dims{1, s.o, s.kw * s.cg * s.o, s.cg * s.o});
  else
    d.w_user = memory::desc({s.groups, og, s.cg, s.kh, s.kw}, dt,
                            memory::dims{og, 1, s.o, s.kw * s.cg * s.o, s.cg * s.o});
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
auto with_threads(int threads, F&& body) {
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

int threads_for(const ConvShape& s) {
#ifdef _OPENMP
  const double macs = static_cast<double>(s.n) * s.oh * s.ow * s.o * s.kh * s.kw * s.cg;
  if (!omp_in_parallel() && macs >= kParallelGemmWork) return omp_get_max_threads();
#endif
  return 1;
}

memory wrap(const memory::desc& md, const Array& a) { return memory(md, cpu_engine(), const_cast<void*>(a.raw())); }

// `m` in layout `want`: itself when it already is, else a reordered copy.
memory in_layout(memory m, const memory::desc& want, dnnl::stream& stream) {
  if (m.get_desc() == want) return m;
  memory out(want, cpu_engine());
  dnnl::reorder(m, out).execute(stream, m, out);
  return out;
}

}  // namespace

Array conv_forward_onednn(const Array& x, const Array& w, const ConvShape& s) {
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

Array conv_backward_weights_onednn(const Array& x, const Array& gy, const ConvShape& s) {
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
    if (!direct) dnnl::reorder(mdw, user_dw).execute(stream, mdw, user_dw);
    stream.wait();
    return dw;
  });
}

}  // namespace linum::kernels
