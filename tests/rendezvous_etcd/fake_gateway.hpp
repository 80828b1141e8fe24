#pragma once
// A fake etcd gateway on 127.0.0.1 (port 0, read back) on the test's io_context: it reads each
// HTTP request (headers and Content-Length body) and answers with the bytes its handler returns,
// then keeps the connection open (silent) or closes it. For replies no etcd member sends.
#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddprun::test {

class FakeGateway {
 public:
  struct Reply {
    std::string bytes;
    bool close = false;  // close the connection after the bytes (else wait for the next request)
  };
  // Gets the request's first line ("POST /v3/kv/range HTTP/1.1") and its body.
  using Handler = std::function<Reply(const std::string& request_line, const std::string& body)>;

  FakeGateway(boost::asio::io_context& io, Handler handler)
      : io_(io), acceptor_(io, {boost::asio::ip::make_address("127.0.0.1"), 0}), handler_(std::move(handler)) {
    accept();
  }
  ~FakeGateway() {
    boost::system::error_code ec;
    acceptor_.close(ec);
    for (auto& c : conns_) c->socket.close(ec);
  }
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port()); }
  int requests() const { return requests_; }
  // The Authorization header of the request being answered ("" when none); for forward().
  const std::string& authorization() const { return authorization_; }
  const std::vector<std::string>& request_lines() const { return lines_; }

 private:
  using tcp = boost::asio::ip::tcp;
  struct Conn {
    tcp::socket socket;
    std::string in;
    std::array<char, 65536> buf{};
    std::string out;
    explicit Conn(boost::asio::io_context& io) : socket(io) {}
  };

  void accept() {
    auto c = std::make_shared<Conn>(io_);
    acceptor_.async_accept(c->socket, [this, c](const boost::system::error_code& ec) {
      if (ec) return;
      conns_.push_back(c);
      read(c);
      accept();
    });
  }

  void read(const std::shared_ptr<Conn>& c) {
    if (serve(c)) return;
    c->socket.async_read_some(boost::asio::buffer(c->buf),
                              [this, c](const boost::system::error_code& ec, std::size_t n) {
                                if (ec) return;
                                c->in.append(c->buf.data(), n);
                                read(c);
                              });
  }

  // Answers one complete buffered request; false when more bytes are needed.
  bool serve(const std::shared_ptr<Conn>& c) {
    const std::size_t end = c->in.find("\r\n\r\n");
    if (end == std::string::npos) return false;
    std::size_t length = 0;
    std::string head = c->in.substr(0, end);
    for (char& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (const auto p = head.find("content-length:"); p != std::string::npos) length = std::stoul(head.substr(p + 15));
    if (c->in.size() < end + 4 + length) return false;
    authorization_.clear();
    if (const auto p = head.find("\r\nauthorization:"); p != std::string::npos) {
      const std::size_t from = head.find_first_not_of(' ', p + 16);
      const std::size_t to = head.find("\r\n", from);
      authorization_ = c->in.substr(from, to == std::string::npos ? std::string::npos : to - from);
    }
    const std::string line = c->in.substr(0, c->in.find("\r\n"));
    const std::string body = c->in.substr(end + 4, length);
    c->in.erase(0, end + 4 + length);
    ++requests_;
    lines_.push_back(line);
    Reply r = handler_(line, body);
    c->out = std::move(r.bytes);
    boost::asio::async_write(c->socket, boost::asio::buffer(c->out),
                             [this, c, close = r.close](const boost::system::error_code& ec, std::size_t) {
                               boost::system::error_code ignored;
                               if (ec || close) return c->socket.close(ignored);
                               read(c);
                             });
    return true;
  }

  boost::asio::io_context& io_;
  tcp::acceptor acceptor_;
  Handler handler_;
  std::vector<std::shared_ptr<Conn>> conns_;
  int requests_ = 0;
  std::vector<std::string> lines_;
  std::string authorization_;
};

// An HTTP/1.1 reply with a Content-Length body.
inline std::string http_reply(int status, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) +
         " X\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Sends one request to a real etcd member on 127.0.0.1:`port` and returns its whole reply (the
// connection is closed after it, and so is the client's). Blocking: for quick unary calls only.
// `authorization`: the token to pass on (FakeGateway::authorization()).
inline FakeGateway::Reply forward(std::uint16_t port, const std::string& request_line, const std::string& body,
                                  const std::string& authorization = {}) {
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  const std::string req = request_line + "\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                          (authorization.empty() ? "" : "Authorization: " + authorization + "\r\n") +
                          "Content-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  asio::write(s, asio::buffer(req));
  std::string out;
  std::array<char, 65536> buf{};
  boost::system::error_code ec;
  while (!ec) out.append(buf.data(), s.read_some(asio::buffer(buf), ec));
  return {out, true};
}

}  // namespace ddprun::test
