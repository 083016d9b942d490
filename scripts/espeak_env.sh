# Source me: unpack .espeak/espeak-ng.tar.xz (made by scripts/bundle_espeak.sh) into
# $ESPEAK_ROOT (default /tmp/espeak) and put an `espeak-ng` on PATH that runs it, so speech
# can be synthesized on a machine where espeak-ng is not installed.
#
# The wrapper gives the bundle's libraries to espeak-ng alone: exported to the shell they
# would replace the machine's libzstd, liblzma, ... in Python and torch too.
_espeak_env() {
    local bundle=${1:-.espeak/espeak-ng.tar.xz}
    local root=${ESPEAK_ROOT:-/tmp/espeak}
    if [ ! -f "$bundle" ]; then
        echo "espeak_env: no $bundle (run scripts/bundle_espeak.sh where espeak-ng is installed)" >&2
        return 1
    fi
    mkdir -p "$root/wrapper" && tar -C "$root" -xJf "$bundle" || return 1
    cat > "$root/wrapper/espeak-ng" <<WRAPPER
#!/bin/sh
LD_LIBRARY_PATH="$root/lib" exec "$root/bin/espeak-ng" "\$@"
WRAPPER
    chmod +x "$root/wrapper/espeak-ng"
    export PATH="$root/wrapper:$PATH"
    export MUSE_ESPEAK_NG="$root/wrapper/espeak-ng"
    export ESPEAK_DATA_PATH="$root"
}
_espeak_env "$@"
