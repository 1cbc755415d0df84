"""The overlapped window's pure bucket state (mpidp.overlap.buckets): no MPI, no threads."""

from __future__ import annotations

import numpy as np

from mpidp.overlap.buckets import Buckets, divide


def make() -> Buckets:
    # slots 0..3 of 3, 10, 2, 2 values, expected in the order 3, 2, 0, 1; buckets of 4 values, calls of 4, no taper
    return Buckets([3, 10, 2, 2], [3, 2, 0, 1], 4, 4, taper=1)


def test_buckets_complete_strictly_in_order_and_remember_a_slot_made_ready_twice() -> None:
    b = make()
    assert len(b) == 3 and b.tail == 2 and b.fixed == [False, True, False, False]
    b.ready(0)  # bucket 1 ([0]) is full, but bucket 0 ([3, 2]) is not: nothing is complete
    assert b.complete == 0 and b.touched
    b.ready(3)
    b.ready(2)
    assert b.complete == 2 and b.unready() == [1]
    b.ready(2)
    assert b.again == {2}
    b.rest()
    assert b.complete == 3 and b.unready() == []
    b.reset()
    assert b.complete == 0 and not b.touched and not b.again


def test_calls_are_views_of_the_send_and_receive_buffers_that_swap_and_the_tail_stays_home() -> None:
    b = make()
    send, recv = b.send, b.recv
    [(s, r)] = b.calls(0)
    assert np.shares_memory(s, send) and np.shares_memory(r, recv) and s.size == 4
    tail = b.tail_views()
    assert [v.size for v in tail] == [4, 4, 2] and all(np.shares_memory(v, send) for v in tail)
    assert all(np.shares_memory(b.slot_views[0][i], send) for i in range(4))
    assert b.slot_views[0][1] is b.slot_views[1][1]  # a tail slot is one array in both buffers
    b.swap()
    assert b.send is recv and b.recv is send
    assert all(np.shares_memory(v, b.recv) for v in b.tail_views())  # the tail stays in buffer 0
    head_send, head_recv = b.head()
    assert head_send.size == 7 and np.shares_memory(head_send, recv) and np.shares_memory(head_recv, send)


def test_zero_clears_what_this_rank_contributes_and_divide_is_the_plain_paths_float32_division() -> None:
    b = make()
    b.send[:] = 1
    b.recv[:] = 1
    b.zero()
    assert not b.send.any() and b.recv.all()
    values = np.array([1, 2, 3], np.float32)
    out = np.empty(3, np.float32)
    divide(values, 3, out=out)
    assert out.tobytes() == (values / np.float32(3)).tobytes()
    divide(values, 3)
    assert values.tobytes() == out.tobytes()
