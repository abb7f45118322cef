#include "common/thread_name.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>

namespace strata {

void set_thread_name(std::string_view name) {
  char buf[16];
  const size_t n = std::min(name.size(), sizeof(buf) - 1);
  std::memcpy(buf, name.data(), n);
  buf[n] = '\0';
  (void)pthread_setname_np(pthread_self(), buf);  // only ERANGE, which the cut rules out
}

}  // namespace strata
