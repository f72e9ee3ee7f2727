// The shared-memory all-reduce of the MPI backend (shm_allreduce.h).
//
// One chunk of at most kChunk floats per rank goes through three steps, each
// ended by a generation counter of the rank in the segment:
//   arrived: the rank copied its chunk into its slot;
//   reduced: it summed its 1/P slice over every slot (ranks in order), wrote
//            the result into its own data and back into its slot;
//   read:    it copied every other rank's reduced slice out of their slots.
// Two sets of slots alternate, so a rank may fill chunk g's slot while a slow
// peer still reads chunk g - 1's; before refilling a set it waits until every
// rank has read it (read >= g - 2).
#include "shm_allreduce.h"
#include "mpi_process_group.h"
#include "wire16.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/core/half.h"

namespace kiln::dist::detail {

// A generation counter with what a blocked waiter needs: `word`, the low half
// of the generation for futex(2) (which waits on 32 bits), and how many ranks
// sleep on it, so a publisher makes the wake-up system call only when one does.
struct alignas(64) ShmAllreduce::Flag {
  std::atomic<uint64_t> v;
  std::atomic<uint32_t> word;
  std::atomic<uint32_t> waiters;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need lock-free atomics");

namespace {

using Flag = ShmAllreduce::Flag;

std::atomic<int64_t> g_calls{0}, g_chunks{0}, g_sleeps{0};

constexpr size_t kPage = 4096;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

// Publishes generation g of a rank's flag and wakes any peer asleep on it.
// Sequentially consistent, against the waiter's order below (count itself,
// then read the word): either the waiter sees g, or the publisher sees it
// counted and wakes it; a wake that comes first makes the wait return at once.
void publish(Flag& f, uint64_t g) {
  f.v.store(g);
  f.word.store(static_cast<uint32_t>(g));
  if (f.waiters.load() > 0) futex(&f.word, FUTEX_WAKE, INT32_MAX, nullptr);
}

// Waits for every flag of `f[0..size)` to reach `g`. A short spin keeps the
// latency of a peer that is about to arrive; then the rank sleeps in the kernel
// until its peer publishes (futex on the shared segment), so a rank that
// arrives early gives its core to the training threads and takes it back only
// when there is work: no periodic wake-ups, which on a machine with no spare
// core each preempt a training thread. Spin mode (ProgressMode::Spin) only polls.
void wait_all(Flag* f, int size, uint64_t g, bool spin) {
  auto all = [&] {
    for (int q = 0; q < size; ++q) {
      if (f[q].v.load(std::memory_order_acquire) < g) return false;
    }
    return true;
  };
  if (all()) return;
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
  for (;;) {
    for (int k = 0; k < 32; ++k) {
      if (all()) return;
      _mm_pause();
    }
    if (spin || std::chrono::steady_clock::now() < spin_until) continue;
    for (int q = 0; q < size; ++q) {
      Flag& fq = f[q];
      fq.waiters.fetch_add(1);
      const uint32_t w = fq.word.load();
      if (fq.v.load() < g) {
        // Bounded, so that a wake-up lost to anything unforeseen costs 10 ms, not a hang.
        const timespec bound{0, 10'000'000};
        futex(&fq.word, FUTEX_WAIT, w, &bound);
        g_sleeps.fetch_add(1, std::memory_order_relaxed);
      }
      fq.waiters.fetch_sub(1);
    }
  }
}

void count_call(size_t n, size_t per_chunk) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_chunks.fetch_add(static_cast<int64_t>((n + per_chunk - 1) / per_chunk), std::memory_order_relaxed);
}

}  // namespace

ShmAllreduce::ShmAllreduce(int rank, int size, void* base, size_t bytes)
    : rank_(rank),
      size_(size),
      base_(base),
      bytes_(bytes),
      arrived_(static_cast<Flag*>(base)),
      reduced_(arrived_ + size),
      read_(reduced_ + size),
      slots_(reinterpret_cast<float*>(static_cast<char*>(base) + round_up(3 * size * sizeof(Flag), kPage))) {}

ShmAllreduce::~ShmAllreduce() { munmap(base_, bytes_); }

uint64_t ShmAllreduce::next_chunk(bool spin) {
  const uint64_t g = ++gen_;
  if (g > 2) wait_all(read_, size_, g - 2, spin);
  return g;
}

float* ShmAllreduce::slot(int set, int rank) const {
  return slots_ + (static_cast<size_t>(set) * size_ + rank) * kChunk;
}

std::unique_ptr<ShmAllreduce> ShmAllreduce::create(MPI_Comm comm, std::string* why_not) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  int one_node = node_size == size ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &one_node, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce (shared-memory check)");
  if (!one_node) {
    *why_not = kNotOneNode;
    return nullptr;
  }

  const size_t bytes =
      round_up(3 * size * sizeof(Flag), kPage) + 2 * static_cast<size_t>(size) * kChunk * sizeof(float);
  // Rank 0 makes the object under a name no other job uses and passes it on.
  char name[64] = {};
  int fd = -1, ok = 1;
  std::string err;
  if (rank == 0) {
    static std::atomic<int> serial{0};
    std::snprintf(name, sizeof(name), "/kiln-allreduce-%d-%d", static_cast<int>(getpid()), serial.fetch_add(1));
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      ok = 0, err = std::string("shm_open: ") + std::strerror(errno);
    } else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      ok = 0, err = std::string("ftruncate: ") + std::strerror(errno);
    } else if (int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0) {
      ok = 0, err = std::string("posix_fallocate of ") + std::to_string(bytes) + " bytes: " + std::strerror(rc);
    }
  }
  check_mpi(MPI_Bcast(name, sizeof(name), MPI_CHAR, 0, comm), "MPI_Bcast (shared-memory name)");
  check_mpi(MPI_Bcast(&ok, 1, MPI_INT, 0, comm), "MPI_Bcast (shared-memory segment)");
  if (ok && rank != 0) {
    fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) ok = 0, err = std::string("shm_open: ") + std::strerror(errno);
  }
  void* base = MAP_FAILED;
  if (ok) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) ok = 0, err = std::string("mmap: ") + std::strerror(errno);
  }
  if (fd >= 0) close(fd);
  int all_ok = ok;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &all_ok, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce (shared-memory segment)");
  // Every rank has opened the object (or given up): the name can go.
  if (rank == 0 && name[0] != '\0') shm_unlink(name);
  if (!all_ok) {
    if (base != MAP_FAILED) munmap(base, bytes);
    *why_not = err.empty() ? "another rank could not map the segment" : err;
    return nullptr;
  }
  return std::unique_ptr<ShmAllreduce>(new ShmAllreduce(rank, size, base, bytes));
}

// The all-reduce with values of type T in `data` (float, or 16-bit bits) and
// W on the wire. Whatever W, a slice is summed in float in rank order, divided
// and rounded to W once, so a 16-bit all-reduce has the bits of widening,
// the float32 all-reduce and one rounding.
template <typename W, typename T>
void ShmAllreduce::run_as(T* data, size_t n, bool average, bool spin) {
  using Bits = typename Wire<W>::Bits;
  const int P = size_, r = rank_;
  const float by = static_cast<float>(P);
  const size_t chunk = kChunk * sizeof(float) / sizeof(Bits);  // elements per slot
  constexpr size_t kBlock = 1024;                              // the sum of a slice, block by block, stays in L1
  float acc[kBlock], wide[kBlock];
  count_call(n, chunk);
  auto slot_of = [&](int set, int q) { return reinterpret_cast<Bits*>(slot(set, q)); };
  for (size_t off = 0; off < n; off += chunk) {
    const size_t m = std::min(chunk, n - off);
    const uint64_t g = next_chunk(spin);
    const int set = static_cast<int>(g & 1);
    T* out = data + off;
    convert<W>(slot_of(set, r), out, m);
    publish(arrived_[r], g);
    wait_all(arrived_, P, g, spin);

    auto lo = [&](int q) { return m * static_cast<size_t>(q) / static_cast<size_t>(P); };
    Bits* mine = slot_of(set, r);
    for (size_t b = lo(r); b < lo(r + 1); b += kBlock) {
      const size_t k = std::min(kBlock, lo(r + 1) - b);
      convert<W>(acc, slot_of(set, 0) + b, k);
      for (int q = 1; q < P; ++q) {
        if constexpr (std::is_same_v<W, float>) {
          const float* sq = slot_of(set, q) + b;
          for (size_t i = 0; i < k; ++i) acc[i] += sq[i];
        } else {
          convert<W>(wide, slot_of(set, q) + b, k);
          for (size_t i = 0; i < k; ++i) acc[i] += wide[i];
        }
      }
      if (average) {
        for (size_t i = 0; i < k; ++i) acc[i] /= by;
      }
      // Rounded once into this rank's slot, where the others read it, and
      // taken from there into its own data.
      convert<W>(mine + b, acc, k);
      convert<W>(out + b, mine + b, k);
    }
    publish(reduced_[r], g);

    for (int step = 1; step < P; ++step) {
      const int q = (r + step) % P;  // start with the next rank's slice: ranks do not all read one slot at once
      wait_all(reduced_ + q, 1, g, spin);
      convert<W>(out + lo(q), slot_of(set, q) + lo(q), lo(q + 1) - lo(q));
    }
    publish(read_[r], g);
  }
}

void ShmAllreduce::run(float* data, size_t n, bool average, bool spin) { run_as<float>(data, n, average, spin); }

void ShmAllreduce::run16(uint16_t* data, size_t n, DType dtype, bool average, bool spin) {
  KILN_ASSERT(dtype == DType::BFloat16 || dtype == DType::Float16, "ShmAllreduce::run16: a 16-bit float dtype");
  if (dtype == DType::BFloat16) return run_as<BFloat16>(data, n, average, spin);
  run_as<Half>(data, n, average, spin);
}

void ShmAllreduce::run_compressed(float* data, size_t n, DType wire, bool average, bool spin) {
  KILN_ASSERT(wire == DType::BFloat16 || wire == DType::Float16, "ShmAllreduce::run_compressed: a 16-bit wire");
  if (wire == DType::BFloat16) return run_as<BFloat16>(data, n, average, spin);
  run_as<Half>(data, n, average, spin);
}

void ShmAllreduce::reduce_scatter(const float* send, float* out, size_t count, bool average, bool spin) {
  const int P = size_, r = rank_;
  const float by = static_cast<float>(P);
  const size_t per = kChunk / static_cast<size_t>(P);  // floats of each shard per chunk
  count_call(count, per);
  for (size_t off = 0; off < count; off += per) {
    const size_t m = std::min(per, count - off);
    const uint64_t g = next_chunk(spin);
    const int set = static_cast<int>(g & 1);
    // Slot layout: shard q's piece at q * per, so rank q finds its pieces at one offset in every slot.
    for (int q = 0; q < P; ++q) std::memcpy(slot(set, r) + q * per, send + q * count + off, m * sizeof(float));
    publish(arrived_[r], g);
    wait_all(arrived_, P, g, spin);
    float* dst = out + off;
    const size_t at = static_cast<size_t>(r) * per;
    std::memcpy(dst, slot(set, 0) + at, m * sizeof(float));
    for (int q = 1; q < P; ++q) {
      const float* sq = slot(set, q) + at;
      for (size_t i = 0; i < m; ++i) dst[i] += sq[i];
    }
    if (average) {
      for (size_t i = 0; i < m; ++i) dst[i] /= by;
    }
    publish(read_[r], g);
  }
}

ShmCounters shm_counters() { return {.calls = g_calls.load(), .chunks = g_chunks.load(), .sleeps = g_sleeps.load()}; }

}  // namespace kiln::dist::detail
