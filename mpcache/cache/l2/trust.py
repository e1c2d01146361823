"""What L2 trusts: the deployment's record key (resolved once by the supervisor from --l2-secret-file, the
first fs tier's secret file, or a random one per run) and the private files and directories it comes from
(the rules: ``docs/ARCHITECTURE.md``, "L2 trust")."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import uuid
from dataclasses import dataclass

from mpcache.errors import ConfigError

MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 64 * 1024
KEY_BYTES = 32  # the derived record key
SECRET_FILE_ENV = "MPCACHE_L2_SECRET_FILE"
FS_SECRET_NAME = ".mpcache-l2-secret"
_PERSON = b"mpcache-l2-key"


def derive_key(secret: bytes) -> bytes:
    """The record key for ``secret`` (32 bytes)."""
    return hashlib.blake2b(secret, digest_size=KEY_BYTES, person=_PERSON).digest()


def check_private_dir(path: str, what: str) -> None:
    """Refuse ``path`` unless it is a real directory (not a symlink) owned by us that group and others
    cannot write.  ``what`` starts the one-line error (e.g. ``--l2: fs path``)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r}: cannot use it ({exc.strerror})") from None
    euid = os.geteuid()
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != euid:
        problem = f"is owned by uid {info.st_uid}, not by this service's uid {euid}"
    elif info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem is not None:
        raise ConfigError(f"{what} {path!r} {problem}; refusing it (use a directory of uid {euid}, "
                          "not a symlink, mode 0700)")


def ensure_private_dir(path: str, what: str) -> None:
    """Create ``path`` (mode 0700, parents as needed) unless it exists, then :func:`check_private_dir` it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling symlink: check_private_dir names the problem
    except OSError as exc:
        raise ConfigError(f"{what} {path!r}: cannot create it ({exc.strerror})") from None
    check_private_dir(path, what)


def read_private_file(path: str, what: str, *, min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """The content of a secret file, trailing whitespace removed, after checking that it is a regular
    file (not a symlink) owned by us, with no access for group or others, of ``min_bytes`` or more."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        reason = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise ConfigError(f"{what} {path!r} {reason}") from None
    try:
        info = os.fstat(fd)
        euid = os.geteuid()
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {path!r} is not a regular file")
        if info.st_uid != euid:
            raise ConfigError(f"{what} {path!r} is owned by uid {info.st_uid}, not by this service's uid {euid}")
        if info.st_mode & 0o077:
            raise ConfigError(f"{what} {path!r} is accessible by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        if info.st_size > MAX_SECRET_BYTES:
            raise ConfigError(f"{what} {path!r} is larger than {MAX_SECRET_BYTES} bytes")
        chunks = []
        while chunk := os.read(fd, MAX_SECRET_BYTES + 1):
            chunks.append(chunk)
            if sum(map(len, chunks)) > MAX_SECRET_BYTES:
                raise ConfigError(f"{what} {path!r} is larger than {MAX_SECRET_BYTES} bytes")
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    secret = b"".join(chunks).rstrip()
    if len(secret) < min_bytes:
        raise ConfigError(f"{what} {path!r} holds {len(secret)} bytes; at least {min_bytes} are needed "
                          "(e.g. openssl rand -hex 32)")
    return secret


def fs_secret(directory: str) -> bytes:
    """The secret kept in an fs tier's root (``<directory>/.mpcache-l2-secret``): read it, or create it
    (32 random bytes as 64 hex digits, as ``openssl rand -hex 32`` writes them: raw bytes could end in
    what reading strips as whitespace; mode 0600, exclusively and without following a symlink) the first time."""
    path = os.path.join(directory, FS_SECRET_NAME)
    what = "--l2: the fs tier's secret file"
    temp = os.path.join(directory, f"{FS_SECRET_NAME}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES).hex().encode("ascii") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)  # atomic and exclusive: a concurrent start never reads half a secret
        except FileExistsError:
            pass  # created earlier (or by a concurrent start): read that one
        finally:
            os.unlink(temp)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be created ({exc.strerror})") from None
    return read_private_file(path, what)


@dataclass(frozen=True)
class ResolvedKey:
    key: bytes  # the record key (KEY_BYTES)
    source: str  # where it came from: "--l2-secret-file PATH", "fs PATH" or "per-run"

    @property
    def per_run(self) -> bool:
        return self.source == "per-run"


def resolve_l2_key(specs: list[dict], secret_file: str = "") -> ResolvedKey | None:
    """The deployment's record key for the checked ``--l2`` specs; None when no tier keeps records (mock only).

    fs tiers' directories must already have passed :func:`ensure_private_dir`.
    """
    if not any(spec["type"] in ("fs", "redis") for spec in specs):
        return None
    if secret_file:
        secret = read_private_file(secret_file, "--l2-secret-file")
        return ResolvedKey(derive_key(secret), f"--l2-secret-file {secret_file}")
    for spec in specs:
        if spec["type"] == "fs":
            root = os.path.abspath(spec["path"])
            return ResolvedKey(derive_key(fs_secret(root)), f"fs {os.path.join(root, FS_SECRET_NAME)}")
    return ResolvedKey(derive_key(os.urandom(KEY_BYTES)), "per-run")


def key_from_hex(text: str) -> bytes:
    """``Config.l2_secret`` back to bytes; ConfigError if it is not a record key."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"l2_secret: expected {2 * KEY_BYTES} hex digits")
    return key
