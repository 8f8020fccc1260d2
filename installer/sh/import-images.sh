#!/bin/sh
# Import image archives into containerd's k8s.io namespace (the workers phase). Assigned before
# this: ctr (the ctr binary), dir (where the archives are), tries (seconds to wait for
# containerd). Then one `imp FILE DIGEST NAME...` per archive: imported when one of its images
# is missing or the digest stamped beside it differs; prints "imported FILE". Each image is
# pinned (containerd's CRI label io.cri-containerd.pinned=pinned): the kubelet's image garbage
# collection never removes a pinned image, and one imported from an archive has no registry to
# be pulled back from (seen on the lab: a disk at 85 % use lost busybox and agnhost); prints
# "pinned NAME" for an image found unpinned.
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
pin=io.cri-containerd.pinned
pinned=$("$ctr" -n k8s.io images ls -q "labels.\"$pin\"==pinned")
imp() { # file digest names...
  f=$dir/$1
  d=$2
  shift 2
  need=0
  [ "$(cat "$f.imported" 2>/dev/null || true)" = "$d" ] || need=1
  for ref in "$@"; do
    printf '%s\n' "$have" | grep -qxF -- "$ref" || need=1
  done
  if [ "$need" = 1 ]; then
    "$ctr" -n k8s.io images import "$f" >&2
    printf '%s\n' "$d" >"$f.imported.new"
    mv -f "$f.imported.new" "$f.imported"
    echo "imported ${f##*/}"
  fi
  for ref in "$@"; do
    if [ "$need" = 1 ] || ! printf '%s\n' "$pinned" | grep -qxF -- "$ref"; then
      "$ctr" -n k8s.io images label "$ref" "$pin=pinned" >/dev/null
      [ "$need" = 1 ] || echo "pinned $ref"
    fi
  done
}
