"""The bridge's loop: pop, generate, submit; up to `threads` jobs at once.

Each thread pops for itself (at once after a job). An idle pop carries `wait` (`pop_wait`, ADR
0024): the horde holds it until a job arrives, and the thread pops again at once; an empty answer
that came sooner than `pop_interval` (a horde that ignores the key) is followed by a pause to the
end of that interval, so such a horde is polled about once a `pop_interval` as before. Leases:
a job is given up (faulted) `lease_margin` seconds before its pop's ttl ends, so the request is
handed out again at once instead of after the horde's stale sweep. Stop: the first SIGINT/SIGTERM
stops popping (a pop the horde holds ends within a second) and lets held jobs finish for `stop_grace`
seconds, then faults what is left; a second signal faults at once. The declaration goes with every
pop: a context Ollama changed is read again between pops and declared on the next (ADR 0081).
"""

from __future__ import annotations

import dataclasses
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from contract.chat_declaration import ChatDeclaration, ChatFaultReason, ChatLimits
from contract.chat_policy import ChatGuarantee as G
from contract.chat_progress import streams_progress
from contract.text import TEXT_JOB_LEASE_SECONDS
from workers.bridge import BRIDGE_AGENT
from workers.bridge.backends import (
    DEFAULT_CONTEXT,
    Backend,
    BackendDown,
    BackendError,
    BackendRefused,
    Capabilities,
    GenerationStopped,
    ProgressSink,
    apply_overrides,
)
from workers.bridge.config import BridgeConfig
from workers.bridge.horde import FATAL_POP_RCS, HordeClient, HordeRefused, HordeUnavailable
from workers.bridge.jobs import (
    chat_backend_request,
    chat_fault_body,
    chat_submit_body,
    enforce_tool_controls,
    estimate_tokens,
    forces_a_tool_call,
    parse_chat_response,
    parse_text_response,
    reply_was_cut,
    text_backend_request,
    text_fault_body,
    text_submit_body,
    trim_prompt_start,
)
from workers.bridge.progress import ProgressPoster

# The horde's stale sweep runs every 60 s: a submit up to then after the lease may still land.
SUBMIT_GRACE_AFTER_LEASE = 60.0
REPLY_REFUSAL_RCS = frozenset({"ChatSubmitInvalid", "ChatSubmitNonconformant", "ChatModelMismatch"})
# A backend that fails job after job (a model that no longer fits in memory, a dead engine whose
# model list still answers) would fault requests at the pace of the pops, each one's retries
# included: after this many generation errors in a row no pop goes out for a while (doubling up
# to the cap while it keeps failing), so other workers take the requests (ADR 0131).
BACKEND_FAILURES_BEFORE_PAUSE = 2
BACKEND_FAILING_PAUSE_SECONDS = 5.0
BACKEND_FAILING_PAUSE_CAP_SECONDS = 300.0


def _cut_at_length(response: dict[str, Any]) -> bool:
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    return choice.get("finish_reason") == "length"


class _StoppedStarting(BaseException):
    """A second signal while the bridge starts: the call under way is left (a backend loading a model
    may answer the probe minutes later), and run() ends. No job is held yet."""


class Backoff:
    """Exponential backoff with jitter: 1, 2, 4 ... `cap` seconds."""

    def __init__(self, base: float = 1.0, cap: float = 60.0):
        self.base, self.cap, self.failures = base, cap, 0

    def next(self) -> float:
        delay = min(self.cap, self.base * 2**self.failures)
        self.failures += 1
        return delay * (0.75 + random.random() / 4)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class HeldJob:
    id: str
    chat: bool
    model_id: str
    popped: float  # time.monotonic()
    ttl: float
    margin: float
    owner: str | None = None  # who submits its outcome: "job" (its thread) or "stop" (the main thread)
    lock: threading.Lock = field(default_factory=threading.Lock)
    progress: ProgressSink | None = None  # a streamed job's poster, whose posts renew the lease

    @property
    def lease_end(self) -> float:
        return self.popped + self.ttl + self._extension()

    @property
    def deadline(self) -> float:
        """When the bridge gives the job up: the lease end less the margin (at least half the lease),
        moved by the renewals its progress posts earned."""
        return self.popped + max(self.ttl - self.margin, self.ttl / 2) + self._extension()

    def _extension(self) -> float:
        return self.progress.lease_extension() if self.progress is not None else 0.0

    def claim(self, owner: str) -> bool:
        with self.lock:
            if self.owner is None:
                self.owner = owner
            return self.owner == owner


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    ok: int = 0
    faulted: int = 0
    dropped: int = 0  # lease lapsed, or the horde unreachable until too late
    tokens: int = 0
    generation_seconds: float = 0.0
    kudos: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def jobs(self) -> int:
        return self.ok + self.faulted + self.dropped

    def summary(self) -> str:
        up = time.monotonic() - self.started
        rate = self.tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0
        return (
            f"summary: {self.jobs} jobs ({self.ok} ok, {self.faulted} faulted, {self.dropped} dropped) in "
            f"{up:.1f} s; {self.tokens} tokens at {rate:.1f} tokens/s while generating; "
            f"{self.kudos:.2f} kudos earned"
        )


def jobs_at_once(config: BridgeConfig, caps: Capabilities) -> int:
    """--threads, but never more than the backend's slots (a job past them would wait in its queue
    while its lease runs)."""
    return min(config.threads, caps.slots) if caps.slots else config.threads


def job_context(config: BridgeConfig, caps: Capabilities, jobs: int) -> tuple[int, str]:
    """The context each job may fill while `jobs` run at once, and where it came from.

    A context the backend's slots may share (llama.cpp's unified KV cache: /props reports the
    whole cache as every slot's n_ctx) is divided among the jobs, so that they fit together;
    --max-context-length or --no-context-split is the volunteer saying otherwise."""
    if config.max_context_length:
        return config.max_context_length, "--max-context-length"
    if not caps.context:
        return DEFAULT_CONTEXT, "default"
    if caps.context_shared and jobs > 1 and config.context_split:
        return caps.context // jobs, f"{caps.context} shared by {jobs} jobs at once"
    return caps.context, "the backend"


def build_declaration(config: BridgeConfig, caps: Capabilities, horde_model: str, jobs: int = 1) -> ChatDeclaration:
    context, _ = job_context(config, caps, jobs)
    return ChatDeclaration(
        chat_jobs=config.chat_jobs and caps.chat,
        prompt_jobs=config.text_jobs and caps.completions,
        chat_features=frozenset(caps.features),
        chat_limits=ChatLimits(
            max_context_length=context,
            max_length=min(config.max_length, context),
            tools_max_temperature=config.tools_max_temperature,
        ),
        model_id=horde_model,
        image_transports=frozenset(caps.image_transports),
    )


class Bridge:
    def __init__(
        self,
        config: BridgeConfig,
        backend: Backend,
        horde: HordeClient | None = None,
        *,
        out: TextIO | None = None,
        progress_factory: Callable[[HeldJob, dict[str, Any]], ProgressSink | None] | None = None,
    ):
        self.config = config
        self.backend = backend
        self.horde = horde or HordeClient(config.horde_url, config.api_key)
        self.out = out or sys.stderr
        # The sink posting progress for a job whose payload carries the stream hint.
        self.progress_factory = progress_factory or self._progress_poster
        self.stats = Stats()
        self.stop_event = threading.Event()  # no more pops
        self.stop_deadline: float | None = None  # set by a signal: fault held jobs after it
        self.fatal: str | None = None
        self.held: dict[str, HeldJob] = {}
        self._lock = threading.Lock()
        self._print_lock = threading.RLock()  # the signal handler logs, maybe mid-log in the main thread
        self._taken = 0
        self._backend_ok = threading.Event()
        self._probe_lock = threading.Lock()
        self.caps: Capabilities | None = None
        self.declaration: ChatDeclaration | None = None
        self.horde_model = config.horde_model or ""
        self.threads = config.threads  # jobs at once: --threads within the backend's slots
        self.context = config.max_context_length or DEFAULT_CONTEXT  # each job's, as declared
        self.username = ""
        self.ready = threading.Event()  # set once the first pop was answered
        # Set by run() as it closes the clients; a thread still serving a job then leaves it to its lease.
        self.closed = threading.Event()
        self.pop_wait = config.pop_wait  # 0 once the horde refused the key
        self._starting = False  # run() is in start(): a second signal ends it there (_StoppedStarting)
        # The backend's context read again while serving (Ollama reloads models, ADR 0081): when it
        # was last read, why it should be read before the next pop ("fault" loads the model first,
        # "length" reads only), and the jobs served since the last read.
        self._context_read_at = time.monotonic()
        self._context_reread: str | None = None
        self._jobs_since_context_read = 0
        self._context_lock = threading.Lock()
        # Generation errors in a row, and no pops before `_pause_until` once they are too many.
        self._failures = 0
        self._failing_backoff = Backoff(BACKEND_FAILING_PAUSE_SECONDS, BACKEND_FAILING_PAUSE_CAP_SECONDS)
        self._pause_until = 0.0

    def _progress_poster(self, held: HeldJob, payload: dict[str, Any]) -> ProgressSink:
        return ProgressPoster(
            self.horde,
            held.id,
            max_length=int(payload.get("max_length") or self.config.max_length),
            lease_seconds=held.ttl,
            interval=self.config.progress_interval,
            log=self.log,
        )

    # -- output

    def log(self, message: str) -> None:
        with self._print_lock:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} [bridge] {message}", file=self.out, flush=True)

    # -- start

    def start(self) -> None:
        """Check the key, probe the backend and build the declaration; retry while either is down."""
        backoff = Backoff()
        while not self.stop_event.is_set():
            try:
                user = self.horde.find_user()
                self.username = str(user.get("username") or "")
                break
            except HordeUnavailable as error:
                if self.stop_event.is_set():
                    break  # stopping: no retry
                delay = backoff.next()
                self.log(f"horde unreachable ({error}); retrying in {delay:.0f} s")
                self.stop_event.wait(delay)
            except HordeRefused as error:
                raise SystemExit(f"the horde refused the API key: {error.message}") from None
        backoff.reset()
        while not self.stop_event.is_set():
            try:
                caps = self.backend.probe(self.config.model)
                break
            except BackendRefused as error:
                raise SystemExit(str(error)) from None
            except BackendError as error:
                delay = backoff.next()
                self.log(f"backend not ready ({error}); retrying in {delay:.0f} s")
                self.stop_event.wait(delay)
        if self.stop_event.is_set():
            return
        apply_overrides(
            caps,
            add=self.config.add_features,
            remove=self.config.remove_features,
            transports=self.config.image_transports,
        )
        self.caps = caps
        self.horde_model = self.config.horde_model or caps.public_model or caps.model
        self.threads = jobs_at_once(self.config, caps)
        self.context, context_source = job_context(self.config, caps, self.threads)
        self.declaration = build_declaration(self.config, caps, self.horde_model, self.threads)
        self._context_read_at = time.monotonic()
        self._backend_ok.set()
        d = self.declaration
        limits = d.chat_limits
        assert limits is not None  # build_declaration always sets them
        self.log(
            f"worker '{self.config.worker_name}' of {self.username or '?'} on {self.config.horde_url}; "
            f"backend {self.backend.name} ({'; '.join(caps.notes)})"
        )
        if self.threads < self.config.threads:
            self.log(f"threads {self.config.threads} lowered to {self.threads}: the backend runs {caps.slots} slot(s)")
        if caps.context and self.config.max_context_length and caps.context_shared and self.threads > 1 \
                and self.config.max_context_length * self.threads > caps.context:
            self.log(
                f"warning: --max-context-length {self.config.max_context_length} x {self.threads} jobs is more than "
                f"the {caps.context} tokens the backend's slots may share; it may answer 'Context size has been exceeded'"
            )
        self.log(
            f"serving '{self.horde_model}' (backend model '{caps.model}'): chat {'on' if d.chat_jobs else 'off'}, "
            f"text {'on' if d.prompt_jobs else 'off'}, context {limits.max_context_length} ({context_source}), "
            f"max_length {limits.max_length}, threads {self.threads}, token counts "
            f"{'by the backend ' + caps.tokenizer if caps.tokenizer else 'estimated'}; features "
            f"{', '.join(sorted(d.chat_features)) or 'none'}; image transports "
            f"{', '.join(sorted(d.image_transports)) or 'none'}"
        )
        if d.chat_jobs and G.PROMPT_OVERFLOW_REFUSED not in d.chat_features:
            # Every strict chat request needs the guarantee: the front's default would never reach us.
            self.log(
                "note: chat requests are served only under horde.conformance best_effort: this backend is not "
                f"known to refuse an over-long prompt ({G.PROMPT_OVERFLOW_REFUSED}); if it does, start with "
                f"--feature {G.PROMPT_OVERFLOW_REFUSED}"
            )

    def pop_body(self) -> dict[str, Any]:
        assert self.declaration is not None and self.declaration.chat_limits is not None
        limits = self.declaration.chat_limits
        body: dict[str, Any] = {
            "name": self.config.worker_name,
            "models": [self.horde_model],
            "max_length": limits.max_length,
            "max_context_length": limits.max_context_length,
            "threads": self.threads,
            "amount": 1,
            "bridge_agent": BRIDGE_AGENT,
            "nsfw": self.config.nsfw,
            "priority_usernames": [],
            "softprompts": [],
        }
        body.update(self.declaration.pop_fields())
        if self.pop_wait and self.ready.is_set():  # the first pop checks in, answered at once
            body["wait"] = self.pop_wait
        return body

    # -- run

    def request_stop(self, *, immediately: bool = False) -> None:
        now = time.monotonic()
        grace = 0.0 if immediately else self.config.stop_grace
        deadline = now + grace
        self.stop_deadline = deadline if self.stop_deadline is None else min(self.stop_deadline, deadline)
        self.stop_event.set()
        # A pop the horde holds for a job would keep the worker up to the stop grace: it ends now
        # (run() ends one that was still young at the stop once it is held).
        self.horde.interrupt_pops()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stop_deadline is not None:
            if self._starting:  # the first one waits for the call under way, which may take minutes
                self.log(f"{name} again: stopping now")
                self.request_stop(immediately=True)
                raise _StoppedStarting(name)
            self.log(f"{name} again: faulting held jobs now")
            self.request_stop(immediately=True)
            return
        held = len(self.held)
        self.log(
            f"{name}: no more pops; finishing {held} held job(s) within {self.config.stop_grace:.0f} s"
            if held
            else f"{name}: stopping"
        )
        self.request_stop()

    def run(self, *, install_signals: bool = True) -> int:
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)
        self._starting = True
        try:
            self.start()
            self._starting = False
        except SystemExit as error:
            self.log(str(error))
            return 2
        except _StoppedStarting:
            self._starting = False
            self.log("stopped while starting")
            self.close_clients()
            return 0
        threads = [
            threading.Thread(target=self._thread_loop, name=f"bridge-{i}", daemon=True)
            for i in range(self.threads)
        ]
        if self.declaration is not None:
            for thread in threads:
                thread.start()
        while any(t.is_alive() for t in threads):
            if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
                self._fault_held_at_stop()
                break
            if self.stop_event.is_set():
                self.horde.interrupt_pops()  # again: a pop that was young at the stop is held by now
            for thread in threads:
                thread.join(timeout=0.1)
        self.log(self.stats.summary())
        self.close_clients()
        if self.fatal:
            self.log(f"stopped: {self.fatal}")
            return 2
        return 0

    def close_clients(self) -> None:
        """The end of run(): the horde's and the backend's clients close. A daemon thread may still be
        serving a job popped after the held jobs were faulted at stop; it finds the clients closed."""
        self.closed.set()
        self.horde.close()
        self.backend.close()

    def _fault_held_at_stop(self) -> None:
        with self._lock:
            held = list(self.held.values())
        for job in held:
            if not job.claim("stop"):
                continue
            # A shutdown is not one of the fault reasons: the fault is sent without one.
            body = chat_fault_body(job.id, job.model_id, None) if job.chat else text_fault_body(job.id)
            try:
                self.horde.submit(body)
                self.log(f"job {job.id[:8]} faulted at stop (not finished within the stop grace)")
            except (HordeUnavailable, HordeRefused) as error:
                self.log(f"job {job.id[:8]} could not be faulted at stop: {error}")
            with self.stats.lock:
                self.stats.faulted += 1

    # -- the per-thread loop

    def _thread_loop(self) -> None:
        backoff = Backoff()
        in_maintenance = False
        while not self.stop_event.is_set():
            if (paused := self._pause_until - time.monotonic()) > 0:
                self.stop_event.wait(paused)
                continue
            if not self._wait_for_backend():
                continue
            self._read_context_again()
            popped_at, asked_to_wait = time.monotonic(), bool(self.pop_wait) and self.ready.is_set()
            try:
                job = self._pop()
            except HordeUnavailable as error:
                if self.stop_event.is_set():
                    break  # the stop ended the pop
                delay = backoff.next()
                self.log(f"horde unreachable ({error}); retrying in {delay:.0f} s")
                self.stop_event.wait(delay)
                continue
            except HordeRefused as error:
                if error.rc in FATAL_POP_RCS:
                    self.fatal = f"pop refused: {error.rc}: {error.message}"
                    self.log(self.fatal)
                    self.request_stop()
                    return
                if error.rc == "WorkerMaintenance":
                    # In maintenance the horde hands this worker its owner's requests alone, and
                    # refuses its pop while none waits: poll as an idle worker does, so the owner's
                    # test request is taken at once; said once, not at every pop (docs/adr/0083).
                    if not in_maintenance:
                        self.log(f"in maintenance, serving only its owner's requests ({error.message})")
                        in_maintenance = True
                    self.stop_event.wait(self.config.pop_interval)
                    continue
                delay = backoff.next()
                self.log(f"pop refused ({error.rc}: {error.message}); retrying in {delay:.0f} s")
                self.stop_event.wait(delay)
                continue
            if in_maintenance and not job.get("id"):  # an empty pop: served as everyone's worker again
                self.log("out of maintenance")
                in_maintenance = False
            backoff.reset()
            self.ready.set()
            if not job.get("id"):
                if not self.pop_wait:
                    pause = self.config.pop_interval
                elif asked_to_wait:  # held by the horde: at once; answered sooner: poll as before
                    pause = self.config.pop_interval - (time.monotonic() - popped_at)
                else:
                    pause = 0.0  # the check-in pop: the next one waits at the horde
                self.stop_event.wait(max(0.0, pause))
                continue
            with self._lock:
                self._taken += 1
                if self.config.max_jobs and self._taken >= self.config.max_jobs:
                    self.stop_event.set()  # the last job: no more pops, and no stop deadline
            self._serve(job)

    def _pop(self) -> dict[str, Any]:
        body = self.pop_body()
        try:
            return self.horde.pop(body)
        except HordeRefused as error:
            if "wait" not in body or error.status != 400 or not self.pop_wait:
                raise
            # A horde that validates strictly and does not know the key: pop without it from now on.
            self.pop_wait = 0
            self.log(
                f"the horde refused the pop's wait ({error.rc}: {error.message}); polling every "
                f"{self.config.pop_interval:g} s"
            )
            body.pop("wait")
            return self.horde.pop(body)

    def _read_context_again(self) -> None:
        """Ollama may load the model again with another context (an automatic context that fits
        less memory, a restart with other settings): read the one it holds now every
        --context-check-interval, and at once after a job that faulted or was cut at its length,
        and declare it on the next pop. A smaller context is declared at once (it promises less);
        a larger one once a job of ours ran since the last read, or after our own load request
        (a model another client loaded with its own num_ctx is loaded again for our requests)."""
        caps, interval = self.caps, self.config.context_check_interval
        if caps is None or self.config.max_context_length:
            return  # --max-context-length wins over whatever the backend reports
        due = bool(interval) and time.monotonic() - self._context_read_at >= interval
        if not (due or self._context_reread) or not self._context_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                reason, self._context_reread = self._context_reread, None
                ran, self._jobs_since_context_read = self._jobs_since_context_read, 0
            self._context_read_at = time.monotonic()
            loaded = self.backend.runtime_context(load=reason == "fault")
            if not loaded or loaded == caps.context:
                return
            if caps.context and loaded > caps.context and not ran and reason != "fault":
                return
            self.caps = dataclasses.replace(caps, context=loaded)
            self.context, source = job_context(self.config, self.caps, self.threads)
            self.declaration = build_declaration(self.config, self.caps, self.horde_model, self.threads)
            self.log(f"context {loaded} from /api/ps (was {caps.context}): each job's is {self.context} "
                     f"({source}) from the next pop")
        finally:
            self._context_lock.release()

    def _withdraw_probed_guarantee(self, guarantee: str, violation: str) -> None:
        """The backend broke a guarantee the start's probe found (llama-server builds no tool
        grammar for a template it does not recognise, ADR 0091): declare it no more from the next
        pop, so the horde sends such requests to workers that keep it instead of restarting them
        here. A guarantee the volunteer asserted with --feature stays."""
        with self._context_lock:  # the context's re-read replaces caps too
            caps = self.caps
            if caps is None or guarantee not in caps.features or guarantee in self.config.add_features:
                return
            self.caps = dataclasses.replace(caps, features=caps.features - {guarantee})
            self.declaration = build_declaration(self.config, self.caps, self.horde_model, self.threads)
        self.log(f"{guarantee} withdrawn from the next pop: the backend broke it ({violation})")

    def _read_context_soon(self, reason: str) -> None:
        with self._lock:
            if self._context_reread != "fault":
                self._context_reread = reason

    def _wait_for_backend(self) -> bool:
        """True when the backend is up; else probe it (one thread at a time) with backoff."""
        if self._backend_ok.is_set():
            return True
        with self._probe_lock:
            if self._backend_ok.is_set():
                return True
            backoff = Backoff()
            while not self.stop_event.is_set():
                if self.backend.healthy():
                    self.log("backend is back: popping again")
                    self._backend_ok.set()
                    return True
                delay = backoff.next()
                self.log(f"backend down; probing again in {delay:.0f} s")
                self.stop_event.wait(delay)
        return False

    def _backend_answered(self) -> None:
        with self._lock:
            self._failures = 0
            self._failing_backoff.reset()

    def _backend_failed(self, error: BackendError) -> None:
        """A job the backend failed (generation_error): past BACKEND_FAILURES_BEFORE_PAUSE in a
        row, pause the pops. The scripted backend's errors are its requests' directives."""
        if self.config.is_scripted:
            return
        with self._lock:
            self._failures += 1
            failures = self._failures
            if failures < BACKEND_FAILURES_BEFORE_PAUSE:
                return
            delay = self._failing_backoff.next()
            self._pause_until = max(self._pause_until, time.monotonic() + delay)
        self.log(f"the backend failed {failures} jobs in a row (last: {error}): no pops for {delay:.0f} s, "
                 "so other workers take the requests")

    def _backend_down(self, error: BackendError) -> None:
        if self._backend_ok.is_set():
            self._backend_ok.clear()
            self.log(f"backend down ({error}): no pops until it answers")

    # -- one job

    def _serve(self, job: dict[str, Any]) -> None:
        is_chat = bool(job.get("chat"))
        held = HeldJob(
            id=str(job["id"]),
            chat=is_chat,
            model_id=str(job.get("model") or self.horde_model),
            popped=time.monotonic(),
            ttl=float(job.get("ttl") or TEXT_JOB_LEASE_SECONDS),
            margin=self.config.lease_margin,
        )
        with self._lock:
            self.held[held.id] = held
        try:
            if is_chat:
                self._serve_chat(job, held)
            else:
                self._serve_text(job, held)
        except Exception as error:  # a bug here must not leave the job held until its lease lapses
            if self.closed.is_set():  # nothing can reach the horde now: its lease ends the job
                self.log(f"job {held.id[:8]} left to its lease: the bridge stopped while serving it")
                return
            self.log(f"job {held.id[:8]}: unexpected {type(error).__name__}: {error}")
            self._fault(held, ChatFaultReason.GENERATION_ERROR, f"unexpected error: {error}")
        finally:
            with self._lock:
                self.held.pop(held.id, None)
                self._jobs_since_context_read += 1

    def _generate(self, held: HeldJob, call: Callable[[float], dict[str, Any]]) -> tuple[dict[str, Any] | None, float]:
        """Run the backend call within the job's deadline; (response, seconds) or (None, s) after a fault."""
        started = time.monotonic()
        remaining = held.deadline - started
        if remaining <= 0:
            self._fault(held, ChatFaultReason.GENERATION_ERROR, "no time left in the lease")
            return None, 0.0
        try:
            response = call(remaining)
            self._backend_answered()
            if _cut_at_length(response):
                self._read_context_soon("length")  # maybe cut by a context smaller than declared
            return response, time.monotonic() - started
        except GenerationStopped as stop:  # the horde said stop: no submit
            self._record_dropped(held, f"stopped generating: {stop}")
            return None, time.monotonic() - started
        except BackendError as error:
            elapsed = time.monotonic() - started
            self._read_context_soon("fault")  # the model may have been unloaded, or loaded with less
            if time.monotonic() >= held.deadline - 0.5:
                self._fault(
                    held,
                    ChatFaultReason.GENERATION_ERROR,
                    f"gave the job up {self.config.lease_margin:.0f} s before its {held.ttl:.0f} s lease ends",
                )
            else:
                if isinstance(error, BackendDown):
                    self._backend_down(error)
                self._fault(held, error.fault_reason, str(error))
                if error.fault_reason == ChatFaultReason.GENERATION_ERROR and not error.load:
                    self._backend_failed(error)
                else:  # the backend refused this request (its prompt, its grammar) or this load: it works
                    self._backend_answered()
            return None, elapsed

    def _serve_chat(self, job: dict[str, Any], held: HeldJob) -> None:
        assert self.caps is not None
        payload = dict(job.get("payload") or {})
        if "messages" not in payload and payload.get("messages_url"):
            try:
                payload["messages"] = self.horde.fetch_json(payload["messages_url"])
            except HordeUnavailable as error:
                # ChatFaultReason has no value for a failed input fetch: faulted without a reason.
                self._fault(held, None, str(error))
                return
        body = chat_backend_request(payload, model=self.caps.model, kind=self.caps.kind)
        if not self._fit_chat_prompt(held, body):
            return
        progress = self.progress_factory(held, payload) if streams_progress(payload) else None
        held.progress = progress
        response, seconds = self._generate(held, lambda timeout: self.backend.chat(body, timeout=timeout, progress=progress))
        if response is None:
            return
        try:
            reply = parse_chat_response(response, split_think=progress is None)
        except BackendError as error:
            self._fault(held, error.fault_reason, str(error))
            return
        violation = enforce_tool_controls(payload, reply)
        if violation:
            self._fault(held, ChatFaultReason.TOOL_VIOLATION, violation)
            # A reply cut at max_tokens before the call does not show the backend broke the
            # guarantee: its grammar allows text first (ADR 0112). Faulted, never submitted.
            if forces_a_tool_call(payload) and not reply_was_cut(reply):
                self._withdraw_probed_guarantee(G.TOOL_CHOICE_ENFORCED, violation)
            return
        outcome = self._submit(held, chat_submit_body(held.id, held.model_id, reply))
        if outcome is None:
            return
        status, detail = outcome
        if status == "refused":
            self._fault(held, ChatFaultReason.REPLY_REFUSED, f"the horde refused the reply: {detail}", claimed=True)
            return
        self._record_ok(held, reply.tokens, seconds, float(detail), f"finish {reply.finish_reason}"
                        + (f", {len(reply.tool_calls)} tool call(s)" if reply.tool_calls else "")
                        + (", reasoning" if reply.reasoning else ""))

    def _serve_text(self, job: dict[str, Any], held: HeldJob) -> None:
        assert self.caps is not None
        payload = job.get("payload") or {}
        body = text_backend_request(payload, model=self.caps.model, kind=self.caps.kind)
        self._fit_text_prompt(held, payload, body)
        response, seconds = self._generate(held, lambda timeout: self.backend.complete(body, timeout=timeout))
        if response is None:
            return
        try:
            reply = parse_text_response(response)
        except BackendError as error:
            self._fault(held, error.fault_reason, str(error))
            return
        outcome = self._submit(held, text_submit_body(held.id, reply))
        if outcome is None:
            return
        status, detail = outcome
        if status == "refused":  # upstream's worker abandons a text job on a 400
            self._record_dropped(held, f"the horde refused the text: {detail}")
            return
        self._record_ok(held, reply.tokens, seconds, float(detail), "text")

    # -- prompt sizes

    def _fit_chat_prompt(self, held: HeldJob, body: dict[str, Any]) -> bool:
        """Count the rendered prompt with the backend's tokenizer before generating: a prompt
        that leaves no room in the job's context is faulted prompt_overflow (no backend call), a
        reply budget past it is lowered to what is left. Without a tokenizer the backend decides."""
        counted = self.backend.count_chat_tokens(body)
        if counted is None:
            return True
        room = self.context - counted
        if room < 1:
            self._fault(
                held,
                ChatFaultReason.PROMPT_OVERFLOW,
                f"the prompt is {counted} tokens (counted by the backend's tokenizer); the context of a job "
                f"here is {self.context} tokens",
            )
            return False
        if body.get("max_tokens", 0) > room:
            body["max_tokens"] = room
        return True

    def _fit_text_prompt(self, held: HeldJob, payload: dict[str, Any], body: dict[str, Any]) -> None:
        """Trim a text job's prompt from its start to its max_context_length - max_length tokens
        (counted by the backend's tokenizer where it has one), as koboldcpp's own worker does."""
        context = min(int(payload.get("max_context_length") or self.context), self.context)
        budget = context - int(body.get("max_tokens") or 0)

        def count(text: str) -> int:
            counted = self.backend.count_tokens(text)
            return counted if counted is not None else estimate_tokens(text)

        prompt = str(body.get("prompt") or "")
        trimmed, tokens = trim_prompt_start(prompt, budget, count)
        if trimmed != prompt:
            body["prompt"] = trimmed
            if not self.config.quiet:
                self.log(
                    f"job {held.id[:8]} text prompt trimmed from the start to {tokens} tokens "
                    f"({len(prompt) - len(trimmed)} characters dropped) to fit {context} - {body.get('max_tokens')}"
                )

    # -- submits

    def _submit(self, held: HeldJob, body: dict[str, Any], *, claimed: bool = False) -> tuple[str, Any] | None:
        """("ok", reward) or ("refused", "rc: message"); None when the job ended otherwise (recorded)."""
        if not claimed and not held.claim("job"):
            return None  # the main thread faulted it at stop
        backoff = Backoff(cap=10.0)
        faulting = body.get("state") == "faulted"
        unanswered = False  # an attempt went out and its answer was lost: the horde may have stored it
        while True:
            try:
                answer = self.horde.submit(body)
                reward = answer.get("reward", 0) if isinstance(answer, dict) else 0
                return "ok", reward if isinstance(reward, int | float) else 0
            except HordeUnavailable as error:
                unanswered = True
                if time.monotonic() > held.lease_end + SUBMIT_GRACE_AFTER_LEASE:
                    self._record_dropped(held, f"the horde stayed unreachable past the lease ({error})")
                    return None
                delay = backoff.next()
                self.log(f"job {held.id[:8]}: submit failed ({error}); retrying in {delay:.0f} s")
                time.sleep(delay)
            except HordeRefused as error:
                # A job's outcome is sent once (HeldJob.claim), so a reply found stored is this one, sent
                # before and its answer lost (the client sends a request a dropped connection left
                # unanswered again at once); a fault found faulted after a lost answer, likewise.
                if error.rc == "DuplicateGen" and not faulting:
                    self.log(f"job {held.id[:8]}: the reply was stored by a submit whose answer was lost (DuplicateGen)")
                    return "ok", 0
                if error.rc == "AbortedGen" and faulting and unanswered:
                    self.log(f"job {held.id[:8]}: already faulted, by the fault sent before, whose answer was lost "
                             "(or at its lease's end)")
                    return "ok", 0
                if error.rc == "AbortedGen":
                    self._record_dropped(held, "the horde aborted the job before the submit: its lease lapsed or its request was cancelled (AbortedGen)")
                    return None
                if error.rc in ("DuplicateGen", "InvalidJobID"):
                    self._record_dropped(held, f"{error.rc}: {error.message}")
                    return None
                if held.chat and (error.rc in REPLY_REFUSAL_RCS or error.status == 400) and "message" in body:
                    return "refused", f"{error.rc}: {error.message}"
                if not held.chat and error.status == 400:
                    return "refused", f"{error.rc}: {error.message}"
                self._record_dropped(held, f"submit refused: {error.rc}: {error.message}")
                return None

    def _fault(self, held: HeldJob, reason: str | None, detail: str, *, claimed: bool = False) -> None:
        """Submit the job as faulted with `reason` (chat jobs; a text fault has no reason field;
        None: a chat fault sent without one)."""
        body = chat_fault_body(held.id, held.model_id, reason) if held.chat else text_fault_body(held.id)
        outcome = self._submit(held, body, claimed=claimed)
        if outcome is None:
            return
        with self.stats.lock:
            self.stats.faulted += 1
        if not self.config.quiet:
            kind = "chat" if held.chat else "text"
            self.log(f"job {held.id[:8]} {kind} faulted ({(reason or 'no reason') if held.chat else 'fault'}): {detail}")

    def _record_ok(self, held: HeldJob, tokens: int, seconds: float, reward: float, detail: str) -> None:
        with self.stats.lock:
            self.stats.ok += 1
            self.stats.tokens += tokens
            self.stats.generation_seconds += seconds
            self.stats.kudos += reward
        if not self.config.quiet:
            rate = tokens / seconds if seconds > 0 else 0.0
            kind = "chat" if held.chat else "text"
            self.log(
                f"job {held.id[:8]} {kind} ok: {tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), "
                f"{detail}; +{reward:.2f} kudos"
            )

    def _record_dropped(self, held: HeldJob, detail: str) -> None:
        with self.stats.lock:
            self.stats.dropped += 1
        if not self.config.quiet:
            self.log(f"job {held.id[:8]} dropped: {detail}")
