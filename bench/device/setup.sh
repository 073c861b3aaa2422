# Sourced on the device machine (bash), after the calls of bench/device/payload.sh: reassemble and
# check the parts sent to /tmp, install them into /tmp/site (once per lease), convert SmolLM2 and
# write the arithmetic task (once), and export PYTHONPATH and the environment the benches expect.
R=$PWD; K=/tmp/vllmkit; X=/tmp/xkit; t0=$SECONDS
if [ ! -f /tmp/site/.done ]; then
  want=$(wc -l < .gpu/XPARTS); have=$(ls $X/xpart* 2>/dev/null | wc -l)
  [ "$want" = "$have" ] || { echo "setup: $have of $want .gpu parts in $X: the machine went back; send them again"; return 3; }
  cat $X/xpart* > $X/extra.tar && (cd $X && sha256sum -c "$R/.gpu/XSUMS") || return 4
  rm -rf $X/x /tmp/site && mkdir -p $X/x && tar -xf $X/extra.tar -C $X/x && rm $X/extra.tar
  wheels=($X/x/wheels/*.whl)
  if [ -f .vllm-kit/chunks/SHA256SUMS ] && ls $K/part* >/dev/null 2>&1; then
    want=$(grep -c ' part' .vllm-kit/chunks/SHA256SUMS); have=$(ls $K/part* | wc -l)
    [ "$want" = "$have" ] || { echo "setup: $have of $want vLLM kit parts in $K; send them again"; return 3; }
    cat $K/part* > $K/kit.tar && (cd $K && grep ' kit.tar' "$R/.vllm-kit/chunks/SHA256SUMS" | sha256sum -c) || return 4
    rm -rf $K/x && mkdir -p $K/x && tar -xf $K/kit.tar -C $K/x && rm $K/kit.tar
    wheels+=($K/x/wheels/*.whl)
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" || return 5
  [ -d $K/x/shadow ] && python3 .vllm-kit/install_shadows.py $K/x/shadow /tmp/site
  # Bytecode, as pip writes it for a user (the install above is --no-compile): without it, where
  # PYTHONDONTWRITEBYTECODE is set every process compiles Ray's sources again on import, which the
  # start-up measurements would count. The project's modules too (.ci/run does the same).
  python3 -m compileall -q -j 0 /tmp/site dataflow rl nodes graphs bench examples >/dev/null 2>&1
  # The image's own packages (torch, sympy: no __pycache__ there) likewise: without their bytecode
  # every node process compiled them again (bench/results/startup_h100_2026-12-07c.md).
  image_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" 2>/dev/null)
  [ -n "$image_site" ] && python3 -m compileall -q -j 0 "$image_site" >/dev/null 2>&1
  touch /tmp/site/.done
  echo "setup: parts checked, installed and compiled in $((SECONDS - t0)) s (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
fi
export PYTHONPATH=/tmp/site:$R VLLM_USE_FLASHINFER_SAMPLER=0 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
[ -f /tmp/real/smollm2/config.json ] || { python3 examples/smollm2_arithmetic/smollm2.py /tmp/real/smollm2 2>&1 | tail -2; echo "setup: SmolLM2 converted at $((SECONDS - t0)) s"; }
[ -d /tmp/real/arithmetic ] || python3 examples/smollm2_arithmetic/make_arithmetic.py /tmp/real/arithmetic --seed 0 2>&1 | tail -1
