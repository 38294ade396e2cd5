#include "transport/tcp_asio.hpp"

#include <chrono>
#include <iostream>
#include <memory>
#include <mutex>

namespace troupe::transport::detail {

core::result<tcp::acceptor> open_acceptor(asio::io_context& io, const endpoint& where,
                                          const std::string& hint) {
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto found = resolver.resolve(where.host, std::to_string(where.port),
                                tcp::resolver::numeric_service | tcp::resolver::passive, ec);
  if (ec || found.empty())
    return core::error::make(
        "cannot resolve the listening address '" + where.host + "': " + ec.message(),
        "give a numeric address such as 127.0.0.1 or 0.0.0.0");
  tcp::endpoint ep = found.begin()->endpoint();
  tcp::acceptor acceptor(io);
  acceptor.open(ep.protocol(), ec);
  // Lets a restarted job reuse a port whose old connections linger in TIME_WAIT; a port with a
  // live listener still fails below.
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (ec == asio::error::address_in_use)
    return core::error::make(
        "port " + std::to_string(where.port) + " on " + where.host + " is already in use", hint);
  if (!ec) acceptor.listen(tcp::acceptor::max_listen_connections, ec);
  if (ec)
    return core::error::make("cannot listen on " + where.to_string() + ": " + ec.message(), hint);
  return acceptor;
}

std::string remote_name(const tcp::socket& s) {
  boost::system::error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "an unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

std::function<void(const std::string&)> logger_or_stderr(
    std::function<void(const std::string&)> log, std::string who) {
  if (log) return log;
  return [who = std::move(who)](const std::string& line) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lk(mu);
    std::cerr << "troupe " << who << ": " << line << std::endl;
  };
}

void accept_connections(tcp::acceptor& acceptor, const bool& closing,
                        std::function<void(const std::string&)> log,
                        std::function<void(tcp::socket)> on_accept) {
  acceptor.async_accept([&acceptor, &closing, log = std::move(log),
                         on_accept = std::move(on_accept)](boost::system::error_code ec,
                                                           tcp::socket sock) mutable {
    if (closing || ec == asio::error::operation_aborted) return;
    if (ec) {
      log("accepting a connection failed: " + ec.message());
      auto t = std::make_shared<asio::steady_timer>(acceptor.get_executor(),
                                                    std::chrono::milliseconds(100));
      t->async_wait([&acceptor, &closing, log, on_accept, t](boost::system::error_code e) {
        if (!e && !closing) accept_connections(acceptor, closing, log, on_accept);
      });
      return;
    }
    on_accept(std::move(sock));
    accept_connections(acceptor, closing, std::move(log), std::move(on_accept));
  });
}

}  // namespace troupe::transport::detail
