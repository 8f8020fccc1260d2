"""The teardown's firewall step (``clean_rules`` in installer/sh/teardown-prelude.sh) against the
real iptables and ip6tables in a network namespace of its own: rules that jump to our chains go,
our chains go, everything else stays. The attacker: anyone who can add a rule on a host before a
reset (root in a hostNetwork pod with NET_ADMIN, a component writing comments it was handed)
writes a comment that a shell would run. The teardown runs as root, so the rule's text must
never be read as shell words."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from installer.actions import teardown_script, teardown_shell

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("iptables") or not shutil.which("unshare"),
    reason="needs root, iptables and unshare (scripts/test installs iptables)")

# words that run something if a shell evaluates them, in the forms iptables-save quotes
PAYLOADS = ['a $(touch @P@/dollar) b', 'c `touch @P@/backtick` d', "e '; touch @P@/quote; ' f",
            'g "$(touch @P@/dq)" h']


def _setup(ipt: str, pwn: Path) -> list[str]:
    """The rules an attacker plants before a reset, in both tables the step walks."""
    p = [x.replace("@P@", str(pwn)) for x in PAYLOADS]
    return [
        f"{ipt} -w -t nat -N KUBE-POSTROUTING",
        f"{ipt} -w -t nat -A KUBE-POSTROUTING -j MASQUERADE",
        # jumps to ours, each with a comment that is shell code
        *(f"{ipt} -w -t nat -A POSTROUTING -m comment --comment {_q(c)} -j KUBE-POSTROUTING" for c in p),
        # foreign rules that only look like jumps to ours: they stay
        f"{ipt} -w -t nat -A POSTROUTING -m comment --comment {_q('-j KUBE-POSTROUTING')} -j MASQUERADE",
        f"{ipt} -w -t nat -N MINE",
        f"{ipt} -w -t nat -A MINE -m comment --comment {_q('-g CNI-x')} -j RETURN",
        f"{ipt} -w -t nat -A POSTROUTING -j MINE",
        f"{ipt} -w -t filter -N CNI-FORWARD",
        f"{ipt} -w -t filter -A FORWARD -m comment --comment {_q(p[0])} -j CNI-FORWARD",
        f"{ipt} -w -t filter -A FORWARD -j ACCEPT",
        f"{ipt} -w -t filter -A FORWARD -m comment --comment {_q(p[1])} -g CNI-FORWARD",
    ]


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def test_rules_jumping_to_ours_go_by_number_and_no_comment_runs(tmp_path):
    pwn = tmp_path / "pwned"
    pwn.mkdir()
    prefixes = "|".join(teardown_script.CHAIN_PREFIXES)
    script = "\n".join([
        "set -e", *_setup("iptables", pwn), *_setup("ip6tables", pwn), "set +e",
        teardown_shell.PRELUDE, f"PREFIXES='{prefixes}'",
        "clean_rules iptables ip", "clean_rules ip6tables ip6",
        "echo '@@after'", "iptables-save", "ip6tables-save"])
    run = subprocess.run(["unshare", "--net", "/bin/sh", "-c", script], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
    assert run.returncode == 0, run.stderr
    out, after = run.stdout.split("@@after\n")
    assert list(pwn.iterdir()) == [], (out, run.stderr)
    for fam in ("ip", "ip6"):
        assert out.count(f"removed {fam} nat rule") == len(PAYLOADS), out
        assert out.count(f"removed {fam} filter rule") == 2, out
        assert f"removed {fam} nat chain KUBE-POSTROUTING" in out and f"removed {fam} filter chain CNI-FORWARD" in out
    rules = [x for x in after.splitlines() if x.startswith(("-A ", ":"))]
    assert not [x for x in rules if "KUBE-POSTROUTING" in x.split("--comment")[0] or x.startswith(":CNI-")], rules
    # the foreign ones, both families, untouched and in order
    for _ in ("ip", "ip6"):
        for kept in ('-A POSTROUTING -m comment --comment "-j KUBE-POSTROUTING" -j MASQUERADE',
                     '-A MINE -m comment --comment "-g CNI-x" -j RETURN', "-A POSTROUTING -j MINE",
                     "-A FORWARD -j ACCEPT"):
            assert kept in rules, (kept, rules)
    assert rules.count("-A FORWARD -j ACCEPT") == 2 and rules.count("-A POSTROUTING -j MINE") == 2
    # what it says names each rule without running or echoing control characters of it
    assert "$(touch" in out and all(ch == "\n" or ch.isprintable() for ch in out)
