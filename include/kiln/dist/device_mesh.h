#pragma once
// DeviceMesh: the world's ranks arranged as a grid with named dimensions
// (DESIGN.md §6), e.g. data parallel x tensor parallel x pipeline stages, so
// that each parallel wrapper is handed the process group of its own dimension
// rather than working out rank arithmetic itself.
//
// Layout (as torch's init_device_mesh): the world ranks fill the grid in
// row-major order, the LAST dimension fastest. For {{"dp", 2}, {"tp", 2}}:
//
//          tp=0  tp=1
//   dp=0    0     1        tp groups: [0, 1] and [2, 3]  (neighbouring ranks)
//   dp=1    2     3        dp groups: [0, 2] and [1, 3]
//
// so the dimension named last gets ranks that are adjacent (on one machine,
// when a job spans several), which is where the chattiest parallelism (tp)
// belongs. A rank's coordinate along a dimension is its rank in that
// dimension's group.
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"

namespace kiln::dist {

class DeviceMesh {
 public:
  struct Dim {
    std::string name;  // how callers ask for it: "dp", "tp", "pp", "ep", ...
    int size = 1;
  };

  /// Builds the mesh over the world (dist::init() must have run) and its
  /// subgroups: for every dimension, one group per line of the grid along it,
  /// each made with dist::new_group by every rank in the same order (the
  /// dimensions in order, the lines in row-major order of the other
  /// coordinates), named after its dimension ("tp group [0, 1] (2 of 4 ranks)"
  /// in errors and watchdog reports). So every rank must construct the same
  /// meshes in the same order. The sizes must multiply to the world size;
  /// names must be non-empty and distinct; every size >= 1.
  explicit DeviceMesh(std::vector<Dim> dims);

  /// The dimensions, in the order given.
  const std::vector<Dim>& dims() const { return dims_; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  /// The number of ranks in the mesh (the world size).
  int size() const { return world_size_; }
  /// The size of one dimension.
  int size(const std::string& dim) const;
  /// This rank's index along `dim`, 0 .. size(dim) - 1 (= group(dim)->rank()).
  int coordinate(const std::string& dim) const;
  /// This rank's coordinates, one per dimension, in order.
  const std::vector<int>& coordinates() const { return coords_; }
  /// The world ranks of this rank's line along `dim` (the members of
  /// group(dim)), in coordinate order, which is also their group-rank order.
  std::vector<int> ranks_along(const std::string& dim) const;
  /// This rank's group along `dim`: the ranks whose other coordinates equal its own.
  ProcessGroupPtr group(const std::string& dim) const;
  /// The world rank at `coords` (one per dimension).
  int rank_at(const std::vector<int>& coords) const;
  /// "mesh dp=2 x tp=2 (4 ranks); world rank 3 at dp=1, tp=1"
  std::string describe() const;

 private:
  size_t index_of(const std::string& dim) const;

  std::vector<Dim> dims_;
  std::vector<int> strides_;  // world-rank distance between neighbours along each dimension
  std::vector<int> coords_;
  std::vector<ProcessGroupPtr> groups_;
  int world_size_ = 1, world_rank_ = 0;
};

}  // namespace kiln::dist
