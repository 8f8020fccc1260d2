"""Certificates: check expiry, renew the leaves, rotate the CAs."""

from installer.actions.certs import check
from installer.actions.renew import renew
from installer.actions.rotate import rotate_ca

__all__ = ["check", "renew", "rotate_ca"]
