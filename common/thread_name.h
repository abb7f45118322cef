// thread_name.h — names the calling thread for the operating system, so that `top -H`, `perf report --sort
// comm` and debuggers tell Strata's threads apart (the copy queues, the I/O engines' reapers, the optimizer's
// worker). Linux keeps at most 15 characters; longer names are cut there.
#pragma once

#include <string_view>

namespace strata {

void set_thread_name(std::string_view name);

}  // namespace strata
