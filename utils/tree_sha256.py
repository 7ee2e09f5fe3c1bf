"""``python utils/tree_sha256.py ARCHIVE``: the sha256 of what a source archive holds, whatever its packing.

The build scripts pin each upstream source by this digest.  It hashes every member's path (its first component,
the archive's top folder, dropped), kind, executable bit and content (a link: its target), in path order, so a
``git archive`` of a commit and GitHub's download of it (other top folder, other gzip bytes) agree, and any change
of a file does not.  ``git get-tar-commit-id`` only reads a comment anyone can write; this reads the files.
"""

from __future__ import annotations

import hashlib
import sys
import tarfile


def tree_sha256(archive: str) -> str:
    """The digest of ``archive``'s members (see the module's docstring)."""
    entries = []
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            if member.type in (tarfile.XGLTYPE, tarfile.XHDTYPE) or member.isdir():
                continue
            parts = member.name.split("/", 1)
            if len(parts) < 2 or not parts[1]:
                continue
            if member.issym() or member.islnk():
                body = f"link {member.linkname}".encode()
            elif member.isfile():
                f = tar.extractfile(member)
                body = hashlib.sha256(f.read() if f else b"").hexdigest().encode()
            else:
                raise SystemExit(f"tree_sha256: {archive}: {member.name} is neither file nor link")
            mode = "x" if member.mode & 0o111 and member.isfile() else "-"
            entries.append(parts[1].encode() + b"\0" + mode.encode() + b"\0" + body + b"\n")
    return hashlib.sha256(b"".join(sorted(entries))).hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: tree_sha256.py ARCHIVE")
    print(tree_sha256(sys.argv[1]))
