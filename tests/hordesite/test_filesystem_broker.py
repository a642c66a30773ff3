"""The embedded default's broker (hordesite/filesystem_broker.py): a reader polling while a writer
publishes gets every message, whole and once. kombu's own filesystem transport can hand the reader
a file the writer has created but not yet filled; the worker then stops on the decode error. That
showed under load (a full test run on two busy cores), not on demand, so this test checks the
transport's delivery, and test_beat.py runs beat and the worker on it."""

from __future__ import annotations

import threading

from kombu import Connection

TRANSPORT = "hordesite.filesystem_broker:Transport"
MESSAGES = 300


def _folders(tmp_path) -> dict:
    """The transport's options: its folders under the test's own."""
    folder = tmp_path / "broker"
    folder.mkdir()
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
        "store_processed": False,
    }


def test_a_reader_polling_while_a_writer_publishes_reads_every_message_whole(tmp_path):
    transport = TRANSPORT
    options = _folders(tmp_path)
    payload = "x" * 50_000  # a long write: a wide window for a reader to see a file unfinished
    received: list[int] = []
    failures: list[BaseException] = []

    def read() -> None:
        with Connection("filesystem://", transport=transport, transport_options=options) as conn:
            queue = conn.SimpleQueue("sweeps")
            try:
                while len(received) < MESSAGES:
                    message = queue.get(timeout=20)
                    received.append(message.payload["n"])
                    assert message.payload["pad"] == payload
                    message.ack()
            except BaseException as exc:  # reported to the test thread
                failures.append(exc)

    # The queue is bound before the threads start. kombu's virtual transport keeps its bindings in a
    # process-wide state: in one process, a connection whose binding another connection has recorded
    # but not yet written to the exchange table skips its own write, and a publish in that moment
    # finds no table and is dropped. Beat and the worker are separate processes, each of which
    # writes its own binding before it publishes or consumes, so only this test's two threads meet it.
    with Connection("filesystem://", transport=transport, transport_options=options) as conn:
        conn.SimpleQueue("sweeps").close()
    reader = threading.Thread(target=read)
    reader.start()
    with Connection("filesystem://", transport=transport, transport_options=options) as conn:
        queue = conn.SimpleQueue("sweeps")
        for n in range(MESSAGES):
            queue.put({"n": n, "pad": payload})
    reader.join(60)
    assert not reader.is_alive()
    assert not failures, failures[0]
    assert sorted(received) == list(range(MESSAGES))


def test_a_connection_to_the_folders_warns_of_no_missing_hostname(tmp_path, caplog):
    """kombu's filesystem transport asked for a host it never uses, so every start of the embedded
    default's worker and beat logged "No hostname was supplied. Reverting to default 'localhost'"."""
    options = _folders(tmp_path)
    caplog.set_level("WARNING", logger="kombu")
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as conn:
        # A queue of its own: kombu keeps the bindings it made process-wide (see above).
        queue = conn.SimpleQueue("hostname-probe")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        queue.close()
        conn.clone().release()  # as Celery's worker and beat do at start
        assert conn.info()["hostname"] is None
    assert [r.getMessage() for r in caplog.records if r.name.startswith("kombu")] == []
