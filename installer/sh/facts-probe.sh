#!/bin/sh
# The facts probe: everything a run needs to know of a host, in one round trip, one line per
# fact (K key value, M module, T tool, P port, S user, X runtime marker, D dir, U unit, F/A/Z/R
# files, C content; END last); installer/core/facts.py parses it. The paths to stat, hash or
# read come on stdin (facts.probe_input). Set before it by facts.py: MANIFEST, LOCK, PENDING
# (the installer's files on the host), HOST_TOOLS and RUNTIME_MARKERS (names to look for).
set -u
T=$(printf '\t')
k() { printf 'K\t%s\t%s\n' "$1" "$2"; }
k hostname "$(hostname)"
# shellcheck source=/dev/null # the host's own
if [ -r /etc/os-release ]; then . /etc/os-release; fi
k os "${ID:-unknown} ${VERSION_ID:-}"
k arch "$(uname -m)"
k init "$(cat /proc/1/comm 2>/dev/null || echo unknown)"
k swap "$(awk 'NR>1' /proc/swaps 2>/dev/null | wc -l)"
if [ -e /var/lib/kubelet/pki/kubelet-client-current.pem ]; then k joined 1; fi
if [ -d /var/lib/etcd/member ]; then k etcd_data 1; fi
if [ -s "$PENDING" ]; then k pending "$(sort -u "$PENDING" | tr '\n' ' ')"; fi
if [ -f "$LOCK" ]; then k lock "$(head -c 300 "$LOCK" | tr '\t\n' '  ')"; fi
awk '{print "M\t" $1}' /proc/modules 2>/dev/null
# built-in modules do not show in /proc/modules (nor does anything inside a container): look
# for what they provide instead
if grep -qw overlay /proc/filesystems 2>/dev/null; then printf 'M\toverlay\n'; fi
if [ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]; then printf 'M\tbr_netfilter\n'; fi
# shellcheck disable=SC2086 # a list of names
for x in $HOST_TOOLS; do if command -v "$x" >/dev/null 2>&1; then printf 'T\t%s\n' "$x"; fi; done
if command -v ss >/dev/null 2>&1; then ss -Htln 2>/dev/null | awk '{n=split($4,a,":"); print "P\t" a[n]}'; fi
awk -F: '{print "S\t" $1}' /etc/passwd
# shellcheck disable=SC2086 # a list of names
for x in $RUNTIME_MARKERS; do
  if command -v "$x" >/dev/null 2>&1 || [ -e "/usr/local/bin/$x" ]; then printf 'X\tbinary\t%s\n' "$x"; fi
  if pgrep -x "$x" >/dev/null 2>&1; then printf 'X\tprocess\t%s\n' "$x"; fi
  if [ -e "/etc/systemd/system/$x.service" ] || [ -e "/lib/systemd/system/$x.service" ]; then
    printf 'X\tunit\t%s\n' "$x"
  fi
done
tmp=$(mktemp -d)
: > "$tmp/f"; : > "$tmp/u"
while IFS="$T" read -r kind p; do
  case "$kind" in
    F) printf '%s\n' "$p" >> "$tmp/f";;
    D) if [ -d "$p" ]; then printf 'D\t%s\t%s\n' "$p" "$(stat --printf '%a\t%U\t%G' "$p")"; fi;;
    U) printf '%s\n' "$p" >> "$tmp/u";;
    # certificates (public) for the CA and stale-leaf guards; of a kubeconfig only its client
    # certificate leaves the host, never the key beside it (decoded and encoded again: bad
    # base64 on the host becomes no certificate, not an unreadable probe)
    C) if [ -f "$p" ]; then
         case "$p" in
           *.conf) c=$(sed -n 's/^[[:space:]]*client-certificate-data:[[:space:]]*//p' "$p" | head -n 1 |
                       base64 -d 2>/dev/null | head -c 65536 | base64 | tr -d '\n');;
           *) c=$(head -c 65536 "$p" | base64 | tr -d '\n');;
         esac
         printf 'C\t%s\t%s\n' "$p" "$c"
       fi;;
  esac
done
# units: one `systemctl show` for all of them and systemd-resolved (two `systemctl` calls a
# unit took 60-80 ms on a control host, this one 13 ms); a block per unit, in argument order,
# each starting with its Id (a unit that does not exist: inactive, no file state)
if command -v systemctl >/dev/null 2>&1; then
  printf 'systemd-resolved.service\n' >> "$tmp/u"
  tr '\n' '\0' < "$tmp/u" | xargs -0 systemctl show -p Id,ActiveState,UnitFileState -- 2>/dev/null |
    awk -v OFS="$T" -v list="$tmp/u" '
      BEGIN { while ((getline u < list) > 0) name[++n] = u }
      /^Id=/ { i++ }
      /^ActiveState=/ { a[i] = substr($0, 13) }
      /^UnitFileState=/ { e[i] = substr($0, 15) }
      END { for (j = 1; j < n; j++) print "U", name[j], a[j], e[j]
            if (a[n] == "active") print "K", "resolved", 1 }'
fi
# files: one stat for all; a file whose size and mtime match the manifest reports the digest
# recorded there, the others are hashed (one sha256sum for all of them)
if [ -s "$tmp/f" ]; then
  tr '\n' '\0' < "$tmp/f" | xargs -0 stat --printf '%n\t%s\t%Y\t%a\t%U\t%G\n' 2>/dev/null > "$tmp/st" || true
  if [ -f "$MANIFEST" ]; then cp "$MANIFEST" "$tmp/m"; else : > "$tmp/m"; fi
  awk -F"$T" -v OFS="$T" -v h="$tmp/h" '
    FILENAME == ARGV[1] { known[$1 SUBSEP $3 SUBSEP $4] = $2; next }
    { k = $1 SUBSEP $2 SUBSEP $3
      if (k in known) print "F", $1, known[k], $4, $5, $6
      else { print "A", $1, $4, $5, $6; print $1 > h } }' "$tmp/m" "$tmp/st"
  if [ -s "$tmp/h" ]; then
    tr '\n' '\0' < "$tmp/h" | xargs -0 sha256sum 2>/dev/null |
      awk -v OFS="$T" '{ d = $1; sub(/^[^ ]+  /, ""); print "Z", $0, d }'
  fi
  awk -F"$T" -v OFS="$T" '{ print "R", $1, $2 }' "$tmp/m"
fi
rm -rf "$tmp"
echo END
