// The `kiln` executable; everything it does lives in kiln_cli (src/cli) so the tests can reach it.
#include "cli/app.h"

int main(int argc, char** argv) { return kiln::cli::main(argc, argv); }
