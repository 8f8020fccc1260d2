#!/bin/sh
# Import image archives into containerd's k8s.io namespace (the workers phase). Assigned before
# this: ctr (the ctr binary), dir (where the archives are), tries (seconds to wait for
# containerd). Then one `imp FILE DIGEST NAME...` per archive: imported when one of its images
# is missing or the digest stamped beside it differs; prints "imported FILE".
set -eu
: "${ctr:?}" "${dir:?}" "${tries:?}"
# containerd may still be (re)starting: its units were started without blocking
i=0
until "$ctr" version >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -ge "$tries" ]; then
    "$ctr" version >&2
    exit 1
  fi
  sleep 1
done
have=$("$ctr" -n k8s.io images ls -q)
imp() { # file digest names...
  f=$dir/$1
  d=$2
  shift 2
  need=0
  [ "$(cat "$f.imported" 2>/dev/null || true)" = "$d" ] || need=1
  for ref in "$@"; do
    printf '%s\n' "$have" | grep -qxF -- "$ref" || need=1
  done
  [ "$need" = 1 ] || return 0
  "$ctr" -n k8s.io images import "$f" >&2
  printf '%s\n' "$d" >"$f.imported.new"
  mv -f "$f.imported.new" "$f.imported"
  echo "imported ${f##*/}"
}
