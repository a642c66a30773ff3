"""What a process heard of its queue lists' growth (chat.services.pop_wait.QueueGrowth, ADR 0057): a
version only while a subscription is live, changed by every growth of a list it names, ended by the
subscription's loss or a new one, never back to a value once read."""

from __future__ import annotations

from chat.services import pop_wait
from chat.services.pop_wait import EVERY_LIST_TOKEN, QueueGrowth

A, B = "a" * 16, "b" * 16


def subscribed() -> tuple[QueueGrowth, object]:
    growth, listener = QueueGrowth(), object()
    growth.subscribed(listener)
    return growth, listener


def test_no_version_without_a_live_subscription():
    growth = QueueGrowth()
    assert growth.version((EVERY_LIST_TOKEN, A)) is None
    listener = object()
    growth.subscribed(listener)
    assert growth.version((EVERY_LIST_TOKEN, A)) is not None
    growth.lost(listener)
    assert growth.version((EVERY_LIST_TOKEN, A)) is None


def test_growth_of_a_named_list_or_every_list_changes_the_version_and_others_do_not():
    growth, listener = subscribed()
    before = growth.version((EVERY_LIST_TOKEN, A))
    growth.signalled(listener, frozenset({B}))
    assert growth.version((EVERY_LIST_TOKEN, A)) == before
    growth.signalled(listener, frozenset({A}))
    after_a = growth.version((EVERY_LIST_TOKEN, A))
    assert after_a != before
    growth.signalled(listener, None)  # every list
    assert growth.version((EVERY_LIST_TOKEN, A)) != after_a
    last = growth.version((EVERY_LIST_TOKEN, A))
    growth.grew((A,))  # this process's own addition
    assert growth.version((EVERY_LIST_TOKEN, A)) != last


def test_a_new_subscription_ends_every_version_and_a_stale_listener_is_not_heard():
    growth, first = subscribed()
    before = growth.version((EVERY_LIST_TOKEN, A))
    second = object()
    growth.subscribed(second)
    assert growth.version((EVERY_LIST_TOKEN, A)) != before
    now = growth.version((EVERY_LIST_TOKEN, A))
    growth.signalled(first, frozenset({A}))  # an older listener still running
    growth.lost(first)
    assert growth.version((EVERY_LIST_TOKEN, A)) == now


def test_a_late_write_of_an_older_value_still_changes_the_version():
    growth, _ = subscribed()
    late = next(growth._sequence)  # a writer that took its value, then lost the interpreter
    growth.grew((A,))
    read = growth.version((A,))
    growth._values[A] = late  # ... and writes it now
    assert growth.version((A,)) != read


def test_too_many_lists_start_afresh_and_end_every_version(monkeypatch):
    monkeypatch.setattr(pop_wait, "QUEUE_GROWTH_MAX_LISTS", 3)
    growth, _ = subscribed()
    growth.grew(("1" * 16, "2" * 16, "3" * 16, "4" * 16))
    before = growth.version((A,))
    growth.grew((B,))
    assert growth.version((A,)) != before
    assert len(growth._values) == 1
