// A small HTTP/1.1 server on POSIX sockets: one thread per connection (at most 256 at once; more
// are answered 503), one request per connection (Connection: close), bodies by Content-Length,
// responses whole or streamed with chunked transfer encoding (close-delimited for HTTP/1.0
// clients). Limits are checked at the edge: 64 KB of headers, 8 MB of body, 60 s for the whole
// request to arrive, 60 s for a stalled send.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace kda::server {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string path;                            // without the query string
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  bool http10 = false;  // an HTTP/1.0 client: no chunked responses
};

// The handler's side of one connection.
class HttpResponder {
 public:
  HttpResponder(int fd, bool chunked) : fd_(fd), chunked_(chunked) {}
  // A whole response.
  void send(int status, const std::string& content_type, const std::string& body);
  // Starts a streamed response (chunked); then write() each piece, end() once. write() returns
  // false once the client has gone away.
  bool begin_stream(int status, const std::string& content_type);
  bool write(const std::string& piece);
  void end();
  bool sent() const { return sent_; }
  // True once the client has closed its side (or the connection broke): no one will read more.
  bool peer_closed() const;

 private:
  bool send_all(const std::string& bytes);
  int fd_;
  bool chunked_ = true;
  bool sent_ = false;
  bool broken_ = false;
};

class HttpServer {
 public:
  using Handler = std::function<void(const HttpRequest&, HttpResponder&)>;
  // Binds and listens (port 0: any free port; see port()). Throws kda::Error when it cannot.
  HttpServer(const std::string& host, int port, Handler handler);
  ~HttpServer();
  int port() const { return port_; }
  // Accepts connections until stop() (from another thread or a signal handler's flag watcher).
  void run();
  void stop();

 private:
  void serve_connection(int fd);
  int read_request(int fd, HttpRequest& req);  // 0, an HTTP status to answer, or -1 (gone)
  int listen_fd_ = -1;
  int port_ = 0;
  Handler handler_;
  std::atomic<bool> stopping_{false};
  // connection threads run detached; the destructor waits until none is left
  std::mutex connections_mutex_;
  std::condition_variable connections_done_;
  int connections_ = 0;
  static constexpr int kMaxConnections = 256;
};

const char* http_status_text(int status);

}  // namespace kda::server
