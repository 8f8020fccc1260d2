#!/bin/sh
# The pod-network routes the kernel took away, put back:
#   hiddenplane-routes-repair FAMILY PROTO [CIDR VIA]...
# hiddenplane-routes-repair.service runs it every few seconds (its timer). The kernel deletes the
# routes of a link that goes down and adds none back when it comes up (ifdown/ifup, a network
# restart, a switch port flap), while hiddenplane-routes.service adds them only when it starts.
# Each CIDR that has no route marked "proto PROTO" is routed via VIA again with `ip route
# replace`; a route that is there is left alone (no flush: nothing in flight is disturbed), and
# so is any route not listed. A gateway still unreachable (its link still down) is no error: the
# next run tries again. It exits 0 whatever happened, so that a link that stays down leaves no
# failed unit every few seconds for `systemctl is-failed` and health checks to find. What it
# puts back is said on stdout (the journal). Assigned before this: ip (the ip(8) binary).
set -u
: "${ip:?}"
family=$1
proto=$2
shift 2
[ "$#" -ge 2 ] || exit 0
nl='
'
# the destinations of our routes, one a line (ip(8) writes a host route without its /32 or /128)
have="$nl$("$ip" -"$family" route show proto "$proto" 2>/dev/null | cut -d' ' -f1)$nl"
while [ "$#" -ge 2 ]; do
  cidr=$1
  via=$2
  shift 2
  bare=${cidr%/32}
  [ "$family" = 6 ] && bare=${cidr%/128}
  case $have in *"$nl$cidr$nl"* | *"$nl$bare$nl"*) continue ;; esac
  if "$ip" -"$family" route replace "$cidr" via "$via" proto "$proto" 2>/dev/null; then
    echo "re-added the route to $cidr via $via (proto $proto)"
  fi
done
exit 0
