// einsum: parses the equation, checks the operands against it, lines every
// operand up in one layout and contracts them left to right.
//
// Note [einsum layout]
// Every dim the equation names gets one position in a common layout: first
// the output's dims in output order (the `...` dims where the output puts
// them), then the `...` dims when the output omits them, then the summed
// subscripts in ASCII order (torch 1.13's order). Each operand becomes a view
// of that rank: diagonals taken for repeated subscripts, dims permuted into
// layout order, size 1 unsqueezed where it lacks a dim. Contracting two such
// operands is then a broadcasting product summed over some positions, which
// contract_pair turns into one bmm (or mm). A position is summed at the last
// operand where its size is not 1, as torch does, so a dim shared by the first
// two operands only is gone before the third is multiplied in. No backward of
// its own: gradients of any order come from the views, sum, mul and products.
#include "kiln/ops/einsum.h"

#include <algorithm>
#include <string>

#include "kiln/ops/linalg.h"
#include "op_record.h"

namespace kiln {

namespace {

constexpr int kLetters = 52;   // subscripts A-Z are 0-25 and a-z 26-51 (ASCII order)
constexpr int kEllipsis = -1;  // `...` in a parsed subscript list

int label_of(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return 26 + (c - 'a');
  return -2;
}
char char_of(int label) { return static_cast<char>(label < 26 ? 'A' + label : 'a' + (label - 26)); }

struct Equation {
  std::vector<std::vector<int>> inputs;  // per operand: its subscripts in order, kEllipsis for `...`
  std::vector<int> output;               // explicit output's subscripts (kEllipsis for `...`)
  bool explicit_output = false;
};

// Appends the subscripts of eq[begin, end) to `terms` (a new list at each ',' when `operands`).
void parse_side(std::string_view eq, size_t begin, size_t end, bool operands, std::vector<std::vector<int>>& terms) {
  terms.emplace_back();
  bool ellipsis = false;
  for (size_t i = begin; i < end; ++i) {
    const char c = eq[i];
    if (c == ' ') continue;
    if (c == ',' && operands) {
      terms.emplace_back();
      ellipsis = false;
      continue;
    }
    const std::string where = operands ? "operand " + std::to_string(terms.size() - 1) : std::string("the output");
    if (c == '.') {
      KILN_CHECK(i + 3 <= end && eq.substr(i, 3) == "...", ValueError, "einsum: '.' at index ", i, " of equation \"",
                 eq, "\" is not part of an ellipsis \"...\" (in ", where, ")");
      KILN_CHECK(!ellipsis, ValueError, "einsum: ", where, " of equation \"", eq,
                 "\" has a second ellipsis \"...\" at index ", i, "; at most one per subscript list is allowed");
      terms.back().push_back(kEllipsis);
      ellipsis = true;
      i += 2;
      continue;
    }
    KILN_CHECK(label_of(c) >= 0, ValueError, "einsum: invalid character '", std::string(1, c), "' at index ", i,
               " of equation \"", eq,
               operands ? "\"; expected subscripts [a-zA-Z], ',' between operands, \"...\" or \"->\""
                        : "\"; the output (after \"->\") takes subscripts [a-zA-Z] and \"...\" only");
    terms.back().push_back(label_of(c));
  }
}

Equation parse(std::string_view eq) {
  Equation e;
  const size_t arrow = eq.find("->");
  parse_side(eq, 0, arrow == std::string_view::npos ? eq.size() : arrow, true, e.inputs);
  if (arrow != std::string_view::npos) {
    std::vector<std::vector<int>> out;
    parse_side(eq, arrow + 2, eq.size(), false, out);
    e.output = std::move(out[0]);
    e.explicit_output = true;
  }
  return e;
}

std::string subscripts(const std::vector<int>& labels) {
  std::string s;
  for (int l : labels) s += l == kEllipsis ? std::string("...") : std::string(1, char_of(l));
  return s;
}

int64_t product(const Tensor& t, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= t.size(d);
  return n;
}

// sum over `summed` positions of a * b (broadcasting), a and b in one layout
// of the same rank; summed positions stay, with size 1. The product is one
// matrix product: [batch, a's own dims, contracted] · [batch, contracted, b's own dims].
Tensor contract_pair(Tensor a, Tensor b, const std::vector<bool>& summed, std::source_location loc) {
  const int64_t rank = a.dim();
  std::vector<int64_t> batch, only_a, only_b, contracted, sum_a, sum_b;
  for (int64_t d = 0; d < rank; ++d) {
    const int64_t sa = a.size(d), sb = b.size(d);
    if (summed[static_cast<size_t>(d)]) {
      if (sa != 1 && sb != 1)
        contracted.push_back(d);
      else if (sa != 1)
        sum_a.push_back(d);  // b is constant along d: sum a first
      else if (sb != 1)
        sum_b.push_back(d);
    } else if (sa == sb) {
      if (sa != 1) batch.push_back(d);
    } else {
      (sb == 1 ? only_a : only_b).push_back(d);
    }
  }
  if (!sum_a.empty()) a = a.sum(sum_a, /*keepdim=*/true, std::nullopt, loc);
  if (!sum_b.empty()) b = b.sum(sum_b, /*keepdim=*/true, std::nullopt, loc);
  if (contracted.empty()) return a.mul(b, loc);  // nothing to sum: the broadcasting product is the result

  // Positions in the order given, then every other one (size 1 in the tensor permuted).
  auto order = [rank](std::initializer_list<const std::vector<int64_t>*> groups) {
    std::vector<int64_t> o;
    for (const auto* g : groups) o.insert(o.end(), g->begin(), g->end());
    for (int64_t d = 0; d < rank; ++d)
      if (std::find(o.begin(), o.end(), d) == o.end()) o.push_back(d);
    return o;
  };
  const int64_t nb = product(a, batch), m = product(a, only_a), k = product(a, contracted), n = product(b, only_b);
  const Tensor a2 = a.permute(order({&batch, &only_a, &contracted}), loc);
  const Tensor b2 = b.permute(order({&batch, &contracted, &only_b}), loc);
  Tensor c = nb == 1 ? mm(a2.reshape({m, k}, loc), b2.reshape({k, n}, loc), loc)
                     : bmm(a2.reshape({nb, m, k}, loc), b2.reshape({nb, k, n}, loc), loc);
  const std::vector<int64_t> out_order = order({&batch, &only_a, &only_b});
  std::vector<int64_t> shape(static_cast<size_t>(rank), 1), inverse(static_cast<size_t>(rank));
  for (size_t i = 0; i < out_order.size(); ++i) {
    const int64_t d = out_order[i];
    if (i < batch.size() + only_a.size() + only_b.size()) shape[i] = a.size(d) != 1 ? a.size(d) : b.size(d);
    inverse[static_cast<size_t>(d)] = static_cast<int64_t>(i);
  }
  return c.reshape(shape, loc).permute(inverse, loc);
}

}  // namespace

Tensor einsum(std::string_view equation, const std::vector<Tensor>& operands, std::source_location loc) {
  ops::OpScope rs("einsum", {ops::nth_input(operands, 0), ops::nth_input(operands, 1), ops::nth_input(operands, 2),
                             ops::nth_input(operands, 3)});
  KILN_CHECK(!operands.empty(), ValueError, "einsum: expected at least one operand for equation \"", equation,
             "\", got none");
  const Equation eq = parse(equation);
  const size_t nops = operands.size();
  KILN_CHECK(eq.inputs.size() == nops, ValueError, "einsum: equation \"", equation, "\" has subscripts for ",
             eq.inputs.size(), eq.inputs.size() == 1 ? " operand" : " operands", " but ", nops,
             nops == 1 ? " operand was" : " operands were", " given");
  for (size_t i = 0; i < nops; ++i) {
    KILN_CHECK(operands[i].defined(), ValueError, "einsum: operand ", i, " is an undefined tensor");
    KILN_CHECK(operands[i].dtype() == operands[0].dtype(), DTypeError, "einsum: expected operands of one dtype, got ",
               dtype_name(operands[0].dtype()), " for operand 0 and ", dtype_name(operands[i].dtype()), " for operand ",
               i, " (convert them with .to())");
  }

  // Shapes against subscripts; `...` covers ell_dims[i] dims of operand i, right-aligned in ell_ndim broadcast dims.
  std::vector<int64_t> ell_dims(nops, 0);
  int64_t ell_ndim = 0;
  std::vector<int> label_count(kLetters, 0);
  for (size_t i = 0; i < nops; ++i) {
    const std::vector<int>& labels = eq.inputs[i];
    const bool has_ell = std::find(labels.begin(), labels.end(), kEllipsis) != labels.end();
    const int64_t named = static_cast<int64_t>(labels.size()) - (has_ell ? 1 : 0), ndim = operands[i].dim();
    KILN_CHECK(has_ell ? named <= ndim : named == ndim, ShapeError, "einsum: operand ", i, " has subscripts \"",
               subscripts(labels), "\" (", named, has_ell ? " named dims and \"...\"" : " dims", ") but shape ",
               operands[i].sizes(), " (", ndim, " dims)",
               has_ell ? "; \"...\" may cover zero or more dims, but not fewer than zero"
                       : "; write \"...\" in its subscripts to let it cover the other dims");
    ell_dims[i] = ndim - named;
    ell_ndim = std::max(ell_ndim, ell_dims[i]);
    for (int l : labels)
      if (l != kEllipsis) ++label_count[static_cast<size_t>(l)];
  }

  // Every label and `...` dim gets a position in the layout (Note [einsum layout]); size: its broadcast size.
  const int kNone = -1;
  std::vector<int64_t> label_pos(kLetters, kNone);
  int64_t pos = 0, ell_pos = kNone;
  if (eq.explicit_output) {
    for (int l : eq.output) {
      if (l == kEllipsis) {
        ell_pos = pos;
        pos += ell_ndim;
        continue;
      }
      const size_t li = static_cast<size_t>(l);
      KILN_CHECK(label_pos[li] == kNone, ValueError, "einsum: output subscript '", std::string(1, char_of(l)),
                 "' appears more than once in the output of equation \"", equation,
                 "\"; each output subscript names one dim of the result");
      KILN_CHECK(label_count[li] > 0, ValueError, "einsum: output subscript '", std::string(1, char_of(l)),
                 "' of equation \"", equation, "\" does not appear in the subscripts of any input operand");
      label_pos[li] = pos++;
    }
  } else {
    ell_pos = 0;
    pos = ell_ndim;
    for (size_t l = 0; l < kLetters; ++l)
      if (label_count[l] == 1) label_pos[l] = pos++;
  }
  const int64_t out_size = pos;
  if (ell_pos == kNone) {
    ell_pos = pos;
    pos += ell_ndim;
  }
  for (size_t l = 0; l < kLetters; ++l)
    if (label_count[l] > 0 && label_pos[l] == kNone) label_pos[l] = pos++;
  const int64_t rank = pos;

  // Sizes: a subscript repeated in one operand must have one size (the diagonal); across operands, one size or 1.
  std::vector<int64_t> size_at(static_cast<size_t>(rank), 1);
  std::vector<size_t> size_from(static_cast<size_t>(rank), 0);  // the operand that set size_at
  std::vector<size_t> last_op(static_cast<size_t>(rank), 0);    // the last operand whose size there is not 1
  std::vector<std::vector<int64_t>> op_pos(nops);               // per operand: the position of each of its dims
  for (size_t i = 0; i < nops; ++i) {
    const Tensor& x = operands[i];
    std::vector<int64_t>& at = op_pos[i];
    std::vector<int64_t> own(static_cast<size_t>(rank), -1);  // size of each position within this operand
    for (int l : eq.inputs[i]) {
      if (l == kEllipsis) {
        for (int64_t j = 0; j < ell_dims[i]; ++j) at.push_back(ell_pos + ell_ndim - ell_dims[i] + j);
      } else {
        at.push_back(label_pos[static_cast<size_t>(l)]);
      }
    }
    for (int64_t d = 0; d < x.dim(); ++d) {
      const size_t p = static_cast<size_t>(at[static_cast<size_t>(d)]);
      const int64_t s = x.size(d);
      auto name = [&] {
        for (size_t l = 0; l < kLetters; ++l)
          if (label_pos[l] == static_cast<int64_t>(p))
            return "subscript '" + std::string(1, char_of(static_cast<int>(l))) + "'";
        return "dim " + std::to_string(static_cast<int64_t>(p) - ell_pos) + " of the broadcast \"...\" dims";
      };
      KILN_CHECK(own[p] == -1 || own[p] == s, ShapeError, "einsum: ", name(), " is repeated in operand ", i, " (shape ",
                 x.sizes(), ") with sizes ", own[p], " and ", s,
                 "; a repeated subscript takes the diagonal, which needs equal sizes");
      own[p] = s;
      if (s == 1) continue;
      KILN_CHECK(size_at[p] == 1 || size_at[p] == s, ShapeError, "einsum: ", name(), " has size ", size_at[p],
                 " in operand ", size_from[p], " (shape ", operands[size_from[p]].sizes(), ") but size ", s,
                 " in operand ", i, " (shape ", x.sizes(), "); the sizes must match, or be 1 to broadcast");
      size_at[p] = s;
      size_from[p] = i;
      last_op[p] = i;
    }
  }

  // Each operand as a view in the layout.
  std::vector<Tensor> laid(nops);
  for (size_t i = 0; i < nops; ++i) {
    Tensor x = operands[i];
    std::vector<int64_t> at = op_pos[i];
    for (bool repeated = true; repeated;) {
      repeated = false;
      for (size_t d1 = 1; d1 < at.size() && !repeated; ++d1) {
        for (size_t d0 = 0; d0 < d1 && !repeated; ++d0) {
          if (at[d0] != at[d1]) continue;
          const int64_t p = at[d0];
          x = x.diagonal(0, static_cast<int64_t>(d0), static_cast<int64_t>(d1), loc);  // the diagonal goes last
          at.erase(at.begin() + static_cast<std::ptrdiff_t>(d1));
          at.erase(at.begin() + static_cast<std::ptrdiff_t>(d0));
          at.push_back(p);
          repeated = true;
        }
      }
    }
    std::vector<int64_t> perm(at.size());
    for (size_t d = 0; d < perm.size(); ++d) perm[d] = static_cast<int64_t>(d);
    std::sort(perm.begin(), perm.end(),
              [&](int64_t u, int64_t v) { return at[static_cast<size_t>(u)] < at[static_cast<size_t>(v)]; });
    bool identity = true;
    for (size_t d = 0; d < perm.size(); ++d) identity = identity && perm[d] == static_cast<int64_t>(d);
    if (!identity) x = x.permute(perm, loc);
    // x's dims now hold the positions in `at` in increasing order; insert the others with size 1.
    std::vector<bool> present(static_cast<size_t>(rank), false);
    for (int64_t p : at) present[static_cast<size_t>(p)] = true;
    for (int64_t p = 0; p < rank; ++p)
      if (!present[static_cast<size_t>(p)]) x = x.unsqueeze(p, loc);
    laid[i] = std::move(x);
  }

  // Contract left to right, each position summed at the last operand that is not constant along it.
  std::vector<int64_t> sum_first;
  for (int64_t p = out_size; p < rank; ++p)
    if (last_op[static_cast<size_t>(p)] == 0 && laid[0].size(p) != 1) sum_first.push_back(p);
  Tensor result = sum_first.empty() ? laid[0] : laid[0].sum(sum_first, /*keepdim=*/true, std::nullopt, loc);
  for (size_t i = 1; i < nops; ++i) {
    std::vector<bool> summed(static_cast<size_t>(rank), false);
    for (int64_t p = out_size; p < rank; ++p) summed[static_cast<size_t>(p)] = last_op[static_cast<size_t>(p)] <= i;
    result = contract_pair(result, laid[i], summed, loc);
  }
  for (int64_t p = rank - 1; p >= out_size; --p) result = result.squeeze(p, loc);  // size 1 by now
  return result;
}

}  // namespace kiln
