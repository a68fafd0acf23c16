#include <linum/core/autodiff/graph.hpp>

#include <algorithm>
#include <utility>

namespace linum::autodiff {
namespace {

thread_local bool t_recording = true;
std::atomic<std::uint64_t> g_sweep_counter{0};

// a += b for same-shaped float arrays, into a fresh buffer when `a`'s is shared.
Array accumulate(Array a, const Array& b) {
  Array out = Array::empty(a.shape());
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.mutable_data();
  const std::int64_t n = a.numel();
#pragma omp parallel for if (n > (1 << 16)) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  return out;
}

}  // namespace

bool is_recording() { return t_recording; }

NoGradGuard::NoGradGuard() : previous_(t_recording) { t_recording = false; }
NoGradGuard::~NoGradGuard() { t_recording = previous_; }

bool needs_grad(std::span<const Array> inputs) {
  if (!is_recording()) return false;
  return std::any_of(inputs.begin(), inputs.end(), [](const Array& a) { return a.node() != nullptr; });
}

std::vector<Edge> edges_of(std::initializer_list<const Array*> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Array* a : inputs) edges.push_back(Edge{a->node(), a->output_index()});
  return edges;
}

std::vector<Edge> edges_of(std::span<const Array> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Array& a : inputs) edges.push_back(Edge{a.node(), a.output_index()});
  return edges;
}

Array Node::take_grad(std::size_t i) {
  if (i >= grads_.size()) return Array();
  return std::exchange(grads_[i], Array());
}

Array make_leaf(const Array& x) {
  if (x.dtype() != DType::f32)
    throw AutodiffError(detail::cat("make_leaf: only float32 arrays can be differentiated, got ",
                                    dtype_name(x.dtype()), x.shape().str(),
                                    "; pass integer arrays (labels, indices) as non-differentiated arguments"));
  Array leaf = x.detached();
  leaf.set_node(std::make_shared<LeafNode>(x.shape()), 0);
  return leaf;
}

void backward(std::span<const Array> roots, std::span<const Array> cotangents, bool retain_graph) {
  if (roots.size() != cotangents.size())
    throw AutodiffError(detail::cat("backward: ", roots.size(), " roots but ", cotangents.size(), " cotangents"));
  const std::uint64_t mark = ++g_sweep_counter;

  // 1. Topological order (post-order DFS), iterative so that deep graphs cannot overflow the stack.
  std::vector<std::shared_ptr<Node>> order;
  std::vector<std::pair<std::shared_ptr<Node>, std::size_t>> stack;
  for (const Array& r : roots) {
    if (r.node() == nullptr || r.node()->mark_ == mark) continue;
    r.node()->mark_ = mark;
    stack.emplace_back(r.node(), 0);
    while (!stack.empty()) {
      Node* node = stack.back().first.get();
      std::size_t& next = stack.back().second;
      if (next < node->inputs_.size()) {
        const Edge& e = node->inputs_[next++];
        Node* child = e.node.get();
        if (child != nullptr && child->mark_ != mark) {
          if (child->released_)
            throw AutodiffError(detail::cat(
                "backward: the graph through op '", child->op(),
                "' was already used by a backward pass and freed; compute the forward pass again, or use "
                "vjp (which keeps its graph) to pull back several cotangents"));
          child->mark_ = mark;
          stack.emplace_back(e.node, 0);
        }
      } else {
        order.push_back(std::move(stack.back().first));
        stack.pop_back();
      }
    }
  }

  // 2. Seed the roots' cotangents.
  for (std::size_t i = 0; i < roots.size(); ++i) {
    Node* n = roots[i].node().get();
    if (n == nullptr) continue;
    if (n->released_)
      throw AutodiffError(detail::cat("backward: the graph through op '", n->op(),
                                      "' was already used by a backward pass and freed"));
    if (!(cotangents[i].shape() == roots[i].shape()))
      throw AutodiffError(detail::cat("backward: cotangent of shape ", cotangents[i].shape(),
                                      " for an output of shape ", roots[i].shape()));
    n->grads_.resize(n->num_outputs());
    Array& slot = n->grads_[roots[i].output_index()];
    slot = slot.defined() ? accumulate(slot, cotangents[i]) : cotangents[i].detached();
  }

  // 3. Sweep in reverse topological order.
  NoGradGuard no_grad;  // backward rules compute with constants
  std::vector<Array> in_grads;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* node = it->get();
    if (node->is_leaf()) continue;
    node->grads_.resize(node->num_outputs());
    bool any = std::any_of(node->grads_.begin(), node->grads_.end(), [](const Array& g) { return g.defined(); });
    if (any) {
      if (node->num_outputs() == 1 && !node->grads_[0].defined()) continue;
      in_grads.assign(node->inputs_.size(), Array());
      Cotangents c(node->grads_, in_grads, node->inputs_);
      node->backward(c);
      for (std::size_t k = 0; k < node->inputs_.size(); ++k) {
        const Edge& e = node->inputs_[k];
        if (e.node == nullptr || !in_grads[k].defined()) continue;
        Node* target = e.node.get();
        const Shape& want = target->output_shapes_[e.index];
        if (!(in_grads[k].shape() == want))
          throw AutodiffError(detail::cat("backward rule of op '", node->op(), "' produced a gradient of shape ",
                                          in_grads[k].shape(), " for input ", k, " of shape ", want,
                                          " (a bug in that op's rule; please report it)"));
        target->grads_.resize(target->num_outputs());
        Array& slot = target->grads_[e.index];
        slot = slot.defined() ? accumulate(std::move(slot), in_grads[k]) : std::move(in_grads[k]).detached();
      }
      in_grads.clear();
    }
    node->grads_.clear();
    if (!retain_graph) {
      node->release();
      node->released_ = true;
      node->inputs_.clear();
      node->inputs_.shrink_to_fit();
    }
    it->reset();  // drop our reference: the node dies now unless an array still refers to it
  }
}

}  // namespace linum::autodiff

#include <linum/core/autodiff/grad.hpp>

namespace linum::autodiff {
EnableGradGuard::EnableGradGuard() : previous_(t_recording) { t_recording = true; }
EnableGradGuard::~EnableGradGuard() { t_recording = previous_; }
}  // namespace linum::autodiff
