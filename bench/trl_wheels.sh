#!/usr/bin/env bash
# Wheels for bench/trl_w1.py on the GPU machine, in build/trl-whl/ (ignored, like build/): TRL and what
# its `datasets` import needs there (the image has torch, transformers, accelerate, no pyarrow).
# Carried apart from .whl/*.whl (ray): together they pass the 64 MiB a call may carry. pyarrow is
# slimmed like wheels.sh slims ray: Arrow Flight (RPC), headers and tests are left out
# (datasets and TRL import none of them; libarrow links Substrait, so it stays): 52 -> 40 MiB.
#   bash bench/trl_wheels.sh            # then carry build/trl-whl and install build/trl-whl/*.whl
set -euo pipefail
PY=${PY:-3.12}
out=build/trl-whl
mkdir -p "$out"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$tmp" \
  trl==1.16.0 datasets==5.2.0 'dill<0.4.2' 'multiprocess<0.70.20' xxhash pyarrow==26.0.1 pandas tzdata pytz
for w in "$tmp"/*.whl; do
  case "$(basename "$w")" in
    pyarrow-*) python3 "$(dirname "$0")/slim_wheel.py" "$w" "$out" ;;
    *) cp "$w" "$out/" ;;
  esac
done
rm -rf "$tmp"
du -sh "$out"
