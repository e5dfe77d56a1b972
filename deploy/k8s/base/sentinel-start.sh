#!/bin/sh
# One sentinel per Redis pod, watching the master "pagedserve" (quorum 2 of 3), by hostname.
set -eu
CONF=/data/sentinel.conf
MASTER=redis-0.redis
for s in redis-0.redis redis-1.redis redis-2.redis; do
  FOUND=$(redis-cli -h "$s" -p 26379 --raw sentinel get-master-addr-by-name pagedserve 2>/dev/null | head -1 || true)
  if [ -n "$FOUND" ]; then MASTER="$FOUND"; break; fi
done
until redis-cli -h "$MASTER" -a "$REDIS_PASSWORD" --no-auth-warning ping 2>/dev/null | grep -q PONG; do sleep 1; done
cat > "$CONF" <<CONF
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $(hostname).redis
sentinel monitor pagedserve $MASTER 6379 2
sentinel auth-pass pagedserve $REDIS_PASSWORD
sentinel down-after-milliseconds pagedserve 5000
sentinel failover-timeout pagedserve 60000
sentinel parallel-syncs pagedserve 1
CONF
exec redis-server "$CONF" --sentinel
