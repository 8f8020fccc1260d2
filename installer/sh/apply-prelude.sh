#!/bin/sh
# The start of every change's script (installer/host/hostops.py writes the steps after it): the
# tar on stdin unpacked into a private stage, and put(), which installs one file from it
# atomically (PATH.hp-new renamed over PATH; a file there before us backed up once, as
# PATH$BACKUP_INFIX$STAMP) and records it for the manifest. Set before it: STAMP, TAR_CODEC,
# STATE_DIR, BACKUP_INFIX.
set -eu
umask 077
mkdir -p "$STATE_DIR/stage"
chmod 700 "$STATE_DIR"
stage=$(mktemp -d "$STATE_DIR/stage/apply.XXXXXX")
# the target whose temporary files exist while put() runs: a failed step (a full disk) takes
# them with it, so no empty PATH.hp-new or half-copied backup stays behind
cur=
trap 'rm -rf "$stage"; if [ -n "$cur" ]; then rm -f -- "$cur.hp-new" "$cur.hp-bak"; fi' EXIT
# shellcheck disable=SC2086 # empty, or the one option that unpacks it
tar -x $TAR_CODEC -C "$stage" -f -
backed_up() {  # path: a backup with the same content exists (an earlier attempt made it)
  for b in "$1$BACKUP_INFIX"*; do
    if [ -f "$b" ] && cmp -s -- "$1" "$b"; then return 0; fi
  done
  return 1
}
put() {  # index path mode owner group backup digest move
  (umask 022; mkdir -p "$(dirname "$2")")
  cur=$2
  if [ "$8" = 1 ]; then   # a binary: moved out of the stage, not copied a second time
    mv -f "$stage/$1" "$2.hp-new"; chown "$4:$5" "$2.hp-new"; chmod "$3" "$2.hp-new"
  else
    install -m "$3" -o "$4" -g "$5" "$stage/$1" "$2.hp-new"
  fi
  sync "$2.hp-new"
  # the backup only once the new file is complete, and never twice for the same content
  if [ "$6" = 1 ] && [ -e "$2" ] && ! backed_up "$2"; then
    cp -p "$2" "$2.hp-bak"
    mv -f "$2.hp-bak" "$2$BACKUP_INFIX$STAMP"
  fi
  mv -f "$2.hp-new" "$2"
  cur=
  printf '%s\t%s\t%s\n' "$2" "$7" "$(stat --printf '%s\t%Y' "$2")" >> "$stage/manifest.add"
}
