// Exportable pools for KV transports (Pool::export_handles, torpor_export_handles): one shareable
// handle per chunk holding allocations of the tags asked for, all or nothing, refused with the fix
// named; after a sleep and wake the handles are new ones naming the new memory at the same
// addresses, and the tag hooks are where a transport exports again. Oracles, independent of the
// export code: the bytes the pool's owner wrote, read through an import of the handle (in another
// process where the backend allows: a child that also maps the descriptor itself with mmap), the
// bytes the importer wrote, read back at the pool's address; the process's open descriptors
// (/proc/self/fd); and on a GPU, the driver's own cuPointerGetAttribute for the RDMA flag.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"
#include "torpor/torpor.h"
#ifdef TORPOR_HAVE_CUDA
#include <cuda.h>
#endif

namespace torpor::test {
namespace {

using Bytes = std::vector<std::uint8_t>;

// An in-process import of an exported handle, mapped at a span of the pool's reservation.
class Imported {
 public:
  Imported(Driver& d, Pool& pool, const ExportedChunk& e) : d_(d), pool_(pool), bytes_(e.bytes) {
    h_ = e.kind == HandleKind::fabric ? d.import_fabric(e.fabric, e.bytes) : d.import_fd_of_size(e.fd(), e.bytes);
    va_ = pool.reserve_address_range(bytes_);
    d.map(va_, bytes_, h_, 0);
    int dev = pool.device();
    d.set_access(va_, bytes_, std::span<const int>(&dev, 1));
  }
  Imported(const Imported&) = delete;
  Imported& operator=(const Imported&) = delete;
  ~Imported() {
    d_.unmap(va_, bytes_);
    d_.release(h_);
    pool_.release_address_range(va_);
  }
  Bytes read(std::size_t offset, std::size_t n) { return test::read(pool_, reinterpret_cast<void*>(va_ + offset), n); }

 private:
  Driver& d_;
  Pool& pool_;
  std::size_t bytes_;
  PhysicalHandle h_;
  device_ptr va_ = 0;
};

// The entry whose chunk holds `p`, or nullptr.
const ExportedChunk* holding(const std::vector<ExportedChunk>& v, const void* p) {
  auto a = reinterpret_cast<device_ptr>(p);
  for (const auto& e : v)
    if (a >= e.va && a < e.va + e.bytes) return &e;
  return nullptr;
}

std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

PoolOptions exportable(PoolOptions o) {
  o.exportable = true;
  return o;
}

template <typename B>
class ExportTest : public BackendTest<B> {
 protected:
  // The kinds this backend can export here (fabric only where the device's probe says yes).
  std::vector<HandleKind> kinds(Pool& pool) {
    std::vector<HandleKind> out{HandleKind::posix_fd};
    if (pool.export_kind() == HandleKind::fabric) out.push_back(HandleKind::fabric);
    return out;
  }
};
TYPED_TEST_SUITE(ExportTest, Backends, BackendNames);

TYPED_TEST(ExportTest, EveryChunkOfTheTagIsHandedOutOnceAndImportsToTheBytesItsOwnerWrote) {
  const std::size_t g = this->granularity();
  Pool pool(this->driver(), exportable(this->small_pool()));
  std::mt19937_64 rng(29);
  void* big = pool.allocate(3 * g, {"kv_cache", MemoryClass::cache, "kv.big"});
  void* small = pool.allocate(1024, {"kv_cache", MemoryClass::cache, "kv.small"});
  void* w = pool.allocate(g, {"weights", MemoryClass::state, "w"});
  const Bytes big_bytes = random_bytes(rng, 3 * g), small_bytes = random_bytes(rng, 1024);
  write(pool, big, big_bytes);
  write(pool, small, small_bytes);
  for (HandleKind kind : this->kinds(pool)) {
    SCOPED_TRACE(std::string(to_string(kind)));
    std::vector<ExportedChunk> v = pool.export_handles({"kv_cache"}, kind);
    ASSERT_EQ(v.size(), 2u) << "one handle per chunk of the tag: the dedicated chunk and the slab";
    EXPECT_LT(v[0].va, v[1].va) << "address order";
    const ExportedChunk* eb = holding(v, big);
    const ExportedChunk* es = holding(v, small);
    ASSERT_TRUE(eb && es && eb != es);
    EXPECT_EQ(holding(v, w), nullptr) << "a chunk of another tag is not handed out";
    for (const auto& e : v) {
      EXPECT_EQ(e.tag, "kv_cache");
      EXPECT_EQ(e.kind, kind);
      EXPECT_EQ(e.bytes % g, 0u);
      EXPECT_EQ(e.gpu_direct_rdma, this->driver().device_properties(0).gpu_direct_rdma_vmm);
      EXPECT_EQ(e.fd() >= 0, kind == HandleKind::posix_fd) << "a descriptor exactly for kind posix_fd";
    }
    const std::size_t off_b = reinterpret_cast<device_ptr>(big) - eb->va;
    const std::size_t off_s = reinterpret_cast<device_ptr>(small) - es->va;
    Imported ib(this->driver(), pool, *eb);
    Imported is(this->driver(), pool, *es);
    for (auto& e : v) e.reset_fd();  // the descriptors close; the imports hold the memory themselves
    EXPECT_EQ(ib.read(off_b, big_bytes.size()), big_bytes);
    EXPECT_EQ(is.read(off_s, small_bytes.size()), small_bytes);
  }
  EXPECT_EQ(pool.export_handles().size(), 3u) << "every tag: the two kv_cache chunks and the weights chunk";
  EXPECT_EQ(pool.export_count({"weights"}), 1u);
  for (void* p : {big, small, w}) pool.deallocate(p);
}

TYPED_TEST(ExportTest, AfterSleepAndWakeTheTagHooksExportNewHandlesThatImportToTheRestoredBytesAtTheSameAddress) {
  const std::size_t g = this->granularity();
  Pool pool(this->driver(), exportable(this->small_pool(FillOnWake::poison)));
  std::mt19937_64 rng(30);
  void* kv = pool.allocate(2 * g, {"kv_cache", MemoryClass::state, "kv"});
  const Bytes a = random_bytes(rng, 2 * g), b = random_bytes(rng, 2 * g);
  write(pool, kv, a);
  for (HandleKind kind : this->kinds(pool)) {
    SCOPED_TRACE(std::string(to_string(kind)));
    // The transport: registered now, deregistered before each unmap, registered again after each map.
    std::vector<ExportedChunk> registered = pool.export_handles({"kv_cache"}, kind);
    ASSERT_EQ(registered.size(), 1u);
    const device_ptr va = registered[0].va;
    const std::size_t off = reinterpret_cast<device_ptr>(kv) - va;
    std::optional<Imported> before;
    before.emplace(this->driver(), pool, registered[0]);  // a peer's import of the old memory
    int unmaps = 0, maps = 0;
    bool mapped_in_before_unmap = false;
    const std::uint64_t id = pool.add_tag_hooks("kv_cache", TagHooks{[&](const std::string&) {
                                                                       ++unmaps;
                                                                       mapped_in_before_unmap =
                                                                           read(pool, kv, a.size()) == a;
                                                                       registered.clear();  // closes the descriptors
                                                                     },
                                                                     [&](const std::string& t) {
                                                                       ++maps;
                                                                       registered = pool.export_handles({t}, kind);
                                                                     }});
    pool.sleep(1, {"kv_cache"});
    EXPECT_EQ(unmaps, 1);
    EXPECT_TRUE(mapped_in_before_unmap) << "before_unmap runs while the old handles still name mapped memory";
    EXPECT_TRUE(registered.empty());
    try {
      (void)pool.export_handles({"kv_cache"}, kind);
      ADD_FAILURE() << "a sleeping tag has no handle to export";
    } catch (const invalid_state& e) {
      EXPECT_NE(std::string(e.what()).find("asleep"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("Wake the tag first"), std::string::npos) << e.what();
    }
    pool.wake_up({"kv_cache"});
    EXPECT_EQ(maps, 1) << "after_map exported the new handles";
    ASSERT_EQ(registered.size(), 1u);
    EXPECT_EQ(registered[0].va, va) << "the same address after wake";
    {
      Imported after(this->driver(), pool, registered[0]);
      EXPECT_EQ(after.read(off, a.size()), a) << "the new handle imports to the restored bytes";
      write(pool, kv, b);
      EXPECT_EQ(after.read(off, b.size()), b) << "and is the memory mapped at the pool's address now";
      EXPECT_EQ(before->read(off, a.size()), a) << "the old handle names the old memory, not the new";
      if (kind == HandleKind::fabric) {
        std::vector<ExportedChunk> again = pool.export_handles({"kv_cache"}, kind);
        EXPECT_EQ(again[0].fabric, registered[0].fabric) << "the same memory, the same fabric handle";
      }
    }
    before.reset();
    pool.remove_tag_hooks(id);
    registered.clear();
    write(pool, kv, a);
  }
  pool.deallocate(kv);
}

TYPED_TEST(ExportTest, APoolThatIsNotExportableIsRefusedNamingTheFix) {
  Pool pool(this->driver(), this->small_pool());
  void* kv = pool.allocate(4096, {"kv_cache", MemoryClass::cache, "kv"});
  EXPECT_FALSE(pool.export_kind().has_value());
  for (auto call : {+[](Pool& p) { (void)p.export_handles({"kv_cache"}); }, +[](Pool& p) { (void)p.export_count(); }}) {
    try {
      call(pool);
      ADD_FAILURE() << "a pool that is not exportable has no handle to give";
    } catch (const invalid_state& e) {
      EXPECT_NE(std::string(e.what()).find("not exportable"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("PoolOptions::exportable = true"), std::string::npos) << e.what();
    }
  }
  pool.deallocate(kv);
}

TYPED_TEST(ExportTest, ASleepingTagAnUnknownTagOrTooManyChunksHandOutNothing) {
  const std::size_t g = this->granularity();
  Pool pool(this->driver(), exportable(this->small_pool()));
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::cache, "kv"});
  void* w1 = pool.allocate(g, {"weights", MemoryClass::state, "w1"});
  void* w2 = pool.allocate(g, {"weights", MemoryClass::state, "w2"});
  pool.sleep(2, {"kv_cache"});
  EXPECT_THROW((void)pool.export_handles(), invalid_state) << "every tag includes the sleeping one";
  EXPECT_THROW((void)pool.export_count({"kv_cache", "weights"}), invalid_state);
  EXPECT_EQ(pool.export_handles({"weights"}).size(), 2u) << "an awake tag beside a sleeping one";
  try {
    (void)pool.export_handles({"weights", "kv-cache"});
    ADD_FAILURE() << "an unknown tag";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown tag 'kv-cache'"), std::string::npos) << e.what();
  }
  try {
    (void)pool.export_handles({"weights"}, HandleKind::posix_fd, 1);
    ADD_FAILURE() << "two chunks, room for one";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2 chunks to export, room for 1"), std::string::npos) << e.what();
  }
  pool.wake_up();
  EXPECT_EQ(pool.export_handles({"kv_cache"}).size(), 1u);
  for (void* p : {kv, w1, w2}) pool.deallocate(p);
}

// --- the host backend: descriptors, failures, the RDMA mark ------------------------------------

TEST(ExportHostTest, AFailedExportClosesTheDescriptorsItAlreadyMade) {
  HostDriver host(HostBackend::options());
  FaultInjectingDriver faulty(host);
  PoolOptions o;
  o.va_bytes = std::size_t{64} << 20;
  o.medium_limit = 0;
  o.exportable = true;
  Pool pool(faulty, o);
  const std::size_t g = host.options().granularity;
  std::vector<void*> kv;
  for (int i = 0; i < 3; ++i) kv.push_back(pool.allocate(g, {"kv_cache", MemoryClass::cache, ""}));
  const std::size_t before = open_descriptors();
  faulty.fail_nth(DriverCall::export_handle, 2);  // the second chunk's export
  EXPECT_THROW((void)pool.export_handles({"kv_cache"}, HandleKind::posix_fd), driver_error);
  EXPECT_EQ(open_descriptors(), before) << "the first chunk's descriptor was closed, not leaked";
  faulty.clear();
  {
    std::vector<ExportedChunk> v = pool.export_handles({"kv_cache"}, HandleKind::posix_fd);
    EXPECT_EQ(v.size(), 3u);
    EXPECT_EQ(open_descriptors(), before + 3);
    const int fd = v[1].release_fd();
    v.clear();
    EXPECT_EQ(open_descriptors(), before + 1) << "a released descriptor is the caller's";
    ::close(fd);
  }
  EXPECT_EQ(open_descriptors(), before);
  for (void* p : kv) pool.deallocate(p);
}

TEST(ExportHostTest, ExportableMemoryCarriesTheRdmaMarkWhereTheDeviceSupportsIt) {
  for (bool device_can : {true, false}) {
    HostDriverOptions ho = HostBackend::options();
    ho.gpu_direct_rdma_vmm = device_can;
    HostDriver host(ho);
    EXPECT_EQ(host.device_properties(0).gpu_direct_rdma_vmm, device_can);
    PoolOptions o;
    o.va_bytes = std::size_t{64} << 20;
    Pool plain(host, o);
    o.exportable = true;
    Pool shared(host, o);
    void* p = plain.allocate(4096, {"kv_cache", MemoryClass::cache, ""});
    void* s = shared.allocate(4096, {"kv_cache", MemoryClass::cache, ""});
    EXPECT_EQ(host.gpu_direct_rdma_capable(reinterpret_cast<device_ptr>(s)), device_can);
    EXPECT_EQ(host.gpu_direct_rdma_capable(reinterpret_cast<device_ptr>(p)), false) << "only exportable memory";
    std::vector<ExportedChunk> v = shared.export_handles();
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].gpu_direct_rdma, device_can);
    shared.deallocate(s);
    plain.deallocate(p);
  }
}

TEST(ExportHostTest, AskingForFabricHandlesWhereTheDeviceHasNoneIsUnavailableWithTheCause) {
  HostDriverOptions ho = HostBackend::options();
  ho.fabric = HostDriverOptions::Fabric::off;
  HostDriver host(ho);
  PoolOptions o;
  o.va_bytes = std::size_t{64} << 20;
  o.exportable = true;
  Pool pool(host, o);
  void* kv = pool.allocate(4096, {"kv_cache", MemoryClass::cache, ""});
  EXPECT_EQ(pool.export_kind(), HandleKind::posix_fd) << "no fabric: descriptors by default";
  try {
    (void)pool.export_handles({}, HandleKind::fabric);
    ADD_FAILURE() << "fabric handles on a device without them";
  } catch (const unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("no fabric handle support"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("POSIX descriptors"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.export_handles().at(0).kind, HandleKind::posix_fd);
  pool.deallocate(kv);
}

// --- another process ---------------------------------------------------------------------------

// A child process started before the test makes any thread: it imports what it is sent with a
// HostDriver of its own, reads the bytes (a descriptor also through its own mmap of it, without
// torpor), optionally writes bytes through its mapping, and sends back what it read.
class Importer {
 public:
  struct Request {
    std::uint8_t kind = 0;      // HandleKind
    std::uint64_t bytes = 0;    // the chunk's
    std::uint64_t offset = 0;   // where to read (and write)
    std::uint64_t n = 0;        // how many bytes to read
    std::uint64_t write_n = 0;  // how many bytes follow, written at offset after reading
    FabricHandle fabric;
  };

  Importer() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      ::close(sv[0]);
      serve(sv[1]);
      ::_exit(0);
    }
    ::close(sv[1]);
    sock_ = sv[0];
  }
  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;
  ~Importer() {
    ::close(sock_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }

  // What the child read at [offset, offset + n) of the chunk; throws with its error.
  Bytes import_and_read(const ExportedChunk& e, std::size_t offset, std::size_t n, const Bytes& then_write = {}) {
    Request r;
    r.kind = static_cast<std::uint8_t>(e.kind);
    r.write_n = then_write.size();
    r.bytes = e.bytes;
    r.offset = offset;
    r.n = n;
    r.fabric = e.fabric;
    send_with_fd(sock_, &r, sizeof r, e.kind == HandleKind::posix_fd ? e.fd() : -1);
    if (!then_write.empty()) send_all(sock_, then_write.data(), then_write.size());
    std::uint8_t ok = 0;
    std::uint64_t len = 0;
    recv_all(sock_, &ok, 1);
    recv_all(sock_, &len, sizeof len);
    Bytes out(len);
    recv_all(sock_, out.data(), len);
    if (!ok) throw std::runtime_error("the importer failed: " + std::string(out.begin(), out.end()));
    return out;
  }

 private:
  static void send_all(int s, const void* p, std::size_t n) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t k = ::send(s, c, n, MSG_NOSIGNAL);
      if (k <= 0) throw std::runtime_error("send");
      c += k;
      n -= static_cast<std::size_t>(k);
    }
  }
  static bool recv_all(int s, void* p, std::size_t n) {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      ssize_t k = ::recv(s, c, n, 0);
      if (k <= 0) return false;
      c += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }
  static void send_with_fd(int s, const void* p, std::size_t n, int fd) {
    iovec iov{const_cast<void*>(p), n};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (fd >= 0) {
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    if (::sendmsg(s, &m, MSG_NOSIGNAL) != static_cast<ssize_t>(n)) throw std::runtime_error("sendmsg");
  }
  // The request and the descriptor that came with it (-1 when none); false at the end.
  static bool recv_request(int s, Request& r, int& fd) {
    iovec iov{&r, sizeof r};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    fd = -1;
    ssize_t k = ::recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    if (k <= 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    auto rest = static_cast<std::size_t>(k);
    return rest == sizeof r || recv_all(s, reinterpret_cast<char*>(&r) + rest, sizeof r - rest);
  }
  static void reply(int s, bool ok, const void* p, std::size_t n) {
    const std::uint8_t o = ok ? 1 : 0;
    const std::uint64_t len = n;
    send_all(s, &o, 1);
    send_all(s, &len, sizeof len);
    send_all(s, p, n);
  }

  static void serve(int s) {
    HostDriver other(HostBackend::options());
    const int dev = 0;
    for (;;) {
      Request r;
      int fd = -1;
      if (!recv_request(s, r, fd)) return;
      if (r.write_n > r.bytes) return;  // a broken request: end the child
      Bytes incoming(r.write_n);
      if (!incoming.empty() && !recv_all(s, incoming.data(), incoming.size())) return;
      std::string problem;
      Bytes got(r.n);
      try {
        const auto kind = static_cast<HandleKind>(r.kind);
        if (kind == HandleKind::posix_fd) {
          // Without torpor: the descriptor mapped by the kernel is the oracle for what torpor imports.
          void* raw = ::mmap(nullptr, r.bytes, PROT_READ, MAP_SHARED, fd, 0);
          if (raw == MAP_FAILED) throw std::runtime_error("mmap of the descriptor failed");
          got.assign(static_cast<std::uint8_t*>(raw) + r.offset, static_cast<std::uint8_t*>(raw) + r.offset + r.n);
          ::munmap(raw, r.bytes);
        }
        PhysicalHandle h =
            kind == HandleKind::fabric ? other.import_fabric(r.fabric, r.bytes) : other.import_fd_of_size(fd, r.bytes);
        const device_ptr va = other.reserve(r.bytes, other.options().granularity);
        other.map(va, r.bytes, h, 0);
        other.set_access(va, r.bytes, std::span<const int>(&dev, 1));
        const auto* p = reinterpret_cast<const std::uint8_t*>(va + r.offset);
        if (kind == HandleKind::posix_fd && !std::equal(got.begin(), got.end(), p))
          problem = "torpor's import and the kernel's mmap of the descriptor read different bytes";
        got.assign(p, p + r.n);
        if (!incoming.empty()) std::memcpy(reinterpret_cast<void*>(va + r.offset), incoming.data(), incoming.size());
        other.unmap(va, r.bytes);
        other.release(h);
        other.free_reservation(va, r.bytes);
      } catch (const std::exception& e) {
        problem = e.what();
      }
      if (fd >= 0) ::close(fd);
      if (problem.empty())
        reply(s, true, got.data(), got.size());
      else
        reply(s, false, problem.data(), problem.size());
    }
  }

  pid_t pid_ = -1;
  int sock_ = -1;
};

TEST(ExportProcessesTest, HandlesImportInAnotherProcessBeforeAndAfterWakeAndShareTheMemory) {
  Importer child;  // first, before anything may start a thread
  HostDriver host(HostBackend::options());
  PoolOptions o;
  o.va_bytes = std::size_t{64} << 20;
  o.exportable = true;
  o.fill_on_wake = FillOnWake::poison;
  Pool pool(host, o);
  const std::size_t g = host.options().granularity;
  std::mt19937_64 rng(31);
  void* kv = pool.allocate(2 * g, {"kv_cache", MemoryClass::state, "kv"});
  Bytes mine = random_bytes(rng, 2 * g);
  write(pool, kv, mine);
  for (HandleKind kind : {HandleKind::posix_fd, HandleKind::fabric}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    std::vector<ExportedChunk> v = pool.export_handles({"kv_cache"}, kind);
    ASSERT_EQ(v.size(), 1u);
    const std::size_t off = reinterpret_cast<device_ptr>(kv) - v[0].va;
    const Bytes theirs = random_bytes(rng, 64);
    EXPECT_EQ(child.import_and_read(v[0], off, mine.size(), theirs), mine) << "the owner's bytes, in another process";
    std::memcpy(mine.data(), theirs.data(), theirs.size());
    EXPECT_EQ(read(pool, kv, mine.size()), mine) << "what the other process wrote is at the pool's address";

    // The transport's cycle: handles closed before the unmap, exported anew after the map.
    const device_ptr va = v[0].va;
    const std::uint64_t id =
        pool.add_tag_hooks("kv_cache", TagHooks{[&](const std::string&) { v.clear(); },
                                                [&](const std::string& t) { v = pool.export_handles({t}, kind); }});
    pool.sleep(1, {"kv_cache"});
    pool.wake_up({"kv_cache"});
    pool.remove_tag_hooks(id);
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].va, va);
    EXPECT_EQ(child.import_and_read(v[0], off, mine.size()), mine)
        << "after the wake the new handle imports to the restored bytes, in another process";
  }
  pool.deallocate(kv);
}

// --- the C API ---------------------------------------------------------------------------------

struct CExportTest : ::testing::Test {
  torpor_pool_t make(int exportable) {
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.va_bytes = std::size_t{1} << 30;
    o.exportable = exportable;
    torpor_pool_t p = nullptr;
    EXPECT_EQ(torpor_pool_create(&o, &p), TORPOR_OK) << torpor_last_error();
    return p;
  }
};

TEST_F(CExportTest, AsksThenExportsOneEntryPerChunkWhoseDescriptorsTheCallerOwns) {
  torpor_pool_t pool = make(1);
  int flag = -1;
  ASSERT_EQ(torpor_pool_exportable(pool, &flag), TORPOR_OK);
  EXPECT_EQ(flag, 1);
  void *a = nullptr, *b = nullptr;
  // Beyond PoolOptions::medium_limit (256 MiB): a chunk each.
  const std::size_t size = std::size_t{300} << 20;
  ASSERT_EQ(torpor_alloc(pool, size, TORPOR_TAG_KV_CACHE, TORPOR_CLASS_STATE, "a", &a), TORPOR_OK);
  ASSERT_EQ(torpor_alloc(pool, size, TORPOR_TAG_KV_CACHE, TORPOR_CLASS_STATE, "b", &b), TORPOR_OK);
  // The host backend's memory is the host's: written directly, its first and last MiB.
  std::memset(a, 0x5a, 1 << 20);
  std::memset(static_cast<char*>(a) + size - (1 << 20), 0x5a, 1 << 20);
  const char* tags[] = {TORPOR_TAG_KV_CACHE};
  size_t n = 99;
  ASSERT_EQ(torpor_export_handles(pool, tags, 1, TORPOR_HANDLE_POSIX_FD, nullptr, 0, &n), TORPOR_OK);
  EXPECT_EQ(n, 2u) << "the question exports nothing and says how many";
  std::array<torpor_chunk_export, 2> out{};
  const std::size_t before = open_descriptors();
  EXPECT_EQ(torpor_export_handles(pool, tags, 1, TORPOR_HANDLE_POSIX_FD, out.data(), 1, &n),
            TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(n, 2u) << "a small buffer is told how many";
  EXPECT_NE(std::string(torpor_last_error()).find("2 chunks to export, room for 1"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(open_descriptors(), before) << "and nothing was exported";
  ASSERT_EQ(torpor_export_handles(pool, tags, 1, TORPOR_HANDLE_POSIX_FD, out.data(), out.size(), &n), TORPOR_OK)
      << torpor_last_error();
  ASSERT_EQ(n, 2u);
  EXPECT_EQ(open_descriptors(), before + 2);
  for (const auto& e : out) {
    EXPECT_EQ(e.kind, TORPOR_HANDLE_POSIX_FD);
    EXPECT_STREQ(e.tag, TORPOR_TAG_KV_CACHE);
    EXPECT_EQ(e.gpu_direct_rdma, 1);
  }
  const torpor_chunk_export* ea = static_cast<char*>(a) >= static_cast<char*>(out[0].va) &&
                                          static_cast<char*>(a) < static_cast<char*>(out[0].va) + out[0].bytes
                                      ? &out[0]
                                      : &out[1];
  void* raw = ::mmap(nullptr, ea->bytes, PROT_READ, MAP_SHARED, ea->fd, 0);
  ASSERT_NE(raw, MAP_FAILED);
  const std::size_t off = static_cast<std::size_t>(static_cast<char*>(a) - static_cast<char*>(ea->va));
  EXPECT_EQ(static_cast<unsigned char*>(raw)[off], 0x5a);
  EXPECT_EQ(static_cast<unsigned char*>(raw)[off + size - 1], 0x5a);
  ::munmap(raw, ea->bytes);
  for (auto& e : out) EXPECT_EQ(::close(e.fd), 0) << "the caller's to close";
  EXPECT_EQ(open_descriptors(), before);

  ASSERT_EQ(torpor_export_handles(pool, nullptr, 0, TORPOR_HANDLE_FABRIC, out.data(), out.size(), &n), TORPOR_OK)
      << torpor_last_error();
  EXPECT_EQ(n, 2u);
  EXPECT_EQ(out[0].fd, -1);
  EXPECT_EQ(out[0].kind, TORPOR_HANDLE_FABRIC);
  EXPECT_EQ(open_descriptors(), before) << "a fabric handle is bytes";
  EXPECT_STREQ(torpor_handle_kind_name(TORPOR_HANDLE_AUTO), "auto");
  EXPECT_STREQ(torpor_handle_kind_name(TORPOR_HANDLE_POSIX_FD), "posix_fd");
  EXPECT_STREQ(torpor_handle_kind_name(TORPOR_HANDLE_FABRIC), "fabric");
  EXPECT_EQ(torpor_handle_kind_name(3), nullptr);
  EXPECT_EQ(torpor_free(pool, a), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, b), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

TEST_F(CExportTest, RefusesBadArgumentsASleepingTagAndAPoolThatIsNotExportable) {
  torpor_pool_t pool = make(1);
  void* a = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, TORPOR_TAG_KV_CACHE, TORPOR_CLASS_CACHE, nullptr, &a), TORPOR_OK);
  torpor_chunk_export e{};
  size_t n = 7;
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, 0, &e, 1, nullptr), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, 3, &e, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("unknown handle kind 3"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, -1, &e, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, 0, nullptr, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 2, 0, &e, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT) << "NULL tags";
  const char* unknown[] = {"kv"};
  EXPECT_EQ(torpor_export_handles(pool, unknown, 1, 0, &e, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_export_handles(nullptr, nullptr, 0, 0, &e, 1, &n), TORPOR_ERROR_INVALID_HANDLE);
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, 0, nullptr, 0, &n), TORPOR_ERROR_INVALID_STATE);
  EXPECT_NE(std::string(torpor_last_error()).find("'kv_cache' asleep"), std::string::npos) << torpor_last_error();
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_free(pool, a), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);

  torpor_pool_t plain = make(0);
  int flag = -1;
  ASSERT_EQ(torpor_pool_exportable(plain, &flag), TORPOR_OK);
  EXPECT_EQ(flag, 0);
  EXPECT_EQ(torpor_pool_exportable(plain, nullptr), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_export_handles(plain, nullptr, 0, 0, nullptr, 0, &n), TORPOR_ERROR_INVALID_STATE);
  EXPECT_NE(std::string(torpor_last_error()).find("torpor_pool_options.exportable = 1"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(torpor_pool_destroy(plain), TORPOR_OK);
}

TEST_F(CExportTest, ATagLongerThanAnEntryCarriesIsRefusedWithNothingExported) {
  torpor_pool_t pool = make(1);
  const std::string tag(TORPOR_EXPORT_TAG_MAX + 1, 't');
  void* a = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, tag.c_str(), TORPOR_CLASS_CACHE, nullptr, &a), TORPOR_OK);
  torpor_chunk_export e{};
  size_t n = 0;
  const std::size_t before = open_descriptors();
  EXPECT_EQ(torpor_export_handles(pool, nullptr, 0, TORPOR_HANDLE_POSIX_FD, &e, 1, &n), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("TORPOR_EXPORT_TAG_MAX"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(open_descriptors(), before);
  EXPECT_EQ(torpor_free(pool, a), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

// --- a GPU: the driver's own word on the RDMA flag ---------------------------------------------

#ifdef TORPOR_HAVE_CUDA
TEST(ExportCudaTest, ExportableMemoryIsGpuDirectRdmaCapableWhereTheDeviceSupportsIt) {
  std::string skip;
  std::shared_ptr<Driver> d = CudaBackend::open(skip);
  if (!d) GTEST_SKIP() << skip;
  if (!d->device_properties(0).gpu_direct_rdma_vmm)
    GTEST_SKIP() << "device 0 reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 0";
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr);
  using get_attribute_t = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  auto get_attribute = reinterpret_cast<get_attribute_t>(::dlsym(lib, "cuPointerGetAttribute"));
  ASSERT_NE(get_attribute, nullptr);
  d->make_current(0);  // cuPointerGetAttribute needs a current context
  PoolOptions o;
  o.va_bytes = std::size_t{1} << 30;
  o.exportable = true;
  {
    Pool pool(*d, o);
    void* kv = pool.allocate(std::size_t{4} << 20, {"kv_cache", MemoryClass::cache, ""});
    int capable = 0;
    ASSERT_EQ(get_attribute(&capable, CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                            reinterpret_cast<CUdeviceptr>(kv)),
              CUDA_SUCCESS);
    EXPECT_EQ(capable, 1) << "exportable memory is created with allocFlags.gpuDirectRDMACapable";
    std::vector<ExportedChunk> v = pool.export_handles({"kv_cache"}, HandleKind::posix_fd);
    ASSERT_EQ(v.size(), 1u);
    EXPECT_TRUE(v[0].gpu_direct_rdma);
    pool.sleep(2);
    v.clear();
    pool.wake_up();
    capable = 0;
    ASSERT_EQ(get_attribute(&capable, CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                            reinterpret_cast<CUdeviceptr>(kv)),
              CUDA_SUCCESS);
    EXPECT_EQ(capable, 1) << "and so is the memory a wake maps";
    pool.deallocate(kv);
  }
  ::dlclose(lib);
}
#endif

}  // namespace
}  // namespace torpor::test
