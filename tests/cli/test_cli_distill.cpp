// Knowledge distillation in `kiln train` ([distill], src/cli/distill.h): a
// tiny MLP teacher is trained, then a smaller student learns from it. The
// teacher's accuracy the run reports is `kiln eval`'s for the teacher; an
// alpha-0 student computes the very losses of a run without a teacher (so
// loading the teacher moves no random stream); soft and hard runs train and
// resume; a missing teacher, a class-count mismatch and bad settings are
// config errors (exit 2) naming what was expected and what was got.
#include <gtest/gtest.h>

#include "cli_util.h"

using namespace kiln;
using namespace kiln::test;
namespace fs = std::filesystem;

namespace {

struct Fixture {
  TempDir dir;
  fs::path teacher;
  std::string config;
  Fixture() {
    write_text(dir.path() / "t.toml", tiny_mlp_config());
    teacher = dir.path() / "teacher";
    auto t = kiln_cli("train " + dir.file("t.toml") + " --out " + teacher.string());
    EXPECT_EQ(t.rc, 0) << t.output;
    // The student: a quarter of the teacher's hidden units, 20 steps.
    write_text(dir.path() / "s.toml", tiny_mlp_config());
    config = dir.file("s.toml") + " --set model.hidden=[8] --set train.steps=20 --set train.eval_every=0";
  }
  std::string with_teacher(const fs::path& run) const {
    return "train " + config + " --out " + run.string() + " --set 'distill.teacher=\"" + teacher.string() + "\"'";
  }
};

// One teacher for every test: training it is most of the suite's time.
Fixture& fixture() {
  static Fixture f;
  return f;
}

std::string after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return "";
  const size_t end = text.find('%', at);
  return text.substr(at + key.size(), end - at - key.size());
}

}  // namespace

TEST(CliDistill, ReportsTheTeachersAccuracyAsKilnEvalDoes) {
  Fixture& f = fixture();
  auto ev = kiln_cli("eval " + f.teacher.string());
  ASSERT_EQ(ev.rc, 0) << ev.output;
  const std::string want = after(ev.output, "accuracy ");
  ASSERT_FALSE(want.empty()) << ev.output;
  auto s = kiln_cli(f.with_teacher(f.dir.path() / "soft") + " --set distill.temperature=2.0 --set distill.alpha=0.5");
  ASSERT_EQ(s.rc, 0) << s.output;
  EXPECT_NE(s.output.find("distilling from mlp teacher " + (f.teacher / "checkpoints").string()), std::string::npos)
      << s.output;
  EXPECT_NE(s.output.find("(soft, temperature 2.0, alpha 0.5)"), std::string::npos) << s.output;
  EXPECT_EQ(after(s.output, "teacher accuracy "), want) << s.output;
  EXPECT_NE(s.output.find("on this run's 64 evaluation samples"), std::string::npos) << s.output;
  EXPECT_EQ(train_losses(f.dir.path() / "soft").size(), 20u);
  // The run's config records the teacher, so `kiln resume` loads it again.
  auto r = kiln_cli("resume " + (f.dir.path() / "soft").string() + " --set train.steps=24");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("distilling from mlp teacher"), std::string::npos) << r.output;
  EXPECT_EQ(train_losses(f.dir.path() / "soft").size(), 24u);
}

// alpha = 0 leaves only the cross-entropy: the student's losses are bitwise a
// plain run's, which they could not be if building the teacher had consumed
// random numbers (initialisation, shuffling) or changed the thread count.
// Soft (alpha 1) and hard runs see the same batches and learn something else.
TEST(CliDistill, AlphaZeroIsThePlainRunAndOtherSettingsDiffer) {
  Fixture& f = fixture();
  const fs::path plain = f.dir.path() / "plain", zero = f.dir.path() / "zero", soft = f.dir.path() / "soft1",
                 hard = f.dir.path() / "hard";
  auto p = kiln_cli("train " + f.config + " --out " + plain.string());
  ASSERT_EQ(p.rc, 0) << p.output;
  EXPECT_EQ(p.output.find("distilling"), std::string::npos) << p.output;
  auto z = kiln_cli(f.with_teacher(zero) + " --set distill.alpha=0.0");
  ASSERT_EQ(z.rc, 0) << z.output;
  auto s = kiln_cli(f.with_teacher(soft) + " --set distill.alpha=1.0");
  ASSERT_EQ(s.rc, 0) << s.output;
  auto h = kiln_cli(f.with_teacher(hard) + " --set distill.kind=hard");
  ASSERT_EQ(h.rc, 0) << h.output;
  EXPECT_NE(h.output.find("hard (DeiT"), std::string::npos) << h.output;
  const auto lp = train_losses(plain), lz = train_losses(zero), ls = train_losses(soft), lh = train_losses(hard);
  ASSERT_EQ(lp.size(), 20u);
  ASSERT_EQ(lz.size(), 20u);
  ASSERT_EQ(ls.size(), 20u);
  ASSERT_EQ(lh.size(), 20u);
  for (size_t i = 0; i < lp.size(); ++i) EXPECT_EQ(lp[i], lz[i]) << "step " << i + 1;
  EXPECT_NE(lp[0], ls[0]);
  EXPECT_NE(lp[0], lh[0]);
}

TEST(CliDistill, ConfigErrorsNameBothSides) {
  Fixture& f = fixture();
  auto missing = kiln_cli("train " + f.config + " --out " + (f.dir.path() / "x").string() +
                          " --set 'distill.teacher=\"" + (f.dir.path() / "nowhere").string() + "\"'");
  EXPECT_EQ(missing.rc, 2) << missing.output;
  EXPECT_NE(missing.output.find("distill.teacher = \"" + (f.dir.path() / "nowhere").string() +
                                "\": no such run directory"),
            std::string::npos)
      << missing.output;

  auto classes = kiln_cli(f.with_teacher(f.dir.path() / "y") + " --set data.num_classes=5");
  EXPECT_EQ(classes.rc, 2) << classes.output;
  EXPECT_NE(classes.output.find("the teacher predicts 10 classes (synthetic), the student 5 (synthetic)"),
            std::string::npos)
      << classes.output;

  // A directory that is not a run (no checkpoints under it).
  fs::create_directories(f.dir.path() / "empty");
  auto empty = kiln_cli("train " + f.config + " --out " + (f.dir.path() / "z").string() +
                        " --set 'distill.teacher=\"" + (f.dir.path() / "empty").string() + "\"'");
  EXPECT_EQ(empty.rc, 2) << empty.output;
  EXPECT_NE(empty.output.find("no checkpoint under checkpoints/"), std::string::npos) << empty.output;

  auto kind = kiln_cli(f.with_teacher(f.dir.path() / "k") + " --set distill.kind=medium");
  EXPECT_EQ(kind.rc, 2) << kind.output;
  EXPECT_NE(kind.output.find("distill.kind"), std::string::npos) << kind.output;
  EXPECT_NE(kind.output.find("medium"), std::string::npos) << kind.output;

  auto temp = kiln_cli(f.with_teacher(f.dir.path() / "t") + " --set distill.temperature=0.0");
  EXPECT_EQ(temp.rc, 2) << temp.output;
  EXPECT_NE(temp.output.find("distill.temperature"), std::string::npos) << temp.output;
  auto alpha = kiln_cli(f.with_teacher(f.dir.path() / "a") + " --set distill.alpha=1.5");
  EXPECT_EQ(alpha.rc, 2) << alpha.output;
  EXPECT_NE(alpha.output.find("distill.alpha"), std::string::npos) << alpha.output;
  for (const char* run : {"x", "y", "z", "k", "t", "a"}) EXPECT_FALSE(fs::exists(f.dir.path() / run / "checkpoints"));
}
