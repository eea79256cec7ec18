// NCCL transport: run-time loading of libcuda.so.1 (CUDA driver API) and libnccl.so.2.
//
// Nothing here is linked: both libraries are dlopen()ed and every function is resolved with
// dlsym into a table, so the module imports on machines with neither. The CUDA driver part
// needs no CUDA header (the few driver types are declared below, ABI-identical to cuda.h);
// the NCCL part uses nccl.h for its types only and is compiled when TMRUN_HAVE_NCCL is 1.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tmrun/nccl_types.h"

#if TMRUN_HAVE_NCCL
#include <nccl.h>
#endif

struct CUctx_st;
struct CUevent_st;
struct CUstream_st;

namespace tmrun {
namespace nccl {

// ---- CUDA driver API (libcuda.so.1) -------------------------------------------------
namespace cu {
using Result = int;  // CUresult
using Device = int;  // CUdevice
using Context = CUctx_st*;
using Event = CUevent_st*;
using Stream = CUstream_st*;
constexpr Result kSuccess = 0;
constexpr Result kErrorNotReady = 600;       // CUDA_ERROR_NOT_READY
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING
}  // namespace cu

struct CudaDriver {
  std::string path;
  void* handle = nullptr;
  int driver_version = 0;  // cuDriverGetVersion
  int device_count = 0;    // cuDeviceGetCount after cuInit(0)

  cu::Result (*Init)(unsigned) = nullptr;
  cu::Result (*DriverGetVersion)(int*) = nullptr;
  cu::Result (*DeviceGetCount)(int*) = nullptr;
  cu::Result (*DeviceGet)(cu::Device*, int) = nullptr;
  cu::Result (*DevicePrimaryCtxRetain)(cu::Context*, cu::Device) = nullptr;
  cu::Result (*DevicePrimaryCtxRelease)(cu::Device) = nullptr;  // _v2
  cu::Result (*CtxSetCurrent)(cu::Context) = nullptr;
  cu::Result (*CtxGetCurrent)(cu::Context*) = nullptr;
  cu::Result (*EventCreate)(cu::Event*, unsigned) = nullptr;
  cu::Result (*EventRecord)(cu::Event, cu::Stream) = nullptr;
  cu::Result (*EventQuery)(cu::Event) = nullptr;
  cu::Result (*EventDestroy)(cu::Event) = nullptr;  // _v2
  cu::Result (*GetErrorName)(cu::Result, const char**) = nullptr;
  cu::Result (*GetErrorString)(cu::Result, const char**) = nullptr;

  // "CUDA_ERROR_NOT_READY (600): device not ready"
  std::string describe(cu::Result r) const;
};

// Loads libcuda.so.1 (or $TMRUN_CUDA_DRIVER_LIBRARY), runs cuInit(0) and counts devices.
// Cached after the first success. Throws UnavailableError with the reason (library missing,
// symbol missing, cuInit failed, no device).
std::shared_ptr<const CudaDriver> cuda_driver();

#if TMRUN_HAVE_NCCL
// ---- NCCL (libnccl.so.2) ------------------------------------------------------------
struct NcclLib {
  std::string path;
  void* handle = nullptr;
  int version = 0;  // ncclGetVersion, e.g. 23203

  // Core (required).
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclCommCount) CommCount = nullptr;
  decltype(&::ncclCommUserRank) CommUserRank = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  decltype(&::ncclReduce) Reduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;

  // Optional (nullptr when the loaded library lacks them). Signatures spelled out so this
  // compiles against older headers too.
  const char* (*GetLastError)(ncclComm_t) = nullptr;                       // 2.13+
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommRevoke)(ncclComm_t, int) = nullptr;                    // 2.28.7+
  ncclResult_t (*CommShrink)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int) = nullptr;  // 2.27+
  ncclResult_t (*CommGetUniqueId)(ncclComm_t, ncclUniqueId*) = nullptr;    // 2.29+
  ncclResult_t (*CommGrow)(ncclComm_t, int, const ncclUniqueId*, int, ncclComm_t*, ncclConfig_t*) =
      nullptr;  // 2.29+

  bool has_revoke() const { return CommRevoke != nullptr; }
  bool has_shrink() const { return CommShrink != nullptr; }
  bool has_grow() const { return CommGrow != nullptr && CommGetUniqueId != nullptr; }
  std::string error_string(ncclResult_t r) const;
};

// Opens exactly `path` (no caching, no search). Throws UnavailableError with dlerror() or
// the missing symbol. A library that loads is never dlclose()d.
std::shared_ptr<const NcclLib> open_nccl_library(const std::string& path);

// The process-wide library. With `explicit_path` non-empty: opens that file and makes it
// current. Otherwise returns the current one, or searches: $TMRUN_NCCL_LIBRARY (only it, if
// set), then <dir>/libnccl.so.2 for each of `search_dirs` (remembered for later calls; the
// Python layer passes the nvidia-nccl wheel's lib dir), then "libnccl.so.2" through the
// default loader path. Throws UnavailableError listing every attempt.
std::shared_ptr<const NcclLib> load_nccl(const std::string& explicit_path = "",
                                         const std::vector<std::string>& search_dirs = {});
// The current library or nullptr (no loading).
std::shared_ptr<const NcclLib> current_nccl();
#endif

}  // namespace nccl
}  // namespace tmrun
