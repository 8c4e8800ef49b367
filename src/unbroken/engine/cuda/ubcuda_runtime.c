/* Stand-in for the CUDA runtime library (libcudart.so). Like the real one, each runtime
 * call is a thin layer over a driver call, so a tracer that probes both must not count
 * the inner call twice. */
#include <stddef.h>

#define EXPORT __attribute__((visibility("default"), noinline))

typedef int cudaError_t;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned x, y, z; } dim3;

enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost };

extern int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                          unsigned, void *, void **, void **);
extern int cuGraphLaunch(void *, void *);
extern int cuMemAlloc_v2(CUdeviceptr *, size_t);
extern int cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, void *);
extern int cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, void *);
extern int cuStreamSynchronize(void *);

EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args,
                                    size_t shmem, void *stream) {
    return cuLaunchKernel((void *)func, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                          (unsigned)shmem, stream, args, NULL);
}

EXPORT cudaError_t cudaGraphLaunch(void *exec, void *stream) {
    return cuGraphLaunch(exec, stream);
}

EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
    CUdeviceptr p = 0;
    int rc = cuMemAlloc_v2(&p, size);
    if (ptr) *ptr = (void *)p;
    return rc;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind,
                                   void *stream) {
    if (kind == cudaMemcpyDeviceToHost)
        return cuMemcpyDtoHAsync_v2(dst, (CUdeviceptr)src, count, stream);
    return cuMemcpyHtoDAsync_v2((CUdeviceptr)dst, src, count, stream);
}

EXPORT cudaError_t cudaStreamSynchronize(void *stream) {
    return cuStreamSynchronize(stream);
}
