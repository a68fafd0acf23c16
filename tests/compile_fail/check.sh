#!/usr/bin/env bash
# Compile-time misuse must fail to compile with a message that says what to do.
# Usage: check.sh <file.cpp> <expected text> <compiler and flags...>
set -uo pipefail
file=$1 expected=$2
shift 2
if out=$("$@" -fsyntax-only "$file" 2>&1); then
  echo "$file compiled, but it must not"
  exit 1
fi
if ! grep -qF -- "$expected" <<<"$out"; then
  echo "$file failed to compile, but without the expected message: $expected"
  echo "$out" | head -40
  exit 1
fi
echo "$file: refused with: $expected"
