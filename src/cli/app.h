#pragma once
// The `kiln` command line: subcommands train, resume, eval, sample, inspect.
// Every error becomes one "kiln: error: ..." message and a non-zero exit code
// (2 for a bad command line or config, 1 for a failure while running, 3 when
// the loss became NaN/Inf or anomaly mode found one), never a crash. `kiln`
// alone prints the help and exits 0.

namespace kiln::cli {

int main(int argc, char** argv);

}  // namespace kiln::cli
