// Python bindings of the TCP communicator (bind_comm is called from module.cpp).
#include <pybind11/pybind11.h>

#include "tmrun/nogil.h"
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include "tmrun/checksum.h"
#include "tmrun/tcp_comm.h"
#include "tmrun/frame.h"

namespace py = pybind11;
using tmrun::DType;
using tmrun::ReduceOp;

namespace {

PyObject* g_comm_error = nullptr;
PyObject* g_peer_lost = nullptr;
PyObject* g_protocol = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_auth = nullptr;
PyObject* g_frame_error = nullptr;

PyObject* new_exc(py::module_& m, const char* name, PyObject* base, const char* doc) {
  std::string full = std::string("tmrun_native.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(full.c_str(), doc, base, nullptr);
  if (!t) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(t));
  return t;
}

py::object exc_with(PyObject* type, const char* msg,
                    std::initializer_list<std::pair<const char*, py::object>> attrs) {
  py::object exc = py::reinterpret_borrow<py::object>(type)(msg);
  for (auto& a : attrs) exc.attr(a.first) = a.second;
  return exc;
}

// The Python exception object for a C++ exception (nullptr type when it is not one of ours).
std::pair<PyObject*, py::object> to_python(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const tmrun::PeerLostError& e) {
    return {g_peer_lost, exc_with(g_peer_lost, e.what(),
                                  {{"peer", py::int_(e.peer)}, {"epoch", py::int_(e.epoch)},
                                   {"reporter", py::int_(e.reporter)}})};
  } catch (const tmrun::ProtocolError& e) {
    return {g_protocol, exc_with(g_protocol, e.what(), {{"peer", py::int_(e.peer)}})};
  } catch (const tmrun::AuthError& e) {
    return {g_auth, exc_with(g_auth, e.what(), {})};
  } catch (const tmrun::CommTimeoutError& e) {
    return {g_timeout, exc_with(g_timeout, e.what(), {})};
  } catch (const tmrun::CommError& e) {
    return {g_comm_error, exc_with(g_comm_error, e.what(), {})};
  } catch (const std::invalid_argument& e) {
    return {PyExc_ValueError, exc_with(PyExc_ValueError, e.what(), {})};
  } catch (const std::exception& e) {
    return {PyExc_RuntimeError, exc_with(PyExc_RuntimeError, e.what(), {})};
  } catch (...) {
    return {PyExc_RuntimeError, exc_with(PyExc_RuntimeError, "unknown C++ exception", {})};
  }
}

// One Python buffer argument, held for the lifetime of an operation.
struct Buf {
  std::unique_ptr<py::buffer_info> info;
  DType dt = DType::kUInt8;
  size_t count = 0;
  size_t bytes = 0;
  uint8_t* ptr = nullptr;
};

std::optional<DType> dtype_from_format(const std::string& fmt0, ssize_t itemsize) {
  std::string fmt = fmt0;
  while (!fmt.empty() && std::strchr("@=<>!", fmt[0])) fmt.erase(0, 1);
  if (fmt.size() != 1) return std::nullopt;
  char c = fmt[0];
  if (c == 'f' && itemsize == 4) return DType::kFloat32;
  if (c == 'd' && itemsize == 8) return DType::kFloat64;
  if (c == 'e' && itemsize == 2) return DType::kFloat16;
  if (std::strchr("ilqn", c)) {
    if (itemsize == 4) return DType::kInt32;
    if (itemsize == 8) return DType::kInt64;
  }
  if (c == 'B' && itemsize == 1) return DType::kUInt8;
  return std::nullopt;
}

Buf get_buf(const py::buffer& b, std::optional<DType> dt, bool writable, const char* what, bool raw = false) {
  Buf out;
  out.info = std::make_unique<py::buffer_info>(b.request(writable));
  py::buffer_info& info = *out.info;
  if (!PyBuffer_IsContiguous(info.view(), 'C'))
    throw py::value_error(std::string(what) + ": buffer must be C-contiguous");
  out.bytes = size_t(info.size) * size_t(info.itemsize);
  out.ptr = static_cast<uint8_t*>(info.ptr);
  if (raw) {  // point-to-point: any contiguous buffer, as bytes
    out.dt = DType::kUInt8;
    out.count = out.bytes;
    return out;
  }
  if (dt) {
    out.dt = *dt;
    size_t es = tmrun::dtype_size(*dt);
    bool bytes_like = info.itemsize == 1;
    if (size_t(info.itemsize) != es && !(bytes_like && out.bytes % es == 0))
      throw py::value_error(std::string(what) + ": buffer item size " + std::to_string(info.itemsize) +
                            " does not match dtype " + tmrun::dtype_name(*dt));
  } else {
    auto d = dtype_from_format(info.format, info.itemsize);
    if (!d)
      throw py::value_error(std::string(what) + ": cannot infer dtype from buffer format '" + info.format +
                            "'; pass dtype=")
          ;
    out.dt = *d;
  }
  size_t es = tmrun::dtype_size(out.dt);
  out.count = out.bytes / es;
  if (out.bytes && reinterpret_cast<uintptr_t>(out.ptr) % es != 0)
    throw py::value_error(std::string(what) + ": buffer is not aligned to its element size");
  return out;
}

// A pending operation. Holds the buffers (and the communicator) until the operation is over;
// dropping an unfinished Work waits for it (with the GIL released).
struct Work {
  std::shared_ptr<tmrun::tcp::OpState> st;
  std::vector<std::unique_ptr<py::buffer_info>> bufs;
  py::object keep;
  Work() = default;
  Work(const Work&) = delete;
  ~Work() {
    if (st && !st->done()) {
      tmrun::NoGil r;
      st->wait(-1);
    }
  }
  bool wait(std::optional<double> timeout) {
    bool ok;
    {
      tmrun::NoGil r;
      ok = st->wait(timeout ? *timeout : -1.0);
    }
    if (!ok) return false;
    if (auto e = st->error()) std::rethrow_exception(e);
    return true;
  }
};

using Comm = tmrun::tcp::Communicator;
using Options = tmrun::tcp::Options;

// Queues an operation: `start` calls one of the communicator's *_async methods. The Work holds the
// buffers (and the communicator) before the operation can start.
template <typename Start>
std::unique_ptr<Work> launch(py::object self, Start&& start, std::vector<Buf*> bufs) {
  auto w = std::make_unique<Work>();
  for (Buf* b : bufs) w->bufs.push_back(std::move(b->info));
  w->keep = self;
  w->st = start(self.cast<Comm&>());
  return w;
}

void finish(std::unique_ptr<Work> w) { w->wait(std::nullopt); }

// The operations. Each returns the Work of the queued operation; the blocking form of the
// binding is the same call followed by a wait (see sync()).
std::unique_ptr<Work> allreduce_async(py::object self, py::buffer buf, ReduceOp op, std::optional<DType> dtype) {
  Buf b = get_buf(buf, dtype, true, "allreduce");
  return launch(self, [&](Comm& c) { return c.allreduce_async(b.ptr, b.count, b.dt, op); }, {&b});
}

std::unique_ptr<Work> broadcast_async(py::object self, py::buffer buf, int root, std::optional<DType> dtype) {
  Buf b = get_buf(buf, dtype, true, "broadcast");
  return launch(self, [&](Comm& c) { return c.broadcast_async(b.ptr, b.count, b.dt, root); }, {&b});
}

std::unique_ptr<Work> allgather_async(py::object self, py::buffer output, py::buffer input, std::optional<DType> dtype) {
  Buf o = get_buf(output, dtype, true, "allgather output");
  Buf i = get_buf(input, dtype ? dtype : std::optional<DType>(o.dt), false, "allgather input");
  if (o.bytes != i.bytes * size_t(self.cast<Comm&>().world_size()))
    throw py::value_error("allgather: output must hold world_size * input elements");
  return launch(self, [&](Comm& c) { return c.allgather_async(o.ptr, i.ptr, i.count, o.dt); }, {&o, &i});
}

std::unique_ptr<Work> reduce_scatter_async(py::object self, py::buffer output, py::buffer input, ReduceOp rop,
                                           std::optional<DType> dtype) {
  Buf o = get_buf(output, dtype, true, "reduce_scatter output");
  Buf i = get_buf(input, dtype ? dtype : std::optional<DType>(o.dt), false, "reduce_scatter input");
  if (i.bytes != o.bytes * size_t(self.cast<Comm&>().world_size()))
    throw py::value_error("reduce_scatter: input must hold world_size * output elements");
  return launch(self, [&](Comm& c) { return c.reduce_scatter_async(o.ptr, i.ptr, o.count, o.dt, rop); }, {&o, &i});
}

std::unique_ptr<Work> barrier_async(py::object self) {
  return launch(self, [](Comm& c) { return c.barrier_async(); }, {});
}

std::unique_ptr<Work> send_async(py::object self, py::buffer buf, int dst, uint32_t tag) {
  Buf b = get_buf(buf, std::nullopt, false, "send", true);
  return launch(self, [&](Comm& c) { return c.send_async(b.ptr, b.bytes, dst, tag); }, {&b});
}

std::unique_ptr<Work> recv_async(py::object self, py::buffer buf, int src, uint32_t tag) {
  Buf b = get_buf(buf, std::nullopt, true, "recv", true);
  return launch(self, [&](Comm& c) { return c.recv_async(b.ptr, b.bytes, src, tag); }, {&b});
}

// items: (is_send, buffer, peer) tuples, one operation (see Communicator::p2p_batch_async).
std::unique_ptr<Work> p2p_batch_async(py::object self, py::list items, uint32_t tag) {
  std::vector<Buf> bufs;
  bufs.reserve(items.size());
  std::vector<Comm::P2PItem> list;
  for (py::handle h : items) {
    auto t = h.cast<py::tuple>();
    if (t.size() != 3) throw py::value_error("p2p_batch: each item is (is_send, buffer, peer)");
    bool is_send = t[0].cast<bool>();
    bufs.push_back(get_buf(t[1].cast<py::buffer>(), std::nullopt, !is_send, is_send ? "send" : "recv", true));
    list.push_back({is_send, bufs.back().ptr, bufs.back().bytes, t[2].cast<int>()});
  }
  std::vector<Buf*> ptrs;
  for (Buf& b : bufs) ptrs.push_back(&b);
  return launch(self, [&](Comm& c) { return c.p2p_batch_async(std::move(list), tag); }, ptrs);
}

std::unique_ptr<Work> commit_async(py::object self) {
  return launch(self, [](Comm& c) { return c.commit_async(); }, {});
}

// The blocking binding of an *_async operation: the same arguments, waits, returns None.
template <typename... Args>
auto sync(std::unique_ptr<Work> (*op)(py::object, Args...)) {
  return [op](py::object self, Args... args) { finish(op(std::move(self), std::move(args)...)); };
}

}  // namespace

void bind_comm(py::module_& m) {
  g_comm_error = new_exc(m, "CommError", PyExc_RuntimeError, "A communicator operation failed.");
  g_peer_lost = new_exc(m, "PeerLostError", g_comm_error,
                        "A peer died, reset, stopped answering or was reported lost. Attributes: peer (rank), "
                        "epoch, reporter (rank that observed it).");
  g_protocol = new_exc(m, "ProtocolError", g_comm_error,
                       "A malformed or foreign frame arrived; the link to `peer` was closed.");
  {
    py::tuple bases = py::make_tuple(py::handle(g_comm_error), py::handle(PyExc_TimeoutError));
    g_timeout = PyErr_NewExceptionWithDoc("tmrun_native.CommTimeoutError", "An operation exceeded op_timeout.",
                                          bases.ptr(), nullptr);
    m.add_object("CommTimeoutError", py::reinterpret_borrow<py::object>(g_timeout));
  }
  g_auth = new_exc(m, "AuthenticationError", g_comm_error,
                   "A link failed the job token's challenge-response (a different job token, or none).");
  g_frame_error = new_exc(m, "FrameError", PyExc_ValueError, "Bytes that are not a valid tmrun frame.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tmrun::CommError&) {
      auto te = to_python(p);
      PyErr_SetObject(te.first, te.second.ptr());
    }
  });

  py::enum_<DType>(m, "DType", "Element type of a buffer.")
      .value("FLOAT32", DType::kFloat32)
      .value("FLOAT64", DType::kFloat64)
      .value("FLOAT16", DType::kFloat16)
      .value("BFLOAT16", DType::kBFloat16)
      .value("INT32", DType::kInt32)
      .value("INT64", DType::kInt64)
      .value("UINT8", DType::kUInt8);
  py::enum_<ReduceOp>(m, "ReduceOp", "Reduction operator.")
      .value("SUM", ReduceOp::kSum)
      .value("AVG", ReduceOp::kAvg)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax)
      .value("PRODUCT", ReduceOp::kProduct);

  py::class_<Options>(m, "Options", "Communicator options (all keyword arguments).")
      .def(py::init([](py::kwargs kw) {
             Options o;
             py::object obj = py::cast(o);
             for (auto item : kw) {
               std::string k = py::str(item.first);
               if (!py::hasattr(obj, k.c_str())) throw py::type_error("unknown option '" + k + "'");
               obj.attr(k.c_str()) = item.second;
             }
             return obj.cast<Options>();
           }))
      .def_readwrite("bind_address", &Options::bind_address)
      .def_readwrite("port", &Options::port)
      .def_readwrite("advertise_host", &Options::advertise_host)
      .def_readwrite("timeout", &Options::timeout)
      .def_readwrite("connect_timeout", &Options::connect_timeout)
      .def_readwrite("op_timeout", &Options::op_timeout)
      .def_readwrite("segment_bytes", &Options::segment_bytes)
      .def_readwrite("small_bytes", &Options::small_bytes)
      .def_readwrite("payload_checksum", &Options::payload_checksum)
      .def_readwrite("socket_buffer", &Options::socket_buffer)
      .def_readwrite("heartbeat_interval", &Options::heartbeat_interval)
      .def_property(
          "token", [](const Options& o) { return py::bytes(o.token); },
          [](Options& o, py::object v) {
            if (py::isinstance<py::str>(v))
              o.token = v.cast<std::string>();
            else if (py::isinstance<py::bytes>(v))
              o.token = std::string(v.cast<py::bytes>());
            else if (v.is_none())
              o.token.clear();
            else
              throw py::type_error("token must be bytes or str");
          },
          "Job token (bytes; str is taken as UTF-8): every link proves it by challenge-response before its "
          "first frame. Empty: no authentication.")
      .def("__repr__", [](const Options& o) {
        return "Options(bind_address='" + o.bind_address + "', port=" + std::to_string(o.port) +
               ", timeout=" + std::to_string(o.timeout) + ", segment_bytes=" + std::to_string(o.segment_bytes) + ")";
      });

  py::class_<Work>(m, "Work", "Handle of an asynchronous operation.")
      .def("wait", &Work::wait, py::arg("timeout") = py::none(),
           "Wait up to `timeout` seconds (None: until done). Returns True when finished, False on timeout; "
           "raises the operation's error.")
      .def("done", [](const Work& w) { return w.st->done(); })
      .def("exception", [](const Work& w) -> py::object {
        if (!w.st->done() || !w.st->error()) return py::none();
        return to_python(w.st->error()).second;
      }, "The operation's exception once it finished with one, else None.");

  py::class_<Comm>(m, "Communicator", R"doc(
TCP communicator of `world_size` ranks. Listens at construction; `connect(addresses)` builds the
ring-neighbour links. Collectives operate in place on C-contiguous Python buffers (numpy arrays,
torch CPU tensors through .numpy(), bytearray); dtype is inferred from the buffer format or given
explicitly (required for bfloat16). Every blocking call releases the GIL; *_async variants return
a Work. Operations run in submission order on the communicator's worker thread.)doc")
      .def(py::init([](int rank, int world_size, const std::string& job_id, uint64_t epoch,
                       std::optional<Options> options) {
             return std::make_unique<Comm>(rank, world_size, job_id, epoch, options ? *options : Options{});
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("job_id"), py::arg("epoch") = 0,
           py::arg("options") = py::none())
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("epoch", &Comm::epoch)
      .def_property_readonly("port", &Comm::port)
      .def_property_readonly("address", &Comm::address)
      .def_property_readonly("job_id", &Comm::job_id)
      .def_property_readonly("ring_peers", &Comm::ring_peers)
      .def_property_readonly("options", &Comm::options)
      .def("connect", &Comm::connect, py::arg("addresses"), py::call_guard<tmrun::NoGil>(),
           "Build the links of this epoch (addresses[r] = 'host:port' of rank r). Joiners call this too.")
      // ---- collectives and point to point: each sync form is its *_async form, waited for
      .def("allreduce_async", &allreduce_async, py::arg("buf"), py::arg("op") = ReduceOp::kSum,
           py::arg("dtype") = py::none())
      .def("allreduce", sync(&allreduce_async), py::arg("buf"), py::arg("op") = ReduceOp::kSum,
           py::arg("dtype") = py::none(), "In-place allreduce; every rank ends with identical bits.")
      .def("broadcast_async", &broadcast_async, py::arg("buf"), py::arg("root"), py::arg("dtype") = py::none())
      .def("broadcast", sync(&broadcast_async), py::arg("buf"), py::arg("root"), py::arg("dtype") = py::none())
      .def("allgather_async", &allgather_async, py::arg("output"), py::arg("input"), py::arg("dtype") = py::none())
      .def("allgather", sync(&allgather_async), py::arg("output"), py::arg("input"), py::arg("dtype") = py::none(),
           "output = concatenation of every rank's input, in rank order.")
      .def("reduce_scatter_async", &reduce_scatter_async, py::arg("output"), py::arg("input"),
           py::arg("op") = ReduceOp::kSum, py::arg("dtype") = py::none())
      .def("reduce_scatter", sync(&reduce_scatter_async), py::arg("output"), py::arg("input"),
           py::arg("op") = ReduceOp::kSum, py::arg("dtype") = py::none(),
           "output = block `rank` of the elementwise reduction of every rank's input (world_size blocks).")
      .def("barrier_async", &barrier_async)
      .def("barrier", sync(&barrier_async))
      .def("send_async", &send_async, py::arg("buf"), py::arg("dst"), py::arg("tag") = 0)
      .def("send", sync(&send_async), py::arg("buf"), py::arg("dst"), py::arg("tag") = 0,
           "Send the buffer's bytes to rank dst (links to non-neighbours are opened on first use).")
      .def("recv_async", &recv_async, py::arg("buf"), py::arg("src"), py::arg("tag") = 0)
      .def("recv", sync(&recv_async), py::arg("buf"), py::arg("src"), py::arg("tag") = 0,
           "Receive exactly len(buf) bytes from rank src (sizes and tags must match the send).")
      .def("p2p_batch_async", &p2p_batch_async, py::arg("items"), py::arg("tag") = 0,
           "Sends and receives as one operation: items are (is_send, buffer, peer); they move together "
           "(batch_isend_irecv), in order per peer and direction.")
      // ---- replacement
      .def("prepare",
           [](Comm& c, const std::vector<int>& replaced, py::object new_addresses, uint64_t new_epoch) {
             std::map<int, std::string> addrs;
             if (py::isinstance<py::dict>(new_addresses)) {
               for (auto kv : new_addresses.cast<py::dict>())
                 addrs[kv.first.cast<int>()] = kv.second.cast<std::string>();
             } else if (!new_addresses.is_none()) {
               auto lst = new_addresses.cast<std::vector<std::string>>();
               for (int r : replaced)
                 if (r >= 0 && size_t(r) < lst.size()) addrs[r] = lst[size_t(r)];
             }
             tmrun::NoGil rel;
             c.prepare(replaced, addrs, new_epoch);
           },
           py::arg("replaced_ranks"), py::arg("new_addresses"), py::arg("new_epoch"),
           "Phase 1 of replacement (call on every surviving rank): links to the joiners of `replaced_ranks` "
           "(new_addresses: {rank: 'host:port'} or a full list) are built in the background.")
      .def("prepare_done", &Comm::prepare_done, "True once prepare's background connections finished.")
      .def("cancel_prepare",
           [](Comm& c) {
             tmrun::NoGil rel;
             return c.cancel_prepare();
           },
           "End the pending prepare's dials and waits now if its links are not ready (any thread): a commit "
           "waiting for them raises CommError at once. Returns whether there was one to end.")
      .def("commit_async", &commit_async)
      .def("commit", sync(&commit_async),
           "Phase 2 (every surviving rank): after the operations queued before it, close the links to "
           "replaced ranks, install the prepared ones, switch to the new epoch and resynchronise every link.")
      // ---- introspection
      .def("links",
           [](const Comm& c) {
             py::list out;
             for (auto& l : c.links()) {
               py::dict d;
               d["peer"] = l.peer;
               d["id"] = l.id;
               d["opened_epoch"] = l.opened_epoch;
               d["ring"] = l.ring;
               d["open"] = l.open;
               d["bytes_sent"] = l.bytes_sent;
               d["bytes_recv"] = l.bytes_recv;
               d["frames_sent"] = l.frames_sent;
               d["frames_recv"] = l.frames_recv;
               d["error"] = l.error;
               out.append(d);
             }
             return out;
           },
           "One dict per link: peer, id (stable identity), opened_epoch, ring, open, bytes/frames sent/recv, error.")
      .def("counters",
           [](const Comm& c) {
             auto k = c.counters();
             py::dict d, per;
             d["links_opened"] = k.links_opened;
             d["links_closed"] = k.links_closed;
             d["collectives"] = k.collectives;
             d["p2p_ops"] = k.p2p_ops;
             d["bytes_sent"] = k.bytes_sent;
             d["bytes_recv"] = k.bytes_recv;
             d["rejected_connections"] = k.rejected_connections;
             d["auth_failures"] = k.auth_failures;
             d["commits"] = k.commits;
             d["prepares_superseded"] = k.prepares_superseded;
             d["last_reject_reason"] = k.last_reject_reason;
             for (auto& kv : k.per_peer) {
               py::dict pp;
               pp["bytes_sent"] = kv.second.first;
               pp["bytes_recv"] = kv.second.second;
               per[py::int_(kv.first)] = pp;
             }
             d["per_peer"] = per;
             return d;
           })
      .def("failure", &Comm::failure, "Sticky failure of the current epoch ('' when healthy).")
      .def(
          "wait_failure",
          [](const Comm& c, double timeout, int64_t ignore_epoch) -> py::object {
            if (!(timeout >= 0.0) || timeout > 86400.0) throw std::invalid_argument("timeout must be in [0, 86400] s");
            tmrun::tcp::FailureInfo info;
            bool found;
            {
              tmrun::NoGil r;
              found = c.wait_failure(timeout, ignore_epoch, &info);
            }
            if (!found) return py::none();
            return py::make_tuple(info.epoch, info.peer, info.protocol, info.message);
          },
          py::arg("timeout"), py::arg("ignore_epoch") = -1,
          "Waits up to timeout s for a failure recorded in an epoch other than ignore_epoch (-1: any): "
          "(epoch, lost rank or -1, protocol error, message), or None (timeout, closed).")
      .def("close", &Comm::close, py::call_guard<tmrun::NoGil>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](Comm& c, py::args) {
        tmrun::NoGil r;
        c.close();
      })
      .def("_debug_vanish", &Comm::debug_vanish, py::call_guard<tmrun::NoGil>(),
           "Test hook: close without the goodbye, as a killed process ends its connections.")
      .def("_debug_send_raw",
           [](Comm& c, int peer, py::bytes data) {
             std::string s = data;
             tmrun::NoGil r;
             c.debug_send_raw(peer, s);
           },
           "Test hook: write raw bytes on the link to `peer`, bypassing framing.");

  // ---- frame codec (pure functions, for tests and tools)
  m.attr("FRAME_HEADER_SIZE") = tmrun::kHeaderSize;
  m.attr("WIRE_VERSION") = tmrun::kWireVersion;
  m.def("job_hash", &tmrun::job_hash, py::arg("job_id"));
  m.def(
      "encode_frame",
      [](int type, py::bytes payload, const std::string& job_id, uint64_t epoch, uint64_t seq, uint32_t tag,
         bool checksum) {
        std::string pl = payload;
        if (type < 1 || type > 7) throw py::value_error("bad frame type");
        tmrun::FrameHeader h;
        h.type = static_cast<tmrun::FrameType>(type);
        h.tag = tag;
        h.job_hash = tmrun::job_hash(job_id);
        h.epoch = epoch;
        h.seq = seq;
        h.length = pl.size();
        if (checksum) {
          h.flags = tmrun::kFlagPayloadCrc;
          h.payload_crc = tmrun::crc32c(0, pl.data(), pl.size());
        }
        std::string out(tmrun::kHeaderSize, '\0');
        tmrun::encode_header(h, reinterpret_cast<uint8_t*>(out.data()));
        out += pl;
        return py::bytes(out);
      },
      py::arg("type"), py::arg("payload") = py::bytes(), py::arg("job_id") = "", py::arg("epoch") = 0,
      py::arg("seq") = 1, py::arg("tag") = 0, py::arg("checksum") = true,
      "Encode one frame (type: 1 data, 2 hello, 3 hello_ack, 4 heartbeat, 5 abort, 6 sync, 7 reject).");
  m.def(
      "parse_frame",
      [](py::buffer data, std::optional<std::string> job_id) {
        py::buffer_info info = data.request();
        size_t n = size_t(info.size) * size_t(info.itemsize);
        // The parser reads n bytes from ptr: a strided view (memoryview(b)[::2], [::-1]) would
        // make it read other bytes than the view's, or before or past its object.
        ssize_t step = info.itemsize;
        for (ssize_t i = info.ndim - 1; i >= 0; --i) {
          if (info.shape[size_t(i)] > 1 && info.strides[size_t(i)] != step)
            throw py::type_error("parse_frame needs a C-contiguous buffer");
          step *= info.shape[size_t(i)];
        }
        const auto* p = static_cast<const uint8_t*>(info.ptr);
        tmrun::FrameHeader h;
        std::string err;
        if (!tmrun::parse_header(p, n, job_id ? tmrun::job_hash(*job_id) : 0, &h, &err))
        {
          PyErr_SetString(g_frame_error, err.c_str());
          throw py::error_already_set();
        }
        py::dict d;
        d["type"] = tmrun::frame_type_name(h.type);
        d["type_id"] = int(h.type);
        d["version"] = h.version;
        d["flags"] = h.flags;
        d["tag"] = h.tag;
        d["job_hash"] = h.job_hash;
        d["epoch"] = h.epoch;
        d["seq"] = h.seq;
        d["length"] = h.length;
        d["payload_crc"] = h.payload_crc;
        size_t have = n - tmrun::kHeaderSize;
        d["complete"] = have >= h.length;
        if (have >= h.length && (h.flags & tmrun::kFlagPayloadCrc)) {
          if (tmrun::crc32c(0, p + tmrun::kHeaderSize, size_t(h.length)) != h.payload_crc) {
            PyErr_SetString(g_frame_error, "payload checksum mismatch");
            throw py::error_already_set();
          }
        }
        return d;
      },
      py::arg("data"), py::arg("job_id") = py::none(),
      "Parse and validate one frame header (and payload checksum when the payload is present). "
      "Raises FrameError for anything malformed; never crashes.");
}
