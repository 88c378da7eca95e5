// Sharing work between the CPU threads: a range of units taken from both of its ends, and a team
// of threads that runs the phases of one computation inside a single parallel region.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace cpu_parallel {

// The units [0, units) shared by `threads` threads. The threads pair up on equal segments of the
// range: in a pair one thread takes units from the segment's front, in order, the other from its
// back, until they meet. So each thread still reads its units in one direction through memory,
// and a thread that runs slower (on a 2-core VM one core ran the same GEMM share 1.3x slower than
// the other, and which one changed from run to run) does fewer of them instead of holding the
// faster one at the end. With an odd number of threads the last one has a segment to itself.
class SharedUnits {
 public:
  SharedUnits(int64_t units, int64_t threads) : ranges_((std::max<int64_t>(threads, 1) + 1) / 2) {
    TORCH_CHECK(units < (int64_t{1} << 31), "too many work units");
    const int64_t segments = static_cast<int64_t>(ranges_.size());
    for (int64_t s = 0; s < segments; ++s) {
      const uint64_t lo = s * units / segments, hi = (s + 1) * units / segments;
      ranges_[s].store(lo | (hi << 32), std::memory_order_relaxed);
    }
  }

  // Runs body(unit, front) for each unit that thread `thread` takes, until its segment is empty.
  template <typename Body>
  void take_all(int64_t thread, const Body& body) {
    auto& range = ranges_[thread / 2];
    const bool front = thread % 2 == 0;
    for (int64_t u = take(range, front); u >= 0; u = take(range, front)) body(u, front);
  }

 private:
  // The next unit of [lo, hi) packed in one word, from the front or the back; -1 once none is left.
  static int64_t take(std::atomic<uint64_t>& range, bool front) {
    uint64_t cur = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(cur & 0xffffffffu), hi = static_cast<int64_t>(cur >> 32);
      if (lo >= hi) return -1;
      const uint64_t next = front ? cur + 1 : cur - (uint64_t{1} << 32);
      if (range.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }

  std::vector<std::atomic<uint64_t>> ranges_;
};

// Runs body(unit, front) for every unit of [0, units), in parallel (see SharedUnits).
template <typename Body>
void for_units_from_both_ends(int64_t units, const Body& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  SharedUnits shared(units, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) shared.take_all(t, body);  // one thread index each, unless run serially
  });
}

// One thread of a team (run_team): its index and the team's size. Phases that read what other
// threads wrote are separated by barrier().
struct Team {
  int64_t thread, threads;

  void barrier() const {
#pragma omp barrier
  }

  // This thread's even share [begin, end) of n items.
  std::pair<int64_t, int64_t> share(int64_t n) const { return {thread * n / threads, (thread + 1) * n / threads}; }
};

// Runs body(team) on every thread of one parallel region of at::get_num_threads() threads. A
// parallel region costs its start and end, and whatever the calling thread does between two of
// them the others wait for; one region with barriers between phases keeps both short. body must
// not throw (check everything before), and must reach each barrier on every thread.
template <typename Body>
void run_team(const Body& body) {
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  body(Team{omp_get_thread_num(), omp_get_num_threads()});
}

}  // namespace cpu_parallel
