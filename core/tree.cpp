#include <linum/core/tree.hpp>

#include <algorithm>
#include <ostream>
#include <sstream>

namespace linum {

namespace {

std::string quoted_keys(const std::vector<Tree::Entry>& entries) {
  if (entries.empty()) return "(none: the dict is empty)";
  std::string s;
  for (const auto& [k, v] : entries) {
    if (!s.empty()) s += ", ";
    s.append(1, '\'').append(k).append(1, '\'');
  }
  return s;
}

std::string where_str(std::string_view path) {
  return path.empty() ? std::string("the root") : detail::cat('\'', path, '\'');
}

std::string leaf_desc(const Array& a) { return detail::cat(dtype_name(a.dtype()), a.shape().str()); }

// Splits "a/b/c" into components; throws on empty components.
std::vector<std::string_view> split_path(std::string_view path, std::string_view where) {
  std::vector<std::string_view> parts;
  if (path.empty()) return parts;
  std::size_t start = 0;
  while (true) {
    std::size_t slash = path.find('/', start);
    std::string_view part = path.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (part.empty())
      throw ValueError(detail::cat(where, ": path '", path,
                                   "' has an empty component; paths look like 'params/Dense_0/kernel' "
                                   "(no leading, trailing or doubled '/')"));
    parts.push_back(part);
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return parts;
}

}  // namespace

// --- Tree ------------------------------------------------------------------------------------

Tree::Tree(Array leaf) {
  if (!leaf.defined())
    throw ValueError("Tree: cannot hold an undefined (default-constructed) Array as a leaf; create it "
                     "with Array::zeros/empty/from first");
  leaf_ = std::move(leaf);
}

Tree::Tree(std::initializer_list<Entry> entries) {
  entries_.reserve(entries.size());
  for (const auto& [k, v] : entries) {
    check_key(k, "Tree");
    if (find(k))
      throw ValueError(detail::cat("Tree: duplicate key '", k, "' in an initializer list; keys of a dict must be unique"));
    entries_.emplace_back(k, v);
  }
}

Tree Tree::from_entries(std::vector<Entry> entries) {
  std::vector<std::string_view> sorted;
  sorted.reserve(entries.size());
  for (const auto& e : entries) {
    check_key(e.first, "Tree::from_entries");
    sorted.push_back(e.first);
  }
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end())
    throw ValueError(detail::cat("Tree::from_entries: duplicate key '", *dup, "'; keys of a dict must be unique"));
  Tree t;
  t.entries_ = std::move(entries);
  return t;
}

void Tree::check_key(std::string_view key, std::string_view where) {
  if (key.empty())
    throw ValueError(detail::cat(where, ": tree keys must be non-empty strings"));
  if (key.find('/') != std::string_view::npos)
    throw ValueError(detail::cat(where, ": key '", key,
                                 "' contains '/', which separates path components; use set_path/at_path "
                                 "for nested entries or pick a key without '/'"));
}

void Tree::require_dict(std::string_view where) const {
  if (is_leaf())
    throw ValueError(detail::cat(where, ": this tree node is a leaf (", leaf_desc(*leaf_),
                                 "), not a dict; it has no keys"));
}

const Array& Tree::array() const {
  if (!is_leaf())
    throw ValueError(detail::cat("Tree::array: this tree node is a dict with keys ", quoted_keys(entries_),
                                 ", not a leaf; index into it with at(key) or at_path(path)"));
  return *leaf_;
}

const std::vector<std::string>& Tree::axis_names() const {
  static const std::vector<std::string> none;
  return axis_names_ ? *axis_names_ : none;
}

Tree Tree::with_axis_names(std::vector<std::string> names) const {
  if (!is_leaf())
    throw ShapeError(detail::cat("Tree::with_axis_names: axis names belong to a leaf; this node is a dict with keys ",
                                 quoted_keys(entries_)));
  if (static_cast<int>(names.size()) != leaf_->rank()) {
    std::string listed;
    for (const auto& n : names) listed += (listed.empty() ? "\"" : ", \"") + n + "\"";
    throw ShapeError(detail::cat("axis names (", listed, ") do not fit a ", leaf_desc(*leaf_), " leaf: give one name per axis (",
                                 leaf_->rank(), "), \"\" for an axis without one"));
  }
  Tree out = *this;
  out.axis_names_ = std::make_shared<const std::vector<std::string>>(std::move(names));
  return out;
}

const Tree* Tree::find(std::string_view key) const {
  for (const auto& e : entries_)
    if (e.first == key) return &e.second;
  return nullptr;
}

Tree* Tree::find(std::string_view key) {
  for (auto& e : entries_)
    if (e.first == key) return &e.second;
  return nullptr;
}

Tree& Tree::operator[](std::string_view key) {
  require_dict("Tree::operator[]");
  if (Tree* t = find(key)) return *t;
  check_key(key, "Tree::operator[]");
  entries_.emplace_back(std::string(key), Tree());
  return entries_.back().second;
}

const Tree& Tree::at(std::string_view key) const {
  require_dict(detail::cat("Tree::at('", key, "')"));
  if (const Tree* t = find(key)) return *t;
  throw ValueError(detail::cat("Tree::at: no entry '", key, "'; available keys: ", quoted_keys(entries_)));
}

Tree& Tree::at(std::string_view key) { return const_cast<Tree&>(std::as_const(*this).at(key)); }

bool Tree::contains(std::string_view key) const { return is_dict() && find(key) != nullptr; }

void Tree::set(std::string_view key, Tree value) {
  require_dict("Tree::set");
  if (Tree* t = find(key)) {
    *t = std::move(value);
    return;
  }
  check_key(key, "Tree::set");
  entries_.emplace_back(std::string(key), std::move(value));
}

bool Tree::erase(std::string_view key) {
  require_dict("Tree::erase");
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.first == key; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  return true;
}

std::vector<std::string> Tree::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.first);
  return out;
}

const Tree& Tree::at_path(std::string_view path) const {
  auto parts = split_path(path, "Tree::at_path");
  const Tree* node = this;
  std::string done;
  for (auto part : parts) {
    if (node->is_leaf())
      throw ValueError(detail::cat("Tree::at_path('", path, "'): ", where_str(done), " is a leaf (",
                                   leaf_desc(*node->leaf_), "), so it has no entry '", part, "'"));
    const Tree* next = node->find(part);
    if (!next)
      throw ValueError(detail::cat("Tree::at_path('", path, "'): no entry '", part, "' at ", where_str(done),
                                   "; available keys there: ", quoted_keys(node->entries_)));
    node = next;
    done = join_path(done, part);
  }
  return *node;
}

Tree& Tree::at_path(std::string_view path) { return const_cast<Tree&>(std::as_const(*this).at_path(path)); }

bool Tree::contains_path(std::string_view path) const {
  const Tree* node = this;
  std::size_t start = 0;
  if (path.empty()) return true;
  while (true) {
    std::size_t slash = path.find('/', start);
    std::string_view part = path.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (part.empty() || node->is_leaf()) return false;
    node = node->find(part);
    if (!node) return false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

void Tree::set_path(std::string_view path, Tree value) {
  auto parts = split_path(path, "Tree::set_path");
  if (parts.empty())
    throw ValueError("Tree::set_path: the path is empty; to replace the whole tree, assign to it");
  Tree* node = this;
  std::string done;
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    if (node->is_leaf())
      throw ValueError(detail::cat("Tree::set_path('", path, "'): ", where_str(done), " is a leaf (",
                                   leaf_desc(*node->leaf_), "); erase it first to put a dict there"));
    node = &(*node)[parts[i]];
    done = join_path(done, parts[i]);
  }
  if (node->is_leaf())
    throw ValueError(detail::cat("Tree::set_path('", path, "'): ", where_str(done), " is a leaf (",
                                 leaf_desc(*node->leaf_), "); erase it first to put a dict there"));
  node->set(parts.back(), std::move(value));
}

namespace {
void print(std::ostream& os, const Tree& t, int indent) {
  if (t.is_leaf()) {
    os << leaf_desc(t.array());
    return;
  }
  if (t.size() == 0) {
    os << "{}";
    return;
  }
  os << "{\n";
  for (const auto& [k, v] : t) {
    os << std::string(static_cast<std::size_t>(indent + 2), ' ') << k << ": ";
    print(os, v, indent + 2);
    os << '\n';
  }
  os << std::string(static_cast<std::size_t>(indent), ' ') << '}';
}
}  // namespace

std::string Tree::str() const {
  std::ostringstream os;
  print(os, *this, 0);
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tree& tree) {
  print(os, tree, 0);
  return os;
}

std::string join_path(std::string_view prefix, std::string_view key) {
  if (prefix.empty()) return std::string(key);
  std::string s;
  s.reserve(prefix.size() + 1 + key.size());
  s.append(prefix).append(1, '/').append(key);
  return s;
}

// --- flat views --------------------------------------------------------------------------------

namespace {

template <class F>
void visit_leaves(const Tree& t, const std::string& path, F& f) {
  if (t.is_leaf()) {
    f(path, t.array());
    return;
  }
  for (const auto& [k, v] : t) visit_leaves(v, join_path(path, k), f);
}

template <class F>
void visit_leaves_nopath(const Tree& t, F& f) {
  if (t.is_leaf()) {
    f(t.array());
    return;
  }
  for (const auto& e : t) visit_leaves_nopath(e.second, f);
}

}  // namespace

std::vector<std::pair<std::string, Array>> flatten(const Tree& tree) {
  std::vector<std::pair<std::string, Array>> out;
  auto f = [&](const std::string& p, const Array& a) { out.emplace_back(p, a); };
  visit_leaves(tree, std::string(), f);
  return out;
}

Tree unflatten(const std::vector<std::pair<std::string, Array>>& items) {
  if (items.size() == 1 && items[0].first.empty()) return Tree(items[0].second);
  Tree root;
  for (const auto& [path, array] : items) {
    if (path.empty())
      throw ValueError("unflatten: the empty path (a leaf at the root) must be the only item; got it together "
                       "with other paths");
    auto parts = split_path(path, "unflatten");
    Tree* node = &root;
    std::string done;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (node->is_leaf())
        throw ValueError(detail::cat("unflatten: path '", path, "' goes through '", done,
                                     "', which is already a leaf"));
      Tree::check_key(parts[i], "unflatten");
      bool last = i + 1 == parts.size();
      if (last) {
        if (node->contains(parts[i]))
          throw ValueError(detail::cat("unflatten: path '", path, "' ",
                                       node->at(parts[i]).is_leaf() ? "appears twice" : "is also a prefix of other paths"));
        node->set(parts[i], Tree(array));
      } else {
        node = &(*node)[parts[i]];
        done = join_path(done, parts[i]);
      }
    }
  }
  return root;
}

std::vector<Array> leaves(const Tree& tree) {
  std::vector<Array> out;
  auto f = [&](const Array& a) { out.push_back(a); };
  visit_leaves_nopath(tree, f);
  return out;
}

std::size_t leaf_count(const Tree& tree) {
  std::size_t n = 0;
  auto f = [&](const Array&) { ++n; };
  visit_leaves_nopath(tree, f);
  return n;
}

namespace {
Tree rebuild(const Tree& t, std::span<const Array> new_leaves, std::size_t& next) {
  if (t.is_leaf()) return Tree(new_leaves[next++]);
  Tree out;
  for (const auto& [k, v] : t) out.set(k, rebuild(v, new_leaves, next));
  return out;
}
}  // namespace

Tree with_leaves(const Tree& structure, std::span<const Array> new_leaves) {
  std::size_t n = leaf_count(structure);
  if (n != new_leaves.size())
    throw ValueError(detail::cat("with_leaves: the tree has ", n, " leaves but ", new_leaves.size(),
                                 " arrays were given; pass exactly one array per leaf, in flatten order"));
  std::size_t next = 0;
  return rebuild(structure, new_leaves, next);
}

namespace {
Tree map1(const std::function<Array(const Array&)>& f, const Tree& t) {
  if (t.is_leaf()) return Tree(f(t.array()));
  Tree out;
  for (const auto& [k, v] : t) out.set(k, map1(f, v));
  return out;
}

Tree map2(const std::function<Array(const Array&, const Array&)>& f, const Tree& a, const Tree& b) {
  if (a.is_leaf()) return Tree(f(a.array(), b.array()));
  Tree out;
  auto ib = b.begin();
  for (const auto& [k, v] : a) out.set(k, map2(f, v, (ib++)->second));
  return out;
}

Tree map_path(const std::function<Array(const std::string&, const Array&)>& f, const Tree& t,
              const std::string& path) {
  if (t.is_leaf()) return Tree(f(path, t.array()));
  Tree out;
  for (const auto& [k, v] : t) out.set(k, map_path(f, v, join_path(path, k)));
  return out;
}
}  // namespace

Tree tree_map(const std::function<Array(const Array&)>& f, const Tree& tree) { return map1(f, tree); }

Tree tree_map(const std::function<Array(const Array&, const Array&)>& f, const Tree& a, const Tree& b) {
  if (auto d = structure_difference(a, b, /*compare_leaves=*/false))
    throw ValueError(detail::cat("tree_map: the two trees have different structures: ", *d));
  return map2(f, a, b);
}

Tree tree_map_with_path(const std::function<Array(const std::string&, const Array&)>& f, const Tree& tree) {
  return map_path(f, tree, std::string());
}

// --- counting and comparing --------------------------------------------------------------------

std::int64_t param_count(const Tree& tree) {
  std::int64_t n = 0;
  auto f = [&](const Array& a) { n += a.numel(); };
  visit_leaves_nopath(tree, f);
  return n;
}

std::int64_t byte_count(const Tree& tree) {
  std::int64_t n = 0;
  auto f = [&](const Array& a) { n += static_cast<std::int64_t>(a.nbytes()); };
  visit_leaves_nopath(tree, f);
  return n;
}

namespace {
std::string key_list(const Tree& t) {
  std::string s = "[";
  bool first = true;
  for (const auto& e : t) {
    if (!first) s += ", ";
    s += e.first;
    first = false;
  }
  return s + "]";
}

std::optional<std::string> first_difference(const Tree& a, const Tree& b, bool leaves, const std::string& path) {
  std::string at = path.empty() ? std::string("<root>") : path;
  if (a.is_leaf() != b.is_leaf())
    return detail::cat(at, ": ", a.is_leaf() ? "a leaf" : "a dict", " vs ", b.is_leaf() ? "a leaf" : "a dict");
  if (a.is_leaf()) {
    if (leaves && (!(a.array().shape() == b.array().shape()) || a.array().dtype() != b.array().dtype()))
      return detail::cat(at, ": ", leaf_desc(a.array()), " vs ", leaf_desc(b.array()));
    return std::nullopt;
  }
  bool keys_equal = a.size() == b.size() &&
                    std::equal(a.begin(), a.end(), b.begin(), [](const Tree::Entry& x, const Tree::Entry& y) {
                      return x.first == y.first;
                    });
  if (!keys_equal) return detail::cat(at, ": keys differ: ", key_list(a), " vs ", key_list(b));
  auto ib = b.begin();
  for (const auto& [k, v] : a) {
    if (auto d = first_difference(v, (ib++)->second, leaves, join_path(path, k))) return d;
  }
  return std::nullopt;
}
}  // namespace

std::optional<std::string> structure_difference(const Tree& a, const Tree& b, bool compare_leaves) {
  return first_difference(a, b, compare_leaves, std::string());
}

bool same_structure(const Tree& a, const Tree& b) { return !structure_difference(a, b, true).has_value(); }

bool bitwise_equal(const Tree& a, const Tree& b) {
  if (!same_structure(a, b)) return false;
  auto la = leaves(a);
  auto lb = leaves(b);
  for (std::size_t i = 0; i < la.size(); ++i)
    if (!la[i].bitwise_equal(lb[i])) return false;
  return true;
}

namespace {
// Every leaf path and every empty-dict path.
void terminal_paths(const Tree& t, const std::string& path, std::vector<std::string>& out) {
  if (t.is_leaf() || t.size() == 0) {
    out.push_back(path);
    return;
  }
  for (const auto& [k, v] : t) terminal_paths(v, join_path(path, k), out);
}

void diff_rec(const Tree& e, const Tree& a, const std::string& path, TreeDiff& d) {
  std::string at = path.empty() ? std::string("<root>") : path;
  if (e.is_leaf() && a.is_leaf()) {
    if (!(e.array().shape() == a.array().shape()) || e.array().dtype() != a.array().dtype())
      d.mismatched.push_back(detail::cat(at, ": expected ", leaf_desc(e.array()), ", found ", leaf_desc(a.array())));
    return;
  }
  if (e.is_leaf() != a.is_leaf()) {
    d.mismatched.push_back(detail::cat(at, ": expected ", e.is_leaf() ? leaf_desc(e.array()) : std::string("a dict"),
                                       ", found ", a.is_leaf() ? leaf_desc(a.array()) : std::string("a dict")));
    return;
  }
  if (e.size() == 0 && a.size() == 0) return;
  for (const auto& [k, v] : e) {
    std::string p = join_path(path, k);
    if (a.contains(k))
      diff_rec(v, a.at(k), p, d);
    else
      terminal_paths(v, p, d.missing);
  }
  for (const auto& [k, v] : a)
    if (!e.contains(k)) terminal_paths(v, join_path(path, k), d.extra);
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) {
    if (!s.empty()) s += ", ";
    s += x.empty() ? std::string("<root>") : x;
  }
  return s;
}
}  // namespace

TreeDiff diff(const Tree& expected, const Tree& actual) {
  TreeDiff d;
  diff_rec(expected, actual, std::string(), d);
  return d;
}

std::string TreeDiff::str() const {
  std::string s;
  auto part = [&](const char* name, const std::vector<std::string>& v) {
    if (v.empty()) return;
    if (!s.empty()) s += "; ";
    s += name;
    s += joined(v);
  };
  part("missing entries: ", missing);
  part("extra entries: ", extra);
  part("mismatched entries: ", mismatched);
  return s;
}

}  // namespace linum
