"""engine/admission.py on its own: addresses and stages in, decisions out; no sockets."""

import random

import pytest

from engine.admission import (ADDRESS_CAP, GONE, IDENTITY_CAP, MID_DELIVERY_SECONDS,
                              STAGE_FULL, TOTAL_FULL, Admission, Cap, Limits, Stage,
                              address_key)

H, U, A = Stage.HANDSHAKE, Stage.UNAUTH, Stage.AUTH


def limits(total=100, handshake=(100, 100), unauth=(100, 100), auth=(100, 100),
           per_identity=0) -> Limits:
    return Limits(total, Cap(*handshake), Cap(*unauth), Cap(*auth), per_identity)


def test_address_key_is_the_ipv4_address_or_the_ipv6_slash_64():
    assert address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert address_key("2001:db8:1:2::7") == address_key("2001:db8:1:2:ffff::1") \
        == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::7") != address_key("2001:db8:1:2::7")
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("") == ""


def test_an_address_at_its_cap_is_refused_and_others_are_not():
    adm = Admission(limits(handshake=(100, 2)))
    assert adm.admit("a", 0) and adm.admit("a", 0)
    d = adm.admit("a", 0)
    assert (d.ticket, d.refused, d.evicted) == (None, ADDRESS_CAP, ())
    assert adm.admit("b", 0)
    assert (adm.count_of("a", H), adm.count_of("b", H), adm.total) == (2, 1, 3)


def test_full_handshake_stage_evicts_the_oldest_of_the_biggest_holder():
    adm = Admission(limits(handshake=(5, 10)))
    a = [adm.admit("a", t).ticket for t in range(3)]
    b = [adm.admit("b", t).ticket for t in range(2)]
    closed = []
    for t in a + b:
        t.closer = lambda t=t: closed.append(t)
    d = adm.admit("c", 9)
    assert d.ticket is not None and d.evicted == (a[0],)
    for t in d.evicted:
        t.close()
    assert closed == [a[0]] and not a[0].live
    # a and b now hold two each; b has held two longer (a just came down), so b loses, then a
    assert adm.admit("c", 10).evicted == (b[0],)
    assert adm.admit("d", 11).evicted == (a[1],)
    assert adm.counts() == {H: 5, U: 0, A: 0}


def test_equal_holders_lose_their_slots_oldest_first_so_a_newcomer_outlasts_a_flood():
    adm = Admission(limits(handshake=(50, 50)))
    flood = [adm.admit(f"10.0.0.{i}", i).ticket for i in range(50)]
    legit = adm.admit("192.0.2.1", 100)
    assert legit.evicted == (flood[0],)
    for i in range(49):          # the flood goes on: every new connection evicts its own
        d = adm.admit(f"10.0.1.{i}", 200 + i)
        assert d.evicted and d.evicted[0] is not legit.ticket
    assert legit.ticket.live


def test_advancing_frees_the_previous_stage_and_full_unauth_evicts_there():
    adm = Admission(limits(handshake=(2, 2), unauth=(2, 2)))
    t1, t2 = adm.admit("a", 0).ticket, adm.admit("a", 0).ticket
    assert adm.advance(t1, U, 1) and adm.advance(t2, U, 2)
    assert adm.counts() == {H: 0, U: 2, A: 0} and adm.total == 2
    assert (t1.stage, t1.since) == (U, 1)
    t3 = adm.admit("b", 3).ticket
    d = adm.advance(t3, U, 4)
    assert d.evicted == (t1,) and adm.count_of("b", U) == 1
    assert adm.advance(t3, A, 5) and adm.counts() == {H: 0, U: 1, A: 1}


def test_auth_is_displaced_only_by_fair_share():
    adm = Admission(limits(auth=(4, 5)))
    held = []
    for addr in "abbb":                 # b holds 3, a holds 1
        t = adm.admit(addr, 0).ticket
        assert adm.advance(t, A, 0)
        held.append(t)
    t = adm.admit("a", 0).ticket        # a would hold 2 against b's 2 after a swap: fair
    d = adm.advance(t, A, 1)
    assert d and d.evicted == (held[1],)     # b's oldest, a's own session untouched
    assert not held[1].live and held[0].live
    t = adm.admit("a", 2).ticket        # a 3 against b 1: no swap, refused
    d = adm.advance(t, A, 3)
    assert (d.ticket, d.refused, d.evicted) == (None, STAGE_FULL, ())
    assert t.stage is H and t.live      # refused: keeps its old slot until released
    adm.release(t)
    assert adm.total == 4


def test_equal_auth_holders_never_displace_each_other_and_unauth_never_displaces_auth():
    adm = Admission(limits(auth=(2, 5), unauth=(1, 5)))
    for addr in "ab":
        assert adm.advance(adm.admit(addr, 0).ticket, A, 0)
    t = adm.admit("a", 0).ticket        # a holds 1, b holds 1: a second for a is no gain
    assert adm.advance(t, A, 0).refused == STAGE_FULL
    c = adm.admit("c", 0).ticket        # a newcomer from c holds 0 and the top holds 1: no
    assert adm.advance(c, A, 0).refused == STAGE_FULL    # gain either (1 < 0 + 2)
    assert adm.advance(c, U, 0) and adm.counts()[A] == 2


def test_a_lone_device_gets_in_past_a_flood_spread_over_many_addresses():
    adm = Admission(limits(total=10_000, handshake=(10_000, 100), auth=(900, 100)))
    for i in range(2000):               # 253 addresses each push until refused
        t = adm.admit(f"10.0.{i % 253}.1", i).ticket
        if not adm.advance(t, A, i):
            adm.release(t)
    assert adm.count(A) == 900
    device = adm.admit("192.0.2.7", 3000).ticket
    d = adm.advance(device, A, 3000)
    assert d and len(d.evicted) == 1 and d.evicted[0].address.startswith("10.0.")


def test_past_the_handshake_an_address_at_its_cap_loses_its_idlest_connection_not_the_newcomer():
    adm = Admission(limits(unauth=(100, 1), auth=(100, 1)))
    t1, t2 = adm.admit("a", 0).ticket, adm.admit("a", 0).ticket
    assert adm.advance(t1, U, 0)
    d = adm.advance(t2, U, 1)
    assert d and d.evicted == (t1,) and adm.count_of("a", U) == 1
    t3 = adm.admit("a", 2).ticket
    assert adm.advance(t3, A, 2)       # a stage may be skipped (trueseal receive: XX -> AUTH)
    t4 = adm.admit("a", 3).ticket
    d = adm.advance(t4, A, 3)
    assert d.evicted == (t3,) and t2.live and adm.count_of("b", A) == 0
    assert adm.decisions[("auth", "evicted_address_cap")] == 1
    assert adm.decisions[("unauth", "evicted_address_cap")] == 1


def _authenticated(adm, addr, n, t0=0, identity=None):
    out = []
    for i in range(n):
        t = adm.admit(addr, t0 + i).ticket
        assert adm.advance(t, A, t0 + i, identity=identity(i) if identity else None)
        out.append(t)
    return out


def test_at_the_address_cap_the_session_idle_longest_in_application_terms_goes():
    adm = Admission(limits(auth=(100, 3)))
    s = _authenticated(adm, "nat", 3)
    adm.touch(s[0], 10)                # s[0] sent a message: s[1] is now idle longest
    d = adm.advance(adm.admit("nat", 11).ticket, A, 11)
    assert d.evicted == (s[1],)
    d = adm.advance(adm.admit("nat", 12).ticket, A, 12)
    assert d.evicted == (s[2],)        # s[2] entered AUTH at 2, s[0] was active at 10
    assert s[0].live and s[0].active == 10


def test_a_session_mid_delivery_is_never_evicted_and_all_busy_refuses():
    adm = Admission(limits(auth=(100, 2)))
    s = _authenticated(adm, "nat", 2)
    s[0].owe()                         # a write or a store under way
    acked = {"yes": False}
    d = adm.advance(adm.admit("nat", 5).ticket, A, 5)
    assert d.evicted == (s[1],)        # idle longest is s[0], but it is mid-delivery
    newest = d.ticket
    newest.delivering = lambda: not acked["yes"]    # a Deliver not acked yet
    t = adm.admit("nat", 6).ticket
    d = adm.advance(t, A, 6)
    assert (d.ticket, d.refused, d.evicted) == (None, ADDRESS_CAP, ())
    assert s[0].live and newest.live
    s[0].paid()
    assert adm.advance(t, A, 7).evicted == (s[0],)
    acked["yes"] = True
    assert adm.advance(adm.admit("nat", 8).ticket, A, 8).evicted == (newest,)


def test_a_delivery_unanswered_past_the_grace_protects_nothing():
    """A client that never acks its Deliver does not keep its slot for ever."""
    adm = Admission(limits(auth=(100, 1)))
    (s,) = _authenticated(adm, "nat", 1)
    s.owe()
    t = adm.admit("nat", 10).ticket
    assert adm.advance(t, A, 10).refused == ADDRESS_CAP
    late = MID_DELIVERY_SECONDS + 1
    assert adm.advance(t, A, late).evicted == (s,)


def test_one_identity_holds_at_most_its_budget_and_replaces_its_idlest():
    adm = Admission(limits(auth=(100, 100), per_identity=2))
    s = _authenticated(adm, "nat", 2, identity=lambda i: "key")
    adm.touch(s[0], 5)
    d = adm.advance(adm.admit("other", 6).ticket, A, 6, identity="key")
    assert d.evicted == (s[1],) and adm.sessions_of("key") == 2
    assert adm.decisions[("auth", "evicted_identity_cap")] == 1
    # another identity behind the same address is not touched
    assert adm.advance(adm.admit("nat", 7).ticket, A, 7, identity="k2").evicted == ()
    for t in (s[0], d.ticket):
        t.owe()
    t = adm.admit("nat", 8).ticket
    d2 = adm.advance(t, A, 8, identity="key")
    assert (d2.ticket, d2.refused) == (None, IDENTITY_CAP)
    adm.release(s[0])
    assert adm.advance(t, A, 9, identity="key") and adm.sessions_of("key") == 2


def test_a_newcomer_always_gets_in_past_idle_sessions_with_a_key_each_from_its_address():
    adm = Admission(limits(total=20_000, handshake=(20_000, 200), auth=(11_000, 256),
                           per_identity=4))
    legit_in = 0
    for i in range(10_000):            # one fresh identity per connection, all from "nat"
        t = adm.admit("nat", i).ticket
        assert adm.advance(t, A, i, identity=f"k{i}")
        if i % 100 == 50:              # the neighbour connects, sends, leaves
            me = adm.admit("nat", i).ticket
            if adm.advance(me, A, i, identity="me"):
                legit_in += 1
            adm.release(me)
    assert legit_in == 100 and adm.count_of("nat", A) == 256


def test_a_full_house_of_sessions_refuses_newcomers_and_handshakes_are_evicted_first():
    adm = Admission(limits(total=3))
    s = adm.admit("a", 0).ticket
    adm.advance(s, U, 0)
    h1, h2 = adm.admit("b", 0).ticket, adm.admit("b", 0).ticket
    d = adm.admit("c", 1)
    assert d.ticket is not None and d.evicted == (h1,)
    for t in (h2, d.ticket):
        adm.advance(t, U, 2)
    d = adm.admit("d", 3)                 # interop §1: nothing to evict, closed at once
    assert (d.ticket, d.refused) == (None, TOTAL_FULL)
    assert s.live


def test_release_is_idempotent_and_an_evicted_ticket_cannot_advance():
    adm = Admission(limits(handshake=(1, 1)))
    t = adm.admit("a", 0).ticket
    t2 = adm.admit("b", 0).ticket
    assert not t.live
    assert adm.advance(t, U, 0).refused == GONE
    adm.release(t)
    adm.release(t2)
    adm.release(t2)
    assert adm.total == 0 and adm.counts() == {H: 0, U: 0, A: 0}
    with pytest.raises(ValueError):
        t3 = adm.admit("a", 0).ticket
        adm.advance(t3, U, 0)
        adm.advance(t3, H, 0)


def test_a_stage_with_no_room_at_all_refuses():
    adm = Admission(limits(unauth=(0, 10)))
    t = adm.admit("a", 0).ticket
    assert adm.advance(t, U, 0).refused == STAGE_FULL


def test_counts_and_victims_match_a_brute_force_model():
    rng = random.Random(19)
    lim = limits(total=40, handshake=(25, 8), unauth=(12, 5), auth=(10, 3))
    adm = Admission(lim)
    live: list = []
    for step in range(5000):
        op = rng.random()
        if op < 0.45 or not live:
            addr = f"10.0.0.{rng.randrange(12)}"
            before = _holders(live, H)
            d = adm.admit(addr, step)
            for v in d.evicted:
                assert v.stage is H
                assert before.get(v.address, 0) == max(before.values())
                live.remove(v)
                before = _holders(live, H)
            if d.ticket:
                live.append(d.ticket)
        elif op < 0.8:
            t = rng.choice(live)
            if t.stage is A:
                continue
            stage = Stage(t.stage + rng.choice([1, 2]) if t.stage is H else A)
            before = _holders(live, stage)
            d = adm.advance(t, stage, step)
            for v in d.evicted:
                assert v.stage is stage and stage is not H
                if v.address == t.address and before[v.address] >= lim.cap(stage).per_address:
                    # rule 1: the newcomer's own address, its session idle longest
                    assert v.active == min(o.active for o in live
                                           if o.address == v.address and o.stage is stage)
                else:
                    assert before[v.address] == max(before.values())
                    if stage is A:      # fair share: the victim's address keeps >= newcomer's
                        assert before[v.address] - 1 >= before.get(t.address, 0) + 1
                live.remove(v)
                before = _holders(live, stage)
        else:
            t = rng.choice(live)
            adm.release(t)
            live.remove(t)
        assert all(t.live for t in live)
        assert adm.total == len(live) <= lim.total
        for stage in Stage:
            held = _holders(live, stage)
            assert adm.count(stage) == sum(held.values()) <= lim.cap(stage).total
            assert all(n <= lim.cap(stage).per_address for n in held.values())
            for addr, n in held.items():
                assert adm.count_of(addr, stage) == n
        for addr in {t.address for t in live}:
            assert adm.held_by(addr) == sum(t.address == addr for t in live)


def _holders(tickets, stage) -> dict:
    out: dict = {}
    for t in tickets:
        if t.stage is stage:
            out[t.address] = out.get(t.address, 0) + 1
    return out
