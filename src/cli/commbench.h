#pragma once
// `kiln commbench`: what kiln's collectives cost on this machine, in the
// manner of nccl-tests' all_reduce_perf. Run under `kiln launch -n N -- kiln
// commbench` (or mpirun); for each collective and message size it prints the
// mean time per call on the slowest rank, the algorithm bandwidth (size /
// time) and the bus bandwidth (algbw x the collective's factor: allreduce
// 2(n-1)/n, reduce-scatter, all-gather and all-to-all (n-1)/n, broadcast 1;
// docs/distributed.md derives them), and checks every result once.
#include <string>

namespace kiln::cli {

/// The flags as given (strings, so that an error can quote the value).
struct CommbenchOptions {
  std::string ops = "allreduce,reduce_scatter,allgather,alltoall,broadcast";
  std::string min_bytes = "8";
  std::string max_bytes = "256M";  // K, M, G: powers of 1024 (as nccl-tests); KB, MB: of 1000; KiB, MiB
  int iters = 20;
  int warmup = 5;
  /// default | an algorithm name for every collective that has it (ring,
  /// recursive_doubling, ...) | op=name,op=name (Open MPI's coll/tuned names).
  std::string algorithm = "default";
  std::string json;  // write the results there too (rank 0)
  /// float32 | bf16 | fp16: allreduce's float32 buffers sent as 16 bits
  /// (ProcessGroup::allreduce_compressed, DDP's compression hooks); allreduce only.
  std::string wire = "float32";
};

/// Initialises dist (after forcing the algorithm, which MPI_Init must see),
/// runs the benchmark on the world and prints the table on rank 0. Returns 0,
/// or 1 when some collective gave a wrong result; ConfigError on a bad flag.
int commbench_command(const CommbenchOptions& options);

}  // namespace kiln::cli
