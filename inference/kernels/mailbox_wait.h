/* The wait of the host threads that serve the device through a mailbox (host_experts.c's pool
 * leader, copy_agent.c's agent) for the device's next ticket: spin while steps run (the device
 * posts every few microseconds), nap 50 us at a time after SPIN_NS without a job. */
#ifndef EXPERTPACK_MAILBOX_WAIT_H
#define EXPERTPACK_MAILBOX_WAIT_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

static const int64_t SPIN_NS = 5000000;  /* spin this long after a job before napping */

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The ticket word's value once it differs from `last` (an acquire load: the job's inputs, written
 * before it, are visible), or `last` once `stop` is set. idle_since: when the last job ended. */
static inline int64_t next_ticket(volatile int64_t *ticket, int64_t last, int64_t idle_since, _Atomic int *stop) {
    while (!atomic_load_explicit(stop, memory_order_relaxed)) {
        const int64_t now = __atomic_load_n(ticket, __ATOMIC_ACQUIRE);
        if (now != last) return now;
        if (now_ns() - idle_since > SPIN_NS) {
            struct timespec nap = {0, 50000};
            nanosleep(&nap, NULL);
        } else {
            PAUSE();
        }
    }
    return last;
}

#endif
