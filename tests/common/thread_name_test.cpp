// set_thread_name: the name the operating system shows for the thread, cut to Linux's 15 characters.
#include "common/thread_name.h"

#include <pthread.h>

#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace strata {
namespace {

std::string name_in(std::string_view set) {
  std::string got;
  std::thread t([&] {
    set_thread_name(set);
    char buf[32] = {};
    if (pthread_getname_np(pthread_self(), buf, sizeof(buf)) == 0) got = buf;
  });
  t.join();
  return got;
}

TEST(ThreadNameTest, TheOperatingSystemSeesItCutTo15Characters) {
  EXPECT_EQ(name_in("cq h2d"), "cq h2d");
  EXPECT_EQ(name_in("cq gradient io and more"), "cq gradient io ");
}

}  // namespace
}  // namespace strata
