#!/bin/sh
# The functions every teardown script starts with (installer/actions/teardown_script.py writes
# the steps that call them): stop a unit of ours, put back or remove one of our files, remove a
# tree but keep what was there before us, find the processes of our cgroups and binaries, drop
# our firewall rules. Set before it: BACKUP_INFIX, CONTAINERD_RUN, CONTAINERD_DATA, KUBELET_DIR,
# CNI_NETNS (teardown_shell.py); R, RESTORED, CG_UNITS, NAMESPACES, SCRIPTS, PREFIXES and
# exe_pids (the script's head).
set -u
PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
say() { printf '%s\n' "$*"; }
has() { command -v "$1" >/dev/null 2>&1; }
# stop and disable a unit of ours (its unit file is ours: planned or in the manifest)
off() {
  has systemctl || return 0
  case "$(systemctl is-active "$1" 2>/dev/null)" in
    active|activating|reloading|deactivating) systemctl stop "$1" >/dev/null 2>&1 && say "stopped $1";;
  esac
  case "$(systemctl is-enabled "$1" 2>/dev/null)" in
    enabled|enabled-runtime) systemctl disable --quiet "$1" >/dev/null 2>&1 && say "disabled $1";;
  esac
  for l in "$R"/etc/systemd/system/*.wants/"$1"; do
    if [ -L "$l" ] && [ "$(readlink "$l")" = "/etc/systemd/system/$1" ]; then rm -f "$l"; say "removed ${l#"$R"}"; fi
  done
}
# one of our files: its pre-hiddenplane original comes back if there is one, else it goes
# (backup names end in a sortable time stamp: the first one the glob lists is the oldest)
rmf() {
  p="$R$1"
  if [ -s "$R$RESTORED" ] && grep -qxF "$1" "$R$RESTORED"; then return 0; fi
  b=''; n=0
  for x in "$p$BACKUP_INFIX"*; do
    [ -e "$x" ] || continue
    if [ -z "$b" ]; then b=$x; else n=$((n+1)); fi
  done
  if [ -n "$b" ]; then
    mv -f "$b" "$p" && say "restored $1 (the file that was there before hiddenplane)"
    printf '%s\n' "$1" >> "$R$RESTORED"
    if [ "$n" -gt 0 ]; then say "kept $n newer backup(s) of $1 (not written by hiddenplane)"; fi
  elif [ -e "$p" ] || [ -L "$p" ]; then
    rm -f "$p" && say "removed $1"
  fi
}
# a tree made by us or our components goes whole; but files that were there before hiddenplane
# (restored from a backup, or a newer backup) stay, with the directories holding them; a mount
# point is emptied, never removed
rmtree() {
  p="$R$1"
  [ -e "$p" ] || return 0
  keep=''
  if [ -e "$R$RESTORED" ] && grep -q "^$1/" "$R$RESTORED"; then keep=1; fi
  if [ -n "$(find "$p" -name "*$BACKUP_INFIX*" -print 2>/dev/null | head -n 1)" ]; then keep=1; fi
  if [ -n "$keep" ]; then
    find "$p" -depth ! -type d -print 2>/dev/null | while IFS= read -r f; do
      case "$f" in *"$BACKUP_INFIX"*) continue;; esac
      if [ -e "$R$RESTORED" ] && grep -qxF "${f#"$R"}" "$R$RESTORED"; then continue; fi
      rm -f "$f"
    done
    find "$p" -depth -mindepth 1 -type d -empty -delete 2>/dev/null
    say "emptied $1 but for the files that were there before hiddenplane"
  elif awk '{print $5}' "$R/proc/self/mountinfo" 2>/dev/null | grep -qxF "$1"; then
    if [ -n "$(ls -A "$p" 2>/dev/null)" ]; then
      find "$p" -mindepth 1 -maxdepth 1 -exec rm -rf {} + && say "emptied $1 (a mount point: kept)"
    fi
  else
    rm -rf "$p" && say "removed $1"
  fi
}
rmd() { if [ -d "$R$1" ] && [ ! -L "$R$1" ] && rmdir "$R$1" 2>/dev/null; then say "removed $1/"; fi; }
# cgroup directories of our worker units, of pods and of containerd's namespaces (ctr run
# puts a container in /<namespace>/<id> of every hierarchy)
hierarchies() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' "$R/proc/self/mounts" 2>/dev/null; }
cgdirs() {
  for h in $(hierarchies); do
    for u in $CG_UNITS; do [ -d "$R$h/system.slice/$u" ] && printf '%s\n' "$R$h/system.slice/$u"; done
    [ -n "$CG_UNITS" ] || continue
    for d in "$R$h"/kubepods*; do [ -d "$d" ] && printf '%s\n' "$d"; done
    for ns in $NAMESPACES; do [ -d "$R$h/$ns" ] && printf '%s\n' "$R$h/$ns"; done
  done
}
# processes in those cgroups, and processes running one of our binaries (a few processes for
# all of them: forks are slow on an emulated VM). 0 stands for a process of another PID
# namespace sharing a cgroup: never a target (kill -9 0 would hit our own process group)
pids() {
  {
    cgdirs | while read -r d; do find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null; done
    exe_pids
    # an interpreted binary (#!) runs as its interpreter: matched by its first argument
    for b in $SCRIPTS; do
      grep -lsF -- "$b" "$R"/proc/[0-9]*/cmdline 2>/dev/null | while read -r c; do
        [ "$(tr '\0' '\n' 2>/dev/null < "$c" | sed -n 2p)" = "$b" ] && { c=${c%/cmdline}; printf '%s\n' "${c##*/}"; }
      done
    done
  } | grep -E '^[1-9][0-9]*$' | grep -vx -e 1 -e "$$" | sort -un | while read -r x; do
    kill -0 "$x" 2>/dev/null && printf '%s\n' "$x"
  done
}
reap() {
  i=0; killed=0
  while [ $i -lt 20 ]; do
    p=$(pids)
    [ -n "$p" ] || break
    for x in $p; do kill -9 "$x" 2>/dev/null && killed=$((killed+1)); done
    i=$((i+1)); sleep 0.3
  done
  if [ "$killed" -gt 0 ]; then say "killed $killed leftover process(es) (shims, runc, containers, components)"; fi
  left=$(pids)
  if [ -n "$left" ]; then echo "processes survived SIGKILL: $left" >&2; fi
  # the pods' and namespaces' cgroups, now empty (systemd removes its units' own)
  for h in $(hierarchies); do
    [ -n "$CG_UNITS" ] || continue
    for d in "$R$h"/kubepods* $(for ns in $NAMESPACES; do printf '%s\n' "$R$h/$ns"; done); do
      [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
  done
  return 0
}
# shellcheck disable=SC2329 # a worker's steps call it, a control host's have nothing to unmount
unmount_ours() {
  awk '{print $5}' "$R/proc/self/mountinfo" 2>/dev/null | while read -r m; do
    case "$m" in "$CONTAINERD_RUN"/*|"$CONTAINERD_DATA"/*|"$KUBELET_DIR"/*|"$CNI_NETNS"*) printf '%s\n' "$m";; esac
  done | sort -r | while read -r m; do
    if umount "$R$m" 2>/dev/null || umount -l "$R$m" 2>/dev/null; then say "unmounted $m"; fi
  done
}
# rules of ours and of the components in every table: first the jumps from other chains,
# then the chains; a nat table left empty by this is dropped when nft can (iptables cannot)
chains() {
  t=$1; ipt=$2
  "$ipt-save" -t "$t" 2>/dev/null | sed -n 's/^:\([^ ]*\) .*/\1/p' | grep -E "^($PREFIXES)" || true
}
# rules of the other chains that jump to ours, as "CHAIN NUMBER", the last of each chain first
# (a deletion then leaves the numbers still to come as they were). A rule goes by its number and
# never by its text: the text carries what others wrote (a comment), which a shell must not read
# as words. A jump to a chain is the rule's last words (iptables prints matches before the target,
# and a jump has no options), so a comment that holds "-j KUBE-..." is not one.
jumps() {
  t=$1; ipt=$2
  "$ipt-save" -t "$t" 2>/dev/null | sed -n 's/^:\([^ ]*\) .*/\1/p' | grep -Ev "^($PREFIXES)" | while read -r c; do
    "$ipt" -w -t "$t" -S "$c" 2>/dev/null | grep -nE -- "$JUMP" | sed 's/:.*//' | sort -rn | while read -r i; do
      printf '%s %s\n' "$c" $((i - 1))
    done
  done
}
clean_rules() {
  ipt=$1; fam=$2
  JUMP=" -[jg] ($PREFIXES)[^ ]*\$"
  has "$ipt" && has "$ipt-save" || return 0
  for t in filter nat mangle raw; do
    ours=$(chains "$t" "$ipt")
    [ -n "$ours" ] || continue
    jumps "$t" "$ipt" | while read -r c n; do
      rule=$("$ipt" -w -t "$t" -S "$c" "$n" 2>/dev/null) || continue
      # still that jump, and one line (a comment cannot hide a second one in it)
      [ "$(printf '%s\n' "$rule" | wc -l)" -eq 1 ] || continue
      printf '%s\n' "$rule" | grep -qE -- "$JUMP" || continue
      "$ipt" -w -t "$t" -D "$c" "$n" 2>/dev/null \
        && say "removed $fam $t rule $n of $c: $(printf '%s' "${rule#-A "$c" }" | tr -c '[:print:]' '?')"
    done
    for c in $ours; do "$ipt" -w -t "$t" -F "$c" 2>/dev/null; done
    for c in $ours; do "$ipt" -w -t "$t" -X "$c" 2>/dev/null && say "removed $fam $t chain $c"; done
    if [ "$t" = nat ] && has nft && "$ipt" -V 2>/dev/null | grep -q nf_tables \
       && ! "$ipt-save" -t nat 2>/dev/null | grep -qE '^-A |^:[^ ]+ (-|DROP)'; then
      nft delete table "$fam" nat 2>/dev/null && say "removed the empty $fam nat table"
    fi
  done
}
