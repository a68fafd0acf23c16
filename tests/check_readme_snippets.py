#!/usr/bin/env python3
"""The README's C++ excerpts are real code: every ```cpp block names, in the paragraph above it, the
example it is taken from (a link to examples/...), and each of its lines, except elisions
(comments starting with '// ...'), is a line of that file, in the same order. The suite builds and
runs the examples, so the excerpts compile and do what they say."""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
problems = []
blocks = list(re.finditer(r"```cpp\n(.*?)```", text, re.S))
if not blocks:
    problems.append("README.md has no ```cpp block (the check would be empty)")
for block in blocks:
    before = text[: block.start()].rstrip().rsplit("\n\n", 1)[-1]
    source = re.search(r"\((examples/[^)\s]+)\)", before)
    line_no = text[: block.start()].count("\n") + 1
    if not source:
        problems.append(f"README.md:{line_no}: a cpp block whose paragraph names no examples/ file")
        continue
    lines = [l.rstrip() for l in open(os.path.join(root, source.group(1)), encoding="utf-8").read().split("\n")]
    at = 0
    for k, line in enumerate(block.group(1).split("\n")):
        if not line.strip() or line.strip().startswith("// ..."):
            continue
        try:
            at = lines.index(line.rstrip(), at) + 1
        except ValueError:
            problems.append(f"README.md:{line_no + 1 + k}: not a line of {source.group(1)} (after the previous one): {line.strip()}")
for p in problems:
    print(p)
print(f"readme_snippets: {len(blocks)} block(s), {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
