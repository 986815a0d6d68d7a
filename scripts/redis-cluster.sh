#!/usr/bin/env bash
# Starts or stops a 3-master Redis Cluster on loopback, for the cluster tests:
#   scripts/redis-cluster.sh start   # ports 7301-7303 (IDEM_CLUSTER_BASE_PORT=7300)
#   scripts/redis-cluster.sh stop
# The tests find it through IDEM_REDIS_CLUSTER_URLS (default: these three ports).
set -euo pipefail

base=${IDEM_CLUSTER_BASE_PORT:-7300}
ports=($((base + 1)) $((base + 2)) $((base + 3)))
dir=${IDEM_CLUSTER_DIR:-${TMPDIR:-/tmp}/idem-redis-cluster-$base}

start() {
    mkdir -p "$dir"
    for port in "${ports[@]}"; do
        if redis-cli -p "$port" ping >/dev/null 2>&1; then
            redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
        fi
        rm -f "$dir/nodes-$port.conf"
        redis-server --port "$port" --bind 127.0.0.1 --daemonize yes \
            --cluster-enabled yes --cluster-config-file "nodes-$port.conf" \
            --cluster-node-timeout 2000 --dir "$dir" --save "" --appendonly no \
            --logfile "$dir/redis-$port.log"
    done
    for port in "${ports[@]}"; do
        for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    local nodes=()
    for port in "${ports[@]}"; do nodes+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log"
    for _ in $(seq 100); do
        if redis-cli -p "${ports[0]}" cluster info | grep -q "cluster_state:ok"; then
            echo "redis cluster up on ports ${ports[*]}"
            return 0
        fi
        sleep 0.1
    done
    echo "the redis cluster did not reach cluster_state:ok" >&2
    cat "$dir/create.log" >&2
    return 1
}

stop() {
    for port in "${ports[@]}"; do
        redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -rf "$dir"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
