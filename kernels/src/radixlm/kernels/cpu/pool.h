/* pool.c's interface: the threads the CPU kernels split their work over. */
#ifndef RADIXLM_POOL_H
#define RADIXLM_POOL_H

typedef void (*RlmTask)(void *ctx, int ith, int nth);

/* task(ctx, i, nth) for i < nth on nth threads (at most `most`), the caller taking i = 0. */
void radixlm_parallel(RlmTask task, void *ctx, int most);
/* The threads tasks use now (radixlm_set_threads). */
int radixlm_threads(void);
/* [lo, hi) of n items for thread ith of nth, in whole units of `align` items. */
void radixlm_split(int n, int align, int ith, int nth, int *lo, int *hi);
/* The most threads worth waking for a product over `weights` weights. */
int radixlm_threads_for(long weights);

#endif
