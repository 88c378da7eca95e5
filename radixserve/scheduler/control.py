"""Control commands: one table and one set of names for the scheduler process (a `ControlReq`
from the api process over ZeroMQ) and the offline `Engine` (the same `ControlReq`, posted to its
scheduler thread). Each command answers a JSON-able dict; a command refused for a reason the
caller gave (a bad path, a mode, an adapter in use) answers `success: False` with the message."""

from __future__ import annotations

from typing import Callable

from ..messages import ControlReq
from .scheduler import Scheduler

Reply = dict


def run_control(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """Run one command; an unknown one answers with an error naming it."""
    handler = COMMANDS.get(msg.kind)
    if handler is None:
        return {"error": f"unknown control {msg.kind!r}"}
    try:
        return handler(scheduler, msg)
    except (ValueError, OSError) as exc:
        return {"success": False, "message": str(exc)}


# ---- the cache and its figures -------------------------------------------------
def flush_cache(scheduler: Scheduler, msg: ControlReq) -> Reply:
    return {"success": scheduler.flush_cache()}


def stats(scheduler: Scheduler, msg: ControlReq) -> Reply:
    figures = scheduler.snapshot()
    return dict(vars(figures), cache_hit_rate=figures.cache_hit_rate)


def top_prefixes(scheduler: Scheduler, msg: ControlReq) -> Reply:
    return {"top_prefixes": scheduler.top_prefixes(msg.arg)}


def check_memory(scheduler: Scheduler, msg: ControlReq) -> Reply:
    try:
        scheduler.check_memory()
    except AssertionError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True}


# ---- rollouts: pausing, weights, memory ------------------------------------------
def pause(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """Stop running steps until `resume`. Mode (`text`) `abort` ends every request, `retract`
    sends the running ones back to the queue (to recompute later), `in_place` leaves them."""
    touched = 0
    if msg.text == "abort":
        touched = scheduler.end_all("aborted: generation was paused")
    elif msg.text == "retract":
        touched = scheduler.retract_all()
    scheduler.paused = True
    return {"success": True, "num_paused_requests": touched}


def resume(scheduler: Scheduler, msg: ControlReq) -> Reply:
    scheduler.paused = False
    return {"success": True}


def update_weights(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """Serve the weights at `text` from the next step on; ValueError (nothing changed) when they
    cannot replace the served ones. In-flight requests are ended (`arg` set) or retracted, to
    recompute with the new weights; every cached prefix, on every tier, is dropped."""
    scheduler.executor.update_weights(msg.text)
    touched = scheduler.end_all("aborted: the weights were updated") if msg.arg else 0
    touched += scheduler.retract_all()
    scheduler.kv.renew(msg.text)
    scheduler.metrics.reset_cache_figures()
    return {"success": True, "message": "weights updated", "num_paused_requests": touched}


def release_memory(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """Give back the KV cache's and/or the weights' memory (`text`: comma-separated tags); only
    with no request running. Steps stay off until `resume_memory`."""
    tags = frozenset(msg.text.split(","))
    if running := scheduler.queues.num_running():
        raise ValueError(
            f"{running} requests are running: pause generation (mode abort or retract) before "
            f"releasing memory"
        )
    scheduler.executor.release_memory(tags)
    if "kv_cache" in tags:  # the tree goes with the KV it indexed
        scheduler.kv.flush()
        scheduler.metrics.reset_cache_figures()
    scheduler.released |= tags
    return {"success": True}


def resume_memory(scheduler: Scheduler, msg: ControlReq) -> Reply:
    tags = frozenset(msg.text.split(","))
    scheduler.executor.resume_memory(tags)
    scheduler.released -= tags
    return {"success": True}


# ---- LoRA adapters -------------------------------------------------------------
def load_lora(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """`text`: the adapter's name, a newline, its path."""
    name, _, path = msg.text.partition("\n")
    scheduler.adapters.load(name, path)
    return _adapters_reply(scheduler, 0)


def unload_lora(scheduler: Scheduler, msg: ControlReq) -> Reply:
    """Unload the adapter named `text` once no queued or running request uses it; until then it
    takes no new request and the reply says how many still use it."""
    busy = scheduler.adapters.unload(msg.text, scheduler.queues.all())
    return _adapters_reply(scheduler, busy)


def _adapters_reply(scheduler: Scheduler, busy: int) -> Reply:
    names = scheduler.adapters.names()
    return {"success": busy == 0, "in_use": busy, "loaded_adapters": names}


COMMANDS: dict[str, Callable[[Scheduler, ControlReq], Reply]] = {
    "flush_cache": flush_cache,
    "stats": stats,
    "top_prefixes": top_prefixes,
    "check_memory": check_memory,
    "pause": pause,
    "resume": resume,
    "update_weights": update_weights,
    "release_memory": release_memory,
    "resume_memory": resume_memory,
    "load_lora": load_lora,
    "unload_lora": unload_lora,
}
