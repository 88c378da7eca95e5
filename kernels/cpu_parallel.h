// Sharing a range of work units between the CPU threads from both of its ends.
#pragma once
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <memory>

namespace cpu_parallel {

// The next unit of [lo, hi) packed in one word, from the front or the back; -1 once none is left.
inline int64_t take(std::atomic<uint64_t>& range, bool front) {
  uint64_t cur = range.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t lo = static_cast<int64_t>(cur & 0xffffffffu), hi = static_cast<int64_t>(cur >> 32);
    if (lo >= hi) return -1;
    const uint64_t next = front ? cur + 1 : cur - (uint64_t{1} << 32);
    if (range.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
  }
}

// Runs body(unit, front) for every unit of [0, units), in parallel. The threads pair up on equal
// segments of the range: in a pair one thread takes units from the segment's front, in order,
// the other from its back, until they meet. So each thread still reads its units in one
// direction through memory, and a thread that runs slower (on a 2-core VM one core ran the same
// GEMM share 1.3x slower than the other, and which one changed from run to run) does fewer of
// them instead of holding the faster one at the end of the parallel region. With an odd number of
// threads the last one has a segment to itself.
template <typename Body>
void for_units_from_both_ends(int64_t units, const Body& body) {
  TORCH_CHECK(units < (int64_t{1} << 31), "too many work units");
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  const int64_t segments = (threads + 1) / 2;
  auto ranges = std::make_unique<std::atomic<uint64_t>[]>(segments);
  for (int64_t s = 0; s < segments; ++s) {
    const uint64_t lo = s * units / segments, hi = (s + 1) * units / segments;
    ranges[s].store(lo | (hi << 32), std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {  // one thread index each, unless run serially
      const bool front = t % 2 == 0;
      for (int64_t u = take(ranges[t / 2], front); u >= 0; u = take(ranges[t / 2], front)) body(u, front);
    }
  });
}

}  // namespace cpu_parallel
