#!/bin/sh
# Until every unit given is active: wait-active TRIES UNIT... (a try a second). Each unit is
# asked alone: `systemctl is-active A B` succeeds when ANY of them is. A unit that failed (started
# with --no-block, nothing else reports it) ends the wait early; not in the first seconds, while
# a unit that failed before may not have begun its new start. On timeout the units' status goes
# to stderr. host/waits.py runs it in a subshell, so that scripts chain it with &&.
tries=$1
shift
i=0
while [ "$i" -lt "$tries" ]; do
  all=1
  for u in "$@"; do systemctl is-active --quiet "$u" || { all=0; break; }; done
  if [ "$all" = 1 ]; then exit 0; fi
  if [ "$i" -ge 3 ] && systemctl is-failed --quiet "$@"; then break; fi
  i=$((i + 1))
  sleep 1
done
systemctl --no-pager status "$@" 2>&1 | tail -30 >&2
exit 1
