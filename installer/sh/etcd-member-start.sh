#!/bin/sh
# Start one etcd member of a hosted control plane (docs/hosted.md): its pod may come back with
# its volume, or with an empty one. Assigned before this: etcd and etcdctl (the binaries), member (its name),
# peer_url (this member's; legacy_peer_url the one it had before the members' Services),
# cluster (every member, name=peer URL, for a first bootstrap), data (the data directory),
# endpoints (the other members' client URLs, comma-separated), and the client certificate
# etcdctl uses: cacert, cert, key; etcdutl and restore (the directory an
# `etcd snapshot restore` leaves a snapshot and its cluster token in), restore_flags (etcdutl's
# other flags for it). The arguments are etcd's
# other flags.
#   - a restore waiting (restore/snapshot.db and restore/token): this member of a new cluster
#     (every member, that token) is written from the snapshot, the data before it kept in
#     data.before-restore, then etcd starts on it (every member restores the same file);
#   - data present (a write-ahead log file): etcd starts on it (the bootstrap flags are ignored
#     then, as etcd does); a data directory without one is removed (its start never joined);
#   - no data, and no cluster answers: a first bootstrap, every member at once (state new);
#   - no data, the cluster answers and lists this member as never started (late for the
#     bootstrap, or added by a start that died before etcd ran): it joins as listed;
#   - no data, the cluster answers and lists this member as started (its volume was lost):
#     the old member is removed and this one added again, then it starts empty (state
#     existing) and gets everything from the others: no data lost while they keep quorum;
#   - no data, the cluster answers without this member: added, then started (state existing).
set -eu
: "${etcd:?}" "${etcdctl:?}" "${member:?}" "${peer_url:?}" "${cluster:?}" "${data:?}" "${endpoints:?}"
: "${cacert:?}" "${cert:?}" "${key:?}" "${etcdutl:?}" "${restore:?}" "${legacy_peer_url:?}" "${restore_flags:?}"

if [ -f "$restore/snapshot.db" ] && [ -f "$restore/token" ]; then
  token=$(cat "$restore/token")
  echo "etcd-member-start: $member: restoring the snapshot in $restore (cluster token $token)" >&2
  rm -rf "$data.restoring"
  # restore_flags: the revision raised past every client's (core/etcd_rules.py, RESTORE_FLAGS);
  # flags without spaces, split into words on purpose
  # shellcheck disable=SC2086
  "$etcdutl" snapshot restore "$restore/snapshot.db" --name="$member" --initial-cluster="$cluster" \
    --initial-cluster-token="$token" --initial-advertise-peer-urls="$peer_url" --data-dir="$data.restoring" \
    $restore_flags
  rm -rf "$data.before-restore"
  if [ -e "$data" ]; then
    mv "$data" "$data.before-restore"
  fi
  mv "$data.restoring" "$data"
  rm -rf "$restore"
fi

# a member is on its data when its write-ahead log has a file (etcd's own test: the database
# file alone is made before the member has joined; a start that died there left it)
for wal in "$data"/member/wal/*.wal; do
  if [ -e "$wal" ]; then
    exec "$etcd" "$@" --name="$member" --data-dir="$data" --initial-advertise-peer-urls="$peer_url" \
      --initial-cluster="$cluster" --initial-cluster-state=existing
  fi
  break
done
if [ -e "$data" ]; then
  echo "etcd-member-start: $member: $data holds no write-ahead log (a start that never joined): starting empty" >&2
  rm -rf "$data"
fi

ctl() {
  "$etcdctl" --endpoints="$endpoints" --cacert="$cacert" --cert="$cert" --key="$key" \
    --dial-timeout=3s --command-timeout=10s "$@"
}

# a membership change etcd refuses while a peer is new or just gone (strict reconfiguration
# check): again, each second, for up to a minute; anything else fails at once. And an add in
# the same second as the removal of this peer URL's member: etcd derives a new member's ID from
# its peer URLs, the cluster's name and the second (membership.computeMemberID), gets the
# removed member's ID again and refuses it as removed, which its API says as "member not found";
# the next second makes another ID (seen in CI: a member added, its volume lost, removed and
# added again within 0.2 s)
retry() {
  i=0
  until out=$(ctl "$@" 2>&1); do
    case $out in
      *"unhealthy cluster"* | *"too many requests"* | *"not ready"*) ;;
      *"member not found"*) [ "$2" = add ] || { printf '%s\n' "$out" >&2; return 1; } ;;
      *) printf '%s\n' "$out" >&2; return 1 ;;
    esac
    i=$((i + 1))
    if [ "$i" -ge 60 ]; then
      printf '%s\n' "$out" >&2
      return 1
    fi
    sleep 1
  done
  printf '%s\n' "$out"
}

# "ID, status, name, peer URLs, client URLs, learner" per member; the status of a member that
# never started is "unstarted"
if ! members=$(ctl member list -w simple 2>/dev/null); then
  echo "etcd-member-start: $member: no cluster answers at $endpoints: bootstrapping" >&2
  exec "$etcd" "$@" --name="$member" --data-dir="$data" --initial-advertise-peer-urls="$peer_url" \
    --initial-cluster="$cluster" --initial-cluster-state=new
fi
# this member as listed: by its peer URL, the one it had before the members' Services
# (legacy_peer_url, until apply moves it), or its name
mine=$(printf '%s\n' "$members" | awk -F', ' -v u="$peer_url" -v l="$legacy_peer_url" -v m="$member" \
  '$4 == u || $4 == l || ($3 == m && m != "") {print $1 " " $2 " " $4; exit}')
id=${mine%% *}
rest=${mine#* }
status=${rest%% *}
listed=${rest#* }
if [ "$status" != unstarted ]; then
  if [ -n "$mine" ]; then
    echo "etcd-member-start: $member: its data is gone: removing member $id and adding it again" >&2
    retry member remove "$id" >&2
  fi
  # an add whose answer was lost may have been made: this peer URL listed is the proof
  if ! retry member add "$member" --peer-urls="$peer_url" >&2; then
    ctl member list -w simple | awk -F', ' -v u="$peer_url" '$4 == u {f = 1} END {exit !f}' || exit 1
  fi
else
  echo "etcd-member-start: $member: listed, never started: joining as it is listed" >&2
  peer_url=$listed
fi
# the cluster as etcd now has it, this member under its name
initial=$(ctl member list -w simple | awk -F', ' -v m="$member" -v u="$peer_url" \
  '{printf "%s%s=%s", sep, ($4 == u ? m : $3), $4; sep = ","}')
echo "etcd-member-start: $member: starting empty, the others send it the data" >&2
exec "$etcd" "$@" --name="$member" --data-dir="$data" --initial-advertise-peer-urls="$peer_url" \
  --initial-cluster="$initial" --initial-cluster-state=existing
