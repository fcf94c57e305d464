#!/usr/bin/env bash
# Fails (exit 1) when any C++/CUDA file under csrc/ is not formatted as the repository's .clang-format says; run by CI.
# To fix: the same file list through `clang-format -i`. Pinned version: pip install clang-format==23.1.5 (other
# versions may format differently, so a different one only warns here). CLANG_FORMAT names the binary to use.
# Not a linter: it checks layout only.
set -euo pipefail
cd "$(dirname "$0")/.."
pinned="23.1.5"
cf="${CLANG_FORMAT:-clang-format}"
if ! command -v "$cf" >/dev/null 2>&1; then
  echo "check_clang_format: '$cf' not found; install it with: pip install clang-format==$pinned" >&2
  exit 2
fi
version="$("$cf" --version | sed -n 's/.*clang-format version \([0-9.]*\).*/\1/p')"
if [ "$version" != "$pinned" ]; then
  echo "check_clang_format: warning: clang-format $version, the pinned version is $pinned" >&2
fi
mapfile -t files < <(find csrc -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \) | sort)
"$cf" --style=file --dry-run --Werror "${files[@]}"
echo "check_clang_format: ${#files[@]} files formatted"
