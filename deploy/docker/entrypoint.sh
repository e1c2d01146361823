#!/bin/sh
# The container's entry point: start-cache with its runtime dir (the cache processes' sockets) at
# $MPCACHE_RUNTIME_DIR, on a volume an inference engine's container may mount too, and the arguments given
# (the image's CMD: --prometheus-host 0.0.0.0).
#
# start-cache wants its --runtime-dir absent or empty.  A run stopped cleanly removes it, but one killed
# (docker kill, the OOM killer) leaves its sockets behind on the volume; only this container's supervisor uses
# the directory, and it is not running yet: remove what is left.
set -eu
dir=${MPCACHE_RUNTIME_DIR:-/run/mpcache/service}
rm -rf -- "$dir"
exec start-cache --runtime-dir "$dir" "$@"
