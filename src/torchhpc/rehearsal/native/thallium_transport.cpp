// _torchhpc_thallium: the Thallium transport of torchhpc.rehearsal (built by `make native-mochi`).
//
// Each rank runs one Thallium engine (server mode, with its own Argobots progress execution stream, in
// which RPCs are also served; the Margo JSON configuration comes from Python) and exposes its record block -- the same memory SlotStorage reads and writes --
// as a read-only bulk region.  A reader asks an owner for records with one RPC per owner, carrying a
// bulk handle of the reader's staging rows; the owner's RPC stream takes the block's lock in shared mode
// and pushes each requested record with a bulk transfer from the exposed block into the reader's rows,
// then releases the lock and answers.  The owner's Python threads take no part: Argobots serves the RPC.
// (While the owner's writer holds the lock, handlers wait for it by yielding; an update is a few
// record copies long.)
//
// No torn records: the owner's writer (SlotStorage.write/load) holds the same lock exclusively while it
// rewrites records and fill counts, and a push reads a record only while holding it shared, so a record
// arrives either wholly before or wholly after an update -- the guarantee the MPI transport gets from
// its exclusive/shared passive-target epochs.  A one-sided pull by the reader could not take the owner's
// lock, and RDMA reads give no ordering within a record that a version check (seqlock) could rely on.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <thallium.hpp>
#include <thallium/serialization/stl/string.hpp>
#include <thallium/serialization/stl/vector.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace tl = thallium;

namespace {

struct PeerTimeout : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct PeerError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A peer that cannot be reached at all (its engine is gone: closed, or its process died).  Messages
// start with "rank <r> " so callers can name the failed rank.
struct PeerUnreachable : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Status codes an owner answers with (0: ok).
constexpr int kOk = 0;
constexpr int kBadSlot = 1;
constexpr int kTooLarge = 2;
constexpr int kClosed = 3;
constexpr int kTransfer = 4;

// The block lock taken shared inside an RPC handler: it never blocks the execution stream (which also
// drives progress, and may be running another handler that holds the lock while its transfers complete);
// while the owner's writer holds it, the handler yields to the other work of its stream and retries.
class SharedHold {
  public:
    explicit SharedHold(std::shared_mutex& m) : m_m(m) {
        while (!m_m.try_lock_shared()) tl::thread::yield();
    }
    ~SharedHold() { m_m.unlock_shared(); }
    SharedHold(const SharedHold&) = delete;
    SharedHold& operator=(const SharedHold&) = delete;

  private:
    std::shared_mutex& m_m;
};

class Transport {
  public:
    Transport(const std::string& protocol, std::uintptr_t base, std::size_t nbytes, std::size_t header_bytes,
              std::size_t record_bytes, std::size_t num_classes, std::size_t max_records, const std::string& config)
    : m_base(reinterpret_cast<char*>(base)), m_nbytes(nbytes), m_header_bytes(header_bytes),
      m_record_bytes(record_bytes), m_num_classes(num_classes), m_max_records(std::max<std::size_t>(max_records, 1)),
      m_staging(m_max_records * record_bytes) {
        if (m_base == nullptr || record_bytes == 0 || header_bytes < 8 * num_classes || nbytes < header_bytes)
            throw std::invalid_argument("Transport: inconsistent storage layout");
        m_num_slots = (nbytes - header_bytes) / record_bytes;
        m_engine = std::make_unique<tl::engine>(protocol, THALLIUM_SERVER_MODE, config);
        std::vector<std::pair<void*, std::size_t>> block{{m_base, m_nbytes}};
        m_block = m_engine->expose(block, tl::bulk_mode::read_only);
        std::vector<std::pair<void*, std::size_t>> staging{{m_staging.data(), m_staging.size()}};
        m_staging_bulk = m_engine->expose(staging, tl::bulk_mode::write_only);
        m_fills_rpc_ = m_engine->define("torchhpc_rehearsal_fills", [this](const tl::request& req) { serve_fills(req); });
        m_read_rpc_ = m_engine->define(
            "torchhpc_rehearsal_read",
            [this](const tl::request& req, const std::vector<std::uint64_t>& slots, tl::bulk& dest, std::uint64_t start) {
                serve_read(req, slots, dest, start);
            });
    }

    ~Transport() { close(); }

    std::string address() const { return static_cast<std::string>(m_engine->self()); }

    void connect(const std::vector<std::string>& addresses, int me) {
        m_peers.clear();
        m_me = me;
        for (std::size_t r = 0; r < addresses.size(); ++r)
            m_peers.push_back(static_cast<int>(r) == me ? tl::endpoint() : m_engine->lookup(addresses[r]));
    }

    // The owner's writer: exclusive while records and fills are rewritten (GIL released while waiting).
    void lock_exclusive() {
        py::gil_scoped_release nogil;
        m_lock.lock();
    }
    void unlock_exclusive() { m_lock.unlock(); }

    // Fill counts of `ranks`, one RPC each, all in flight at once; (len(ranks), K) int64.
    py::array_t<std::int64_t> fills(const std::vector<int>& ranks, double timeout_s) {
        py::array_t<std::int64_t> out({ranks.size(), m_num_classes});
        std::vector<std::vector<std::int64_t>> got(ranks.size());
        {
            py::gil_scoped_release nogil;
            auto limit = to_duration(timeout_s);
            std::vector<tl::async_response> pending;
            pending.reserve(ranks.size());
            for (int r : ranks) pending.push_back(m_fills_rpc_->on(peer(r)).timed_async(limit));
            for (std::size_t i = 0; i < ranks.size(); ++i) {
                try {
                    got[i] = pending[i].wait().as<std::vector<std::int64_t>>();
                } catch (const tl::timeout&) {
                    throw PeerTimeout("rank " + std::to_string(ranks[i]) + " did not answer a fill-count request within " +
                                      seconds(timeout_s) + " s (stuck or dead?)");
                } catch (const tl::exception& e) {
                    throw PeerUnreachable("rank " + std::to_string(ranks[i]) + " is unreachable (" + e.what() +
                                          "): its buffer is closed or its process died");
                }
                if (got[i].size() != m_num_classes)
                    throw PeerError("rank " + std::to_string(ranks[i]) + " answered " + std::to_string(got[i].size()) +
                                    " fill counts, expected " + std::to_string(m_num_classes) + " (closed or other layout)");
            }
        }
        auto view = out.mutable_unchecked<2>();
        for (std::size_t i = 0; i < ranks.size(); ++i)
            for (std::size_t k = 0; k < m_num_classes; ++k) view(i, k) = got[i][k];
        return out;
    }

    // Fetch record slots[i] of rank ranks[i] into row i of every output field, for every i not ours.
    // fields: (array of shape (rows, nbytes) uint8 C-contiguous, byte offset of the field in a record).
    std::size_t read(py::array_t<std::int64_t, py::array::c_style> ranks, py::array_t<std::int64_t, py::array::c_style> slots,
                     const std::vector<std::pair<py::array_t<std::uint8_t, py::array::c_style>, std::size_t>>& fields,
                     double timeout_s) {
        const std::size_t n = static_cast<std::size_t>(ranks.size());
        if (static_cast<std::size_t>(slots.size()) != n) throw std::invalid_argument("ranks and slots differ in length");
        struct Dest { char* data; std::size_t row_stride; std::size_t offset; std::size_t nbytes; };
        std::vector<Dest> dests;
        for (const auto& [arr, offset] : fields) {
            if (arr.ndim() != 2 || static_cast<std::size_t>(arr.shape(0)) < n)
                throw std::invalid_argument("each output field must be a (rows >= draws, bytes) uint8 array");
            auto nbytes = static_cast<std::size_t>(arr.shape(1));
            if (offset + nbytes > m_record_bytes) throw std::invalid_argument("output field lies outside the record");
            dests.push_back({static_cast<char*>(const_cast<void*>(static_cast<const void*>(arr.data()))),
                             static_cast<std::size_t>(arr.strides(0)), offset, nbytes});
        }
        const std::int64_t* rk = ranks.data();
        const std::int64_t* sl = slots.data();
        std::size_t total = 0;
        py::gil_scoped_release nogil;
        auto limit = to_duration(timeout_s);
        // Group the wanted rows by owner; each owner's records land in a contiguous run of staging rows.
        std::vector<std::vector<std::size_t>> rows(m_peers.size());
        for (std::size_t i = 0; i < n; ++i) {
            if (rk[i] == m_me) continue;
            if (rk[i] < 0 || static_cast<std::size_t>(rk[i]) >= m_peers.size())
                throw std::invalid_argument("rank " + std::to_string(rk[i]) + " out of range");
            rows[rk[i]].push_back(i);
        }
        for (std::size_t start = 0; start < n;) {  // staging holds max_records: go in rounds if more are wanted
            std::vector<std::pair<int, std::vector<std::size_t>>> round;
            std::size_t used = 0;
            for (std::size_t r = 0; r < rows.size() && used < m_max_records; ++r) {
                if (rows[r].empty()) continue;
                std::size_t take = std::min(rows[r].size(), m_max_records - used);
                std::vector<std::size_t> mine(rows[r].begin(), rows[r].begin() + take);
                rows[r].erase(rows[r].begin(), rows[r].begin() + take);
                used += take;
                round.emplace_back(static_cast<int>(r), std::move(mine));
            }
            if (round.empty()) break;
            std::vector<tl::async_response> pending;
            std::size_t at = 0;
            for (auto& [r, idx] : round) {
                std::vector<std::uint64_t> wanted;
                wanted.reserve(idx.size());
                for (auto i : idx) wanted.push_back(static_cast<std::uint64_t>(sl[i]));
                tl::bulk seg = m_staging_bulk;  // the owner pushes into rows [at, at + len) of our staging
                pending.push_back(m_read_rpc_->on(peer(r)).timed_async(limit, wanted, seg, static_cast<std::uint64_t>(at)));
                at += idx.size();
            }
            at = 0;
            for (std::size_t j = 0; j < round.size(); ++j) {
                int status;
                try {
                    status = pending[j].wait().as<int>();
                } catch (const tl::timeout&) {
                    throw PeerTimeout("rank " + std::to_string(round[j].first) + " did not serve a record read within " +
                                      seconds(timeout_s) + " s (stuck or dead?)");
                } catch (const tl::exception& e) {
                    throw PeerUnreachable("rank " + std::to_string(round[j].first) + " is unreachable (" + e.what() +
                                          "): its buffer is closed or its process died");
                }
                if (status != kOk)
                    throw PeerError("rank " + std::to_string(round[j].first) + " refused a record read (" + status_text(status) + ")");
                for (std::size_t q = 0; q < round[j].second.size(); ++q) {
                    const char* rec = m_staging.data() + (at + q) * m_record_bytes;
                    std::size_t row = round[j].second[q];
                    for (const auto& d : dests) {
                        std::memcpy(d.data + row * d.row_stride, rec + d.offset, d.nbytes);
                        total += d.nbytes;
                    }
                }
                at += round[j].second.size();
            }
            start += used;
        }
        return total;
    }

    void close() {
        if (!m_engine) return;
        py::gil_scoped_release nogil;
        m_closed.store(true);
        m_peers.clear();
        if (m_fills_rpc_) m_fills_rpc_->deregister();
        if (m_read_rpc_) m_read_rpc_->deregister();
        m_fills_rpc_.reset();
        m_read_rpc_.reset();
        m_block = tl::bulk();
        m_staging_bulk = tl::bulk();
        m_engine->finalize();
        m_engine.reset();
    }

  private:
    static std::chrono::milliseconds to_duration(double s) {
        if (!(s > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
        return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000.0 + 0.5));
    }

    static std::string seconds(double s) {
        char text[32];
        std::snprintf(text, sizeof text, "%.3g", s);
        return text;
    }

    static std::string status_text(int status) {
        switch (status) {
            case kBadSlot: return "slot out of range: the ranks disagree on the buffer layout";
            case kTooLarge: return "more records than the reader's staging rows";
            case kClosed: return "its buffer is closed";
            case kTransfer: return "a bulk transfer failed";
            default: return "status " + std::to_string(status);
        }
    }

    const tl::endpoint& peer(int r) const {
        if (r < 0 || static_cast<std::size_t>(r) >= m_peers.size() || r == m_me)
            throw std::invalid_argument("no peer rank " + std::to_string(r));
        return m_peers[r];
    }

    void serve_fills(const tl::request& req) {
        if (m_closed.load()) {
            req.respond(std::vector<std::int64_t>{});
            return;
        }
        std::vector<std::int64_t> out(m_num_classes);
        {
            SharedHold hold(m_lock);
            std::memcpy(out.data(), m_base, 8 * m_num_classes);
        }
        req.respond(out);
    }

    void serve_read(const tl::request& req, const std::vector<std::uint64_t>& slots, tl::bulk& dest,
                    std::uint64_t start) {
        if (m_closed.load()) {
            req.respond(kClosed);
            return;
        }
        for (auto s : slots)
            if (s >= m_num_slots) {
                req.respond(kBadSlot);
                return;
            }
        if ((start + slots.size()) * m_record_bytes > dest.size()) {
            req.respond(kTooLarge);
            return;
        }
        int status = kOk;
        try {
            tl::remote_bulk remote = dest.on(req.get_endpoint());
            SharedHold hold(m_lock);  // no writer while records leave
            std::vector<tl::async_bulk_op> ops;
            ops.reserve(slots.size());
            for (std::size_t q = 0; q < slots.size(); ++q)
                ops.push_back(m_block.select(m_header_bytes + slots[q] * m_record_bytes, m_record_bytes)
                                  .push_to(remote.select((start + q) * m_record_bytes, m_record_bytes)));
            for (auto& op : ops) op.wait();
        } catch (const std::exception&) {
            status = kTransfer;
        }
        req.respond(status);
    }

    char* m_base;
    std::size_t m_nbytes, m_header_bytes, m_record_bytes, m_num_classes, m_max_records, m_num_slots = 0;
    std::vector<char> m_staging;
    std::unique_ptr<tl::engine> m_engine;
    tl::bulk m_block, m_staging_bulk;
    std::optional<tl::remote_procedure> m_fills_rpc_, m_read_rpc_;
    std::vector<tl::endpoint> m_peers;
    int m_me = -1;
    std::shared_mutex m_lock;
    std::atomic<bool> m_closed{false};
};

}  // namespace

PYBIND11_MODULE(_torchhpc_thallium, m) {
    m.doc() = "Thallium (Mochi) transport of torchhpc.rehearsal: records served by RPC + bulk push under the owner's lock";
    py::register_exception<PeerTimeout>(m, "PeerTimeout", PyExc_TimeoutError);
    py::register_exception<PeerError>(m, "PeerError", PyExc_RuntimeError);
    py::register_exception<PeerUnreachable>(m, "PeerUnreachable", PyExc_ConnectionError);
    m.attr("THALLIUM_VERSION") = THALLIUM_VERSION;
    py::class_<Transport>(m, "Transport")
        .def(py::init<const std::string&, std::uintptr_t, std::size_t, std::size_t, std::size_t, std::size_t, std::size_t,
                      const std::string&>(),
             py::arg("protocol"), py::arg("base"), py::arg("nbytes"), py::arg("header_bytes"), py::arg("record_bytes"),
             py::arg("num_classes"), py::arg("max_records"), py::arg("config"), py::call_guard<py::gil_scoped_release>())
        .def("address", &Transport::address)
        .def("connect", &Transport::connect, py::arg("addresses"), py::arg("me"))
        .def("lock_exclusive", &Transport::lock_exclusive)
        .def("unlock_exclusive", &Transport::unlock_exclusive)
        .def("fills", &Transport::fills, py::arg("ranks"), py::arg("timeout"))
        .def("read", &Transport::read, py::arg("ranks"), py::arg("slots"), py::arg("fields"), py::arg("timeout"))
        .def("close", &Transport::close);
}
