// Boost.Asio helpers shared by tcp.cpp and rendezvous.cpp (private: only .cpp files include this,
// so Asio's headers stay out of the public ones).
#pragma once

#include <utility>  // before Asio: Boost 1.74 under C++20 with g++ 12 needs it

#include <boost/asio.hpp>
#include <functional>
#include <string>

#include "core/error.hpp"
#include "transport/tcp_wire.hpp"

namespace troupe::transport::detail {

namespace asio = boost::asio;
using asio::ip::tcp;

/// A listening socket on `where` (a numeric address or a name resolving to one). A port that is
/// taken gives "port P on H is already in use" followed by `hint`.
core::result<tcp::acceptor> open_acceptor(asio::io_context& io, const endpoint& where,
                                          const std::string& hint);

/// "1.2.3.4:5678" for the far end of a socket, "an unknown peer" when it is gone.
std::string remote_name(const tcp::socket& s);

/// Accepts connections on `acceptor` one after another, each handed to `on_accept`, until
/// `closing` is true or the acceptor is closed. A failed accept (out of file descriptors and the
/// like) is logged and retried after 100 ms rather than spun on. Runs on the acceptor's io_context;
/// `acceptor` and `closing` must outlive it (their owner closes the acceptor first).
void accept_connections(tcp::acceptor& acceptor, const bool& closing,
                        std::function<void(const std::string&)> log,
                        std::function<void(tcp::socket)> on_accept);

/// The logger in `log`, or one writing "troupe <who>: line" to standard error.
std::function<void(const std::string&)> logger_or_stderr(
    std::function<void(const std::string&)> log, std::string who);

}  // namespace troupe::transport::detail
