"""`installer plan --render`: the tree on disk matches the plan, modes included, and re-runs
write nothing."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

from click.testing import CliRunner

from installer.cli.main import cli
from installer.core.render.plan import render_cluster
from installer.core.render.worker import RESOLVED_RESOLV_CONF, HostFacts

from .conftest import EXAMPLE, ROOT, write_inventory


def _tree(root: Path) -> dict[str, Path]:
    return {"/" + str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and p.name != "MANIFEST"}


def test_render_tree_matches_manifest(tmp_path):
    out, state = tmp_path / "out", tmp_path / "state"
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--render", str(out), "--state", str(state)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["_cluster", "cp1", "node2", "node3"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for host in ("cp1", "node2", "node3"):
        files = _tree(out / host)
        rows = (out / host / "MANIFEST").read_text().splitlines()
        listed = {}
        for row in rows:
            path, mode, owner, digest = row.split(" ")
            if path.endswith("/"):
                assert digest == "-" and (out / host / path.lstrip("/")).is_dir()
                continue
            listed[path] = (int(mode, 8), owner, digest)
        assert set(listed) == set(files), f"{host}: MANIFEST and tree differ"
        for path, (mode, owner, digest) in listed.items():
            f = files[path]
            assert stat.S_IMODE(f.stat().st_mode) == mode, path
            assert hashlib.sha256(f.read_bytes()).hexdigest() == digest, path
            assert owner in ("root:root", "etcd:etcd"), path
            if (path.endswith(".key")
                    or path.startswith("/etc/kubernetes/") and path.endswith((".conf", "-config.yaml"))):
                assert mode == 0o600, f"{path} holds a secret but is {mode:o}"


def test_second_plan_changes_nothing(tmp_path):
    out, state = tmp_path / "out", tmp_path / "state"
    args = ["plan", str(EXAMPLE), "--render", str(out), "--state", str(state)]
    first = CliRunner().invoke(cli, args)
    assert "pki: ca: new CA" in first.output
    snapshot = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in list(out.rglob("*")) + list(state.rglob("*"))
                if p.is_file()}
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0
    assert "pki:" not in second.output            # nothing issued
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in snapshot}
    assert after == snapshot                      # not even rewritten


def test_plan_output_holds_no_secret(tmp_path, prepared):
    state = tmp_path / "state"
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--state", str(state), "--render", str(tmp_path / "o")])
    assert result.exit_code == 0
    tokens = (state / "secrets" / "tokens.yaml").read_text()
    secret = tokens.split("secret: ")[1].split()[0]
    assert secret not in result.output
    assert "PRIVATE KEY" not in result.output
    assert (state / "secrets" / "encryption.key").read_text().strip() not in result.output


def test_resolv_conf_follows_systemd_resolved(prepared):
    import yaml
    plans = render_cluster(prepared.inventory, prepared.material, {"node2": HostFacts(systemd_resolved=True)})
    cfg2 = yaml.safe_load(plans["node2"].files["/var/lib/kubelet/config.yaml"].content)
    cfg3 = yaml.safe_load(plans["node3"].files["/var/lib/kubelet/config.yaml"].content)
    assert cfg2["resolvConf"] == RESOLVED_RESOLV_CONF
    assert cfg3["resolvConf"] == "/etc/resolv.conf"


def test_explicit_resolv_conf_wins(doc, tmp_path):
    import yaml

    from installer import api
    doc["spec"]["network"]["resolvConf"] = "/etc/kubernetes/upstream-resolv.conf"
    p = api.prepare(write_inventory(tmp_path, doc), tmp_path / "state")
    cfg = yaml.safe_load(p.plans["node2"].files["/var/lib/kubelet/config.yaml"].content)
    assert cfg["resolvConf"] == "/etc/kubernetes/upstream-resolv.conf"


def test_state_dir_error_is_clear(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    result = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--state", str(blocker / "state")])
    assert result.exit_code == 2
    assert "state directory" in result.output and "Traceback" not in result.output


def test_wheel_ships_units_and_not_tests(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("hiddenplane-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "installer/units/kube-apiserver.service.j2" in names
    assert "installer/cli/main.py" in names
    assert not any(n.startswith("tests/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "installer = installer.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_wheel_renders(tmp_path):
    """The wheel works outside the checkout (templates found inside the package)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "w"), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "w").glob("*.whl"))
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", "import installer.core.render.files as f; print(f._units_dir())"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(target / "installer" / "units")


def test_libyaml_emits_what_pure_python_emits(prepared, monkeypatch):
    """to_yaml uses libyaml's emitter for speed; a different byte would change every host's
    file digests (and restart units) on the first apply after an upgrade of the installer."""
    import yaml

    from installer.core.render import files

    assert files._DUMPER is yaml.CSafeDumper, "PyYAML without libyaml: rendering is ~7x slower"
    docs = []
    real = files.to_yaml
    monkeypatch.setattr(files, "to_yaml", lambda doc: docs.append(doc) or real(doc))
    for mod in ("worker", "control", "kubeconfig", "plan"):
        monkeypatch.setattr(f"installer.core.render.{mod}.to_yaml", files.to_yaml, raising=False)
    render_cluster(prepared.inventory, prepared.material)
    assert len(docs) > 10
    for doc in docs:
        assert real(doc) == yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).encode()
