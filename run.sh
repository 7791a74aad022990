#!/usr/bin/env bash
# keras_ps set-up and entry points. Two commands for a new machine:
#   ./run.sh demo   # train on a local multi-process cluster it starts itself
#   ./run.sh test   # the test suite
# Both create .venv and install keras_ps into it on first use (a few minutes,
# about 2 GB for TensorFlow), then reuse it.
set -euo pipefail
cd "$(dirname "$0")"

ensure_venv() {
  local stamp=.venv/.keras_ps-installed
  if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
  fi
  if [[ ! -f "$stamp" || setup.cfg -nt "$stamp" ]]; then
    echo "Installing keras_ps and its dependencies into .venv (once)..." >&2
    .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
    .venv/bin/python -m pip install -q -e ".[test]"
    touch "$stamp"
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  demo)
    ensure_venv
    TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}" exec .venv/bin/python -m keras_ps.demo "$@"
    ;;
  test)
    ensure_venv
    exec .venv/bin/python -m pytest -q "$@"
    ;;
  *)
    echo "usage: ./run.sh demo | test [pytest args]" >&2
    exit 2
    ;;
esac
