#!/usr/bin/env bash
# The first command on a GPU machine (README "GPU status"): hybridrl's GPU paths that CPU tests cannot reach, one
# line per check with a number, in under 10 minutes, with no network. Run from the repository root:
#   bash scripts/gpu_check.sh                          # every check (scripts/gpu_check.py lists them)
#   bash scripts/gpu_check.sh --dry-run                # the checks, their limits, the wheels' size; runs nothing
#   bash scripts/gpu_check.sh --fetch-wheels DIR [--python-version 3.12]   # here, with network: fill DIR
#   bash scripts/gpu_check.sh --wheels DIR [--only a,b] [--out DIR]         # there: install what is missing
# The wheels (scripts/gpu_check_wheels.txt) travel with the script, at most 64 MiB; they are installed only where
# the image lacks the package (pip --no-index --no-deps). Results: benchmarks/results/gpu_check.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=scripts/gpu_check_wheels.txt
LIMIT_BYTES=$((64 * 1024 * 1024))
PYTHON=${PYTHON:-python}
wheels="" fetch="" pyver="" dry=0 pass=()
while (($#)); do
  case "$1" in
    --dry-run) dry=1; pass+=("$1") ;;
    --wheels) wheels=$2; shift ;;
    --fetch-wheels) fetch=$2; shift ;;
    --python-version) pyver=$2; shift ;;
    *) pass+=("$1") ;;
  esac
  shift
done

requirements() { grep -v '^#' "$LIST" | awk 'NF {print $1}'; }

wheel_bytes() {  # the wheels' total: the folder's files when given, else the list's recorded sizes
  if [[ -n "$1" && -d "$1" ]]; then
    find "$1" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}'
  else
    grep -v '^#' "$LIST" | awk 'NF {s += $2} END {print s + 0}'
  fi
}

if [[ -n "$fetch" ]]; then
  mkdir -p "$fetch"
  args=(--no-deps --only-binary=:all: -d "$fetch" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
  [[ -n "$pyver" ]] && args+=(--python-version "$pyver")
  $PYTHON -m pip download "${args[@]}" $(requirements)
  tmp=$(mktemp)
  grep '^#' "$LIST" > "$tmp"
  for req in $(requirements); do
    name=${req%%==*}; version=${req##*==}
    file=$(find "$fetch" -iname "$(echo "$name" | tr '-' '_')-${version}-*.whl" | head -1)
    echo "$req $(stat -c %s "$file")" >> "$tmp"
  done
  mv "$tmp" "$LIST"
fi

bytes=$(wheel_bytes "$wheels")
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
if ((bytes > LIMIT_BYTES)); then
  echo "gpu_check: the wheels are ${mib} MiB, over the 64 MiB that travel with the script" >&2
  exit 2
fi
echo "wheels: $(requirements | wc -l) packages, ${mib} MiB <= 64 MiB"
if ((dry)); then
  exec $PYTHON scripts/gpu_check.py "${pass[@]}"
fi
[[ -n "$fetch" ]] && exit 0

if [[ -n "$wheels" ]]; then  # offline: only what this image lacks, never an upgrade of what it has
  missing=()
  for req in $(requirements); do
    name=${req%%==*}
    $PYTHON -m pip show -q "$name" >/dev/null 2>&1 || missing+=("$req")
  done
  if ((${#missing[@]})); then
    $PYTHON -m pip install -q --no-index --no-deps --find-links "$wheels" "${missing[@]}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec $PYTHON scripts/gpu_check.py "${pass[@]}"
