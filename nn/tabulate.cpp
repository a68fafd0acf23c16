#include <linum/nn/tabulate.hpp>


#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <map>
#include <sstream>

namespace linum::nn {

namespace tabulate_detail {

// A module-call hook that records every call: a row on entry, its output's shape on return.
struct Trace::Observer final : linum::detail::ModuleCallHook {
  std::vector<Row> rows;

  bool wants(const linum::detail::ModuleCall&) const override { return true; }
  std::vector<Array> around(Scope& scope, const linum::detail::ModuleCall& call, const linum::detail::ModuleCallBody& next,
                            const linum::detail::ModuleCallBody&) override {
    Row r;
    r.path = call.path;
    r.type = call.type;
    rows.push_back(std::move(r));
    const std::size_t row = rows.size() - 1;
    std::vector<Array> outputs = next(scope);
    if (!outputs.empty() && outputs.front().defined()) {
      rows[row].has_output = true;
      rows[row].output_shape = outputs.front().shape();
      rows[row].output_dtype = outputs.front().dtype();
    }
    return outputs;
  }
};

Trace::Trace()
    : observer_(std::make_unique<Observer>()),
      guard_(std::make_unique<linum::detail::ModuleCallHookGuard>(observer_.get())) {}
Trace::~Trace() = default;
const std::vector<Row>& Trace::rows() const { return observer_->rows; }

namespace {

std::string join(const std::vector<std::string>& parts) { return linum::detail::join_module_path(parts); }

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : path) {
    if (c == '/') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!path.empty()) out.push_back(cur);
  return out;
}

// "Dense" for "Dense_3"; empty for names that are not <CamelCaseType>_<n>.
std::string type_from_name(const std::string& name) {
  const auto us = name.rfind('_');
  if (us == std::string::npos || us == 0 || us + 1 == name.size()) return {};
  if (!std::all_of(name.begin() + static_cast<std::ptrdiff_t>(us) + 1, name.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
    return {};
  if (!std::isupper(static_cast<unsigned char>(name[0]))) return {};
  return name.substr(0, us);
}

std::string shape_str(DType dtype, const Shape& shape) {
  std::ostringstream os;
  os << dtype_name(dtype) << '[';
  for (int i = 0; i < shape.rank(); ++i) os << (i ? "," : "") << shape[i];
  os << ']';
  return os.str();
}

// Flax's _bytes_repr: decimal units with one decimal ("2.6 KB"), plain bytes up to 1000.
std::string bytes_str(std::int64_t bytes) {
  const double b = static_cast<double>(bytes);
  char buf[64];
  if (b > 1e9) std::snprintf(buf, sizeof(buf), "%.1f GB", b / 1e9);
  else if (b > 1e6) std::snprintf(buf, sizeof(buf), "%.1f MB", b / 1e6);
  else if (b > 1e3) std::snprintf(buf, sizeof(buf), "%.1f KB", b / 1e3);
  else std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  return buf;
}

std::string count_str(std::int64_t count, std::int64_t bytes) {
  if (count == 0) return "";
  return std::to_string(count) + " (" + bytes_str(bytes) + ")";
}

struct Owned {
  std::int64_t count = 0, bytes = 0;
};

}  // namespace

std::string render(const std::string& root_type, const Tree& variables, std::vector<Row> rows, const Array& root_output) {
  // Variables owned directly by each module path, per collection.
  std::vector<std::string> collections = variables.keys();
  std::map<std::pair<std::string, std::string>, Owned> owned;  // (collection, module path)
  std::vector<std::string> variable_modules;                   // module paths in dict order
  for (const auto& collection : collections) {
    for (const auto& [path, array] : flatten(variables.at(collection))) {
      auto parts = split(path);
      parts.pop_back();
      const std::string module = join(parts);
      Owned& o = owned[{collection, module}];
      o.count += array.numel();
      o.bytes += static_cast<std::int64_t>(array.nbytes());
      if (std::find(variable_modules.begin(), variable_modules.end(), module) == variable_modules.end())
        variable_modules.push_back(module);
    }
  }
  // Modules that own variables but were not seen running ops still get a row.
  for (const auto& module : variable_modules) {
    const auto parts = split(module);
    if (std::none_of(rows.begin(), rows.end(), [&](const Row& r) { return r.path == parts; })) {
      Row r;
      r.path = parts;
      rows.push_back(std::move(r));
    }
  }
  if (rows.empty() || !rows.front().path.empty()) rows.insert(rows.begin(), Row{});
  if (root_output.defined()) {
    rows.front().has_output = true;
    rows.front().output_shape = root_output.shape();
    rows.front().output_dtype = root_output.dtype();
  }

  // Cells.
  std::vector<std::string> header{"path", "module", "outputs"};
  for (const auto& c : collections) header.push_back(c);
  header.push_back("activation bytes");
  std::vector<std::vector<std::string>> table;
  std::int64_t activation_total = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const std::string path = join(r.path);
    std::vector<std::string> cells;
    cells.push_back(r.path.empty() ? "<root>" : path);
    cells.push_back(r.path.empty() ? root_type : !r.type.empty() ? r.type : type_from_name(r.path.back()));
    cells.push_back(r.has_output ? shape_str(r.output_dtype, r.output_shape) : "?");
    for (const auto& c : collections) {
      auto it = owned.find({c, path});
      cells.push_back(it == owned.end() ? "" : count_str(it->second.count, it->second.bytes));
    }
    const std::int64_t out_bytes = r.has_output ? r.output_shape.numel() * static_cast<std::int64_t>(dtype_size(r.output_dtype)) : 0;
    cells.push_back(r.has_output ? bytes_str(out_bytes) : "?");
    const bool leaf = std::none_of(rows.begin(), rows.end(), [&](const Row& o) {
      return o.path.size() > r.path.size() && std::equal(r.path.begin(), r.path.end(), o.path.begin());
    });
    if (leaf) activation_total += out_bytes;
    table.push_back(std::move(cells));
  }
  std::vector<std::string> totals{"Total", "", ""};
  for (const auto& c : collections) totals.push_back(count_str(param_count(variables.at(c)), byte_count(variables.at(c))));
  totals.push_back(bytes_str(activation_total));

  std::vector<std::size_t> width(header.size(), 0);
  auto widen = [&](const std::vector<std::string>& cells) {
    for (std::size_t i = 0; i < cells.size(); ++i) width[i] = std::max(width[i], cells[i].size());
  };
  widen(header);
  widen(totals);
  for (const auto& cells : table) widen(cells);

  std::ostringstream os;
  auto rule = [&] {
    os << '+';
    for (std::size_t w : width) os << std::string(w + 2, '-') << '+';
    os << '\n';
  };
  auto line = [&](const std::vector<std::string>& cells) {
    os << '|';
    for (std::size_t i = 0; i < cells.size(); ++i) os << ' ' << cells[i] << std::string(width[i] - cells[i].size() + 1, ' ') << '|';
    os << '\n';
  };
  os << root_type << " summary\n";
  rule();
  line(header);
  rule();
  for (const auto& cells : table) line(cells);
  rule();
  line(totals);
  rule();
  for (const auto& c : collections)
    os << "Total " << c << ": " << param_count(variables.at(c)) << " (" << bytes_str(byte_count(variables.at(c))) << ")\n";
  os << "Total activation bytes (modules without submodules): " << activation_total << " (" << bytes_str(activation_total)
     << ")\n";
  return os.str();
}

}  // namespace tabulate_detail

}  // namespace linum::nn
