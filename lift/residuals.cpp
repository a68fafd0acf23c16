#include <linum/lift/residuals.hpp>

#include <linum/core/autodiff/hooks.hpp>
#include <linum/modules/scope.hpp>

#include <map>
#include <unordered_set>

namespace linum::lift {

std::string Residual::str() const {
  std::string s = std::string(dtype_short_name(dtype)) + "[";
  for (int i = 0; i < shape.rank(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  s += "] ";
  if (kind == "argument") s += "from the argument " + std::to_string(argument);
  else if (kind == "op") s += (name.empty() ? "" : "named '" + name + "' ") + std::string("output of ") + op;
  else s += "from a constant";
  if (!module_path.empty()) s += " in " + module_path;
  return s;
}

namespace detail {
namespace {

struct Producer {
  std::string op, name, module_path;
  Array keep;  // keeps the buffer (and so its address) alive while the trace runs
};

// Remembers which op produced each buffer recorded while tracing.
class ProducerTrace final : public autodiff::detail::RecordHook {
 public:
  void on_record(const char* op, Array& out, const autodiff::Node* node, const autodiff::detail::PrimitiveCall*) override {
    const auto* where = linum::detail::current_module_path();
    std::string path = where ? linum::detail::join_module_path(*where) : std::string();
    // A view (reshape, a same-shape broadcast_to) only looks at the value its input's producer made,
    // so it does not take the name; a checkpoint or checkpoint_name re-publishing a value does.
    const std::string_view kind = op;
    Producer p{op, std::string(node ? node->label() : std::string_view()), std::move(path), out.detached()};
    if (kind == "reshape" || kind == "broadcast_to") producers_.try_emplace(out.raw(), std::move(p));
    else producers_[out.raw()] = std::move(p);
  }
  const Producer* find(const void* p) const {
    auto it = producers_.find(p);
    return it == producers_.end() ? nullptr : &it->second;
  }

 private:
  std::map<const void*, Producer> producers_;
};

}  // namespace

std::vector<Residual> trace_residuals(const std::vector<Array>& arguments,
                                      const std::function<std::vector<Array>(const std::vector<Array>&)>& run) {
  std::vector<Array> tracked;
  std::map<const void*, int> argument_index;
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    const Array& a = arguments[i];
    tracked.push_back(a.defined() && is_floating(a.dtype()) ? autodiff::make_leaf(a) : a);
    if (a.defined()) argument_index.emplace(a.raw(), static_cast<int>(i));
  }
  ProducerTrace trace;
  std::vector<Array> outs;
  {
    autodiff::EnableGradGuard recording;
    outs = run(tracked);
  }
  // Walk the graph from the outputs; list each node's saved arrays once.
  std::vector<Residual> result;
  std::unordered_set<const void*> listed;
  std::unordered_set<const autodiff::Node*> seen;
  std::vector<const autodiff::Node*> stack;
  for (const Array& o : outs)
    if (o.node() && seen.insert(o.node().get()).second) stack.push_back(o.node().get());
  while (!stack.empty()) {
    const autodiff::Node* n = stack.back();
    stack.pop_back();
    std::vector<Array> saved;
    n->saved_arrays(saved);
    for (const Array& a : saved) {
      if (!a.defined() || !listed.insert(a.raw()).second) continue;
      Residual r;
      r.shape = a.shape();
      r.dtype = a.dtype();
      r.bytes = a.nbytes();
      if (auto it = argument_index.find(a.raw()); it != argument_index.end()) {
        r.kind = "argument";
        r.argument = it->second;
      } else if (const Producer* p = trace.find(a.raw())) {
        r.kind = "op";
        r.op = p->op;
        r.name = p->name;
        r.module_path = p->module_path;
      } else {
        r.kind = "constant";
      }
      result.push_back(std::move(r));
    }
    for (const autodiff::Edge& e : n->inputs())
      if (e.node && seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  }
  return result;
}

}  // namespace detail
}  // namespace linum::lift
