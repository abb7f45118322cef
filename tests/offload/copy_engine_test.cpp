// The copy engine's queues: jobs run in order on their queue's thread, prerequisites on other queues are
// waited for, and a failed prerequisite fails its dependents without running them.
#include "offload/copy_engine.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

TEST(CopyEngineTest, JobsRunInSubmissionOrderAndCountTheirBytes) {
  CopyQueue q("test");
  std::vector<int> order;
  std::vector<CopyTicket> tickets;
  for (int i = 0; i < 50; ++i) {
    tickets.push_back(q.submit(
        [&order, i] {
          order.push_back(i);  // one thread runs them: no lock needed
          return Status::ok();
        },
        10));
  }
  for (const CopyTicket& t : tickets) EXPECT_TRUE(t.wait().is_ok());
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(q.stats().jobs, 50u);
  EXPECT_EQ(q.stats().bytes, 500u);
}

TEST(CopyEngineTest, AJobWaitsForItsPrerequisitesOnOtherQueues) {
  CopyEngine e;
  std::atomic<bool> read_done{false};
  CopyTicket read = e.nvme.submit([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    read_done = true;
    return Status::ok();
  });
  bool saw_read = false;
  CopyTicket upload = e.h2d.submit([&] {
    saw_read = read_done.load();
    return Status::ok();
  }, 0, {read});
  EXPECT_TRUE(upload.wait().is_ok());
  EXPECT_TRUE(saw_read) << "the upload ran before the read it depends on";
  EXPECT_TRUE(read.done());
}

TEST(CopyEngineTest, AFailedPrerequisiteFailsItsDependentsWithoutRunningThem) {
  CopyEngine e;
  CopyTicket read = e.nvme.submit([] { return Status::io_error("swap read of key 'param.h.1.0' failed: EIO"); });
  bool ran = false;
  CopyTicket upload = e.h2d.submit([&] {
    ran = true;
    return Status::ok();
  }, 0, {read});
  const Status st = upload.wait();
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.to_string().find("param.h.1.0"), std::string::npos) << st.to_string();
  EXPECT_FALSE(ran);
  // The queue goes on with later jobs.
  EXPECT_TRUE(e.h2d.submit([] { return Status::ok(); }).wait().is_ok());
}

// A settled job runs after a failed prerequisite too, told its error (a load still waits for the buffer's
// earlier users before its ticket ends, though it copies nothing); its ticket ends with what it returns.
TEST(CopyEngineTest, ASettledJobRunsWhateverBecameOfItsPrerequisites) {
  CopyEngine e;
  CopyTicket ok = e.d2h.submit([] { return Status::ok(); });
  CopyTicket read = e.nvme.submit([] { return Status::io_error("swap read of key 'param.h.2.0' failed: EIO"); });
  std::string seen = "not run";
  CopyTicket upload = e.h2d.submit_settled(
      [&](const Status& prerequisites) {
        seen = prerequisites.to_string();
        return prerequisites;
      },
      0, {ok, read});
  const Status st = upload.wait();
  EXPECT_NE(seen.find("param.h.2.0"), std::string::npos) << seen;
  EXPECT_NE(st.to_string().find("param.h.2.0"), std::string::npos) << st.to_string();
  CopyTicket fine = e.h2d.submit_settled([](const Status& prerequisites) { return prerequisites; }, 0, {ok});
  EXPECT_TRUE(fine.wait().is_ok());
}

TEST(CopyEngineTest, DestroyingAQueueRunsEverythingItAccepted) {
  std::atomic<int> ran{0};
  {
    CopyQueue q("drain");
    for (int i = 0; i < 20; ++i) {
      q.submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
        return Status::ok();
      });
    }
  }
  EXPECT_EQ(ran.load(), 20);
}

}  // namespace
}  // namespace strata::offload
