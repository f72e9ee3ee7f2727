// DeviceMesh: row-major rank layout and one new_group per line of the grid
// along each dimension (include/kiln/dist/device_mesh.h).
#include "kiln/dist/device_mesh.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/dist/dist.h"

namespace kiln::dist {

namespace {

std::string shape_text(const std::vector<DeviceMesh::Dim>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? " x " : "") + dims[i].name + "=" + std::to_string(dims[i].size);
  return s;
}

std::string names_text(const std::vector<DeviceMesh::Dim>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].name;
  return s;
}

}  // namespace

DeviceMesh::DeviceMesh(std::vector<Dim> dims) : dims_(std::move(dims)) {
  // Argument errors are the same on every rank (all pass the same shape), so
  // each throws before the first collective and none is left waiting.
  KILN_CHECK(!dims_.empty(), ValueError,
             "dist::DeviceMesh: expected at least one dimension, e.g. {{\"dp\", 2}, {\"tp\", 2}}, got none");
  int64_t product = 1;
  for (size_t i = 0; i < dims_.size(); ++i) {
    const Dim& d = dims_[i];
    KILN_CHECK(!d.name.empty(), ValueError, "dist::DeviceMesh: dimension ", i,
               " has an empty name; name every dimension (\"dp\", \"tp\", \"pp\", ...)");
    KILN_CHECK(d.size >= 1, ValueError, "dist::DeviceMesh: dimension '", d.name, "' must have size >= 1, got ", d.size);
    for (size_t j = 0; j < i; ++j) {
      KILN_CHECK(dims_[j].name != d.name, ValueError, "dist::DeviceMesh: dimension '", d.name, "' is named twice in ",
                 shape_text(dims_), "; dimension names must be distinct");
    }
    product = std::min<int64_t>(product * d.size, int64_t{1} << 40);  // no overflow from absurd sizes
  }
  auto world_group = world();  // throws before init()
  world_size_ = world_group->size();
  world_rank_ = world_group->rank();
  KILN_CHECK(product == world_size_, ValueError, "dist::DeviceMesh: the dimensions ", shape_text(dims_), " hold ",
             product, product == 1 ? " rank" : " ranks", ", but the world has ", world_size_,
             "; the sizes must multiply to the number of processes (launch with -n ", product,
             ", or change the sizes)");

  // Row-major, the last dimension fastest: its stride is 1.
  strides_.assign(dims_.size(), 1);
  for (size_t i = dims_.size() - 1; i > 0; --i) strides_[i - 1] = strides_[i] * dims_[i].size;
  coords_.resize(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) coords_[i] = world_rank_ / strides_[i] % dims_[i].size;

  // Every rank makes every group, in one fixed order: dimension by dimension,
  // and within one, the lines in increasing order of their first world rank
  // (the row-major order of the other coordinates). new_group requires
  // every process to call it with the same ranks in the same order.
  groups_.resize(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) {
    for (int start = 0; start < world_size_; ++start) {
      if (start / strides_[i] % dims_[i].size != 0) continue;  // not the first rank of a line
      std::vector<int> line(static_cast<size_t>(dims_[i].size));
      for (int k = 0; k < dims_[i].size; ++k) line[static_cast<size_t>(k)] = start + k * strides_[i];
      const bool mine = world_rank_ - coords_[i] * strides_[i] == start;
      ProcessGroupPtr g = new_group(line, dims_[i].name);
      if (mine) groups_[i] = std::move(g);
    }
  }
}

size_t DeviceMesh::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == dim) return i;
  }
  throw ValueError("dist::DeviceMesh: no dimension '" + dim + "' in the mesh " + shape_text(dims_) +
                   "; its dimensions are " + names_text(dims_));
}

int DeviceMesh::size(const std::string& dim) const { return dims_[index_of(dim)].size; }

int DeviceMesh::coordinate(const std::string& dim) const { return coords_[index_of(dim)]; }

std::vector<int> DeviceMesh::ranks_along(const std::string& dim) const {
  const size_t i = index_of(dim);
  const int start = world_rank_ - coords_[i] * strides_[i];
  std::vector<int> out(static_cast<size_t>(dims_[i].size));
  for (int k = 0; k < dims_[i].size; ++k) out[static_cast<size_t>(k)] = start + k * strides_[i];
  return out;
}

ProcessGroupPtr DeviceMesh::group(const std::string& dim) const { return groups_[index_of(dim)]; }

int DeviceMesh::rank_at(const std::vector<int>& coords) const {
  KILN_CHECK(coords.size() == dims_.size(), ValueError, "dist::DeviceMesh::rank_at: expected ", dims_.size(),
             " coordinates (", names_text(dims_), "), got ", coords.size());
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    KILN_CHECK(coords[i] >= 0 && coords[i] < dims_[i].size, ValueError, "dist::DeviceMesh::rank_at: coordinate ",
               dims_[i].name, "=", coords[i], " is outside 0 .. ", dims_[i].size - 1);
    r += coords[i] * strides_[i];
  }
  return r;
}

std::string DeviceMesh::describe() const {
  std::string s = "mesh " + shape_text(dims_) + " (" + std::to_string(world_size_) +
                  (world_size_ == 1 ? " rank" : " ranks") + "); world rank " + std::to_string(world_rank_) + " at ";
  for (size_t i = 0; i < dims_.size(); ++i) {
    s += (i ? ", " : "") + dims_[i].name + "=" + std::to_string(coords_[i]);
  }
  return s;
}

}  // namespace kiln::dist
