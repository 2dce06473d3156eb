#!/usr/bin/env bash
# CI check of the packaged app: build the lite one-folder app from this checkout, then run the FROZEN binaries
# offscreen and fail on any error.
#
#   packaging/ci_check.sh .venv/bin/python          (the Python of a venv with memcalc's dependencies)
#
# Steps: install PyInstaller into that venv if missing; packaging/build.py --flavour lite into a temporary
# folder (it checks resources, "no torch", the size budget and writes the .tar.gz); then, offscreen:
#   memcalc-gui --version, --smoke-test, --screenshot (PNG must exist and be non-trivial),
#   memcalc estimate, memcalc report --out x.pdf (only if the `report` subcommand exists),
#   the archive unpacks and its memcalc-gui runs, install-desktop.sh writes a valid .desktop file,
#   and no uncaught error reached the log. Any output line matching Traceback|Error|error:|Failed|FAILED|QThread
#   fails the check. ~60-90 s on 2 cores. Set MEMCALC_CI_KEEP=1 to keep the build folder.
set -euo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
ROOT=$PWD
[ -x "$PY" ] || { echo "ci_check: $PY is not an executable Python" >&2; exit 2; }
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")

start=$(date +%s)
if ! "$PY" -c "import PyInstaller" 2>/dev/null; then
  echo "ci_check: installing PyInstaller into $PY"
  "$PY" -m pip install -q --disable-pip-version-check "pyinstaller>=6.22,<7"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/memcalc-ci.XXXXXX")
cleanup() { if [ "${MEMCALC_CI_KEEP:-0}" = 1 ]; then echo "ci_check: kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
export QT_QPA_PLATFORM=offscreen
export MEMCALC_SETTINGS_DIR="$WORK/settings" MEMCALC_LOG_DIR="$WORK/logs"

fail=0
ERR_RE='Traceback|Error|error:|Failed|FAILED|QThread'
# run NAME CMD...: run a step, keep its output in $WORK/NAME.log, fail on a non-zero exit or an error line
# (the build step is judged by its exit status only: PyInstaller's warnings are not the app's errors).
run() {
  local name=$1; shift
  local t0 rc
  t0=$(date +%s.%N)
  set +e
  "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  set -e
  printf 'ci_check: %-12s exit %d, %.2f s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
  if [ "$rc" -ne 0 ] || { [ "$name" != build ] && grep -En "$ERR_RE" "$WORK/$name.log" >/dev/null; }; then
    echo "ci_check: FAIL in $name; its output:" >&2
    sed 's/^/    /' "$WORK/$name.log" >&2
    fail=1
    return 1
  fi
}

run build "$PY" packaging/build.py --flavour lite --dist "$WORK/dist" --work "$WORK/build" --compresslevel 1 \
  || { echo "ci_check: the build failed; nothing else to check" >&2; exit 1; }
tail -2 "$WORK/build.log"
APP="$WORK/dist/memcalc-lite"
GUI="$APP/memcalc-gui"
CLI="$APP/memcalc"
VERSION=$("$PY" -c "import sys; sys.path.insert(0, '$ROOT'); import memcalc_gui; print(memcalc_gui.__version__)")

run version "$GUI" --version && grep -qx "memcalc-gui $VERSION" "$WORK/version.log" \
  || { echo "ci_check: --version does not say $VERSION" >&2; fail=1; }
run smoke "$GUI" --smoke-test && grep -q "memcalc-gui smoke ok" "$WORK/smoke.log" \
  || { echo "ci_check: --smoke-test did not print its ok line" >&2; fail=1; }
# the frozen app bundles the build machine's Python and Qt binding: 10 s of scripted use must not abort it (the
# source app's soak in the test suite runs half a minute)
run soak "$GUI" --soak 10 && grep -q "memcalc-gui soak ok" "$WORK/soak.log" \
  || { echo "ci_check: the frozen window did not survive --soak 10" >&2; tail -3 "$WORK/soak.log" >&2; fail=1; }
SHOT="$WORK/shot.png"
if run screenshot "$GUI" --preset llama-3.1-8b --gpu a100-80gb --batch 2 --seq 2048 --screenshot "$SHOT"; then
  # non-trivial: a PNG of at least 800x500 px and 20 kB (an empty window is ~5 kB)
  "$PY" - "$SHOT" <<'EOF' || fail=1
import struct, sys
data = open(sys.argv[1], "rb").read()
ok = data[:8] == b"\x89PNG\r\n\x1a\n"
w, h = struct.unpack(">II", data[16:24]) if ok else (0, 0)
print(f"ci_check: screenshot {w}x{h} px, {len(data) // 1024} kB")
sys.exit(0 if ok and w >= 800 and h >= 500 and len(data) > 20_000 else 1)
EOF
fi
run estimate "$CLI" estimate --preset gpt2 --gpu a100-80gb --json && grep -q '"schema"' "$WORK/estimate.log" \
  || { echo "ci_check: memcalc estimate --json printed no result" >&2; fail=1; }

if "$CLI" report --help >/dev/null 2>&1; then
  PDF="$WORK/report.pdf"
  if run report "$CLI" report --preset gpt2 --out "$PDF"; then
    if [ "$(head -c 5 "$PDF" 2>/dev/null)" != "%PDF-" ] || [ "$(wc -c <"$PDF")" -lt 10000 ]; then
      echo "ci_check: $PDF is missing or not a PDF" >&2; fail=1
    else
      echo "ci_check: report $(($(wc -c <"$PDF") / 1024)) kB"
    fi
  fi
else
  echo "ci_check: note: this build has no 'memcalc report' subcommand; report export skipped"
fi

# The archive unpacks to a folder whose memcalc-gui runs (exec bits, relative _internal).
ARCHIVE=$(ls "$WORK/dist"/memcalc-lite-"$VERSION"-*.tar.gz 2>/dev/null | head -1)
if [ -z "$ARCHIVE" ]; then
  echo "ci_check: no memcalc-lite-$VERSION-*.tar.gz" >&2; fail=1
else
  mkdir -p "$WORK/unpacked"
  tar -xzf "$ARCHIVE" -C "$WORK/unpacked"
  run unpacked "$WORK/unpacked/memcalc-lite-$VERSION/memcalc-gui" --smoke-test || true
  # The desktop entry (into a private XDG_DATA_HOME): Exec points into the unpacked folder.
  run desktop env XDG_DATA_HOME="$WORK/xdg" sh "$WORK/unpacked/memcalc-lite-$VERSION/install-desktop.sh" || true
  DESKTOP="$WORK/xdg/applications/memcalc.desktop"
  if ! grep -q "^Exec=\"$WORK/unpacked/memcalc-lite-$VERSION/memcalc-gui\"$" "$DESKTOP" 2>/dev/null \
     || [ ! -s "$WORK/xdg/icons/hicolor/256x256/apps/memcalc.png" ]; then
    echo "ci_check: install-desktop.sh did not write the entry and icon" >&2; fail=1
  elif command -v desktop-file-validate >/dev/null 2>&1; then
    run validate desktop-file-validate "$DESKTOP" || true
  fi
fi

if [ -n "$(ls -A "$MEMCALC_LOG_DIR" 2>/dev/null)" ]; then
  echo "ci_check: uncaught errors were logged:" >&2
  cat "$MEMCALC_LOG_DIR"/* >&2
  fail=1
fi

echo "ci_check: folder $(du -sm "$APP" | cut -f1) MiB, archive $(du -m "${ARCHIVE:-/dev/null}" | cut -f1) MiB, \
$(($(date +%s) - start)) s in all"
if [ "$fail" -ne 0 ]; then
  echo "ci_check: FAILED" >&2
  exit 1
fi
echo "ci_check: ok"
