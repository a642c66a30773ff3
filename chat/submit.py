"""The submit: store a worker's result (the first submit wins), charge and reward in one transaction."""

from __future__ import annotations

from decimal import Decimal
from uuid import UUID

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from accounts.models import HordeUser, KudosTransaction
from accounts.services import kudos_transfer
from chat.models import Generation, GenerationRequest
from chat.pricing import text_generation_kudos, things_count
from chat.services import requeue_faulted
from contract.errors import HordeError
from workers.services import worker_record_aborted, worker_record_job


def generation_submit(
    *, user: HordeUser, generation_id: UUID, text: str, state: str, seed: int, gen_metadata: list
) -> Decimal:
    """Store a worker's result (the first submit wins), charge the requester, reward the owner."""
    with transaction.atomic():
        generation = (
            Generation.objects.select_related("worker", "worker__owner", "request")
            .filter(pk=generation_id)
            .first()
        )
        if generation is None:
            raise HordeError("InvalidJobID", f"Processing Generation with ID {generation_id} does not exist.")
        worker = generation.worker
        if worker.owner_id != user.pk:
            raise HordeError("WrongCredentials", "Wrong credentials to submit as this worker.")
        now = timezone.now()
        new_state = state if state in ("ok", "censored", "csam", "faulted") else "ok"
        won = Generation.objects.filter(pk=generation_id, state=Generation.State.PROCESSING).update(
            state=new_state,
            text=None if new_state == "faulted" else text,
            seed=seed,
            gen_metadata=gen_metadata,
            finished_at=now,
        )
        if not won:
            current = Generation.objects.filter(pk=generation_id).values_list("state", flat=True).first()
            if current in (Generation.State.FAULTED, Generation.State.CANCELLED):
                raise HordeError(
                    "AbortedGen",
                    f"Processing Generation with ID {generation_id} took too long to process and has been "
                    "aborted! Please check your worker's speed and make sure it can finish within the lease.",
                )
            raise HordeError("DuplicateGen", f"Processing Generation with ID {generation_id} already submitted.")

        request = generation.request
        if new_state == "faulted":
            worker_record_aborted(worker_ids=[worker.pk])
            requeue_faulted([generation.pk], request.pk)
            return Decimal("0")

        reward = text_generation_kudos(
            model=generation.model,
            prompt=request.prompt,
            generation=text,
            max_length=request.max_length,
            owner_trusted=worker.owner.trusted,
        )
        charge = Decimal("0") if new_state in ("censored", "csam") else reward
        Generation.objects.filter(pk=generation_id).update(kudos=reward)
        tokens = things_count(text, request.max_length)
        worker_record_job(
            worker_id=worker.pk, tokens=tokens, seconds=(now - generation.created).total_seconds(), kudos=reward
        )
        kudos_transfer(
            user_id=worker.owner_id,
            amount=reward,
            kind=KudosTransaction.Kind.GENERATION_REWARD,
            request_id=request.pk,
            generation_id=generation.pk,
        )
        # Each generation releases its share of the request's hold as it is charged.
        locked = GenerationRequest.objects.select_for_update().only("kudos_held", "n").get(pk=request.pk)
        release = min(locked.kudos_held, (request.kudos_quote / request.n).quantize(Decimal("0.01")))
        kudos_transfer(
            user_id=request.user_id,
            amount=-charge,
            kind=KudosTransaction.Kind.GENERATION_CHARGE,
            request_id=request.pk,
            generation_id=generation.pk,
            release_held=release,
        )
        GenerationRequest.objects.filter(pk=request.pk).update(
            consumed_kudos=F("consumed_kudos") + charge, kudos_held=F("kudos_held") - release
        )
    return reward


