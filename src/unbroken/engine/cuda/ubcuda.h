/* Shared by the stand-in CUDA libraries and their Python loader (unbroken.engine.cuda).
 * Function ids index the per-function delay table. */
#ifndef UBCUDA_H
#define UBCUDA_H

enum ubcuda_fn {
    UB_CU_LAUNCH_KERNEL = 0,
    UB_CU_LAUNCH_KERNEL_EX,
    UB_CU_GRAPH_LAUNCH,
    UB_CU_MEM_ALLOC,
    UB_CU_MEMCPY_HTOD_ASYNC,
    UB_CU_MEMCPY_DTOH_ASYNC,
    UB_CU_STREAM_SYNCHRONIZE,
    UB_FN_COUNT
};

/* Base cost of the next calls of `fn`, in nanoseconds. */
void ubcuda_set_delay(int fn, long long ns);
/* Extra cost added to every launch, graph launch and copy (simulated bus contention). */
void ubcuda_set_contention(long long ns);
/* Calls made so far to `fn` (driver entry points only). */
unsigned long long ubcuda_calls(int fn);

#endif
