/* tmrun: types-only stand-in for <cuda_runtime.h>, used ONLY when no CUDA toolkit headers
 * are found at build time. nccl.h needs nothing from CUDA but the opaque handle types below
 * (and tests CUDART_VERSION, left undefined here so it skips the bf16/fp8 headers).
 * tmrun never calls the CUDA runtime: it uses the driver API through dlopen("libcuda.so.1").
 * The handle types are ABI-identical to CUDA's (pointers to opaque structs). */
#ifndef TMRUN_CUDA_STUB_RUNTIME_H
#define TMRUN_CUDA_STUB_RUNTIME_H
#define TMRUN_CUDA_STUB 1
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
