"""Shared-memory regions that clients register (system and CUDA), and resolving tensor references
into them.

The frontend only checks regions and hands out ``ShmRef``s into them: the worker reads inputs from
and writes outputs into the client's memory directly. Nothing here ever unlinks a client's
segment; unregistering only forgets it.
"""
from __future__ import annotations

import _posixshmem
import ipaddress
import os
import stat

from shmserve.ipc.messages import ErrorCode, ShmRef
from shmserve.ipc.shm import PREFIX

from .errors import InferError, invalid
from .shm_regions import RegionTable, SystemRegion

CUDA_UNSUPPORTED = "CUDA shared memory is not supported on this server"
_UINT64_MAX = 2 ** 64 - 1


def _unsupported() -> InferError:
    return InferError(ErrorCode.UNSUPPORTED, "client shared memory is disabled on this server "
                                             "(start it with --allow-client-shm=true)")


def is_local_peer(peer: str) -> bool:
    """Whether a client address is on this host: loopback IPv4/IPv6 or a unix socket. Takes
    gRPC's form ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") and a bare host."""
    if peer.startswith("unix:") or peer == "":
        return True
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    host = host.removeprefix("::ffff:")     # an IPv4 peer on a dual-stack socket
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _non_negative_int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(f"{what} must be a non-negative integer, got {value!r}")
    return value


class ShmRegistry:
    def __init__(self, allowed: bool = True, local_only: bool = True,
                 table: RegionTable | None = None):
        self.allowed = allowed
        # a region gives its client read and write access to a segment through the server's
        # own permissions; only a client on this host can have put its tensors there anyway
        self.local_only = local_only
        # shared by the server's frontend processes (frontend/shm_regions.py)
        self.table = table if table is not None else RegionTable()

    @property
    def system(self) -> dict[str, SystemRegion]:
        return self.table.current()

    # ---- system shared memory ----------------------------------------------------------------
    def register_system(self, name: str, key, offset, byte_size, peer: str = "") -> SystemRegion:
        if not self.allowed:
            raise _unsupported()
        if self.local_only and not is_local_peer(peer):
            raise invalid(f"shared memory region '{name}': registration is accepted only from "
                          f"clients on this host (--client-shm-from=local); this request came "
                          f"from {peer}")
        if not name:
            raise invalid("shared memory region name must not be empty")
        if not isinstance(key, str) or not key.strip("/"):
            raise invalid(f"shared memory region '{name}': 'key' must be a non-empty string")
        offset = _non_negative_int(offset, f"shared memory region '{name}': 'offset'")
        byte_size = _non_negative_int(byte_size, f"shared memory region '{name}': 'byte_size'")
        if name in self.system:
            raise InferError(ErrorCode.ALREADY_EXISTS,
                             f"shared memory region '{name}' already in manager")
        segment = key[1:] if key.startswith("/") else key
        if "/" in segment or "\0" in segment or segment in (".", ".."):
            raise invalid(f"shared memory key '{key}' is not a valid POSIX shared memory name")
        if segment.startswith(PREFIX):
            raise invalid(f"shared memory key '{key}' names one of the server's own segments; "
                          f"register a segment your client created")
        try:
            fd = _posixshmem.shm_open("/" + segment, os.O_RDWR, 0)
        except FileNotFoundError:
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': no "
                          f"segment with that key exists)") from None
        except PermissionError:
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': "
                          f"permission denied)") from None
        except OSError as e:        # a directory, a symlink (shm_open refuses to follow), ...
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': not "
                          f"a shared memory segment: {e.strerror})") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': not "
                          f"a shared memory segment)")
        size = st.st_size
        if offset + byte_size > size:
            raise invalid(f"failed to register shared memory region '{name}': invalid args "
                          f"(offset {offset} + byte_size {byte_size} exceeds the {size} bytes "
                          f"of segment '{key}')")
        region = SystemRegion(name, key, offset, byte_size, segment)
        with self.table.change() as table:
            if name in table:       # registered meanwhile, through another frontend
                raise InferError(ErrorCode.ALREADY_EXISTS,
                                 f"shared memory region '{name}' already in manager")
            table[name] = region
        return region

    def unregister_system(self, name: str | None) -> list[str]:
        """Forget one region (or all); returns the segments no longer referenced by any region."""
        if not self.allowed:
            raise _unsupported()
        if name and name not in self.system:
            return []           # as Triton: unregistering an unknown region is not an error
        with self.table.change() as table:
            if name:
                region = table.get(name)
                regions = [region] if region is not None else []
            else:
                regions = list(table.values())
            # in flight through this frontend; another's requests hold their own mapping of
            # the client's segment, which stays valid (nothing here unlinks it)
            busy = [r.name for r in regions if r.in_use]
            if busy:
                raise invalid(f"cannot unregister shared memory region(s) {busy} while "
                              f"requests that use them are in flight")
            for r in regions:
                del table[r.name]
            still = {r.segment for r in table.values()}
        return sorted({r.segment for r in regions} - still)

    def status_system(self, name: str | None) -> list[dict]:
        if name:
            region = self.system.get(name)
            if region is None:
                raise InferError(ErrorCode.NOT_FOUND,
                                 f"Unable to find system shared memory region: '{name}'")
            regions = [region]
        else:
            regions = self.system.values()
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in regions]

    # ---- CUDA shared memory ------------------------------------------------------------------
    def register_cuda(self, name: str, raw_handle, device_id, byte_size) -> None:
        if not self.allowed:
            raise _unsupported()
        raise invalid(CUDA_UNSUPPORTED)

    def unregister_cuda(self, name: str | None) -> list[str]:
        if not self.allowed:
            raise _unsupported()
        return []

    def status_cuda(self, name: str | None) -> list[dict]:
        if name:
            raise InferError(ErrorCode.NOT_FOUND,
                             f"Unable to find cuda shared memory region: '{name}'")
        return []

    # ---- tensors in regions ------------------------------------------------------------------
    def resolve(self, region_name, byte_size, offset, what: str) -> tuple[SystemRegion, ShmRef]:
        if not self.allowed:
            raise _unsupported()
        if not isinstance(region_name, str):
            raise invalid(f"{what}: shared_memory_region must be a string")
        region = self.system.get(region_name)
        if region is None:
            raise invalid(f"{what}: Unable to find shared memory region: '{region_name}'")
        if byte_size is None:
            raise invalid(f"{what}: shared_memory_byte_size must be given with "
                          f"shared_memory_region")
        byte_size = _non_negative_int(byte_size, f"{what}: shared_memory_byte_size")
        offset = _non_negative_int(offset or 0, f"{what}: shared_memory_offset")
        # Triton's texts (its QA greps them), then the numbers
        if offset >= region.byte_size:
            raise invalid(f"{what}: Invalid offset for shared memory region: '{region_name}' "
                          f"(shared_memory_offset {offset}, the region has {region.byte_size} "
                          f"bytes)")
        if offset + byte_size > _UINT64_MAX:
            raise invalid(f"{what}: Integer overflow detected: byte_size ({byte_size}) + offset "
                          f"({offset}) exceeds maximum value ({_UINT64_MAX}) for region "
                          f"'{region_name}'")
        if offset + byte_size > region.byte_size:
            raise invalid(f"{what}: Invalid offset + byte size for shared memory region: "
                          f"'{region_name}' (shared_memory_offset {offset} + "
                          f"shared_memory_byte_size {byte_size} exceeds the {region.byte_size} "
                          f"bytes of the region)")
        return region, ShmRef(region.segment, region.offset + offset, byte_size)
