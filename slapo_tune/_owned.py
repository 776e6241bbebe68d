"""Temp folders tagged with the process that owns them, so that a later run can remove the ones
whose owner died without removing them (SIGKILL runs no cleanup).

A folder is removed only when it carries our tag, belongs to this user, and the process the tag
names has ended: an untagged folder (another program's, or one still being made) and the folder
of a live process are left alone. The tag holds the PID and, on Linux, the process's start time,
so that a PID reused by another process is not taken for the owner.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

OWNER_FILE = ".slapo-tune-owner"


def process_identity(pid: int) -> str | None:
    """``"PID STARTTIME"`` of a running process (Linux: its start time in clock ticks after boot,
    from ``/proc``), ``"PID"`` where there is no ``/proc``; None when no such process runs (a
    zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the name, in parentheses, may hold spaces)
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
        try:  # no /proc: whether the PID exists at all
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # another user's
            pass
        return str(pid)
    except OSError:  # unreadable: taken as running, so that its folder is kept
        return str(pid)
    if fields[0] == "Z":
        return None
    return f"{pid} {fields[19]}"  # field 22 of stat(5), counted after the name's (field 2) end


def tag_as_mine(folder: str | os.PathLike) -> None:
    """Tag ``folder`` as this process's (once: a tag already there is kept)."""
    marker = Path(folder) / OWNER_FILE
    if not marker.exists():
        marker.write_text(process_identity(os.getpid()) or str(os.getpid()))


def remove_orphans(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the folders ``parent/prefix*`` of this user whose tag names a process that has
    ended; returns them."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            info = entry.lstat()
            tag = (entry / OWNER_FILE).read_text().strip()
            pid = int(tag.split()[0])
        except (OSError, ValueError, IndexError):  # untagged, unreadable, or not a tag of ours
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        now = process_identity(pid)
        # the owner runs (a tag without a start time, written where /proc was unreadable: its PID runs)
        if now is not None and (now == tag or " " not in tag):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
