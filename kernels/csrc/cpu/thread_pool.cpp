#include "thread_pool.h"

#if defined(_WIN32)
#include <process.h>
#define DEEPSHARD_GETPID _getpid
#else
#include <unistd.h>
#define DEEPSHARD_GETPID getpid
#endif

namespace deepshard::cpu {

void ThreadPool::run(int n, const std::function<void(int)>& task) {
    if (n <= 1) {
        task(0);
        return;
    }
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        while (static_cast<int>(workers_.size()) < n - 1) {
            int index = static_cast<int>(workers_.size());
            // The worker starts from the current generation, so it takes part in the next one.
            uint64_t seen = generation_;
            workers_.emplace_back([this, index, seen] { worker_main(index, seen); });
        }
        task_ = &task;
        active_ = n - 1;
        pending_ = n - 1;
        ++generation_;
    }
    wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
}

void ThreadPool::worker_main(int index, uint64_t seen_generation) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        wake_.wait(lock, [&] { return generation_ != seen_generation; });
        seen_generation = generation_;
        if (index >= active_) {
            continue;  // not needed this time
        }
        const std::function<void(int)>* task = task_;
        lock.unlock();
        (*task)(index + 1);
        lock.lock();
        if (--pending_ == 0) {
            done_.notify_one();
        }
    }
}

ThreadPool& ThreadPool::instance() {
    static std::mutex mutex;
    static ThreadPool* pool = nullptr;
    static long owner = 0;
    std::lock_guard<std::mutex> lock(mutex);
    long pid = static_cast<long>(DEEPSHARD_GETPID());
    if (pool == nullptr || owner != pid) {
        // Deliberately never deleted: workers sleep until the process exits, and after a fork
        // the parent's pool refers to threads that do not exist in the child.
        pool = new ThreadPool();
        owner = pid;
    }
    return *pool;
}

}  // namespace deepshard::cpu
