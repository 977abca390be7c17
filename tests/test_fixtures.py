"""The tensor samples' packed form (sample_dumps/fixtures.py): deterministic archives, idempotent checked unpacking."""

from __future__ import annotations

import io
import json
import lzma
import shutil
import sys
import tarfile

import pytest

from helpers import SAMPLES

sys.path.insert(0, str(SAMPLES))
import fixtures  # noqa: E402  (sample_dumps/fixtures.py)

SAMPLE = "bf16_tensor"  # the smallest archive


def _root_with(tmp_path, name: str = SAMPLE):
    """A samples folder holding one sample's archive and manifest entry, nothing unpacked."""
    (tmp_path / fixtures.ARCHIVES).mkdir()
    shutil.copy(SAMPLES / fixtures.ARCHIVES / f"{name}.tar.xz", tmp_path / fixtures.ARCHIVES)
    entry = json.loads((SAMPLES / fixtures.ARCHIVES / fixtures.MANIFEST).read_text())[name]
    (tmp_path / fixtures.ARCHIVES / fixtures.MANIFEST).write_text(json.dumps({name: entry}))
    return tmp_path


def test_every_tensor_sample_is_packed_and_unpacked_as_tracked():
    manifest = json.loads((SAMPLES / fixtures.ARCHIVES / fixtures.MANIFEST).read_text())
    with_tensors = sorted({p.parts[-4] for p in SAMPLES.glob(f"*/step*/*/{fixtures.TENSOR_DIR}")})
    assert sorted(manifest) == with_tensors and len(with_tensors) == 11
    assert fixtures.check() == []  # the session's unpacking (conftest) gave every file, byte for byte


def test_packing_again_gives_the_same_bytes():
    data, entry = fixtures.archive_bytes(SAMPLES / SAMPLE)
    assert data == (SAMPLES / fixtures.ARCHIVES / f"{SAMPLE}.tar.xz").read_bytes()
    assert entry["files"] == 400
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == sorted(i.name for i in infos)
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) for i in infos} == {(0, 0, 0, "", "", 0o644)}


def test_unpacking_is_checked_and_done_once(tmp_path):
    root = _root_with(tmp_path)
    assert fixtures.unpack_all(root) == [SAMPLE]
    want = fixtures.tensor_files(SAMPLES / SAMPLE)
    got = fixtures.tensor_files(root / SAMPLE)
    assert [p.relative_to(root) for p in got] == [p.relative_to(SAMPLES) for p in want]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(got, want))
    assert fixtures.unpack_all(root) == []  # already there
    got[7].write_bytes(b"truncated")
    assert fixtures.unpack_all(root) == [SAMPLE]  # a file of another size: unpacked again
    assert got[7].read_bytes() == want[7].read_bytes()
    assert fixtures.check(root) == []


def test_an_archive_that_differs_from_its_manifest_is_refused(tmp_path):
    root = _root_with(tmp_path)
    archive = root / fixtures.ARCHIVES / f"{SAMPLE}.tar.xz"
    archive.write_bytes(archive.read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match=r"bf16_tensor\.tar\.xz: sha256 differs from tensor_data/manifest\.json"):
        fixtures.unpack_all(root)
    assert not (root / SAMPLE).exists()


def test_a_member_outside_the_sample_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../step0/rank0/dump_tensor_data/x.pt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(SystemExit, match=r"member '\.\./step0/rank0/dump_tensor_data/x\.pt' is not a tensor file"):
        fixtures._members(lzma.compress(buf.getvalue()), "evil")
