"""Membership: registration, beats, death after missed beats, comeback, restart with a new identity."""

import pytest

from coordinator.membership import NODE, WORKER, Membership

GIB = 2**30


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_dead_node_leaves_the_ring_and_comes_back_when_it_beats(clock):
    members = Membership(clock, dead_after_s=2.5)
    a = members.register(NODE, "127.0.0.1:1", GIB)
    b = members.register(NODE, "127.0.0.1:2", GIB)
    worker = members.register(WORKER, "127.0.0.1:9")
    epoch_both = members.ring.epoch
    assert set(members.ring.nodes) == {"127.0.0.1:1", "127.0.0.1:2"}
    clock.now += 2.0
    assert members.heartbeat(a.member_id) and members.heartbeat(worker.member_id)
    assert members.sweep() == []
    clock.now += 1.0  # b silent for 3 s
    dead = members.sweep()
    assert [m.address for m in dead] == ["127.0.0.1:2"]
    assert set(members.ring.nodes) == {"127.0.0.1:1"} and members.ring.epoch != epoch_both
    assert members.heartbeat(b.member_id)
    assert set(members.ring.nodes) == {"127.0.0.1:1", "127.0.0.1:2"}
    assert members.ring.epoch == epoch_both


def test_restart_registers_a_new_identity_and_the_old_id_is_unknown(clock):
    members = Membership(clock)
    first = members.register(NODE, "127.0.0.1:1", GIB)
    second = members.register(NODE, "127.0.0.1:1", 2 * GIB)
    assert first.member_id != second.member_id
    assert not members.heartbeat(first.member_id)
    assert members.ring.nodes == {"127.0.0.1:1": 2 * GIB}
    assert len(members.members()) == 1


def test_unknown_member_is_told_to_register(clock):
    assert not Membership(clock).heartbeat("nobody")


def test_bad_registrations_are_refused(clock):
    members = Membership(clock)
    with pytest.raises(ValueError, match="role"):
        members.register("printer", "127.0.0.1:1")
    with pytest.raises(ValueError, match="capacity"):
        members.register(NODE, "127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="address"):
        members.register(WORKER, "")


def test_mark_dead_stops_routing_until_the_next_beat(clock):
    members = Membership(clock)
    worker = members.register(WORKER, "127.0.0.1:9")
    members.mark_dead("127.0.0.1:9")
    assert members.live(WORKER) == []
    members.heartbeat(worker.member_id, {"running": 1})
    assert [m.load for m in members.live(WORKER)] == [{"running": 1}]


def test_two_views_with_the_same_live_set_share_an_epoch(clock):
    one, two = Membership(clock), Membership(clock)
    for members in (one, two):
        for port in (3, 1, 2):
            members.register(NODE, f"127.0.0.1:{port}", GIB)
    assert one.ring.epoch == two.ring.epoch
    assert all(one.ring.placement(k, 2) == two.ring.placement(k, 2) for k in ("a", "b", "c", "d"))


def test_a_member_that_deregisters_leaves_the_ring_at_once(clock):
    members = Membership(clock)
    a = members.register(NODE, "127.0.0.1:1", GIB)
    members.register(NODE, "127.0.0.1:2", GIB)
    assert members.deregister(a.member_id).address == "127.0.0.1:1"
    assert set(members.ring.nodes) == {"127.0.0.1:2"}
    assert [m.address for m in members.members()] == ["127.0.0.1:2"]
    assert members.deregister(a.member_id) is None and not members.heartbeat(a.member_id)


def test_heartbeats_and_reads_do_not_wait_for_a_ring_build(clock, monkeypatch):
    """A ring of 1,000 nodes takes seconds to build: members must keep beating meanwhile, and the
    ring that is finally in place is the one for the newest live set."""
    import threading

    import coordinator.membership as membership_module

    building, release = threading.Event(), threading.Event()
    real_ring = membership_module.Ring

    def slow_ring(nodes):
        if len(nodes) == 2:  # only the second node's build is held
            building.set()
            assert release.wait(10), "the test never released the build"
        return real_ring(nodes)

    members = Membership(clock=clock)
    first = members.register(NODE, "10.0.0.1:1", capacity_bytes=2**30)
    monkeypatch.setattr(membership_module, "Ring", slow_ring)
    joining = threading.Thread(target=members.register, args=(NODE, "10.0.0.2:1"), kwargs={"capacity_bytes": 2**30})
    joining.start()
    try:
        assert building.wait(10), "the second node's ring build never started"
        beats = []
        beat = threading.Thread(target=lambda: beats.append(members.heartbeat(first.member_id)))
        beat.start()
        beat.join(5)
        assert beats == [True], "a heartbeat waited for the ring build"
        assert {m.address for m in members.live(NODE)} == {"10.0.0.1:1", "10.0.0.2:1"}
    finally:
        release.set()
        joining.join(10)
    assert not joining.is_alive()
    assert set(members.ring.nodes) == {"10.0.0.1:1", "10.0.0.2:1"}
