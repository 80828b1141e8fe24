#pragma once
// EtcdClient: an asynchronous etcd v3 client on the caller's io_context, through etcd's JSON
// gateway (HTTP/1.1 POST /v3/..., Boost.Beast), optionally over TLS (OpenSSL) and with etcd's
// username/password auth. docs/rendezvous.md ("etcd backend") says why the gateway and not gRPC.
//
// Unary calls (range, put, delete, txn, lease grant/keepalive/revoke) are queued and sent one at
// a time over one keep-alive connection to the current endpoint. When that endpoint cannot be
// reached, times out, answers that it has no leader (etcd's Unavailable / "no leader" /
// "request timed out"), answers HTTP 5xx, a 404 that is not etcd's NotFound or a 400/401/403
// that is not etcd's error, or sends a 200 reply that does not decode, the call moves to the
// next endpoint of the list; it fails only after every endpoint was tried once, with an error
// naming each endpoint and what it answered. Auth: the client authenticates before its first
// call and again when etcd says the token is invalid, expired, older than the auth store or
// dropped, then retries the call (once per endpoint). Wrong credentials fail the call with
// EtcdError::auth_failed set and the endpoint named.
//
// Retrying a call on another endpoint may apply a mutation twice when the first member applied it
// but its answer was lost; callers make mutations safe to repeat (compare-and-swap txns).
//
// A watch runs on its own streaming connection. When the connection breaks (member killed, "no
// leader", token expired) it reconnects to the next endpoint with backoff and resumes from the
// revision after the last event it delivered, so no event is lost or repeated; a stream silent
// for watch_idle_timeout is resumed the same way (on the same endpoint). It ends (on_error)
// only when resuming is impossible: the revision was compacted, the watch was refused, or a
// message was malformed or over the size bound.
//
// Everything read from the network is bounded (response bodies, header sizes, watch messages)
// and validated (etcd_codec.hpp). Not thread-safe: every call and every callback runs on the
// io_context thread. No callback runs after the client is destroyed or shutdown() is called.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/rendezvous/etcd_codec.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous::etcd {

struct EtcdClientOptions {
  std::vector<Endpoint> endpoints;  // tried in order, rotating on failure
  bool tls = false;                 // https (torchrun's protocol=https)
  std::string cacert;               // PEM CA bundle; "" = the system's default CAs
  std::string cert;                 // PEM client certificate (with `key`), "" = none
  std::string key;
  std::string username;  // etcd auth; "" = auth off
  std::string password;
  Duration connect_timeout = std::chrono::seconds(3);
  Duration request_timeout = std::chrono::seconds(5);
  std::size_t max_response_bytes = std::size_t{32} << 20;
  std::size_t max_watch_message_bytes = std::size_t{32} << 20;
  // A watch stream silent this long is resumed anew (a member may stall without closing the
  // connection); zero: never. Ask for progress_notify so etcd itself speaks now and then.
  Duration watch_idle_timeout{};
};

struct EtcdError {
  std::string message;       // one sentence, names the endpoint(s)
  std::string endpoint;      // "host:port" of the last endpoint tried
  int grpc_code = 0;         // 0 when the failure was not an etcd answer (network, protocol)
  bool auth_failed = false;  // etcd refused the username/password, or wants them and got none
  // etcd's answer will not change on a retry: HTTP 400/401/403 with etcd's error body and a
  // gRPC code that goes with the status (InvalidArgument, FailedPrecondition, OutOfRange;
  // Unauthenticated; PermissionDenied), other than a token to refresh. The same status without
  // such a body (a proxy's page) moves the call to the next endpoint. NotFound (an expired
  // lease) is not permanent.
  bool permanent = false;
  // The reply was over max_response_bytes (every member would send the same): read less at once.
  bool too_large = false;
  // Every member tried took the request and did not answer within the request timeout: a page
  // read may ask for fewer keys (range_all does).
  bool timed_out = false;
};

template <class T>
using EtcdCallback = std::function<void(const std::optional<EtcdError>& error, T value)>;

struct WatchHandlers {
  // Messages in revision order, each with at least one event.
  std::function<void(const WatchMessage&)> on_message;
  // The watch ended and will not resume (compaction, refusal, malformed stream).
  std::function<void(const EtcdError&)> on_error;
  // The stream broke and is being resumed. `worked`: the broken stream had been established for
  // at least the request timeout (a member that answered); false for a watch that never got
  // that far (no connection, no reply, an error), which an owner may count towards giving up.
  std::function<void(const std::string& why, bool worked)> on_reconnect;
};

class EtcdClient {
 public:
  // Throws ddprun::Error naming the file when a TLS file cannot be loaded, and UsageError when
  // the endpoint list is empty or cert is given without key.
  EtcdClient(boost::asio::io_context& io, EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  void range(RangeRequest request, EtcdCallback<RangeResponse> done);
  // Every key of request.key .. request.range_end, read in pages at the revision of the first
  // (one consistent snapshot, like one range), each page small enough for max_response_bytes:
  // the page size follows the sizes seen so far and is halved while a page is too large, or
  // comes from no member within the request timeout (a slow link). Fails
  // permanently, naming the range, once the keys and values read pass `max_total_bytes`. A page
  // whose revision was compacted meanwhile starts the read again (at most 3 times). The reply's
  // header is the first page's; `more` is false, `count` the number of keys.
  void range_all(RangeRequest request, std::size_t max_total_bytes, EtcdCallback<RangeResponse> done);
  void put(PutRequest request, EtcdCallback<ResponseHeader> done);
  void delete_range(DeleteRangeRequest request, EtcdCallback<ResponseHeader> done);
  void txn(TxnRequest request, EtcdCallback<TxnResponse> done);
  void lease_grant(std::int64_t ttl_seconds, EtcdCallback<LeaseGrantResponse> done);
  void lease_keepalive(std::int64_t id, EtcdCallback<LeaseKeepAliveResponse> done);
  void lease_revoke(std::int64_t id, EtcdCallback<ResponseHeader> done);

  // Starts a watch; the id cancels it. start_revision 0 = from the current revision.
  std::uint64_t watch(WatchCreate create, WatchHandlers handlers);
  void cancel_watch(std::uint64_t id);

  // Called (on the io_context's thread) each time a call of this client leaves endpoint `index`
  // for the next because it did not answer: another client of the same cluster can act on it
  // (endpoint_failed) rather than find out later by itself.
  void set_endpoint_failed_hook(std::function<void(std::size_t index)> hook);
  // Endpoint `index` failed another client's call: this client's watches on it resume on the
  // next endpoint now (from their next revision: nothing is lost), not after their idle timeout.
  void endpoint_failed(std::size_t index);

  // Closes every connection and drops every pending call and watch without calling back.
  void shutdown();

  // "h1:2379,h2:2379" (with the scheme when TLS is on).
  std::string endpoints_text() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous::etcd
