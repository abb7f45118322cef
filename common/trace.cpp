#include "common/trace.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include <fmt/format.h>

namespace strata::trace {
namespace {

struct Event {
  const char* name;
  uint64_t begin_ns, end_ns;
  int64_t arg;
  uint32_t tid;
  char phase;
  std::atomic<bool> ready;  // every field written (write() skips one still being filled)
};

struct Recorder {
  std::unique_ptr<Event[]> events;
  size_t capacity = 0;
  std::atomic<size_t> next{0}, dropped{0};
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
  std::mutex mu;  // thread names
  std::map<uint32_t, std::string> names;
  std::atomic<uint32_t> next_tid{1};
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: threads may record during exit
  return *r;
}

thread_local uint32_t t_tid = 0;  // 0: none yet

uint32_t this_tid() {
  if (t_tid == 0) t_tid = recorder().next_tid.fetch_add(1);
  return t_tid;
}

// JSON string contents: the names are our own literals, but a quote or backslash must not break the file.
std::string escaped(const char* s) {
  std::string out;
  for (; *s != '\0'; ++s) {
    if (*s == '"' || *s == '\\') out += '\\';
    out += static_cast<unsigned char>(*s) < 0x20 ? ' ' : *s;
  }
  return out;
}

}  // namespace

namespace detail {

std::atomic<bool> g_on{false};

uint64_t now_ns() {
  // +1: 0 means "taken while off".
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - recorder().origin)
                                   .count()) +
         1;
}

void record(char phase, const char* name, uint64_t begin_ns, uint64_t end_ns, int64_t arg) {
  Recorder& r = recorder();
  const size_t i = r.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= r.capacity) {
    r.dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Event& e = r.events[i];
  e.name = name;
  e.begin_ns = begin_ns;
  e.end_ns = end_ns;
  e.arg = arg;
  e.tid = this_tid();
  e.phase = phase;
  e.ready.store(true, std::memory_order_release);
}

}  // namespace detail

void start(size_t capacity) {
  Recorder& r = recorder();
  detail::g_on.store(false);
  if (capacity != r.capacity) {
    r.events = std::make_unique<Event[]>(capacity);
    r.capacity = capacity;
  }
  for (size_t i = 0; i < r.capacity; ++i) r.events[i].ready.store(false, std::memory_order_relaxed);
  r.next.store(0);
  r.dropped.store(0);
  {
    std::lock_guard lock(r.mu);
    r.names.clear();
  }
  r.origin = std::chrono::steady_clock::now();
  detail::g_on.store(true);
}

size_t recorded() {
  const Recorder& r = recorder();
  return std::min(r.next.load(), r.capacity);
}

size_t dropped() { return recorder().dropped.load(); }

void name_thread(const char* name) {
  if (!on()) return;
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  // A thread that takes the name of one before it (a worker started anew each step) continues its row.
  for (const auto& [tid, known] : r.names) {
    if (known == name) {
      t_tid = tid;
      return;
    }
  }
  r.names[this_tid()] = name;
}

Status write(const std::string& path) {
  detail::g_on.store(false);
  Recorder& r = recorder();
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return Status::io_error("trace: cannot create {}: {}", path, std::strerror(errno));
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto add = [&](const std::string& line) {
    if (!first) out += ",\n";
    first = false;
    out += line;
  };
  {
    std::lock_guard lock(r.mu);
    for (const auto& [tid, name] : r.names)
      add(fmt::format(R"({{"ph":"M","name":"thread_name","pid":1,"tid":{},"args":{{"name":"{}"}}}})", tid,
                      escaped(name.c_str())));
  }
  const size_t n = recorded();
  uint64_t async_id = 0;
  bool failed = false;
  for (size_t i = 0; i < n && !failed; ++i) {
    const Event& e = r.events[i];
    if (!e.ready.load(std::memory_order_acquire)) continue;
    const std::string name = escaped(e.name);
    const std::string args = e.arg >= 0 ? fmt::format(R"(,"args":{{"arg":{}}})", e.arg) : "";
    const double ts = e.begin_ns / 1e3, dur = (e.end_ns - e.begin_ns) / 1e3;  // microseconds
    switch (e.phase) {
      case 'X':
        add(fmt::format(R"({{"ph":"X","name":"{}","pid":1,"tid":{},"ts":{:.3f},"dur":{:.3f}{}}})", name, e.tid, ts,
                        dur, args));
        break;
      case 'b':
        ++async_id;
        add(fmt::format(R"({{"ph":"b","cat":"async","id":{},"name":"{}","pid":1,"tid":{},"ts":{:.3f}{}}})", async_id,
                        name, e.tid, ts, args));
        add(fmt::format(R"({{"ph":"e","cat":"async","id":{},"name":"{}","pid":1,"tid":{},"ts":{:.3f}}})", async_id,
                        name, e.tid, e.end_ns / 1e3));
        break;
      default:
        add(fmt::format(R"({{"ph":"i","s":"t","name":"{}","pid":1,"tid":{},"ts":{:.3f}{}}})", name, e.tid, ts, args));
    }
    if (out.size() > (size_t{1} << 24)) {
      failed = std::fwrite(out.data(), 1, out.size(), f) != out.size();
      out.clear();
    }
  }
  out += "\n]}\n";
  if (!failed) failed = std::fwrite(out.data(), 1, out.size(), f) != out.size();
  if (std::fclose(f) != 0) failed = true;
  if (failed) return Status::io_error("trace: writing {} failed: {}", path, std::strerror(errno));
  return Status::ok();
}

}  // namespace strata::trace
