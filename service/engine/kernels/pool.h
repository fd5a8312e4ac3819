// The kernels' thread pool. Every family of primitives that splits its work shares this one
// helper thread (pool()), so a process never has two spinning against each other.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sched.h>
#include <thread>

namespace lmspd {

// Both cores on every product: the MLX stream thread and one helper thread take runs of chunks
// of the output columns, from the two ends, until none are left. The caller never waits for a
// chunk nobody has started: on a busy machine, where the helper may not be scheduled for a
// while, the caller does the work alone instead of waiting a scheduler slice for it (a fixed
// half per thread cost a 192-column product 10x). The helper is kept for the process's life
// and spins briefly after each job before it sleeps: a decode step runs ~200 products tens of
// microseconds apart, and waking a sleeping thread costs about as much as one.
class Pool {
 public:
  Pool() : thread_([this] { loop(); }) { thread_.detach(); }

  // fn(c0, c1) for chunks [c0, c1) of [0, n), grain wide (the last one narrower).
  void parallel_for(int n, int grain, const std::function<void(int, int)>& fn) {
    const int chunks = (n + grain - 1) / grain;
    if (chunks <= 1 || chunks >= (1 << 16)) return fn(0, n);
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    const uint32_t t = ++ticket_ == 0 ? ++ticket_ : ticket_;  // 0 means "no job"
    state_.store((uint64_t(t) << 32) | uint64_t(chunks));
    posted_.store(t);
    posted_.notify_one();  // a futex wake only when the helper sleeps
    work(t, false);
    // Every chunk is taken; the helper may still be in its last one.
    for (int i = 0; i < SPINS && working_.load() == t; ++i) pause();
    for (uint32_t w; (w = working_.load()) == t;) working_.wait(w);
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  // The next run of chunks of job t, if t is still the job and a chunk is left. state_ holds
  // the job's ticket, the first chunk nobody has taken and one past the last, in one word, so a
  // late helper can never take a chunk of a job that has moved on. The caller takes from the
  // front, the helper from the back, each a quarter of what is left (a chunk at least): each
  // thread reads its weights in long runs in order (the prefetchers see one stream each), their
  // outputs meet in one place only, and the shared word moves between the cores a few times a
  // product rather than once a chunk (at eight rows a chunk is ~1 us).
  bool claim(uint32_t t, bool back, int& c0, int& c1) {
    uint64_t s = state_.load();
    for (;;) {
      const int front = int((s >> 16) & 0xffff), end = int(s & 0xffff);
      if (uint32_t(s >> 32) != t || front >= end) return false;
      const int take = std::clamp((end - front) / 4, 1, MAX_RUN);
      const uint64_t next = back ? s - uint64_t(take) : s + (uint64_t(take) << 16);
      if (state_.compare_exchange_weak(s, next)) {
        c0 = back ? end - take : front;
        c1 = c0 + take;
        return true;
      }
    }
  }
  void work(uint32_t t, bool back) {
    for (int c0, c1; claim(t, back, c0, c1);) {
      const int end = c1 * grain_;
      (*fn_)(c0 * grain_, end < n_ ? end : n_);
    }
  }
  void loop() {
    using clock = std::chrono::steady_clock;
    uint32_t seen = 0;
    for (;;) {
      const auto until = clock::now() + std::chrono::microseconds(SPIN_US);
      // Spinning, the helper yields its core rather than pausing on it: in a served decode the
      // engine's main thread (the next step's graph) and the server's threads want the same two
      // cores between products, and a spin that holds one makes them wait (one stream 1.04x,
      // docs/benchmarks.md, "Eighth pass"). With nothing else to run, sched_yield returns at once.
      while (posted_.load(std::memory_order_relaxed) == seen && clock::now() < until) sched_yield();
      posted_.wait(seen);  // returns at once when a job came meanwhile
      seen = posted_.load();
      working_.store(seen);  // before claiming: the caller waits while the helper is in its job
      work(seen, true);
      working_.store(0);
      working_.notify_one();
    }
  }
  static inline const int SPIN_US = [] {  // a tuning knob for bench.matvec, not a setting
    const char* v = std::getenv("LMSPD_KERNEL_SPIN_US");
    return v ? std::atoi(v) : 50;
  }();
  static constexpr int SPINS = 2000;
  static constexpr int MAX_RUN = 8;  // chunks: what the caller may wait for if the helper is preempted in them
  std::mutex run_mu_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int n_ = 0, grain_ = 1;
  uint32_t ticket_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> posted_{0}, working_{0};
  std::thread thread_;
};

inline Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: its thread outlives static teardown
  return *p;
}

}  // namespace lmspd
