#!/usr/bin/env python3
"""The layer check (DESIGN.md §1, docs/architecture.md), run by scripts/test.sh.

Dependencies point one way. This fails when
  1. a file of a layer includes a kiln header of a layer above its own, or of a
     sibling layer (same rank, different layer): checked on the sources alone;
  2. a layer's CMake target links a target that is not below it: checked on the
     target graph CMake writes with --graphviz (needs a configured build dir);
  3. a layer's static library leaves undefined a symbol that only a library
     above it defines, i.e. it needs that library at link time whatever
     CMake says: checked with nm on the built libraries (needs a built dir).

  scripts/check_layers.py              the include check only
  scripts/check_layers.py build/release  all three
  scripts/check_layers.py --self-test    the include check on a made-up tree: each
                                         kind of violation is reported, allowed includes are not
Exit status 1 with one line per violation; 0 and a summary otherwise.
"""
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rank: a layer may use layers of lower rank only. Layers of equal rank are
# siblings and use neither each other. Keep in step with docs/architecture.md.
RANK = {
    "core": 0,
    "kernels": 1,
    "autograd": 2,
    "ops": 3,
    "io": 4,
    "nn": 5, "data": 5,
    "optim": 6, "quant": 6,  # quant: quantized modules are nn modules; beside optim
    "amp": 7,
    "profiler": 8,  # listens on core's record hook; train, export and dist use it
    "train": 9, "export": 9,  # export: beside train (docs/architecture.md says why)
    "dist": 10,
    "parallel": 11,  # built into kiln_dist; uses dist's groups and mesh
    "cli": 12,
}
# Layers whose headers only the named layers may include (tests aside): the
# kernels are ops' private implementation, so nn and above compose ops.
PRIVATE_TO = {"kernels": {"kernels", "ops"}}
# Public header folders that belong to a layer whose folder has another name.
ALIAS = {"models": "nn"}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]kiln/([a-z_]+)/')


def layer_of(path, root=ROOT):
    """The layer a source or header belongs to, or None (tests, bench, umbrella)."""
    rel = os.path.relpath(path, root).split(os.sep)
    if rel[:2] == ["include", "kiln"] and len(rel) > 3:
        return ALIAS.get(rel[2], rel[2])
    if rel[:3] == ["src", "kernels", "include"]:
        return "kernels"
    if rel[0] == "src" and len(rel) > 2:
        return rel[1]
    if rel[:2] == ["tools", "kiln"]:
        return "cli"
    return None


def check_includes(root=ROOT):
    errors, files = [], 0
    for top in ("include", "src", "tools"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                if not name.endswith((".h", ".cpp")):
                    continue
                path = os.path.join(dirpath, name)
                own = layer_of(path, root)
                if own is None:
                    continue
                if own not in RANK:
                    errors.append(f"{os.path.relpath(path, root)}: folder of unknown layer '{own}' "
                                  "(add it to scripts/check_layers.py and docs/architecture.md)")
                    continue
                files += 1
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE_RE.match(line)
                        if not m:
                            continue
                        dep = ALIAS.get(m.group(1), m.group(1))
                        if dep == own:
                            continue
                        if dep not in RANK:
                            errors.append(f"{os.path.relpath(path, root)}:{n}: includes kiln/{m.group(1)}/, "
                                          "a folder of no known layer")
                        elif dep in PRIVATE_TO and own not in PRIVATE_TO[dep]:
                            errors.append(f"{os.path.relpath(path, root)}:{n}: layer {own} includes "
                                          f"kiln/{m.group(1)}/, private to {', '.join(sorted(PRIVATE_TO[dep]))}")
                        elif RANK[dep] >= RANK[own]:
                            kind = "a sibling layer" if RANK[dep] == RANK[own] else "a layer above"
                            errors.append(f"{os.path.relpath(path, root)}:{n}: layer {own} includes "
                                          f"kiln/{m.group(1)}/ ({dep}, {kind})")
    return errors, files


def check_targets(build):
    """Edges kiln_X -> kiln_Y of CMake's own target graph."""
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        dot = os.path.join(tmp, "deps.dot")
        subprocess.run(["cmake", f"--graphviz={dot}", "."], cwd=build, check=True,
                       stdout=subprocess.DEVNULL)
        text = open(dot, encoding="utf-8").read()
    # Labels read "kiln_ops\n(kiln::ops)": the target name is the first line.
    names = {node: label.split("\\n")[0]
             for node, label in re.findall(r'"(node\d+)"\s*\[\s*label\s*=\s*"([^"]+)"', text)}
    edges = 0
    for a, b in re.findall(r'"(node\d+)"\s*->\s*"(node\d+)"', text):
        src, dst = names.get(a, ""), names.get(b, "")
        ls, ld = src.removeprefix("kiln_"), dst.removeprefix("kiln_")
        if not (src.startswith("kiln_") and dst.startswith("kiln_")) or ls not in RANK or ld not in RANK:
            continue
        edges += 1
        if RANK[ld] >= RANK[ls]:
            errors.append(f"CMake: target {src} links {dst}, which is not below it")
    return errors, edges


def nm_symbols(lib, defined):
    args = ["nm", "-C", "--defined-only" if defined else "-u", lib]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    syms = set()
    for line in out.splitlines():
        parts = line.split(None, 2)
        if defined and len(parts) == 3 and parts[1] in "TWVBDRu":
            syms.add(parts[2])
        elif not defined and len(parts) == 2 and parts[0] == "U":
            syms.add(parts[1])
    return syms


def check_symbols(build):
    errors = []
    libs = {l: os.path.join(build, f"libkiln_{l}.a") for l in RANK}
    libs = {l: p for l, p in libs.items() if os.path.exists(p)}
    defined = {l: nm_symbols(p, True) for l, p in libs.items()}
    for own, path in libs.items():
        below = set().union(*(defined[l] for l in libs if RANK[l] < RANK[own] or l == own))
        elsewhere = set().union(*(defined[l] for l in libs if l != own and RANK[l] >= RANK[own]))
        needed = (nm_symbols(path, False) - below) & elsewhere
        for sym in sorted(needed)[:10]:
            errors.append(f"link: libkiln_{own}.a needs {sym}, defined only in a layer not below it")
        if len(needed) > 10:
            errors.append(f"link: libkiln_{own}.a needs {len(needed) - 10} more such symbols")
    return errors, len(libs)


def self_test():
    """Check (1) against a tree whose violations are known, so a broken check cannot pass CI."""
    tree = {
        "src/core/ok.cpp": '#include "kiln/core/tensor.h"\n',
        "src/ops/ok.cpp": '#include "kiln/kernels/loop.h"\n#include "kiln/autograd/node.h"\n',
        "src/nn/ok.cpp": '#include "kiln/models/gpt.h"\n#include "kiln/ops/linalg.h"\n',
        "src/autograd/up.cpp": '#include "kiln/ops/factory.h"\n',
        "include/kiln/core/up.h": '#include <kiln/io/stateful.h>\n',
        "src/nn/sibling.cpp": '#include "kiln/data/loader.h"\n',
        "src/optim/private.cpp": '#include "kiln/kernels/loop.h"\n',
        "src/kernels/include/kiln/kernels/up.h": '#include "kiln/ops/conv.h"\n',
        "src/mystery/x.cpp": "\n",
    }
    want = ["src/autograd/up.cpp:1: layer autograd includes kiln/ops/ (ops, a layer above)",
            "include/kiln/core/up.h:1: layer core includes kiln/io/ (io, a layer above)",
            "src/nn/sibling.cpp:1: layer nn includes kiln/data/ (data, a sibling layer)",
            "src/optim/private.cpp:1: layer optim includes kiln/kernels/, private to kernels, ops",
            "src/kernels/include/kiln/kernels/up.h:1: layer kernels includes kiln/ops/ (ops, a layer above)",
            "src/mystery/x.cpp: folder of unknown layer 'mystery'"]
    with tempfile.TemporaryDirectory() as root:
        for rel, text in tree.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
                f.write(text)
        errors, _ = check_includes(root)
    missing = [w for w in want if not any(e.startswith(w) for e in errors)]
    extra = [e for e in errors if not any(e.startswith(w) for w in want)]
    for m in missing:
        print(f"check_layers self-test: expected a report of: {m}")
    for e in extra:
        print(f"check_layers self-test: reported an allowed include: {e}")
    if missing or extra:
        return 1
    print(f"check_layers: self-test ok ({len(want)} violations reported, 3 allowed files passed)")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    errors, files = check_includes()
    summary = [f"{files} files' includes"]
    if len(sys.argv) > 1:
        build = os.path.abspath(sys.argv[1])
        e, edges = check_targets(build)
        errors += e
        summary.append(f"{edges} target links")
        e, libs = check_symbols(build)
        errors += e
        summary.append(f"{libs} libraries' undefined symbols")
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} violation(s) of the layer order (docs/architecture.md)")
        return 1
    print("check_layers: ok (" + ", ".join(summary) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
