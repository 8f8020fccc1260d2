"""The ordered phases of `installer apply`. Names are what --only/--skip take."""

from .acquire_lock import AcquireLock
from .apply_addons import ApplyAddons
from .bootstrap_cluster import BootstrapCluster
from .connect_hosts import ConnectHosts
from .join_workers import JoinWorkers
from .run_preflight import RunPreflight
from .start_control_plane import StartControlPlane
from .start_etcd import StartEtcd
from .upload_artifacts import UploadArtifacts
from .verify_hidden import VerifyHidden
from .write_pki import WritePKI

PHASES = (ConnectHosts(), RunPreflight(), AcquireLock(), WritePKI(), UploadArtifacts(), StartEtcd(),
          StartControlPlane(), BootstrapCluster(), ApplyAddons(), JoinWorkers(), VerifyHidden())
PHASE_NAMES = tuple(p.name for p in PHASES)
# without facts nothing can be planned, and changes are never made without the lock
ALWAYS = frozenset({"connect", "lock"})
# phases that need what another one makes: skipping the key skips them too (runner.effective_options)
SKIPPED_WITH = {"cluster-bootstrap": frozenset({"addons"})}
