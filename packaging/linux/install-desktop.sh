#!/bin/sh
# Add memcalc to the desktop's application menu, for the current user (no root needed).
#
#   install-desktop.sh [APPDIR]              install: menu entry + icon, pointing to APPDIR/memcalc-gui
#   install-desktop.sh --with-cli [APPDIR]   also link ~/.local/bin/memcalc -> APPDIR/memcalc
#   install-desktop.sh --uninstall           remove what install wrote
#
# APPDIR is the unpacked memcalc folder (the one holding memcalc-gui and _internal/). Default: the folder this
# script is in (it is copied into every build), else dist/memcalc-lite or dist/memcalc-full of a checkout.
# Writes (XDG_DATA_HOME defaults to ~/.local/share):
#   $XDG_DATA_HOME/applications/memcalc.desktop
#   $XDG_DATA_HOME/icons/hicolor/256x256/apps/memcalc.png and .../scalable/apps/memcalc.svg
# Keep APPDIR where it is afterwards: the entry points there (re-run the script after moving it).
set -eu

data="${XDG_DATA_HOME:-$HOME/.local/share}"
desktop="$data/applications/memcalc.desktop"
png="$data/icons/hicolor/256x256/apps/memcalc.png"
svg="$data/icons/hicolor/scalable/apps/memcalc.svg"
cli_link="$HOME/.local/bin/memcalc"

refresh() {
  command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$data/applications" || true
  command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$data/icons/hicolor" 2>/dev/null || true
  command -v xdg-desktop-menu >/dev/null 2>&1 && xdg-desktop-menu forceupdate 2>/dev/null || true
}

with_cli=0
case "${1:-}" in
  --uninstall)
    rm -f "$desktop" "$png" "$svg"
    if [ -L "$cli_link" ]; then rm -f "$cli_link"; fi
    refresh
    echo "memcalc: removed $desktop and its icons"
    exit 0 ;;
  --with-cli) with_cli=1; shift ;;
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
esac

here=$(cd "$(dirname "$0")" && pwd)
if [ $# -ge 1 ]; then
  appdir=$1
elif [ -x "$here/memcalc-gui" ]; then
  appdir=$here
elif [ -x "$here/../../dist/memcalc-lite/memcalc-gui" ]; then
  appdir=$here/../../dist/memcalc-lite
elif [ -x "$here/../../dist/memcalc-full/memcalc-gui" ]; then
  appdir=$here/../../dist/memcalc-full
else
  echo "memcalc: no memcalc-gui next to this script; pass the unpacked folder: $0 /path/to/memcalc-lite" >&2
  exit 2
fi
appdir=$(cd "$appdir" && pwd)
if [ ! -x "$appdir/memcalc-gui" ]; then
  echo "memcalc: $appdir/memcalc-gui is missing or not executable" >&2
  exit 2
fi
case "$appdir" in
  *[\"\`\$\\%]*) echo "memcalc: the folder path contains \" \` \$ \\ or %, which a .desktop Exec line cannot carry; move it" >&2
             exit 2 ;;
esac

res="$appdir/_internal/resources/icons"
template="$here/memcalc.desktop.in"
[ -f "$template" ] || template="$appdir/memcalc.desktop.in"
if [ ! -f "$template" ]; then
  echo "memcalc: memcalc.desktop.in not found next to $0" >&2
  exit 2
fi

mkdir -p "$(dirname "$desktop")" "$(dirname "$png")" "$(dirname "$svg")"
cp "$res/memcalc.png" "$png"
cp "$res/memcalc.svg" "$svg"
# Escape sed's replacement specials (| is the delimiter, & the match) in the path.
esc=$(printf '%s' "$appdir" | sed 's/[|&]/\\&/g')
sed "s|@APPDIR@|$esc|g" "$template" > "$desktop.tmp"
chmod 0755 "$desktop.tmp"  # some desktops (GNOME, KDE) only trust executable launchers
mv "$desktop.tmp" "$desktop"
if [ "$with_cli" -eq 1 ]; then
  mkdir -p "$(dirname "$cli_link")"
  ln -sfn "$appdir/memcalc" "$cli_link"
  echo "memcalc: linked $cli_link -> $appdir/memcalc"
fi
refresh
echo "memcalc: installed $desktop -> $appdir/memcalc-gui (icon $png)"
