"""The Ray engine on a simulated three-node cluster (ray.cluster_utils.Cluster): locality and the same store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from dumpstore import engine_ray  # noqa: E402
from dumpstore._ingest import IngestOptions, ingest  # noqa: E402
from dumpstore._ingest.unit import _ingest_unit  # noqa: E402
from dumpstore.layout import find_units  # noqa: E402
from dumpstore.query import run_query  # noqa: E402
from dumpstore.store import open_store  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "sample_dumps" / "ref_2rank_stats"
CHECKSUM = (
    "select count(*), bit_xor(hash(step, rank, seq, leaf, name, dtype, shape, min, max, mean, norm)) from tensors"
)


@pytest.fixture(scope="module")
def nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    yield engine_ray._alive_nodes(ray)
    ray.shutdown()
    cluster.shutdown()


def test_three_nodes_each_see_every_folder_so_no_preference(nodes):
    assert len(nodes) == 3
    units = find_units(SAMPLE)
    assert engine_ray.probe_homes(units, nodes) == {}  # one machine: every node lists every folder


def test_a_folder_seen_by_one_node_goes_to_it(nodes):
    units = find_units(SAMPLE)
    folders = [engine_ray.unit_folder(u) for u in units]
    seen = [[f for f, u in zip(folders, units) if u.rank == 0], [], [f for f, u in zip(folders, units) if u.rank]]
    homes = engine_ray.choose_homes(units, nodes, seen)
    assert homes == {i: nodes[0] if u.rank == 0 else nodes[2] for i, u in enumerate(units)}
    assert engine_ray.choose_homes(units, nodes, [folders] * 3) == {}
    plan = engine_ray.plan_batches(units, homes, 2)
    assert [(n, len(idx)) for n, idx in plan] == [(nodes[0], 2), (nodes[2], 2)]
    singles = engine_ray.plan_batches(units, homes, 1)
    assert [(n, len(idx)) for n, idx in singles] == [(nodes[0], 1)] * 2 + [(nodes[2], 1)] * 2


def test_units_run_on_their_preferred_node(nodes, tmp_path):
    units = find_units(SAMPLE)
    assert len(units) == 4  # 2 steps x 2 ranks

    def by_rank(us, ns):
        return {i: ns[(u.step + u.rank) % len(ns)] for i, u in enumerate(us)}

    st = open_store(tmp_path / "s", create=True)
    results = engine_ray.run_units(
        st, "x", uuid.uuid4().hex[:12], units, IngestOptions(), work=_ingest_unit, batch=1, locate=by_rank
    )
    want = by_rank(units, nodes)
    assert [r.meta["node"] for r in results] == [want[i] for i in range(len(units))]
    assert len({r.meta["node"] for r in results}) == 3


def test_ingest_on_three_nodes_equals_local(nodes, tmp_path):
    def spread(us, ns):
        return {i: ns[i % len(ns)] for i in range(len(us))}

    on_ray = ingest(SAMPLE, "r", store=tmp_path / "ray", engine="ray", engine_options={"batch": 1, "locate": spread})
    local = ingest(SAMPLE, "r", store=tmp_path / "local", jobs=1)
    assert (on_ray.rows, on_ray.records, on_ray.steps, on_ray.ranks) == (
        local.rows,
        local.records,
        local.steps,
        local.ranks,
    )
    sums = [run_query(open_store(tmp_path / d), CHECKSUM).to_pylist() for d in ("ray", "local")]
    assert sums[0] == sums[1] and list(sums[0][0].values())[0] == local.rows
