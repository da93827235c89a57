"""Boundary messages between ranks of one host through shared memory instead of gloo's TCP.

Why: on CPU a gloo ``isend`` costs the sender 90-100 us of its own time per message (two ``writev``
calls on a TCP socket, then gloo's threads), which was most of what the executor spent above its
compute bound (``benchmarks/README.md``). Ranks on one host can hand a message over with one copy
into shared pages and a datagram of a few bytes.

How:

* Each message key (sender rank, receiver rank, boundary, channel, micro-batch, each tensor's bytes) has
  a file in the run's shared directory (``GPIPE_SHM_DIR``: ``gpipe train`` and calibration make it
  under ``/dev/shm`` and remove it when the run ends, whatever happened; what a launcher killed
  before its cleanup leaves, the next launch removes: :func:`shared_directory`), created and reserved
  (``posix_fallocate``: a full directory is an error at creation, never a SIGBUS later) by the
  sender at its first send and mapped by both ranks: a header holding the generation each of two
  payload slots was last consumed at, then the two slots. The key's n-th send uses slot n % 2, so a
  sender one step ahead of its receiver never overwrites what it still uses; two steps ahead it
  waits (a pipeline's sender is never that far ahead: see :meth:`HostLinks.take`).
* A receiver that sleeps is woken by a datagram on its own Unix socket (Linux's abstract
  namespace: nothing on disk); :meth:`HostLinks.take` returns the slot's tensors where they lie
  (no copy: the receiving stage computes on the shared pages) and :meth:`HostLinks.release`, at
  the end of the receiver's step, marks them consumed. Copying each message out cost the receiver
  20-40 us of a 256 KiB message on the critical path, once per hop.
* Which peers: the ranks that gathered the same (host name, shared directory) at setup
  (:func:`host_links`, collective), for CPU tensors, where the host has a core for each of them;
  other hosts, CUDA, more ranks than cores (polling would take turns with compute: 6% slower than
  gloo on D = 2 x K = 2 over two cores) and workers started without the directory use
  ``torch.distributed``. ``--transport dist`` forces that everywhere. A stage's transport to such a
  neighbour is :class:`executor.transport.shm_p2p.SharedMemoryTransport`, chosen once at set-up
  (:mod:`executor.transport.stage_transport`).

Limits: Linux only (abstract sockets); a receiver waits at most the run's timeout for a message and
then raises; a rank that dies is noticed by torchrun's agent, which ends the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import mmap
import os
import socket
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

SHM_DIR_ENV = "GPIPE_SHM_DIR"
HEADER_BYTES = 64  # per slot, the generation last consumed and the one last written (int64), padded
SENDER_WAIT_S = 50e-6  # a sender two steps ahead of its receiver polls this often
SPIN_S = 0.05  # a receiver polls this long (yielding its core between polls) before it sleeps on its socket
SLEEP_CHECK_S = 1e-3  # a sleeping receiver looks at its slot at least this often (a doorbell may be lost)


@contextlib.contextmanager
def shared_directory(base: str | None = None) -> Iterator[str]:
    """A fresh directory for a run's message files, under ``/dev/shm`` (memory) where there is one,
    removed when the block ends; launchers pass it to their ranks as :data:`SHM_DIR_ENV`.

    Named after the launcher's host and process id, so a later launch on the host can remove what a
    launcher killed before its cleanup (SIGKILL, or SIGTERM, which Python does not turn into an
    exception) left behind: message files are memory, and they would hold it until the machine
    restarts."""
    import shutil
    import tempfile

    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    remove_orphans(base)
    directory = tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{_host()}-{os.getpid()}-", dir=base)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


SHM_PREFIX = "gpipe-shm-"


def _host() -> str:
    """This host's name as a directory name may carry it."""
    import re

    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def remove_orphans(base: str) -> list[str]:
    """Remove the shared directories under ``base`` made on this host by a launcher that is no
    longer running; the ones removed. A directory of a live process, of another user's, of another
    host's (containers that share ``/dev/shm`` see each other's directories but not each other's
    processes; their host names differ) is left alone; so is one named before directories carried
    their launcher's id. Limits: two process namespaces with one host name and one ``/dev/shm``
    would take each other's directories for orphans."""
    import re
    import shutil

    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = re.fullmatch(rf"{SHM_PREFIX}{_host()}-(\d+)-\w+", name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
        except (PermissionError, OverflowError):
            pass  # alive under another user, or no process id at all
    return removed


ALIGN_BYTES = 64  # each tensor of a message starts on a cache line (and on its dtype's alignment)

Layout = Sequence[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor of a message


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def message_sizes(layout: Layout) -> tuple[int, ...]:
    """Each tensor's bytes: with the key, what names a message's file (a message of other sizes under
    the same key is another file, never taken for this one)."""
    return tuple(math.prod(shape) * dtype.itemsize for shape, dtype in layout)


def map_file(path: str, size: int, create: bool, what: str) -> mmap.mmap:
    """``path`` mapped (``size`` bytes). ``create``: made whole under another name (``posix_fallocate``:
    a full directory is an error here, never a SIGBUS later), then renamed, so a rank looking for it
    finds nothing or all of it; otherwise opened (FileNotFoundError until it is made)."""
    fd = os.open(path + ".new" if create else path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path + ".new")
                raise RuntimeError(f"shared memory for {what} in {os.path.dirname(path)} could not be reserved "
                                   f"({exc.strerror}); free space there or run with --transport dist") from None
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if create:
        os.rename(path + ".new", path)
    return mapped


class _MessageFile:
    """One key's mapped file: a header (per slot the generation last consumed and last written), then
    two slots, each holding a message's tensors one after another at aligned offsets.

    The header is read and written through a ``memoryview`` of int64 (a fraction of a microsecond a
    look), not through tensor indexing: a receiver looks at it once or more per message, and each
    tensor call there cost 5-10 us of a stage's time right after its compute (cold caches)."""

    def __init__(self, path: str, sizes: tuple[int, ...], create: bool) -> None:
        payload_bytes = sum(_padded(n) for n in sizes)  # each tensor's bytes padded to ALIGN_BYTES
        self.map = map_file(path, HEADER_BYTES + 2 * payload_bytes, create, f"a {payload_bytes}-byte message")
        self.payload_bytes = payload_bytes
        # [consumed of slot 0, of slot 1, written of slot 0, of slot 1]
        self.header = memoryview(self.map)[:32].cast("q")

    def consumed(self, slot: int) -> int:
        return self.header[slot]

    def written(self, slot: int) -> int:
        return self.header[2 + slot]

    def tensors(self, slot: int, layout: Layout) -> list[torch.Tensor]:
        """The slot's tensors as ``layout`` places them, each a storage of its own over the mapped
        pages (so the activation counter charges a received tensor its own bytes); a :class:`Link`
        makes them once and keeps them."""
        views, offset = [], HEADER_BYTES + slot * self.payload_bytes
        for shape, dtype in layout:
            count = math.prod(shape)
            flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset) if count else \
                torch.empty(0, dtype=dtype)
            views.append(flat.view(shape))
            offset += _padded(count * dtype.itemsize)
        return views


class Link:
    """One message key seen from one end: its file, the generations this end has sent or taken, and
    where each tensor of its layout lies in each slot, all found once.

    The executor sends and receives the same keys every step; looking each up afresh (key tuples,
    sizes, dictionaries) cost a stage tens of microseconds per message right after its compute, when
    the caches hold the compute's matrices and every Python object touched is a miss."""

    def __init__(self, links: "HostLinks", sender: int, receiver: int, boundary: int, channel: str,
                 microbatch: int, layout: Layout) -> None:
        self.links = links
        self.sender, self.receiver, self.boundary, self.channel, self.microbatch = \
            sender, receiver, boundary, channel, microbatch
        self.layout = tuple((tuple(shape), dtype) for shape, dtype in layout)
        self.sizes = message_sizes(self.layout)
        self.generation = 0  # sent (the sender's end) or taken (the receiver's end)
        self.file: _MessageFile | None = None  # mapped at the first use; made by the sender
        self._slots: list[list[torch.Tensor]] = []  # per slot, the layout's tensors over the mapped pages
        self._addresses: list[list[int]] = []  # per slot, where each of them starts
        # a plain byte copy is exact for every dtype but complex ones (a conjugate view's bits are not its value)
        self._bytes_copy = not any(dtype.is_complex for _, dtype in self.layout)

    def _mapped(self, create: bool) -> _MessageFile | None:
        if self.file is None:
            self.file = self.links._file(self.sender, self.receiver, self.boundary, self.channel, self.microbatch,
                                         self.sizes, create)
            if self.file is not None:
                self._slots = [self.file.tensors(slot, self.layout) for slot in (0, 1)]
                self._addresses = [[t.data_ptr() for t in tensors] for tensors in self._slots]
        return self.file

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are of this link's layout (shapes and dtypes)."""
        if len(tensors) != len(self.layout):
            return False
        for tensor, (shape, dtype) in zip(tensors, self.layout):
            if tensor.dtype != dtype or tensor.shape != shape:
                return False
        return True

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (of :meth:`fits` this layout) into the next slot and mark it written."""
        message = self.file if self.file is not None else self._mapped(create=True)
        assert message is not None
        generation = self.generation + 1
        slot = generation % 2
        if generation > 2 and message.consumed(slot) < generation - 2:  # its last use not yet released
            self._wait_released(message, slot, generation - 2)
        addresses = self._addresses[slot]
        for index, tensor in enumerate(tensors):
            nbytes = self.sizes[index]
            # a contiguous plain tensor is copied as bytes (ctypes.memmove): a torch copy costs a
            # dispatch of 30-40 us on the caches a stage's compute has just filled, the bytes alone
            # about 20 us for 64 KiB
            if self._bytes_copy and type(tensor) is torch.Tensor and tensor.is_contiguous():
                if nbytes:
                    ctypes.memmove(addresses[index], tensor.data_ptr(), nbytes)
            else:
                with torch.no_grad():
                    self._slots[slot][index].copy_(tensor)
        message.header[2 + slot] = generation  # written: after the copy (x86 keeps stores in order)
        self.generation = generation
        self.links.ring(self.receiver)

    def _wait_released(self, message: _MessageFile, slot: int, generation: int) -> None:
        deadline = time.monotonic() + self.links.timeout_s
        while message.consumed(slot) < generation:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.sender}: rank {self.receiver} did not take {self.channel} of "
                                   f"micro-batch {self.microbatch} within {self.links.timeout_s:.0f} s")
            time.sleep(SENDER_WAIT_S)

    def arrived(self) -> bool:
        """Whether the next generation is written (the receiver's end)."""
        message = self.file if self.file is not None else self._mapped(create=False)
        generation = self.generation + 1
        return message is not None and message.written(generation % 2) == generation

    def take(self) -> list[torch.Tensor]:
        """Wait for the next generation; its tensors where they lie (see :meth:`HostLinks.take`)."""
        if not self.arrived():
            self.links._wait(self)
        self.generation += 1
        slot = self.generation % 2
        self.links._held.append((self.file, slot, self.generation))  # type: ignore[arg-type]
        return list(self._slots[slot])


class HostLinks:
    """This process's end of the shared-memory links to the ranks of its host.

    A waiting receiver polls its slot's written generation, yielding its core between polls
    (``os.sched_yield``: about 1 us here; ``time.sleep(0)`` sleeps out the kernel's timer slack, 85 us,
    which put a message 40 us late on average), for up to :data:`SPIN_S`, then sleeps on its socket:
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
        self._links: dict[tuple, Link] = {}  # by (sender, receiver, boundary, channel, micro-batch, bytes)
        self._held: list[tuple[_MessageFile, int, int]] = []  # taken, not released: (file, slot, generation)
        self.sums_made = itertools.count()  # numbers the gradient sums' files (executor.transport.shm_allreduce)

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
              sizes: tuple[int, ...], create: bool) -> _MessageFile | None:
        """The key's file, mapped at its first use: made by its sender (``create``); None when the
        receiver looks before the sender has made it."""
        key = (sender, receiver, boundary, channel, microbatch, sizes)
        found = self.files.get(key)
        if found is None:
            name = "-".join(map(str, key[:-1])) + "-" + "x".join(map(str, sizes))
            try:
                found = self.files[key] = _MessageFile(os.path.join(self.directory, name), sizes, create)
            except FileNotFoundError:
                return None
        return found

    def link(self, sender: int, receiver: int, boundary: int, channel: str, microbatch: int,
             layout: Layout) -> Link:
        """The :class:`Link` of a key at this end (one of ``sender``, ``receiver`` is this rank), made
        once; callers that send or receive a key every step keep it."""
        key = (sender, receiver, boundary, channel, microbatch, message_sizes(layout))
        found = self._links.get(key)
        if found is None:
            found = self._links[key] = Link(self, sender, receiver, boundary, channel, microbatch, layout)
        return found

    def ring(self, receiver: int) -> None:
        """Wake ``receiver`` if it sleeps on its socket (in :meth:`wait_until`)."""
        flag = self.sleeping.get(receiver)
        if flag is None:
            flag = self.sleeping[receiver] = self._flag(receiver, create=False)
        if flag[0]:  # the receiver sleeps on its socket: wake it
            try:
                self.bell.sendto(b"\1", self._address(receiver))
            except OSError:
                pass  # a full queue: it looks at its slot every SLEEP_CHECK_S anyway

    def send(self, receiver: int, boundary: int, channel: str, microbatch: int,
             tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into the key's next slot and mark it written; returns when copied."""
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        self.link(self.rank, receiver, boundary, channel, microbatch, layout).send(tensors)

    def ready(self, sender: int, boundary: int, channel: str, microbatch: int, sizes: tuple[int, ...]) -> bool:
        """Whether the key's next message (of tensors of ``sizes`` bytes, :func:`message_sizes`) has arrived."""
        found = self._links.get((sender, self.rank, boundary, channel, microbatch, sizes))
        if found is not None:
            return found.arrived()
        # no link yet: nothing was taken under this key, so the next message is generation 1, in slot 1
        message = self._file(sender, self.rank, boundary, channel, microbatch, sizes, create=False)
        return message is not None and message.written(1) == 1

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

    def _wait(self, link: Link) -> None:
        """Until ``link``'s next generation arrives."""
        self.wait_until(link.arrived, lambda: f"no {link.channel} of micro-batch {link.microbatch} from rank "
                                              f"{link.sender}")

    def wait_until(self, done: Callable[[], bool], missing: Callable[[], str]) -> None:
        """Until ``done()``: poll, yielding the core, then sleep on the socket until a peer rings
        (:meth:`ring`); after the run's timeout, raise with ``missing()`` saying what never came."""
        start = time.monotonic()
        while not done():
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise RuntimeError(f"rank {self.rank}: {missing()} within {self.timeout_s:.0f} s")
            if waited < self.spin_s:
                os.sched_yield()  # let any other thread on this core run, then look again
                continue
            mine = self.sleeping[self.rank]
            mine[0] = 1  # from now on peers ring; look once more before sleeping
            if not done():
                self._sleep(self.timeout_s - waited)
            mine[0] = 0

    def take(self, sender: int, boundary: int, channel: str, microbatch: int, layout: Layout) -> list[torch.Tensor]:
        """Wait for the key's next message and return its tensors where they lie, in the shared
        pages: no copy. They stay this rank's until :meth:`release` (the executor releases at the
        end of each step, when its stage holds none of them); until then the sender does not write
        that slot again, and it only needs to two steps later, so a step never waits for it."""
        return self.link(sender, self.rank, boundary, channel, microbatch, layout).take()

    def release(self) -> None:
        """Every message taken so far is no longer used: its slot may be written again."""
        for message, slot, generation in self._held:
            message.header[slot] = generation  # consumed
        self._held.clear()


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
