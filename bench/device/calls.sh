# Sourced on the device machine after bench/device/setup.sh: one-line runs of the real-model benches
# that bring back one .tgz per run. The device tool returns only a limited number of files per call
# (2026-12-02: a real_variants run's five files were refused as "(count)"), and the 600 s call limit
# once ran out while taring traces, so each run keeps only logs, metrics, curves and its gzip'd trace.
#
#   source bench/device/setup.sh && source bench/device/calls.sh
#   rl grpo_async 300 --steps 100 --eval-every 10 --lr 5e-6 --trace --set max_staleness=1
#   variants var_dr 250 --steps 40 --val-every 20 --budget-s 225 --variants dr_grpo --seeds 1
#   TORCHINDUCTOR_CACHE_DIR=/tmp/ic_w1 partial w1long 500 --steps 10 --timeout 230 --variants base,packed
#   variants lora_vs_full 570 --steps 40 --val-every 10 --budget-s 540 --variants grpo,lora32,lora1   # issue 37 item 5
#
# Model and data: /tmp/real/smollm2 and /tmp/real/arithmetic (setup.sh). Runs write under /tmp/runs
# (their checkpoints stay there); $OUT/<name>.tgz comes back.

pack() {  # pack <name>: $OUT/<name>/ -> $OUT/<name>.tgz
  (cd "$OUT" && tar -czf "$1.tgz" "$1" && rm -rf "$1")
}

rl() {  # rl <name> <timeout s> <bench/real_rl.py args...>
  local name=$1 limit=$2; shift 2
  local run=/tmp/runs/$name dest=$OUT/$name
  mkdir -p "$dest"
  echo "== $name $(date +%T) (call at ${SECONDS}s)"
  timeout "$limit" python3 bench/real_rl.py --model /tmp/real/smollm2 --data /tmp/real/arithmetic --out "$run" "$@" \
    > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; grep -h "accuracy\|start-up \|graph loaded" "$dest/log.txt" | cut -c1-160
  cp "$run"/curve.json "$run"/curve.md "$run"/curve.png "$run"/actor_logs.tgz "$dest"/ 2>/dev/null
  [ -f "$run/run/metrics.jsonl" ] && gzip -c "$run/run/metrics.jsonl" > "$dest/metrics.jsonl.gz"
  [ -f "$run/trace.json" ] && timeout 40 gzip -1 -c "$run/trace.json" > "$dest/trace.json.gz"
  pack "$name"
}

partial() {  # partial <name> <timeout s> <bench/partial_rollout.py args...>: W1-long's variants
  # The run directory holds the W1 workload's model (1 GB): only results, output, metrics and
  # traces come back (2026-12-03: a tar of all of it was 784 MB and was left out).
  local name=$1 limit=$2; shift 2
  local run=/tmp/runs/$name dest=$OUT/$name
  mkdir -p "$dest"
  echo "== $name $(date +%T) (call at ${SECONDS}s)"
  timeout "$limit" python3 bench/partial_rollout.py --out "$run" "$@" > "$dest/stdout.txt" 2>&1
  echo "   rc=$? $(date +%T)"; tail -4 "$dest/stdout.txt" | cut -c1-200
  cp "$run"/results.json "$dest"/ 2>/dev/null
  for d in "$run"/*/; do
    local b; b=$(basename "$d")
    [ -f "$d/run/metrics.jsonl" ] && gzip -c "$d/run/metrics.jsonl" > "$dest/${b}_metrics.jsonl.gz"
    [ -f "$d/trace.json.gz" ] && cp "$d/trace.json.gz" "$dest/${b}_trace.json.gz"
  done
  pack "$name"
}

variants() {  # variants <name> <timeout s> <bench/real_variants.py args...>
  local name=$1 limit=$2; shift 2
  local run=/tmp/runs/$name dest=$OUT/$name
  mkdir -p "$dest"
  echo "== $name $(date +%T) (call at ${SECONDS}s)"
  timeout "$limit" python3 bench/real_variants.py --model-dir /tmp/real/smollm2 --data /tmp/real/arithmetic \
    --out "$run" "$@" > "$dest/stdout.txt" 2>&1
  echo "   rc=$? $(date +%T)"; tail -8 "$dest/stdout.txt" | cut -c1-200
  cp "$run"/results.json "$run"/table.md "$dest"/ 2>/dev/null
  for d in "$run"/*/; do
    local b; b=$(basename "$d")
    cp "$d/log.txt" "$dest/$b.log" 2>/dev/null
    [ -f "$d/run/metrics.jsonl" ] && gzip -c "$d/run/metrics.jsonl" > "$dest/${b}_metrics.jsonl.gz"
  done
  pack "$name"
}

agent_bench() {  # agent_bench <script> <summary grep> <name> <timeout s> <script args...>: one agent bench run
  local script=$1 summary=$2 name=$3 limit=$4; shift 4
  local run=/tmp/runs/$name dest=$OUT/$name
  mkdir -p "$dest"
  echo "== $name $(date +%T) (call at ${SECONDS}s)"
  timeout "$limit" python3 "$script" --model /tmp/real/smollm2 --work /tmp/real --out "$run" "$@" > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; grep -h "$summary" "$dest/log.txt" | cut -c1-200
  cp "$run"/results.json "$run"/table.md "$run"/curve.png "$dest"/ 2>/dev/null
  for d in "$run"/*/; do      # real_agent.py's runs (agent, single); TRL's trainer dir has neither file
    local b; b=$(basename "$d")
    [ -f "$d/run/metrics.jsonl" ] && gzip -c "$d/run/metrics.jsonl" > "$dest/${b}_metrics.jsonl.gz"
    [ -f "$d/run.log" ] && tail -c 20000 "$d/run.log" > "$dest/${b}_run_tail.log"
    [ -f "$d/trace.json.gz" ] && python3 -m dataflow.trace "$d/trace.json.gz" --spans > "$dest/${b}_trace_report.txt" 2>&1
  done
  # with TORCH_LOGS=recompiles: what made torch.compile recompile, from the nodes' own logs
  [ -n "$TORCH_LOGS" ] && grep -rh -A3 "ecompiling" /tmp/ray/session_latest/logs/ 2>/dev/null | tail -80 > "$dest/recompiles.txt"
  pack "$name"
}

agent() {  # agent <name> <timeout s> <bench/real_agent.py args...>: ours on an agent task (+ its baseline)
  agent_bench bench/real_agent.py "held-out\|rc \|start-up " "$@"
}

trlagent() {  # trlagent <name> <timeout s> <bench/real_trl_agent.py args...>: TRL on an agent task
  agent_bench bench/real_trl_agent.py "held-out\|trl step [0-9]*0 " "$@"
}

agent_data() {  # the agent tasks' data in /tmp/real/agent_data (examples/agents/tasks.py), once
  [ -f /tmp/real/agent_data/READY ] || { python3 examples/agents/tasks.py /tmp/real/agent_data > /dev/null && echo "seed 0" > /tmp/real/agent_data/READY; }
}

baserates() {  # [MODEL=dir] baserates <name> <rows> [tasks...]: sampled base success of the agent tasks (judge.py)
  local name=$1 rows=$2; shift 2
  local dest=$OUT/$name
  mkdir -p "$dest"
  agent_data
  for t in "$@"; do
    echo "== $name $t $(date +%T) (call at ${SECONDS}s)"
    timeout 240 python3 examples/agents/judge.py "${MODEL:-/tmp/real/smollm2}" /tmp/real/agent_data/$t/val.jsonl --task $t \
      --limit "$rows" --samples 2 --temperature 0.8 --batch 256 > "$dest/$t.txt" 2>&1
    echo "   rc=$?"; tail -4 "$dest/$t.txt" | cut -c1-300
  done
  pack "$name"
}

warm() {  # warm <out dir> <examples> [warm_start.py args...]: the calculator task's supervised warm start
  local dir=$1 n=$2; shift 2
  agent_data
  echo "== warm $dir $n $(date +%T) (call at ${SECONDS}s)"
  python3 examples/agents/warm_start.py /tmp/real/smollm2 /tmp/real/agent_data/calculator/train.jsonl "$dir" \
    --examples "$n" "$@" 2>&1 | tail -2
}

ladder() {  # ladder <name> <timeout s> <bench/gpu_step.py args...>: one row of the memory-plan ladder
  # e.g. ladder l7b_lora 300 --shape 7b --set learner.lora.rank=32; with --trl --trl-lora-rank 32
  # the TRL anchor runs beside it (it needs TRL=1 in payload.sh). The W1-shaped model dir (GBs) stays.
  local name=$1 limit=$2; shift 2
  local run=/tmp/runs/$name dest=$OUT/$name
  mkdir -p "$dest"
  echo "== $name $(date +%T) (call at ${SECONDS}s)"
  timeout "$limit" python3 bench/gpu_step.py --plan --gpus 1 --algos grpo --modes async --steps 6 --warmup 2 \
    --out "$run" "$@" > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; grep -h "s/step\|error\|OOM" "$dest/log.txt" | tail -4 | cut -c1-200
  cp "$run"/results.json "$dest"/ 2>/dev/null
  for d in "$run"/*/; do
    local b; b=$(basename "$d")
    [ -f "$d/describe.txt" ] && cp "$d/describe.txt" "$dest/${b}_describe.txt"
    [ -f "$d/run/metrics.jsonl" ] && gzip -c "$d/run/metrics.jsonl" > "$dest/${b}_metrics.jsonl.gz"
  done
  pack "$name"
}

agents_plan() {  # agents_plan calc|guess|speed1..9: issue 36's side-by-side runs, one call each, in one lease
  # calc: the bf16-sized warm start (bench/results/agent_warm_start_cpu_2026-12-04b.md; made on the
  # CPU, fp32), then ours and TRL from it. guess: ours and TRL again in the same lease.
  # Both need TRL=1 in payload.sh. On a fresh machine (setup converts SmolLM2) calc does not fit one
  # 600 s call: 2026-12-05 ran warm + ours, then TRL + ours on guess, then TRL on guess. Judged
  # every 5 steps: at every 15, the time to an accuracy could not tell the two engines apart.
  case $1 in
    calc)
      warm /tmp/real/smollm2_warm 16 --lr 5e-5 --device cpu
      agent calcw 300 --task calculator --model /tmp/real/smollm2_warm --steps 45 --eval-every 5 --val-n 128 \
        --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent
      trlagent trlcalcw 250 --task calculator --model /tmp/real/smollm2_warm --steps 45 --eval-every 5 --val-n 128 \
        --lr 1e-5 --prompts-per-step 16 --group 8 --max-wall 190 ;;
    speed1)   # judged at every step over the first 6 (the calculator), with inductor's recompile log
      warm /tmp/real/smollm2_warm 16 --lr 5e-5 --device cpu
      TORCH_LOGS=recompiles agent calc1 280 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent --trace ;;
    speed2)
      trlagent trlcalc1 330 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 --val-n 64 \
        --lr 1e-5 --prompts-per-step 16 --group 8 --max-wall 250
      agent guesst 220 --task guess --variants agent --steps 12 --eval-every 12 --val-n 16 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --timeout 170 --trace ;;
    speed3)   # the same guess run with partial rollouts (no drain before a weight switch), and the HF loop
      agent guessp 220 --task guess --variants agent --steps 12 --eval-every 12 --val-n 16 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --timeout 170 --trace --set generator.partial_rollout=true
      agent hfguess 200 --task guess --variants agent --steps 4 --eval-every 4 --val-n 16 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --timeout 150 --set generator.backend=hf ;;
    speed4)   # after the compile and extend changes: the calculator judged every step (cold compile cache)
      warm /tmp/real/smollm2_warm 16 --lr 5e-5 --device cpu
      TORCH_LOGS=recompiles agent calc2 280 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent --trace ;;
    speed6)   # the calculator with the learner's layers eager (no compile on the critical path)
      agent calc2e 200 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 150 --variants agent --trace \
        --set learner.compile=false ;;
    speed5)   # guess traced again; the calculator again on the compile cache the first run left
      agent guess2 220 --task guess --variants agent --steps 12 --eval-every 12 --val-n 16 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --timeout 170 --trace
      TORCH_LOGS=recompiles agent calc2w 250 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent --trace ;;
    speed7)   # after the one-row and warm-up-width fixes: the calculator judged every step, own cold caches
      warm /tmp/real/smollm2_warm 16 --lr 5e-5 --device cpu
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_calc3 TRITON_CACHE_DIR=/tmp/tri_calc3 TORCH_LOGS=recompiles \
        agent calc3 280 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent --trace ;;
    speed8)   # the same with the learner's layers eager (own cold caches), then TRL in the same lease
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_calc3e TRITON_CACHE_DIR=/tmp/tri_calc3e \
        agent calc3e 200 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 150 --variants agent --trace \
        --set learner.compile=false
      trlagent trlcalc1 330 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 --val-n 64 \
        --lr 1e-5 --prompts-per-step 16 --group 8 --max-wall 250 ;;
    speed9)   # speed7's run again on the compile caches it left (warm)
      TORCHINDUCTOR_CACHE_DIR=/tmp/ind_calc3 TRITON_CACHE_DIR=/tmp/tri_calc3 TORCH_LOGS=recompiles \
        agent calc3w 250 --task calculator --model /tmp/real/smollm2_warm --steps 6 --eval-every 1 \
        --val-n 64 --lr 1e-5 --prompts-per-step 16 --group 8 --timeout 200 --variants agent --trace ;;
    guess)
      agent guess 300 --task guess --variants agent --steps 30 --eval-every 5 --val-n 128 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --timeout 230
      trlagent trlguess 300 --task guess --steps 30 --eval-every 5 --val-n 128 --lr 2e-5 \
        --prompts-per-step 16 --group 8 --max-wall 230 ;;
  esac
}

phase_plan() {  # phase_plan w1|1.5b: issue 37's phase switch, synchronous GRPO with the plan's auto slots,
  # phase_switch=off (fixed shares) against auto (on: max_staleness=0), one call per shape
  local shape=$1 steps=(--steps 6 --warmup 2) limit=150
  [ "$shape" = 1.5b ] && steps=(--steps 4 --warmup 1) && limit=200
  for ps in off auto; do
    ladder "ps_${shape}_${ps}" "$limit" --shape "$shape" --modes sync "${steps[@]}" \
      --set generator.prompts_per_call=0 --set phase_switch=$ps
  done
}

vllm_lora() {  # issue 37 item 3: LoRA merged into vLLM's weights (ours) against vLLM's own LoRA path;
  # needs the vLLM kit (payload.sh with VLLM=1). Both engines, one process each: ~4-6 min (unmeasured).
  local dest=$OUT/vllm_lora
  mkdir -p "$dest"
  echo "== vllm_lora $(date +%T) (call at ${SECONDS}s)"
  timeout 560 python3 bench/vllm_lora.py --out "$dest" > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; tail -5 "$dest/log.txt" | cut -c1-200
  pack vllm_lora
}

lora_plan() {  # lora_plan anchor|rows|curve: issue 37's missing measurements, one call each
  # anchor: 1.5B LoRA again with TRL's GRPOTrainer + peft LoRA beside it (TRL=1 in payload.sh);
  # rows: the 0.5B and 3B LoRA rows and 1.5B full again for its push cost (weights/push_mib);
  # curve: LoRA rank 32 / 1 against full fine-tuning on the real model (bench/real_variants.py).
  case $1 in
    anchor) ladder l15_trl 570 --shape 1.5b --set learner.lora.rank=32 --trl --trl-lora-rank 32 ;;
    rows)   ladder l05_lora 150 --shape w1 --set learner.lora.rank=32
            ladder l3_lora 250 --shape 3b --set learner.lora.rank=32
            ladder l15_full 170 --shape 1.5b --steps 4 --warmup 1 ;;
    curve)  variants lora_vs_full 570 --steps 40 --val-every 10 --budget-s 540 --variants grpo,lora32,lora1 ;;
  esac
}

lora_compile() {  # lora_compile [--only-lora]: the learner's warm-up alone, LoRA r=32 against full fine-tuning,
  # cold then warm inductor cache (bench/lora_compile.py); full + LoRA need ~6.5 min at W1 on an H100,
  # LoRA alone ~4.5 (plan_rows_lora_compile_h100_2026-12-07.md). Next: why LoRA's generated code is
  # this slow to make and to load (TORCH_LOGS=output_code on the LoRA variant alone).
  local dest=$OUT/lora_compile
  mkdir -p "$dest"
  echo "== lora_compile $(date +%T) (call at ${SECONDS}s)"
  timeout 560 python3 bench/lora_compile.py --shape w1 --rank 32 --out "$dest" "$@" > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; grep "^rank" "$dest/log.txt"
}

vllm_plan() {  # vllm_plan agent|startup: the vLLM backend's missing GPU runs, one call each
  # agent: graphs/agent.py with generator.backend=vllm (the guess task; issue 36's episodes on vLLM).
  # startup: SmolLM2 GRPO with vLLM, twice: the second finds the engine's compile cache the first
  # left (issue 38: at most 40 s warm from the command to the first step).
  case $1 in
    agent)   agent_data
             agent guessv 330 --task guess --variants agent --steps 12 --eval-every 6 --val-n 64 --lr 2e-5 \
               --prompts-per-step 16 --group 8 --timeout 290 --trace --set generator.backend=vllm ;;
    startup) for run in vllm_cold vllm_warm; do
               rl "$run" 250 --steps 3 --eval-every 3 --val-n 64 --set generator.backend=vllm
             done ;;
  esac
}

h200_ladder() {  # h200_ladder a|b|c|d: issue 37's "done when" on one H200 at the current memory plan
  # (push buffers counted, data-sized slots, phase switch where the shares do not fit): nothing set by
  # hand but the rank. a: 3B full; b: 7B LoRA r=32 (its cold compile took over 2 min in 2026-12-04's
  # lease); c: 1.5B full (goal 1.5x the hand-tuned 8.1 s/step), 0.5B full and LoRA; d: 3B LoRA.
  case $1 in
    a) ladder h3_full 420 --shape 3b --steps 5 --warmup 1 ;;
    b) ladder h7_lora 560 --shape 7b --set learner.lora.rank=32 --steps 4 --warmup 1 ;;
    c) ladder h15_full 220 --shape 1.5b --steps 5 --warmup 1
       ladder h05_full 150 --shape w1
       ladder h05_lora 180 --shape w1 --set learner.lora.rank=32 ;;
    d) ladder h3_lora 300 --shape 3b --set learner.lora.rank=32 --steps 5 --warmup 1 ;;
  esac
}

startup_plan() {  # issue 38: SmolLM2 GRPO's time from the command to the first step, static decoder,
  # cold then warm caches (inductor, the decoder's graphs, the prompt cache), against the 10 s goal
  for run in st_cold st_warm; do
    rl "$run" 200 --steps 3 --eval-every 3 --val-n 64 --no-eval
  done
}

startup_kept() {  # issue 38: SmolLM2 GRPO as commands joining a `ray start` cluster, without and with
  # --keep-processes (bench/kept_processes.py --cli: off, first, kept per round), after a run that fills
  # the compile and prompt caches; the settings are that run's (bench/real_rl.py's for the H100)
  local dest=$OUT/startup_kept
  rl st_fill 200 --steps 3 --eval-every 3 --val-n 64 --no-eval
  mkdir -p "$dest"
  local sets; sets=$(tar -xzOf "$OUT/st_fill.tgz" st_fill/log.txt | grep -o "graph settings: .*" | head -1 | cut -d' ' -f3-)
  local args=(); for kv in $sets; do args+=(--set "$kv"); done
  echo "== startup_kept $(date +%T) (call at ${SECONDS}s)"
  timeout 400 python3 bench/kept_processes.py --cli --graph graphs/grpo.py --runs 2 --out /tmp/runs/kept \
    "${args[@]}" --set max_steps=3 --set save_interval=0 --json "$dest/rows.json" > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; grep -A7 "^median" "$dest/log.txt"; grep -E "^(off|first|kept) " "$dest/log.txt"
}

startup_preload() {  # issue 38: Ray's RAY_preload_python_modules (each worker Ray starts, the ones it prestarts
  # for the driver's job included, imports these before it hosts anything), right after startup_plan,
  # whose warm run (st_warm) is the same run without it: does a model node's import run ahead?
  RAY_preload_python_modules=torch,transformers.modeling_utils rl st_pre 200 --steps 3 --eval-every 3 --val-n 64 --no-eval
}

import_profile() {  # issue 38: where a model node's imports go on the GPU image (transformers' model code is
  # its largest start-up part there: bench/results/startup_h100_2026-12-07b.md): python -X importtime of each,
  # the slowest modules by cumulative time, and whether bytecode is written (PYTHONDONTWRITEBYTECODE)
  local dest=$OUT/import_profile
  mkdir -p "$dest"
  echo "== import_profile $(date +%T) PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
  python3 - <<'PY'   # where each package lives and whether its bytecode is there to load
import importlib.util, os, sys
for name in ("ray", "torch", "transformers", "tokenizers", "sympy"):
    spec = importlib.util.find_spec(name)
    d = os.path.dirname(spec.origin) if spec and spec.origin else None
    cached = os.path.isdir(os.path.join(d, "__pycache__")) if d else None
    print(f"   {name}: {d} (__pycache__ {'present' if cached else 'absent'})")
print(f"   python {sys.version.split()[0]}, os.cpu_count {os.cpu_count()}")
PY
  for m in ray torch transformers.modeling_utils "torch; import transformers.modeling_utils" "torch._inductor.compile_fx"; do
    local f="$dest/$(echo "$m" | tr -c 'a-zA-Z0-9_.\n' '_').txt"
    TIMEFORMAT="   %R s wall, %U s user: import $m"
    { time python3 -X importtime -c "import $m" 2> "$f"; } 2>&1
    grep "^import time:" "$f" | sort -t'|' -k2 -n -r | head -12 | cut -c1-120
  done
  # which functions the model-code import spends its time in (file reads, the lazy-module structure, ...)
  python3 -c "import cProfile, pstats, torch; cProfile.run('import transformers.modeling_utils', '/tmp/tf.prof')
pstats.Stats('/tmp/tf.prof').sort_stats('tottime').print_stats(14)" > "$dest/transformers_cprofile.txt" 2>&1
  grep -A16 "ncalls" "$dest/transformers_cprofile.txt" | cut -c1-150
  # No bytecode in the image's packages (and none written: PYTHONDONTWRITEBYTECODE) means every process
  # compiles them from source, which a user's pip install does not: compile them, time the import again.
  local dirs; dirs=$(python3 -c "import importlib.util as u, os
print(' '.join(os.path.dirname(u.find_spec(n).origin) for n in ('torch', 'transformers')))")
  if ! ls -d $(for d in $dirs; do echo "$d/__pycache__"; done) >/dev/null 2>&1; then
    TIMEFORMAT="   %R s: compileall of $dirs"
    { time python3 -m compileall -q -j 0 $dirs >/dev/null 2>&1; } 2>&1
    for i in 1 2; do
      TIMEFORMAT="   %R s wall, %U s user: import torch; import transformers.modeling_utils (compiled, try $i)"
      { time python3 -c "import torch; import transformers.modeling_utils"; } 2>&1
    done
  fi
}

vllm_tests() {  # the vLLM backend's tests on the GPU (tests/integration/test_vllm_backend.py: episodes, sleep, the auto KV cache)
  local dest=$OUT/vllm_tests
  mkdir -p "$dest"
  echo "== vllm_tests $(date +%T) (call at ${SECONDS}s)"
  timeout "${1:-300}" python3 -m pytest -p no:cacheprovider -n 0 -rs -q tests/integration/test_vllm_backend.py > "$dest/log.txt" 2>&1
  echo "   rc=$? $(date +%T)"; tail -4 "$dest/log.txt" | cut -c1-200
}
