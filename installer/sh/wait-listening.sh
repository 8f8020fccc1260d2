#!/bin/sh
# Until something listens on every port given: wait-listening TRIES PORT... -- UNIT... (a try a
# second); on timeout the units' status goes to stderr. host/waits.py runs it in a subshell, so
# that scripts chain it with &&.
tries=$1
shift
ports=
while [ "$#" -gt 0 ] && [ "$1" != -- ]; do
  ports="$ports $1"
  shift
done
[ "$#" -gt 0 ] && shift
i=0
while [ "$i" -lt "$tries" ]; do
  ok=1
  for p in $ports; do
    ss -Htln | awk '{print $4}' | grep -q ":$p$" || ok=0
  done
  if [ "$ok" = 1 ]; then exit 0; fi
  i=$((i + 1))
  sleep 1
done
echo "not listening on all of:$ports" >&2
systemctl --no-pager status "$@" 2>&1 | tail -20 >&2
exit 1
