#!/usr/bin/env bash
# System tools that features need, from the OS's packages: bubblewrap (`bwrap`), the kernel sandbox that runs
# model-written code in the HumanEval+/MBPP+ scorers (mbd/eval/code_exec.py), and Prometheus, which the suite's
# scrape test and benchmarks/dashboard_render.py run against a real `mbd serve` with the unedited
# deploy/prometheus/prometheus.yml (no service is started). Never fails the caller: where it cannot install, it
# says what is missing and what that disables.
set -u
missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
if [ -z "$missing" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi
fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
  echo "installing$missing with apt-get ..."
  $SUDO apt-get update -qq >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1
fi
if ! command -v bwrap >/dev/null 2>&1; then
  cat >&2 <<'MSG'
NOTE: bubblewrap (bwrap) is not installed and could not be installed here (needs root or passwordless sudo with
apt-get). HumanEval+/MBPP+ scoring will refuse to run model-written code without it (unless you pass
--unsafe-code-exec), and the sandbox-escape tests will be skipped. Install it with your OS's package manager:
Debian/Ubuntu `apt-get install bubblewrap`, Fedora `dnf install bubblewrap`, Arch `pacman -S bubblewrap`.
MSG
fi
if ! command -v prometheus >/dev/null 2>&1; then
  echo "NOTE: prometheus is not installed here: the suite's Prometheus scrape test is skipped (the service's" \
       "metrics work without it; install it with your OS's package manager to scrape them)." >&2
fi
exit 0
