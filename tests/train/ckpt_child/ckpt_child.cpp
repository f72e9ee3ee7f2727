// A training process for test_optim's separate-process checkpoint tests
// (tests/train/test_checkpoint_process.cpp). Prints "loss <step> <%a>" per
// step, so that losses compare exactly as text.
//
//   ckpt_child straight <steps> <params.safetensors>   train from scratch, write the final state
//   ckpt_child first <steps> <dir>                      train, save through CheckpointManager, exit
//   ckpt_child resume <steps> <dir> <params.safetensors> load_latest, train on, write the final state
//   ckpt_child loop <dir>                               resume if there is a checkpoint, then train
//                                                       and save every step until killed
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "ckpt_rig.h"
#include "kiln/io/safetensors.h"

namespace {

using kiln::ckpt_test::Rig;

void train(Rig& rig, int64_t steps) {
  for (int64_t i = 0; i < steps; ++i) {
    const float loss = rig.train_step();
    std::printf("loss %lld %a\n", static_cast<long long>(rig.step), static_cast<double>(loss));
  }
}

int usage() {
  std::fprintf(stderr, "usage: ckpt_child straight|first|resume|loop ... (see the source)\n");
  return 2;
}

int run(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string mode = argv[1];
  Rig rig;
  if (mode == "straight" && argc == 4) {
    train(rig, std::atoll(argv[2]));
    kiln::io::save_safetensors(argv[3], rig.final_state());
  } else if (mode == "first" && argc == 4) {
    train(rig, std::atoll(argv[2]));
    kiln::train::CheckpointManager(argv[3]).save(rig.refs(), rig.info());
  } else if (mode == "resume" && argc == 5) {
    kiln::train::CheckpointManager m(argv[3]);
    rig.resume(m.load_latest(rig.refs()));
    std::printf("resumed %lld\n", static_cast<long long>(rig.step));
    train(rig, std::atoll(argv[2]));
    kiln::io::save_safetensors(argv[4], rig.final_state());
  } else if (mode == "loop" && argc == 3) {
    kiln::train::CheckpointManager m(argv[2]);
    if (m.latest()) rig.resume(m.load_latest(rig.refs()));
    const pid_t parent = ::getppid();
    // Until killed; an orphan (the test died) stops by itself.
    while (::getppid() == parent) {
      rig.train_step();
      m.save(rig.refs(), rig.info());
    }
  } else {
    return usage();
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_child: %s\n", e.what());
    return 1;
  }
}
