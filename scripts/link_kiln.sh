#!/usr/bin/env bash
# Leaves a `kiln` a user can run. The README's commands and kiln's own hints say
# `kiln ...`, but the build puts the executable at build/release/bin/kiln: this
# links it into a directory on PATH (/usr/local/bin) when that directory is
# writable (as root), and otherwise prints the line that puts it on PATH.
# demo.sh and test.sh call it after building.
#   KILN_BIN=FILE      the executable (default build/release/bin/kiln)
#   KILN_LINK_DIR=DIR  where the link goes (default /usr/local/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath -m "${KILN_BIN:-build/release/bin/kiln}")
dir=${KILN_LINK_DIR:-/usr/local/bin}
if [[ ! -x "$bin" ]]; then
  echo "link_kiln: $bin is not built (cmake --build build/release --target kiln_cmd)" >&2
  exit 1
fi
path_line="export PATH=\"$(dirname "$bin"):\$PATH\""
link="$dir/kiln"
# Never replace a `kiln` that is not a link (someone else's program of that name).
if [[ -d "$dir" && -w "$dir" && ( ! -e "$link" || -L "$link" ) ]]; then
  ln -sfn "$bin" "$link"
  echo "kiln: $link -> $bin"
  case ":$PATH:" in
    *":$dir:"*) ;;
    *) echo "kiln: $dir is not on your PATH; add it, or run: $path_line" ;;
  esac
else
  why="$dir is not writable"
  [[ -d "$dir" ]] || why="$dir does not exist"
  [[ -e "$link" && ! -L "$link" ]] && why="$link exists and is not kiln's link"
  echo "kiln: not linked into $dir ($why); to run it as \`kiln\`, run (or add to your shell's profile):"
  echo "  $path_line"
fi
