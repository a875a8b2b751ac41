"""The validator's results CSV: whole rows only, one writer at a time, nobody else's file.

A row is appended with one write of a complete line and fsynced; a write that fails part-way (a full
disk) is cut back to the last whole row before the error is raised. A row cut by a kill mid-write (the
only way left to get one) is told apart from a whole one by its missing newline (every row is one
physical line: newlines inside values are written as " | ") and, for files written before that rule, by
an odd count of quote characters; readers skip it and a resume drops it before appending, so a new row
never lands on the end of a half one.
"""
import contextlib
import csv
import errno
import fcntl
import io
import os
from dataclasses import dataclass, field

from zerocalc.rows_schema import render  # noqa: F401  (a row as one CSV line: the schema's)


class ResultsFileError(ValueError):
    """--out cannot be used as it is: one line that says why and what to do."""


@dataclass(frozen=True)
class Parsed:
    """A results file read as whole records. `text` is the header line plus every good record, as
    written (what pandas reads); `bad` holds complete records whose field count is not the header's
    (a row written onto the end of a half one by an older validator), skipped; `partial` is what follows
    the last whole record (a row cut mid-write), empty when the file ends cleanly; `whole_bytes` is
    where it starts; `lines` the line each row starts on (the header is line 1)."""
    header: list[str]
    rows: list[dict]
    text: str
    bad: list[str] = field(default_factory=list)
    partial: str = ""
    whole_bytes: int = 0
    lines: list[int] = field(default_factory=list)


def _records(text: str):
    """(raw record, complete) per CSV record of text, in order: a record runs over physical lines until
    its quote characters pair up; complete when they do and its last line ends with a newline."""
    pending = ""
    for line in _lines(text):
        pending += line
        if pending.count('"') % 2 == 0 and pending.endswith("\n"):
            yield pending, True
            pending = ""
    if pending:
        yield pending, False


def _lines(text: str):
    """Physical lines split on "\\n" only (a lone "\\r" inside a value is not a line end)."""
    parts = text.split("\n")
    for p in parts[:-1]:
        yield p + "\n"
    if parts[-1]:
        yield parts[-1]


def _fields(raw: str) -> list[str]:
    return next(csv.reader(io.StringIO(raw, newline="")), [])


def parse(data: bytes, path: str = "") -> Parsed:
    """A results file's bytes as whole records (raises ResultsFileError for a file that is not text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ResultsFileError(f"{path} is not a validator results file (not UTF-8 text at byte {err.start})")
    records = list(_records(text))
    if not records:
        return Parsed([], [], "")
    head_raw, head_complete = records[0]
    if not head_complete:
        return Parsed([], [], "", partial=head_raw)
    header = _fields(head_raw)
    rows, good, bad, partial, offset = [], [head_raw], [], "", len(head_raw.encode())
    whole, line, starts = offset, 1 + head_raw.count("\n"), []
    for raw, complete in records[1:]:
        if not complete:
            partial = raw
            break
        offset += len(raw.encode())
        whole, line = offset, line + raw.count("\n")
        values = _fields(raw)
        if len(values) != len(header):
            bad.append(raw)
            continue
        rows.append(dict(zip(header, values)))
        good.append(raw)
        starts.append(line - raw.count("\n"))
    return Parsed(header, rows, "".join(good), bad, partial, whole, starts)


def read(path: str) -> Parsed:
    with open(path, "rb") as f:
        return parse(f.read(), path)


def is_results_header(header: list[str]) -> bool:
    """A header the validator wrote: the key first and an outcome column (older files lack later
    columns and keep some since renamed, so the exact set is not required)."""
    return bool(header) and header[0] == "key" and "outcome" in header


def repeated_column(header: list[str]) -> str | None:
    """A column named twice in a header (a hand-made or joined file): which of its values a reader
    took would depend on the reader. None where every name is once."""
    seen = set()
    for name in header:
        if name in seen:
            return name
        seen.add(name)
    return None


def check_output(path: str) -> None:
    """Refuse, before any job runs, an --out the sweep could not finish into: a missing or read-only
    directory, a file that cannot be written, or a file that is not a validator results file (its header
    would be rewritten and its rows mixed with ours)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ResultsFileError(f"--out {path}: the directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ResultsFileError(f"--out {path}: the directory {folder} is not writable; choose another --out")
    if not os.path.exists(path):
        return
    if not os.path.isfile(path):
        raise ResultsFileError(f"--out {path} is not a regular file")
    if not os.access(path, os.R_OK | os.W_OK):
        raise ResultsFileError(f"--out {path} is not readable and writable; fix its permissions or choose another --out")
    parsed = read(path)
    if parsed.header and not is_results_header(parsed.header):
        shown = ",".join(parsed.header[:3])[:60]
        raise ResultsFileError(f"--out {path} is not a validator results file (its header starts {shown!r}); "
                               "give a new file or one written by `validate run`")
    if repeated_column(parsed.header):
        raise ResultsFileError(f"--out {path}: column {repeated_column(parsed.header)!r} appears twice in its header; "
                               "give a new file or one written by `validate run`")
    if not parsed.header and parsed.partial and not "key,".startswith(parsed.partial[:4]):
        raise ResultsFileError(f"--out {path} is not a validator results file (no header line); "
                               "give a new file or one written by `validate run`")


def drop_partial_row(path: str) -> str:
    """Cut the file back to its last whole record (a row half-written when a sweep was killed or the
    disk filled) so the next row starts on a line of its own. Returns what was dropped."""
    if not os.path.exists(path):
        return ""
    parsed = read(path)
    if not parsed.partial:
        return ""
    with open(path, "r+b") as f:
        f.truncate(parsed.whole_bytes)
        f.flush()
        os.fsync(f.fileno())
    return parsed.partial


def done_keys(path: str, retry_failed: bool = False) -> set[str]:
    """Keys with a whole row already; with retry_failed, only those whose last row is ok."""
    if not os.path.exists(path):
        return set()
    last = {}
    for r in read(path).rows:
        last[r["key"]] = r.get("outcome", "")
    return {k for k, o in last.items() if o == "ok" or not retry_failed}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def append_row(path: str, row: dict) -> None:
    """Append one row as one complete line, flushed and fsynced; the header comes with the first. A
    write that fails part-way is cut back, so the file keeps whole rows and the error is raised. A file
    written before a column existed (a new Setup field) gets it, empty in its earlier rows (read back
    as the field's default, `rows.job_from_row`)."""
    from zerocalc.rows_schema import COLUMNS
    path = os.path.realpath(path)   # a link stays a link: the rewrite below replaces the file it names
    parsed = read(path) if os.path.exists(path) else None
    header = parsed.header if parsed and parsed.header else list(COLUMNS)
    missing = [k for k in row if k not in header]
    if missing and parsed and parsed.header:
        header = _add_columns(path, parsed, missing)
    elif missing:
        header = header + missing
    new = not (parsed and parsed.header)
    data = render(header, [row], with_header=new).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                os.fsync(fd)
            raise
    finally:
        os.close(fd)


def _add_columns(path: str, parsed: Parsed, missing: list[str]) -> list[str]:
    """Rewrite the file with the missing columns at the end of its header, atomically (a killed sweep
    keeps the old file or the new one). Whole rows only: a half row at the end is dropped here too."""
    header = parsed.header + missing
    replace_whole(path, render(header, parsed.rows, with_header=True).encode())
    return header


def replace_whole(path: str, data: bytes) -> None:
    """Write `path` through `<path>.tmp`, fsynced, and a rename: a reader sees the old file or the new
    one, whole. On any failure (a full disk, a signal) the old file stays as it was and the .tmp is
    removed. A link is followed: the file it names is replaced, the link kept."""
    real = os.path.realpath(path)
    tmp = real + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(real):
            os.chmod(tmp, os.stat(real).st_mode & 0o7777)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(real)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class OutputLock:
    """One runner per results file: an exclusive flock on `<out>.lock`, which holds the owner's pid.
    The kernel drops the flock when its holder dies, however it dies, so a lock file left by a killed
    runner is stale and taken over; the file is removed by the holder on a clean exit (a waiter that
    opened it first finds its inode gone and opens the new one)."""

    def __init__(self, csv_path: str):
        # the file's real path: two runners given it through different links take the same lock
        self.path = os.path.realpath(csv_path) + ".lock"
        self.fd = None

    def __enter__(self):
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise ResultsFileError(f"cannot create the lock {self.path}: {err.strerror}; choose another --out")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ResultsFileError(f"another `validate run` (pid {holder}) is writing {self.path[:-5]}; "
                                       "wait for it to finish or give another --out")
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                with contextlib.suppress(OSError):   # the pid is for the message only (a full disk)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return self
            os.close(fd)   # removed by its previous holder while we waited: take the new one
        raise ResultsFileError(f"could not take the lock {self.path}; retry")

    def __exit__(self, *exc):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            os.close(self.fd)
            self.fd = None
