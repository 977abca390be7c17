#!/usr/bin/env python
"""The tensor samples' tensor files, packed: one archive per sample, unpacked where the dumps expect them.

A tensor sample (`ref_tensor`, `xdev_*_tensor`, ...) is msprobe's dump.json files, tracked as they are, and its
`step<N>/rank<N>/dump_tensor_data/` folders of small `.pt` files (thousands of them), tracked packed instead:
`tensor_data/<sample>.tar.xz` holds them all (paths from the sample's folder).  The archives are deterministic:
members sorted, mtime 0, owner 0/0 without names, mode 0644, xz with fixed settings, so packing the same files
twice gives the same bytes.  `tensor_data/manifest.json` records, per sample, the archive's sha256 and its members':
how many, their bytes, and the sha256 of their list of (path, size, sha256).

Unpacking (`make setup`, the test session's start in tests/conftest.py, bench scripts) is idempotent: a sample
whose archive was unpacked already (its hash in `.unpacked.json`, as many files and bytes as the manifest says)
is left as it is; otherwise every member is written (atomically, under a lock: concurrent test sessions and benches can
unpack at once) and checked against the manifest.  The unpacked folders are git-ignored.

Usage::

    python sample_dumps/fixtures.py                  # unpack every archive (idempotent)
    python sample_dumps/fixtures.py --pack NAME,...  # pack those samples' unpacked folders (generate.py does)
    python sample_dumps/fixtures.py --check          # unpacked files equal the manifest, byte for byte
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHIVES = "tensor_data"
MANIFEST = "manifest.json"
STAMPS = ".unpacked.json"
TENSOR_DIR = "dump_tensor_data"
_XZ = {"format": lzma.FORMAT_XZ, "check": lzma.CHECK_CRC64, "preset": 9 | lzma.PRESET_EXTREME}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_files(sample_dir: Path) -> list[Path]:
    """The files of a sample's dump_tensor_data folders, sorted by their path in the sample."""
    return sorted(
        (p for p in sample_dir.glob(f"step*/*/{TENSOR_DIR}/*") if p.is_file()),
        key=lambda p: p.relative_to(sample_dir).as_posix(),
    )


def _manifest(root: Path) -> dict:
    path = root / ARCHIVES / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


@contextmanager
def _locked(root: Path):
    """One packer or unpacker at a time under `root` (test sessions and benches may start together)."""
    with open(root / ".fixtures.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def members_entry(members: list[tuple[str, bytes]]) -> dict:
    """The manifest's account of a sample's tensor files ((path in the sample, bytes) each, sorted by path)."""
    listing = "".join(f"{rel} {len(data)} {_sha256(data)}\n" for rel, data in members)
    return {"files": len(members), "bytes": sum(len(d) for _, d in members), "members": _sha256(listing.encode())}


def archive_bytes(sample_dir: Path) -> tuple[bytes, dict]:
    """The deterministic .tar.xz of a sample's tensor files, and the manifest's account of them."""
    buf = io.BytesIO()
    members = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in tensor_files(sample_dir):
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(sample_dir).as_posix())
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
            members.append((info.name, data))
    return lzma.compress(buf.getvalue(), **_XZ), members_entry(members)


def pack(name: str, root: Path = HERE) -> Path:
    """Pack sample `name`'s tensor files into tensor_data/<name>.tar.xz and record it in the manifest."""
    data, members = archive_bytes(root / name)
    if not members["files"]:
        raise SystemExit(f"{root / name}: no {TENSOR_DIR} files to pack")
    out = root / ARCHIVES / f"{name}.tar.xz"
    out.parent.mkdir(exist_ok=True)
    with _locked(root):
        out.write_bytes(data)
        manifest = _manifest(root)
        manifest[name] = {"archive": _sha256(data), **members}
        _write_json(root / ARCHIVES / MANIFEST, manifest)
        stamps = _stamps(root)
        stamps[name] = manifest[name]["archive"]  # the files are there: they were just packed
        _write_json(root / STAMPS, stamps)
    return out


def _stamps(root: Path) -> dict:
    path = root / STAMPS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _present(sample_dir: Path, entry: dict) -> bool:
    """Whether the sample holds as many tensor files and bytes as the manifest's entry says (one stat each)."""
    files = tensor_files(sample_dir)
    return len(files) == entry["files"] and sum(p.stat().st_size for p in files) == entry["bytes"]


def _members(data: bytes, name: str) -> list[tuple[str, bytes]]:
    """(path, bytes) of each member of an archive: plain files inside the sample only."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r:") as tar:
        for info in tar:
            parts = Path(info.name).parts
            if not info.isfile() or info.name.startswith("/") or ".." in parts or TENSOR_DIR not in parts:
                raise SystemExit(f"{ARCHIVES}/{name}.tar.xz: member {info.name!r} is not a tensor file of the sample")
            fh = tar.extractfile(info)
            assert fh is not None
            out.append((info.name, fh.read()))
    return out


def unpack(name: str, root: Path = HERE) -> bool:
    """Unpack sample `name`'s archive unless it is unpacked already; whether it wrote anything."""
    entry = _manifest(root)[name]
    archive = root / ARCHIVES / f"{name}.tar.xz"
    stamps = _stamps(root)
    if stamps.get(name) == entry["archive"] and _present(root / name, entry):
        return False
    data = archive.read_bytes()
    if _sha256(data) != entry["archive"]:
        raise SystemExit(f"{archive}: sha256 differs from {ARCHIVES}/{MANIFEST}; run `git checkout {archive}`")
    members = _members(data, name)
    if {"archive": entry["archive"], **members_entry(members)} != entry:
        raise SystemExit(f"{archive}: members differ from {ARCHIVES}/{MANIFEST}")
    for rel, content in members:
        dest = root / name / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(content)
        os.replace(tmp, dest)
    stamps[name] = entry["archive"]
    _write_json(root / STAMPS, stamps)
    return True


def unpack_all(root: Path = HERE) -> list[str]:
    """Unpack every archive of the manifest that needs it; the samples unpacked."""
    with _locked(root):
        return [name for name in sorted(_manifest(root)) if unpack(name, root)]


def check(root: Path = HERE) -> list[str]:
    """The samples whose unpacked tensor files differ from the manifest (missing, extra or other bytes)."""
    bad = []
    for name, entry in sorted(_manifest(root).items()):
        files = tensor_files(root / name)
        got = members_entry([(p.relative_to(root / name).as_posix(), p.read_bytes()) for p in files])
        if {"archive": entry["archive"], **got} != entry:
            bad.append(name)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=HERE, help="the samples' folder (default: this script's)")
    ap.add_argument("--pack", help="comma-separated samples to pack from their unpacked folders")
    ap.add_argument("--check", action="store_true", help="compare the unpacked files with the manifest")
    a = ap.parse_args()
    if a.pack:
        for name in a.pack.split(","):
            print(f"packed {pack(name, a.root)}")
        return 0
    if a.check:
        bad = check(a.root)
        print("\n".join(bad[:20]) or f"unpacked files equal {ARCHIVES}/{MANIFEST}")
        return 1 if bad else 0
    done = unpack_all(a.root)
    if done:
        print(f"unpacked {', '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
