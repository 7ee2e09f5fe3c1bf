// _torchhpc_thallium: the Thallium transport of torchhpc.rehearsal (built by `make native-mochi`).
//
// Each rank runs one Thallium engine (server mode, with its own Argobots progress execution stream, in
// which RPCs are also served; the Margo JSON configuration comes from Python) and exposes its record block
// -- the same memory SlotStorage reads and writes -- as a read-only bulk region.  A reader asks an owner for
// records with one RPC per owner, carrying a bulk handle of its output rows (exposed for that draw); the
// owner's progress stream takes the block's lock in shared mode, pushes each requested record's fields with
// bulk transfers from the exposed block straight into the reader's rows, releases the lock and answers.
// The owner's Python threads take no part.  (While the owner's writer holds the lock, handlers wait for it
// by yielding; an update is a few record copies long.)
//
// No torn records: the owner's writer (SlotStorage.write/load) holds the same lock exclusively while it
// rewrites records and fill counts, and a push reads a record only while holding it shared, so a record
// arrives either wholly before or wholly after an update -- the guarantee the MPI transport gets from
// its exclusive/shared passive-target epochs.  A one-sided pull by the reader could not take the owner's
// lock, and RDMA reads give no ordering within a record that a version check (seqlock) could rely on.
//
// Only the job's own ranks are served: every request carries a secret the ranks agreed over MPI at construction
// (32 random bytes from rank 0), and an owner answers a request without it with kDenied and no data.  Anyone who
// reaches the port (other users' jobs on the network) gets that refusal, never a record.  Every range a request
// names is checked, without overflow, against the block and the reader's region before any transfer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <thallium.hpp>
#include <thallium/serialization/stl/string.hpp>
#include <thallium/serialization/stl/vector.hpp>

#include <algorithm>
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
constexpr int kDenied = 5;
constexpr int kLate = 6;

// Whether [at, at + len) lies within [0, size), computed without overflow.
bool fits(std::uint64_t at, std::uint64_t len, std::uint64_t size) { return len <= size && at <= size - len; }

// Whether every field f of every row lies within the record (offsets[f] + nbytes[f] <= record) and the reader's
// region (bases[f] + (row + 1) * nbytes[f] <= region), with no product or sum wrapping around.
bool ranges_fit(const std::vector<std::uint64_t>& rows, const std::vector<std::uint64_t>& offsets,
                const std::vector<std::uint64_t>& nbytes, const std::vector<std::uint64_t>& bases,
                std::uint64_t record, std::uint64_t region) {
    if (offsets.size() != nbytes.size() || bases.size() != nbytes.size()) return false;
    for (std::size_t f = 0; f < nbytes.size(); ++f) {
        if (!fits(offsets[f], nbytes[f], record)) return false;
        for (auto row : rows) {
            std::uint64_t at = 0;
            if (__builtin_mul_overflow(row, nbytes[f], &at) || __builtin_add_overflow(at, bases[f], &at) ||
                !fits(at, nbytes[f], region))
                return false;
        }
    }
    return true;
}

// Compare two secrets in time that does not depend on where they differ.
bool same_secret(const std::string& a, const std::string& b) {
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

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

// The requester's deadline as a handler sees it: the wait the request carries, counted from the handler's start
// (later than the send, so never before the requester gives up).  Past it the requester has stopped waiting and
// may have closed its engine: a transfer or an answer to it would be retried by Mercury for up to
// NA_OFI_OP_RETRY_TIMEOUT (120 s) over TCP, and closing this engine waits for that handler.  So nothing is sent.
class Deadline {
  public:
    explicit Deadline(std::int64_t wait_ms) : m_until(clock::now() + std::chrono::milliseconds(wait_ms)) {}
    bool passed() const { return clock::now() >= m_until; }
    double left_ms() const { return std::chrono::duration<double, std::milli>(m_until - clock::now()).count(); }

  private:
    using clock = std::chrono::steady_clock;
    clock::time_point m_until;
};

class Transport {
  public:
    Transport(const std::string& protocol, std::uintptr_t base, std::size_t nbytes, std::size_t header_bytes,
              std::size_t record_bytes, std::size_t num_classes, const std::string& config, const std::string& secret)
    : m_base(reinterpret_cast<char*>(base)), m_nbytes(nbytes), m_header_bytes(header_bytes),
      m_record_bytes(record_bytes), m_num_classes(num_classes), m_secret(secret) {
        if (m_base == nullptr || record_bytes == 0 || header_bytes < 8 * num_classes || nbytes < header_bytes)
            throw std::invalid_argument("Transport: inconsistent storage layout");
        if (secret.size() < 16) throw std::invalid_argument("Transport: the job's secret must be at least 16 bytes");
        m_num_slots = (nbytes - header_bytes) / record_bytes;
        m_engine = std::make_unique<tl::engine>(protocol, THALLIUM_SERVER_MODE, config);
        std::vector<std::pair<void*, std::size_t>> block{{m_base, m_nbytes}};
        m_block = m_engine->expose(block, tl::bulk_mode::read_only);
        m_fills_rpc_ = m_engine->define(
            "torchhpc_rehearsal_fills", [this](const tl::request& req, const std::string& token, std::int64_t wait_ms) {
                serve_fills(req, token, Deadline(wait_ms));
            });
        m_read_rpc_ = m_engine->define(
            "torchhpc_rehearsal_read",
            [this](const tl::request& req, const std::string& token, std::int64_t wait_ms,
                   const std::vector<std::uint64_t>& slots, const std::vector<std::uint64_t>& rows,
                   const std::vector<std::uint64_t>& offsets, const std::vector<std::uint64_t>& nbytes,
                   const std::vector<std::uint64_t>& bases, tl::bulk& dest) {
                serve_read(req, token, Deadline(wait_ms), slots, rows, offsets, nbytes, bases, dest);
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
        for (int r : ranks) peer(r);  // a rank out of range is the caller's error, raised before anything is sent
        {
            py::gil_scoped_release nogil;
            await_all(
                "a fill-count request", ranks, timeout_s,
                [&](int r, std::chrono::milliseconds limit) { return m_fills_rpc_->on(peer(r)).timed_async(limit, m_secret, limit.count()); },
                [&](std::size_t i, const tl::packed_data<>& answer) -> std::string {
                    got[i] = answer.as<std::vector<std::int64_t>>();
                    if (got[i].size() == 1 && got[i][0] == -kDenied) return status_text(kDenied);
                    if (got[i].size() != m_num_classes)
                        return "answered " + std::to_string(got[i].size()) + " fill counts, expected " +
                               std::to_string(m_num_classes) + ": closed or another layout";
                    return "";
                });
        }
        auto view = out.mutable_unchecked<2>();
        for (std::size_t i = 0; i < ranks.size(); ++i)
            for (std::size_t k = 0; k < m_num_classes; ++k) view(i, k) = got[i][k];
        return out;
    }

    // Fetch record slots[i] of rank ranks[i] into row i of every output field, for every i not ours.
    // fields: (uint8 array of shape (rows >= n, nbytes), C-contiguous and writable; byte offset of the field in a
    // record).  The output rows are exposed as one bulk region (a segment per field) for this call, and each owner
    // pushes its records' fields straight into their rows: one copy, no staging.
    std::size_t read(py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> ranks,
                     py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> slots,
                     const std::vector<std::pair<py::array, std::size_t>>& fields, double timeout_s) {
        const std::size_t n = static_cast<std::size_t>(ranks.size());
        if (static_cast<std::size_t>(slots.size()) != n) throw std::invalid_argument("ranks and slots differ in length");
        std::vector<std::pair<void*, std::size_t>> segments;
        std::vector<std::uint64_t> offsets, nbytes, bases;
        std::uint64_t base = 0;
        for (const auto& [arr, offset] : fields) {
            if (arr.dtype().kind() != 'u' || arr.itemsize() != 1 || arr.ndim() != 2 ||
                !(arr.flags() & py::array::c_style) || !arr.writeable() || static_cast<std::size_t>(arr.shape(0)) < n)
                throw std::invalid_argument("each output field must be a writable C-contiguous (rows >= draws, bytes) uint8 array");
            auto nb = static_cast<std::size_t>(arr.shape(1));
            if (offset + nb > m_record_bytes) throw std::invalid_argument("output field lies outside the record");
            if (n == 0 || nb == 0) continue;
            segments.emplace_back(const_cast<void*>(arr.data()), n * nb);
            offsets.push_back(offset);
            nbytes.push_back(nb);
            bases.push_back(base);
            base += n * nb;
        }
        const std::int64_t* rk = ranks.data();
        const std::int64_t* sl = slots.data();
        py::gil_scoped_release nogil;
        std::vector<std::vector<std::uint64_t>> want_slots(m_peers.size()), want_rows(m_peers.size());
        std::size_t count = 0;
        for (std::size_t i = 0; i < n; ++i) {
            if (rk[i] == m_me) continue;
            if (rk[i] < 0 || static_cast<std::size_t>(rk[i]) >= m_peers.size())
                throw std::invalid_argument("rank " + std::to_string(rk[i]) + " out of range");
            want_slots[rk[i]].push_back(static_cast<std::uint64_t>(sl[i]));
            want_rows[rk[i]].push_back(i);
            ++count;
        }
        if (count == 0 || segments.empty()) return 0;
        tl::bulk dest = m_engine->expose(segments, tl::bulk_mode::write_only);
        std::vector<int> owners;
        for (std::size_t r = 0; r < m_peers.size(); ++r)
            if (!want_slots[r].empty()) owners.push_back(static_cast<int>(r));
        // every answer is awaited before `dest` may go, even after a failure
        await_all(
            "a record read", owners, timeout_s,
            [&](int r, std::chrono::milliseconds limit) {
                return m_read_rpc_->on(peer(r)).timed_async(limit, m_secret, limit.count(), want_slots[r], want_rows[r],
                                                            offsets, nbytes, bases, dest);
            },
            [&](std::size_t, const tl::packed_data<>& answer) -> std::string {
                int status = answer.as<int>();
                return status == kOk ? "" : status_text(status);
            });
        std::size_t per_record = 0;
        for (auto nb : nbytes) per_record += nb;
        return count * per_record;
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
        // and wait for the handlers still running: margo_finalize alone returns while they do, and a handler that
        // was waiting for the block lock then read a block already freed (SIGSEGV, seen after a stuck owner)
        m_engine->finalize_and_wait();
        m_engine.reset();
    }

  private:
    // Send one request to each of `ranks` (issue(rank, deadline) -> async_response), all in flight at once, and
    // await every answer, passing each to check(index, answer), which returns "" or why the answer is refused.
    // Every response is awaited, whatever failed before it: thallium's ~async_response waits for an unawaited
    // one, and a timeout thrown there, in a noexcept destructor, would end the process in std::terminate.  The
    // first failure is then thrown as this module's error, naming the rank and the time that really passed: a
    // transport that gives up early (Mercury's send retries end after NA_OFI_OP_RETRY_TIMEOUT, 120 s by
    // default) is told apart from our own deadline.
    template <class Issue, class Check>
    void await_all(const char* what, const std::vector<int>& ranks, double timeout_s, Issue issue, Check check) {
        using clock = std::chrono::steady_clock;
        const auto limit = to_duration(timeout_s);
        const auto start = clock::now();
        enum class Failure { none, timeout, unreachable, refused } failed = Failure::none;
        std::string text;
        auto fail = [&](Failure kind, const std::string& why) {
            if (failed != Failure::none) return;
            failed = kind;
            text = why;
        };
        auto rank_text = [&](std::size_t i) { return "rank " + std::to_string(ranks[i]) + " "; };
        auto waited = [&] {
            return std::chrono::duration<double>(clock::now() - start).count();
        };
        std::vector<std::optional<tl::async_response>> pending(ranks.size());
        for (std::size_t i = 0; i < ranks.size(); ++i) {
            try {
                pending[i].emplace(issue(ranks[i], limit));
            } catch (const std::exception& e) {
                fail(Failure::unreachable, rank_text(i) + "is unreachable (" + e.what() + ")");
            }
        }
        for (std::size_t i = 0; i < ranks.size(); ++i) {
            if (!pending[i]) continue;
            try {
                std::string refused = check(i, pending[i]->wait());
                if (!refused.empty()) fail(Failure::refused, rank_text(i) + "refused " + what + " (" + refused + ")");
            } catch (const tl::timeout&) {
                double s = waited();
                if (s >= 0.95 * timeout_s)
                    fail(Failure::timeout, rank_text(i) + "did not answer " + what + " within the " + seconds(timeout_s) +
                                               " s deadline (stuck or dead?)");
                else
                    fail(Failure::timeout, rank_text(i) + "did not answer " + what + ": the transport gave up after " +
                                               seconds(s) + " s, before the " + seconds(timeout_s) +
                                               " s deadline (no message reached it: stuck, dead or unreachable?)");
            } catch (const std::exception& e) {
                fail(Failure::unreachable, rank_text(i) + "is unreachable (" + e.what() + ") after " + seconds(waited()) +
                                               " s: its buffer is closed or its process died");
            }
        }
        if (failed == Failure::timeout) throw PeerTimeout(text);
        if (failed == Failure::unreachable) throw PeerUnreachable(text);
        if (failed == Failure::refused) throw PeerError(text);
    }

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
            case kTooLarge: return "a field or row outside the reader's output region";
            case kClosed: return "its buffer is closed";
            case kTransfer: return "a bulk transfer failed";
            case kDenied: return "the request did not carry this job's secret: not a rank of this job";
            case kLate: return "it reached the records after the reader's deadline";
            default: return "status " + std::to_string(status);
        }
    }

    const tl::endpoint& peer(int r) const {
        if (r < 0 || static_cast<std::size_t>(r) >= m_peers.size() || r == m_me)
            throw std::invalid_argument("no peer rank " + std::to_string(r));
        return m_peers[r];
    }

    // Answer a request, giving the answer until the requester's deadline (and a second's grace) to leave, then
    // cancelling it: a requester that gave up may have closed its engine, and Mercury retries a send to it for up to
    // NA_OFI_OP_RETRY_TIMEOUT (120 s) over TCP, which this engine's close would wait for.  A failed or cancelled
    // answer is dropped (the requester has already reported its timeout): thrown from a handler, it would end this
    // process in std::terminate.
    template <class T>
    void answer(const tl::request& req, const T& value, const Deadline& deadline) noexcept {
        try {
            hg_handle_t handle = req.native_handle();
            tl::timed_callback cancel = m_engine->create_timed_callback([handle] { HG_Cancel(handle); });
            cancel.start(std::max(deadline.left_ms(), 0.0) + 1000.0);
            try {
                req.respond(value);
            } catch (const std::exception&) {
            }
            cancel.cancel();  // returns once a callback already running has finished: the handle outlives it
        } catch (const std::exception&) {
        }
    }

    void serve_fills(const tl::request& req, const std::string& token, const Deadline& deadline) {
        if (!same_secret(token, m_secret)) {
            answer(req, std::vector<std::int64_t>{-kDenied}, deadline);
            return;
        }
        if (m_closed.load()) {
            answer(req, std::vector<std::int64_t>{}, deadline);
            return;
        }
        std::vector<std::int64_t> out(m_num_classes);
        {
            SharedHold hold(m_lock);
            std::memcpy(out.data(), m_base, 8 * m_num_classes);
        }
        answer(req, out, deadline);
    }

    void serve_read(const tl::request& req, const std::string& token, const Deadline& deadline,
                    const std::vector<std::uint64_t>& slots, const std::vector<std::uint64_t>& rows,
                    const std::vector<std::uint64_t>& offsets, const std::vector<std::uint64_t>& nbytes,
                    const std::vector<std::uint64_t>& bases, tl::bulk& dest) {
        if (!same_secret(token, m_secret)) {
            answer(req, kDenied, deadline);
            return;
        }
        if (m_closed.load()) {
            answer(req, kClosed, deadline);
            return;
        }
        bool ok = rows.size() == slots.size();
        for (auto s : slots) ok = ok && s < m_num_slots;
        if (!ok) {
            answer(req, kBadSlot, deadline);
            return;
        }
        if (!ranges_fit(rows, offsets, nbytes, bases, m_record_bytes, dest.size())) {
            answer(req, kTooLarge, deadline);
            return;
        }
        answer(req, push_records(req, deadline, slots, rows, offsets, nbytes, bases, dest), deadline);
    }

    // Push each requested record's fields into the reader's rows under the shared lock; the status to answer.
    // Nothing is sent once the reader's deadline has passed (it waited for the lock that long: the reader gave
    // up), and a transfer gets only what is left of it.  Every transfer started is awaited, each on its own: an
    // async_bulk_op left to its destructor would wait there and throw a timeout from it (std::terminate).
    int push_records(const tl::request& req, const Deadline& deadline, const std::vector<std::uint64_t>& slots,
                     const std::vector<std::uint64_t>& rows, const std::vector<std::uint64_t>& offsets,
                     const std::vector<std::uint64_t>& nbytes, const std::vector<std::uint64_t>& bases,
                     tl::bulk& dest) {
        SharedHold hold(m_lock);  // no writer while records leave
        if (deadline.passed()) return kLate;
        bool sent = true;
        std::vector<tl::async_bulk_op> ops;
        ops.reserve(slots.size() * nbytes.size());
        try {
            const double left_ms = deadline.left_ms();
            tl::remote_bulk remote = dest.on(req.get_endpoint());
            for (std::size_t q = 0; q < slots.size(); ++q) {
                std::size_t record = m_header_bytes + slots[q] * m_record_bytes;
                for (std::size_t f = 0; f < nbytes.size(); ++f)
                    ops.push_back(remote.select(bases[f] + rows[q] * nbytes[f], nbytes[f])
                                      .timed(left_ms)
                                      .push_from(m_block.select(record + offsets[f], nbytes[f])));
            }
        } catch (const std::exception&) {
            sent = false;
        }
        for (auto& op : ops) {
            try {
                op.wait();
            } catch (const std::exception&) {
                sent = false;
            }
        }
        return sent ? kOk : kTransfer;
    }

    char* m_base;
    std::size_t m_nbytes, m_header_bytes, m_record_bytes, m_num_classes, m_num_slots = 0;
    std::string m_secret;  // the job's: a request without it is refused
    std::unique_ptr<tl::engine> m_engine;
    tl::bulk m_block;
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
        .def(py::init<const std::string&, std::uintptr_t, std::size_t, std::size_t, std::size_t, std::size_t,
                      const std::string&, const std::string&>(),
             py::arg("protocol"), py::arg("base"), py::arg("nbytes"), py::arg("header_bytes"), py::arg("record_bytes"),
             py::arg("num_classes"), py::arg("config"), py::arg("secret"), py::call_guard<py::gil_scoped_release>())
        .def("address", &Transport::address)
        .def("connect", &Transport::connect, py::arg("addresses"), py::arg("me"))
        .def("lock_exclusive", &Transport::lock_exclusive)
        .def("unlock_exclusive", &Transport::unlock_exclusive)
        .def("fills", &Transport::fills, py::arg("ranks"), py::arg("timeout"))
        .def("read", &Transport::read, py::arg("ranks"), py::arg("slots"), py::arg("fields"), py::arg("timeout"))
        .def("close", &Transport::close);
    m.def("ranges_fit", &ranges_fit, py::arg("rows"), py::arg("offsets"), py::arg("nbytes"), py::arg("bases"),
          py::arg("record"), py::arg("region"),
          "whether a read request's ranges lie in the record and the reader's region (the owner's check)");
}
