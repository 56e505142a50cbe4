"""A regional worker's entity states on local disk (issue 36): one RocksDB per
changelog partition, holding the changelog's own records and the changelog offset
they reflect.

What a partition's database holds (rocksdict, the RocksDB binding Faust and Quix
Streams use; keys are the changelog's keys as bytes):

- the changelog records of pipeline.statestore (entity records, row chunks,
  checkpoint and fence records), values as the changelog holds them (orjson:
  the serialized size, not Python objects);
- ``\\x00offset``: the changelog offset of the last record it reflects (Kafka
  Streams' checkpoint file), written in the same write batch as the records;
- ``\\x00epoch``: the highest owner epoch read on the partition, so that a
  recovery that reads only the changelog's tail still fences a late previous
  owner (pipeline.statestore, "Owner epochs");
- ``\\x00versions``: the feature-set versions the renewal index was built for;
- the renewal index: ``\\x1e`` + when the entity's vector must be written again
  (8 bytes, big-endian microseconds; 0: now) + its key -> empty. Kept in the
  same batches from each entity record, so that the worker finds what is due by
  a range read instead of holding a schedule per entity in memory.

Records enter a database only once the broker has them: a checkpoint's records
after their acknowledgement (with the offset the broker gave the last one), a
recovery's from the changelog it reads. A worker restarted on the same folder
reads only the changelog's tail after the saved offset, however long the
history; a folder that lacks a partition (a new host, a deleted folder) reads
that partition's changelog whole, and says so.

A worker takes a folder of its own under ``pipeline.state_dir`` (``w0``,
``w1``, ...: the first whose lock file it can lock), so that several workers of
a region share a host, and a restarted one takes a free folder again, most
often its own. Any folder is correct for any worker: each partition's database
is consistent with its saved offset, and the changelog brings it up to date.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import struct
from collections.abc import (
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from pathlib import Path
from typing import Any, Protocol

import orjson

from pipeline.exceptions import StateStoreError
from pipeline.features import EntityState
from pipeline.statestore import ROW_SEP, state_from_tables

__all__ = [
    "ChangelogWriter",
    "LocalStates",
    "PartitionStore",
    "RenewalOf",
    "StateStoreError",
    "renewal_key",
]

log = logging.getLogger("edgefeed.pipeline")

META_OFFSET = b"\x00offset"
META_EPOCH = b"\x00epoch"
META_VERSIONS = b"\x00versions"
META_LAST = b"\x00last"  # what the record at the saved offset is (see record_mark)
RENEW = b"\x1e"
_SEP = ROW_SEP.encode()
_AFTER_SEP = bytes([_SEP[0] + 1])
_NOT_ENTITY = (0x00, 0x1E, 0x1F)  # first bytes of keys that are not an entity's
_UNTIL = struct.Struct(">Q")

# Entity key, its record -> when its vector must be written again (microseconds
# since the epoch; 0: at once), None: never (no schedule runs out).
RenewalOf = Callable[[str, Mapping[str, Any]], int | None]
# Partition, offset -> the changelog record there as (key, value), None: none there.
LastRecordFetch = Callable[[int, int], Awaitable[tuple[bytes | None, bytes | None] | None]]


def record_mark(key: bytes | None, value: bytes | None) -> bytes:
    """What identifies a changelog record: a digest of its key and value. The store
    keeps the mark of the record at its saved offset, so that a changelog that is
    no longer the one it reflects (a broker that lost its topics) is recognised."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(key or b"")
    digest.update(b"\x00" if value is None else b"\x01" + value)
    return digest.digest()


def renewal_key(until: int, key: str) -> bytes:
    return RENEW + _UNTIL.pack(max(0, until)) + key.encode()


def _is_entity_key(key: bytes) -> bool:
    return bool(key) and key[0] not in _NOT_ENTITY and _SEP not in key


def _options(cache: Any, memtables: Any) -> Any:
    import rocksdict

    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_compression_type(rocksdict.DBCompressionType.lz4())
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(cache)
    # The index of every table file lives in the block cache, so the store's memory
    # is the cache's size whatever the number of entities: left outside it (RocksDB's
    # default), a table's index stays in memory while the file is open, ~2.5% of the
    # store on disk (713 MB for a worker of a 10M-user region against 274 at 10k).
    # Partitioned (two-level): a lookup reads one small index partition instead of
    # a file's whole index, and only the top level (a few KB per file) is pinned.
    # Files written before this keep their one-level index; RocksDB reads both.
    table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_top_level_index_and_filter(True)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(8 << 20)
    options.set_max_write_buffer_number(2)
    # One budget for the memtables of all the worker's partitions (a database's own
    # limit, 2 x 8 MB, would grow with the partitions a worker holds): past it
    # RocksDB flushes the largest, without stalling writes.
    options.set_write_buffer_manager(memtables)
    return options


def memtable_bytes(cache_mb: int) -> int:
    """The memtables' budget, shared by a worker's partitions: half the block cache's
    size, at least 16 MB (two of a partition's 8 MB memtables)."""
    return max(16, cache_mb // 2) << 20


class PartitionStore:
    """The database of one changelog partition."""

    def __init__(self, path: Path, partition: int, options: Any, renewal_of: RenewalOf) -> None:
        import rocksdict

        self.path, self.partition = path, partition
        self.renewal_of = renewal_of
        try:
            self._handle = rocksdict.Rdict(str(path), options)
        except Exception as exc:
            raise StateStoreError(
                f"cannot open the local state store {path}: {exc}; check the folder "
                "(pipeline.state_dir) is writable and not held by another process"
            ) from exc
        self._options = options
        self._failed = False
        raw = self.db.get(META_EPOCH)
        self.top = int(raw) if raw is not None else 0
        self.created = self.db.get(META_OFFSET) is None

    # -- reading -----------------------------------------------------------------------------

    def offset(self) -> int | None:
        """The changelog offset of the last record this database reflects."""
        raw = self.db.get(META_OFFSET)
        return int(raw) if raw is not None else None

    def load(self, key: str) -> EntityState | None:
        """The entity's working state (its record and its row chunks): one range read,
        since the record's key sorts right before its chunks' (``key<US>...``)."""
        import rocksdict

        raw_key = key.encode()
        bound = rocksdict.ReadOptions()
        bound.set_iterate_upper_bound(raw_key + _AFTER_SEP)  # "key\x20" > "key\x1f..."
        record: Any = None
        chunks: dict[bytes, list[bytes]] = {}  # table -> its chunk records, in key order
        size = len(raw_key)
        for stored_key, value in self.db.items(from_key=raw_key, read_opt=bound):
            if len(stored_key) == size:
                record = orjson.loads(value)
                continue
            if stored_key[size] != _SEP[0]:  # another entity: "key\n..." sorts here too
                continue
            end = stored_key.find(_SEP, size + 1)  # key<US>table<US>chunk
            name = stored_key[size + 1 : end if end >= 0 else None]
            found = chunks.get(name)
            if found is None:
                chunks[name] = [value]
            else:
                found.append(value)
        # A table's chunks decoded in one call, as one JSON array (most of an
        # entity's read is its chunks: one per 10 s of event time that holds a row).
        tables: dict[str, dict[str, list[Any]]] = {}
        for name, values in chunks.items():
            if len(values) == 1:
                tables[name.decode()] = orjson.loads(values[0])
                continue
            rows: dict[str, list[Any]] = {}
            for chunk in orjson.loads(b"[" + b",".join(values) + b"]"):
                rows.update(chunk)
            tables[name.decode()] = rows
        return state_from_tables(record, tables)

    def entity_keys(self) -> Iterator[str]:
        """Every entity key in the database, in key order."""
        it = self.db.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            if _is_entity_key(key):
                yield key.decode()
            it.next()

    def due(self, after: bytes | None, now_us: int, limit: int) -> list[tuple[int, str, bytes]]:
        """Up to ``limit`` renewal entries due by ``now_us``, after the index key
        ``after`` (None: from the first): ``(until, entity key, index key)``."""
        found: list[tuple[int, str, bytes]] = []
        it = self.db.iter()
        it.seek(after if after is not None else RENEW)
        if after is not None and it.valid() and it.key() == after:
            it.next()
        while it.valid() and len(found) < limit:
            index_key = it.key()
            if not index_key.startswith(RENEW):
                break
            (until,) = _UNTIL.unpack_from(index_key, 1)
            if until > now_us:
                break
            found.append((until, index_key[9:].decode(), index_key))
            it.next()
        return found

    # -- writing -----------------------------------------------------------------------------

    def admit(self, epoch: int | None) -> bool:
        """Whether a record written under ``epoch`` counts (read in partition order):
        the fence of pipeline.statestore.ChangelogFence, kept across restarts."""
        if epoch is None:
            return True
        if epoch < self.top:
            return False
        self.top = epoch
        return True

    def next_epoch(self) -> int:
        """The epoch a new owner of the partition writes under."""
        self.top += 1
        return self.top

    def apply(
        self,
        records: Iterable[tuple[bytes, bytes | None]],
        offset: int | None,
        last: bytes | None = None,
    ) -> int:
        """Write changelog records (already admitted) and the offset they reach, in
        one write batch, keeping the renewal index; returns the records written.
        ``last``: the :func:`record_mark` of the record at ``offset``.

        Raises:
            StateStoreError: the database refused the write (a full disk).
        """
        import rocksdict

        batch = rocksdict.WriteBatch(raw_mode=True)
        renewals: dict[bytes, int | None] = {}  # entity key -> its index entry now
        count = 0
        for key, value in records:
            count += 1
            if _is_entity_key(key):
                old = renewals[key] if key in renewals else self._renewal_stored(key)
                new = None
                if value is not None:
                    until = self._renewal(key, value)
                    new = None if until is None else max(0, until)
                if old != new:
                    if old is not None:
                        batch.delete(RENEW + _UNTIL.pack(old) + key)
                    if new is not None:
                        batch.put(RENEW + _UNTIL.pack(new) + key, b"")
                renewals[key] = new
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        if offset is not None:
            batch.put(META_OFFSET, str(offset).encode())
            if last is not None:
                batch.put(META_LAST, last)
        batch.put(META_EPOCH, str(self.top).encode())
        self._write(batch)
        return count

    def _renewal_stored(self, key: bytes) -> int | None:
        value = self.db.get(key)
        if value is None:
            return None
        until = self._renewal(key, value)
        return None if until is None else max(0, until)

    def _renewal(self, key: bytes, value: bytes) -> int | None:
        try:
            record = orjson.loads(value)
            return self.renewal_of(key.decode(), record) if isinstance(record, dict) else None
        except (ValueError, UnicodeDecodeError):  # not a record this worker wrote: unindexed
            log.error("state %s: entity record %r is not JSON; not indexed", self.path, key[:80])
            return None

    @property
    def db(self) -> Any:
        """The database (opened again first if a write failed: RocksDB keeps a
        failed write-ahead log in error until then).

        Raises:
            StateStoreError: it cannot be opened again (the disk is still full).
        """
        if self._failed:
            self._reopen()
        return self._handle

    def check(self) -> None:
        """Raise :class:`StateStoreError` unless the database takes a write now."""
        import rocksdict

        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.put(META_EPOCH, str(self.top).encode())
        self._write(batch)

    def _write(self, batch: Any) -> None:
        db = self.db
        try:
            db.write(batch)
        except Exception as exc:
            # RocksDB keeps a failed write-ahead log in error until the database
            # is opened again: the next write reopens it.
            self._failed = True
            raise StateStoreError(
                f"cannot write the local state store {self.path}: {exc}; free space on "
                "its volume (pipeline.state_dir) or move it to a larger one: the worker "
                "waits, acking nothing, until it can write"
            ) from exc

    def _reopen(self) -> None:
        import rocksdict

        with contextlib.suppress(Exception):  # it fails as its last write did
            self._handle.close()
        try:
            self._handle = rocksdict.Rdict(str(self.path), self._options)
        except Exception as exc:
            raise StateStoreError(
                f"cannot open the local state store {self.path} again: {exc}; free space "
                "on its volume (pipeline.state_dir)"
            ) from exc
        self._failed = False

    def reindex(self, versions: Mapping[str, int]) -> int:
        """Build the renewal index again from the entity records (after the
        feature-set versions changed: every vector is due); returns the entries."""
        import rocksdict

        batch = rocksdict.WriteBatch(raw_mode=True)
        it = self.db.iter()
        it.seek(RENEW)
        while it.valid() and it.key().startswith(RENEW):
            batch.delete(it.key())
            it.next()
        count = 0
        it = self.db.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            if _is_entity_key(key):
                until = self._renewal(key, it.value())
                if until is not None:
                    batch.put(RENEW + _UNTIL.pack(max(0, until)) + key, b"")
                    count += 1
            it.next()
        batch.put(META_VERSIONS, orjson.dumps(dict(versions), option=orjson.OPT_SORT_KEYS))
        self._write(batch)
        return count

    def last_mark(self) -> bytes | None:
        """The mark of the record at the saved offset (None: not kept)."""
        value = self.db.get(META_LAST)
        return bytes(value) if value is not None else None

    def versions(self) -> dict[str, int] | None:
        raw = self.db.get(META_VERSIONS)
        return orjson.loads(raw) if raw is not None else None

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a database a failed write left in error
            self._handle.close()


class LocalStates:
    """A worker's folder of partition databases (see the module's doc).

    Args:
        root: ``pipeline.state_dir``/<app id>: the region's folders on this host.
        renewal_of: See :data:`RenewalOf`.
        versions: Entity type -> its feature-set version: a database built under
            other versions has its renewal index built again when opened.
        cache_mb: RocksDB's block cache, shared by the partitions (the tables' data
            and index blocks); the memtables of all partitions share half as much
            again (:func:`memtable_bytes`).
    """

    def __init__(
        self,
        root: Path,
        renewal_of: RenewalOf,
        versions: Mapping[str, int],
        cache_mb: int = 64,
    ) -> None:
        import rocksdict

        self.root = Path(root)
        self.renewal_of = renewal_of
        self.versions = dict(versions)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateStoreError(
                f"cannot create the local state folder {self.root}: {exc}; set "
                "pipeline.state_dir to a writable folder"
            ) from exc
        self._lock_fd, self.folder = self._take_folder()
        self._options = _options(
            rocksdict.Cache(cache_mb << 20),
            rocksdict.WriteBufferManager(memtable_bytes(cache_mb), False),
        )
        self.stores: dict[int, PartitionStore] = {}

    def _take_folder(self) -> tuple[int, Path]:
        for slot in range(4096):
            lock = self.root / f"w{slot}.lock"
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            folder = self.root / f"w{slot}"
            folder.mkdir(exist_ok=True)
            return fd, folder
        raise StateStoreError(f"no free state folder under {self.root} (4096 are held)")

    def partition(self, partition: int) -> PartitionStore:
        store = self.stores.get(partition)
        if store is None:
            path = self.folder / f"p{partition}"
            store = PartitionStore(path, partition, self._options, self.renewal_of)
            self.stores[partition] = store
            found = store.versions()
            if found is None:
                store.reindex(self.versions)  # empty or from before versions: cheap
            elif found != self.versions:
                log.warning(
                    "state %s: feature-set versions changed (%s -> %s): every vector "
                    "is written again",
                    path,
                    found,
                    self.versions,
                )
                store.reindex(self.versions)
        return store

    def load(self, key: str, partition: int) -> EntityState | None:
        return self.partition(partition).load(key)

    def due(
        self, partition: int, after: bytes | None, now_us: int, limit: int
    ) -> list[tuple[int, str, bytes]]:
        return self.partition(partition).due(after, now_us, limit)

    def entity_keys(self, partition: int) -> Iterator[str]:
        return self.partition(partition).entity_keys()

    def check(self) -> None:
        """Raise :class:`StateStoreError` unless every open database takes a write."""
        for store in self.stores.values():
            store.check()

    def records_applied(
        self,
        partition: int,
        records: Sequence[tuple[bytes, bytes | None]],
        offset: int | None,
        last: bytes | None = None,
    ) -> None:
        self.partition(partition).apply(records, offset, last)

    def present(self) -> list[int]:
        """The partitions this folder holds a database of."""
        found = []
        for path in self.folder.glob("p*"):
            if path.is_dir() and path.name[1:].isdigit():
                found.append(int(path.name[1:]))
        return sorted(found)

    def discard(self, partition: int, why: str) -> None:
        """Delete a partition's database: the changelog is read whole into a new one."""
        store = self.stores.pop(partition, None)
        if store is not None:
            store.close()
        path = self.folder / f"p{partition}"
        log.warning(
            "state partition %d: local state in %s discarded (%s); it is rebuilt from "
            "the changelog",
            partition,
            path,
            why,
        )
        shutil.rmtree(path, ignore_errors=True)

    async def check_lineage(self, fetch: LastRecordFetch) -> list[int]:
        """Discard the databases whose changelog partition no longer holds, at their
        saved offset, the record they reflect (the broker lost its topics, or the
        topic was deleted and made again): their offsets would skip the new
        changelog's records. ``fetch(partition, offset)`` reads the changelog's
        record there (None: none). Returns the partitions discarded."""
        discarded = []
        for partition in self.present():
            store = self.partition(partition)
            offset, mark = store.offset(), store.last_mark()
            if offset is None:
                continue
            found = await fetch(partition, offset)
            if found is None:
                why = f"the changelog ends before offset {offset}: the broker lost it?"
            elif mark is not None and record_mark(*found) != mark:
                why = f"the changelog's record at offset {offset} is another one"
            else:
                continue
            self.discard(partition, why)
            discarded.append(partition)
        return discarded

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the folder's lock
            self._lock_fd = -1


class RecordSink(Protocol):
    """Where a checkpoint's records go (pipeline.faustlocal.LocalChangelog; the
    benchmark's file-backed sink): ``local`` is the worker's store."""

    local: LocalStates

    def send(self, partition: int, key: str, value: bytes | None) -> None: ...


class ChangelogWriter(MutableMapping[str, Any]):
    """One changelog partition as a checkpoint writes it (pipeline.statestore's
    ``store_state`` takes it as the table): each record encoded once and handed
    to ``sink``; what is stored is read back from the partition's database."""

    def __init__(self, sink: RecordSink, partition: int) -> None:
        self.sink, self.partition = sink, partition

    def __getitem__(self, key: str) -> Any:
        raw = self.sink.local.partition(self.partition).db.get(key.encode())
        if raw is None:
            raise KeyError(key)
        return orjson.loads(raw)

    def __setitem__(self, key: str, value: Any) -> None:
        self.sink.send(self.partition, key, orjson.dumps(value))

    def __delitem__(self, key: str) -> None:
        self.sink.send(self.partition, key, None)

    def __contains__(self, key: object) -> bool:
        db = self.sink.local.partition(self.partition).db
        return isinstance(key, str) and db.get(key.encode()) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.sink.local.partition(self.partition).entity_keys())

    def __len__(self) -> int:  # pragma: no cover - not used
        raise TypeError("not counted")
