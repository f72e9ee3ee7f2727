// The MPI backend: argument checks on the caller's thread, the collectives
// themselves on the communication thread, and debug-mode signature checks.
// The watchdog is in watchdog.cpp.
#include "mpi_process_group.h"
#include "rank_status.h"

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/half.h"

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
  }
  return "?";
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

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw DistributedError(std::string("dist: ") + what + " failed: " + std::string(msg, len));
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
    for (int d = 0; d < std::min<int>(ndim, kShapeDims); ++d) os << (d ? ", " : "") << shape[d];
    if (ndim > kShapeDims) os << ", ... (" << count << " elements)";
    os << "]";
  }
  const auto k = static_cast<OpKind>(kind);
  if (k == OpKind::Broadcast) os << " root=" << peer;
  if (k == OpKind::Send) os << " to=" << peer;
  if (k == OpKind::Recv) os << " from=" << peer;
  os << " at " << site;
  return os.str();
}

void MPIWork::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_; });
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

MPIProcessGroup::MPIProcessGroup(MPI_Comm comm) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  check_mpi(MPI_Comm_dup(comm, &watch_), "MPI_Comm_dup");
  // Errors come back as codes, thrown by check_mpi and rethrown by Work::wait.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
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
  int flags[2] = {debug_ ? 1 : 0, debug_ ? -1 : 0};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, flags, 2, MPI_INT, MPI_MAX, comm_), "MPI_Allreduce (KILN_DIST_DEBUG check)");
  KILN_CHECK(flags[0] == -flags[1], DistributedError,
             "KILN_DIST_DEBUG must be set alike on every rank, but some ranks have it on and some off (rank ", rank_,
             " has it ", debug_ ? "on" : "off", "); launch with `kiln launch` or mpirun -x KILN_DIST_DEBUG");
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
  std::snprintf(s.site, sizeof s.site, "%s", short_site(loc).c_str());
  return s;
}

WorkPtr MPIProcessGroup::enqueue(Signature sig, std::function<void()> run) {
  KILN_CHECK(!shut_down_, DistributedError, "dist: ", kind_name(sig.kind), " at ", sig.site,
             " after the process group was shut down (MPI finalised)");
  Task task;
  {
    std::lock_guard lock(issue_mu_);
    sig.seq = ++next_seq_;
    const auto k = static_cast<OpKind>(sig.kind);
    if (k != OpKind::Send && k != OpKind::Recv) sig.coll_no = ++next_coll_;
    task.sig = sig;
    task.run = std::move(run);
    task.work = std::make_shared<MPIWork>(sig.seq);
    std::lock_guard qlock(q_mu_);
    queue_.push_back(task);
  }
  q_cv_.notify_one();
  return task.work;
}

void MPIProcessGroup::comm_loop() {
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
                 " not run: an earlier collective of this group failed, so the ranks no longer agree on "
                 "what runs next. The first failure was:\n",
                 poisoned);
      if (debug_ && collective) check_signatures(task.sig);
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
  os << "dist: collective mismatch at collective number " << mine.coll_no
     << " of the group (KILN_DIST_DEBUG=1): the ranks called different collectives\n"
     << "  rank | what it called\n";
  for (int r = 0; r < size_; ++r) {
    const auto& s = all[static_cast<size_t>(r)];
    os << "  "
       << (r < 10    ? "   "
           : r < 100 ? "  "
                     : " ")
       << r << " | " << s.describe() << (s.same_call(all[0]) ? "" : "   <-- differs from rank 0") << "\n";
  }
  os << "every rank must issue the same collectives (op, dtype, shape, root) in the same order";
  throw DistributedError(os.str());
}

WorkPtr MPIProcessGroup::allreduce(Tensor& t, ReduceOp op, Loc loc) {
  check_tensor(t, "allreduce", "tensor");
  KILN_CHECK(op != ReduceOp::Avg || t.dtype() != DType::Int64, DTypeError,
             "dist::allreduce: ReduceOp::Avg needs a float32 or bfloat16 tensor, got int64 (use Sum and divide)");
  auto sig = make_signature(OpKind::AllReduce, static_cast<int>(op), -1, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, op] {
    const int n = static_cast<int>(keep.numel());
    const int size = size_;
    if (keep.dtype() == DType::BFloat16) {
      auto f = to_float(keep);
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, f.data(), n, MPI_FLOAT, mpi_op(op), comm_), "MPI_Allreduce");
      if (op == ReduceOp::Avg) divide(f.data(), f.size(), size);
      from_float(f, keep.data_ptr());
      return;
    }
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, keep.data_ptr(), n, mpi_type(keep.dtype()), mpi_op(op), comm_),
              "MPI_Allreduce");
    if (op == ReduceOp::Avg) divide(static_cast<float*>(keep.data_ptr()), static_cast<size_t>(n), size);
  });
}

WorkPtr MPIProcessGroup::broadcast(Tensor& t, int root, Loc loc) {
  check_tensor(t, "broadcast", "tensor");
  KILN_CHECK(root >= 0 && root < size_, ValueError, "dist::broadcast: root must be a rank in [0, ", size_, "), got ",
             root);
  auto sig = make_signature(OpKind::Broadcast, -1, root, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, root] {
    check_mpi(MPI_Bcast(keep.data_ptr(), static_cast<int>(keep.numel()), mpi_type(keep.dtype()), root, comm_),
              "MPI_Bcast");
  });
}

WorkPtr MPIProcessGroup::allgather(std::vector<Tensor>& out, const Tensor& in, Loc loc) {
  check_tensor(in, "allgather", "input");
  KILN_CHECK(static_cast<int>(out.size()) == size_, ShapeError, "dist::allgather: expected ", size_,
             " output tensors (one per rank), got ", out.size());
  for (size_t r = 0; r < out.size(); ++r) {
    check_tensor(out[r], "allgather", "output");
    KILN_CHECK(out[r].dtype() == in.dtype() && out[r].numel() == in.numel(), ShapeError, "dist::allgather: output ", r,
               " must match the input (", dtype_name(in.dtype()), " ", in.shape_string(), "), got ",
               dtype_name(out[r].dtype()), " ", out[r].shape_string());
  }
  auto sig = make_signature(OpKind::AllGather, -1, -1, &in, loc);
  std::vector<Tensor> outs = out;
  Tensor keep = in;
  return enqueue(sig, [this, outs, keep] {
    const int n = static_cast<int>(keep.numel());
    const size_t bytes = static_cast<size_t>(keep.nbytes());
    std::vector<unsigned char> all(bytes * outs.size());
    check_mpi(MPI_Allgather(keep.data_ptr(), n, mpi_type(keep.dtype()), all.data(), n, mpi_type(keep.dtype()), comm_),
              "MPI_Allgather");
    for (size_t r = 0; r < outs.size(); ++r) std::memcpy(outs[r].data_ptr(), all.data() + r * bytes, bytes);
  });
}

WorkPtr MPIProcessGroup::reduce_scatter(Tensor& out, const std::vector<Tensor>& in, ReduceOp op, Loc loc) {
  check_tensor(out, "reduce_scatter", "output");
  KILN_CHECK(static_cast<int>(in.size()) == size_, ShapeError, "dist::reduce_scatter: expected ", size_,
             " input tensors (one per rank), got ", in.size());
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
    const int n = static_cast<int>(keep.numel());
    const size_t count = static_cast<size_t>(n);
    if (keep.dtype() == DType::BFloat16) {
      std::vector<float> send(count * ins.size()), recv(count);
      for (size_t r = 0; r < ins.size(); ++r) {
        const auto f = to_float(ins[r]);
        std::copy(f.begin(), f.end(), send.begin() + static_cast<std::ptrdiff_t>(r * count));
      }
      check_mpi(MPI_Reduce_scatter_block(send.data(), recv.data(), n, MPI_FLOAT, mpi_op(op), comm_),
                "MPI_Reduce_scatter_block");
      if (op == ReduceOp::Avg) divide(recv.data(), count, size_);
      from_float(recv, keep.data_ptr());
      return;
    }
    const size_t bytes = static_cast<size_t>(keep.nbytes());
    std::vector<unsigned char> send(bytes * ins.size());
    for (size_t r = 0; r < ins.size(); ++r) std::memcpy(send.data() + r * bytes, ins[r].data_ptr(), bytes);
    check_mpi(MPI_Reduce_scatter_block(send.data(), keep.data_ptr(), n, mpi_type(keep.dtype()), mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
    if (op == ReduceOp::Avg) divide(static_cast<float*>(keep.data_ptr()), count, size_);
  });
}

WorkPtr MPIProcessGroup::barrier(Loc loc) {
  auto sig = make_signature(OpKind::Barrier, -1, -1, nullptr, loc);
  return enqueue(sig, [this] { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); });
}

WorkPtr MPIProcessGroup::send(const Tensor& t, int dst, int tag, Loc loc) {
  check_tensor(t, "send", "tensor");
  KILN_CHECK(dst >= 0 && dst < size_ && dst != rank_, ValueError, "dist::send: dst must be another rank in [0, ", size_,
             "), got ", dst, " on rank ", rank_);
  KILN_CHECK(tag >= 0, ValueError, "dist::send: tag must be >= 0, got ", tag);
  auto sig = make_signature(OpKind::Send, -1, dst, &t, loc);
  Tensor keep = t;
  return enqueue(sig, [this, keep, dst, tag] {
    check_mpi(MPI_Send(keep.data_ptr(), static_cast<int>(keep.numel()), mpi_type(keep.dtype()), dst, tag, comm_),
              "MPI_Send");
  });
}

WorkPtr MPIProcessGroup::recv(Tensor& t, int src, int tag, Loc loc) {
  check_tensor(t, "recv", "tensor");
  KILN_CHECK(src >= 0 && src < size_ && src != rank_, ValueError, "dist::recv: src must be another rank in [0, ", size_,
             "), got ", src, " on rank ", rank_);
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
