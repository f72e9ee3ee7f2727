#!/usr/bin/env python3
"""Compiles kiln's CPU kernels for an AVX2-only x86-64 (-march=x86-64-v3), at -O0.

    /usr/bin/python3 scripts/check_portable_kernels.py BUILD_DIR

kiln builds with -march=native, so on the AVX-512 machines that run CI the
kernels' portable paths (the #else of each `#if defined(__AVX512F__)`) are
never compiled; an unguarded AVX-512 intrinsic then breaks the build only on
a user's AVX2 machine, as transpose16.h did (docs/decisions.md, Note [Kernels
without AVX-512]). This takes each kernel's own compile command from
BUILD_DIR/compile_commands.json, swaps -march=native for -march=x86-64-v3
-O2 for -O0 and the object for assembly thrown away, and fails if any file
does not compile.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

MARCH = "-march=x86-64-v3"


def commands(build_dir):
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    seen = set()
    for e in entries:
        path = e["file"]
        if "/src/kernels/" not in path or path in seen:
            continue
        seen.add(path)
        args = shlex.split(e["command"])
        args = [a for a in args if not a.endswith("ccache")]
        out, skip = [], False
        for a in args:
            if skip:  # the file after -o, -MF, -MT, -MQ
                skip = False
            elif a in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
            elif a not in ("-MD", "-MMD"):
                out.append(MARCH if re.fullmatch(r"-march=\S+", a) else "-O0" if re.fullmatch(r"-O\S*", a) else a)
        if MARCH not in out:
            out.insert(1, MARCH)
        # Code generation at -O0, not -fsyntax-only: a target-specific
        # always_inline intrinsic fails only when the compiler inlines it.
        yield path, e["directory"], out + ["-S", "-o", os.devnull]


def compile_one(item):
    path, cwd, args = item
    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    return path, r.returncode, r.stderr


def main(build_dir):
    items = list(commands(build_dir))
    if not items:
        print(f"check_portable_kernels: no kernel sources in {build_dir}/compile_commands.json", file=sys.stderr)
        return 1
    failed = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for path, rc, err in pool.map(compile_one, items):
            if rc != 0:
                failed += 1
                print(f"check_portable_kernels: {os.path.relpath(path)} does not compile with {MARCH}:\n{err}",
                      file=sys.stderr)
    print(f"check_portable_kernels: {len(items) - failed} of {len(items)} kernel sources compile with {MARCH}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/release"))
