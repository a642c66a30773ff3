"""Worker details carry the declaration of the worker's latest pop (spec: chat_requests.md, "Worker
details")."""

from __future__ import annotations

from datetime import timedelta

from django.core.cache import cache
from django.utils import timezone

from chat.selectors.snapshots import reset_snapshots
from tests.chat.pop_helpers import MODEL, chat_pop
from workers.models import Worker


def _details(horde, name: str) -> dict:
    worker = Worker.objects.get(name=name)
    response = horde.client.get(f"/api/v2/workers/{worker.id}")
    assert response.status_code == 200
    return response.json()


def test_a_text_worker_has_no_chat_object(horde, make_user):
    owner = make_user("owner")
    horde.pop(owner.key, name="text")
    details = _details(horde, "text")
    assert details["accepts_chat_jobs"] is False and details["accepts_prompt_jobs"] is True
    assert "chat" not in details
    assert details["nonconformant_replies"] == 0


def test_a_chat_worker_shows_its_declaration(horde, make_user):
    owner = make_user("owner")
    chat_pop(
        horde,
        owner.key,
        name="chat",
        prompt_jobs=False,
        features=["vision", "seed", "made-up", "prompt_overflow_refused"],
        limits={"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.8},
        transports=["url", "base64", "telepathy"],
    )
    Worker.objects.filter(name="chat").update(nonconformant_replies=3)
    details = _details(horde, "chat")
    assert details["accepts_chat_jobs"] is True and details["accepts_prompt_jobs"] is False
    assert details["chat"] == {
        "model_id": MODEL,
        "features": ["prompt_overflow_refused", "seed", "vision"],
        "limits": {"max_context_length": 8192, "max_length": 1024, "tools_max_temperature": 0.8},
        "image_transports": ["base64", "url"],
    }
    assert details["nonconformant_replies"] == 3


def test_limits_leave_out_an_undeclared_tool_temperature(horde, make_user):
    owner = make_user("owner")
    chat_pop(horde, owner.key, name="chat", limits={"max_context_length": 4096, "max_length": 512})
    assert _details(horde, "chat")["chat"]["limits"] == {"max_context_length": 4096, "max_length": 512}


def test_the_worker_list_carries_the_same_fields(horde, make_user):
    owner = make_user("owner")
    chat_pop(horde, owner.key, name="chat")
    horde.pop(owner.key, name="text")
    listed = {w["name"]: w for w in horde.client.get("/api/v2/workers").json()}
    assert listed["chat"]["chat"]["model_id"] == MODEL and listed["chat"]["accepts_chat_jobs"] is True
    assert "chat" not in listed["text"] and listed["text"]["nonconformant_replies"] == 0


def test_single_details_are_cached_but_the_owner_switch_shows_at_once(horde, make_user):
    owner = make_user("owner")
    chat_pop(horde, owner.key, name="chat")
    assert "chat" in _details(horde, "chat")
    horde.pop(owner.key, name="chat")  # withdraws the declaration
    assert "chat" in _details(horde, "chat")  # cached for 30 seconds
    worker = Worker.objects.get(name="chat")
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    details = _details(horde, "chat")
    assert details["maintenance_mode"] is True and "chat" not in details
    cache.clear()
    reset_snapshots()
    assert _details(horde, "chat")["accepts_chat_jobs"] is False


# --- By name: GET /api/v2/workers/name/<name> ----------------------------------------------------


def test_details_by_name_are_the_details_by_id(horde, make_user):
    owner = make_user("owner")
    chat_pop(horde, owner.key, name="Scribe of the North", features=["seed"])
    by_id = _details(horde, "Scribe of the North")
    response = horde.client.get("/api/v2/workers/name/Scribe%20of%20the%20North")
    assert response.status_code == 200
    assert response.json() == by_id
    assert by_id["name"] == "Scribe of the North" and by_id["chat"]["features"] == ["seed"]


def test_an_unknown_name_is_worker_not_found(horde, make_user):
    owner = make_user("owner")
    horde.pop(owner.key, name="known")
    response = horde.client.get("/api/v2/workers/name/unknown")
    assert response.status_code == 404
    # Upstream's WorkerNotFound names an ID whatever it was given.
    assert response.json() == {"message": "Worker with ID 'unknown' not found.", "rc": "WorkerNotFound"}
    assert horde.client.get("/api/v2/workers/name/Known").status_code == 404  # names are exact


def test_a_name_with_a_nul_is_worker_not_found(horde, make_user):
    # No worker can have it, and PostgreSQL text cannot hold it: the lookup answered 500.
    horde.pop(make_user("owner").key, name="known")
    response = horde.client.get("/api/v2/workers/name/kn%00own")
    assert response.status_code == 404
    assert response.json() == {"message": "Worker with ID 'kn\x00own' not found.", "rc": "WorkerNotFound"}


def test_details_by_name_are_cached_but_the_owner_switch_shows_at_once(horde, make_user):
    owner = make_user("owner")
    chat_pop(horde, owner.key, name="chat")
    assert "chat" in horde.client.get("/api/v2/workers/name/chat").json()
    horde.pop(owner.key, name="chat")  # withdraws the declaration
    assert "chat" in horde.client.get("/api/v2/workers/name/chat").json()  # cached for 30 seconds
    worker = Worker.objects.get(name="chat")
    horde.client.put(f"/api/v2/workers/{worker.id}", {"maintenance": True}, format="json", HTTP_APIKEY=owner.key)
    details = horde.client.get("/api/v2/workers/name/chat").json()
    assert details["maintenance_mode"] is True and "chat" not in details


def test_the_text_worker_list_kobold_lite_asks_for(horde, make_user):
    """KoboldAI Lite lists GET /api/v2/workers?type=text at load (spec: existing-clients.md)."""
    owner = make_user("owner")
    horde.pop(owner.key, name="text")
    chat_pop(horde, owner.key, name="chat")
    response = horde.client.get("/api/v2/workers?type=text", HTTP_ORIGIN="null")
    assert response.status_code == 200 and response["Access-Control-Allow-Origin"] == "*"
    listed = {w["name"]: w for w in response.json()}
    assert set(listed) == {"text", "chat"}
    assert listed["text"]["type"] == "text" and listed["text"]["models"] == [MODEL]
    assert listed["text"]["accepts_prompt_jobs"] is True and listed["chat"]["accepts_chat_jobs"] is True
    assert horde.client.get("/api/v2/workers?type=image").json() == []


def test_the_list_matches_a_name_by_pythons_lower_case_as_upstream(horde, make_user):
    """Upstream keeps the listed workers whose name.lower() is the asked name's. SQLite's LIKE folded
    only ASCII letters (Ä was not ä) and PostgreSQL's UPPER more than lower() does (ı and i are both I)."""
    owner = make_user("owner")
    horde.pop(owner.key, name="Ärger")
    horde.pop(owner.key, name="kıwi")

    def listed(query: str) -> list[str]:
        response = horde.client.get(f"/api/v2/workers?{query}")
        assert response.status_code == 200
        return [worker["name"] for worker in response.json()]

    assert listed("name=%C3%84RGER") == ["Ärger"] and listed("name=%C3%A4rger") == ["Ärger"]
    assert listed("name=KIWI") == [] and listed("name=kiwi") == []
    assert listed("name=K%C4%B1WI") == ["kıwi"]  # 'KıWI'.lower() is 'kıwi'


def test_the_list_reads_a_repeated_filter_by_its_first_value(horde, make_user):
    """Upstream's reqparse keeps the first of a repeated query parameter; QueryDict.get kept the last."""
    horde.pop(make_user("owner").key, name="text")

    def listed(query: str) -> list[str]:
        return [worker["name"] for worker in horde.client.get(f"/api/v2/workers?{query}").json()]

    assert listed("type=text&type=image") == ["text"]
    assert listed("type=image&type=text") == []
    assert listed("name=text&name=other") == ["text"]
    assert listed("name=other&name=text") == []
    assert listed("name=&name=text&type=image") == []  # the first name is empty: the type filters


def test_an_offline_worker_is_listed_by_no_filter_but_found_by_name(horde, make_user):
    """Upstream lists the workers checked in within 300 seconds (get_active_workers), and its name
    filter picks among them; /workers/name/<name> finds any worker, exact name, with online false."""
    owner = make_user("owner")
    horde.pop(owner.key, name="gone")
    horde.pop(owner.key, name="here")
    Worker.objects.filter(name="gone").update(last_check_in=timezone.now() - timedelta(seconds=301))
    for query in ("", "?type=", "?type=text"):
        assert [w["name"] for w in horde.client.get(f"/api/v2/workers{query}").json()] == ["here"]
    assert horde.client.get("/api/v2/workers?name=gone").json() == []
    assert horde.client.get("/api/v2/workers?type=text&name=GONE").json() == []
    response = horde.client.get("/api/v2/workers/name/gone")
    assert response.status_code == 200 and response.json()["online"] is False
    assert horde.client.get("/api/v2/workers/name/GONE").json() == {
        "message": "Worker with ID 'GONE' not found.", "rc": "WorkerNotFound"
    }


def test_details_carry_upstreams_kudos_breakdown_and_flag(horde, make_user):
    """Fields upstream's worker details always send, which clients built against it read."""
    owner = make_user("owner")
    horde.pop(owner.key, name="text")
    Worker.objects.filter(name="text").update(kudos_earned=12.5)
    cache.clear()
    details = _details(horde, "text")
    assert details["kudos_details"] == {"generated": 12.5} and details["kudos_rewards"] == 12.5
    assert details["flagged"] is False


def test_the_owner_is_shown_to_the_workers_owner_and_moderators_only(horde, make_user):
    """As upstream's details privilege: a worker's owner alias links a volunteer's account to the
    machine it runs, so only its owner and moderators read it (docs/adr/0126)."""
    owner, stranger, moderator = make_user("owner"), make_user("stranger"), make_user("mod", moderator=True)
    horde.pop(owner.key, name="private")
    worker = Worker.objects.select_related("owner").get(name="private")
    alias = worker.owner.unique_alias
    routes = (f"/api/v2/workers/{worker.id}", "/api/v2/workers/name/private", "/api/v2/workers")
    for route in routes:
        for key, shown in ((None, False), (stranger.key, False), (owner.key, True), (moderator.key, True)):
            answer = horde.client.get(route, **({"HTTP_APIKEY": key} if key else {}))
            assert answer.status_code == 200, (route, answer.content)
            (details,) = answer.json() if route.endswith("workers") else [answer.json()]
            assert details.get("owner") == (alias if shown else None), (route, key)
            assert details["name"] == "private" and details["trusted"] is False
