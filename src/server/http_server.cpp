#include "server/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <thread>

#include "core/error.h"

namespace kda::server {
namespace {

constexpr size_t kMaxHeaderBytes = 64 * 1024;
constexpr size_t kMaxBodyBytes = 8 * 1024 * 1024;
constexpr int kRequestSeconds = 60;  // for the whole request to arrive
constexpr int kSendTimeoutSeconds = 60;

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

bool wait_readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, timeout_ms) > 0;
}

}  // namespace

const char* http_status_text(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Content Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Unknown";
  }
}

// Reads one request from fd: 0, or an HTTP status to answer with, or -1 when the client went
// away (or the server is stopping) before a request arrived.
int HttpServer::read_request(int fd, HttpRequest& req) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kRequestSeconds);
  // the next bytes, waiting at most until the deadline (and never past stop())
  char buf[16384];
  const auto receive = [&]() -> ssize_t {
    while (!stopping_ && std::chrono::steady_clock::now() < deadline) {
      if (!wait_readable(fd, 200)) continue;
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
    return -1;
  };
  std::string data;
  size_t header_end = std::string::npos;
  while (header_end == std::string::npos) {
    const ssize_t n = receive();
    if (n <= 0) return -1;  // closed, timed out or stopping: nothing to answer
    data.append(buf, size_t(n));
    header_end = data.find("\r\n\r\n");
    if (header_end == std::string::npos && data.size() > kMaxHeaderBytes) return 431;
  }
  if (header_end > kMaxHeaderBytes) return 431;
  size_t line_end = data.find("\r\n");
  const std::string request_line = data.substr(0, line_end);
  const size_t sp1 = request_line.find(' '), sp2 = request_line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1) return 400;
  req.method = request_line.substr(0, sp1);
  const std::string target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string version = request_line.substr(sp2 + 1);
  if (version.rfind("HTTP/1.", 0) != 0 || target.empty() || target[0] != '/') return 400;
  req.http10 = version == "HTTP/1.0";
  req.path = target.substr(0, target.find('?'));
  size_t pos = line_end + 2;
  while (pos < header_end) {
    line_end = data.find("\r\n", pos);
    const std::string line = data.substr(pos, line_end - pos);
    const size_t colon = line.find(':');
    if (colon == std::string::npos || colon == 0) return 400;
    req.headers[lower(line.substr(0, colon))] = trim(line.substr(colon + 1));
    pos = line_end + 2;
  }
  if (req.headers.count("transfer-encoding")) return 501;  // chunked request bodies
  size_t length = 0;
  if (auto it = req.headers.find("content-length"); it != req.headers.end()) {
    const std::string& v = it->second;
    if (v.empty() || v.size() > 12 || !std::all_of(v.begin(), v.end(), ::isdigit)) return 400;
    length = size_t(std::stoull(v));
    if (length > kMaxBodyBytes) return 413;
  }
  req.body = data.substr(header_end + 4);
  if (req.body.size() < length && lower(req.headers["expect"]) == "100-continue") {
    const std::string go_on = "HTTP/1.1 100 Continue\r\n\r\n";
    ::send(fd, go_on.data(), go_on.size(), MSG_NOSIGNAL);
  }
  while (req.body.size() < length) {
    const ssize_t n = receive();
    if (n <= 0) return -1;
    req.body.append(buf, size_t(n));
  }
  if (req.body.size() > length) req.body.resize(length);  // one request per connection
  return 0;
}

bool HttpResponder::peer_closed() const {
  if (broken_) return true;
  pollfd p{fd_, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

bool HttpResponder::send_all(const std::string& bytes) {
  size_t done = 0;
  while (!broken_ && done < bytes.size()) {
    const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      broken_ = true;
    else
      done += size_t(n);
  }
  return !broken_;
}

void HttpResponder::send(int status, const std::string& content_type, const std::string& body) {
  sent_ = true;
  send_all("HTTP/1.1 " + std::to_string(status) + " " + http_status_text(status) +
           "\r\nContent-Type: " + content_type + "\r\nContent-Length: " +
           std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
}

bool HttpResponder::begin_stream(int status, const std::string& content_type) {
  sent_ = true;
  return send_all("HTTP/1.1 " + std::to_string(status) + " " + http_status_text(status) +
                  "\r\nContent-Type: " + content_type +
                  (chunked_ ? "\r\nTransfer-Encoding: chunked" : "") +
                  "\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n");
}

bool HttpResponder::write(const std::string& piece) {
  if (piece.empty()) return !broken_;
  if (!chunked_) return send_all(piece);  // the body ends where the connection closes
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", piece.size());
  return send_all(size + piece + "\r\n");
}

void HttpResponder::end() {
  if (chunked_) send_all("0\r\n\r\n");
}

HttpServer::HttpServer(const std::string& host, int port, Handler handler)
    : handler_(std::move(handler)) {
  require(port >= 0 && port <= 65535, "port " + std::to_string(port) + " is not in 0..65535");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  require(rc == 0, "cannot resolve host '" + host + "': " + gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* a = found; a && listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0) {
      listen_fd_ = fd;
    } else {
      last_error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  require(listen_fd_ >= 0,
          "cannot listen on " + host + ":" + std::to_string(port) + ": " + last_error);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

HttpServer::~HttpServer() {
  stop();
  std::unique_lock<std::mutex> lock(connections_mutex_);
  connections_done_.wait(lock, [&] { return connections_ == 0; });
  if (listen_fd_ >= 0) close(listen_fd_);
}

void HttpServer::stop() {
  stopping_ = true;
}

void HttpServer::run() {
  while (!stopping_) {
    if (!wait_readable(listen_fd_, 100)) continue;  // wake up to notice stop()
    const int fd = accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {  // e.g. out of file descriptors: do not spin
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    timeval send_timeout{kSendTimeoutSeconds, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout);
    {
      std::lock_guard<std::mutex> lock(connections_mutex_);
      if (connections_ >= kMaxConnections) {
        HttpResponder(fd, true).send(503, "application/json",
                                     "{\"error\":{\"message\":\"too many connections\","
                                     "\"type\":\"server_error\",\"param\":null,\"code\":null}}");
        close(fd);
        continue;
      }
      ++connections_;
    }
    try {
      std::thread([this, fd] {
        serve_connection(fd);
        std::lock_guard<std::mutex> lock(connections_mutex_);
        if (--connections_ == 0) connections_done_.notify_all();
      }).detach();
    } catch (const std::system_error&) {  // no thread to be had: refuse this one
      close(fd);
      std::lock_guard<std::mutex> lock(connections_mutex_);
      if (--connections_ == 0) connections_done_.notify_all();
    }
  }
}

void HttpServer::serve_connection(int fd) {
  HttpRequest req;
  const int bad = read_request(fd, req);
  HttpResponder out(fd, !req.http10);
  if (bad > 0) {
    out.send(bad, "application/json",
             std::string("{\"error\":{\"message\":\"") + http_status_text(bad) +
                 "\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}");
  } else if (bad == 0) {
    try {
      handler_(req, out);
    } catch (const std::exception& e) {
      if (!out.sent())
        out.send(500, "application/json",
                 "{\"error\":{\"message\":\"internal error\",\"type\":\"server_error\","
                 "\"param\":null,\"code\":null}}");
    }
  }
  // Lingering close: read what the client still sends (up to 1 MB, 1 s) before closing, so that
  // unread input does not turn the close into a reset that could destroy the response.
  shutdown(fd, SHUT_WR);
  timeval linger{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &linger, sizeof linger);
  char buf[16384];
  size_t drained = 0;
  for (ssize_t n; drained < (1u << 20) && (n = recv(fd, buf, sizeof buf, 0)) > 0;)
    drained += size_t(n);
  close(fd);
}

}  // namespace kda::server
