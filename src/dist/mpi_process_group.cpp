// The MPI backend: argument checks on the caller's thread, the collectives
// themselves on the communication thread, and debug-mode signature checks.
// The watchdog is in watchdog.cpp.
#include "mpi_process_group.h"
#include "rank_status.h"
#include "wire16.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/half.h"
#include "kiln/core/record.h"
#include "kiln/dist/traffic.h"

namespace kiln::dist::detail {
namespace {

const char* kind_name(int32_t k) {
  switch (static_cast<OpKind>(k)) {
    case OpKind::AllReduce: return "allreduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllGather: return "allgather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::Barrier: return "barrier";
    case OpKind::Send: return "send";
    case OpKind::Recv: return "recv";
    case OpKind::AllGatherInto: return "allgather_into_tensor";
    case OpKind::ReduceScatterTensor: return "reduce_scatter_tensor";
    case OpKind::AllToAll: return "alltoall";
    case OpKind::AllToAllSplit: return "alltoall(splits)";
    case OpKind::AllReduceCompressed: return "allreduce_compressed";
  }
  return "?";
}

// The CollectiveWait scope's name: the collective's, so a table keeps waits and transfers apart.
const char* wait_name(int32_t k) {
  switch (static_cast<OpKind>(k)) {
    case OpKind::AllReduce: return "allreduce.wait";
    case OpKind::Broadcast: return "broadcast.wait";
    case OpKind::AllGather: return "allgather.wait";
    case OpKind::ReduceScatter: return "reduce_scatter.wait";
    case OpKind::Barrier: return "barrier.wait";
    case OpKind::Send: return "send.wait";
    case OpKind::Recv: return "recv.wait";
    case OpKind::AllGatherInto: return "allgather_into_tensor.wait";
    case OpKind::ReduceScatterTensor: return "reduce_scatter_tensor.wait";
    case OpKind::AllToAll: return "alltoall.wait";
    case OpKind::AllToAllSplit: return "alltoall(splits).wait";
    case OpKind::AllReduceCompressed: return "allreduce_compressed.wait";
  }
  return "?.wait";
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Int64: return MPI_INT64_T;
    case DType::BFloat16: return MPI_UINT16_T;  // moved as bits; reduced through float32
    default: break;
  }
  throw DTypeError("dist: expected a float32, bfloat16 or int64 tensor, got " + std::string(dtype_name(t)));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

void check_tensor(const Tensor& t, const char* op, const char* name) {
  KILN_CHECK(t.defined(), ValueError, "dist::", op, ": ", name, " is an undefined tensor");
  KILN_CHECK(t.is_contiguous(), ValueError, "dist::", op, ": expected a contiguous ", name, ", got one with shape ",
             t.shape_string(), " that is not (call .contiguous())");
  mpi_type(t.dtype());
  KILN_CHECK(t.numel() <= INT_MAX, ValueError, "dist::", op, ": ", name, " has ", t.numel(),
             " elements; at most INT_MAX per collective (split the tensor)");
}

// bfloat16 is reduced in float32 (one rounding at the end, and MPI's own
// optimised reductions), then written back.
std::vector<float> to_float(const Tensor& t) {
  const auto* p = static_cast<const BFloat16*>(t.data_ptr());
  std::vector<float> f(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(p[i]);
  return f;
}
void from_float(const std::vector<float>& f, void* dst) {
  auto* p = static_cast<BFloat16*>(dst);
  for (size_t i = 0; i < f.size(); ++i) p[i] = BFloat16(f[i]);
}

template <typename T>
void divide(T* p, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) p[i] /= static_cast<T>(by);
}

// FNV-1a over the per-rank sizes of an uneven allgather: ranks that disagree on
// them would pair buffers of different lengths.
uint64_t hash_sizes(const std::vector<int64_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t x : v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(x >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h == 0 ? 1 : h;
}

bool overlap(const Tensor& a, const Tensor& b) {
  const auto* pa = static_cast<const unsigned char*>(a.data_ptr());
  const auto* pb = static_cast<const unsigned char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

std::string short_site(const std::source_location& loc) {
  std::string f = loc.file_name();
  // Keep the path from the last src/, tests/, examples/ or tools/ on: enough to find the line.
  for (const char* anchor : {"/src/", "/tests/", "/examples/", "/tools/", "/bench/"}) {
    const auto at = f.rfind(anchor);
    if (at != std::string::npos) {
      f = f.substr(at + 1);
      break;
    }
  }
  return f + ":" + std::to_string(loc.line());
}

}  // namespace

std::string Signature::describe() const {
  std::ostringstream os;
  os << "#" << seq << " " << kind_name(kind);
  if (reduce >= 0) os << "(" << reduce_name(static_cast<ReduceOp>(reduce)) << ")";
  if (dtype >= 0) {
    os << " " << dtype_name(static_cast<DType>(dtype)) << "[";
    for (int d = 0; d < std::min<int>(ndim, kShapeDims); ++d) {
      os << (d ? ", " : "");
      if (shape[d] < 0) {
        os << "*";  // differs between ranks by design (the rows an alltoall with splits sends)
      } else {
        os << shape[d];
      }
    }
    if (ndim > kShapeDims) os << ", ... (" << count << " elements)";
    os << "]";
  }
  const auto k = static_cast<OpKind>(kind);
  if (k == OpKind::Broadcast) os << " root=" << peer;
  if (k == OpKind::Send) os << " to=" << peer;
  if (k == OpKind::Recv) os << " from=" << peer;
  if (k == OpKind::AllGather && layout != 0) os << " uneven";
  os << " at " << site;
  return os.str();
}

void MPIWork::wait() {
  std::unique_lock lock(mu_);
  if (!done_) {
    // Only a wait that blocks is recorded: the time this thread spent on its peers and the transfer.
    record::Scope blocked(record::Kind::CollectiveWait, wait_name_);
    blocked.set_detail(*group_);
    cv_.wait(lock, [&] { return done_; });
  }
  if (err_) std::rethrow_exception(err_);
}

bool MPIWork::is_completed() {
  std::lock_guard lock(mu_);
  return done_;
}

void MPIWork::finish(std::exception_ptr err) {
  {
    std::lock_guard lock(mu_);
    done_ = true;
    err_ = std::move(err);
  }
  cv_.notify_all();
}

MPIProcessGroup::MPIProcessGroup(MPI_Comm comm, std::vector<int> world_ranks, const std::string& name)
    : world_ranks_(std::move(world_ranks)) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  check_mpi(MPI_Comm_dup(comm, &watch_), "MPI_Comm_dup");
  // Errors come back as codes, thrown by check_mpi and rethrown by Work::wait.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  int world_size = size_;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  is_world_ = world_ranks_.empty();
  if (is_world_) {
    for (int r = 0; r < size_; ++r) world_ranks_.push_back(r);
    name_ = "the world (" + std::to_string(size_) + (size_ == 1 ? " rank)" : " ranks)");
  } else {
    KILN_ASSERT(static_cast<int>(world_ranks_.size()) == size_, "MPIProcessGroup: ", world_ranks_.size(),
                " world ranks for a communicator of ", size_);
    name_ = (name.empty() ? "" : name + " ") + "group [";
    for (size_t i = 0; i < world_ranks_.size(); ++i) name_ += (i ? ", " : "") + std::to_string(world_ranks_[i]);
    name_ += "] (" + std::to_string(size_) + " of " + std::to_string(world_size) + " ranks)";
  }
  progress_mode_ = progress_mode_from_env();
  if (const char* d = std::getenv("KILN_DIST_DEBUG")) debug_ = std::strcmp(d, "") != 0 && std::strcmp(d, "0") != 0;
  if (const char* t = std::getenv("KILN_DIST_TIMEOUT"); t && *t) {
    char* end = nullptr;
    const double v = std::strtod(t, &end);
    KILN_CHECK(end && *end == '\0' && v >= 0, ValueError,
               "KILN_DIST_TIMEOUT: expected a number of seconds (0 turns the watchdog off), got '", t, "'");
    timeout_s_ = v;
  }
  // Debug mode adds an allgather before each collective: every rank must agree
  // on it, or the first collective would pair an allgather with something else.
  // So must KILN_DIST_PROGRESS: a nonblocking collective does not match a blocking one.
  // So must KILN_DIST_SHM: one rank in shared memory and one in MPI would never meet.
  if (const char* v = std::getenv("KILN_DIST_SHM")) shm_enabled_ = std::strcmp(v, "0") != 0;
  const int mode = static_cast<int>(progress_mode_);
  const int shm = shm_enabled_ ? 1 : 0;
  int flags[6] = {debug_ ? 1 : 0, debug_ ? -1 : 0, mode, -mode, shm, -shm};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, flags, 6, MPI_INT, MPI_MAX, comm_), "MPI_Allreduce (KILN_DIST_DEBUG check)");
  KILN_CHECK(flags[0] == -flags[1], DistributedError,
             "KILN_DIST_DEBUG must be set alike on every rank, but some ranks have it on and some off (rank ", rank_,
             " has it ", debug_ ? "on" : "off", "); launch with `kiln launch` or mpirun -x KILN_DIST_DEBUG");
  KILN_CHECK(flags[2] == -flags[3], DistributedError, "KILN_DIST_PROGRESS must be set alike on every rank (rank ",
             rank_, " has ", progress_mode_ == ProgressMode::Spin ? "spin" : "backoff",
             ", another rank the other); launch with `kiln launch` or mpirun -x KILN_DIST_PROGRESS");
  KILN_CHECK(flags[4] == -flags[5], DistributedError, "KILN_DIST_SHM must be set alike on every rank (rank ", rank_,
             " has the shared-memory all-reduce ", shm_enabled_ ? "on" : "off",
             ", another rank the other); launch with `kiln launch` or mpirun -x KILN_DIST_SHM");
  comm_thread_ = std::thread([this] { comm_loop(); });
  watch_thread_ = std::thread([this] { watchdog_loop(); });
}

MPIProcessGroup::~MPIProcessGroup() { shutdown(); }

void MPIProcessGroup::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  {
    std::lock_guard lock(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  // A collective still running here means a peer never joined it: the
  // watchdog, still running, reports it and aborts after its timeout.
  if (comm_thread_.joinable()) comm_thread_.join();
  watch_stop_ = true;
  if (watch_thread_.joinable()) watch_thread_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Comm_free(&comm_);
    MPI_Comm_free(&watch_);
  }
}

Signature MPIProcessGroup::make_signature(OpKind kind, int reduce, int peer, const Tensor* t, const Loc& loc) {
  Signature s;
  s.kind = static_cast<int32_t>(kind);
  s.reduce = reduce;
  s.peer = peer;
  if (t) {
    s.dtype = static_cast<int32_t>(t->dtype());
    s.count = t->numel();
    s.ndim = static_cast<int32_t>(t->dim());
    for (int d = 0; d < std::min<int>(s.ndim, Signature::kShapeDims); ++d) s.shape[d] = t->size(d);
  }
  const std::string& label = CollectiveLabel::current();
  if (label.empty()) {
    std::snprintf(s.site, sizeof s.site, "%s", short_site(loc).c_str());
  } else {
    std::snprintf(s.site, sizeof s.site, "%s (%s)", short_site(loc).c_str(), label.c_str());
  }
  return s;
}

// dist::traffic()'s totals, over every group of the process.
std::atomic<int64_t> g_traffic_ops{0}, g_traffic_bytes{0};

WorkPtr MPIProcessGroup::enqueue(Signature sig, std::function<void()> run) {
  KILN_CHECK(!shut_down_, DistributedError, "dist: ", kind_name(sig.kind), " at ", sig.site,
             " after the process group was shut down (MPI finalised)");
  g_traffic_ops.fetch_add(1, std::memory_order_relaxed);
  if (sig.dtype >= 0)
    g_traffic_bytes.fetch_add(sig.count * element_size(static_cast<DType>(sig.dtype)), std::memory_order_relaxed);
  Task task;
  {
    std::lock_guard lock(issue_mu_);
    sig.seq = ++next_seq_;
    const auto k = static_cast<OpKind>(sig.kind);
    if (k != OpKind::Send && k != OpKind::Recv) sig.coll_no = ++next_coll_;
    task.sig = sig;
    task.run = std::move(run);
    task.work = std::make_shared<MPIWork>(sig.seq, wait_name(sig.kind), &name_);
    std::lock_guard qlock(q_mu_);
    queue_.push_back(task);
  }
  q_cv_.notify_one();
  return task.work;
}

void MPIProcessGroup::comm_loop() {
  record::set_thread_name("collectives: " + name_);
  for (;;) {
    Task task;
    {
      std::unique_lock lock(q_mu_);
      q_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const bool collective = task.sig.coll_no != 0;
    std::string poisoned;
    {
      std::lock_guard lock(state_mu_);
      progress_.started_seq = task.sig.seq;
      if (collective) progress_.colls_started = task.sig.coll_no;
      progress_.in_flight = 1;
      progress_.current = task.sig;
      started_at_ = std::chrono::steady_clock::now();
      history_.push_back(task.sig);
      if (history_.size() > 8) history_.pop_front();
      poisoned = poisoned_;
    }
    if (rank_status_enabled()) status_collective(task.sig.describe(), true);
    std::exception_ptr err;
    try {
      KILN_CHECK(poisoned.empty(), DistributedError, "dist: ", task.sig.describe(),
                 " not run: an earlier collective of ", name_,
                 " failed, so its ranks no longer agree on what runs next. The first failure was:\n", poisoned);
      if (debug_ && collective) check_signatures(task.sig);
      // The transfer itself, on this thread's track; the detail names the group and the call site
      // (and its CollectiveLabel, e.g. DDP's bucket), and lives until the scope closes.
      std::string detail;
      if (record::active()) detail = name_ + "; " + task.sig.site;
      record::Scope transfer(record::Kind::Collective, kind_name(task.sig.kind));
      if (transfer.recording()) {
        transfer.set_detail(detail);
        if (task.sig.dtype >= 0)
          transfer.set_bytes(task.sig.count * static_cast<int64_t>(element_size(static_cast<DType>(task.sig.dtype))));
      }
      task.run();
    } catch (const std::exception& e) {
      err = std::current_exception();
      // Only a failed collective desynchronises the group; a failed send or
      // recv concerns two ranks and is the caller's to handle.
      std::lock_guard lock(state_mu_);
      if (collective && poisoned_.empty()) poisoned_ = e.what();
    } catch (...) {
      err = std::current_exception();
      std::lock_guard lock(state_mu_);
      if (collective && poisoned_.empty()) poisoned_ = "unknown error in " + task.sig.describe();
    }
    {
      std::lock_guard lock(state_mu_);
      progress_.completed_seq = task.sig.seq;
      if (collective) progress_.colls_completed = task.sig.coll_no;
      progress_.in_flight = 0;
    }
    status_collective({}, false);
    // Drop the tensors the task holds before waking the caller: once wait()
    // returns the group keeps no reference, so memory counters read then are exact.
    task.run = nullptr;
    task.work->finish(err);
  }
}

void MPIProcessGroup::check_signatures(const Signature& mine) {
  std::vector<Signature> all(static_cast<size_t>(size_));
  check_mpi(MPI_Allgather(&mine, sizeof(Signature), MPI_BYTE, all.data(), sizeof(Signature), MPI_BYTE, comm_),
            "MPI_Allgather (signature check)");
  bool agree = true;
  for (const auto& s : all) agree = agree && s.same_call(all[0]);
  if (agree) return;
  std::ostringstream os;
  os << "dist: collective mismatch at collective number " << mine.coll_no << " of " << name_
     << " (KILN_DIST_DEBUG=1): the ranks called different collectives\n"
     << "  rank | what it called\n";
  for (int r = 0; r < size_; ++r) {
    const auto& s = all[static_cast<size_t>(r)];
    os << "  "
       << (r < 10    ? "   "
           : r < 100 ? "  "
                     : " ")
       << who(r) << " | " << s.describe() << (s.same_call(all[0]) ? "" : "   <-- differs from rank 0") << "\n";
  }
  os << "every rank must issue the same collectives (op, dtype, shape, root) in the same order";
  throw DistributedError(os.str());
}

WorkPtr MPIProcessGroup::allreduce(Tensor& t, ReduceOp op, Loc loc) {
  // Every collective: a replay runs no communication (and the peers would not be there).
  capture::graph_break_if_recording("collective all_reduce");
  check_tensor(t, "allreduce", "tensor");
  KILN_CHECK(op != ReduceOp::Avg || t.dtype() != DType::Int64, DTypeError,
             "dist::allreduce: ReduceOp::Avg needs a float32 or bfloat16 tensor, got int64 (use Sum and divide)");
  auto sig = make_signature(OpKind::AllReduce, static_cast<int>(op), -1, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, op] {
    const int n = static_cast<int>(keep.numel());
    const int size = size_;
    // In place; with ProgressMode::Backoff nonblocking, tested without holding a core.
    // Returns whether Avg's division is done (the shared-memory path divides as it reduces).
    auto reduce = [&](void* data, MPI_Datatype type) {
      if (type == MPI_FLOAT && (op == ReduceOp::Sum || op == ReduceOp::Avg)) {
        if (ShmAllreduce* shm = shm_for(static_cast<size_t>(n))) {
          shm->run(static_cast<float*>(data), static_cast<size_t>(n), op == ReduceOp::Avg,
                   progress_mode_ == ProgressMode::Spin);
          return true;
        }
      }
      if (progress_mode_ == ProgressMode::Spin) {
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, data, n, type, mpi_op(op), comm_), "MPI_Allreduce");
        return false;
      }
      MPI_Request req = MPI_REQUEST_NULL;
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, n, type, mpi_op(op), comm_, &req), "MPI_Iallreduce");
      wait_with_backoff(req, "MPI_Iallreduce");
      return false;
    };
    // Avg's division happens here, on the communication thread, as the reduced
    // data comes out (for bfloat16, in the conversion back), so the caller's
    // thread never makes a pass over the buffer for it.
    if (keep.dtype() == DType::BFloat16) {
      // Through shared memory as 16 bits, with the bits of the float32 path below.
      if (op == ReduceOp::Sum || op == ReduceOp::Avg) {
        if (ShmAllreduce* shm = shm_for(static_cast<size_t>(n))) {
          shm->run16(static_cast<uint16_t*>(keep.data_ptr()), static_cast<size_t>(n), DType::BFloat16,
                     op == ReduceOp::Avg, progress_mode_ == ProgressMode::Spin);
          return;
        }
      }
      auto f = to_float(keep);
      const bool divided = reduce(f.data(), MPI_FLOAT);
      if (op == ReduceOp::Avg && !divided) divide(f.data(), f.size(), size);
      from_float(f, keep.data_ptr());
      return;
    }
    const bool divided = reduce(keep.data_ptr(), mpi_type(keep.dtype()));
    if (op == ReduceOp::Avg && !divided) divide(static_cast<float*>(keep.data_ptr()), static_cast<size_t>(n), size);
  });
}

namespace {
// MPI reduction ops over 16-bit floats moved as MPI_UINT16_T: each pair
// widened, added in float32 and rounded back. Made once, on first use (after
// MPI_Init), and kept for the process.
template <typename W>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  constexpr int kBlock = 1024;
  float x[kBlock], y[kBlock];
  for (int at = 0; at < *len; at += kBlock) {
    const size_t k = static_cast<size_t>(std::min(kBlock, *len - at));
    convert<W>(x, a + at, k);
    convert<W>(y, b + at, k);
    for (size_t i = 0; i < k; ++i) x[i] += y[i];
    convert<W>(b + at, x, k);
  }
}

MPI_Op half_sum_op(DType wire) {
  static MPI_Op ops[2] = {MPI_OP_NULL, MPI_OP_NULL};
  static std::once_flag once;
  std::call_once(once, [] {
    check_mpi(MPI_Op_create(&half_sum<BFloat16>, 1, &ops[0]), "MPI_Op_create (bfloat16 sum)");
    check_mpi(MPI_Op_create(&half_sum<Half>, 1, &ops[1]), "MPI_Op_create (float16 sum)");
  });
  return ops[wire == DType::BFloat16 ? 0 : 1];
}
}  // namespace

WorkPtr MPIProcessGroup::allreduce_compressed(Tensor& t, DType wire, ReduceOp op, Loc loc) {
  capture::graph_break_if_recording("collective all_reduce (compressed)");
  check_compressed(t, wire, op);
  check_tensor(t, "allreduce_compressed", "tensor");
  // The signature carries the wire type: a rank that sends bfloat16 where its
  // peer sends float32 is a mismatch, and the traffic counts the bytes moved.
  auto sig = make_signature(OpKind::AllReduceCompressed, static_cast<int>(op), -1, &t, loc);
  sig.dtype = static_cast<int32_t>(wire);
  Tensor keep = t;
  return enqueue(sig, [this, keep, wire, op] {
    const size_t n = static_cast<size_t>(keep.numel());
    auto* data = static_cast<float*>(keep.data_ptr());
    if (ShmAllreduce* shm = shm_for(n)) {
      shm->run_compressed(data, n, wire, op == ReduceOp::Avg, progress_mode_ == ProgressMode::Spin);
      return;
    }
    // Across nodes, through MPI as 16 bits. MPI's reduction rounds each
    // partial sum to the wire type (as NCCL's reduction of bf16 / fp16 does),
    // so Avg divides first, as torch's hooks do, keeping a float16 sum of
    // large gradients in range. On 2 ranks (any power of two, without
    // underflow) the division is exact and the result has the bits of the
    // shared-memory path.
    const int P = size_;
    std::vector<uint16_t> bits(n);
    if (op == ReduceOp::Avg) divide(data, n, P);
    wire == DType::BFloat16 ? convert<BFloat16>(bits.data(), data, n) : convert<Half>(bits.data(), data, n);
    const int count = static_cast<int>(n);
    const MPI_Op sum = half_sum_op(wire);
    if (progress_mode_ == ProgressMode::Spin) {
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, bits.data(), count, MPI_UINT16_T, sum, comm_), "MPI_Allreduce");
    } else {
      MPI_Request req = MPI_REQUEST_NULL;
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, bits.data(), count, MPI_UINT16_T, sum, comm_, &req), "MPI_Iallreduce");
      wait_with_backoff(req, "MPI_Iallreduce");
    }
    wire == DType::BFloat16 ? convert<BFloat16>(data, bits.data(), n) : convert<Half>(data, bits.data(), n);
  });
}

std::string MPIProcessGroup::shm_status() const {
  if (!shm_enabled_) return "off (KILN_DIST_SHM=0)";
  std::lock_guard lock(state_mu_);
  return shm_why_;
}

ShmAllreduce* MPIProcessGroup::shm_for(size_t n) {
  // Every size, not only large ones: then every float sum of a group on one
  // node adds the ranks in one order, and a reduce-scatter and an all-reduce
  // of the same gradients (ZeRO against DDP) agree bit for bit.
  if (!shm_enabled_ || size_ < 2 || n == 0) return nullptr;
  if (!shm_tried_) {
    shm_tried_ = true;
    // Every rank decides alike (same count, same setting), so all make it here together.
    std::string why;
    shm_ = ShmAllreduce::create(comm_, &why);
    {
      std::lock_guard lock(state_mu_);
      shm_why_ = why;
    }
    // Ranks on several nodes are the expected case for MPI; a failure on one node is worth a word.
    if (!shm_ && rank_ == 0 && why != ShmAllreduce::kNotOneNode)
      std::fprintf(stderr, "kiln dist: %s: the shared-memory all-reduce is unavailable (%s); using Open MPI\n",
                   name_.c_str(), why.c_str());
  }
  return shm_.get();
}

WorkPtr MPIProcessGroup::broadcast(Tensor& t, int root, Loc loc) {
  capture::graph_break_if_recording("collective broadcast");
  check_tensor(t, "broadcast", "tensor");
  KILN_CHECK(root >= 0 && root < size_, ValueError, "dist::broadcast: root must be a rank of ", name_, ", in [0, ",
             size_, "), got ", root, " (ranks within a group count from 0)");
  auto sig = make_signature(OpKind::Broadcast, -1, root, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, root] {
    const int n = static_cast<int>(keep.numel());
    if (progress_mode_ == ProgressMode::Spin) {
      check_mpi(MPI_Bcast(keep.data_ptr(), n, mpi_type(keep.dtype()), root, comm_), "MPI_Bcast");
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibcast(keep.data_ptr(), n, mpi_type(keep.dtype()), root, comm_, &req), "MPI_Ibcast");
    wait_with_backoff(req, "MPI_Ibcast");
  });
}

std::string MPIProcessGroup::who(int r) const {
  if (is_world_ || r < 0 || r >= size_) return std::to_string(r);
  return std::to_string(r) + " (world " + std::to_string(world_ranks_[static_cast<size_t>(r)]) + ")";
}

WorkPtr MPIProcessGroup::allgather(std::vector<Tensor>& out, const Tensor& in, Loc loc) {
  capture::graph_break_if_recording("collective all_gather");
  check_tensor(in, "allgather", "input");
  KILN_CHECK(static_cast<int>(out.size()) == size_, ShapeError, "dist::allgather: expected ", size_,
             " output tensors (one per rank of ", name_, "), got ", out.size());
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (size_t r = 0; r < out.size(); ++r) {
    check_tensor(out[r], "allgather", "output");
    KILN_CHECK(out[r].dtype() == in.dtype(), DTypeError, "dist::allgather: output ", r, " is ",
               dtype_name(out[r].dtype()), ", the input ", dtype_name(in.dtype()), "; they must match");
    counts.push_back(out[r].numel());
    total += out[r].numel();
  }
  KILN_CHECK(counts[static_cast<size_t>(rank_)] == in.numel(), ShapeError, "dist::allgather: output ", rank_,
             " (this rank's) must have the input's ", in.numel(), " elements (", in.shape_string(), "), got ",
             out[static_cast<size_t>(rank_)].shape_string());
  KILN_CHECK(total <= INT_MAX, ValueError, "dist::allgather: ", total,
             " elements gathered in all; at most INT_MAX per collective (split the tensor)");
  const bool even = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
  auto sig = make_signature(OpKind::AllGather, -1, -1, &in, loc);
  if (!even) {
    // The shapes differ between ranks by design; what all must agree on is every rank's count.
    sig.ndim = 1;
    sig.count = total;
    std::fill(std::begin(sig.shape), std::end(sig.shape), 0);
    sig.shape[0] = total;
    sig.layout = hash_sizes(counts);
  }
  std::vector<Tensor> outs = out;
  Tensor keep = in;
  return enqueue(sig, [this, outs, keep, counts, even] {
    const MPI_Datatype type = mpi_type(keep.dtype());
    const size_t elem = static_cast<size_t>(keep.element_size());
    std::vector<int> cnt, displs;
    int64_t at = 0;
    for (int64_t c : counts) {
      cnt.push_back(static_cast<int>(c));
      displs.push_back(static_cast<int>(at));
      at += c;
    }
    std::vector<unsigned char> all(static_cast<size_t>(at) * elem);
    if (even) {
      check_mpi(MPI_Allgather(keep.data_ptr(), cnt[0], type, all.data(), cnt[0], type, comm_), "MPI_Allgather");
    } else {
      check_mpi(MPI_Allgatherv(keep.data_ptr(), static_cast<int>(keep.numel()), type, all.data(), cnt.data(),
                               displs.data(), type, comm_),
                "MPI_Allgatherv");
    }
    for (size_t r = 0; r < outs.size(); ++r) {
      std::memcpy(outs[r].data_ptr(), all.data() + static_cast<size_t>(displs[r]) * elem,
                  static_cast<size_t>(cnt[r]) * elem);
    }
  });
}

WorkPtr MPIProcessGroup::allgather_into_tensor(Tensor& out, const Tensor& in, Loc loc) {
  capture::graph_break_if_recording("collective all_gather_into_tensor");
  check_tensor(in, "allgather_into_tensor", "input");
  check_tensor(out, "allgather_into_tensor", "output");
  KILN_CHECK(out.dtype() == in.dtype(), DTypeError, "dist::allgather_into_tensor: the output is ",
             dtype_name(out.dtype()), ", the input ", dtype_name(in.dtype()), "; they must match");
  KILN_CHECK(out.numel() == in.numel() * size_, ShapeError, "dist::allgather_into_tensor: expected an output of ",
             size_, " x ", in.numel(), " = ", in.numel() * size_, " elements (", size_, " ranks in ", name_,
             " x the input ", in.shape_string(), "), got ", out.shape_string(),
             "; for shards of different sizes use allgather into a list");
  const bool at_my_offset =
      static_cast<const unsigned char*>(in.data_ptr()) ==
      static_cast<const unsigned char*>(out.data_ptr()) + static_cast<size_t>(rank_) * in.nbytes();
  KILN_CHECK(at_my_offset || !overlap(in, out), ValueError,
             "dist::allgather_into_tensor: the input overlaps the output other than as this rank's shard (elements ",
             rank_ * in.numel(), " .. ", (rank_ + 1) * in.numel() - 1, "); pass that view or a separate tensor");
  auto sig = make_signature(OpKind::AllGatherInto, -1, -1, &in, loc);
  Tensor keep_out = out, keep_in = in;
  return enqueue(sig, [this, keep_out, keep_in] {
    const int n = static_cast<int>(keep_in.numel());
    const MPI_Datatype type = mpi_type(keep_in.dtype());
    auto* base = static_cast<unsigned char*>(keep_out.data_ptr());
    // FSDP gathers a flat parameter whose own shard is a view of it: gather in place.
    const bool in_place = keep_in.data_ptr() == base + static_cast<size_t>(rank_) * keep_in.nbytes();
    // Not through shared memory: Open MPI's all-gather moves each piece with one
    // single-copy read from the peer (CMA), which measured as fast as or faster
    // than copying through a segment (1 MiB: 35 against 48 µs; 16 MiB: equal).
    check_mpi(MPI_Allgather(in_place ? MPI_IN_PLACE : keep_in.data_ptr(), n, type, base, n, type, comm_),
              "MPI_Allgather");
  });
}

void MPIProcessGroup::reduce_scatter_block(const Tensor& out, const void* send, ReduceOp op) {
  const int n = static_cast<int>(out.numel());
  const size_t count = static_cast<size_t>(n);
  // Float data (bfloat16 comes as float32 shards) summed or averaged: shared memory where it can.
  ShmAllreduce* shm = (op == ReduceOp::Sum || op == ReduceOp::Avg) && out.dtype() != DType::Int64
                          ? shm_for(count * static_cast<size_t>(size_))
                          : nullptr;
  if (shm) {
    const bool bf16 = out.dtype() == DType::BFloat16;
    std::vector<float> recv(bf16 ? count : 0);
    shm->reduce_scatter(static_cast<const float*>(send), bf16 ? recv.data() : static_cast<float*>(out.data_ptr()),
                        count, op == ReduceOp::Avg, progress_mode_ == ProgressMode::Spin);
    if (bf16) from_float(recv, out.data_ptr());
    return;
  }
  if (out.dtype() == DType::BFloat16) {
    std::vector<float> recv(count);
    check_mpi(MPI_Reduce_scatter_block(send, recv.data(), n, MPI_FLOAT, mpi_op(op), comm_), "MPI_Reduce_scatter_block");
    if (op == ReduceOp::Avg) divide(recv.data(), count, size_);
    from_float(recv, out.data_ptr());
    return;
  }
  check_mpi(MPI_Reduce_scatter_block(send, out.data_ptr(), n, mpi_type(out.dtype()), mpi_op(op), comm_),
            "MPI_Reduce_scatter_block");
  if (op == ReduceOp::Avg) divide(static_cast<float*>(out.data_ptr()), count, size_);
}

WorkPtr MPIProcessGroup::reduce_scatter(Tensor& out, const std::vector<Tensor>& in, ReduceOp op, Loc loc) {
  capture::graph_break_if_recording("collective reduce_scatter");
  check_tensor(out, "reduce_scatter", "output");
  KILN_CHECK(static_cast<int>(in.size()) == size_, ShapeError, "dist::reduce_scatter: expected ", size_,
             " input tensors (one per rank of ", name_, "), got ", in.size());
  for (size_t r = 0; r < in.size(); ++r) {
    check_tensor(in[r], "reduce_scatter", "input");
    KILN_CHECK(in[r].dtype() == out.dtype() && in[r].numel() == out.numel(), ShapeError, "dist::reduce_scatter: input ",
               r, " must match the output (", dtype_name(out.dtype()), " ", out.shape_string(), "), got ",
               dtype_name(in[r].dtype()), " ", in[r].shape_string());
  }
  KILN_CHECK(op != ReduceOp::Avg || out.dtype() != DType::Int64, DTypeError,
             "dist::reduce_scatter: ReduceOp::Avg needs a float32 or bfloat16 tensor, got int64");
  auto sig = make_signature(OpKind::ReduceScatter, static_cast<int>(op), -1, &out, loc);
  Tensor keep = out;
  std::vector<Tensor> ins = in;
  return enqueue(sig, [this, keep, ins, op] {
    const size_t count = static_cast<size_t>(keep.numel());
    if (keep.dtype() == DType::BFloat16) {
      std::vector<float> send(count * ins.size());
      for (size_t r = 0; r < ins.size(); ++r) {
        const auto f = to_float(ins[r]);
        std::copy(f.begin(), f.end(), send.begin() + static_cast<std::ptrdiff_t>(r * count));
      }
      reduce_scatter_block(keep, send.data(), op);
      return;
    }
    const size_t bytes = static_cast<size_t>(keep.nbytes());
    std::vector<unsigned char> send(bytes * ins.size());
    for (size_t r = 0; r < ins.size(); ++r) std::memcpy(send.data() + r * bytes, ins[r].data_ptr(), bytes);
    reduce_scatter_block(keep, send.data(), op);
  });
}

WorkPtr MPIProcessGroup::reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op, Loc loc) {
  capture::graph_break_if_recording("collective reduce_scatter_tensor");
  check_tensor(out, "reduce_scatter_tensor", "output");
  check_tensor(in, "reduce_scatter_tensor", "input");
  KILN_CHECK(out.dtype() == in.dtype(), DTypeError, "dist::reduce_scatter_tensor: the output is ",
             dtype_name(out.dtype()), ", the input ", dtype_name(in.dtype()), "; they must match");
  KILN_CHECK(in.numel() == out.numel() * size_, ShapeError, "dist::reduce_scatter_tensor: expected an input of ", size_,
             " x ", out.numel(), " = ", out.numel() * size_, " elements (", size_, " ranks in ", name_,
             " x the output ", out.shape_string(), "), got ", in.shape_string(),
             "; pad the input to a multiple of the group size");
  KILN_CHECK(op != ReduceOp::Avg || out.dtype() != DType::Int64, DTypeError,
             "dist::reduce_scatter_tensor: ReduceOp::Avg needs a float32 or bfloat16 tensor, got int64");
  KILN_CHECK(!overlap(in, out), ValueError,
             "dist::reduce_scatter_tensor: the output overlaps the input; reduce into a separate tensor");
  auto sig = make_signature(OpKind::ReduceScatterTensor, static_cast<int>(op), -1, &out, loc);
  Tensor keep = out, keep_in = in;
  return enqueue(sig, [this, keep, keep_in, op] {
    if (keep.dtype() == DType::BFloat16) {
      const auto f = to_float(keep_in);
      reduce_scatter_block(keep, f.data(), op);
    } else {
      reduce_scatter_block(keep, keep_in.data_ptr(), op);
    }
  });
}

WorkPtr MPIProcessGroup::alltoall(Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                                  const std::vector<int64_t>& in_splits, Loc loc) {
  capture::graph_break_if_recording("collective all_to_all_single");
  check_tensor(in, "alltoall", "input");
  check_tensor(out, "alltoall", "output");
  KILN_CHECK(out.dtype() == in.dtype(), DTypeError, "dist::alltoall: the output is ", dtype_name(out.dtype()),
             ", the input ", dtype_name(in.dtype()), "; they must match");
  KILN_CHECK(in.dim() >= 1 && out.dim() >= 1, ShapeError,
             "dist::alltoall: expected tensors of at least one dimension (split along dim 0), got ", in.shape_string(),
             " and ", out.shape_string());
  // Elements per row, from the trailing dimensions: a rank may send no rows at all.
  int64_t row = 1;
  for (int64_t d = 1; d < in.dim(); ++d) row *= in.size(d);
  KILN_CHECK(in.sizes().size() == out.sizes().size() &&
                 std::equal(in.sizes().begin() + 1, in.sizes().end(), out.sizes().begin() + 1),
             ShapeError, "dist::alltoall: the input ", in.shape_string(), " and the output ", out.shape_string(),
             " must have the same dimensions after dim 0 (a row is what is exchanged)");
  KILN_CHECK(out_splits.empty() == in_splits.empty(), ValueError,
             "dist::alltoall: give both split lists or neither (got ", out_splits.size(), " output and ",
             in_splits.size(), " input split sizes)");
  const bool split = !in_splits.empty();
  std::vector<int64_t> ins = in_splits, outs = out_splits;
  if (!split) {
    KILN_CHECK(in.size(0) % size_ == 0 && out.size(0) == in.size(0), ShapeError, "dist::alltoall: without split ",
               "sizes dim 0 of the input and the output must be equal and divisible by the ", size_, " ranks of ",
               name_, ", got ", in.shape_string(), " and ", out.shape_string(),
               "; pass out_splits and in_splits for uneven blocks");
    ins.assign(static_cast<size_t>(size_), in.size(0) / size_);
    outs = ins;
  } else {
    for (const auto* v : {&outs, &ins}) {
      const char* which = v == &ins ? "in_splits" : "out_splits";
      const Tensor& t = v == &ins ? in : out;
      KILN_CHECK(static_cast<int>(v->size()) == size_, ShapeError, "dist::alltoall: ", which, " must have ", size_,
                 " entries (one per rank of ", name_, "), got ", v->size());
      int64_t sum = 0;
      for (int64_t x : *v) {
        KILN_CHECK(x >= 0, ValueError, "dist::alltoall: ", which, " must be >= 0, got ", x);
        sum += x;
      }
      KILN_CHECK(sum == t.size(0), ShapeError, "dist::alltoall: ", which, " add up to ", sum,
                 " rows, but dim 0 of the ", v == &ins ? "input" : "output", " is ", t.size(0), " (", t.shape_string(),
                 ")");
    }
  }
  KILN_CHECK(in.numel() <= INT_MAX && out.numel() <= INT_MAX, ValueError,
             "dist::alltoall: at most INT_MAX elements per collective (split the tensor)");
  KILN_CHECK(!overlap(in, out), ValueError, "dist::alltoall: the output overlaps the input; use separate tensors");
  auto sig = make_signature(split ? OpKind::AllToAllSplit : OpKind::AllToAll, -1, -1, &in, loc);
  if (split) {
    sig.shape[0] = -1;  // the rows each rank sends differ by design; the row shape must agree
    sig.count = row;
  }
  Tensor keep_out = out, keep_in = in;
  const bool check_pairs = debug_ && split;
  return enqueue(sig, [this, keep_out, keep_in, ins, outs, row, check_pairs] {
    if (check_pairs) {
      // What each peer will send here, against what this rank expects from it.
      std::vector<int64_t> coming(ins.size());
      check_mpi(MPI_Alltoall(ins.data(), 1, MPI_INT64_T, coming.data(), 1, MPI_INT64_T, comm_),
                "MPI_Alltoall (split size check)");
      std::ostringstream bad;
      for (size_t j = 0; j < coming.size(); ++j) {
        if (coming[j] != outs[j]) {
          bad << "\n  from rank " << who(static_cast<int>(j)) << ": it sends " << coming[j]
              << " rows, out_splits expects " << outs[j];
        }
      }
      // Every rank must raise, also those whose own expectations hold, or they would wait in the exchange.
      int any_bad = bad.str().empty() ? 0 : 1;
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, &any_bad, 1, MPI_INT, MPI_MAX, comm_), "MPI_Allreduce (split size check)");
      if (any_bad) {
        throw DistributedError("dist: alltoall split sizes disagree in " + name_ + " (KILN_DIST_DEBUG=1); on rank " +
                               who(rank_) + ":" + (bad.str().empty() ? std::string(" its own agree") : bad.str()) +
                               "\nrank j's in_splits[i] must equal rank i's out_splits[j]");
      }
    }
    std::vector<int> scount, sdispl, rcount, rdispl;
    int64_t sat = 0, rat = 0;
    for (size_t j = 0; j < ins.size(); ++j) {
      scount.push_back(static_cast<int>(ins[j] * row));
      sdispl.push_back(static_cast<int>(sat));
      sat += ins[j] * row;
      rcount.push_back(static_cast<int>(outs[j] * row));
      rdispl.push_back(static_cast<int>(rat));
      rat += outs[j] * row;
    }
    const MPI_Datatype type = mpi_type(keep_in.dtype());
    check_mpi(MPI_Alltoallv(keep_in.data_ptr(), scount.data(), sdispl.data(), type, keep_out.data_ptr(), rcount.data(),
                            rdispl.data(), type, comm_),
              "MPI_Alltoallv");
  });
}

WorkPtr MPIProcessGroup::barrier(Loc loc) {
  capture::graph_break_if_recording("collective barrier");
  auto sig = make_signature(OpKind::Barrier, -1, -1, nullptr, loc);
  return enqueue(sig, [this] { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); });
}

WorkPtr MPIProcessGroup::send(const Tensor& t, int dst, int tag, Loc loc) {
  capture::graph_break_if_recording("collective send");
  check_tensor(t, "send", "tensor");
  KILN_CHECK(dst >= 0 && dst < size_ && dst != rank_, ValueError, "dist::send: dst must be another rank of ", name_,
             ", in [0, ", size_, "), got ", dst, " on rank ", rank_);
  KILN_CHECK(tag >= 0, ValueError, "dist::send: tag must be >= 0, got ", tag);
  auto sig = make_signature(OpKind::Send, -1, dst, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, dst, tag] {
    check_mpi(MPI_Send(keep.data_ptr(), static_cast<int>(keep.numel()), mpi_type(keep.dtype()), dst, tag, comm_),
              "MPI_Send");
  });
}

WorkPtr MPIProcessGroup::recv(Tensor& t, int src, int tag, Loc loc) {
  capture::graph_break_if_recording("collective recv");
  check_tensor(t, "recv", "tensor");
  KILN_CHECK(src >= 0 && src < size_ && src != rank_, ValueError, "dist::recv: src must be another rank of ", name_,
             ", in [0, ", size_, "), got ", src, " on rank ", rank_);
  KILN_CHECK(tag >= 0, ValueError, "dist::recv: tag must be >= 0, got ", tag);
  auto sig = make_signature(OpKind::Recv, -1, src, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, src, tag] {
    MPI_Status st;
    check_mpi(MPI_Recv(keep.data_ptr(), static_cast<int>(keep.numel()), mpi_type(keep.dtype()), src, tag, comm_, &st),
              "MPI_Recv");
    int got = 0;
    MPI_Get_count(&st, mpi_type(keep.dtype()), &got);
    KILN_CHECK(got == keep.numel(), ShapeError, "dist::recv: expected ", keep.numel(), " elements from rank ", src,
               ", got ", got);
  });
}

}  // namespace kiln::dist::detail

namespace kiln::dist {
Traffic traffic() { return {detail::g_traffic_ops.load(), detail::g_traffic_bytes.load()}; }
}  // namespace kiln::dist
