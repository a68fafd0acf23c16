#include <linum/lift/policies.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/hooks.hpp>
#include <linum/core/autodiff/primitive.hpp>

#include <algorithm>
#include <charconv>
#include <optional>

namespace linum::lift {

Policy::Policy() : description_("nothing_saveable") {}
Policy::Policy(std::string description, Predicate saveable) : description_(std::move(description)) {
  if (saveable)
    decider_ = [saveable = std::move(saveable)](const OpInfo& op) -> std::optional<storage::Placement> {
      if (saveable(op)) return storage::Placement{};
      return std::nullopt;
    };
}
Policy::Policy(std::string description, Decider decide) : description_(std::move(description)), decider_(std::move(decide)) {}

Policy policies_detail_beyond_ram(Policy p) {
  p.beyond_ram_ = true;
  return p;
}

Policy policies_detail_inputs_on_disk(Policy p, bool on_disk) {
  p.inputs_on_disk_ = on_disk;
  if (on_disk) p.beyond_ram_ = true;
  return p;
}

Policy policies_detail_split_batch(int n, const Policy& each) {
  if (n < 1) throw ValueError(linum::detail::cat("policies::split_batch: n must be >= 1, got ", n));
  if (each.batch_splits() > 1)
    throw ValueError(linum::detail::cat("policies::split_batch: '", each.description(), "' splits already; give the product as one n"));
  Policy p = each;
  p.description_ = linum::detail::cat("split_batch(", n, ", ", each.description(), ")");
  p.splits_ = n;
  p.split_of_ = std::make_shared<const Policy>(each);
  return p;
}

Policy policies_detail_residuals(const Policy& placement) {
  Policy p("residuals(" + placement.description() + ")", placement.decider_);
  p.beyond_ram_ = true;
  p.residual_placement_ = std::make_shared<const Policy>(placement);
  return p;
}

Policy Policy::everything() {
  Policy p("everything_saveable", Predicate([](const OpInfo&) { return true; }));
  p.everything_ = true;
  return p;
}

}  // namespace linum::lift

namespace linum::policies {

using lift::OpInfo;
using lift::Policy;

Policy everything_saveable::make() { return Policy::everything(); }
Policy nothing_saveable::make() { return Policy(); }
Policy dots_saveable::make() {
  return Policy("dots_saveable", [](const OpInfo& op) { return op.is_dot(); });
}
Policy dots_with_no_batch_dims_saveable::make() {
  return Policy("dots_with_no_batch_dims_saveable",
                [](const OpInfo& op) { return (op.op == ops::kind::matmul || op.op == ops::kind::linear) && !op.has_batch_dims(); });
}

namespace {
std::string list(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}
}  // namespace

Policy save_only_these_names(std::vector<std::string> names) {
  std::string d = "save_only_these_names(" + list(names) + ")";
  return Policy(std::move(d), [names = std::move(names)](const OpInfo& op) {
    return op.op == ops::kind::checkpoint_name && std::find(names.begin(), names.end(), op.name) != names.end();
  });
}

Policy save_any_names_but_these(std::vector<std::string> names) {
  std::string d = "save_any_names_but_these(" + list(names) + ")";
  return Policy(std::move(d), [names = std::move(names)](const OpInfo& op) {
    return op.op == ops::kind::checkpoint_name && std::find(names.begin(), names.end(), op.name) == names.end();
  });
}

Policy save_from_both_policies(const Policy& a, const Policy& b) {
  if (a.saves_everything() || b.saves_everything()) return Policy::everything();
  Policy both("save_from_both_policies(" + a.description() + ", " + b.description() + ")",
              Policy::Decider([a, b](const OpInfo& op) {
                if (auto p = a.decide(op)) return p;
                return b.decide(op);
              }));
  if (a.places_beyond_ram() || b.places_beyond_ram()) both = lift::policies_detail_beyond_ram(std::move(both));
  return lift::policies_detail_inputs_on_disk(std::move(both), a.offloads_inputs() || b.offloads_inputs());
}

Policy save_and_offload_only_these_names(std::vector<std::string> saveable, std::vector<std::string> offloadable) {
  std::string d = "save_and_offload_only_these_names(" + list(saveable) + "; " + list(offloadable) + ")";
  return lift::policies_detail_beyond_ram(Policy(std::move(d), Policy::Decider([saveable = std::move(saveable), offloadable = std::move(offloadable)](
                                                  const OpInfo& op) -> std::optional<storage::Placement> {
                  if (op.op != ops::kind::checkpoint_name) return std::nullopt;
                  if (std::find(saveable.begin(), saveable.end(), op.name) != saveable.end()) return storage::Placement{};
                  if (std::find(offloadable.begin(), offloadable.end(), op.name) != offloadable.end())
                    return storage::Placement{storage::Where::disk};
                  return std::nullopt;
                })));
}

namespace {
// `which` with every placement it decides changed by `change`.
Policy transformed(std::string description, const Policy& which, storage::Placement (*change)(storage::Placement, storage::Codec),
                   storage::Codec codec) {
  if (which.saves_nothing()) return Policy(std::move(description), Policy::Decider());
  return lift::policies_detail_beyond_ram(
      Policy(std::move(description), Policy::Decider([which, change, codec](const OpInfo& op) -> std::optional<storage::Placement> {
               if (auto p = which.decide(op)) return change(*p, codec);
               return std::nullopt;
             })));
}
}  // namespace

Policy offload(const Policy& which) {
  return lift::policies_detail_inputs_on_disk(transformed("offload(" + which.description() + ")", which,
                     [](storage::Placement p, storage::Codec) { return storage::Placement{storage::Where::disk, p.codec}; },
                     storage::Codec::none), true);
}

Policy residuals(const Policy& placement) { return lift::policies_detail_residuals(placement); }
Policy split_batch(int n, const Policy& each) { return lift::policies_detail_split_batch(n, each); }

Policy compress(storage::Codec codec, const Policy& which) {
  return lift::policies_detail_inputs_on_disk(
      transformed("compress(" + std::string(storage::codec_name(codec)) + ", " + which.description() + ")", which,
                  [](storage::Placement p, storage::Codec c) { return storage::Placement{p.where, c}; }, codec),
      which.offloads_inputs());
}

}  // namespace linum::policies

namespace linum {

namespace {
// checkpoint_name's node: the identity, labelled with the name for policies.
class NamedNode final : public autodiff::Node {
 public:
  NamedNode(std::vector<autodiff::Edge> in, Shape shape, std::string name)
      : Node(ops::kind::checkpoint_name, std::move(in), std::move(shape)), name_(std::move(name)) {}
  void backward(autodiff::Cotangents& c) override { c.set(0, c.out()); }
  void backward_differentiable(autodiff::Cotangents& c, const std::shared_ptr<Node>&) override { c.set(0, c.out()); }
  std::string_view label() const override { return name_; }

 private:
  std::string name_;
};
}  // namespace

Array checkpoint_name(const Array& x, std::string name) {
  if (!x.defined()) throw ValueError("checkpoint_name: got an undefined array");
  if (x.batched()) [[unlikely]]  // vmap: the name labels the physical value
    return Array::batched_view(checkpoint_name(x.physical(), std::move(name)), x.batch_levels());
  Array y = x.detached();
  const Array* in[] = {&x};
  const std::span<const Array* const> ins(in, 1);
  if (autodiff::detail::any_needs_grad(ins)) {
    // The identity as a primitive: a replaying checkpoint hands back the value its policy saved
    // here (the name's whole point).
    if (autodiff::detail::record_hooks_active())
      if (std::optional<autodiff::detail::Replayed> r = autodiff::detail::replay_primitive(ins)) y = std::move(r->outs.at(0));
    auto node = std::make_shared<NamedNode>(autodiff::detail::edges_of(ins), x.shape(), std::move(name));
    autodiff::Node* raw = node.get();
    y.set_node(std::move(node), 0);
    const autodiff::detail::PrimitiveCall call{ins, std::span<const Array>(&y, 1), {}, 1, {}};
    autodiff::detail::after_record(ops::kind::checkpoint_name, std::span<Array>(&y, 1), raw, &call);
  }
  return y;
}

}  // namespace linum

namespace linum::policies {

namespace {
// "a, b" -> {"a", "b"} (the list inside a description's parentheses).
std::vector<std::string> split_names(std::string_view list) {
  std::vector<std::string> out;
  while (!list.empty()) {
    const std::size_t comma = list.find(", ");
    out.emplace_back(list.substr(0, comma));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 2);
  }
  return out;
}
}  // namespace

lift::Policy from_description(std::string_view d) {
  if (d == "nothing_saveable") return nothing_saveable::make();
  if (d == "everything_saveable") return everything_saveable::make();
  if (d == "dots_saveable") return dots_saveable::make();
  if (d == "dots_with_no_batch_dims_saveable") return dots_with_no_batch_dims_saveable::make();
  auto names_in = [&](std::string_view prefix) -> std::optional<std::vector<std::string>> {
    if (!d.starts_with(prefix) || !d.ends_with(")")) return std::nullopt;
    return split_names(d.substr(prefix.size(), d.size() - prefix.size() - 1));
  };
  if (auto names = names_in("save_only_these_names(")) return save_only_these_names(std::move(*names));
  if (auto names = names_in("save_any_names_but_these(")) return save_any_names_but_these(std::move(*names));
  auto inner = [&](std::string_view prefix) -> std::optional<std::string_view> {
    if (!d.starts_with(prefix) || !d.ends_with(")")) return std::nullopt;
    return d.substr(prefix.size(), d.size() - prefix.size() - 1);
  };
  if (auto in = inner("save_and_offload_only_these_names(")) {
    const std::size_t semi = in->find("; ");
    if (semi != std::string_view::npos)
      return save_and_offload_only_these_names(split_names(in->substr(0, semi)), split_names(in->substr(semi + 2)));
  }
  if (auto in = inner("offload(")) return offload(from_description(*in));
  if (auto in = inner("residuals(")) return residuals(from_description(*in));
  if (auto in = inner("split_batch(")) {
    const std::size_t comma = in->find(", ");
    if (comma != std::string_view::npos) {
      int n = 0;
      const std::string_view count = in->substr(0, comma);
      const auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), n);
      if (ec == std::errc() && end == count.data() + count.size()) return split_batch(n, from_description(in->substr(comma + 2)));
    }
  }
  if (auto in = inner("compress(")) {
    const std::size_t comma = in->find(", ");
    if (comma != std::string_view::npos) return compress(storage::codec_from_name(in->substr(0, comma)), from_description(in->substr(comma + 2)));
  }
  throw ValueError(linum::detail::cat("policies::from_description: '", d, "' names none of the standard policies "
                                      "(nothing_saveable, everything_saveable, dots_saveable, dots_with_no_batch_dims_saveable, "
                                      "save_only_these_names(...), save_any_names_but_these(...), save_and_offload_only_these_names(...; ...), "
                                      "offload(...), compress(codec, ...), residuals(...), split_batch(n, ...)); a policy made from your "
                                      "own predicate cannot be restored from its description"));
}

}  // namespace linum::policies

