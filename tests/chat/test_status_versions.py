"""A status body built from a read that a write overtook is never served after the write."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction

from chat.selectors.status_cache import cached_status, status_changed


def test_a_body_stored_after_a_later_write_is_not_served(db):
    request_id = uuid.uuid4()
    state = {"finished": 0}

    def build_read_before_the_commit(read):
        body = {"finished": state["finished"]}  # the database read, before the submit commits
        state["finished"] = 1
        status_changed(request_id)  # the submit commits and announces it
        return body  # ...and this poll stores what it read before

    assert cached_status(request_id, is_chat=True, build=build_read_before_the_commit)["finished"] == 0
    # The next poll (the one the completion signal causes) rebuilds instead of serving the old body.
    assert cached_status(request_id, is_chat=True, build=lambda read: {"finished": state["finished"]}) == {
        "finished": 1
    }
    # And that body is served until the next change.
    assert cached_status(request_id, is_chat=True, build=lambda read: pytest.fail("rebuilt")) == {"finished": 1}


@pytest.mark.django_db(transaction=True)
def test_a_change_inside_a_transaction_is_announced_again_at_its_commit():
    request_id = uuid.uuid4()
    builds = []

    def build(read):
        builds.append(1)
        return {"n": len(builds)}

    with transaction.atomic():
        status_changed(request_id)
        # A poll between the change and the commit caches what it reads then...
        assert cached_status(request_id, is_chat=False, build=build) == {"n": 1}
    # ...which the commit makes stale.
    assert cached_status(request_id, is_chat=False, build=build) == {"n": 2}
    assert cached_status(request_id, is_chat=False, build=build) == {"n": 2}
