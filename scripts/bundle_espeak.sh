#!/usr/bin/env bash
# Pack this machine's espeak-ng (binary, the shared libraries it loads beyond the C library,
# and the English voice data) into .espeak/espeak-ng.tar.xz, for a Linux x86-64 machine that
# cannot install packages, such as the GPU machine that trains the default model:
#
#   scripts/bundle_espeak.sh                 # here, after `apt-get install espeak-ng`
#   source scripts/espeak_env.sh             # there: unpacks to /tmp/espeak, sets the paths
#
# The bundle is about 4 MB; .espeak/ is git-ignored and travels as a carried path.
set -euo pipefail

BINARY=$(command -v espeak-ng) || { echo "espeak-ng is not installed" >&2; exit 1; }
DATA=$(dirname "$(readlink -f "$(ldd "$BINARY" | awk '/libespeak-ng/ {print $3}')")")/espeak-ng-data
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/espeak-ng-data" .espeak
cp "$BINARY" "$STAGE/bin/"
# Every library the dynamic loader resolves, except the C library itself (the other
# machine's must be used, and must be as new as the one these were built against).
ldd "$BINARY" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' \
    | while read -r library; do cp -L "$library" "$STAGE/lib/"; done
# English only: the phoneme tables, English's dictionary, the language and voice files.
for item in phondata phonindex phontab intonations en_dict lang voices; do
    cp -r "$DATA/$item" "$STAGE/espeak-ng-data/"
done
tar -C "$STAGE" -cJf .espeak/espeak-ng.tar.xz bin lib espeak-ng-data
du -h .espeak/espeak-ng.tar.xz
