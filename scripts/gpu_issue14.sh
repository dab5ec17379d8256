#!/usr/bin/env bash
# Issue 14's runs on the H200 after staging vLLM 0.33 (shared/gpu-vllm-0.33) and scripts/gpu_extra:
#   bash scripts/gpu_issue14.sh STEP...    steps: model e2e-tiers e2e-rest e2e bench app tests
# (e2e: the configurations in $CONFIGS, $PARALLEL at once, MTP counts in $SPEC, $LAYERS decoder layers (4),
#  results as e2e-$TAG.json; bench: $BENCH_CONFIGS on the routing family $FAMILY, reads further ahead at $AHEAD_DROP
#  less recall a layer (0: as right as the next layer's); uva: scripts/gpu_uva_probe.py;
#  extra: install scripts/gpu_extra's wheels from the x folders earlier calls copied into $STAGEX (/tmp/stagex);
#  q4x-start: tests/gpu/test_qwen4exp_vllm_gpu.py in the background from a private copy of the tree, since with its
#  engine starts and SSD mix it can outlast one device call, $Q4X_K its cases by pytest's -k; q4x-wait: wait up to
#  $WAIT_S (540) for it, its output as qwen4exp-test.txt; call q4x-wait again, back to back, while it says "still
#  running")
# Results and logs under $OUT (the device tool returns 8 files: logs go into one tarball per step).
set -uo pipefail
cd "$(dirname "$0")/.."
source /tmp/site/env.sh
export PYTHONPATH="$PWD/pager:$PWD/app:$PWD/bench:$PYTHONPATH" PYTHONUNBUFFERED=1 VLLM_DEEP_GEMM_WARMUP=skip
out="${OUT:-/tmp/bigmoe-gpu}"; mkdir -p "$out"
# the model and bench steps' checkpoint: $MODEL_LAYERS decoder layers (4; more give reads ahead further to go)
model_layers="${MODEL_LAYERS:-4}"
model="/tmp/bigmoe-vllm-e2e/flash-next-fp8-${model_layers}l"
pack() { tar czf "$out/$1.tgz" -C "$(dirname "$2")" "$(basename "$2")" 2>/dev/null; }
q4x=/tmp/bigmoe-q4x-test  # the background test's tree copy, pytest's temp dirs, its output and exit status
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    model)  # made by gpu_vllm_e2e too; done first so the other steps can share it
      [ -f "$model/config.json" ] || python3 scripts/make_qwen4exp.py "$model" --layers "$model_layers" --indexer-heads 8 --dtype fp8 --device cuda --seed 0 ;;
    e2e-tiers)
      python3 scripts/gpu_vllm_e2e.py --shape flash-next --layers 4 --parallel 6 --budget-s "${BUDGET:-400}" \
        --configs unpaged,unpaged-repeat,vram40,vram40-ngram,vram12-ram50-ssd,vram12-ram50-ssd-ngram \
        --out "$out/e2e-tiers.json" --logs /tmp/logs-e2e-tiers; pack logs-e2e-tiers /tmp/logs-e2e-tiers ;;
    e2e-rest)
      python3 scripts/gpu_vllm_e2e.py --shape flash-next --layers 4 --parallel 6 --budget-s "${BUDGET:-400}" \
        --configs unpaged,vramall,vramall-ngram,unpaged-mtp1,vram12-ram50-ssd-ngram-mtp1,unpaged-mtp3,vram12-ram50-ssd-ngram-mtp3 \
        --out "$out/e2e-rest.json" --logs /tmp/logs-e2e-rest; pack logs-e2e-rest /tmp/logs-e2e-rest ;;
    e2e)
      python3 scripts/gpu_vllm_e2e.py --shape flash-next --layers "${LAYERS:-4}" --parallel "${PARALLEL:-6}" \
        --budget-s "${BUDGET:-400}" \
        --configs "$CONFIGS" --spec-tokens "${SPEC:-1,3}" \
        --out "$out/e2e-${TAG:-run}.json" --logs "/tmp/logs-e2e-${TAG:-run}"; pack "logs-e2e-${TAG:-run}" "/tmp/logs-e2e-${TAG:-run}" ;;
    bench)
      sync  # a checkpoint just written may still be flushing: not while the disk is measured and engines time it
      python3 scripts/gpu_qwen4exp_bench.py --model "$model" --budget-s "${BUDGET:-500}" --out "$out/bench.json" \
        --configs "${BENCH_CONFIGS:-resident,offload,bigmoe-4090,bigmoe-4090-nongram}" --family "${FAMILY:-standard}" \
        --ahead-recall-drop "${AHEAD_DROP:-0}";
      pack logs-bench "$out/bench_logs"; rm -rf "$out/bench_logs" ;;
    app)
      python3 scripts/gpu_app_run.py --model "$model" --budgets "${BUDGETS:-8:14,6:12,8:12,5:10,6:16}" \
        --out "$out/app-run.json"; cp -r ~/.cache/bigmoe/logs /tmp/app-logs 2>/dev/null; pack logs-app /tmp/app-logs ;;
    uva)
      python3 scripts/gpu_uva_probe.py --out "$out/uva-probe.json" ;;
    tests)
      # the Qwen4Exp vLLM test has its own steps (q4x-start, q4x-wait): its three cases (about 6 minutes each)
      # outlast one device call
      python3 -m pytest tests/gpu -m gpu -q -rfEs -p no:cacheprovider --ignore=tests/gpu/test_tiny_fp8_vllm_gpu.py \
        --ignore=tests/gpu/test_qwen4exp_vllm_gpu.py --junitxml="$out/gpu-tests.xml" > /tmp/gpu-tests.txt 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" /tmp/gpu-tests.txt > "$out/gpu-tests.txt"; tail -n 5 "$out/gpu-tests.txt" ;;
    extra)
      bash scripts/gpu_extra/stage.sh "${STAGEX:-/tmp/stagex}" && source /tmp/site/env.sh
      python3 -c "import cutlass.cute" && echo "extra: cutlass.cute imports" ;;
    q4x-start)
      # the next calls copy their trees over this one, so the test runs from its own copy (as gpu_issue15.sh's early)
      # Q4X_K picks cases by pytest's -k (for example mtp3: one case, a third of the three cases' time)
      rm -rf "$q4x" && mkdir -p "$q4x" && cp -a . "$q4x/tree"
      (cd "$q4x/tree" && source /tmp/site/env.sh \
        && export PYTHONPATH="$q4x/tree/pager:$q4x/tree/app:$q4x/tree/bench:$PYTHONPATH" \
        && setsid nohup bash -c "python3 -m pytest -m gpu tests/gpu/test_qwen4exp_vllm_gpu.py ${Q4X_K:+-k $Q4X_K} -q -rfEs \
          -p no:cacheprovider --basetemp=$q4x/tmp > $q4x/test.txt 2>&1; echo \$? > $q4x/rc" \
          > /dev/null 2>&1 < /dev/null &)
      echo "q4x-start: started; q4x-wait follows it" ;;
    q4x-wait)
      for _ in $(seq 1 "${WAIT_S:-540}"); do [ -f "$q4x/rc" ] && break; sleep 1; done
      cp "$q4x/test.txt" "$out/qwen4exp-test.txt" 2>/dev/null; tail -n 20 "$q4x/test.txt" 2>/dev/null
      if [ -f "$q4x/rc" ]; then echo "q4x-wait: pytest exit $(cat "$q4x/rc")"; else echo "q4x-wait: still running"; fi ;;
    *) echo "unknown step $step" ;;
  esac
done
