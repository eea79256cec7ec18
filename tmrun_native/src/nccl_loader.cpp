// NCCL transport: dlopen()-based loading of libcuda.so.1 and libnccl.so.2.
#include "tmrun/nccl_loader.h"
#include "tmrun/str_cat.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace tmrun {
namespace nccl {

namespace {

std::string last_dlerror() {
  const char* e = dlerror();
  return e ? std::string(e) : std::string("unknown dlopen error");
}

template <typename Fn>
bool resolve(void* handle, const char* name, Fn& out) {
  dlerror();
  void* p = dlsym(handle, name);
  if (!p) return false;
  out = reinterpret_cast<Fn>(p);
  return true;
}

}  // namespace

// ---- CUDA driver --------------------------------------------------------------------------

std::string CudaDriver::describe(cu::Result r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (GetErrorName) GetErrorName(r, &name);
  if (GetErrorString) GetErrorString(r, &text);
  std::string msg = str_cat(name ? name : "CUresult", " (", r, ")");
  if (text) msg += str_cat(": ", text);
  return msg;
}

namespace {

std::shared_ptr<const CudaDriver> load_cuda_driver() {
  const char* env = std::getenv("TMRUN_CUDA_DRIVER_LIBRARY");
  const std::string path = (env && *env) ? env : "libcuda.so.1";
  dlerror();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    throw UnavailableError("CUDA driver library '" + path + "' could not be loaded (" +
                           last_dlerror() + "); no NVIDIA driver on this machine?");
  }
  auto d = std::make_shared<CudaDriver>();
  d->path = path;
  d->handle = h;
  std::vector<std::string> missing;
  auto need = [&](const char* name, auto& fn) {
    if (!resolve(h, name, fn)) missing.push_back(name);
  };
  need("cuInit", d->Init);
  need("cuDriverGetVersion", d->DriverGetVersion);
  need("cuDeviceGetCount", d->DeviceGetCount);
  need("cuDeviceGet", d->DeviceGet);
  need("cuDevicePrimaryCtxRetain", d->DevicePrimaryCtxRetain);
  need("cuDevicePrimaryCtxRelease_v2", d->DevicePrimaryCtxRelease);
  need("cuCtxSetCurrent", d->CtxSetCurrent);
  need("cuCtxGetCurrent", d->CtxGetCurrent);
  need("cuEventCreate", d->EventCreate);
  need("cuEventRecord", d->EventRecord);
  need("cuEventQuery", d->EventQuery);
  need("cuEventDestroy_v2", d->EventDestroy);
  need("cuGetErrorName", d->GetErrorName);
  need("cuGetErrorString", d->GetErrorString);
  if (!missing.empty()) {
    std::string m;
    for (const auto& s : missing) m += " " + s;
    dlclose(h);
    throw UnavailableError("CUDA driver library '" + path + "' lacks symbols:" + m);
  }
  d->DriverGetVersion(&d->driver_version);
  cu::Result r = d->Init(0);
  if (r != cu::kSuccess) {
    // Keep the handle open: other code in the process may use it.
    throw UnavailableError("cuInit(0) failed: " + d->describe(r) + " (library " + path + ")");
  }
  r = d->DeviceGetCount(&d->device_count);
  if (r != cu::kSuccess) {
    throw UnavailableError("cuDeviceGetCount failed: " + d->describe(r));
  }
  if (d->device_count <= 0) {
    throw UnavailableError("the CUDA driver reports no GPU (cuDeviceGetCount == 0)");
  }
  return d;
}

std::mutex g_cuda_mu;
std::shared_ptr<const CudaDriver> g_cuda;

}  // namespace

std::shared_ptr<const CudaDriver> cuda_driver() {
  std::lock_guard<std::mutex> lk(g_cuda_mu);
  if (!g_cuda) g_cuda = load_cuda_driver();  // failures are not cached: retried next call
  return g_cuda;
}

#if TMRUN_HAVE_NCCL
// ---- NCCL ---------------------------------------------------------------------------------

std::string NcclLib::error_string(ncclResult_t r) const {
  std::string s = result_name(static_cast<int>(r));
  if (GetErrorString) {
    const char* t = GetErrorString(r);
    if (t) s += std::string(" (") + t + ")";
  }
  return s;
}

std::shared_ptr<const NcclLib> open_nccl_library(const std::string& path) {
  if (path.empty()) throw UnavailableError("empty NCCL library path");
  dlerror();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    throw UnavailableError("NCCL library '" + path + "' could not be loaded: " + last_dlerror());
  }
  auto lib = std::make_shared<NcclLib>();
  lib->path = path;
  lib->handle = h;
  std::vector<std::string> missing;
  auto need = [&](const char* name, auto& fn) {
    if (!resolve(h, name, fn)) missing.push_back(name);
  };
  auto want = [&](const char* name, auto& fn) { resolve(h, name, fn); };
  need("ncclGetVersion", lib->GetVersion);
  need("ncclGetUniqueId", lib->GetUniqueId);
  need("ncclGetErrorString", lib->GetErrorString);
  need("ncclCommInitRankConfig", lib->CommInitRankConfig);
  need("ncclCommFinalize", lib->CommFinalize);
  need("ncclCommDestroy", lib->CommDestroy);
  need("ncclCommAbort", lib->CommAbort);
  need("ncclCommGetAsyncError", lib->CommGetAsyncError);
  need("ncclCommCount", lib->CommCount);
  need("ncclCommUserRank", lib->CommUserRank);
  need("ncclAllReduce", lib->AllReduce);
  need("ncclBroadcast", lib->Broadcast);
  need("ncclReduce", lib->Reduce);
  need("ncclAllGather", lib->AllGather);
  need("ncclReduceScatter", lib->ReduceScatter);
  need("ncclSend", lib->Send);
  need("ncclRecv", lib->Recv);
  need("ncclGroupStart", lib->GroupStart);
  need("ncclGroupEnd", lib->GroupEnd);
  want("ncclGetLastError", lib->GetLastError);
  want("ncclCommSplit", lib->CommSplit);
  want("ncclCommRevoke", lib->CommRevoke);
  want("ncclCommShrink", lib->CommShrink);
  want("ncclCommGetUniqueId", lib->CommGetUniqueId);
  want("ncclCommGrow", lib->CommGrow);
  if (!missing.empty()) {
    std::string m;
    for (const auto& s : missing) m += " " + s;
    dlclose(h);
    throw UnavailableError("'" + path + "' is not a usable NCCL library; missing symbols:" + m);
  }
  ncclResult_t r = lib->GetVersion(&lib->version);
  if (r != ncclSuccess) {
    throw UnavailableError("ncclGetVersion failed in '" + path + "': " + lib->error_string(r));
  }
  // Non-blocking communicators and ncclConfig_t need 2.14; we ask for 2.18 (config fields
  // and ncclCommGetAsyncError semantics we rely on).
  if (lib->version < 21800) {
    throw UnavailableError("NCCL in '" + path + "' is version " + std::to_string(lib->version) +
                           "; tmrun needs 2.18 or newer");
  }
  return lib;
}

namespace {
std::mutex g_nccl_mu;
std::shared_ptr<const NcclLib> g_nccl;
std::vector<std::string> g_search_dirs;
}  // namespace

std::shared_ptr<const NcclLib> load_nccl(const std::string& explicit_path,
                                         const std::vector<std::string>& search_dirs) {
  std::lock_guard<std::mutex> lk(g_nccl_mu);
  if (!search_dirs.empty()) g_search_dirs = search_dirs;
  if (!explicit_path.empty()) {
    if (g_nccl && g_nccl->path == explicit_path) return g_nccl;
    auto lib = open_nccl_library(explicit_path);
    g_nccl = lib;
    return lib;
  }
  if (g_nccl) return g_nccl;
  std::vector<std::string> attempts;
  const char* env = std::getenv("TMRUN_NCCL_LIBRARY");
  if (env && *env) {
    try {
      g_nccl = open_nccl_library(env);
      return g_nccl;
    } catch (const UnavailableError& e) {
      throw UnavailableError(std::string("TMRUN_NCCL_LIBRARY is set but unusable: ") + e.what());
    }
  }
  std::vector<std::string> candidates;
  for (const auto& d : g_search_dirs) {
    if (!d.empty()) candidates.push_back(d + "/libnccl.so.2");
  }
  candidates.push_back("libnccl.so.2");
  for (const auto& c : candidates) {
    try {
      g_nccl = open_nccl_library(c);
      return g_nccl;
    } catch (const UnavailableError& e) {
      attempts.push_back(e.what());
    }
  }
  std::string msg = "libnccl.so.2 not found or unusable (set TMRUN_NCCL_LIBRARY or pip install "
                    "nvidia-nccl-cu13). Tried:";
  for (const auto& a : attempts) msg += "\n  - " + a;
  throw UnavailableError(msg);
}

std::shared_ptr<const NcclLib> current_nccl() {
  std::lock_guard<std::mutex> lk(g_nccl_mu);
  return g_nccl;
}
#endif  // TMRUN_HAVE_NCCL

}  // namespace nccl
}  // namespace tmrun
