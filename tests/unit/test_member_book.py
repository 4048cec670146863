"""``spark_share.driver.members``: the query's share-group members under their cap (no I/O)."""
from __future__ import annotations

import pytest

from spark_share.driver import members as members_module
from spark_share.driver.members import IDLE_BATCHES, MemberBook


def book(cap: int, **agents: int) -> MemberBook:
    b = MemberBook(cap)
    for name, n in agents.items():
        b.joined(name, f"host-{name}", n)
    return b


def test_a_read_may_open_a_member_only_within_the_cap_and_its_lease_counts_until_reported():
    b = book(3, a=1, b=1)
    assert b.may_open("a", batch=0, slot=2) and b.total == 3, "the lease counts at once"
    assert not b.may_open("b", batch=0, slot=3), "a second read past the cap opens none"
    b.read("a", batch=0, slot=2, session="a-2", opened=True)  # the lease became a member
    assert b.total == 3 and b.leases == {}
    assert not b.may_open("b", batch=1, slot=0)


def test_at_the_cap_a_read_is_lent_to_an_agent_with_a_member_free_in_its_batch_never_twice(monkeypatch):
    """Members do not move per batch (a join waits for its assignment): a host with a consumer that no read
    of this batch claimed reads the slot for the read that found none, the least recently read first, each
    free consumer lent once; when every member is in use, none."""
    clock = [100.0]
    monkeypatch.setattr(members_module.time, "monotonic", lambda: clock[0])
    b = book(4, a=2, b=1, c=1)
    b.claimed("c", 4, slot=0)
    clock[0] += 1
    b.claimed("b", 5, slot=1)
    clock[0] += 1
    b.claimed("a", 5, slot=0)  # claimed, not yet polled: its consumer is in use all the same
    # In batch 5: b uses its only member, a one of two, c none (it last read in batch 4).
    assert b.lend("d", 5, slot=2) == "c"
    assert b.lend("d", 5, slot=3) == "a", "c's one member is lent already"
    assert b.lend("d", 5, slot=4) is None, "every member is in use or lent"
    assert b.lend("c", 6, slot=0) == "b", "never the asking agent itself; in a new batch all are free again"


def test_a_read_that_opened_a_member_on_a_lease_uses_that_one():
    b = book(3, a=1, b=1)
    b.claimed("a", 0, slot=0)
    b.claimed("a", 0, slot=1)  # a's second read: no free consumer there, within the cap it opens one
    assert b.may_open("a", 0, 1) and b.total == 3
    assert b.lend("b", 0, slot=2) is None, "a's two consumers (one on its lease) are in use"
    b.read("a", 0, 1, "a-2", opened=True)
    assert b.lend("b", 0, slot=2) is None and b.total == 3


def test_an_agent_whose_members_no_read_used_lately_is_asked_to_close_them_at_most_every_half_idle(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(members_module.time, "monotonic", lambda: clock[0])
    b = book(8, a=2, b=1)
    for batch in range(10):
        b.read("a", batch=batch, slot=0, session="a-1", opened=False)  # a uses one of its two every batch
        b.read("b", batch=batch, slot=1, session="b-1", opened=False)
    assert b.idle(9, idle_s=10) == ["a"]
    clock[0] += 4
    assert b.idle(10, idle_s=10) == [], "asked again within idle_s / 2"
    clock[0] += 2
    for batch in range(10, 10 + IDLE_BATCHES):  # b's member stops being used: after IDLE_BATCHES it is idle
        b.read("a", batch=batch, slot=0, session="a-1", opened=False)
    assert b.idle(10 + IDLE_BATCHES, idle_s=10) == ["a", "b"]


def test_a_refused_member_lowers_the_cap_to_what_the_group_admitted():
    b = book(4, a=1, b=1)
    assert b.may_open("a", 0, 2) and b.may_open("b", 0, 3) and b.total == 4
    assert b.refuse("b", 0, 3) and b.cap == 3 and b.refused == 1
    b.read("a", batch=0, slot=2, session="a-2", opened=True)
    assert b.total == 3 == b.cap and not b.may_open("a", 1, 0)
    nothing = book(2, a=1)
    assert not nothing.refuse("a", 0, 0), "the group admitted none of this query's members (its one refused)"
    assert nothing.cap == 2


def test_a_lease_of_a_read_that_never_reported_counts_as_a_member_once_its_batch_is_acknowledged():
    """Counting one too many keeps the cap; the agent's next answer to a Trim corrects it."""
    b = book(3, a=1)
    assert b.may_open("a", 3, 1)
    b.settled(2)
    assert b.total == 2 and b.leases
    b.settled(3)
    assert b.total == 2 and not b.leases and b.agents["a"].members == 2
    b.closed("a", 1)
    assert b.total == 1


def test_out_of_order_reports_of_one_agent_never_undercount():
    """Two reads of one agent: the one that opened a member reports first, the other (its report made
    before the member opened) after. Counting by events, the total stays right: no second lease."""
    b = book(2, a=1)
    assert b.may_open("a", 0, 1)
    b.read("a", 0, 1, "a-2", opened=True)
    b.read("a", 0, 0, "a-1", opened=False)
    assert b.total == 2 and not b.may_open("a", 0, 2)


@pytest.mark.parametrize("hosts", [3, 500])
def test_the_view_names_at_most_top_hosts(hosts):
    b = MemberBook(hosts)
    for i in range(hosts):
        b.joined(f"agent-{i}", f"host-{i:03d}", 1 + (i % 3))
    view = b.view(top=20)
    assert len(view["membersPerHost"]) == min(20, hosts) and view["hostsWithMembers"] == hosts
    assert view["members"] == sum(1 + (i % 3) for i in range(hosts))
    assert list(view["membersPerHost"].values()) == sorted(view["membersPerHost"].values(), reverse=True)
