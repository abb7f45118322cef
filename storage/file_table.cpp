#include "storage/file_table.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "common/check.h"
#include "common/log.h"
#include "storage/io_queue.h"

namespace strata {

namespace {
constexpr size_t kDirectAlignment = 4096;  // safe for 512-byte and 4 KiB logical blocks alike
}

FileTable::~FileTable() {
  for (Entry& e : files_)
    if (e.fd >= 0) ::close(e.fd);
}

Result<int> FileTable::open(const std::string& path, const OpenOptions& options) {
  int flags = O_RDWR | O_CLOEXEC;
  if (options.create) flags |= O_CREAT;
  if (options.truncate) flags |= O_TRUNC;
  bool direct = options.direct;
  int fd = ::open(path.c_str(), flags | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0 && direct && errno == EINVAL) {
    // tmpfs and some FUSE filesystems refuse O_DIRECT; the data is still right, only the page cache is in the way.
    static std::once_flag warned;
    std::call_once(warned, [&] {
      STRATA_LOG_WARN("{}: the filesystem refuses O_DIRECT; using buffered I/O (throughput figures will include "
                      "the page cache)", path);
    });
    direct = false;
    fd = ::open(path.c_str(), flags, 0644);
  }
  if (fd < 0) return Status::io_error("open {}: {}", path, errno_text(errno));
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < kMaxFiles; ++i) {
    if (files_[i].fd >= 0) continue;
    files_[i] = Entry{fd, direct, path};
    if (on_slot_change_) on_slot_change_(i, fd);
    return i;
  }
  ::close(fd);
  return Status::out_of_memory("open {}: all {} file slots of the I/O engine are in use", path, kMaxFiles);
}

Status FileTable::close(int file) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_ASSERT(file >= 0 && file < kMaxFiles && files_[file].fd >= 0);
  Entry e = std::move(files_[file]);
  files_[file] = Entry{};
  if (on_slot_change_) on_slot_change_(file, -1);
  if (::close(e.fd) != 0) return Status::io_error("close {}: {}", e.path, errno_text(errno));
  return Status::ok();
}

int FileTable::fd(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_ASSERT(file >= 0 && file < kMaxFiles && files_[file].fd >= 0);
  return files_[file].fd;
}

const std::string& FileTable::path(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_ASSERT(file >= 0 && file < kMaxFiles);
  return files_[file].path;  // entries are only replaced by open/close, which the caller orders after I/O
}

bool FileTable::direct(int file) const {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_ASSERT(file >= 0 && file < kMaxFiles && files_[file].fd >= 0);
  return files_[file].direct;
}

size_t FileTable::alignment(int file) const { return direct(file) ? kDirectAlignment : 1; }

Status FileTable::allocate(int file, uint64_t bytes) {
  const int f = fd(file);
  int rc;
  do {
    rc = ::fallocate(f, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return Status::ok();
  if (errno == EOPNOTSUPP) {  // a filesystem without fallocate: posix_fallocate writes zeros instead
    rc = ::posix_fallocate(f, 0, static_cast<off_t>(bytes));
    if (rc == 0) return Status::ok();
    errno = rc;
  }
  return Status::io_error("reserving {} bytes for {}: {}", bytes, path(file), errno_text(errno));
}

Result<uint64_t> FileTable::size(int file) const {
  struct stat st;
  if (::fstat(fd(file), &st) != 0) return Status::io_error("stat {}: {}", path(file), errno_text(errno));
  return static_cast<uint64_t>(st.st_size);
}

Status FileTable::sync(int file) {
  if (::fdatasync(fd(file)) != 0) return Status::io_error("fdatasync {}: {}", path(file), errno_text(errno));
  return Status::ok();
}

Result<bool> FileTable::try_lock(int file) {
  if (::flock(fd(file), LOCK_EX | LOCK_NB) == 0) return true;
  if (errno == EWOULDBLOCK) return false;
  return Status::io_error("flock {}: {}", path(file), errno_text(errno));
}

Status FileTable::create_dirs(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::io_error("creating directory {}: {}", dir, ec.message());
  return Status::ok();
}

Status FileTable::remove(const std::string& path) {
  if (::unlink(path.c_str()) != 0) return Status::io_error("removing {}: {}", path, errno_text(errno));
  return Status::ok();
}

Result<std::vector<std::string>> FileTable::list(const std::string& dir) const {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return Status::not_found("directory {} does not exist", dir);
    return Status::io_error("listing {}: {}", dir, errno_text(errno));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    bool regular = e->d_type == DT_REG;
    if (e->d_type == DT_UNKNOWN) {  // some file systems do not fill d_type: ask
      struct stat st;
      regular = ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
    }
    if (regular) names.push_back(name);
  }
  ::closedir(d);
  return names;
}

}  // namespace strata
