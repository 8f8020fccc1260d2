"""The ordered phases of `installer apply`. Names are what --only/--skip take."""

from installer.engine.phases.acquire_lock import AcquireLock
from installer.engine.phases.apply_addons import ApplyAddons
from installer.engine.phases.bootstrap_cluster import BootstrapCluster
from installer.engine.phases.connect_hosts import ConnectHosts
from installer.engine.phases.join_workers import JoinWorkers
from installer.engine.phases.read_etcd_membership import ReadEtcdMembership
from installer.engine.phases.run_preflight import RunPreflight
from installer.engine.phases.start_control_plane import StartControlPlane
from installer.engine.phases.start_etcd import StartEtcd
from installer.engine.phases.start_hosted import StartHosted
from installer.engine.phases.upload_artifacts import UploadArtifacts
from installer.engine.phases.verify_hidden import VerifyHidden
from installer.engine.phases.write_pki import WritePKI

# the phases of one run, in order: new instances per run (a phase may keep what it learnt in a
# run on itself, never across runs)
PHASE_CLASSES = (ConnectHosts, RunPreflight, AcquireLock, WritePKI, UploadArtifacts, ReadEtcdMembership, StartEtcd,
                 StartHosted, StartControlPlane, BootstrapCluster, ApplyAddons, JoinWorkers, VerifyHidden)


def build() -> tuple:
    """The phases for one run."""
    return tuple(cls() for cls in PHASE_CLASSES)


PHASE_NAMES = tuple(cls.name for cls in PHASE_CLASSES)
# without facts nothing can be planned, and changes are never made without the lock; keys made
# for this run are kept in the state whatever else runs: `--only hosted` on a new state pushed
# a tenant's whole PKI into its hosting cluster and kept none of it (the next apply made another
# CA, which the CA guard then refused; the density benchmark never ran a second apply)
ALWAYS = frozenset({"connect", "lock", "pki"})
# phases that need what another one makes: skipping the key skips them too (runner.effective_options)
SKIPPED_WITH = {"cluster-bootstrap": frozenset({"addons"}), "etcd-membership": frozenset({"etcd"})}
# phases another one cannot run without: naming the key in --only runs them too (the members
# are never changed without the membership read first)
RUN_WITH = {"etcd": frozenset({"etcd-membership"})}
