"""Boundary messages between ranks of one host through shared memory instead of gloo's TCP.

Why: on CPU a gloo ``isend`` costs the sender 90-100 us of its own time per message (two ``writev``
calls on a TCP socket, then gloo's threads), which was most of what the executor spent above its
compute bound (``benchmarks/README.md``). Ranks on one host can hand a message over with one copy
into shared pages and a datagram of a few bytes.

How:

* Each message key (sender rank, receiver rank, boundary, channel, micro-batch, payload bytes) has
  a file in the run's shared directory (``GPIPE_SHM_DIR``: ``gpipe train`` and calibration make it
  under ``/dev/shm`` and remove it when the run ends, whatever happened), created and reserved
  (``posix_fallocate``: a full directory is an error at creation, never a SIGBUS later) by the
  sender at its first send and mapped by both ranks: a header holding the generation each of two
  payload slots was last consumed at, then the two slots. The key's n-th send uses slot n % 2, so a
  sender one step ahead of its receiver never overwrites what it has not copied; two steps ahead
  it waits.
* The receiver is woken by a datagram on its own Unix socket (Linux's abstract namespace: nothing
  on disk) naming the key and the generation; :meth:`HostLinks.recv` copies the slot into the
  buffers the stage announced (:meth:`executor.transport.Transport.expect`) and marks it consumed.
* Which peers: the ranks that gathered the same (host name, shared directory) at setup
  (:func:`host_links`, collective), for CPU tensors, where the host has a core for each of them;
  other hosts, CUDA, more ranks than cores (polling would take turns with compute: 6% slower than
  gloo on D = 2 x K = 2 over two cores) and workers started without the directory use
  ``torch.distributed`` as before. ``--transport dist`` forces that everywhere.

Limits: Linux only (abstract sockets); a receiver waits at most the run's timeout for a message and
then raises; a rank that dies is noticed by torchrun's agent, which ends the others.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

SHM_DIR_ENV = "GPIPE_SHM_DIR"
HEADER_BYTES = 64  # per slot, the generation last consumed and the one last written (int64), padded
SENDER_WAIT_S = 50e-6  # a sender two steps ahead of its receiver polls this often
SPIN_S = 0.05  # a receiver polls this long (yielding its core between polls) before it sleeps on its socket
SLEEP_CHECK_S = 1e-3  # a sleeping receiver looks at its slot at least this often (a doorbell may be lost)


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A fresh directory for a run's message files, under ``/dev/shm`` (memory) where there is one,
    removed when the block ends; launchers pass it to their ranks as :data:`SHM_DIR_ENV`."""
    import shutil
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="gpipe-shm-", dir=base)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


class _MessageFile:
    """One key's mapped file: per slot the generation last consumed and last written, then the slots.

    The header is read and written through a ``memoryview`` of int64 (a fraction of a microsecond a
    look), not through tensor indexing: a receiver looks at it once or more per message, and each
    tensor call there cost 5-10 us of a stage's time right after its compute (cold caches)."""

    def __init__(self, path: str, payload_bytes: int, create: bool) -> None:
        size = HEADER_BYTES + 2 * payload_bytes
        # the sender makes the file whole under another name, then renames it: a receiver looking for
        # it finds nothing or all of it
        fd = os.open(path + ".new" if create else path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(path + ".new")
                    raise RuntimeError(f"shared memory for a {payload_bytes}-byte message in {os.path.dirname(path)} "
                                       f"could not be reserved ({exc.strerror}); free space there or run with "
                                       "--transport dist") from None
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            os.rename(path + ".new", path)
        # [consumed of slot 0, of slot 1, written of slot 0, of slot 1]
        self.header = memoryview(self.map)[:32].cast("q")
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        self.slots = (whole[HEADER_BYTES:HEADER_BYTES + payload_bytes],
                      whole[HEADER_BYTES + payload_bytes:HEADER_BYTES + 2 * payload_bytes])

    def consumed(self, slot: int) -> int:
        return self.header[slot]

    def written(self, slot: int) -> int:
        return self.header[2 + slot]


def _copy_in(slot: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The tensors' bytes one after another into ``slot``."""
    offset = 0
    for tensor in tensors:
        part = _as_bytes(tensor)
        size = part.numel()
        (slot if offset == 0 and size == slot.numel() else slot[offset:offset + size]).copy_(part)
        offset += size


def _copy_out(slot: torch.Tensor, buffers: Sequence[torch.Tensor]) -> None:
    """``slot``'s bytes into ``buffers``, one after another."""
    offset = 0
    for buffer in buffers:
        part = buffer.view(-1).view(torch.uint8)
        size = part.numel()
        part.copy_(slot if offset == 0 and size == slot.numel() else slot[offset:offset + size])
        offset += size


class HostLinks:
    """This process's end of the shared-memory links to the ranks of its host.

    A waiting receiver polls its slot's written generation, yielding its core between polls, for up
    to :data:`SPIN_S`, then sleeps on its socket:
    waking a sleeping process costs its sender about 100 us here (Linux runs the woken process on the
    waker's core), which is what a gloo send paid on every message a waiting stage received."""

    def __init__(self, directory: str, rank: int, local_ranks: Sequence[int], timeout_s: float) -> None:
        self.directory = directory
        self.rank = rank
        self.local = frozenset(local_ranks) - {rank}
        self.timeout_s = timeout_s
        self.spin_s = SPIN_S
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self._address(rank))
        self.bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # rings the others' sockets, never waits
        self.bell.setblocking(False)
        self._maps: list[mmap.mmap] = []  # the flags' mappings, kept open
        self.sleeping = {rank: self._flag(rank, create=True)}  # rank -> its "asleep on its socket" flag
        self.files: dict[tuple, _MessageFile] = {}  # by (sender, receiver, boundary, channel, micro-batch, bytes)
        self.sent: dict[tuple, int] = {}  # key -> generations sent
        self.taken: dict[tuple, int] = {}  # key -> generations received

    def _address(self, rank: int) -> str:
        run, attempt = os.path.split(self.directory)
        return f"\0gpipe-{os.path.basename(run)}-{attempt}-{rank}"

    def _flag(self, rank: int, create: bool) -> memoryview:
        """``rank``'s flag (one int64 in a file of its own): 1 while it sleeps on its socket."""
        path = os.path.join(self.directory, f"sleeping-{rank}")
        if create:
            with open(path, "wb") as handle:
                handle.write(bytes(8))
        with open(path, "r+b") as handle:
            mapped = mmap.mmap(handle.fileno(), 8)
        self._maps.append(mapped)
        return memoryview(mapped).cast("q")

    def covers(self, peer: int) -> bool:
        return peer in self.local

    def _file(self, sender: int, receiver: int, boundary: int, channel: str, microbatch: int,
              payload_bytes: int, create: bool) -> _MessageFile | None:
        """The key's file, mapped at its first use: made by its sender (``create``); None when the
        receiver looks before the sender has made it."""
        key = (sender, receiver, boundary, channel, microbatch, payload_bytes)
        found = self.files.get(key)
        if found is None:
            name = "-".join(map(str, key))
            try:
                found = self.files[key] = _MessageFile(os.path.join(self.directory, name), payload_bytes, create)
            except FileNotFoundError:
                return None
        return found

    def send(self, receiver: int, boundary: int, channel: str, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into the key's next slot and mark it written; returns when copied."""
        payload = sum(t.nbytes for t in tensors)
        key = (receiver, boundary, channel, microbatch, payload)  # one file, one count of generations
        generation = self.sent.get(key, 0) + 1
        self.sent[key] = generation
        message = self._file(self.rank, receiver, boundary, channel, microbatch, payload, create=True)
        assert message is not None
        slot = generation % 2
        if generation > 2 and message.consumed(slot) < generation - 2:  # its last use not yet copied
            deadline = time.monotonic() + self.timeout_s
            while message.consumed(slot) < generation - 2:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank}: rank {receiver} did not take {channel} of micro-batch "
                                       f"{microbatch} within {self.timeout_s:.0f} s")
                time.sleep(SENDER_WAIT_S)
        _copy_in(message.slots[slot], tensors)
        message.header[2 + slot] = generation  # written: after the copy (x86 keeps stores in order)
        flag = self.sleeping.get(receiver)
        if flag is None:
            flag = self.sleeping[receiver] = self._flag(receiver, create=False)
        if flag[0]:  # the receiver sleeps on its socket: wake it
            try:
                self.bell.sendto(b"\1", self._address(receiver))
            except OSError:
                pass  # a full queue: it looks at its slot every SLEEP_CHECK_S anyway

    def _arrived(self, sender: int, boundary: int, channel: str, microbatch: int,
                 payload: int) -> tuple[_MessageFile, int] | None:
        """The key's file and slot when its next generation is written, else None."""
        message = self._file(sender, self.rank, boundary, channel, microbatch, payload, create=False)
        generation = self.taken.get((sender, boundary, channel, microbatch, payload), 0) + 1
        if message is None or message.written(generation % 2) != generation:
            return None
        return message, generation

    def ready(self, sender: int, boundary: int, channel: str, microbatch: int,
              buffers: Sequence[torch.Tensor]) -> bool:
        payload = sum(b.nbytes for b in buffers)
        return self._arrived(sender, boundary, channel, microbatch, payload) is not None

    def _sleep(self, left_s: float) -> None:
        """Sleep on the socket until a doorbell, at most ``left_s`` and :data:`SLEEP_CHECK_S`."""
        self.socket.settimeout(max(1e-6, min(left_s, SLEEP_CHECK_S)))
        try:
            self.socket.recv(64)
            self.socket.settimeout(0.0)
            while True:  # doorbells rung for messages taken already
                self.socket.recv(64)
        except (BlockingIOError, TimeoutError):
            pass

    def recv(self, sender: int, boundary: int, channel: str, microbatch: int,
             buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Wait for the key's next message and copy it into ``buffers``."""
        start = time.monotonic()
        payload = sum(b.nbytes for b in buffers)
        found = self._arrived(sender, boundary, channel, microbatch, payload)
        while found is None:
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise RuntimeError(f"rank {self.rank}: no {channel} of micro-batch {microbatch} from rank {sender} "
                                   f"within {self.timeout_s:.0f} s")
            if waited < self.spin_s:
                time.sleep(0)  # yield the core, then look again
                found = self._arrived(sender, boundary, channel, microbatch, payload)
                continue
            mine = self.sleeping[self.rank]
            mine[0] = 1  # from now on senders ring; look once more before sleeping
            found = self._arrived(sender, boundary, channel, microbatch, payload)
            if found is None:
                self._sleep(self.timeout_s - waited)
                found = self._arrived(sender, boundary, channel, microbatch, payload)
            mine[0] = 0
        message, generation = found
        slot = generation % 2
        _copy_out(message.slots[slot], buffers)
        message.header[slot] = generation  # consumed: the sender may write this slot again
        self.taken[(sender, boundary, channel, microbatch, payload)] = generation
        return list(buffers)


_LINKS: HostLinks | None | bool = None  # None: not set up yet; False: none in this process


def host_links(device: torch.device, transport: str, timeout_s: float) -> HostLinks | None:
    """This process's links to the ranks of its host, made at the first call. Collective: every
    rank makes its first call at the same point (the executor's stage construction does)."""
    global _LINKS
    if transport != "auto":
        return None
    if _LINKS is None:
        directory = os.environ.get(SHM_DIR_ENV)
        usable = device.type == "cpu" and directory and os.path.isdir(directory)
        if usable:  # a torchrun restart's ranks start afresh, apart from the files of the attempt before
            directory = os.path.join(str(directory), f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
            os.makedirs(directory, exist_ok=True)
        key = (socket.gethostname(), directory) if usable else None
        keys: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys, key)
        rank = dist.get_rank()
        local = [r for r, k in enumerate(keys) if key is not None and k == key]
        # more ranks than cores: gloo's blocking waits share the cores better than polling does
        fits = len(local) <= (os.cpu_count() or 1)
        _LINKS = HostLinks(str(directory), rank, local, timeout_s) if 1 < len(local) and fits else False
        dist.barrier()  # every socket bound before any message is sent
    return _LINKS or None
