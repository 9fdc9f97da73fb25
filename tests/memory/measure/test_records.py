"""memory.json and bench.json: written and read in one place."""

from __future__ import annotations

import json

import pytest

from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import Footprint


def record(**measured):
    footprint = Footprint({"forward": {"weights": 2**30}})
    return records.memory_record(
        device={"type": "cpu", "name": "cpu", "total_bytes": None, "limit_bytes": None},
        world_size=1, batch_shape=[32, 128], batches=2, tracked_batches=2, optimizer_steps=2,
        predicted={"analytic": footprint, "simulated": None},
        measured={"tracked": footprint, **measured},
    )


def test_memory_json_round_trips_and_other_schemas_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no memory.json"):
        records.read_memory(tmp_path)
    (tmp_path / records.MEMORY_JSON).write_text(json.dumps({"schema": 2, "peak_bytes": 3}))
    with pytest.raises(ValueError, match="not a schema-3 memory record"):
        records.read_memory(tmp_path)
    records.write_memory(tmp_path, record())
    data = records.read_memory(tmp_path)
    assert records.measured_peak(data) == 2**30
    assert records.predicted_peak(data) == (2**30, "analytic")


def test_predictions_keep_their_three_levels_per_phase_and_read_back():
    """A CUDA prediction's footprint carries the allocator's reserve and the context: the device level is their
    sum, at the peak and in every phase, and the dict read back is the same footprint."""
    footprint = Footprint(
        {"forward": {"weights": 2**30, "activations": 2**29}, "step": {"weights": 2**30, "optimizer": 2**30}},
        reserved=2**31 + 2**20, reserved_phase="forward", context=600 * 2**20,
    )
    data = footprint.to_dict()
    assert data["peak_bytes"] == 2**31 and data["peak_phase"] == "step"
    assert data["device_bytes"] == data["reserved_bytes"] + data["context_bytes"] == 2**31 + 601 * 2**20
    assert {p: e["device_bytes"] for p, e in data["phases"].items()} == {
        "forward": data["device_bytes"],
        "step": data["device_bytes"],
    }
    back = Footprint.from_dict(json.loads(json.dumps(data)))
    assert back.to_dict() == data
    assert "reserved_bytes" not in Footprint({"forward": {"weights": 1}}).to_dict()  # tensors only (CPU, tracked)


def test_the_peak_in_words_names_what_was_measured(tmp_path):
    assert records.peak_summary(tmp_path) is None  # no memory.json
    (tmp_path / records.MEMORY_JSON).write_text("{not json")
    assert records.peak_summary(tmp_path) is None
    process = {"rss_at_start_bytes": 0, "max_rss_bytes": 3 * 2**30, "growth_bytes": 3 * 2**30}
    records.write_memory(tmp_path, record(process=process))
    assert records.peak_summary(tmp_path) == "1.00 GiB tracked tensors, 3.00 GiB process RSS growth (cpu)"
    cuda = {"max_allocated_bytes": 2**31, "max_reserved_bytes": 5 * 2**29, "peak_phase": "backward"}
    records.write_memory(tmp_path, record(cuda=cuda))
    assert records.peak_summary(tmp_path) == "2.00 GiB allocated, 2.50 GiB reserved (CUDA)"
    records.write_memory(tmp_path, record(cuda={**cuda, "max_device_bytes": 3 * 2**30}))
    assert records.peak_summary(tmp_path) == "2.00 GiB allocated, 2.50 GiB reserved, 3.00 GiB device (CUDA)"


def test_bench_json_rows_are_read_back_by_recipe(tmp_path):
    assert records.read_bench(tmp_path / records.BENCH_JSON) == {}
    records.write_bench(tmp_path, {"command": "x"}, [{"recipe": "4gb", "samples_per_s": 9.5}])
    assert records.read_bench(tmp_path / records.BENCH_JSON) == {"4gb": {"recipe": "4gb", "samples_per_s": 9.5}}
