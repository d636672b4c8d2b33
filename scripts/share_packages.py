"""Makes the hosts' venvs share the files they install alike, as hard links: two ComfyUI hosts each install the
same torch with its CUDA libraries (5.3 GiB), and a machine whose disk the test suite nearly fills (its
checkpoints, two suites' temporary files) runs out of it.

    python scripts/share_packages.py VENV OTHER_VENV...

A file is shared when both venvs hold the same distribution (name and version) and pip's RECORD gives the
file the same sha256 in both, at the same size on disk. The file in each OTHER_VENV becomes a link to VENV's;
pip replaces a file it upgrades (a new inode), so a later install into one venv never changes the other.
Run again, it finds them linked and does nothing. Prints the bytes it shared, if any.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages")) + sorted(venv.glob("Lib/site-packages"))
    if not found:
        raise SystemExit(f"share_packages: {venv} has no site-packages; is it a venv?")
    return found[0]


def recorded_hashes(site: Path) -> dict[str, dict[str, str]]:
    """{dist-info folder name: {file path relative to site-packages: its RECORD hash}}."""
    found: dict[str, dict[str, str]] = {}
    for record in site.glob("*.dist-info/RECORD"):
        with record.open(newline="") as handle:
            rows = [row for row in csv.reader(handle) if len(row) >= 2 and row[1].startswith("sha256=")]
        found[record.parent.name] = {path: digest for path, digest, *_ in rows}
    return found


def share(source_site: Path, target_site: Path) -> tuple[int, int]:
    """Links target_site's files to source_site's where their distributions record them alike; (files, bytes)."""
    source, target = recorded_hashes(source_site), recorded_hashes(target_site)
    files = shared_bytes = 0
    for dist in source.keys() & target.keys():
        for path, digest in source[dist].items():
            if target[dist].get(path) != digest:
                continue
            a, b = Path(os.path.normpath(source_site / path)), Path(os.path.normpath(target_site / path))
            if not (a.is_file() and b.is_file()) or a.is_symlink() or b.is_symlink():
                continue
            sa, sb = a.stat(), b.stat()
            if sa.st_ino == sb.st_ino or sa.st_size != sb.st_size or sa.st_dev != sb.st_dev:
                continue
            # Linked beside it, then renamed over it: the file is never missing, even if this is interrupted.
            partial = b.with_name(b.name + ".share-partial")
            partial.unlink(missing_ok=True)
            try:
                os.link(a, partial)
            except OSError as exc:  # a file system without hard links, or a file with too many: each venv keeps its own
                print(f"share_packages: {target_site} keeps its own files: cannot link {a} ({exc})", file=sys.stderr)
                return files, shared_bytes
            os.replace(partial, b)
            files += 1
            shared_bytes += sa.st_size
    return files, shared_bytes


def main() -> int:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    first, *others = (Path(arg) for arg in sys.argv[1:])
    source_site = site_packages(first)
    for other in others:
        files, shared_bytes = share(source_site, site_packages(other))
        if files:
            gib = shared_bytes / 2**30
            print(f"share_packages: {other.name} now shares {files} files with {first.name}, {gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
