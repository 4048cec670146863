"""``spark_share.consumers.spill``: an agent's cached batches past its memory budget wait in a mapped file.

Covers: slots that fit are held in memory and counted; one that does not is moved to a file in the agent
directory and read back from it byte for byte (its dead-letter source too), the file's name is gone at
once (a killed agent leaves nothing), and its pages are mapped, not allocated; an acknowledged slot frees
its share of the budget; a budget of 0 maps every slot; where no file can be written, a slot stays in
memory, over budget, rather than failing its read.
"""
from __future__ import annotations

import os

import pyarrow as pa

from spark_share.consumers import records
from spark_share.consumers.agent_acks import Cached
from spark_share.consumers.spill import SpillBudget


def cached(slot: int, rows: int, dead_letters: bool = False) -> Cached:
    batch = pa.RecordBatch.from_pydict({"value": [bytes([slot]) * 100] * rows, "offset": list(range(rows))})
    ipc = records.to_ipc(batch)
    return Cached(7, slot, None, ipc, rows, rows, full=batch if dead_letters else None)


def mapped_from(directory) -> int:
    """Mappings of (deleted) files of ``directory`` in this process."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for line in f if str(directory) in line)


def test_slots_past_the_budget_wait_in_a_mapped_file_and_read_back_the_same(tmp_path):
    first, second = cached(1, 1000), cached(2, 1000, dead_letters=True)
    size = first.ipc.size
    budget = SpillBudget(size + 10, str(tmp_path))
    budget.admit(first)
    assert budget.in_memory == size == first.in_memory and budget.spilled == 0
    want_ipc, want_full = second.ipc.to_pybytes(), second.full
    allocated = pa.total_allocated_bytes()
    budget.admit(second)
    assert budget.spilled == 1 and budget.spilled_bytes == want_full.nbytes + len(want_ipc)
    assert budget.in_memory == size and second.in_memory == 0
    assert second.ipc.to_pybytes() == want_ipc, "a read task gets the same bytes from the file"
    assert pa.ipc.open_stream(second.ipc).read_all().num_rows == 1000
    assert second.full.equals(want_full), "the dead-letter source is the same records"
    assert list(tmp_path.iterdir()) == [], "the file's name is gone once it is mapped"
    assert mapped_from(tmp_path) == 2, "the slot's data and its dead-letter source are mapped"
    assert pa.total_allocated_bytes() <= allocated, "a mapped slot takes nothing from Arrow's memory pool"
    budget.release(first)
    assert budget.in_memory == 0
    budget.release(second)
    assert budget.in_memory == 0
    del second
    assert mapped_from(tmp_path) == 0, "acknowledged and dropped: unmapped"


def test_a_budget_of_zero_maps_every_slot_and_an_acknowledged_slot_frees_its_share(tmp_path):
    budget = SpillBudget(0, str(tmp_path))
    slots = [cached(i, 50) for i in range(3)]
    for c in slots:
        budget.admit(c)
    assert budget.spilled == 3 and budget.in_memory == 0
    roomy = SpillBudget(3 * slots[0].ipc.size, str(tmp_path))
    fresh = [cached(i, 50) for i in range(4)]
    for c in fresh[:3]:
        roomy.admit(c)
    assert roomy.in_memory == 3 * fresh[0].ipc.size and roomy.spilled == 0
    roomy.release(fresh[0])  # acknowledged
    roomy.admit(fresh[3])
    assert roomy.spilled == 0 and roomy.in_memory == 3 * fresh[0].ipc.size


def test_where_no_file_can_be_written_a_slot_stays_in_memory_over_budget(tmp_path, caplog):
    budget = SpillBudget(0, str(tmp_path / "removed"))  # the executor's local dir is gone
    c = cached(1, 100)
    want = c.ipc.to_pybytes()
    budget.admit(c)
    assert budget.spilled == 0 and budget.in_memory == c.in_memory == len(want) and c.ipc.to_pybytes() == want
    assert "stays in memory" in caplog.text
    budget.release(c)
    assert budget.in_memory == 0
