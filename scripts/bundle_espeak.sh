#!/usr/bin/env bash
# Pack this machine's espeak-ng (binary, its library, libsonic and the English voice data) into
# .espeak/espeak-ng.tar.xz, for a Linux x86-64 machine that cannot install packages, such as
# the GPU machine that trains the default model:
#
#   scripts/bundle_espeak.sh                 # here, after `apt-get install espeak-ng`; needs cc
#   source scripts/espeak_env.sh             # there: unpacks to /tmp/espeak, sets the paths
#
# espeak-ng links libpcaudio for playing sound, which pulls in PulseAudio, ALSA, X11 and a
# dozen more libraries (3 MB packed). Clips are only ever written (`--stdout`), so the bundle
# carries a stub libpcaudio instead, compiled here, whose device never opens. The bundle is
# about 1 MB; .espeak/ is git-ignored and travels as a carried path.
set -euo pipefail

BINARY=$(command -v espeak-ng) || { echo "espeak-ng is not installed" >&2; exit 1; }
DATA=$(dirname "$(readlink -f "$(ldd "$BINARY" | awk '/libespeak-ng/ {print $3}')")")/espeak-ng-data
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/espeak-ng-data" .espeak
cp "$BINARY" "$STAGE/bin/"
LIBRARY=$(ldd "$BINARY" | awk '/libespeak-ng/ {print $3}')
cp -L "$LIBRARY" "$(ldd "$LIBRARY" | awk '/libsonic/ {print $3}')" "$STAGE/lib/"
# libpcaudio's interface (pcaudiolib's audio.h), every call failing: nothing is played.
cat > "$STAGE/pcaudio_stub.c" <<'STUB'
#include <errno.h>
#include <stddef.h>
struct audio_object;
struct audio_object *create_audio_device_object(const char *d, const char *a, const char *n)
{ (void)d; (void)a; (void)n; return NULL; }
int audio_object_open(struct audio_object *o, int f, unsigned r, unsigned char c)
{ (void)o; (void)f; (void)r; (void)c; return ENODEV; }
void audio_object_close(struct audio_object *o) { (void)o; }
void audio_object_destroy(struct audio_object *o) { (void)o; }
int audio_object_write(struct audio_object *o, const void *d, size_t b)
{ (void)o; (void)d; (void)b; return ENODEV; }
int audio_object_drain(struct audio_object *o) { (void)o; return ENODEV; }
int audio_object_flush(struct audio_object *o) { (void)o; return ENODEV; }
const char *audio_object_strerror(struct audio_object *o, int e)
{ (void)o; (void)e; return "no audio device in this bundle"; }
STUB
cc -shared -fPIC -O2 -Wl,-soname,libpcaudio.so.0 -o "$STAGE/lib/libpcaudio.so.0" \
    "$STAGE/pcaudio_stub.c"
# English only: the phoneme tables, English's dictionary, the language and voice files.
for item in phondata phonindex phontab intonations en_dict lang voices; do
    cp -r "$DATA/$item" "$STAGE/espeak-ng-data/"
done
tar -C "$STAGE" -cJf .espeak/espeak-ng.tar.xz bin lib espeak-ng-data
du -h .espeak/espeak-ng.tar.xz
