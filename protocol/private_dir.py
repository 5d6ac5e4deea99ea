"""Directories only this user may change: the worker socket's, the prefix
cache's, the one `mlxd keys generate` writes to. Another user who could
write there could plant a link where a file of ours goes, or a socket or key
of their own."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def own_directory(directory: Path, parents: bool = False, tighten: bool = True) -> Path:
    """`directory`, made (0700) if it is not there, this user's own (not a
    symbolic link, nobody else's), nobody else's to write; ValueError saying
    why not. tighten: its mode is made 0700 (a directory of mlxd's own making);
    else (one the operator names) one others may write is refused, never
    changed: `--prefix-cache-dir /tmp` must not close /tmp to everyone."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=parents)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{directory} is a symbolic link: give the directory's own path")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"{directory} belongs to another user (uid {info.st_uid})")
    if tighten and info.st_mode & 0o777 != 0o700:
        directory.chmod(0o700)
    elif info.st_mode & 0o022:
        raise ValueError(f"{directory} is writable by other users: give a directory of this user's own")
    return directory
