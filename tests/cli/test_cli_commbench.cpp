// `kiln commbench` (issue 20) on 2 ranks through `kiln launch` and on one
// process: the table's shape (every collective at every doubling size, the
// columns nccl-tests prints), bus bandwidth = algorithm bandwidth x the
// collective's factor in the table and in the JSON, every result checked
// right, Open MPI's algorithm choice reported back, and bad flags refused
// once. Small sizes and few iterations: each job ends in a second or two.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli_util.h"

namespace kiln::test {
namespace {

struct TableRow {
  std::string op;
  long long bytes = 0, count = 0, wrong = -1;
  double time_us = 0, algbw = 0, busbw = 0;
};

// The rows of the table: the lines that do not start with '#' and have 7 fields.
std::vector<TableRow> table_rows(const std::string& output) {
  std::vector<TableRow> rows;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    const size_t start = line.find_first_not_of(' ');
    if (start == std::string::npos || line[start] == '#') continue;
    std::istringstream f(line);
    TableRow r;
    if (f >> r.op >> r.bytes >> r.count >> r.time_us >> r.algbw >> r.busbw >> r.wrong) rows.push_back(r);
  }
  return rows;
}

// nccl-tests' factors at n ranks.
double factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

TEST(CliCommbench, TwoRanksPrintEveryCollectiveAtEverySizeWithBusbwFromAlgbw) {
  TempDir dir;
  const std::string json_path = dir.file("bench.json");
  auto r = launch2("commbench --max-bytes 4K --iters 3 --warmup 1 --json " + json_path);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("# kiln commbench: 2 ranks, float32, 3 iterations after 1 warm-up"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("allreduce 2(n-1)/n = 1; reduce_scatter (n-1)/n = 0.5;"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("time(us)  algbw(GB/s)  busbw(GB/s)   wrong"), std::string::npos) << r.output;

  const auto rows = table_rows(r.output);
  const std::vector<std::string> ops = {"allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast"};
  ASSERT_EQ(rows.size(), ops.size() * 10) << "8 B .. 4 KiB is 10 doublings per collective (rank 0 alone prints)\n"
                                          << r.output;
  for (size_t i = 0; i < rows.size(); ++i) {
    const TableRow& row = rows[i];
    SCOPED_TRACE(row.op + " " + std::to_string(row.bytes) + " B");
    EXPECT_EQ(row.op, ops[i / 10]);
    EXPECT_EQ(row.bytes, 8LL << (i % 10));
    EXPECT_EQ(row.count * 4, row.bytes) << "float32 elements";
    EXPECT_GT(row.time_us, 0);
    EXPECT_EQ(row.wrong, 0);
    // Four decimals printed: busbw and algbw x factor agree to their rounding.
    EXPECT_NEAR(row.busbw, row.algbw * factor(row.op, 2), 1e-4) << "busbw = algbw x factor";
    EXPECT_NEAR(row.algbw, row.bytes / row.time_us * 1e-3, 1e-4 + 1e-3 * row.algbw) << "algbw = size / time";
  }

  // The JSON holds the same rows at full precision.
  const auto j = read_json(json_path);
  EXPECT_EQ(j["ranks"].get<int>(), 2);
  EXPECT_EQ(j["iters"].get<int>(), 3);
  for (const auto& op : ops) EXPECT_EQ(j["algorithms"][op].get<std::string>(), "default") << op;
  ASSERT_EQ(j["results"].size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& e = j["results"][i];
    const std::string op = e["op"].get<std::string>();
    EXPECT_EQ(op, rows[i].op);
    EXPECT_EQ(e["bytes"].get<long long>(), rows[i].bytes);
    EXPECT_EQ(e["wrong"].get<long long>(), 0);
    EXPECT_DOUBLE_EQ(e["bus_factor"].get<double>(), factor(op, 2)) << op;
    EXPECT_DOUBLE_EQ(e["busbw_gbps"].get<double>(), e["algbw_gbps"].get<double>() * factor(op, 2)) << op;
    EXPECT_DOUBLE_EQ(e["algbw_gbps"].get<double>(),
                     e["bytes"].get<double>() / (e["time_us"].get<double>() * 1e-6) / 1e9)
        << op;
  }
}

TEST(CliCommbench, AlgorithmChoiceReachesOpenMpi) {
  // One name for every collective that has it; the header reports what Open
  // MPI took (read back through MPI_T), and the results are still right.
  TempDir dir;
  const std::string json_path = dir.file("ring.json");
  auto r = launch2("commbench --ops allreduce,allgather,alltoall --min-bytes 1K --max-bytes 8K --iters 2 --warmup 1 "
                   "--algorithm ring --json " +
                   json_path);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce ring; allgather ring; alltoall default (no ring);"), std::string::npos)
      << r.output;
  const auto j = read_json(json_path);
  EXPECT_EQ(j["algorithms"]["allreduce"].get<std::string>(), "ring");
  EXPECT_EQ(table_rows(r.output).size(), 12u) << r.output;
  for (const auto& row : table_rows(r.output)) EXPECT_EQ(row.wrong, 0) << row.op << " " << row.bytes;

  // Per collective.
  r = launch2("commbench --ops allreduce,broadcast --max-bytes 64 --iters 2 --warmup 0 "
              "--algorithm allreduce=recursive_doubling,broadcast=binomial");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce recursive_doubling; broadcast binomial;"), std::string::npos) << r.output;
}

// --wire: allreduce's float32 buffers sent as bf16 or fp16 (DDP's
// compression hooks); the sizes stay the float32 buffer's, and every result is
// checked against the roundings (each value in, the sum out).
TEST(CliCommbench, AllreduceSentAs16BitsIsCheckedAgainstItsRoundings) {
  for (const std::string wire : {"bf16", "fp16"}) {
    TempDir dir;
    const std::string json_path = dir.file("wire.json");
    auto r = launch2("commbench --ops allreduce --min-bytes 1K --max-bytes 1M --iters 2 --warmup 1 --wire " + wire +
                     " --json " + json_path);
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("# kiln commbench: 2 ranks, float32 sent as " + wire + ", 2 iterations"), std::string::npos)
        << r.output;
    const auto rows = table_rows(r.output);
    ASSERT_EQ(rows.size(), 11u) << "1 KiB .. 1 MiB\n" << r.output;
    for (const auto& row : rows) {
      EXPECT_EQ(row.count * 4, row.bytes) << "the float32 buffer's size";
      EXPECT_EQ(row.wrong, 0) << wire << " " << row.bytes;
    }
    EXPECT_EQ(read_json(json_path)["wire"].get<std::string>(), wire);
  }
}

TEST(CliCommbench, OneProcessRunsWithoutMpirun) {
  auto r = kiln_cli("commbench --ops allreduce,broadcast --max-bytes 32 --iters 2 --warmup 1");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("one rank moves nothing between processes"), std::string::npos) << r.output;
  const auto rows = table_rows(r.output);
  ASSERT_EQ(rows.size(), 6u) << "8, 16, 32 B for each\n" << r.output;
  for (const auto& row : rows) {
    // 2(n-1)/n is 0 at one rank: an allreduce of one process crosses no link.
    EXPECT_EQ(row.busbw, row.op == "allreduce" ? 0.0 : row.algbw) << row.op;
    EXPECT_EQ(row.wrong, 0);
  }
}

TEST(CliCommbench, BadFlagsAreRefusedOnce) {
  auto r = launch2("commbench --algorithm bogus");
  EXPECT_EQ(r.rc, 2) << r.output;
  EXPECT_NE(r.output.find("kiln commbench: --algorithm bogus: expected default, op=name pairs"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("  allreduce: "), std::string::npos) << "the valid names are listed\n" << r.output;
  size_t n = 0;
  for (size_t at = r.output.find("kiln: error:"); at != std::string::npos; at = r.output.find("kiln: error:", at + 1))
    ++n;
  EXPECT_EQ(n, 1u) << "one message, not one per rank\n" << r.output;

  struct Case {
    std::string args, want;
  };
  for (const Case& c : {Case{"--algorithm allreduce=butterfly", "for allreduce one of default, "},
                        Case{"--ops allreduce,scan", "--ops allreduce,scan: expected a comma-separated list of"},
                        Case{"--min-bytes 1K --max-bytes 512", "--max-bytes 512: expected at least --min-bytes (1K)"},
                        Case{"--max-bytes 3.5", "--max-bytes 3.5: expected a whole number of bytes"},
                        Case{"--iters 0", "--iters 0: expected an integer >= 1"},
                        Case{"--wire int8", "--wire int8: expected float32, bf16 or fp16"},
                        Case{"--wire bf16", "--wire bf16: expected float32 with reduce_scatter (16-bit sending is "
                                            "allreduce's"}}) {
    auto one = kiln_cli("commbench " + c.args);
    EXPECT_EQ(one.rc, 2) << c.args << "\n" << one.output;
    EXPECT_NE(one.output.find(c.want), std::string::npos) << c.args << "\n" << one.output;
  }
}

}  // namespace
}  // namespace kiln::test
