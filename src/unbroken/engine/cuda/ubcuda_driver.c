/* Stand-in for the CUDA driver library (libcuda.so): the same entry-point names and
 * argument shapes, no GPU. Each call takes as long as the simulator asks, so uprobes see
 * the same durations they would see on a GPU node. Built with frame pointers and without
 * CET so every entry point begins with `push %rbp`, like the real libraries. */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include "ubcuda.h"

#define EXPORT __attribute__((visibility("default"), noinline))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static volatile long long delay_ns[UB_FN_COUNT];
static volatile long long contention_ns;
static unsigned long long calls[UB_FN_COUNT];
static CUdeviceptr next_ptr = 0x7f0000000000ULL;

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Sleep most of a long wait (cheap for the host), spin the last stretch (precise). */
static void spend(long long ns) {
    if (ns <= 0) return;
    long long end = now_ns() + ns;
    if (ns > 150000) {
        long long s = ns - 100000;
        struct timespec t = {s / 1000000000LL, s % 1000000000LL};
        nanosleep(&t, NULL);
    }
    while (now_ns() < end) {
        __asm__ __volatile__("pause");
    }
}

static inline CUresult call(int fn, int contended) {
    __atomic_add_fetch(&calls[fn], 1, __ATOMIC_RELAXED);
    spend(delay_ns[fn] + (contended ? contention_ns : 0));
    return 0;
}

EXPORT void ubcuda_set_delay(int fn, long long ns) {
    if (fn >= 0 && fn < UB_FN_COUNT) delay_ns[fn] = ns;
}
EXPORT void ubcuda_set_contention(long long ns) { contention_ns = ns; }
EXPORT unsigned long long ubcuda_calls(int fn) {
    return (fn >= 0 && fn < UB_FN_COUNT) ? __atomic_load_n(&calls[fn], __ATOMIC_RELAXED) : 0;
}

EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, void *stream,
                               void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)shmem; (void)stream; (void)params; (void)extra;
    return call(UB_CU_LAUNCH_KERNEL, 1);
}

EXPORT CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
    (void)config; (void)f; (void)params; (void)extra;
    return call(UB_CU_LAUNCH_KERNEL_EX, 1);
}

EXPORT CUresult cuGraphLaunch(void *exec, void *stream) {
    (void)exec; (void)stream;
    return call(UB_CU_GRAPH_LAUNCH, 1);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    if (dptr) *dptr = __atomic_fetch_add(&next_ptr, (bytes + 511) & ~(size_t)511, __ATOMIC_RELAXED);
    return call(UB_CU_MEM_ALLOC, 0);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    (void)dst; (void)src; (void)n; (void)stream;
    return call(UB_CU_MEMCPY_HTOD_ASYNC, 1);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    (void)dst; (void)src; (void)n; (void)stream;
    return call(UB_CU_MEMCPY_DTOH_ASYNC, 1);
}

EXPORT CUresult cuStreamSynchronize(void *stream) {
    (void)stream;
    return call(UB_CU_STREAM_SYNCHRONIZE, 0);
}
