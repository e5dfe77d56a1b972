#!/bin/sh
# Start redis-server as the master Sentinel reports, or (first boot, no sentinel answers) redis-0 as
# master and the others as its replicas. A pod that restarts after a failover rejoins as a replica.
set -eu
ME="$(hostname).redis"
MASTER=""
for s in redis-0.redis redis-1.redis redis-2.redis; do
  MASTER=$(redis-cli -h "$s" -p 26379 --raw sentinel get-master-addr-by-name pagedserve 2>/dev/null | head -1 || true)
  [ -n "$MASTER" ] && break
done
if [ -z "$MASTER" ]; then
  if [ "$(hostname)" = "redis-0" ]; then MASTER="$ME"; else MASTER="redis-0.redis"; fi
fi
set -- --port 6379 --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" --save "" --appendonly no \
  --replica-announce-ip "$ME"
if [ "$MASTER" != "$ME" ]; then
  set -- "$@" --replicaof "$MASTER" 6379
fi
exec redis-server "$@"
