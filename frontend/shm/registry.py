"""Shared-memory regions that clients register (system and CUDA), and resolving tensor references
into them.

The frontend only checks regions and hands out references into them (``ShmRef`` for a system
region, ``CudaRef`` for a CUDA one): the worker reads inputs from and writes outputs into the
client's memory directly. Nothing here ever unlinks a client's segment or frees a client's device
memory; unregistering only forgets it.

Who may do what (docs/security.md): a region is registered, listed, used in a request and
unregistered only by clients allowed to register regions (--client-shm-from: by default those on
this host), checked in every frontend on every use. Among them regions are global, as in Triton:
tritonclient registers through one client object and infers through another, and perf_analyzer
registers once and infers over several connections, so a region cannot be private to the
connection that registered it; a peer address would not tell two local users apart either. What
keeps one local user from another's memory is the registration: a system segment is accepted
only from the user who owns it (frontend/peer_uid.py finds the user behind a loopback TCP
client), and never one of the server's own segments.

A CUDA region is a device allocation the client exported as a CUDA IPC handle (64 bytes,
``cudaIpcMemHandle_t``). It is checked once, at registration, as Triton does: the handle is opened
on its GPU (ipc/gpu/device.py, cuda-python's driver API, imported and initialised on the first
registration only), the allocation's size is read, and the handle is closed again; workers open
it when a request uses it.
"""
from __future__ import annotations

import _posixshmem
import base64
import binascii
import ipaddress
import logging
import os
import stat
from typing import Any

from shmserve.frontend.peer_uid import socket_uid
from shmserve.frontend.shm.regions import CudaRegion, Region, RegionTable, SystemRegion
from shmserve.ipc.errors import InferError, invalid
from shmserve.ipc.messages.common import CudaRef, ErrorCode, ShmRef
from shmserve.ipc.shm import PREFIX

log = logging.getLogger("shmserve.frontend")

CUDA_NEEDS = "CUDA shared memory needs a GPU that CUDA can use and cuda-python on the server"
IPC_HANDLE_SIZE = 64                # sizeof(cudaIpcMemHandle_t)
_UINT64_MAX = 2 ** 64 - 1
_BAD_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"     # Triton's words

# keys Triton keeps for its python backend's own segments: a client may not register them
RESERVED_KEY_PREFIX = "triton_python_backend_shm_region_"


def _unsupported() -> InferError:
    return InferError(ErrorCode.UNSUPPORTED, "client shared memory is disabled on this server "
                                             "(start it with --allow-client-shm=true)")


def is_local_peer(peer: str) -> bool:
    """Whether a client address is on this host: loopback IPv4/IPv6 or a unix socket. Takes
    gRPC's form ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") and a bare host."""
    # the usual peers first, without parsing: a region's request asks for every one
    if peer.startswith(("unix:", "ipv4:127.", "127.", "ipv6:[::1]:", "::ffff:127.",
                        "ipv6:[::ffff:127.")) or peer in ("", "::1"):
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


def raw_handle_from_json(name: str, value) -> bytes:
    """The handle of an HTTP registration, ``{"b64": "<base64>"}`` (tritonclient sends
    cuda_shared_memory.get_raw_handle() there), as bytes; its length is checked on register."""
    if not isinstance(value, dict) or not isinstance(value.get("b64"), str):
        raise invalid(f"{_BAD_HANDLE} (region '{name}': 'raw_handle' must be an object "
                      f"{{\"b64\": \"<base64 of the {IPC_HANDLE_SIZE}-byte handle>\"}}, got "
                      f"{value!r:.80})")
    try:
        return base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"{_BAD_HANDLE} (region '{name}': 'raw_handle.b64' is not valid base64: "
                      f"{e})") from None


class ShmRegistry:
    def __init__(self, allowed: bool = True, local_only: bool = True,
                 table: RegionTable | None = None):
        self.allowed = allowed
        # a region gives its client read and write access to a segment through the server's
        # own permissions; only a client on this host can have put its tensors there anyway
        self.local_only = local_only
        # shared by the server's frontend processes (frontend/shm/regions.py)
        self.table = table if table is not None else RegionTable()

    @property
    def regions(self) -> dict[str, Region]:
        """Every region, system and CUDA (one namespace, as in Triton)."""
        return self.table.current()

    @property
    def system(self) -> dict[str, SystemRegion]:
        return {n: r for n, r in self.regions.items() if type(r) is SystemRegion}

    @property
    def cuda(self) -> dict[str, CudaRegion]:
        return {n: r for n, r in self.regions.items() if type(r) is CudaRegion}

    def _check_client(self, what: str, peer: str) -> None:
        """Refuse a client that may not register regions; ``peer`` "" is this process."""
        if not self.allowed:
            raise _unsupported()
        if self.local_only and not is_local_peer(peer):
            raise _not_local(what, peer)

    def for_peer(self, peer: str) -> ShmRegistry:
        """The registry a request from ``peer`` resolves its regions in: this one, or, for a
        client that may not register regions, one that refuses to name any."""
        if self.local_only and self.allowed and not is_local_peer(peer):
            return _Refused(self, peer)
        return self

    def _check_owner(self, name: str, key: str, owner: int, peer: str) -> None:
        """A client on this host registers only a segment its own user owns (root: any):
        otherwise it could read and write, through the server's permissions, a segment its
        user cannot open (another user's, or a program's of the server's user)."""
        if not peer or not is_local_peer(peer):
            return      # this process; or a remote client, which --client-shm-from=any trusts
        uid = socket_uid(peer)
        if uid is None:
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': "
                          f"cannot tell which user the client {peer} runs as, so cannot check "
                          f"that the segment is its own; connect over TCP on this host)")
        if uid != 0 and uid != owner:
            raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': the "
                          f"segment belongs to user {owner}, not to the client's user {uid}; "
                          f"register a segment your client created)")

    # ---- system shared memory ----------------------------------------------------------------
    def register_system(self, name: str, key, offset, byte_size, peer: str = "") -> SystemRegion:
        self._check_client(f"shared memory region '{name}'", peer)
        if not name:
            raise invalid("shared memory region name must not be empty")
        if not isinstance(key, str):
            raise invalid(f"shared memory region '{name}': 'key' must be a non-empty string")
        # Triton's key rules and words, checked before anything else as Triton checks them
        if not key.strip("/"):
            raise invalid(f"cannot register shared memory region '{name}' - invalid shm key "
                          f"'{key}'")
        if key.lstrip("/").startswith(RESERVED_KEY_PREFIX):
            raise invalid(f"cannot register shared memory region '{name}' with key '{key}' as the "
                          f"key contains the reserved prefix '{RESERVED_KEY_PREFIX}'")
        offset = _non_negative_int(offset, f"shared memory region '{name}': 'offset'")
        byte_size = _non_negative_int(byte_size, f"shared memory region '{name}': 'byte_size'")
        if name in self.regions:
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
        except FileNotFoundError:       # Triton's code for it too (its QA expects INTERNAL)
            raise InferError(ErrorCode.INTERNAL, f"Unable to open shared memory region: '{key}' "
                             f"(region '{name}': no segment with that key exists)") from None
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
        self._check_owner(name, key, st.st_uid, peer)
        size = st.st_size
        if offset + byte_size > size:
            raise invalid(f"failed to register shared memory region '{name}': invalid args "
                          f"(offset {offset} + byte_size {byte_size} exceeds the {size} bytes "
                          f"of segment '{key}')")
        return self._add(SystemRegion(name, key, offset, byte_size, segment))

    def unregister_system(self, name: str | None, peer: str = "") -> list[str]:
        """Forget one region (or all); returns the segments no longer referenced by any region."""
        self._check_client(_which(name), peer)
        return sorted(r.segment for r in self._unregister(SystemRegion, name))

    def _unregister(self, kind: type, name: str | None) -> list:
        """Forget the region ``name`` of this kind, or every region of this kind; returns the
        regions forgotten whose key (segment, or CUDA handle) no region still uses."""
        if name and type(self.regions.get(name)) is not kind:
            return []           # as Triton: unregistering an unknown region is not an error
        with self.table.change() as table:
            if name:
                region = table.get(name)
                regions = [region] if region is not None and type(region) is kind else []
            else:
                regions = [r for r in table.values() if type(r) is kind]
            # in flight through this frontend; another's requests hold their own mapping of
            # the client's memory, which stays valid (nothing here unlinks or frees it)
            busy = [r.name for r in regions if r.in_use]
            if busy:
                raise invalid(f"cannot unregister shared memory region(s) {busy} while "
                              f"requests that use them are in flight")
            for r in regions:
                del table[r.name]
            still = {_key(r) for r in table.values()}
        gone, seen = [], set()
        for r in regions:
            if _key(r) not in still and _key(r) not in seen:
                seen.add(_key(r))
                gone.append(r)
        return gone

    def _status(self, kind: type, name: str | None) -> list[Any]:
        if not name:
            return [r for r in self.regions.values() if type(r) is kind]
        region = self.regions.get(name)
        if type(region) is kind:
            return [region]
        if region is None:
            which = "system" if kind is SystemRegion else "cuda"
            raise InferError(ErrorCode.NOT_FOUND,
                             f"Unable to find {which} shared memory region: '{name}'")
        if kind is SystemRegion:
            raise InferError(ErrorCode.NOT_FOUND, f"The region named '{name}' is registered as "
                                                  f"CUDA shared memory, not system shared memory")
        raise InferError(ErrorCode.NOT_FOUND, f"The region named '{name}' is registered as "
                                              f"system shared memory, not CUDA shared memory")

    def status_system(self, name: str | None, peer: str = "") -> list[dict]:
        if self.allowed:        # disabled: nothing to show, and nothing to hide
            self._check_client(_which(name), peer)
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in self._status(SystemRegion, name)]

    # ---- CUDA shared memory ------------------------------------------------------------------
    def register_cuda(self, name: str, raw_handle, device_id, byte_size,
                      peer: str = "") -> CudaRegion:
        """``raw_handle``: the handle's bytes (gRPC), or HTTP's ``{"b64": ...}``; a field the
        HTTP request left out is None."""
        self._check_client(f"shared memory region '{name}'", peer)
        if not name:        # Triton's words first (its QA matches them)
            raise invalid("failed to register shared memory region '': invalid args ('region "
                          "name' is necessary to register cuda shared memory region)")
        if raw_handle is None:
            raise invalid(f"Shared memory register request has no 'raw_handle' field (region "
                          f"'{name}')")
        if not isinstance(raw_handle, (bytes, bytearray)):
            raw_handle = raw_handle_from_json(name, raw_handle)
        if len(raw_handle) != IPC_HANDLE_SIZE:      # Triton's gRPC words, its HTTP words, ours
            raise invalid(f"failed to register shared memory region '{name}': invalid args "
                          f"({_BAD_HANDLE}: 'raw_handle' has {len(raw_handle)} bytes, a CUDA IPC "
                          f"handle has {IPC_HANDLE_SIZE})")
        for field, value in (("byte_size", byte_size), ("device_id", device_id)):
            if value is None:
                raise invalid(f"Shared memory register request has no '{field}' field (region "
                              f"'{name}')")
        byte_size = _non_negative_int(byte_size, f"cuda shared memory region '{name}': "
                                                 f"'byte_size'")
        device_id = _non_negative_int(device_id, f"cuda shared memory region '{name}': "
                                                 f"'device_id'")
        # imported on first use (the frontend needs it for CUDA regions only); it imports
        # cuda-python and initialises the driver only when asked to count or open
        from shmserve.ipc.gpu import device as gpu
        count, why = gpu.driver_device_count()
        if count == 0:
            raise invalid(f"failed to register CUDA shared memory region: '{name}', GPUs not "
                          f"supported ({CUDA_NEEDS}: {why})")
        if device_id >= count:
            raise invalid(f"failed to register CUDA shared memory region '{name}': 'device_id' "
                          f"{device_id} is not a GPU of this server (it has {count} "
                          f"GPU{'' if count == 1 else 's'}: 0 to {count - 1})")
        if name in self.regions:
            raise InferError(ErrorCode.ALREADY_EXISTS,
                             f"shared memory region '{name}' already in manager")
        size = self._allocation_size(gpu, name, bytes(raw_handle), device_id)
        if byte_size > size:
            raise invalid(f"failed to register shared memory region '{name}': invalid args "
                          f"(byte_size {byte_size} exceeds the {size} bytes of the device "
                          f"allocation the handle exports)")
        return self._add(CudaRegion(name, bytes(raw_handle), device_id, byte_size))

    def _add(self, region):
        """Into the server's table, unless the name was registered meanwhile (through another
        frontend: the first check ran on this frontend's copy)."""
        with self.table.change() as table:
            if region.name in table:
                raise InferError(ErrorCode.ALREADY_EXISTS,
                                 f"shared memory region '{region.name}' already in manager")
            table[region.name] = region
        return region

    @staticmethod
    def _allocation_size(gpu, name: str, handle: bytes, device_id: int) -> int:
        """Open the handle on its GPU, read the size of the allocation it exports, close it."""
        try:
            c = gpu.cuda(device_id)
            base = c.open_ipc_handle(handle)
        except gpu.CudaError as e:
            raise invalid(f"failed to register shared memory region: invalid args (region "
                          f"'{name}': cannot open the CUDA IPC handle on GPU {device_id}: "
                          f"{e})") from None
        try:
            return c.address_range(base)[1]
        except gpu.CudaError as e:
            raise invalid(f"failed to register shared memory region '{name}': invalid args "
                          f"({e})") from None
        finally:
            try:
                c.close_ipc_handle(base)
            except gpu.CudaError as e:
                log.warning("closing the CUDA IPC handle of region '%s' failed: %s", name, e)

    def unregister_cuda(self, name: str | None, peer: str = "") -> list[bytes]:
        """Forget one CUDA region (or all); returns the handles no region uses any more (for
        the workers to close)."""
        self._check_client(_which(name), peer)
        return sorted(r.handle for r in self._unregister(CudaRegion, name))

    def status_cuda(self, name: str | None, peer: str = "") -> list[dict]:
        if self.allowed:
            self._check_client(_which(name), peer)
        return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                for r in self._status(CudaRegion, name)]

    # ---- tensors in regions ------------------------------------------------------------------
    def resolve(self, region_name, byte_size, offset, what: str) -> tuple[Region, ShmRef | CudaRef]:
        """The region a tensor names and the reference to its bytes: a ``ShmRef`` into a system
        region's segment, or a ``CudaRef`` into a CUDA region's allocation."""
        if not self.allowed:
            raise _unsupported()
        if not isinstance(region_name, str):
            raise invalid(f"{what}: shared_memory_region must be a string")
        region = self.regions.get(region_name)
        if region is None:
            # Triton's words and code (NOT_FOUND: 404 over HTTP), then which tensor named it
            raise InferError(ErrorCode.NOT_FOUND, f"Unable to find shared memory region: "
                                                  f"'{region_name}' ({what})")
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
        if isinstance(region, CudaRegion):
            return region, CudaRef(region.handle, region.device_id, offset, byte_size)
        return region, ShmRef(region.segment, region.offset + offset, byte_size)


class _Refused(ShmRegistry):
    """The registry of a request from a client that may not use regions: any region it names
    is refused, before anything about the region (its existence, its size) is told."""

    def __init__(self, registry: ShmRegistry, peer: str):
        super().__init__(registry.allowed, registry.local_only, registry.table)
        self.peer = peer

    def resolve(self, region_name, byte_size, offset, what: str) -> tuple[Region, ShmRef | CudaRef]:
        raise _not_local(f"{what}: shared memory region '{region_name}'", self.peer)


def _not_local(what: str, peer: str) -> InferError:
    return invalid(f"{what}: shared memory is accepted only from clients on this host "
                   f"(--client-shm-from=local); this request came from {peer}")


def _which(name: str | None) -> str:
    return f"shared memory region '{name}'" if name else "shared memory regions"


def _key(region: Region) -> str | bytes:
    """What workers know a region's memory by: its segment, or its CUDA IPC handle."""
    return region.segment if isinstance(region, SystemRegion) else region.handle
