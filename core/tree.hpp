// Tree: a nested, insertion-ordered, string-keyed dict whose leaves are Arrays.
//
// This is Linum's variable dict, the C++ counterpart of a Flax variable collection:
//
//   {"params": {"Dense_0": {"kernel": f32[2,3], "bias": f32[3]}}}
//
// A Tree node is either a leaf (one Array) or a dict of (key, Tree) entries kept in insertion
// order. Keys are non-empty and never contain '/', so every leaf has a unique path such as
// "params/Dense_0/kernel". Copying a Tree copies its structure; the Arrays inside share their
// (immutable) buffers, so copies are cheap.
//
// The free functions below (flatten, leaves, tree_map, with_leaves, ...) all visit leaves in the
// same order: depth first, entries in insertion order. That order is the contract the autodiff
// relies on when it turns a tree into a flat list of arrays and back.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace linum {

class Tree {
 public:
  // One dict entry: the key and the subtree stored under it.
  using Entry = std::pair<std::string, Tree>;
  using const_iterator = std::vector<Entry>::const_iterator;

  // An empty dict.
  Tree() = default;

  // A leaf holding `leaf`. Throws ValueError if the array is undefined (default-constructed).
  // Implicit so that trees can be written as nested initializer lists of arrays.
  Tree(Array leaf);  // NOLINT(google-explicit-constructor)

  // A dict with the given entries, in the given order:
  //   Tree{{"params", {{"kernel", k}, {"bias", b}}}}
  // Throws ValueError on a duplicate key or a key that is empty or contains '/'.
  Tree(std::initializer_list<Entry> entries);

  // A dict with the given entries, in order. Throws ValueError on a duplicate or invalid key.
  // Runs in O(n log n), so it suits dicts with very many entries (deserialization uses it).
  static Tree from_entries(std::vector<Entry> entries);

  // --- kind ------------------------------------------------------------------------------------
  // True when this node holds an Array.
  bool is_leaf() const { return leaf_.has_value(); }
  // True when this node is a dict (possibly empty).
  bool is_dict() const { return !leaf_.has_value(); }

  // The Array of a leaf. Throws ValueError if this node is a dict.
  const Array& array() const;

  // --- dict access -----------------------------------------------------------------------------
  // The subtree under `key`, inserting an empty dict at the end if it is missing (like
  // std::map::operator[]). Throws ValueError if this node is a leaf or the key is invalid.
  Tree& operator[](std::string_view key);
  // Read-only lookup; same as at(key).
  const Tree& operator[](std::string_view key) const { return at(key); }

  // The subtree under `key`. Throws ValueError naming the missing key and listing the available
  // keys if there is no such entry, or if this node is a leaf.
  const Tree& at(std::string_view key) const;
  Tree& at(std::string_view key);

  // True when this node is a dict with an entry `key` (false for leaves).
  bool contains(std::string_view key) const;

  // Stores `value` under `key`: replaces an existing entry in place (keeping its position) or
  // appends a new one. Throws ValueError if this node is a leaf or the key is invalid.
  void set(std::string_view key, Tree value);

  // Removes the entry `key`; returns whether there was one. Throws ValueError on a leaf.
  bool erase(std::string_view key);

  // The keys of this dict in insertion order (empty for a leaf).
  std::vector<std::string> keys() const;

  // Number of entries of this dict (0 for a leaf).
  std::size_t size() const { return entries_.size(); }

  // True for an empty dict (false for a leaf).
  bool empty() const { return is_dict() && entries_.empty(); }

  // Iteration over the (key, subtree) entries of a dict, in insertion order. A leaf has none.
  const_iterator begin() const { return entries_.begin(); }
  const_iterator end() const { return entries_.end(); }

  // --- paths -----------------------------------------------------------------------------------
  // The subtree at a '/'-separated path such as "params/Dense_0/kernel". The empty path is the
  // tree itself. Throws ValueError naming the path, the first missing component and the keys
  // available at that point.
  const Tree& at_path(std::string_view path) const;
  Tree& at_path(std::string_view path);

  // True when at_path(path) would succeed.
  bool contains_path(std::string_view path) const;

  // Stores `value` at `path`, creating intermediate dicts as needed. Throws ValueError if a
  // component of the path is an existing leaf, the path is empty, or a component is empty.
  void set_path(std::string_view path, Tree value);

  // --- partitioning metadata (Flax's nn.Partitioned box) ----------------------------------------
  // The logical names of this leaf's axes, one per axis (e.g. {"embed", "mlp"}; "" for an axis
  // without a name, Flax's None), as nn::with_partitioning gives them at init; empty when the leaf
  // carries none (a dict, or a leaf built from an Array). Copies of the tree keep them; functions
  // that build new leaves (tree_map, with_leaves, loading from a file) do not.
  const std::vector<std::string>& axis_names() const;
  // This leaf with `names` as its axis names. Throws ShapeError unless this is a leaf and `names`
  // has one entry per axis.
  Tree with_axis_names(std::vector<std::string> names) const;

  // --- printing --------------------------------------------------------------------------------
  // An indented listing of the tree with each leaf's dtype and shape, e.g.
  //   {
  //     params: {
  //       Dense_0: {
  //         kernel: float32(2, 3)
  //         bias: float32(3,)
  //       }
  //     }
  //   }
  std::string str() const;

  // Throws ValueError unless `key` is usable as a tree key (non-empty, no '/'). `where` names
  // the caller in the message.
  static void check_key(std::string_view key, std::string_view where);

 private:
  const Tree* find(std::string_view key) const;
  Tree* find(std::string_view key);
  void require_dict(std::string_view where) const;

  std::optional<Array> leaf_;
  std::vector<Entry> entries_;
  std::shared_ptr<const std::vector<std::string>> axis_names_;  // shared: copies stay cheap
};

// Writes tree.str() to `os`.
std::ostream& operator<<(std::ostream& os, const Tree& tree);

// Joins two path components with '/', leaving out an empty prefix: join_path("", "a") == "a".
std::string join_path(std::string_view prefix, std::string_view key);

// --- flat views --------------------------------------------------------------------------------

// Every leaf with its path, depth first in insertion order. A leaf at the root has the path "".
// Empty dicts have no leaves and do not appear.
std::vector<std::pair<std::string, Array>> flatten(const Tree& tree);

// Rebuilds a tree from (path, array) pairs (the inverse of flatten, except that empty dicts are
// not restored). Dict entries appear in the order their first path appears. A single pair with
// the path "" gives a leaf tree. Throws ValueError on duplicate paths, on a path that is both a
// leaf and a prefix of another path, or on invalid components.
Tree unflatten(const std::vector<std::pair<std::string, Array>>& items);

// Every leaf array in flatten order.
std::vector<Array> leaves(const Tree& tree);

// The number of leaves.
std::size_t leaf_count(const Tree& tree);

// A tree with the structure of `structure` and the given leaves, assigned in flatten order (the
// inverse of leaves()). Throws ValueError if the number of leaves does not match.
Tree with_leaves(const Tree& structure, std::span<const Array> new_leaves);

// Applies `f` to every leaf; the result has the same structure.
Tree tree_map(const std::function<Array(const Array&)>& f, const Tree& tree);

// Applies `f` to corresponding leaves of two trees with the same keys in the same order
// (shapes may differ). Throws ValueError naming the first path where the structures differ.
Tree tree_map(const std::function<Array(const Array&, const Array&)>& f, const Tree& a, const Tree& b);

// Like tree_map, with the leaf's path (e.g. "params/Dense_0/kernel") as the first argument.
Tree tree_map_with_path(const std::function<Array(const std::string&, const Array&)>& f, const Tree& tree);

// --- counting and comparing --------------------------------------------------------------------

// Total number of elements over all leaves.
std::int64_t param_count(const Tree& tree);

// Total bytes of leaf data (elements times element size).
std::int64_t byte_count(const Tree& tree);

// Describes the first place where `a` and `b` differ in keys, key order, leaf-vs-dict kind or,
// when `compare_leaves` is true, a leaf's shape or dtype; nullopt when they agree. Example:
//   "params/Dense_0: keys differ: [kernel, bias] vs [bias, kernel]"
std::optional<std::string> structure_difference(const Tree& a, const Tree& b, bool compare_leaves = true);

// Same keys in the same order, same leaf-vs-dict kinds, and same shape and dtype at every leaf.
bool same_structure(const Tree& a, const Tree& b);

// same_structure plus identical leaf bytes (NaNs compare by bit pattern, -0.0 differs from 0.0).
bool bitwise_equal(const Tree& a, const Tree& b);

// The difference between the tree a caller expects and one it was given, by leaf path.
struct TreeDiff {
  // Leaf (or empty-dict) paths present in `expected` but not in `actual`.
  std::vector<std::string> missing;
  // Leaf (or empty-dict) paths present in `actual` but not in `expected`.
  std::vector<std::string> extra;
  // Paths present in both whose kind, shape or dtype differ, with a description, e.g.
  // "params/Dense_0/kernel: expected float32(2, 3), found float32(3, 2)".
  std::vector<std::string> mismatched;

  // True when the trees agree (key order is not compared).
  bool empty() const { return missing.empty() && extra.empty() && mismatched.empty(); }
  // "missing entries: a/b, a/c; extra entries: d; mismatched entries: ..." (only non-empty parts),
  // or "" when empty().
  std::string str() const;
};

// Compares `actual` against `expected` by paths, ignoring key order.
TreeDiff diff(const Tree& expected, const Tree& actual);

}  // namespace linum
