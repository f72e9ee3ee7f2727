// Open MPI's coll/tuned algorithm choice through MPI_T (include/kiln/dist/mpi_tuning.h).
#include "kiln/dist/mpi_tuning.h"

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/dist/dist.h"

namespace kiln::dist {

namespace {

// MPI_T may be initialised any number of times, before MPI_Init too (which
// is how the names are known before the choice is made); each session here
// is balanced by its own finalize.
class MpiTSession {
 public:
  MpiTSession() {
    int provided = 0;
    ok_ = MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS;
  }
  ~MpiTSession() {
    if (ok_) MPI_T_finalize();
  }
  MpiTSession(const MpiTSession&) = delete;
  MpiTSession& operator=(const MpiTSession&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
};

struct CVar {
  bool found = false;
  int index = -1;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_T_enum enumtype = MPI_T_ENUM_NULL;
};

CVar find_cvar(const std::string& name) {
  CVar v;
  if (MPI_T_cvar_get_index(name.c_str(), &v.index) != MPI_SUCCESS) return v;
  char got_name[256], desc[2048];
  int name_len = sizeof(got_name), desc_len = sizeof(desc), verbosity = 0, bind = 0, scope = 0;
  if (MPI_T_cvar_get_info(v.index, got_name, &name_len, &verbosity, &v.type, &v.enumtype, desc, &desc_len, &bind,
                          &scope) != MPI_SUCCESS) {
    return v;
  }
  v.found = true;
  return v;
}

// The variable's value as an integer (an enum's value, or a bool's 0/1).
bool read_cvar(const CVar& v, int64_t& out) {
  MPI_T_cvar_handle h;
  int count = 0;
  if (MPI_T_cvar_handle_alloc(v.index, nullptr, &h, &count) != MPI_SUCCESS) return false;
  // Wide and zeroed: a bool variable writes one byte of it, an int four.
  unsigned char buf[64] = {};
  const bool ok = count == 1 && MPI_T_cvar_read(h, buf) == MPI_SUCCESS;
  MPI_T_cvar_handle_free(&h);
  if (!ok) return false;
  if (v.type == MPI_INT) {
    int x = 0;
    std::memcpy(&x, buf, sizeof(x));
    out = x;
  } else if (v.type == MPI_LONG_LONG || v.type == MPI_INT64_T) {
    long long x = 0;
    std::memcpy(&x, buf, sizeof(x));
    out = x;
  } else {
    out = buf[0] != 0;
  }
  return true;
}

// (value, name) of every item of the variable's enumeration.
std::vector<std::pair<int, std::string>> enum_items(const CVar& v) {
  std::vector<std::pair<int, std::string>> out;
  if (v.enumtype == MPI_T_ENUM_NULL) return out;
  int n = 0;
  char ename[256];
  int ename_len = sizeof(ename);
  if (MPI_T_enum_get_info(v.enumtype, &n, ename, &ename_len) != MPI_SUCCESS) return out;
  for (int i = 0; i < n; ++i) {
    int value = 0;
    char item[256];
    int item_len = sizeof(item);
    if (MPI_T_enum_get_item(v.enumtype, i, &value, item, &item_len) == MPI_SUCCESS) out.emplace_back(value, item);
  }
  return out;
}

constexpr const char* kDynamicRules = "coll_tuned_use_dynamic_rules";
constexpr const char* kIgnore = "ignore";  // Open MPI's "no choice" value

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "allreduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllGather: return "allgather";
    case Collective::AllToAll: return "alltoall";
    case Collective::Broadcast: return "broadcast";
  }
  return "?";
}

std::string tuned_variable(Collective c) {
  // The MPI call the backend makes (src/dist/mpi_process_group.cpp), not the
  // kiln name: reduce-scatter is MPI_Reduce_scatter_block, whose algorithms
  // (no ring among them) differ from MPI_Reduce_scatter's.
  switch (c) {
    case Collective::AllReduce: return "coll_tuned_allreduce_algorithm";
    case Collective::ReduceScatter: return "coll_tuned_reduce_scatter_block_algorithm";
    case Collective::AllGather: return "coll_tuned_allgather_algorithm";
    case Collective::AllToAll: return "coll_tuned_alltoallv_algorithm";
    case Collective::Broadcast: return "coll_tuned_bcast_algorithm";
  }
  return "";
}

std::vector<std::string> tuned_algorithms(Collective c) {
  MpiTSession session;
  std::vector<std::string> out;
  if (!session.ok()) return out;
  const CVar v = find_cvar(tuned_variable(c));
  if (!v.found) return out;
  for (auto& [value, name] : enum_items(v)) {
    if (name != kIgnore) out.push_back(name);
  }
  return out;
}

void force_tuned_algorithm(Collective c, const std::string& algorithm) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  KILN_CHECK(!is_initialized() && !initialised, DistributedError, "dist::force_tuned_algorithm(", collective_name(c),
             ", ", algorithm,
             "): MPI is already initialised, and Open MPI reads the algorithm only in MPI_Init; choose it before "
             "dist::init()");
  const std::vector<std::string> names = tuned_algorithms(c);
  KILN_CHECK(!names.empty(), ValueError, "dist::force_tuned_algorithm: this MPI has no variable ", tuned_variable(c),
             " (Open MPI's coll/tuned component chooses collective algorithms; is this Open MPI?)");
  bool known = false;
  for (const auto& n : names) known = known || n == algorithm;
  KILN_CHECK(known, ValueError, "dist::force_tuned_algorithm: Open MPI has no ", collective_name(c),
             " algorithm named '", algorithm, "' (", tuned_variable(c), "); expected one of: ", join(names));
  // Open MPI accepts an enumeration's names as values, so the number need not be known here.
  ::setenv((std::string("OMPI_MCA_") + kDynamicRules).c_str(), "1", 1);
  ::setenv(("OMPI_MCA_" + tuned_variable(c)).c_str(), algorithm.c_str(), 1);
}

std::string tuned_algorithm_in_effect(Collective c) {
  MpiTSession session;
  if (!session.ok()) return "default";
  const CVar dynamic = find_cvar(kDynamicRules), var = find_cvar(tuned_variable(c));
  int64_t on = 0, value = 0;
  if (!dynamic.found || !read_cvar(dynamic, on) || on == 0) return "default";
  if (!var.found || !read_cvar(var, value)) return "default";
  for (auto& [v, name] : enum_items(var)) {
    if (v == value) return name == kIgnore ? "default" : name;
  }
  return std::to_string(value);
}

}  // namespace kiln::dist
