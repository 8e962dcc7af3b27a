/* The threads the CPU kernels split their work over: `radixlm_set_threads(n)` (the caller's
 * torch intra-op thread count) makes `radixlm_parallel` run a task on n threads, the caller
 * and n - 1 workers started on first use. A product splits its output columns, the decode
 * step its attention groups; what each thread computes does not depend on how many there
 * are, so results are the same bits at every count.
 *
 * Workers wait for the next task spinning for about SPIN_NS, then asleep on a condition
 * variable: the products of one step follow each other within microseconds, and between
 * steps (the scheduler's Python) the workers give the core back. One task at a time: a call
 * while another runs (another thread's engine) or from inside a task runs on its caller
 * alone.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define MAX_THREADS 64
#define SPIN_NS 300000L
/* Weights per thread below which a product stays on fewer threads (waking one costs more). */
#define WEIGHTS_PER_THREAD (1L << 16)

static struct {
    pthread_mutex_t busy; /* held by the caller of the task that runs */
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    atomic_int generation; /* bumped per task */
    atomic_int pending;    /* workers still on the current task */
    atomic_int sleepers;
    int started;           /* workers running */
    int born[MAX_THREADS]; /* the generation before each worker's first task */
    int nth;               /* threads of the current task */
    RlmTask task;
    void *ctx;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static atomic_int wanted = 1;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *worker(void *arg) {
    const int ith = (int)(long)arg;
    int seen = pool.born[ith];
    for (;;) {
        long since = 0;
        for (int spins = 0; atomic_load(&pool.generation) == seen; spins++) {
            if (spins % 256 == 0) {
                long t = now_ns();
                if (!since) since = t;
                if (t - since < SPIN_NS) continue;
                pthread_mutex_lock(&pool.mutex);
                atomic_fetch_add(&pool.sleepers, 1);
                while (atomic_load(&pool.generation) == seen)
                    pthread_cond_wait(&pool.wake, &pool.mutex);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mutex);
                break;
            }
            PAUSE();
        }
        seen = atomic_load(&pool.generation);
        if (ith < pool.nth) pool.task(pool.ctx, ith, pool.nth);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

/* A child of fork() has none of the workers (nor a task in flight): it starts its own. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.pending, 0);
    pool.started = 0;
}

/* The threads the next tasks use (1: the caller alone). */
void radixlm_set_threads(int n) {
    atomic_store(&wanted, n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n);
}

int radixlm_threads(void) { return atomic_load(&wanted); }

/* (see pool.h; at most the wanted count of threads, and returns once all have run) */
void radixlm_parallel(RlmTask task, void *ctx, int most) {
    int nth = atomic_load(&wanted);
    nth = most < nth ? most : nth;
    if (nth <= 1 || pthread_mutex_trylock(&pool.busy)) {
        task(ctx, 0, 1);
        return;
    }
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, forget_workers);
    while (pool.started < nth - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.born[pool.started + 1] = atomic_load(&pool.generation);
        int failed = pthread_create(&thread, &attr, worker, (void *)(long)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    nth = pool.started + 1 < nth ? pool.started + 1 : nth;
    pool.task = task, pool.ctx = ctx, pool.nth = nth;
    atomic_store(&pool.pending, pool.started);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
    }
    task(ctx, 0, nth);
    while (atomic_load(&pool.pending)) PAUSE();
    pthread_mutex_unlock(&pool.busy);
}

void radixlm_split(int n, int align, int ith, int nth, int *lo, int *hi) {
    long units = (n + align - 1) / align;
    long first = units * ith / nth, last = units * (ith + 1) / nth;
    *lo = (int)(first * align < n ? first * align : n);
    *hi = (int)(last * align < n ? last * align : n);
}

int radixlm_threads_for(long weights) {
    long most = weights / WEIGHTS_PER_THREAD;
    return most < 1 ? 1 : most > MAX_THREADS ? MAX_THREADS : (int)most;
}
