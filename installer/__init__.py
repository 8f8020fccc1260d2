"""hiddenplane: Kubernetes the hard way, with a control plane that never registers as a node.

The library is a pure core (inventory, PKI, rendering) that needs no host; ``installer.cli``
is a thin click layer over it.
"""

__version__ = "0.1.0"
