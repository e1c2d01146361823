# shellcheck shell=bash
# The build-or-reuse logic shared by .ci/lmcache-env (LMCache 0.5.6) and .ci/lmcache057-env (LMCache
# 0.5.7rc3): sourced by both, never run on its own.  The sourcing script sets
#
#   TAG            the log prefix (the script's name)
#   VENV           where the venv lives
#   PYTHON         the interpreter that creates it (one inside VENV cannot build its own replacement:
#                  the tests point the same variable at the venv's python, so that falls back to python3)
#   REQ_HASH       the hash of everything the venv is built from (the marker .complete holds it)
#   CHECK_IMPORTS  Python that must run in the venv for it to count as complete
#
# and defines install_packages (installs into "$VENV", created empty, with "${PIP[@]}"), then calls
#
#   lmcache_venv_main "$@"     # [--reuse-only]: the venv's path on the last line of stdout, or exit 3
#
# Guarantees: progress goes to stderr; a complete venv whose marker matches REQ_HASH and whose imports
# run is reused as it is; --reuse-only never builds, changes or deletes anything; only a venv (a
# pyvenv.cfg) or an empty folder is ever deleted; every process runs with LMCACHE_TRACK_USAGE=false and
# DO_NOT_TRACK=1 (otherwise LMCache sends usage reports off the machine).

export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[%s] %s\n' "$TAG" "$*" >&2; }

check_imports() {
    "$VENV/bin/python" -c "$CHECK_IMPORTS" >&2
}

lmcache_venv_main() {
    local reuse_only=0
    case "${1:-}" in
        "") ;;
        --reuse-only) reuse_only=1 ;;
        *) log "usage: $0 [--reuse-only]"; exit 2 ;;
    esac
    if [[ "$PYTHON" == "$VENV"/* ]]; then
        PYTHON=python3
    fi
    local marker="$VENV/.complete"

    if [[ -f "$marker" && "$(cat "$marker")" == "$REQ_HASH" && -x "$VENV/bin/python" ]]; then
        if check_imports; then
            log "reusing complete venv $VENV"
            echo "$VENV"
            exit 0
        fi
        log "venv $VENV has a marker but its imports fail; it needs rebuilding"
    fi

    if [[ $reuse_only == 1 ]]; then
        log "no complete, current venv at $VENV (--reuse-only: not building one)"
        exit 3
    fi

    if [[ -e "$VENV" ]]; then
        # Only ever delete something this script could have made: a venv, or an empty folder.
        if [[ -f "$VENV/pyvenv.cfg" ]] || [[ -d "$VENV" && -z "$(ls -A -- "$VENV")" ]]; then
            log "removing incomplete or outdated venv $VENV"
            rm -rf -- "$VENV"
        else
            log "refusing to replace $VENV: it exists and is not a virtual environment"
            exit 2
        fi
    fi
    mkdir -p -- "$(dirname "$VENV")"

    log "creating venv $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install --no-input --progress-bar off)
    install_packages

    log "checking imports"
    check_imports
    printf '%s\n' "$REQ_HASH" >"$marker"
    log "venv complete"
    echo "$VENV"
}
