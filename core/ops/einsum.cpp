#include <linum/core/ops/einsum.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>

namespace linum {
namespace {

// An axis label: a letter (its character code) or one of the axes "..." stands for (kEllipsis + k,
// k counted so that the last ellipsis axes of every operand share labels, as broadcasting aligns).
using Label = int;
constexpr Label kEllipsis = 1000;

struct Term {
  std::string text;
  std::vector<Label> letters_before, letters_after;  // around "..."
  bool ellipsis = false;
};

std::string describe(std::string_view subscripts, std::span<const Array> operands) {
  std::ostringstream s;
  s << "einsum('" << subscripts << "'";
  for (const Array& a : operands) s << ", " << (a.defined() ? a.type_str() : std::string("undefined"));
  s << ")";
  return s.str();
}

Term parse_term(const std::string& text, const std::string& where) {
  Term t;
  t.text = text;
  bool after = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '.') {
      if (t.ellipsis || text.compare(i, 3, "...") != 0)
        throw ValueError(where + ": '" + text + "' has a '.' that is not one \"...\"");
      t.ellipsis = after = true;
      i += 2;
    } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      (after ? t.letters_after : t.letters_before).push_back(c);
    } else {
      throw ValueError(where + ": '" + std::string(1, c) + "' in '" + text + "' is not a letter (axes are labelled a-z, A-Z)");
    }
  }
  return t;
}

std::string label_name(Label l) { return l >= kEllipsis ? "..." : std::string(1, static_cast<char>(l)); }

// One operand on its way through the contraction: the array and the label of each axis.
struct Labelled {
  Array x;
  std::vector<Label> labels;
};

// The diagonal of axes a < b (equal sizes): a gather of the flattened pair, moved to a's place.
Array diagonal(const Array& x, int a, int b) {
  const std::int64_t n = x.dim(a);
  std::vector<int> perm;
  for (int i = 0; i < x.rank(); ++i)
    if (i != a && i != b) perm.push_back(i);
  perm.push_back(a);
  perm.push_back(b);
  std::vector<std::int64_t> dims;
  for (std::size_t i = 0; i + 2 < perm.size(); ++i) dims.push_back(x.dim(perm[i]));
  dims.push_back(n * n);
  std::vector<std::int32_t> at(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) at[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * (n + 1));
  const Array d = take(reshape(transpose(x, perm), dims), Array::from_i32(Shape{n}, at), -1);
  return moveaxis(d, -1, a);
}

// Sums the axes whose labels `keep` does not contain.
void sum_unneeded(Labelled& t, const std::set<Label>& keep) {
  std::vector<int> axes;
  std::vector<Label> rest;
  for (std::size_t i = 0; i < t.labels.size(); ++i) {
    if (keep.count(t.labels[i]) == 0) axes.push_back(static_cast<int>(i));
    else rest.push_back(t.labels[i]);
  }
  if (axes.empty()) return;
  t.x = sum(t.x, axes);
  t.labels = rest;
}

int axis_of(const std::vector<Label>& labels, Label l) {
  return static_cast<int>(std::find(labels.begin(), labels.end(), l) - labels.begin());
}

}  // namespace

Array einsum(std::string_view subscripts, std::span<const Array> operands) {
  const std::string where = describe(subscripts, operands);
  if (operands.empty()) throw ValueError(where + ": needs at least one operand");
  for (const Array& a : operands)
    if (!a.defined()) throw ValueError(where + ": an operand is undefined");
  std::string spec;
  for (char c : subscripts)
    if (c != ' ') spec.push_back(c);
  const std::size_t arrow = spec.find("->");
  const bool explicit_output = arrow != std::string::npos;
  const std::string lhs = explicit_output ? spec.substr(0, arrow) : spec;
  std::vector<Term> terms;
  for (std::size_t start = 0;;) {
    const std::size_t comma = lhs.find(',', start);
    terms.push_back(parse_term(lhs.substr(start, comma == std::string::npos ? std::string::npos : comma - start), where));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (terms.size() != operands.size())
    throw ValueError(where + ": the subscripts name " + std::to_string(terms.size()) + " operand(s), " +
                     std::to_string(operands.size()) + " were given");

  // Labels per operand, "..." expanded; each label's size (1 broadcasts against n for "...").
  int ellipsis_rank = 0;
  for (std::size_t k = 0; k < terms.size(); ++k) {
    const Term& t = terms[k];
    const int named = static_cast<int>(t.letters_before.size() + t.letters_after.size());
    const int rank = operands[k].rank();
    if (t.ellipsis ? rank < named : rank != named)
      throw ShapeError(where + ": operand " + std::to_string(k) + " has rank " + std::to_string(rank) + " but '" + t.text +
                       "' names " + std::to_string(named) + " axes" + (t.ellipsis ? " (and \"...\")" : ""));
    if (t.ellipsis) ellipsis_rank = std::max(ellipsis_rank, rank - named);
  }
  std::vector<Labelled> parts;
  std::map<Label, std::int64_t> size;
  std::map<Label, int> uses;  // operands using each label
  for (std::size_t k = 0; k < terms.size(); ++k) {
    const Term& t = terms[k];
    Labelled p{operands[k], t.letters_before};
    if (t.ellipsis) {
      const int e = operands[k].rank() - static_cast<int>(t.letters_before.size() + t.letters_after.size());
      for (int i = 0; i < e; ++i) p.labels.push_back(kEllipsis + ellipsis_rank - e + i);
      p.labels.insert(p.labels.end(), t.letters_after.begin(), t.letters_after.end());
    }
    std::set<Label> seen;
    for (std::size_t i = 0; i < p.labels.size(); ++i) {
      const Label l = p.labels[i];
      const std::int64_t d = p.x.dim(static_cast<int>(i));
      auto [it, fresh] = size.emplace(l, d);
      if (!fresh && it->second != d) {
        if (l >= kEllipsis && (it->second == 1 || d == 1)) it->second = std::max(it->second, d);
        else
          throw ShapeError(where + ": axis '" + label_name(l) + "' has size " + std::to_string(it->second) +
                           " in one place and " + std::to_string(d) + " in operand " + std::to_string(k));
      }
      if (seen.insert(l).second) ++uses[l];
    }
    parts.push_back(std::move(p));
  }

  // The output's labels.
  std::vector<Label> out;
  if (explicit_output) {
    const Term t = parse_term(spec.substr(arrow + 2), where);
    for (Label l : t.letters_before) out.push_back(l);
    if (t.ellipsis)
      for (int i = 0; i < ellipsis_rank; ++i) out.push_back(kEllipsis + i);
    for (Label l : t.letters_after) out.push_back(l);
    std::set<Label> seen;
    for (Label l : out) {
      if (!seen.insert(l).second) throw ValueError(where + ": the output names '" + label_name(l) + "' twice");
      if (l < kEllipsis && size.count(l) == 0)
        throw ValueError(where + ": the output names '" + label_name(l) + "', which no operand has");
    }
  } else {
    for (int i = 0; i < ellipsis_rank; ++i) out.push_back(kEllipsis + i);
    std::map<Label, int> count;
    for (const Labelled& p : parts)
      for (Label l : p.labels) ++count[l];
    for (const auto& [l, n] : count)  // std::map: ascending character codes, uppercase first
      if (l < kEllipsis && n == 1) out.push_back(l);
  }
  const std::set<Label> out_set(out.begin(), out.end());

  // Each operand alone: diagonals of repeated labels, then sums over labels used nowhere else.
  for (Labelled& p : parts) {
    for (bool again = true; again;) {
      again = false;
      for (std::size_t a = 0; a < p.labels.size() && !again; ++a)
        for (std::size_t b = a + 1; b < p.labels.size() && !again; ++b)
          if (p.labels[a] == p.labels[b]) {
            if (p.x.dim(static_cast<int>(a)) != p.x.dim(static_cast<int>(b)))
              throw ShapeError(where + ": '" + label_name(p.labels[a]) + "' repeats over axes of sizes " +
                               std::to_string(p.x.dim(static_cast<int>(a))) + " and " + std::to_string(p.x.dim(static_cast<int>(b))));
            p.x = diagonal(p.x, static_cast<int>(a), static_cast<int>(b));
            p.labels.erase(p.labels.begin() + static_cast<std::ptrdiff_t>(b));
            again = true;
          }
    }
  }
  auto needed_after = [&](std::size_t k) {  // labels the output or operands k.. use
    std::set<Label> keep = out_set;
    for (std::size_t j = k; j < parts.size(); ++j) keep.insert(parts[j].labels.begin(), parts[j].labels.end());
    return keep;
  };
  // "..." axes of size 1 broadcast to the size the other operands give them.
  auto broadcast_ellipsis = [&](Labelled& p) {
    std::vector<std::int64_t> dims;
    bool grow = false;
    for (std::size_t i = 0; i < p.labels.size(); ++i) {
      dims.push_back(size.at(p.labels[i]));
      grow = grow || dims.back() != p.x.dim(static_cast<int>(i));
    }
    if (grow) p.x = broadcast_to(p.x, Shape(dims));
  };

  Labelled acc = std::move(parts[0]);
  sum_unneeded(acc, needed_after(1));
  for (std::size_t k = 1; k < parts.size(); ++k) {
    Labelled& next = parts[k];
    sum_unneeded(next, [&] {
      std::set<Label> keep = needed_after(k + 1);
      keep.insert(acc.labels.begin(), acc.labels.end());
      return keep;
    }());
    broadcast_ellipsis(acc);
    broadcast_ellipsis(next);
    const std::set<Label> later = needed_after(k + 1);
    DotDims dims;
    std::vector<Label> batch, acc_free, next_free;
    for (std::size_t i = 0; i < acc.labels.size(); ++i) {
      const Label l = acc.labels[i];
      const int j = axis_of(next.labels, l);
      if (j == static_cast<int>(next.labels.size())) {
        acc_free.push_back(l);
      } else if (later.count(l)) {
        dims.lhs_batch.push_back(static_cast<int>(i));
        dims.rhs_batch.push_back(j);
        batch.push_back(l);
      } else {
        dims.lhs_contracting.push_back(static_cast<int>(i));
        dims.rhs_contracting.push_back(j);
      }
    }
    for (Label l : next.labels)
      if (axis_of(acc.labels, l) == static_cast<int>(acc.labels.size())) next_free.push_back(l);
    acc.x = dot_general(acc.x, next.x, dims);
    acc.labels = batch;
    acc.labels.insert(acc.labels.end(), acc_free.begin(), acc_free.end());
    acc.labels.insert(acc.labels.end(), next_free.begin(), next_free.end());
  }
  sum_unneeded(acc, out_set);
  broadcast_ellipsis(acc);
  // Output labels no operand reached (a "..." of rank 0 everywhere cannot occur): transpose to order.
  std::vector<int> perm;
  for (Label l : out) perm.push_back(axis_of(acc.labels, l));
  bool identity = true;
  for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  return identity ? acc.x : transpose(acc.x, perm);
}

}  // namespace linum
