#pragma once
// Choosing the algorithm Open MPI runs a collective with (its coll/tuned
// component: ring, recursive doubling, binomial tree, ...), for `kiln
// commbench --algorithm` and for a user who wants to see where each wins.
//
// Open MPI reads the choice from MCA variables when MPI_Init runs
// (OMPI_MCA_coll_tuned_use_dynamic_rules=1 and
// OMPI_MCA_coll_tuned_<call>_algorithm=<name>), and applies it to every
// communicator made afterwards, so it is one choice per process, made before
// dist::init(). The names are read from Open MPI's MPI_T interface rather
// than kept here, so they follow the installed version (`ompi_info --param
// coll tuned --level 9` lists the same ones).
#include <string>
#include <vector>

namespace kiln::dist {

/// The collectives of ProcessGroup whose algorithm can be chosen, each by the
/// MPI call the MPI backend makes for it.
enum class Collective {
  AllReduce,      // allreduce: MPI_Allreduce
  ReduceScatter,  // reduce_scatter_tensor (and reduce_scatter): MPI_Reduce_scatter_block
  AllGather,      // allgather_into_tensor (and even allgather): MPI_Allgather
  AllToAll,       // alltoall: MPI_Alltoallv
  Broadcast,      // broadcast: MPI_Bcast
};

/// "allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast".
const char* collective_name(Collective c);
/// Open MPI's variable for the MPI call behind `c`: "coll_tuned_allreduce_algorithm",
/// "coll_tuned_reduce_scatter_block_algorithm", "coll_tuned_allgather_algorithm",
/// "coll_tuned_alltoallv_algorithm", "coll_tuned_bcast_algorithm".
std::string tuned_variable(Collective c);

/// The algorithm names Open MPI accepts for `c` ("ring", "recursive_doubling",
/// ...; its "ignore", which means no choice, left out). Works before and after
/// init(). Empty when the MPI library has no such variable (not Open MPI, or no
/// coll/tuned component).
std::vector<std::string> tuned_algorithms(Collective c);

/// Before init(): makes `c` run `algorithm` (one of tuned_algorithms(c)) on
/// every group of this process, by putting the two MCA variables into the
/// environment MPI_Init reads. Every rank must make the same choice, or the
/// ranks would run different algorithms against each other. Throws ValueError
/// naming the valid names for an unknown one, and DistributedError once init()
/// has run (the choice would no longer take effect).
void force_tuned_algorithm(Collective c, const std::string& algorithm);

/// The algorithm `c` runs with, read back from Open MPI after init(): the
/// forced name, or "default" when none is forced (coll/tuned then picks one by
/// message size and rank count at each call). Reports what Open MPI took,
/// including variables a user exported before mpirun.
std::string tuned_algorithm_in_effect(Collective c);

}  // namespace kiln::dist
