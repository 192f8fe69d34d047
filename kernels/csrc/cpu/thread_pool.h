// A small persistent pool of worker threads for the optimizer steps.
//
// A step splits its range into N contiguous chunks; the calling thread runs chunk 0 and N-1
// workers run the others. Workers are started on first need and then sleep on a condition
// variable between steps, so a step pays a wake-up (microseconds), not a thread start. std::thread
// rather than OpenMP: the extension must not load a second OpenMP runtime next to torch's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace deepshard::cpu {

class ThreadPool {
public:
    ThreadPool() = default;
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    // Runs task(0), ..., task(n - 1), task(0) on the calling thread; returns when all are done.
    // Concurrent callers are served one at a time.
    void run(int n, const std::function<void(int)>& task);

    // The pool of this process: a new one after fork(), whose child has none of the parent's
    // threads (the parent's pool object is then left alone, never used again).
    static ThreadPool& instance();

private:
    void worker_main(int index, uint64_t seen_generation);

    std::mutex run_mutex_;  // one run at a time
    std::mutex mutex_;      // guards everything below
    std::condition_variable wake_;
    std::condition_variable done_;
    std::vector<std::thread> workers_;
    const std::function<void(int)>* task_ = nullptr;
    uint64_t generation_ = 0;
    int active_ = 0;   // workers that take part in the current generation
    int pending_ = 0;  // of those, how many have not finished
};

}  // namespace deepshard::cpu
