#!/usr/bin/env bash
# Issue 15's runs on the H200: bash scripts/gpu_issue15.sh STEP...
#   early  (before vLLM is staged; the image's torch) in the background: the 40-layer checkpoint and traces, and the
#          GPU kernel tests (EARLY_TESTS=0: none, the GPU left quiet for a probe); touches its flag file at the end.
#          It runs from a copy of the tree (/tmp/issue15-early-tree): in run 43 its tests, started in the first piece
#          call, failed to import scripts/ modules while the next calls' trees were copied in
#   wait   block until `early` is done (its results are then under $OUT)
#   bench  (vLLM 0.33 staged) scripts/gpu_vllm_bench.py over $CONFIGS, $PARALLEL engines started at once, every
#          family of $FAMILIES, recalls $RECALLS for `@r` names (their wrong ids drawn $WRONG: uniform, popular or none),
#          a kernel timeline of $PROFILE_TOKENS decode tokens per measurement (0: none); results as bench-$TAG.json, the host's samples in the logs tarball;
#          then one line a row on stdout (scripts/bench_table.py)
#   harness  the fast harness (scripts/bench_pager.py, no vLLM) on $FAMILY, recalls 0, 0.8, 1.0
#   e2e    token and logprob identity with the live predictor prefetching (scripts/gpu_vllm_e2e.py, $E2E_LAYERS layers, 2;
#          $E2E_SETTINGS: space-separated BIGMOE_NAME=VALUE added to every paged configuration)
#   probes (the image's torch is enough) run 21's side-kernel probes, the decision's time with the gate open and
#          closed, and the overlap probe's idle paths at recall 0 (a decision beside the chain, the one-node kernel,
#          the joinless steps alone), interleaved three times since a
#          process's first graphs replay fast (run 23); each bounded
#   stall  (the image's torch is enough) standard's `onenode` at recall 0.8 in a process of its own, per
#          $STALL_CASES (recalls:warm-up:profiled tokens[:trace rows], default `0.8:64:0:136 0.8:64:8:200`: run 37
#          found the stall follows a torch.profiler session earlier in the process, not the trace: the first case
#          ran, the second stalled), reported stalled after 20 s with the chain's words, the host copier's counters
#          and each layer's copies under way, claim, gate and mailbox (exit 3); each bounded by STALL_S (120 s: a
#          fresh process compiles for about 45 s)
#   step-probe  (the image's torch is enough) the fused step's cost when every id hits (256 slots) under each eviction,
#          and with misses (102 slots, lfu-duel), among the probe's MoE kernels; and back to back (the GPU test)
#   copy-probe  (the image's torch is enough) scripts/gpu_copy_path_probe.py: an expert's copy on the SMs, through the
#          host copier's round trip and as raw DMA, and the kernels beside a busy copy engine (run 28's question)
#   ssd-gil  (the image's torch is enough) scripts/bench_ssd_gil.py: one SSD read at a time through the service, by
#          SsdService.load and through the GPU's mailbox, answered by the Python threads and by the C ones (the native
#          reader), idle and beside a GIL-busy Python thread, at three switch intervals (the SSD tier's 0.875 ms a
#          layer: is it the GIL?); SSD_GIL_BATCH=N experts a request (prefill's shape), SSD_GIL_READS requests a row
#   ssd-tests  (the image's torch is enough) the SSD tier's GPU tests (mailbox, read-ahead), which the native
#          reader's C threads now answer
#   sync-tests  (the image's torch is enough) the joinless GPU tests (round sync, chain, one-node rounds) $RUNS times
#          (default 4, no timeout: the first run compiles), then scripts/gpu_slot_tear_probe.py's joinless cases
#          ($TEAR_REPS builds each, default 40): run 26's race, which left torn slots, must not come back
#   quiet  (the image's torch is enough) the quiet forwards' GPU run in one call (starts are scarce): the overlap
#          probe, `none` against `onenode` three times on $FAMILIES, at recall 0 with profiled tokens, then at 0.8 in a
#          process of its own without (each bounded by $PROBE_S, default 200 s; one line a run: ms a token, hit rate,
#          prefetches, closed gates, the step kernel's mean us),
#          then the joinless GPU tests once (bounded by $TESTS_S, default 330 s: the first run compiles)
#   copy-pair  (the image's torch is enough) the copy probe's link question alone, no busy backgrounds (about a
#          minute): one copy engine (flat) against two at once (pair), SM copies beside one (mixed), the host copier (host)
#   copy-split  (the image's torch is enough) where the host copier's time an expert goes, no busy backgrounds
#          (about a minute): one flat copy, one copy a component (dma), with the completion word (goal), the copier's
#          round trip (host) and the copier serving the weights alone, as if the scale blocks stayed in VRAM (hostwt)
#   copy-eager  (the image's torch is enough) the flat, dma and host copies of 1-8 experts timed as graph replays,
#          then launched one by one (--eager): run 43's H100 moved two to eight experts at half rate in the graphs
#          while a plain torch copy of the same bytes did not (about a minute)
#   copy-packed  (the image's torch is enough) packed slots, no busy backgrounds (about a minute a pass, PASSES of
#          them, default 2): the host copier and the step's copy kernel copying each expert as one run of bytes
#          (hostflat, stepflat) against today's four components (host, step) and one flat copy (flat)
#   codec  (the image's torch is enough) scripts/bench_codec.py over chunk geometries 16x128 (the pager's), 64x32 and
#          128x16: one expert's expansion alone, copy+expand of 1-8 experts against their raw copy, alone and as a
#          side round beside each layer of a 40-layer dense forward, the ratio (would a compressed RAM tier's miss
#          wait less than a raw one's, and its prefetch rounds cost the compute less?), then the codec's GPU tests
#   ssd-codec  (the image's torch is enough) scripts/bench_ssd.py over a raw and a compressed paging file of Student-t
#          experts with 1, 4, 8 and 16 I/O workers: do the reader threads, expanding each record on the CPU, deliver
#          more raw GB/s from this disk than raw reads (the question before a compressed SSD tier in vLLM)?
# The device tool returns 8 files from $OUT: logs go into one tarball per step.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/pager:$PWD/app:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VLLM_DEEP_GEMM_WARMUP=skip
out="${OUT:-/tmp/bigmoe-gpu}"; mkdir -p "$out"
early_out=/tmp/issue15-early; flag=/tmp/issue15-early.done; early_tree=/tmp/issue15-early-tree
work=/tmp/bigmoe-vllm-bench
families="${FAMILIES:-standard,topic-shift}"
recalls="${RECALLS:-0,0.6,0.8,0.95,1.0}"
joinless_tests="tests/gpu/test_round_sync_gpu.py tests/gpu/test_prefetch_chain_gpu.py tests/gpu/test_forward_rounds_gpu.py"
pack() { tar czf "$out/$1.tgz" -C "$(dirname "$2")" "$(basename "$2")" 2>/dev/null; }
# env.sh puts /tmp/site first, where the extra kit's bigmoe wheel may be older than this tree: the tree goes first again
vllm_env() {
  [ -n "${VLLM_STAGED:-}" ] || { source /tmp/site/env.sh; export VLLM_STAGED=1; }
  export PYTHONPATH="$PWD/pager:$PWD/app:$PWD/bench:$PYTHONPATH"
  # vLLM finds the plugin by its entry points, which only an installed copy carries (the tree's egg-info is ignored
  # by git, so it never travels): the carried wheel (.whlx/own, see below) or scripts/gpu_extra's pieces install one
  if ls .whlx/own/bigmoe-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whlx/own/bigmoe-*.whl
  fi
  python3 -c "from importlib.metadata import entry_points as e; import sys; sys.exit(not any(p.value.startswith('bigmoe') for p in e(group='vllm.general_plugins')))" \
    || { echo "gpu_issue15.sh: bigmoe's vLLM plugin is not installed on the device: carry .whlx/own (python -m pip wheel --no-deps -w .whlx/own .) or stage scripts/gpu_extra"; exit 2; }
}

early() {
  mkdir -p "$early_out"
  python3 scripts/gpu_vllm_bench.py --prepare-only --workdir "$work" --families "$families" --recalls "$recalls" \
    --configs bigmoe-102@r --out "$early_out/prepare.json" > "$early_out/prepare.txt" 2>&1 &
  local prep=$!
  [ "${EARLY_TESTS:-1}" = 0 ] || python3 -m pytest tests/gpu -m gpu -q -rfEs -p no:cacheprovider --ignore=tests/gpu/test_tiny_fp8_vllm_gpu.py \
    --ignore=tests/gpu/test_qwen4exp_vllm_gpu.py > "$early_out/gpu-kernel-tests.txt" 2>&1
  wait "$prep"
  touch "$flag"
}

for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    early)
      # From a private copy of the tree: the next calls copy their working trees over this one while it runs (run 43)
      rm -f "$flag"; rm -rf "$early_tree" && cp -a . "$early_tree"
      (cd "$early_tree" && export PYTHONPATH="$early_tree/pager:$early_tree/app:$early_tree/bench" && setsid nohup bash -c \
        "$(declare -f early); $(declare -p early_out flag work families recalls); export EARLY_TESTS=${EARLY_TESTS:-1}; early" \
        > /tmp/issue15-early.log 2>&1 < /dev/null &) ;;
    wait)
      for _ in $(seq 1 "${WAIT_S:-300}"); do [ -f "$flag" ] && break; sleep 1; done
      [ -f "$flag" ] || echo "early step not done yet"
      cp "$early_out"/*.json "$out"/ 2>/dev/null
      grep -E "^(FAILED|ERROR)|passed|failed" "$early_out/gpu-kernel-tests.txt" > "$out/gpu-kernel-tests.txt" 2>/dev/null
      tail -n 3 "$out/gpu-kernel-tests.txt" ;;
    bench)
      vllm_env
      python3 scripts/gpu_vllm_bench.py --workdir "$work" --families "$families" --recalls "$recalls" \
        --wrong "${WRONG:-uniform}" --parallel "${PARALLEL:-4}" --budget-s "${BUDGET:-540}" --configs "$CONFIGS" \
        --profile-tokens "${PROFILE_TOKENS:-0}" --out "$out/bench-${TAG:-run}.json" --logs "/tmp/logs-bench-${TAG:-run}"
      pack "logs-bench-${TAG:-run}" "/tmp/logs-bench-${TAG:-run}"
      python3 scripts/bench_table.py "$out/bench-${TAG:-run}.json"
      [ "${PROFILE_TOKENS:-0}" = 0 ] || python3 scripts/trace_gap_spread.py --bench "$out/bench-${TAG:-run}.json" \
        --out "$out/gap-spread-${TAG:-run}.json" ;;
    harness)  # the fast harness (no vLLM), alone on the GPU
      python3 scripts/bench_pager.py --models qwen3.6-35b-a3b --family "${FAMILY:-topic-shift}" \
        --configs bigmoe,bigmoe-prefetch --recalls 0,0.8,1.0 --out "$out/harness-${FAMILY:-topic-shift}.json" ;;
    e2e)
      vllm_env
      python3 scripts/gpu_vllm_e2e.py --layers "${E2E_LAYERS:-2}" --parallel "${PARALLEL:-4}" --budget-s "${BUDGET:-400}" \
        --configs "${E2E_CONFIGS:-unpaged,vram40-predict,vram12-ram50-ssd-predict-ahead,vram40-predict-piecewise}" \
        ${E2E_SETTINGS:+$(printf -- '--setting %s ' $E2E_SETTINGS)} \
        --out "$out/e2e-${TAG:-predict}.json" --logs "/tmp/logs-e2e-${TAG:-predict}"
      pack "logs-e2e-${TAG:-predict}" "/tmp/logs-e2e-${TAG:-predict}" ;;
    probes)
      timeout 60 python3 scripts/gpu_launch_gap_probe.py --kernels 1000 --replays 50 --rounds 3 --out "$out/gap.json"
      timeout 60 python3 scripts/gpu_launch_gap_probe.py --chain add --width 4194304 --kernels 400 --replays 20 \
        --rounds 2 --out "$out/gap-add.json"
      timeout 60 python3 scripts/gpu_decide_timing.py --warps 4 --out "$out/decide-open.json"
      timeout 60 python3 scripts/gpu_decide_timing.py --warps 4 --recall 0 --gate 25 --out "$out/decide-closed.json"
      v=none,admit,onenode-bare,onenode
      timeout 240 python3 scripts/gpu_overlap_probe.py --families standard,topic-shift --variants "$v,$v,$v" \
        --recalls 0 --dump-after 45 --out "$out/overlap.json" ;;
    stall)
      # Run 37 (H100): profiled tokens earlier in the process (the resident run's) stall the onenode run after them.
      for case in ${STALL_CASES:-0.8:64:0:136 0.8:64:8:200}; do
        IFS=: read -r recalls warmup profile rows <<< "$case"; name="r$recalls-w$warmup-p$profile-t${rows:-0}"
        PYTHONPATH="$PWD/pager:$PWD/bench" timeout -k 5 -s INT "${STALL_S:-120}" python3 scripts/gpu_overlap_probe.py \
          --families standard --variants onenode --recalls "$recalls" --warmup "$warmup" --tokens 64 \
          --profile-tokens "$profile" --profile-anyway --trace-rows "${rows:-0}" --stall-after 20 --dump-after 0 \
          --out "$out/stall-$name.json" > "/tmp/stall-$name.log" 2>&1
        echo "$name: probe exit $?"; grep -E '^\{' "/tmp/stall-$name.log" | cut -c1-300
        grep -v Warn "/tmp/stall-$name.log" | tail -n 3 | cut -c1-6000
      done ;;
    step-probe)
      for run in 256:lru 256:lfu-fast 256:lfu-duel 102:lfu-duel; do  # slots:eviction (256: every id hits)
        python3 scripts/gpu_overlap_probe.py --families standard --slots "${run%%:*}" --eviction "${run#*:}" \
          --variants none --tokens 64 --profile-tokens 8 --out "$out/step-${run/:/-}.json" 2>&1 | grep -o '"_step_kernel"[^}]*'
      done
      python3 -m pytest tests/gpu/test_step_kernel_gpu.py -m gpu -q -s -p no:cacheprovider -k costs_less | grep "per layer" ;;
    copy-probe)
      timeout 240 python3 scripts/gpu_copy_path_probe.py --out "$out/copy-path.json" 2>&1 | tail -n 40 ;;
    copy-pair)
      timeout 300 python3 scripts/gpu_copy_path_probe.py --paths flat,pair,mixed,host --experts 1,2,4,8 --busy '' \
        --out "$out/copy-pair.json" 2>&1 | tail -n 25 ;;
    copy-split)
      timeout 300 python3 scripts/gpu_copy_path_probe.py --paths flat,dma,goal,host,hostwt --experts 1,2,4,8 --busy '' \
        --out "$out/copy-split.json" 2>&1 | tail -n 25 ;;
    copy-eager)
      for how in graph eager; do
        timeout 200 python3 scripts/gpu_copy_path_probe.py --paths flat,dma,host --experts 1,2,4,8 --busy '' \
          $([ "$how" = eager ] && echo --eager) --out "$out/copy-$how.json" 2>&1 | grep '^{' | cut -c1-120
      done ;;
    copy-packed)
      for pass in $(seq 1 "${PASSES:-2}"); do
        timeout 240 python3 scripts/gpu_copy_path_probe.py --paths flat,host,hostflat,step,stepflat --experts 1,2,4,8 \
          --busy '' --out "$out/copy-packed-$pass.json" 2>&1 | tail -n 21
      done ;;
    codec)
      timeout 420 python3 scripts/bench_codec.py --geometries 16x128,64x32,128x16 --experts 2 --copy-batches 1,2,4,8 \
        --out "$out/codec-geometry.json" --note "H200 device machine, graph replay" 2>&1 | tail -n 20
      timeout 240 python3 -m pytest tests/gpu/test_codec_gpu.py -m gpu -q -rfEs -p no:cacheprovider 2>&1 | tail -n 8 ;;
    ssd-codec)
      timeout 300 python3 scripts/bench_ssd.py --dir /tmp,/var/tmp --gb 1.5 --workers 1,4,8,16 --modes store,load \
        --sources paging-file,compressed,paging-file --out "$out/ssd-codec.json" 2>&1 | tail -n 30 ;;
    ssd-gil)
      timeout 300 python3 scripts/bench_ssd_gil.py --dir /tmp --paths load,mailbox --readers python,native \
        --reads "${SSD_GIL_READS:-150}" --batch "${SSD_GIL_BATCH:-1}" --switch-us 5000,200,50 \
        --out "$out/ssd-gil-b${SSD_GIL_BATCH:-1}.json" 2>&1 | tail -n 30 ;;
    ssd-tests)
      timeout 300 python3 -m pytest tests/gpu/test_ssd_gpu.py tests/gpu/test_ssd_read_ahead_gpu.py -m gpu -q -rfEs \
        -p no:cacheprovider 2>&1 | tail -n 15 ;;
    sync-tests)
      mkdir -p /tmp/sync-tests
      for i in $(seq 1 "${RUNS:-4}"); do
        python3 -m pytest -q -m gpu -p no:cacheprovider $joinless_tests > "/tmp/sync-tests/run-$i.txt" 2>&1
        echo "run $i: $(tail -n 1 "/tmp/sync-tests/run-$i.txt")"; grep -E "^FAILED|illegal memory" "/tmp/sync-tests/run-$i.txt"
      done
      python3 scripts/gpu_slot_tear_probe.py --cases lfu-duel:joinless:0,lru:joinless:0,lfu:joinless:0 \
        --reps "${TEAR_REPS:-40}" --out "$out/tear.json" 2>&1 | grep '^{'
      pack sync-tests /tmp/sync-tests ;;
    quiet)
      # Two processes: profiled tokens at recall 0 (the step kernel's us), then recall 0.8 unprofiled (runs 36-37: after
      # torch.profiler in a process, onenode's host-copied rounds crawl). Each bounded by $PROBE_S.
      variants=none,onenode,none,onenode,none,onenode
      for run in r0:0:8 r08:0.8:0; do
        IFS=: read -r name recall profile <<< "$run"
        timeout -k 5 -s INT "${PROBE_S:-200}" python3 scripts/gpu_overlap_probe.py --families "$families" \
          --variants "$variants" --recalls "$recall" --profile-tokens "$profile" --stall-after 30 \
          --out "$out/quiet-$name.json" > "/tmp/quiet-$name.log" 2>&1
        echo "$name: probe exit $?"; tail -n 2 "/tmp/quiet-$name.log" | cut -c1-3000
        [ -f "$out/quiet-$name.json" ] && python3 - "$out/quiet-$name.json" <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    step = [k["mean_us"] for k in run.get("profile", {}).get("top_kernels", []) if k["name"] == "_step_kernel"]
    keys = ("family", "variant", "recall", "ms_per_token", "vram_hit", "prefetched_per_token", "gates_closed")
    print(*(run.get(k) for k in keys), "step_us", step, *(["stalled", run["stalled"]] if "stalled" in run else []))
PY
      done
      mkdir -p /tmp/quiet-tests
      timeout "${TESTS_S:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider $joinless_tests > /tmp/quiet-tests/run.txt 2>&1
      echo "tests exit $?: $(tail -n 1 /tmp/quiet-tests/run.txt)"; grep -E "^FAILED|illegal memory" /tmp/quiet-tests/run.txt
      cp /tmp/quiet-r0.log /tmp/quiet-r08.log /tmp/quiet-tests/ 2>/dev/null; pack quiet-tests /tmp/quiet-tests ;;
    *) echo "unknown step $step" ;;
  esac
done
