// Python bindings of the NCCL transport: bind_nccl(m) is called from module.cpp.
//
// Always present: nccl_compiled(), the exception types, dtype/op tables, rank-map helpers,
// cuda_driver_info(). With TMRUN_HAVE_NCCL: the dlopen loader, unique ids and
// NcclCommunicator; without it those raise NcclUnavailableError.
#include <pybind11/pybind11.h>

#include "tmrun/nogil.h"
#include <pybind11/stl.h>

#include "tmrun/nccl_loader.h"
#include "tmrun/nccl_types.h"

// Set by CMakeLists.txt from -DTMRUN_NCCL_HEADERS (AUTO|FETCH).
#ifndef TMRUN_NCCL_HEADERS_MODE
#define TMRUN_NCCL_HEADERS_MODE "AUTO"
#endif

#if TMRUN_HAVE_NCCL
#include "tmrun/nccl_comm.h"
#endif

namespace py = pybind11;
using namespace tmrun::nccl;

namespace {

PyObject* g_exc_error = nullptr;
PyObject* g_exc_timeout = nullptr;
PyObject* g_exc_unavailable = nullptr;

void raise_with_code(PyObject* type, const char* what, int code) {
  py::object exc = py::reinterpret_borrow<py::object>(type)(py::str(what));
  exc.attr("code") = code;
  PyErr_SetObject(type, exc.ptr());
}

py::dict cuda_info() {
  auto d = cuda_driver();
  py::dict out;
  out["path"] = d->path;
  out["driver_version"] = d->driver_version;
  out["device_count"] = d->device_count;
  return out;
}

#if TMRUN_HAVE_NCCL
py::dict lib_info(const NcclLib& lib) {
  py::dict out;
  out["path"] = lib.path;
  out["version"] = lib.version;
  out["revoke"] = lib.has_revoke();
  out["shrink"] = lib.has_shrink();
  out["grow"] = lib.has_grow();
  out["split"] = lib.CommSplit != nullptr;
  out["get_last_error"] = lib.GetLastError != nullptr;
  return out;
}

std::shared_ptr<const NcclLib> lib_for(const std::string& library) {
  if (!library.empty()) return load_nccl(library);
  return load_nccl();  // current, or search with the remembered dirs
}

Options make_opts(double timeout, bool revoke_on_error, bool shrink_share, const std::string& name) {
  Options o;
  o.timeout_s = timeout;
  o.revoke_on_error = revoke_on_error;
  o.shrink_share = shrink_share;
  o.name = name;
  return o;
}
#else
[[noreturn]] void not_compiled() {
  throw UnavailableError(
      "tmrun_native was built without the NCCL transport (nccl.h was not found at build time; "
      "pip install nvidia-nccl-cu13 or set NCCL_INCLUDE_DIR, then rebuild)");
}
#endif

}  // namespace

void bind_nccl(py::module_& m) {
  // ---- exceptions
  static py::exception<Error> exc_error(m, "NcclError", PyExc_RuntimeError);
  static py::exception<TimeoutError> exc_timeout(m, "NcclTimeoutError", exc_error.ptr());
  static py::exception<UnavailableError> exc_unavailable(m, "NcclUnavailableError", exc_error.ptr());
  g_exc_error = exc_error.ptr();
  g_exc_timeout = exc_timeout.ptr();
  g_exc_unavailable = exc_unavailable.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      raise_with_code(g_exc_timeout, e.what(), e.code());
    } catch (const Error& e) {
      raise_with_code(g_exc_error, e.what(), e.code());
    } catch (const UnavailableError& e) {
      raise_with_code(g_exc_unavailable, e.what(), -1);
    }
  });

  m.attr("NCCL_UNIQUE_ID_BYTES") = 128;
  m.def("nccl_compiled", [] { return TMRUN_HAVE_NCCL != 0; },
        "True when the NCCL transport was compiled in (nccl.h found at build time).");
  m.def("nccl_headers_mode", [] { return std::string(TMRUN_NCCL_HEADERS_MODE); },
        "How the build was told to get nccl.h: \"AUTO\" (search; transport OFF if absent) or "
        "\"FETCH\" (pinned header downloaded at configure time; the transport must be compiled).");
  m.def("nccl_header_version", [] {
#if TMRUN_HAVE_NCCL
    return static_cast<int>(NCCL_VERSION_CODE);
#else
    return 0;
#endif
  }, "NCCL_VERSION_CODE of the nccl.h compiled against (0 when not compiled).");
  m.def("nccl_cuda_stub_headers", [] {
#if defined(TMRUN_CUDA_STUB)
    return true;
#else
    return false;
#endif
  }, "True when nccl.h was compiled against tmrun's types-only CUDA stub.");

  // ---- tables
  m.def("nccl_dtypes", [] {
    py::dict d;
    for (const auto& t : dtypes()) d[py::str(t.name)] = py::make_tuple(t.nccl, t.size);
    return d;
  }, "{dtype name: (ncclDataType_t value, element size)} for every NCCL dtype.");
  m.def("nccl_ops", [] {
    py::dict d;
    for (const auto& o : ops()) d[py::str(o.name)] = o.nccl;
    return d;
  }, "{op name: ncclRedOp_t value} for every built-in NCCL reduction.");
  m.def("nccl_dtype", [](const std::string& n) {
    const auto& t = dtype_by_name(n);
    return py::make_tuple(t.name, t.nccl, t.size);
  }, py::arg("name"), "(canonical name, ncclDataType_t, size) for a dtype name or alias; ValueError if unknown.");
  m.def("nccl_op", [](const std::string& n) {
    const auto& o = op_by_name(n);
    return py::make_tuple(o.name, o.nccl);
  }, py::arg("name"), "(canonical name, ncclRedOp_t) for an op name or alias; ValueError if unknown.");
  m.def("nccl_result_name", &result_name, py::arg("code"));

  // ---- rank maps
  m.def("nccl_shrink_rank_map", &shrink_rank_map, py::arg("rank_map"), py::arg("exclude"),
        "(new map, excluded NCCL ranks) after ncclCommShrink drops the given logical ranks.");
  m.def("nccl_grow_rank_map", &grow_rank_map, py::arg("rank_map"), py::arg("joiners"),
        "Map after ncclCommGrow appends the joiners (logical ranks) at the end.");
  m.def("nccl_rank_positions", &positions, py::arg("rank_map"),
        "Logical position (sorted order) of each NCCL rank: the data layout of allgather/reduce-scatter.");

  // ---- CUDA driver
  m.def("cuda_driver_info", &cuda_info,
        "Loads libcuda.so.1 (or $TMRUN_CUDA_DRIVER_LIBRARY), runs cuInit and counts GPUs: "
        "{path, driver_version, device_count}. Raises NcclUnavailableError with the reason.");

#if TMRUN_HAVE_NCCL
  m.def("nccl_load", [](const std::string& path, const std::vector<std::string>& search_dirs) {
    return lib_info(*load_nccl(path, search_dirs));
  }, py::arg("path") = "", py::arg("search_dirs") = std::vector<std::string>{},
     "dlopen libnccl.so.2 (explicit path; else $TMRUN_NCCL_LIBRARY; else <dir>/libnccl.so.2 for "
     "search_dirs; else the default loader path) and resolve its API. Returns "
     "{path, version, revoke, shrink, grow, split, get_last_error}.");
  m.def("nccl_open_library", [](const std::string& path) { return lib_info(*open_nccl_library(path)); },
        py::arg("path"), "Open and validate exactly this file, without making it current (for checks).");
  m.def("nccl_library_info", []() -> py::object {
    auto l = current_nccl();
    if (!l) return py::none();
    return lib_info(*l);
  }, "The currently loaded NCCL library, or None.");
  m.def("nccl_get_unique_id", [](const std::string& library) {
    auto lib = lib_for(library);
    ncclUniqueId id;
    ncclResult_t r;
    {
      tmrun::NoGil nogil;
      r = lib->GetUniqueId(&id);
    }
    if (r != ncclSuccess) throw Error("ncclGetUniqueId failed: " + lib->error_string(r), r);
    return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
  }, py::arg("library") = "", "ncclGetUniqueId() as 128 bytes (starts a bootstrap root in this process).");

  using C = Communicator;
  py::class_<C>(m, "NcclCommunicator",
                "Non-blocking NCCL communicator with deadlines, logical rank map and replacement.")
      .def(py::init([](py::bytes uid, int world_size, int rank, int device, std::vector<int> rank_map,
                       double timeout, bool revoke_on_error, bool shrink_share, const std::string& name,
                       bool wait, const std::string& library) {
             std::string id = uid;
             auto lib = lib_for(library);
             auto opts = make_opts(timeout, revoke_on_error, shrink_share, name);
             tmrun::NoGil nogil;
             return C::init(id, world_size, rank, device, std::move(rank_map), opts, wait, lib);
           }),
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"),
           py::arg("rank_map") = std::vector<int>{}, py::arg("timeout") = 300.0,
           py::arg("revoke_on_error") = true, py::arg("shrink_share") = true, py::arg("name") = "",
           py::arg("wait") = true, py::arg("library") = "",
           "ncclCommInitRankConfig (non-blocking). `rank` is logical; rank_map[i] is the logical rank of "
           "NCCL rank i (empty: identity).")
      .def_static("grow_join", [](py::bytes uid, int world_size, int rank, int device, std::vector<int> rank_map,
                                  double timeout, bool revoke_on_error, bool shrink_share, const std::string& name,
                                  bool wait, const std::string& library) {
             std::string id = uid;
             auto lib = lib_for(library);
             auto opts = make_opts(timeout, revoke_on_error, shrink_share, name);
             tmrun::NoGil nogil;
             return C::grow_join(id, world_size, rank, device, std::move(rank_map), opts, wait, lib);
           },
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"), py::arg("rank_map"),
           py::arg("timeout") = 300.0, py::arg("revoke_on_error") = true, py::arg("shrink_share") = true,
           py::arg("name") = "", py::arg("wait") = true, py::arg("library") = "",
           "Joiner side of ncclCommGrow: rank_map is the grown map; this rank's NCCL rank is its index there.")
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("nccl_rank", &C::nccl_rank)
      .def_property_readonly("size", &C::size)
      .def_property_readonly("device", &C::device)
      .def_property_readonly("rank_map", &C::rank_map)
      .def_property_readonly("state", [](const C& c) { (void)c.state(); return c.state_name(); })
      .def_property_readonly("has_pending", &C::has_pending)
      .def_property_readonly("nccl_version", [](const C& c) { return c.lib().version; })
      .def("stats", &C::stats)
      .def("wait_ready", &C::wait_ready, py::arg("timeout") = -1.0, py::call_guard<tmrun::NoGil>())
      .def("poll_ready", &C::poll_ready, py::call_guard<tmrun::NoGil>())
      .def("check", &C::check, py::call_guard<tmrun::NoGil>())
      .def("allreduce", &C::allreduce, py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"),
           py::arg("op") = "sum", py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("broadcast", &C::broadcast, py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"),
           py::arg("root"), py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("allgather", &C::allgather, py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"),
           py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("reduce_scatter", &C::reduce_scatter, py::arg("send"), py::arg("recv"), py::arg("recv_count"),
           py::arg("dtype"), py::arg("op") = "sum", py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("send", &C::send, py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("peer"),
           py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("recv", &C::recv, py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("peer"),
           py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("sendrecv", &C::sendrecv, py::arg("send_buf"), py::arg("send_count"), py::arg("send_peer"),
           py::arg("recv_buf"), py::arg("recv_count"), py::arg("recv_peer"), py::arg("dtype"),
           py::arg("stream") = 0, py::call_guard<tmrun::NoGil>())
      .def("synchronize", &C::synchronize, py::arg("stream") = 0, py::arg("timeout") = -1.0,
           py::call_guard<tmrun::NoGil>())
      .def("revoke", &C::revoke, py::arg("timeout") = -1.0, py::call_guard<tmrun::NoGil>())
      .def("abort", &C::abort, py::call_guard<tmrun::NoGil>())
      .def("close", &C::close, py::arg("timeout") = -1.0, py::call_guard<tmrun::NoGil>())
      .def("shrink", &C::shrink, py::arg("exclude"), py::arg("abort") = false, py::arg("timeout") = -1.0,
           py::call_guard<tmrun::NoGil>())
      .def("grow_unique_id", [](C& c) {
             std::string s;
             {
               tmrun::NoGil nogil;
               s = c.grow_unique_id();
             }
             return py::bytes(s);
           })
      .def("grow_begin", [](C& c, const std::vector<int>& joiners, py::object uid) {
             std::string id;
             if (!uid.is_none()) id = py::cast<std::string>(py::bytes(uid));
             tmrun::NoGil nogil;
             c.grow_begin(joiners, id);
           }, py::arg("joiners"), py::arg("unique_id") = py::none())
      .def("reinit_begin", [](C& c, py::bytes uid, int world_size, std::vector<int> rank_map) {
             std::string id = uid;
             tmrun::NoGil nogil;
             c.reinit_begin(id, world_size, std::move(rank_map));
           }, py::arg("unique_id"), py::arg("world_size"), py::arg("rank_map") = std::vector<int>{})
      .def("pending_ready", &C::pending_ready, py::call_guard<tmrun::NoGil>())
      .def("commit", &C::commit, py::arg("timeout") = -1.0, py::call_guard<tmrun::NoGil>())
      .def("cancel_pending", &C::cancel_pending, py::call_guard<tmrun::NoGil>());
#else
  m.def("nccl_load", [](const std::string&, const std::vector<std::string>&) -> py::dict { not_compiled(); },
        py::arg("path") = "", py::arg("search_dirs") = std::vector<std::string>{});
  m.def("nccl_open_library", [](const std::string&) -> py::dict { not_compiled(); }, py::arg("path"));
  m.def("nccl_library_info", []() -> py::object { return py::none(); });
  m.def("nccl_get_unique_id", [](const std::string&) -> py::bytes { not_compiled(); }, py::arg("library") = "");
  struct NotCompiled {};
  py::class_<NotCompiled>(m, "NcclCommunicator", "Unavailable: built without the NCCL transport.")
      .def(py::init([](py::args, py::kwargs) -> NotCompiled* { not_compiled(); }))
      .def_static("grow_join", [](py::args, py::kwargs) { not_compiled(); });
#endif
}
