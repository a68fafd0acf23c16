#include <linum/core/autodiff/jvp.hpp>

#include <linum/core/autodiff/batching.hpp>

#include <linum/core/error.hpp>

namespace linum::autodiff::detail {

std::vector<Array> flat_tangents(const std::vector<Array>& primals, const std::vector<Array>& tangents, const char* api) {
  if (primals.size() != tangents.size())
    throw ValueError(linum::detail::cat(api, ": the tangents hold ", tangents.size(), " arrays, the primals ", primals.size(),
                                        "; give one tangent per primal array, in the same structure"));
  std::vector<Array> v;
  for (std::size_t i = 0; i < primals.size(); ++i) {
    const Array& p = primals[i];
    if (!p.defined() || !is_floating(p.dtype()) || p.node() == nullptr) continue;
    const Array& t = tangents[i];
    if (!t.defined() || !(t.shape() == p.shape()) || !is_floating(t.dtype()))
      throw ValueError(linum::detail::cat(api, ": the tangent of primal array ", i, " (", p.type_str(), ") is ",
                                          t.defined() ? t.type_str() : std::string("undefined"),
                                          "; tangents must be float arrays of their primals' shapes"));
    v.push_back(physical_cotangent(p, t.detached()));  // vmap: the tangent of each example (physical)
  }
  return v;
}

std::vector<Array> jvp_by_transposition(const std::vector<Array>& roots, const std::vector<Boundary>& boundaries,
                                        const std::vector<Array>& v, bool nested) {
  // u: one fresh leaf per differentiable output, the cotangent J^T u is linear in.
  std::vector<Edge> edges;
  std::vector<Array> us;
  std::vector<Boundary> u_boundaries;
  std::vector<std::size_t> u_of(roots.size(), roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Array& r = roots[i];
    if (!r.defined() || r.node() == nullptr || !is_floating(r.dtype())) continue;
    u_of[i] = us.size();
    // (vmap: u has the root's physical shape, one per example)
    Array u = make_leaf(Array::batched_view(Array::zeros(r.physical_shape(), r.dtype()), r.batch_levels()));
    u_boundaries.push_back({u.node().get(), 0});
    edges.push_back(Edge{r.node(), r.output_index()});
    us.push_back(std::move(u));
  }
  std::vector<Array> jt_u;  // J^T u per tracked primal, functions of u
  {
    DifferentiationScope depth;
    jt_u = backward_into(edges, us, boundaries, {}, /*create_graph=*/true, /*prune=*/true);
  }
  // J v = d<J^T u, v>/du.
  std::vector<Edge> g_edges;
  std::vector<Array> g_cts;
  for (std::size_t k = 0; k < jt_u.size() && k < v.size(); ++k) {
    if (!jt_u[k].defined() || jt_u[k].node() == nullptr) continue;
    g_edges.push_back(Edge{jt_u[k].node(), jt_u[k].output_index()});
    g_cts.push_back(v[k].dtype() == jt_u[k].dtype() ? v[k] : linum::detail::convert_float(v[k], jt_u[k].dtype()));
  }
  jt_u.clear();
  std::vector<Array> jv = backward_into(std::move(g_edges), std::move(g_cts), u_boundaries, {}, nested, /*prune=*/true);
  std::vector<Array> out(roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Array& r = roots[i];
    if (!r.defined()) continue;
    const std::size_t k = u_of[i];
    if (k < jv.size() && jv[k].defined()) out[i] = Array::batched_view(jv[k], r.batch_levels());
    else out[i] = Array::zeros(r.shape(), is_floating(r.dtype()) ? r.dtype() : DType::i32);
  }
  return out;
}

}  // namespace linum::autodiff::detail
