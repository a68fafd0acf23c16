#!/usr/bin/env python3
"""Fails when a library file includes a header of a higher layer (see README, "Layout").

Layers, lowest first. A file may include headers of its own folder and of the folders listed
before it; never one listed after it. Headers named *_internal.hpp are not installed: source files
may include them, installed headers never. Every #include <linum/...> must name a file of the tree, and every folder of the library must
have its place in this list.
"""
import os
import re
import sys

LAYERS = [
    "core",               # arrays, dtypes, shapes, errors, memory accounting and timeline, threading, trees, files
    "core/kernels",       # compute engines (Eigen, oneDNN, bf16 GEMM) and the engine choice
    "core/storage",       # where kept values live: the spill file (offload), compression codecs
    "core/autodiff",      # the tape, the primitive path, grad, custom_vjp, pytrees
    "core/ops",           # every differentiable op
    "core/transforms",    # transformations composed of grad/vjp/jvp and ops: jacobians, hessian, hvp, vmap
    "core/pch",           # the library's precompiled header: the core headers most sources include
    "rng",                # JAX-compatible keys and named streams
    "modules",            # Scope, Module, init/apply, initializers
    "lift",               # lifted transforms: checkpoint engine, policies, remat, scan, planner
    "nn",                 # layers (above the transforms they use, as flax.linen)
    "train/io",           # variable files (MessagePack, JSON), the checkpoint manager
    "train",              # optimizers, metrics
    "train/distributed",  # communicator, data parallelism
    "train/data",         # datasets, IDX reader, loader
]
TOP = {"linum.hpp"}  # the umbrella header may include everything
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]linum/([^>"]+)[>"]', re.M)


def folder_of(path):
    return os.path.dirname(path)


def internal(path):
    return path.endswith("_internal.hpp")


def main(root):
    os.chdir(root)
    rank = {f: i for i, f in enumerate(LAYERS)}
    problems = []
    files = []
    for top in sorted({f.split("/")[0] for f in LAYERS}):
        for dirpath, _, names in os.walk(top):
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith((".hpp", ".cpp"))]
    for path in files + sorted(TOP):
        folder = folder_of(path)
        if path not in TOP and folder not in rank:
            problems.append(f"{path}: folder '{folder}' has no layer; add it to LAYERS in .ci/check_layers.py")
            continue
        text = open(path, encoding="utf-8").read()
        for included in INCLUDE.findall(text):
            if not os.path.isfile(included):
                problems.append(f"{path}: includes <linum/{included}>, which is not a file of the tree")
                continue
            target = folder_of(included)
            if path.endswith(".hpp") and not internal(path) and internal(included):
                problems.append(f"{path}: an installed header includes the internal {included}")
            if path in TOP or folder == target:
                continue
            if target not in rank:
                problems.append(f"{path}: includes {included} from folder '{target}', which has no layer")
            elif rank[target] > rank[folder]:
                problems.append(f"{path} (layer {folder}) includes {included} of the higher layer {target}")
    for p in problems:
        print(p)
    print(f"check_layers: {len(files) + len(TOP)} files, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")))
