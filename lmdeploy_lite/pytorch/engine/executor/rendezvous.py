"""Where the ranks of one host meet without a network listener: torch.distributed's store is a
file (FileStore) in a private temporary directory, not a TCP store (which listens on every
interface, unauthenticated), and the collectives' own TCP links (gloo's pairs, the bootstrap of
NCCL and NVSHMEM) are pinned to the loopback interface unless the user named one. Multi-node
launches (ray) keep TCP on the address the user gives."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile

SOCKET_IFNAME_VARS = ('GLOO_SOCKET_IFNAME', 'NCCL_SOCKET_IFNAME',
                      'NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME')


def loopback_env() -> dict[str, str]:
    """The loopback interface ('lo' on Linux, 'lo0' on macOS) for each socket-interface variable
    the user has not set."""
    names = [name for _, name in socket.if_nameindex()]
    lo = next((n for n in ('lo', 'lo0') if n in names), None)
    if lo is None:
        return {}
    return {name: lo for name in SOCKET_IFNAME_VARS if name not in os.environ}


class FileRendezvous:
    """A file:// `init_method` in a directory only this user can read; `close()` removes it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix='lmdeploy_lite_rendezvous_')    # mode 0700
        self.init_method = 'file://' + os.path.join(self.dir, 'store')

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)
